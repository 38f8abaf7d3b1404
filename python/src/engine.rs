//! A registered engine and a read from it, as Python holds them: thin
//! wrappers of the library's `EngineRef` and `TransferGuard`, bound to the one
//! registration they came from.
//!
//! ```python
//! with engine.read() as r:          # refused at once (ReadRefused) on a marked engine
//!     handle = agent.make_prepped_xfer("READ", local, ids, engine_dlist, ids, b"...")
//!     agent.transfer(handle)
//!     ... poll ...
//!     r.finish(nixl_keepalive.xfer_status(agent, handle))   # the raw status
//! ```
//!
//! The engine is never released while a read of it is open: leaving the
//! `with` block (or `finish`) ends the read. Starting and ending a read
//! touch the registration's counts (ordinary stores on the thread that
//! reads first, one atomic on any other), with the GIL held (no wait is
//! involved).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nixl_keepalive::{Destination, EngineRef, GiveUp, OwnedTransferGuard};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::errors;
use crate::runtime;
use crate::status::status_of;

/// What the binding knows of a registration beyond the library's
/// `EngineRef`.
#[derive(Clone, Debug)]
pub(crate) struct Identity {
    pub(crate) address: String,
    pub(crate) agents: Vec<String>,
    pub(crate) incarnation: Option<u64>,
}

/// A registered prefill engine (one registration of it). Reads start
/// here; the service tells it apart from a later registration of the same
/// engine id (a pinned id that restarted), so a late report from this one
/// never touches its successor.
#[pyclass(module = "nixl_keepalive._native", frozen)]
pub(crate) struct Engine {
    pub(crate) inner: EngineRef,
    pub(crate) identity: Identity,
}

#[pymethods]
impl Engine {
    /// The engine id.
    #[getter]
    fn id(&self) -> &str {
        self.inner.id().as_str()
    }

    /// Its side-channel address, `host:port`.
    #[getter]
    fn address(&self) -> &str {
        &self.identity.address
    }

    /// Its NIXL agent names, one per remote rank.
    #[getter]
    fn agents<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.identity.agents)
    }

    /// The incarnation the handshake reported (`None` if none was given).
    #[getter]
    fn incarnation(&self) -> Option<u64> {
        self.identity.incarnation
    }

    /// `live`, `unreachable`, `replaced`, `retiring`, `stalled` or
    /// `released`.
    #[getter]
    fn state(&self) -> &'static str {
        self.inner.state().as_str()
    }

    /// Whether reads may start (the state is `live`).
    #[getter]
    fn is_live(&self) -> bool {
        self.inner.state() == nixl_keepalive::EngineState::Live
    }

    /// Reads from this registration in flight now.
    #[getter]
    fn reads_in_flight(&self) -> u64 {
        self.inner.reads_in_flight()
    }

    /// Whether the service has failed this registration's reads
    /// (unreachable, stalled, or gone in `fail` mode): abandon them.
    #[getter]
    fn reads_failed(&self) -> bool {
        self.inner.reads_failed()
    }

    /// Starts a read. Use it as a context manager; the engine is not
    /// released before the read ends. Raises `ReadRefused` at once (no
    /// wait) when the engine is not live: post no transfer to it.
    fn read(&self, py: Python<'_>) -> PyResult<Read> {
        guarded(&self.inner, py, self.inner.begin_read_owned())
    }

    /// Starts a write (push mode: this process writes into the engine's
    /// memory, e.g. SGLang's prefill into a decode). The same guard as a
    /// read, and the same rule: the engine is not released before the
    /// write ends. Raises `ReadRefused` at once when the engine is not
    /// live.
    fn write(&self, py: Python<'_>) -> PyResult<Read> {
        guarded(&self.inner, py, self.inner.begin_write_owned())
    }

    /// Accounts for a transfer already running without a guard (posted
    /// by code that bypassed yours): a guard like `read()`'s, granted on a
    /// marked engine too, so that the engine is not released before the
    /// transfer ends. Raises `ReadRefused` only when the engine is already
    /// released (`state == "released"`: end the transfer at once, its
    /// destination is not safe) or too many reads are in flight. Never
    /// use it to start a transfer.
    fn adopt_posted_read(&self, py: Python<'_>) -> PyResult<Read> {
        guarded(&self.inner, py, self.inner.adopt_posted_read())
    }

    /// Waits (GIL released) until this registration has been released:
    /// its NIXL state given back, the release call returned. `True` once
    /// released, `False` after `timeout` seconds (`None`: no limit).
    #[pyo3(signature = (timeout = None))]
    fn wait_released(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let timeout = seconds(timeout, "timeout")?;
        Ok(runtime::wait_for(py, self.inner.released(), timeout)?.is_some())
    }

    /// An awaitable that resolves once this registration has been
    /// released. Cancelling it changes nothing.
    fn released<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let released = self.inner.released();
        runtime::for_async();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            released.await;
            Ok(())
        })
    }

    /// Calls `callback(engine)` once, on the service's thread (with the
    /// GIL), when this registration has been released; at once if it
    /// already has. Keep it short and leave the agent alone in it: the
    /// decoder's own tables are best purged on its own thread (set a flag,
    /// or put the engine on a queue). An exception it raises goes to
    /// `sys.unraisablehook`.
    fn on_released(slf: Py<Self>, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        if !callback.bind(py).is_callable() {
            return Err(PyTypeError::new_err(
                "on_released takes a callable (called with the Engine once it is released)",
            ));
        }
        let released = slf.get().inner.released();
        runtime::get().spawn(async move {
            released.await;
            Python::attach(|py| {
                if let Err(e) = callback.call1(py, (slf,)) {
                    e.write_unraisable(py, Some(&callback.into_bound(py)));
                }
            });
        });
        Ok(())
    }

    /// Reports how a transfer from this registration ended, for
    /// transfers not tracked with `read()`: a raw `nixl_status_t` (int),
    /// a NIXL exception, or `"DONE"`. REMOTE_DISCONNECT (-10) marks the
    /// engine unreachable; other errors are counted, never a release.
    fn report_transfer(&self, status: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.report_transfer(status_of(status)?);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "Engine(id={:?}, address={:?}, state={:?}, reads_in_flight={})",
            self.inner.id().as_str(),
            self.identity.address,
            self.inner.state().as_str(),
            self.inner.reads_in_flight()
        )
    }
}

