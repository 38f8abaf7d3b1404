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
//! - `engine_id`: the engine id its handshake reports, 1 to 256 bytes of
//!   printable text (no control characters: no NUL, ESC or newline);
//! - `address`: its side-channel address, `host:port`, at most
//!   [`MAX_ADDRESS`] bytes: a DNS name, an IPv4 address or a bracketed
//!   IPv6 address, then a port from 1 to 65535;
//! - `ranks`: its ranks (NIXL agents), 1 to 64.
//!
//! Only the record under an engine's own key speaks for it: a
//! well-formed record under any other key (a copy of a live prefill's
//! record, whatever it names) is refused as
//! [`SchemaError::NotCanonical`], never a member, so its removal retires
//! nothing (see `docs/design/membership-resets.md`).
//!
//! A value is at most [`MAX_RECORD`] bytes (checked before it is parsed)
//! and a key at most [`MAX_KEY`]. Unknown fields are ignored (room to
//! grow). A record that breaks these rules is refused: counted by reason
//! (`nixl_keepalive_membership_bad_values_total{reason}`), logged at a
//! bounded rate with its key escaped and cut (see [`SchemaError::reason`]),
//! and the key is treated as unchanged: never a panic, never a removal.
//!
//! # Revisions
//!
//! etcd gives every event of one transaction the same revision: a prefix
//! delete of 10 keys, a 5-put transaction, or the revocation of a lease
//! that held several keys arrive as several events with one revision (as
//! measured on etcd 3.4). Every event is applied, in order, whatever its
//! revision; the revision is kept only to resume the watch.
//!
//! # A store reset
//!
//! An etcd restarted with a wiped data directory (or restored from an old
//! snapshot) lost its data, which is no evidence that any engine died. Its
//! first list is a **store reset** when anything says it is another store:
//! its cluster id changed, its revision is below the last one seen, or
//! its store epoch (a value the source keeps in the store itself, see
//! [`SourceEvent::Listed`]) changed, appeared or vanished. The epoch is
//! what tells an etcd restarted empty with the same flags, which keeps its
//! cluster id, and whose revision other writers may have taken past the
//! last one seen. So it is handled as an
//! outage followed by a grace period of [`MembershipConfig::reset_grace`]
//! (set it to the prefills' lease TTL: a prefill whose lease is gone
//! registers again within about a third of it): the engines the new store
//! lists are kept or announced, the ones it lacks are kept and awaited,
//! and only those still missing when the grace period ends are retired
//! ([`RetireWhy::MissingAfterReset`]). The grace period starts again with
//! every list of the prefix while engines are still awaited (an outage
//! during it gives them no chance to register).
//!
//! # Parts
//!
//! - [`MembershipSource`]: where changes come from; [`memory`] (in-memory,
//!   for tests on tokio's paused clock) and, with the `etcd` feature,
//!   `etcd` (a watch on etcd with the `etcd-client` crate, and the prefill
//!   side's lease-backed registration).
//! - [`Reconciler`]: a synchronous state machine from source events to
//!   [`Decision`]s; no clock, no I/O.
//! - [`spawn`]: the driver; it applies the actions to a
//!   [`KeepaliveHandle`] and tells the runtime through
//!   [`MembershipUpdate`]s.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::text::{check_name, Escaped, NameError};
use crate::{
    Departure, EngineId, Event, GoneMode, Incarnation, KeepaliveHandle, PeerAddr, ReleaseReason,
};

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod memory;
mod refusals;

/// The key prefix prefills register under unless told otherwise.
pub const DEFAULT_PREFIX: &str = "/nixl-keepalive/prefill/";

/// Longest engine id a value may carry (bytes), longest address, and most
/// ranks: the library's bounds, the same for every source.
pub use crate::text::{MAX_ADDRESS, MAX_ENGINE_ID, MAX_RANKS};

/// The largest value accepted under one key, in bytes. A member's JSON is
/// about 100 bytes with a UUID engine id and under 600 with the longest id
/// and address; the rest is room for fields added later. Checked before
/// the value is parsed, so a megabyte of JSON costs no parsing.
pub const MAX_RECORD: usize = 4096;

/// The longest key accepted, in bytes: a prefix and an engine id.
pub const MAX_KEY: usize = 1024;

/// One prefill engine as the membership plane knows it: the JSON value of
/// its key (see the module docs for the schema).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Member {
    /// The engine id its handshake reports.
    pub engine_id: String,
    /// Its side-channel address, `host:port`.
    pub address: String,
    /// Its ranks (NIXL agents).
    pub ranks: u16,
    /// The incarnation of the process that wrote the record (the one its
    /// handshake reports), when the prefill knows it: a record of a dead
    /// predecessor is then told apart from its successor's. Optional, for
    /// prefills that do not report one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incarnation: Option<u64>,
}

