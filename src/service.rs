//! The tokio driver: owns the clock, the timers, the transport and the
//! channels, and carries out what the peer table decides.
//!
//! Transport calls are blocking FFI. They run on blocking threads through
//! the `offload` queue, which gives jobs queued behind a call that may be
//! hung a thread of their own, so a notification that hangs on one engine
//! holds one thread and delays no other engine's heartbeat; the table never
//! stacks a second round on an engine whose first has not come back.

use std::collections::HashMap;
use std::future::poll_fn;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tokio_util::time::{delay_queue, DelayQueue};

use crate::config::Config;
use crate::engine::{EngineCell, EngineRef, ReadGuard, Wake};
use crate::error::{ReadRefused, ServiceStopped};
use crate::event::Event;
use crate::offload::{Offload, Outcome};
use crate::snapshot::{DetectionSummary, Snapshot};
use crate::table::{Action, GoneMode, PeerRef, PeerTable, Registration};
use crate::telemetry;
use crate::transport::{EngineId, PeerAddr, Transport};
use crate::ucx_settings::{detection_bound, warnings, UcxSettings};
use crate::{EngineState, NixlStatus};

/// Requests that carry the transport's resources type.
enum Command<R> {
    Register {
        registration: Registration<R>,
        cell: Arc<EngineCell>,
        done: oneshot::Sender<EngineRef>,
    },
    PrepareReload {
        engine: EngineId,
        done: oneshot::Sender<()>,
    },
    AddLeases {
        engine: EngineId,
        requests: Vec<String>,
        renew_now: bool,
    },
    RemoveLeases {
        engine: EngineId,
        requests: Vec<String>,
    },
    PeerGone {
        peer: PeerRef,
        mode: GoneMode,
    },
    Snapshot(oneshot::Sender<Snapshot>),
}

/// Engines by id, for runtimes that look them up instead of keeping the
/// [`EngineRef`]. Written by the service at registration and release only.
type Directory = Arc<RwLock<HashMap<EngineId, EngineRef>>>;

/// The decoder runtime's side of the service. Cheap to clone; every method
/// is non-blocking except the `async` ones, which wait for the service.
pub struct KeepaliveHandle<R> {
    commands: mpsc::UnboundedSender<Command<R>>,
    wake: mpsc::UnboundedSender<Wake>,
    events: broadcast::Sender<Event>,
    directory: Directory,
}

impl<R> Clone for KeepaliveHandle<R> {
    fn clone(&self) -> Self {
        KeepaliveHandle {
            commands: self.commands.clone(),
            wake: self.wake.clone(),
            events: self.events.clone(),
            directory: self.directory.clone(),
        }
    }
}

