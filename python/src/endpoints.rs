//! Releases through the caller's agent close a live prefill's UCX
//! endpoints, as the Rust transport's do.
//!
//! NIXL 1.5.1's `invalidateRemoteMD` (NIXL's Python `remove_remote_agent`)
//! closes a remote agent's endpoint in UCX's flush mode, which keeps a live
//! peer's endpoint and its TCP connection until the decode's agent dies:
//! one connection per rank on each side, per release. `nixl-sys` has an
//! interposer that NIXL's UCX plugin binds its `ucp_ep_close_nbx` to when
//! it is loaded first (see `nixl_agent::endpoints`); this module installs it
//! when the package is imported ([`install`], from the module's init), and
//! the transport calls `remove_remote_agent` inside its scope
//! ([`Closer::remove_remote_agent`]), on the service's blocking thread,
//! with the GIL held for that one call.
//!
//! The import-order rule: NIXL loads its UCX plugin when an agent first
//! creates a UCX backend (`nixl_agent(...)` does, importing `nixl_cu12`
//! does not), so `import nixl_keepalive` must come before the first
//! `nixl_agent` of the process. Too late, the mode is `unavailable` (with
//! the reason), the releases say `not_observed`, and `Keepalive(agent)`
//! warns. Measured in this package's Python tests: the wheel's plugin
//! (`.nixl_cu12.mesonpy.libs/plugins/libplugin_UCX.so`, loaded by NIXL with
//! `RTLD_LOCAL`, no `RTLD_DEEPBIND`) binds the interposer when the package
//! is imported first, and does not when an agent existed before, or with
//! `NIXL_UCX_DEEPBIND=1`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use nixl_agent::{
    BadEpCloseSetting, Connections, EndpointCloseMode, EndpointCloser, EndpointCloses,
};
use nixl_keepalive::{AgentName, EndpointClose, NixlStatus};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::status::{classify, Classified};

/// The process's closer, installed at import.
static CLOSER: OnceLock<Result<EndpointCloser, BadEpCloseSetting>> = OnceLock::new();

/// Installs the interposer (once per process), as `NIXL_SYS_EP_CLOSE`
/// says. Called from the module's init: before any `nixl_agent` made
/// after `import nixl_keepalive` loads NIXL's UCX plugin.
pub(crate) fn install() -> Result<EndpointCloser, BadEpCloseSetting> {
    CLOSER.get_or_init(EndpointCloser::install).clone()
}

/// The mode, in words for Python: `(mode, reason)`.
fn mode_words(mode: &Result<EndpointCloser, BadEpCloseSetting>) -> (&'static str, Option<String>) {
    match mode {
        Err(bad) => ("unavailable", Some(bad.to_string())),
        Ok(closer) => match closer.mode() {
            EndpointCloseMode::Force => ("force", None),
            EndpointCloseMode::Nixl => (
                "nixl",
                Some(format!(
                    "{}=nixl: NIXL's own close mode, which keeps a live peer's endpoints",
                    nixl_agent::endpoints::EP_CLOSE_ENV
                )),
            ),
            EndpointCloseMode::Unavailable(why) if closer.installed_too_late() => (
                "unavailable",
                Some(format!(
                    "{why}; import nixl_keepalive before the process makes its first nixl_agent"
                )),
            ),
            EndpointCloseMode::Unavailable(why) => ("unavailable", Some(why)),
            EndpointCloseMode::Pending => (
                "pending",
                Some("no NIXL agent has created a UCX backend yet".into()),
            ),
        },
    }
}

/// How this process closes the UCX endpoints of a released agent:
/// `{"mode": "force" | "nixl" | "unavailable" | "pending", "reason": str |
/// None}`. `force`: every release closes a live prefill's endpoints (and
/// their TCP connections) at once. `nixl` (`NIXL_SYS_EP_CLOSE=nixl`) and
/// `unavailable` (the package was imported after the first `nixl_agent`
/// was made, or NIXL loads its UCX plugin with `NIXL_UCX_DEEPBIND`): NIXL
/// 1.5.1's own close, which keeps one connection per rank of each
/// released live prefill until the agent is destroyed. `pending`: no agent
/// has created a UCX backend yet.
#[pyfunction]
pub(crate) fn endpoint_close_mode(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let (mode, reason) = mode_words(CLOSER.get_or_init(EndpointCloser::install));
    let d = PyDict::new(py);
    d.set_item("mode", mode)?;
    d.set_item("reason", reason)?;
    Ok(d)
}

