//! Transport calls off the async threads, on a pool of threads the service
//! owns and bounds.
//!
//! Transport calls are blocking FFI and may never return: a hung call holds
//! its thread for as long as it hangs, and nothing can take it back. So the
//! pool cannot be a fixed set of workers (a few hung calls would take them
//! all), nor tokio's blocking pool (shared with the runtime's own blocking
//! work, and capped at 512 threads by default: past that, every heartbeat
//! of every healthy engine waited behind the hung calls). Its rules:
//!
//! - **Calls waiting behind stuck threads get threads, in doubling
//!   waves.** A batch goes to an idle thread (or a new one), which takes
//!   its calls one at a time. A thread that takes a call while others
//!   still wait asks the watchdog to watch: whenever every busy thread has
//!   been inside its current call for [`STUCK`] or more, the watchdog gives
//!   as many waiting calls a thread of their own (idle ones first, then
//!   new ones) as there are stuck threads. One hung call costs one thread;
//!   a thread that is merely preempted on a busy machine costs one
//!   wake-up, not one per queued call; a burst of N hung calls in one
//!   batch is absorbed in log2(N) waves (1, 2, 4, ...: 1,000 in ten, about
//!   [`STUCK`] each), not N x [`STUCK`] as with one spare at a time.
//! - **Newest batch first.** A free thread takes the oldest call of the
//!   newest batch, so a batch whose calls hang holds back only its own
//!   tail (which the watchdog serves), never a later batch: the next
//!   slot's heartbeats and a release decided since go ahead. Releases go
//!   first within their batch.
//! - **Bounded.** At most [`TRANSPORT_THREADS_CAP`] threads (plus the
//!   watchdog). The core never sends an engine a heartbeat round while its
//!   previous one is in flight, and releases a registration once, so a
//!   registration holds at most two threads however long its calls hang.
//!   At the cap, calls wait for a thread to come back (logged, and visible
//!   in the snapshot). A thread idle for [`KEEP_ALIVE`] exits.
//! - **Visible.** A call in flight for [`HUNG_AFTER`] is hung: counted once
//!   (`nixl_keepalive_transport_calls_hung_total`), in the gauge
//!   `nixl_keepalive_transport_calls_hung`, and listed with its engine and
//!   age in the snapshot ([`TransportSnapshot`]). The watchdog looks at
//!   most once per [`HUNG_AFTER`] while the pool has threads.
//!
//! Results are handed back in batches: a thread adds its result to the
//! shared list and wakes the driver only when no call is left queued (the
//! thread that takes the last queued call wakes it too if results wait),
//! so one wake-up of the driver serves a batch; a release's result goes at
//! once, and when every busy thread is stuck the watchdog hands over what
//! is done: a result never waits behind a hung call for more than
//! [`STUCK`].
//!
//! The watchdog and the threads sleep on the wall clock, which is what a
//! hung call is hung in. On a current-thread runtime (the only kind whose
//! clock can be paused) a blocking task of tokio's stands by while calls
//! are queued or running, so that tokio does not advance a paused clock
//! while a call runs on one of our threads: every result reaches the driver
//! before virtual time can move, and tests stay deterministic. A
//! multi-threaded runtime needs none and gets none.

use crate::registration::RegistrationId;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::Notify;

use crate::core::{Call, CallOutcome, Panicked, RoundResults};
use crate::snapshot::{CallInFlight, TransportSnapshot};
use crate::telemetry;
use crate::transport::{EngineId, Transport};

/// A call lasting this long (wall clock) with calls queued behind it and
/// no free thread gets those calls threads of their own.
pub(crate) const STUCK: Duration = Duration::from_millis(1);

/// The most threads the pool runs transport calls on at once (the
/// watchdog is one more). Each holds a stack of 2 MiB of address space,
/// of which a blocked call touches a few KiB: at the cap, on the order of
/// 50 MiB of memory. A registration holds at most two of them (a heartbeat
/// round and its release), so the cap is reached only with about a thousand
/// engines hung at once; past it, calls wait for a thread to come back.
/// Not a knob: the snapshot shows the pool's threads, and the docs state
/// the cap.
pub(crate) const TRANSPORT_THREADS_CAP: usize = 2048;

/// A call in flight this long is hung: counted, logged and listed in the
/// snapshot. Far beyond any NIXL call's time (microseconds for a
/// notification, milliseconds for a release).
///
/// Hidden (re-exported at the root for the `hung_calls` benchmark, which
/// waits past it): a fact of the pool the docs state, not an embedding
/// API.
pub const HUNG_AFTER: Duration = Duration::from_secs(1);

/// A thread idle this long exits.
pub(crate) const KEEP_ALIVE: Duration = Duration::from_secs(10);

/// After the system refuses a thread, no new one is asked for this long.
const REFUSED_BACKOFF: Duration = Duration::from_millis(100);

/// The driver's side: submits batches, receives results.
pub(crate) struct Offload<T: Transport> {
    shared: Arc<Shared<T>>,
}

