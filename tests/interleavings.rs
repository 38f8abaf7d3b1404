//! Random interleavings of every input and fault, on the paused clock.
//!
//! The service's promises, checked independently of its own bookkeeping:
//! the test counts its own reads per registration, and a transport wrapped
//! around the fake audits every release against that count.
//! - never a release with a read in flight;
//! - never a read started on an engine the service has marked;
//! - every dead idle engine released within its bound;
//! - every engine the service holds live has its metadata loaded (a
//!   conflict of identities never invalidates a healthy engine: racing
//!   handshakes of one id, replayed replies, stale membership records);
//! - a membership record that is not the registration's own never
//!   retires it;
//! - nothing leaked at the end.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nixl_keepalive::fake::{AuditedUcx, FakeConfig, FakeResources, FakeUcx};
use nixl_keepalive::{
    AgentName, Config, Departure, EngineId, EngineRef, EngineState, Event, GoneMode, Handshake,
    Incarnation, KeepaliveHandle, OwnedTransferGuard, PeerAddr, PeerRef, Ready, Transport,
    UcsStatus, HEARTBEAT_SLOT,
};
use proptest::prelude::*;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const ADDRS: usize = 3;
const INTERVAL: Duration = Duration::from_secs(2);
const JITTER: Duration = Duration::from_millis(200);
const RATE_PERIOD: Duration = Duration::from_millis(500);

/// The test's own record: its count of reads per registration lives in
/// the audited transport ([`AuditedUcx::track`]), which reports a release
/// under a read here; the test's other checks report here too.
#[derive(Default)]
struct Ledger {
    violations: Mutex<Vec<String>>,
}

impl Ledger {
    /// The fake, with every release audited against the test's read
    /// counts, each violation recorded in this ledger.
    fn audited(self: &Arc<Self>, ucx: &FakeUcx) -> AuditedUcx {
        let ledger = self.clone();
        AuditedUcx::new(ucx.clone(), move |v| {
            ledger.violations.lock().unwrap().push(v)
        })
    }
}

