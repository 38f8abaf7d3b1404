//! The peer table and its rules: a synchronous state machine.
//!
//! Every input carries `now`; every decision comes out as an [`Action`] the
//! driver carries out (arm a timer, send a heartbeat, release an engine,
//! publish an event). Nothing here reads a clock, sleeps, spawns or calls
//! NIXL, so the rules can be tested step by step and the driver stays thin.
//!
//! Engines are keyed internally by their registration serial, not their
//! engine id: a pinned id that comes back is a new registration, and a late
//! result from the old one must not touch the new one.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::{Clock, FakeRelativeClock};
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::StateStore;
use governor::{Quota, RateLimiter};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use crate::config::Config;
use crate::engine::{EngineCell, EngineRef, EngineState};
use crate::event::{Event, ReleaseReason, WaitedFor};
use crate::offload::Job;
use crate::snapshot::{EngineSnapshot, HeartbeatSnapshot, Snapshot};
use crate::telemetry;
use crate::transport::{AgentName, EngineId, PeerAddr, ReleaseStep, TransportError};
use crate::NixlStatus;

/// What the decoder runtime hands over after a successful handshake.
#[derive(Debug)]
pub struct Registration<R> {
    /// The engine id the prefill reported (and the runtime checked).
    pub engine: EngineId,
    /// Its side-channel address.
    pub address: PeerAddr,
    /// Its NIXL agent names, one per remote rank. Heartbeats go to each;
    /// each one's remote metadata is invalidated at release.
    pub agents: Vec<AgentName>,
    /// What the transport must free at release (prepped dlist handles...).
    pub resources: R,
}

/// Which peer a "peer gone" message means.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PeerRef {
    /// By engine id.
    Engine(EngineId),
    /// By side-channel address: the engine registered there now.
    Address(PeerAddr),
}

/// What to do with reads in flight from a peer that is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GoneMode {
    /// Let reads in flight finish, then release.
    Drain,
    /// Report reads in flight failed at once; release as soon as their
    /// guards drop.
    Fail,
}

/// One heartbeat round's results: how many notifications NIXL accepted,
/// and the ones that failed, in agent order. A round where every agent
/// accepted allocates nothing.
#[derive(Debug, Default)]
pub(crate) struct RoundResults {
    /// Notifications accepted.
    pub(crate) sent: usize,
    /// Notifications that failed, with their agent.
    pub(crate) failed: Vec<(AgentName, TransportError)>,
}

/// Registrations queued behind the release of their engine id's previous
/// registration.
type Waiting<R> = VecDeque<(Registration<R>, Arc<EngineCell>)>;

/// Heartbeat deadlines are rounded up to multiples of this, so engines due
/// within one slot are sent in one wake-up of the driver instead of one
/// each: at 10k engines a wake-up per millisecond (thread hand-offs and
/// all) was most of the service's CPU. Next to a jitter of hundreds of
/// milliseconds this changes no engine's schedule in any way that matters;
/// every bound in this crate includes it.
pub const HEARTBEAT_SLOT: Duration = Duration::from_millis(10);

/// A decision of the table, for the driver to carry out.
pub(crate) enum Action<R> {
    /// Arm (or re-arm) the engine's heartbeat timer for `at`.
    Schedule { serial: u64, at: Instant },
    /// Disarm the engine's heartbeat timer.
    Unschedule { serial: u64 },
    /// Make a transport call (a heartbeat round, a release), off the
    /// async threads.
    Call(Job<R>),
    /// A registration is active: hand its reference to whoever awaits it.
    Activated(EngineRef),
    /// No registration of this engine id is held any more: its metadata
    /// may be loaded again.
    ReloadReady(EngineId),
    /// Publish an event.
    Emit(Event),
}

/// Why an engine was marked, and what its release has waited for.
struct Mark {
    reason: ReleaseReason,
    at: Instant,
    reads_at_mark: u64,
    held_by_handshake: bool,
}

