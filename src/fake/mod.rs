//! A simulated UCX/NIXL cluster, as one decode engine's NIXL agent sees it.
//!
//! [`FakeUcx`] implements [`Transport`] for tests: ours and yours. It holds
//! prefill engines (processes with one NIXL agent per rank, listening on a
//! side-channel address), the decode agent's loaded remote metadata with one
//! simulated UCX endpoint per remote agent, and the prepped descriptor-list
//! handles. Faults are injected per engine; every call is recorded; what is
//! loaded and not released is counted, so a test can assert nothing leaked.
//!
//! ```
//! use nixl_keepalive::fake::{FakeConfig, FakeUcx};
//! use nixl_keepalive::{NixlStatus, PeerAddr, Transport};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let ucx = FakeUcx::new(FakeConfig::default());
//! let engine = ucx.spawn_prefill(PeerAddr::from("10.0.0.1:5600"), 2);
//! // What the decoder runtime does: handshake, then register with the service.
//! let hs = ucx.handshake(&PeerAddr::from("10.0.0.1:5600")).unwrap();
//! assert_eq!(hs.engine, engine);
//! assert!(ucx.notify(&hs.agents[0], b"HB:req-1").is_ok());
//!
//! ucx.crash(&engine);
//! let err = ucx.notify(&hs.agents[0], b"HB:req-1").unwrap_err();
//! assert_eq!(err.status, NixlStatus::ERR_REMOTE_DISCONNECT);
//!
//! let steps = ucx.release(&hs.engine, &hs.agents, hs.resources);
//! assert!(steps.iter().all(|s| s.status == NixlStatus::SUCCESS));
//! ucx.assert_nothing_leaked();
//! # });
//! ```
//!
//! # Time
//!
//! The fake reads the clock with [`tokio::time::Instant::now`], so it
//! follows tokio's paused clock in `#[tokio::test(start_paused = true)]`,
//! also from `spawn_blocking` threads of that runtime (the service calls
//! `notify` there). Use it inside a tokio runtime; outside one it runs on
//! real time. Nothing in the fake sleeps on tokio's clock: the keepalive
//! rules below are evaluated when an operation or a fault method runs.
//!
//! # What is simulated
//!
//! - **Handshake** ([`FakeUcx::handshake`] = [`FakeUcx::fetch_metadata`] +
//!   [`FakeUcx::load_metadata`]): the side channel gives the engine id and
//!   its agents; then `loadRemoteMD` per agent and `prepXferDlist` per rank.
//!   Loading another process's metadata under an agent name that is still
//!   loaded is refused with `NOT_ALLOWED` (NIXL cannot update metadata in
//!   place); loading the identical metadata again is accepted and keeps
//!   one entry, as measured with NIXL 1.5.1. [`FakeUcx::replay_at`] stages
//!   a hostile prefill that answers with another's reply;
//!   [`FakeUcx::connect`] is the reference runtime. Nobody listening
//!   (crashed, not restarted) fails the handshake; so does a frozen or
//!   partitioned engine (its side channel does not answer).
//! - **Endpoints**: one per loaded remote agent. Once UCX fails one (by a
//!   reset, a keepalive timeout, or an injected disconnect status) it stays
//!   failed: every later notify or read on it returns `REMOTE_DISCONNECT`
//!   until the metadata is invalidated. Calls to an agent whose metadata is
//!   not loaded return `NOT_FOUND`.
//! - **Notify** is fire-and-forget, as `genNotif`: `SUCCESS` until the
//!   endpoint has failed, `IN_PROG` reported as `SUCCESS`.
//! - **Read** ([`FakeUcx::read`]): the status a READ transfer posted now
//!   would end with: `SUCCESS` from a live peer, `IN_PROG` while the peer is
//!   silent (frozen or partitioned, not yet detected), `REMOTE_DISCONNECT`
//!   once the endpoint has failed. With
//!   [`FakeConfig::drop_metadata_on_disconnect`] a read ending in
//!   `REMOTE_DISCONNECT` drops the agent's metadata as NIXL 0.6+ does.
//! - **Write** ([`FakeUcx::write`], push mode): as a read, `IN_PROG`
//!   while the peer is silent included (measured with NIXL 1.5.1 over
//!   loopback TCP: a WRITE into a SIGSTOPped decode stays in progress
//!   until it runs again); `drop_metadata_on_disconnect` applies to reads
//!   only.
//! - **Release** ([`Transport::release`]): `releasedDlistH` per handle, then
//!   `invalidateRemoteMD` per agent; a step whose target is already gone
//!   answers `NOT_FOUND`; double release never panics. After each
//!   successful invalidation, a [`ReleaseTarget::Endpoints`] step: the
//!   agent's endpoint is closed (`EndpointClose::Closed`), live peer or
//!   dead, as measured with the real transport (`nixl-sys` forces the
//!   close). [`FakeConfig::nixl_flush_close`] models NIXL 1.5.1's own
//!   close mode instead (also measured): a live peer's endpoint is left
//!   open, only a failed one is closed.
//! - **Status mapping**: UCX statuses become NIXL statuses as in NIXL's UCX
//!   backend ([`nixl_status_from_ucs`]); each call records both.
//!
//! # Faults
//!
//! | fault | what the decode side sees |
//! |---|---|
//! | [`crash`](FakeUcx::crash) | next operation on each endpoint: `UCS_ERR_CONNECTION_RESET` (`REMOTE_DISCONNECT`), failed from then on; nobody listens at the address |
//! | [`crash_during_read`](FakeUcx::crash_during_read) | as crash, but the next read on each endpoint ends with `UCS_ERR_IO_ERROR` (`BACKEND`): the transfer on the wire when the peer died |
//! | [`freeze`](FakeUcx::freeze) / [`thaw`](FakeUcx::thaw) | a hang: operations succeed (reads stay in progress) until the keepalive interval has passed since the freeze, then `UCS_ERR_ENDPOINT_TIMEOUT`; never with keepalive `inf` |
//! | [`partition`](FakeUcx::partition) / [`heal`](FakeUcx::heal) | a silent peer, same rule; a heal before detection leaves nothing noticed, after detection the endpoint stays failed |
//! | [`flap`](FakeUcx::flap) | alternating partition and heal, `period` each; detected only if one silent window lasts the keepalive interval |
//! | [`restart`](FakeUcx::restart), [`restart_with_same_id`](FakeUcx::restart_with_same_id) | the old process is gone (as crash); a new one, new or same engine id, listens at the address |
//! | [`inject`](FakeUcx::inject) | the next `count` notifies/reads to the engine end with a given UCX status (e.g. `UCS_ERR_NO_RESOURCE` -> `BACKEND`, `UCS_ERR_BUSY` -> `IN_PROG`); the endpoint is failed only if that status is a disconnect |
//! | [`block_notify`](FakeUcx::block_notify), [`block_notify_for`](FakeUcx::block_notify_for) | notify calls to the engine block their OS thread on a gate the test opens, or for a real-time duration |
//!
//! # What is not simulated, and where the fake departs from UCX
//!
//! - **Frozen peers.** Measured with NIXL 1.5.1 on shared-memory and TCP
//!   transports, a SIGSTOPped prefill was never reported: `genNotif`
//!   returned `SUCCESS` for 60 s, with `UCX_KEEPALIVE_INTERVAL=2s` too (its
//!   kernel still answers TCP, its shared memory is still there). The fake
//!   does the same by default: a frozen peer is never detected by UCX; its
//!   notifies succeed and its reads stay in progress (the service's
//!   read-stall check is what catches one with reads in flight). Set
//!   [`FakeConfig::frozen_peers_detected`] to `true` for an unmeasured
//!   model of a network transport that times it out after the keepalive
//!   interval, as it does a partitioned peer.
//! - **Keepalive timing** is exact: an endpoint fails exactly one interval
//!   after the peer went silent (or after the endpoint was loaded, if
//!   later). Real UCX checks endpoints in rounds (`UCX_KEEPALIVE_NUM_EPS`)
//!   and detection can take up to about two intervals; transport timeouts
//!   (`UCX_UD_TIMEOUT`, TCP keepalive) are not modelled separately. The
//!   fake assumes the worker always progresses (NIXL's progress thread).
//! - A crash is noticed at the next operation on each endpoint, not in the
//!   background: [`FakeUcx::endpoint_failure`] says `None` until then. A
//!   crashed peer that is also partitioned still resets.
//! - One endpoint per remote agent (UCX has one per worker pair and lane);
//!   no memory registration, no descriptors, no data; a read is one call
//!   that returns its final status. Prepped handles do not go stale when
//!   the peer re-registers. The prefill side's lease bookkeeping is not
//!   simulated: tests assert on the recorded heartbeat payloads.
//! - Thread safety: the fake is fully thread-safe (NIXL's default agent is
//!   not; the real transport must create its agent in a locking mode).
//!
//! # Panics
//!
//! Fault and query methods that name an engine or an address nobody ever
//! spawned panic: that is a mistake in the test. Transport and handshake
//! calls never panic; they return the status NIXL would.
#![warn(missing_docs, unreachable_pub)]