#[derive(Clone, Debug)]
enum Op {
    Spawn(usize),
    Connect(usize),
    /// Two handshakes with one address at once (two readers of one
    /// prefill, or a probe racing a reconnect): one id, two claims.
    RacingConnect(usize),
    /// A hostile prefill at the second address replays the reply of the
    /// engine at the first.
    Replay(usize, usize),
    /// A membership record of the engine at the address goes away:
    /// its own record (`false`), or a stale one (`true`: another
    /// incarnation, or another address).
    MemberGone(usize, bool),
    OpenHandshake(usize),
    CloseHandshake(usize),
    BeginRead(usize),
    EndRead(usize),
    Crash(usize),
    CrashDuringRead(usize),
    Freeze(usize),
    Thaw(usize),
    Partition(usize),
    Heal(usize),
    Restart(usize),
    RestartSameId(usize),
    Transient(usize, u8),
    GoneById(usize, bool),
    GoneByAddr(usize, bool),
    Lease(usize, u8),
    Unlease(usize, u8),
    Advance(u16),
    /// Not generated: removes an engine's metadata behind the service's
    /// back, for the test that the loaded check can fail.
    Unload(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let a = 0..ADDRS;
    prop_oneof![
        2 => a.clone().prop_map(Op::Spawn),
        4 => a.clone().prop_map(Op::Connect),
        2 => a.clone().prop_map(Op::RacingConnect),
        1 => (a.clone(), a.clone()).prop_map(|(v, h)| Op::Replay(v, h)),
        1 => (a.clone(), any::<bool>()).prop_map(|(i, s)| Op::MemberGone(i, s)),
        1 => a.clone().prop_map(Op::OpenHandshake),
        1 => (0..4usize).prop_map(Op::CloseHandshake),
        5 => (0..16usize).prop_map(Op::BeginRead),
        4 => (0..16usize).prop_map(Op::EndRead),
        2 => a.clone().prop_map(Op::Crash),
        1 => a.clone().prop_map(Op::CrashDuringRead),
        1 => a.clone().prop_map(Op::Freeze),
        1 => a.clone().prop_map(Op::Thaw),
        1 => a.clone().prop_map(Op::Partition),
        1 => a.clone().prop_map(Op::Heal),
        2 => a.clone().prop_map(Op::Restart),
        1 => a.clone().prop_map(Op::RestartSameId),
        1 => (a.clone(), 0..3u8).prop_map(|(a, s)| Op::Transient(a, s)),
        1 => (a.clone(), any::<bool>()).prop_map(|(a, f)| Op::GoneById(a, f)),
        1 => (a.clone(), any::<bool>()).prop_map(|(a, f)| Op::GoneByAddr(a, f)),
        1 => (a.clone(), 0..4u8).prop_map(|(a, r)| Op::Lease(a, r)),
        1 => (a.clone(), 0..4u8).prop_map(|(a, r)| Op::Unlease(a, r)),
        6 => (1..6000u16).prop_map(Op::Advance),
    ]
}

struct Read {
    guard: OwnedTransferGuard,
    count: Arc<AtomicUsize>,
    engine: EngineId,
}

/// A crash of an engine nobody was reading from: it must be released
/// within one heartbeat bound unless the test touches it again.
struct Watch {
    engine: EngineId,
    since: Instant,
    touched: bool,
}

struct Run {
    ucx: FakeUcx,
    ledger: Arc<Ledger>,
    audit: Arc<AuditedUcx>,
    handle: KeepaliveHandle<FakeResources>,
    events: tokio::sync::broadcast::Receiver<Event>,
    /// Registrations the test holds, latest last, with their read counts.
    engines: Vec<(EngineRef, Arc<AtomicUsize>, PeerAddr)>,
    reads: Vec<Read>,
    handshakes: Vec<(PeerAddr, Handshake<FakeResources>)>,
    open_handshakes: HashMap<PeerAddr, usize>,
    /// Engine ids the service has marked (since their last registration).
    marked: HashSet<EngineId>,
    released: HashMap<EngineId, Vec<Instant>>,
    watches: Vec<Watch>,
    /// The operation applied last, for reports.
    last_op: String,
}

fn addr(i: usize) -> PeerAddr {
    PeerAddr::new(format!("10.1.0.{i}:7000"))
}

impl Run {
    fn violation(&self, text: String) {
        self.ledger.violations.lock().unwrap().push(text);
    }

    fn drain_events(&mut self) {
        while let Ok(event) = self.events.try_recv() {
            match event {
                Event::Registered { engine, .. } => {
                    self.marked.remove(&engine);
                }
                Event::Unreachable { engine, .. } | Event::Retiring { engine, .. } => {
                    self.marked.insert(engine);
                }
                Event::Replaced { old, .. } => {
                    self.marked.insert(old);
                }
                Event::Released { engine, .. } => {
                    self.released
                        .entry(engine)
                        .or_default()
                        .push(Instant::now());
                }
                _ => {}
            }
        }
    }

    fn engine_at(&self, i: usize) -> Option<EngineId> {
        self.ucx.engine_at(&addr(i))
    }

    async fn settle(&mut self) {
        tokio::task::yield_now().await;
        // A snapshot round-trip: everything sent before it is processed.
        let _ = self.handle.snapshot().await;
        self.drain_events();
    }

