//! The simulated state: prefill processes, and the decode agent's loaded
//! metadata, endpoints and prepped handles. Plain data and rules, no locks
//! and no clock: every rule takes `now`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::gate::GateInner;
use super::record::{FakeCall, FakeOp, Held};
use super::status::nixl_status_from_ucs;
use super::FakeConfig;
use crate::transport::{AgentName, EngineId, PeerAddr};
use nixl_status::NixlStatus;
use nixl_status::UcsStatus;

/// Index of a process in `Cluster::processes`: one per engine start.
pub(super) type ProcessId = usize;

/// How the network sees a prefill process.
#[derive(Clone, Copy, Debug)]
pub(super) enum Silence {
    /// Reachable.
    Reachable,
    /// Silent since `since`, until healed.
    Partition { since: Instant },
    /// Silent during `[start + 2k*period, start + (2k+1)*period)`, reachable
    /// in between, until healed.
    Flap { start: Instant, period: Duration },
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Gone {
    /// A READ was on the wire when the process died: the next read on each
    /// endpoint ends with `UCS_ERR_IO_ERROR` instead of a reset.
    pub(super) during_read: bool,
}

/// One start of a prefill engine.
#[derive(Debug)]
pub(super) struct Process {
    pub(super) engine: EngineId,
    pub(super) agents: Vec<AgentName>,
    pub(super) gone: Option<Gone>,
    pub(super) frozen_since: Option<Instant>,
    pub(super) silence: Silence,
    /// Transient statuses for the next operations: (status, operations left).
    pub(super) injected: VecDeque<(UcsStatus, usize)>,
}

/// The decode side's loaded metadata for one remote agent, and its endpoint.
#[derive(Debug)]
pub(super) struct LoadedAgent {
    pub(super) process: ProcessId,
    pub(super) loaded_at: Instant,
    /// Set once UCX has failed the endpoint, with the status that failed it.
    pub(super) failed: Option<UcsStatus>,
}

#[derive(Debug)]
pub(super) struct HandleSlot {
    pub(super) process: ProcessId,
    pub(super) agent: AgentName,
    pub(super) released: bool,
}

#[derive(Clone, Debug)]
pub(super) enum NotifyBlock {
    Gate(Arc<GateInner>),
    Sleep(std::time::Duration),
}

/// The simulated cluster: every prefill process the fake started (each
/// engine start is one), and the decode agent's view of them.
#[derive(Debug)]
pub(super) struct Cluster {
    pub(super) config: FakeConfig,
    pub(super) next_engine: u64,
    pub(super) processes: Vec<Process>,
    /// Engine id -> newest process started with it.
    pub(super) by_engine: HashMap<EngineId, ProcessId>,
    /// Address -> last process started there (listening unless gone).
    pub(super) by_addr: HashMap<PeerAddr, ProcessId>,
    /// Agent name -> engine id (names are derived from the engine id).
    pub(super) agent_engine: HashMap<AgentName, EngineId>,
    pub(super) loaded: BTreeMap<AgentName, LoadedAgent>,
    pub(super) handles: Vec<HandleSlot>,
    pub(super) blocks: HashMap<EngineId, NotifyBlock>,
    pub(super) calls: Vec<FakeCall>,
    /// Addresses whose side channel replays another process's reply.
    pub(super) replays: HashMap<PeerAddr, ProcessId>,
    /// The failure watches ([`crate::Transport::watch_failures`]), by id.
    pub(super) watchers: Vec<(u64, crate::transport::Suspicions)>,
    pub(super) next_watcher: u64,
}

impl Cluster {
    pub(super) fn new(config: FakeConfig) -> Self {
        Self {
            config,
            next_engine: 0,
            processes: Vec::new(),
            by_engine: HashMap::new(),
            by_addr: HashMap::new(),
            agent_engine: HashMap::new(),
            loaded: BTreeMap::new(),
            handles: Vec::new(),
            blocks: HashMap::new(),
            calls: Vec::new(),
            replays: HashMap::new(),
            watchers: Vec::new(),
            next_watcher: 0,
        }
    }

    pub(super) fn record(&mut self, call: FakeCall) {
        if self.config.record_calls {
            self.calls.push(call);
        }
    }