/// One read in flight. Leaving its `with` block ends it; `finish(status)`
/// ends it with the transfer's raw status.
#[pyclass(module = "nixl_keepalive._native", frozen)]
pub(crate) struct Read {
    guard: Mutex<Option<OwnedTransferGuard>>,
    engine: EngineRef,
}

impl Read {
    fn take(&self) -> Option<OwnedTransferGuard> {
        self.guard.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

#[pymethods]
impl Read {
    /// The engine id this read is from.
    #[getter]
    fn engine(&self) -> &str {
        self.engine.id().as_str()
    }

    /// Whether the service has failed this engine's reads: abandon the
    /// transfer (`release_xfer_handle`) and fail or recompute its request.
    #[getter]
    fn failed(&self) -> bool {
        self.engine.reads_failed()
    }

    /// Whether the read is still open.
    #[getter]
    fn open(&self) -> bool {
        self.guard
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Ends the read with the raw status its transfer ended with: an int
    /// (`nixl_keepalive.xfer_status(agent, handle)`), the NIXL exception
    /// `transfer`/`make_prepped_xfer` raised, or `"DONE"`. The status
    /// reaches the service before the read counts as ended, so a
    /// REMOTE_DISCONNECT marks the engine before it can be released. A
    /// second call does nothing.
    ///
    /// A status that is refused (`"ERR"`, a non-NIXL exception, a wrong
    /// type) still ends the read, as a completion without a status, and
    /// then raises, saying so: a read left open would hold the engine's
    /// release until shutdown. `"PROC"` alone leaves it open (the
    /// transfer is still running): finish it later, or `give_up`.
    fn finish(&self, status: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = status.py();
        if let Ok(text) = status.cast::<pyo3::types::PyString>() {
            if text.to_cow()?.as_ref() == "PROC" {
                return Err(PyValueError::new_err(
                    "status \"PROC\" means the transfer is still in progress: the read stays \
                     open; finish it once the transfer has ended (DONE, or the raw error \
                     status), or give_up(GiveUp.TIMED_OUT / GiveUp.CANCELLED) to stop waiting",
                ));
            }
        }
        match status_of(status) {
            Ok(status) => {
                if let Some(guard) = self.take() {
                    guard.finish(status);
                }
                Ok(())
            }
            Err(refused) => {
                let ended = self.take().is_some();
                let note = if ended {
                    "the read has been ended (as a completion without a status)"
                } else {
                    "the read had already ended"
                };
                Err(PyErr::from_type(
                    refused.get_type(py),
                    format!("{}; {note}", refused.value(py)),
                ))
            }
        }
    }

    /// Gives the read up: the runtime stopped waiting for a transfer still
    /// in progress (its timeout passed: `"timed_out"`, or the request was
    /// aborted: `"cancelled"`; `nixl_keepalive.GiveUp`) and fails its
    /// request now. Not a completion: a read given up as timed out, with no
    /// other read of the engine completing meanwhile, marks the engine
    /// stalled (as if the read-stall bound had passed). The transfer still
    /// counts as in flight (the engine is not released under it): keep
    /// polling it (do not release NIXL's handle: that does not end it) and
    /// call `ended(status)` on the returned `GivenUpRead` when it stops
    /// being in progress; the destination is reusable then. `blocks`: how
    /// many destination blocks it holds, in your unit (for the snapshot and
    /// the `nixl_keepalive_given_up_blocks` gauge).
    #[pyo3(signature = (why, blocks = 0))]
    fn give_up(&self, why: &Bound<'_, PyAny>, blocks: u64) -> PyResult<GivenUpRead> {
        let why = give_up_of(why)?;
        match self.take() {
            Some(guard) => Ok(GivenUpRead {
                inner: Arc::new(guard.give_up_holding(why, blocks)),
            }),
            None => Err(PyValueError::new_err(
                "this read has already ended (finish, close or give_up): nothing to give up",
            )),
        }
    }

    /// Ends the read without a status (as leaving the `with` block does).
    fn close(&self) {
        drop(self.take());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        drop(self.take());
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "Read(engine={:?}, open={})",
            self.engine.id().as_str(),
            self.open()
        )
    }
}

/// `timeout` in seconds as a `Duration` (`None`: no limit); a negative or
/// non-number value is refused naming the argument.
pub(crate) fn seconds(value: Option<f64>, name: &str) -> PyResult<Option<Duration>> {
    match value {
        None => Ok(None),
        Some(t) if t.is_finite() && t >= 0.0 => Ok(Some(Duration::from_secs_f64(t))),
        Some(t) if t == f64::INFINITY => Ok(None),
        Some(t) => Err(PyValueError::new_err(format!(
            "{name}={t} is not accepted: seconds >= 0, or None for no limit"
        ))),
    }
}

/// Why a read was given up, from `"timed_out"` or `"cancelled"` (the
/// values of `nixl_keepalive.GiveUp`).
fn give_up_of(why: &Bound<'_, PyAny>) -> PyResult<GiveUp> {
    let accepted = "expected GiveUp.TIMED_OUT (\"timed_out\": the runtime's read timeout \
                    passed) or GiveUp.CANCELLED (\"cancelled\": aborted for the runtime's own \
                    reasons)";
    let Ok(text) = why.extract::<String>() else {
        return Err(PyTypeError::new_err(format!(
            "give_up's why must be a string; {accepted}"
        )));
    };
    match text.as_str() {
        "timed_out" => Ok(GiveUp::TimedOut),
        "cancelled" => Ok(GiveUp::Cancelled),
        other => Err(PyValueError::new_err(format!(
            "give_up: why {other:?} is not accepted; {accepted}"
        ))),
    }
}

fn destination_str(d: Destination) -> &'static str {
    match d {
        Destination::Reusable => "reusable",
        Destination::Retire => "retire",
        // Anything this binding does not know yet is not a proof that no
        // byte can land: never reuse.
        _ => "retire",
    }
}

/// A read given up while its transfer was in progress (`Read.give_up`):
/// the token of its destination buffer, and the fence on its engine (not
/// released while the transfer may run). Call `ended(status)` when the
/// transfer stops being in progress: the buffer is `"reusable"` then.
/// `abandon()` (or dropping the last reference) stops watching it: the
/// engine may then be released under the transfer, and the buffer is
/// decided when that release comes back (`"retire"`: never reuse it, keep
/// it allocated for as long as the agent lives).
#[pyclass(module = "nixl_keepalive._native", frozen)]
pub(crate) struct GivenUpRead {
    inner: Arc<nixl_keepalive::GivenUpRead>,
}

#[pymethods]
impl GivenUpRead {
    /// The engine id the read was from.
    #[getter]
    fn engine(&self) -> &str {
        self.inner.engine().as_str()
    }