    /// The protocol as a runtime follows it (see `FakeUcx::connect`),
    /// with the test's own read count for every registration. Gives up on
    /// a claim that waits for reads this single-threaded runtime only ends
    /// later (the mark stays; a later attempt finds the id released).
    async fn attempt(
        handle: KeepaliveHandle<FakeResources>,
        ucx: FakeUcx,
        audit: Arc<AuditedUcx>,
        address: PeerAddr,
    ) -> Option<(EngineRef, Option<Arc<AtomicUsize>>)> {
        let handshake = handle.handshake(address.clone());
        let metadata = ucx.fetch_metadata(&address).ok()?;
        let ready = tokio::time::timeout(
            Duration::from_secs(1),
            handshake.ready_to_load(metadata.claim()),
        )
        .await
        .ok()?
        .ok()?;
        let ready = match ready {
            Ready::Current(engine) => return Some((engine, None)),
            Ready::Load(ready) => ready,
        };
        let hs = ucx.load_metadata(&metadata).ok()?;
        let count = audit.track(hs.resources.clone());
        let engine = ready.register(hs.resources).await.expect("service runs");
        Some((engine, Some(count)))
    }

    fn keep(&mut self, address: PeerAddr, got: Option<(EngineRef, Option<Arc<AtomicUsize>>)>) {
        match got {
            Some((engine, Some(count))) => self.engines.push((engine, count, address)),
            Some((engine, None)) => {
                // The engine already registered: the read count is its.
                let count = self
                    .engines
                    .iter()
                    .rev()
                    .find(|(e, _, _)| e.id() == engine.id() && e.state() == engine.state())
                    .map(|(_, c, _)| c.clone());
                if count.is_none() {
                    self.violation(format!(
                        "{} answered current but never registered",
                        engine.id()
                    ));
                }
            }
            None => {}
        }
    }

    async fn connect(&mut self, i: usize) {
        let got = Self::attempt(
            self.handle.clone(),
            self.ucx.clone(),
            self.audit.clone(),
            addr(i),
        )
        .await;
        self.keep(addr(i), got);
    }

    async fn racing_connect(&mut self, i: usize) {
        let attempt = || {
            Self::attempt(
                self.handle.clone(),
                self.ucx.clone(),
                self.audit.clone(),
                addr(i),
            )
        };
        let (a, b) = tokio::join!(attempt(), attempt());
        let loads = [&a, &b]
            .iter()
            .filter(|g| matches!(g, Some((_, Some(_)))))
            .count();
        if loads > 1 {
            self.violation(format!("two loads of one engine at {} at once", addr(i)));
        }
        self.keep(addr(i), a);
        self.keep(addr(i), b);
    }

    /// Every engine the service holds live has its metadata loaded.
    ///
    /// A snapshot is a moment of the core, and a release runs on the
    /// service's own threads: between a snapshot saying live and the look
    /// at the fake's loaded agents, the core may have marked the engine and
    /// its release removed the metadata (seen: 3 runs in 1,000 of the
    /// regression below). So an engine is only a suspect after the first
    /// snapshot, and a violation if a second snapshot, taken after its
    /// agent was seen gone, still holds it live: metadata is loaded only by
    /// this task, so an agent gone before that snapshot was gone while the
    /// core held the engine live.
    async fn check_loaded(&mut self) {
        let Ok(snapshot) = self.handle.snapshot().await else {
            return;
        };
        let gone =
            |ucx: &FakeUcx, s: &nixl_keepalive::Snapshot| -> Vec<(EngineId, PeerAddr, AgentName)> {
                s.engines
                    .iter()
                    .filter(|e| e.state == EngineState::Live)
                    .flat_map(|e| e.agents.iter().map(move |a| (e, a)))
                    .filter(|(_, a)| !ucx.is_loaded(a))
                    .map(|(e, a)| (e.engine.clone(), e.address.clone(), a.clone()))
                    .collect()
            };
        let suspects = gone(&self.ucx, &snapshot);
        if suspects.is_empty() {
            return;
        }
        let Ok(again) = self.handle.snapshot().await else {
            return;
        };
        let still = gone(&self.ucx, &again);
        for (engine, address, agent) in suspects {
            if still.iter().any(|(e, _, a)| *e == engine && *a == agent) {
                self.violation(format!(
                    "{engine} is live at {address} but its agent {agent}'s metadata is gone (after {})",
                    self.last_op
                ));
            }
        }
    }

