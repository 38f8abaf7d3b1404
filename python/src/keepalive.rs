//! The service object Python holds: spawns the library's service on the
//! binding's runtime over a [`PyTransport`], and carries the runtime's
//! side of it (leases, "peer gone", snapshot, events, close).

use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use nixl_keepalive::ucx::settings::UcxSettings;
use nixl_keepalive::{
    AgentName, EngineId, GoneMode, PeerAddr, PeerRef, ReleaseTarget, Snapshot, Stopped, Transport,
};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tokio_util::sync::CancellationToken;

use crate::args;
use crate::config::Config;
use crate::control;
use crate::engine::Engine;
use crate::errors;
use crate::protocol::{self, Events, Handshake};
use crate::runtime;
use crate::shared::Shared;
use crate::transport::{PyResources, PyTransport};

/// The keepalive service, running on its own thread over the caller's
/// `nixl_agent`. The public `nixl_keepalive.Keepalive` wraps it.
#[pyclass(module = "nixl_keepalive._native", frozen)]
pub(crate) struct Service {
    shared: Arc<Shared>,
    /// The control server, when asked for: stopped with the service.
    control: Option<control::Running>,
}

impl Drop for Service {
    fn drop(&mut self) {
        // Not closed: the service stops in the background, draining and
        // releasing as at close.
        self.shared.shutdown.cancel();
    }
}

/// An engine id from a str or an `Engine`.
fn engine_id(engine: &Bound<'_, PyAny>) -> PyResult<EngineId> {
    if let Ok(e) = engine.cast::<Engine>() {
        return Ok(e.get().inner.id().clone());
    }
    match engine.extract::<String>() {
        Ok(s) => Ok(EngineId::from(s)),
        Err(_) => Err(PyTypeError::new_err(
            "engine must be an engine id (str) or an Engine",
        )),
    }
}

/// `ServiceStopped`: the service is gone and the call did nothing.
fn stopped() -> PyErr {
    errors::ServiceStopped::new_err("the keepalive service has stopped; nothing was done")
}

/// `address` made the one canonical `host:port` the library compares
/// (`PeerAddr::resolve`, the rule the Rust embedders and the CLI use: an
/// IP literal as the standard library writes it, a name resolved to its
/// one address); waits for a lookup with the GIL released. Refused with a
/// `ValueError` naming the argument, the address and what is accepted.
pub(crate) fn resolve(py: Python<'_>, argument: &str, address: &str) -> PyResult<PeerAddr> {
    let owned = address.to_string();
    match runtime::wait(py, async move { PeerAddr::resolve(&owned).await })? {
        Ok(canonical) => Ok(canonical),
        Err(e) => Err(PyValueError::new_err(format!(
            "{argument}: {e} (accepted: host:port, with an IPv4 address in standard form, \
             an IPv6 address in brackets, or a host name that resolves to one address)"
        ))),
    }
}

/// The canonical form of a prefill's side-channel address, as the service
/// compares addresses (`localhost:5600` and `127.0.0.1:5600` are one);
/// `ValueError` for anything that is not one `host:port`.
#[pyfunction]
pub(crate) fn canonical_address(py: Python<'_>, address: &str) -> PyResult<String> {
    Ok(resolve(py, "address", address)?.as_str().to_string())
}

#[pymethods]
impl Service {
    /// Starts the service over `agent` (a `nixl_agent`, made with a
    /// locking thread-sync mode) with `config`; with `control_addr`, the
    /// control server there too (a bearer token from `control_token` or
    /// `control_token_file`), checked and bound before the service
    /// starts.
    #[new]
    #[pyo3(signature = (agent, config, control_addr = None, control_token = None, control_token_file = None))]
    fn new(
        py: Python<'_>,
        agent: Py<PyAny>,
        config: &Config,
        control_addr: Option<&str>,
        control_token: Option<&str>,
        control_token_file: Option<&str>,
    ) -> PyResult<Service> {
        for method in ["send_notif", "release_dlist_handle", "remove_remote_agent"] {
            if !agent.bind(py).hasattr(method)? {
                return Err(PyTypeError::new_err(format!(
                    "agent has no {method}(): pass the decoder's nixl_agent"
                )));
            }
        }
        let settings = UcxSettings::read()
            .map_err(|e| errors::ConfigError::new_err(format!("UCX settings: {e}")))?;
        if let Some(bad) = crate::endpoints::bad_setting() {
            return Err(errors::ConfigError::new_err(bad.to_string()));
        }
        let server = match control_addr {
            Some(addr) => Some(control::bind(py, addr, control_token, control_token_file)?),
            None if control_token.is_some() || control_token_file.is_some() => {
                return Err(errors::ConfigError::new_err(
                    "control: a token without an address to serve on; give control too".into(),
                ))
            }
            None => None,
        };
        let transport = Arc::new(PyTransport::new(py, agent));
        let rt = runtime::get();
        let _enter = rt.enter();
        let (service, handle) =
            nixl_keepalive::Keepalive::new(transport.clone(), config.inner.clone());
        let service = service.with_ucx_settings(&settings);
        let shutdown = CancellationToken::new();
        let stopped = CancellationToken::new();
        let task = {
            let shutdown = shutdown.clone();
            let stopped = stopped.clone();
            rt.spawn(async move {
                let out = service.run(shutdown).await;
                stopped.cancel();
                out
            })
        };
        let control =
            server.map(|s| control::Running::start(s, handle.clone(), shutdown.child_token()));
        Ok(Service {
            control,
            shared: Arc::new(Shared {
                handle,
                transport,
                registry: Mutex::default(),
                shutdown,
                stopped,
                task: Mutex::new(Some(task)),
            }),
        })
    }