/// A record (key and value) that does not follow the schema. Every text
/// from the record is escaped and cut (it comes from whoever can write to
/// etcd).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SchemaError {
    /// The key is longer than [`MAX_KEY`] bytes.
    #[error("key is {0} bytes long; expected at most {MAX_KEY}")]
    KeyTooLong(usize),
    /// The value is larger than [`MAX_RECORD`] bytes (not parsed).
    #[error("value is {0} bytes long; expected at most {MAX_RECORD}")]
    TooLarge(usize),
    /// Not JSON, or not an object with the three fields of the right types.
    #[error("value is not a member object ({0}); expected {{\"engine_id\": string, \"address\": \"host:port\", \"ranks\": 1..=64}}")]
    Json(String),
    /// `engine_id` empty, longer than [`MAX_ENGINE_ID`] bytes, or holding
    /// a control character.
    #[error("engine_id: {0}")]
    EngineId(NameError),
    /// `address` is not `host:port` (see the module docs for its form).
    #[error("address {shown} is not host:port: {why}; expected a DNS name, an IPv4 address or a bracketed IPv6 address, then ':' and a port from 1 to 65535, at most {MAX_ADDRESS} bytes")]
    Address {
        /// The address, escaped and cut.
        shown: String,
        /// What is wrong with it.
        why: String,
    },
    /// `ranks` outside 1..=[`MAX_RANKS`].
    #[error("ranks must be 1 to {MAX_RANKS}, got {0}")]
    Ranks(u16),
    /// A well-formed record under another key than its engine's own,
    /// `<prefix><engine id>` (a copy of a live prefill's record, a key of
    /// an old version, a hand-written one): only the record under the
    /// engine's own key speaks for it, so this one is a conflict, never a
    /// member, and its removal retires nothing, whatever it names.
    #[error("a record of engine {engine} under another key than its own ({expected}): only the record under <prefix><engine id> speaks for an engine")]
    NotCanonical {
        /// The engine id the record names, escaped and cut.
        engine: String,
        /// The key that would speak for it, escaped and cut.
        expected: String,
    },
}

impl SchemaError {
    /// The reason, as the `reason` label of
    /// `nixl_keepalive_membership_bad_values_total`: `key`, `too_large`,
    /// `json`, `engine_id`, `address`, `ranks` or `not_canonical`.
    pub fn reason(&self) -> &'static str {
        match self {
            SchemaError::KeyTooLong(_) => "key",
            SchemaError::TooLarge(_) => "too_large",
            SchemaError::Json(_) => "json",
            SchemaError::EngineId(_) => "engine_id",
            SchemaError::Address { .. } => "address",
            SchemaError::Ranks(_) => "ranks",
            SchemaError::NotCanonical { .. } => "not_canonical",
        }
    }
}

impl Member {
    /// A member.
    pub fn new(engine_id: impl Into<String>, address: impl Into<String>, ranks: u16) -> Self {
        Member {
            engine_id: engine_id.into(),
            address: address.into(),
            ranks,
            incarnation: None,
        }
    }

    /// The same member, naming the incarnation of its process.
    pub fn with_incarnation(mut self, incarnation: u64) -> Self {
        self.incarnation = Some(incarnation);
        self
    }

    /// What the record says of its engine, for the service to judge
    /// against the engine's registration when the record goes away
    /// ([`KeepaliveHandle::member_gone`]); `address` is the record's
    /// address as resolved when it was announced.
    pub fn departure(&self, address: PeerAddr) -> Departure {
        Departure {
            engine: self.engine(),
            incarnation: self.incarnation.map(Incarnation),
            address,
        }
    }

    /// Whether `other` can be a record of the same process at the same
    /// address: the same engine id and address, and the same incarnation
    /// where both name one.
    fn same_process(&self, other: &Member) -> bool {
        self.engine_id == other.engine_id
            && self.address == other.address
            && (self.incarnation.is_none()
                || other.incarnation.is_none()
                || self.incarnation == other.incarnation)
    }

    /// Parses and checks a key's value: its size first, then its JSON,
    /// then the schema's rules.
    pub fn from_json(bytes: &[u8]) -> Result<Member, SchemaError> {
        if bytes.len() > MAX_RECORD {
            return Err(SchemaError::TooLarge(bytes.len()));
        }
        let m: Member = serde_json::from_slice(bytes)
            .map_err(|e| SchemaError::Json(Escaped(&e.to_string()).to_string()))?;
        m.check()?;
        Ok(m)
    }

