//! An in-memory membership plane: a key-value store with revisions and
//! leases on tokio's clock, and the [`MembershipSource`] that watches it.
//! For tests and the demo on the paused clock; it behaves as the etcd
//! source does at the trait: a `Listed` first, then puts and deletions in
//! revision order, an `Outage` while the store is down, a `Listed` when it
//! is back or after a compaction.
//!
//! Leases follow etcd: a key attached to a lease is deleted when the lease
//! is not kept alive for its TTL; a store that is down expires nothing,
//! and when it comes back every lease gets its full TTL again (etcd
//! extends leases when a leader takes over after a restart).
//!
//! Revisions follow etcd as measured (3.4): one write is one revision, and
//! every event of one transaction shares it: [`InMemoryStore::put_all`] (a
//! multi-put transaction), [`InMemoryStore::delete_prefix`], and a lease's
//! expiry or [`InMemoryStore::revoke_lease`] with several keys each send
//! several events of one revision. [`InMemoryStore::wipe`] is an etcd
//! restarted with an empty data directory: revision back to 0, every key
//! and lease gone, a new cluster id; [`InMemoryStore::wipe_keeping_cluster_id`]
//! is one restarted empty with the same flags (its cluster id kept) whose
//! revision other writers took past the old one. Either way the store's
//! epoch (see [`SourceEvent::Listed`]) is a new one: the etcd source keeps
//! it in a key of the store, which the wipe took with the rest.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Member, MembershipSource, SourceEvent};

/// A lease of the in-memory store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseId(pub u64);

struct Lease {
    ttl: Duration,
    deadline: Instant,
}

#[derive(Default)]
struct Inner {
    kv: BTreeMap<String, (Vec<u8>, Option<LeaseId>)>,
    revision: i64,
    cluster_id: u64,
    /// The store's epoch: new with every wipe.
    epoch: u64,
    up: bool,
    watchers: Vec<mpsc::UnboundedSender<SourceEvent>>,
    leases: HashMap<LeaseId, Lease>,
    next_lease: u64,
}

impl Inner {
    fn send(&mut self, event: SourceEvent) {
        if self.up {
            self.watchers.retain(|w| w.send(event.clone()).is_ok());
        }
    }

    fn listing(&self) -> SourceEvent {
        SourceEvent::Listed {
            revision: self.revision,
            cluster_id: self.cluster_id,
            epoch: Some(self.epoch),
            entries: self
                .kv
                .iter()
                .map(|(k, (v, _))| (k.clone(), v.clone()))
                .collect(),
        }
    }

    /// Deletes `keys` in one transaction: one revision, one event each.
    /// The number deleted.
    fn delete_all(&mut self, keys: Vec<String>) -> usize {
        let keys: Vec<String> = keys
            .into_iter()
            .filter(|k| self.kv.remove(k).is_some())
            .collect();
        if keys.is_empty() {
            return 0;
        }
        self.revision += 1;
        let revision = self.revision;
        for key in &keys {
            self.send(SourceEvent::Deleted {
                key: key.clone(),
                revision,
            });
        }
        keys.len()
    }

    /// Revokes `lease`: it and every key attached to it go, in one
    /// revision.
    fn revoke(&mut self, lease: LeaseId) -> usize {
        self.leases.remove(&lease);
        let keys: Vec<String> = self
            .kv
            .iter()
            .filter(|(_, (_, l))| *l == Some(lease))
            .map(|(k, _)| k.clone())
            .collect();
        self.delete_all(keys)
    }
}

/// The store. Cheap to clone; every clone is the same store.
#[derive(Clone, Default)]
pub struct InMemoryStore {
    inner: Arc<Mutex<Inner>>,
}

/// Watches an [`InMemoryStore`]'s keys (all of them: one store, one
/// prefix, [`super::DEFAULT_PREFIX`] unless [`InMemoryStore::watch_prefix`]
/// names another).
pub struct InMemorySource {
    rx: mpsc::UnboundedReceiver<SourceEvent>,
    prefix: String,
}

impl MembershipSource for InMemorySource {
    async fn next(&mut self) -> Option<SourceEvent> {
        // `recv` is cancel safe.
        self.rx.recv().await
    }

    fn prefix(&self) -> &str {
        &self.prefix
    }
}

