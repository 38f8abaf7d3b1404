//! The tokio driver: owns the clock, the transport and the channels, and
//! carries out what the core decides.
//!
//! It is thin on purpose: every rule is in [`crate::core`]. The driver
//! feeds the core the handle's messages (one channel, in the order they
//! were sent), the transport's results and the time; sleeps until the
//! core's next deadline (checking that deadline against the clock itself
//! rather than trusting that a timer fired); and carries out the core's
//! actions: transport calls go to the offload queue as one batch per
//! wake-up, answers go to whoever awaits them, events to subscribers.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use std::time::Instant;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::{Action, Answer, Core, Input};
use crate::config::Config;
use crate::core::RequestId;
use crate::driver::engine_ref::EngineRef;
use crate::driver::handle::{EngineIndex, KeepaliveHandle, Msg};
use crate::driver::offload::Offload;
use crate::event::Event;
use crate::registration::Registration;
use crate::snapshot::DetectionSummary;
use crate::telemetry;
use crate::transport::{EngineId, FailureWatch, GpuMappings, Suspicions, Transport};
use crate::ucx::settings::{
    detection_bound, is_cuda_ipc_cache_warning, secs_text, warnings, UcxSettings,
};

/// What the service could not release when it stopped, each registration
/// once: engines whose reads were still in flight at the drain deadline,
/// and registrations refused at shutdown whose caller had stopped waiting.
/// The caller releases them once its reads have ended.
#[non_exhaustive]
pub struct Stopped<R> {
    /// Registrations still held, resources and all.
    pub unreleased: Vec<Registration<R>>,
    /// Engines whose release was handed to the transport and had not come
    /// back at the drain deadline (a hung `invalidateRemoteMD`, say): their
    /// resources are with the transport call.
    pub releases_unfinished: Vec<EngineId>,
}

/// Most messages taken from the inbox in one wake-up.
const BATCH: usize = 256;

/// The keepalive service. Create it with [`Keepalive::new`], then run
/// [`Keepalive::run`] as a tokio task.
pub struct Keepalive<T: Transport> {
    config: Config,
    core: Core<T::Resources>,
    inbox: mpsc::UnboundedReceiver<Msg<T::Resources>>,
    events: broadcast::Sender<Event>,
    engines: EngineIndex,
    /// Every transport call (heartbeat rounds, releases), off the async
    /// threads.
    offload: Offload<T>,
    /// Questions the core has not answered yet, by request: every one is
    /// answered or withdrawn exactly once, so nothing outlives its ticket.
    replies: std::collections::HashMap<RequestId, oneshot::Sender<Answer<T::Resources>>>,
    /// Refused registrations whose caller stopped waiting: handed back at
    /// shutdown.
    orphans: Vec<Registration<T::Resources>>,
    startup: Startup,
    bound: Option<DetectionSummary>,
    /// The transport's endpoint-failure watch, running while the service
    /// does (`None`: off, or the transport cannot; `endpoint_events` says
    /// which).
    _failure_watch: Option<FailureWatch>,
    endpoint_events: EndpointEvents,
    /// What releases do with the engines' GPU mappings, found at start-up.
    gpu_mappings: GpuMappings,
}

/// Whether the transport's endpoint failures reach the service.
enum EndpointEvents {
    On,
    Off,
    Unavailable(String),
}

/// What the start-up line says.
struct Startup {
    line: String,
    warnings: Vec<String>,
    ucx: String,
}

