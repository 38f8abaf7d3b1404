//! The library's [`Transport`] over the caller's Python `nixl_agent`.
//!
//! NIXL's metadata, endpoints and remote keys live in the agent that
//! loaded them, so the service must call that very agent: a heartbeat is
//! `agent.send_notif(name, b"HB:...")`; a release is
//! `agent.release_dlist_handle(h)` for each prepped handle the runtime
//! handed over, then `agent.remove_remote_agent(name)` for each agent of
//! the engine, inside the endpoint-close scope ([`crate::endpoints`]): a
//! live prefill's UCX endpoints and their connections are closed at once,
//! and a [`ReleaseTarget::Endpoints`] step after each agent's
//! [`ReleaseTarget::RemoteMetadata`] step says so, as in the Rust
//! transport. Each call takes the GIL for itself alone (never for a whole
//! release), on one of the service's blocking threads; a NIXL exception
//! becomes its raw status ([`crate::status::classify`]), never a
//! collapsed one.
//!
//! An exception that is not NIXL's (a broken agent object, a bug) is not
//! turned into a made-up status: the call unwinds, and the library reports
//! it as a transport panic (`TransportPanicked`, the engine kept for a
//! heartbeat; a release marked `panicked`). It unwinds with
//! `resume_unwind`, which skips the panic hook: a heartbeat every interval
//! to a broken agent does not print a backtrace each time.
//!
//! Thread safety: the service calls the agent from several threads at
//! once (each call holding the GIL, but NIXL's Python binding releases it
//! inside some calls), so the agent must be made with a locking
//! thread-sync mode (`nixl_thread_sync_t.NIXL_THREAD_SYNC_RW`), as the
//! Rust API requires of its own agents.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nixl_agent::Connections;
use nixl_keepalive::{
    AgentName, EndpointClose, EngineId, FailureWatch, NixlStatus, ReleaseStep, ReleaseTarget,
    Suspicions, Transfers, Transport, TransportError,
};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::endpoints::{self, EndpointTotals};
use crate::status::{classify, Classified};

/// What the runtime hands over at registration and the service gives back
/// at release: the engine's prepped remote dlist handles (whatever
/// `prep_xfer_dlist` returned, one per remote rank or however the runtime
/// prepped them), kept alive until released.
pub(crate) struct PyResources {
    pub(crate) dlist_handles: Vec<Py<PyAny>>,
}

/// How long transport calls waited for the GIL, for the operator (and the
/// busy-GIL measurement): a model step holding the GIL delays heartbeats
/// by this much.
#[derive(Default)]
pub(crate) struct GilStats {
    calls: AtomicU64,
    wait_ns_total: AtomicU64,
    wait_ns_max: AtomicU64,
    /// Calls that waited 10 ms or more.
    waits_over_10ms: AtomicU64,
}

impl GilStats {
    fn record(&self, waited: Duration) {
        let ns = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.wait_ns_total.fetch_add(ns, Ordering::Relaxed);
        self.wait_ns_max.fetch_max(ns, Ordering::Relaxed);
        if waited >= Duration::from_millis(10) {
            self.waits_over_10ms.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// (calls, total wait, longest wait, waits of 10 ms or more).
    pub(crate) fn read(&self) -> (u64, Duration, Duration, u64) {
        (
            self.calls.load(Ordering::Relaxed),
            Duration::from_nanos(self.wait_ns_total.load(Ordering::Relaxed)),
            Duration::from_nanos(self.wait_ns_max.load(Ordering::Relaxed)),
            self.waits_over_10ms.load(Ordering::Relaxed),
        )
    }
}

/// The service's transport: the caller's `nixl_agent`.
pub(crate) struct PyTransport {
    agent: Py<PyAny>,
    /// The agent's name (`agent.name`), which NIXL gives its UCX context:
    /// where UCX's own view of its endpoints is read.
    agent_name: Option<String>,
    pub(crate) gil: GilStats,
    /// What the releases did to endpoints.
    pub(crate) endpoints: EndpointTotals,
}

impl PyTransport {
    pub(crate) fn new(py: Python<'_>, agent: Py<PyAny>) -> Self {
        let agent_name = agent
            .bind(py)
            .getattr(intern!(py, "name"))
            .and_then(|n| n.extract::<String>())
            .ok();
        PyTransport {
            agent,
            agent_name,
            gil: GilStats::default(),
            endpoints: EndpointTotals::default(),
        }
    }

    /// The agent.
    pub(crate) fn agent(&self) -> &Py<PyAny> {
        &self.agent
    }

    /// The agent's name, when it has a `name` that is a str.
    pub(crate) fn agent_name(&self) -> Option<&str> {
        self.agent_name.as_deref()
    }

    /// Runs `f` with the GIL, recording how long taking it took. Unwinds
    /// (see the module docs) when the interpreter is shutting down.
    fn with_gil<R>(&self, call: &str, f: impl for<'py> FnOnce(Python<'py>) -> R) -> R {
        let asked = Instant::now();
        let out = Python::try_attach(|py| {
            self.gil.record(asked.elapsed());
            f(py)
        });
        match out {
            Some(out) => out,
            None => std::panic::resume_unwind(Box::new(format!(
                "{call}: the Python interpreter is shutting down"
            ))),
        }
    }

    /// `agent.release_dlist_handle(handle)`.
    fn release_dlist(&self, handle: Py<PyAny>) -> Result<NixlStatus, String> {
        self.with_gil("release_dlist_handle", |py| {
            let out = self
                .agent
                .bind(py)
                .call_method1(intern!(py, "release_dlist_handle"), (handle.bind(py),));
            // The last reference to a released handle goes here, with the
            // GIL.
            drop(handle);
            outcome(py, out.map(drop))
        })
    }

    /// `agent.remove_remote_agent(name)`, its endpoints closed at once
    /// (see [`crate::endpoints`]): the raw status, and what became of the
    /// endpoints when it succeeded.
    fn remove_remote_agent(
        &self,
        agent: &AgentName,
        connections: Connections,
    ) -> Result<(NixlStatus, Option<EndpointClose>), String> {
        self.with_gil("remove_remote_agent", |py| {
            let removal =
                endpoints::remove_remote_agent(py, self.agent.bind(py), agent, connections);
            self.endpoints.record_shut(removal.connections_shut);
            match removal.status {
                Ok(status) => Ok((status, removal.close)),
                Err(e) => Err(e.to_string()),
            }
        })
    }
}

/// SUCCESS, a NIXL error's raw status, or the text of another exception.
fn outcome(py: Python<'_>, result: PyResult<()>) -> Result<NixlStatus, String> {
    match result {
        Ok(()) => Ok(NixlStatus::SUCCESS),
        Err(e) => match classify(py, &e) {
            Classified::Nixl(status) => Ok(status),
            Classified::Other(text) => Err(text),
        },
    }
}

impl Transport for PyTransport {
    type Resources = PyResources;

