//! What happens to the prefills: a built-in script, or incidents drawn from
//! a seed. Each incident says what the service must do about it (release
//! the engine within a bound, or keep it), and the timeline checks it.

use std::collections::BTreeMap;
use std::time::Duration;

use nixl_keepalive::{Config, EngineId, UcsStatus};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::decoder::Decoder;
use super::membership::{DemoMembership, LEASE_TTL};
use super::report::{Expect, Timeline};

/// How long the service may take, fault to release, with these settings.
#[derive(Clone, Copy, Debug)]
pub(super) struct Bounds {
    /// A crashed (or restarted) prefill: the next heartbeat or read sees the
    /// reset. `None` with periodic heartbeats off.
    pub(super) crash: Option<Duration>,
    /// A partitioned prefill: UCX's keepalive fails the endpoint, the next
    /// heartbeat or read sees it. `None` when never.
    pub(super) silent: Option<Duration>,
    /// A frozen prefill with reads in flight: UCX never reports it (as
    /// measured on shm/tcp); the service's read-stall check finds it, its
    /// reads fail, and it is released. `None` with the check off: then a
    /// frozen prefill is kept, as the service cannot know.
    pub(super) stalled: Option<Duration>,
    /// The simulated UCX keepalive interval.
    pub(super) ucx_keepalive: Option<Duration>,
    /// A frozen prefill (UCX blind, as measured): its lease expires within
    /// the TTL, then its reads are failed and it is released.
    pub(super) lease: Duration,
}

impl Bounds {
    pub(super) fn new(
        config: &Config,
        ucx_keepalive: Option<Duration>,
        max_read: Duration,
    ) -> Self {
        // Slack: a heartbeat round, a release, and the event reaching us.
        let slack = Duration::from_secs(1);
        let heartbeat = config.heartbeat_interval().map(|i| i + config.jitter());
        let crash = heartbeat.map(|h| h + max_read + slack);
        let silent = match (heartbeat, ucx_keepalive) {
            (Some(h), Some(k)) => Some(k + h + max_read + slack),
            _ => None,
        };
        // Found within 1.25 bounds (checked four times per bound), once a
        // read is in flight there (the readers pick prefills at random).
        let stalled = config
            .read_stall()
            .map(|b| b + b / 4 + max_read + slack + Duration::from_secs(2));
        Bounds {
            crash,
            silent,
            stalled,
            ucx_keepalive,
            lease: LEASE_TTL + slack,
        }
    }

    /// The longest bound: incidents closer than this to the end are not
    /// started (they could not be checked).
    fn longest(&self) -> Duration {
        self.silent
            .or(self.crash)
            .unwrap_or(Duration::from_secs(10))
            .max(self.crash.unwrap_or_default())
            .max(self.stalled.unwrap_or_default())
    }

    /// A freeze this long is surely found stalled (or, with the check off,
    /// long enough to show it is kept).
    fn long_freeze(&self) -> Duration {
        self.stalled.unwrap_or(Duration::from_secs(30)) + Duration::from_secs(5)
    }

    /// A partition or freeze this long is surely detected.
    fn long_silence(&self) -> Duration {
        match self.ucx_keepalive {
            Some(k) => k + self.crash.unwrap_or(Duration::from_secs(10)) + Duration::from_secs(5),
            None => Duration::from_secs(30),
        }
    }

    /// A partition this short is surely not detected.
    fn short_silence(&self) -> Duration {
        match self.ucx_keepalive {
            Some(k) => k / 2,
            None => Duration::from_secs(5),
        }
    }
}

/// One thing done to a prefill (by its address index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fault {
    /// Killed (SIGKILL): its endpoints reset.
    Kill,
    /// Killed with a READ on the wire: that read ends with an I/O error
    /// (not a disconnect), the rest see the reset.
    KillDuringRead,
    /// Frozen (SIGSTOP): UCX never reports it on shm/tcp; its reads in
    /// flight stop completing and the read-stall check fails them.
    Freeze,
    /// Cut off the network: silent until UCX's keepalive gives up.
    Partition,
    /// Cut off for less than UCX's keepalive: nothing must happen.
    ShortPartition,
    /// Restarted under a new engine id at the same address.
    Restart,
    /// Restarted under the same (pinned) engine id.
    RestartSameId,
    /// Transient errors that are not disconnects (UCS_ERR_NO_RESOURCE).
    Transient,
    /// etcd (the membership plane) is down for three lease TTLs: nothing
    /// may be released for it.
    EtcdOutage,
}

