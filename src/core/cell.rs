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
//! - "one read was given up" is one `fetch_sub` (it lowers the in-flight
//!   count and leaves the completed count alone: a given-up read is
//!   evidence against the engine, not a completion);
//! - "no read is in flight, release it" is one compare-and-swap.
//!
//! They can never interleave wrongly: a release never happens with a read in
//! flight, and a read never starts on a marked engine. The completed count
//! lets the core tell a slow engine (reads still completing) from a hung one
//! without another atomic on the hot path.
//!
//! # Why the completed count cannot fool the stall check
//!
//! The core compares the completed count between two of its checks; equal
//! counts mean "no completion" only if the count cannot wrap between two
//! checks. It has 36 bits (6.9 * 10^10), and the checks are at most
//! [`super::stall::MAX_STALL_CHECK_PERIOD`] (60 s) apart, so a wrap would take more
//! than 10^9 completions a second at one engine: every begin and end is an
//! atomic operation on this one word, which a core cannot do faster than a
//! few hundred million times a second (the `read_accounting` benchmark
//! measures 10 ns for a begin and an end). The in-flight count has 24 bits:
//! a 16,777,216th read in flight at one engine is refused
//! ([`BeginRefused::Full`]) instead of carrying into the state.

use crate::registration::RegistrationId;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

use crate::give_up::GiveUp;
use crate::state::EngineState;
use crate::transport::EngineId;
use crate::NixlStatus;

/// Bits 0..24: reads in flight.
const COUNT_BITS: u32 = 24;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
/// The most reads one registration may have in flight at once.
pub(crate) const MAX_READS_IN_FLIGHT: u64 = COUNT_MASK;
/// Bits 24..28: the state.
const STATE_SHIFT: u32 = COUNT_BITS;
const STATE_MASK: u64 = 0xf << STATE_SHIFT;
/// Bits 28..64: reads completed, wrapping. At the top of the word, so that
/// its overflow leaves the word instead of carrying into the state.
const DONE_SHIFT: u32 = 28;
/// How many bits the completed count has: it wraps at `2^DONE_BITS`.
pub(crate) const DONE_BITS: u32 = 64 - DONE_SHIFT;
/// Added when a read ends: one less in flight, one more completed.
const END_READ: u64 = (1 << DONE_SHIFT) - 1;

const _: () = assert!(
    EngineState::Live as u64 == 0,
    "begin_read's single comparison needs Live to be state 0"
);

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
    Drained(RegistrationId),
    /// A transfer of this registration ended with this raw NIXL status
    /// (only errors are sent).
    TransferResult(RegistrationId, NixlStatus),
    /// The runtime gave up a read of this registration while its transfer
    /// was in progress.
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
    },
}

/// Why a read was not started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BeginRefused {
    /// The engine is not live.
    State(EngineState),
    /// [`MAX_READS_IN_FLIGHT`] reads are in flight already.
    Full,
}

/// Where a cell's wake-ups go: the driver's one input channel. A trait so
/// the cell needs no type parameter (the channel carries registrations of
/// the transport's resources type).
pub(crate) trait WakeSink: Send + Sync {
    /// Delivers a wake-up; a stopped service drops it.
    fn wake(&self, wake: Wake);
}

/// Flags set once each, and one wait for them: what the runtime's handles
/// watch (a registration's reads failed, its release came back). Two
/// `CancellationToken`s without their tree, in a byte and one `Notify`:
/// two tokens were about 300 bytes of each registration's memory, two
/// flags with a `Notify` each 80.
#[derive(Default)]
pub(crate) struct Signals {
    set: AtomicU8,
    notify: Notify,
}

/// The registration's reads have been failed.
const READS_FAILED: u8 = 1;
/// The registration's release came back from the transport.
const RELEASE_DONE: u8 = 2;
/// That release ended every transfer still running to the engine: set
/// with [`RELEASE_DONE`], in the same operation.
const TRANSFERS_ENDED: u8 = 4;

impl Signals {
    /// Sets `bits`; wakes every waiter if one of them was not set yet.
    fn set(&self, bits: u8) {
        if self.set.fetch_or(bits, Ordering::AcqRel) & bits != bits {
            self.notify.notify_waiters();
        }
    }

    fn is_set(&self, bit: u8) -> bool {
        self.set.load(Ordering::Acquire) & bit != 0
    }
}

/// One of a registration's [`Signals`]: set once, waited for.
#[derive(Clone, Copy)]
pub(crate) struct Signal<'a> {
    signals: &'a Signals,
    bit: u8,
}

impl Signal<'_> {
    /// Whether it is set.
    pub(crate) fn is_set(&self) -> bool {
        self.signals.is_set(self.bit)
    }

    /// Resolves once it is set. Cancel safe. The other flag being set
    /// wakes the wait too; it checks again and keeps waiting.
    pub(crate) async fn wait(self) {
        loop {
            let notified = self.signals.notify.notified();
            tokio::pin!(notified);
            // Registered before the check: a `set` between the check and
            // the await is not missed.
            notified.as_mut().enable();
            if self.is_set() {
                return;
            }
            notified.await;
        }
    }
}

