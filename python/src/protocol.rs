//! Every use of the library's handshake protocol and of its events, in one
//! place: when either changes, this module changes, and nothing else.
//!
//! The Python protocol mirrors the library's (a claim before the load,
//! then the resources):
//!
//! ```python
//! with ka.handshake(address) as h:                # before the side channel
//!     reply = side_channel(address)               # who is there now?
//!     engine = h.ready_to_load(reply.engine_id, agents, incarnation=reply.incarnation)
//!     if engine is None:                          # load now
//!         load_metadata_and_prep_dlists(reply)    # add_remote_agent, prep_xfer_dlist
//!         engine = h.register(dlist_handles)
//! ```
//!
//! `ready_to_load` is the library's `Handshake::ready_to_load` with a
//! `Claim`: `None` is `Ready::Load` (an older registration of the id was
//! released first), an `Engine` is `Ready::Current` (this incarnation is
//! registered at this address: load nothing), and a `ClaimRefused` is
//! `IdentityConflict` (nothing may be loaded) or `ServiceStopped`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nixl_keepalive::{
    AgentName, Claim as RustClaim, ClaimRefused, Conflict, EngineId, Event, EventField,
    Incarnation, PeerAddr, Ready, ReadyToLoad, RegisterError, Registration, ReleaseHeld,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::args;
use crate::engine::{Engine, Identity};
use crate::errors;
use crate::runtime;
use crate::shared::Shared;
use crate::transport::PyResources;

/// What a handshake claims before anything is loaded.
#[derive(Clone, Debug)]
struct Claim {
    engine: EngineId,
    agents: Vec<String>,
    incarnation: Option<u64>,
}

impl Claim {
    fn to_rust(&self) -> RustClaim {
        RustClaim {
            engine: self.engine.clone(),
            incarnation: self.incarnation.map(Incarnation),
            agents: self
                .agents
                .iter()
                .map(|a| AgentName::from(a.as_str()))
                .collect(),
        }
    }
}

/// Where a handshake is.
enum Stage {
    /// Started; `ready_to_load` not called yet.
    Open(nixl_keepalive::Handshake<PyResources>),
    /// A call is waiting on the service.
    Waiting,
    /// Free to load: `register` next.
    Ready {
        ready: ReadyToLoad<PyResources>,
        claim: Claim,
    },
    /// Ended (registered, already registered, refused, or finished).
    Done,
}

/// What `ready_to_load` found.
enum Outcome {
    Load(ReadyToLoad<PyResources>, Claim),
    Registered(Engine),
}

/// Why a protocol step failed.
enum Failure {
    Stopped,
    Claim(ClaimRefused),
    Refused(Box<RegisterError<PyResources>>),
    Misuse(String),
}

/// A handshake in progress with one prefill address: the way to connect,
/// reconnect, or reload a pinned engine id. Made by `Keepalive.handshake`;
/// until it ends, a marked engine at the address is not released (the
/// runtime may still be finding out whether the engine there is new).
/// Ending it (`finish`, leaving its `with` block, or dropping it) at any
/// step registers nothing.
#[pyclass(module = "nixl_keepalive._native", frozen)]
pub(crate) struct Handshake {
    shared: Arc<Shared>,
    address: String,
    stage: Arc<Mutex<Stage>>,
}

/// Starts a handshake with `address`.
pub(crate) fn start(shared: &Arc<Shared>, address: String, declared: bool) -> Handshake {
    let _rt = runtime::get().enter();
    let peer = PeerAddr::from(address.as_str());
    let inner = if declared {
        shared.handle.handshake_declared(peer)
    } else {
        shared.handle.handshake(peer)
    };
    Handshake {
        shared: shared.clone(),
        address,
        stage: Arc::new(Mutex::new(Stage::Open(inner))),
    }
}

fn lock(stage: &Mutex<Stage>) -> std::sync::MutexGuard<'_, Stage> {
    stage.lock().unwrap_or_else(|e| e.into_inner())
}

fn take_open(stage: &Mutex<Stage>) -> Result<nixl_keepalive::Handshake<PyResources>, Failure> {
    let mut s = lock(stage);
    match std::mem::replace(&mut *s, Stage::Waiting) {
        Stage::Open(h) => Ok(h),
        other => {
            let why = match &other {
                Stage::Waiting => "a call on this handshake is still waiting",
                Stage::Ready { .. } => "ready_to_load was already called: register next",
                _ => "the handshake has ended",
            };
            *s = other;
            Err(Failure::Misuse(format!("ready_to_load refused: {why}")))
        }
    }
}

