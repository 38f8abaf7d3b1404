//! The service's configuration from Python: the same `NIXL_KEEPALIVE_*`
//! knobs, read by the library's own reader (`Config::from_lookup`) with
//! keyword arguments over the environment, so values, ranges, derived
//! defaults and error texts are the Rust ones.
//!
//! A keyword is the knob's name without the prefix, lowercase
//! (`interval` is `NIXL_KEEPALIVE_INTERVAL`). A value is a string in the
//! knob's own syntax (`"250ms"`, `"inf"`, `"fail"`), or, for a time knob, a
//! number of seconds (`0.25`, `math.inf`) or a `datetime.timedelta`; for a
//! count, an `int`. Every refused value, from a keyword or from the
//! environment, is listed in one `ConfigError` that names the keyword, the
//! variable, the value, why it is refused and what is accepted.

use std::collections::BTreeMap;
use std::time::Duration;

use nixl_keepalive::config::{Knob, KnobKind as Kind, KNOBS};
use nixl_keepalive::{ConfigError as RustConfigError, StallAction};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors;

/// The keyword of a knob: its name without the prefix, lowercase.
fn keyword(knob: &Knob) -> String {
    knob.env
        .trim_start_matches(nixl_keepalive::config::ENV_PREFIX)
        .to_ascii_lowercase()
}