    async fn apply(&mut self, op: Op) {
        match op {
            Op::Spawn(i) => {
                if self.engine_at(i).is_none() {
                    self.ucx.spawn_prefill(addr(i), 1 + i % 2);
                }
            }
            Op::Connect(i) => self.connect(i).await,
            Op::RacingConnect(i) => self.racing_connect(i).await,
            Op::Replay(victim, hostile) => {
                if victim != hostile {
                    if let Some(engine) = self.engine_at(victim) {
                        self.ucx.replay_at(addr(hostile), &engine);
                    }
                }
            }
            Op::MemberGone(i, stale) => {
                self.drain_events();
                let Some((engine, _, address)) = self
                    .engines
                    .iter()
                    .rev()
                    .find(|(_, _, a)| *a == addr(i))
                    .cloned()
                else {
                    return;
                };
                let Some(snapshot) = self.handle.snapshot().await.ok() else {
                    return;
                };
                let Some(registered) = snapshot.engine(engine.id()).cloned() else {
                    return;
                };
                let departure = Departure {
                    engine: engine.id().clone(),
                    incarnation: if stale {
                        Some(Incarnation(u64::MAX))
                    } else {
                        registered.incarnation
                    },
                    address: if stale && i % 2 == 0 {
                        addr(i + 1)
                    } else {
                        address
                    },
                };
                let was_live = registered.state == EngineState::Live;
                self.handle
                    .member_gone(departure, GoneMode::Drain)
                    .expect("the service is running");
                self.settle().await;
                // Nothing else ran in between: only this record could have
                // retired it.
                if stale && was_live && engine.state() == EngineState::Retiring {
                    self.violation(format!(
                        "a stale membership record retired the live engine {}",
                        engine.id()
                    ));
                }
            }
            Op::OpenHandshake(i) => {
                self.handshakes
                    .push((addr(i), self.handle.handshake(addr(i))));
                *self.open_handshakes.entry(addr(i)).or_default() += 1;
                let here: Vec<EngineId> = self
                    .engines
                    .iter()
                    .filter(|(_, _, a)| a == &addr(i))
                    .map(|(e, _, _)| e.id().clone())
                    .chain(self.ucx.engine_at(&addr(i)))
                    .collect();
                for w in &mut self.watches {
                    if here.contains(&w.engine) {
                        w.touched = true;
                    }
                }
            }
            Op::CloseHandshake(k) => {
                if !self.handshakes.is_empty() {
                    let (address, guard) = self.handshakes.remove(k % self.handshakes.len());
                    drop(guard);
                    if let Some(n) = self.open_handshakes.get_mut(&address) {
                        *n -= 1;
                        if *n == 0 {
                            self.open_handshakes.remove(&address);
                        }
                    }
                }
            }
            Op::BeginRead(k) => {
                self.drain_events();
                if self.engines.is_empty() {
                    return;
                }
                let index = k % self.engines.len();
                let (engine, count, _) = &self.engines[index];
                let id = engine.id().clone();
                let is_latest =
                    self.engines.iter().rposition(|(e, _, _)| e.id() == &id) == Some(index);
                let count = count.clone();
                let engine = engine.clone();
                if let Ok(guard) = engine.begin_read_owned() {
                    {
                        if is_latest && self.marked.contains(&id) {
                            self.violation(format!("a read started on {id}, which was marked"));
                        }
                        count.fetch_add(1, Ordering::SeqCst);
                        for w in &mut self.watches {
                            if w.engine == id {
                                w.touched = true;
                            }
                        }
                        self.reads.push(Read {
                            guard,
                            count,
                            engine: id,
                        });
                    }
                }
            }
            Op::EndRead(k) => {
                if self.reads.is_empty() {
                    return;
                }
                let read = self.reads.remove(k % self.reads.len());
                let status = self.ucx.read(&read.engine);
                // The status is what NIXL would say; IN_PROG (a silent
                // peer) ends the read as the runtime gives up on it.
                read.count.fetch_sub(1, Ordering::SeqCst);
                read.guard.finish(status);
            }
            Op::Crash(i) | Op::CrashDuringRead(i) => {
                if let Some(engine) = self.engine_at(i) {
                    // Where it is registered may not be where it listens
                    // (a replay registered it at the replayer's address):
                    // a handshake open there holds its release back.
                    let registered_at = self
                        .engines
                        .iter()
                        .rev()
                        .find(|(e, _, _)| *e.id() == engine)
                        .map(|(_, _, a)| a.clone());
                    let idle = !self.reads.iter().any(|r| r.engine == engine)
                        && !self.open_handshakes.contains_key(&addr(i))
                        && !registered_at.is_some_and(|a| self.open_handshakes.contains_key(&a));
                    let registered = self.handle.engine(&engine).is_some();
                    if matches!(op, Op::Crash(_)) {
                        self.ucx.crash(&engine);
                    } else {
                        self.ucx.crash_during_read(&engine);
                    }
                    if idle && registered {
                        self.watches.push(Watch {
                            engine,
                            since: Instant::now(),
                            touched: false,
                        });
                    }
                }
            }
            Op::Freeze(i) => self.fault(i, |u, e| u.freeze(e)),
            Op::Thaw(i) => self.fault(i, |u, e| u.thaw(e)),
            Op::Partition(i) => self.fault(i, |u, e| u.partition(e)),
            Op::Heal(i) => self.fault(i, |u, e| u.heal(e)),
            Op::Restart(i) => {
                if self.engine_at(i).is_some() {
                    self.ucx.restart(&addr(i));
                }
            }
            Op::RestartSameId(i) => {
                if self.engine_at(i).is_some() {
                    self.ucx.restart_with_same_id(&addr(i));
                }
            }
            Op::Transient(i, s) => {
                let status = [
                    UcsStatus::ERR_NO_RESOURCE,
                    UcsStatus::ERR_BUSY,
                    UcsStatus::ERR_IO_ERROR,
                ][s as usize];
                self.fault(i, |u, e| u.inject(e, status, 2));
            }
            Op::GoneById(i, fail) => {
                if let Some(engine) = self.engine_at(i) {
                    self.handle
                        .peer_gone(PeerRef::Engine(engine), mode(fail))
                        .expect("the service is running");
                }
            }
            Op::GoneByAddr(i, fail) => self
                .handle
                .peer_gone(PeerRef::Address(addr(i)), mode(fail))
                .expect("the service is running"),
            Op::Lease(i, r) => {
                if let Some(engine) = self.engine_at(i) {
                    self.handle
                        .add_leases(&engine, vec![format!("req-{r}")], r % 2 == 0)
                        .expect("a valid request id");
                }
            }
            Op::Unlease(i, r) => {
                if let Some(engine) = self.engine_at(i) {
                    self.handle
                        .remove_leases(&engine, vec![format!("req-{r}")])
                        .expect("the service is running");
                }
            }
            Op::Advance(ms) => tokio::time::sleep(Duration::from_millis(ms as u64)).await,
            Op::Unload(i) => {
                if let Some(engine) = self.engine_at(i) {
                    let agents = self.ucx.agents_of(&engine);
                    let resources = FakeResources::empty(engine.clone());
                    let _ = Transport::release(&self.ucx, &engine, &agents, resources);
                }
            }
        }
        self.settle().await;
        self.check_loaded().await;
    }