fn take_ready(stage: &Mutex<Stage>) -> Result<(ReadyToLoad<PyResources>, Claim), Failure> {
    let mut s = lock(stage);
    match std::mem::replace(&mut *s, Stage::Waiting) {
        Stage::Ready { ready, claim } => Ok((ready, claim)),
        other => {
            let why = match &other {
                Stage::Open(_) => "call ready_to_load first",
                Stage::Waiting => "a call on this handshake is still waiting",
                _ => "the handshake has ended (already registered, refused, or finished)",
            };
            *s = other;
            Err(Failure::Misuse(format!("register refused: {why}")))
        }
    }
}

/// The library's `ready_to_load` with the claim.
async fn claim(
    shared: Arc<Shared>,
    handshake: nixl_keepalive::Handshake<PyResources>,
    address: String,
    claim: Claim,
    limit: Option<Duration>,
) -> Result<Outcome, Failure> {
    let judged = match limit {
        Some(limit) => handshake.ready_to_load_within(claim.to_rust(), limit).await,
        None => handshake.ready_to_load(claim.to_rust()).await,
    };
    match judged {
        Ok(Ready::Load(ready)) => Ok(Outcome::Load(ready, claim)),
        Ok(Ready::Current(engine)) => Ok(Outcome::Registered(shared.current(
            engine,
            Identity {
                address,
                agents: claim.agents,
                incarnation: claim.incarnation,
            },
        ))),
        Err(ClaimRefused::Stopped(_)) => Err(Failure::Stopped),
        Err(refused) => Err(Failure::Claim(refused)),
    }
}

/// The library's `register`, with the resources.
async fn register(
    shared: Arc<Shared>,
    ready: ReadyToLoad<PyResources>,
    claim: Claim,
    address: String,
    dlist_handles: Vec<Py<PyAny>>,
) -> Result<Engine, Failure> {
    match ready.register(PyResources { dlist_handles }).await {
        Ok(engine) => Ok(shared.remember(
            engine,
            Identity {
                address,
                agents: claim.agents,
                incarnation: claim.incarnation,
            },
        )),
        Err(refused) => Err(Failure::Refused(Box::new(refused))),
    }
}

/// Registers an engine whose metadata is loaded and dlists prepped,
/// without a handshake of its own (the library's `register`).
pub(crate) async fn register_direct(
    shared: Arc<Shared>,
    engine: String,
    address: String,
    agents: Vec<String>,
    incarnation: Option<u64>,
    dlist_handles: Vec<Py<PyAny>>,
) -> PyResult<Engine> {
    let claim = Claim {
        engine: EngineId::from(engine.as_str()),
        agents: agents.clone(),
        incarnation,
    };
    let registration = Registration::new(
        claim.to_rust(),
        PeerAddr::from(address.as_str()),
        PyResources { dlist_handles },
    );
    match shared.handle.register(registration).await {
        Ok(e) => Ok(shared.remember(
            e,
            Identity {
                address,
                agents,
                incarnation,
            },
        )),
        Err(refused) => Err(to_pyerr(Failure::Refused(Box::new(refused)))),
    }
}

/// How long a blocking `ready_to_load` waits by default, in seconds, for
/// an older registration of the claimed engine id to be released.
///
/// That release waits for the registration's transfers (reads in flight,
/// and given-up reads still running) to end, and only the runtime ends
/// them (`Read.finish`, `GivenUpRead.ended`), from whatever thread polls
/// them. A runtime that handshakes on that very thread would wait for
/// itself for good (issue 58: the example decode, re-handshaking a
/// stalled prefill whose given-up READ only its handshaking thread
/// polled). So the wait is bounded and its end names what holds the
/// release ([`release_held`]). Five seconds is vLLM's own handshake
/// timeout, and far above what a live peer needs: the side channel has
/// just answered, and a resumed prefill's given-up READs end 10-16 ms
/// after its resume (`real_given_up.rs`, `test_vllm_real.py`). A runtime
/// whose handshakes run on a thread that ends no transfer passes
/// `timeout=None`.
pub(crate) const RELEASE_WAIT: f64 = 5.0;