    /// Parses and checks a record: its key's length, then its value (see
    /// [`Member::from_json`]).
    pub fn from_record(key: &str, value: &[u8]) -> Result<Member, SchemaError> {
        if key.len() > MAX_KEY {
            return Err(SchemaError::KeyTooLong(key.len()));
        }
        Member::from_json(value)
    }

    /// The value to store under the key.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a member serializes")
    }

    /// Checks the schema's rules.
    pub fn check(&self) -> Result<(), SchemaError> {
        check_name("engine id", &self.engine_id, MAX_ENGINE_ID).map_err(SchemaError::EngineId)?;
        check_address(&self.address).map_err(|why| SchemaError::Address {
            shown: Escaped(&self.address).to_string(),
            why,
        })?;
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

/// The address rules: bounded and printable ([`check_name`]), then
/// `host:port` with a host a decoder can connect to.
fn check_address(address: &str) -> Result<(), String> {
    check_name("address", address, MAX_ADDRESS).map_err(|e| match e {
        // The address is shown once, by the caller.
        NameError::Control { code, at, .. } => {
            format!("it holds a control character (U+{code:04X}) at byte {at}")
        }
        other => other.to_string(),
    })?;
    let Some((host, port)) = address.rsplit_once(':') else {
        return Err("no ':port'".into());
    };
    if port.is_empty()
        || !port.bytes().all(|b| b.is_ascii_digit())
        || !port.parse::<u16>().is_ok_and(|p| p > 0)
    {
        return Err("the port is not a number from 1 to 65535".into());
    }
    if let Some(v6) = host.strip_prefix('[') {
        let ok = v6
            .strip_suffix(']')
            .is_some_and(|v6| v6.parse::<std::net::Ipv6Addr>().is_ok());
        return if ok {
            Ok(())
        } else {
            Err("the bracketed host is not an IPv6 address".into())
        };
    }
    if host.is_empty() {
        return Err("the host is empty".into());
    }
    if !host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
    {
        return Err(
            "the host holds characters other than letters, digits, '.', '-' and '_'".into(),
        );
    }
    Ok(())
}

/// What a membership source reports. Revisions are the source's own
/// (etcd's store revision): they never decrease within one store, and
/// several events may share one (every event of one etcd transaction, a
/// prefix delete or a lease revocation has the same revision).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SourceEvent {
    /// The whole prefix at `revision`: at start, after a compaction and
    /// after every outage. Keys not listed are gone. A revision below the
    /// last one seen, or another `cluster_id`, is a store reset (see the
    /// module docs).
    Listed {
        /// The revision the list was read at; the watch goes on from the
        /// next one.
        revision: i64,
        /// Which store answered: etcd's cluster id (a restored snapshot
        /// or a new cluster gets a new one; an etcd restarted empty with
        /// the same flags keeps it).
        cluster_id: u64,
        /// The store's epoch, read at `revision`: a value kept in the
        /// store itself (the etcd source creates it when it is missing),
        /// so a store that lost its data, whatever its cluster id and
        /// revision say, lists another epoch (or none). `None` when the
        /// source cannot read or write one; the revision and cluster id
        /// are the only evidence then.
        epoch: Option<u64>,
        /// Every key with its raw value.
        entries: Vec<(String, Vec<u8>)>,
    },
    /// A key was written.
    Put {
        /// The key.
        key: String,
        /// Its raw value.
        value: Vec<u8>,
        /// The revision of the write (shared by every event of its
        /// transaction).
        revision: i64,
    },
    /// A key was deleted (by its engine, by a prefix delete, or by its
    /// lease's expiry or revocation).
    Deleted {
        /// The key.
        key: String,
        /// The revision of the deletion (shared by every event of its
        /// transaction).
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

    /// The key prefix the source watches: only the record under
    /// `<prefix><engine id>` speaks for an engine (see
    /// [`SchemaError::NotCanonical`]). [`DEFAULT_PREFIX`] unless the
    /// source says otherwise.
    fn prefix(&self) -> &str {
        DEFAULT_PREFIX
    }
}

/// Why an engine is retired.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
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
    /// The store was reset (wiped, or restored from an old snapshot) and
    /// the engine had not registered again when the grace period ended.
    MissingAfterReset,
}

impl RetireWhy {
    /// A short name, for logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            RetireWhy::Deleted => "deleted",
            RetireWhy::Replaced { .. } => "replaced",
            RetireWhy::MissingFromList => "missing_from_list",
            RetireWhy::MissingAfterReset => "missing_after_reset",
        }
    }
}

/// What the reconciler decided.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
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
    /// The store was reset: the engines it lacks are kept and awaited for
    /// the grace period; the driver calls [`Reconciler::end_reset_grace`]
    /// when it ends.
    StoreReset {
        /// Engines known before the reset that the new store lacks.
        awaited: usize,
    },
}

