//! What one transfer is: which way its bytes go ([`Direction`]), which
//! block ([`Target`]) and how it ended ([`ReadOutcome`]): the words the
//! loaded engine, the read path and the reports share.

use nixl_agent::NixlStatus;

/// Which way a transfer's bytes go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Direction {
    /// Pull mode: READ the peer's block into a local slot, check it here.
    #[default]
    Read,
    /// Push mode: WRITE a local slot into the peer's block; the peer
    /// checks it.
    Write,
}

impl Direction {
    /// `read` or `write`.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Read => "read",
            Direction::Write => "write",
        }
    }
}

/// How one transfer (a read, or a push-mode write) ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Done, and every byte matched the pattern.
    Verified,
    /// A write is done: NIXL said DONE, and its `WR:` went to the peer,
    /// which checks the bytes (push mode).
    Written,
    /// Done, but the bytes are wrong from this offset on.
    Corrupt {
        /// First differing byte.
        offset: usize,
    },
    /// NIXL refused or failed the transfer with this raw status.
    Failed(NixlStatus),
    /// Still in progress at the deadline: given up, its request kept (not
    /// released: `releaseXferReq` does not end a READ in progress, it only
    /// stops its `RD:`, measured in `cli/tests/real_buffer.rs`) to be
    /// watched to its end ([`RemoteEngine::take_running`](super::RemoteEngine::take_running)). Its landing
    /// slot stays lent to the transfer until then.
    TimedOut {
        /// The landing slot the transfer may still write.
        slot: usize,
    },
    /// The service failed the engine's reads (unreachable, stalled, gone in
    /// fail mode): given up as [`ReadOutcome::TimedOut`] is.
    Abandoned {
        /// The landing slot the transfer may still write.
        slot: usize,
    },
    /// Completed; its bytes were not checked ([`RemoteEngine::unchecked`](super::RemoteEngine::unchecked)).
    Unchecked,
    /// The engine's dlists were already released: nothing was posted.
    Released,
    /// Every landing slot was busy: nothing was posted.
    NoSlot,
}

impl ReadOutcome {
    /// The status to report to the service, when there is one.
    pub fn status(self) -> Option<NixlStatus> {
        match self {
            ReadOutcome::Verified
            | ReadOutcome::Written
            | ReadOutcome::Unchecked
            | ReadOutcome::Corrupt { .. } => Some(NixlStatus::SUCCESS),
            ReadOutcome::Failed(s) => Some(s),
            _ => None,
        }
    }

    /// The landing slot a read given up in progress left lent to its
    /// transfer: not free again until [`RemoteEngine::return_slot`](super::RemoteEngine::return_slot).
    pub fn lent_slot(self) -> Option<usize> {
        match self {
            ReadOutcome::TimedOut { slot, .. } | ReadOutcome::Abandoned { slot, .. } => Some(slot),
            _ => None,
        }
    }

    /// A short name, used as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ReadOutcome::Verified => "verified",
            ReadOutcome::Written => "written",
            ReadOutcome::Unchecked => "unchecked",
            ReadOutcome::Corrupt { .. } => "corrupt",
            ReadOutcome::Failed(_) => "failed",
            ReadOutcome::TimedOut { .. } => "timed_out",
            ReadOutcome::Abandoned { .. } => "abandoned",
            ReadOutcome::Released => "released",
            ReadOutcome::NoSlot => "no_slot",
        }
    }
}

/// Where one transfer goes: block `block` of rank `rank` of the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// The peer's rank.
    pub rank: u16,
    /// The block of that rank.
    pub block: u32,
}