    fn fault(&self, i: usize, f: impl Fn(&FakeUcx, &EngineId)) {
        if let Some(engine) = self.engine_at(i) {
            f(&self.ucx, &engine);
        }
    }

    fn check_watches(&mut self) {
        let bound = INTERVAL + JITTER + RATE_PERIOD + HEARTBEAT_SLOT;
        let now = Instant::now();
        let mut late = Vec::new();
        self.watches.retain(|w| {
            if w.touched {
                return false;
            }
            let released = self
                .released
                .get(&w.engine)
                .is_some_and(|ts| ts.iter().any(|t| *t >= w.since));
            if released {
                return false;
            }
            if now - w.since > bound {
                late.push(format!(
                    "{} idle and crashed {:?} ago, not released (bound {bound:?})",
                    w.engine,
                    now - w.since
                ));
                return false;
            }
            true
        });
        for text in late {
            self.violation(text);
        }
    }

    /// What the service says of the late engines, for the report.
    async fn explain(&self) {
        let Ok(snapshot) = self.handle.snapshot().await else {
            return;
        };
        let mut violations = self.ledger.violations.lock().unwrap();
        for v in violations.iter_mut() {
            if v.contains("not released (bound") {
                let engine = v.split_whitespace().next().unwrap_or("").to_string();
                if let Some(e) = snapshot.engine(&EngineId::from(engine.as_str())) {
                    v.push_str(&format!(
                        "; the service: {} at {} ({})",
                        e.state, e.address, e.why
                    ));
                }
            }
        }
    }
}

fn mode(fail: bool) -> GoneMode {
    if fail {
        GoneMode::Fail
    } else {
        GoneMode::Drain
    }
}

fn run(ops: Vec<Op>, seed: u64) -> Vec<String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async move {
        let ucx = FakeUcx::new({
            let mut config = FakeConfig::default();
            config.keepalive_interval = Some(Duration::from_secs(5));
            config
        });
        let ledger = Arc::new(Ledger::default());
        let config = Config::builder()
            .heartbeat_interval(Some(INTERVAL))
            .jitter(JITTER)
            .rate_limit(RATE_PERIOD, 2)
            .metrics_period(None)
            .seed(seed)
            .build()
            .unwrap();
        let shutdown = CancellationToken::new();
        let audit = Arc::new(ledger.audited(&ucx));
        let (handle, task) = nixl_keepalive::spawn(audit.clone(), config, shutdown.clone());
        let events = handle.subscribe();
        let mut run = Run {
            ucx: ucx.clone(),
            ledger: ledger.clone(),
            audit,
            handle,
            events,
            engines: Vec::new(),
            reads: Vec::new(),
            handshakes: Vec::new(),
            open_handshakes: HashMap::new(),
            marked: HashSet::new(),
            released: HashMap::new(),
            watches: Vec::new(),
            last_op: String::new(),
        };
        for (i, op) in ops.into_iter().enumerate() {
            let text = format!("{op:?}");
            run.last_op = format!("op {i}: {text}");
            if tokio::time::timeout(Duration::from_secs(3600), run.apply(op))
                .await
                .is_err()
            {
                run.violation(format!("{text} never completed"));
                break;
            }
            let before = ledger.violations.lock().unwrap().len();
            run.check_watches();
            if ledger.violations.lock().unwrap().len() > before {
                run.explain().await;
            }
        }
        // The end: every read and handshake ends, every prefill dies.
        for read in run.reads.drain(..) {
            read.count.fetch_sub(1, Ordering::SeqCst);
            drop(read.guard);
        }
        run.handshakes.clear();
        for i in 0..ADDRS {
            if let Some(engine) = ucx.engine_at(&addr(i)) {
                ucx.crash(&engine);
            }
        }
        tokio::time::sleep(INTERVAL * 10).await;
        run.settle().await;
        let left = run.handle.snapshot().await.unwrap();
        // Frozen or partitioned peers are detected by the fake's keepalive
        // (5 s); everything else by the next heartbeat.
        for e in &left.engines {
            run.violation(format!("{} still held at the end: {}", e.engine, e.why));
        }
        shutdown.cancel();
        let stopped = task.await.unwrap();
        if !stopped.unreleased.is_empty() {
            run.violation(format!(
                "{} unreleased at shutdown",
                stopped.unreleased.len()
            ));
        }
        let held = ucx.held();
        if !held.is_empty() {
            run.violation(format!("leaked: {held:?}"));
        }
        let violations = ledger.violations.lock().unwrap().clone();
        violations
    })
}