/// The membership state machine: keys to members, the last revision seen.
/// Every input returns the actions it implies; it has no clock and does
/// no I/O, so its rules are tested on their own.
///
/// Two rules stand above the others (see `docs/design/membership-resets.md`):
/// only the record under an engine's own key, `<prefix><engine id>`,
/// speaks for it (any other is refused as [`SchemaError::NotCanonical`]);
/// and a list of a store that lost its data (another cluster id, a lower
/// revision, or another [store epoch](SourceEvent::Listed)) retires
/// nothing at once: what it lacks is awaited for a grace period.
#[derive(Debug)]
pub struct Reconciler {
    /// The watched prefix: a record speaks for its engine only under
    /// `prefix + engine id`.
    prefix: String,
    members: BTreeMap<String, Member>,
    /// How many keys hold each record identity (engine id, incarnation,
    /// address): a record that goes away while another key still says the
    /// same retires nothing.
    identities: HashMap<(String, Option<u64>, String), usize>,
    revision: i64,
    /// The store's cluster id, from the last list (`None` before the
    /// first).
    cluster_id: Option<u64>,
    /// The store's epoch, from the last list.
    epoch: Option<u64>,
    /// After a store reset: members the new store lacked, by key, until
    /// they register again or the grace period ends.
    awaited: BTreeMap<String, Member>,
}

impl Default for Reconciler {
    fn default() -> Self {
        Reconciler::new()
    }
}

impl Reconciler {
    /// Empty: nothing known, revision 0, watching [`DEFAULT_PREFIX`].
    pub fn new() -> Self {
        Reconciler::with_prefix(DEFAULT_PREFIX)
    }

    /// Empty, for a source watching `prefix` (its
    /// [`MembershipSource::prefix`]).
    pub fn with_prefix(prefix: impl Into<String>) -> Self {
        Reconciler {
            prefix: prefix.into(),
            members: BTreeMap::new(),
            identities: HashMap::new(),
            revision: 0,
            cluster_id: None,
            epoch: None,
            awaited: BTreeMap::new(),
        }
    }

    /// The key that speaks for `engine_id`: `<prefix><engine id>`.
    pub fn own_key(&self, engine_id: &str) -> String {
        format!("{}{engine_id}", self.prefix)
    }

    /// Parses a record and checks that it is under its engine's own key.
    fn parse(&self, key: &str, value: &[u8]) -> Result<Member, SchemaError> {
        let member = Member::from_record(key, value)?;
        let own = key
            .strip_prefix(self.prefix.as_str())
            .is_some_and(|id| id == member.engine_id);
        if !own {
            return Err(SchemaError::NotCanonical {
                engine: cut(&member.engine_id),
                expected: cut(&self.own_key(&member.engine_id)),
            });
        }
        Ok(member)
    }

    /// The highest revision seen (the watch resumes after it). Only for
    /// resuming: events are applied whatever their revision.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The members known now, by key.
    pub fn members(&self) -> &BTreeMap<String, Member> {
        &self.members
    }

    /// After a store reset, the members the new store lacks (by key),
    /// kept until they register again or [`Reconciler::end_reset_grace`].
    pub fn awaited(&self) -> &BTreeMap<String, Member> {
        &self.awaited
    }

    /// Applies one source event. Outages change nothing here.
    pub fn apply(&mut self, event: SourceEvent) -> Vec<Decision> {
        match event {
            SourceEvent::Listed {
                revision,
                cluster_id,
                epoch,
                entries,
            } => self.list(revision, cluster_id, epoch, entries),
            SourceEvent::Put {
                key,
                value,
                revision,
            } => {
                self.seen(revision);
                self.put(key, &value)
            }
            SourceEvent::Deleted { key, revision } => {
                self.seen(revision);
                self.recall_awaited(&key);
                self.deleted(&key)
            }
            SourceEvent::Outage { .. } => Vec::new(),
        }
    }

    /// The reset's grace period is over: every member still awaited is
    /// retired, unless its engine is listed under another key now.
    pub fn end_reset_grace(&mut self) -> Vec<Decision> {
        let awaited = std::mem::take(&mut self.awaited);
        awaited
            .into_values()
            .filter_map(|member| self.retire(member, RetireWhy::MissingAfterReset))
            .collect()
    }

    // Revisions and store resets.

    /// An event's revision: kept for resuming only. Events of one revision
    /// (one transaction) are all applied.
    fn seen(&mut self, revision: i64) {
        self.revision = self.revision.max(revision);
    }

