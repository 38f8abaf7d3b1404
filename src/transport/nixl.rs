//! The service's transport over a real NIXL agent.
//!
//! [`NixlTransport`] implements [`Transport`] with one decode-side
//! [`nixl_agent::Agent`] (UCX backend, created by the caller in a locking
//! thread-sync mode, which is the only kind `nixl_agent` makes):
//!
//! - **notify** is `genNotif`, the raw C++ status kept: `REMOTE_DISCONNECT`
//!   stays `REMOTE_DISCONNECT` (the released 1.5.x C API would have said
//!   `BACKEND`);
//! - **release** gives back an engine's [`RemoteDlists`] (one prepped
//!   remote dlist handle per rank, `releasedDlistH`), then invalidates each
//!   agent's remote metadata (`invalidateRemoteMD`), which with `nixl-agent`
//!   closes the agent's UCX endpoints at once, live peer or dead (NIXL
//!   1.5.1 alone keeps a live peer's endpoint, socket and mappings until
//!   the agent is destroyed: see `nixl_agent::endpoints`). Every step is
//!   attempted; `NOT_FOUND` (NIXL had already dropped it) is reported as
//!   such and counts as done. After each successful invalidation a
//!   [`ReleaseTarget::Endpoints`] step says what became of the endpoints
//!   (`nixl_keepalive_release_endpoints_total{outcome}`); after the whole
//!   release, UCX's own count of the agent's endpoints is exported
//!   (`nixl_keepalive_ucx_endpoints`).
//!
//! Every method blocks in FFI. The service only calls them from blocking
//! threads; so must anyone else.
//!
//! # Progress
//!
//! `nixl_agent` agents run without NIXL's progress thread by default: UCX
//! moves only inside NIXL calls, and a dead peer is noticed on the next
//! call that progresses the worker. A decode process should poll its agent
//! (see [`NixlTransport::spawn_progress`]) or create it with a slow polling
//! progress thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nixl_agent::gpu::{GpuReleaseCounts, GpuUnmapMode};
use nixl_agent::{Agent, Connections, DlistHandle, EndpointCloses, NixlError, NixlStatus};

use crate::transport::{
    AgentName, EndpointClose, EngineId, FailureWatch, GpuMappings, ReleaseStep, ReleaseTarget,
    Suspicion, Suspicions, Transfers, Transport, TransportError,
};
use nixl_status::UcsStatus;

/// The prepped remote dlist handles of one engine registration, one per
/// rank, in rank order: the real transport's [`Transport::Resources`].
///
/// Shared between the service (which releases them) and the reader that
/// posts transfers with them: cloning shares the same handles. Once
/// released, [`RemoteDlists::with_handle`] finds nothing, and a second
/// release reports `NOT_FOUND` for every handle without calling NIXL (the
/// handle is gone; calling `releasedDlistH` on it again would be a use
/// after free).
#[derive(Clone)]
pub struct RemoteDlists {
    slot: Arc<Mutex<Option<Vec<DlistHandle>>>>,
    len: usize,
}

impl std::fmt::Debug for RemoteDlists {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteDlists")
            .field("len", &self.len)
            .field("released", &self.is_released())
            .finish()
    }
}

impl RemoteDlists {
    /// Takes ownership of prepped handles (one per rank, in rank order).
    pub fn new(handles: Vec<DlistHandle>) -> Self {
        let len = handles.len();
        RemoteDlists {
            slot: Arc::new(Mutex::new(Some(handles))),
            len,
        }
    }

    /// How many handles (ranks).
    pub fn len(&self) -> usize {
        self.len
    }

    /// No handles at all.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the handles have been released.
    pub fn is_released(&self) -> bool {
        self.lock().is_none()
    }

    /// Runs `f` with rank `rank`'s handle, unless released (`None`). The
    /// lock is held during `f`: keep it short (create a transfer request,
    /// which keeps what it needs of the handle alive by itself).
    pub fn with_handle<T>(&self, rank: usize, f: impl FnOnce(&DlistHandle) -> T) -> Option<T> {
        let guard = self.lock();
        guard.as_ref().and_then(|h| h.get(rank)).map(f)
    }

    fn take(&self) -> Option<Vec<DlistHandle>> {
        self.lock().take()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<DlistHandle>>> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The service's transport over one real NIXL agent. See the module docs.
pub struct NixlTransport {
    agent: Agent,
}

impl std::fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransport")
            .field("agent", &self.agent.name())
            .finish()
    }
}