impl Fault {
    pub(super) fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::KillDuringRead => "kill during a read",
            Fault::Freeze => "freeze",
            Fault::Partition => "partition",
            Fault::ShortPartition => "short partition",
            Fault::Restart => "restart (new id)",
            Fault::RestartSameId => "restart (same id)",
            Fault::Transient => "transient errors",
            Fault::EtcdOutage => "etcd outage",
        }
    }

    const ALL: [Fault; 9] = [
        Fault::Kill,
        Fault::KillDuringRead,
        Fault::Freeze,
        Fault::Partition,
        Fault::ShortPartition,
        Fault::Restart,
        Fault::RestartSameId,
        Fault::Transient,
        Fault::EtcdOutage,
    ];
}

/// A timed step.
#[derive(Clone, Copy, Debug)]
enum Step {
    Fault(Fault),
    /// The process at the address runs again / is reachable again.
    Thaw,
    Heal,
    /// etcd is back.
    EtcdBack,
    /// Start a process at the (dead) address and announce it, as a router
    /// would: with a new id or the same one.
    Start {
        same_id: bool,
    },
}

/// The steps to play, by time.
pub(super) struct Scenario {
    steps: BTreeMap<(Duration, u64), (usize, Step)>,
    next_seq: u64,
    duration: Duration,
    bounds: Bounds,
    /// Random incidents: the generator and the prefill count.
    random: Option<(StdRng, usize)>,
}

impl Scenario {
    fn new(duration: Duration, bounds: Bounds, random: Option<(StdRng, usize)>) -> Self {
        Scenario {
            steps: BTreeMap::new(),
            next_seq: 0,
            duration,
            bounds,
            random,
        }
    }

    fn push(&mut self, at: Duration, prefill: usize, step: Step) {
        self.steps.insert((at, self.next_seq), (prefill, step));
        self.next_seq += 1;
    }

    /// The built-in script: every kind of incident once or twice, spread
    /// over the scenario.
    pub(super) fn script(prefills: usize, duration: Duration, bounds: Bounds) -> Self {
        let mut s = Scenario::new(duration, bounds, None);
        let script: [(f64, usize, Fault); 11] = [
            (0.05, 0, Fault::Kill),
            (0.14, 1, Fault::Freeze),
            (0.23, 2, Fault::Restart),
            (0.32, 3, Fault::RestartSameId),
            (0.41, 4, Fault::Partition),
            (0.50, 5, Fault::ShortPartition),
            (0.54, 4, Fault::EtcdOutage),
            (0.58, 6, Fault::Transient),
            (0.66, 7, Fault::KillDuringRead),
            (0.76, 2, Fault::Kill),
            (0.86, 3, Fault::RestartSameId),
        ];
        for (frac, prefill, fault) in script {
            s.push(
                duration.mul_f64(frac),
                prefill % prefills,
                Step::Fault(fault),
            );
        }
        s
    }

