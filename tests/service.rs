//! The service's rules, driven through the fake UCX on tokio's paused
//! clock: each test runs minutes of virtual time in milliseconds.

use std::sync::Arc;
use std::time::Duration;

use nixl_keepalive::fake::{FakeConfig, FakeResources, FakeUcx};
use nixl_keepalive::{
    AgentName, Config, Destination, EngineId, EngineRef, EngineState, Event, GiveUp, GivenUpRead,
    GoneMode, Keepalive, NixlStatus, PeerAddr, PeerRef, ReleaseReason, ReleaseStep, Transfers,
    Transport, TransportError, UcsStatus, HEARTBEAT_SLOT,
};
use tokio_util::sync::CancellationToken;

mod common;

use common::{addr, World};

fn config() -> Config {
    Config::builder()
        .heartbeat_interval(Some(Duration::from_secs(5)))
        .jitter(Duration::from_millis(500))
        .rate_limit(Duration::from_secs(1), 2)
        .seed(7)
        .build()
        .unwrap()
}

impl World {
    /// What a decoder runtime does: handshake (guarded), load, register.
    async fn connect(&self, address: &PeerAddr) -> EngineRef {
        self.ucx
            .connect(&self.handle, address)
            .await
            .expect("connects")
    }

    async fn released(&mut self, engine: &EngineId, within: Duration) -> Event {
        self.until(within, |e| match e {
            Event::Released { engine: id, .. } if id == engine => Some(e.clone()),
            _ => None,
        })
        .await
    }

    /// Crashes prefill `p` and waits for the service to find it
    /// unreachable (its next heartbeat, within the interval and jitter).
    async fn crash_and_find(&mut self, p: &EngineId) {
        self.ucx.crash(p);
        self.until(Duration::from_secs(6), |e| {
            matches!(e, Event::Unreachable { .. }).then_some(())
        })
        .await;
    }

    /// Lets the service run for `d` of virtual time.
    async fn run_for(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }

    async fn stop(self) -> FakeUcx {
        let (ucx, stopped) = self.stopped().await;
        assert!(
            stopped.unreleased.is_empty(),
            "engines left unreleased at shutdown"
        );
        ucx
    }
}

