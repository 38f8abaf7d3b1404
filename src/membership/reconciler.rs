//! The reconciler: sans-IO, from what a source saw (lists, puts,
//! deletions, outages) to what the service must be told (announce,
//! retire), with the store-reset and canonical-record rules.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;

use crate::text::Escaped;
use crate::transport::EngineId;

use super::schema::{Member, SchemaError, DEFAULT_PREFIX};

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
    /// against the registration ([`crate::KeepaliveHandle::member_gone`]): only a
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
