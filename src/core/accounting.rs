//! What the core asks of a registration's read accounting, and nothing
//! more: the counts it decides on and the two steps it takes (a mark, a
//! release). The counting itself is shared-memory concurrency (atomic
//! words, a `membarrier`), which the driver's implementation
//! ([`crate::read_accounting::cell::EngineCell`]) keeps outside the core:
//! the core stays sans-IO, and its tests drive it with a plain, single
//! threaded accounting instead of the real one (`tests/plain.rs`).

use crate::give_up::GiveUp;
use crate::names::EngineId;
use crate::registration::RegistrationId;
use crate::state::EngineState;
use nixl_status::NixlStatus;

/// One registration's reads, as the core sees them.
pub(crate) trait ReadAccounting {
    /// The engine id the registration is of.
    fn id(&self) -> &EngineId;

    /// The registration's serial: unique per process, never reused.
    fn serial(&self) -> RegistrationId;

    /// Where the registration stands.
    fn state(&self) -> EngineState;

    /// Reads in flight now.
    fn reads_in_flight(&self) -> u64 {
        self.progress().0
    }

    /// Reads in flight and the wrapping count of reads completed (the
    /// stall check's sample).
    fn progress(&self) -> (u64, u64);

    /// Marks a live registration with `state`: no read begins from now
    /// on. The reads in flight at that moment, or `None` when it was
    /// marked already (the first mark stands).
    fn mark(&self, state: EngineState) -> Option<u64>;

    /// Moves a marked registration with no read in flight to
    /// [`EngineState::Released`]; the reads still in flight otherwise
    /// (the last to end wakes the core again).
    fn try_release(&self) -> Result<(), u64>;
}

/// What a read handle tells the core. Sent only when it matters: an error
/// status, or a read of a marked registration ending (or backing out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Wake {
    /// A read of a marked registration ended or backed out, and it may
    /// have been the last (the shared word's last one, or any of the
    /// owner's, whose counts no ender adds up alone): the core tries the
    /// release, which checks every count.
    Drained(RegistrationId),
    /// A transfer of this registration ended with this raw NIXL status
    /// (only errors are sent).
    TransferResult(RegistrationId, NixlStatus),
    /// The runtime gave up a read of this registration while its transfer
    /// was in progress. The transfer still counts as in flight until
    /// [`Wake::GivenUpEnded`].
    GivenUp {
        /// The registration.
        serial: RegistrationId,
        /// Why the runtime stopped waiting.
        why: GiveUp,
        /// No read of the engine completed while this one was in flight
        /// (the completed count was the same at its begin and its end).
        unanswered: bool,
        /// The engine's completed count when it was given up.
        done: u64,
        /// This give-up, among every give-up of the process.
        token: u64,
        /// The destination blocks the transfer holds, in the runtime's
        /// own unit (0: not said).
        blocks: u64,
    },
    /// A given-up read's transfer stopped counting as in flight: it ended
    /// (`over`), or the runtime stopped watching it (the transfer may
    /// still run: see `GivenUpRead::abandon`).
    GivenUpEnded {
        /// The registration.
        serial: RegistrationId,
        /// The give-up, as [`Wake::GivenUp`] named it.
        token: u64,
        /// The transfer was seen to end.
        over: bool,
    },
}
