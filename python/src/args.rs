//! Arguments from Python, checked at the call: each converter names the
//! argument, what it got and what is accepted, so a bad value fails where
//! it was passed (never later, on the service's thread, and never in
//! PyO3's words).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyString};

/// The Python type name of `value`, for messages.
fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// The items of a sequence argument, refusing a `str` or `bytes` (which
/// would iterate as characters or byte values) and anything not iterable.
fn items<'py>(
    value: &Bound<'py, PyAny>,
    argument: &str,
    of: &str,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if value.is_instance_of::<PyString>() || value.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "{argument} must be a sequence of {of} (a list or tuple), not one {} ({}): wrap a \
             single one in a list",
            type_name(value),
            value.repr()?
        )));
    }
    let iter = value.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "{argument} must be a sequence of {of} (a list or tuple); got {}",
            type_name(value)
        ))
    })?;
    iter.collect()
}

/// Agent names (`str`, or the UTF-8 `bytes` `add_remote_agent` returns),
/// each non-empty.
pub(crate) fn agent_names(value: &Bound<'_, PyAny>, argument: &str) -> PyResult<Vec<String>> {
    let of = "agent names (str, or the bytes add_remote_agent returns), one per remote rank";
    items(value, argument, of)?
        .iter()
        .enumerate()
        .map(|(i, a)| agent_name(a, &format!("{argument}[{i}]")))
        .collect()
}

/// One agent name: `str`, or UTF-8 `bytes`; not empty.
pub(crate) fn agent_name(value: &Bound<'_, PyAny>, argument: &str) -> PyResult<String> {
    let name = if let Ok(s) = value.cast::<PyString>() {
        s.to_cow()?.into_owned()
    } else if let Ok(b) = value.cast::<PyBytes>() {
        String::from_utf8(b.as_bytes().to_vec()).map_err(|_| {
            PyValueError::new_err(format!("{argument}: the agent name {b:?} is not UTF-8"))
        })?
    } else {
        return Err(PyTypeError::new_err(format!(
            "{argument} must be an agent name (str or bytes); got {}",
            type_name(value)
        )));
    };
    if name.is_empty() {
        return Err(PyValueError::new_err(format!(
            "{argument}: an agent name must not be empty"
        )));
    }
    Ok(name)
}

/// Prepped remote dlist handles: what NIXL's `prep_xfer_dlist` returns (a
/// `nixl_prepped_dlist_handle`, whose `_handle` is an int) or the int
/// itself. Checked here because the service hands them to
/// `release_dlist_handle` only at release, on its own thread.
pub(crate) fn dlist_handles(value: &Bound<'_, PyAny>, argument: &str) -> PyResult<Vec<Py<PyAny>>> {
    let of = "prepped dlist handles (what prep_xfer_dlist returned)";
    items(value, argument, of)?
        .into_iter()
        .enumerate()
        .map(|(i, h)| {
            let is_int =
                |v: &Bound<'_, PyAny>| v.is_instance_of::<PyInt>() && !v.is_instance_of::<PyBool>();
            let wrapped = h
                .getattr("_handle")
                .map(|inner| is_int(&inner))
                .unwrap_or(false);
            if is_int(&h) || wrapped {
                Ok(h.unbind())
            } else {
                Err(PyTypeError::new_err(format!(
                    "{argument}[{i}] must be a prepped dlist handle (the \
                     nixl_prepped_dlist_handle prep_xfer_dlist returned, or its int); got {}",
                    type_name(&h)
                )))
            }
        })
        .collect()
}

/// Lease request ids: a sequence of `str` (each id's text is checked by
/// the library).
pub(crate) fn request_ids(value: &Bound<'_, PyAny>, argument: &str) -> PyResult<Vec<String>> {
    items(value, argument, "request ids (str)")?
        .iter()
        .enumerate()
        .map(|(i, r)| match r.cast::<PyString>() {
            Ok(s) => Ok(s.to_cow()?.into_owned()),
            Err(_) => Err(PyTypeError::new_err(format!(
                "{argument}[{i}] must be a request id (str); got {}",
                type_name(r)
            ))),
        })
        .collect()
}

/// An incarnation: a whole number 0 to 2^64 - 1, or `None`.
pub(crate) fn incarnation(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    if value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>() {
        if let Ok(n) = value.extract::<u64>() {
            return Ok(Some(n));
        }
    }
    Err(PyValueError::new_err(format!(
        "incarnation={} is not accepted: a whole number 0 to {} (the prefill's start count or \
         start time), or None",
        value.repr()?,
        u64::MAX
    )))
}