impl<T: Transport> Keepalive<T> {
    /// A service over `transport`, and the handle to talk to it. Nothing
    /// runs until [`Keepalive::run`] is polled.
    pub fn new(transport: Arc<T>, config: Config) -> (Self, KeepaliveHandle<T::Resources>) {
        let (inbox_tx, inbox) = mpsc::unbounded_channel();
        let (events, _) = broadcast::channel(config.event_capacity);
        let engines = EngineIndex::default();
        let handle = KeepaliveHandle {
            sink: Arc::new(inbox_tx.clone()),
            inbox: inbox_tx,
            events: events.clone(),
            engines: engines.clone(),
            handed_back: Default::default(),
        };
        let rng = match config.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        let mut core = Core::new(config.clone(), clock_now(), rng);
        core.set_release_ends_transfers(transport.release_ends_transfers());
        let (failure_watch, endpoint_events) = if config.endpoint_events {
            // Weak: the watch must not keep the inbox open once every
            // handle is gone.
            let inbox = handle.inbox.downgrade();
            let suspicions = Suspicions::new(move |suspicion| {
                if let Some(inbox) = inbox.upgrade() {
                    let _ = inbox.send(Msg::Input(Input::Suspect(suspicion)));
                }
            });
            match transport.watch_failures(suspicions) {
                Ok(watch) => (Some(watch), EndpointEvents::On),
                Err(why) => (None, EndpointEvents::Unavailable(why)),
            }
        } else {
            (None, EndpointEvents::Off)
        };
        let gpu_mappings = transport.gpu_mappings(config.gpu_unmap);
        let service = Keepalive {
            offload: Offload::new(transport),
            core,
            config,
            inbox,
            events,
            engines,
            replies: Default::default(),
            orphans: Vec::new(),
            startup: Startup {
                line: "detection bound not computed (UCX settings not given: see Keepalive::with_ucx_settings)".into(),
                warnings: Vec::new(),
                ucx: "not read".into(),
            },
            bound: None,
            _failure_watch: failure_watch,
            endpoint_events,
            gpu_mappings,
        };
        (service, handle)
    }

    /// Tells the service the UCX settings in force (read them with
    /// [`UcxSettings::read`] before anything starts). With them it reports
    /// how long a dead prefill can go unnoticed, for each kind of death
    /// (crashed, silent, frozen with reads in flight: see
    /// [`crate::ucx::settings`]): one line at start-up, the
    /// `nixl_keepalive_detection_bound_{crashed,silent,frozen}_seconds`
    /// gauges, the snapshot; and it warns once about settings that defeat
    /// detection.
    pub fn with_ucx_settings(mut self, settings: &UcxSettings) -> Self {
        let gap = self
            .config
            .heartbeat_interval
            .map(|interval| interval + self.config.jitter);
        let bound = detection_bound(settings, gap.unwrap_or(Duration::ZERO))
            .with_read_stall(self.config.read_stall);
        let (line, crashed) = match gap {
            Some(_) => (bound.to_string(), Some(bound.crashed)),
            None => (
                format!(
                    "heartbeats are off (NIXL_KEEPALIVE_INTERVAL=inf): a crashed peer is released only after a transfer to it fails; {bound}"
                ),
                None,
            ),
        };
        let silent = bound.silent.filter(|_| gap.is_some());
        telemetry::detection_bound(crashed, silent, bound.frozen);
        let note = if settings.keepalive_enabled() {
            format!(
                "UCX keepalive ({}) fails a silent peer's endpoint{}; a frozen process on shm/tcp is never reported",
                settings.keepalive_interval.value,
                silent.map_or(String::new(), |d| format!(", release within {}", secs_text(d)))
            )
        } else {
            "UCX keepalive is off (inf or NUM_EPS 0): a silent peer is never reported".to_string()
        };
        self.core.set_silent_peer_note(note);
        // UCX's cache costs nothing where releases give its mappings back.
        let cache_is_free = self.gpu_mappings.memory_comes_back();
        self.startup = Startup {
            line,
            warnings: warnings(settings)
                .into_iter()
                .filter(|w| !(cache_is_free && is_cuda_ipc_cache_warning(w)))
                .collect(),
            ucx: settings.summary(),
        };
        self.bound = Some(DetectionSummary {
            crashed,
            silent,
            frozen: bound.frozen,
        });
        self
    }

