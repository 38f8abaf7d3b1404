//! The service's reaction to cluster membership, on tokio's paused clock:
//! the in-memory membership plane (`membership::memory`, leases and all)
//! and the fake UCX. Minutes of virtual time in milliseconds.

use std::sync::Arc;
use std::time::Duration;

use nixl_keepalive::fake::{FakeConfig, FakeResources, FakeUcx};
use nixl_keepalive::membership::memory::{InMemoryStore, LeaseId};
use nixl_keepalive::membership::{
    self, Decision, Member, MembershipConfig, MembershipUpdate, Reconciler, RetireWhy, SourceEvent,
};
use nixl_keepalive::{
    Config, EngineId, EngineRef, EngineState, Event, GoneMode, KeepaliveHandle, NixlStatus,
    PeerAddr, ReleaseReason,
};
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

mod common;

use common::addr;

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
    let mut config = FakeConfig::default();
    config.frozen_peers_detected = false;
    config
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
        {
            let mut config = MembershipConfig::default();
            config.gone_mode = mode;
            config.reset_grace = TTL;
            config
        },
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
        let member = self.record(engine, address, ranks as u16);
        assert!(self.store.put_member(&key(engine), &member, Some(lease)));
        lease
    }

    /// The record a prefill writes: its engine id, address, ranks and the
    /// incarnation its handshake reports.
    fn record(&self, engine: &EngineId, address: &PeerAddr, ranks: u16) -> Member {
        let member = Member::new(engine.as_str(), address.as_str(), ranks);
        match self.ucx.fetch_metadata(address) {
            Ok(m) => member.with_incarnation(m.incarnation().0),
            Err(_) => member,
        }
    }

    /// A prefill that starts and registers itself without a lease.
    fn start_prefill(&self, address: &PeerAddr, ranks: usize) -> EngineId {
        let engine = self.ucx.spawn_prefill(address.clone(), ranks);
        self.register_plain(&engine, address);
        engine
    }

    fn register_plain(&self, engine: &EngineId, address: &PeerAddr) {
        let member = self.record(engine, address, 1);
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
async fn a_new_engine_id_at_the_same_address_is_only_announced_and_the_handshake_there_replaces() {
    let mut w = world(GoneMode::Drain);
    let (p1, _) = w.start_leased_prefill(&addr(1), 1);
    let (_, e1) = w.joined().await;
    // Restarted under a fresh id; its old key still waits for its lease.
    let p2 = w.ucx.restart(&addr(1));
    let l2 = w.register(&p2, &addr(1), 1);
    let alive = CancellationToken::new();
    w.keep_alive(l2, alive.clone());
    // The new key is announced; the old engine is not retired by it (a
    // record naming another id at an address is no evidence: a hostile or
    // stale record must not release a healthy engine).
    let (m2, e2) = w.joined().await;
    assert_eq!(m2.engine(), p2);
    // The runtime's handshake at the address found p2: that replaced p1.
    assert_eq!(w.released(&p1).await, ReleaseReason::Replaced);
    assert_eq!(e1.state(), EngineState::Released);
    // The old key's lease then expires: its record is gone, p1 is no
    // longer registered: nothing more is released.
    match tokio::time::timeout(TTL * 3, w.update()).await {
        Ok(MembershipUpdate::Left { member, why }) => {
            assert_eq!(member.engine(), p1);
            assert_eq!(why, RetireWhy::Deleted);
        }
        other => panic!("{other:?}"),
    }
    tokio::time::sleep(TTL * 3).await;
    assert!(w.releases_so_far().is_empty());
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
fn every_event_of_one_revision_is_applied_in_order() {
    // etcd gives every event of one transaction the same revision: a
    // 3-put transaction, then a prefix delete of the three keys.
    let mut r = Reconciler::with_prefix("");
    let mut announced = Vec::new();
    for k in ["e1", "e2", "e3"] {
        announced.extend(r.apply(put(k, k, &format!("h{k}:1"), 5)));
    }
    assert_eq!(announced.len(), 3, "{announced:?}");
    assert_eq!(r.members().len(), 3);
    let mut retired = Vec::new();
    for k in ["e1", "e2", "e3"] {
        retired.extend(r.apply(SourceEvent::Deleted {
            key: k.into(),
            revision: 6,
        }));
    }
    assert_eq!(retired.len(), 3, "{retired:?}");
    assert!(r.members().is_empty());
    assert_eq!(r.revision(), 6, "kept for resuming");
}

#[test]
fn only_the_record_under_its_engines_own_key_speaks_for_it_and_a_copy_elsewhere_retires_nothing() {
    // Issue 30, item 3: a copy of a live prefill's record under another
    // key (same engine id and address, no incarnation). Before, the copy
    // was a member of its own, and its deletion was a departure that
    // matched the registration: the healthy prefill was released.
    let mut r = Reconciler::new();
    let own = format!("{}e1", membership::DEFAULT_PREFIX);
    let copy = format!("{}copy-of-e1", membership::DEFAULT_PREFIX);
    let live = Member::new("e1", "h:1", 1).with_incarnation(7);
    assert_eq!(r.own_key("e1"), own);
    let a = r.apply(SourceEvent::Put {
        key: own.clone(),
        value: live.to_json().into_bytes(),
        revision: 1,
    });
    assert_eq!(a, vec![Decision::Announce(live.clone())]);
    let refused = r.apply(put(&copy, "e1", "h:1", 2));
    assert!(
        matches!(&refused[..], [Decision::BadValue { key, error }]
            if *key == copy && error.reason() == "not_canonical"),
        "{refused:?}"
    );
    assert_eq!(r.members().len(), 1, "the copy is no member");
    assert!(
        r.apply(SourceEvent::Deleted {
            key: copy.clone(),
            revision: 3
        })
        .is_empty(),
        "its deletion retires nothing"
    );
    // Whatever it names: another engine id under a key of another, a
    // record under a key outside the prefix, and in a list too.
    for (k, e) in [(own.as_str(), "e2"), ("/elsewhere/e1", "e1")] {
        let a = r.apply(put(k, e, "h:1", 4));
        assert!(
            matches!(&a[..], [Decision::BadValue { error, .. }] if error.reason() == "not_canonical"),
            "{a:?}"
        );
    }
    assert_eq!(r.members().get(&own), Some(&live), "the key is unchanged");
    let a = r.apply(SourceEvent::Listed {
        revision: 9,
        cluster_id: 1,
        epoch: Some(1),
        entries: vec![
            (own.clone(), live.to_json().into_bytes()),
            (
                copy.clone(),
                Member::new("e1", "h:1", 1).to_json().into_bytes(),
            ),
        ],
    });
    assert!(
        matches!(&a[..], [Decision::BadValue { key, .. }] if *key == copy),
        "{a:?}"
    );
    // Its own record's deletion still retires it.
    let a = r.apply(SourceEvent::Deleted {
        key: own,
        revision: 10,
    });
    assert_eq!(
        a,
        vec![Decision::Retire {
            member: live,
            why: RetireWhy::Deleted
        }]
    );
}

#[test]
fn a_list_announces_only_what_is_new_and_retires_only_what_is_missing() {
    let mut r = Reconciler::with_prefix("");
    r.apply(put("e1", "e1", "h:1", 1));
    r.apply(put("e2", "e2", "h:2", 2));
    let listed = |entries: Vec<(&str, &str, &str)>| SourceEvent::Listed {
        revision: 10,
        cluster_id: 1,
        epoch: Some(1),
        entries: entries
            .into_iter()
            .map(|(k, e, a)| (k.to_string(), Member::new(e, a, 1).to_json().into_bytes()))
            .collect(),
    };
    let a = r.apply(listed(vec![("e1", "e1", "h:1"), ("e3", "e3", "h:2")]));
    // k2 is gone from the list: its record is retired (the service judges
    // it against e2's registration); k3 is new: announced. A new engine id
    // at e2's address is not itself a retirement: only a handshake there
    // replaces an engine.
    assert_eq!(
        a,
        vec![
            Decision::Retire {
                member: Member::new("e2", "h:2", 1),
                why: RetireWhy::MissingFromList,
            },
            Decision::Announce(Member::new("e3", "h:2", 1)),
        ]
    );
    assert_eq!(r.revision(), 10);
    // The same list again: nothing.
    assert!(r
        .apply(listed(vec![("e1", "e1", "h:1"), ("e3", "e3", "h:2")]))
        .is_empty());
}

// etcd as it really behaves (measured on etcd 3.4): one revision for every
// event of a transaction, leases that never come back, a store that loses
// its data, and records written by anyone.

impl World {
    /// `n` prefills with plain keys, announced and connected.
    async fn connected_prefills(&mut self, n: u16) -> Vec<(EngineId, EngineRef)> {
        let engines: Vec<EngineId> = (1..=n).map(|i| self.start_prefill(&addr(i), 1)).collect();
        let mut connected = Vec::new();
        for _ in 0..n {
            let (m, e) = self.joined().await;
            connected.push((m.engine(), e));
        }
        connected.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        let mut sorted = engines;
        sorted.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        assert_eq!(
            connected.iter().map(|(e, _)| e.clone()).collect::<Vec<_>>(),
            sorted
        );
        connected
    }

    /// Three leased prefills kept registered, announced and connected;
    /// then the third freezes (UCX reports nothing) and stops renewing:
    /// it cannot register again after a store reset.
    async fn three_kept_prefills_the_third_frozen(
        &mut self,
    ) -> (
        Vec<EngineId>,
        Vec<CancellationToken>,
        Vec<(Member, EngineRef)>,
    ) {
        let mut prefills = Vec::new();
        let mut keepers = Vec::new();
        for i in 1..=3 {
            let (p, lease) = self.start_leased_prefill(&addr(i), 1);
            let stop = CancellationToken::new();
            self.keep_registered(&p, &addr(i), lease, stop.clone());
            keepers.push(stop);
            prefills.push(p);
        }
        let mut engines = Vec::new();
        for _ in 0..3 {
            engines.push(self.joined().await);
        }
        self.ucx.freeze(&prefills[2]);
        keepers[2].cancel();
        (prefills, keepers, engines)
    }

    /// After a store reset at `since`: the frozen third prefill, and only
    /// it, is retired once the grace period has run and released; the
    /// others stay live.
    async fn only_the_frozen_one_leaves_after_the_grace(
        &mut self,
        prefills: &[EngineId],
        engines: &[(Member, EngineRef)],
        since: tokio::time::Instant,
    ) {
        let left = self.left(1).await;
        assert_eq!(
            left,
            vec![(prefills[2].clone(), RetireWhy::MissingAfterReset)]
        );
        assert!(since.elapsed() >= TTL);
        assert_eq!(self.released(&prefills[2]).await, ReleaseReason::PeerGone);
        tokio::time::sleep(TTL * 3).await;
        assert!(self.releases_so_far().is_empty());
        for (m, e) in engines {
            let want = if m.engine() == prefills[2] {
                EngineState::Released
            } else {
                EngineState::Live
            };
            assert_eq!(e.state(), want, "{}", m.engine_id);
        }
    }

    /// The `Left` updates among the next `n` updates that are not
    /// `Released`.
    async fn left(&mut self, n: usize) -> Vec<(EngineId, RetireWhy)> {
        let mut out = Vec::new();
        while out.len() < n {
            match self.update().await {
                MembershipUpdate::Left { member, why } => out.push((member.engine(), why)),
                MembershipUpdate::Released { .. } => {}
                other => panic!("expected Left, got {other:?}"),
            }
        }
        out.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        out
    }

    /// Engines released from now until `within` has passed, sorted.
    async fn released_within(&mut self, within: Duration) -> Vec<EngineId> {
        tokio::time::sleep(within).await;
        let mut out = self.releases_so_far();
        out.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        out
    }

    /// What a prefill's `EtcdRegistration` does, on the in-memory store:
    /// keeps its lease alive every TTL/3 and, when the lease is gone,
    /// grants a new one and writes its key again. Until `stop`.
    fn keep_registered(
        &self,
        engine: &EngineId,
        address: &PeerAddr,
        mut lease: LeaseId,
        stop: CancellationToken,
    ) -> JoinHandle<()> {
        let store = self.store.clone();
        let member = self.record(engine, address, 1);
        let key = key(engine);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(TTL / 3) => {}
                }
                if !store.keep_alive(lease) {
                    if let Some(new) = store.grant_lease(TTL) {
                        assert!(store.put_member(&key, &member, Some(new)));
                        lease = new;
                    }
                }
            }
        })
    }
}