fn released_reason(e: &Event) -> ReleaseReason {
    match e {
        Event::Released { reason, .. } => *reason,
        other => panic!("not a release: {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_peer_whose_heartbeat_returns_remote_disconnect_is_released() {
    let mut w = World::start(FakeConfig::default(), config());
    let p = w.ucx.spawn_prefill(addr(1), 2);
    let engine = w.connect(&addr(1)).await;
    w.run_for(Duration::from_secs(12)).await;
    assert!(
        w.ucx.notifications_to(&p).len() >= 2 * 2,
        "heartbeats to both agents"
    );
    assert_eq!(w.ucx.held_by(&p).remote_metadata, 2);

    w.ucx.crash(&p);
    let status = w
        .until(Duration::from_secs(6), |e| match e {
            Event::Unreachable { status, source, .. } => Some((*status, *source)),
            _ => None,
        })
        .await;
    assert_eq!(
        status,
        (
            NixlStatus::ERR_REMOTE_DISCONNECT,
            nixl_keepalive::Source::Heartbeat
        )
    );
    let released = w.released(&p, Duration::from_secs(1)).await;
    assert_eq!(released_reason(&released), ReleaseReason::Unreachable);
    assert_eq!(engine.state(), EngineState::Released);
    assert!(
        w.ucx.held_by(&p).is_empty(),
        "dlists released and metadata invalidated"
    );
    assert!(w.handle.engine(&p).is_none());
    let snap = w.handle.snapshot().await.unwrap();
    assert!(snap.engines.is_empty());
    assert_eq!(snap.limiter_keys, 0, "the limiter forgot the engine");
    assert_eq!(snap.heartbeat_timers, 0, "its timer is gone");
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_dead_peer_is_kept_while_a_read_from_it_is_in_flight_and_released_when_it_ends() {
    let mut w = World::start(FakeConfig::default(), config());
    let p = w.ucx.spawn_prefill(addr(1), 1);
    let engine = w.connect(&addr(1)).await;
    let read = engine.begin_read().unwrap();
    w.crash_and_find(&p).await;
    // Many heartbeat periods later: still held, and the snapshot says why.
    w.run_for(Duration::from_secs(60)).await;
    assert!(
        read.is_failed(),
        "reads from an unreachable peer are failed"
    );
    assert_eq!(
        w.ucx.held_by(&p).remote_metadata,
        1,
        "not released under a read"
    );
    let snap = w.handle.snapshot().await.unwrap();
    let e = snap.engine(&p).unwrap();
    assert_eq!(e.state, EngineState::Unreachable);
    assert_eq!(e.reads_in_flight, 1);
    assert!(e.why.contains("1 read(s) in flight"), "{}", e.why);
    assert!(
        engine.begin_read().is_err(),
        "no new read on a marked engine"
    );

    read.finish(w.ucx.read(&p));
    let released = w.released(&p, Duration::from_millis(1)).await;
    match released {
        Event::Released { waited_for, .. } => {
            assert_eq!(waited_for.reads_in_flight_at_mark, 1);
            assert!(waited_for.duration >= Duration::from_secs(60));
        }
        _ => unreachable!(),
    }
    w.stop().await.assert_nothing_leaked();
}

/// A runtime that finds a transfer running without a guard (posted by code
/// that bypassed its own) adopts it: on an engine already marked, where a
/// new read is refused, the adopted transfer still holds the release until
/// it ends; once the engine is released, adopting is refused.
#[tokio::test(start_paused = true)]
async fn a_transfer_adopted_after_the_mark_holds_the_release_until_it_ends() {
    let mut w = World::start(FakeConfig::default(), config());
    let p = w.ucx.spawn_prefill(addr(1), 1);
    let engine = w.connect(&addr(1)).await;
    let read = engine.begin_read().unwrap();
    w.crash_and_find(&p).await;
    assert!(
        engine.begin_read().is_err(),
        "no new read on a marked engine"
    );
    let adopted = engine
        .adopt_posted_read()
        .expect("a running transfer is adopted on a marked engine");
    read.finish(w.ucx.read(&p));
    w.run_for(Duration::from_secs(30)).await;
    assert_eq!(
        w.ucx.held_by(&p).remote_metadata,
        1,
        "not released under the adopted transfer"
    );
    let snap = w.handle.snapshot().await.unwrap();
    assert_eq!(snap.engine(&p).unwrap().reads_in_flight, 1);

    adopted.finish(w.ucx.read(&p));
    w.released(&p, Duration::from_millis(1)).await;
    let refused = engine
        .adopt_posted_read()
        .expect_err("nothing is adopted on a released engine");
    assert_eq!(refused.state, EngineState::Released);
    w.stop().await.assert_nothing_leaked();
}

/// Push mode: a write into a dead peer (a decode, the service embedded in
/// the prefill) holds its release exactly as a read does; the fake's
/// WRITE into the crashed peer fails, the guard's end releases it.
#[tokio::test(start_paused = true)]
async fn a_dead_peer_is_kept_while_a_push_write_into_it_is_in_flight() {
    let mut w = World::start(FakeConfig::default(), config());
    let p = w.ucx.spawn_prefill(addr(1), 1);
    let engine = w.connect(&addr(1)).await;
    assert_eq!(
        w.ucx.write(&p),
        NixlStatus::SUCCESS,
        "a live peer takes writes"
    );
    let write = engine.begin_write_owned().unwrap();
    assert_eq!(
        engine.reads_in_flight(),
        1,
        "a write counts as a transfer in flight"
    );
    w.crash_and_find(&p).await;
    w.run_for(Duration::from_secs(60)).await;
    assert!(
        write.is_failed(),
        "writes into an unreachable peer are failed"
    );
    assert_eq!(
        w.ucx.held_by(&p).remote_metadata,
        1,
        "not released under a write"
    );
    assert!(
        engine.begin_write().is_err(),
        "no new write to a marked engine"
    );
    let status = w.ucx.write(&p);
    assert!(!status.is_ok(), "a WRITE into a crashed peer: {status}");
    write.finish(status);
    match w.released(&p, Duration::from_millis(1)).await {
        Event::Released { waited_for, .. } => {
            assert_eq!(waited_for.reads_in_flight_at_mark, 1);
            assert!(waited_for.duration >= Duration::from_secs(60));
        }
        _ => unreachable!(),
    }
    w.stop().await.assert_nothing_leaked();
}

/// The owned guard (and a borrowed one turned owned) keeps the read for
/// as long as it lives, wherever it went: the read counts once, the
/// borrowed guard it came from ends nothing, and the release waits for the
/// spawned task's finish.
#[tokio::test(start_paused = true)]
async fn owned_reads_moved_to_other_tasks_hold_a_dead_peer_until_they_end() {
    let mut w = World::start(FakeConfig::default(), config());
    let p = w.ucx.spawn_prefill(addr(1), 1);
    let engine = w.connect(&addr(1)).await;
    let owned = engine.begin_read_owned().unwrap();
    let converted = engine.begin_read().unwrap().into_owned();
    assert_eq!(engine.reads_in_flight(), 2, "into_owned keeps the one read");
    let (end_tx, end_rx) = tokio::sync::oneshot::channel::<()>();
    let ucx = w.ucx.clone();
    let id = p.clone();
    let reader = tokio::spawn(async move {
        let _ = end_rx.await;
        owned.finish(ucx.read(&id));
        drop(converted);
    });
    w.crash_and_find(&p).await;
    w.run_for(Duration::from_secs(30)).await;
    assert_eq!(engine.reads_in_flight(), 2);
    assert_eq!(
        w.ucx.held_by(&p).remote_metadata,
        1,
        "not released under reads held by another task"
    );
    end_tx.send(()).unwrap();
    reader.await.unwrap();
    match w.released(&p, Duration::from_millis(1)).await {
        Event::Released { waited_for, .. } => assert_eq!(waited_for.reads_in_flight_at_mark, 2),
        _ => unreachable!(),
    }
    assert_eq!(engine.reads_in_flight(), 0);
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn the_per_engine_heartbeat_is_rate_limited_lease_renewals_included() {
    let w = World::start(FakeConfig::default(), config());
    let p = w.ucx.spawn_prefill(addr(1), 1);
    let engine = w.connect(&addr(1)).await;
    let start = tokio::time::Instant::now();
    // The runtime asks for a renewal a hundred times in a burst, and again
    // every 100 ms for ten seconds.
    for i in 0..100 {
        w.handle
            .add_leases(engine.id(), vec![format!("req-{i}")], true)
            .expect("a valid request id");
    }
    for _ in 0..100 {
        w.handle
            .renew_leases(engine.id())
            .expect("the service is running");
        w.run_for(Duration::from_millis(100)).await;
    }
    let elapsed = start.elapsed();
    let calls = w.ucx.calls();
    let times: Vec<_> = calls
        .iter()
        .filter(|c| c.engine.as_ref() == Some(&p) && c.message.starts_with(b"HB:"))
        .map(|c| c.at)
        .collect();
    // Burst of 2, then one per second: at most 2 + elapsed seconds.
    let cap = 2 + elapsed.as_secs() as usize;
    assert!(
        times.len() <= cap,
        "{} notifications in {elapsed:?}, cap {cap}",
        times.len()
    );
    assert!(
        times.len() >= cap - 1,
        "renewals still go out at the capped rate: {}",
        times.len()
    );
    // GCRA: any window of k+2 notifications spans at least k periods.
    for w3 in times.windows(3) {
        assert!(w3[2] - w3[0] >= Duration::from_millis(999), "{:?}", w3);
    }
    let last = calls
        .iter()
        .rev()
        .find(|c| c.message.starts_with(b"HB:"))
        .unwrap();
    assert!(
        last.message_str().contains("req-99"),
        "leases ride on the heartbeat"
    );
}

#[tokio::test(start_paused = true)]
async fn a_replaced_engine_is_released_only_after_its_reads_and_pending_handshakes_end() {
    let mut w = World::start(FakeConfig::default(), config());
    let old = w.ucx.spawn_prefill(addr(1), 2);
    let old_ref = w.connect(&addr(1)).await;
    let read = old_ref.begin_read().unwrap();

    let new = w.ucx.restart(&addr(1));
    assert_ne!(new, old);
    // Another handshake with the address is still going on.
    let other_handshake = w.handle.handshake(addr(1));
    let new_ref = w.connect(&addr(1)).await;
    let replaced = w
        .until(Duration::from_secs(1), |e| match e {
            Event::Replaced { old, new, .. } => Some((old.clone(), new.clone())),
            _ => None,
        })
        .await;
    assert_eq!(replaced, (old.clone(), new.clone()));
    assert_eq!(old_ref.state(), EngineState::Replaced);

    drop(read);
    w.run_for(Duration::from_secs(30)).await;
    assert_eq!(
        w.ucx.held_by(&old).remote_metadata,
        2,
        "a handshake is pending"
    );
    let why = w
        .handle
        .snapshot()
        .await
        .unwrap()
        .engine(&old)
        .unwrap()
        .why
        .clone();
    assert!(why.contains("handshake(s) pending"), "{why}");

    other_handshake.finish();
    let released = w.released(&old, Duration::from_millis(1)).await;
    assert_eq!(released_reason(&released), ReleaseReason::Replaced);
    match released {
        Event::Released { waited_for, .. } => {
            assert!(waited_for.handshake);
            assert_eq!(waited_for.reads_in_flight_at_mark, 1);
        }
        _ => unreachable!(),
    }
    // The new engine is heartbeated and readable.
    w.ucx.clear_calls();
    w.run_for(Duration::from_secs(11)).await;
    assert!(w.ucx.notifications_to(&new).len() >= 2 * 2);
    assert_eq!(w.ucx.read(&new), NixlStatus::SUCCESS);
    new_ref.begin_read().unwrap().finish(NixlStatus::SUCCESS);
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_prefill_restarted_twice_normally_and_once_by_force_is_cleared_each_time() {
    let mut w = World::start(FakeConfig::default(), config());
    w.ucx.spawn_prefill(addr(1), 2);
    let mut current = w.connect(&addr(1)).await;
    let mut released = Vec::new();

    // Two normal restarts: the router says the old one is gone (drain),
    // reads in flight finish, the new one is handshaked.
    for _ in 0..2 {
        let read = current.begin_read().unwrap();
        w.handle
            .peer_gone(PeerRef::Engine(current.id().clone()), GoneMode::Drain)
            .expect("the service is running");
        w.run_for(Duration::from_millis(10)).await;
        assert!(!read.is_failed(), "drain lets reads finish");
        read.finish(w.ucx.read(current.id()));
        let old = current.id().clone();
        released.push(released_reason(
            &w.released(&old, Duration::from_secs(1)).await,
        ));
        w.ucx.restart(&addr(1));
        current = w.connect(&addr(1)).await;
        assert_ne!(current.id(), &old);
    }

    // A forced stop with reads in flight: they fail and are reported.
    let cut: Vec<_> = (0..3).map(|_| current.begin_read().unwrap()).collect();
    let forced = current.id().clone();
    w.ucx.crash(&forced);
    let failed = w
        .until(Duration::from_secs(6), |e| match e {
            Event::ReadsFailed { engine, count, .. } if engine == &forced => Some(*count),
            _ => None,
        })
        .await;
    assert_eq!(failed, 3);
    for read in cut {
        assert!(read.is_failed());
        let status = w.ucx.read(&forced);
        assert_eq!(status, NixlStatus::ERR_REMOTE_DISCONNECT);
        read.finish(status);
    }
    released.push(released_reason(
        &w.released(&forced, Duration::from_secs(1)).await,
    ));
    assert_eq!(
        released,
        [
            ReleaseReason::PeerGone,
            ReleaseReason::PeerGone,
            ReleaseReason::Unreachable
        ]
    );

    w.ucx.restart(&addr(1));
    let fresh = w.connect(&addr(1)).await;
    for _ in 0..5 {
        let read = fresh.begin_read().unwrap();
        assert_eq!(w.ucx.read(fresh.id()), NixlStatus::SUCCESS);
        read.finish(NixlStatus::SUCCESS);
    }
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_pinned_engine_id_that_restarts_is_released_before_it_is_loaded_again() {
    let mut w = World::start(FakeConfig::default(), config());
    let p = w.ucx.spawn_prefill(addr(1), 2);
    let first = w.connect(&addr(1)).await;
    let read = first.begin_read().unwrap();
    assert_eq!(w.ucx.restart_with_same_id(&addr(1)), p);

    // The runtime's reconnect waits for the old registration to drain.
    let handle = w.handle.clone();
    let ucx = w.ucx.clone();
    let reconnect = tokio::spawn(async move {
        ucx.connect(&handle, &addr(1))
            .await
            .expect("old metadata was invalidated first")
    });
    w.run_for(Duration::from_secs(3)).await;
    assert!(!reconnect.is_finished(), "held by the read in flight");
    read.finish(NixlStatus::ERR_REMOTE_DISCONNECT);
    let second = reconnect.await.unwrap();
    let released = w.released(&p, Duration::from_millis(1)).await;
    assert_eq!(released_reason(&released), ReleaseReason::Reregistered);
    assert_eq!(first.state(), EngineState::Released);
    assert_eq!(second.state(), EngineState::Live);
    assert_eq!(w.ucx.read(&p), NixlStatus::SUCCESS);
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn idle_engines_without_leases_are_heartbeated_and_released_when_dead() {
    let mut w = World::start(FakeConfig::default(), config());
    let engines: Vec<_> = (1..=5).map(|n| w.ucx.spawn_prefill(addr(n), 1)).collect();
    for n in 1..=5 {
        w.connect(&addr(n)).await;
    }
    w.run_for(Duration::from_secs(20)).await;
    for p in &engines {
        let beats = w.ucx.notifications_to(p);
        assert!(beats.len() >= 3, "{p}: {beats:?}");
        assert!(
            beats.iter().all(|b| b == "HB:"),
            "idle engines get an empty lease list"
        );
    }
    w.ucx.crash(&engines[2]);
    let crash_at = tokio::time::Instant::now();
    w.released(&engines[2], Duration::from_secs(6)).await;
    // Bound: one interval plus jitter, rounded up to the timer slot.
    assert!(crash_at.elapsed() <= Duration::from_millis(5500) + HEARTBEAT_SLOT);
    let snap = w.handle.snapshot().await.unwrap();
    assert_eq!(snap.engines.len(), 4);
    assert!(snap.engines.iter().all(|e| e.state == EngineState::Live));
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_hung_engine_with_ucx_keepalive_inf_is_never_released_and_the_snapshot_says_why() {
    let w = World::start(FakeConfig::with_keepalive(None), config());
    let p = w.ucx.spawn_prefill(addr(1), 1);
    w.connect(&addr(1)).await;
    w.ucx.freeze(&p);
    w.run_for(Duration::from_secs(600)).await;
    let snap = w.handle.snapshot().await.unwrap();
    let e = snap.engine(&p).unwrap();
    assert_eq!(e.state, EngineState::Live);
    assert_eq!(
        e.last_heartbeat.as_ref().unwrap().status,
        NixlStatus::SUCCESS
    );
    assert!(
        e.why
            .contains("only a membership signal or the router (peer_gone) can retire it"),
        "{}",
        e.why
    );
    assert_eq!(w.ucx.held_by(&p).remote_metadata, 1);
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_silent_engine_is_released_once_ucx_keepalive_fails_its_endpoint() {
    let mut w = World::start(
        FakeConfig::with_keepalive(Some(Duration::from_secs(2))),
        config(),
    );
    let p = w.ucx.spawn_prefill(addr(1), 1);
    w.connect(&addr(1)).await;
    w.ucx.partition(&p);
    let status = w
        .until(Duration::from_secs(10), |e| match e {
            Event::Unreachable { status, .. } => Some(*status),
            _ => None,
        })
        .await;
    assert_eq!(status, NixlStatus::ERR_REMOTE_DISCONNECT);
    w.released(&p, Duration::from_secs(1)).await;
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn transient_errors_are_counted_and_never_release() {
    let mut w = World::start(FakeConfig::default(), config());
    let p = w.ucx.spawn_prefill(addr(1), 1);
    let engine = w.connect(&addr(1)).await;
    w.ucx.inject(&p, UcsStatus::ERR_NO_RESOURCE, 3);
    let status = w
        .until(Duration::from_secs(6), |e| match e {
            Event::TransientError { status, .. } => Some(*status),
            _ => None,
        })
        .await;
    assert_eq!(status, NixlStatus::ERR_BACKEND);
    for s in [
        NixlStatus::ERR_BACKEND,
        NixlStatus::ERR_NOT_ALLOWED,
        NixlStatus::ERR_CANCELED,
        NixlStatus::ERR_INVALID_PARAM,
    ] {
        engine.begin_read().unwrap().finish(s);
    }
    w.run_for(Duration::from_secs(60)).await;
    let snap = w.handle.snapshot().await.unwrap();
    let e = snap.engine(&p).unwrap();
    assert_eq!(e.state, EngineState::Live);
    assert!(e.transient_errors >= 4 + 3, "{}", e.transient_errors);
    assert!(engine.begin_read().is_ok());
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_transfer_that_returns_remote_disconnect_marks_the_engine_at_once() {
    let mut w = World::start(FakeConfig::default(), config());
    let p = w.ucx.spawn_prefill(addr(1), 1);
    let engine = w.connect(&addr(1)).await;
    w.ucx.crash(&p);
    let read = engine.begin_read().unwrap();
    let status = w.ucx.read(&p);
    assert_eq!(status, NixlStatus::ERR_REMOTE_DISCONNECT);
    let marked_at = tokio::time::Instant::now();
    read.finish(status);
    w.released(&p, Duration::from_millis(1)).await;
    assert_eq!(marked_at.elapsed(), Duration::ZERO, "no heartbeat needed");
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn peer_gone_by_id_and_by_address_in_both_modes_is_idempotent_and_ignores_unknown_peers() {
    let mut w = World::start(FakeConfig::default(), config());
    let a = w.ucx.spawn_prefill(addr(1), 1);
    let b = w.ucx.spawn_prefill(addr(2), 1);
    let ea = w.connect(&addr(1)).await;
    let eb = w.connect(&addr(2)).await;

    // Unknown peers: nothing happens.
    w.handle
        .peer_gone(PeerRef::Engine(EngineId::from("nobody")), GoneMode::Fail)
        .expect("the service is running");
    w.handle
        .peer_gone(
            PeerRef::Address(PeerAddr::from("10.9.9.9:1")),
            GoneMode::Drain,
        )
        .expect("the service is running");

    // By id, drain: the read finishes normally, then release.
    let ra = ea.begin_read().unwrap();
    for _ in 0..3 {
        w.handle
            .peer_gone(PeerRef::Engine(a.clone()), GoneMode::Drain)
            .expect("the service is running");
    }
    w.run_for(Duration::from_secs(10)).await;
    assert!(!ra.is_failed());
    assert_eq!(ea.state(), EngineState::Retiring);
    ra.finish(NixlStatus::SUCCESS);
    assert_eq!(
        released_reason(&w.released(&a, Duration::from_millis(1)).await),
        ReleaseReason::PeerGone
    );

    // By address, fail: the reads are failed at once, release on drop.
    let rb: Vec<_> = (0..2).map(|_| eb.begin_read().unwrap()).collect();
    w.handle
        .peer_gone(PeerRef::Address(addr(2)), GoneMode::Fail)
        .expect("the service is running");
    w.handle
        .peer_gone(PeerRef::Address(addr(2)), GoneMode::Fail)
        .expect("the service is running");
    let count = w
        .until(Duration::from_millis(1), |e| match e {
            Event::ReadsFailed { engine, count, .. } if engine == &b => Some(*count),
            _ => None,
        })
        .await;
    assert_eq!(count, 2);
    assert!(rb.iter().all(|r| r.is_failed()));
    drop(rb);
    w.released(&b, Duration::from_millis(1)).await;
    // Gone again after release: still nothing.
    w.handle
        .peer_gone(PeerRef::Engine(b.clone()), GoneMode::Fail)
        .expect("the service is running");
    w.run_for(Duration::from_secs(1)).await;
    assert!(w.handle.snapshot().await.unwrap().engines.is_empty());
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_hung_notify_to_one_engine_does_not_delay_heartbeats_to_others() {
    let w = World::start(FakeConfig::default(), config());
    let slow = w.ucx.spawn_prefill(addr(1), 1);
    let fine = w.ucx.spawn_prefill(addr(2), 1);
    w.connect(&addr(1)).await;
    w.connect(&addr(2)).await;
    let gate = w.ucx.block_notify(&slow);
    // Let the slow engine's round start and block.
    let next = w
        .handle
        .snapshot()
        .await
        .unwrap()
        .engine(&slow)
        .unwrap()
        .next_heartbeat_in;
    tokio::time::advance(next.unwrap() + Duration::from_millis(1)).await;
    for _ in 0..5000 {
        if gate.waiting() == 1 {
            break;
        }
        // Let the service run, then give the blocking thread real time.
        w.handle.snapshot().await.unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(gate.waiting(), 1, "the slow engine's heartbeat is blocked");
    // A blocked spawn_blocking thread stops tokio's auto-advance, so the
    // clock moves by hand, to each of the healthy engine's due times.
    for _ in 0..6 {
        let before = w.ucx.notifications_to(&fine).len();
        let next = w
            .handle
            .snapshot()
            .await
            .unwrap()
            .engine(&fine)
            .unwrap()
            .next_heartbeat_in;
        let due = next.expect("the healthy engine stays scheduled");
        assert!(due <= Duration::from_millis(5500), "on schedule: {due:?}");
        tokio::time::advance(due + Duration::from_millis(1)).await;
        // The healthy round runs on its own thread: wait (real time,
        // bounded) until the service has seen it come back.
        let mut came_back = false;
        for _ in 0..5000 {
            let snap = w.handle.snapshot().await.unwrap();
            let e = snap.engine(&fine).unwrap();
            if w.ucx.notifications_to(&fine).len() > before
                && e.last_heartbeat.as_ref().is_some_and(|h| h.ago.is_zero())
            {
                came_back = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(
            came_back,
            "the healthy engine's heartbeat went out while the other hung"
        );
    }
    assert_eq!(
        gate.waiting(),
        1,
        "no second round stacked on the hung engine"
    );
    gate.open();
    w.run_for(Duration::from_secs(10)).await;
    assert!(w.ucx.notifications_to(&slow).len() >= 2);
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn shutdown_returns_engines_with_reads_in_flight_instead_of_releasing_them() {
    let w = World::start(FakeConfig::default(), config());
    let p = w.ucx.spawn_prefill(addr(1), 1);
    let q = w.ucx.spawn_prefill(addr(2), 1);
    let ep = w.connect(&addr(1)).await;
    w.connect(&addr(2)).await;
    let read = ep.begin_read().unwrap();
    w.shutdown.cancel();
    let stopped = w.task.await.unwrap();
    assert_eq!(stopped.unreleased.len(), 1);
    assert_eq!(stopped.unreleased[0].engine, p);
    assert!(w.ucx.held_by(&q).is_empty(), "the idle engine was released");
    assert_eq!(w.ucx.held_by(&p).remote_metadata, 1, "the busy one was not");
    drop(read);
}

// ----- given-up reads and the destination of their buffers -----

/// The fake UCX, with a release that ends the transfers still running (as a
/// transport that closes its endpoints would): an opt-in, not measured.
struct ClosingUcx(FakeUcx);

impl Transport for ClosingUcx {
    type Resources = FakeResources;
    fn notify(&self, agent: &AgentName, message: &[u8]) -> Result<(), TransportError> {
        self.0.notify(agent, message)
    }
    fn release_with(
        &self,
        engine: &EngineId,
        agents: &[AgentName],
        resources: FakeResources,
        _transfers: Transfers,
    ) -> Vec<ReleaseStep> {
        self.0.release(engine, agents, resources)
    }
    fn release_ends_transfers(&self) -> bool {
        true
    }
}

/// A decoder reading from `fine` all the time (one read every 100 ms).
fn keep_reading(engine: EngineRef, ucx: FakeUcx) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let Ok(read) = engine.begin_read() else {
                return;
            };
            tokio::time::sleep(Duration::from_millis(100)).await;
            read.finish(ucx.read(engine.id()));
        }
    })
}

/// What a runtime does with a given-up read: keeps polling its transfer
/// (every 100 ms here) and says when it ended.
async fn watch_to_its_end(ucx: &FakeUcx, engine: &EngineId, given_up: &GivenUpRead) -> Destination {
    loop {
        let status = ucx.read(engine);
        if status != NixlStatus::IN_PROG {
            return given_up.ended(status);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A frozen prefill's reads time out: the requests fail at once (the
/// stall), the engine is fenced while its given-up transfers may run, and
/// when it resumes (`thaw`) or dies (`crash`) the transfers end, their
/// buffers are reusable and the engine is released: never under them.
#[tokio::test(start_paused = true)]
async fn a_frozen_prefill_is_fenced_until_its_given_up_reads_end_then_released_and_buffers_reused()
{
    for resumes in [true, false] {
        let mut w = World::start(FakeConfig::default(), config());
        let frozen = w.ucx.spawn_prefill(addr(1), 1);
        let healthy = w.ucx.spawn_prefill(addr(2), 1);
        let engine = w.connect(&addr(1)).await;
        let other = w.connect(&addr(2)).await;
        let reader = keep_reading(other, w.ucx.clone());
        w.ucx.freeze(&frozen);
        let read = engine.begin_read().unwrap();
        let second = engine.begin_read().unwrap();
        // The runtime's read timeout, 5 s (the read-stall bound is 10 s).
        w.run_for(Duration::from_secs(5)).await;
        assert_eq!(
            engine.state(),
            EngineState::Live,
            "not before the runtime gave up"
        );
        let given_up = read.give_up_holding(GiveUp::TimedOut, 3);
        assert_eq!(given_up.try_destination(), None, "still running");
        let (reads, given) = w
            .until(Duration::from_millis(100), |e| match e {
                Event::Stalled {
                    engine,
                    reads_in_flight,
                    given_up,
                    failed: true,
                    ..
                } if *engine == frozen => Some((*reads_in_flight, *given_up)),
                _ => None,
            })
            .await;
        assert_eq!((reads, given), (2, 1), "the given-up read still counts");
        assert!(second.is_failed(), "its other read is failed");
        let cancelled = second.give_up(GiveUp::Cancelled);
        // Fenced for as long as it stays frozen: no release under the
        // transfers, the snapshot says what it waits for.
        w.run_for(Duration::from_secs(60)).await;
        assert_eq!(engine.state(), EngineState::Stalled);
        let snap = w.handle.snapshot().await.unwrap();
        let e = snap.engines.iter().find(|e| e.engine == frozen).unwrap();
        assert_eq!(e.given_up.len(), 2, "{e:?}");
        assert_eq!(e.given_up[0].blocks, 3);
        assert!(e.given_up[0].held_for >= Duration::from_secs(60));
        assert!(e.why.contains("given-up transfer(s) to end"), "{}", e.why);
        if resumes {
            w.ucx.thaw(&frozen);
        } else {
            w.ucx.crash(&frozen);
        }
        let (a, b) = tokio::join!(
            watch_to_its_end(&w.ucx, &frozen, &given_up),
            watch_to_its_end(&w.ucx, &frozen, &cancelled)
        );
        assert_eq!((a, b), (Destination::Reusable, Destination::Reusable));
        assert_eq!(given_up.try_destination(), Some(Destination::Reusable));
        let reason = released_reason(&w.released(&frozen, Duration::from_millis(100)).await);
        assert_eq!(reason, ReleaseReason::Stalled, "resumes: {resumes}");
        assert_eq!(
            w.handle.engine(&healthy).map(|e| e.state()),
            Some(EngineState::Live)
        );
        reader.abort();
        let _ = reader.await;
        w.stop().await.assert_nothing_leaked();
    }
}

/// A runtime that stops watching (it released NIXL's request): the engine
/// is released under the transfer, and with a transport that cannot prove
/// the release ended it (NIXL 1.5.1, the fake by default) the buffer is
/// retired. A token dropped unsaid does the same.
#[tokio::test(start_paused = true)]
async fn an_abandoned_given_up_read_lets_the_release_go_and_its_buffer_is_retired() {
    let mut w = World::start(FakeConfig::default(), config());
    let frozen = w.ucx.spawn_prefill(addr(1), 1);
    let engine = w.connect(&addr(1)).await;
    w.ucx.freeze(&frozen);
    let read = engine.begin_read().unwrap();
    let second = engine.begin_read().unwrap();
    w.run_for(Duration::from_secs(5)).await;
    let given_up = read.give_up(GiveUp::TimedOut);
    w.run_for(Duration::from_millis(100)).await;
    assert_eq!(engine.state(), EngineState::Stalled);
    drop(second.give_up(GiveUp::Cancelled));
    given_up.abandon();
    given_up.abandon();
    assert_eq!(
        released_reason(&w.released(&frozen, Duration::from_millis(100)).await),
        ReleaseReason::Stalled
    );
    assert_eq!(given_up.destination().await, Destination::Retire);
    // Said to end after all: over is over (counted once, above).
    assert_eq!(given_up.ended(NixlStatus::SUCCESS), Destination::Reusable);
    w.ucx.thaw(&frozen);
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_given_up_reads_buffer_is_reusable_once_a_release_that_ends_transfers_came_back() {
    let ucx = FakeUcx::new(FakeConfig::default());
    let shutdown = CancellationToken::new();
    let (handle, task) = nixl_keepalive::spawn(
        Arc::new(ClosingUcx(ucx.clone())),
        config(),
        shutdown.clone(),
    );
    let p = ucx.spawn_prefill(addr(1), 1);
    let engine = ucx.connect(&handle, &addr(1)).await.unwrap();
    ucx.freeze(&p);
    let read = engine.begin_read().unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let given_up = read.give_up(GiveUp::TimedOut);
    given_up.abandon();
    let destination = tokio::time::timeout(Duration::from_secs(1), given_up.destination())
        .await
        .expect("released within the second");
    assert_eq!(destination, Destination::Reusable);
    assert_eq!(engine.state(), EngineState::Released);
    ucx.thaw(&p);
    shutdown.cancel();
    assert!(task.await.unwrap().unreleased.is_empty());
    ucx.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn the_start_up_bounds_name_crashed_silent_and_frozen_apart_in_seconds() {
    use nixl_keepalive::ucx::settings::UcxSettings;
    let ucx = FakeUcx::new(FakeConfig::default());
    let (service, handle) = Keepalive::new(Arc::new(ucx.clone()), config());
    // What UCX's own configuration prints for the default keepalive, on a
    // host without an RDMA device, TCP and shared memory enabled.
    let from_ucx = |name: &str| match name {
        "KEEPALIVE_INTERVAL" => Some("20000000.00us".to_string()),
        "TLS" => Some("all".to_string()),
        _ => None,
    };
    let mut settings = UcxSettings::from_lookup(&|_| None, Some(&from_ucx)).unwrap();
    settings.rdma_devices.value = false;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(service.with_ucx_settings(&settings).run(shutdown.clone()));
    let snapshot = handle.snapshot().await.unwrap();
    let bound = snapshot.detection_bound.expect("bounds given");
    // Crashed: the next heartbeat at worst (5 s + 0.5 s jitter) + 1 s, not
    // the TCP timeout.
    assert_eq!(bound.crashed, Some(Duration::from_millis(6500)));
    // Silent: keepalive 20 s + the kernel's TCP retransmission limit.
    assert_eq!(
        bound.silent,
        Some(Duration::from_millis(20_000 + 924_600 + 5_500 + 1_000))
    );
    // Frozen with reads in flight: 1.25 x the 10 s read-stall bound + 1 s.
    assert_eq!(bound.frozen, Some(Duration::from_millis(13_500)));
    assert_eq!(
        bound.to_string(),
        "crashed 6.5s, silent 951.1s, frozen with reads in flight 13.5s"
    );
    assert!(
        snapshot.silent_peer_note.contains("UCX keepalive (20s)"),
        "{}",
        snapshot.silent_peer_note
    );
    assert!(!snapshot.to_string().contains("us"), "{snapshot}");
    shutdown.cancel();
    task.await.unwrap();
}

// ---- endpoint events (issue 45) -------------------------------------------

/// The fake as measured over TCP: a crash fails the endpoints at once and
/// the failure watch hears of it.
fn with_endpoint_events() -> FakeConfig {
    let mut c = FakeConfig::default();
    c.endpoint_events = true;
    c
}

/// Heartbeats off: only an endpoint event can find a crashed idle peer.
fn no_heartbeats(endpoint_events: bool) -> Config {
    Config::builder()
        .heartbeat_interval(None)
        .rate_limit(Duration::from_secs(1), 2)
        .endpoint_events(endpoint_events)
        .seed(7)
        .build()
        .unwrap()
}

fn heartbeats_to(ucx: &FakeUcx, p: &EngineId) -> usize {
    ucx.calls()
        .iter()
        .filter(|c| c.engine.as_ref() == Some(p) && c.message.starts_with(b"HB:"))
        .count()
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_failure_releases_a_crashed_idle_prefill_with_heartbeats_off() {
    let mut w = World::start(with_endpoint_events(), no_heartbeats(true));
    assert_eq!(w.ucx.failure_watches(), 1, "the service watches");
    let p = w.ucx.spawn_prefill(addr(1), 2);
    let engine = w.connect(&addr(1)).await;
    w.run_for(Duration::from_secs(30)).await;
    assert_eq!(heartbeats_to(&w.ucx, &p), 0, "heartbeats are off");

    w.ucx.crash(&p);
    let (status, source) = w
        .until(Duration::from_millis(50), |e| match e {
            Event::Unreachable { status, source, .. } => Some((*status, *source)),
            _ => None,
        })
        .await;
    // Marked by the heartbeat the event asked for, not by the event.
    assert_eq!(
        (status, source),
        (
            NixlStatus::ERR_REMOTE_DISCONNECT,
            nixl_keepalive::Source::Heartbeat
        )
    );
    w.released(&p, Duration::from_millis(50)).await;
    assert_eq!(engine.state(), EngineState::Released);
    assert_eq!(
        heartbeats_to(&w.ucx, &p),
        2,
        "one round (two agents), though both endpoints reported"
    );
    let ucx = w.stop().await;
    assert_eq!(ucx.failure_watches(), 0, "the watch stops with the service");
    ucx.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn with_endpoint_events_off_a_crashed_idle_prefill_waits_for_a_heartbeat() {
    let mut w = World::start(with_endpoint_events(), no_heartbeats(false));
    assert_eq!(w.ucx.failure_watches(), 0, "nothing watched");
    let p = w.ucx.spawn_prefill(addr(1), 1);
    let engine = w.connect(&addr(1)).await;
    w.ucx.crash(&p);
    w.run_for(Duration::from_secs(60)).await;
    assert_eq!(engine.state(), EngineState::Live, "nobody asked");
    // The runtime's renewal is a heartbeat: it finds the crash.
    w.handle.renew_leases(&p).unwrap();
    w.released(&p, Duration::from_millis(50)).await;
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_spurious_endpoint_failure_costs_a_heartbeat_and_releases_nothing() {
    let w = World::start(with_endpoint_events(), no_heartbeats(true));
    let p1 = w.ucx.spawn_prefill(addr(1), 1);
    let p2 = w.ucx.spawn_prefill(addr(2), 1);
    let e1 = w.connect(&addr(1)).await;
    let e2 = w.connect(&addr(2)).await;
    let a1 = w.ucx.agents_of(&p1)[0].clone();
    let reset = UcsStatus::ERR_CONNECTION_RESET;

    // Named: that engine alone gets a round.
    w.ucx.report_endpoint_failure(Some(a1.clone()), reset);
    w.run_for(Duration::from_millis(10)).await;
    assert_eq!(
        (heartbeats_to(&w.ucx, &p1), heartbeats_to(&w.ucx, &p2)),
        (1, 0)
    );
    // An agent nobody holds (already released, or a stranger): nothing.
    w.ucx
        .report_endpoint_failure(Some(AgentName::new("stranger-rank0")), reset);
    w.run_for(Duration::from_millis(10)).await;
    assert_eq!(
        (heartbeats_to(&w.ucx, &p1), heartbeats_to(&w.ucx, &p2)),
        (1, 0)
    );
    // Unnamed: every live engine gets one.
    w.ucx.report_endpoint_failure(None, reset);
    w.run_for(Duration::from_millis(10)).await;
    assert_eq!(
        (heartbeats_to(&w.ucx, &p1), heartbeats_to(&w.ucx, &p2)),
        (2, 1)
    );

    // A flood (a flapping or hostile source): the rate cap holds, burst 2
    // then one round per second.
    let start = tokio::time::Instant::now();
    let before = heartbeats_to(&w.ucx, &p1);
    for _ in 0..1000 {
        w.ucx.report_endpoint_failure(Some(a1.clone()), reset);
        w.run_for(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed();
    let rounds = heartbeats_to(&w.ucx, &p1) - before;
    assert!(
        rounds <= 2 + elapsed.as_secs() as usize,
        "{rounds} rounds in {elapsed:?}"
    );
    assert!(
        rounds >= elapsed.as_secs() as usize,
        "{rounds} rounds in {elapsed:?}"
    );
    assert_eq!(
        (e1.state(), e2.state()),
        (EngineState::Live, EngineState::Live)
    );
    assert_eq!(w.ucx.held_by(&p1).remote_metadata, 1, "nothing released");
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_failure_under_a_read_marks_at_once_and_releases_when_the_read_ends() {
    let mut w = World::start(with_endpoint_events(), no_heartbeats(true));
    let p = w.ucx.spawn_prefill(addr(1), 1);
    let engine = w.connect(&addr(1)).await;
    let read = engine.begin_read().unwrap();
    w.ucx.crash(&p);
    w.until(Duration::from_millis(50), |e| {
        matches!(e, Event::Unreachable { .. }).then_some(())
    })
    .await;
    assert!(read.is_failed(), "its reads are failed at once");
    w.run_for(Duration::from_secs(30)).await;
    assert_eq!(w.ucx.held_by(&p).remote_metadata, 1, "never under a read");
    read.finish(w.ucx.read(&p));
    w.released(&p, Duration::from_millis(50)).await;
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn endpoint_failures_racing_a_shutdown_are_dropped_without_a_panic() {
    let w = World::start(with_endpoint_events(), no_heartbeats(true));
    let p = w.ucx.spawn_prefill(addr(1), 1);
    let _engine = w.connect(&addr(1)).await;
    let a = w.ucx.agents_of(&p)[0].clone();
    let ucx = w.ucx.clone();
    w.shutdown.cancel();
    for _ in 0..100 {
        ucx.report_endpoint_failure(Some(a.clone()), UcsStatus::ERR_CONNECTION_RESET);
        ucx.report_endpoint_failure(None, UcsStatus::ERR_CONNECTION_RESET);
        tokio::task::yield_now().await;
    }
    let stopped = w.task.await.unwrap();
    assert!(stopped.unreleased.is_empty());
    assert_eq!(ucx.failure_watches(), 0);
    ucx.report_endpoint_failure(Some(a), UcsStatus::ERR_CONNECTION_RESET);
    ucx.assert_nothing_leaked();
}
