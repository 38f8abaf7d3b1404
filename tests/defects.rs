//! The four defects issue 8 reported at the seams of the old design, each
//! reproduced on the public API with the fake UCX on tokio's paused clock.
//! They fail on the design before the core was closed (a deadlock, a
//! stall, a live engine handed back at shutdown, a report that marked the
//! wrong incarnation) and pass now.

use std::sync::Arc;
use std::time::Duration;

use nixl_keepalive::fake::{FakeConfig, FakeResources, FakeUcx, NotifyGate};
use nixl_keepalive::{
    ClaimRefused, Config, EngineId, EngineRef, EngineState, Event, GoneMode, KeepaliveHandle,
    NixlStatus, PeerAddr, PeerRef, Ready, RegisterError, ReleaseReason,
};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

type Handle = KeepaliveHandle<FakeResources>;

fn addr(n: u16) -> PeerAddr {
    PeerAddr::new(format!("10.0.9.{n}:5600"))
}

fn config(interval: Duration) -> Config {
    Config::builder()
        .heartbeat_interval(Some(interval))
        .jitter(interval / 10)
        .rate_limit(interval / 2, 2)
        .seed(3)
        .build()
        .unwrap()
}

type Task = tokio::task::JoinHandle<nixl_keepalive::Stopped<FakeResources>>;

/// The fake UCX and a service over it, heartbeating every `interval`.
fn service(interval: Duration) -> (FakeUcx, Handle, Task, CancellationToken) {
    let ucx = FakeUcx::new(FakeConfig::default());
    let shutdown = CancellationToken::new();
    let (handle, task) =
        nixl_keepalive::spawn(Arc::new(ucx.clone()), config(interval), shutdown.clone());
    (ucx, handle, task, shutdown)
}

/// The library's reconnect protocol, as every caller uses it.
async fn connect(handle: &Handle, ucx: &FakeUcx, address: &PeerAddr) -> EngineRef {
    ucx.connect(handle, address)
        .await
        .expect("nothing loaded under it")
}

async fn released(events: &mut broadcast::Receiver<Event>, engine: &EngineId) -> ReleaseReason {
    loop {
        if let Event::Released {
            engine: e, reason, ..
        } = events.recv().await.unwrap()
        {
            if &e == engine {
                return reason;
            }
        }
    }
}

/// Defect 1: a REMOTE_DISCONNECT lands between the runtime's handshake
/// start and its reload of the same pinned id. The old `prepare_reload`
/// never resolved: the release waited for the caller's own handshake.
#[tokio::test(start_paused = true)]
async fn a_reconnect_to_a_pinned_id_that_went_unreachable_meanwhile_does_not_deadlock() {
    let (ucx, handle, task, shutdown) = service(Duration::from_secs(5));
    let p = ucx.spawn_prefill(addr(1), 2);
    let engine = connect(&handle, &ucx, &addr(1)).await;
    let first = engine.begin_read().unwrap();
    let second = engine.begin_read().unwrap();
    ucx.restart_with_same_id(&addr(1));
    first.finish(NixlStatus::ERR_REMOTE_DISCONNECT);
    // The runtime's reconnect starts, then the last read ends.
    let handshake = handle.handshake(addr(1));
    second.finish(NixlStatus::ERR_REMOTE_DISCONNECT);
    let metadata = ucx.fetch_metadata(&addr(1)).unwrap();
    assert_eq!(metadata.engine, p);
    let ready = tokio::time::timeout(
        Duration::from_secs(3),
        handshake.ready_to_load(metadata.claim()),
    )
    .await
    .expect("ready_to_load resolves: no deadlock")
    .unwrap();
    let Ready::Load(ready) = ready else {
        panic!("a new process: it must be loaded")
    };
    assert_eq!(engine.state(), EngineState::Released);
    let loaded = ucx
        .load_metadata(&metadata)
        .expect("the old metadata went first");
    let again = ready.register(loaded.resources).await.unwrap();
    assert_eq!(again.state(), EngineState::Live);
    shutdown.cancel();
    assert!(task.await.unwrap().unreleased.is_empty());
    ucx.assert_nothing_leaked();
}