mod audit;
mod cluster;
mod gate;
mod record;
mod status;

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

pub use audit::AuditedUcx;
pub use gate::NotifyGate;
pub use record::{FakeCall, FakeOp, Held};
pub use status::nixl_status_from_ucs;

use cluster::{Cluster, Gone, HandleSlot, LoadedAgent, NotifyBlock, ProcessId, Silence};

use crate::driver::engine_ref::EngineRef;
use crate::driver::handle::{Handshake, KeepaliveHandle, Ready};
use crate::error::ClaimRefused;
use crate::registration::{Claim, Incarnation, Registration};
use crate::transport::{
    AgentName, EndpointClose, EngineId, FailureWatch, PeerAddr, ReleaseStep, ReleaseTarget,
    Suspicion, Suspicions, Transfers, Transport, TransportError,
};
use nixl_status::NixlStatus;
use nixl_status::UcsStatus;

/// How the simulated UCX behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FakeConfig {
    /// `UCX_KEEPALIVE_INTERVAL`: how long a peer must be silent before UCX
    /// fails its endpoints with `UCS_ERR_ENDPOINT_TIMEOUT`. `None` is `inf`:
    /// never. Default: 20 s, as UCX.
    pub keepalive_interval: Option<Duration>,
    /// Whether a frozen (SIGSTOPped) peer is detected like a silent one.
    /// Default `false`: what was measured with NIXL 1.5.1 on shared-memory
    /// and TCP transports (never detected: notifies succeed, reads stay in
    /// progress). `true` is an opt-in model of a network transport that
    /// times a frozen peer out after the keepalive interval; it is not
    /// measured.
    pub frozen_peers_detected: bool,
    /// Whether a read ending in `REMOTE_DISCONNECT` drops the agent's remote
    /// metadata, as NIXL 0.6+ does; a later call then gets `NOT_FOUND` and
    /// so does its `invalidateRemoteMD`. Default `false`, as measured with
    /// NIXL 1.5.1 (the caller must release).
    pub drop_metadata_on_disconnect: bool,
    /// Whether to record every call for [`FakeUcx::calls`]. Default `true`;
    /// turn it off for long benchmarks.
    pub record_calls: bool,
    /// Whether a release closes endpoints the way NIXL 1.5.1 does on its
    /// own (UCX's flush mode): an endpoint UCX has not failed (a live peer)
    /// is reported [`EndpointClose::LeftOpen`](crate::EndpointClose), a
    /// failed one closed. Default `false`: every endpoint closed, as
    /// measured with the real transport, whose `nixl-sys` forces the close.
    /// Both are measured behaviour.
    pub nixl_flush_close: bool,
    /// Whether a [`crash`](FakeUcx::crash) fails the crashed process's
    /// endpoints at once and reports each to the failure watches
    /// ([`Transport::watch_failures`]), as UCX's error handler does when a
    /// TCP lane reads the dead peer's FIN inside worker progress (measured
    /// with NIXL 1.5.1 over loopback: `real_detection`). Default `false`:
    /// the endpoint fails only at the next operation on it, the behaviour
    /// of lanes UCX checks only at its keepalive round (shared memory), and
    /// of a decode whose agent nobody progresses.
    pub endpoint_events: bool,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            keepalive_interval: Some(Duration::from_secs(20)),
            frozen_peers_detected: false,
            drop_metadata_on_disconnect: false,
            record_calls: true,
            nixl_flush_close: false,
            endpoint_events: false,
        }
    }
}

