//! Reads in flight per registration, counted with one atomic word.
//!
//! A decoder starts a read for every KV-cache pull, so starting and ending a
//! read must not take a lock the service also takes. Each registration has
//! an [`EngineCell`] shared by the runtime's handles and the core: one
//! 64-bit word holds the engine's state, its reads in flight and a wrapping
//! count of reads completed, so
//! - "the engine is still live, count one more read" is one compare-and-swap;
//! - "one read ended" is one `fetch_add` (it lowers the in-flight count and
//!   raises the completed count in the same addition);
//! - "no read is in flight, release it" is one compare-and-swap.
//!
//! They can never interleave wrongly: a release never happens with a read in
//! flight, and a read never starts on a marked engine. The completed count
//! lets the core tell a slow engine (reads still completing) from a hung one
//! without another atomic on the hot path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::state::EngineState;
use crate::transport::EngineId;
use crate::NixlStatus;

/// Bits 0..36: reads in flight (64 G reads is more than any decoder has).
const COUNT_BITS: u32 = 36;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
/// Bits 36..40: the state.
const STATE_SHIFT: u32 = COUNT_BITS;
const STATE_MASK: u64 = 0xf << STATE_SHIFT;
/// Bits 40..64: reads completed, wrapping. At the top of the word, so that
/// its overflow leaves the word instead of carrying into the state.
const DONE_SHIFT: u32 = 40;
/// Added when a read ends: one less in flight, one more completed.
const END_READ: u64 = (1 << DONE_SHIFT) - 1;

fn state_bits(state: EngineState) -> u64 {
    (state as u64) << STATE_SHIFT
}

fn state_of(word: u64) -> EngineState {
    EngineState::from_index(((word & STATE_MASK) >> STATE_SHIFT) as usize)
        .expect("only EngineState values are stored")
}

/// What a read handle tells the core. Sent only when it matters: an error
/// status, or the last read of a marked registration ending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Wake {
    /// The last read of a marked registration ended: it may be released.
    Drained(u64),
    /// A transfer of this registration ended with this raw NIXL status
    /// (only errors are sent).
    TransferResult(u64, NixlStatus),
}

/// Where a cell's wake-ups go: the driver's one input channel. A trait so
/// the cell needs no type parameter (the channel carries registrations of
/// the transport's resources type).
pub(crate) trait WakeSink: Send + Sync {
    /// Delivers a wake-up; a stopped service drops it.
    fn wake(&self, wake: Wake);
}

/// The state shared between the runtime's handles and the core for one
/// registration of one engine.
pub(crate) struct EngineCell {
    id: EngineId,
    serial: u64,
    word: AtomicU64,
    /// Cancelled when the core fails this registration's reads in flight.
    reads_failed: CancellationToken,
    sink: Arc<dyn WakeSink>,
}

/// Registration serials: unique per process, never reused.
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

impl EngineCell {
    pub(crate) fn new(id: EngineId, sink: Arc<dyn WakeSink>) -> Arc<Self> {
        Arc::new(EngineCell {
            id,
            serial: NEXT_SERIAL.fetch_add(1, Ordering::Relaxed),
            word: AtomicU64::new(state_bits(EngineState::Live)),
            reads_failed: CancellationToken::new(),
            sink,
        })
    }

    pub(crate) fn id(&self) -> &EngineId {
        &self.id
    }

    /// This registration's serial: a pinned engine id that registers again
    /// gets a new one, so late reports of the old one never reach it.
    pub(crate) fn serial(&self) -> u64 {
        self.serial
    }

    pub(crate) fn state(&self) -> EngineState {
        state_of(self.word.load(Ordering::Acquire))
    }

    pub(crate) fn reads_in_flight(&self) -> u64 {
        self.word.load(Ordering::Acquire) & COUNT_MASK
    }

    /// Reads in flight and the wrapping count of reads completed, read
    /// together.
    pub(crate) fn progress(&self) -> (u64, u64) {
        let word = self.word.load(Ordering::Acquire);
        (word & COUNT_MASK, word >> DONE_SHIFT)
    }

    /// Counts one more read if the engine is live; else says why not.
    pub(crate) fn begin_read(&self) -> Result<(), EngineState> {
        let mut word = self.word.load(Ordering::Relaxed);
        loop {
            let state = state_of(word);
            if state != EngineState::Live {
                return Err(state);
            }
            match self.word.compare_exchange_weak(
                word,
                word + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => word = now,
            }
        }
    }