struct Peer<R> {
    cell: Arc<EngineCell>,
    address: PeerAddr,
    /// Shared with every heartbeat round in flight: no copy per round.
    agents: Arc<[AgentName]>,
    /// `None` once handed to the transport.
    resources: Option<R>,
    mark: Option<Mark>,
    leases: BTreeSet<String>,
    /// The heartbeat message for `leases`, built at the first round after
    /// they change (`None` until then).
    message: Option<Arc<[u8]>>,
    next_heartbeat: Option<Instant>,
    heartbeat_in_flight: bool,
    /// A lease renewal was asked for and has not gone out yet.
    renewal_wanted: bool,
    last_heartbeat: Option<(Instant, NixlStatus)>,
    transient_errors: u64,
}

impl<R> Peer<R> {
    fn id(&self) -> &EngineId {
        self.cell.id()
    }

    fn is_live(&self) -> bool {
        self.mark.is_none()
    }
}

/// governor's keyed state, kept where the table can forget a released
/// engine's key at once (governor's own stores only forget idle keys in
/// bulk).
#[derive(Clone, Default)]
struct LimiterKeys(Arc<Mutex<HashMap<u64, Nanos>>>);

impl StateStore for LimiterKeys {
    type Key = u64;

    fn measure_and_replace<T, F, E>(&self, key: &u64, f: F) -> Result<T, E>
    where
        F: Fn(Option<Nanos>) -> Result<(T, Nanos), E>,
    {
        let mut keys = self.0.lock().expect("limiter keys poisoned");
        let (out, state) = f(keys.get(key).copied())?;
        keys.insert(*key, state);
        Ok(out)
    }
}

impl LimiterKeys {
    fn forget(&self, key: u64) {
        self.0.lock().expect("limiter keys poisoned").remove(&key);
    }

    fn len(&self) -> usize {
        self.0.lock().expect("limiter keys poisoned").len()
    }
}

/// The per-engine notification rate cap, on the table's clock: governor
/// sees exactly the `now` the driver passed in (tokio's clock, paused in
/// tests), never the wall clock.
struct RateCap {
    limiter: RateLimiter<u64, LimiterKeys, FakeRelativeClock, NoOpMiddleware<Nanos>>,
    keys: LimiterKeys,
    clock: FakeRelativeClock,
    origin: Instant,
    clock_at: Duration,
}

impl RateCap {
    fn new(config: &Config, origin: Instant) -> Self {
        let burst = NonZeroU32::new(config.rate_burst).expect("validated burst");
        let quota = Quota::with_period(config.rate_period)
            .expect("validated period")
            .allow_burst(burst);
        let keys = LimiterKeys::default();
        let clock = FakeRelativeClock::default();
        RateCap {
            limiter: RateLimiter::new(quota, keys.clone(), clock.clone()),
            keys,
            clock,
            origin,
            clock_at: Duration::ZERO,
        }
    }

    /// `at`, rounded up to the next [`HEARTBEAT_SLOT`] boundary (counted
    /// from the table's origin).
    fn slot_up(&self, at: Instant) -> Instant {
        let slot = HEARTBEAT_SLOT.as_nanos();
        let since = at.saturating_duration_since(self.origin).as_nanos();
        let rounded = since.div_ceil(slot) * slot;
        self.origin + Duration::from_nanos(rounded as u64)
    }

    /// `Ok` if the engine may get a notification round at `now` (and counts
    /// it), else how long until it may.
    fn check(&mut self, serial: u64, now: Instant) -> Result<(), Duration> {
        let since = now.saturating_duration_since(self.origin);
        if since > self.clock_at {
            self.clock.advance(since - self.clock_at);
            self.clock_at = since;
        }
        self.limiter
            .check_key(&serial)
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }
}

