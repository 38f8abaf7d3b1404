//! What the metrics count, as the core decides it. The core never touches
//! the metrics recorder: it hands each count to the driver
//! ([`super::Action::Count`]), which records it (`telemetry::record`), so
//! the rules stay testable without a recorder and every metric is written
//! in one place.

use std::time::Duration;

use crate::event::{ReleaseReason, Source};
use crate::give_up::GiveUp;
use nixl_status::NixlStatus;

/// One thing to count.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Count {
    /// Heartbeat notifications NIXL accepted, summed over the calls whose
    /// results the core took in since the last action it handed out (one
    /// count per batch, not per heartbeat: the hot path).
    HeartbeatsSent(u64),
    /// Heartbeat rounds held back by the rate cap, summed the same way.
    HeartbeatsDeferred(u64),
    /// An error status, by where it was seen.
    StatusError { source: Source, status: NixlStatus },
    /// An identity conflict refused, by kind.
    IdentityConflict(&'static str),
    /// A stalled engine, by what was done about it.
    ReadStall(&'static str),
    /// A read the runtime gave up.
    ReadGivenUp { why: GiveUp, unanswered: bool },
    /// A given-up transfer stopped being held: seen to end (`over`) or
    /// abandoned, `held_for` after its give-up.
    GivenUpEnded { over: bool, held_for: Duration },
    /// The gauges of given-up transfers still running, and the blocks
    /// their destinations hold.
    GivenUpHeld { transfers: u64, blocks: u64 },
    /// An endpoint failure the transport reported, by what it led to
    /// (`probed`, `not_live`, `not_held`, `unnamed`).
    EndpointFailure(&'static str),
    /// A decoder-wide stall began.
    DecoderStuck,
    /// The transport panicked in `call`.
    TransportPanicked(&'static str),
    /// A registration released, `since_mark` after it was marked.
    Released {
        reason: ReleaseReason,
        since_mark: Duration,
    },
    /// One step of a release failed with `status`.
    ReleaseStepFailed(NixlStatus),
    /// The gauges: engines by state (indexed by `EngineState as usize`)
    /// and reads in flight over all of them.
    Census { by_state: [usize; 6], reads: u64 },
}

/// Counts summed inside the core and handed out as one [`Count`] each
/// when the driver next takes actions: per-heartbeat numbers, which would
/// otherwise cost an action per heartbeat.
#[derive(Debug, Default)]
pub(super) struct Summed {
    pub(super) heartbeats_sent: u64,
    pub(super) heartbeats_deferred: u64,
}

impl Summed {
    /// The next summed count to hand out, if any is pending.
    pub(super) fn take(&mut self) -> Option<Count> {
        if self.heartbeats_sent > 0 {
            return Some(Count::HeartbeatsSent(std::mem::take(
                &mut self.heartbeats_sent,
            )));
        }
        if self.heartbeats_deferred > 0 {
            return Some(Count::HeartbeatsDeferred(std::mem::take(
                &mut self.heartbeats_deferred,
            )));
        }
        None
    }
}
