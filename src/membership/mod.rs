//! Cluster membership: which prefill engines exist, as a membership plane
//! (etcd) says, turned into the service's inputs.
//!
//! A prefill engine registers itself under a key of a prefix, attached to a
//! lease it keeps alive (NVIDIA Dynamo does the same for its workers). The
//! decoder watches the prefix:
//!
//! - a key that appears: the engine is announced
//!   ([`MembershipUpdate::Joined`]); the runtime handshakes with it (the
//!   handshake stays the runtime's: this module never loads metadata);
//! - a key deleted, or its lease expired (etcd deletes the key): the engine
//!   is retired with [`KeepaliveHandle::peer_gone`] in the configured
//!   [`GoneMode`] (drain by default), and the time from seeing the
//!   deletion to the release lands in a histogram;
//! - a key whose value names a new engine id at the same address (or a new
//!   key at an address another engine held): the old engine is retired, it
//!   was replaced;
//! - after a compaction, an outage or a reconnection, the prefix is listed
//!   again and reconciled: engines missing from the list are retired, new
//!   ones announced, so no removal is lost;
//! - **the membership plane being unreachable or slow is never a removal**:
//!   every engine is kept (its heartbeats go on: they are the service's,
//!   not this module's), the outage is reported (an update, the
//!   `nixl_keepalive_membership_watch_up` gauge, warnings that back off
//!   with the retries), and the prefix is reconciled when the watch is back.
//!
//! # Key schema
//!
//! One key per engine: `<prefix><engine id>` (default prefix
//! [`DEFAULT_PREFIX`], `/nixl-keepalive/prefill/`), attached to the
//! engine's lease, whose value is a JSON object ([`Member`]):
//!
//! ```json
//! {"engine_id": "8c1e...-uuid", "address": "10.0.0.7:17001", "ranks": 2}
//! ```
//!
//! - `engine_id`: the engine id its handshake reports, 1 to 256 bytes;
//! - `address`: its side-channel address, `host:port`;
//! - `ranks`: its ranks (NIXL agents), 1 to 64.
//!
//! Unknown fields are ignored (room to grow). A value that breaks these
//! rules is counted (`nixl_keepalive_membership_bad_values_total`) and
//! logged, and the key is treated as unchanged: never a panic, never a
//! removal.
//!
//! # Parts
//!
//! - [`MembershipSource`]: where changes come from; [`memory`] (in-memory,
//!   for tests on tokio's paused clock) and, with the `etcd` feature,
//!   `etcd` (a watch on etcd with the `etcd-client` crate, and the prefill
//!   side's lease-backed registration).
//! - [`Reconciler`]: a synchronous state machine from source events to
//!   [`Action`]s; no clock, no I/O.
//! - [`spawn`]: the driver; it applies the actions to a
//!   [`KeepaliveHandle`] and tells the runtime through
//!   [`MembershipUpdate`]s.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{EngineId, Event, GoneMode, KeepaliveHandle, PeerAddr, PeerRef, ReleaseReason};

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod memory;

/// The key prefix prefills register under unless told otherwise.
pub const DEFAULT_PREFIX: &str = "/nixl-keepalive/prefill/";

/// Longest engine id a value may carry (bytes), and most ranks: the
/// library's bounds, the same for every source.
pub use crate::text::{MAX_ENGINE_ID, MAX_RANKS};

/// One prefill engine as the membership plane knows it: the JSON value of
/// its key (see the module docs for the schema).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The engine id its handshake reports.
    pub engine_id: String,
    /// Its side-channel address, `host:port`.
    pub address: String,
    /// Its ranks (NIXL agents).
    pub ranks: u16,
}

/// A key's value that does not follow the schema.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchemaError {
    /// Not JSON, or not an object with the three fields of the right types.
    #[error("value is not a member object ({0}); expected {{\"engine_id\": string, \"address\": \"host:port\", \"ranks\": 1..=64}}")]
    Json(String),
    /// `engine_id` empty or longer than [`MAX_ENGINE_ID`] bytes.
    #[error("engine_id must be 1 to {MAX_ENGINE_ID} bytes, got {0}")]
    EngineId(usize),
    /// `address` is not `host:port` with a port number.
    #[error("address {0:?} is not host:port")]
    Address(String),
    /// `ranks` outside 1..=[`MAX_RANKS`].
    #[error("ranks must be 1 to {MAX_RANKS}, got {0}")]
    Ranks(u16),
}

