//! A gate that holds notify calls on their OS thread until a test opens it.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
struct GateState {
    open: bool,
    waiting: usize,
}

#[derive(Debug, Default)]
pub(super) struct GateInner {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl GateInner {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks the calling OS thread until the gate is open.
    pub(super) fn pass(&self) {
        let mut state = self.lock();
        if state.open {
            return;
        }
        state.waiting += 1;
        self.changed.notify_all();
        while !state.open {
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.waiting -= 1;
        self.changed.notify_all();
    }

    pub(super) fn open(&self) {
        self.lock().open = true;
        self.changed.notify_all();
    }
}

/// Holds every notify to one engine on its OS thread until opened.
///
/// Made by [`super::FakeUcx::block_notify`]. A held notify blocks its thread
/// on a condition variable, not on tokio's clock, so it stays blocked while
/// a test advances tokio's paused clock (tokio does not auto-advance paused
/// time while a `spawn_blocking` task runs, so a sleeping notify would stall
/// a virtual-time test instead).
///
/// Opening is final: later notifies pass at once (block again with a new
/// gate). Dropping the gate opens it, so a test that fails early never
/// leaves a blocking thread behind for the runtime to wait on.
#[derive(Debug)]
pub struct NotifyGate {
    inner: Arc<GateInner>,
}

impl NotifyGate {
    pub(super) fn new(inner: Arc<GateInner>) -> Self {
        Self { inner }
    }

    /// Lets every held notify go on, and every later one pass.
    pub fn open(&self) {
        self.inner.open();
    }

    /// Whether the gate is open.
    pub fn is_open(&self) -> bool {
        self.inner.lock().open
    }

    /// How many notify calls are held at this gate now.
    pub fn waiting(&self) -> usize {
        self.inner.lock().waiting
    }

    /// Blocks the calling thread until at least `count` notify calls are
    /// held at this gate, or `timeout` (real time) has passed. Returns
    /// whether they are. Use it to know that a notify started on a blocking
    /// thread has reached the gate.
    pub fn wait_for_waiting(&self, count: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = self.inner.lock();
        while state.waiting < count {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self
                .inner
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

impl Drop for NotifyGate {
    fn drop(&mut self) {
        self.inner.open();
    }
}