/// What releases do with the GPU mappings UCX's CUDA IPC cache keeps in
/// this process (`nixl_agent::gpu`): `{"mode": "unmapping" | "off" |
/// "none" | "pending" | "unavailable", "reason": str | None, "counts":
/// {...}}`. `unmapping`: each release gives back the mappings of the
/// released engine's memory that no other engine uses, once no transfer
/// holds them. `none`: UCX's CUDA transport is not loaded (no GPU mapping
/// here). `off`: `NIXL_KEEPALIVE_GPU_UNMAP=off`. `pending`: no UCX backend
/// yet. `unavailable`: the CUDA driver or UCX binds its calls elsewhere
/// (loaded before this package), the reason names them: set
/// `UCX_CUDA_IPC_CACHE=n` there. `counts`: the ledger's process-wide
/// counts (maps, hits, opens, regions and bytes held now, unmapped).
#[pyfunction]
pub(crate) fn gpu_mappings(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    use nixl_agent::gpu::GpuUnmapMode;
    let _ = CLOSER.get_or_init(EndpointCloser::install);
    let (mode, reason) = match nixl_agent::gpu::mode() {
        GpuUnmapMode::Unmapping => ("unmapping", None),
        GpuUnmapMode::Off => ("off", Some("NIXL_KEEPALIVE_GPU_UNMAP=off".to_string())),
        GpuUnmapMode::NoCudaTransport => (
            "none",
            Some("UCX's CUDA transport (libuct_cuda) is not loaded in this process".to_string()),
        ),
        GpuUnmapMode::Pending => (
            "pending",
            Some("no NIXL agent has created a UCX backend yet".to_string()),
        ),
        GpuUnmapMode::Unavailable(why) => ("unavailable", Some(why)),
    };
    let c = nixl_agent::gpu::counts();
    let counts = PyDict::new(py);
    for (k, v) in [
        ("maps", c.maps),
        ("hits", c.hits),
        ("opens", c.opens),
        ("open_failures", c.open_failures),
        ("closes", c.closes),
        ("close_failures", c.close_failures),
        ("unmapped", c.unmapped),
        ("unmapped_bytes", c.unmapped_bytes),
        ("regions", c.regions),
        ("bytes", c.bytes),
        ("held", c.held),
        ("unknown_keys", c.unknown_keys),
    ] {
        counts.set_item(k, v)?;
    }
    let d = PyDict::new(py);
    d.set_item("mode", mode)?;
    d.set_item("reason", reason)?;
    d.set_item("counts", counts)?;
    Ok(d)
}

/// A bad `NIXL_SYS_EP_CLOSE`, for `Keepalive(...)` to refuse.
pub(crate) fn bad_setting() -> Option<BadEpCloseSetting> {
    CLOSER
        .get_or_init(EndpointCloser::install)
        .as_ref()
        .err()
        .cloned()
}

/// What one `remove_remote_agent` did: NIXL's raw status (or a non-NIXL
/// exception) and, when it succeeded, the endpoints.
pub(crate) struct Removal {
    pub(crate) status: Result<NixlStatus, PyErr>,
    pub(crate) close: Option<EndpointClose>,
    /// TCP connections recorded at the agent's loads and shut down.
    pub(crate) connections_shut: u32,
}

