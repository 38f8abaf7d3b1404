//! The boundary between the service and NIXL.
//!
//! Everything the service asks of NIXL goes through [`Transport`]: send a
//! notification to an agent, and give back what was loaded and prepared for
//! an engine. Both calls are blocking FFI in the real transport, so the
//! service only ever calls them from blocking threads, one call per thread,
//! never from a tokio worker: a hung call to one engine holds one thread and
//! nothing else.
//!
//! Here: the trait and what crosses it (`mod.rs`), resolving an address
//! (`resolve.rs`), and the NIXL transport itself (`nixl`, feature `nixl`).
//! The names a peer is known by are the crate's `names.rs`, re-exported
//! here.

#[cfg(feature = "nixl")]
pub mod nixl;
mod resolve;

use nixl_status::NixlStatus;

// The names live outside the transport: the core keys its tables by them
// and names nothing of the transport's calls to get them.
pub use crate::names::{AgentName, EngineId, PeerAddr, ResolveError};

/// A NIXL call that did not succeed, with the raw status it returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{operation} returned {status}")]
#[non_exhaustive]
pub struct TransportError {
    /// What was called (`genNotif`, `invalidateRemoteMD`, ...).
    pub operation: &'static str,
    /// The raw status NIXL returned, never collapsed.
    pub status: NixlStatus,
}

impl TransportError {
    /// An error from `operation` with `status`.
    pub fn new(operation: &'static str, status: NixlStatus) -> Self {
        Self { operation, status }
    }
}

/// What the service knows, when it releases an engine, of the transfers
/// that ran with it: whether the peer may still be sending to this
/// process. It decides whether the release may cut the engine's
/// connections ([`Transport::release_with`]).
///
/// A read given up at a frozen prefill is still on the prefill's side: when
/// the prefill resumes, its UCX sends the data. Measured with NIXL 1.5.1
/// over TCP: shutting the connection down under that send made UCX in the
/// prefill abort the whole process (`Fatal: unexpected error: Endpoint
/// timeout`, `cli/tests/real_buffer.rs`). A release must never harm a
/// live peer, so only an engine whose every transfer ended here with
/// `SUCCESS` has its connections cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transfers {
    /// Every transfer of the registration ended on this side with
    /// `SUCCESS` (or none ran): nothing of them is still on its way.
    Ended,
    /// A transfer was given up, or ended with an error status: the peer
    /// may still be sending for it.
    MayBeRunning,
}

impl Transfers {
    /// `ended` or `may_be_running`, for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Transfers::Ended => "ended",
            Transfers::MayBeRunning => "may_be_running",
        }
    }
}

/// One step of a release and what NIXL said to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReleaseStep {
    /// What was released.
    pub target: ReleaseTarget,
    /// The raw status of the call. `SUCCESS` and `NOT_FOUND` (NIXL had
    /// already dropped it) both count as released.
    pub status: NixlStatus,
}

impl ReleaseStep {
    /// UCX endpoints this step left open (see [`EndpointClose::LeftOpen`]):
    /// they keep their sockets and mappings until the decode's agent is
    /// destroyed. 0 for every other step.
    pub fn endpoints_left_open(&self) -> u32 {
        match &self.target {
            ReleaseTarget::Endpoints {
                close: EndpointClose::LeftOpen { left_open, .. },
                ..
            } => *left_open,
            _ => 0,
        }
    }
}

/// What one release step gave back.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReleaseTarget {
    /// A prepped descriptor-list handle (`releasedDlistH`), by its index in
    /// the engine's resources.
    DlistHandle(usize),
    /// An agent's loaded remote metadata (`invalidateRemoteMD`).
    RemoteMetadata(AgentName),
    /// The UCX endpoints to an agent, which its `invalidateRemoteMD`
    /// closes: reported right after that agent's
    /// [`ReleaseTarget::RemoteMetadata`] step when the invalidation
    /// succeeded, with the same status. What happened to them is in
    /// `close`; an endpoint left open is not a failed step (NIXL said
    /// SUCCESS) but is counted in
    /// `nixl_keepalive_release_endpoints_total{outcome="left_open"}`.
    Endpoints {
        /// The remote agent.
        agent: AgentName,
        /// What the invalidation did to its endpoints.
        close: EndpointClose,
    },
}