    /// Random incidents from `seed`: one every 20 to 60 s (scaled down for
    /// short scenarios), each on a healthy prefill, with its recovery.
    pub(super) fn random(seed: u64, prefills: usize, duration: Duration, bounds: Bounds) -> Self {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_5eed);
        let first = Duration::from_secs_f64(rng.random_range(5.0..20.0)).min(duration / 10);
        let mut s = Scenario::new(duration, bounds, None);
        s.random = Some((rng, prefills));
        s.push(first, usize::MAX, Step::Fault(Fault::Kill));
        s
    }

    /// Plays the steps on the decoder's cluster until the scenario's end
    /// (or Ctrl-C). Returns whether it was interrupted.
    pub(super) async fn run(
        mut self,
        decoder: &Decoder,
        membership: &DemoMembership,
        timeline: &Timeline,
        origin: Instant,
    ) -> bool {
        let end = origin + self.duration;
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        loop {
            let next = self.steps.keys().next().copied();
            let wake = match next {
                Some((at, _)) if origin + at < end => origin + at,
                _ => end,
            };
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = &mut ctrl_c => {
                    timeline.log("interrupted: stopping the scenario early".into());
                    return true;
                }
            }
            if wake >= end {
                return false;
            }
            let key = next.expect("a step is due");
            let (prefill, step) = self.steps.remove(&key).expect("present");
            self.play(key.0, prefill, step, decoder, membership, timeline);
        }
    }

    fn play(
        &mut self,
        at: Duration,
        prefill: usize,
        step: Step,
        decoder: &Decoder,
        membership: &DemoMembership,
        timeline: &Timeline,
    ) {
        let ucx = decoder.ucx();
        match step {
            Step::Fault(fault) => {
                let (prefill, fault) = match self.random.as_mut() {
                    Some((rng, prefills)) => {
                        // Draw the next incident now, then this one's target.
                        let gap = Duration::from_secs_f64(rng.random_range(20.0..60.0));
                        let gap = gap.min(self.duration / 8).max(Duration::from_secs(1));
                        let kind = Fault::ALL[rng.random_range(0..Fault::ALL.len())];
                        let healthy: Vec<usize> = (0..*prefills)
                            .filter(|&p| decoder.is_healthy(p) && !timeline.has_open_incident_at(p))
                            .collect();
                        let target = (!healthy.is_empty())
                            .then(|| healthy[rng.random_range(0..healthy.len())]);
                        let next_seq = self.next_seq;
                        self.steps
                            .insert((at + gap, next_seq), (usize::MAX, Step::Fault(Fault::Kill)));
                        self.next_seq += 1;
                        match target {
                            Some(t) => (t, kind),
                            None => {
                                timeline
                                    .log("no healthy prefill to break: incident skipped".into());
                                return;
                            }
                        }
                    }
                    None => (prefill, fault),
                };
                if at + self.bounds.longest() + self.recovery_time(fault) > self.duration {
                    timeline.log(format!(
                        "{} on {}: skipped (too close to the end to be checked)",
                        fault.name(),
                        decoder.addr(prefill)
                    ));
                    return;
                }
                self.fault(at, prefill, fault, decoder, membership, timeline);
            }
            Step::Thaw => {
                membership.thaw(prefill);
                if let Some(engine) = ucx.engine_at(decoder.addr(prefill)) {
                    ucx.thaw(&engine);
                    timeline.log(format!("{} at {} thawed", engine, decoder.addr(prefill)));
                }
            }
            Step::Heal => {
                if let Some(engine) = ucx.engine_at(decoder.addr(prefill)) {
                    ucx.heal(&engine);
                    timeline.log(format!(
                        "network to {} at {} healed",
                        engine,
                        decoder.addr(prefill)
                    ));
                }
            }
            Step::EtcdBack => {
                membership.restore();
                timeline.log("etcd is back".into());
            }
            Step::Start { same_id } => {
                let addr = decoder.addr(prefill);
                let engine = if same_id {
                    ucx.restart_with_same_id(addr)
                } else {
                    ucx.restart(addr)
                };
                timeline.log(format!(
                    "{engine} started at {addr} ({}); the router announces it",
                    if same_id { "same id" } else { "new id" }
                ));
                decoder.announce(prefill);
            }
        }
    }

    fn recovery_time(&self, fault: Fault) -> Duration {
        match fault {
            Fault::Freeze => self.bounds.long_freeze(),
            Fault::Partition => self.bounds.long_silence(),
            Fault::ShortPartition => self.bounds.short_silence(),
            Fault::EtcdOutage => LEASE_TTL * 3,
            _ => Duration::ZERO,
        }
    }

    fn fault(
        &mut self,
        at: Duration,
        prefill: usize,
        fault: Fault,
        decoder: &Decoder,
        membership: &DemoMembership,
        timeline: &Timeline,
    ) {
        let ucx = decoder.ucx();
        let addr = decoder.addr(prefill).clone();
        let Some(engine): Option<EngineId> = ucx.engine_at(&addr) else {
            timeline.log(format!(
                "{} on {addr}: skipped (nobody listens there)",
                fault.name()
            ));
            return;
        };
        if !decoder.is_healthy(prefill) {
            timeline.log(format!(
                "{} on {addr}: skipped (the decoder has no live engine there)",
                fault.name()
            ));
            return;
        }
        let b = self.bounds;
        let (expect, bound) = match fault {
            Fault::Kill | Fault::KillDuringRead | Fault::Restart | Fault::RestartSameId => {
                (Expect::Release, b.crash)
            }
            // UCX is blind to a frozen prefill (as measured): its lease
            // expires and membership retires it, or (with reads in flight)
            // the read-stall check fails its reads, whichever comes first.
            Fault::Freeze if membership.in_outage() => {
                timeline.log(format!(
                    "freeze on {addr}: skipped (etcd is down: no lease can expire, the bound would not hold)"
                ));
                return;
            }
            Fault::Freeze => (
                Expect::Release,
                Some(b.stalled.map_or(b.lease, |s| s.min(b.lease))),
            ),
            Fault::EtcdOutage if membership.in_outage() || membership.any_frozen() => {
                timeline.log(
                    "etcd outage: skipped (etcd is already down, or a frozen prefill waits for its lease to expire)"
                        .into(),
                );
                return;
            }
            Fault::EtcdOutage => (Expect::Keep, None),
            Fault::Partition => match b.ucx_keepalive {
                // Reads or heartbeats see the failed endpoint (no bound
                // when periodic heartbeats are off).
                Some(_) => (Expect::Release, b.silent),
                // UCX never gives up on a silent peer: nor can we.
                None => (Expect::Keep, None),
            },
            Fault::ShortPartition | Fault::Transient => (Expect::Keep, None),
        };
        timeline.open_incident(prefill, fault.name(), &addr, &engine, expect, bound);
        let random = self.random.is_some();
        let mut rng_pick = |lo: f64, hi: f64| match self.random.as_mut() {
            Some((rng, _)) => Duration::from_secs_f64(rng.random_range(lo..hi)),
            None => Duration::from_secs_f64((lo + hi) / 2.0),
        };
        match fault {
            Fault::Kill | Fault::KillDuringRead => {
                if fault == Fault::Kill {
                    ucx.crash(&engine);
                } else {
                    ucx.crash_during_read(&engine);
                }
                // Scripted kills come back later (the last one stays dead);
                // random ones always, with a new or the same id.
                let back = rng_pick(10.0, 60.0);
                let same_id = if random {
                    back.as_millis() % 2 == 0
                } else {
                    fault == Fault::KillDuringRead
                };
                if random || at + back + b.longest() < self.duration {
                    self.push(at + back, prefill, Step::Start { same_id });
                }
            }
            Fault::Freeze => {
                ucx.freeze(&engine);
                membership.freeze(prefill);
                let back = b.long_freeze().max(b.long_silence()) + rng_pick(0.0, 20.0);
                self.push(at + back, prefill, Step::Thaw);
            }
            Fault::Partition => {
                ucx.partition(&engine);
                let back = b.long_silence() + rng_pick(0.0, 20.0);
                self.push(at + back, prefill, Step::Heal);
            }
            Fault::ShortPartition => {
                ucx.partition(&engine);
                let short = b.short_silence();
                let back = short.mul_f64(if random {
                    rng_pick(0.2, 1.0).as_secs_f64()
                } else {
                    0.8
                });
                self.push(at + back, prefill, Step::Heal);
            }
            Fault::Restart | Fault::RestartSameId => {
                let new = if fault == Fault::Restart {
                    ucx.restart(&addr)
                } else {
                    ucx.restart_with_same_id(&addr)
                };
                timeline.log(format!("{new} started at {addr}; the router announces it"));
                decoder.announce(prefill);
            }
            Fault::Transient => {
                ucx.inject(&engine, UcsStatus::ERR_NO_RESOURCE, 5);
            }
            Fault::EtcdOutage => {
                membership.outage();
                self.push(at + LEASE_TTL * 3, prefill, Step::EtcdBack);
            }
        }
    }
}
