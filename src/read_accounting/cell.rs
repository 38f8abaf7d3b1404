//! Reads in flight per registration: counted by the thread that owns the
//! registration with ordinary stores, by every other thread with one
//! atomic word.
//!
//! A decoder starts a read for every KV-cache pull, so starting and ending a
//! read must not take a lock the service also takes, and on the thread
//! that does most of the reading it should not even take a locked
//! instruction (two of them, about 20 ns on this project's Intel VMs, were
//! the whole cost of a read). Each registration has an [`EngineCell`]
//! shared by the runtime's handles and the core:
//! - the *shared word* (64 bits) holds the engine's state, the reads in
//!   flight that other threads began, and a wrapping count of reads
//!   completed. "The engine is still live, count one more read" is one
//!   compare-and-swap; "one read ended" is one `fetch_add` (one less in
//!   flight, one more completed, in the same addition); "one read was
//!   given up" is one `fetch_sub` (not a completion: evidence against the
//!   engine); "no read is in flight, release it" is one compare-and-swap.
//! - the *owner's word*: the first thread to read from the registration
//!   owns it (where the kernel allows the asymmetric fence,
//!   [`super::barrier`]) and counts its own begins, ends and completions
//!   there with a load and a store, no locked instruction. A begin stores
//!   its count, then looks at the state in the shared word; a mark sets
//!   the state, then has every thread pass a full fence (`membarrier`),
//!   then looks at the owner's count. Whichever comes second sees the
//!   other: the begin sees the mark and takes its count back (and wakes
//!   the core, which may have seen it), or the mark sees the count.
//! - a read the owner began and another thread ends (its guard moved) is
//!   ended there with a `fetch_add` on a third counter, *moved*: the
//!   owner's reads in flight are its count minus moved, modulo 2^24.
//!
//! They can never interleave wrongly: after a mark, no read can start
//! (the shared word refuses, and the owner's begin sees the mark or was
//! seen by it), the counts only fall, and the release is a
//! compare-and-swap on the shared word once every count reads zero. A
//! release never happens with a read in flight, and a read never starts
//! on a marked engine. The completed count lets the core tell a slow engine
//! (reads still completing) from a hung one without another atomic on the
//! hot path.
//!
//! # Why the completed count cannot fool the stall check
//!
//! The core compares the completed count (the owner's and the shared
//! word's, added modulo 2^36) between two of its checks; equal counts mean
//! "no completion" only if the count cannot wrap between two checks. It
//! has 36 bits (6.9 * 10^10), and the checks are at most
//! `MAX_STALL_CHECK_PERIOD` (60 s, in the core's stall check) apart, so a wrap would
//! take more than 10^9 completions a second at one engine, more than one
//! thread can begin and end (the `read_accounting` benchmark measures
//! about 3 ns for a begin and an end on the owner's thread). The in-flight
//! counts have 24 bits: a 16,777,216th read in flight at one engine, on
//! either path, is refused ([`BeginRefused::Full`]) instead of carrying
//! into the state.

use crate::registration::RegistrationId;
use std::sync::atomic::{compiler_fence, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use event_listener::Event;

use super::barrier::{self, ThreadToken, NO_OWNER};
use crate::give_up::GiveUp;
use crate::state::EngineState;
use crate::transport::EngineId;
use nixl_status::NixlStatus;

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
/// One completion, in either word.
const ONE_DONE: u64 = 1 << DONE_SHIFT;
/// Added when a read ends: one less in flight, one more completed.
const END_READ: u64 = ONE_DONE - 1;
/// The completed count's bits, once shifted down.
const DONE_MASK: u64 = (1 << DONE_BITS) - 1;

/// Set in what [`EngineCell::begin_read`] returns when the read was
/// counted in the owner's word (completed counts have 36 bits, so the top
/// bit is free); the guard hands the value back at the read's end.
pub(crate) const ON_OWNER: u64 = 1 << 63;

const _: () = assert!(
    EngineState::Live as u64 == 0,
    "begin_read's single comparison needs Live to be state 0"
);

fn state_bits(state: EngineState) -> u64 {
    (state as u64) << STATE_SHIFT
}

/// Whether the word's state is `Live` (state 0: one mask, no decoding).
#[inline(always)]
fn is_live(word: u64) -> bool {
    word & STATE_MASK == 0
}

fn state_of(word: u64) -> EngineState {
    EngineState::from_index(((word & STATE_MASK) >> STATE_SHIFT) as usize)
        .expect("only EngineState values are stored")
}

/// Test only: a pause of random length at each place where the read
/// protocol's two sides can interleave, so that the race tests reach the
/// interleavings a real machine makes once in billions (a mark landing
/// between the owner's look at the state and its store, say). Off unless a
/// test turns it on; compiled out of the library.
#[cfg(test)]
pub(crate) static WIDEN_RACES: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

#[inline(always)]
fn race_window() {
    #[cfg(test)]
    if WIDEN_RACES.load(Ordering::Relaxed) {
        let spins: u32 = rand::random_range(0..512);
        if spins < 8 {
            // Off the CPU now and then, long enough for the other side to
            // run its whole step (a mark, its fence and a release).
            std::thread::sleep(std::time::Duration::from_micros(50));
        } else if spins < 32 {
            std::thread::yield_now();
        } else {
            for _ in 0..spins {
                std::hint::spin_loop();
            }
        }
    }
}

/// The owner's reads in flight: its count less the ones that ended on
/// other threads, modulo 2^24 (both wrap).
fn owner_in_flight(own: u64, moved: u32) -> u64 {
    own.wrapping_sub(u64::from(moved)) & COUNT_MASK
}

/// Reads completed on both paths (the owner's word and the shared word,
/// which also counts the owner's reads that ended elsewhere), modulo
/// 2^36.
#[inline(always)]
fn total_done(own: u64, word: u64) -> u64 {
    ((own >> DONE_SHIFT) + (word >> DONE_SHIFT)) & DONE_MASK
}

/// The owner's word with its count field set to `count`'s (modulo 2^24):
/// the count wraps within its field, never into the completed count.
fn with_count(own: u64, count: u64) -> u64 {
    (own & !COUNT_MASK) | (count & COUNT_MASK)
}

pub(crate) use crate::core::Wake;

// The proof, checked by the compiler: wrapping the completed count within
// one of the core's stall-check periods would take more than 10^9
// completions a second.
const _: () = assert!(
    crate::core::MAX_STALL_CHECK_PERIOD.as_secs() * 1_000_000_000 < 1 << DONE_BITS,
    "the completed count could wrap between two stall checks"
);

/// Give-up tokens: unique per process.
static NEXT_GIVE_UP: AtomicU64 = AtomicU64::new(1);

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
/// `CancellationToken`s without their tree, in a byte and one event: two
/// tokens were about 300 bytes of each registration's memory; the byte
/// and tokio's `Notify` 40, the byte and this event 16 (`size_of`, x86-64),
/// its waiter list allocated only once someone waits.
#[derive(Default)]
pub(crate) struct Signals {
    set: AtomicU8,
    /// Its waiters. Not tokio's `Notify`: the core holds the cell and
    /// names nothing of the runtime.
    waiters: Event,
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
            self.waiters.notify(usize::MAX);
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
            // Registered before the check: a `set` between the check and
            // the await is not missed.
            let listener = self.signals.waiters.listen();
            if self.is_set() {
                return;
            }
            listener.await;
        }
    }
}

