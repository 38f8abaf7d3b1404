//! Metric names and the few places that record them.
//!
//! Prometheus-style names with units; the status label is the NIXL status
//! name, so a dashboard tells REMOTE_DISCONNECT from every other error.

use std::time::Duration;

use metrics::{counter, gauge, histogram};

use crate::core::Count;
use crate::event::Source;
use crate::state::EngineState;

/// Heartbeat notifications accepted by NIXL (one per agent).
pub(crate) const HEARTBEATS_SENT: &str = "nixl_keepalive_heartbeats_sent_total";
/// Heartbeat notifications that failed, by `status`.
pub(crate) const HEARTBEATS_FAILED: &str = "nixl_keepalive_heartbeats_failed_total";
/// Heartbeat rounds held back by the per-engine rate cap.
pub(crate) const HEARTBEATS_DEFERRED: &str = "nixl_keepalive_heartbeats_rate_limited_total";
/// Transfer results reported with an error, by `status`.
pub(crate) const TRANSFER_ERRORS: &str = "nixl_keepalive_transfer_errors_total";
/// Engines whose reads in flight stopped completing (hung peers), by
/// `action` (`fail` or `report`).
pub(crate) const READ_STALLS: &str = "nixl_keepalive_read_stalls_total";
/// Reads the runtime gave up while their transfer was in progress, by
/// `why` (`timed_out`, `cancelled`) and `answered` (`false`: no read of the
/// engine completed meanwhile, evidence against it).
pub(crate) const READS_GIVEN_UP: &str = "nixl_keepalive_reads_given_up_total";
/// Given-up transfers still running: their requests failed, their
/// destinations held, their engines not released until each ends.
pub(crate) const GIVEN_UP_TRANSFERS: &str = "nixl_keepalive_given_up_transfers";
/// The destination blocks those transfers hold, in the runtime's unit
/// (`TransferGuard::give_up_holding`).
pub(crate) const GIVEN_UP_BLOCKS: &str = "nixl_keepalive_given_up_blocks";
/// Seconds a given-up transfer's destination was held, from the give-up to
/// its end, by `end` (`over`: seen to end; `abandoned`: the runtime
/// stopped watching it).
pub(crate) const GIVEN_UP_HELD: &str = "nixl_keepalive_given_up_held_seconds";
/// Episodes in which engines' reads stopped completing while no engine's
/// completed: the decoder itself looked stuck and nobody was blamed.
pub(crate) const DECODER_STALLS: &str = "nixl_keepalive_decoder_stalls_total";
/// Endpoint failures the transport reported between heartbeats, by
/// `outcome`: `probed` (a live engine's agent: it got a heartbeat at
/// once), `not_live` (its engine is marked or being released already),
/// `not_held` (no engine holds that agent), `unnamed` (the transport could
/// not tell whose endpoint it was: every live engine got a heartbeat).
pub(crate) const ENDPOINT_FAILURES: &str = "nixl_keepalive_endpoint_failures_total";
/// Transport calls that panicked, by `call` (`genNotif`, `release`).
pub(crate) const TRANSPORT_PANICS: &str = "nixl_keepalive_transport_panics_total";
/// Threads of the transport calls' pool (busy and idle).
pub(crate) const TRANSPORT_THREADS: &str = "nixl_keepalive_transport_threads";
/// Transport calls in flight for `HUNG_AFTER` or more, now.
pub(crate) const TRANSPORT_CALLS_HUNG: &str = "nixl_keepalive_transport_calls_hung";
/// Transport calls counted hung, ever (each once).
pub(crate) const TRANSPORT_CALLS_HUNG_TOTAL: &str = "nixl_keepalive_transport_calls_hung_total";
/// Engines in the table, by `state`.
pub(crate) const ENGINES: &str = "nixl_keepalive_engines";
/// Releases, by `reason`.
pub(crate) const RELEASES: &str = "nixl_keepalive_releases_total";
/// Release steps that failed with something other than NOT_FOUND, by
/// `status`.
pub(crate) const RELEASE_STEPS_FAILED: &str = "nixl_keepalive_release_steps_failed_total";
/// Seconds from an engine being marked (detection) to its release.
pub(crate) const DETECTION_TO_RELEASE: &str = "nixl_keepalive_detection_to_release_seconds";
/// Reads in flight over all engines.
pub(crate) const READS_IN_FLIGHT: &str = "nixl_keepalive_reads_in_flight";
/// The worst-case seconds from a peer's crash (its process gone) to its
/// release with the settings in force: the first operation after the
/// crash sees it, so at most one heartbeat gap (plus slack) when idle;
/// longer only where IB transports are in use. +Inf with heartbeats off.
pub(crate) const DETECTION_BOUND_CRASH: &str = "nixl_keepalive_detection_bound_crashed_seconds";
/// The same for a silent peer (partition, a NIC that stops answering):
/// UCX keepalive plus the timeout of the slowest transport in use (the TCP
/// user timeout over TCP); +Inf when unbounded.
pub(crate) const DETECTION_BOUND_SILENT: &str = "nixl_keepalive_detection_bound_silent_seconds";
/// The same for a frozen peer (SIGSTOP, a deadlock) with reads in flight:
/// 1.25 read-stall bounds, or one runtime read timeout if the runtime gives
/// reads up sooner; +Inf with the read-stall check off. A frozen idle peer
/// is not bounded by the service (membership or the router retire it).
pub(crate) const DETECTION_BOUND_FROZEN: &str = "nixl_keepalive_detection_bound_frozen_seconds";
/// Identity conflicts refused (two sources claiming one agent name,
/// engine id, address or incarnation), by `kind`.
pub(crate) const IDENTITY_CONFLICTS: &str = "nixl_keepalive_identity_conflicts_total";

