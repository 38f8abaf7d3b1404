//! A plain read accounting for the core's tests: one thread, plain
//! `Cell`s, no atomics and no fences. It keeps the contract the core
//! relies on (what [`super::super::ReadAccounting`] says, and the wake-ups
//! the real cell sends: a marked registration's last read ending, a
//! give-up and its end), so the rules are tested apart from the
//! shared-memory counting, which has its own tests beside it
//! (`read_accounting/cell.rs`).

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use super::super::{ReadAccounting, Wake};
use crate::give_up::GiveUp;
use crate::names::EngineId;
use crate::registration::RegistrationId;
use crate::state::EngineState;

/// What the [`PlainReads`] of one test share: where their wake-ups go, in
/// order, and the numbers they hand out (serials, give-up tokens).
#[derive(Default)]
pub(super) struct Wakes {
    wakes: RefCell<Vec<Wake>>,
    serials: Cell<u64>,
    give_ups: Cell<u64>,
}

impl Wakes {
    fn push(&self, wake: Wake) {
        self.wakes.borrow_mut().push(wake);
    }

    /// Every wake-up so far, in order, taken.
    pub(super) fn take(&self) -> Vec<Wake> {
        std::mem::take(&mut self.wakes.borrow_mut())
    }

    fn next(counter: &Cell<u64>) -> u64 {
        counter.set(counter.get() + 1);
        counter.get()
    }
}

/// A flag set once, as the real cell's signals are.
pub(super) struct Flag(bool);

impl Flag {
    pub(super) fn is_set(&self) -> bool {
        self.0
    }
}

/// One registration's reads, counted in plain cells.
pub(super) struct PlainReads {
    id: EngineId,
    serial: RegistrationId,
    state: Cell<EngineState>,
    in_flight: Cell<u64>,
    done: Cell<u64>,
    reads_failed: Cell<bool>,
    release_done: Cell<bool>,
    transfers_ended: Cell<bool>,
    wakes: Rc<Wakes>,
}

impl PlainReads {
    // The core holds every accounting behind an `Arc` (the driver's cells
    // are shared with the runtime's threads); this one stays on the test's
    // thread.
    #[allow(clippy::arc_with_non_send_sync)]
    pub(super) fn new(id: EngineId, wakes: Rc<Wakes>) -> std::sync::Arc<Self> {
        std::sync::Arc::new(PlainReads {
            id,
            serial: RegistrationId(Wakes::next(&wakes.serials)),
            state: Cell::new(EngineState::Live),
            in_flight: Cell::new(0),
            done: Cell::new(0),
            reads_failed: Cell::new(false),
            release_done: Cell::new(false),
            transfers_ended: Cell::new(false),
            wakes,
        })
    }

    /// Counts a read if the registration is live; the completed count at
    /// that moment (what a give-up compares with).
    pub(super) fn begin_read(&self) -> Result<u64, EngineState> {
        match self.state.get() {
            EngineState::Live => {
                self.in_flight.set(self.in_flight.get() + 1);
                Ok(self.done.get())
            }
            state => Err(state),
        }
    }

    /// What the real cell's path bit would be; nothing here.
    pub(super) fn begun_here(&self) -> u64 {
        0
    }

    /// Ends a read that completed.
    pub(super) fn end_read(&self, _begun: u64) {
        if self.end(true) {
            self.wakes.push(Wake::Drained(self.serial));
        }
    }

    /// Ends a read; whether the core must hear that a marked registration
    /// may be drained.
    fn end(&self, completed: bool) -> bool {
        let left = self.in_flight.get().checked_sub(1).expect("a read began");
        self.in_flight.set(left);
        if completed {
            self.done.set(self.done.get().wrapping_add(1));
        }
        self.state.get() != EngineState::Live && left == 0
    }

    /// Gives a read up: it stays in flight until
    /// [`PlainReads::end_given_up`]. Returns the give-up's token.
    pub(super) fn give_up(&self, why: GiveUp, begun: u64, blocks: u64) -> u64 {
        let token = Wakes::next(&self.wakes.give_ups);
        let done = self.done.get();
        self.wakes.push(Wake::GivenUp {
            serial: self.serial,
            why,
            unanswered: done == begun,
            done,
            token,
            blocks,
        });
        token
    }

    /// Ends a given-up read: seen to end (`over`, a completion when
    /// `completed`), or no longer watched.
    pub(super) fn end_given_up(&self, _begun: u64, token: u64, over: bool, completed: bool) {
        let drained = self.end(completed);
        self.wakes.push(Wake::GivenUpEnded {
            serial: self.serial,
            token,
            over,
        });
        if drained {
            self.wakes.push(Wake::Drained(self.serial));
        }
    }

    /// `n` reads begun and completed at once.
    pub(super) fn add_completions(&self, n: u64) {
        self.done.set(self.done.get().wrapping_add(n));
    }

    /// What the driver does on [`super::Action::FailReads`].
    pub(super) fn fail_reads(&self) {
        self.reads_failed.set(true);
    }

    pub(super) fn reads_failed(&self) -> Flag {
        Flag(self.reads_failed.get())
    }

    /// What the driver does on [`super::Action::ReleaseFinished`].
    pub(super) fn release_finished(&self, transfers_ended: bool) {
        self.release_done.set(true);
        self.transfers_ended.set(transfers_ended);
    }

    pub(super) fn release_done(&self) -> Flag {
        Flag(self.release_done.get())
    }

    pub(super) fn transfers_ended(&self) -> bool {
        self.transfers_ended.get()
    }
}

impl ReadAccounting for PlainReads {
    fn id(&self) -> &EngineId {
        &self.id
    }

    fn serial(&self) -> RegistrationId {
        self.serial
    }

    fn state(&self) -> EngineState {
        self.state.get()
    }

    fn progress(&self) -> (u64, u64) {
        (self.in_flight.get(), self.done.get())
    }

    fn mark(&self, state: EngineState) -> Option<u64> {
        if self.state.get() != EngineState::Live {
            return None;
        }
        self.state.set(state);
        Some(self.in_flight.get())
    }

    fn try_release(&self) -> Result<(), u64> {
        assert_ne!(
            self.state.get(),
            EngineState::Live,
            "release of a live engine"
        );
        match self.in_flight.get() {
            0 => {
                self.state.set(EngineState::Released);
                Ok(())
            }
            n => Err(n),
        }
    }
}