/// The state shared between the runtime's handles and the core for one
/// registration of one engine.
pub(crate) struct EngineCell {
    id: EngineId,
    serial: RegistrationId,
    /// The shared word: state, other threads' reads in flight, their
    /// completions (and those of the owner's reads that ended elsewhere).
    word: AtomicU64,
    /// The owner's word: its reads in flight (bits 0..24, modulo 2^24, less
    /// `moved`) and completions (bits 28..64). Written only by the owner
    /// thread, with plain stores.
    own: AtomicU64,
    /// The thread that owns the registration ([`NO_OWNER`] until one
    /// reads).
    owner: AtomicU32,
    /// The owner's reads that ended on another thread (their guard moved),
    /// wrapping: subtracted from the owner's count.
    moved: AtomicU32,
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
            own: AtomicU64::new(0),
            owner: AtomicU32::new(NO_OWNER),
            moved: AtomicU32::new(0),
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

    /// Reads in flight now, on both paths.
    pub(crate) fn reads_in_flight(&self) -> u64 {
        self.progress().0
    }

    /// Reads in flight and the wrapping count of reads completed, both
    /// paths added. The owner's word is read before `moved`: a read the
    /// owner began and another thread ended between the two loads is then
    /// counted as still in flight, never as ended twice (too many, never
    /// too few).
    pub(crate) fn progress(&self) -> (u64, u64) {
        let own = self.own.load(Ordering::SeqCst);
        let moved = self.moved.load(Ordering::SeqCst);
        let word = self.word.load(Ordering::SeqCst);
        (
            (word & COUNT_MASK) + owner_in_flight(own, moved),
            total_done(own, word),
        )
    }

    /// Counts one more read if the engine is live; else says why not.
    /// Returns the completed count at that moment, [`ON_OWNER`] set when
    /// the read was counted on the owner's word (hand it back to
    /// [`EngineCell::end_read`] or [`EngineCell::give_up`]), so that the
    /// read can tell at its end whether the engine completed anything
    /// meanwhile.
    #[inline]
    pub(crate) fn begin_read(&self) -> Result<u64, BeginRefused> {
        let me = barrier::this_thread();
        let owner = self.owner.load(Ordering::Relaxed);
        if owner == me || (owner == NO_OWNER && self.claim(me)) {
            self.begin_owned()
        } else {
            self.begin_shared()
        }
    }