/// The state shared between the runtime's handles and the core for one
/// registration of one engine.
pub(crate) struct EngineCell {
    id: EngineId,
    serial: RegistrationId,
    word: AtomicU64,
    /// Reads failed, release done, transfers ended.
    signals: Signals,
    sink: Arc<dyn WakeSink>,
}

/// Registration serials: unique per process, never reused.
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

impl EngineCell {
    pub(crate) fn new(id: EngineId, sink: Arc<dyn WakeSink>) -> Arc<Self> {
        Arc::new(EngineCell {
            id,
            serial: RegistrationId(NEXT_SERIAL.fetch_add(1, Ordering::Relaxed)),
            word: AtomicU64::new(state_bits(EngineState::Live)),
            signals: Signals::default(),
            sink,
        })
    }

    pub(crate) fn id(&self) -> &EngineId {
        &self.id
    }

    /// This registration's serial: a pinned engine id that registers again
    /// gets a new one, so late reports of the old one never reach it.
    pub(crate) fn serial(&self) -> RegistrationId {
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
    /// Returns the completed count at that moment (read from the word the
    /// compare-and-swap replaced: no extra atomic), so that the read can
    /// tell at its end whether the engine completed anything meanwhile.
    #[inline]
    pub(crate) fn begin_read(&self) -> Result<u64, BeginRefused> {
        let mut word = self.word.load(Ordering::Relaxed);
        loop {
            // Live is state 0: one comparison finds both a marked engine
            // (state bits set) and a full count.
            if word & (STATE_MASK | COUNT_MASK) >= COUNT_MASK {
                return Err(match state_of(word) {
                    EngineState::Live => BeginRefused::Full,
                    state => BeginRefused::State(state),
                });
            }
            match self.word.compare_exchange_weak(
                word,
                word + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(word >> DONE_SHIFT),
                Err(now) => word = now,
            }
        }
    }

    /// Ends one read. Wakes the core when it was the last read of a marked
    /// registration: the core may be waiting for exactly this.
    #[inline]
    pub(crate) fn end_read(&self) {
        let before = self.word.fetch_add(END_READ, Ordering::AcqRel);
        debug_assert!(before & COUNT_MASK > 0, "a read ended that never began");
        if before & COUNT_MASK == 1 && state_of(before) != EngineState::Live {
            self.sink.wake(Wake::Drained(self.serial));
        }
    }

    /// Ends one read that the runtime gave up while its transfer was in
    /// progress: one less in flight, no completion counted. The core hears
    /// of it (with whether the engine completed anything since the read
    /// began, `done_at_begin` being what [`EngineCell::begin_read`]
    /// returned), and, as for any read, of the last read of a marked
    /// registration ending.
    pub(crate) fn give_up(&self, why: GiveUp, done_at_begin: u64) {
        let before = self.word.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before & COUNT_MASK > 0, "a read ended that never began");
        let done = before >> DONE_SHIFT;
        self.sink.wake(Wake::GivenUp {
            serial: self.serial,
            why,
            unanswered: done == done_at_begin,
            done,
        });
        if before & COUNT_MASK == 1 && state_of(before) != EngineState::Live {
            self.sink.wake(Wake::Drained(self.serial));
        }
    }