    /// The agent the service calls.
    #[getter]
    fn agent(&self, py: Python<'_>) -> Py<PyAny> {
        self.shared.transport.agent().clone_ref(py)
    }

    /// Whether the service has stopped.
    #[getter]
    fn stopped(&self) -> bool {
        self.shared.stopped.is_cancelled()
    }

    /// The control server's address (`host:port`, the port the system
    /// picked for port 0), or `None` without one.
    #[getter]
    fn control_addr(&self) -> Option<String> {
        self.control.as_ref().map(control::Running::addr)
    }

    /// Starts a handshake with the peer at `address` (`host:port`);
    /// `declared`: the address is the peer's own word, not one the runtime
    /// reached (a live engine of another id there is not replaced on it).
    #[pyo3(signature = (address, declared = false))]
    fn handshake(&self, py: Python<'_>, address: &str, declared: bool) -> PyResult<Handshake> {
        let address = resolve(py, "handshake address", address)?;
        Ok(protocol::start(
            &self.shared,
            address.as_str().to_string(),
            declared,
        ))
    }

    /// Registers an engine without a handshake of its own (its metadata
    /// loaded, its dlists prepped). Prefer `handshake` for engine ids that
    /// may come back.
    #[pyo3(signature = (engine_id, address, agents, dlist_handles, incarnation = None))]
    fn register(
        &self,
        py: Python<'_>,
        engine_id: String,
        address: String,
        agents: &Bound<'_, PyAny>,
        dlist_handles: &Bound<'_, PyAny>,
        incarnation: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Engine> {
        let agents = args::agent_names(agents, "agents")?;
        let dlist_handles = args::dlist_handles(dlist_handles, "dlist_handles")?;
        let incarnation = args::incarnation(incarnation)?;
        let address = resolve(py, "register address", &address)?
            .as_str()
            .to_string();
        let fut = protocol::register_direct(
            self.shared.clone(),
            engine_id,
            address,
            agents,
            incarnation,
            dlist_handles,
        );
        runtime::wait(py, fut)?
    }

    /// The registered engine `engine_id`, if any.
    fn engine(&self, engine_id: String) -> Option<Engine> {
        self.shared.lookup(&EngineId::from(engine_id))
    }

    /// Renews these lease request ids with every heartbeat to `engine`
    /// until removed; with `renew_now`, a renewal goes out as soon as the
    /// engine's rate cap allows. Each id must be 1 to 256 bytes of
    /// printable text without `,` (the separator of `HB:`'s ids): else
    /// `ValueError` naming it, and none is added.
    #[pyo3(signature = (engine, requests, renew_now = false))]
    fn add_leases(
        &self,
        engine: &Bound<'_, PyAny>,
        requests: &Bound<'_, PyAny>,
        renew_now: bool,
    ) -> PyResult<()> {
        let requests = args::request_ids(requests, "requests")?;
        self.shared
            .handle
            .add_leases(&engine_id(engine)?, requests, renew_now)
            .map_err(|e| match e {
                // As every other call on a stopped service says it.
                nixl_keepalive::LeaseError::Stopped(_) => stopped(),
                other => PyValueError::new_err(other.to_string()),
            })
    }

    /// Stops renewing these lease request ids.
    fn remove_leases(
        &self,
        engine: &Bound<'_, PyAny>,
        requests: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let requests = args::request_ids(requests, "requests")?;
        self.shared
            .handle
            .remove_leases(&engine_id(engine)?, requests)
            .map_err(|_| stopped())
    }

    /// A lease renewal to `engine` as soon as its rate cap allows.
    fn renew_leases(&self, engine: &Bound<'_, PyAny>) -> PyResult<()> {
        self.shared
            .handle
            .renew_leases(&engine_id(engine)?)
            .map_err(|_| stopped())
    }

    /// The router or orchestrator says a peer is gone: by engine id or by
    /// address (exactly one), `mode` `drain` (reads in flight finish) or
    /// `fail` (they are failed at once). Idempotent; a no-op for unknown
    /// peers.
    #[pyo3(signature = (engine = None, *, address = None, mode = "drain"))]
    fn peer_gone(
        &self,
        py: Python<'_>,
        engine: Option<&Bound<'_, PyAny>>,
        address: Option<String>,
        mode: &str,
    ) -> PyResult<()> {
        let mode = match mode {
            "drain" => GoneMode::Drain,
            "fail" => GoneMode::Fail,
            other => {
                return Err(PyValueError::new_err(format!(
                    "mode {other:?} is not accepted; expected \"drain\" or \"fail\""
                )))
            }
        };
        let peer = match (engine, address) {
            (Some(e), None) => PeerRef::Engine(engine_id(e)?),
            (None, Some(a)) => PeerRef::Address(resolve(py, "peer_gone address", &a)?),
            _ => {
                return Err(PyTypeError::new_err(
                    "peer_gone takes exactly one of an engine (id or Engine) and address=",
                ))
            }
        };
        self.shared
            .handle
            .peer_gone(peer, mode)
            .map_err(|_| stopped())
    }

    /// The service's table as plain dicts.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let handle = self.shared.handle.clone();
        let snap = runtime::wait(py, async move { handle.snapshot().await })?;
        match snap {
            Ok(s) => endpoints_into(py, &self.shared, snapshot_dict(py, &s)?),
            Err(_) => Err(errors::ServiceStopped::new_err(
                "the keepalive service has stopped",
            )),
        }
    }

