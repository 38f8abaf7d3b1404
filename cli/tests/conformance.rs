//! One conformance suite, two transports: the fake UCX and the real NIXL
//! runtime (NixlTransport plus real `nixl-keepalive prefill` processes).
//!
//! Each behaviour is written once, as a function over [`Stage`]; each
//! transport runs every behaviour it can stage. Where the two differ, the
//! difference is written down in [`Truths`] (what each one really does,
//! measured), not papered over.
//!
//! Without the NIXL runtime the real half prints SKIPPED and passes, unless
//! NIXL_KEEPALIVE_REQUIRE_REAL=1.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{decode_transport, report, serial, PrefillProc, PrefillSpec};
use nixl_agent::testing::real_runtime;
use nixl_keepalive::fake::{FakeConfig, FakeError, FakeHandshake, FakeUcx};
use nixl_keepalive::transport::nixl::{NixlTransport, ProgressPoller};
use nixl_keepalive::{
    AgentName, EndpointClose, EngineId, NixlStatus, PeerAddr, ReleaseStep, ReleaseTarget,
    Transport, TransportError,
};
use nixl_keepalive_cli::pd::decode::{
    fetch, Direction, HandshakeError, ReadOutcome, RemoteEngine, Target,
};

/// What differs between transports, as measured.
struct Truths {
    /// `loadRemoteMD` of a restarted peer's metadata (same agent names)
    /// while the old metadata is still loaded.
    reload_over_loaded: Result<(), NixlStatus>,
    /// A second `loadRemoteMD` of the very same metadata bytes (same peer
    /// process, handshaken twice) while the first is still loaded.
    reload_identical: Result<(), NixlStatus>,
}

/// What a behaviour may do to a transport and its prefills.
trait Stage {
    /// A completed handshake (metadata loaded, dlists prepped).
    type Loaded;
    fn name(&self) -> &'static str;
    fn truths(&self) -> Truths;
    /// Starts a prefill (one rank), with a fresh or a pinned engine id.
    fn spawn(&mut self, pinned: Option<&str>) -> PeerAddr;
    /// Kills the prefill at `addr` (SIGKILL for the real one).
    fn kill(&mut self, addr: &PeerAddr);
    /// Freezes the prefill at `addr` (SIGSTOP for the real one): alive,
    /// its threads stopped.
    fn freeze(&mut self, addr: &PeerAddr);
    /// Lets a frozen prefill run again (SIGCONT).
    fn thaw(&mut self, addr: &PeerAddr);
    /// Starts a new prefill at `addr` (the old one is killed if alive),
    /// with a fresh engine id or the same one.
    fn restart(&mut self, addr: &PeerAddr, same_id: bool);
    /// Side channel, then `loadRemoteMD` and `prepXferDlist`. `Err` is the
    /// raw status of the NIXL call that refused.
    fn handshake(&mut self, addr: &PeerAddr) -> Result<Self::Loaded, NixlStatus>;
    fn engine(&self, loaded: &Self::Loaded) -> EngineId;
    fn agents(&self, loaded: &Self::Loaded) -> Vec<AgentName>;
    fn notify(&self, agent: &AgentName) -> Result<(), TransportError>;
    /// Releases the handshake's resources (callable twice: the second
    /// release gets the same, already released, handles).
    fn release(&self, loaded: &Self::Loaded) -> Vec<ReleaseStep>;
    /// One READ from rank 0, to its end: SUCCESS (bytes checked, for the
    /// real one), or the failure status.
    fn read(&self, loaded: &Self::Loaded) -> NixlStatus {
        self.read_within(loaded, Duration::from_secs(5))
    }
    /// The same, given up (`IN_PROG`) if still in progress after `limit`.
    fn read_within(&self, loaded: &Self::Loaded, limit: Duration) -> NixlStatus;
    /// One push-mode WRITE into rank 0's block 1 (never the block reads
    /// check), to its end: SUCCESS, or the failure status.
    fn write(&self, loaded: &Self::Loaded) -> NixlStatus {
        self.write_within(loaded, Duration::from_secs(5))
    }
    /// The same, given up (`IN_PROG`) if still in progress after `limit`.
    fn write_within(&self, loaded: &Self::Loaded, limit: Duration) -> NixlStatus;
}

// ---------------------------------------------------------------------
// The behaviours, written once.