impl<R: Send + 'static> KeepaliveHandle<R> {
    /// Says a handshake with `address` has started. Until the guard drops,
    /// the engine previously at that address is not released: the runtime
    /// may still be deciding whether the engine there is new.
    pub fn handshake_started(&self, address: PeerAddr) -> HandshakeGuard {
        // Through the same channel as the guard's drop, so the service can
        // never see the end of a handshake before its start.
        let _ = self.wake.send(Wake::HandshakeStarted(address.clone()));
        HandshakeGuard {
            address: Some(address),
            wake: self.wake.clone(),
        }
    }

    /// Registers an engine after a successful handshake (its metadata
    /// loaded, its dlists prepped) and returns its reference once active.
    ///
    /// A new engine id at a known address marks the old engine replaced. An
    /// engine id already registered (a pinned id that came back) first has
    /// its old registration released; this resolves after that. Prefer
    /// [`KeepaliveHandle::prepare_reload`] before loading the metadata
    /// again, since NIXL refuses to load over loaded metadata.
    ///
    /// Cancel safety: dropping the future does not undo the registration.
    pub async fn register(
        &self,
        registration: Registration<R>,
    ) -> Result<EngineRef, ServiceStopped> {
        let cell = EngineCell::new(registration.engine.clone(), self.wake.clone());
        let (done, wait) = oneshot::channel();
        self.commands
            .send(Command::Register {
                registration,
                cell,
                done,
            })
            .map_err(|_| ServiceStopped)?;
        wait.await.map_err(|_| ServiceStopped)
    }

    /// Before loading the metadata of an engine id that may still be
    /// registered (a pinned id that restarted): marks the old registration
    /// and resolves once it has been released, reads drained and all.
    /// Resolves at once for an id not registered.
    ///
    /// Cancel safety: dropping the future does not undo the mark.
    pub async fn prepare_reload(&self, engine: &EngineId) -> Result<(), ServiceStopped> {
        let (done, wait) = oneshot::channel();
        self.commands
            .send(Command::PrepareReload {
                engine: engine.clone(),
                done,
            })
            .map_err(|_| ServiceStopped)?;
        wait.await.map_err(|_| ServiceStopped)
    }

    /// The registered engine `engine`, if any.
    pub fn engine(&self, engine: &EngineId) -> Option<EngineRef> {
        self.directory
            .read()
            .expect("directory poisoned")
            .get(engine)
            .cloned()
    }

    /// Starts a read from `engine` by id. Keeping the [`EngineRef`] and
    /// calling [`EngineRef::begin_read`] skips the lookup.
    pub fn begin_read(&self, engine: &EngineId) -> Result<ReadGuard, ReadRefused> {
        match self.engine(engine) {
            Some(e) => e.begin_read(),
            None => Err(ReadRefused {
                engine: engine.clone(),
                state: EngineState::Released,
            }),
        }
    }

    /// Reports how a transfer from `engine` ended, for transfers not tracked
    /// with a [`ReadGuard`] (use [`ReadGuard::finish`] otherwise).
    pub fn report_transfer(&self, engine: &EngineId, status: NixlStatus) {
        if status.is_ok() {
            return;
        }
        if let Some(e) = self.engine(engine) {
            let _ = self
                .wake
                .send(Wake::TransferResult(e.cell.serial(), status));
        }
    }

    /// Renews these lease request ids with every heartbeat to `engine`
    /// until removed. With `renew_now`, a renewal goes out as soon as the
    /// engine's rate cap allows.
    pub fn add_leases(&self, engine: &EngineId, requests: Vec<String>, renew_now: bool) {
        let _ = self.commands.send(Command::AddLeases {
            engine: engine.clone(),
            requests,
            renew_now,
        });
    }

    /// Asks for a lease renewal to `engine` as soon as its rate cap allows.
    pub fn renew_leases(&self, engine: &EngineId) {
        self.add_leases(engine, Vec::new(), true);
    }

    /// Stops renewing these lease request ids.
    pub fn remove_leases(&self, engine: &EngineId, requests: Vec<String>) {
        let _ = self.commands.send(Command::RemoveLeases {
            engine: engine.clone(),
            requests,
        });
    }

    /// The router or orchestrator says a peer is gone. Idempotent; a no-op
    /// for unknown peers. `Fail` after `Drain` fails the reads still in
    /// flight.
    pub fn peer_gone(&self, peer: PeerRef, mode: GoneMode) {
        let _ = self.commands.send(Command::PeerGone { peer, mode });
    }

    /// Events from now on. A subscriber slower than the event capacity
    /// misses the oldest and is told how many (`RecvError::Lagged`).
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// The table as it is now.
    ///
    /// Cancel safe.
    pub async fn snapshot(&self) -> Result<Snapshot, ServiceStopped> {
        let (done, wait) = oneshot::channel();
        self.commands
            .send(Command::Snapshot(done))
            .map_err(|_| ServiceStopped)?;
        wait.await.map_err(|_| ServiceStopped)
    }
}

/// A handshake in progress. Dropping it (or [`HandshakeGuard::finish`])
/// says it is over, whatever its outcome.
#[must_use = "dropping the guard ends the handshake at once"]
pub struct HandshakeGuard {
    address: Option<PeerAddr>,
    wake: mpsc::UnboundedSender<Wake>,
}

impl HandshakeGuard {
    /// Ends the handshake.
    pub fn finish(self) {}
}

impl Drop for HandshakeGuard {
    fn drop(&mut self) {
        if let Some(address) = self.address.take() {
            let _ = self.wake.send(Wake::HandshakeFinished(address));
        }
    }
}

/// What the service could not release when it stopped: engines with reads
/// still in flight (or handshakes pending), resources and all. The caller
/// releases them once its reads have ended.
pub struct Stopped<R> {
    /// Registrations still held.
    pub unreleased: Vec<Registration<R>>,
}