    /// Why it was given up: `"timed_out"` or `"cancelled"`.
    #[getter]
    fn why(&self) -> &'static str {
        self.inner.why().as_str()
    }

    /// The transfer ended with this raw status (an int from
    /// `xfer_status`, `"DONE"`, or the NIXL exception it raised): no byte
    /// can land any more. Returns `"reusable"`. An error reaches the
    /// service as a read's does. Only the first call (or `abandon`)
    /// counts. `"PROC"` is refused: the transfer is still running.
    fn ended(&self, status: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        if let Ok(text) = status.cast::<pyo3::types::PyString>() {
            if text.to_cow()?.as_ref() == "PROC" {
                return Err(PyValueError::new_err(
                    "status \"PROC\" means the transfer is still in progress: call ended() once it \
                     has ended (DONE, or the raw error status), or abandon() to stop watching it",
                ));
            }
        }
        let status = status_of(status)?;
        Ok(destination_str(self.inner.ended(status)))
    }

    /// Stops watching the transfer without seeing it end (its handle was
    /// released, or the runtime is stopping): the engine may be released
    /// under it, and the buffer is decided when that release comes back.
    fn abandon(&self) {
        self.inner.abandon();
    }

    /// Whether the transfer is still watched (neither `ended` nor
    /// `abandon` was called).
    #[getter]
    fn watched(&self) -> bool {
        self.inner.is_watched()
    }