/// `ReleaseHeld` from the library's refusal of a bounded claim: its text,
/// and what holds the release as attributes (`None` where the service
/// named no registration of the id).
fn release_held(py: Python<'_>, held: &ReleaseHeld) -> PyErr {
    let text = |s: &str| PyString::new(py, s).into_any();
    let (given_up, blocks) = held.given_up();
    // Without a registration left, nothing of it is counted: `None`.
    let (state, counts, why) = match &held.holder {
        Some(e) => (
            Some(e.state.as_str()),
            Some([e.reads_in_flight, given_up, blocks]),
            e.why.as_str(),
        ),
        None => (
            None,
            None,
            "no registration of the id is left: another handshake of it is loading, or it was \
             released as the wait ran out",
        ),
    };
    let attrs = (|| -> PyResult<Vec<(&str, Bound<'_, PyAny>)>> {
        let [reads, given_up, blocks] = counts.map_or([None; 3], |c| c.map(Some));
        Ok(vec![
            ("engine", text(held.engine.as_str())),
            ("state", state.into_pyobject(py)?.into_any()),
            ("reads_in_flight", reads.into_pyobject(py)?.into_any()),
            ("given_up", given_up.into_pyobject(py)?.into_any()),
            ("given_up_blocks", blocks.into_pyobject(py)?.into_any()),
            (
                "waited",
                held.waited.as_secs_f64().into_pyobject(py)?.into_any(),
            ),
            ("why", text(why)),
        ])
    })();
    match attrs {
        Ok(attrs) => errors::with_attrs(py, errors::ReleaseHeld::new_err(held.to_string()), &attrs),
        Err(e) => e,
    }
}

/// The Python exception for a failure.
fn to_pyerr(failure: Failure) -> PyErr {
    Python::attach(|py| match failure {
        Failure::Stopped => errors::ServiceStopped::new_err(
            "the keepalive service has stopped: nothing was registered",
        ),
        Failure::Misuse(text) => PyRuntimeError::new_err(text),
        Failure::Claim(ClaimRefused::Conflict(conflict)) => conflict_error(py, &conflict),
        Failure::Claim(ClaimRefused::ReleaseHeld(held)) => release_held(py, &held),
        Failure::Claim(refused) => {
            PyValueError::new_err(format!("{refused}; nothing may be loaded"))
        }
        Failure::Refused(refused) => refused_error(py, *refused),
    })
}

/// A conflict's fields: kind, engine, the agent and holder for an agent
/// in use, and the holder for an address in use.
fn conflict_attrs<'py>(py: Python<'py>, c: &Conflict) -> Vec<(&'static str, Bound<'py, PyAny>)> {
    let text = |s: &str| PyString::new(py, s).into_any();
    let mut attrs = vec![
        ("conflict", text(c.kind())),
        ("engine", text(c.engine().as_str())),
    ];
    let (agent, holder) = match c {
        Conflict::AgentInUse { agent, holder, .. } => (Some(agent.as_str()), Some(holder.as_str())),
        Conflict::AddressInUse { holder, .. } => (None, Some(holder.as_str())),
        _ => (None, None),
    };
    attrs.push((
        "agent",
        agent.map(text).unwrap_or_else(|| py.None().into_bound(py)),
    ));
    attrs.push((
        "holder",
        holder.map(text).unwrap_or_else(|| py.None().into_bound(py)),
    ));
    attrs
}

/// `IdentityConflict` for a refused claim: nothing was loaded.
fn conflict_error(py: Python<'_>, conflict: &Conflict) -> PyErr {
    let attrs = conflict_attrs(py, conflict);
    errors::with_attrs(
        py,
        errors::IdentityConflict::new_err(format!(
            "identity conflict: {conflict}; nothing was loaded (the registered engine is kept)"
        )),
        &attrs,
    )
}