fn members_json(engines: &[(EngineId, PeerAddr)]) -> Vec<(String, Vec<u8>)> {
    engines
        .iter()
        .map(|(e, a)| {
            (
                key(e),
                Member::new(e.as_str(), a.as_str(), 1)
                    .to_json()
                    .into_bytes(),
            )
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_prefix_delete_of_several_keys_in_one_revision_retires_every_engine() {
    let mut w = world(GoneMode::Drain);
    let engines = w.connected_prefills(4).await;
    assert_eq!(w.store.delete_prefix(membership::DEFAULT_PREFIX), 4);
    let left = w.left(4).await;
    let want: Vec<(EngineId, RetireWhy)> = engines
        .iter()
        .map(|(e, _)| (e.clone(), RetireWhy::Deleted))
        .collect();
    assert_eq!(left, want, "each key of the one revision");
    let released = w.released_within(Duration::from_secs(1)).await;
    assert_eq!(
        released,
        engines.iter().map(|(e, _)| e.clone()).collect::<Vec<_>>()
    );
    for (_, e) in &engines {
        assert_eq!(e.state(), EngineState::Released);
    }
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_multi_put_transaction_announces_every_engine() {
    let mut w = world(GoneMode::Drain);
    let engines: Vec<(EngineId, PeerAddr)> = (1..=5)
        .map(|i| (w.ucx.spawn_prefill(addr(i), 1), addr(i)))
        .collect();
    assert!(w.store.put_all(members_json(&engines), None));
    let mut joined = Vec::new();
    for _ in 0..5 {
        let (m, e) = w.joined().await;
        assert_eq!(e.state(), EngineState::Live);
        joined.push(m.engine());
    }
    joined.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    let mut want: Vec<EngineId> = engines.iter().map(|(e, _)| e.clone()).collect();
    want.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    assert_eq!(joined, want);
    assert!(w.releases_so_far().is_empty());
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_revoked_lease_holding_several_keys_retires_every_engine_on_it_and_no_other() {
    let mut w = world(GoneMode::Drain);
    let shared: Vec<(EngineId, PeerAddr)> = (1..=3)
        .map(|i| (w.ucx.spawn_prefill(addr(i), 1), addr(i)))
        .collect();
    let lease = w.store.grant_lease(TTL).unwrap();
    assert!(w.store.put_all(members_json(&shared), Some(lease)));
    let other = w.start_prefill(&addr(9), 1);
    let mut engines = Vec::new();
    for _ in 0..4 {
        engines.push(w.joined().await);
    }
    assert_eq!(w.store.revoke_lease(lease), 3);
    let left = w.left(3).await;
    let mut want: Vec<(EngineId, RetireWhy)> = shared
        .iter()
        .map(|(e, _)| (e.clone(), RetireWhy::Deleted))
        .collect();
    want.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    assert_eq!(left, want);
    let released = w.released_within(Duration::from_secs(1)).await;
    assert_eq!(
        released,
        want.iter().map(|(e, _)| e.clone()).collect::<Vec<_>>()
    );
    let (_, e_other) = engines.iter().find(|(m, _)| m.engine() == other).unwrap();
    assert_eq!(e_other.state(), EngineState::Live);
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_wiped_store_retires_nothing_during_the_grace_period_and_then_only_what_did_not_register_again(
) {
    let mut w = world(GoneMode::Fail);
    let (prefills, keepers, engines) = w.three_kept_prefills_the_third_frozen().await;

    // etcd restarted with an empty data directory.
    w.store.outage("etcd: connection refused");
    assert!(matches!(w.update().await, MembershipUpdate::Outage { .. }));
    tokio::time::sleep(Duration::from_secs(5)).await;
    w.store.wipe();
    w.store.restore();
    let restored_at = tokio::time::Instant::now();
    assert!(matches!(
        w.update().await,
        MembershipUpdate::Restored { .. }
    ));
    match w.update().await {
        MembershipUpdate::StoreReset { awaited, grace } => {
            assert_eq!((awaited, grace), (3, TTL));
        }
        other => panic!("{other:?}"),
    }
    // Just before the grace period ends: nothing retired; p1 and p2 wrote
    // their keys again (the same records: nothing announced again).
    tokio::time::sleep(TTL - Duration::from_millis(10)).await;
    assert!(w.releases_so_far().is_empty(), "nothing during the grace");
    assert!(
        w.updates.try_recv().is_err(),
        "no Left, no Joined during the grace"
    );
    assert!(w.store.contains(&key(&prefills[0])) && w.store.contains(&key(&prefills[1])));
    // Then only p3, which never came back.
    w.only_the_frozen_one_leaves_after_the_grace(&prefills, &engines, restored_at)
        .await;
    for k in keepers {
        k.cancel();
    }
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_store_wiped_with_its_cluster_id_kept_and_its_revision_passed_releases_no_healthy_prefill(
) {
    // Issue 30, item 1: an etcd restarted empty with the same flags keeps
    // its cluster id, and other applications' keys took its revision past
    // the last one the decoder saw. Before, that list was taken as the
    // truth: every prefill retired (`missing_from_list`) and released.
    let mut w = world(GoneMode::Fail);
    let (prefills, keepers, engines) = w.three_kept_prefills_the_third_frozen().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    w.store.wipe_keeping_cluster_id(10_000);
    match w.update().await {
        MembershipUpdate::StoreReset { awaited, grace } => {
            assert_eq!((awaited, grace), (3, TTL));
        }
        other => panic!("a store reset, not {other:?}"),
    }
    let reset_at = tokio::time::Instant::now();
    tokio::time::sleep(TTL - Duration::from_millis(10)).await;
    assert!(w.releases_so_far().is_empty(), "nothing during the grace");
    assert!(w.store.contains(&key(&prefills[0])) && w.store.contains(&key(&prefills[1])));
    w.only_the_frozen_one_leaves_after_the_grace(&prefills, &engines, reset_at)
        .await;
    for k in keepers {
        k.cancel();
    }
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_copy_of_a_live_prefills_record_under_another_key_is_refused_and_its_deletion_releases_nothing(
) {
    // Issue 30, item 3, through the service: before, the copy's deletion
    // matched the registration (same engine id and address, no
    // incarnation) and released the healthy prefill.
    let mut w = world(GoneMode::Drain);
    let (p, _lease) = w.start_leased_prefill(&addr(1), 1);
    let (_, healthy) = w.joined().await;
    let copy_key = format!("{}copy", membership::DEFAULT_PREFIX);
    let copy = Member::new(p.as_str(), addr(1).as_str(), 1);
    for _ in 0..3 {
        // Flapped: written and deleted again and again.
        assert!(w.store.put_member(&copy_key, &copy, None));
        assert!(w.store.delete(&copy_key));
    }
    match w.update().await {
        MembershipUpdate::BadValue { key, error, .. } => {
            assert_eq!(key, copy_key);
            assert_eq!(error.reason(), "not_canonical", "{error}");
        }
        other => panic!("{other:?}"),
    }
    tokio::time::sleep(TTL).await;
    assert!(
        w.updates.try_recv().is_err(),
        "reported once, however often it flapped"
    );
    assert!(w.releases_so_far().is_empty());
    assert_eq!(healthy.state(), EngineState::Live);
    assert!(conflicts_in(&mut w.events).is_empty(), "never judged");
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn an_outage_during_the_grace_period_starts_it_again_when_the_store_is_back() {
    let mut w = world(GoneMode::Drain);
    let p = w.start_prefill(&addr(1), 1);
    let (_, engine) = w.joined().await;
    w.store.outage("down");
    assert!(matches!(w.update().await, MembershipUpdate::Outage { .. }));
    w.store.wipe();
    w.store.restore();
    assert!(matches!(
        w.update().await,
        MembershipUpdate::Restored { .. }
    ));
    assert!(matches!(
        w.update().await,
        MembershipUpdate::StoreReset { awaited: 1, .. }
    ));
    tokio::time::sleep(TTL / 2).await;
    // Down again for many grace periods: nobody can register, nothing is
    // retired.
    w.store.outage("down again");
    tokio::time::sleep(TTL * 10).await;
    assert!(w.releases_so_far().is_empty());
    w.store.restore();
    let back = tokio::time::Instant::now();
    assert!(matches!(w.update().await, MembershipUpdate::Outage { .. }));
    assert!(matches!(
        w.update().await,
        MembershipUpdate::Restored { .. }
    ));
    let left = w.left(1).await;
    assert_eq!(left, vec![(p.clone(), RetireWhy::MissingAfterReset)]);
    assert_eq!(back.elapsed(), TTL, "a whole grace period after the list");
    assert_eq!(w.released(&p).await, ReleaseReason::PeerGone);
    assert_eq!(engine.state(), EngineState::Released);
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn hostile_records_are_refused_by_reason_printed_escaped_and_reported_at_a_bounded_rate() {
    let mut w = world(GoneMode::Drain);
    let p = w.start_prefill(&addr(1), 1);
    let (_, engine) = w.joined().await;
    let record = |id: &str, address: &str| {
        serde_json::json!({"engine_id": id, "address": address, "ranks": 1})
            .to_string()
            .into_bytes()
    };
    let cases: Vec<(String, Vec<u8>, &str)> = vec![
        (key(&p), record("e\0vil", "10.0.0.9:1"), "engine_id"),
        (key(&p), record("e\u{1b}[2Jvil", "10.0.0.9:1"), "engine_id"),
        (
            key(&p),
            record("e\nmembership: left engine=x", "10.0.0.9:1"),
            "engine_id",
        ),
        (key(&p), record(&"e".repeat(300), "10.0.0.9:1"), "engine_id"),
        (
            key(&p),
            record("e", &format!("{}:1", "h".repeat(1 << 20))),
            "too_large",
        ),
        (key(&p), record("e", &"h".repeat(300)), "address"),
        (key(&p), record("e", "host name:1"), "address"),
        (key(&p), record("e", "h\n:1"), "address"),
        (key(&p), record("e", "h:0"), "address"),
        (key(&p), record("e", "[::1:5"), "address"),
        (
            key(&p),
            b"{\"engine_id\": \"\\u001b]0;pwn\\u0007\"".to_vec(),
            "json",
        ),
        (
            format!("/k/{}", "x".repeat(2000)),
            record("e", "h:1"),
            "key",
        ),
    ];
    for (k, v, reason) in &cases {
        assert!(w.store.put(k, v.clone()));
        match w.update().await {
            MembershipUpdate::BadValue {
                key,
                error,
                unreported,
            } => {
                assert_eq!(&key, k);
                assert_eq!(error.reason(), *reason, "{error}");
                assert_eq!(unreported, 0);
                let shown = error.to_string();
                assert!(
                    !shown.chars().any(char::is_control),
                    "printed with a control character: {shown:?}"
                );
                assert!(shown.len() < 600, "{} bytes: {shown}", shown.len());
            }
            other => panic!("{other:?}"),
        }
        tokio::time::sleep(membership::REFUSALS_PERIOD).await;
    }
    // The key still means p: nothing refused changed it.
    assert_eq!(engine.state(), EngineState::Live);

    // A flood: 2,000 broken records at once are each counted, and reported
    // a burst's worth at once, then one per period with the count.
    let flood = 2000u64;
    for i in 0..flood {
        assert!(w.store.put(&format!("/junk/{i}"), b"\x1b[31m".to_vec()));
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
    let mut reported = 0u64;
    while let Ok(u) = w.updates.try_recv() {
        assert!(
            matches!(u, MembershipUpdate::BadValue { unreported: 0, .. }),
            "{u:?}"
        );
        reported += 1;
    }
    assert_eq!(reported, u64::from(membership::REFUSALS_BURST));
    tokio::time::sleep(membership::REFUSALS_PERIOD).await;
    assert!(w.store.put("/junk/last", b"!".to_vec()));
    match w.update().await {
        MembershipUpdate::BadValue { unreported, .. } => assert_eq!(unreported, flood - reported),
        other => panic!("{other:?}"),
    }
    assert!(w.releases_so_far().is_empty());
    assert_eq!(engine.state(), EngineState::Live);
    w.stop().await.assert_nothing_leaked();
}

// The store-reset rules on their own.

fn listed(revision: i64, cluster_id: u64, entries: &[(&str, &str, &str)]) -> SourceEvent {
    SourceEvent::Listed {
        revision,
        cluster_id,
        epoch: Some(1),
        entries: entries
            .iter()
            .map(|(k, e, a)| (k.to_string(), Member::new(*e, *a, 1).to_json().into_bytes()))
            .collect(),
    }
}

#[test]
fn a_list_from_another_cluster_sets_aside_what_it_lacks_until_the_grace_period_ends() {
    let mut r = Reconciler::with_prefix("");
    r.apply(listed(40, 1, &[("e1", "e1", "h:1"), ("e2", "e2", "h:2")]));
    // A restored snapshot: a higher revision, but another cluster id.
    let a = r.apply(listed(90, 2, &[("e1", "e1", "h:1"), ("e3", "e3", "h:3")]));
    assert_eq!(
        a,
        vec![
            Decision::StoreReset { awaited: 1 },
            Decision::Announce(Member::new("e3", "h:3", 1))
        ]
    );
    assert_eq!(r.awaited().len(), 1);
    assert_eq!(
        r.end_reset_grace(),
        vec![Decision::Retire {
            member: Member::new("e2", "h:2", 1),
            why: RetireWhy::MissingAfterReset
        }]
    );
    assert!(r.awaited().is_empty());
    assert!(r.end_reset_grace().is_empty(), "once");
}

#[test]
fn a_revision_that_went_back_is_a_store_reset_and_a_key_written_again_is_no_longer_awaited() {
    let mut r = Reconciler::with_prefix("");
    r.apply(listed(40, 1, &[("e1", "e1", "h:1"), ("e2", "e2", "h:2")]));
    r.apply(put("e3", "e3", "h:3", 41));
    let a = r.apply(listed(1, 1, &[]));
    assert_eq!(
        a,
        vec![Decision::StoreReset { awaited: 3 }],
        "nothing retired"
    );
    assert_eq!(r.revision(), 1, "resumes from the new store's revision");
    // k1 registers again with the same record: nothing to do; k2 comes
    // back at another address: its old record is gone (the service
    // retires e2's registration only if it is the one at h:2), the new one
    // announced.
    assert!(r.apply(put("e1", "e1", "h:1", 2)).is_empty());
    assert_eq!(
        r.apply(put("e2", "e2", "h:9", 3)),
        vec![
            Decision::Retire {
                member: Member::new("e2", "h:2", 1),
                why: RetireWhy::Replaced {
                    by: EngineId::from("e2")
                },
            },
            Decision::Announce(Member::new("e2", "h:9", 1))
        ]
    );
    assert_eq!(
        r.end_reset_grace(),
        vec![Decision::Retire {
            member: Member::new("e3", "h:3", 1),
            why: RetireWhy::MissingAfterReset
        }]
    );
    assert_eq!(r.members().len(), 2);
}

#[test]
fn a_list_of_another_store_epoch_is_a_reset_whatever_its_cluster_id_and_revision_say() {
    let mut r = Reconciler::with_prefix("");
    let with_epoch = |revision, epoch: Option<u64>, entries: &[(&str, &str, &str)]| {
        let SourceEvent::Listed {
            cluster_id,
            entries,
            ..
        } = listed(revision, 1, entries)
        else {
            unreachable!()
        };
        SourceEvent::Listed {
            revision,
            cluster_id,
            epoch,
            entries,
        }
    };
    r.apply(with_epoch(
        40,
        Some(1),
        &[("e1", "e1", "h:1"), ("e2", "e2", "h:2")],
    ));
    // Wiped, restarted with the same flags (same cluster id), revision
    // past 40: before, e2 was retired at once (`missing_from_list`).
    assert_eq!(
        r.apply(with_epoch(500, Some(2), &[("e1", "e1", "h:1")])),
        vec![Decision::StoreReset { awaited: 1 }]
    );
    // An epoch that vanished (the store lost it and none could be written
    // again) is as good as another one.
    assert_eq!(
        r.apply(with_epoch(600, None, &[("e1", "e1", "h:1")])),
        vec![Decision::StoreReset { awaited: 1 }]
    );
    assert_eq!(
        r.end_reset_grace(),
        vec![Decision::Retire {
            member: Member::new("e2", "h:2", 1),
            why: RetireWhy::MissingAfterReset
        }]
    );
    // The same epoch again: the same store, a deletion is a deletion.
    assert_eq!(
        r.apply(with_epoch(700, None, &[])),
        vec![Decision::Retire {
            member: Member::new("e1", "h:1", 1),
            why: RetireWhy::MissingFromList
        }]
    );
}

#[test]
fn a_refused_record_at_an_awaited_key_does_not_keep_its_engine_past_the_grace() {
    let mut r = Reconciler::with_prefix("");
    r.apply(listed(40, 1, &[("e1", "e1", "h:1")]));
    assert_eq!(
        r.apply(listed(1, 1, &[])),
        vec![Decision::StoreReset { awaited: 1 }]
    );
    // Another engine's record at e1's own key: refused, e1 still awaited.
    let a = r.apply(put("e1", "e2", "h:2", 2));
    assert!(
        matches!(&a[..], [Decision::BadValue { error, .. }] if error.reason() == "not_canonical"),
        "{a:?}"
    );
    assert_eq!(r.awaited().len(), 1);
    assert_eq!(
        r.end_reset_grace(),
        vec![Decision::Retire {
            member: Member::new("e1", "h:1", 1),
            why: RetireWhy::MissingAfterReset
        }]
    );
}

#[test]
fn a_first_list_and_a_later_one_of_the_same_store_are_no_reset() {
    let mut r = Reconciler::with_prefix("");
    assert!(!r
        .apply(listed(7, 3, &[("e1", "e1", "h:1")]))
        .contains(&Decision::StoreReset { awaited: 0 }));
    let a = r.apply(listed(9, 3, &[]));
    assert_eq!(
        a,
        vec![Decision::Retire {
            member: Member::new("e1", "h:1", 1),
            why: RetireWhy::MissingFromList
        }]
    );
}

#[test]
fn a_second_reset_during_the_grace_keeps_awaiting_and_a_record_under_another_key_keeps_nothing() {
    let mut r = Reconciler::with_prefix("");
    r.apply(listed(
        40,
        1,
        &[
            ("e1", "e1", "h:1"),
            ("e2", "e2", "h:2"),
            ("e3", "e3", "h:3"),
        ],
    ));
    assert_eq!(
        r.apply(listed(2, 2, &[("e1", "e1", "h:1")])),
        vec![Decision::StoreReset { awaited: 2 }]
    );
    // Wiped again before the grace ended: k1 had come back, now it is
    // awaited too; a record of e3 shows up under another key: refused (it
    // does not speak for e3), so e3 stays awaited.
    let a = r.apply(listed(1, 3, &[("e9", "e3", "h:3")]));
    assert!(
        matches!(&a[..], [Decision::StoreReset { awaited: 3 }, Decision::BadValue { error, .. }]
            if error.reason() == "not_canonical"),
        "{a:?}"
    );
    let mut retired: Vec<String> = r
        .end_reset_grace()
        .into_iter()
        .map(|a| match a {
            Decision::Retire {
                member,
                why: RetireWhy::MissingAfterReset,
            } => member.engine_id,
            other => panic!("{other:?}"),
        })
        .collect();
    retired.sort();
    assert_eq!(
        retired,
        vec!["e1", "e2", "e3"],
        "a record of e3 under another key does not keep it"
    );
}

#[test]
fn record_bounds_are_exact() {
    let record = |id: &str, address: &str, ranks: u32| {
        serde_json::json!({"engine_id": id, "address": address, "ranks": ranks})
            .to_string()
            .into_bytes()
    };
    let reason =
        |key: &str, value: &[u8]| Member::from_record(key, value).err().map(|e| e.reason());
    let ok = record("e", "h:1", 1);
    assert_eq!(reason("k", &ok), None);
    // Key: at most MAX_KEY bytes.
    assert_eq!(reason(&"k".repeat(membership::MAX_KEY), &ok), None);
    assert_eq!(
        reason(&"k".repeat(membership::MAX_KEY + 1), &ok),
        Some("key")
    );
    // Value: at most MAX_RECORD bytes (padding in an unknown field).
    let padded = |len: usize| {
        let base = record("e", "h:1", 1);
        let pad = len - base.len() - r#","pad":"""#.len();
        let mut v: serde_json::Value = serde_json::from_slice(&base).unwrap();
        v["pad"] = serde_json::Value::String("p".repeat(pad));
        let out = v.to_string().into_bytes();
        assert_eq!(out.len(), len);
        out
    };
    assert_eq!(reason("k", &padded(membership::MAX_RECORD)), None);
    assert_eq!(
        reason("k", &padded(membership::MAX_RECORD + 1)),
        Some("too_large")
    );
    // Engine id: 1 to MAX_ENGINE_ID bytes, printable (not ASCII-only).
    assert_eq!(reason("k", &record(&"e".repeat(256), "h:1", 1)), None);
    assert_eq!(
        reason("k", &record(&"e".repeat(257), "h:1", 1)),
        Some("engine_id")
    );
    assert_eq!(reason("k", &record("", "h:1", 1)), Some("engine_id"));
    assert_eq!(reason("k", &record("préfill-1", "h:1", 1)), None);
    assert_eq!(reason("k", &record("e\u{7f}", "h:1", 1)), Some("engine_id"));
    // Address: at most MAX_ADDRESS bytes, host:port, port 1 to 65535.
    let host = |len: usize| format!("{}:1", "h".repeat(len - 2));
    assert_eq!(
        reason("k", &record("e", &host(membership::MAX_ADDRESS), 1)),
        None
    );
    assert_eq!(
        reason("k", &record("e", &host(membership::MAX_ADDRESS + 1), 1)),
        Some("address")
    );
    for good in ["h:65535", "10.0.0.1:1", "[::1]:5600", "a-b.c_d:80"] {
        assert_eq!(reason("k", &record("e", good, 1)), None, "{good}");
    }
    for bad in [
        "h:0", "h:65536", "h:", ":1", "h", "h:+1", "h :1", "[::1:1", "[zz]:1", "h/x:1",
    ] {
        assert_eq!(reason("k", &record("e", bad, 1)), Some("address"), "{bad}");
    }
    // Ranks: 1 to MAX_RANKS.
    assert_eq!(reason("k", &record("e", "h:1", 64)), None);
    assert_eq!(reason("k", &record("e", "h:1", 65)), Some("ranks"));
    assert_eq!(reason("k", &record("e", "h:1", 0)), Some("ranks"));
    assert_eq!(reason("k", &record("e", "h:1", 70000)), Some("json"));
}

// ----- conflicting records never release a healthy engine (issue 14) -----

fn conflicts_in(events: &mut broadcast::Receiver<Event>) -> Vec<&'static str> {
    let mut out = Vec::new();
    while let Ok(e) = events.try_recv() {
        if let Event::Conflict { conflict, .. } = e {
            out.push(conflict.kind());
        }
    }
    out
}

#[tokio::test(start_paused = true)]
async fn a_record_naming_a_new_engine_id_at_a_healthy_prefills_address_releases_nothing() {
    let mut w = world(GoneMode::Drain);
    let (p, _lease) = w.start_leased_prefill(&addr(1), 1);
    let (_, healthy) = w.joined().await;
    let forged = Member::new("forged", addr(1).as_str(), 1);
    assert!(w
        .store
        .put_member("/nixl-keepalive/prefill/forged", &forged, None));
    // Announced; the runtime handshakes there and finds the healthy engine.
    let (m, found) = w.joined().await;
    assert_eq!(m.engine_id, "forged");
    assert!(
        found.same_registration(&healthy),
        "the engine there is the one registered"
    );
    // The forged record goes away: it was never the registration's.
    assert!(w.store.delete("/nixl-keepalive/prefill/forged"));
    tokio::time::sleep(TTL).await;
    assert!(w.releases_so_far().is_empty());
    assert_eq!(healthy.state(), EngineState::Live);
    let _ = p;
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_record_of_a_healthy_engine_id_at_another_address_neither_retires_nor_shields_it() {
    let mut w = world(GoneMode::Drain);
    let (p, _lease) = w.start_leased_prefill(&addr(1), 1);
    let (_, healthy) = w.joined().await;
    // Another key names p at another address: not p's own key, so it is
    // refused (never announced, never a member).
    let hostile_key = "/nixl-keepalive/prefill/hostile";
    assert!(w.store.put_member(
        hostile_key,
        &Member::new(p.as_str(), addr(9).as_str(), 1),
        None
    ));
    assert!(matches!(
        w.update().await,
        MembershipUpdate::BadValue { error, .. } if error.reason() == "not_canonical"
    ));
    let _ = w.releases_so_far();
    assert!(w.store.delete(hostile_key));
    tokio::time::sleep(TTL).await;
    assert_eq!(
        healthy.state(),
        EngineState::Live,
        "its record's removal retires nothing"
    );
    assert!(conflicts_in(&mut w.events).is_empty());
    // Its own record's removal still retires it: not shielded.
    assert!(w.store.delete(&key(&p)));
    assert_eq!(w.released(&p).await, ReleaseReason::PeerGone);
    w.stop().await.assert_nothing_leaked();
}

#[tokio::test(start_paused = true)]
async fn a_dead_predecessors_record_expiring_late_never_retires_its_successor() {
    let mut w = world(GoneMode::Drain);
    let pinned = EngineId::from("pinned");
    w.ucx.spawn_prefill_with_id(addr(1), pinned.clone(), 1);
    let old = w.record(&pinned, &addr(1), 1);
    // The predecessor's record under its own key; the successor (a new
    // incarnation, the same pinned id) registers.
    assert!(w.store.put_member(&key(&pinned), &old, None));
    let _ = w.joined().await;
    w.ucx.restart_with_same_id(&addr(1));
    let successor = w.connect(&addr(1)).await;
    assert_eq!(successor.state(), EngineState::Live);
    let _ = w.releases_so_far();
    let _ = conflicts_in(&mut w.events);
    // The predecessor's record finally goes (replaced by the successor's
    // own): judged against the successor's registration, a conflict.
    w.register_plain(&pinned, &addr(1));
    tokio::time::sleep(TTL).await;
    assert_eq!(successor.state(), EngineState::Live);
    assert_eq!(conflicts_in(&mut w.events), vec!["record_incarnation"]);
    // A stale copy under another key is refused and goes unnoticed.
    let stale_key = "/nixl-keepalive/prefill/old-pinned";
    assert!(w.store.put_member(stale_key, &old, None));
    assert!(w.store.delete(stale_key));
    tokio::time::sleep(TTL).await;
    assert_eq!(successor.state(), EngineState::Live);
    assert!(conflicts_in(&mut w.events).is_empty());
    assert!(w.releases_so_far().is_empty());
    w.stop().await.assert_nothing_leaked();
}
