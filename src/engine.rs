//! The runtime's handles on one registration: [`EngineRef`] to start reads
//! and report transfers, [`ReadGuard`] for one read in flight. Both are
//! bound to the registration they came from, never to whatever registration
//! holds the engine id later: a late report from an old process of a
//! pinned id cannot touch its reloaded successor.

use std::fmt;
use std::sync::Arc;

use tokio_util::sync::WaitForCancellationFutureOwned;

use crate::core::EngineCell;
use crate::error::ReadRefused;
use crate::state::EngineState;
use crate::transport::EngineId;
use crate::NixlStatus;

/// A registered engine, as the decoder runtime holds it. Cheap to clone.
///
/// Keep it beside the engine's cached layout: starting a read through it
/// touches one atomic and nothing else.
#[derive(Clone)]
pub struct EngineRef {
    pub(crate) cell: Arc<EngineCell>,
}

impl EngineRef {
    /// The engine's id.
    pub fn id(&self) -> &EngineId {
        self.cell.id()
    }

    /// Whether `other` is a reference to this very registration (not just
    /// to the same engine id: a pinned id loaded again is another
    /// registration).
    pub fn same_registration(&self, other: &EngineRef) -> bool {
        Arc::ptr_eq(&self.cell, &other.cell)
    }

    /// The engine's state now.
    pub fn state(&self) -> EngineState {
        self.cell.state()
    }

    /// Reads from this engine in flight now.
    pub fn reads_in_flight(&self) -> u64 {
        self.cell.reads_in_flight()
    }

    /// Starts a read from this engine. Hold the guard for as long as the
    /// transfer may touch the engine's memory (until it is DONE, failed, or
    /// released); the service will not release the engine before.
    ///
    /// Fails at once, without waiting, when the engine is unreachable,
    /// replaced, retiring or released: a decoder must not post a transfer
    /// to it.
    pub fn begin_read(&self) -> Result<ReadGuard, ReadRefused> {
        match self.cell.begin_read() {
            Ok(()) => Ok(ReadGuard {
                cell: Arc::clone(&self.cell),
            }),
            Err(state) => Err(ReadRefused {
                engine: self.id().clone(),
                state,
            }),
        }
    }

    /// Reports how a transfer from this registration ended, for transfers
    /// not tracked with a [`ReadGuard`] (use [`ReadGuard::finish`]
    /// otherwise). Successes are not sent anywhere.
    pub fn report_transfer(&self, status: NixlStatus) {
        self.cell.report(status);
    }

    /// Whether the service has failed this registration's reads.
    pub fn reads_failed(&self) -> bool {
        self.cell.reads_failed().is_cancelled()
    }
}

impl fmt::Debug for EngineRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineRef")
            .field("engine", self.id())
            .field("state", &self.state())
            .field("reads_in_flight", &self.reads_in_flight())
            .finish()
    }
}

/// One read in flight. Dropping it ends the read.
///
/// Report how the transfer ended with [`ReadGuard::finish`]: a
/// REMOTE_DISCONNECT result is how production learns of most dead peers.
#[must_use = "dropping the guard ends the read at once"]
pub struct ReadGuard {
    cell: Arc<EngineCell>,
}

impl ReadGuard {
    /// The engine this read is from.
    pub fn engine(&self) -> &EngineId {
        self.cell.id()
    }

    /// Whether the service has failed this engine's reads (the peer is
    /// unreachable, or it was declared gone in `fail` mode). The transfer
    /// should be abandoned and its request failed or recomputed.
    pub fn is_failed(&self) -> bool {
        self.cell.reads_failed().is_cancelled()
    }

    /// Resolves when the service fails this engine's reads. Cancel safe.
    pub fn failed(&self) -> WaitForCancellationFutureOwned {
        self.cell.reads_failed().clone().cancelled_owned()
    }

    /// Ends the read, reporting the raw NIXL status the transfer ended with
    /// (`SUCCESS`, or the error `getXferStatus`/`postXferReq` returned).
    /// An error reaches the service before the read is counted as ended,
    /// so a REMOTE_DISCONNECT marks the engine before it can be released.
    pub fn finish(self, status: NixlStatus) {
        self.cell.report(status);
        drop(self);
    }
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        self.cell.end_read();
    }
}

impl fmt::Debug for ReadGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadGuard")
            .field("engine", self.engine())
            .finish()
    }
}