impl Member {
    /// A member.
    pub fn new(engine_id: impl Into<String>, address: impl Into<String>, ranks: u16) -> Self {
        Member {
            engine_id: engine_id.into(),
            address: address.into(),
            ranks,
        }
    }

    /// Parses and checks a key's value.
    pub fn from_json(bytes: &[u8]) -> Result<Member, SchemaError> {
        let m: Member =
            serde_json::from_slice(bytes).map_err(|e| SchemaError::Json(e.to_string()))?;
        m.check()?;
        Ok(m)
    }

    /// The value to store under the key.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a member serializes")
    }

    /// Checks the schema's rules.
    pub fn check(&self) -> Result<(), SchemaError> {
        if self.engine_id.is_empty() || self.engine_id.len() > MAX_ENGINE_ID {
            return Err(SchemaError::EngineId(self.engine_id.len()));
        }
        let port_ok = self
            .address
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok {
            return Err(SchemaError::Address(self.address.clone()));
        }
        if self.ranks == 0 || self.ranks > MAX_RANKS {
            return Err(SchemaError::Ranks(self.ranks));
        }
        Ok(())
    }

    /// The engine id, typed.
    pub fn engine(&self) -> EngineId {
        EngineId::from(self.engine_id.as_str())
    }

    /// The side-channel address, typed.
    pub fn peer_addr(&self) -> PeerAddr {
        PeerAddr::from(self.address.as_str())
    }
}

/// What a membership source reports. Revisions are the source's own
/// (etcd's store revision), increasing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceEvent {
    /// The whole prefix at `revision`: at start, after a compaction and
    /// after every outage. Keys not listed are gone.
    Listed {
        /// The revision the list was read at; the watch goes on from the
        /// next one.
        revision: i64,
        /// Every key with its raw value.
        entries: Vec<(String, Vec<u8>)>,
    },
    /// A key was written.
    Put {
        /// The key.
        key: String,
        /// Its raw value.
        value: Vec<u8>,
        /// The revision of the write.
        revision: i64,
    },
    /// A key was deleted (by its engine, or by its lease's expiry).
    Deleted {
        /// The key.
        key: String,
        /// The revision of the deletion.
        revision: i64,
    },
    /// The source lost the membership plane; it retries and will send
    /// [`SourceEvent::Listed`] when it is back. Never a removal.
    Outage {
        /// What failed, in words.
        error: String,
    },
}

/// Where membership changes come from.
pub trait MembershipSource: Send + 'static {
    /// The next change; `None` when the source has stopped for good.
    ///
    /// Must be cancel safe: the driver races it against other inputs.
    fn next(&mut self) -> impl Future<Output = Option<SourceEvent>> + Send;
}

/// Why an engine is retired.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RetireWhy {
    /// Its key was deleted, or its lease expired.
    Deleted,
    /// Its key (or another key at its address) names a new engine id.
    Replaced {
        /// The engine id there now.
        by: EngineId,
    },
    /// A fresh list of the prefix no longer has it (deleted while the
    /// watch was down or behind a compaction).
    MissingFromList,
}

impl RetireWhy {
    /// A short name, for logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            RetireWhy::Deleted => "deleted",
            RetireWhy::Replaced { .. } => "replaced",
            RetireWhy::MissingFromList => "missing_from_list",
        }
    }
}

/// What the reconciler decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// A new engine: the runtime should handshake with it.
    Announce(Member),
    /// An engine the membership plane no longer has: `peer_gone`.
    Retire {
        /// The engine as its key last said.
        member: Member,
        /// Why.
        why: RetireWhy,
    },
    /// A value broke the schema: counted and logged, the key unchanged.
    BadValue {
        /// The key.
        key: String,
        /// What was wrong.
        error: SchemaError,
    },
}