    fn notify(&self, agent: &AgentName, message: &[u8]) -> Result<(), TransportError> {
        let out = self.with_gil("send_notif", |py| {
            let message = PyBytes::new(py, message);
            let out = self
                .agent
                .bind(py)
                .call_method1(intern!(py, "send_notif"), (agent.as_str(), message));
            outcome(py, out.map(drop))
        });
        match out {
            Ok(status) if status.is_ok() => Ok(()),
            Ok(status) => Err(TransportError::new("send_notif", status)),
            Err(text) => std::panic::resume_unwind(Box::new(format!(
                "send_notif to {agent} raised a non-NIXL exception: {text}"
            ))),
        }
    }

    /// With [`Transfers::Ended`] the TCP connections recorded at the
    /// agents' loads (`nixl_keepalive.load_remote_agent`) are shut down
    /// after their invalidation, as the Rust transport's are; otherwise
    /// they are left to UCX (a transfer given up may still be running at
    /// the peer).
    fn release_with(
        &self,
        engine: &EngineId,
        agents: &[AgentName],
        resources: PyResources,
        transfers: Transfers,
    ) -> Vec<ReleaseStep> {
        let connections = Connections::from(transfers);
        let mut steps = Vec::with_capacity(resources.dlist_handles.len() + agents.len());
        let mut broken = Vec::new();
        for (index, handle) in resources.dlist_handles.into_iter().enumerate() {
            match self.release_dlist(handle) {
                Ok(status) => steps.push(ReleaseStep {
                    target: ReleaseTarget::DlistHandle(index),
                    status,
                }),
                Err(text) => broken.push(format!("release_dlist_handle #{index}: {text}")),
            }
        }
        for agent in agents {
            match self.remove_remote_agent(agent, connections) {
                Ok((status, close)) => {
                    steps.push(ReleaseStep {
                        target: ReleaseTarget::RemoteMetadata(agent.clone()),
                        status,
                    });
                    if let Some(close) = close {
                        self.endpoints.record(&close);
                        if let EndpointClose::LeftOpen { left_open, .. } = close {
                            tracing::warn!(%engine, %agent, left_open, "UCX endpoints of a released agent left open: they keep their sockets and mappings until this agent is destroyed");
                        }
                        steps.push(ReleaseStep {
                            target: ReleaseTarget::Endpoints {
                                agent: agent.clone(),
                                close,
                            },
                            status,
                        });
                    }
                }
                Err(text) => broken.push(format!("remove_remote_agent({agent}): {text}")),
            }
        }
        if !broken.is_empty() {
            // Every step was attempted; what the failed ones did is
            // unknown, so the release is reported as a panic, not a status.
            std::panic::resume_unwind(Box::new(format!(
                "releasing engine {engine}: non-NIXL exceptions: {}",
                broken.join("; ")
            )));
        }
        tracing::debug!(%engine, ?steps, "NIXL state released through the Python agent");
        steps
    }

    /// UCX's endpoint failures of the Python agent's UCX context, from
    /// `nixl_agent::failures` (the interposer this package installs before
    /// NIXL's UCX plugin loads). The agent's own loads name their
    /// endpoints only when made through [`crate::endpoints`]' load scope;
    /// any other failure comes unnamed, and every live engine gets a
    /// heartbeat. NIXL's Python agent runs a progress thread by default,
    /// which is where UCX runs the handler.
    fn watch_failures(&self, suspicions: Suspicions) -> Result<FailureWatch, String> {
        let local = self
            .agent_name
            .as_deref()
            .ok_or("the agent has no `name` that is a str")?;
        nixl_keepalive::transport::nixl::watch_endpoint_failures(local, suspicions)
    }

    /// The process's GPU-mapping ledger (`nixl_agent::gpu`), on or off: the
    /// same one as the Rust transport's (NIXL's Python agent loads through
    /// `nixl_keepalive.load_remote_agent` name their rkeys).
    fn gpu_mappings(&self, on: bool) -> nixl_keepalive::GpuMappings {
        nixl_keepalive::transport::nixl::gpu_mappings(on)
    }
}