/// Stops the thread started by [`NixlTransport::spawn_progress`] when
/// dropped, and waits for it.
pub struct ProgressPoller {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for ProgressPoller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl NixlTransport {
    /// A transport over `agent` (the decode engine's agent).
    pub fn new(agent: Agent) -> Self {
        NixlTransport { agent }
    }

    /// The agent, for handshakes and transfers.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The UCP endpoints the agent's UCX workers hold now, from UCX's own
    /// introspection: NIXL's loopback endpoint plus one per loaded remote
    /// agent when releases leave nothing behind. `None` when UCX's VFS is
    /// off (`UCX_VFS_ENABLE=n`).
    pub fn ucx_endpoints(&self) -> Option<nixl_agent::UcxEndpoints> {
        self.agent.ucx_endpoints()
    }

    /// Starts a thread that progresses the agent's UCX worker every
    /// `interval` (by polling notifications, which are dropped: a decode
    /// agent expects none). Needed when the agent has no progress thread
    /// and nothing else calls into it regularly. Stops when the returned
    /// poller drops.
    pub fn spawn_progress(&self, interval: Duration) -> ProgressPoller {
        let stop = Arc::new(AtomicBool::new(false));
        let agent = self.agent.clone();
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("nixl-progress".into())
            .spawn(move || {
                while !flag.load(Ordering::Acquire) {
                    if let Err(e) = agent.get_notifs() {
                        tracing::debug!(error = %e, "progress poll failed");
                    }
                    std::thread::sleep(interval);
                }
            })
            .expect("spawn progress thread");
        ProgressPoller {
            stop,
            thread: Some(thread),
        }
    }
}

fn status_of(result: Result<(), NixlError>) -> NixlStatus {
    match result {
        Ok(()) => NixlStatus::SUCCESS,
        Err(e) => e.status,
    }
}

/// What `nixl-agent` saw of one invalidation's endpoint closes, in the
/// transport's terms: the one reading, for this transport and for
/// bindings that invalidate through an agent of their own (the Python
/// package).
impl From<EndpointCloses> for EndpointClose {
    fn from(closes: EndpointCloses) -> Self {
        if !closes.observed {
            EndpointClose::NotObserved
        } else if closes.left_open > 0 {
            EndpointClose::LeftOpen {
                closed: closes.closed(),
                left_open: closes.left_open,
            }
        } else if closes.closed() > 0 {
            EndpointClose::Closed {
                endpoints: closes.closed(),
            }
        } else {
            EndpointClose::NoneClosed
        }
    }
}

impl Transport for NixlTransport {
    type Resources = RemoteDlists;

    fn notify(&self, agent: &AgentName, message: &[u8]) -> Result<(), TransportError> {
        match self.agent.gen_notif_status(agent.as_str(), message) {
            Ok(_) => Ok(()),
            Err(e) => Err(TransportError::new("genNotif", e.status)),
        }
    }

    /// UCX's endpoint failures of this agent, from `nixl_agent::failures`:
    /// named by the remote agent for endpoints this agent's loads created,
    /// unnamed for any other. UCX runs its error handlers only inside
    /// worker progress: an agent with neither a progress thread nor a
    /// poller ([`NixlTransport::spawn_progress`]) learns nothing until its
    /// next call.
    fn watch_failures(&self, suspicions: Suspicions) -> Result<FailureWatch, String> {
        watch_endpoint_failures(self.agent.name(), suspicions)
    }

    /// The process's GPU-mapping ledger (`nixl_agent::gpu`), on or off.
    fn gpu_mappings(&self, on: bool) -> GpuMappings {
        gpu_mappings(on)
    }