/// The membership state machine: keys to members, the last revision seen.
/// Every input returns the actions it implies; it has no clock and does
/// no I/O, so its rules are tested on their own.
#[derive(Debug, Default)]
pub struct Reconciler {
    members: BTreeMap<String, Member>,
    revision: i64,
}

impl Reconciler {
    /// Empty: nothing known, revision 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The last revision applied.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The members known now, by key.
    pub fn members(&self) -> &BTreeMap<String, Member> {
        &self.members
    }

    /// Applies one source event. Outages change nothing here.
    pub fn apply(&mut self, event: SourceEvent) -> Vec<Action> {
        match event {
            SourceEvent::Listed { revision, entries } => self.listed(revision, entries),
            SourceEvent::Put {
                key,
                value,
                revision,
            } => self.put(key, &value, revision),
            SourceEvent::Deleted { key, revision } => self.deleted(&key, revision),
            SourceEvent::Outage { .. } => Vec::new(),
        }
    }

    fn engine_elsewhere(&self, engine: &str) -> bool {
        self.members.values().any(|m| m.engine_id == engine)
    }

    /// A write. Stale revisions (already applied) are ignored.
    fn put(&mut self, key: String, value: &[u8], revision: i64) -> Vec<Action> {
        if revision <= self.revision {
            return Vec::new();
        }
        self.revision = revision;
        let member = match Member::from_json(value) {
            Ok(m) => m,
            Err(error) => return vec![Action::BadValue { key, error }],
        };
        let mut actions = Vec::new();
        // Another key at the same address with another engine id: the
        // engine there was replaced (a restart under a fresh id registers
        // a fresh key before its old lease expires).
        let displaced: Vec<String> = self
            .members
            .iter()
            .filter(|(k, m)| {
                **k != key && m.address == member.address && m.engine_id != member.engine_id
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in displaced {
            let old = self.members.remove(&k).expect("listed above");
            if !self.engine_elsewhere(&old.engine_id) {
                actions.push(Action::Retire {
                    member: old,
                    why: RetireWhy::Replaced {
                        by: member.engine(),
                    },
                });
            }
        }
        let old = self.members.insert(key, member.clone());
        match old {
            Some(old) if old == member => {}
            Some(old) if old.engine_id == member.engine_id => {
                // Same engine, new address or ranks: announce it again so
                // the runtime handshakes where it is now.
                actions.push(Action::Announce(member));
            }
            Some(old) => {
                if !self.engine_elsewhere(&old.engine_id) {
                    actions.push(Action::Retire {
                        member: old,
                        why: RetireWhy::Replaced {
                            by: member.engine(),
                        },
                    });
                }
                actions.push(Action::Announce(member));
            }
            None => actions.push(Action::Announce(member)),
        }
        actions
    }

    /// A deletion (or lease expiry). Stale revisions are ignored.
    fn deleted(&mut self, key: &str, revision: i64) -> Vec<Action> {
        if revision <= self.revision {
            return Vec::new();
        }
        self.revision = revision;
        match self.members.remove(key) {
            Some(member) if !self.engine_elsewhere(&member.engine_id) => vec![Action::Retire {
                member,
                why: RetireWhy::Deleted,
            }],
            _ => Vec::new(),
        }
    }

    /// A fresh list of the whole prefix: everything missing is retired,
    /// everything new announced. Applied whatever its revision: a list
    /// is the truth as of now (after an etcd restore it may even be
    /// older).
    fn listed(&mut self, revision: i64, entries: Vec<(String, Vec<u8>)>) -> Vec<Action> {
        let mut actions = Vec::new();
        let mut fresh = BTreeMap::new();
        for (key, value) in entries {
            match Member::from_json(&value) {
                Ok(m) => {
                    fresh.insert(key, m);
                }
                Err(error) => {
                    // Unchanged: keep what the key said before, if anything.
                    if let Some(old) = self.members.get(&key) {
                        fresh.insert(key.clone(), old.clone());
                    }
                    actions.push(Action::BadValue { key, error });
                }
            }
        }
        let engines_now: HashMap<&str, &Member> =
            fresh.values().map(|m| (m.engine_id.as_str(), m)).collect();
        for old in self.members.values() {
            if engines_now.contains_key(old.engine_id.as_str()) {
                continue;
            }
            let by = fresh
                .values()
                .find(|m| m.address == old.address)
                .map(|m| m.engine());
            let why = match by {
                Some(by) => RetireWhy::Replaced { by },
                None => RetireWhy::MissingFromList,
            };
            actions.push(Action::Retire {
                member: old.clone(),
                why,
            });
        }
        let known: HashMap<&str, &Member> = self
            .members
            .values()
            .map(|m| (m.engine_id.as_str(), m))
            .collect();
        for m in fresh.values() {
            if known.get(m.engine_id.as_str()) != Some(&m) {
                actions.push(Action::Announce(m.clone()));
            }
        }
        self.members = fresh;
        self.revision = revision;
        actions
    }
}

/// What the driver tells the decoder runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MembershipUpdate {
    /// A prefill engine joined: handshake with it.
    Joined(Member),
    /// A prefill engine left; `peer_gone` has been sent for it.
    Left {
        /// The engine as its key last said.
        member: Member,
        /// Why.
        why: RetireWhy,
    },
    /// A value broke the schema (counted, logged; the key is unchanged).
    BadValue {
        /// The key.
        key: String,
        /// What was wrong.
        error: SchemaError,
    },
    /// The membership plane is unreachable: nothing is retired until it is
    /// back. Sent once per outage.
    Outage {
        /// What failed first.
        error: String,
    },
    /// The watch is back and the prefix was reconciled.
    Restored {
        /// How long the outage lasted.
        outage: Duration,
    },
    /// An engine retired by membership was released by the service.
    Released {
        /// The engine.
        engine: EngineId,
        /// From seeing its key's deletion (or replacement) to the release.
        after: Duration,
        /// The release's reason (`peer_gone`, or another input that was
        /// faster, such as `unreachable`).
        reason: ReleaseReason,
    },
}

/// How the driver retires engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MembershipConfig {
    /// What a removal does to reads in flight (default: drain).
    pub gone_mode: GoneMode,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            gone_mode: GoneMode::Drain,
        }
    }
}