impl InMemoryStore {
    /// An empty store that is up.
    pub fn new() -> Self {
        let store = InMemoryStore::default();
        let mut inner = store.lock();
        inner.up = true;
        inner.cluster_id = 1;
        inner.epoch = 1;
        drop(inner);
        store
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A watcher: it gets the whole store at once (`Listed`), then every
    /// change. While the store is down it gets the listing when it is back.
    pub fn watch(&self) -> InMemorySource {
        self.watch_prefix(super::DEFAULT_PREFIX)
    }

    /// A watcher (as [`InMemoryStore::watch`]) whose records speak for
    /// their engines under `prefix`.
    pub fn watch_prefix(&self, prefix: &str) -> InMemorySource {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut inner = self.lock();
        if inner.up {
            let _ = tx.send(inner.listing());
        } else {
            let _ = tx.send(SourceEvent::Outage {
                error: "in-memory store down".into(),
            });
        }
        inner.watchers.push(tx);
        InMemorySource {
            rx,
            prefix: prefix.to_string(),
        }
    }

    /// Writes `value` under `key` (no lease). Refused (false) while down.
    pub fn put(&self, key: &str, value: impl Into<Vec<u8>>) -> bool {
        self.put_inner(key, value.into(), None)
    }

    /// Writes `member`'s JSON under `key`, attached to `lease`. Refused
    /// (false) while down or when the lease is gone.
    pub fn put_member(&self, key: &str, member: &Member, lease: Option<LeaseId>) -> bool {
        self.put_inner(key, member.to_json().into_bytes(), lease)
    }

    fn put_inner(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> bool {
        self.put_all(vec![(key.to_string(), value)], lease)
    }

    /// Writes every record in one transaction (one revision, one event
    /// each, in order), all attached to `lease`. Refused (false) while down
    /// or when the lease is gone.
    pub fn put_all(&self, records: Vec<(String, Vec<u8>)>, lease: Option<LeaseId>) -> bool {
        let mut inner = self.lock();
        if !inner.up || lease.is_some_and(|l| !inner.leases.contains_key(&l)) {
            return false;
        }
        inner.revision += 1;
        let revision = inner.revision;
        for (key, value) in records {
            inner.kv.insert(key.clone(), (value.clone(), lease));
            inner.send(SourceEvent::Put {
                key,
                value,
                revision,
            });
        }
        true
    }

    /// Deletes `key`; false when absent or the store is down.
    pub fn delete(&self, key: &str) -> bool {
        let mut inner = self.lock();
        inner.up && inner.delete_all(vec![key.to_string()]) == 1
    }

    /// Deletes every key that starts with `prefix`, in one revision (as
    /// `etcdctl del --prefix`); how many. Nothing while down.
    pub fn delete_prefix(&self, prefix: &str) -> usize {
        let mut inner = self.lock();
        if !inner.up {
            return 0;
        }
        let keys: Vec<String> = inner
            .kv
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect();
        inner.delete_all(keys)
    }

    /// Revokes `lease`: its keys are deleted in one revision; how many.
    /// Nothing while down.
    pub fn revoke_lease(&self, lease: LeaseId) -> usize {
        let mut inner = self.lock();
        if !inner.up {
            return 0;
        }
        inner.revoke(lease)
    }

    /// An etcd restarted with a wiped data directory: every key and lease
    /// gone, the revision back to 0, a new cluster id. Watchers get the
    /// (empty) store as a list when it is up, as the etcd source does when
    /// it reconnects.
    pub fn wipe(&self) {
        let mut inner = self.lock();
        inner.kv.clear();
        inner.leases.clear();
        inner.revision = 0;
        inner.cluster_id += 1;
        inner.epoch += 1;
        let listing = inner.listing();
        inner.send(listing);
    }

    /// An etcd restarted empty with the same flags: every key and lease
    /// gone, the cluster id kept, and the revision at `revision` (other
    /// applications' writes took it there, past what watchers saw).
    /// Only the store's epoch tells the new store from the old one.
    /// Watchers get the store as a list.
    pub fn wipe_keeping_cluster_id(&self, revision: i64) {
        let mut inner = self.lock();
        inner.kv.clear();
        inner.leases.clear();
        inner.revision = revision;
        inner.epoch += 1;
        let listing = inner.listing();
        inner.send(listing);
    }

    /// A new lease of `ttl`, or `None` while down.
    pub fn grant_lease(&self, ttl: Duration) -> Option<LeaseId> {
        let mut inner = self.lock();
        if !inner.up {
            return None;
        }
        inner.next_lease += 1;
        let id = LeaseId(inner.next_lease);
        inner.leases.insert(
            id,
            Lease {
                ttl,
                deadline: Instant::now() + ttl,
            },
        );
        Some(id)
    }

    /// Keeps `lease` alive for another TTL; false when it expired (or the
    /// store is down: the caller retries).
    pub fn keep_alive(&self, lease: LeaseId) -> bool {
        let mut inner = self.lock();
        if !inner.up {
            return false;
        }
        match inner.leases.get_mut(&lease) {
            Some(l) => {
                l.deadline = Instant::now() + l.ttl;
                true
            }
            None => false,
        }
    }

    /// Expires the leases whose TTL has passed, deleting their keys (one
    /// revision per lease, one event per key, as etcd does). Nothing
    /// expires while down.
    pub fn expire_leases(&self) {
        let mut inner = self.lock();
        if !inner.up {
            return;
        }
        let now = Instant::now();
        let expired: Vec<LeaseId> = inner
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            inner.revoke(id);
        }
    }

    /// Expires leases every `tick` until `shutdown` (on tokio's clock).
    pub fn spawn_lease_expiry(
        &self,
        tick: Duration,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let mut t = tokio::time::interval(tick);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = t.tick() => store.expire_leases(),
                }
            }
        })
    }

    /// The store goes down: watchers get an `Outage`, writes are refused,
    /// leases stop counting.
    pub fn outage(&self, error: &str) {
        let mut inner = self.lock();
        if !inner.up {
            return;
        }
        let event = SourceEvent::Outage {
            error: error.to_string(),
        };
        inner.send(event);
        inner.up = false;
    }

    /// The store is back: every lease gets its full TTL again, and
    /// watchers get the whole store (`Listed`).
    pub fn restore(&self) {
        let mut inner = self.lock();
        if inner.up {
            return;
        }
        inner.up = true;
        let now = Instant::now();
        for l in inner.leases.values_mut() {
            l.deadline = now + l.ttl;
        }
        let listing = inner.listing();
        inner.send(listing);
    }

    /// A compaction overtook the watchers: they list again (what the etcd
    /// source does when its watch is cancelled for a compacted revision).
    pub fn compact(&self) {
        let mut inner = self.lock();
        let listing = inner.listing();
        inner.send(listing);
    }

    /// Deletes `key` without telling watchers, as if the deletion fell into
    /// a compacted range they never saw; only a later list shows it.
    pub fn delete_unseen(&self, key: &str) -> bool {
        let mut inner = self.lock();
        if inner.kv.remove(key).is_none() {
            return false;
        }
        inner.revision += 1;
        true
    }

    /// Whether `key` exists.
    pub fn contains(&self, key: &str) -> bool {
        self.lock().kv.contains_key(key)
    }
}