/// The peer table.
pub(crate) struct PeerTable<R> {
    config: Config,
    peers: HashMap<u64, Peer<R>>,
    /// The registration each engine id holds now (at most one).
    by_id: HashMap<EngineId, u64>,
    /// The registration each address maps to now.
    by_addr: HashMap<PeerAddr, u64>,
    /// Handshakes in progress per address.
    handshakes: HashMap<PeerAddr, usize>,
    /// Marked engines whose release waits for a handshake at their address.
    held_by_handshake: HashMap<PeerAddr, Vec<u64>>,
    /// Registrations of an engine id whose previous registration is still
    /// being released (NIXL cannot load metadata over metadata).
    waiting: HashMap<EngineId, Waiting<R>>,
    rate: RateCap,
    rng: StdRng,
    actions: VecDeque<Action<R>>,
    /// The message of an engine without leases, shared by all of them.
    idle_message: Arc<[u8]>,
    /// Appended to a live engine's "why not released": what the settings in
    /// force say about silent peers.
    silent_peer_note: String,
}

impl<R> PeerTable<R> {
    pub(crate) fn new(config: Config, now: Instant) -> Self {
        let rng = match config.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        PeerTable {
            rate: RateCap::new(&config, now),
            config,
            peers: HashMap::new(),
            by_id: HashMap::new(),
            by_addr: HashMap::new(),
            handshakes: HashMap::new(),
            held_by_handshake: HashMap::new(),
            waiting: HashMap::new(),
            rng,
            actions: VecDeque::new(),
            idle_message: heartbeat_message(&BTreeSet::new()).into(),
            silent_peer_note: "UCX settings not given to the service".to_string(),
        }
    }

    /// Sets the note a live engine's snapshot carries about silent peers.
    pub(crate) fn set_silent_peer_note(&mut self, note: String) {
        self.silent_peer_note = note;
    }

    /// The next decision to carry out, if any.
    pub(crate) fn poll_action(&mut self) -> Option<Action<R>> {
        self.actions.pop_front()
    }

    fn emit(&mut self, event: Event) {
        self.actions.push_back(Action::Emit(event));
    }

    // ----- inputs from the runtime -----

    /// A handshake with `address` started: the release of any engine there
    /// waits until it finishes.
    pub(crate) fn handshake_started(&mut self, address: PeerAddr) {
        *self.handshakes.entry(address).or_default() += 1;
    }

    /// A handshake with `address` finished (successfully or not).
    pub(crate) fn handshake_finished(&mut self, now: Instant, address: &PeerAddr) {
        let Some(count) = self.handshakes.get_mut(address) else {
            return;
        };
        *count -= 1;
        if *count > 0 {
            return;
        }
        self.handshakes.remove(address);
        for serial in self.held_by_handshake.remove(address).unwrap_or_default() {
            self.try_release(now, serial);
        }
    }

    /// An engine registered after a successful handshake.
    pub(crate) fn register(
        &mut self,
        now: Instant,
        registration: Registration<R>,
        cell: Arc<EngineCell>,
    ) {
        let id = registration.engine.clone();
        if let Some(&old) = self.by_id.get(&id) {
            // A pinned id came back. Its old metadata must go first.
            tracing::info!(engine = %id, "engine registered again under the same id; releasing the old registration first");
            self.emit(Event::Replaced {
                old: id.clone(),
                new: id.clone(),
                address: registration.address.clone(),
            });
            self.mark(now, old, ReleaseReason::Reregistered);
            self.waiting
                .entry(id)
                .or_default()
                .push_back((registration, cell));
            return;
        }
        self.activate(now, registration, cell);
    }