/// What an agent's invalidation did to its UCX endpoints (one per UCX
/// worker of the decode's agent).
///
/// Measured with NIXL 1.5.1 (loopback): NIXL closes a live peer's endpoint
/// in UCX's flush mode, which keeps it, its TCP socket and its
/// shared-memory mappings until the decode's agent is destroyed; only a
/// peer UCX had already failed (killed) was closed for real. `nixl-sys`
/// forces the close (see `nixl_agent::endpoints`), so both are
/// [`EndpointClose::Closed`]. The TCP connection UCX shares between both
/// directions then closes on the prefill's side, at its next UCX
/// keepalive round (`UCX_KEEPALIVE_INTERVAL` of the prefill, 20 s by
/// default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EndpointClose {
    /// Every endpoint closed at once: destroyed with its transports.
    Closed {
        /// How many.
        endpoints: u32,
    },
    /// Some endpoints were closed in UCX's flush mode and stay open, with
    /// their sockets and mappings, until the decode's agent is destroyed.
    LeftOpen {
        /// Endpoints closed for real.
        closed: u32,
        /// Endpoints left open.
        left_open: u32,
    },
    /// No endpoint was closed: NIXL held no connection to the agent any
    /// more, or a handle made from it (a transfer request, a dlist) still
    /// holds it and it closes when that goes.
    NoneClosed,
    /// The transport cannot see endpoint closes (the process runs NIXL's
    /// own close mode, or the transport does not observe them).
    NotObserved,
}

impl EndpointClose {
    /// A short name, used as the `outcome` metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            EndpointClose::Closed { .. } => "closed",
            EndpointClose::LeftOpen { .. } => "left_open",
            EndpointClose::NoneClosed => "none_closed",
            EndpointClose::NotObserved => "not_observed",
        }
    }
}

/// A peer whose connection the transport saw fail between heartbeats: a
/// suspicion, never a verdict. The service answers it with a heartbeat to
/// that engine at once (under its rate cap), and only that heartbeat's
/// `REMOTE_DISCONNECT` marks it, by the usual rules: a false alarm costs
/// one heartbeat.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Suspicion {
    /// The remote agent whose connection failed; `None` when the
    /// transport could not tell whose it was (every live engine is then
    /// checked).
    pub agent: Option<AgentName>,
    /// UCX's status for the failure (`UCS_ERR_CONNECTION_RESET`, ...),
    /// raw, when the transport has one.
    pub ucs_status: Option<nixl_status::UcsStatus>,
}

impl Suspicion {
    /// A suspicion of `agent` (`None`: of whoever it was).
    pub fn new(agent: Option<AgentName>, ucs_status: Option<nixl_status::UcsStatus>) -> Self {
        Suspicion { agent, ucs_status }
    }
}

/// Where a transport tells the service of [`Suspicion`]s: cheap to clone,
/// callable from any thread, never blocks. Once the service has stopped,
/// what is told is dropped.
#[derive(Clone)]
pub struct Suspicions(std::sync::Arc<dyn Fn(Suspicion) + Send + Sync>);

impl std::fmt::Debug for Suspicions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Suspicions")
    }
}

impl Suspicions {
    /// Suspicions handed to `tell` (the service's own wiring; tests).
    pub fn new(tell: impl Fn(Suspicion) + Send + Sync + 'static) -> Self {
        Suspicions(std::sync::Arc::new(tell))
    }

    /// Tells the service.
    pub fn suspect(&self, suspicion: Suspicion) {
        (self.0)(suspicion)
    }
}

/// Keeps a transport's failure watch running ([`Transport::watch_failures`])
/// until dropped.
#[must_use = "the watch stops when this is dropped"]
pub struct FailureWatch(#[allow(dead_code)] Box<dyn Send + Sync>);

impl FailureWatch {
    /// Holds `guard`, which stops the watch when dropped.
    pub fn new(guard: impl Send + Sync + 'static) -> Self {
        FailureWatch(Box::new(guard))
    }
}

impl std::fmt::Debug for FailureWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FailureWatch")
    }
}

