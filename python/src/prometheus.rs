//! `GET /metrics` on the control server: the service's metrics (the
//! `metrics` crate's counters, gauges and histograms the library records)
//! as Prometheus text, as `nixl-keepalive decode` serves them.
//!
//! The recorder is this extension module's own: the `metrics` crate linked
//! into it is not shared with any other extension of the process, so
//! installing it takes nothing from the runtime that embeds the package. It
//! is installed once per process, by the first `Keepalive(control=...)`,
//! before that service starts; every service of the process records into
//! it from then on (one per process is the normal case: vLLM and SGLang run
//! one per rank process).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use nixl_keepalive::control::MetricsRender;

use crate::runtime;

/// How often the recorder's upkeep drains its histograms, so that a
/// server nobody scrapes does not grow them without bound.
const UPKEEP: Duration = Duration::from_secs(5);

/// The process's recorder, or why it could not be installed.
static RECORDER: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();

/// The renderer of the process's recorder, installing it (and its upkeep
/// task, on the binding's runtime) on first use. An error only when the
/// recorder cannot be installed: its text, for the caller's refusal.
pub(crate) fn render() -> Result<MetricsRender, String> {
    let installed = RECORDER.get_or_init(|| {
        let handle = PrometheusBuilder::new()
            .install_recorder()
            .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
        let upkeep = handle.clone();
        runtime::get().spawn(async move {
            let mut every = tokio::time::interval(UPKEEP);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                upkeep.run_upkeep();
            }
        });
        Ok(handle)
    });
    let handle = installed.clone()?;
    Ok(Arc::new(move || handle.render()))
}