pub(crate) fn transport_threads(threads: usize) {
    gauge!(TRANSPORT_THREADS).set(threads as f64);
}

pub(crate) fn transport_calls_hung(now: usize) {
    gauge!(TRANSPORT_CALLS_HUNG).set(now as f64);
}

pub(crate) fn transport_calls_hung_counted(newly: u64) {
    counter!(TRANSPORT_CALLS_HUNG_TOTAL).increment(newly);
}

pub(crate) fn detection_bound(
    crashed: Option<Duration>,
    silent: Option<Duration>,
    frozen: Option<Duration>,
) {
    let secs = |d: Option<Duration>| d.map_or(f64::INFINITY, |d| d.as_secs_f64());
    gauge!(DETECTION_BOUND_CRASH).set(secs(crashed));
    gauge!(DETECTION_BOUND_SILENT).set(secs(silent));
    gauge!(DETECTION_BOUND_FROZEN).set(secs(frozen));
}

/// Records what the core counted (the core never touches the recorder).
pub(crate) fn record(count: Count) {
    match count {
        Count::HeartbeatsSent(n) => counter!(HEARTBEATS_SENT).increment(n),
        Count::HeartbeatsDeferred(n) => counter!(HEARTBEATS_DEFERRED).increment(n),
        Count::StatusError { source, status } => {
            let name = match source {
                Source::Heartbeat => HEARTBEATS_FAILED,
                Source::Transfer => TRANSFER_ERRORS,
            };
            counter!(name, "status" => status.name()).increment(1);
        }
        Count::IdentityConflict(kind) => counter!(IDENTITY_CONFLICTS, "kind" => kind).increment(1),
        Count::ReadStall(action) => counter!(READ_STALLS, "action" => action).increment(1),
        Count::ReadGivenUp { why, unanswered } => counter!(
            READS_GIVEN_UP,
            "why" => why.as_str(),
            "answered" => if unanswered { "false" } else { "true" }
        )
        .increment(1),
        Count::GivenUpEnded { over, held_for } => histogram!(
            GIVEN_UP_HELD,
            "end" => if over { "over" } else { "abandoned" }
        )
        .record(held_for.as_secs_f64()),
        Count::GivenUpHeld { transfers, blocks } => {
            gauge!(GIVEN_UP_TRANSFERS).set(transfers as f64);
            gauge!(GIVEN_UP_BLOCKS).set(blocks as f64);
        }
        Count::DecoderStuck => counter!(DECODER_STALLS).increment(1),
        Count::EndpointFailure(outcome) => {
            counter!(ENDPOINT_FAILURES, "outcome" => outcome).increment(1)
        }
        Count::TransportPanicked(call) => counter!(TRANSPORT_PANICS, "call" => call).increment(1),
        Count::Released { reason, since_mark } => {
            counter!(RELEASES, "reason" => reason.as_str()).increment(1);
            histogram!(DETECTION_TO_RELEASE).record(since_mark.as_secs_f64());
        }
        Count::ReleaseStepFailed(status) => {
            counter!(RELEASE_STEPS_FAILED, "status" => status.name()).increment(1)
        }
        Count::Census { by_state, reads } => {
            for state in EngineState::all() {
                gauge!(ENGINES, "state" => state.as_str()).set(by_state[state as usize] as f64);
            }
            gauge!(READS_IN_FLIGHT).set(reads as f64);
        }
    }
}