    /// `"reusable"` once the transfer ended; after `abandon`, `"reusable"`
    /// or `"retire"` once the engine's release has come back; `None`
    /// before (the buffer is not yours yet).
    fn try_destination(&self) -> Option<&'static str> {
        self.inner.try_destination().map(destination_str)
    }

    /// Waits (GIL released) for the release, then returns what may become
    /// of the buffer (`"reusable"` or `"retire"`); `None` after `timeout`
    /// seconds (`None`: no limit).
    #[pyo3(signature = (timeout = None))]
    fn wait_destination(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
    ) -> PyResult<Option<&'static str>> {
        let timeout = seconds(timeout, "timeout")?;
        let inner = Arc::clone(&self.inner);
        let got = runtime::wait_for(py, async move { inner.destination().await }, timeout)?;
        Ok(got.map(destination_str))
    }

    /// An awaitable of `wait_destination`'s answer (no timeout: wrap it in
    /// `asyncio.wait_for`).
    fn destination<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let inner = Arc::clone(&self.inner);
        runtime::for_async();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            Ok(destination_str(inner.destination().await))
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "GivenUpRead(engine={:?}, why={:?}, watched={}, destination={:?})",
            self.engine(),
            self.why(),
            self.inner.is_watched(),
            self.try_destination()
        )
    }
}

/// Wraps a begun transfer's guard, or raises `ReadRefused`.
fn guarded(
    engine: &nixl_keepalive::EngineRef,
    py: Python<'_>,
    begun: Result<nixl_keepalive::OwnedTransferGuard, nixl_keepalive::ReadRefused>,
) -> PyResult<Read> {
    match begun {
        Ok(guard) => Ok(Read {
            guard: Mutex::new(Some(guard)),
            engine: engine.clone(),
        }),
        Err(refused) => Err(errors::with_attrs(
            py,
            errors::ReadRefused::new_err(refused.to_string()),
            &[
                (
                    "engine",
                    pyo3::types::PyString::new(py, refused.engine.as_str()).into_any(),
                ),
                (
                    "state",
                    pyo3::types::PyString::new(py, refused.state.as_str()).into_any(),
                ),
            ],
        )),
    }
}