/// The keepalive service. Create it with [`Keepalive::new`], then run
/// [`Keepalive::run`] as a tokio task.
pub struct Keepalive<T: Transport> {
    config: Config,
    table: PeerTable<T::Resources>,
    commands: mpsc::UnboundedReceiver<Command<T::Resources>>,
    wake: mpsc::UnboundedReceiver<Wake>,
    events: broadcast::Sender<Event>,
    directory: Directory,
    timers: DelayQueue<u64>,
    timer_keys: HashMap<u64, delay_queue::Key>,
    /// Every transport call (heartbeat rounds, releases), off the async
    /// threads.
    offload: Offload<T>,
    registering: HashMap<u64, oneshot::Sender<EngineRef>>,
    reloading: HashMap<EngineId, Vec<oneshot::Sender<()>>>,
    startup: Startup,
    bound: Option<DetectionSummary>,
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
        let (commands_tx, commands) = mpsc::unbounded_channel();
        let (wake_tx, wake) = mpsc::unbounded_channel();
        let (events, _) = broadcast::channel(config.event_capacity);
        let directory = Directory::default();
        let handle = KeepaliveHandle {
            commands: commands_tx,
            wake: wake_tx,
            events: events.clone(),
            directory: directory.clone(),
        };
        let service = Keepalive {
            offload: Offload::new(transport),
            table: PeerTable::new(config.clone(), Instant::now()),
            config,
            commands,
            wake,
            events,
            directory,
            timers: DelayQueue::new(),
            timer_keys: HashMap::new(),
            registering: HashMap::new(),
            reloading: HashMap::new(),
            startup: Startup {
                line: "detection bound not computed (UCX settings not given: see Keepalive::with_ucx_settings)".into(),
                warnings: Vec::new(),
                ucx: "not read".into(),
            },
            bound: None,
        };
        (service, handle)
    }

    /// Tells the service the UCX settings in force (read them with
    /// [`UcxSettings::read`] before anything starts). With them it reports
    /// how long a dead prefill can go unnoticed: one line at start-up, the
    /// `nixl_keepalive_detection_bound_*_seconds` gauges, the snapshot; and
    /// it warns once about settings that defeat detection.
    pub fn with_ucx_settings(mut self, settings: &UcxSettings) -> Self {
        let gap = self
            .config
            .heartbeat_interval
            .map(|interval| interval + self.config.jitter);
        let (line, crashed, silent) = match gap {
            Some(gap) => {
                let bound = detection_bound(settings, gap);
                (bound.to_string(), Some(bound.crashed), bound.silent)
            }
            None => {
                let silent = detection_bound(settings, Duration::ZERO);
                (
                    format!(
                        "heartbeats are off (NIXL_KEEPALIVE_INTERVAL=inf): a dead peer is released only after a transfer to it fails; {silent}"
                    ),
                    None,
                    None,
                )
            }
        };
        telemetry::detection_bound(crashed, silent);
        let note = if settings.keepalive_enabled() {
            format!(
                "UCX keepalive ({}) fails a silent peer's endpoint{}; a frozen process on shm/tcp is never reported",
                settings.keepalive_interval.raw,
                silent.map_or(String::new(), |d| format!(", release within {d:?}"))
            )
        } else {
            "UCX keepalive is off (inf or NUM_EPS 0): a silent peer is never reported".to_string()
        };
        self.table.set_silent_peer_note(note);
        self.startup = Startup {
            line,
            warnings: warnings(settings),
            ucx: settings.summary(),
        };
        self.bound = Some(DetectionSummary { crashed, silent });
        self
    }

    /// Runs until `shutdown` is cancelled. Then releases every engine it
    /// can (no read in flight, no handshake pending), waits for those
    /// releases, and returns what it could not release.
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
        for var in Config::unknown_env_vars() {
            tracing::warn!(%var, "unknown NIXL_KEEPALIVE_ environment variable ignored (a typo?)");
        }
        let mut census = self.config.metrics_period.map(|p| {
            let mut t = tokio::time::interval(p);
            t.set_missed_tick_behavior(MissedTickBehavior::Delay);
            t
        });
        let mut outcomes = Vec::new();
        loop {
            self.carry_out();
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                Some(wake) = self.wake.recv() => self.on_wake(wake),
                Some(command) = self.commands.recv() => self.on_command(command),
                _ = self.offload.recv(&mut outcomes) => {
                    let now = Instant::now();
                    for outcome in outcomes.drain(..) {
                        match outcome {
                            Outcome::Release { serial, steps } => self.table.release_done(now, serial, steps),
                            Outcome::Heartbeat { serial, results } => self.table.heartbeat_done(now, serial, results),
                        }
                    }
                }
                Some(expired) = poll_fn(|cx| self.timers.poll_expired(cx)) => {
                    let serial = expired.into_inner();
                    self.timer_keys.remove(&serial);
                    self.table.heartbeat_due(Instant::now(), serial);
                }
                _ = async { census.as_mut().expect("guarded").tick().await }, if census.is_some() => {
                    let (by_state, reads) = self.table.census();
                    telemetry::census(by_state, reads);
                }
            }
        }
        tracing::info!("nixl-keepalive stopping: releasing idle engines");
        // Guards that drained before the stop still count.
        while let Ok(wake) = self.wake.try_recv() {
            self.on_wake(wake);
        }
        self.table.shutdown(Instant::now());
        self.carry_out();
        // Wait for the releases, not for heartbeats: a hung notification
        // must not hold the shutdown. Their results are no longer heard.
        while self.offload.releases_pending() > 0 {
            self.offload.recv(&mut outcomes).await;
            for outcome in outcomes.drain(..) {
                if let Outcome::Release { serial, steps } = outcome {
                    self.table.release_done(Instant::now(), serial, steps);
                    self.carry_out();
                }
            }
        }
        let unreleased = self.table.into_unreleased();
        if !unreleased.is_empty() {
            tracing::warn!(
                engines = unreleased.len(),
                "stopped with engines still held (reads in flight or handshakes pending): returned to the caller"
            );
        }
        Stopped { unreleased }
    }

    fn on_wake(&mut self, wake: Wake) {
        let now = Instant::now();
        match wake {
            Wake::HandshakeStarted(address) => self.table.handshake_started(address),
            Wake::HandshakeFinished(address) => self.table.handshake_finished(now, &address),
            Wake::Drained(serial) => self.table.drained(now, serial),
            Wake::TransferResult(serial, status) => self.table.transfer_result(now, serial, status),
        }
    }

    fn on_command(&mut self, command: Command<T::Resources>) {
        let now = Instant::now();
        match command {
            Command::Register {
                registration,
                cell,
                done,
            } => {
                self.registering.insert(cell.serial(), done);
                self.table.register(now, registration, cell);
            }
            Command::PrepareReload { engine, done } => {
                self.reloading.entry(engine.clone()).or_default().push(done);
                self.table.prepare_reload(now, engine);
            }
            Command::AddLeases {
                engine,
                requests,
                renew_now,
            } => self.table.add_leases(now, &engine, requests, renew_now),
            Command::RemoveLeases { engine, requests } => {
                self.table.remove_leases(&engine, &requests)
            }
            Command::PeerGone { peer, mode } => self.table.peer_gone(now, peer, mode),
            Command::Snapshot(done) => {
                let mut snapshot = self.table.snapshot(now);
                snapshot.heartbeat_timers = self.timers.len();
                snapshot.detection_bound = self.bound;
                let _ = done.send(snapshot);
            }
        }
    }

    /// Carries out every decision the table has queued.
    fn carry_out(&mut self) {
        while let Some(action) = self.table.poll_action() {
            match action {
                Action::Schedule { serial, at } => match self.timer_keys.get(&serial) {
                    Some(key) => self.timers.reset_at(key, at),
                    None => {
                        let key = self.timers.insert_at(serial, at);
                        self.timer_keys.insert(serial, key);
                    }
                },
                Action::Unschedule { serial } => {
                    if let Some(key) = self.timer_keys.remove(&serial) {
                        self.timers.try_remove(&key);
                    }
                }
                Action::Call(job) => self.offload.submit(job),
                Action::Activated(engine) => {
                    let serial = engine.cell.serial();
                    self.directory
                        .write()
                        .expect("directory poisoned")
                        .insert(engine.id().clone(), engine.clone());
                    if let Some(done) = self.registering.remove(&serial) {
                        let _ = done.send(engine);
                    }
                }
                Action::ReloadReady(engine) => {
                    {
                        let mut directory = self.directory.write().expect("directory poisoned");
                        if directory
                            .get(&engine)
                            .is_some_and(|e| e.state() == EngineState::Released)
                        {
                            directory.remove(&engine);
                        }
                    }
                    for done in self.reloading.remove(&engine).unwrap_or_default() {
                        let _ = done.send(());
                    }
                }
                Action::Emit(event) => {
                    // No subscriber is not an error.
                    let _ = self.events.send(event);
                }
            }
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