impl FakeConfig {
    /// The default configuration with this keepalive interval (`None`: `inf`).
    pub fn with_keepalive(interval: Option<Duration>) -> Self {
        Self {
            keepalive_interval: interval,
            ..Self::default()
        }
    }
}

/// A handshake that did not complete. Nothing was loaded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FakeError {
    /// Nobody listens at the address: the engine there crashed and was not
    /// restarted.
    #[error("no prefill engine listens at {0}")]
    NoListener(PeerAddr),
    /// The engine at the address is frozen or partitioned: its side channel
    /// does not answer.
    #[error("prefill engine {engine} at {addr} does not answer")]
    Unresponsive {
        /// The address.
        addr: PeerAddr,
        /// The engine listening there.
        engine: EngineId,
    },
    /// `loadRemoteMD` refused an agent: `NOT_ALLOWED` while metadata under
    /// that name is still loaded (invalidate it first).
    #[error("loadRemoteMD for {agent} returned {status}")]
    Load {
        /// The agent refused.
        agent: AgentName,
        /// The status `loadRemoteMD` returned.
        status: NixlStatus,
    },
}

/// Why [`FakeUcx::connect`] did not connect. Nothing stays loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FakeConnectError {
    /// The side channel did not answer.
    #[error("handshake: {0}")]
    Fetch(FakeError),
    /// The service refused the claim (nothing was loaded).
    #[error("{0}")]
    Refused(ClaimRefused),
    /// NIXL refused the metadata.
    #[error("load: {0}")]
    Load(FakeError),
    /// NIXL loaded other agent names than the reply claimed: given back.
    #[error("the reply claimed agents {claimed:?}, its metadata loaded {loaded:?}")]
    AgentMismatch {
        /// What the reply said.
        claimed: Vec<AgentName>,
        /// What NIXL loaded.
        loaded: Vec<AgentName>,
    },
    /// The registration was not taken.
    #[error("register: {0}")]
    Register(String),
}

/// What a prefill engine's side channel answers: its engine id, its
/// process's incarnation, its agent names and their metadata. Load it with
/// [`FakeUcx::load_metadata`].
///
/// `engine` and `agents` are what the reply *says*; the metadata blob
/// belongs to one process, and loading it loads that process's agents,
/// whatever the reply said (a test may edit `agents` to stage a reply that
/// names other agents than its metadata, as a misconfigured or hostile
/// prefill would).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeMetadata {
    /// The engine id.
    pub engine: EngineId,
    /// The side-channel address it was fetched from.
    pub addr: PeerAddr,
    /// One agent per rank, in rank order, as the reply names them.
    pub agents: Vec<AgentName>,
    process: ProcessId,
}

impl FakeMetadata {
    /// The incarnation of the process whose metadata this is (one per
    /// start: a restart under a pinned id has a new one).
    pub fn incarnation(&self) -> Incarnation {
        Incarnation(self.process as u64 + 1)
    }

    /// Who the reply says the prefill is: what the runtime hands
    /// [`Handshake::ready_to_load`] before loading anything.
    pub fn claim(&self) -> Claim {
        Claim {
            engine: self.engine.clone(),
            incarnation: Some(self.incarnation()),
            agents: self.agents.clone(),
        }
    }
}

/// A completed handshake: what the decoder runtime registers with the
/// service.
#[derive(Debug)]
pub struct FakeHandshake {
    /// The engine id.
    pub engine: EngineId,
    /// The incarnation of the process loaded.
    pub incarnation: Incarnation,
    /// The side-channel address.
    pub addr: PeerAddr,
    /// The agents NIXL loaded (the metadata's own names), one per rank, in
    /// rank order.
    pub agents: Vec<AgentName>,
    /// The prepped dlist handles, one per rank.
    pub resources: FakeResources,
}

impl From<FakeHandshake> for Registration<FakeResources> {
    /// What the decoder runtime registers with the service after the
    /// handshake.
    fn from(hs: FakeHandshake) -> Self {
        Registration {
            engine: hs.engine,
            incarnation: Some(hs.incarnation),
            address: hs.addr,
            agents: hs.agents,
            resources: hs.resources,
        }
    }
}