    /// Ends one read. Wakes the core when it was the last read of a marked
    /// registration: the core may be waiting for exactly this.
    pub(crate) fn end_read(&self) {
        let before = self.word.fetch_add(END_READ, Ordering::AcqRel);
        debug_assert!(before & COUNT_MASK > 0, "a read ended that never began");
        if before & COUNT_MASK == 1 && state_of(before) != EngineState::Live {
            self.sink.wake(Wake::Drained(self.serial));
        }
    }

    /// Reports a transfer's error status, bound to this registration.
    pub(crate) fn report(&self, status: NixlStatus) {
        if !status.is_ok() {
            self.sink.wake(Wake::TransferResult(self.serial, status));
        }
    }

    /// Marks a live engine with `state`, refusing new reads from now on.
    /// Returns the reads in flight at that moment, or `None` when the
    /// engine was already marked (its first mark stands).
    pub(crate) fn mark(&self, state: EngineState) -> Option<u64> {
        debug_assert!(!matches!(state, EngineState::Live | EngineState::Released));
        let mut word = self.word.load(Ordering::Acquire);
        loop {
            if state_of(word) != EngineState::Live {
                return None;
            }
            let next = (word & !STATE_MASK) | state_bits(state);
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
    /// last read to end wakes the core again.
    pub(crate) fn try_release(&self) -> Result<(), u64> {
        let mut word = self.word.load(Ordering::Acquire);
        loop {
            debug_assert!(
                state_of(word) != EngineState::Live,
                "release of a live engine"
            );
            if word & COUNT_MASK != 0 {
                return Err(word & COUNT_MASK);
            }
            let next = (word & !STATE_MASK) | state_bits(EngineState::Released);
            // A read cannot start on a marked engine; only a read ending
            // changes the word, and then the count is already zero.
            match self
                .word
                .compare_exchange(word, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(()),
                Err(now) => word = now,
            }
        }
    }

    /// Tells every read in flight that it has failed.
    pub(crate) fn fail_reads(&self) {
        self.reads_failed.cancel();
    }

    pub(crate) fn reads_failed(&self) -> &CancellationToken {
        &self.reads_failed
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Collects wake-ups, for tests of the cell and the core.
    #[derive(Default)]
    pub(crate) struct Collect(pub(crate) Mutex<Vec<Wake>>);

    impl WakeSink for Collect {
        fn wake(&self, wake: Wake) {
            self.0.lock().unwrap().push(wake);
        }
    }

    impl Collect {
        pub(crate) fn take(&self) -> Vec<Wake> {
            std::mem::take(&mut *self.0.lock().unwrap())
        }
    }

    #[test]
    fn a_marked_engine_refuses_reads_and_releases_only_when_idle() {
        let sink = Arc::new(Collect::default());
        let cell = EngineCell::new(EngineId::from("p"), sink.clone());
        cell.begin_read().unwrap();
        assert_eq!(cell.mark(EngineState::Unreachable), Some(1));
        assert_eq!(cell.mark(EngineState::Retiring), None, "first mark stands");
        assert_eq!(cell.begin_read(), Err(EngineState::Unreachable));
        assert_eq!(cell.try_release(), Err(1));
        cell.end_read();
        assert_eq!(sink.take(), vec![Wake::Drained(cell.serial())]);
        assert_eq!(cell.try_release(), Ok(()));
        assert_eq!(cell.state(), EngineState::Released);
    }

    #[test]
    fn ending_a_read_on_a_live_engine_wakes_nobody_and_counts_a_completion() {
        let sink = Arc::new(Collect::default());
        let cell = EngineCell::new(EngineId::from("p"), sink.clone());
        cell.begin_read().unwrap();
        cell.begin_read().unwrap();
        cell.end_read();
        assert_eq!(cell.progress(), (1, 1));
        assert!(sink.take().is_empty());
    }

    #[test]
    fn the_completed_count_wraps_without_touching_the_state_or_the_count() {
        let sink = Arc::new(Collect::default());
        let cell = EngineCell::new(EngineId::from("p"), sink);
        // Start just below the wrap, with one read in flight.
        cell.word.store(
            (((1u64 << (64 - DONE_SHIFT)) - 1) << DONE_SHIFT) | state_bits(EngineState::Live),
            Ordering::Release,
        );
        cell.begin_read().unwrap();
        cell.begin_read().unwrap();
        cell.end_read();
        assert_eq!(cell.progress(), (1, 0), "wrapped to zero");
        assert_eq!(cell.state(), EngineState::Live);
        cell.mark(EngineState::Retiring).unwrap();
        cell.end_read();
        assert_eq!(cell.try_release(), Ok(()));
        assert_eq!(cell.progress(), (0, 1));
    }
}