/// `RegistrationRefused`, carrying the registration whole.
fn refused_error(py: Python<'_>, refused: RegisterError<PyResources>) -> PyErr {
    let message = refused.to_string();
    let engine = refused.engine().as_str().to_string();
    let (reason, conflict) = match &refused {
        RegisterError::Stopped(_) => ("stopped", None),
        RegisterError::Conflict { conflict, .. } => ("conflict", Some(conflict.clone())),
        RegisterError::ServiceGone { .. } => ("service_gone", None),
        RegisterError::Invalid { .. } => ("invalid", None),
        // A refusal this binding does not know yet: its message says why.
        _ => ("other", None),
    };
    // An agent another engine holds is not this registration's to
    // invalidate: giving it back must leave that one alone.
    let held = match &conflict {
        Some(Conflict::AgentInUse { agent, .. }) => Some(agent.as_str().to_string()),
        _ => None,
    };
    let registration = match refused.into_registration() {
        Some(r) => {
            let keep: HashSet<&str> = held.iter().map(String::as_str).collect();
            registration_dict(py, r, &keep).map(|d| d.into_any())
        }
        None => Ok(py.None().into_bound(py)),
    };
    let registration = match registration {
        Ok(r) => r,
        Err(e) => return e,
    };
    let mut attrs = match &conflict {
        Some(c) => conflict_attrs(py, c),
        None => vec![
            ("conflict", py.None().into_bound(py)),
            ("agent", py.None().into_bound(py)),
            ("holder", py.None().into_bound(py)),
        ],
    };
    attrs.retain(|(name, _)| *name != "engine");
    attrs.push(("reason", PyString::new(py, reason).into_any()));
    attrs.push(("engine", PyString::new(py, &engine).into_any()));
    attrs.push(("registration", registration));
    errors::with_attrs(py, errors::RegistrationRefused::new_err(message), &attrs)
}

/// A registration handed back, as a dict `Keepalive.give_back` takes:
/// engine, address, agents (to invalidate) and dlist_handles (to release).
/// Agents in `keep` are left out of `agents` (listed in `kept_agents`).
pub(crate) fn registration_dict<'py>(
    py: Python<'py>,
    r: Registration<PyResources>,
    keep: &HashSet<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("engine", r.engine.as_str())?;
    d.set_item("address", r.address.as_str())?;
    let (kept, agents): (Vec<&AgentName>, Vec<&AgentName>) =
        r.agents.iter().partition(|a| keep.contains(a.as_str()));
    d.set_item(
        "agents",
        PyList::new(py, agents.iter().map(|a| a.as_str()))?,
    )?;
    d.set_item(
        "kept_agents",
        PyList::new(py, kept.iter().map(|a| a.as_str()))?,
    )?;
    d.set_item(
        "dlist_handles",
        PyList::new(py, r.resources.dlist_handles.iter().map(|h| h.bind(py)))?,
    )?;
    Ok(d)
}

