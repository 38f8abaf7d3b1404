//! NIXL statuses as the Python API shows them, back to the raw
//! `nixl_status_t` the library classifies.
//!
//! NIXL's Python API (`nixl_cu12` 1.5.1 and the `nixl` meta package)
//! shows a failure in two ways, and loses it in a third:
//!
//! - its calls raise one exception class per status
//!   (`nixlRemoteDisconnectError`, `nixlNotFoundError`,
//!   `nixlBackendError`, ...): [`classify`] maps the class back to its raw
//!   status by name (the classes live in whichever NIXL package the caller
//!   imported, so they are matched by name along the class's MRO);
//! - the raw agent (`agent.agent`) returns a `nixl_status_t` from
//!   `getXferStatus` / `postXferReq`: [`status_of`] takes its integer;
//! - `check_xfer_state` and `transfer` collapse every error to `"ERR"`:
//!   refused by [`status_of`], with the way to get the raw status
//!   ([`xfer_status`]).

use nixl_keepalive::NixlStatus;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyType;

/// NIXL's Python exception classes and the raw status each stands for.
const EXCEPTIONS: &[(&str, NixlStatus)] = &[
    (
        "nixlRemoteDisconnectError",
        NixlStatus::ERR_REMOTE_DISCONNECT,
    ),
    ("nixlNotFoundError", NixlStatus::ERR_NOT_FOUND),
    ("nixlBackendError", NixlStatus::ERR_BACKEND),
    ("nixlInvalidParamError", NixlStatus::ERR_INVALID_PARAM),
    ("nixlNotPostedError", NixlStatus::ERR_NOT_POSTED),
    ("nixlMismatchError", NixlStatus::ERR_MISMATCH),
    ("nixlNotAllowedError", NixlStatus::ERR_NOT_ALLOWED),
    ("nixlRepostActiveError", NixlStatus::ERR_REPOST_ACTIVE),
    ("nixlUnknownError", NixlStatus::ERR_UNKNOWN),
    ("nixlNotSupportedError", NixlStatus::ERR_NOT_SUPPORTED),
    ("nixlCancelledError", NixlStatus::ERR_CANCELED),
    ("nixlCanceledError", NixlStatus::ERR_CANCELED),
    ("nixlNoTelemetryError", NixlStatus::ERR_NO_TELEMETRY),
];

/// What a Python exception from a NIXL call was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Classified {
    /// A NIXL error: its raw status.
    Nixl(NixlStatus),
    /// Not a NIXL error (a broken agent object, a bug): its text. Never
    /// turned into a made-up NIXL status.
    Other(String),
}

/// The raw status of NIXL exception class `ty`, by name along its MRO.
fn status_of_class(ty: &Bound<'_, PyType>) -> Option<NixlStatus> {
    let mro = ty.mro();
    for class in mro.iter() {
        let Ok(class) = class.cast_into::<PyType>() else {
            continue;
        };
        let Ok(name) = class.name() else { continue };
        let Ok(name) = name.to_str() else { continue };
        if let Some((_, status)) = EXCEPTIONS.iter().find(|(n, _)| *n == name) {
            return Some(*status);
        }
    }
    None
}

/// Classifies an exception raised by a call on the caller's NIXL agent.
pub(crate) fn classify(py: Python<'_>, err: &PyErr) -> Classified {
    match status_of_class(&err.get_type(py)) {
        Some(status) => Classified::Nixl(status),
        None => Classified::Other(err.to_string()),
    }
}