/// The prepped dlist handles of one engine, one per rank: the fake's
/// [`Transport::Resources`].
///
/// Dropping it releases nothing: the handles stay counted by
/// [`FakeUcx::held`] and [`FakeUcx::assert_nothing_leaked`] reports them.
/// Cloning it lets a test release the same handles twice (the second
/// release answers `NOT_FOUND`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeResources {
    engine: EngineId,
    handles: Vec<usize>,
}

impl FakeResources {
    /// Resources holding no handle, for `engine`: a registration whose
    /// transport state is empty (tests of the service's own rules).
    pub fn empty(engine: EngineId) -> Self {
        FakeResources {
            engine,
            handles: Vec::new(),
        }
    }

    /// The engine the handles were prepared for.
    pub fn engine(&self) -> &EngineId {
        &self.engine
    }

    /// How many handles (ranks).
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// No handles.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }
}

/// The simulated UCX/NIXL cluster of one decode engine. Cheap to clone: all
/// clones share one cluster. See the [module docs](self).
#[derive(Clone)]
pub struct FakeUcx {
    cluster: Arc<Mutex<Cluster>>,
}

impl Default for FakeUcx {
    fn default() -> Self {
        Self::new(FakeConfig::default())
    }
}

impl fmt::Debug for FakeUcx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cluster = self.lock();
        f.debug_struct("FakeUcx")
            .field("config", &cluster.config)
            .field("engines", &cluster.by_engine.len())
            .field("held", &cluster.held_where(|_| true))
            .finish_non_exhaustive()
    }
}