/// What the driver, the threads and the watchdog share.
struct Shared<T: Transport> {
    transport: Arc<T>,
    state: Mutex<State<T::Resources>>,
    /// Idle threads wait here for calls.
    work: Condvar,
    /// Wakes the watchdog.
    watchdog: Condvar,
    /// Wakes the stand-by blocking task: nothing is queued or running.
    drained: Condvar,
    /// Wakes the driver: results are waiting.
    results: Notify,
    /// The runtime: the stand-by task runs on it, and the threads run in
    /// its context; set at the first submit.
    runtime: OnceLock<Handle>,
    limits: Limits,
}

/// The pool's timings and bound (constants in the service; unit tests
/// shorten them).
#[derive(Clone, Copy, Debug)]
struct Limits {
    cap: usize,
    stuck: Duration,
    hung_after: Duration,
    keep_alive: Duration,
}

const LIMITS: Limits = Limits {
    cap: TRANSPORT_THREADS_CAP,
    stuck: STUCK,
    hung_after: HUNG_AFTER,
    keep_alive: KEEP_ALIVE,
};

/// A thread inside a call.
struct InCall {
    thread: u64,
    since: Instant,
    /// The registration the call is for (the driver knows its engine id).
    serial: RegistrationId,
    /// `genNotif` (a heartbeat round) or `release`.
    call: &'static str,
    /// Counted as hung already.
    hung: bool,
}

/// Calls waiting, results waiting, and the threads. Changed only under the
/// lock.
struct State<R> {
    /// Calls waiting, one queue per batch, the newest last.
    batches: VecDeque<VecDeque<Call<R>>>,
    queued: usize,
    results: Vec<CallOutcome>,
    /// A result in `results` the driver must hear of soon: a release, or
    /// a heartbeat that did not only succeed. Results that carry only
    /// successes wake nobody: the driver takes them at its next wake-up
    /// for any reason ([`Offload::try_recv`]), always before it serves a
    /// timer, so the core never sees a round as still in flight once it
    /// came back.
    urgent: bool,
    /// Registrations whose next heartbeat result is urgent all the same:
    /// a renewal waits for it ([`Offload::expedite`]). One entry per
    /// registration at most.
    expedite: Vec<RegistrationId>,
    /// Threads started and not yet exited.
    threads: usize,
    /// Threads waiting for a call.
    idle: usize,
    /// Idle threads woken to take calls that have not woken up yet.
    permits: usize,
    /// New threads that have not taken a call yet.
    starting: usize,
    in_call: Vec<InCall>,
    next_thread: u64,
    /// The watchdog has been asked to watch for stuck threads.
    watching: bool,
    /// The watchdog sleeps until woken (no call was in flight when it last
    /// looked): the next call to start wakes it, so that it looks again
    /// when that call could turn hung.
    watchdog_asleep: bool,
    watchdog_started: bool,
    /// The stand-by blocking task is running (current-thread runtimes).
    standing_by: bool,
    /// The driver is gone: heartbeats are dropped, releases still run.
    closed: bool,
    /// The system refused a thread: no new one is asked for before this.
    refused_until: Option<Instant>,
    /// Calls ever counted hung.
    hung_total: u64,
    /// Calls hung now (in flight for at least `hung_after`).
    hung_now: usize,
    /// The cap has been reached and said so; cleared when a thread comes
    /// back.
    at_cap_logged: bool,
}

impl<R> State<R> {
    /// The oldest call of the newest batch.
    fn take(&mut self) -> Option<Call<R>> {
        let batch = self.batches.back_mut()?;
        let call = batch.pop_front();
        if batch.is_empty() {
            self.batches.pop_back();
        }
        if call.is_some() {
            self.queued -= 1;
        }
        call
    }

    /// Calls queued or running: while there are any, a paused clock must
    /// not move.
    fn pending(&self) -> usize {
        self.queued + self.in_call.len()
    }

    /// Threads on their way to take a call.
    fn coming(&self) -> usize {
        self.permits + self.starting
    }

    /// Calls queued that no thread is on its way to take.
    fn unserved(&self) -> usize {
        self.queued.saturating_sub(self.coming())
    }

    /// Idle threads nobody has woken yet.
    fn unclaimed_idle(&self) -> usize {
        self.idle.saturating_sub(self.permits)
    }

    /// How many more threads may be started now.
    fn room(&self, cap: usize, now: Instant) -> usize {
        if self.refused_until.is_some_and(|t| now < t) {
            return 0;
        }
        cap.saturating_sub(self.threads)
    }
}

impl<T: Transport> Offload<T> {
    /// An idle offload over `transport`. Starts nothing and needs no runtime
    /// until the first submit.
    pub(crate) fn new(transport: Arc<T>) -> Self {
        Self::with_limits(transport, LIMITS)
    }

