//! Transport calls off the async threads: one queue, served by as few
//! blocking threads as keep every call isolated.
//!
//! Transport calls are blocking FFI and may never return. One
//! `spawn_blocking` per call isolates them, but costs a thread hand-off and
//! a join per heartbeat: most of the service's CPU at 10k engines. Here the
//! driver queues jobs, and workers (tokio blocking tasks) take them one at a
//! time and exit as soon as the queue is empty. One rule keeps isolation:
//!
//! > while a job is queued, at least one worker is alive and not inside a
//! > transport call.
//!
//! A submit that finds every worker inside a call starts a worker. A worker
//! that takes a job, leaving others queued while every other worker is
//! inside a call that has already lasted [`STUCK`], starts a spare before it
//! makes its own call (alone, it always does). So a call that hangs holds
//! its own thread only, and whatever is queued behind it has a worker. In
//! the common case (fast calls) two workers drain a whole slot's worth of
//! jobs; a spare per job (the rule without the [`STUCK`] test) cost a
//! thread start per heartbeat in bursts.
//!
//! What is left: two calls that start within [`STUCK`] of each other and
//! both hang leave the jobs behind them waiting for the next submit (the
//! next heartbeat slot or release), which starts a worker.
//!
//! The rule reads the wall clock (`std::time::Instant`) at each take, and
//! sets no timer: a watchdog would need one, and tokio's timers follow the
//! paused clock in tests, which does not move while a blocking task runs,
//! so a job queued behind a hung call would wait for a timer that never
//! fires.
//!
//! Workers are tokio blocking tasks, not bare threads, and each hands its
//! result to the driver before it takes the next job or exits. On a paused
//! clock tokio does not advance time while a blocking task runs, so every
//! result reaches the driver before virtual time can move: tests stay
//! deterministic.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::table::RoundResults;
use crate::transport::{
    AgentName, EngineId, ReleaseStep, ReleaseTarget, Transport, TransportError,
};
use crate::NixlStatus;

/// Most results the driver takes in one wake-up.
const BATCH: usize = 256;

/// A transport call to make off the async threads.
pub(crate) enum Job<R> {
    /// One heartbeat round: `message` to every agent of the engine.
    Heartbeat {
        serial: u64,
        agents: Arc<[AgentName]>,
        message: Arc<[u8]>,
    },
    /// Give back an engine's NIXL state.
    Release {
        serial: u64,
        engine: EngineId,
        agents: Arc<[AgentName]>,
        resources: R,
    },
}

/// What a job came back with.
pub(crate) enum Outcome {
    /// A heartbeat round's results.
    Heartbeat { serial: u64, results: RoundResults },
    /// A release's steps.
    Release {
        serial: u64,
        steps: Vec<ReleaseStep>,
    },
}

/// The driver's side: submits jobs, receives outcomes.
pub(crate) struct Offload<T: Transport> {
    lane: Arc<Lane<T>>,
    outcomes: mpsc::UnboundedReceiver<Outcome>,
    /// Releases submitted whose outcome has not been received.
    releases_pending: usize,
}

/// What the driver and the workers share.
struct Lane<T: Transport> {
    transport: Arc<T>,
    queue: Mutex<Queue<T::Resources>>,
    outcomes: mpsc::UnboundedSender<Outcome>,
}

/// A call lasting this long (wall clock) is taken as possibly hung when a
/// worker decides whether jobs queued behind it need a spare worker.
pub(crate) const STUCK: Duration = Duration::from_millis(1);

/// Jobs waiting, and the workers that serve them. Counters change only
/// under the lock, with the jobs.
struct Queue<R> {
    jobs: VecDeque<Job<R>>,
    /// Workers started and not yet exited.
    workers: usize,
    /// Workers inside a transport call, by worker id, with when the call
    /// began.
    in_call: Vec<(u64, Instant)>,
    next_worker: u64,
}

impl<R> Queue<R> {
    /// At a submit: counts a new worker if jobs wait and every worker is
    /// inside a call (or there is none); the caller then starts it.
    fn claim_worker(&mut self) -> bool {
        let needed = !self.jobs.is_empty() && self.in_call.len() == self.workers;
        if needed {
            self.workers += 1;
        }
        needed
    }

    /// At a take by worker `me`, just counted inside its call: counts a
    /// spare if jobs still wait, no worker is free, and every other call in
    /// progress has lasted [`STUCK`].
    fn claim_spare(&mut self, me: u64, now: Instant) -> bool {
        let needed = !self.jobs.is_empty()
            && self.in_call.len() == self.workers
            && self
                .in_call
                .iter()
                .filter(|(id, _)| *id != me)
                .all(|(_, since)| now.duration_since(*since) >= STUCK);
        if needed {
            self.workers += 1;
        }
        needed
    }
}

