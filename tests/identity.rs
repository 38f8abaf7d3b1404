//! One identity per prefill, through the public API on the fake UCX: every
//! collision of identities a user or a hostile peer can stage, and in each
//! the healthy engine stays live, loaded and read, and every registration
//! ends exactly once.

use std::time::Duration;

use nixl_keepalive::fake::{FakeConfig, FakeConnectError, FakeResources};
use nixl_keepalive::{
    AgentName, ClaimRefused, Config, Conflict, EngineId, EngineRef, EngineState, Event, GiveUp,
    NixlStatus, OwnedReadGuard, PeerAddr, Ready, RegisterError, Registration,
};

mod common;

use common::{addr, World};

fn world() -> World {
    let config = Config::builder()
        .heartbeat_interval(Some(Duration::from_secs(1)))
        .metrics_period(None)
        .seed(3)
        .build()
        .unwrap();
    World::start(FakeConfig::default(), config)
}

impl World {
    /// A minute of traffic: the healthy engine is read every second and
    /// each read must succeed on a loaded, live engine.
    async fn read_for(&self, engine: &EngineRef, seconds: u64) {
        for _ in 0..seconds {
            let read = engine.begin_read().expect("the healthy engine stays live");
            let status = self.ucx.read(engine.id());
            assert_eq!(status, NixlStatus::SUCCESS, "its reads stay verified");
            read.finish(status);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        for agent in self.ucx.agents_of(engine.id()) {
            assert!(self.ucx.is_loaded(&agent), "{agent} still loaded");
        }
    }

    /// Prefill `p` at address 1, registered, one read taken from it, then
    /// restarted under the same engine id: a claim of the new incarnation
    /// waits for the old registration's release, which waits for that
    /// read (owned, so the caller ends it when the test says).
    async fn restarted_under_a_read(&self) -> (EngineRef, OwnedReadGuard) {
        self.ucx
            .spawn_prefill_with_id(addr(1), EngineId::from("p"), 1);
        let old = self.ucx.connect(&self.handle, &addr(1)).await.unwrap();
        let read = old.begin_read_owned().unwrap();
        self.ucx.restart_with_same_id(&addr(1));
        (old, read)
    }

    /// Address 1 connects again and its engine is live; then the service
    /// stops with nothing unreleased and nothing leaked.
    async fn reloads_then_stops_clean(self) {
        let reloaded = self.ucx.connect(&self.handle, &addr(1)).await.unwrap();
        assert_eq!(reloaded.state(), EngineState::Live);
        let (ucx, stopped) = self.stopped().await;
        assert!(stopped.unreleased.is_empty());
        ucx.assert_nothing_leaked();
    }
}

fn conflicts(events: &[Event]) -> Vec<&Conflict> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Conflict { conflict, .. } => Some(conflict),
            _ => None,
        })
        .collect()
}

fn releases(events: &[Event]) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, Event::Released { .. }))
        .count()
}