/// Calls `agent.remove_remote_agent(name)` (the GIL held) with this
/// thread's flush-mode endpoint closes forced, then does what
/// `connections` says to the TCP connections recorded at the agent's
/// loads through [`load_remote_agent_py`] ([`Connections::Shut`]: shut
/// down, so that a released live prefill's descriptors go at once and not
/// at its next UCX keepalive round; `Keep`: left to UCX).
pub(crate) fn remove_remote_agent(
    py: Python<'_>,
    agent: &Bound<'_, PyAny>,
    name: &AgentName,
    connections: Connections,
) -> Removal {
    let call = || agent.call_method1(intern!(py, "remove_remote_agent"), (name.as_str(),));
    // Unloaded: invalidated, or unknown to NIXL (dropped by it already).
    let unloaded = |out: &PyResult<Bound<'_, PyAny>>| match out {
        Ok(_) => true,
        Err(e) => matches!(classify(py, e), Classified::Nixl(s) if s == NixlStatus::ERR_NOT_FOUND),
    };
    let local = agent_name(agent);
    let (out, closes) = match (install(), &local) {
        (Ok(closer), Some(local)) => {
            closer.invalidate(local, name.as_str(), connections, call, unloaded)
        }
        (Ok(closer), None) => closer.around_invalidation(call),
        (Err(_), _) => (call(), EndpointCloses::default()),
    };
    let status = match out {
        Ok(_) => Ok(NixlStatus::SUCCESS),
        Err(e) => match classify(py, &e) {
            Classified::Nixl(status) => Ok(status),
            Classified::Other(_) => Err(e),
        },
    };
    if let Some(gpu) = &closes.gpu {
        nixl_keepalive::transport::nixl::record_release_gpu(name.as_str(), gpu);
    }
    let close = match &status {
        Ok(s) if *s == NixlStatus::SUCCESS => Some(EndpointClose::from(closes)),
        _ => None,
    };
    Removal {
        status,
        close,
        connections_shut: closes.connections_shut,
    }
}

/// Totals of what the service's releases did to endpoints (one count per
/// endpoint for `closed` and `left_open`, per agent for `none_closed` and
/// `not_observed`), for the snapshot: the binding's
/// `nixl_keepalive_release_endpoints_total{outcome}`.
#[derive(Default)]
pub(crate) struct EndpointTotals {
    closed: AtomicU64,
    left_open: AtomicU64,
    none_closed: AtomicU64,
    not_observed: AtomicU64,
    connections_shut: AtomicU64,
}

impl EndpointTotals {
    /// TCP connections a release shut down after the invalidation.
    pub(crate) fn record_shut(&self, n: u32) {
        self.connections_shut
            .fetch_add(u64::from(n), Ordering::Relaxed);
    }

    pub(crate) fn record(&self, close: &EndpointClose) {
        let add = |c: &AtomicU64, n: u32| c.fetch_add(u64::from(n), Ordering::Relaxed);
        match close {
            EndpointClose::Closed { endpoints } => add(&self.closed, *endpoints),
            EndpointClose::LeftOpen { closed, left_open } => {
                add(&self.closed, *closed);
                add(&self.left_open, *left_open)
            }
            EndpointClose::NoneClosed => add(&self.none_closed, 1),
            EndpointClose::NotObserved => add(&self.not_observed, 1),
            // An outcome this binding does not know yet: not counted as
            // closed.
            _ => add(&self.not_observed, 1),
        };
    }

    /// The totals, the mode, and UCX's own count of the endpoints the
    /// agent named `agent` holds now (its VFS tree: NIXL's loopback
    /// endpoint plus one per connected remote agent; `None` when UCX's VFS
    /// is off or the name is unknown).
    pub(crate) fn dict<'py>(
        &self,
        py: Python<'py>,
        agent: Option<&str>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let (mode, reason) = mode_words(CLOSER.get_or_init(EndpointCloser::install));
        d.set_item("mode", mode)?;
        d.set_item("reason", reason)?;
        d.set_item("closed", self.closed.load(Ordering::Relaxed))?;
        d.set_item("left_open", self.left_open.load(Ordering::Relaxed))?;
        d.set_item("none_closed", self.none_closed.load(Ordering::Relaxed))?;
        d.set_item("not_observed", self.not_observed.load(Ordering::Relaxed))?;
        d.set_item(
            "connections_shut",
            self.connections_shut.load(Ordering::Relaxed),
        )?;
        let ucx = match agent {
            Some(name) => {
                let name = name.to_string();
                py.detach(move || nixl_agent::endpoints::ucx_endpoints(&name))
            }
            None => None,
        };
        d.set_item("ucx_endpoints", ucx.map(|u| u.endpoints.len()))?;
        Ok(d)
    }
}