    fn with_limits(transport: Arc<T>, limits: Limits) -> Self {
        Offload {
            shared: Arc::new(Shared {
                transport,
                state: Mutex::new(State {
                    batches: VecDeque::new(),
                    queued: 0,
                    results: Vec::new(),
                    urgent: false,
                    expedite: Vec::new(),
                    threads: 0,
                    idle: 0,
                    permits: 0,
                    starting: 0,
                    in_call: Vec::new(),
                    next_thread: 0,
                    watching: false,
                    watchdog_asleep: false,
                    watchdog_started: false,
                    standing_by: false,
                    closed: false,
                    refused_until: None,
                    hung_total: 0,
                    hung_now: 0,
                    at_cap_logged: false,
                }),
                work: Condvar::new(),
                watchdog: Condvar::new(),
                drained: Condvar::new(),
                results: Notify::new(),
                runtime: OnceLock::new(),
                limits,
            }),
        }
    }

    /// Queues a batch of calls; their results come back through
    /// [`Offload::recv`]. Must be called within the tokio runtime.
    pub(crate) fn submit(&self, calls: impl IntoIterator<Item = Call<T::Resources>>) {
        let shared = &self.shared;
        let runtime = shared.runtime.get_or_init(Handle::current);
        // Releases first (in order): a release must not wait behind
        // heartbeats that may hang. A batch of heartbeats alone (a slot's)
        // becomes the queue without a copy.
        let mut calls: Vec<Call<T::Resources>> = calls.into_iter().collect();
        if calls.iter().any(|c| matches!(c, Call::Release { .. })) {
            calls.sort_by_key(|c| matches!(c, Call::Heartbeat { .. }));
        }
        let batch = VecDeque::from(calls);
        if batch.is_empty() {
            return;
        }
        let (wake, start, start_watchdog, stand_by) = {
            let mut state = shared.lock();
            let was_pending = state.pending();
            state.queued += batch.len();
            state.batches.push_back(batch);
            // The batch needs a taker unless one is on its way (it takes
            // the newest batch first): an idle thread, else a new one.
            let (mut wake, mut start) = (false, false);
            if state.coming() == 0 {
                if state.unclaimed_idle() > 0 {
                    // Counted now, woken once the lock is let go (woken
                    // under it, the thread would only wait for the lock).
                    state.permits += 1;
                    wake = true;
                } else if state.room(shared.limits.cap, Instant::now()) > 0 {
                    state.threads += 1;
                    state.starting += 1;
                    start = true;
                }
                // Else every thread is busy: the busy ones come back for
                // it, and the watchdog watches.
            }
            let start_watchdog = !state.watchdog_started;
            state.watchdog_started = true;
            let stand_by = was_pending == 0
                && !state.standing_by
                && runtime.runtime_flavor() == RuntimeFlavor::CurrentThread;
            if stand_by {
                state.standing_by = true;
            }
            (wake, start, start_watchdog, stand_by)
        };
        if wake {
            shared.work.notify_one();
        }
        if stand_by {
            let watched = shared.clone();
            // The task ends on its own once nothing is queued or running.
            drop(runtime.spawn_blocking(move || watched.stand_by()));
        }
        if start_watchdog {
            let watched = shared.clone();
            let started = std::thread::Builder::new()
                .name("nixl-keepalive-watchdog".into())
                .spawn(move || watched.watch());
            if let Err(e) = started {
                tracing::error!(error = %e, "the transport watchdog thread did not start: calls queued behind a hung call wait for it; retried at the next batch");
                shared.lock().watchdog_started = false;
            }
        }
        if start {
            Shared::start_threads(shared, 1);
        }
    }

    /// The next heartbeat result of `serial` wakes the driver, even if it
    /// only succeeded: a renewal waits for it. At once if it is back
    /// already.
    pub(crate) fn expedite(&self, serial: RegistrationId) {
        let mut state = self.shared.lock();
        let back = state
            .results
            .iter()
            .any(|r| matches!(r, CallOutcome::Heartbeat { .. }) && r.serial() == serial);
        if back {
            state.urgent = true;
            drop(state);
            self.shared.results.notify_one();
        } else if !state.expedite.contains(&serial) {
            state.expedite.push(serial);
        }
    }

    /// Moves every result ready into `out`, without waiting; whether there
    /// was any. The driver calls it at every wake-up: results that carry
    /// only successes do not wake it themselves.
    pub(crate) fn try_recv(&self, out: &mut Vec<CallOutcome>) -> bool {
        let mut state = self.shared.lock();
        state.urgent = false;
        if state.results.is_empty() {
            return false;
        }
        Self::move_results(&mut state.results, out);
        true
    }

    /// Waits for a result the driver must hear of soon (a release, a
    /// heartbeat that did not only succeed; see [`Offload::try_recv`] for
    /// the rest) and moves every result ready into `out`.
    ///
    /// Cancel safe: a result is either in `out` or still waiting.
    pub(crate) async fn recv(&self, out: &mut Vec<CallOutcome>) {
        loop {
            {
                let mut state = self.shared.lock();
                if state.urgent {
                    state.urgent = false;
                    Self::move_results(&mut state.results, out);
                    return;
                }
            }
            // A notification sent since the check above is kept as a permit.
            self.shared.results.notified().await;
        }
    }