    /// A list: after a store reset, the members the new store lacks are set
    /// aside (awaited, not retired); then the list is reconciled as any
    /// other. The list's revision is taken as it is (after a reset it is
    /// lower, or higher: an etcd restarted empty with the same flags keeps
    /// its cluster id, and other keys may have taken its revision past the
    /// last one seen).
    ///
    /// A reset is any evidence that the store is not the one listed
    /// before: another cluster id, a lower revision, or another epoch
    /// (one appearing or vanishing included). The first list has nothing
    /// to compare with.
    fn list(
        &mut self,
        revision: i64,
        cluster_id: u64,
        epoch: Option<u64>,
        entries: Vec<(String, Vec<u8>)>,
    ) -> Vec<Decision> {
        let reset = self.cluster_id.is_some()
            && (self.cluster_id != Some(cluster_id)
                || revision < self.revision
                || self.epoch != epoch);
        self.cluster_id = Some(cluster_id);
        self.epoch = epoch;
        // Only a record that speaks for its engine brings it back: a
        // refused one at an awaited key must not keep it past the grace.
        for (key, value) in &entries {
            if self.awaited.contains_key(key) && self.parse(key, value).is_ok() {
                self.recall_awaited(key);
            }
        }
        let mut actions = Vec::new();
        if reset {
            let listed: HashSet<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
            let lacking: Vec<String> = self
                .members
                .keys()
                .filter(|k| !listed.contains(k.as_str()))
                .cloned()
                .collect();
            for key in lacking {
                let member = self.remove_member(&key).expect("listed above");
                self.awaited.insert(key, member);
            }
            actions.push(Decision::StoreReset {
                awaited: self.awaited.len(),
            });
        }
        actions.extend(self.listed(entries));
        self.revision = revision;
        actions
    }

    /// A key of an awaited member is in the store again: it is a member
    /// again, so what the store says now is compared with what it said
    /// before the reset (the same record announces nothing).
    fn recall_awaited(&mut self, key: &str) {
        if let Some(member) = self.awaited.remove(key) {
            self.insert_member(key.to_string(), member);
        }
    }

    // The members and their identity index.

    fn insert_member(&mut self, key: String, member: Member) -> Option<Member> {
        *self.identities.entry(identity_key(&member)).or_default() += 1;
        let old = self.members.insert(key, member);
        if let Some(old) = &old {
            self.forget_identity(old);
        }
        old
    }

    fn remove_member(&mut self, key: &str) -> Option<Member> {
        let old = self.members.remove(key)?;
        self.forget_identity(&old);
        Some(old)
    }

    fn forget_identity(&mut self, member: &Member) {
        let k = identity_key(member);
        if let Some(n) = self.identities.get_mut(&k) {
            *n -= 1;
            if *n == 0 {
                self.identities.remove(&k);
                // After mass departures the table gives its buckets back.
                crate::shrink::after_removal(&mut self.identities);
            }
        }
    }

    /// Whether some key still holds a record of this very process at this
    /// address: then a record of it going away under another key is no
    /// evidence that it left.
    fn still_listed(&self, member: &Member) -> bool {
        self.identities.contains_key(&identity_key(member))
    }

    /// A retirement of `member`'s record, unless another key still lists
    /// the same process at the same address. The service judges it
    /// against the registration ([`KeepaliveHandle::member_gone`]): only a
    /// record that is the registration's own retires the engine.
    fn retire(&self, member: Member, why: RetireWhy) -> Option<Decision> {
        (!self.still_listed(&member)).then_some(Decision::Retire { member, why })
    }

    // Membership rules. The membership plane announces and retires
    // records; it never decides who is at an address: a record naming a
    // new engine id at an address is only announced (the runtime's
    // handshake there is what replaces an engine).

    /// A write.
    fn put(&mut self, key: String, value: &[u8]) -> Vec<Decision> {
        let member = match self.parse(&key, value) {
            Ok(m) => m,
            // Refused: the key is unchanged, an awaited engine still
            // awaited.
            Err(error) => return vec![Decision::BadValue { key, error }],
        };
        self.recall_awaited(&key);
        let old = self.insert_member(key, member.clone());
        let mut actions = Vec::new();
        match old {
            Some(old) if old == member => {}
            Some(old) if old.same_process(&member) => {
                // Same process, new ranks: announce it again.
                actions.push(Decision::Announce(member));
            }
            Some(old) => {
                // The key names another process (a restart under a pinned
                // id writes its key again) or moved: the old record is
                // gone.
                actions.extend(self.retire(
                    old,
                    RetireWhy::Replaced {
                        by: member.engine(),
                    },
                ));
                actions.push(Decision::Announce(member));
            }
            None => actions.push(Decision::Announce(member)),
        }
        actions
    }