/// A status the caller reports: an `int` (or anything with `__index__`,
/// like NIXL's `nixl_status_t`), a NIXL exception (instance or class),
/// or `"DONE"`. `"ERR"` and `"PROC"` are refused: the first is
/// `check_xfer_state`'s collapsed error, the second no end at all.
pub(crate) fn status_of(value: &Bound<'_, PyAny>) -> PyResult<NixlStatus> {
    let py = value.py();
    // The hot path: a plain int, checked without raising anything.
    if value.is_exact_instance_of::<pyo3::types::PyInt>() {
        if let Ok(raw) = value.extract::<i32>() {
            return Ok(NixlStatus::from_raw(raw));
        }
    }
    if let Ok(text) = value.cast::<pyo3::types::PyString>() {
        let text = text.to_cow()?;
        return match text.as_ref() {
            "DONE" => Ok(NixlStatus::SUCCESS),
            "ERR" => Err(PyValueError::new_err(
                "status \"ERR\" is check_xfer_state()'s collapsed error: the raw status is lost \
                 (REMOTE_DISCONNECT reads as any other error); pass the raw status instead: \
                 nixl_keepalive.xfer_status(agent, handle), or the NIXL exception the call raised",
            )),
            "PROC" => Err(PyValueError::new_err(
                "status \"PROC\" means the transfer is still in progress: report it once it has \
                 ended (DONE, or the raw error status)",
            )),
            other => Err(PyValueError::new_err(format!(
                "status {other:?} is not accepted; expected a raw nixl_status_t (int), a NIXL \
                 exception, or \"DONE\""
            ))),
        };
    }
    if value.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err(
            "a status must be a raw nixl_status_t (int), not a bool",
        ));
    }
    if let Ok(raw) = value.extract::<i32>() {
        return Ok(NixlStatus::from_raw(raw));
    }
    if value.is_instance_of::<pyo3::types::PyInt>() {
        // An int, but not one a nixl_status_t can hold.
        return Err(PyValueError::new_err(format!(
            "status {value} is out of range: a raw nixl_status_t is a 32-bit int              ({} to {}; NIXL's are 0 and the small negative codes)",
            i32::MIN,
            i32::MAX
        )));
    }
    if let Ok(index) = value.call_method0("__index__") {
        if let Ok(raw) = index.extract::<i32>() {
            return Ok(NixlStatus::from_raw(raw));
        }
    }
    let class = if let Ok(ty) = value.cast::<PyType>() {
        Some(ty.clone())
    } else if value.is_instance_of::<pyo3::exceptions::PyBaseException>() {
        Some(value.get_type())
    } else {
        None
    };
    if let Some(class) = class {
        if let Some(status) = status_of_class(&class) {
            return Ok(status);
        }
        return Err(PyValueError::new_err(format!(
            "{} is not a NIXL error: only NIXL's exceptions (nixlRemoteDisconnectError, \
             nixlBackendError, ...) carry a status",
            class.name().map(|n| n.to_string()).unwrap_or_default()
        )));
    }
    let _ = py;
    Err(PyTypeError::new_err(format!(
        "a status must be a raw nixl_status_t (int), a NIXL exception, or \"DONE\"; got {}",
        value
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    )))
}

/// The name of raw NIXL status `status` (`NIXL_ERR_REMOTE_DISCONNECT`).
#[pyfunction]
pub(crate) fn status_name(status: i32) -> &'static str {
    NixlStatus::from_raw(status).name()
}

/// The raw status a NIXL exception stands for (`None`: not a NIXL error).
#[pyfunction]
pub(crate) fn classify_exception(exc: &Bound<'_, PyAny>) -> Option<i32> {
    let ty = match exc.cast::<PyType>() {
        Ok(ty) => ty.clone(),
        Err(_) => exc.get_type(),
    };
    status_of_class(&ty).map(NixlStatus::raw)
}

/// The raw status of transfer `handle` on `agent` (a `nixl_agent`):
/// `agent.agent.getXferStatus(handle._handle)`, where `check_xfer_state`
/// would collapse every error to `"ERR"`. 0 is done, 1 in progress, a
/// negative value the error (`-10`: REMOTE_DISCONNECT). A NIXL exception
/// the call raises is returned as its status.
#[pyfunction]
pub(crate) fn xfer_status(agent: &Bound<'_, PyAny>, handle: &Bound<'_, PyAny>) -> PyResult<i32> {
    let py = agent.py();
    let raw_agent = agent.getattr("agent")?;
    let raw_handle = handle
        .getattr("_handle")
        .or_else(|_| Ok::<_, PyErr>(handle.clone()))?;
    match raw_agent.call_method1("getXferStatus", (raw_handle,)) {
        Ok(status) => Ok(status_of(&status)?.raw()),
        Err(e) => match classify(py, &e) {
            Classified::Nixl(status) => Ok(status.raw()),
            Classified::Other(_) => Err(e),
        },
    }
}