    /// `snapshot` as an awaitable.
    fn snapshot_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let handle = self.shared.handle.clone();
        let shared = self.shared.clone();
        runtime::for_async();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let snap = handle.snapshot().await;
            Python::attach(|py| match snap {
                Ok(s) => endpoints_into(py, &shared, snapshot_dict(py, &s)?).map(|d| d.unbind()),
                Err(_) => Err(errors::ServiceStopped::new_err(
                    "the keepalive service has stopped",
                )),
            })
        })
    }

    /// The service's events from now on.
    fn events(&self) -> Events {
        protocol::subscribe(&self.shared)
    }

    /// Stops the service as the Rust shutdown does: every engine is marked
    /// (new reads refused), each is released as its reads end, for at
    /// most the shutdown drain; registrations arriving now are refused.
    /// Waits for that (GIL released), and returns what was left:
    /// `unreleased` (registrations still held, as dicts for `give_back`,
    /// once their reads have ended) and `releases_unfinished` (engine ids
    /// whose release call had not come back). A second call returns
    /// nothing left.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let task = self.shared.begin_close();
        if let Some(server) = self.control.as_ref().and_then(control::Running::take_task) {
            // Its listener closed before close returns (the shutdown
            // stopped it); interrupted, a later close still has the
            // service to wait for.
            if let Err(interrupted) = runtime::wait(py, async {
                let _ = server.await;
            }) {
                if let Some(task) = task {
                    *self.shared.task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
                }
                return Err(interrupted);
            }
        }
        let Some(mut task) = task else {
            return stopped_dict(py, None);
        };
        match runtime::wait(py, async { (&mut task).await }) {
            Ok(joined) => stopped_dict(py, joined.ok()),
            Err(interrupted) => {
                *self.shared.task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
                Err(interrupted)
            }
        }
    }

    /// `close` as an awaitable.
    fn close_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let task = self.shared.begin_close();
        let server = self.control.as_ref().and_then(control::Running::take_task);
        runtime::for_async();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            if let Some(server) = server {
                let _ = server.await;
            }
            let joined = match task {
                Some(task) => task.await.ok(),
                None => None,
            };
            Python::attach(|py| stopped_dict(py, joined).map(|d| d.unbind()))
        })
    }

    /// Gives back a registration the service handed back (from
    /// `RegistrationRefused.registration` or `close()["unreleased"]`),
    /// through the agent, as the service would: each dlist handle, then
    /// each agent's remote metadata. Only once no read from it is in
    /// flight. Returns each step with its raw status.
    fn give_back<'py>(
        &self,
        py: Python<'py>,
        registration: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyList>> {
        let engine: String = registration
            .get_item("engine")?
            .ok_or_else(|| PyValueError::new_err("registration has no 'engine'"))?
            .extract()?;
        // A registration as the service hands it back (a refusal's
        // `registration`, `close()`'s "unreleased") holds both lists; a
        // dict without them is not one, and giving back nothing from it
        // would hide the caller's mistake.
        let missing: Vec<&str> = ["agents", "dlist_handles"]
            .into_iter()
            .filter(|key| !matches!(registration.get_item(*key), Ok(Some(_))))
            .collect();
        if !missing.is_empty() {
            return Err(PyValueError::new_err(format!(
                "registration of engine {engine:?} has no {}: give back the registration the \
                 service handed you (RegistrationRefused.registration, or close()'s \
                 \"unreleased\"), which holds engine, agents and dlist_handles",
                missing.join(" or ")
            )));
        }
        let agents: Vec<String> = match registration.get_item("agents")? {
            Some(a) => a.extract()?,
            None => Vec::new(),
        };
        let handles: Vec<Py<PyAny>> = match registration.get_item("dlist_handles")? {
            Some(h) => h.extract()?,
            None => Vec::new(),
        };
        // Given back once: a second call finds nothing to release.
        registration.set_item("dlist_handles", PyList::empty(py))?;
        registration.set_item("agents", PyList::empty(py))?;
        let transport = self.shared.transport.clone();
        let engine = EngineId::from(engine);
        let agents: Vec<AgentName> = agents.into_iter().map(AgentName::from).collect();
        let steps = py.detach(move || {
            catch_unwind(AssertUnwindSafe(|| {
                transport.release(
                    &engine,
                    &agents,
                    PyResources {
                        dlist_handles: handles,
                    },
                )
            }))
        });
        let steps = steps.map_err(|panic| {
            let text = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "the release failed".into());
            PyRuntimeError::new_err(text)
        })?;
        let list = PyList::empty(py);
        for step in steps {
            let d = PyDict::new(py);
            match &step.target {
                ReleaseTarget::DlistHandle(i) => {
                    d.set_item("target", "dlist_handle")?;
                    d.set_item("index", *i)?;
                }
                ReleaseTarget::RemoteMetadata(agent) => {
                    d.set_item("target", "remote_metadata")?;
                    d.set_item("agent", agent.as_str())?;
                }
                ReleaseTarget::Endpoints { agent, close } => {
                    d.set_item("target", "endpoints")?;
                    d.set_item("agent", agent.as_str())?;
                    d.set_item("close", close.as_str())?;
                }
                other => {
                    d.set_item("target", "other")?;
                    d.set_item("detail", format!("{other:?}"))?;
                }
            }
            d.set_item("status", step.status.raw())?;
            d.set_item("status_name", step.status.name())?;
            list.append(d)?;
        }
        Ok(list)
    }

    /// How long the service's calls on the agent waited for the GIL:
    /// `calls`, `gil_wait_total`, `gil_wait_max` (seconds) and
    /// `gil_waits_over_10ms`.
    fn transport_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (calls, total, max, over) = self.shared.transport.gil.read();
        let d = PyDict::new(py);
        d.set_item("calls", calls)?;
        d.set_item("gil_wait_total", total.as_secs_f64())?;
        d.set_item("gil_wait_max", max.as_secs_f64())?;
        d.set_item("gil_waits_over_10ms", over)?;
        Ok(d)
    }
}

