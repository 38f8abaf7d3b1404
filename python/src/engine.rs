//! A registered engine and a read from it, as Python holds them: thin
//! wrappers of the library's `EngineRef` and `ReadGuard`, bound to the one
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

use std::sync::Mutex;

use nixl_keepalive::{EngineRef, OwnedReadGuard};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::errors;
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
        match self.inner.begin_read_owned() {
            Ok(guard) => Ok(Read {
                guard: Mutex::new(Some(guard)),
                engine: self.inner.clone(),
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
    guard: Mutex<Option<OwnedReadGuard>>,
    engine: EngineRef,
}

impl Read {
    fn take(&self) -> Option<OwnedReadGuard> {
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
    fn finish(&self, status: &Bound<'_, PyAny>) -> PyResult<()> {
        let status = status_of(status)?;
        if let Some(guard) = self.take() {
            guard.finish(status);
        }
        Ok(())
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