    /// With [`Transfers::Ended`] the agents' TCP connections are shut down
    /// after their invalidation ([`Connections::Shut`]), so a released live
    /// peer's descriptors go at once instead of at its next UCX keepalive
    /// round; otherwise they are left to UCX ([`Connections::Keep`]).
    fn release_with(
        &self,
        engine: &EngineId,
        agents: &[AgentName],
        resources: RemoteDlists,
        transfers: Transfers,
    ) -> Vec<ReleaseStep> {
        let connections = Connections::from(transfers);
        let mut steps = Vec::with_capacity(resources.len() + agents.len());
        match resources.take() {
            Some(handles) => {
                for (index, handle) in handles.into_iter().enumerate() {
                    let status = status_of(handle.release());
                    steps.push(ReleaseStep {
                        target: ReleaseTarget::DlistHandle(index),
                        status,
                    });
                }
            }
            None => {
                for index in 0..resources.len() {
                    steps.push(ReleaseStep {
                        target: ReleaseTarget::DlistHandle(index),
                        status: NixlStatus::ERR_NOT_FOUND,
                    });
                }
            }
        }
        for agent in agents {
            match self
                .agent
                .invalidate_remote_metadata_with(agent.as_str(), connections)
            {
                Ok(closes) => {
                    if let Some(gpu) = &closes.gpu {
                        record_release_gpu(agent.as_str(), gpu);
                    }
                    let close = EndpointClose::from(closes);
                    record_release_endpoints(&close);
                    if let EndpointClose::LeftOpen { left_open, .. } = close {
                        tracing::warn!(%engine, %agent, left_open, "UCX endpoints of a released agent left open: they keep their sockets and mappings until this agent is destroyed");
                    }
                    steps.push(ReleaseStep {
                        target: ReleaseTarget::RemoteMetadata(agent.clone()),
                        status: NixlStatus::SUCCESS,
                    });
                    steps.push(ReleaseStep {
                        target: ReleaseTarget::Endpoints {
                            agent: agent.clone(),
                            close,
                        },
                        status: NixlStatus::SUCCESS,
                    });
                }
                Err(e) => steps.push(ReleaseStep {
                    target: ReleaseTarget::RemoteMetadata(agent.clone()),
                    status: e.status,
                }),
            }
        }
        let open = self.agent.ucx_endpoints().map(|u| u.endpoints.len());
        if let Some(open) = open {
            record_ucx_endpoints(open);
        }
        tracing::debug!(%engine, ?steps, ucx_endpoints = ?open, transfers = transfers.as_str(), "NIXL state released");
        steps
    }
}

/// UCX's endpoint failures of the local agent named `local` (this
/// process's, made through `nixl_agent` or another binding), told to
/// `suspicions` with the remote agent when its load named it: what
/// [`Transport::watch_failures`] is for any transport over a NIXL agent.
pub fn watch_endpoint_failures(
    local: &str,
    suspicions: Suspicions,
) -> Result<FailureWatch, String> {
    let watch = nixl_agent::failures::watch(local, move |f| {
        let status = i8::try_from(f.ucs_status).ok().map(UcsStatus::from_raw);
        let agent = f.remote_agent.map(AgentName::new);
        suspicions.suspect(Suspicion::new(agent, status));
    })?;
    Ok(FailureWatch::new(watch))
}

// The transport's own metrics: recorded here, where the endpoints are
// seen, so the transport imports nothing of the service's telemetry (which
// records the core's counts: a transport that imported it would close a
// loop core -> transport -> telemetry -> core).

/// UCX endpoints of released agents, by `outcome`: `closed` (destroyed at
/// once), `left_open` (kept by UCX, with their sockets and mappings, until
/// the decode's agent is destroyed), `not_observed` (one per agent whose
/// endpoint closes the transport cannot see: NIXL's own close mode).
const RELEASE_ENDPOINTS: &str = "nixl_keepalive_release_endpoints_total";
/// UCP endpoints the decode agent's UCX workers hold, from UCX's own
/// introspection (its VFS tree), read after each release: NIXL's loopback
/// endpoint plus one per loaded remote agent when nothing is left behind.
const UCX_ENDPOINTS: &str = "nixl_keepalive_ucx_endpoints";
/// GPU mappings of released agents (UCX's CUDA IPC cache, see
/// `nixl_agent::gpu`), by `outcome`: `unmapped` (UCX removed and closed
/// it), `deferred` (in use: closed at its last transfer's end),
/// `kept_shared` (another agent uses it), `kept_unknown` (a load made
/// without nixl-keepalive uses it), `raced` (mapped again meanwhile),
/// `failed` (the driver refused the close).
const RELEASE_GPU_MAPPINGS: &str = "nixl_keepalive_release_gpu_mappings_total";
/// Bytes of GPU mappings the releases unmapped.
const RELEASE_GPU_BYTES: &str = "nixl_keepalive_release_gpu_unmapped_bytes_total";
/// GPU mappings UCX's cache holds now that the ledger saw opened, and
/// their bytes (read after each release).
const GPU_MAPPINGS: &str = "nixl_keepalive_gpu_mappings";
const GPU_MAPPED_BYTES: &str = "nixl_keepalive_gpu_mapped_bytes";

/// What one agent's release did to the GPU mappings UCX cached for it:
/// metrics, and a log line (a warning for failures and for mappings kept
/// because a load this process made without nixl-keepalive uses them).
/// Every NIXL transport's release calls it (the Python package's too).
pub fn record_release_gpu(agent: &str, gpu: &GpuReleaseCounts) {
    let count = |outcome: &'static str, n: u32| {
        if n > 0 {
            metrics::counter!(RELEASE_GPU_MAPPINGS, "outcome" => outcome).increment(u64::from(n));
        }
    };
    count("unmapped", gpu.unmapped);
    count("deferred", gpu.deferred);
    count("kept_shared", gpu.kept_shared);
    count("kept_unknown", gpu.kept_unknown);
    count("raced", gpu.raced);
    count("failed", gpu.failures);
    if gpu.bytes > 0 {
        metrics::counter!(RELEASE_GPU_BYTES).increment(gpu.bytes);
    }
    let now = nixl_agent::gpu::counts();
    metrics::gauge!(GPU_MAPPINGS).set(now.regions as f64);
    metrics::gauge!(GPU_MAPPED_BYTES).set(now.bytes as f64);
    if gpu.failures > 0 {
        tracing::warn!(%agent, failed = gpu.failures, unmapped = gpu.unmapped, "the CUDA driver refused to close GPU mappings of a released agent (UCX forgot them all the same)");
    }
    if gpu.kept_unknown > 0 {
        tracing::warn!(%agent, kept = gpu.kept_unknown, "GPU mappings of a released agent kept: a load made without nixl-keepalive uses them (route loads through nixl_keepalive.load_remote_agent)");
    }
    if gpu.unmapped > 0 || gpu.deferred > 0 {
        tracing::info!(%agent, unmapped = gpu.unmapped, bytes = gpu.bytes, deferred = gpu.deferred, kept_shared = gpu.kept_shared, "GPU mappings of a released agent given back");
    }
}