#[tokio::test(start_paused = true)]
async fn a_hostile_prefill_replaying_a_healthy_reply_is_refused_and_the_healthy_one_keeps_reading()
{
    let mut w = world();
    let p = w.ucx.spawn_prefill(addr(1), 2);
    let healthy = w.ucx.connect(&w.handle, &addr(1)).await.unwrap();
    w.ucx.replay_at(addr(2), &p);
    for _ in 0..10 {
        match w.ucx.connect(&w.handle, &addr(2)).await {
            Err(FakeConnectError::Refused(ClaimRefused::Conflict(Conflict::EngineElsewhere {
                engine,
                live_at,
                ..
            }))) => {
                assert_eq!(engine, p);
                assert_eq!(live_at, addr(1));
            }
            other => panic!("the replay must be refused: {other:?}"),
        }
        w.read_for(&healthy, 6).await;
    }
    let events = w.drain();
    assert_eq!(conflicts(&events).len(), 1, "logged and published once");
    assert_eq!(releases(&events), 0);
    assert_eq!(healthy.state(), EngineState::Live);
    let (ucx, stopped) = w.stopped().await;
    assert!(stopped.unreleased.is_empty());
    ucx.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_reply_whose_metadata_is_another_engines_never_unloads_that_engine() {
    let mut w = world();
    w.ucx.spawn_prefill(addr(1), 1);
    let healthy = w.ucx.connect(&w.handle, &addr(1)).await.unwrap();
    // The reply at another address says "engine q, agent q-rank0", but its
    // metadata blob is the healthy engine's: NIXL loads the healthy agent
    // (identical metadata: accepted, one entry).
    let mut reply = w.ucx.fetch_metadata(&addr(1)).unwrap();
    reply.engine = EngineId::from("q");
    reply.agents = vec![AgentName::from("q-rank0")];
    let handshake = w.handle.handshake(addr(2));
    match w.ucx.connect_with(handshake, reply).await {
        Err(FakeConnectError::AgentMismatch { loaded, .. }) => {
            assert_eq!(loaded, w.ucx.agents_of(healthy.id()))
        }
        other => panic!("the mismatch must be refused: {other:?}"),
    }
    w.read_for(&healthy, 10).await;
    let events = w.drain();
    assert_eq!(releases(&events), 0);
    assert!(
        matches!(conflicts(&events)[..], [Conflict::AgentInUse { .. }]),
        "{events:?}"
    );
    let (ucx, stopped) = w.stopped().await;
    assert!(stopped.unreleased.is_empty());
    ucx.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_reply_naming_another_engines_agents_is_refused_before_anything_is_loaded() {
    let mut w = world();
    w.ucx.spawn_prefill(addr(1), 2);
    let healthy = w.ucx.connect(&w.handle, &addr(1)).await.unwrap();
    w.ucx.spawn_prefill(addr(2), 2);
    let mut reply = w.ucx.fetch_metadata(&addr(2)).unwrap();
    reply.agents = w.ucx.agents_of(healthy.id());
    let loads_before = w.ucx.calls().len();
    let handshake = w.handle.handshake(addr(2));
    assert!(matches!(
        w.ucx.connect_with(handshake, reply).await,
        Err(FakeConnectError::Refused(ClaimRefused::Conflict(
            Conflict::AgentInUse { .. }
        )))
    ));
    assert_eq!(w.ucx.calls().len(), loads_before, "nothing loaded");
    w.read_for(&healthy, 10).await;
    assert_eq!(releases(&w.drain()), 0);
    let (ucx, stopped) = w.stopped().await;
    assert!(stopped.unreleased.is_empty());
    ucx.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn two_readers_of_one_prefill_share_one_registration_and_never_churn() {
    let mut w = world();
    w.ucx.spawn_prefill(addr(1), 2);
    // Two readers (the address listed twice) handshake and probe at once,
    // again and again.
    let mut engines = Vec::new();
    let address = addr(1);
    for _ in 0..20 {
        let (a, b) = tokio::join!(
            w.ucx.connect(&w.handle, &address),
            w.ucx.connect(&w.handle, &address)
        );
        engines.push(a.unwrap());
        engines.push(b.unwrap());
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let first = &engines[0];
    w.read_for(first, 5).await;
    let events = w.drain();
    let registered = events
        .iter()
        .filter(|e| matches!(e, Event::Registered { .. }))
        .count();
    assert_eq!(registered, 1, "one registration, never reloaded");
    assert_eq!(releases(&events), 0);
    assert!(engines.iter().all(|e| e.state() == EngineState::Live));
    let (ucx, stopped) = w.stopped().await;
    assert!(stopped.unreleased.is_empty());
    ucx.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn two_prefills_started_with_one_engine_id_conflict_once_and_the_first_is_kept() {
    let mut w = world();
    let p = EngineId::from("pinned");
    w.ucx.spawn_prefill_with_id(addr(1), p.clone(), 1);
    let first = w.ucx.connect(&w.handle, &addr(1)).await.unwrap();
    w.ucx.spawn_prefill_with_id(addr(2), p.clone(), 1);
    for _ in 0..30 {
        assert!(matches!(
            w.ucx.connect(&w.handle, &addr(2)).await,
            Err(FakeConnectError::Refused(ClaimRefused::Conflict(
                Conflict::EngineElsewhere { .. }
            )))
        ));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let events = w.drain();
    assert_eq!(conflicts(&events).len(), 1);
    assert_eq!(releases(&events), 0);
    assert_eq!(first.state(), EngineState::Live);
    let (_, stopped) = w.stopped().await;
    assert!(stopped.unreleased.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_registration_whose_future_is_dropped_is_registered_or_handed_back_exactly_once() {
    let w = world();
    w.ucx.spawn_prefill(addr(1), 1);
    let old = w.ucx.connect(&w.handle, &addr(1)).await.unwrap();
    let read = old.begin_read().unwrap();
    // The same id again, without a handshake, under a timeout that fires:
    // the registration is with the service from the call on.
    let again = Registration {
        engine: old.id().clone(),
        incarnation: None,
        address: addr(1),
        agents: vec![AgentName::from("again-rank0")],
        resources: FakeResources::empty(old.id().clone()),
    };
    let future = w.handle.register(again);
    drop(future);
    // A fresh engine, its future dropped unpolled: still activated.
    let fresh = Registration {
        engine: EngineId::from("fresh"),
        incarnation: None,
        address: addr(3),
        agents: vec![AgentName::from("fresh-rank0")],
        resources: FakeResources::empty(EngineId::from("fresh")),
    };
    drop(w.handle.register(fresh));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(w.handle.engine(&EngineId::from("fresh")).is_some());
    drop(read);
    let (_, stopped) = w.stopped().await;
    // The refused one came back once (its caller stopped waiting); the
    // fresh one was released by the service.
    let back: Vec<&str> = stopped
        .unreleased
        .iter()
        .map(|r| r.agents[0].as_str())
        .collect();
    assert_eq!(back, vec!["again-rank0"]);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_ready_to_load_leaves_nothing_behind() {
    let w = world();
    let (_old, read) = w.restarted_under_a_read().await;
    for _ in 0..100 {
        let handshake = w.handle.handshake(addr(1));
        let reply = w.ucx.fetch_metadata(&addr(1)).unwrap();
        let waited = tokio::time::timeout(
            Duration::from_millis(5),
            handshake.ready_to_load(reply.claim()),
        )
        .await;
        assert!(waited.is_err(), "waits for the old registration's read");
    }
    let snapshot = w.handle.snapshot().await.unwrap();
    assert!(snapshot.handshakes_pending.is_empty());
    assert!(snapshot.waiting_for_reload.is_empty());
    drop(read);
    w.reloads_then_stops_clean().await;
}

/// Issue 58: a runtime that handshakes on the one task that also ends its
/// transfers. The restarted prefill's claim waits for the old
/// registration's release, which waits for reads only this task ends: the
/// bounded claim ends at its limit naming them, and the same task, having
/// ended them, handshakes again and loads.
#[tokio::test(start_paused = true)]
async fn a_bounded_claim_held_by_its_own_callers_reads_ends_naming_them() {
    let w = world();
    let (old, read) = w.restarted_under_a_read().await;
    let given_up = old
        .begin_read()
        .unwrap()
        .give_up_holding(GiveUp::TimedOut, 3);

    let handshake = w.handle.handshake(addr(1));
    let reply = w.ucx.fetch_metadata(&addr(1)).unwrap();
    let started = tokio::time::Instant::now();
    let refused = handshake
        .ready_to_load_within(reply.claim(), Duration::from_secs(5))
        .await;
    let held = match refused {
        Err(ClaimRefused::ReleaseHeld(held)) => held,
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("granted while the old registration's reads run"),
    };
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(5),
        "waited its limit"
    );
    assert_eq!(held.waited, Duration::from_secs(5));
    assert_eq!(held.engine.as_str(), "p");
    assert_eq!(held.address, addr(1));
    let holder = held.holder.as_ref().expect("the old registration is named");
    assert_eq!(holder.reads_in_flight, 2, "the read and the given-up read");
    assert_eq!(held.given_up(), (1, 3));
    let text = held.to_string();
    for part in [
        "engine p",
        "waited 5.0 s",
        "2 read(s) in flight",
        "1 of them given up (holding 3 block(s)",
        "poll them before handshaking again",
        "Nothing was loaded",
    ] {
        assert!(text.contains(part), "{part:?} missing from: {text}");
    }
    let snapshot = w.handle.snapshot().await.unwrap();
    assert!(
        snapshot.handshakes_pending.is_empty(),
        "the handshake ended"
    );

    // The same task ends its transfers, then handshakes again.
    read.finish(NixlStatus::SUCCESS);
    given_up.ended(NixlStatus::SUCCESS);
    let handshake = w.handle.handshake(addr(1));
    let reply = w.ucx.fetch_metadata(&addr(1)).unwrap();
    let ready = handshake
        .ready_to_load_within(reply.claim(), Duration::from_secs(5))
        .await
        .expect("granted once the old registration's reads ended");
    let Ready::Load(ready) = ready else {
        panic!("a new incarnation is loaded, not found current");
    };
    drop(ready);
    w.reloads_then_stops_clean().await;
}

/// The bound only bounds a wait: a claim that waits on nothing is granted
/// at once, and a limit too long for the clock waits as the unbounded call
/// does, for the whole hour the caller's read takes.
#[tokio::test(start_paused = true)]
async fn a_bounded_claim_is_granted_at_once_or_when_released_at_any_limit() {
    let w = world();
    w.ucx.spawn_prefill_with_id(addr(2), EngineId::from("q"), 1);
    let handshake = w.handle.handshake(addr(2));
    let reply = w.ucx.fetch_metadata(&addr(2)).unwrap();
    let started = tokio::time::Instant::now();
    let ready = handshake
        .ready_to_load_within(reply.claim(), Duration::from_millis(1))
        .await;
    assert!(matches!(ready, Ok(Ready::Load(_))), "nothing to wait for");
    assert_eq!(started.elapsed(), Duration::ZERO);
    drop(ready);

    let (_old, read) = w.restarted_under_a_read().await;
    let handshake = w.handle.handshake(addr(1));
    let reply = w.ucx.fetch_metadata(&addr(1)).unwrap();
    let claim = tokio::spawn(handshake.ready_to_load_within(reply.claim(), Duration::MAX));
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert!(!claim.is_finished(), "still waiting after an hour");
    read.finish(NixlStatus::SUCCESS);
    let ready = claim.await.unwrap();
    assert!(
        matches!(ready, Ok(Ready::Load(_))),
        "granted at the release"
    );
    drop(ready);
    let (_, stopped) = w.stopped().await;
    assert!(stopped.unreleased.is_empty());
}

/// The service stopping while a bounded claim waits: the claim says so
/// (never `ReleaseHeld`, which would send the caller to its reads).
#[tokio::test(start_paused = true)]
async fn a_bounded_claim_waiting_when_the_service_stops_says_it_stopped() {
    let w = world();
    let (_old, read) = w.restarted_under_a_read().await;
    let handshake = w.handle.handshake(addr(1));
    let reply = w.ucx.fetch_metadata(&addr(1)).unwrap();
    let claim = tokio::spawn(handshake.ready_to_load_within(reply.claim(), Duration::from_secs(5)));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stopping = tokio::spawn(w.stopped());
    tokio::time::sleep(Duration::from_millis(10)).await;
    read.finish(NixlStatus::SUCCESS);
    let judged = claim.await.unwrap();
    assert!(
        matches!(judged, Err(ClaimRefused::Stopped(_))),
        "{:?}",
        judged.err()
    );
    let (_, stopped) = stopping.await.unwrap();
    assert!(stopped.unreleased.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_registration_without_a_handshake_of_a_live_id_is_refused_whole() {
    let w = world();
    w.ucx.spawn_prefill(addr(1), 1);
    let live = w.ucx.connect(&w.handle, &addr(1)).await.unwrap();
    let refused = w
        .handle
        .register(Registration {
            engine: live.id().clone(),
            incarnation: None,
            address: addr(1),
            agents: vec![AgentName::from("x")],
            resources: FakeResources::empty(live.id().clone()),
        })
        .await;
    match refused {
        Err(RegisterError::Conflict {
            registration,
            conflict: Conflict::EngineInUse { .. },
        }) => assert_eq!(registration.agents[0].as_str(), "x"),
        other => panic!("{other:?}"),
    }
    assert_eq!(live.state(), EngineState::Live);
    let (_, stopped) = w.stopped().await;
    assert!(stopped.unreleased.is_empty());
}

/// On a multi-threaded runtime the caller can run the moment the answer
/// is sent: the event must have gone out before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_register_returns_its_registered_event_is_already_visible_to_subscribers() {
    let mut w = world();
    for i in 0..500u32 {
        let address = PeerAddr::new(format!("10.1.{}.{}:5600", i / 250, i % 250));
        w.ucx.spawn_prefill(address.clone(), 1);
        let engine = w.ucx.connect(&w.handle, &address).await.unwrap();
        // No yield in between: the event was published before the answer.
        let events = w.drain();
        assert!(
            events
                .iter()
                .any(|e| matches!(e, Event::Registered { engine: e, .. } if e == engine.id())),
            "{events:?}"
        );
        assert!(
            w.handle.engine(engine.id()).is_some(),
            "and it is in the directory"
        );
    }
    let (_, stopped) = w.stopped().await;
    assert!(stopped.unreleased.is_empty());
}