    /// A deletion (by its engine, a prefix delete, or a lease's expiry or
    /// revocation).
    fn deleted(&mut self, key: &str) -> Vec<Decision> {
        match self.remove_member(key) {
            Some(member) => self
                .retire(member, RetireWhy::Deleted)
                .into_iter()
                .collect(),
            None => Vec::new(),
        }
    }

    /// A fresh list of the whole prefix: every key missing is retired,
    /// every new or changed key announced. Applied whatever its revision:
    /// a list is the truth as of now.
    fn listed(&mut self, entries: Vec<(String, Vec<u8>)>) -> Vec<Decision> {
        let mut actions = Vec::new();
        let mut fresh = BTreeMap::new();
        for (key, value) in entries {
            match self.parse(&key, &value) {
                Ok(m) => {
                    fresh.insert(key, m);
                }
                Err(error) => {
                    // Unchanged: keep what the key said before, if anything.
                    if let Some(old) = self.members.get(&key) {
                        fresh.insert(key.clone(), old.clone());
                    }
                    actions.push(Decision::BadValue { key, error });
                }
            }
        }
        let old = std::mem::take(&mut self.members);
        self.identities.clear();
        for (key, member) in &fresh {
            self.insert_member(key.clone(), member.clone());
        }
        // Missing keys first, then new and changed ones, in key order.
        for (key, was) in &old {
            if !fresh.contains_key(key) {
                actions.extend(self.retire(was.clone(), RetireWhy::MissingFromList));
            }
        }
        for (key, now) in &fresh {
            match old.get(key) {
                Some(was) if was == now => {}
                Some(was) if was.same_process(now) => actions.push(Decision::Announce(now.clone())),
                Some(was) => {
                    actions
                        .extend(self.retire(was.clone(), RetireWhy::Replaced { by: now.engine() }));
                    actions.push(Decision::Announce(now.clone()));
                }
                None => actions.push(Decision::Announce(now.clone())),
            }
        }
        actions
    }
}

/// A text from a record, escaped and cut to 128 characters for a message.
fn cut(text: &str) -> String {
    let shown = Escaped(text).to_string();
    match shown.char_indices().nth(128) {
        Some((at, _)) => format!("{}...", &shown[..at]),
        None => shown,
    }
}

fn identity_key(member: &Member) -> (String, Option<u64>, String) {
    (
        member.engine_id.clone(),
        member.incarnation,
        member.address.clone(),
    )
}

/// What the driver tells the decoder runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
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
    /// A record broke the schema: counted, the key unchanged. Reported at
    /// a bounded rate (a burst of [`REFUSALS_BURST`], then one per
    /// [`REFUSALS_PERIOD`]); the others are only counted.
    BadValue {
        /// The key (print it with [`Escaped`]: it may hold anything).
        key: String,
        /// What was wrong.
        error: SchemaError,
        /// Refused records since the previous `BadValue` that were
        /// counted but not reported.
        unreported: u64,
    },
    /// The membership plane is unavailable (unreachable, or its prefix
    /// cannot be listed): nothing is retired until it is back. Sent once
    /// per outage.
    Outage {
        /// What failed first.
        error: String,
    },
    /// The watch is back and the prefix was reconciled.
    Restored {
        /// How long the outage lasted.
        outage: Duration,
    },
    /// The store was reset (see the module docs): the engines it lacks are
    /// kept for `grace`, and retired only if still missing then.
    StoreReset {
        /// Engines awaited.
        awaited: usize,
        /// How long they may take to register again.
        grace: Duration,
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
#[non_exhaustive]
pub struct MembershipConfig {
    /// What a removal does to reads in flight (default: drain).
    pub gone_mode: GoneMode,
    /// After a store reset, how long the engines the new store lacks may
    /// take to register again before they are retired. Set it to the
    /// prefills' lease TTL (default 10 s, the prefill's default
    /// `--etcd-ttl` and Dynamo's lease).
    pub reset_grace: Duration,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            gone_mode: GoneMode::Drain,
            reset_grace: Duration::from_secs(10),
        }
    }
}

/// Refused records reported (logged at WARN and sent as
/// [`MembershipUpdate::BadValue`]) at once before the rate applies.
pub const REFUSALS_BURST: u32 = 10;
/// After the burst, one refused record reported per this period; the
/// others are counted, and the next report says how many.
pub const REFUSALS_PERIOD: Duration = Duration::from_secs(1);

