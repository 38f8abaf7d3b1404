//! The service's reaction to cluster membership, on tokio's paused clock:
//! the in-memory membership plane (`membership::memory`, leases and all)
//! and the fake UCX. Minutes of virtual time in milliseconds.

use std::sync::Arc;
use std::time::Duration;

use nixl_keepalive::fake::{FakeConfig, FakeResources, FakeUcx};
use nixl_keepalive::membership::memory::{InMemoryStore, LeaseId};
use nixl_keepalive::membership::{
    self, Action, Member, MembershipConfig, MembershipUpdate, Reconciler, RetireWhy, SourceEvent,
};
use nixl_keepalive::{
    Config, EngineId, EngineRef, EngineState, Event, GoneMode, KeepaliveHandle, NixlStatus,
    PeerAddr, ReleaseReason,
};
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

type Handle = KeepaliveHandle<FakeResources>;

const TTL: Duration = Duration::from_secs(10);
const PATIENCE: Duration = Duration::from_secs(600);

struct World {
    ucx: FakeUcx,
    store: InMemoryStore,
    handle: Handle,
    events: broadcast::Receiver<Event>,
    updates: mpsc::UnboundedReceiver<MembershipUpdate>,
    shutdown: CancellationToken,
    task: JoinHandle<nixl_keepalive::Stopped<FakeResources>>,
}

fn config() -> Config {
    Config::builder()
        .heartbeat_interval(Some(Duration::from_secs(5)))
        .jitter(Duration::from_millis(500))
        .rate_limit(Duration::from_secs(1), 2)
        .seed(7)
        .build()
        .unwrap()
}

/// The fake UCX as measured: a frozen peer is never reported.
fn measured_ucx() -> FakeConfig {
    FakeConfig {
        frozen_peers_detected: false,
        ..FakeConfig::default()
    }
}

fn world(mode: GoneMode) -> World {
    let ucx = FakeUcx::new(measured_ucx());
    let shutdown = CancellationToken::new();
    let (handle, task) = nixl_keepalive::spawn(Arc::new(ucx.clone()), config(), shutdown.clone());
    let events = handle.subscribe();
    let store = InMemoryStore::new();
    store.spawn_lease_expiry(Duration::from_millis(100), shutdown.clone());
    let (updates, _driver) = membership::spawn(
        store.watch(),
        handle.clone(),
        MembershipConfig { gone_mode: mode },
        shutdown.clone(),
    );
    World {
        ucx,
        store,
        handle,
        events,
        updates,
        shutdown,
        task,
    }
}

fn addr(n: u16) -> PeerAddr {
    PeerAddr::new(format!("10.0.0.{n}:5600"))
}

fn key(engine: &EngineId) -> String {
    format!("{}{engine}", membership::DEFAULT_PREFIX)
}

impl World {
    /// A prefill that starts and registers itself under a lease (which
    /// expires unless kept alive with [`World::keep_alive`]).
    fn start_leased_prefill(&self, address: &PeerAddr, ranks: usize) -> (EngineId, LeaseId) {
        let engine = self.ucx.spawn_prefill(address.clone(), ranks);
        let lease = self.register(&engine, address, ranks);
        (engine, lease)
    }

    fn register(&self, engine: &EngineId, address: &PeerAddr, ranks: usize) -> LeaseId {
        let lease = self.store.grant_lease(TTL).expect("store up");
        let member = Member::new(engine.as_str(), address.as_str(), ranks as u16);
        assert!(self.store.put_member(&key(engine), &member, Some(lease)));
        lease
    }

    /// A prefill that starts and registers itself without a lease.
    fn start_prefill(&self, address: &PeerAddr, ranks: usize) -> EngineId {
        let engine = self.ucx.spawn_prefill(address.clone(), ranks);
        self.register_plain(&engine, address);
        engine
    }

    fn register_plain(&self, engine: &EngineId, address: &PeerAddr) {
        let member = Member::new(engine.as_str(), address.as_str(), 1);
        assert!(self.store.put_member(&key(engine), &member, None));
    }

    /// What the runtime does on `Joined`: handshake, load, register.
    async fn connect(&self, address: &PeerAddr) -> EngineRef {
        self.ucx
            .connect(&self.handle, address)
            .await
            .expect("connects")
    }

    async fn update(&mut self) -> MembershipUpdate {
        tokio::time::timeout(PATIENCE, self.updates.recv())
            .await
            .expect("a membership update in time")
            .expect("driver running")
    }

    /// The next `Joined`, connected.
    async fn joined(&mut self) -> (Member, EngineRef) {
        let mut update = self.update().await;
        while let MembershipUpdate::Released { .. } = update {
            update = self.update().await;
        }
        match update {
            MembershipUpdate::Joined(m) => {
                let e = self.connect(&m.peer_addr()).await;
                (m, e)
            }
            other => panic!("expected Joined, got {other:?}"),
        }
    }