    pub(super) fn fresh_engine_id(&mut self) -> EngineId {
        let id = EngineId::new(format!("prefill-{}", self.next_engine));
        self.next_engine += 1;
        id
    }

    /// Starts a process; whatever listened at `addr` before is gone.
    pub(super) fn spawn(&mut self, addr: PeerAddr, engine: EngineId, ranks: usize) -> EngineId {
        assert!(ranks > 0, "a prefill engine needs at least one rank");
        self.replays.remove(&addr);
        if let Some(&old) = self.by_addr.get(&addr) {
            self.processes[old]
                .gone
                .get_or_insert(Gone { during_read: false });
        }
        let agents: Vec<AgentName> = (0..ranks)
            .map(|r| AgentName::new(format!("{engine}-rank{r}")))
            .collect();
        for agent in &agents {
            self.agent_engine.insert(agent.clone(), engine.clone());
        }
        let id = self.processes.len();
        self.processes.push(Process {
            engine: engine.clone(),
            agents,
            gone: None,
            frozen_since: None,
            silence: Silence::Reachable,
            injected: VecDeque::new(),
        });
        self.by_engine.insert(engine.clone(), id);
        self.by_addr.insert(addr, id);
        engine
    }

    pub(super) fn process_of(&self, engine: &EngineId) -> ProcessId {
        match self.by_engine.get(engine) {
            Some(&p) => p,
            None => panic!("FakeUcx: no prefill engine {engine} was ever spawned"),
        }
    }

    pub(super) fn process_at(&self, addr: &PeerAddr) -> ProcessId {
        match self.by_addr.get(addr) {
            Some(&p) => p,
            None => panic!("FakeUcx: no prefill engine was ever spawned at {addr}"),
        }
    }

    /// Whether the process's side channel and endpoints are silent at `now`.
    pub(super) fn is_silent(&self, p: ProcessId, now: Instant) -> bool {
        let process = &self.processes[p];
        if process.frozen_since.is_some() {
            return true;
        }
        match process.silence {
            Silence::Reachable => false,
            Silence::Partition { .. } => true,
            Silence::Flap { start, period } => {
                now >= start && (now.duration_since(start).as_nanos() / period.as_nanos()) % 2 == 0
            }
        }
    }

    /// When UCX keepalive fails an endpoint loaded at `loaded_at` to
    /// process `p`, given the process's current freeze and silence; `None`
    /// for never.
    pub(super) fn timeout_deadline(&self, p: ProcessId, loaded_at: Instant) -> Option<Instant> {
        let keepalive = self.config.keepalive_interval?;
        let process = &self.processes[p];
        let mut deadline: Option<Instant> = None;
        let mut consider = |d: Instant| deadline = Some(deadline.map_or(d, |old| old.min(d)));
        if self.config.frozen_peers_detected {
            if let Some(since) = process.frozen_since {
                consider(since.max(loaded_at) + keepalive);
            }
        }
        match process.silence {
            Silence::Reachable => {}
            Silence::Partition { since } => consider(since.max(loaded_at) + keepalive),
            Silence::Flap { start, period } => {
                if let Some(d) = flap_deadline(start, period, loaded_at, keepalive) {
                    consider(d);
                }
            }
        }
        deadline
    }