/// The NIXL transports' [`crate::transport::GpuMappings`]: turns the
/// process's ledger on or off (the `NIXL_KEEPALIVE_GPU_UNMAP` knob) and
/// says what it does here.
pub fn gpu_mappings(on: bool) -> GpuMappings {
    nixl_agent::gpu::set_enabled(on);
    match nixl_agent::gpu::mode() {
        GpuUnmapMode::Unmapping => GpuMappings::Unmapping,
        GpuUnmapMode::Off => GpuMappings::Off,
        GpuUnmapMode::NoCudaTransport => GpuMappings::NoCudaTransport,
        GpuUnmapMode::Pending => GpuMappings::Unavailable(
            "no UCX backend in this process yet (the ledger is on; checked at the first release)"
                .into(),
        ),
        GpuUnmapMode::Unavailable(why) => GpuMappings::Unavailable(why),
    }
}
/// What one agent's invalidation did to its endpoints.
fn record_release_endpoints(close: &EndpointClose) {
    let count = |outcome: &'static str, n: u32| {
        if n > 0 {
            metrics::counter!(RELEASE_ENDPOINTS, "outcome" => outcome).increment(u64::from(n));
        }
    };
    match *close {
        EndpointClose::Closed { endpoints } => count("closed", endpoints),
        EndpointClose::LeftOpen { closed, left_open } => {
            count("closed", closed);
            count("left_open", left_open);
        }
        EndpointClose::NoneClosed => {}
        EndpointClose::NotObserved => count("not_observed", 1),
    }
}

fn record_ucx_endpoints(open: usize) {
    metrics::gauge!(UCX_ENDPOINTS).set(open as f64);
}

/// What a release may do to a peer's TCP connections, from what the
/// service knows of its transfers: cut them only when every transfer
/// ended here ([`Transfers::Ended`]); a transfer given up may still be
/// running at the peer, and a connection shut under it made UCX abort the
/// peer (see [`Connections`]). Every NIXL transport's release reads it
/// so.
impl From<Transfers> for Connections {
    fn from(transfers: Transfers) -> Connections {
        match transfers {
            Transfers::Ended => Connections::Shut,
            _ => Connections::Keep,
        }
    }
}