/// Polls (real time, bounded) until `done`; the service runs meanwhile.
async fn until(handle: &Handle, what: &str, done: impl Fn() -> bool) {
    for _ in 0..5000 {
        if done() {
            return;
        }
        let _ = handle.snapshot().await;
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    panic!("{what}: not within 5 s of real time");
}

/// Defect 2: two notifies start hanging in the same burst. The old offload
/// started no worker for what was queued behind them until another submit
/// came: the healthy engine got no heartbeat and a release queued in the
/// same burst never finished.
#[tokio::test(start_paused = true)]
async fn two_notifies_that_hang_in_one_burst_hold_neither_a_release_nor_a_healthy_engine() {
    let interval = Duration::from_millis(200);
    let (ucx, handle, task, shutdown) = service(interval);
    let mut events = handle.subscribe();
    let hung: Vec<EngineId> = (1..=2).map(|i| ucx.spawn_prefill(addr(i), 1)).collect();
    let healthy = ucx.spawn_prefill(addr(3), 1);
    let gone = ucx.spawn_prefill(addr(4), 1);
    for i in 1..=4 {
        connect(&handle, &ucx, &addr(i)).await;
    }
    let gates: Vec<NotifyGate> = hung.iter().map(|e| ucx.block_notify(e)).collect();
    // One burst: two rounds that will hang, and a release, in one batch.
    for e in &hung {
        handle.renew_leases(e).expect("the service is running");
    }
    handle
        .peer_gone(PeerRef::Engine(gone.clone()), GoneMode::Drain)
        .expect("the service is running");
    until(&handle, "both notifies hang", || {
        gates.iter().all(|g| g.waiting() == 1)
    })
    .await;
    // The release behind them finishes without any other submit.
    let gone_id = gone.clone();
    let release = tokio::spawn(async move { released(&mut events, &gone_id).await });
    until(&handle, "the release queued behind two hung calls", || {
        release.is_finished()
    })
    .await;
    assert_eq!(release.await.unwrap(), ReleaseReason::PeerGone);
    // The healthy engine keeps its schedule for 15 intervals. A blocked
    // worker stops tokio's auto-advance, so the clock moves by hand.
    for round in 0..15 {
        let before = ucx.notifications_to(&healthy).len();
        tokio::time::advance(interval + interval / 10).await;
        until(&handle, &format!("healthy heartbeat {round}"), || {
            ucx.notifications_to(&healthy).len() > before
        })
        .await;
    }
    for g in &gates {
        assert_eq!(g.waiting(), 1, "no second round stacked on a hung engine");
        g.open();
    }
    shutdown.cancel();
    assert!(task.await.unwrap().unreleased.is_empty());
    ucx.assert_nothing_leaked();
}

/// Defect 3: during shutdown's drain, the release of a busy engine used to
/// activate a registration of the same id queued behind it: `register()`
/// returned a live engine whose resources were also in `unreleased`. Now a
/// second load of one id waits for the first (identity rules), and a
/// shutdown refuses it before anything is loaded.
#[tokio::test(start_paused = true)]
async fn shutdown_refuses_a_claim_waiting_behind_a_draining_engine_and_hands_back_nothing_twice() {
    let (ucx, handle, task, shutdown) = service(Duration::from_secs(5));
    ucx.spawn_prefill(addr(1), 1);
    let first = connect(&handle, &ucx, &addr(1)).await;
    let read = first.begin_read().unwrap();
    // The prefill restarts under its pinned id: the reload waits for the
    // old registration's read.
    ucx.restart_with_same_id(&addr(1));
    let metadata = ucx.fetch_metadata(&addr(1)).unwrap();
    let b = handle.handshake(addr(1));
    let waiting = tokio::spawn(async move { b.ready_to_load(metadata.claim()).await.map(|_| ()) });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(!waiting.is_finished(), "waits behind the busy registration");
    shutdown.cancel();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(
        matches!(waiting.await.unwrap(), Err(ClaimRefused::Stopped(_))),
        "refused before anything was loaded"
    );
    drop(read);
    // A registration after the stop began is refused too.
    let late = handle.register(nixl_keepalive::Registration {
        engine: EngineId::from("late"),
        incarnation: None,
        address: addr(2),
        agents: vec![nixl_keepalive::AgentName::from("late-agent")],
        resources: FakeResources::empty(EngineId::from("late")),
    });
    let stopped = task.await.unwrap();
    assert!(matches!(late.await, Err(RegisterError::Stopped(_))));
    assert!(
        stopped.unreleased.is_empty(),
        "every registration released or handed back to its caller, once"
    );
    assert_eq!(first.state(), EngineState::Released);
    ucx.assert_nothing_leaked();
}

/// Defect 4: a late transfer report by engine id resolved to whatever
/// registration held the id then, so a REMOTE_DISCONNECT from the old
/// process of a pinned id marked its correctly reloaded successor.
#[tokio::test(start_paused = true)]
async fn a_late_report_from_the_old_process_of_a_pinned_id_never_marks_the_reloaded_engine() {
    let (ucx, handle, task, shutdown) = service(Duration::from_secs(5));
    ucx.spawn_prefill(addr(1), 1);
    let old = connect(&handle, &ucx, &addr(1)).await;
    ucx.restart_with_same_id(&addr(1));
    let new = connect(&handle, &ucx, &addr(1)).await;
    assert_eq!(old.state(), EngineState::Released);
    // The old process's transfer status arrives late.
    old.report_transfer(NixlStatus::ERR_REMOTE_DISCONNECT);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(new.state(), EngineState::Live);
    assert!(new.begin_read().is_ok());
    shutdown.cancel();
    assert!(task.await.unwrap().unreleased.is_empty());
    ucx.assert_nothing_leaked();
}

/// A registration handed to a service that has stopped was lost when its
/// future was dropped unpolled: the `RegisterError::Stopped` that gives it
/// back lived only inside the future. Now it waits in
/// `take_handed_back`, once, for a direct registration and for a claim
/// granted before the stop alike.
#[tokio::test(start_paused = true)]
async fn a_registration_dropped_unpolled_after_the_stop_is_handed_back_exactly_once() {
    use nixl_keepalive::Transport;
    let (ucx, handle, task, shutdown) = service(Duration::from_secs(5));
    ucx.spawn_prefill(addr(1), 2);
    let metadata = ucx.fetch_metadata(&addr(1)).unwrap();
    let Ready::Load(ready) = handle
        .handshake(addr(1))
        .ready_to_load(metadata.claim())
        .await
        .unwrap()
    else {
        panic!("a new engine: load it")
    };
    let loaded = ucx.load_metadata(&metadata).unwrap();
    shutdown.cancel();
    let stopped = task.await.unwrap();
    assert!(stopped.unreleased.is_empty());
    assert!(handle.take_handed_back().is_empty(), "nothing refused yet");
    ucx.spawn_prefill(addr(2), 1);
    let late = ucx.handshake(&addr(2)).unwrap();
    drop(handle.register(nixl_keepalive::Registration {
        engine: late.engine.clone(),
        incarnation: None,
        address: addr(2),
        agents: late.agents.clone(),
        resources: late.resources,
    }));
    drop(ready.register(loaded.resources));
    let mut back = handle.take_handed_back();
    back.sort_by(|a, b| a.address.cmp(&b.address));
    assert_eq!(
        back.iter().map(|r| r.address.clone()).collect::<Vec<_>>(),
        vec![addr(1), addr(2)],
        "both dropped registrations, each once"
    );
    assert!(handle.take_handed_back().is_empty(), "taken once");
    // A future that is polled hands it back itself, and not twice.
    let polled = handle.register(nixl_keepalive::Registration {
        engine: EngineId::from("polled"),
        incarnation: None,
        address: addr(3),
        agents: vec![nixl_keepalive::AgentName::from("polled-agent")],
        resources: FakeResources::empty(EngineId::from("polled")),
    });
    assert!(matches!(polled.await, Err(RegisterError::Stopped(_))));
    assert!(handle.take_handed_back().is_empty());
    for r in back {
        ucx.release(&r.engine, &r.agents, r.resources);
    }
    ucx.assert_nothing_leaked();
}