/// Metric names (Prometheus).
pub mod metric {
    /// Gauge: 1 while the watch is up (listed and watching), else 0.
    pub const WATCH_UP: &str = "nixl_keepalive_membership_watch_up";
    /// Counter: outages of the membership plane.
    pub const OUTAGES: &str = "nixl_keepalive_membership_outages_total";
    /// Counter: full lists of the prefix (start, compaction, outage end).
    pub const LISTS: &str = "nixl_keepalive_membership_lists_total";
    /// Gauge: engines the membership plane lists now.
    pub const MEMBERS: &str = "nixl_keepalive_membership_members";
    /// Counter `{why}`: engines retired (deleted, replaced, missing_from_list).
    pub const RETIRED: &str = "nixl_keepalive_membership_retired_total";
    /// Counter: engines announced.
    pub const JOINED: &str = "nixl_keepalive_membership_joined_total";
    /// Counter: values that broke the key schema.
    pub const BAD_VALUES: &str = "nixl_keepalive_membership_bad_values_total";
    /// Histogram: from seeing a removal to the engine's release, seconds.
    pub const DELETION_TO_RELEASE: &str = "nixl_keepalive_membership_deletion_to_release_seconds";
}

/// Starts the driver: reads `source`, retires engines through `handle`
/// in `config.gone_mode`, and sends [`MembershipUpdate`]s to the returned
/// receiver until `shutdown` or the source ends. Updates are sent whether
/// or not anyone reads them (an unbounded channel: one per change).
pub fn spawn<S: MembershipSource, R: Send + 'static>(
    source: S,
    handle: KeepaliveHandle<R>,
    config: MembershipConfig,
    shutdown: CancellationToken,
) -> (
    mpsc::UnboundedReceiver<MembershipUpdate>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    // Subscribed before the first removal can be applied, so no release
    // is missed.
    let events = handle.subscribe();
    let task = tokio::spawn(drive(source, handle, events, config, tx, shutdown));
    (rx, task)
}

