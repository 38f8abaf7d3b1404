//! The package's exceptions. Each carries, as attributes, what a caller
//! needs to act on it (the refused registration's dlist handles, the
//! engine and its state, every refused configuration value).

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

create_exception!(
    _native,
    KeepaliveError,
    PyException,
    "Base class of nixl_keepalive's errors."
);
create_exception!(
    _native,
    ConfigErrorBase,
    KeepaliveError,
    "Base of ConfigError (internal)."
);
create_exception!(
    _native,
    ServiceStopped,
    KeepaliveError,
    "The keepalive service has stopped (closed, or its task ended); nothing was done."
);
create_exception!(
    _native,
    ReadRefused,
    KeepaliveError,
    "A read was not started: the engine is no longer live (`state` says why). Nothing was \
     counted; post no transfer to it."
);
create_exception!(
    _native,
    RegistrationRefused,
    KeepaliveError,
    "The service did not take a registration. `registration` holds it whole (engine, address, \
     agents, dlist_handles): its metadata is loaded and its dlists prepped, so give them back \
     (Keepalive.give_back) or retry. `reason` says why (stopped, agent_in_use, not_this_engine, \
     invalid, service_gone)."
);
create_exception!(
    _native,
    IdentityConflict,
    KeepaliveError,
    "A handshake's claim conflicts with a registered engine (one of its agent names is held by \
     another engine, or its engine id is live at another address). Refused before anything is \
     loaded: load nothing."
);

create_exception!(
    _native,
    ReleaseHeld,
    KeepaliveError,
    "A handshake's `ready_to_load` waited its `timeout` for an older registration of the engine \
     id to be released, and transfers of it still run: reads in flight or given-up reads that \
     only the runtime ends (`Read.finish`, `GivenUpRead.ended`). Often the waiting thread is the \
     one that would end them. Nothing was loaded and the handshake has ended; `engine`, `state`, \
     `reads_in_flight`, `given_up`, `given_up_blocks`, `waited` and `why` say what holds it: end \
     those transfers (poll them), then handshake again."
);

/// `ConfigError` is also a `ValueError`: a bad value.
pub(crate) struct ConfigError;

impl ConfigError {
    pub(crate) fn new_err(message: String) -> PyErr {
        Python::attach(|py| match config_error_type(py) {
            Ok(ty) => PyErr::from_type(ty, message),
            Err(e) => e,
        })
    }
}

fn config_error_type(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyType>> {
    use std::sync::OnceLock;
    static TYPE: OnceLock<Py<pyo3::types::PyType>> = OnceLock::new();
    if let Some(t) = TYPE.get() {
        return Ok(t.bind(py).clone());
    }
    let builtins = py.import("builtins")?;
    let ty = builtins.getattr("type")?.call1((
        "ConfigError",
        (
            py.get_type::<ConfigErrorBase>(),
            py.get_type::<PyValueError>(),
        ),
        pyo3::types::PyDict::from_sequence(
            &pyo3::types::PyList::new(
                py,
                [
                    ("__module__", "nixl_keepalive._native"),
                    (
                        "__doc__",
                        "A configuration value was refused. The message names each keyword or \
                         variable, the value, why it is refused and what is accepted; `errors` \
                         lists them as dicts (variable, keyword, source, value, reason, \
                         accepted).",
                    ),
                ],
            )?
            .into_any(),
        )?,
    ))?;
    let ty = ty.cast_into::<pyo3::types::PyType>()?;
    let _ = TYPE.set(ty.clone().unbind());
    Ok(TYPE.get().expect("set").bind(py).clone())
}

/// `err` with attributes set on its instance.
pub(crate) fn with_attrs(py: Python<'_>, err: PyErr, attrs: &[(&str, Bound<'_, PyAny>)]) -> PyErr {
    let value = err.value(py);
    for (name, v) in attrs {
        if let Err(e) = value.setattr(*name, v) {
            return e;
        }
    }
    err
}

pub(crate) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KeepaliveError", py.get_type::<KeepaliveError>())?;
    m.add("ConfigError", config_error_type(py)?)?;
    m.add("ServiceStopped", py.get_type::<ServiceStopped>())?;
    m.add("ReadRefused", py.get_type::<ReadRefused>())?;
    m.add("RegistrationRefused", py.get_type::<RegistrationRefused>())?;
    m.add("IdentityConflict", py.get_type::<IdentityConflict>())?;
    m.add("ReleaseHeld", py.get_type::<ReleaseHeld>())?;
    Ok(())
}