/// `nixl_keepalive.remove_remote_agent(agent, name)`: unloads a remote
/// agent the way the service's releases do (its endpoints closed at once
/// in the `force` mode, and the TCP connections its loads through
/// `load_remote_agent` opened shut down), for loads the caller undoes
/// itself before any transfer with the agent (a handshake that failed
/// half-way). Returns `{"status", "status_name", "close",
/// "connections_shut"}`; `close` is `closed`, `left_open`, `none_closed`,
/// `not_observed`, or `None` when NIXL refused (`status` says why: `-4`
/// NOT_FOUND for an agent not loaded). A non-NIXL exception is raised as
/// is.
#[pyfunction(name = "remove_remote_agent")]
pub(crate) fn remove_remote_agent_py<'py>(
    agent: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let py = agent.py();
    let removal = remove_remote_agent(py, agent, &AgentName::from(name), Connections::Shut);
    let status = removal.status?;
    let d = PyDict::new(py);
    d.set_item("status", status.raw())?;
    d.set_item("status_name", status.name())?;
    d.set_item("close", removal.close.map(|c| c.as_str()))?;
    d.set_item("connections_shut", removal.connections_shut)?;
    Ok(d)
}

/// `agent.name` when it is a str.
fn agent_name(agent: &Bound<'_, PyAny>) -> Option<String> {
    agent
        .getattr(intern!(agent.py(), "name"))
        .and_then(|n| n.extract::<String>())
        .ok()
}

/// `nixl_keepalive.load_remote_agent(agent, load)`: calls `load()` (a call
/// that makes `agent` load one remote agent's metadata: NIXL's
/// `add_remote_agent`, or vLLM's method around it) and returns what it
/// returned, having listed under the name it returned (str, or the UTF-8
/// bytes NIXL's `add_remote_agent` returns) the UCX endpoints NIXL created
/// meanwhile on this thread and the TCP connections UCX opened for them.
/// A failure of one of the endpoints then names that engine, and the
/// service heartbeats it alone; the service's release of the engine shuts
/// the connections down (when every transfer with it ended), so a live
/// prefill released again and again leaves no descriptors behind. Loads
/// through this take one process-wide lock (the GIL released while
/// waiting for it): never two at once, so that one engine's connections
/// are never recorded as another's. A load made without this still works:
/// its endpoints' failures come unnamed (every live engine gets a
/// heartbeat) and its connections close at the peer's UCX keepalive round.
/// Exceptions from `load` are raised as they are.
#[pyfunction(name = "load_remote_agent")]
pub(crate) fn load_remote_agent_py<'py>(
    agent: &Bound<'py, PyAny>,
    load: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = agent.py();
    let call = load.clone().unbind();
    let run = || {
        Python::attach(|py| {
            let (out, eps) = nixl_agent::failures::around_load(|| call.call0(py));
            (out, eps)
        })
    };
    let ((out, eps), connections) = match install() {
        // The lock is taken without the GIL: its holder needs the GIL for
        // the load itself.
        Ok(closer) => py.detach(|| closer.around_load(run)),
        Err(_) => (run(), Default::default()),
    };
    let out = out?.into_bound(py);
    let remote = out.extract::<String>().ok().or_else(|| {
        out.extract::<Vec<u8>>()
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
    });
    match (agent_name(agent), remote) {
        (Some(local), Some(remote)) => {
            eps.belong_to(&local, &remote);
            connections.belong_to(&local, &remote);
        }
        _ => {
            drop(eps);
            drop(connections);
        }
    }
    Ok(out)
}