fn statuses(steps: &[ReleaseStep]) -> Vec<NixlStatus> {
    steps.iter().map(|s| s.status).collect()
}

/// The steps that are NIXL calls (a release's endpoint reports left out).
fn calls(steps: &[ReleaseStep]) -> Vec<&ReleaseStep> {
    steps
        .iter()
        .filter(|s| !matches!(s.target, ReleaseTarget::Endpoints { .. }))
        .collect()
}

/// Asserts that `steps` closed every agent's endpoints: one `Endpoints`
/// step per agent, `Closed`, on the fake (its default) as on the real
/// runtime (`nixl-sys` forces the close), live peer or dead.
fn assert_endpoints_closed<S: Stage>(stage: &S, agents: &[AgentName], steps: &[ReleaseStep]) {
    for agent in agents {
        let close = steps.iter().find_map(|s| match &s.target {
            ReleaseTarget::Endpoints { agent: a, close } if a == agent => Some(*close),
            _ => None,
        });
        assert!(
            matches!(close, Some(EndpointClose::Closed { endpoints }) if endpoints >= 1),
            "{}: endpoints of {agent}: {close:?} in {steps:?}",
            stage.name()
        );
    }
}

/// Notifies until the transport reports a failure (the real UCX may need a
/// moment to notice a killed peer); returns the status and how long it took.
fn notify_until_failure<S: Stage>(
    stage: &S,
    agent: &AgentName,
    within: Duration,
) -> (NixlStatus, Duration) {
    let start = Instant::now();
    loop {
        if let Err(e) = stage.notify(agent) {
            return (e.status, start.elapsed());
        }
        assert!(
            start.elapsed() < within,
            "{}: notify kept succeeding for {within:?}",
            stage.name()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn a_live_peer_answers_notify_and_read_and_releases_cleanly<S: Stage>(stage: &mut S) {
    let addr = stage.spawn(None);
    let loaded = stage.handshake(&addr).expect("handshake");
    for agent in stage.agents(&loaded) {
        stage.notify(&agent).expect("notify to a live peer");
    }
    assert_eq!(stage.read(&loaded), NixlStatus::SUCCESS, "{}", stage.name());
    assert_eq!(
        stage.write(&loaded),
        NixlStatus::SUCCESS,
        "{}: a WRITE",
        stage.name()
    );
    let steps = stage.release(&loaded);
    assert!(
        steps.iter().all(|s| s.status == NixlStatus::SUCCESS),
        "{}: {steps:?}",
        stage.name()
    );
    assert!(steps
        .iter()
        .any(|s| matches!(s.target, ReleaseTarget::DlistHandle(0))));
    assert!(steps
        .iter()
        .any(|s| matches!(s.target, ReleaseTarget::RemoteMetadata(_))));
    assert_endpoints_closed(stage, &stage.agents(&loaded), &steps);
}

fn a_second_release_reports_not_found_for_every_step<S: Stage>(stage: &mut S) {
    let addr = stage.spawn(None);
    let loaded = stage.handshake(&addr).expect("handshake");
    let first = stage.release(&loaded);
    assert!(
        statuses(&first).iter().all(|s| *s == NixlStatus::SUCCESS),
        "{}: {first:?}",
        stage.name()
    );
    let second = stage.release(&loaded);
    // The same calls; no endpoint is closed twice (none is reported).
    assert_eq!(calls(&second).len(), calls(&first).len());
    assert!(
        second
            .iter()
            .all(|s| !matches!(s.target, ReleaseTarget::Endpoints { .. })),
        "{}: {second:?}",
        stage.name()
    );
    assert!(
        statuses(&second)
            .iter()
            .all(|s| *s == NixlStatus::ERR_NOT_FOUND),
        "{}: {second:?}",
        stage.name()
    );
    // And NIXL no longer knows the agent.
    let agent = &stage.agents(&loaded)[0];
    assert_eq!(
        stage.notify(agent).unwrap_err().status,
        NixlStatus::ERR_NOT_FOUND
    );
}

fn a_crashed_peer_gets_remote_disconnect_then_release_then_not_found<S: Stage>(
    stage: &mut S,
) -> Duration {
    let addr = stage.spawn(None);
    let loaded = stage.handshake(&addr).expect("handshake");
    let agent = stage.agents(&loaded)[0].clone();
    stage.notify(&agent).expect("live");
    stage.kill(&addr);
    let (status, took) = notify_until_failure(stage, &agent, Duration::from_secs(10));
    assert_eq!(
        status,
        NixlStatus::ERR_REMOTE_DISCONNECT,
        "{}",
        stage.name()
    );
    // It stays that way until released.
    assert_eq!(
        stage.notify(&agent).unwrap_err().status,
        NixlStatus::ERR_REMOTE_DISCONNECT
    );
    let read = stage.read(&loaded);
    assert!(
        !read.is_ok(),
        "{}: read from a dead peer: {read}",
        stage.name()
    );
    let write = stage.write(&loaded);
    assert!(
        !write.is_ok(),
        "{}: write into a dead peer: {write}",
        stage.name()
    );
    let steps = stage.release(&loaded);
    assert!(
        statuses(&steps).iter().all(|s| *s == NixlStatus::SUCCESS),
        "{}: {steps:?}",
        stage.name()
    );
    assert_endpoints_closed(stage, &stage.agents(&loaded), &steps);
    assert_eq!(
        stage.notify(&agent).unwrap_err().status,
        NixlStatus::ERR_NOT_FOUND
    );
    let again = stage.release(&loaded);
    assert!(
        statuses(&again)
            .iter()
            .all(|s| *s == NixlStatus::ERR_NOT_FOUND),
        "{}: {again:?}",
        stage.name()
    );
    took
}

/// Measured on shm/tcp (`facts/hang.md`), and the fake's default: a frozen
/// peer is never reported. Its notifies succeed, its READs stay in
/// progress; once it runs again, they complete.
fn a_frozen_peer_keeps_answering_notify_and_its_reads_stay_in_progress<S: Stage>(
    stage: &mut S,
) -> String {
    let addr = stage.spawn(None);
    let loaded = stage.handshake(&addr).expect("handshake");
    assert_eq!(stage.read(&loaded), NixlStatus::SUCCESS, "{}", stage.name());
    stage.freeze(&addr);
    let frozen = Instant::now();
    let mut notifies = 0;
    while frozen.elapsed() < Duration::from_millis(1500) || notifies < 3 {
        for agent in stage.agents(&loaded) {
            stage
                .notify(&agent)
                .unwrap_or_else(|e| panic!("{}: notify to a frozen peer: {e}", stage.name()));
            notifies += 1;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let read = stage.read_within(&loaded, Duration::from_secs(1));
    assert_eq!(
        read,
        NixlStatus::IN_PROG,
        "{}: a READ from a frozen peer",
        stage.name()
    );
    let write = stage.write_within(&loaded, Duration::from_secs(1));
    assert_eq!(
        write,
        NixlStatus::IN_PROG,
        "{}: a WRITE into a frozen peer",
        stage.name()
    );
    stage.thaw(&addr);
    assert_eq!(
        stage.read(&loaded),
        NixlStatus::SUCCESS,
        "{}: after the thaw",
        stage.name()
    );
    assert_eq!(
        stage.write(&loaded),
        NixlStatus::SUCCESS,
        "{}: a WRITE after the thaw",
        stage.name()
    );
    let steps = stage.release(&loaded);
    assert!(
        statuses(&steps).iter().all(|s| *s == NixlStatus::SUCCESS),
        "{}: {steps:?}",
        stage.name()
    );
    format!(
        "{notifies} notifies to the frozen peer all SUCCESS; a READ and a WRITE still in progress after 1 s"
    )
}

fn a_restart_with_a_new_id_loads_beside_the_old_one<S: Stage>(stage: &mut S) {
    let addr = stage.spawn(None);
    let old = stage.handshake(&addr).expect("handshake");
    stage.restart(&addr, false);
    let new = stage
        .handshake(&addr)
        .expect("handshake with the new engine");
    assert_ne!(stage.engine(&old), stage.engine(&new));
    assert_eq!(stage.read(&new), NixlStatus::SUCCESS, "{}", stage.name());
    let old_agent = stage.agents(&old)[0].clone();
    let (status, _) = notify_until_failure(stage, &old_agent, Duration::from_secs(10));
    assert_eq!(status, NixlStatus::ERR_REMOTE_DISCONNECT);
    assert!(stage
        .release(&old)
        .iter()
        .all(|s| s.status == NixlStatus::SUCCESS));
    // The new engine is untouched by the old one's release.
    assert_eq!(stage.read(&new), NixlStatus::SUCCESS, "{}", stage.name());
    stage
        .notify(&stage.agents(&new)[0])
        .expect("new engine live");
    assert!(stage
        .release(&new)
        .iter()
        .all(|s| s.status == NixlStatus::SUCCESS));
}

fn a_restart_with_the_same_id_needs_invalidate_before_reload<S: Stage>(stage: &mut S) -> String {
    let id = common::unique("pinned");
    let addr = stage.spawn(Some(&id));
    let old = stage.handshake(&addr).expect("handshake");
    stage.restart(&addr, true);
    let over = stage.handshake(&addr);
    let truth = stage.truths().reload_over_loaded;
    let seen = over.as_ref().map(|_| ()).map_err(|s| *s);
    assert_eq!(
        seen,
        truth,
        "{}: loadRemoteMD over loaded metadata of the same agent",
        stage.name()
    );
    let observed = format!(
        "{}: loadRemoteMD over still-loaded metadata of the same agent name -> {seen:?}",
        stage.name()
    );
    if let Ok(l) = over {
        // Whatever was loaded over, give it back before the clean path.
        let _ = stage.release(&l);
    }
    let steps = stage.release(&old);
    assert!(
        statuses(&steps)
            .iter()
            .all(|s| *s == NixlStatus::SUCCESS || *s == NixlStatus::ERR_NOT_FOUND),
        "{steps:?}"
    );
    let new = stage.handshake(&addr).expect("reload after invalidate");
    assert_eq!(stage.engine(&new), EngineId::from(id.as_str()));
    assert_eq!(stage.read(&new), NixlStatus::SUCCESS, "{}", stage.name());
    assert!(stage
        .release(&new)
        .iter()
        .all(|s| s.status == NixlStatus::SUCCESS));
    observed
}

fn loading_the_identical_metadata_twice<S: Stage>(stage: &mut S) -> String {
    let addr = stage.spawn(None);
    let first = stage.handshake(&addr).expect("handshake");
    let second = stage.handshake(&addr);
    let seen = second.as_ref().map(|_| ()).map_err(|s| *s);
    let mut observed = format!(
        "{}: second loadRemoteMD of identical metadata -> {seen:?}",
        stage.name()
    );
    if let Ok(second) = second {
        // One agent, loaded once as far as NIXL is concerned: the first
        // release invalidates it, the other finds it gone.
        assert_eq!(stage.read(&second), NixlStatus::SUCCESS);
        let a = statuses(&stage.release(&second));
        let b = statuses(&stage.release(&first));
        observed.push_str(&format!(
            "; release of the second {a:?}, then of the first {b:?}"
        ));
        assert!(b
            .iter()
            .all(|s| *s == NixlStatus::SUCCESS || *s == NixlStatus::ERR_NOT_FOUND));
    } else {
        assert!(stage
            .release(&first)
            .iter()
            .all(|s| s.status == NixlStatus::SUCCESS));
    }
    assert_eq!(seen, stage.truths().reload_identical, "{observed}");
    observed
}

// ---------------------------------------------------------------------
// The fake.

struct FakeStage {
    ucx: FakeUcx,
    next_port: u16,
}

impl FakeStage {
    fn new() -> Self {
        FakeStage {
            ucx: FakeUcx::new(FakeConfig::default()),
            next_port: 5600,
        }
    }
}

impl Stage for FakeStage {
    type Loaded = FakeHandshake;

    fn name(&self) -> &'static str {
        "fake"
    }

    fn truths(&self) -> Truths {
        Truths {
            reload_over_loaded: Err(NixlStatus::ERR_NOT_ALLOWED),
            // The fake's default is the measured behaviour (one entry).
            reload_identical: REAL_RELOAD_IDENTICAL,
        }
    }

    fn spawn(&mut self, pinned: Option<&str>) -> PeerAddr {
        self.next_port += 1;
        let addr = PeerAddr::from(format!("10.0.0.1:{}", self.next_port));
        match pinned {
            Some(id) => self
                .ucx
                .spawn_prefill_with_id(addr.clone(), EngineId::from(id), 1),
            None => self.ucx.spawn_prefill(addr.clone(), 1),
        };
        addr
    }

    fn kill(&mut self, addr: &PeerAddr) {
        let engine = self.ucx.engine_at(addr).expect("a prefill listens");
        self.ucx.crash(&engine);
    }

    fn freeze(&mut self, addr: &PeerAddr) {
        let engine = self.ucx.engine_at(addr).expect("a prefill listens");
        self.ucx.freeze(&engine);
    }

    fn thaw(&mut self, addr: &PeerAddr) {
        let engine = self.ucx.engine_at(addr).expect("a prefill listens");
        self.ucx.thaw(&engine);
    }

    fn restart(&mut self, addr: &PeerAddr, same_id: bool) {
        if same_id {
            self.ucx.restart_with_same_id(addr);
        } else {
            self.ucx.restart(addr);
        }
    }

    fn handshake(&mut self, addr: &PeerAddr) -> Result<FakeHandshake, NixlStatus> {
        self.ucx.handshake(addr).map_err(|e| match e {
            FakeError::Load { status, .. } => status,
            other => panic!("fake handshake: {other}"),
        })
    }

    fn engine(&self, l: &FakeHandshake) -> EngineId {
        l.engine.clone()
    }

    fn agents(&self, l: &FakeHandshake) -> Vec<AgentName> {
        l.agents.clone()
    }

    fn notify(&self, agent: &AgentName) -> Result<(), TransportError> {
        Transport::notify(&self.ucx, agent, b"HB:")
    }

    fn release(&self, l: &FakeHandshake) -> Vec<ReleaseStep> {
        Transport::release(&self.ucx, &l.engine, &l.agents, l.resources.clone())
    }

    fn read_within(&self, l: &FakeHandshake, _limit: Duration) -> NixlStatus {
        self.ucx.read(&l.engine)
    }

    fn write_within(&self, l: &FakeHandshake, _limit: Duration) -> NixlStatus {
        self.ucx.write(&l.engine)
    }
}

// ---------------------------------------------------------------------
// The real runtime.

struct RealStage {
    transport: Arc<NixlTransport>,
    _progress: ProgressPoller,
    prefills: HashMap<PeerAddr, (PrefillProc, Option<String>)>,
    tokio: tokio::runtime::Runtime,
}

impl RealStage {
    fn new(rt: &'static nixl_agent::Runtime) -> Self {
        let (transport, progress) = decode_transport(rt);
        RealStage {
            transport,
            _progress: progress,
            prefills: HashMap::new(),
            tokio: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        }
    }
}

impl Stage for RealStage {
    type Loaded = RemoteEngine;

    fn name(&self) -> &'static str {
        "real"
    }

    fn truths(&self) -> Truths {
        Truths {
            reload_over_loaded: REAL_RELOAD_OVER_LOADED,
            reload_identical: REAL_RELOAD_IDENTICAL,
        }
    }

    fn spawn(&mut self, pinned: Option<&str>) -> PeerAddr {
        let p = PrefillProc::start(&PrefillSpec {
            engine_id: pinned.map(str::to_string),
            ..Default::default()
        });
        let addr = p.addr.clone();
        self.prefills
            .insert(addr.clone(), (p, pinned.map(str::to_string)));
        addr
    }

    fn kill(&mut self, addr: &PeerAddr) {
        self.prefills.get_mut(addr).expect("spawned").0.kill();
    }

    fn freeze(&mut self, addr: &PeerAddr) {
        self.prefills.get(addr).expect("spawned").0.signal("STOP");
    }

    fn thaw(&mut self, addr: &PeerAddr) {
        self.prefills.get(addr).expect("spawned").0.signal("CONT");
    }

    fn restart(&mut self, addr: &PeerAddr, same_id: bool) {
        let (mut old, pinned) = self.prefills.remove(addr).expect("spawned");
        old.kill();
        let engine_id = if same_id {
            Some(old.engine.clone())
        } else {
            None
        };
        let p = PrefillProc::start(&PrefillSpec {
            listen: Some(old.listen()),
            engine_id,
            ..Default::default()
        });
        self.prefills.insert(addr.clone(), (p, pinned));
    }

    fn handshake(&mut self, addr: &PeerAddr) -> Result<RemoteEngine, NixlStatus> {
        let reply = self
            .tokio
            .block_on(fetch(addr, Duration::from_secs(5)))
            .expect("side channel");
        // Four slots: a READ and a WRITE given up against a frozen peer
        // each keep theirs (the transfer may still use it), and the read
        // and the write after the thaw take the other two.
        match RemoteEngine::load(self.transport.agent(), addr.clone(), &reply, 4) {
            Ok(r) => Ok(r),
            Err(HandshakeError::Load { source, .. }) => Err(source.status),
            Err(e) => panic!("real handshake: {e}"),
        }
    }

    fn engine(&self, l: &RemoteEngine) -> EngineId {
        l.engine.clone()
    }

    fn agents(&self, l: &RemoteEngine) -> Vec<AgentName> {
        l.agents.clone()
    }

    fn notify(&self, agent: &AgentName) -> Result<(), TransportError> {
        self.transport.notify(agent, b"HB:")
    }

    fn release(&self, l: &RemoteEngine) -> Vec<ReleaseStep> {
        self.transport
            .release(&l.engine, &l.agents, l.dlists.clone())
    }

    fn read_within(&self, l: &RemoteEngine, limit: Duration) -> NixlStatus {
        match l.read_block(
            self.transport.agent(),
            "conformance-read",
            0,
            0,
            limit,
            &|| false,
        ) {
            ReadOutcome::Verified | ReadOutcome::Written | ReadOutcome::Unchecked => {
                NixlStatus::SUCCESS
            }
            ReadOutcome::Corrupt { .. } => NixlStatus::ERR_MISMATCH,
            ReadOutcome::Failed(s) => s,
            ReadOutcome::TimedOut { .. } | ReadOutcome::Abandoned { .. } => NixlStatus::IN_PROG,
            ReadOutcome::Released => NixlStatus::ERR_NOT_FOUND,
            ReadOutcome::NoSlot => NixlStatus::ERR_NOT_ALLOWED,
        }
    }

    fn write_within(&self, l: &RemoteEngine, limit: Duration) -> NixlStatus {
        let at = Target { rank: 0, block: 1 };
        let agent = self.transport.agent();
        match l.transfer_block(
            agent,
            Direction::Write,
            "conformance-write",
            at,
            limit,
            &|| false,
        ) {
            ReadOutcome::Written => NixlStatus::SUCCESS,
            ReadOutcome::Failed(s) => s,
            ReadOutcome::TimedOut { .. } | ReadOutcome::Abandoned { .. } => NixlStatus::IN_PROG,
            ReadOutcome::Released => NixlStatus::ERR_NOT_FOUND,
            other => panic!("a WRITE ended as {other:?}"),
        }
    }
}

/// Measured with nixl-cu12 1.5.1: a restarted peer's new metadata under a
/// still-loaded agent name is refused, as NIXL documents.
const REAL_RELOAD_OVER_LOADED: Result<(), NixlStatus> = Err(NixlStatus::ERR_NOT_ALLOWED);
/// Measured with nixl-cu12 1.5.1: the identical bytes again are accepted
/// (NIXL compares and finds nothing to update, and keeps one entry); the
/// fake does the same.
const REAL_RELOAD_IDENTICAL: Result<(), NixlStatus> = Ok(());

// ---------------------------------------------------------------------
// The matrix.

macro_rules! both {
    ($behaviour:ident, $fake:ident, $real:ident) => {
        #[test]
        fn $fake() {
            let _ = $behaviour(&mut FakeStage::new());
        }

        #[test]
        #[cfg_attr(not(nixl_runtime), ignore = "needs NIXL: scripts/install-nixl.sh")]
        fn $real() {
            let rt = real_runtime();
            let _serial = serial();
            let out = $behaviour(&mut RealStage::new(rt));
            report(&format!("{}: {:?}", stringify!($behaviour), out));
        }
    };
}

both!(
    a_live_peer_answers_notify_and_read_and_releases_cleanly,
    fake_live_peer,
    real_live_peer
);
both!(
    a_second_release_reports_not_found_for_every_step,
    fake_second_release,
    real_second_release
);
both!(
    a_crashed_peer_gets_remote_disconnect_then_release_then_not_found,
    fake_crashed_peer,
    real_crashed_peer
);
both!(
    a_frozen_peer_keeps_answering_notify_and_its_reads_stay_in_progress,
    fake_frozen_peer,
    real_frozen_peer
);
both!(
    a_restart_with_a_new_id_loads_beside_the_old_one,
    fake_restart_new_id,
    real_restart_new_id
);
both!(
    a_restart_with_the_same_id_needs_invalidate_before_reload,
    fake_restart_same_id,
    real_restart_same_id
);
both!(
    loading_the_identical_metadata_twice,
    fake_identical_reload,
    real_identical_reload
);
