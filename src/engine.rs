//! The hot path: reads in flight per engine, counted with one atomic word.
//!
//! A decoder starts a read for every KV-cache pull, so starting and ending a
//! read must not take a lock the service also takes. Each engine has an
//! [`EngineCell`] shared by the runtime's handles and the service: one
//! 64-bit word holds both the engine's state and its reads in flight, so
//! "the engine is still live, count one more read" and "no read is in
//! flight, release it" are each a single compare-and-swap and can never
//! interleave wrongly. A release can therefore never happen with a read in
//! flight, and a read can never start on an engine that is marked.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::error::ReadRefused;
use crate::transport::EngineId;
use crate::NixlStatus;

/// Where an engine is in its life, as the service sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EngineState {
    /// Registered and answering: reads may start.
    Live,
    /// A heartbeat or transfer returned REMOTE_DISCONNECT: UCX has failed
    /// the endpoint. Released once idle.
    Unreachable,
    /// Another engine registered at its address, or it registered again
    /// under the same id. Released once idle.
    Replaced,
    /// The router or orchestrator said it is gone. Released once idle.
    Retiring,
    /// Its NIXL state has been given back (or is being given back).
    Released,
}

impl EngineState {
    const ALL: [EngineState; 5] = [
        EngineState::Live,
        EngineState::Unreachable,
        EngineState::Replaced,
        EngineState::Retiring,
        EngineState::Released,
    ];

    /// A short lowercase name, used in logs and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineState::Live => "live",
            EngineState::Unreachable => "unreachable",
            EngineState::Replaced => "replaced",
            EngineState::Retiring => "retiring",
            EngineState::Released => "released",
        }
    }

    /// Every state, in order.
    pub fn all() -> [EngineState; 5] {
        Self::ALL
    }

    fn bits(self) -> u64 {
        (self as u64) << STATE_SHIFT
    }

    fn from_word(word: u64) -> Self {
        Self::ALL[(word >> STATE_SHIFT) as usize]
    }
}

impl fmt::Display for EngineState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

const STATE_SHIFT: u32 = 56;
const COUNT_MASK: u64 = (1 << STATE_SHIFT) - 1;

/// Messages to the service that need no resources type: what guards send
/// when they end, and the runtime's small requests.
pub(crate) enum Wake {
    /// A handshake at this address started.
    HandshakeStarted(crate::transport::PeerAddr),
    /// A handshake at this address finished (its guard dropped).
    HandshakeFinished(crate::transport::PeerAddr),
    /// The last read of a marked registration ended: it may be released.
    Drained(u64),
    /// A read of a registration ended with this raw NIXL status (only
    /// errors are sent).
    TransferResult(u64, NixlStatus),
}

/// Registration serials: unique per process, never reused.
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

/// The state shared between the runtime's handles and the service for one
/// registration of one engine.
pub(crate) struct EngineCell {
    id: EngineId,
    serial: u64,
    word: AtomicU64,
    /// Cancelled when the service fails this engine's reads in flight.
    reads_failed: CancellationToken,
    wake: mpsc::UnboundedSender<Wake>,
}

impl EngineCell {
    pub(crate) fn new(id: EngineId, wake: mpsc::UnboundedSender<Wake>) -> Arc<Self> {
        Arc::new(EngineCell {
            id,
            serial: NEXT_SERIAL.fetch_add(1, Ordering::Relaxed),
            word: AtomicU64::new(EngineState::Live.bits()),
            reads_failed: CancellationToken::new(),
            wake,
        })
    }

    pub(crate) fn id(&self) -> &EngineId {
        &self.id
    }

    /// This registration's serial: a pinned engine id that registers again
    /// gets a new one.
    pub(crate) fn serial(&self) -> u64 {
        self.serial
    }

    pub(crate) fn state(&self) -> EngineState {
        EngineState::from_word(self.word.load(Ordering::Acquire))
    }

    pub(crate) fn reads_in_flight(&self) -> u64 {
        self.word.load(Ordering::Acquire) & COUNT_MASK
    }

