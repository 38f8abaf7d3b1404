//! The simulated decoder runtime: what vLLM's NIXL connector does around
//! the keepalive service. Handshakes (guarded), registrations, read traffic
//! with guards, reconnects after a release. Its read counts feed the
//! release audit ([`nixl_keepalive::fake::AuditedUcx`]), which checks the
//! safety rule independently of the library's own bookkeeping.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::BackoffBuilder;
use nixl_keepalive::fake::{AuditedUcx, FakeError, FakeResources, FakeUcx};
use nixl_keepalive::{
    EngineRef, EngineState, Event, KeepaliveHandle, LeaseError, NixlStatus, PeerAddr, Ready,
};
use nixl_keepalive_cli::pd::retry;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::broadcast;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::report::{EventCounts, Reads, Timeline};

/// How reads look: a transfer takes `read` (uniform), then the runtime
/// polls its status every `poll`; `gap` between reads of one reader.
#[derive(Clone, Copy, Debug)]
pub(super) struct TrafficShape {
    read: (Duration, Duration),
    poll: Duration,
    gap: (Duration, Duration),
    /// Simulated side-channel round trip of a handshake.
    handshake: Duration,
    /// Push mode: the transfers are WRITEs into the peers (the service
    /// runs in a prefill, the peers are decodes), guarded as reads are.
    push: bool,
}

impl Default for TrafficShape {
    fn default() -> Self {
        TrafficShape {
            read: (Duration::from_millis(20), Duration::from_millis(250)),
            poll: Duration::from_millis(50),
            gap: (Duration::from_millis(0), Duration::from_millis(50)),
            handshake: Duration::from_millis(30),
            push: false,
        }
    }
}

impl TrafficShape {
    /// The same traffic, as push-mode writes when `push`.
    pub(super) fn with_push(self, push: bool) -> Self {
        TrafficShape { push, ..self }
    }

    /// The longest a read holds its guard while its peer answers.
    pub(super) fn max_read(&self) -> Duration {
        self.read.1 + self.poll
    }
}

/// The registration the runtime uses for one prefill address.
#[derive(Clone)]
struct Current {
    engine: EngineRef,
    /// The audit's count of this registration's reads in flight.
    reads: Arc<AtomicUsize>,
}

/// Read outcomes, counted by the runtime.
#[derive(Default)]
pub(super) struct ReadCounts {
    pub(super) ok: AtomicU64,
    pub(super) refused: AtomicU64,
    pub(super) failed_by_service: AtomicU64,
    pub(super) disconnect: AtomicU64,
    pub(super) other_error: AtomicU64,
    pub(super) handshakes_ok: AtomicU64,
    pub(super) handshakes_failed: AtomicU64,
}

/// The decoder runtime. Cheap to clone.
#[derive(Clone)]
pub(super) struct Decoder {
    inner: Arc<Inner>,
}

struct Inner {
    ucx: FakeUcx,
    handle: KeepaliveHandle<FakeResources>,
    addrs: Vec<PeerAddr>,
    current: Mutex<Vec<Option<Current>>>,
    connecting: Mutex<HashSet<usize>>,
    audit: Arc<AuditedUcx>,
    timeline: Arc<Timeline>,
    shape: TrafficShape,
    seed: u64,
    stopping: CancellationToken,
    tasks: Mutex<JoinSet<()>>,
    counts: ReadCounts,
}

impl Decoder {
    pub(super) fn new(
        ucx: FakeUcx,
        handle: KeepaliveHandle<FakeResources>,
        addrs: Vec<PeerAddr>,
        audit: Arc<AuditedUcx>,
        timeline: Arc<Timeline>,
        shape: TrafficShape,
        seed: u64,
    ) -> Self {
        let n = addrs.len();
        Decoder {
            inner: Arc::new(Inner {
                ucx,
                handle,
                addrs,
                current: Mutex::new(vec![None; n]),
                connecting: Mutex::new(HashSet::new()),
                audit,
                timeline,
                shape,
                seed,
                stopping: CancellationToken::new(),
                tasks: Mutex::new(JoinSet::new()),
                counts: ReadCounts::default(),
            }),
        }
    }