/// Cases per run: `INTERLEAVINGS_CASES` (default 64, a few thousand
/// operations, what CI runs). The soak below runs a million operations.
fn cases() -> u32 {
    std::env::var("INTERLEAVINGS_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn no_release_under_a_read_no_read_on_a_marked_engine_dead_engines_released_nothing_leaked(
        ops in prop::collection::vec(op(), 1..120),
        seed in any::<u64>(),
    ) {
        let violations = run(ops, seed);
        prop_assert!(violations.is_empty(), "{:#?}", violations);
    }
}

/// The soak: random interleavings, one per seed from `SOAK_SEED` (default
/// 0) on, until `SOAK_OPS` operations (default 1,000,000) have run; every
/// run must end with no violation. Deterministic per seed, so a failure
/// names the seed that reproduces it.
#[test]
#[ignore = "a soak of 1e6 operations (minutes in a release build): cargo test --release --test interleavings -- --ignored soak"]
fn soak() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{RngAlgorithm, TestRng, TestRunner};
    let env = |name: &str, default: u64| -> u64 {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let target = env("SOAK_OPS", 1_000_000);
    let first = env("SOAK_SEED", 0);
    let strategy = prop::collection::vec(op(), 1..120);
    let (mut ops_run, mut seed) = (0u64, first);
    while ops_run < target {
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        let mut runner = TestRunner::new_with_rng(
            ProptestConfig::default(),
            TestRng::from_seed(RngAlgorithm::ChaCha, &bytes),
        );
        let ops = strategy.new_tree(&mut runner).unwrap().current();
        if std::env::var("SOAK_PRINT").is_ok() {
            println!("seed {seed}: {ops:?}");
        }
        ops_run += ops.len() as u64;
        let violations = run(ops, seed);
        assert!(violations.is_empty(), "seed {seed}: {violations:#?}");
        seed += 1;
    }
    println!(
        "SOAK ops={ops_run} seeds={first}..{} violations=0",
        seed - 1
    );
}