    /// Moves `results` to the end of `out`: by swapping the two vectors
    /// when `out` is empty (the usual case: the driver hands every batch
    /// to the core before the next), so a slot's results are not copied
    /// one by one under the pool's lock.
    fn move_results(results: &mut Vec<CallOutcome>, out: &mut Vec<CallOutcome>) {
        if out.is_empty() {
            std::mem::swap(results, out);
        } else {
            out.append(results);
        }
    }

    /// The pool as it is now: threads, calls waiting, calls in flight
    /// (the longest first) and which of them are hung. `engine` names the
    /// registration of a serial (a call whose registration it does not
    /// know is listed under `?`).
    pub(crate) fn snapshot(
        &self,
        engine: impl Fn(RegistrationId) -> Option<EngineId>,
    ) -> TransportSnapshot {
        let now = Instant::now();
        let calls: Vec<(RegistrationId, &'static str, Duration, bool)> = {
            let state = self.shared.lock();
            state
                .in_call
                .iter()
                .map(|c| {
                    (
                        c.serial,
                        c.call,
                        now.saturating_duration_since(c.since),
                        c.hung,
                    )
                })
                .collect()
        };
        let hung_after = self.shared.limits.hung_after;
        let mut in_flight: Vec<CallInFlight> = calls
            .into_iter()
            .map(|(serial, call, age, hung)| CallInFlight {
                engine: engine(serial).unwrap_or_else(|| EngineId::new("?")),
                call,
                age,
                hung: hung || age >= hung_after,
            })
            .collect();
        in_flight.sort_by_key(|c| std::cmp::Reverse(c.age));
        let state = self.shared.lock();
        TransportSnapshot {
            threads: state.threads,
            idle: state.idle,
            cap: self.shared.limits.cap,
            queued: state.queued,
            hung_total: state.hung_total,
            in_flight,
        }
    }
}

impl<T: Transport> Drop for Offload<T> {
    /// Heartbeats not started are dropped; releases not started still run
    /// (their resources must go back to NIXL), their results unheard.
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.closed = true;
        for batch in state.batches.iter_mut() {
            batch.retain(|call| matches!(call, Call::Release { .. }));
        }
        state.batches.retain(|b| !b.is_empty());
        state.queued = state.batches.iter().map(VecDeque::len).sum();
        let start = state.queued > 0 && state.threads == 0;
        if start {
            // Nobody would run them: one thread for the releases.
            state.threads += 1;
            state.starting += 1;
        }
        self.shared.work.notify_all();
        self.shared.watchdog.notify_one();
        self.shared.drained.notify_all();
        drop(state);
        if start {
            Shared::start_threads(&self.shared, 1);
        }
    }
}

impl<T: Transport> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T::Resources>> {
        // Nothing that can panic runs under the lock.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts `count` threads already counted in `threads` and `starting`.
    /// A thread the system refuses (out of threads or memory) is
    /// uncounted, no other is asked for during a short back-off, and the
    /// calls wait for the threads there are.
    fn start_threads(shared: &Arc<Self>, count: usize) {
        for started in 0..count {
            let worker = shared.clone();
            let result = std::thread::Builder::new()
                .name("nixl-keepalive-call".into())
                .spawn(move || worker.work());
            if let Err(e) = result {
                let refused = count - started;
                let mut state = shared.lock();
                state.threads -= refused;
                state.starting -= refused;
                state.refused_until = Some(Instant::now() + REFUSED_BACKOFF);
                let threads = state.threads;
                drop(state);
                tracing::error!(error = %e, threads, "the system refused a transport thread: calls wait for the threads there are");
                return;
            }
        }
        telemetry::transport_threads(shared.lock().threads);
    }