async fn drive<S: MembershipSource, R: Send + 'static>(
    mut source: S,
    handle: KeepaliveHandle<R>,
    mut events: broadcast::Receiver<Event>,
    config: MembershipConfig,
    updates: mpsc::UnboundedSender<MembershipUpdate>,
    shutdown: CancellationToken,
) {
    let mut reconciler = Reconciler::new();
    // Engines retired by membership, waiting for their release.
    let mut pending: HashMap<EngineId, Instant> = HashMap::new();
    let mut outage_since: Option<Instant> = None;
    metrics::gauge!(metric::WATCH_UP).set(0.0);
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => break,
            e = source.next() => match e {
                Some(e) => e,
                None => break,
            },
            e = events.recv() => {
                match e {
                    Ok(Event::Released { engine, reason, .. }) => {
                        if let Some(seen) = pending.remove(&engine) {
                            let after = seen.elapsed();
                            metrics::histogram!(metric::DELETION_TO_RELEASE).record(after.as_secs_f64());
                            let _ = updates.send(MembershipUpdate::Released { engine, after, reason });
                        }
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "membership: service events missed; deletion-to-release times may be lost");
                        // Forget entries whose engine is gone already.
                        pending.retain(|e, _| handle.engine(e).is_some());
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                }
                continue;
            }
        };
        match &event {
            SourceEvent::Outage { error } => {
                if outage_since.is_none() {
                    outage_since = Some(Instant::now());
                    metrics::gauge!(metric::WATCH_UP).set(0.0);
                    metrics::counter!(metric::OUTAGES).increment(1);
                    tracing::warn!(%error, "membership plane unreachable: keeping every engine until it is back");
                    let _ = updates.send(MembershipUpdate::Outage {
                        error: error.clone(),
                    });
                }
                continue;
            }
            SourceEvent::Listed { .. } => {
                metrics::counter!(metric::LISTS).increment(1);
                metrics::gauge!(metric::WATCH_UP).set(1.0);
                if let Some(since) = outage_since.take() {
                    let outage = since.elapsed();
                    tracing::info!(
                        outage_ms = outage.as_millis() as u64,
                        "membership plane back: reconciling"
                    );
                    let _ = updates.send(MembershipUpdate::Restored { outage });
                }
            }
            _ => {}
        }
        for action in reconciler.apply(event) {
            match action {
                Action::Announce(member) => {
                    metrics::counter!(metric::JOINED).increment(1);
                    tracing::info!(engine = %member.engine_id, address = %member.address, ranks = member.ranks, "membership: engine joined");
                    let _ = updates.send(MembershipUpdate::Joined(member));
                }
                Action::Retire { member, why } => {
                    let engine = member.engine();
                    metrics::counter!(metric::RETIRED, "why" => why.as_str()).increment(1);
                    tracing::info!(%engine, address = %member.address, why = why.as_str(), "membership: engine left: retiring it");
                    if handle.engine(&engine).is_some() {
                        pending.entry(engine.clone()).or_insert_with(Instant::now);
                    }
                    retire(&handle, engine, config.gone_mode);
                    let _ = updates.send(MembershipUpdate::Left { member, why });
                }
                Action::BadValue { key, error } => {
                    metrics::counter!(metric::BAD_VALUES).increment(1);
                    tracing::warn!(%key, %error, "membership: bad value ignored");
                    let _ = updates.send(MembershipUpdate::BadValue { key, error });
                }
            }
        }
        metrics::gauge!(metric::MEMBERS).set(reconciler.members().len() as f64);
    }
    metrics::gauge!(metric::WATCH_UP).set(0.0);
}

/// The one call into the service: by engine id, never by address (the
/// address may already hold the engine's replacement).
fn retire<R: Send + 'static>(handle: &KeepaliveHandle<R>, engine: EngineId, mode: GoneMode) {
    handle.peer_gone(PeerRef::Engine(engine), mode);
}