impl FakeUcx {
    /// An empty cluster.
    pub fn new(config: FakeConfig) -> Self {
        Self {
            cluster: Arc::new(Mutex::new(Cluster::new(config))),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The configuration.
    pub fn config(&self) -> FakeConfig {
        self.lock().config.clone()
    }

    // ---- prefill engines ----

    /// Starts a prefill engine with `ranks` agents at `addr`, with a fresh
    /// engine id (`prefill-0`, `prefill-1`, ... in spawn order). Its agents
    /// are `<engine>-rank<r>`. A process already listening at `addr` is
    /// gone, as in [`crash`](Self::crash).
    ///
    /// # Panics
    /// If `ranks` is 0.
    pub fn spawn_prefill(&self, addr: PeerAddr, ranks: usize) -> EngineId {
        let mut cluster = self.lock();
        let id = cluster.fresh_engine_id();
        cluster.spawn(addr, id, ranks)
    }

    /// Starts a prefill engine with a pinned engine id. Same agent names as
    /// any earlier start with that id. Fault methods address the newest
    /// process with an id.
    ///
    /// # Panics
    /// If `ranks` is 0.
    pub fn spawn_prefill_with_id(
        &self,
        addr: PeerAddr,
        engine: EngineId,
        ranks: usize,
    ) -> EngineId {
        self.lock().spawn(addr, engine, ranks)
    }

    /// Restarts the engine at `addr` under a fresh engine id, with the same
    /// number of ranks: the old process is gone (as in crash), the new one
    /// listens at `addr`. Works after a crash too.
    pub fn restart(&self, addr: &PeerAddr) -> EngineId {
        let mut cluster = self.lock();
        let old = cluster.process_at(addr);
        let ranks = cluster.processes[old].agents.len();
        let id = cluster.fresh_engine_id();
        cluster.spawn(addr.clone(), id, ranks)
    }

    /// Restarts the engine at `addr` under the same engine id (pinned), so
    /// with the same agent names: the decode side must invalidate the old
    /// metadata before it can load the new one.
    pub fn restart_with_same_id(&self, addr: &PeerAddr) -> EngineId {
        let mut cluster = self.lock();
        let old = cluster.process_at(addr);
        let ranks = cluster.processes[old].agents.len();
        let id = cluster.processes[old].engine.clone();
        cluster.spawn(addr.clone(), id, ranks)
    }

    /// A hostile (or misconfigured) prefill at `addr` that answers every
    /// handshake with `victim`'s current reply, word for word: its engine
    /// id, incarnation, agent names and metadata. Loading that metadata
    /// loads the victim's own agents (NIXL accepts identical metadata twice
    /// and keeps one entry). Whatever listened at `addr` is gone.
    pub fn replay_at(&self, addr: PeerAddr, victim: &EngineId) {
        let mut cluster = self.lock();
        let p = cluster.process_of(victim);
        if let Some(&old) = cluster.by_addr.get(&addr) {
            cluster.processes[old]
                .gone
                .get_or_insert(Gone { during_read: false });
        }
        cluster.replays.insert(addr, p);
    }

    /// The engine listening at `addr` now, if any.
    pub fn engine_at(&self, addr: &PeerAddr) -> Option<EngineId> {
        let cluster = self.lock();
        let p = *cluster.by_addr.get(addr)?;
        let process = &cluster.processes[p];
        process.gone.is_none().then(|| process.engine.clone())
    }

    /// The agents of an engine, in rank order.
    pub fn agents_of(&self, engine: &EngineId) -> Vec<AgentName> {
        let cluster = self.lock();
        cluster.processes[cluster.process_of(engine)].agents.clone()
    }

    // ---- faults ----

    fn with_process(&self, engine: &EngineId, f: impl FnOnce(&mut Cluster, ProcessId, Instant)) {
        let now = Instant::now();
        let mut cluster = self.lock();
        let p = cluster.process_of(engine);
        f(&mut cluster, p, now);
    }

    /// The engine's process is killed: the next operation on each endpoint
    /// sees `UCS_ERR_CONNECTION_RESET`, which fails it; nobody listens at
    /// its address until a restart.
    ///
    /// With [`FakeConfig::endpoint_events`], its loaded endpoints fail at
    /// once (`UCS_ERR_CONNECTION_RESET`) and each is reported to the
    /// failure watches.
    pub fn crash(&self, engine: &EngineId) {
        let mut failed = Vec::new();
        self.with_process(engine, |w, p, _| {
            w.processes[p]
                .gone
                .get_or_insert(Gone { during_read: false });
            if w.config.endpoint_events {
                for (agent, loaded) in w.loaded.iter_mut() {
                    if loaded.process == p && loaded.failed.is_none() {
                        loaded.failed = Some(UcsStatus::ERR_CONNECTION_RESET);
                        failed.push(agent.clone());
                    }
                }
            }
        });
        for agent in failed {
            self.report_endpoint_failure(Some(agent), UcsStatus::ERR_CONNECTION_RESET);
        }
    }

    /// Tells the failure watches that an endpoint failed, without failing
    /// anything: a spurious event (`agent: None`: one the transport could
    /// not name). What a watch does with it must cost at most a heartbeat.
    pub fn report_endpoint_failure(&self, agent: Option<AgentName>, status: UcsStatus) {
        let watchers: Vec<_> = self
            .lock()
            .watchers
            .iter()
            .map(|(_, w)| w.clone())
            .collect();
        for w in watchers {
            w.suspect(Suspicion::new(agent.clone(), Some(status)));
        }
    }

    /// As [`crash`](Self::crash), with a READ on the wire: the next read on
    /// each endpoint ends with `UCS_ERR_IO_ERROR` (`BACKEND`, not
    /// `REMOTE_DISCONNECT`, as measured) and fails the endpoint; a notify
    /// still sees the reset.
    pub fn crash_during_read(&self, engine: &EngineId) {
        self.with_process(engine, |w, p, _| {
            w.processes[p].gone = Some(Gone { during_read: true });
        });
    }

    /// The engine hangs (SIGSTOP): no reset; its endpoints fail with
    /// `UCS_ERR_ENDPOINT_TIMEOUT` once the keepalive interval has passed
    /// (never with `inf`, nor with `frozen_peers_detected` off). Its side
    /// channel stops answering. Freezing a frozen engine changes nothing.
    pub fn freeze(&self, engine: &EngineId) {
        self.with_process(engine, |w, p, now| {
            w.processes[p].frozen_since.get_or_insert(now);
        });
    }

    /// The engine runs again (SIGCONT). Endpoints detected before the thaw
    /// stay failed; the others never noticed anything.
    pub fn thaw(&self, engine: &EngineId) {
        self.with_process(engine, |w, p, now| {
            w.settle_timeouts(p, now);
            w.processes[p].frozen_since = None;
        });
    }

    /// The engine becomes silent on the network (alive, no reset): its
    /// endpoints fail with `UCS_ERR_ENDPOINT_TIMEOUT` once the keepalive
    /// interval has passed (never with `inf`). Replaces a flap.
    pub fn partition(&self, engine: &EngineId) {
        self.with_process(engine, |w, p, now| {
            w.settle_timeouts(p, now);
            if !matches!(w.processes[p].silence, Silence::Partition { .. }) {
                w.processes[p].silence = Silence::Partition { since: now };
            }
        });
    }

    /// The network to the engine works again (ends a partition or a flap).
    /// Endpoints detected before the heal stay failed, as in UCX; the others
    /// never noticed anything.
    pub fn heal(&self, engine: &EngineId) {
        self.with_process(engine, |w, p, now| {
            w.settle_timeouts(p, now);
            w.processes[p].silence = Silence::Reachable;
        });
    }

    /// The engine's network flaps from now on: silent for `period`, then
    /// reachable for `period`, and so on, until [`heal`](Self::heal). An
    /// endpoint fails only if one silent window lasts the keepalive interval.
    ///
    /// # Panics
    /// If `period` is zero.
    pub fn flap(&self, engine: &EngineId, period: Duration) {
        assert!(!period.is_zero(), "flap period must not be zero");
        self.with_process(engine, |w, p, now| {
            w.settle_timeouts(p, now);
            w.processes[p].silence = Silence::Flap { start: now, period };
        });
    }

    /// The next `count` notifies or reads to any agent of the engine end
    /// with `status` (after any earlier injection is used up), unless the
    /// endpoint has failed or the process is gone. A disconnect status
    /// (see [`nixl_status_from_ucs`]) fails the endpoint as a real one
    /// would; others are transient.
    pub fn inject(&self, engine: &EngineId, status: UcsStatus, count: usize) {
        if count == 0 {
            return;
        }
        self.with_process(engine, |w, p, _| {
            w.processes[p].injected.push_back((status, count));
        });
    }

    /// From now on every notify to the engine blocks its OS thread until the
    /// returned gate is opened or dropped. The notify then completes with
    /// the status of that moment. Replaces an earlier block (opening its
    /// gate).
    pub fn block_notify(&self, engine: &EngineId) -> NotifyGate {
        let inner = Arc::new(gate::GateInner::default());
        self.set_block(engine, Some(NotifyBlock::Gate(inner.clone())));
        NotifyGate::new(inner)
    }

    /// From now on every notify to the engine first sleeps `duration` on
    /// its OS thread (real time, `std::thread::sleep`): for benchmarks. On a
    /// paused tokio clock prefer [`block_notify`](Self::block_notify).
    pub fn block_notify_for(&self, engine: &EngineId, duration: std::time::Duration) {
        self.set_block(engine, Some(NotifyBlock::Sleep(duration)));
    }

    /// Notifies to the engine no longer block (an installed gate is opened).
    pub fn unblock_notify(&self, engine: &EngineId) {
        self.set_block(engine, None);
    }

    fn set_block(&self, engine: &EngineId, block: Option<NotifyBlock>) {
        let mut cluster = self.lock();
        cluster.process_of(engine);
        let old = match block {
            Some(block) => cluster.blocks.insert(engine.clone(), block),
            None => cluster.blocks.remove(engine),
        };
        if let Some(NotifyBlock::Gate(gate)) = old {
            gate.open();
        }
    }

    // ---- the decoder runtime's side ----

    /// Asks the side channel at `addr` for the engine's id and metadata.
    pub fn fetch_metadata(&self, addr: &PeerAddr) -> Result<FakeMetadata, FakeError> {
        let now = Instant::now();
        let cluster = self.lock();
        if let Some(&victim) = cluster.replays.get(addr) {
            let process = &cluster.processes[victim];
            return Ok(FakeMetadata {
                engine: process.engine.clone(),
                addr: addr.clone(),
                agents: process.agents.clone(),
                process: victim,
            });
        }
        let Some(&p) = cluster.by_addr.get(addr) else {
            return Err(FakeError::NoListener(addr.clone()));
        };
        let process = &cluster.processes[p];
        if process.gone.is_some() {
            return Err(FakeError::NoListener(addr.clone()));
        }
        if cluster.is_silent(p, now) {
            return Err(FakeError::Unresponsive {
                addr: addr.clone(),
                engine: process.engine.clone(),
            });
        }
        Ok(FakeMetadata {
            engine: process.engine.clone(),
            addr: addr.clone(),
            agents: process.agents.clone(),
            process: p,
        })
    }

    /// Loads fetched metadata: `loadRemoteMD` for each agent of the
    /// metadata's process, then `prepXferDlist` per rank. As measured with
    /// NIXL 1.5.1: loading the *identical* metadata of an agent that is
    /// loaded already (the same process's) is accepted and keeps one entry
    /// (so one `invalidateRemoteMD` later removes it for both holders);
    /// another process's metadata under a loaded name is refused with
    /// `NOT_ALLOWED`, and then nothing is loaded. Metadata of a process
    /// that has died since it was fetched loads fine; its endpoints reset
    /// on first use.
    pub fn load_metadata(&self, metadata: &FakeMetadata) -> Result<FakeHandshake, FakeError> {
        let now = Instant::now();
        let mut cluster = self.lock();
        let engine = Some(metadata.engine.clone());
        let call = |op, agent: &AgentName, status| FakeCall {
            at: now,
            op,
            engine: engine.clone(),
            agent: Some(agent.clone()),
            message: Vec::new(),
            ucs: None,
            status,
        };
        let agents = cluster.processes[metadata.process].agents.clone();
        if let Some(agent) = agents.iter().find(|a| {
            cluster
                .loaded
                .get(*a)
                .is_some_and(|l| l.process != metadata.process)
        }) {
            cluster.record(call(
                FakeOp::LoadRemoteMd,
                agent,
                NixlStatus::ERR_NOT_ALLOWED,
            ));
            return Err(FakeError::Load {
                agent: agent.clone(),
                status: NixlStatus::ERR_NOT_ALLOWED,
            });
        }
        for agent in &agents {
            cluster.loaded.entry(agent.clone()).or_insert(LoadedAgent {
                process: metadata.process,
                loaded_at: now,
                failed: None,
            });
            cluster.record(call(FakeOp::LoadRemoteMd, agent, NixlStatus::SUCCESS));
        }
        let mut handles = Vec::with_capacity(agents.len());
        for agent in &agents {
            handles.push(cluster.handles.len());
            cluster.handles.push(HandleSlot {
                process: metadata.process,
                agent: agent.clone(),
                released: false,
            });
            cluster.record(call(FakeOp::PrepXferDlist, agent, NixlStatus::SUCCESS));
        }
        Ok(FakeHandshake {
            engine: metadata.engine.clone(),
            incarnation: metadata.incarnation(),
            addr: metadata.addr.clone(),
            agents,
            resources: FakeResources {
                engine: metadata.engine.clone(),
                handles,
            },
        })
    }

    /// Connects the service to the prefill at `addr` the way a decoder
    /// runtime must, step by step: the reference implementation of the
    /// handshake protocol ([`KeepaliveHandle::handshake`]).
    ///
    /// 1. start the handshake (a marked engine at `addr` waits for it);
    /// 2. ask the side channel who is there ([`fetch_metadata`]);
    /// 3. have the service arbitrate that claim before loading anything:
    ///    the engine already registered comes back as it is; a conflict is
    ///    refused with nothing loaded;
    /// 4. load ([`load_metadata`]); if NIXL loaded other agent names than
    ///    the reply claimed, give everything back, unloading only names
    ///    that are this handshake's ([`crate::ReadyToLoad::claim_agent`]),
    ///    never another engine's;
    /// 5. register.
    ///
    /// [`fetch_metadata`]: Self::fetch_metadata
    /// [`load_metadata`]: Self::load_metadata
    pub async fn connect(
        &self,
        keepalive: &KeepaliveHandle<FakeResources>,
        addr: &PeerAddr,
    ) -> Result<EngineRef, FakeConnectError> {
        let handshake = keepalive.handshake(addr.clone());
        let metadata = self.fetch_metadata(addr).map_err(FakeConnectError::Fetch)?;
        self.connect_with(handshake, metadata).await
    }

    /// [`connect`](Self::connect) from step 3 on, with a handshake
    /// already started and a reply already fetched (which a test may have
    /// edited, as a hostile prefill would send it).
    pub async fn connect_with(
        &self,
        handshake: Handshake<FakeResources>,
        metadata: FakeMetadata,
    ) -> Result<EngineRef, FakeConnectError> {
        let ready = match handshake.ready_to_load(metadata.claim()).await {
            Ok(Ready::Current(engine)) => return Ok(engine),
            Ok(Ready::Load(ready)) => ready,
            Err(refused) => return Err(FakeConnectError::Refused(refused)),
        };
        let loaded = self
            .load_metadata(&metadata)
            .map_err(FakeConnectError::Load)?;
        if loaded.agents != ready.claim().agents {
            let mut ours = ready.claim().agents.clone();
            for agent in &loaded.agents {
                if !ours.contains(agent) && ready.claim_agent(agent.clone()).await.is_ok() {
                    ours.push(agent.clone());
                }
            }
            let _ = self.release(&loaded.engine, &ours, loaded.resources);
            return Err(FakeConnectError::AgentMismatch {
                claimed: ready.claim().agents.clone(),
                loaded: loaded.agents,
            });
        }
        ready
            .register(loaded.resources)
            .await
            .map_err(|e| FakeConnectError::Register(e.to_string()))
    }

    /// A full handshake with the engine at `addr`: [`fetch_metadata`]
    /// then [`load_metadata`].
    ///
    /// [`fetch_metadata`]: Self::fetch_metadata
    /// [`load_metadata`]: Self::load_metadata
    pub fn handshake(&self, addr: &PeerAddr) -> Result<FakeHandshake, FakeError> {
        let metadata = self.fetch_metadata(addr)?;
        self.load_metadata(&metadata)
    }

    /// A READ from every rank of the engine: the status the transfer ends
    /// with. The first error in rank order, else `IN_PROG` if a rank is
    /// still in progress, else `SUCCESS`. `NOT_FOUND` when no agent of the
    /// engine is loaded (or the engine is unknown).
    pub fn read(&self, engine: &EngineId) -> NixlStatus {
        self.transfer(FakeOp::Read, engine)
    }

    /// A WRITE into every rank of the engine (push mode): the status the
    /// transfer ends with, by the rules of [`FakeUcx::read`].
    pub fn write(&self, engine: &EngineId) -> NixlStatus {
        self.transfer(FakeOp::Write, engine)
    }

    /// One transfer with every rank of the engine (see [`FakeUcx::read`]).
    fn transfer(&self, op: FakeOp, engine: &EngineId) -> NixlStatus {
        let agents = {
            let cluster = self.lock();
            match cluster.by_engine.get(engine) {
                Some(&p) => cluster.processes[p].agents.clone(),
                None => Vec::new(),
            }
        };
        if agents.is_empty() {
            return self.transfer_of(op, Some(engine.clone()), None);
        }
        let statuses: Vec<NixlStatus> = agents
            .iter()
            .map(|a| {
                let engine = self.lock().agent_engine.get(a).cloned();
                self.transfer_of(op, engine, Some(a))
            })
            .collect();
        statuses
            .iter()
            .copied()
            .find(|s| !s.is_ok())
            .or_else(|| statuses.iter().copied().find(|s| *s == NixlStatus::IN_PROG))
            .unwrap_or(NixlStatus::SUCCESS)
    }

    /// A READ from one remote agent: the status the transfer ends with
    /// (`IN_PROG`: still in progress now).
    pub fn read_agent(&self, agent: &AgentName) -> NixlStatus {
        let engine = self.lock().agent_engine.get(agent).cloned();
        self.read_agent_of(engine, Some(agent))
    }

    fn read_agent_of(&self, engine: Option<EngineId>, agent: Option<&AgentName>) -> NixlStatus {
        self.transfer_of(FakeOp::Read, engine, agent)
    }

    fn transfer_of(
        &self,
        op: FakeOp,
        engine: Option<EngineId>,
        agent: Option<&AgentName>,
    ) -> NixlStatus {
        let now = Instant::now();
        let mut cluster = self.lock();
        let (ucs, status) = match agent {
            Some(agent) => cluster.endpoint_op(agent, op, now),
            None => (None, NixlStatus::ERR_NOT_FOUND),
        };
        cluster.record(FakeCall {
            at: now,
            op,
            engine,
            agent: agent.cloned(),
            message: Vec::new(),
            ucs,
            status,
        });
        status
    }

    // ---- inspection ----

    /// Whether the endpoint to `agent` has failed, and with which UCX
    /// status: `None` while it has not (or its metadata is not loaded). A
    /// crash shows here only after the next operation on the endpoint.
    pub fn endpoint_failure(&self, agent: &AgentName) -> Option<UcsStatus> {
        self.lock().endpoint_failure(agent, Instant::now())
    }

    /// How many failure watches are running ([`Transport::watch_failures`]).
    pub fn failure_watches(&self) -> usize {
        self.lock().watchers.len()
    }

    /// Whether the agent's remote metadata is loaded.
    pub fn is_loaded(&self, agent: &AgentName) -> bool {
        self.lock().loaded.contains_key(agent)
    }

    /// Every recorded call, in order.
    pub fn calls(&self) -> Vec<FakeCall> {
        self.lock().calls.clone()
    }

    /// Forgets the recorded calls.
    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    /// The text of every notify addressed to an agent of `engine` (any
    /// start with that id), in call order, whatever its status.
    pub fn notifications_to(&self, engine: &EngineId) -> Vec<String> {
        self.lock()
            .calls
            .iter()
            .filter(|c| c.op == FakeOp::Notify && c.engine.as_ref() == Some(engine))
            .map(|c| c.message_str().into_owned())
            .collect()
    }

    /// What the decode side holds, all engines together.
    pub fn held(&self) -> Held {
        self.lock().held_where(|_| true)
    }

    /// What the decode side holds for one engine id (any start with it).
    pub fn held_by(&self, engine: &EngineId) -> Held {
        let cluster = self.lock();
        cluster.held_where(|p| &cluster.processes[p].engine == engine)
    }

    /// Panics, listing what is held, unless every loaded agent was
    /// invalidated and every prepped handle released (resources dropped
    /// without release count as leaked).
    pub fn assert_nothing_leaked(&self) {
        let cluster = self.lock();
        let agents: Vec<&AgentName> = cluster.loaded.keys().collect();
        let handles: Vec<&AgentName> = cluster
            .handles
            .iter()
            .filter(|h| !h.released)
            .map(|h| &h.agent)
            .collect();
        assert!(
            agents.is_empty() && handles.is_empty(),
            "FakeUcx: NIXL state leaked: remote metadata still loaded for {agents:?}; \
             dlist handles not released for {handles:?}"
        );
    }
}

/// Removes a failure watch from the cluster when dropped.
struct FakeWatch {
    cluster: std::sync::Weak<Mutex<Cluster>>,
    id: u64,
}

impl Drop for FakeWatch {
    fn drop(&mut self) {
        if let Some(cluster) = self.cluster.upgrade() {
            let mut w = cluster.lock().unwrap_or_else(|e| e.into_inner());
            w.watchers.retain(|(id, _)| *id != self.id);
        }
    }
}

impl Transport for FakeUcx {
    type Resources = FakeResources;

    fn watch_failures(&self, suspicions: Suspicions) -> Result<FailureWatch, String> {
        let mut cluster = self.lock();
        cluster.next_watcher += 1;
        let id = cluster.next_watcher;
        cluster.watchers.push((id, suspicions));
        Ok(FailureWatch::new(FakeWatch {
            cluster: Arc::downgrade(&self.cluster),
            id,
        }))
    }

    fn notify(&self, agent: &AgentName, message: &[u8]) -> Result<(), TransportError> {
        let (engine, block) = {
            let cluster = self.lock();
            let engine = cluster.agent_engine.get(agent).cloned();
            let block = engine.as_ref().and_then(|e| cluster.blocks.get(e).cloned());
            (engine, block)
        };
        match block {
            Some(NotifyBlock::Gate(gate)) => gate.pass(),
            Some(NotifyBlock::Sleep(duration)) => std::thread::sleep(duration),
            None => {}
        }
        let now = Instant::now();
        let mut cluster = self.lock();
        let (ucs, status) = cluster.endpoint_op(agent, FakeOp::Notify, now);
        cluster.record(FakeCall {
            at: now,
            op: FakeOp::Notify,
            engine,
            agent: Some(agent.clone()),
            message: message.to_vec(),
            ucs,
            status,
        });
        if status.is_ok() {
            Ok(())
        } else {
            Err(TransportError::new("genNotif", status))
        }
    }

    fn release_with(
        &self,
        engine: &EngineId,
        agents: &[AgentName],
        resources: FakeResources,
        transfers: Transfers,
    ) -> Vec<ReleaseStep> {
        let now = Instant::now();
        let mut cluster = self.lock();
        let mut steps = Vec::with_capacity(resources.handles.len() + agents.len());
        for (index, &handle) in resources.handles.iter().enumerate() {
            let slot = &mut cluster.handles[handle];
            let status = if slot.released {
                NixlStatus::ERR_NOT_FOUND
            } else {
                slot.released = true;
                NixlStatus::SUCCESS
            };
            let agent = slot.agent.clone();
            cluster.record(FakeCall {
                at: now,
                op: FakeOp::ReleaseDlist,
                engine: Some(engine.clone()),
                agent: Some(agent),
                message: Vec::new(),
                ucs: None,
                status,
            });
            steps.push(ReleaseStep {
                target: ReleaseTarget::DlistHandle(index),
                status,
            });
        }
        let flush_close = cluster.config.nixl_flush_close;
        for agent in agents {
            let removed = cluster.loaded.remove(agent);
            let status = match removed {
                Some(_) => NixlStatus::SUCCESS,
                None => NixlStatus::ERR_NOT_FOUND,
            };
            let close = removed.map(|loaded| {
                if flush_close && loaded.failed.is_none() {
                    EndpointClose::LeftOpen {
                        closed: 0,
                        left_open: 1,
                    }
                } else {
                    EndpointClose::Closed { endpoints: 1 }
                }
            });
            cluster.record(FakeCall {
                at: now,
                op: FakeOp::InvalidateRemoteMd,
                engine: Some(engine.clone()),
                agent: Some(agent.clone()),
                message: Vec::new(),
                ucs: None,
                status,
            });
            if status.is_ok() && transfers == Transfers::Ended {
                cluster.record(FakeCall {
                    at: now,
                    op: FakeOp::ShutConnections,
                    engine: Some(engine.clone()),
                    agent: Some(agent.clone()),
                    message: Vec::new(),
                    ucs: None,
                    status,
                });
            }
            steps.push(ReleaseStep {
                target: ReleaseTarget::RemoteMetadata(agent.clone()),
                status,
            });
            if let Some(close) = close {
                steps.push(ReleaseStep {
                    target: ReleaseTarget::Endpoints {
                        agent: agent.clone(),
                        close,
                    },
                    status,
                });
            }
        }
        steps
    }
}