    /// Fails, with `UCS_ERR_ENDPOINT_TIMEOUT`, every endpoint to `p` whose
    /// keepalive deadline has passed at `now`. Called before a freeze or
    /// silence is lifted, so a detection that happened stays.
    pub(super) fn settle_timeouts(&mut self, p: ProcessId, now: Instant) {
        let due: Vec<AgentName> = self
            .loaded
            .iter()
            .filter(|(_, a)| a.process == p && a.failed.is_none())
            .filter(|(_, a)| {
                self.timeout_deadline(p, a.loaded_at)
                    .is_some_and(|d| d <= now)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in due {
            if let Some(agent) = self.loaded.get_mut(&name) {
                agent.failed = Some(UcsStatus::ERR_ENDPOINT_TIMEOUT);
            }
        }
    }

    /// Whether the endpoint to `agent` has failed at `now` (sticky, or by a
    /// keepalive deadline that has passed).
    pub(super) fn endpoint_failure(&self, agent: &AgentName, now: Instant) -> Option<UcsStatus> {
        let loaded = self.loaded.get(agent)?;
        if loaded.failed.is_some() {
            return loaded.failed;
        }
        self.timeout_deadline(loaded.process, loaded.loaded_at)
            .filter(|d| *d <= now)
            .map(|_| UcsStatus::ERR_ENDPOINT_TIMEOUT)
    }

    /// One notify or read on the endpoint to `agent` at `now`: the UCX
    /// status it completed with (`None` when UCX was not reached) and the
    /// NIXL status NIXL returned.
    pub(super) fn endpoint_op(
        &mut self,
        agent: &AgentName,
        op: FakeOp,
        now: Instant,
    ) -> (Option<UcsStatus>, NixlStatus) {
        let Some(loaded) = self.loaded.get(agent) else {
            return (None, NixlStatus::ERR_NOT_FOUND);
        };
        let p = loaded.process;
        let (ucs, fails) = if loaded.failed.is_some() {
            (None, true)
        } else if let Some(gone) = self.processes[p].gone {
            if op == FakeOp::Read && gone.during_read {
                (Some(UcsStatus::ERR_IO_ERROR), true)
            } else {
                (Some(UcsStatus::ERR_CONNECTION_RESET), true)
            }
        } else if self
            .timeout_deadline(p, loaded.loaded_at)
            .is_some_and(|d| d <= now)
        {
            (Some(UcsStatus::ERR_ENDPOINT_TIMEOUT), true)
        } else if let Some(injected) = self.take_injected(p) {
            (
                Some(injected),
                nixl_status_from_ucs(injected).is_remote_disconnect(),
            )
        } else if self.is_silent(p, now) && matches!(op, FakeOp::Read | FakeOp::Write) {
            (Some(UcsStatus::INPROGRESS), false)
        } else {
            (Some(UcsStatus::OK), false)
        };
        let mut status = match ucs {
            Some(ucs) => nixl_status_from_ucs(ucs),
            None => NixlStatus::ERR_REMOTE_DISCONNECT,
        };
        if fails {
            if let Some(loaded) = self.loaded.get_mut(agent) {
                loaded
                    .failed
                    .get_or_insert(ucs.unwrap_or(UcsStatus::ERR_CONNECTION_RESET));
            }
        }
        if op == FakeOp::Read
            && status.is_remote_disconnect()
            && self.config.drop_metadata_on_disconnect
        {
            self.loaded.remove(agent);
        }
        if op == FakeOp::Notify && status == NixlStatus::IN_PROG {
            status = NixlStatus::SUCCESS;
        }
        (ucs, status)
    }

    fn take_injected(&mut self, p: ProcessId) -> Option<UcsStatus> {
        let queue = &mut self.processes[p].injected;
        let (status, left) = queue.front_mut()?;
        let status = *status;
        *left -= 1;
        if *left == 0 {
            queue.pop_front();
        }
        Some(status)
    }

    pub(super) fn held_where(&self, keep: impl Fn(ProcessId) -> bool) -> Held {
        Held {
            remote_metadata: self.loaded.values().filter(|a| keep(a.process)).count(),
            dlist_handles: self
                .handles
                .iter()
                .filter(|h| !h.released && keep(h.process))
                .count(),
        }
    }
}

/// The first time an endpoint loaded at `from` has been silent for
/// `keepalive` without a break, for a peer flapping with `period` since
/// `start`; `None` when no silent window is long enough.
fn flap_deadline(
    start: Instant,
    period: Duration,
    from: Instant,
    keepalive: Duration,
) -> Option<Instant> {
    if keepalive > period {
        return None;
    }
    let cycle = period * 2;
    let cycles_before = if from <= start {
        0
    } else {
        from.duration_since(start).as_nanos() / cycle.as_nanos()
    };
    let window_start = start + Duration::from_nanos((cycle.as_nanos() * cycles_before) as u64);
    let window_end = window_start + period;
    let silent_from = from.max(window_start);
    if silent_from + keepalive <= window_end {
        Some(silent_from + keepalive)
    } else {
        Some(window_start + cycle + keepalive)
    }
}