    fn begin_read(self: &Arc<Self>) -> Result<ReadGuard, ReadRefused> {
        let mut word = self.word.load(Ordering::Relaxed);
        loop {
            let state = EngineState::from_word(word);
            if state != EngineState::Live {
                return Err(ReadRefused {
                    engine: self.id.clone(),
                    state,
                });
            }
            match self.word.compare_exchange_weak(
                word,
                word + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Ok(ReadGuard {
                        cell: Arc::clone(self),
                    })
                }
                Err(now) => word = now,
            }
        }
    }

    fn end_read(&self) {
        let before = self.word.fetch_sub(1, Ordering::AcqRel);
        if before & COUNT_MASK == 1 && EngineState::from_word(before) != EngineState::Live {
            // The service may be waiting for exactly this. If it has
            // stopped, nobody is waiting: ignore the closed channel.
            let _ = self.wake.send(Wake::Drained(self.serial));
        }
    }

    /// Marks a live engine with `state`, refusing new reads from now on.
    /// Returns the reads in flight at that moment, or `None` when the
    /// engine was already marked (its first mark stands).
    pub(crate) fn mark(&self, state: EngineState) -> Option<u64> {
        debug_assert!(!matches!(state, EngineState::Live | EngineState::Released));
        let mut word = self.word.load(Ordering::Acquire);
        loop {
            if EngineState::from_word(word) != EngineState::Live {
                return None;
            }
            let next = state.bits() | (word & COUNT_MASK);
            match self
                .word
                .compare_exchange(word, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(word & COUNT_MASK),
                Err(now) => word = now,
            }
        }
    }

    /// Moves a marked engine with no read in flight to `Released`. Fails
    /// (returning the reads still in flight) when a read is in flight; the
    /// last guard to drop will wake the service again.
    pub(crate) fn try_release(&self) -> Result<(), u64> {
        let word = self.word.load(Ordering::Acquire);
        let state = EngineState::from_word(word);
        debug_assert!(state != EngineState::Live, "release of a live engine");
        if word & COUNT_MASK != 0 {
            return Err(word & COUNT_MASK);
        }
        match self.word.compare_exchange(
            state.bits(),
            EngineState::Released.bits(),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => Ok(()),
            // A read cannot start on a marked engine, so the only change
            // possible is a read ending: the count is still what we saw,
            // or lower and already zero. Report what is there now.
            Err(now) => Err(now & COUNT_MASK),
        }
    }

    /// Tells every read in flight that it has failed.
    pub(crate) fn fail_reads(&self) {
        self.reads_failed.cancel();
    }
}

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
        self.cell.begin_read()
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
        self.cell.reads_failed.is_cancelled()
    }

    /// Resolves when the service fails this engine's reads. Cancel safe.
    pub fn failed(&self) -> WaitForCancellationFutureOwned {
        self.cell.reads_failed.clone().cancelled_owned()
    }

    /// Ends the read, reporting the raw NIXL status the transfer ended with
    /// (`SUCCESS`, or the error `getXferStatus`/`postXferReq` returned).
    /// Errors reach the service before the read is counted as ended, so a
    /// REMOTE_DISCONNECT marks the engine before it can be released.
    pub fn finish(self, status: NixlStatus) {
        if !status.is_ok() {
            let _ = self
                .cell
                .wake
                .send(Wake::TransferResult(self.cell.serial, status));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cell() -> (Arc<EngineCell>, mpsc::UnboundedReceiver<Wake>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (EngineCell::new(EngineId::from("p"), tx), rx)
    }

    #[test]
    fn a_marked_engine_refuses_reads_and_releases_only_when_idle() {
        let (cell, mut rx) = cell();
        let engine = EngineRef { cell: cell.clone() };
        let read = engine.begin_read().unwrap();
        assert_eq!(cell.mark(EngineState::Unreachable), Some(1));
        assert_eq!(cell.mark(EngineState::Retiring), None, "first mark stands");
        let refused = engine.begin_read().unwrap_err();
        assert_eq!(refused.state, EngineState::Unreachable);
        assert_eq!(cell.try_release(), Err(1));
        drop(read);
        assert!(matches!(rx.try_recv(), Ok(Wake::Drained(_))));
        assert_eq!(cell.try_release(), Ok(()));
        assert_eq!(engine.state(), EngineState::Released);
    }

    #[test]
    fn ending_a_read_on_a_live_engine_wakes_nobody() {
        let (cell, mut rx) = cell();
        let engine = EngineRef { cell };
        engine.begin_read().unwrap().finish(NixlStatus::SUCCESS);
        assert!(rx.try_recv().is_err());
    }
}