    /// The first thread to read owns the registration, where the kernel
    /// has the asymmetric fence. `false`: read on the shared word.
    #[cold]
    fn claim(&self, me: ThreadToken) -> bool {
        if me == barrier::NOT_AN_OWNER || !barrier::available() {
            return false;
        }
        if self
            .owner
            .compare_exchange(NO_OWNER, me, Ordering::SeqCst, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        // A mark that saw no owner sent no fence: this load, after the
        // claim in one total order with the mark's compare-and-swap and
        // its look at the owner, sees that mark; every later begin on
        // this thread then sees it too (its loads are not older).
        is_live(self.word.load(Ordering::SeqCst))
    }

    /// A begin on the owner's thread: a store, then a look at the state.
    #[inline]
    fn begin_owned(&self) -> Result<u64, BeginRefused> {
        let word = self.word.load(Ordering::Relaxed);
        if !is_live(word) {
            return Err(BeginRefused::State(state_of(word)));
        }
        let own = self.own.load(Ordering::Relaxed);
        let moved = self.moved.load(Ordering::Relaxed);
        // A stale `moved` reads as more in flight: refused early at the
        // limit, never late.
        if owner_in_flight(own, moved) >= MAX_READS_IN_FLIGHT {
            return Err(BeginRefused::Full);
        }
        race_window();
        self.own
            .store(with_count(own, own.wrapping_add(1)), Ordering::Relaxed);
        // The light side of the fence: the store above stays before the
        // load below in the program; `membarrier` in `mark` orders them
        // in the hardware.
        compiler_fence(Ordering::SeqCst);
        race_window();
        let now = self.word.load(Ordering::Relaxed);
        if !is_live(now) {
            self.back_out(own);
            return Err(BeginRefused::State(state_of(now)));
        }
        // The completed count as it was before the read counted (`word`,
        // not `now`): a completion in between counts as one during the
        // read, never the other way round.
        Ok(ON_OWNER | total_done(own, word))
    }

    /// A mark came between the owner's store and its look: the count goes
    /// back, and the core hears of it (the mark may have seen the count
    /// and be waiting for it to fall).
    #[cold]
    fn back_out(&self, own: u64) {
        self.own.store(own, Ordering::Release);
        compiler_fence(Ordering::SeqCst);
        self.sink.wake(Wake::Drained(self.serial));
    }

    /// A begin on any other thread: one compare-and-swap.
    #[inline]
    fn begin_shared(&self) -> Result<u64, BeginRefused> {
        self.count_shared(|word| {
            // Live is state 0: one comparison finds both a marked engine
            // (state bits set) and a full count.
            (word & (STATE_MASK | COUNT_MASK) >= COUNT_MASK).then(|| match state_of(word) {
                EngineState::Live => BeginRefused::Full,
                state => BeginRefused::State(state),
            })
        })
    }

    /// Counts one more transfer on the shared word unless `refuse` says
    /// why not, in one compare-and-swap loop. Returns what a begin
    /// returns.
    #[inline]
    fn count_shared(
        &self,
        refuse: impl Fn(u64) -> Option<BeginRefused>,
    ) -> Result<u64, BeginRefused> {
        // The owner's completions, read before this read counts: one that
        // lands in between is seen as a completion during the read (the
        // safe side: a give-up then does not count against the engine).
        let own = self.own.load(Ordering::Acquire);
        let mut word = self.word.load(Ordering::Relaxed);
        loop {
            if let Some(refused) = refuse(word) {
                return Err(refused);
            }
            match self.word.compare_exchange_weak(
                word,
                word + 1,
                Ordering::SeqCst,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(total_done(own, word)),
                Err(now) => word = now,
            }
        }
    }

    /// Counts a transfer that is already running: a runtime found it
    /// posted without a guard (by code that bypassed its own guard). Unlike
    /// [`EngineCell::begin_read`], a marked engine counts it too: refusing
    /// would not stop a transfer that is already running, it would only let
    /// the release go ahead under it. Refused once the engine is released
    /// (too late: the caller must treat the transfer as running on released
    /// state) or when the count is full. Always on the shared word, one
    /// compare-and-swap against [`EngineCell::try_release`]'s own: either
    /// the release sees this count and waits for it to end, or the release
    /// came first and this is refused.
    pub(crate) fn begin_posted(&self) -> Result<u64, BeginRefused> {
        self.count_shared(|word| match state_of(word) {
            EngineState::Released => Some(BeginRefused::State(EngineState::Released)),
            _ if word & COUNT_MASK == COUNT_MASK => Some(BeginRefused::Full),
            _ => None,
        })
    }

    /// Ends one read (`begun`: what [`EngineCell::begin_read`] returned).
    /// Wakes the core when the registration is marked and this may have
    /// been its last read: the core may be waiting for exactly this.
    #[inline]
    pub(crate) fn end_read(&self, begun: u64) {
        if self.end(begun, true) {
            self.sink.wake(Wake::Drained(self.serial));
        }
    }

    /// Ends one read, `completed` or not. Returns whether the core must
    /// hear that the registration may be drained: it was marked, and this
    /// was the shared word's last read or a read of the owner's (whose
    /// counts no ender can add up alone).
    #[inline]
    fn end(&self, begun: u64, completed: bool) -> bool {
        if begun & ON_OWNER == 0 {
            let before = if completed {
                self.word.fetch_add(END_READ, Ordering::SeqCst)
            } else {
                self.word.fetch_sub(1, Ordering::SeqCst)
            };
            debug_assert!(before & COUNT_MASK > 0, "a read ended that never began");
            !is_live(before) && before & COUNT_MASK == 1
        } else if self.owner.load(Ordering::Relaxed) == barrier::this_thread() {
            // On the owner's thread: a store, then a look at the state.
            let own = self.own.load(Ordering::Relaxed);
            let done = if completed { ONE_DONE } else { 0 };
            race_window();
            self.own.store(
                with_count(own.wrapping_add(done), own.wrapping_sub(1)),
                Ordering::Release,
            );
            compiler_fence(Ordering::SeqCst);
            !is_live(self.word.load(Ordering::Relaxed))
        } else {
            // The owner's read, ended elsewhere: its completion in the
            // shared word (first: never "nothing in flight" before the
            // completion is counted), its end in `moved`.
            if completed {
                self.word.fetch_add(ONE_DONE, Ordering::SeqCst);
            }
            self.moved.fetch_add(1, Ordering::SeqCst);
            !is_live(self.word.load(Ordering::SeqCst))
        }
    }

    /// Records that the runtime gave up a read while its transfer was in
    /// progress. The read stays in flight (the engine is not released
    /// under it) until [`EngineCell::end_given_up`]: a given-up transfer
    /// may still write its destination, and may still touch the engine's
    /// memory. The core hears of it (with whether the engine completed
    /// anything since the read began, `begun` being what
    /// [`EngineCell::begin_read`] returned). Returns the give-up's token.
    pub(crate) fn give_up(&self, why: GiveUp, begun: u64, blocks: u64) -> u64 {
        let (_, done) = self.progress();
        let token = NEXT_GIVE_UP.fetch_add(1, Ordering::Relaxed);
        self.sink.wake(Wake::GivenUp {
            serial: self.serial,
            why,
            unanswered: done == begun & DONE_MASK,
            done,
            token,
            blocks,
        });
        token
    }

    /// Ends a given-up read (`token`: what [`EngineCell::give_up`]
    /// returned): its transfer was seen to end (`over`, a completion when
    /// `completed`), or the runtime stopped watching it. As for any read,
    /// the core hears of the last read of a marked registration ending,
    /// after it heard of this end.
    pub(crate) fn end_given_up(&self, begun: u64, token: u64, over: bool, completed: bool) {
        let drained = self.end(begun, completed);
        self.sink.wake(Wake::GivenUpEnded {
            serial: self.serial,
            token,
            over,
        });
        if drained {
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
                .compare_exchange(word, next, Ordering::SeqCst, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(now) => word = now,
            }
        }
        race_window();
        if self.owner.load(Ordering::SeqCst) != NO_OWNER {
            // The heavy side of the fence: from here on the owner's
            // begins see the mark, and its stores so far are seen here.
            barrier::heavy();
        }
        Some(self.reads_in_flight())
    }

    /// Moves a marked engine with no read in flight to `Released`. Fails
    /// (returning the reads still in flight) when a read is in flight; the
    /// last read to end wakes the core again.
    pub(crate) fn try_release(&self) -> Result<(), u64> {
        // After the mark (and its fence) the owner's count only falls:
        // zero once is zero for good.
        let own = self.own.load(Ordering::SeqCst);
        let moved = self.moved.load(Ordering::SeqCst);
        let owned = owner_in_flight(own, moved);
        race_window();
        let mut word = self.word.load(Ordering::Acquire);
        loop {
            debug_assert!(
                state_of(word) != EngineState::Live,
                "release of a live engine"
            );
            if owned != 0 || word & COUNT_MASK != 0 {
                return Err(owned + (word & COUNT_MASK));
            }
            let next = (word & !STATE_MASK) | state_bits(EngineState::Released);
            // A read cannot start on a marked engine; a running transfer
            // adopted by `begin_posted` changes the word (this exchange then
            // fails and the loop sees its count), and so does a read
            // ending, after which the count is already zero.
            match self
                .word
                .compare_exchange(word, next, Ordering::SeqCst, Ordering::Acquire)
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

/// The core's view of the cell: the counts it decides on and its two
/// steps, each the cell's own method of the same name.
impl crate::core::ReadAccounting for EngineCell {
    fn id(&self) -> &EngineId {
        EngineCell::id(self)
    }

    fn serial(&self) -> RegistrationId {
        EngineCell::serial(self)
    }

    fn state(&self) -> EngineState {
        EngineCell::state(self)
    }

    fn reads_in_flight(&self) -> u64 {
        EngineCell::reads_in_flight(self)
    }

    fn progress(&self) -> (u64, u64) {
        EngineCell::progress(self)
    }

    fn mark(&self, state: EngineState) -> Option<u64> {
        EngineCell::mark(self, state)
    }

    fn try_release(&self) -> Result<(), u64> {
        EngineCell::try_release(self)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A signal wakes whoever waits, whether they began waiting before it
    /// was set or after; setting it again changes nothing. The other
    /// signal of the same registration, set first, wakes nobody for good:
    /// they share one waiter list.
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

    /// Collects wake-ups, for the cell's tests.
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

    /// Which word a test's reads go to.
    #[derive(Clone, Copy, Debug)]
    enum Path {
        /// This thread owns the registration.
        Owner,
        /// Another thread does: this one counts on the shared word.
        Shared,
    }

    const PATHS: [Path; 2] = [Path::Owner, Path::Shared];

    fn cell_on(path: Path, sink: Arc<Collect>) -> Arc<EngineCell> {
        let cell = EngineCell::new(EngineId::from("p"), sink);
        if let Path::Shared = path {
            cell.owner.store(barrier::NOT_AN_OWNER, Ordering::Relaxed);
        }
        cell
    }

    /// Checks that a begin went where the test says (the owner path needs
    /// the barrier: `barrier::tests` says loudly when it is missing).
    fn begin(cell: &EngineCell, path: Path) -> u64 {
        let begun = cell.begin_read().expect("live");
        let on_owner = begun & ON_OWNER != 0;
        match path {
            Path::Owner => assert!(on_owner || !barrier::available(), "{path:?}"),
            Path::Shared => assert!(!on_owner, "{path:?}"),
        }
        begun
    }

    /// A registration this thread will own, and its wake-ups; `None` (said
    /// loudly) where the kernel has no membarrier and nobody owns anything
    /// (`barrier::tests` fails CI on such a machine).
    fn owned_cell(test: &str) -> Option<(Arc<Collect>, Arc<EngineCell>)> {
        if !barrier::available() {
            eprintln!("SKIPPED: {test}: no membarrier, so no owner path");
            return None;
        }
        let sink = Arc::new(Collect::default());
        let cell = cell_on(Path::Owner, sink.clone());
        Some((sink, cell))
    }

    #[test]
    fn a_marked_engine_refuses_reads_and_releases_only_when_idle() {
        for path in PATHS {
            let sink = Arc::new(Collect::default());
            let cell = cell_on(path, sink.clone());
            let begun = begin(&cell, path);
            assert_eq!(cell.mark(EngineState::Unreachable), Some(1), "{path:?}");
            assert_eq!(cell.mark(EngineState::Retiring), None, "first mark stands");
            assert_eq!(
                cell.begin_read(),
                Err(BeginRefused::State(EngineState::Unreachable))
            );
            assert_eq!(cell.try_release(), Err(1));
            cell.end_read(begun);
            assert_eq!(sink.take(), vec![Wake::Drained(cell.serial())]);
            assert_eq!(cell.try_release(), Ok(()));
            assert_eq!(cell.state(), EngineState::Released);
        }
    }

    #[test]
    fn a_posted_transfer_adopted_on_a_marked_engine_holds_its_release() {
        for path in PATHS {
            let sink = Arc::new(Collect::default());
            let cell = cell_on(path, sink.clone());
            let begun = begin(&cell, path);
            assert_eq!(cell.mark(EngineState::Unreachable), Some(1), "{path:?}");
            // A transfer the runtime finds running without a guard: counted,
            // where a new read is refused.
            let adopted = cell.begin_posted().expect("marked, not released");
            assert_eq!(adopted & ON_OWNER, 0, "always the shared word");
            assert!(cell.begin_read().is_err());
            cell.end_read(begun);
            assert_eq!(cell.try_release(), Err(1), "the adopted transfer holds it");
            let _ = sink.take();
            cell.end_read(adopted);
            assert_eq!(sink.take(), vec![Wake::Drained(cell.serial())]);
            assert_eq!(cell.try_release(), Ok(()));
            // Released: too late to adopt anything.
            assert_eq!(
                cell.begin_posted(),
                Err(BeginRefused::State(EngineState::Released))
            );
        }
    }

    #[test]
    fn a_posted_transfer_adopted_on_a_live_engine_counts_like_a_read() {
        let sink = Arc::new(Collect::default());
        let cell = cell_on(Path::Shared, sink.clone());
        let adopted = cell.begin_posted().expect("live");
        assert_eq!(cell.progress(), (1, 0));
        cell.end_read(adopted);
        assert_eq!(cell.progress(), (0, 1));
        assert!(sink.take().is_empty(), "a live engine's end wakes nobody");
    }

    #[test]
    fn ending_a_read_on_a_live_engine_wakes_nobody_and_counts_a_completion() {
        for path in PATHS {
            let sink = Arc::new(Collect::default());
            let cell = cell_on(path, sink.clone());
            let first = begin(&cell, path);
            let _second = begin(&cell, path);
            cell.end_read(first);
            assert_eq!(cell.progress(), (1, 1), "{path:?}");
            assert!(sink.take().is_empty());
        }
    }

    #[test]
    fn a_given_up_read_counts_until_it_ends_and_says_whether_it_was_answered() {
        for path in PATHS {
            let sink = Arc::new(Collect::default());
            let cell = cell_on(path, sink.clone());
            let first = begin(&cell, path);
            let second = begin(&cell, path);
            let t1 = cell.give_up(GiveUp::TimedOut, first, 3);
            assert_eq!(
                cell.progress(),
                (2, 0),
                "still in flight, none completed ({path:?})"
            );
            let third = begin(&cell, path);
            cell.end_read(third);
            // `second` began before that completion, `third`'s completion
            // is the one that ended: `second` was answered meanwhile.
            let t2 = cell.give_up(GiveUp::Cancelled, second, 0);
            assert_ne!(t1, t2);
            assert_eq!(cell.progress(), (2, 1));
            assert_eq!(
                sink.take(),
                vec![
                    Wake::GivenUp {
                        serial: cell.serial(),
                        why: GiveUp::TimedOut,
                        unanswered: true,
                        done: 0,
                        token: t1,
                        blocks: 3,
                    },
                    Wake::GivenUp {
                        serial: cell.serial(),
                        why: GiveUp::Cancelled,
                        unanswered: false,
                        done: 1,
                        token: t2,
                        blocks: 0,
                    },
                ]
            );
            // A marked registration is fenced by its given-up reads: the
            // first is seen to end with a completion, the second is
            // abandoned, and only then may it be released.
            cell.mark(EngineState::Stalled).unwrap();
            assert_eq!(cell.try_release(), Err(2));
            cell.end_given_up(first, t1, true, true);
            assert_eq!(cell.progress(), (1, 2), "{path:?}");
            assert_eq!(cell.try_release(), Err(1));
            cell.end_given_up(second, t2, false, false);
            assert_eq!(
                cell.progress(),
                (0, 2),
                "an abandoned read completes nothing"
            );
            let wakes = sink.take();
            assert_eq!(
                wakes.last(),
                Some(&Wake::Drained(cell.serial())),
                "drained after its end is known: {wakes:?}"
            );
            assert!(wakes.contains(&Wake::GivenUpEnded {
                serial: cell.serial(),
                token: t2,
                over: false
            }));
            assert_eq!(cell.try_release(), Ok(()));
        }
    }

    #[test]
    fn reads_in_flight_are_refused_at_the_limit_instead_of_carrying_into_the_state() {
        for path in PATHS {
            let sink = Arc::new(Collect::default());
            let cell = cell_on(path, sink);
            let first = begin(&cell, path);
            // As if MAX - 1 more had begun on the same path.
            match path {
                Path::Owner => cell.own.store(MAX_READS_IN_FLIGHT - 1, Ordering::Relaxed),
                Path::Shared => cell.word.store(
                    (MAX_READS_IN_FLIGHT - 1) | state_bits(EngineState::Live),
                    Ordering::Release,
                ),
            }
            let last = begin(&cell, path);
            assert_eq!(cell.begin_read(), Err(BeginRefused::Full), "{path:?}");
            assert_eq!(cell.state(), EngineState::Live);
            assert_eq!(cell.reads_in_flight(), MAX_READS_IN_FLIGHT);
            cell.end_read(last);
            let again = cell.begin_read().expect("room for one");
            cell.end_read(again);
            cell.end_read(first);
        }
    }

    /// The owner begins, another thread ends (the guard moved): counted
    /// once, completed once; a give-up moved likewise completes nothing;
    /// and a release waits for a moved read like any other.
    #[test]
    fn an_owners_read_ended_on_another_thread_counts_once() {
        let Some((sink, cell)) = owned_cell("an_owners_read_ended_on_another_thread_counts_once")
        else {
            return;
        };
        let a = begin(&cell, Path::Owner);
        let b = begin(&cell, Path::Owner);
        let c = begin(&cell, Path::Owner);
        std::thread::scope(|s| {
            s.spawn(|| {
                assert_ne!(cell.owner.load(Ordering::Relaxed), barrier::this_thread());
                cell.end_read(a);
            });
        });
        assert_eq!(cell.progress(), (2, 1));
        std::thread::scope(|s| {
            s.spawn(|| {
                let token = cell.give_up(GiveUp::Cancelled, b, 0);
                cell.end_given_up(b, token, false, false);
            });
        });
        assert_eq!(cell.progress(), (1, 1), "a give-up completes nothing");
        assert_eq!(cell.mark(EngineState::Retiring), Some(1));
        assert_eq!(cell.try_release(), Err(1), "the moved-to thread's read");
        sink.take();
        std::thread::scope(|s| {
            s.spawn(|| cell.end_read(c));
        });
        assert_eq!(sink.take(), vec![Wake::Drained(cell.serial())]);
        assert_eq!(cell.try_release(), Ok(()));
        assert_eq!(cell.progress(), (0, 2));
    }

    /// Reads begun on both paths at once (the owner and another thread):
    /// the release waits for all of them, whichever ends last wakes the
    /// core.
    #[test]
    fn a_release_waits_for_reads_on_both_paths() {
        for owner_ends_last in [true, false] {
            let Some((sink, cell)) = owned_cell("a_release_waits_for_reads_on_both_paths") else {
                return;
            };
            let mine = begin(&cell, Path::Owner);
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::scope(|s| {
                s.spawn(|| tx.send(cell.begin_read().unwrap()).unwrap());
            });
            let theirs = rx.recv().unwrap();
            assert_eq!(theirs & ON_OWNER, 0, "another thread: the shared word");
            assert_eq!(cell.mark(EngineState::Replaced), Some(2));
            let (first, last) = if owner_ends_last {
                (theirs, mine)
            } else {
                (mine, theirs)
            };
            let end_elsewhere = |begun| {
                std::thread::scope(|s| {
                    s.spawn(|| cell.end_read(begun));
                })
            };
            if owner_ends_last {
                end_elsewhere(first);
            } else {
                cell.end_read(first);
            }
            sink.take();
            assert_eq!(cell.try_release(), Err(1));
            if owner_ends_last {
                cell.end_read(last);
            } else {
                end_elsewhere(last);
            }
            assert_eq!(sink.take(), vec![Wake::Drained(cell.serial())]);
            assert_eq!(cell.try_release(), Ok(()));
        }
    }

    /// Never a release with a read in flight, with the owner, another
    /// thread and moved reads racing a mark: the owner begins and ends in
    /// a tight loop (its store-then-look window is most of its time) and
    /// hands some reads to the other thread to end, the other thread reads
    /// on the shared word, and the core's thread marks at a random moment
    /// and releases as soon as `try_release` lets it. Each read is also
    /// counted in a separate `SeqCst` counter: a release that succeeds
    /// while it is non-zero, or a reader that sees the release after its
    /// begin succeeded, is the violation. `CELL_RACE_ROUNDS` sets the
    /// rounds (a soak: 200,000).
    #[test]
    fn no_release_while_a_read_is_in_flight_on_either_path_or_moved() {
        use std::sync::atomic::AtomicBool;
        use std::sync::{Barrier, Mutex};
        let rounds: u64 = std::env::var("CELL_RACE_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(300);
        WIDEN_RACES.store(true, Ordering::Relaxed);
        let start = Barrier::new(3);
        let go = Barrier::new(3);
        let done = Barrier::new(3);
        let current: Mutex<Option<Arc<EngineCell>>> = Mutex::new(None);
        let in_flight = AtomicU64::new(0);
        let released = AtomicBool::new(false);
        let violations = AtomicU64::new(0);
        let handed: Mutex<Vec<u64>> = Mutex::new(Vec::new());
        let owner_done = AtomicBool::new(false);
        let owner_reads = AtomicU64::new(0);
        let marked_busy = AtomicU64::new(0);
        // Checks and ends one read (on this thread).
        let finish = |cell: &EngineCell, begun: u64| {
            if released.load(Ordering::SeqCst) {
                violations.fetch_add(1, Ordering::SeqCst);
            }
            in_flight.fetch_sub(1, Ordering::SeqCst);
            cell.end_read(begun);
        };
        let began = || {
            in_flight.fetch_add(1, Ordering::SeqCst);
            if released.load(Ordering::SeqCst) {
                violations.fetch_add(1, Ordering::SeqCst);
            }
        };
        std::thread::scope(|s| {
            // The owner.
            s.spawn(|| {
                for round in 0..rounds {
                    start.wait();
                    let cell = current.lock().unwrap().clone().unwrap();
                    let mut held = Vec::new();
                    let mut n = 0u64;
                    // The first read claims the registration.
                    if let Ok(begun) = cell.begin_read() {
                        began();
                        finish(&cell, begun);
                    }
                    go.wait();
                    while let Ok(begun) = cell.begin_read() {
                        began();
                        n += 1;
                        if begun & ON_OWNER != 0 {
                            owner_reads.fetch_add(1, Ordering::Relaxed);
                        }
                        // A third of the rounds end every read at once (a
                        // begin then races a release with nothing else in
                        // flight), the others also hold reads and hand
                        // some to the other thread.
                        match (round % 3, (n + round) % 7) {
                            (0, _) => finish(&cell, begun),
                            (_, 0) => handed.lock().unwrap().push(begun),
                            (_, 1 | 2) => held.push(begun),
                            _ => finish(&cell, begun),
                        }
                        if held.len() > 3 {
                            finish(&cell, held.remove(0));
                        }
                    }
                    for begun in held.drain(..) {
                        finish(&cell, begun);
                    }
                    owner_done.store(true, Ordering::SeqCst);
                    done.wait();
                }
            });
            // Another thread: its own reads on the shared word, and the
            // owner's handed-over ones.
            s.spawn(|| {
                for _ in 0..rounds {
                    start.wait();
                    let cell = current.lock().unwrap().clone().unwrap();
                    go.wait();
                    let mut refused = false;
                    loop {
                        let taken: Vec<u64> = std::mem::take(&mut *handed.lock().unwrap());
                        for begun in taken {
                            finish(&cell, begun);
                        }
                        if !refused {
                            match cell.begin_read() {
                                Ok(begun) => {
                                    began();
                                    finish(&cell, begun);
                                }
                                Err(_) => refused = true,
                            }
                        } else if owner_done.load(Ordering::SeqCst)
                            && handed.lock().unwrap().is_empty()
                        {
                            break;
                        } else {
                            std::thread::yield_now();
                        }
                    }
                    done.wait();
                }
            });
            // The core: a fresh registration each round, marked at a
            // random moment, released once it may be.
            s.spawn(|| {
                for _ in 0..rounds {
                    released.store(false, Ordering::SeqCst);
                    owner_done.store(false, Ordering::SeqCst);
                    let cell = EngineCell::new(EngineId::from("p"), Arc::new(Collect::default()));
                    *current.lock().unwrap() = Some(cell.clone());
                    start.wait();
                    go.wait();
                    for _ in 0..rand::random_range(0..4_000u32) {
                        std::hint::spin_loop();
                    }
                    let at_mark = cell.mark(EngineState::Unreachable).unwrap();
                    if at_mark > 0 {
                        marked_busy.fetch_add(1, Ordering::Relaxed);
                    }
                    while cell.try_release().is_err() {
                        std::thread::yield_now();
                    }
                    released.store(true, Ordering::SeqCst);
                    if in_flight.load(Ordering::SeqCst) != 0 {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    done.wait();
                    assert_eq!(in_flight.load(Ordering::SeqCst), 0);
                    assert_eq!(cell.progress().0, 0);
                }
            });
        });
        eprintln!(
            "{rounds} rounds: {} reads on the owner path, {} marks with reads in flight",
            owner_reads.load(Ordering::Relaxed),
            marked_busy.load(Ordering::Relaxed)
        );
        assert_eq!(violations.load(Ordering::SeqCst), 0);
        if barrier::available() {
            assert!(
                owner_reads.load(Ordering::Relaxed) > 0,
                "the owner path was exercised"
            );
        }
    }

    /// A give-up is judged against completions on both paths: the owner's
    /// completions before another thread's read began are not "during" it,
    /// one after it began is.
    #[test]
    fn a_give_up_is_judged_against_completions_on_both_paths() {
        let Some((sink, cell)) =
            owned_cell("a_give_up_is_judged_against_completions_on_both_paths")
        else {
            return;
        };
        for _ in 0..3 {
            let mine = begin(&cell, Path::Owner);
            cell.end_read(mine);
        }
        let unanswered = |wake: &Wake, expected_done: u64| matches!(wake, Wake::GivenUp { why: GiveUp::TimedOut, unanswered: true, done, .. } if *done == expected_done);
        // Another thread begins after the owner's three completions and
        // gives up with none since: unanswered.
        std::thread::scope(|s| {
            s.spawn(|| {
                let theirs = cell.begin_read().unwrap();
                assert_eq!(theirs & ON_OWNER, 0);
                cell.give_up(GiveUp::TimedOut, theirs, 0);
            });
        });
        let wakes = sink.take();
        assert!(wakes.len() == 1 && unanswered(&wakes[0], 3), "{wakes:?}");
        // The owner gives up with none since its begin either, after the
        // other thread completed one: unanswered; and one begun before
        // the other thread's completion is answered.
        let before = begin(&cell, Path::Owner);
        std::thread::scope(|s| {
            s.spawn(|| {
                let theirs = cell.begin_read().unwrap();
                cell.end_read(theirs);
            });
        });
        let after = begin(&cell, Path::Owner);
        cell.give_up(GiveUp::TimedOut, after, 0);
        cell.give_up(GiveUp::TimedOut, before, 0);
        let wakes = sink.take();
        assert!(unanswered(&wakes[0], 4), "{wakes:?}");
        assert!(
            matches!(
                wakes[1],
                Wake::GivenUp {
                    unanswered: false,
                    done: 4,
                    ..
                }
            ),
            "{wakes:?}"
        );
    }

    /// A thread that claims a registration already marked (the mark saw
    /// no owner, so it sent no fence) is refused, and stays refused.
    #[test]
    fn a_claim_after_the_mark_is_refused() {
        let sink = Arc::new(Collect::default());
        let cell = EngineCell::new(EngineId::from("p"), sink);
        assert_eq!(cell.mark(EngineState::Retiring), Some(0));
        for _ in 0..2 {
            assert_eq!(
                cell.begin_read(),
                Err(BeginRefused::State(EngineState::Retiring))
            );
        }
        assert_eq!(cell.try_release(), Ok(()));
    }

    /// The owner's count wraps within its 24 bits (reads that moved away
    /// keep raising it): it never carries into the completed count.
    #[test]
    fn the_owners_count_wraps_within_its_field() {
        let Some((_sink, cell)) = owned_cell("the_owners_count_wraps_within_its_field") else {
            return;
        };
        let first = begin(&cell, Path::Owner);
        cell.end_read(first);
        // As if 2^24 - 1 reads had begun here and ended elsewhere.
        let own = cell.own.load(Ordering::Relaxed);
        cell.own
            .store(with_count(own, COUNT_MASK), Ordering::Relaxed);
        cell.moved.store(COUNT_MASK as u32, Ordering::Relaxed);
        assert_eq!(cell.progress(), (0, 1));
        let a = begin(&cell, Path::Owner);
        assert_eq!(cell.own.load(Ordering::Relaxed) & COUNT_MASK, 0, "wrapped");
        assert_eq!(cell.progress(), (1, 1));
        cell.end_read(a);
        assert_eq!(
            cell.progress(),
            (0, 2),
            "completed count untouched by the wrap"
        );
    }

    #[test]
    fn the_completed_count_does_not_wrap_at_2_pow_24_or_anywhere_a_check_period_could_reach() {
        let sink = Arc::new(Collect::default());
        let cell = cell_on(Path::Shared, sink);
        cell.begin_read().unwrap();
        cell.add_completions(1 << 24);
        assert_eq!(cell.progress(), (1, 1 << 24));
        // Wrapping needs 2^36 completions: at 10^9 a second (more than one
        // word can take), 68 s, longer than the longest check period.
        // (The core's stall check asserts, at compile time, that its
        // longest period is below that.)
        assert_eq!(DONE_BITS, 36);
    }

    #[test]
    fn the_completed_count_wraps_without_touching_the_state_or_the_count() {
        for path in PATHS {
            let sink = Arc::new(Collect::default());
            let cell = cell_on(path, sink);
            // Start just below the wrap.
            let top = ((1u64 << (64 - DONE_SHIFT)) - 1) << DONE_SHIFT;
            match path {
                Path::Owner => cell.own.store(top, Ordering::Relaxed),
                Path::Shared => cell
                    .word
                    .store(top | state_bits(EngineState::Live), Ordering::Release),
            }
            let first = begin(&cell, path);
            let second = begin(&cell, path);
            cell.end_read(first);
            assert_eq!(cell.progress(), (1, 0), "wrapped to zero ({path:?})");
            assert_eq!(cell.state(), EngineState::Live);
            cell.mark(EngineState::Retiring).unwrap();
            cell.end_read(second);
            assert_eq!(cell.try_release(), Ok(()));
            assert_eq!(cell.progress(), (0, 1));
        }
    }
}