    fn activate(&mut self, now: Instant, registration: Registration<R>, cell: Arc<EngineCell>) {
        let serial = cell.serial();
        let Registration {
            engine,
            address,
            agents,
            resources,
        } = registration;
        tracing::info!(%engine, %address, agents = agents.len(), "engine registered");
        self.emit(Event::Registered {
            engine: engine.clone(),
            address: address.clone(),
        });
        self.by_id.insert(engine.clone(), serial);
        let previous = self.by_addr.insert(address.clone(), serial);
        self.peers.insert(
            serial,
            Peer {
                cell: cell.clone(),
                address: address.clone(),
                agents: agents.into(),
                resources: Some(resources),
                mark: None,
                leases: BTreeSet::new(),
                message: None,
                next_heartbeat: None,
                heartbeat_in_flight: false,
                renewal_wanted: false,
                last_heartbeat: None,
                transient_errors: 0,
            },
        );
        if let Some(first) = self.config.heartbeat_interval {
            // Spread first heartbeats over one interval: engines registered
            // together must not all beat together.
            let offset = first.mul_f64(self.rng.random::<f64>());
            self.schedule(serial, now + offset);
        }
        self.actions
            .push_back(Action::Activated(EngineRef { cell }));
        if let Some(old) = previous.filter(|&old| old != serial) {
            if let Some(old_peer) = self.peers.get(&old) {
                let old_id = old_peer.id().clone();
                tracing::warn!(old = %old_id, new = %engine, %address, "a new engine id answered at a known address: the old engine was replaced");
                self.emit(Event::Replaced {
                    old: old_id,
                    new: engine,
                    address,
                });
                self.mark(now, old, ReleaseReason::Replaced);
            }
        }
    }

    /// Marks the engine `id` holds as re-registering (if any) and reports
    /// [`Action::ReloadReady`] once no registration of `id` is held.
    pub(crate) fn prepare_reload(&mut self, now: Instant, id: EngineId) {
        match self.by_id.get(&id) {
            Some(&serial) => self.mark(now, serial, ReleaseReason::Reregistered),
            None => self.actions.push_back(Action::ReloadReady(id)),
        }
    }

    /// A transfer from the registration `serial` ended with `status` (an
    /// error; successes are not sent).
    pub(crate) fn transfer_result(&mut self, now: Instant, serial: u64, status: NixlStatus) {
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        let engine = peer.id().clone();
        if status.is_remote_disconnect() {
            telemetry::transfer_error(status);
            if peer.is_live() {
                tracing::warn!(%engine, %status, raw = status.raw(), "transfer returned REMOTE_DISCONNECT: engine unreachable");
                self.emit(Event::Unreachable {
                    engine,
                    status,
                    source: "transfer",
                });
                self.mark(now, serial, ReleaseReason::Unreachable);
            }
        } else if !status.is_ok() {
            peer.transient_errors += 1;
            telemetry::transfer_error(status);
            tracing::info!(%engine, %status, raw = status.raw(), "transfer failed with an error that is not a disconnect: counted, engine kept");
            self.emit(Event::TransientError {
                engine,
                status,
                source: "transfer",
            });
        }
    }

    /// The last read of a marked registration ended.
    pub(crate) fn drained(&mut self, now: Instant, serial: u64) {
        self.try_release(now, serial);
    }

    /// Adds lease request ids to renew with each heartbeat of `id`; with
    /// `renew_now`, asks for a renewal as soon as the rate cap allows.
    pub(crate) fn add_leases(
        &mut self,
        now: Instant,
        id: &EngineId,
        requests: Vec<String>,
        renew_now: bool,
    ) {
        let Some(serial) = self.live_serial(id) else {
            tracing::debug!(engine = %id, "lease for an engine that is not live: ignored");
            return;
        };
        let peer = self.peers.get_mut(&serial).expect("live serial");
        if !requests.is_empty() {
            peer.leases.extend(requests);
            peer.message = None;
        }
        if renew_now {
            self.renew(now, serial);
        }
    }

    /// Stops renewing these lease request ids.
    pub(crate) fn remove_leases(&mut self, id: &EngineId, requests: &[String]) {
        if let Some(peer) = self.by_id.get(id).and_then(|s| self.peers.get_mut(s)) {
            for r in requests {
                if peer.leases.remove(r) {
                    peer.message = None;
                }
            }
        }
    }

