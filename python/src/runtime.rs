//! The binding's tokio runtime, and how Python threads wait on it.
//!
//! One runtime per process, made at first use and dedicated to this
//! package: one worker thread (`nixl-keepalive`) runs every service's
//! driver task, and the blocking pool runs the transport calls (the
//! library's offload queue). The Python application's own threads and
//! event loop are never used: a model step that holds the GIL for 100 ms
//! delays a transport call that needs the GIL, never the driver, its
//! timers or another engine's call already inside Python.
//!
//! Python threads wait on the runtime with the GIL released
//! ([`wait`]), in slices, checking for signals between them, so a
//! Ctrl-C still interrupts a Python thread waiting for the service.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;
use tokio::runtime::Runtime;

/// Transport calls that may run at once (the blocking pool's cap). The
/// library's offload starts a spare worker for calls queued behind one
/// that has taken 1 ms; a transport call waiting for the GIL looks like
/// that, and more threads do not help there (they all wait for the same
/// lock), so the pool is capped well below tokio's default of 512.
pub(crate) const MAX_CALL_THREADS: usize = 32;

/// How long one slice of a Python thread's wait lasts before signals are
/// checked.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// The runtime, made at first use.
pub(crate) fn get() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(MAX_CALL_THREADS)
            .thread_name("nixl-keepalive")
            .enable_all()
            .build()
            .expect("nixl_keepalive: cannot start its tokio runtime");
        rt
    })
}

/// The runtime, also made the one Python awaitables of this package run
/// on.
pub(crate) fn for_async() -> &'static Runtime {
    static ONCE: OnceLock<()> = OnceLock::new();
    let rt = get();
    ONCE.get_or_init(|| {
        // Err: already set, by this same call in another thread.
        let _ = pyo3_async_runtimes::tokio::init_with_runtime(rt);
    });
    rt
}

/// Runs `fut` to its end on the runtime while this Python thread waits
/// with the GIL released, checking for signals (Ctrl-C) every
/// [`WAIT_SLICE`]. A signal's exception is returned; `fut` is then
/// dropped (every future handed here is cancel safe, or says what
/// dropping it does).
pub(crate) fn wait<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = get();
    let mut fut = Box::pin(fut);
    loop {
        let slice = py.detach(|| {
            rt.block_on(async { tokio::time::timeout(WAIT_SLICE, &mut fut).await.ok() })
        });
        if let Some(out) = slice {
            return Ok(out);
        }
        py.check_signals()?;
    }
}

/// Like [`wait`], giving up after `timeout` (`None`: never).
pub(crate) fn wait_for<F>(
    py: Python<'_>,
    fut: F,
    timeout: Option<Duration>,
) -> PyResult<Option<F::Output>>
where
    F: Future + Send,
    F::Output: Send,
{
    match timeout {
        None => wait(py, fut).map(Some),
        Some(t) => wait(py, async move { tokio::time::timeout(t, fut).await.ok() }),
    }
}

/// `RUST_LOG` set: the library's `tracing` logs go to stderr with that
/// filter. Unset: nothing is installed (the application may install its
/// own subscriber).
pub(crate) fn init_logging() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
}