#[pymethods]
impl Handshake {
    /// The address this handshake is with.
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// The prefill at this address answered as `engine_id` (with these
    /// agent names, one per rank, and the incarnation its side channel
    /// reported). Returns `None` once its metadata may be loaded: load it,
    /// prep the dlists, then `register`. Returns the `Engine` when this
    /// exact incarnation is already registered and live: load nothing,
    /// the handshake has ended. Blocks (GIL released) while an older
    /// registration of the id drains and is released, for at most
    /// `timeout` seconds (`None`: no limit, for a thread that never ends
    /// a transfer itself). Raises `IdentityConflict` (nothing may be
    /// loaded), `ReleaseHeld` (the wait ran out: what holds the release,
    /// see [`RELEASE_WAIT`]) or `ServiceStopped`.
    #[pyo3(signature = (engine_id, agents, incarnation = None, timeout = Some(RELEASE_WAIT)))]
    fn ready_to_load(
        &self,
        py: Python<'_>,
        engine_id: String,
        agents: &Bound<'_, PyAny>,
        incarnation: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<Option<Engine>> {
        let patience = crate::engine::seconds(timeout, "timeout")?;
        let c = Claim {
            engine: EngineId::from(engine_id.as_str()),
            agents: args::agent_names(agents, "agents")?,
            incarnation: args::incarnation(incarnation)?,
        };
        let handshake = take_open(&self.stage).map_err(to_pyerr)?;
        // The library bounds the wait (`ready_to_load_within`) and names
        // what holds the release when it runs out; running out ends the
        // handshake (a mark it made stands, nothing was loaded under it).
        let fut = claim(
            self.shared.clone(),
            handshake,
            self.address.clone(),
            c,
            patience,
        );
        let stage = self.stage.clone();
        let out = match runtime::wait(py, fut) {
            Ok(judged) => judged.map_err(to_pyerr),
            Err(interrupted) => Err(interrupted),
        };
        settle_claim(&stage, out)
    }

    /// `ready_to_load` as an awaitable (cancelling it ends the
    /// handshake).
    #[pyo3(signature = (engine_id, agents, incarnation = None))]
    fn ready_to_load_async<'py>(
        &self,
        py: Python<'py>,
        engine_id: String,
        agents: &Bound<'py, PyAny>,
        incarnation: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let c = Claim {
            engine: EngineId::from(engine_id.as_str()),
            agents: args::agent_names(agents, "agents")?,
            incarnation: args::incarnation(incarnation)?,
        };
        let handshake = take_open(&self.stage).map_err(to_pyerr)?;
        let fut = claim(
            self.shared.clone(),
            handshake,
            self.address.clone(),
            c,
            None,
        );
        let stage = self.stage.clone();
        runtime::for_async();
        let ended = EndOnDrop(Some(stage.clone()));
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let out = fut.await.map_err(to_pyerr);
            ended.disarm();
            settle_claim(&stage, out)
        })
    }

    /// Registers the engine loaded under this handshake, with its prepped
    /// remote dlist handles (whatever `prep_xfer_dlist` returned; the
    /// service releases each with `release_dlist_handle` when it releases
    /// the engine, so do not release them yourself). Ends the handshake.
    /// Raises `RegistrationRefused` with the registration in it (give it
    /// back with `Keepalive.give_back`).
    fn register(&self, py: Python<'_>, dlist_handles: &Bound<'_, PyAny>) -> PyResult<Engine> {
        let dlist_handles = args::dlist_handles(dlist_handles, "dlist_handles")?;
        let (ready, c) = take_ready(&self.stage).map_err(to_pyerr)?;
        let fut = register(
            self.shared.clone(),
            ready,
            c,
            self.address.clone(),
            dlist_handles,
        );
        let out = runtime::wait(py, fut);
        *lock(&self.stage) = Stage::Done;
        out?.map_err(to_pyerr)
    }

    /// `register` as an awaitable.
    fn register_async<'py>(
        &self,
        py: Python<'py>,
        dlist_handles: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let dlist_handles = args::dlist_handles(dlist_handles, "dlist_handles")?;
        let (ready, c) = take_ready(&self.stage).map_err(to_pyerr)?;
        let fut = register(
            self.shared.clone(),
            ready,
            c,
            self.address.clone(),
            dlist_handles,
        );
        let stage = self.stage.clone();
        runtime::for_async();
        // Cancelled or not, the handshake ends (the registration is with
        // the service once sent).
        let ended = EndOnDrop(Some(stage));
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let out = fut.await;
            drop(ended);
            out.map_err(to_pyerr)
        })
    }

    /// Claims one more agent name for this handshake, after
    /// `ready_to_load` and before `register`: NIXL's `add_remote_agent`
    /// named another agent than the prefill's reply did, and the runtime
    /// wants to unload it. Returns once the name is this handshake's
    /// (invalidating it harms nobody); raises `IdentityConflict` when it
    /// belongs to another engine: then do not remove it (NIXL kept one
    /// entry for both loads).
    fn claim_agent(&self, py: Python<'_>, agent: Bound<'_, PyAny>) -> PyResult<()> {
        let name = args::agent_name(&agent, "agent")?;
        let stage = self.stage.clone();
        // Taken from the stage for the question, and put back.
        let taken = {
            let mut s = lock(&stage);
            match std::mem::replace(&mut *s, Stage::Waiting) {
                Stage::Ready { ready, claim } => Some((ready, claim)),
                other => {
                    *s = other;
                    None
                }
            }
        };
        let out = match taken {
            None => None,
            Some((ready, claim)) => {
                let back = stage.clone();
                let asked = runtime::wait(py, async move {
                    let answer = ready.claim_agent(AgentName::from(name.as_str())).await;
                    (ready, answer)
                });
                match asked {
                    Ok((ready, answer)) => {
                        *lock(&back) = Stage::Ready { ready, claim };
                        Some(answer)
                    }
                    Err(interrupted) => {
                        // The question was dropped with the handshake.
                        *lock(&back) = Stage::Done;
                        return Err(interrupted);
                    }
                }
            }
        };
        match out {
            Some(Ok(())) => Ok(()),
            Some(Err(ClaimRefused::Stopped(_))) => Err(to_pyerr(Failure::Stopped)),
            Some(Err(refused)) => Err(to_pyerr(Failure::Claim(refused))),
            None => Err(to_pyerr(Failure::Misuse(
                "claim_agent refused: call it between ready_to_load (when it returned None) and register"
                    .into(),
            ))),
        }
    }

    /// Ends the handshake (nothing is registered if `register` was not
    /// called). Leaving the `with` block does this.
    fn finish(&self) {
        let old = std::mem::replace(&mut *lock(&self.stage), Stage::Done);
        drop(old);
    }

    /// Whether the handshake has ended.
    #[getter]
    fn ended(&self) -> bool {
        matches!(*lock(&self.stage), Stage::Done)
    }

    fn __repr__(&self) -> String {
        let stage = match *lock(&self.stage) {
            Stage::Open(_) => "open",
            Stage::Waiting => "waiting",
            Stage::Ready { .. } => "ready_to_load",
            Stage::Done => "ended",
        };
        format!("Handshake(address={:?}, {stage})", self.address)
    }
}