    /// The router or orchestrator says a peer is gone. Idempotent; unknown
    /// peers are ignored.
    pub(crate) fn peer_gone(&mut self, now: Instant, peer: PeerRef, mode: GoneMode) {
        let serial = match &peer {
            PeerRef::Engine(id) => self.by_id.get(id).copied(),
            PeerRef::Address(addr) => self.by_addr.get(addr).copied(),
        };
        let Some(serial) = serial else {
            tracing::debug!(?peer, "peer gone: not a known peer, nothing to do");
            return;
        };
        let Some(p) = self.peers.get(&serial) else {
            return;
        };
        let engine = p.id().clone();
        let already_marked = !p.is_live();
        if !already_marked {
            tracing::info!(%engine, ?mode, "peer gone: retiring");
            self.emit(Event::Retiring {
                engine: engine.clone(),
                fail_reads: mode == GoneMode::Fail,
            });
            self.mark(now, serial, ReleaseReason::PeerGone);
        }
        if mode == GoneMode::Fail {
            self.fail_reads(serial);
        }
    }

    // ----- timers and transport results -----

    /// The heartbeat timer of `serial` fired.
    pub(crate) fn heartbeat_due(&mut self, now: Instant, serial: u64) {
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        // The schedule runs from the deadline, not from when the timer was
        // served, so serving delays (and the slot rounding) never add up.
        let due = peer.next_heartbeat.take().map_or(now, |due| due.min(now));
        if !peer.is_live() {
            return;
        }
        if peer.heartbeat_in_flight {
            // The previous round has not come back (a slow or hung call):
            // never stack rounds on one engine. Try again next period.
            if let Some(interval) = self.config.heartbeat_interval {
                let at = now + interval;
                self.schedule(serial, at);
            }
            return;
        }
        match self.rate.check(serial, now) {
            Ok(()) => self.send_heartbeat(due, serial),
            Err(wait) => {
                telemetry::heartbeat_deferred();
                self.schedule(serial, now + wait);
            }
        }
    }

    fn renew(&mut self, now: Instant, serial: u64) {
        let peer = self.peers.get_mut(&serial).expect("live serial");
        if peer.heartbeat_in_flight {
            peer.renewal_wanted = true;
            return;
        }
        match self.rate.check(serial, now) {
            Ok(()) => self.send_heartbeat(now, serial),
            Err(wait) => {
                telemetry::heartbeat_deferred();
                peer.renewal_wanted = true;
                let at = now + wait;
                if peer.next_heartbeat.is_none_or(|next| at < next) {
                    self.schedule(serial, at);
                }
            }
        }
    }

    /// Sends a round now; the next is due one interval (plus jitter) after
    /// `base`: the deadline this round was due at, or now for a renewal.
    fn send_heartbeat(&mut self, base: Instant, serial: u64) {
        let peer = self.peers.get_mut(&serial).expect("live serial");
        peer.heartbeat_in_flight = true;
        peer.renewal_wanted = false;
        let message = match &peer.message {
            Some(message) => message.clone(),
            None => {
                let message: Arc<[u8]> = if peer.leases.is_empty() {
                    self.idle_message.clone()
                } else {
                    heartbeat_message(&peer.leases).into()
                };
                peer.message = Some(message.clone());
                message
            }
        };
        let agents = peer.agents.clone();
        self.actions.push_back(Action::Call(Job::Heartbeat {
            serial,
            agents,
            message,
        }));
        if let Some(interval) = self.config.heartbeat_interval {
            let jitter = self.config.jitter.as_secs_f64();
            let delta = self.rng.random_range(-jitter..=jitter);
            let next = Duration::from_secs_f64((interval.as_secs_f64() + delta).max(0.0));
            self.schedule(serial, base + next);
        } else {
            self.unschedule(serial);
        }
    }