/// The service's view of NIXL.
///
/// Implementations must be callable from several threads at once (the real
/// one creates its agent with a thread-safe sync mode). Every method may
/// block; the service calls them only from blocking threads.
pub trait Transport: Send + Sync + 'static {
    /// What a decoder runtime handed over at registration and what must be
    /// freed at release: the prepped dlist handles of the engine's ranks and
    /// anything else the transport tracks per engine. Opaque to the service.
    type Resources: Send + 'static;

    /// Sends one notification (`genNotif`) to one remote agent.
    ///
    /// Fire-and-forget as in NIXL: `Ok` means it was queued, not delivered.
    /// `Err` carries the raw status; `REMOTE_DISCONNECT` means UCX has
    /// already failed the endpoint.
    fn notify(&self, agent: &AgentName, message: &[u8]) -> Result<(), TransportError>;

    /// Gives back everything held for one engine: releases each prepped
    /// dlist handle in `resources`, then invalidates the remote metadata of
    /// each agent in `agents`, closing its UCX endpoints. Every step is
    /// attempted even when an earlier one fails; the report lists each step
    /// with its raw status, and after each successful invalidation what
    /// became of the agent's endpoints ([`ReleaseTarget::Endpoints`]).
    ///
    /// `transfers` is what the service knows of the engine's transfers:
    /// with [`Transfers::Ended`] a transport may cut the engine's
    /// connections at once (the NIXL transport shuts down the TCP
    /// connections UCX keeps for a released peer until the peer's
    /// keepalive round); with [`Transfers::MayBeRunning`] it must leave
    /// them to UCX. The service calls this one, so it is the method every
    /// transport writes; one that cuts nothing ignores `transfers`.
    fn release_with(
        &self,
        engine: &EngineId,
        agents: &[AgentName],
        resources: Self::Resources,
        transfers: Transfers,
    ) -> Vec<ReleaseStep>;

    /// [`Transport::release_with`] knowing nothing of the transfers
    /// ([`Transfers::MayBeRunning`]: the connections are left to UCX), for
    /// a caller outside the service that releases by hand.
    fn release(
        &self,
        engine: &EngineId,
        agents: &[AgentName],
        resources: Self::Resources,
    ) -> Vec<ReleaseStep> {
        self.release_with(engine, agents, resources, Transfers::MayBeRunning)
    }

    /// Whether [`Transport::release_with`] ends every transfer still running to
    /// the engine (it closes the engine's endpoints, so no byte of a
    /// transfer given up before can land after it returns). The service
    /// then tells the runtime that the destination buffers of the engine's
    /// given-up reads may be reused ([`crate::Destination::Reusable`]);
    /// otherwise they must be retired.
    ///
    /// `false` unless the implementation has proved it on the real thing:
    /// with NIXL 1.5.1 over TCP, a READ given up with `releaseXferReq`
    /// still wrote its destination when the prefill resumed, after
    /// `invalidateRemoteMD` had returned SUCCESS
    /// (`cli/tests/real_buffer.rs`).
    fn release_ends_transfers(&self) -> bool {
        false
    }

    /// Starts telling `suspicions` of peers whose connection fails, as
    /// soon as the transport learns of it (the NIXL transport: the moment
    /// UCX fails one of the agent's endpoints, milliseconds after a peer
    /// process dies), until the returned watch drops. The service calls it
    /// once, at start-up, unless `NIXL_KEEPALIVE_ENDPOINT_EVENTS=off`.
    /// `Err` with the reason when the transport cannot: heartbeats alone
    /// find dead peers then. The default cannot.
    fn watch_failures(&self, suspicions: Suspicions) -> Result<FailureWatch, String> {
        let _ = suspicions;
        Err("this transport reports no endpoint failures".into())
    }

    /// Turns the giving back of released engines' GPU mappings on or off
    /// (`NIXL_KEEPALIVE_GPU_UNMAP`; the NIXL transports: the mappings
    /// UCX's CUDA IPC cache keeps, see `nixl_agent::gpu`) and says what it
    /// does in this process. The service calls it once, at start-up. The
    /// default maps no GPU memory.
    fn gpu_mappings(&self, on: bool) -> GpuMappings {
        let _ = on;
        GpuMappings::NotApplicable
    }
}

/// Whether a release gives the engine's GPU mappings back: what
/// [`Transport::gpu_mappings`] found at start-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuMappings {
    /// Yes, UCX's CUDA IPC cache included: each release gives back the
    /// mappings no other engine uses, once no transfer holds them.
    Unmapping,
    /// No GPU mapping is made in this process (UCX's CUDA transport is not
    /// loaded): nothing to give back.
    NoCudaTransport,
    /// Turned off (`NIXL_KEEPALIVE_GPU_UNMAP=off`).
    Off,
    /// Wanted, not possible here; why.
    Unavailable(String),
    /// This transport maps no GPU memory.
    NotApplicable,
}

impl GpuMappings {
    /// Whether a dead engine's GPU memory comes back at its release (or
    /// nothing is mapped to keep it): UCX_CUDA_IPC_CACHE=y costs nothing
    /// then.
    pub fn memory_comes_back(&self) -> bool {
        matches!(self, GpuMappings::Unmapping | GpuMappings::NoCudaTransport)
    }
}

impl std::fmt::Display for GpuMappings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuMappings::Unmapping => write!(f, "GPU mappings: unmapped at each release (UCX's cuda_ipc cache and the CUDA driver calls are bound)"),
            GpuMappings::NoCudaTransport => write!(f, "GPU mappings: none (UCX's CUDA transport is not loaded in this process)"),
            GpuMappings::Off => write!(f, "GPU mappings: left to UCX (NIXL_KEEPALIVE_GPU_UNMAP=off)"),
            GpuMappings::Unavailable(why) => write!(f, "GPU mappings: left to UCX, unmapping unavailable: {why}"),
            GpuMappings::NotApplicable => write!(f, "GPU mappings: none (this transport maps no GPU memory)"),
        }
    }
}