#[test]
fn the_audit_catches_a_release_under_a_read() {
    // The audit must be able to fail: release resources the ledger says
    // are being read.
    let ucx = FakeUcx::new(FakeConfig::default());
    let ledger = Arc::new(Ledger::default());
    let audited = ledger.audited(&ucx);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let p = ucx.spawn_prefill(addr(0), 1);
        let hs = ucx.handshake(&addr(0)).unwrap();
        audited
            .track(hs.resources.clone())
            .fetch_add(1, Ordering::SeqCst);
        audited.release(&p, &hs.agents, hs.resources);
    });
    assert_eq!(ledger.violations.lock().unwrap().len(), 1);
}

/// Found by the property test (a full run of 2026-12-01; it failed 3 runs
/// in 1,000 of these seven operations): a heartbeat's REMOTE_DISCONNECT
/// marked and released the crashed engine between `check_loaded`'s
/// snapshot (live) and its look at the loaded agents (gone). The service
/// had marked before releasing, as the log showed; the check was not
/// atomic. This sequence must pass every time.
#[test]
fn a_release_racing_the_loaded_check_is_not_a_violation() {
    use Op::*;
    let ops = vec![
        Spawn(0),
        Connect(0),
        GoneByAddr(1, true),
        RacingConnect(0),
        Connect(1),
        Lease(0, 0),
        CrashDuringRead(0),
    ];
    let violations = run(ops, 3345816825570047779);
    assert!(violations.is_empty(), "{violations:#?}");
}

/// The loaded check can fail: metadata removed behind the service's back
/// while it holds the engine live is reported.
#[test]
fn the_loaded_check_catches_a_live_engine_without_metadata() {
    use Op::*;
    let violations = run(vec![Spawn(0), Connect(0), Unload(0)], 1);
    assert!(
        violations
            .iter()
            .any(|v| v.contains("metadata is gone (after op 2: Unload(0))")),
        "{violations:#?}"
    );
}
