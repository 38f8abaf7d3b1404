//! `nixl_keepalive._native`: the keepalive service for Python decode
//! runtimes (vLLM's NixlConnector, SGLang), over the caller's own
//! `nixl_agent`.
//!
//! The service is the Rust library's, unchanged: it runs as a task on the
//! binding's own tokio runtime ([`runtime`]), on threads of its own, and
//! never takes the GIL except for the length of one call on the caller's
//! agent ([`transport`]). Python waits for the service with the GIL
//! released. The Python-facing package (`python/nixl_keepalive/`) adds the
//! context managers and iterators around these classes.
//!
//! One module, [`protocol`], holds every use of the library's handshake
//! protocol and of its events, so that a change of either lands in one
//! place.

use pyo3::prelude::*;

mod args;
// The benchmark hooks are not the API: built only with `--features bench`
// (python/bench/bench_keepalive.py says how).
#[cfg(feature = "bench")]
mod bench;
mod config;
mod control;
mod endpoints;
mod engine;
mod errors;
mod keepalive;
mod prometheus;
mod protocol;
mod runtime;
mod shared;
mod status;
mod transport;

/// The statuses the module exports as constants.
const STATUSES: &[(&str, nixl_keepalive::NixlStatus)] = {
    use nixl_keepalive::NixlStatus as S;
    &[
        ("IN_PROG", S::IN_PROG),
        ("SUCCESS", S::SUCCESS),
        ("NOT_POSTED", S::ERR_NOT_POSTED),
        ("INVALID_PARAM", S::ERR_INVALID_PARAM),
        ("BACKEND", S::ERR_BACKEND),
        ("NOT_FOUND", S::ERR_NOT_FOUND),
        ("MISMATCH", S::ERR_MISMATCH),
        ("NOT_ALLOWED", S::ERR_NOT_ALLOWED),
        ("REPOST_ACTIVE", S::ERR_REPOST_ACTIVE),
        ("UNKNOWN", S::ERR_UNKNOWN),
        ("NOT_SUPPORTED", S::ERR_NOT_SUPPORTED),
        ("REMOTE_DISCONNECT", S::ERR_REMOTE_DISCONNECT),
        ("CANCELED", S::ERR_CANCELED),
        ("NO_TELEMETRY", S::ERR_NO_TELEMETRY),
    ]
};

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    runtime::init_logging();
    // Before any nixl_agent made after this import loads NIXL's UCX plugin
    // (see `endpoints`); a bad NIXL_SYS_EP_CLOSE is refused by Keepalive().
    let _ = endpoints::install();
    m.add_class::<config::Config>()?;
    m.add_class::<keepalive::Service>()?;
    m.add_class::<protocol::Events>()?;
    m.add_class::<protocol::Handshake>()?;
    m.add_class::<engine::Engine>()?;
    m.add_class::<engine::Read>()?;
    m.add_class::<engine::GivenUpRead>()?;
    errors::add(m)?;
    m.add_function(wrap_pyfunction!(status::status_name, m)?)?;
    m.add_function(wrap_pyfunction!(status::classify_exception, m)?)?;
    m.add_function(wrap_pyfunction!(status::xfer_status, m)?)?;
    m.add_function(wrap_pyfunction!(config::knobs, m)?)?;
    m.add_function(wrap_pyfunction!(config::unknown_env_vars, m)?)?;
    m.add_function(wrap_pyfunction!(config::parse_ucx_time, m)?)?;
    m.add_function(wrap_pyfunction!(keepalive::canonical_address, m)?)?;
    m.add_function(wrap_pyfunction!(endpoints::endpoint_close_mode, m)?)?;
    m.add_function(wrap_pyfunction!(endpoints::gpu_mappings, m)?)?;
    m.add_function(wrap_pyfunction!(endpoints::remove_remote_agent_py, m)?)?;
    m.add_function(wrap_pyfunction!(endpoints::load_remote_agent_py, m)?)?;
    #[cfg(feature = "bench")]
    {
        m.add_function(wrap_pyfunction!(bench::bench_read_guards, m)?)?;
        m.add_function(wrap_pyfunction!(bench::bench_service_heartbeats, m)?)?;
    }
    // Every nixl_status_t by its short name (IN_PROG, SUCCESS,
    // REMOTE_DISCONNECT, ...): the C++ numbering, whatever NIXL package
    // the caller imported.
    for (name, status) in STATUSES {
        m.add(*name, status.raw())?;
    }
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
