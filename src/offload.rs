//! Transport calls off the async threads: one queue, served by as few
//! blocking workers as keep every call isolated, watched by a timer of its
//! own.
//!
//! Transport calls are blocking FFI and may never return. The driver hands
//! the calls of one wake-up over as one batch; workers (tokio blocking
//! tasks) take them one at a time and exit when the queue is empty. One
//! rule keeps a hung call from holding anything else:
//!
//! > while a call is queued, a worker is free to take it, or one will be
//! > within [`STUCK`].
//!
//! A submit that finds no free worker starts one. A worker that takes a
//! call while others still wait arms the watchdog: a thread of the service
//! that, while calls wait and every worker has been inside its current call
//! for [`STUCK`] or more, starts a spare. So any number of hung calls,
//! started together or not, each hold one thread; what waits behind them
//! gets a worker within `STUCK` per hung call. The watchdog sleeps on the
//! wall clock, which is what a hung call is hung in (tokio's clock may be
//! paused, and does not move while a blocking task runs); it wakes only
//! while calls are queued behind busy workers, so at most once per batch
//! when calls are fast.
//!
//! Results are handed back in batches: a worker adds its result to the
//! shared list and wakes the driver only when no call is left queued (the
//! worker that takes the last queued call wakes it too if results wait), so
//! one wake-up of the driver serves a batch, and a result never waits
//! behind a hung call.
//!
//! Workers are tokio blocking tasks, not bare threads: on a paused clock
//! tokio does not advance time while a blocking task runs, and each worker
//! hands its result over before it exits, so every result reaches the
//! driver before virtual time can move. Tests stay deterministic.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::Notify;

use crate::core::{Call, CallOutcome, Panicked, RoundResults};
use crate::transport::Transport;

/// A call lasting this long (wall clock) with calls queued behind it and
/// no free worker gets a spare worker started for those calls.
pub(crate) const STUCK: Duration = Duration::from_millis(1);

/// The driver's side: submits batches, receives results.
pub(crate) struct Offload<T: Transport> {
    shared: Arc<Shared<T>>,
}

/// What the driver, the workers and the watchdog share.
struct Shared<T: Transport> {
    transport: Arc<T>,
    state: Mutex<State<T::Resources>>,
    /// Wakes the watchdog.
    watchdog: Condvar,
    /// Wakes the driver: results are waiting.
    results: Notify,
    /// The runtime workers are started on; set at the first submit.
    runtime: OnceLock<Handle>,
}

/// Calls waiting, results waiting, and the workers. Changed only under the
/// lock.
struct State<R> {
    calls: VecDeque<Call<R>>,
    results: Vec<CallOutcome>,
    /// Workers started and not yet exited.
    workers: usize,
    /// Workers inside a call, with when the call began.
    in_call: Vec<(u64, Instant)>,
    next_worker: u64,
    /// The watchdog is watching (a timed wait), or has been asked to.
    watching: bool,
    watchdog_started: bool,
    /// The driver is gone: heartbeats are dropped, releases still run.
    closed: bool,
}

impl<R> State<R> {
    fn free_workers(&self) -> usize {
        self.workers - self.in_call.len()
    }
}

impl<T: Transport> Offload<T> {
    /// An idle offload over `transport`. Starts nothing and needs no runtime
    /// until the first submit.
    pub(crate) fn new(transport: Arc<T>) -> Self {
        Offload {
            shared: Arc::new(Shared {
                transport,
                state: Mutex::new(State {
                    calls: VecDeque::new(),
                    results: Vec::new(),
                    workers: 0,
                    in_call: Vec::new(),
                    next_worker: 0,
                    watching: false,
                    watchdog_started: false,
                    closed: false,
                }),
                watchdog: Condvar::new(),
                results: Notify::new(),
                runtime: OnceLock::new(),
            }),
        }
    }

    /// Queues a batch of calls; their results come back through
    /// [`Offload::recv`]. Must be called within the tokio runtime.
    pub(crate) fn submit(&self, calls: impl IntoIterator<Item = Call<T::Resources>>) {
        let shared = &self.shared;
        shared.runtime.get_or_init(Handle::current);
        let (start, start_watchdog) = {
            let mut state = shared.lock();
            state.calls.extend(calls);
            if state.calls.is_empty() {
                return;
            }
            let start = state.free_workers() == 0;
            if start {
                state.workers += 1;
            }
            let start_watchdog = !state.watchdog_started;
            state.watchdog_started = true;
            (start, start_watchdog)
        };
        if start_watchdog {
            let watched = shared.clone();
            std::thread::Builder::new()
                .name("nixl-keepalive-watchdog".into())
                .spawn(move || watched.watch())
                .expect("the watchdog thread starts");
        }
        if start {
            Shared::start_worker(shared);
        }
    }