    /// Runs until `shutdown` is cancelled, then stops: every engine is
    /// marked (new reads are refused), each is released as its reads end,
    /// for at most [`Config::shutdown_drain`]; what is left is returned.
    /// Registrations that arrive once the stop has begun are refused with
    /// [`crate::RegisterError::Stopped`].
    ///
    /// Cancel safety: not cancel safe; stop it with the token.
    #[tracing::instrument(name = "nixl_keepalive", skip_all)]
    pub async fn run(mut self, shutdown: CancellationToken) -> Stopped<T::Resources> {
        tracing::info!(
            config = %self.config,
            ucx = %self.startup.ucx,
            "nixl-keepalive started: {}",
            self.startup.line
        );
        for warning in &self.startup.warnings {
            tracing::warn!("{warning}");
        }
        match &self.gpu_mappings {
            GpuMappings::Unavailable(_) => tracing::warn!("{}", self.gpu_mappings),
            other => tracing::info!("{other}"),
        }
        match &self.endpoint_events {
            EndpointEvents::On => tracing::info!("endpoint events on: an engine whose UCX endpoint fails gets a heartbeat at once"),
            EndpointEvents::Off => tracing::info!("endpoint events off (NIXL_KEEPALIVE_ENDPOINT_EVENTS=off): crashed engines are found by heartbeats alone"),
            EndpointEvents::Unavailable(why) => tracing::warn!(reason = %why, "endpoint events unavailable: crashed engines are found by heartbeats alone"),
        }
        for var in Config::unknown_env_vars() {
            tracing::warn!(%var, "unknown NIXL_KEEPALIVE_ environment variable ignored (a typo?)");
        }
        let mut msgs = Vec::with_capacity(BATCH);
        let mut results = Vec::new();
        let mut stopping = false;
        let mut inbox_open = true;
        let sleep = tokio::time::sleep_until(tokio::time::Instant::now());
        tokio::pin!(sleep);
        loop {
            // Results that carry only successes wake nobody (offload): they
            // are taken here, at every wake-up, before anything else (a
            // timer's round must see the last round as back).
            self.take_results(&mut results);
            self.carry_out();
            let now = clock_now();
            if self.core.is_stopped(now) {
                break;
            }
            let deadline = self.core.poll_timeout();
            if let Some(deadline) = deadline {
                // Checked against the clock here, not only when the sleep
                // fires: a busy loop must not starve the timers.
                if deadline <= now {
                    self.core.handle_timeout(now);
                    continue;
                }
                let deadline = tokio::time::Instant::from_std(deadline);
                if sleep.deadline() != deadline {
                    sleep.as_mut().reset(deadline);
                }
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled(), if !stopping => {
                    stopping = true;
                    tracing::info!("nixl-keepalive stopping");
                    self.core.handle(clock_now(), Input::Shutdown);
                }
                n = self.inbox.recv_many(&mut msgs, BATCH), if inbox_open => {
                    if n == 0 {
                        // Every handle and engine reference is gone: only
                        // the timers and the token are left to serve.
                        inbox_open = false;
                    }
                    let now = clock_now();
                    for msg in msgs.drain(..) {
                        self.on_msg(now, msg);
                    }
                }
                _ = self.offload.recv(&mut results) => {
                    self.core.handle_results(clock_now(), &mut results);
                }
                _ = &mut sleep, if deadline.is_some() => {}
            }
        }
        // Whatever is still in the inbox is answered: the service is gone.
        self.inbox.close();
        while let Ok(msg) = self.inbox.try_recv() {
            self.on_msg(clock_now(), msg);
        }
        self.carry_out();
        let (mut unreleased, releases_unfinished) = self.core.into_unreleased();
        unreleased.append(&mut self.orphans);
        if !unreleased.is_empty() || !releases_unfinished.is_empty() {
            tracing::warn!(
                unreleased = unreleased.len(),
                releases_unfinished = releases_unfinished.len(),
                "stopped with engines still held (reads in flight at the drain deadline, or a release that did not come back): returned to the caller"
            );
        } else {
            tracing::info!("nixl-keepalive stopped: every engine released");
        }
        Stopped {
            unreleased,
            releases_unfinished,
        }
    }

