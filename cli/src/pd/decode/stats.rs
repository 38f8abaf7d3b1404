//! What the reads came to: the counts every read adds to ([`ReadStats`],
//! the `nixl_keepalive_pd_reads_total` metric, the logs), which the
//! `decode` command prints and the tests assert on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use nixl_keepalive::EngineId;

use super::transfer::ReadOutcome;

/// How many given-up request ids [`ReadStats`] keeps.
pub const GIVEN_UP_KEPT: usize = 10_000;

/// How many verified requests [`ReadStats`] remembers.
pub const COMPLETIONS_KEPT: usize = 4096;

/// Counts of read outcomes, all prefills together.
#[derive(Debug, Default)]
pub struct ReadStats {
    /// Reads whose bytes all matched.
    pub verified: AtomicU64,
    /// Push-mode writes done (the peer checks their bytes).
    pub written: AtomicU64,
    /// Reads that completed with wrong bytes.
    pub corrupt: AtomicU64,
    /// Reads NIXL failed.
    pub failed: AtomicU64,
    /// Reads abandoned (timed out, or failed by the service).
    pub abandoned: AtomicU64,
    /// What the given-up reads' transfers ended with, once watched to
    /// their end (`SUCCESS`: the prefill resumed; an error: it died): raw
    /// status -> count.
    pub given_up_ended: Mutex<std::collections::BTreeMap<i32, u64>>,
    /// The ids of the requests whose reads were given up (the first
    /// [`GIVEN_UP_KEPT`]), so that a prefill's late completions can be
    /// matched to them.
    pub given_up_requests: Mutex<Vec<String>>,
    /// The last [`COMPLETIONS_KEPT`] requests whose reads were verified,
    /// with when `decode` saw them done (their `RD:` had been handed to
    /// the prefill by then), to match a prefill's late completions.
    pub completions: Mutex<std::collections::VecDeque<(String, Instant)>>,
    /// Landing slots of given-up reads handed back (their transfer was
    /// seen to end).
    pub slots_returned: AtomicU64,
    /// Landing slots of given-up reads retired for good (their transfer
    /// was abandoned unwatched and may still write them).
    pub slots_retired: AtomicU64,
    /// Landing slots lent to given-up transfers now (still running).
    pub slots_lent: AtomicU64,
    /// Reads refused before posting (engine not live, released, no slot).
    pub refused: AtomicU64,
    /// Reads completed and not checked ([`DecodeOptions::check`](super::DecodeOptions::check) off).
    pub unchecked: AtomicU64,
    /// Handshakes that registered an engine.
    pub handshakes: AtomicU64,
}

/// Counts one read's outcome (stats, metrics, logs).
pub(super) fn count(
    stats: &ReadStats,
    engine: &EngineId,
    request: &str,
    rank: u16,
    block: u32,
    outcome: ReadOutcome,
) {
    let counter = match outcome {
        ReadOutcome::Verified => {
            let mut done = stats.completions.lock().unwrap_or_else(|e| e.into_inner());
            if done.len() == COMPLETIONS_KEPT {
                done.pop_front();
            }
            done.push_back((request.to_string(), Instant::now()));
            &stats.verified
        }
        ReadOutcome::Written => &stats.written,
        ReadOutcome::Unchecked => &stats.unchecked,
        ReadOutcome::Corrupt { offset } => {
            tracing::error!(%engine, rank, block, offset, "read returned wrong bytes");
            &stats.corrupt
        }
        ReadOutcome::Failed(status) => {
            tracing::debug!(%engine, %status, "read failed");
            &stats.failed
        }
        ReadOutcome::TimedOut { .. } | ReadOutcome::Abandoned { .. } => {
            tracing::info!(%engine, request, outcome = outcome.as_str(), "read given up: its request failed now, its transfer watched to its end");
            let mut ids = stats
                .given_up_requests
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if ids.len() < GIVEN_UP_KEPT {
                ids.push(request.to_string());
            }
            &stats.abandoned
        }
        ReadOutcome::Released | ReadOutcome::NoSlot => &stats.refused,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    metrics::counter!("nixl_keepalive_pd_reads_total", "outcome" => outcome.as_str()).increment(1);
}