    /// Waits for results and moves every result ready into `out`.
    ///
    /// Cancel safe: a result is either in `out` or still waiting.
    pub(crate) async fn recv(&self, out: &mut Vec<CallOutcome>) {
        loop {
            {
                let mut state = self.shared.lock();
                if !state.results.is_empty() {
                    out.append(&mut state.results);
                    return;
                }
            }
            // A notification sent since the check above is kept as a permit.
            self.shared.results.notified().await;
        }
    }
}

impl<T: Transport> Drop for Offload<T> {
    /// Heartbeats not started are dropped; releases not started still run
    /// (their resources must go back to NIXL), their results unheard.
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.closed = true;
        state
            .calls
            .retain(|call| matches!(call, Call::Release { .. }));
        self.shared.watchdog.notify_one();
    }
}

impl<T: Transport> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T::Resources>> {
        // Nothing that can panic runs under the lock.
        self.state.lock().expect("offload state poisoned")
    }

    /// Starts a worker already counted in `workers`.
    fn start_worker(shared: &Arc<Self>) {
        let runtime = shared.runtime.get().expect("set at the first submit");
        let worker = shared.clone();
        drop(runtime.spawn_blocking(move || worker.work()));
    }

    /// A worker: takes calls until none is queued, then exits.
    fn work(self: &Arc<Self>) {
        let mut state = self.lock();
        let me = state.next_worker;
        state.next_worker += 1;
        loop {
            let Some(call) = state.calls.pop_front() else {
                state.workers -= 1;
                return;
            };
            state.in_call.push((me, Instant::now()));
            if state.calls.is_empty() {
                if !state.results.is_empty() {
                    // This call may hang: what is done goes to the driver now.
                    self.results.notify_one();
                }
            } else if !state.watching {
                // Calls wait behind this one: the watchdog makes sure they
                // get a worker if it hangs.
                state.watching = true;
                self.watchdog.notify_one();
            }
            drop(state);
            let outcome = self.call(call);
            state = self.lock();
            state.in_call.retain(|(id, _)| *id != me);
            state.results.push(outcome);
            if state.calls.is_empty() {
                self.results.notify_one();
            }
        }
    }

    /// The watchdog: starts a spare worker whenever calls wait, no worker is
    /// free, and every worker has been inside its call for [`STUCK`].
    fn watch(self: Arc<Self>) {
        let mut state = self.lock();
        loop {
            if state.closed && state.calls.is_empty() {
                return;
            }
            let blocked = !state.calls.is_empty() && state.free_workers() == 0;
            if !blocked {
                state.watching = false;
                state = self.watchdog.wait(state).expect("offload state poisoned");
                continue;
            }
            state.watching = true;
            let now = Instant::now();
            let newest = state
                .in_call
                .iter()
                .map(|(_, since)| *since)
                .max()
                .unwrap_or(now);
            let stuck_at = newest + STUCK;
            if now >= stuck_at {
                state.workers += 1;
                tracing::debug!(
                    queued = state.calls.len(),
                    workers = state.workers,
                    "every worker is inside a call that may be hung: a spare takes the calls behind them"
                );
                drop(state);
                Self::start_worker(&self);
                state = self.lock();
                continue;
            }
            state = self
                .watchdog
                .wait_timeout(state, stuck_at - now)
                .expect("offload state poisoned")
                .0;
        }
    }

    /// Makes one call's transport calls; a panic is caught and reported as
    /// a panic.
    fn call(&self, call: Call<T::Resources>) -> CallOutcome {
        match call {
            Call::Heartbeat {
                serial,
                agents,
                message,
            } => {
                let mut results = RoundResults::default();
                for agent in agents.iter() {
                    match catch_unwind(AssertUnwindSafe(|| self.transport.notify(agent, &message)))
                    {
                        Ok(Ok(())) => results.sent += 1,
                        Ok(Err(e)) => results.failed.push((agent.clone(), e)),
                        Err(payload) => results
                            .panicked
                            .push((agent.clone(), Panicked::from_payload(&*payload))),
                    }
                }
                CallOutcome::Heartbeat { serial, results }
            }
            Call::Release {
                serial,
                engine,
                agents,
                resources,
            } => {
                let steps = catch_unwind(AssertUnwindSafe(|| {
                    self.transport.release(&engine, &agents, resources)
                }))
                .map_err(|payload| Panicked::from_payload(&*payload));
                CallOutcome::Release { serial, steps }
            }
        }
    }
}