    /// A thread: takes calls, newest batch first; waits for more while
    /// idle; exits after [`KEEP_ALIVE`] idle, or once the driver is gone
    /// and nothing is queued.
    fn work(self: Arc<Self>) {
        // In the runtime's context, as tokio's own blocking threads are: a
        // transport that reads tokio's clock (the fake UCX does) reads the
        // runtime's, paused or not.
        let _context = self.runtime.get().map(Handle::enter);
        let mut state = self.lock();
        let me = state.next_thread;
        state.next_thread += 1;
        state.starting -= 1;
        loop {
            let Some(call) = state.take() else {
                if state.closed {
                    state.threads -= 1;
                    return;
                }
                state.idle += 1;
                let (s, waited) = self
                    .work
                    .wait_timeout(state, self.limits.keep_alive)
                    .unwrap_or_else(|e| e.into_inner());
                state = s;
                state.idle -= 1;
                if state.permits > 0 {
                    // Woken to take a call (or another idle thread was,
                    // and this one came first: either takes it).
                    state.permits -= 1;
                } else if waited.timed_out() && state.queued == 0 {
                    state.threads -= 1;
                    let threads = state.threads;
                    drop(state);
                    telemetry::transport_threads(threads);
                    return;
                }
                continue;
            };
            let serial = call.serial();
            let what = match &call {
                Call::Heartbeat { .. } => "genNotif",
                Call::Release { .. } => "release",
            };
            state.in_call.push(InCall {
                thread: me,
                since: Instant::now(),
                serial,
                call: what,
                hung: false,
            });
            if state.queued == 0 {
                if state.urgent {
                    // This call may hang: what is urgent goes to the
                    // driver now.
                    self.results.notify_one();
                }
            } else if !state.watching {
                // Calls wait behind this one: the watchdog makes sure they
                // get a thread if it hangs.
                state.watching = true;
                state.watchdog_asleep = false;
                self.watchdog.notify_one();
            }
            if state.watchdog_asleep {
                // Once per busy stretch: the watchdog looks again when this
                // call could turn hung.
                state.watchdog_asleep = false;
                self.watchdog.notify_one();
            }
            drop(state);
            let outcome = self.call(call);
            state = self.lock();
            if let Some(i) = state.in_call.iter().position(|c| c.thread == me) {
                let done = state.in_call.swap_remove(i);
                if done.hung {
                    state.hung_now -= 1;
                    telemetry::transport_calls_hung(state.hung_now);
                    tracing::debug!(registration = %done.serial, call = done.call, after = ?done.since.elapsed(), "a hung transport call came back");
                }
            }
            state.at_cap_logged = false;
            // A release's result goes to the driver at once (releases are
            // few, and a peer's reload may wait for it); a heartbeat that
            // failed waits for the batch (one wake-up of the driver per
            // batch); successes wake nobody (the driver takes them at its
            // next wake-up, before any timer: a slot's heartbeats cost the
            // slot's timer and the hand-off, not a third wake-up).
            let (urgent, now) = match &outcome {
                CallOutcome::Release { .. } => (true, true),
                CallOutcome::Heartbeat { key, results, .. } => {
                    match state.expedite.iter().position(|s| *s == key.serial) {
                        Some(i) => {
                            state.expedite.swap_remove(i);
                            (true, true)
                        }
                        None => (!results.only_successes(), false),
                    }
                }
            };
            state.results.push(outcome);
            state.urgent |= urgent;
            if now || (state.queued == 0 && state.urgent) {
                self.results.notify_one();
            }
            if state.pending() == 0 && state.standing_by {
                // After the driver was told: it runs before time can move.
                self.drained.notify_all();
            }
        }
    }