impl<T: Transport> Offload<T> {
    /// An idle offload over `transport`. Starts nothing; needs no runtime
    /// until the first submit.
    pub(crate) fn new(transport: Arc<T>) -> Self {
        let (tx, outcomes) = mpsc::unbounded_channel();
        Offload {
            lane: Arc::new(Lane {
                transport,
                queue: Mutex::new(Queue {
                    jobs: VecDeque::new(),
                    workers: 0,
                    in_call: Vec::new(),
                    next_worker: 0,
                }),
                outcomes: tx,
            }),
            outcomes,
            releases_pending: 0,
        }
    }

    /// Queues a job; its outcome comes back through [`Offload::recv`].
    /// Must be called within the tokio runtime (it may start a worker).
    pub(crate) fn submit(&mut self, job: Job<T::Resources>) {
        if matches!(job, Job::Release { .. }) {
            self.releases_pending += 1;
        }
        let start = {
            let mut queue = self.lane.lock();
            queue.jobs.push_back(job);
            queue.claim_worker()
        };
        if start {
            Lane::start_worker(&self.lane);
        }
    }

    /// Waits for at least one outcome and moves every outcome ready (up to
    /// a batch) into `out`.
    ///
    /// Cancel safe: an outcome is either in `out` or still in the channel.
    pub(crate) async fn recv(&mut self, out: &mut Vec<Outcome>) {
        let from = out.len();
        // Never 0: the lane holds a sender as long as `self` lives.
        self.outcomes.recv_many(out, BATCH).await;
        self.releases_pending -= out[from..]
            .iter()
            .filter(|o| matches!(o, Outcome::Release { .. }))
            .count();
    }

    /// Releases submitted and not yet received back.
    pub(crate) fn releases_pending(&self) -> usize {
        self.releases_pending
    }
}

impl<T: Transport> Drop for Offload<T> {
    /// Heartbeats not started are dropped; releases not started still run
    /// (their resources must go back to NIXL), their outcomes unheard.
    fn drop(&mut self) {
        self.lane
            .lock()
            .jobs
            .retain(|job| matches!(job, Job::Release { .. }));
    }
}

impl<T: Transport> Lane<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<T::Resources>> {
        // Nothing that can panic runs under the lock.
        self.queue.lock().expect("offload queue poisoned")
    }

    /// Starts a worker already counted in `workers`. Within the runtime:
    /// the driver, or a worker (blocking threads run in its context).
    fn start_worker(lane: &Arc<Self>) {
        let lane = lane.clone();
        drop(tokio::task::spawn_blocking(move || lane.work()));
    }

    /// A worker: takes jobs until the queue is empty, then exits.
    fn work(self: &Arc<Self>) {
        let me = {
            let mut queue = self.lock();
            queue.next_worker += 1;
            queue.next_worker
        };
        let mut finished: Option<Outcome> = None;
        loop {
            let (job, start) = {
                let mut queue = self.lock();
                if finished.is_some() {
                    queue.in_call.retain(|(id, _)| *id != me);
                }
                match queue.jobs.pop_front() {
                    Some(job) => {
                        let now = Instant::now();
                        queue.in_call.push((me, now));
                        (Some(job), queue.claim_spare(me, now))
                    }
                    None => {
                        queue.workers -= 1;
                        (None, false)
                    }
                }
            };
            // Before the next call (which may hang) and before exiting
            // (which may let a paused clock move): the driver has it.
            if let Some(outcome) = finished.take() {
                // The driver has stopped: nobody is waiting for it.
                let _ = self.outcomes.send(outcome);
            }
            let Some(job) = job else {
                return;
            };
            if start {
                // Jobs wait behind this call and every other worker is in
                // a call that may be hung: they get a worker of their own,
                // in case this one hangs too.
                Lane::start_worker(self);
            }
            finished = Some(self.call(job));
        }
    }

    /// Makes one job's transport calls; a panic is a failed call.
    fn call(&self, job: Job<T::Resources>) -> Outcome {
        match job {
            Job::Heartbeat {
                serial,
                agents,
                message,
            } => {
                let mut results = RoundResults::default();
                for agent in agents.iter() {
                    let result =
                        catch_unwind(AssertUnwindSafe(|| self.transport.notify(agent, &message)))
                            .unwrap_or_else(|_| {
                                Err(TransportError::new(
                                    "genNotif (transport panicked)",
                                    NixlStatus::ERR_UNKNOWN,
                                ))
                            });
                    match result {
                        Ok(()) => results.sent += 1,
                        Err(e) => results.failed.push((agent.clone(), e)),
                    }
                }
                Outcome::Heartbeat { serial, results }
            }
            Job::Release {
                serial,
                engine,
                agents,
                resources,
            } => {
                let steps = catch_unwind(AssertUnwindSafe(|| {
                    self.transport.release(&engine, &agents, resources)
                }))
                .unwrap_or_else(|_| {
                    tracing::error!(%engine, "transport panicked while releasing");
                    vec![ReleaseStep {
                        target: ReleaseTarget::DlistHandle(0),
                        status: NixlStatus::ERR_UNKNOWN,
                    }]
                });
                Outcome::Release { serial, steps }
            }
        }
    }
}