/// Metric names (Prometheus).
mod metric {
    /// Gauge: 1 while the watch is up (listed and watching), else 0.
    pub(crate) const WATCH_UP: &str = "nixl_keepalive_membership_watch_up";
    /// Counter: outages of the membership plane.
    pub(crate) const OUTAGES: &str = "nixl_keepalive_membership_outages_total";
    /// Counter: full lists of the prefix (start, compaction, outage end).
    pub(crate) const LISTS: &str = "nixl_keepalive_membership_lists_total";
    /// Gauge: engines the membership plane lists now.
    pub(crate) const MEMBERS: &str = "nixl_keepalive_membership_members";
    /// Counter `{why}`: engines retired (deleted, replaced,
    /// missing_from_list, missing_after_reset).
    pub(crate) const RETIRED: &str = "nixl_keepalive_membership_retired_total";
    /// Counter: engines announced.
    pub(crate) const JOINED: &str = "nixl_keepalive_membership_joined_total";
    /// Counter `{reason}`: records refused (see [`super::SchemaError::reason`]).
    pub(crate) const BAD_VALUES: &str = "nixl_keepalive_membership_bad_values_total";
    /// Counter: store resets (another store epoch or cluster id, or the
    /// revision went back).
    pub(crate) const STORE_RESETS: &str = "nixl_keepalive_membership_store_resets_total";
    /// Gauge: engines kept after a store reset, awaiting their new record.
    pub(crate) const AWAITED: &str = "nixl_keepalive_membership_awaited";
    /// Histogram: from seeing a removal to the engine's release, seconds.
    pub(crate) const DELETION_TO_RELEASE: &str =
        "nixl_keepalive_membership_deletion_to_release_seconds";
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
    let mut reconciler = Reconciler::with_prefix(source.prefix());
    // Engines retired by membership, waiting for their release.
    let mut pending: HashMap<EngineId, Instant> = HashMap::new();
    let mut outage_since: Option<Instant> = None;
    // When the grace period after a store reset ends.
    let mut grace_until: Option<Instant> = None;
    let mut refusals = refusals::RefusalLog::new(Instant::now());
    let mut resolved = Resolved::default();
    metrics::gauge!(metric::WATCH_UP).set(0.0);
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => break,
            e = source.next() => match e {
                Some(e) => e,
                None => break,
            },
            _ = sleep_until_some(grace_until) => {
                grace_until = None;
                let actions = reconciler.end_reset_grace();
                tracing::info!(retired = actions.len(), "membership: store reset's grace period over");
                for action in actions {
                    carry_out(action, &handle, &config, &mut pending, &mut refusals, &mut resolved, &updates).await;
                }
                set_member_gauges(&reconciler);
                continue;
            }
            e = events.recv() => {
                match e {
                    Ok(Event::Released { engine, reason, .. }) => {
                        let seen = pending.remove(&engine);
                        crate::shrink::after_removal(&mut pending);
                        if let Some(seen) = seen {
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
                        crate::shrink::after_removal(&mut pending);
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                }
                continue;
            }
        };
        let listed = matches!(event, SourceEvent::Listed { .. });
        match &event {
            SourceEvent::Outage { error } => {
                // The grace period waits for the store: it starts again
                // with the next list.
                grace_until = None;
                if outage_since.is_none() {
                    outage_since = Some(Instant::now());
                    metrics::gauge!(metric::WATCH_UP).set(0.0);
                    metrics::counter!(metric::OUTAGES).increment(1);
                    tracing::warn!(%error, "membership plane unavailable: keeping every engine until it is back");
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
            carry_out(
                action,
                &handle,
                &config,
                &mut pending,
                &mut refusals,
                &mut resolved,
                &updates,
            )
            .await;
        }
        if listed {
            grace_until = reset_grace_deadline(&reconciler, &config);
        }
        set_member_gauges(&reconciler);
    }
    metrics::gauge!(metric::WATCH_UP).set(0.0);
}

/// The addresses of announced records, resolved when they were announced
/// ([`PeerAddr::resolve`], as the runtime resolves them to handshake):
/// a record's departure names the address its engine was registered at,
/// even if the name no longer resolves (a pod and its DNS entry go away
/// together).
#[derive(Default)]
struct Resolved(HashMap<(String, String), PeerAddr>);

impl Resolved {
    async fn announce(&mut self, member: &Member) {
        let address = match PeerAddr::resolve(&member.address).await {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(address = %Escaped(&member.address), error = %e, "membership: a record's address does not resolve to one address; compared as written");
                member.peer_addr()
            }
        };
        if self.0.len() >= MAX_RESOLVED {
            self.0.clear();
        }
        self.0
            .insert((member.engine_id.clone(), member.address.clone()), address);
    }

    fn departed(&mut self, member: &Member) -> PeerAddr {
        let address = self
            .0
            .remove(&(member.engine_id.clone(), member.address.clone()))
            .unwrap_or_else(|| member.peer_addr());
        crate::shrink::after_removal(&mut self.0);
        address
    }
}

/// The most resolved addresses remembered (a hostile plane writing
/// endless records cannot grow it without bound).
const MAX_RESOLVED: usize = 1 << 16;

/// One action of the reconciler, carried out.
async fn carry_out<R: Send + 'static>(
    action: Decision,
    handle: &KeepaliveHandle<R>,
    config: &MembershipConfig,
    pending: &mut HashMap<EngineId, Instant>,
    refusals: &mut refusals::RefusalLog,
    resolved: &mut Resolved,
    updates: &mpsc::UnboundedSender<MembershipUpdate>,
) {
    match action {
        Decision::Announce(member) => {
            resolved.announce(&member).await;
            metrics::counter!(metric::JOINED).increment(1);
            tracing::info!(engine = %member.engine_id, address = %member.address, ranks = member.ranks, "membership: engine joined");
            let _ = updates.send(MembershipUpdate::Joined(member));
        }
        Decision::Retire { member, why } => {
            let engine = member.engine();
            metrics::counter!(metric::RETIRED, "why" => why.as_str()).increment(1);
            tracing::info!(%engine, address = %Escaped(&member.address), why = why.as_str(), "membership: record gone: the service retires its engine if it is that registration's own");
            if handle.engine(&engine).is_some() {
                pending.entry(engine.clone()).or_insert_with(Instant::now);
            }
            let address = resolved.departed(&member);
            if handle
                .member_gone(member.departure(address), config.gone_mode)
                .is_err()
            {
                // A stopped service released or handed back every engine:
                // nothing is left to retire (the loop ends when the
                // service's events close).
                tracing::debug!(%engine, "membership: the service has stopped; nothing to retire");
            }
            let _ = updates.send(MembershipUpdate::Left { member, why });
        }
        Decision::BadValue { key, error } => refused(key, error, refusals, updates),
        Decision::StoreReset { awaited } => {
            metrics::counter!(metric::STORE_RESETS).increment(1);
            tracing::warn!(
                awaited,
                grace_ms = config.reset_grace.as_millis() as u64,
                "membership plane was reset (another store epoch or cluster id, or its revision went back): the engines it lacks are kept for the grace period, none retired now"
            );
            let _ = updates.send(MembershipUpdate::StoreReset {
                awaited,
                grace: config.reset_grace,
            });
        }
    }
}