/// A keyword's value in the knob's syntax.
fn text_of(knob: &Knob, value: &Bound<'_, PyAny>) -> PyResult<String> {
    let kw = keyword(knob);
    let refuse = |what: &str| {
        PyTypeError::new_err(format!(
            "{kw} (NIXL_KEEPALIVE_{}) takes {what}; got {}",
            kw.to_ascii_uppercase(),
            value
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    };
    if let Ok(text) = value.extract::<String>() {
        return Ok(text);
    }
    if value.is_instance_of::<pyo3::types::PyBool>() {
        if knob.kind == Kind::Switch {
            let on: bool = value.extract()?;
            return Ok(if on { "on" } else { "off" }.into());
        }
        return Err(refuse(match knob.kind {
            Kind::Time => "a time (a string such as \"250ms\", seconds, or a timedelta)",
            Kind::Count => "a whole number",
            Kind::Word => "a string",
            Kind::Switch => "a bool or \"on\"/\"off\"",
        }));
    }
    match knob.kind {
        Kind::Word => Err(refuse("a string")),
        Kind::Switch => Err(refuse("a bool or \"on\"/\"off\"")),
        Kind::Count => match value.extract::<i128>() {
            Ok(n) => Ok(n.to_string()),
            Err(_) => Err(refuse("a whole number")),
        },
        Kind::Time => {
            let seconds: f64 = if let Ok(n) = value.extract::<i128>() {
                n as f64
            } else if let Ok(f) = value.extract::<f64>() {
                f
            } else if let Ok(total) = value.call_method0("total_seconds") {
                total.extract::<f64>()?
            } else {
                return Err(refuse(
                    "a time (a string such as \"250ms\", seconds, or a timedelta)",
                ));
            };
            Ok(seconds_text(seconds))
        }
    }
}

/// Seconds in UCX syntax: `inf`, or whole nanoseconds (a negative or
/// non-number value is written as it is, for the parser to refuse with
/// its own words).
fn seconds_text(seconds: f64) -> String {
    if seconds == f64::INFINITY {
        "inf".into()
    } else if seconds.is_finite() && seconds >= 0.0 {
        format!("{}ns", (seconds * 1e9).round() as u128)
    } else {
        format!("{seconds}s")
    }
}

/// The service's configuration, validated. Build one with keyword
/// arguments (see the module docs); `env=False` ignores the environment.
#[pyclass(module = "nixl_keepalive._native", frozen)]
pub(crate) struct Config {
    pub(crate) inner: nixl_keepalive::Config,
}

#[pymethods]
impl Config {
    #[new]
    #[pyo3(signature = (*, env = true, seed = None, **kwargs))]
    fn new(
        py: Python<'_>,
        env: bool,
        seed: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Config> {
        let seed = match seed {
            None => None,
            Some(s) if s.is_none() => None,
            Some(s) => Some(seed_of(s)?),
        };
        let mut given: BTreeMap<&'static str, (String, String)> = BTreeMap::new();
        if let Some(kwargs) = kwargs {
            for (key, value) in kwargs.iter() {
                let key: String = key.extract()?;
                let Some(knob) = KNOBS.iter().find(|k| keyword(k) == key) else {
                    let accepted: Vec<String> = KNOBS.iter().map(keyword).collect();
                    return Err(PyTypeError::new_err(format!(
                        "unknown configuration keyword {key:?}; accepted: {}, env, seed",
                        accepted.join(", ")
                    )));
                };
                if value.is_none() {
                    continue;
                }
                let text = text_of(knob, &value)?;
                let shown = value.repr()?.to_string();
                given.insert(knob.env, (text, shown));
            }
        }
        let lookup = |var: &str| match given.get(var) {
            Some((text, _)) => Some(text.clone()),
            None if env => std::env::var(var).ok(),
            None => None,
        };
        match nixl_keepalive::Config::from_lookup(lookup) {
            Ok(inner) => Ok(Config {
                inner: inner.with_seed(seed),
            }),
            Err(errors) => Err(config_error(py, errors.errors(), &given)),
        }
    }

    /// The configuration in force, as the environment would spell it
    /// (`None`: disabled, `inf`), keyed by keyword.
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner;
        let d = PyDict::new(py);
        let time = |t: Option<Duration>| t.map(|t| t.as_secs_f64());
        d.set_item("interval", time(c.heartbeat_interval()))?;
        d.set_item("jitter", c.jitter().as_secs_f64())?;
        d.set_item("rate_period", c.rate_period().as_secs_f64())?;
        d.set_item("rate_burst", c.rate_burst())?;
        d.set_item("event_capacity", c.event_capacity())?;
        d.set_item("shutdown_drain", c.shutdown_drain().as_secs_f64())?;
        d.set_item("metrics_period", time(c.metrics_period()))?;
        d.set_item("read_stall", time(c.read_stall()))?;
        d.set_item(
            "read_stall_action",
            match c.stall_action() {
                StallAction::Fail => "fail",
                StallAction::Report => "report",
                // A newer action than this binding knows: its own name.
                _ => "other",
            },
        )?;
        d.set_item("endpoint_events", c.endpoint_events())?;
        d.set_item("gpu_unmap", c.gpu_unmap())?;
        d.set_item("seed", c.seed())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!("Config({})", self.inner)
    }
}

/// The jitter's seed: a whole number 0 to 2^64 - 1 (a bool, a negative
/// number or another type is a `ConfigError` naming it).
fn seed_of(value: &Bound<'_, PyAny>) -> PyResult<u64> {
    let refuse = || -> PyResult<u64> {
        Err(errors::ConfigError::new_err(format!(
            "seed={} is not accepted: a whole number 0 to {} (fixes the jitter's randomness), \
             or None for a random one",
            value.repr()?,
            u64::MAX
        )))
    };
    if value.is_instance_of::<pyo3::types::PyBool>()
        || !value.is_instance_of::<pyo3::types::PyInt>()
    {
        return refuse();
    }
    match value.extract::<u64>() {
        Ok(n) => Ok(n),
        Err(_) => refuse(),
    }
}

/// `NIXL_KEEPALIVE_*` variables set in the environment that no knob reads
/// (most likely misspelt), as the Rust service logs them at start-up.
#[pyfunction]
pub(crate) fn unknown_env_vars() -> Vec<String> {
    nixl_keepalive::Config::unknown_env_vars()
}

/// One `ConfigError` for every refused value.
fn config_error(
    py: Python<'_>,
    refused: &[RustConfigError],
    given: &BTreeMap<&'static str, (String, String)>,
) -> PyErr {
    let mut lines = Vec::new();
    let details = PyList::empty(py);
    for e in refused {
        let setting = e.setting();
        let knob = KNOBS.iter().find(|k| k.env == setting);
        let kw = knob.map(keyword).unwrap_or_default();
        let (source, line) = match given.get(setting) {
            Some((_, shown)) => ("keyword", format!("keyword argument {kw}={shown}: {e}")),
            None => ("environment", format!("environment: {e}")),
        };
        let (value, reason, expected) = match e {
            RustConfigError::Env {
                value,
                reason,
                expected,
                ..
            } => (value.clone(), reason.clone(), *expected),
            RustConfigError::Invalid {
                value,
                reason,
                expected,
                ..
            } => (value.clone(), reason.clone(), *expected),
            // A refusal this binding does not know yet: its own words.
            other => (String::new(), other.to_string(), ""),
        };
        let d = PyDict::new(py);
        let _ = d.set_item("variable", setting);
        let _ = d.set_item("keyword", &kw);
        let _ = d.set_item("source", source);
        let _ = d.set_item("value", value);
        let _ = d.set_item("reason", reason);
        let _ = d.set_item("accepted", expected);
        let _ = details.append(d);
        lines.push(line);
    }
    let message = match lines.as_slice() {
        [one] => one.clone(),
        all => format!(
            "{} configuration values are not accepted:\n  - {}",
            all.len(),
            all.join("\n  - ")
        ),
    };
    errors::with_attrs(
        py,
        errors::ConfigError::new_err(message),
        &[("errors", details.into_any())],
    )
}

/// Every knob: keyword, variable, default, syntax, meaning (the README's
/// table) and kind (`time`, `count`, `word`, `switch`: what its keyword
/// takes).
#[pyfunction]
pub(crate) fn knobs(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let list = PyList::empty(py);
    for k in KNOBS {
        let d = PyDict::new(py);
        d.set_item("keyword", keyword(k))?;
        d.set_item("variable", k.env)?;
        d.set_item("default", k.default)?;
        d.set_item("syntax", k.syntax)?;
        d.set_item("meaning", k.meaning)?;
        d.set_item("kind", k.kind.as_str())?;
        list.append(d)?;
    }
    Ok(list)
}

/// `nixl_keepalive.parse_ucx_time(value)`: a UCX time string (`"5s"`,
/// `"250ms"`, `"inf"`) in seconds, `None` for `inf`, read by the same
/// parser as every time knob of the service (`nixl_keepalive::ucx::time`,
/// UCX's own syntax, checked against a real UCX), so that a connector's
/// own time knobs (the vLLM connector's `read_timeout`) accept exactly
/// what the service's do. `auto` and anything else are refused with a
/// `ValueError` that says what is accepted.
#[pyfunction]
pub(crate) fn parse_ucx_time(value: &str) -> PyResult<Option<f64>> {
    use nixl_keepalive::ucx::time::{parse_time, TimeField, UcxTime};
    match parse_time(value, TimeField::TimeUnits) {
        Ok(UcxTime::Finite(d)) => Ok(Some(d.as_secs_f64())),
        Ok(UcxTime::Infinite) => Ok(None),
        Ok(UcxTime::Auto) => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{value:?}: `auto` names no time here; {}",
            TimeField::Time.syntax_help()
        ))),
        Err(e) => Err(pyo3::exceptions::PyValueError::new_err(e.to_string())),
    }
}