/// Adds `endpoints` to a snapshot dict: the endpoint close mode, what the
/// releases did to endpoints so far, and UCX's own count of the agent's
/// endpoints now (see `crate::endpoints`).
fn endpoints_into<'py>(
    py: Python<'py>,
    shared: &Shared,
    d: Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyDict>> {
    let t = &shared.transport;
    d.set_item("endpoints", t.endpoints.dict(py, t.agent_name())?)?;
    Ok(d)
}

/// What `close` returns.
fn stopped_dict(
    py: Python<'_>,
    stopped: Option<Stopped<PyResources>>,
) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    let unreleased = PyList::empty(py);
    let unfinished = PyList::empty(py);
    if let Some(s) = stopped {
        for r in s.unreleased {
            unreleased.append(protocol::registration_dict(py, r, &HashSet::new())?)?;
        }
        for e in s.releases_unfinished {
            unfinished.append(e.as_str())?;
        }
    }
    d.set_item("unreleased", unreleased)?;
    d.set_item("releases_unfinished", unfinished)?;
    Ok(d)
}

/// The snapshot as plain dicts: its one rendering (the library's
/// `Serialize`, what `GET /v1/snapshot` answers), read by Python's own
/// `json.loads`, so the dict is what a router parses from the control
/// endpoint, key for key and in order.
fn snapshot_dict<'py>(py: Python<'py>, s: &Snapshot) -> PyResult<Bound<'py, PyDict>> {
    let text = serde_json::to_string(s).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    let loads = py
        .import(intern!(py, "json"))?
        .getattr(intern!(py, "loads"))?;
    Ok(loads.call1((text,))?.cast_into::<PyDict>()?)
}