// Store resets: the grace period.

/// After a list: engines still awaited get (again) a whole grace period.
fn reset_grace_deadline(reconciler: &Reconciler, config: &MembershipConfig) -> Option<Instant> {
    (!reconciler.awaited().is_empty()).then(|| Instant::now() + config.reset_grace)
}

/// Sleeps until `deadline`; never resolves without one.
async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn set_member_gauges(reconciler: &Reconciler) {
    metrics::gauge!(metric::MEMBERS).set(reconciler.members().len() as f64);
    metrics::gauge!(metric::AWAITED).set(reconciler.awaited().len() as f64);
}

// Refused records.

/// A refused record: counted by reason; logged and reported at a bounded
/// rate, its key escaped and cut.
fn refused(
    key: String,
    error: SchemaError,
    refusals: &mut refusals::RefusalLog,
    updates: &mpsc::UnboundedSender<MembershipUpdate>,
) {
    metrics::counter!(metric::BAD_VALUES, "reason" => error.reason()).increment(1);
    if let Some(unreported) = refusals.refused(&key, &error.to_string(), Instant::now()) {
        tracing::warn!(key = %Escaped(&key), %error, reason = error.reason(), unreported, "membership: record refused; the key is treated as unchanged");
        let _ = updates.send(MembershipUpdate::BadValue {
            key,
            error,
            unreported,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_thousand_members_that_left_give_the_identity_table_back() {
        // Issue 30, item 10d.
        let mut r = Reconciler::new();
        let key = |n: u32| format!("{DEFAULT_PREFIX}e{n}");
        for n in 0..10_000u32 {
            let value = Member::new(
                format!("e{n}"),
                format!("10.0.{}.{}:5600", n >> 8, n & 255),
                1,
            );
            r.apply(SourceEvent::Put {
                key: key(n),
                value: value.to_json().into_bytes(),
                revision: i64::from(n) + 1,
            });
        }
        let full = r.identities.capacity();
        assert!(full >= 10_000);
        for n in 3..10_000u32 {
            r.apply(SourceEvent::Deleted {
                key: key(n),
                revision: 20_000 + i64::from(n),
            });
        }
        assert_eq!(r.members().len(), 3);
        assert_eq!(r.identities.len(), 3);
        assert!(
            r.identities.capacity() <= 256,
            "{} slots for 3 members (was {full})",
            r.identities.capacity()
        );
    }
}