    /// Hands the core every call result that is back, without waiting:
    /// results that carry only successes wake nobody (`offload`).
    fn take_results(&mut self, results: &mut Vec<crate::core::CallOutcome>) {
        if self.offload.try_recv(results) {
            self.core.handle_results(clock_now(), results);
        }
    }

    fn on_msg(&mut self, now: Instant, msg: Msg<T::Resources>) {
        match msg {
            Msg::Input(input) => self.core.handle(now, input),
            Msg::Ask {
                request,
                input,
                reply,
            } => {
                self.replies.insert(request, reply);
                self.core.handle(now, input);
            }
            Msg::Snapshot(done) => {
                // What came back counts, woken for or not.
                self.take_results(&mut Vec::new());
                let mut snapshot = self.core.snapshot(now);
                snapshot.detection_bound = self.bound;
                let ids: std::collections::HashMap<crate::registration::RegistrationId, EngineId> =
                    self.engines
                        .read()
                        .expect("engine index poisoned")
                        .iter()
                        .map(|(id, e)| (e.cell.serial(), id.clone()))
                        .collect();
                snapshot.transport = self.offload.snapshot(|serial| ids.get(&serial).cloned());
                for call in snapshot.transport.hung() {
                    if let Some(e) = snapshot
                        .engines
                        .iter_mut()
                        .find(|e| e.engine == call.engine)
                    {
                        e.why.push_str(&format!(
                            "; its {} call has been inside the transport for {:?} (hung: it holds one transport thread, and the engine gets no other heartbeat until it returns)",
                            call.call, call.age
                        ));
                    }
                }
                let _ = done.send(snapshot);
            }
        }
    }

    /// Carries out every decision the core has queued; transport calls go
    /// to the offload queue as one batch, after the rest.
    fn carry_out(&mut self) {
        while let Some(action) = self.core.poll_action() {
            match action {
                Action::Activated { cell } => {
                    let engine = EngineRef { cell };
                    self.engines
                        .write()
                        .expect("engine index poisoned")
                        .insert(engine.id().clone(), engine);
                }
                Action::Answer { request, answer } => {
                    let Some(reply) = self.replies.remove(&request) else {
                        continue;
                    };
                    if let Err(Answer::Refused(error)) = reply.send(answer) {
                        // Refused, and its caller stopped waiting: handed
                        // back at shutdown.
                        if let Some(registration) = error.into_registration() {
                            self.orphans.push(registration);
                        }
                    }
                }
                Action::Forget { engine, serial } => {
                    let mut engines = self.engines.write().expect("engine index poisoned");
                    if engines
                        .get(&engine)
                        .is_some_and(|e| e.cell.serial() == serial)
                    {
                        engines.remove(&engine);
                        crate::shrink::after_removal(&mut *engines);
                    }
                }
                Action::FailReads { cell } => cell.fail_reads(),
                Action::ReleaseFinished {
                    cell,
                    transfers_ended,
                } => cell.release_finished(transfers_ended),
                Action::Count(count) => telemetry::record(count),
                Action::Expedite { serial } => self.offload.expedite(serial),
                Action::Emit(event) => {
                    // No subscriber is not an error.
                    let _ = self.events.send(event);
                }
            }
        }
        let calls = self.core.take_calls();
        if !calls.is_empty() {
            self.offload.submit(calls);
        }
    }
}

/// Spawns the service on the current tokio runtime: the usual way to run
/// it. Returns the handle and the task, whose output is what the service
/// could not release when `shutdown` was cancelled.
pub fn spawn<T: Transport>(
    transport: Arc<T>,
    config: Config,
    shutdown: CancellationToken,
) -> (
    KeepaliveHandle<T::Resources>,
    tokio::task::JoinHandle<Stopped<T::Resources>>,
) {
    let (service, handle) = Keepalive::new(transport, config);
    (handle, tokio::spawn(service.run(shutdown)))
}

/// The core's `now`: tokio's clock (paused in tests, so the core sees
/// virtual time) as the plain `std::time::Instant` the core works in.
fn clock_now() -> Instant {
    tokio::time::Instant::now().into_std()
}
