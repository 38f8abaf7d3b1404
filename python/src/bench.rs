//! Rust baselines for `python/bench/bench_keepalive.py`: the same
//! operations the benchmark times from Python, done from Rust in the same
//! process and run, so the ratio is what the binding costs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_keepalive::{
    AgentName, Config, EngineId, NixlStatus, PeerAddr, Registration, ReleaseStep, Transfers,
    Transport, TransportError,
};
use pyo3::prelude::*;

use crate::engine::Engine;
use crate::runtime;

/// `n` reads of `engine` begun and finished with SUCCESS, from Rust, with
/// the GIL released: the seconds they took.
#[pyfunction]
pub(crate) fn bench_read_guards(py: Python<'_>, engine: &Engine, n: u64) -> f64 {
    let e = engine.inner.clone();
    py.detach(move || {
        let start = Instant::now();
        for _ in 0..n {
            if let Ok(r) = e.begin_read() {
                r.finish(NixlStatus::SUCCESS);
            }
        }
        start.elapsed().as_secs_f64()
    })
}

/// A transport that counts notifications and does nothing else.
#[derive(Default)]
struct Counting {
    notified: AtomicU64,
}

impl Transport for Counting {
    type Resources = ();
    fn notify(&self, _: &AgentName, _: &[u8]) -> Result<(), TransportError> {
        self.notified.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn release_with(&self, _: &EngineId, _: &[AgentName], _: (), _: Transfers) -> Vec<ReleaseStep> {
        Vec::new()
    }
}

/// Runs the service over a Rust no-op transport with `engines` engines (one
/// agent each) heartbeated every `interval` seconds (no jitter) for
/// `seconds`, on the binding's runtime; returns the heartbeats sent. The
/// GIL is released throughout.
#[pyfunction]
pub(crate) fn bench_service_heartbeats(
    py: Python<'_>,
    engines: usize,
    interval: f64,
    seconds: f64,
) -> PyResult<u64> {
    let config = Config::builder()
        .heartbeat_interval(Some(Duration::from_secs_f64(interval)))
        .jitter(Duration::ZERO)
        .rate_limit(Duration::from_secs_f64(interval), 2)
        .metrics_period(None)
        .build()
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    let transport = Arc::new(Counting::default());
    let t = transport.clone();
    let rt = runtime::get();
    let sent = py.detach(move || {
        rt.block_on(async move {
            let shutdown = tokio_util::sync::CancellationToken::new();
            let (handle, task) = nixl_keepalive::spawn(t.clone(), config, shutdown.clone());
            for i in 0..engines {
                let _ = handle
                    .register(Registration {
                        incarnation: None,
                        engine: EngineId::from(format!("bench-rust-{i}")),
                        address: PeerAddr::from(format!("bench-rust:{i}")),
                        agents: vec![AgentName::from(format!("bench-rust-{i}-rank0"))],
                        resources: (),
                    })
                    .await;
            }
            let start = t.notified.load(Ordering::Relaxed);
            tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
            let sent = t.notified.load(Ordering::Relaxed) - start;
            shutdown.cancel();
            let _ = task.await;
            sent
        })
    });
    let _ = transport;
    Ok(sent)
}