    async fn released(&mut self, engine: &EngineId) -> ReleaseReason {
        tokio::time::timeout(PATIENCE, async {
            loop {
                if let Event::Released {
                    engine: e, reason, ..
                } = self.events.recv().await.unwrap()
                {
                    if &e == engine {
                        return reason;
                    }
                }
            }
        })
        .await
        .expect("released in time")
    }

    fn releases_so_far(&mut self) -> Vec<EngineId> {
        let mut out = Vec::new();
        while let Ok(e) = self.events.try_recv() {
            if let Event::Released { engine, .. } = e {
                out.push(engine);
            }
        }
        out
    }

    /// Keeps `lease` alive every TTL/3 until `stop`.
    fn keep_alive(&self, lease: LeaseId, stop: CancellationToken) -> JoinHandle<()> {
        let store = self.store.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(TTL / 3) => { store.keep_alive(lease); }
                }
            }
        })
    }

    async fn stop(self) -> FakeUcx {
        self.shutdown.cancel();
        let stopped = self.task.await.unwrap();
        assert!(stopped.unreleased.is_empty());
        self.ucx
    }
}

#[tokio::test(start_paused = true)]
async fn a_registered_engine_is_announced_and_its_deleted_key_releases_it_once_reads_drain() {
    let mut w = world(GoneMode::Drain);
    let (p, _lease) = w.start_leased_prefill(&addr(1), 2);
    let (member, engine) = w.joined().await;
    assert_eq!(member.engine(), p);
    assert_eq!(member.ranks, 2);
    let read = engine.begin_read().unwrap();

    assert!(w.store.delete(&key(&p)));
    match w.update().await {
        MembershipUpdate::Left { member, why } => {
            assert_eq!(member.engine(), p);
            assert_eq!(why, RetireWhy::Deleted);
        }
        other => panic!("{other:?}"),
    }
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(engine.state(), EngineState::Retiring, "drained, not pulled");
    assert!(!read.is_failed(), "drain lets the read finish");
    assert!(w.releases_so_far().is_empty());

    read.finish(NixlStatus::SUCCESS);
    assert_eq!(w.released(&p).await, ReleaseReason::PeerGone);
    match w.update().await {
        MembershipUpdate::Released {
            engine,
            after,
            reason,
        } => {
            assert_eq!(engine, p);
            assert_eq!(reason, ReleaseReason::PeerGone);
            assert!(
                after >= Duration::from_secs(60),
                "measured from the deletion"
            );
        }
        other => panic!("{other:?}"),
    }
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn fail_mode_fails_the_reads_in_flight_at_once() {
    let mut w = world(GoneMode::Fail);
    let p = w.start_prefill(&addr(1), 1);
    let (_, engine) = w.joined().await;
    let read = engine.begin_read().unwrap();
    w.store.delete(&key(&p));
    assert!(matches!(w.update().await, MembershipUpdate::Left { .. }));
    read.failed().await;
    assert!(read.is_failed());
    drop(read);
    assert_eq!(w.released(&p).await, ReleaseReason::PeerGone);
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_frozen_idle_prefill_is_retired_when_its_lease_expires_and_picked_up_again_after_it_registers_anew(
) {
    let mut w = world(GoneMode::Drain);
    let (p, lease) = w.start_leased_prefill(&addr(1), 2);
    let alive = CancellationToken::new();
    w.keep_alive(lease, alive.clone());
    let (_, engine) = w.joined().await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(engine.state(), EngineState::Live, "a kept lease keeps it");

    // SIGSTOP: the lease is no longer kept alive; UCX reports nothing.
    w.ucx.freeze(&p);
    alive.cancel();
    let heartbeats_before = w.ucx.notifications_to(&p).len();
    tokio::time::sleep(TTL / 2).await;
    assert_eq!(
        engine.state(),
        EngineState::Live,
        "not before the lease ends"
    );
    match w.update().await {
        MembershipUpdate::Left { member, why } => {
            assert_eq!((member.engine(), why), (p.clone(), RetireWhy::Deleted));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(w.released(&p).await, ReleaseReason::PeerGone);
    assert!(
        w.ucx.notifications_to(&p).len() > heartbeats_before,
        "heartbeats went on while frozen, all accepted"
    );
    assert!(!w.store.contains(&key(&p)));

    // SIGCONT: the old lease is gone; it registers under a new one.
    w.ucx.thaw(&p);
    assert!(!w.store.keep_alive(lease), "the old lease expired");
    let lease2 = w.register(&p, &addr(1), 2);
    assert_ne!(lease, lease2);
    let (member, engine2) = w.joined().await;
    assert_eq!(member.engine(), p);
    assert_eq!(engine2.state(), EngineState::Live);
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn an_outage_longer_than_every_lease_releases_nothing_and_the_relist_retires_only_what_left()
{
    let mut w = world(GoneMode::Drain);
    let (p1, l1) = w.start_leased_prefill(&addr(1), 1);
    let (p2, l2) = w.start_leased_prefill(&addr(2), 1);
    let (alive1, alive2) = (CancellationToken::new(), CancellationToken::new());
    w.keep_alive(l1, alive1.clone());
    w.keep_alive(l2, alive2.clone());
    let (_, e1) = w.joined().await;
    let (_, e2) = w.joined().await;

    w.store.outage("etcd: connection refused");
    match w.update().await {
        MembershipUpdate::Outage { error } => assert!(error.contains("refused")),
        other => panic!("{other:?}"),
    }
    let hb1 = w.ucx.notifications_to(&p1).len();
    // Ten minutes, sixty TTLs: keep-alives fail, nothing expires, nothing
    // is retired, heartbeats go on.
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert!(
        w.releases_so_far().is_empty(),
        "an outage is never a removal"
    );
    assert_eq!(
        (e1.state(), e2.state()),
        (EngineState::Live, EngineState::Live)
    );
    assert!(
        w.ucx.notifications_to(&p1).len() >= hb1 + 100,
        "heartbeats went on"
    );

    // p2's key was deleted where this decoder could not see it.
    assert!(w.store.delete_unseen(&key(&p2)));
    w.store.restore();
    match w.update().await {
        MembershipUpdate::Restored { outage } => assert!(outage >= Duration::from_secs(600)),
        other => panic!("{other:?}"),
    }
    match w.update().await {
        MembershipUpdate::Left { member, why } => {
            assert_eq!(
                (member.engine(), why),
                (p2.clone(), RetireWhy::MissingFromList)
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(w.released(&p2).await, ReleaseReason::PeerGone);
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(
        e1.state(),
        EngineState::Live,
        "its lease survived the outage"
    );
    alive1.cancel();
    alive2.cancel();
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_compaction_relists_and_no_removal_is_lost() {
    let mut w = world(GoneMode::Drain);
    let p1 = w.start_prefill(&addr(1), 1);
    let p2 = w.start_prefill(&addr(2), 1);
    let (_, e1) = w.joined().await;
    let (_, _e2) = w.joined().await;
    let p3 = w.ucx.spawn_prefill(addr(3), 1);
    // The deletion fell into a compacted range the watch never delivered.
    w.store.delete_unseen(&key(&p2));
    w.store.compact();
    // (p3 registers after the compaction: an ordinary put.)
    w.register_plain(&p3, &addr(3));
    match w.update().await {
        MembershipUpdate::Left { member, why } => {
            assert_eq!(
                (member.engine(), why),
                (p2.clone(), RetireWhy::MissingFromList)
            );
        }
        other => panic!("{other:?}"),
    }
    let (m3, _e3) = w.joined().await;
    assert_eq!(m3.engine(), p3);
    assert_eq!(w.released(&p2).await, ReleaseReason::PeerGone);
    assert_eq!(e1.state(), EngineState::Live);
    let _ = p1;
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_new_engine_id_at_the_same_address_retires_the_old_engine() {
    let mut w = world(GoneMode::Drain);
    let (p1, _) = w.start_leased_prefill(&addr(1), 1);
    let (_, e1) = w.joined().await;
    // Restarted under a fresh id; its old key still waits for its lease.
    let p2 = w.ucx.restart(&addr(1));
    let l2 = w.register(&p2, &addr(1), 1);
    let alive = CancellationToken::new();
    w.keep_alive(l2, alive.clone());
    match w.update().await {
        MembershipUpdate::Left { member, why } => {
            assert_eq!(member.engine(), p1);
            assert_eq!(why, RetireWhy::Replaced { by: p2.clone() });
        }
        other => panic!("{other:?}"),
    }
    let (m2, e2) = w.joined().await;
    assert_eq!(m2.engine(), p2);
    assert_eq!(w.released(&p1).await, ReleaseReason::PeerGone);
    assert_eq!(e1.state(), EngineState::Released);
    assert!(matches!(w.update().await, MembershipUpdate::Released { engine, .. } if engine == p1));
    // The old key's lease then expires: nothing more happens.
    tokio::time::sleep(TTL * 3).await;
    assert!(w.releases_so_far().is_empty());
    let more = w.updates.try_recv();
    assert!(more.is_err(), "{more:?}");
    assert_eq!(e2.state(), EngineState::Live);
    alive.cancel();
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_killed_prefill_released_by_its_heartbeat_is_not_released_again_by_its_lease_expiry() {
    let mut w = world(GoneMode::Drain);
    let (p, _lease) = w.start_leased_prefill(&addr(1), 1);
    let (_, engine) = w.joined().await;
    w.ucx.crash(&p);
    assert_eq!(w.released(&p).await, ReleaseReason::Unreachable);
    assert_eq!(engine.state(), EngineState::Released);
    // The lease runs out later.
    match w.update().await {
        MembershipUpdate::Left { member, .. } => assert_eq!(member.engine(), p),
        other => panic!("{other:?}"),
    }
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(w.releases_so_far().is_empty());
    assert!(w.updates.try_recv().is_err(), "no Released update for it");
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_value_that_breaks_the_schema_is_reported_and_changes_nothing() {
    let mut w = world(GoneMode::Drain);
    let p = w.start_prefill(&addr(1), 1);
    let (_, engine) = w.joined().await;
    for bad in [
        &b"not json"[..],
        br#"{"engine_id": "", "address": "10.0.0.1:1", "ranks": 1}"#,
        br#"{"engine_id": "e", "address": "nohost", "ranks": 1}"#,
        br#"{"engine_id": "e", "address": "h:1", "ranks": 0}"#,
        br#"{"engine_id": "e", "address": "h:1", "ranks": 70000}"#,
    ] {
        w.store.put(&key(&p), bad.to_vec());
        match w.update().await {
            MembershipUpdate::BadValue { error, .. } => assert!(!error.to_string().is_empty()),
            other => panic!("{other:?}"),
        }
    }
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(engine.state(), EngineState::Live);
    // The key still means p: its deletion still retires it.
    w.store.delete(&key(&p));
    assert!(matches!(w.update().await, MembershipUpdate::Left { .. }));
    assert_eq!(w.released(&p).await, ReleaseReason::PeerGone);
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_deletion_racing_shutdown_leaves_nothing_behind() {
    let mut w = world(GoneMode::Drain);
    let p = w.start_prefill(&addr(1), 1);
    let (_, _engine) = w.joined().await;
    w.store.delete(&key(&p));
    w.shutdown.cancel();
    let stopped = w.task.await.unwrap();
    assert!(stopped.unreleased.is_empty());
    w.ucx.assert_nothing_leaked();
}

// The reconciler's rules on their own.

fn put(key: &str, engine: &str, address: &str, revision: i64) -> SourceEvent {
    SourceEvent::Put {
        key: key.into(),
        value: Member::new(engine, address, 1).to_json().into_bytes(),
        revision,
    }
}

#[test]
fn a_stale_or_repeated_revision_is_ignored() {
    let mut r = Reconciler::new();
    assert_eq!(r.apply(put("k1", "e1", "h:1", 5)).len(), 1);
    assert!(
        r.apply(put("k1", "e9", "h:1", 5)).is_empty(),
        "same revision again"
    );
    assert!(r
        .apply(SourceEvent::Deleted {
            key: "k1".into(),
            revision: 4
        })
        .is_empty());
    assert_eq!(r.members()["k1"].engine_id, "e1");
}

#[test]
fn an_engine_under_two_keys_is_retired_only_when_both_are_gone() {
    let mut r = Reconciler::new();
    r.apply(put("k1", "e1", "h:1", 1));
    r.apply(put("k2", "e1", "h:1", 2));
    let del = |k: &str, rev| SourceEvent::Deleted {
        key: k.into(),
        revision: rev,
    };
    assert!(r.apply(del("k1", 3)).is_empty());
    let a = r.apply(del("k2", 4));
    assert!(matches!(
        &a[..],
        [Action::Retire {
            why: RetireWhy::Deleted,
            ..
        }]
    ));
}

#[test]
fn a_list_announces_only_what_is_new_and_retires_only_what_is_missing() {
    let mut r = Reconciler::new();
    r.apply(put("k1", "e1", "h:1", 1));
    r.apply(put("k2", "e2", "h:2", 2));
    let listed = |entries: Vec<(&str, &str, &str)>| SourceEvent::Listed {
        revision: 10,
        entries: entries
            .into_iter()
            .map(|(k, e, a)| (k.to_string(), Member::new(e, a, 1).to_json().into_bytes()))
            .collect(),
    };
    let a = r.apply(listed(vec![("k1", "e1", "h:1"), ("k3", "e3", "h:2")]));
    assert_eq!(a.len(), 2, "{a:?}");
    assert!(a.contains(&Action::Retire {
        member: Member::new("e2", "h:2", 1),
        why: RetireWhy::Replaced {
            by: EngineId::from("e3")
        }
    }));
    assert!(a.contains(&Action::Announce(Member::new("e3", "h:2", 1))));
    assert_eq!(r.revision(), 10);
    // The same list again: nothing.
    assert!(r
        .apply(listed(vec![("k1", "e1", "h:1"), ("k3", "e3", "h:2")]))
        .is_empty());
}