/// Ends a handshake whose awaitable was dropped before it resolved.
struct EndOnDrop(Option<Arc<Mutex<Stage>>>);

impl EndOnDrop {
    /// The awaitable resolved: its outcome settles the stage.
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        if let Some(stage) = self.0.take() {
            *lock(&stage) = Stage::Done;
        }
    }
}

fn settle_claim(stage: &Mutex<Stage>, out: PyResult<Outcome>) -> PyResult<Option<Engine>> {
    let mut s = lock(stage);
    match out {
        Ok(Outcome::Load(ready, claim)) => {
            *s = Stage::Ready { ready, claim };
            Ok(None)
        }
        Ok(Outcome::Registered(engine)) => {
            *s = Stage::Done;
            Ok(Some(engine))
        }
        Err(e) => {
            *s = Stage::Done;
            Err(e)
        }
    }
}

/// The service's events, from when this was made: iterate (blocking, GIL
/// released), `async for`, or poll with `get`. Each event is a dict with
/// a `kind` (`registered`, `unreachable`, `replaced`, `retiring`,
/// `stalled`, `reads_failed`, `transient_error`, `released`, `conflict`,
/// `transport_panicked`, and `lagged` when this subscriber fell more than
/// the event capacity behind: `missed` says how many it skipped) and the
/// fields of the event's line (see [`event_dict`]). The iteration ends
/// once the service has stopped and every event is read.
#[pyclass(module = "nixl_keepalive._native", frozen)]
pub(crate) struct Events {
    rx: Arc<tokio::sync::Mutex<broadcast::Receiver<Event>>>,
    stopped: CancellationToken,
}

/// One step of an event subscription.
enum Next {
    Event(Event),
    Lagged(u64),
    End,
}

async fn next(
    rx: Arc<tokio::sync::Mutex<broadcast::Receiver<Event>>>,
    stopped: CancellationToken,
) -> Next {
    let mut rx = rx.lock().await;
    let got = tokio::select! {
        biased;
        r = rx.recv() => r,
        _ = stopped.cancelled() => rx.try_recv().map_err(|e| match e {
            broadcast::error::TryRecvError::Lagged(n) => broadcast::error::RecvError::Lagged(n),
            _ => broadcast::error::RecvError::Closed,
        }),
    };
    match got {
        Ok(e) => Next::Event(e),
        Err(broadcast::error::RecvError::Lagged(n)) => Next::Lagged(n),
        Err(broadcast::error::RecvError::Closed) => Next::End,
    }
}

pub(crate) fn subscribe(shared: &Shared) -> Events {
    Events {
        rx: Arc::new(tokio::sync::Mutex::new(shared.handle.subscribe())),
        stopped: shared.stopped.clone(),
    }
}