    /// Reports a transfer's error status, bound to this registration.
    #[inline]
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
        self.signals.set(READS_FAILED);
    }

    /// Set when the core has failed this registration's reads in flight.
    pub(crate) fn reads_failed(&self) -> Signal<'_> {
        Signal {
            signals: &self.signals,
            bit: READS_FAILED,
        }
    }

    /// The registration's release came back from the transport;
    /// `transfers_ended`: it ended every transfer still running to the
    /// engine.
    pub(crate) fn release_finished(&self, transfers_ended: bool) {
        // One operation: whoever sees the release done sees this too.
        let ended = if transfers_ended { TRANSFERS_ENDED } else { 0 };
        self.signals.set(RELEASE_DONE | ended);
    }

    /// Set once the release came back (see
    /// [`EngineCell::release_finished`]).
    pub(crate) fn release_done(&self) -> Signal<'_> {
        Signal {
            signals: &self.signals,
            bit: RELEASE_DONE,
        }
    }

    /// Whether the release (once done) ended the engine's transfers.
    pub(crate) fn transfers_ended(&self) -> bool {
        self.signals.is_set(TRANSFERS_ENDED)
    }

    /// Test only: `n` reads begun and completed at once.
    #[cfg(test)]
    pub(crate) fn add_completions(&self, n: u64) {
        self.word
            .fetch_add(n.wrapping_shl(DONE_SHIFT), Ordering::AcqRel);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A signal wakes whoever waits, whether they began waiting before it
    /// was set or after; setting it again changes nothing. The other
    /// signal of the same registration, set first, wakes nobody for good:
    /// they share one `Notify`.
    #[tokio::test(start_paused = true)]
    async fn a_signal_wakes_its_waiters_before_and_after_it_is_set_and_only_its_own() {
        let cell = EngineCell::new(EngineId::from("p"), Arc::new(Collect::default()));
        let early = tokio::spawn({
            let cell = cell.clone();
            async move { cell.reads_failed().wait().await }
        });
        let release = tokio::spawn({
            let cell = cell.clone();
            async move { cell.release_done().wait().await }
        });
        tokio::task::yield_now().await;
        assert!(!early.is_finished() && !cell.reads_failed().is_set());
        cell.release_finished(true);
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        assert!(release.is_finished() && cell.transfers_ended());
        assert!(
            !early.is_finished() && !cell.reads_failed().is_set(),
            "woken by the other signal, still waiting"
        );
        cell.fail_reads();
        cell.fail_reads();
        early.await.unwrap();
        assert!(cell.reads_failed().is_set());
        tokio::time::timeout(
            std::time::Duration::from_millis(1),
            cell.reads_failed().wait(),
        )
        .await
        .expect("a late waiter returns at once");
    }

    /// A release that did not end the transfers says so.
    #[test]
    fn a_release_that_left_transfers_running_says_so() {
        let cell = EngineCell::new(EngineId::from("p"), Arc::new(Collect::default()));
        cell.release_finished(false);
        assert!(cell.release_done().is_set() && !cell.transfers_ended());
        assert!(!cell.reads_failed().is_set());
    }

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
        assert_eq!(
            cell.begin_read(),
            Err(BeginRefused::State(EngineState::Unreachable))
        );
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
    fn a_given_up_read_ends_without_counting_a_completion_and_says_whether_it_was_answered() {
        let sink = Arc::new(Collect::default());
        let cell = EngineCell::new(EngineId::from("p"), sink.clone());
        let first = cell.begin_read().unwrap();
        let second = cell.begin_read().unwrap();
        cell.give_up(GiveUp::TimedOut, first);
        assert_eq!(
            cell.progress(),
            (1, 0),
            "one less in flight, none completed"
        );
        let third = cell.begin_read().unwrap();
        cell.end_read();
        // `second` began before that completion, `third`'s completion is
        // the one that ended: `second` was answered meanwhile.
        cell.give_up(GiveUp::Cancelled, second);
        assert_eq!(cell.progress(), (0, 1));
        assert_eq!(
            sink.take(),
            vec![
                Wake::GivenUp {
                    serial: cell.serial(),
                    why: GiveUp::TimedOut,
                    unanswered: true,
                    done: 0
                },
                Wake::GivenUp {
                    serial: cell.serial(),
                    why: GiveUp::Cancelled,
                    unanswered: false,
                    done: 1
                },
            ]
        );
        let _ = third;
        // The last read of a marked registration given up drains it.
        let last = cell.begin_read().unwrap();
        cell.mark(EngineState::Stalled).unwrap();
        cell.give_up(GiveUp::Cancelled, last);
        assert_eq!(
            sink.take().last(),
            Some(&Wake::Drained(cell.serial())),
            "drained after the give-up is known"
        );
        assert_eq!(cell.try_release(), Ok(()));
    }

    #[test]
    fn reads_in_flight_are_refused_at_the_limit_instead_of_carrying_into_the_state() {
        let sink = Arc::new(Collect::default());
        let cell = EngineCell::new(EngineId::from("p"), sink);
        cell.word.store(
            (MAX_READS_IN_FLIGHT - 1) | state_bits(EngineState::Live),
            Ordering::Release,
        );
        cell.begin_read().unwrap();
        assert_eq!(cell.begin_read(), Err(BeginRefused::Full));
        assert_eq!(cell.state(), EngineState::Live);
        assert_eq!(cell.reads_in_flight(), MAX_READS_IN_FLIGHT);
        cell.end_read();
        assert!(cell.begin_read().is_ok());
    }

    #[test]
    fn the_completed_count_does_not_wrap_at_2_pow_24_or_anywhere_a_check_period_could_reach() {
        let sink = Arc::new(Collect::default());
        let cell = EngineCell::new(EngineId::from("p"), sink);
        cell.begin_read().unwrap();
        cell.add_completions(1 << 24);
        assert_eq!(cell.progress(), (1, 1 << 24));
        // Wrapping needs 2^36 completions: at 10^9 a second (more than one
        // word can take), 68 s, longer than the longest check period.
        assert_eq!(DONE_BITS, 36);
        assert!(
            super::super::stall::MAX_STALL_CHECK_PERIOD.as_secs_f64() * 1e9
                < (1u64 << DONE_BITS) as f64
        );
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