    /// A heartbeat round of `serial` came back: one result per agent.
    pub(crate) fn heartbeat_done(&mut self, now: Instant, serial: u64, results: RoundResults) {
        let mut disconnect = None;
        let mut transient = Vec::new();
        for _ in 0..results.sent {
            telemetry::heartbeat_sent();
        }
        for (agent, e) in results.failed {
            telemetry::heartbeat_failed(e.status);
            if e.status.is_remote_disconnect() {
                disconnect.get_or_insert(e.status);
            } else {
                transient.push((agent, e.status));
            }
        }
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        peer.heartbeat_in_flight = false;
        let status = disconnect
            .or(transient.first().map(|t| t.1))
            .unwrap_or(NixlStatus::SUCCESS);
        peer.last_heartbeat = Some((now, status));
        peer.transient_errors += transient.len() as u64;
        let engine = peer.id().clone();
        let live = peer.is_live();
        let renewal_wanted = peer.renewal_wanted;
        for (agent, status) in transient {
            tracing::info!(%engine, %agent, %status, raw = status.raw(), "heartbeat failed with an error that is not a disconnect: counted, engine kept");
            self.emit(Event::TransientError {
                engine: engine.clone(),
                status,
                source: "heartbeat",
            });
        }
        if let Some(status) = disconnect {
            if live {
                tracing::warn!(%engine, %status, raw = status.raw(), "heartbeat returned REMOTE_DISCONNECT: engine unreachable");
                self.emit(Event::Unreachable {
                    engine,
                    status,
                    source: "heartbeat",
                });
                self.mark(now, serial, ReleaseReason::Unreachable);
            }
        } else if live && renewal_wanted {
            self.renew(now, serial);
        }
    }

    /// The transport finished releasing `serial`.
    pub(crate) fn release_done(&mut self, now: Instant, serial: u64, steps: Vec<ReleaseStep>) {
        let Some(peer) = self.peers.remove(&serial) else {
            return;
        };
        let engine = peer.id().clone();
        let mark = peer.mark.expect("released engines are marked");
        let mut failed_steps = 0;
        for step in &steps {
            if step.status == NixlStatus::ERR_NOT_FOUND {
                tracing::debug!(%engine, target = ?step.target, "already dropped by NIXL: counts as released");
            } else if !step.status.is_ok() {
                failed_steps += 1;
                telemetry::release_step_failed(step.status);
                tracing::error!(%engine, target = ?step.target, status = %step.status, raw = step.status.raw(), "release step failed");
            }
        }
        let since_mark = now.saturating_duration_since(mark.at);
        telemetry::released(mark.reason, since_mark);
        tracing::info!(%engine, reason = mark.reason.as_str(), after = ?since_mark, failed_steps, "engine released");
        self.emit(Event::Released {
            engine: engine.clone(),
            reason: mark.reason,
            waited_for: WaitedFor {
                duration: since_mark,
                reads_in_flight_at_mark: mark.reads_at_mark,
                handshake: mark.held_by_handshake,
            },
            failed_steps,
        });
        if self.by_id.get(&engine) == Some(&serial) {
            self.by_id.remove(&engine);
        }
        if self.by_addr.get(&peer.address) == Some(&serial) {
            self.by_addr.remove(&peer.address);
        }
        if let Some(mut queue) = self.waiting.remove(&engine) {
            let (registration, cell) = queue.pop_front().expect("queues are never empty");
            if !queue.is_empty() {
                self.waiting.insert(engine.clone(), queue);
            }
            self.activate(now, registration, cell);
            if self.waiting.contains_key(&engine) {
                let serial = self.by_id[&engine];
                self.mark(now, serial, ReleaseReason::Reregistered);
            }
        } else {
            self.actions.push_back(Action::ReloadReady(engine));
        }
    }

    /// The service is stopping: every live engine is marked, so each one
    /// that can be released now is; [`PeerTable::into_unreleased`] hands
    /// back the rest (reads in flight or handshake pending).
    pub(crate) fn shutdown(&mut self, now: Instant) {
        let live: Vec<u64> = self
            .peers
            .iter()
            .filter(|(_, p)| p.is_live())
            .map(|(s, _)| *s)
            .collect();
        for serial in live {
            self.mark(now, serial, ReleaseReason::Shutdown);
        }
    }