fn next_to_py(py: Python<'_>, n: Next) -> PyResult<Option<Bound<'_, PyDict>>> {
    match n {
        Next::Event(e) => event_dict(py, &e).map(Some),
        Next::Lagged(missed) => {
            let d = PyDict::new(py);
            d.set_item("kind", "lagged")?;
            d.set_item("missed", missed)?;
            Ok(Some(d))
        }
        Next::End => Ok(None),
    }
}

#[pymethods]
impl Events {
    /// The next event, waiting at most `timeout` seconds (`None`: until
    /// one comes). `None` on timeout; raises `ServiceStopped` once the
    /// service has stopped and every event was read.
    #[pyo3(signature = (timeout = None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let timeout = timeout.map(|t| Duration::from_secs_f64(t.max(0.0)));
        let got = runtime::wait_for(py, next(self.rx.clone(), self.stopped.clone()), timeout)?;
        match got {
            None => Ok(None),
            Some(n) => match next_to_py(py, n)? {
                Some(d) => Ok(Some(d)),
                None => Err(errors::ServiceStopped::new_err(
                    "the keepalive service has stopped and every event was read",
                )),
            },
        }
    }

    /// The next event if one is waiting, else `None`.
    fn get_nowait<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Ok(mut rx) = self.rx.try_lock() else {
            return Ok(None);
        };
        match rx.try_recv() {
            Ok(e) => event_dict(py, &e).map(Some),
            Err(broadcast::error::TryRecvError::Lagged(n)) => next_to_py(py, Next::Lagged(n)),
            Err(_) => Ok(None),
        }
    }

    /// The next event if one is waiting, with its one line (the library's
    /// rendering: what `nixl-keepalive decode` prints after `event: `), as
    /// `(event, line)`; else `None`. Where events were missed:
    /// `({"kind": "lagged", "missed": n}, "(n events missed)")`, as the
    /// command line says it. For a log, which then reads as every other
    /// surface's.
    fn get_line_nowait<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<(Bound<'py, PyDict>, String)>> {
        let Ok(mut rx) = self.rx.try_lock() else {
            return Ok(None);
        };
        match rx.try_recv() {
            Ok(e) => Ok(Some((event_dict(py, &e)?, e.to_string()))),
            Err(broadcast::error::TryRecvError::Lagged(n)) => {
                Ok(next_to_py(py, Next::Lagged(n))?.map(|d| (d, format!("({n} events missed)"))))
            }
            Err(_) => Ok(None),
        }
    }

    /// For the tests, not the API: the next event if one is waiting, as
    /// `(dict, line, json)`: its dict, its `Display` line and its JSON
    /// (`Serialize`), the three renderings of one walk side by side. `None`
    /// when none is waiting (a lag is skipped).
    #[pyo3(name = "_rendered_nowait")]
    fn rendered_nowait<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<(Bound<'py, PyDict>, String, String)>> {
        let Ok(mut rx) = self.rx.try_lock() else {
            return Ok(None);
        };
        let Ok(event) = rx.try_recv() else {
            return Ok(None);
        };
        let json =
            serde_json::to_string(&event).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(Some((event_dict(py, &event)?, event.to_string(), json)))
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let n = runtime::wait(py, next(self.rx.clone(), self.stopped.clone()))?;
        next_to_py(py, n)
    }

    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let rx = self.rx.clone();
        let stopped = self.stopped.clone();
        runtime::for_async();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let n = next(rx, stopped).await;
            Python::attach(|py| match next_to_py(py, n)? {
                Some(d) => Ok(d.unbind()),
                None => Err(pyo3::exceptions::PyStopAsyncIteration::new_err(())),
            })
        })
    }
}

/// An event as a plain dict, made only of the library's walk of its
/// fields ([`Event::each_field`], which its `Display` line and its JSON
/// walk too): `kind` (the event's), then every field under the line's
/// key: names and text as `str`, counts as `int`, flags as `bool`, a
/// status as its raw `int` with its name under `<key>_name`, a time as
/// whole milliseconds under its `_ms` key. Its JSON, with `event` named
/// `kind`: except a conflict's own `kind` (what collided), which would
/// hide the event's and goes under `conflict`.
pub(crate) fn event_dict<'py>(py: Python<'py>, event: &Event) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", event.kind())?;
    event.each_field(|key, value| {
        let key = if key == "kind" { event.kind() } else { key };
        match value {
            EventField::Name(s) | EventField::Text(s) => d.set_item(key, s),
            EventField::Word(word) => d.set_item(key, word),
            EventField::Number(n) => d.set_item(key, n),
            EventField::Flag(b) => d.set_item(key, b),
            EventField::Status(status) => {
                d.set_item(key, status.raw())?;
                d.set_item(format!("{key}_name"), status.name())
            }
            EventField::Millis(ms) => d.set_item(key, ms),
            // A kind of value this binding does not know yet (the
            // library's walk grows): passed on in the library's words.
            other => d.set_item(key, format!("{other:?}")),
        }
    })?;
    Ok(d)
}