    /// The stand-by blocking task (current-thread runtimes): returns once
    /// nothing is queued or running. While it runs, tokio does not advance
    /// a paused clock.
    fn stand_by(self: Arc<Self>) {
        let mut state = self.lock();
        while state.pending() > 0 && !(state.closed && state.queued == 0) {
            state = self.drained.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.standing_by = false;
    }

    /// The watchdog: whenever calls wait, no thread is on its way to them,
    /// and every busy thread has been inside its call for [`STUCK`], gives
    /// as many waiting calls a thread as there are stuck threads; counts
    /// calls hung for [`HUNG_AFTER`].
    fn watch(self: Arc<Self>) {
        let limits = self.limits;
        let mut state = self.lock();
        loop {
            if state.closed && state.queued == 0 {
                return;
            }
            let now = Instant::now();
            self.count_hung(&mut state, now);
            let unserved = state.unserved();
            let mut wait = None;
            if unserved > 0 {
                state.watching = true;
                let newest = state.in_call.iter().map(|c| c.since).max();
                let stuck_at = newest.map_or(now, |n| n + limits.stuck);
                if now < stuck_at {
                    wait = Some(stuck_at - now);
                } else {
                    // Every busy thread is stuck: what is done must not
                    // wait for the queue behind them to drain.
                    if state.urgent {
                        self.results.notify_one();
                    }
                    // As many takers as threads are stuck: one hung call
                    // costs one thread, a thread that is only preempted
                    // (a busy machine) costs one wake-up, not one per
                    // queued call; and a burst of hung calls is absorbed
                    // in doubling waves (1, 2, 4, ... threads: 1,000 hung
                    // calls in ten).
                    let stuck = state
                        .in_call
                        .iter()
                        .filter(|c| now.saturating_duration_since(c.since) >= limits.stuck)
                        .count();
                    let wave = unserved.min(stuck.max(1));
                    let (wake, start) = self.takers(&mut state, wave, now);
                    if wake + start > 0 {
                        drop(state);
                        Self::start_threads(&self, start);
                        state = self.lock();
                        continue;
                    }
                    // At the cap (or refused): a thread that comes back
                    // takes the calls itself; look again after a back-off.
                    wait = state
                        .refused_until
                        .map(|t| t.saturating_duration_since(now).max(limits.stuck));
                }
            } else {
                state.watching = false;
            }
            // Look for hung calls when the next one could turn hung.
            let hung_check = state
                .in_call
                .iter()
                .filter(|c| !c.hung)
                .map(|c| (c.since + limits.hung_after).saturating_duration_since(now))
                .min()
                .map(|d| d.max(limits.stuck));
            let wait = match (wait, hung_check) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            state = match wait {
                Some(wait) => {
                    self.watchdog
                        .wait_timeout(state, wait)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => {
                    state.watchdog_asleep = true;
                    let mut state = self.watchdog.wait(state).unwrap_or_else(|e| e.into_inner());
                    state.watchdog_asleep = false;
                    state
                }
            };
        }
    }

    /// Gives `count` waiting calls a thread each: idle threads are woken
    /// first, then new ones counted up to the cap (the caller starts them
    /// without the lock). Returns how many were woken and how many to
    /// start.
    fn takers(
        &self,
        state: &mut State<T::Resources>,
        count: usize,
        now: Instant,
    ) -> (usize, usize) {
        let wake = count.min(state.unclaimed_idle());
        state.permits += wake;
        for _ in 0..wake {
            self.work.notify_one();
        }
        let start = (count - wake).min(state.room(self.limits.cap, now));
        state.threads += start;
        state.starting += start;
        if start > 0 {
            tracing::debug!(
                queued = state.queued,
                threads = state.threads,
                started = start,
                "every busy transport thread is inside a call that may be hung: the calls behind them get threads of their own"
            );
        }
        if wake + start < count && !state.at_cap_logged && state.threads >= self.limits.cap {
            state.at_cap_logged = true;
            tracing::warn!(
                threads = state.threads,
                queued = state.queued,
                hung = state.hung_now,
                cap = self.limits.cap,
                "every transport thread is inside a call: the calls queued wait for one to come back"
            );
        }
        (wake, start)
    }

    /// Counts calls in flight for [`HUNG_AFTER`], once each: one WARN per
    /// look, however many turned hung.
    fn count_hung(&self, state: &mut State<T::Resources>, now: Instant) {
        let hung_after = self.limits.hung_after;
        let mut newly = 0u64;
        let mut example = None;
        for c in state.in_call.iter_mut() {
            let age = now.saturating_duration_since(c.since);
            if !c.hung && age >= hung_after {
                c.hung = true;
                newly += 1;
                example.get_or_insert((c.serial, c.call, age));
            }
        }
        if let Some((serial, call, age)) = example {
            state.hung_total += newly;
            state.hung_now += newly as usize;
            telemetry::transport_calls_hung_counted(newly);
            telemetry::transport_calls_hung(state.hung_now);
            tracing::warn!(
                newly_hung = newly,
                hung = state.hung_now,
                threads = state.threads,
                registration = %serial,
                call,
                after = ?age,
                "transport calls hung: each holds a thread until it returns, and its engine gets no other heartbeat meanwhile (the snapshot lists them)"
            );
        }
    }

    /// Makes one call's transport calls; a panic is caught and reported as
    /// a panic.
    fn call(&self, call: Call<T::Resources>) -> CallOutcome {
        match call {
            Call::Heartbeat {
                key,
                agents,
                messages,
            } => {
                let mut results = RoundResults::default();
                for agent in agents.iter() {
                    for message in messages.iter() {
                        match catch_unwind(AssertUnwindSafe(|| {
                            self.transport.notify(agent, message)
                        })) {
                            Ok(Ok(())) => results.sent += 1,
                            Ok(Err(e)) => {
                                results.failed.push((agent.clone(), e));
                                // The agent's other notifications of this
                                // round would fail the same way.
                                break;
                            }
                            Err(payload) => {
                                results
                                    .panicked
                                    .push((agent.clone(), Panicked::from_payload(&*payload)));
                                break;
                            }
                        }
                    }
                }
                CallOutcome::Heartbeat {
                    key,
                    results,
                    agents,
                }
            }
            Call::Release {
                serial,
                engine,
                agents,
                resources,
                transfers,
            } => {
                let steps = catch_unwind(AssertUnwindSafe(|| {
                    self.transport
                        .release_with(&engine, &agents, resources, transfers)
                }))
                .map_err(|payload| Panicked::from_payload(&*payload));
                CallOutcome::Release { serial, steps }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::transport::{AgentName, ReleaseStep, Transfers, TransportError};

    /// Notifies to agents named `hung-*` block until the gate opens; the
    /// rest return at once. Counts calls per kind.
    #[derive(Default)]
    struct Gated {
        open: Mutex<bool>,
        opened: Condvar,
        notifies: AtomicUsize,
        releases: AtomicUsize,
    }

    impl Gated {
        fn open(&self) {
            *self.open.lock().unwrap() = true;
            self.opened.notify_all();
        }
    }

    impl Transport for Gated {
        type Resources = ();

        fn notify(&self, agent: &AgentName, _message: &[u8]) -> Result<(), TransportError> {
            if agent.as_str().starts_with("hung") {
                let mut open = self.open.lock().unwrap();
                while !*open {
                    open = self.opened.wait(open).unwrap();
                }
            }
            self.notifies.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }

        fn release_with(
            &self,
            _: &EngineId,
            _: &[AgentName],
            _: (),
            _: Transfers,
        ) -> Vec<ReleaseStep> {
            self.releases.fetch_add(1, Ordering::SeqCst);
            Vec::new()
        }
    }

    fn heartbeat(serial: u64, agent: &str) -> Call<()> {
        let serial = RegistrationId(serial);
        Call::Heartbeat {
            key: crate::core::PeerKey::detached(serial),
            agents: Arc::from(vec![AgentName::new(agent)]),
            messages: crate::core::HeartbeatMessages::Idle,
        }
    }

    fn release(serial: u64) -> Call<()> {
        let serial = RegistrationId(serial);
        Call::Release {
            serial,
            engine: EngineId::new(format!("e-{serial}")),
            agents: Arc::from(vec![AgentName::new(format!("a-{serial}"))]),
            resources: (),
            transfers: Transfers::Ended,
        }
    }

    /// The engine id the tests give registration `serial`.
    fn name(serial: RegistrationId) -> Option<EngineId> {
        Some(EngineId::new(format!("e-{serial}")))
    }

    fn serial(outcome: &CallOutcome) -> u64 {
        outcome.serial().0
    }

    /// Receives results until `want` says it has what it needs, for at
    /// most `within` (wall clock); returns the serials seen.
    async fn results_until(
        offload: &Offload<Gated>,
        within: Duration,
        want: impl Fn(&[u64]) -> bool,
    ) -> Vec<u64> {
        let mut seen = Vec::new();
        let deadline = Instant::now() + within;
        while !want(&seen) {
            // As the driver does: what woke it, then whatever else waits
            // (successes wake nobody); it wakes at least every 5 ms here,
            // as the driver does for its next slot.
            let mut out = Vec::new();
            let _ = tokio::time::timeout(Duration::from_millis(5), offload.recv(&mut out)).await;
            offload.try_recv(&mut out);
            seen.extend(out.iter().map(serial));
            if Instant::now() > deadline {
                panic!("results after {within:?}: {seen:?}");
            }
        }
        seen
    }

    fn limits(cap: usize) -> Limits {
        Limits {
            cap,
            stuck: STUCK,
            hung_after: Duration::from_millis(20),
            keep_alive: Duration::from_secs(10),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_calls_behind_a_burst_of_hung_calls_and_a_later_batch_all_complete_while_they_hang()
    {
        let transport = Arc::new(Gated::default());
        let offload = Offload::with_limits(transport.clone(), limits(TRANSPORT_THREADS_CAP));
        // One batch: 64 hung heartbeats with 10 healthy ones behind them.
        offload.submit(
            (0..64)
                .map(|i| heartbeat(i, "hung"))
                .chain((100..110).map(|i| heartbeat(i, "ok"))),
        );
        // A later batch, with a release.
        offload.submit([heartbeat(200, "ok"), release(201)]);
        let healthy: Vec<u64> = (100..110).chain([200, 201]).collect();
        let seen = results_until(&offload, Duration::from_secs(30), |s| {
            healthy.iter().all(|h| s.contains(h))
        })
        .await;
        assert!(
            seen.iter().all(|s| *s >= 100),
            "a hung call came back: {seen:?}"
        );
        let pool = offload.snapshot(name);
        // Each hung call holds a thread of its own, and no more than that
        // plus the threads the healthy calls used.
        let hung: Vec<_> = pool
            .in_flight
            .iter()
            .filter(|c| c.call == "genNotif")
            .collect();
        assert_eq!(hung.len(), 64, "{pool:?}");
        assert!(pool.threads >= 64 && pool.threads <= 64 + 12, "{pool:?}");
        assert_eq!(pool.queued, 0);
        transport.open();
        let all = results_until(&offload, Duration::from_secs(30), |s| s.len() >= 64).await;
        assert_eq!(all.len(), 64);
        assert_eq!(transport.releases.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_release_goes_first_in_its_batch() {
        let transport = Arc::new(Gated::default());
        let offload = Offload::with_limits(transport.clone(), limits(1));
        // One thread only: the release must be the call it takes first,
        // although it comes after a hung heartbeat in the batch.
        offload.submit([heartbeat(1, "hung"), release(2)]);
        let seen = results_until(&offload, Duration::from_secs(30), |s| s.contains(&2)).await;
        assert_eq!(seen, [2]);
        transport.open();
        results_until(&offload, Duration::from_secs(30), |s| s.contains(&1)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_the_cap_calls_wait_for_a_thread_to_come_back_and_no_more_start() {
        let transport = Arc::new(Gated::default());
        let offload = Offload::with_limits(transport.clone(), limits(4));
        offload.submit((0..4).map(|i| heartbeat(i, "hung")));
        // Wait until all four are inside their calls.
        let deadline = Instant::now() + Duration::from_secs(30);
        while offload.snapshot(name).in_flight.len() < 4 {
            assert!(Instant::now() < deadline, "{:?}", offload.snapshot(name));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        offload.submit([heartbeat(10, "ok")]);
        // Past many STUCK periods: still four threads, the call waits.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let pool = offload.snapshot(name);
        assert_eq!((pool.threads, pool.queued), (4, 1), "{pool:?}");
        transport.open();
        let seen = results_until(&offload, Duration::from_secs(30), |s| s.len() == 5).await;
        assert!(seen.contains(&10));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_in_flight_past_the_hung_threshold_is_counted_once_and_listed_with_its_engine() {
        let transport = Arc::new(Gated::default());
        let offload = Offload::with_limits(transport.clone(), limits(8));
        offload.submit([heartbeat(7, "hung")]);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let pool = offload.snapshot(name);
            if pool.hung_total == 1 {
                let hung: Vec<_> = pool.hung().collect();
                assert_eq!(hung.len(), 1, "{pool:?}");
                assert_eq!(hung[0].engine.as_str(), "e-7");
                assert_eq!(hung[0].call, "genNotif");
                assert!(hung[0].age >= Duration::from_millis(20));
                break;
            }
            assert!(Instant::now() < deadline, "never counted: {pool:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Counted once, however long it hangs.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(offload.snapshot(name).hung_total, 1);
        transport.open();
        results_until(&offload, Duration::from_secs(30), |s| s.contains(&7)).await;
        let pool = offload.snapshot(name);
        assert_eq!((pool.hung_total, pool.hung().count()), (1, 0), "{pool:?}");
    }

    /// A transport whose every call takes 50 ms of wall time.
    struct Slow;

    impl Transport for Slow {
        type Resources = ();
        fn notify(&self, _: &AgentName, _: &[u8]) -> Result<(), TransportError> {
            std::thread::sleep(Duration::from_millis(50));
            Ok(())
        }
        fn release_with(
            &self,
            _: &EngineId,
            _: &[AgentName],
            _: (),
            _: Transfers,
        ) -> Vec<ReleaseStep> {
            Vec::new()
        }
    }

    /// A success waits for the driver's next wake-up without waking it;
    /// on a paused clock that wake-up (its next timer) comes only once the
    /// call is done, so the result is there before virtual time moves.
    #[tokio::test(start_paused = true)]
    async fn on_a_paused_clock_a_result_arrives_before_virtual_time_moves() {
        let offload = Offload::new(Arc::new(Slow));
        for round in 0..3 {
            let start = tokio::time::Instant::now();
            offload.submit([heartbeat(round, "ok")]);
            let mut out = Vec::new();
            tokio::select! {
                biased;
                () = offload.recv(&mut out) => panic!("a success woke the driver"),
                () = tokio::time::sleep(Duration::from_millis(10)) => {}
            }
            assert_eq!(
                tokio::time::Instant::now(),
                start + Duration::from_millis(10)
            );
            assert!(
                offload.try_recv(&mut out),
                "the result waits for the next wake-up"
            );
            assert_eq!(out.len(), 1);
        }
    }

    /// A transport whose notify fails for agents named `fail*`.
    struct Failing;

    impl Transport for Failing {
        type Resources = ();
        fn notify(&self, agent: &AgentName, _: &[u8]) -> Result<(), TransportError> {
            if agent.as_str().starts_with("fail") {
                Err(TransportError::new(
                    "genNotif",
                    nixl_status::NixlStatus::ERR_REMOTE_DISCONNECT,
                ))
            } else {
                Ok(())
            }
        }
        fn release_with(
            &self,
            _: &EngineId,
            _: &[AgentName],
            _: (),
            _: Transfers,
        ) -> Vec<ReleaseStep> {
            Vec::new()
        }
    }

    /// What the core must act on wakes the driver (a failed round, a
    /// release); successes alone never do, and are there by its next
    /// wake-up.
    #[tokio::test(start_paused = true)]
    async fn a_failed_round_or_a_release_wakes_the_driver_and_successes_alone_do_not() {
        let offload = Offload::new(Arc::new(Failing));
        let mut out = Vec::new();
        offload.submit([heartbeat(1, "ok"), heartbeat(2, "ok")]);
        tokio::select! {
            biased;
            () = offload.recv(&mut out) => panic!("successes woke the driver"),
            () = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
        assert!(offload.try_recv(&mut out));
        assert_eq!(out.len(), 2);
        out.clear();
        for urgent in [heartbeat(3, "fail-rank0"), release(4)] {
            offload.submit([heartbeat(5, "ok"), urgent]);
            tokio::select! {
                biased;
                () = offload.recv(&mut out) => {}
                () = tokio::time::sleep(Duration::from_secs(3600)) => panic!("not woken"),
            }
            // A release goes at once, maybe before the success beside it:
            // that one is there by the next wake-up (virtual time waits for
            // every call in flight).
            tokio::time::sleep(Duration::from_millis(10)).await;
            offload.try_recv(&mut out);
            assert_eq!(out.len(), 2, "both results by the next wake-up");
            out.clear();
        }
    }
}