    /// Registrations still held, resources and all: what a shutdown could
    /// not release.
    pub(crate) fn into_unreleased(self) -> Vec<Registration<R>> {
        let mut out: Vec<Registration<R>> = self
            .peers
            .into_values()
            .filter_map(|p| {
                let engine = p.cell.id().clone();
                p.resources.map(|resources| Registration {
                    engine,
                    address: p.address,
                    agents: p.agents.to_vec(),
                    resources,
                })
            })
            .collect();
        out.extend(
            self.waiting
                .into_values()
                .flatten()
                .map(|(registration, _)| registration),
        );
        out
    }

    // ----- the rules -----

    fn live_serial(&self, id: &EngineId) -> Option<u64> {
        let serial = *self.by_id.get(id)?;
        self.peers
            .get(&serial)
            .filter(|p| p.is_live())
            .map(|_| serial)
    }

    /// Marks a live engine: no new reads, no more heartbeats; released as
    /// soon as it is idle. The first mark stands.
    fn mark(&mut self, now: Instant, serial: u64, reason: ReleaseReason) {
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        let _span = tracing::info_span!("engine", engine = %peer.id(), serial).entered();
        if !peer.is_live() {
            return;
        }
        let state = match reason {
            ReleaseReason::Unreachable => EngineState::Unreachable,
            ReleaseReason::Replaced | ReleaseReason::Reregistered => EngineState::Replaced,
            ReleaseReason::PeerGone | ReleaseReason::Shutdown => EngineState::Retiring,
        };
        let reads = peer.cell.mark(state).unwrap_or(0);
        peer.mark = Some(Mark {
            reason,
            at: now,
            reads_at_mark: reads,
            held_by_handshake: false,
        });
        peer.leases.clear();
        peer.message = None;
        tracing::info!(engine = %peer.id(), state = state.as_str(), reads_in_flight = reads, "engine marked for release");
        self.unschedule(serial);
        if reason == ReleaseReason::Unreachable {
            // UCX has failed the endpoint: no read in flight can complete.
            self.fail_reads(serial);
        }
        self.try_release(now, serial);
    }

    fn fail_reads(&mut self, serial: u64) {
        let Some(peer) = self.peers.get(&serial) else {
            return;
        };
        peer.cell.fail_reads();
        let count = peer.cell.reads_in_flight();
        if count > 0 {
            let engine = peer.id().clone();
            tracing::warn!(%engine, count, "reads in flight failed");
            self.emit(Event::ReadsFailed { engine, count });
        }
    }

    /// Releases a marked engine if no read is in flight and no handshake is
    /// pending at its address. Decided here, under the table; the transport
    /// is called by the driver after.
    fn try_release(&mut self, now: Instant, serial: u64) {
        let Some(peer) = self.peers.get_mut(&serial) else {
            return;
        };
        let Some(mark) = peer.mark.as_mut() else {
            return;
        };
        if peer.resources.is_none() {
            return; // already being released
        }
        // A pending handshake may yet decide the engine at this address is
        // new, so the old one waits. Not for a re-registration: that
        // handshake is the runtime's own, waiting for this very release.
        if mark.reason != ReleaseReason::Reregistered && self.handshakes.contains_key(&peer.address)
        {
            mark.held_by_handshake = true;
            let held = self
                .held_by_handshake
                .entry(peer.address.clone())
                .or_default();
            if !held.contains(&serial) {
                held.push(serial);
            }
            return;
        }
        if peer.cell.try_release().is_err() {
            return; // the last guard to drop wakes us
        }
        let waited = now.saturating_duration_since(mark.at);
        let engine = peer.id().clone();
        tracing::debug!(%engine, ?waited, "releasing");
        let resources = peer.resources.take().expect("checked above");
        let agents = peer.agents.clone();
        self.rate.keys.forget(serial);
        self.actions.push_back(Action::Call(Job::Release {
            serial,
            engine,
            agents,
            resources,
        }));
    }

    fn schedule(&mut self, serial: u64, at: Instant) {
        let at = self.rate.slot_up(at);
        if let Some(peer) = self.peers.get_mut(&serial) {
            peer.next_heartbeat = Some(at);
            self.actions.push_back(Action::Schedule { serial, at });
        }
    }