    pub(super) fn ucx(&self) -> &FakeUcx {
        &self.inner.ucx
    }

    pub(super) fn addr(&self, prefill: usize) -> &PeerAddr {
        &self.inner.addrs[prefill]
    }

    pub(super) fn prefills(&self) -> usize {
        self.inner.addrs.len()
    }

    /// The read and handshake outcomes counted so far.
    pub(super) fn reads(&self) -> Reads {
        let c = &self.inner.counts;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Reads {
            ok: get(&c.ok),
            refused_marked_engine: get(&c.refused),
            failed_by_service: get(&c.failed_by_service),
            remote_disconnect: get(&c.disconnect),
            other_error: get(&c.other_error),
            handshakes_ok: get(&c.handshakes_ok),
            handshakes_failed: get(&c.handshakes_failed),
        }
    }

    fn current(&self) -> std::sync::MutexGuard<'_, Vec<Option<Current>>> {
        self.inner.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The engine the decoder uses at `prefill` now, if any.
    pub(super) fn engine_at(&self, prefill: usize) -> Option<EngineRef> {
        self.current()[prefill].as_ref().map(|c| c.engine.clone())
    }

    /// The decoder has a live engine at `prefill` and its process answers.
    pub(super) fn is_healthy(&self, prefill: usize) -> bool {
        let Some(engine) = self.engine_at(prefill) else {
            return false;
        };
        engine.state() == EngineState::Live
            && self.inner.ucx.engine_at(self.addr(prefill)).as_ref() == Some(engine.id())
            && self.inner.ucx.fetch_metadata(self.addr(prefill)).is_ok()
    }

    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.inner
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .spawn(task);
    }

    /// Connects to every prefill, one after the other.
    pub(super) async fn connect_all(&self) {
        for prefill in 0..self.prefills() {
            self.clone().connect(prefill).await;
        }
    }

    /// A router says a (new) process answers at `prefill`'s address.
    pub(super) fn announce(&self, prefill: usize) {
        let me = self.clone();
        self.spawn(async move { me.connect(prefill).await });
    }

    /// Handshakes with `prefill` until it works, nobody listens there any
    /// more, or the decoder stops. One at a time per address.
    async fn connect(self, prefill: usize) {
        if !self
            .inner
            .connecting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(prefill)
        {
            return;
        }
        let mut pauses = retry::backoff(Duration::from_millis(500), Duration::from_secs(5)).build();
        loop {
            if self.inner.stopping.is_cancelled()
                || self.inner.ucx.engine_at(self.addr(prefill)).is_none()
            {
                break;
            }
            match self.handshake(prefill).await {
                Ok(()) => break,
                Err(why) => {
                    self.inner
                        .counts
                        .handshakes_failed
                        .fetch_add(1, Ordering::Relaxed);
                    // Never `None`: no limit on attempts.
                    let pause = pauses.next().unwrap_or(Duration::from_secs(5));
                    // Too chatty for the live view: a debug line.
                    tracing::debug!(
                        address = %self.addr(prefill),
                        error = %why,
                        retry_in_ms = pause.as_millis() as u64,
                        "demo: handshake failed, retrying"
                    );
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = self.inner.stopping.cancelled() => break,
                    }
                }
            }
        }
        self.inner
            .connecting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&prefill);
    }

    /// One handshake, through the library's protocol: side channel, then
    /// `ready_to_load` (any registration of the engine id found goes first,
    /// whatever its state), then load the metadata and prep the dlists,
    /// then register. The handshake holds back the release of the engine
    /// previously at this address while the runtime is still deciding.
    async fn handshake(&self, prefill: usize) -> Result<(), String> {
        let inner = &self.inner;
        let addr = self.addr(prefill).clone();
        let handshake = inner.handle.handshake(addr.clone());
        tokio::time::sleep(inner.shape.handshake).await;
        let metadata = inner.ucx.fetch_metadata(&addr).map_err(|e| e.to_string())?;
        let ready = tokio::select! {
            ready = handshake.ready_to_load(metadata.claim()) => ready.map_err(|e| e.to_string())?,
            _ = inner.stopping.cancelled() => return Err("the decoder is stopping".into()),
        };
        let ready = match ready {
            Ready::Load(ready) => ready,
            // This process is registered already (ours): nothing to load.
            Ready::Current(_) => return Ok(()),
        };
        if inner.stopping.is_cancelled() {
            return Ok(());
        }
        let hs = inner.ucx.load_metadata(&metadata).map_err(|e| match e {
            FakeError::Load { agent, status } => format!("loadRemoteMD {agent}: {status}"),
            other => other.to_string(),
        })?;
        let reads = inner.audit.track(hs.resources.clone());
        match ready.register(hs.resources).await {
            Ok(engine) => {
                inner.counts.handshakes_ok.fetch_add(1, Ordering::Relaxed);
                self.current()[prefill] = Some(Current { engine, reads });
                Ok(())
            }
            Err(e) => {
                let text = format!("register: {e}");
                // Loaded, not registered: the runtime gives it back.
                e.give_back(&inner.ucx);
                Err(text)
            }
        }
    }

    /// What the runtime does on an event: after a release, forget the
    /// engine and reconnect if a process listens at its address.
    fn on_event(&self, event: &Event) {
        if let Event::Released { registration, .. } = event {
            let mut reconnect = None;
            {
                let mut current = self.current();
                for (prefill, slot) in current.iter_mut().enumerate() {
                    // The event names the registration: a pinned id's
                    // successor is never taken for the one released.
                    let released = slot
                        .as_ref()
                        .is_some_and(|c| c.engine.registration() == *registration);
                    if released {
                        *slot = None;
                        reconnect = Some(prefill);
                    }
                }
            }
            if let Some(prefill) = reconnect {
                if !self.inner.stopping.is_cancelled() {
                    self.announce(prefill);
                }
            }
        }
    }

    /// Listens to the service's events: feeds the timeline and reacts.
    pub(super) fn watch_events(self, mut events: broadcast::Receiver<Event>) -> Watcher {
        let stop = CancellationToken::new();
        let counts = Arc::new(Mutex::new(EventCounts::default()));
        let task = {
            let stop = stop.clone();
            let counts = counts.clone();
            tokio::spawn(async move {
                let seen = |event: Event, me: &Decoder| {
                    me.inner.timeline.on_event(&event);
                    counts
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .count(&event);
                    me.on_event(&event);
                };
                loop {
                    tokio::select! {
                        biased;
                        received = events.recv() => match received {
                            Ok(event) => seen(event, &self),
                            Err(broadcast::error::RecvError::Lagged(n)) => {
                                counts.lock().unwrap_or_else(|e| e.into_inner()).lagged += n;
                            }
                            Err(broadcast::error::RecvError::Closed) => break,
                        },
                        _ = stop.cancelled() => {
                            // The service has stopped: take what is left.
                            while let Ok(event) = events.try_recv() {
                                seen(event, &self);
                            }
                            break;
                        }
                    }
                }
            })
        };
        Watcher { stop, task, counts }
    }

    /// Starts `n` reader loops.
    pub(super) fn start_readers(self, n: usize) {
        for r in 0..n {
            let me = self.clone();
            let seed = self.inner.seed.wrapping_mul(31).wrapping_add(r as u64);
            self.spawn(async move { me.reader(StdRng::seed_from_u64(seed)).await });
        }
    }

    /// One reader: picks a prefill, starts a read (guard), lets the
    /// transfer run, polls it to its end, reports its status.
    async fn reader(self, mut rng: StdRng) {
        let inner = &self.inner;
        let shape = inner.shape;
        let mut request = 0u64;
        while !inner.stopping.is_cancelled() {
            let gap = rng.random_range(shape.gap.0..=shape.gap.1);
            tokio::select! {
                _ = tokio::time::sleep(gap) => {}
                _ = inner.stopping.cancelled() => break,
            }
            let prefill = rng.random_range(0..self.prefills());
            let Some(current) = self.current()[prefill].clone() else {
                continue;
            };
            let begun = if shape.push {
                current.engine.begin_write()
            } else {
                current.engine.begin_read()
            };
            let guard = match begun {
                Ok(guard) => guard,
                Err(_) => {
                    inner.counts.refused.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            current.reads.fetch_add(1, Ordering::SeqCst);
            request += 1;
            let engine = current.engine.id().clone();
            let lease = format!("req-{}-{request}", rng.random::<u32>());
            if let Err(LeaseError::RequestId(e)) =
                inner.handle.add_leases(&engine, vec![lease.clone()], false)
            {
                // (A stopped service is the end of the run: no lease.)
                panic!("the demo's request ids are valid: {e}");
            }
            let failed = guard.failed();
            tokio::pin!(failed);
            let mut wait = rng.random_range(shape.read.0..=shape.read.1);
            let mut status;
            let mut failed_by_service = false;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = &mut failed => { failed_by_service = true; }
                }
                if failed_by_service {
                    status = NixlStatus::ERR_REMOTE_DISCONNECT;
                    break;
                }
                status = if shape.push {
                    inner.ucx.write(&engine)
                } else {
                    inner.ucx.read(&engine)
                };
                if status == NixlStatus::ERR_NOT_FOUND {
                    let what = if shape.push {
                        "a write into"
                    } else {
                        "a read from"
                    };
                    inner.timeline.violation(format!(
                        "{what} {engine} got NIXL_ERR_NOT_FOUND while its guard was held: its metadata was released under it"
                    ));
                }
                if status != NixlStatus::IN_PROG || inner.stopping.is_cancelled() {
                    break;
                }
                wait = shape.poll;
            }
            // A stopped service renews nothing: there is nothing to remove.
            let _ = inner.handle.remove_leases(&engine, vec![lease]);
            let counter = if failed_by_service {
                &inner.counts.failed_by_service
            } else if status == NixlStatus::SUCCESS {
                &inner.counts.ok
            } else if status.is_remote_disconnect() {
                &inner.counts.disconnect
            } else {
                &inner.counts.other_error
            };
            counter.fetch_add(1, Ordering::Relaxed);
            current.reads.fetch_sub(1, Ordering::SeqCst);
            if failed_by_service || status == NixlStatus::IN_PROG {
                // Abandoned: the request fails (or is recomputed).
                drop(guard);
            } else {
                guard.finish(status);
            }
        }
    }

    /// Stops the readers and reconnects and waits for them: every guard the
    /// runtime held is dropped when this returns.
    pub(super) async fn stop(&self) {
        self.inner.stopping.cancel();
        let mut tasks =
            std::mem::take(&mut *self.inner.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        while let Some(done) = tasks.join_next().await {
            if let Err(e) = done {
                self.inner
                    .timeline
                    .violation(format!("a decoder task failed: {e}"));
            }
        }
        // Spawned while we waited (an event's reconnect): none should be.
        let late = std::mem::take(&mut *self.inner.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        let mut late = late;
        while late.join_next().await.is_some() {}
    }
}

/// The event listener task.
pub(super) struct Watcher {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    counts: Arc<Mutex<EventCounts>>,
}

impl Watcher {
    /// Takes the events left (the service must have stopped) and returns
    /// the counts.
    pub(super) async fn finish(self) -> EventCounts {
        self.stop.cancel();
        let _ = self.task.await;
        let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        counts.clone()
    }
}