    fn unschedule(&mut self, serial: u64) {
        if let Some(peer) = self.peers.get_mut(&serial) {
            if peer.next_heartbeat.take().is_some() {
                self.actions.push_back(Action::Unschedule { serial });
            }
        }
    }

    // ----- introspection -----

    /// Counts of engines by state and reads in flight, for the gauges.
    /// Walks every engine: called at the metrics period, not per tick.
    pub(crate) fn census(&self) -> ([usize; 5], u64) {
        let mut by_state = [0usize; 5];
        let mut reads = 0;
        for peer in self.peers.values() {
            by_state[peer.cell.state() as usize] += 1;
            reads += peer.cell.reads_in_flight();
        }
        (by_state, reads)
    }

    /// The table as it is now.
    pub(crate) fn snapshot(&self, now: Instant) -> Snapshot {
        let mut engines: Vec<EngineSnapshot> = self
            .peers
            .values()
            .map(|p| self.engine_snapshot(now, p))
            .collect();
        engines.sort_by(|a, b| a.engine.cmp(&b.engine));
        let mut handshakes_pending: Vec<(PeerAddr, usize)> = self
            .handshakes
            .iter()
            .map(|(a, n)| (a.clone(), *n))
            .collect();
        handshakes_pending.sort();
        let mut waiting: Vec<EngineId> = self.waiting.keys().cloned().collect();
        waiting.sort();
        Snapshot {
            engines,
            handshakes_pending,
            waiting_for_reload: waiting,
            silent_peer_note: self.silent_peer_note.clone(),
            limiter_keys: self.rate.keys.len(),
            heartbeat_timers: 0,
            detection_bound: None,
        }
    }

    fn engine_snapshot(&self, now: Instant, p: &Peer<R>) -> EngineSnapshot {
        let reads = p.cell.reads_in_flight();
        let last_heartbeat = p.last_heartbeat.map(|(at, status)| HeartbeatSnapshot {
            ago: now.saturating_duration_since(at),
            status,
        });
        let why = match &p.mark {
            None => {
                let last = match &last_heartbeat {
                    Some(h) => format!("last heartbeat {} {:?} ago", h.status.name(), h.ago),
                    None => "no heartbeat yet".to_string(),
                };
                format!(
                    "live: no REMOTE_DISCONNECT seen ({last}); a frozen or silent peer is reported only by UCX: {}",
                    self.silent_peer_note
                )
            }
            Some(_) if p.resources.is_none() => {
                "releasing: the transport is giving back its NIXL state".into()
            }
            Some(m) => {
                let mut held = Vec::new();
                if reads > 0 {
                    held.push(format!("{reads} read(s) in flight"));
                }
                if let Some(n) = self.handshakes.get(&p.address) {
                    held.push(format!("{n} handshake(s) pending at {}", p.address));
                }
                format!(
                    "{}: release waits for {}",
                    m.reason.as_str(),
                    if held.is_empty() {
                        "nothing (about to be released)".to_string()
                    } else {
                        held.join(" and ")
                    }
                )
            }
        };
        EngineSnapshot {
            engine: p.id().clone(),
            address: p.address.clone(),
            agents: p.agents.to_vec(),
            state: p.cell.state(),
            reads_in_flight: reads,
            leases: p.leases.iter().cloned().collect(),
            last_heartbeat,
            next_heartbeat_in: p.next_heartbeat.map(|at| at.saturating_duration_since(now)),
            transient_errors: p.transient_errors,
            why,
        }
    }
}

/// vLLM's lease-renewal text: `HB:` and the comma-separated request ids
/// (nothing after the colon for an idle engine).
pub fn heartbeat_message<'a>(requests: impl IntoIterator<Item = &'a String>) -> Vec<u8> {
    let mut message = b"HB:".to_vec();
    for (i, r) in requests.into_iter().enumerate() {
        if i > 0 {
            message.push(b',');
        }
        message.extend_from_slice(r.as_bytes());
    }
    message
}
