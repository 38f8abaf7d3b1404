//! One registration as the core keeps it.

use std::collections::BTreeSet;
use std::sync::Arc;

use std::time::Instant;

use super::calls::HeartbeatMessages;
use super::heartbeat::heartbeat_round;
use super::key::PeerKey;
use super::TicketId;
use crate::event::ReleaseReason;
use crate::read_accounting::cell::EngineCell;
use crate::registration::Incarnation;
use crate::registration::RegistrationId;
use crate::transport::{AgentName, EngineId, PeerAddr, Transfers};
use nixl_agent::NixlStatus;

/// Why a registration was marked, and what its release has waited for.
pub(super) struct Mark {
    pub(super) reason: ReleaseReason,
    pub(super) at: Instant,
    pub(super) reads_at_mark: u64,
    pub(super) held_by_handshake: bool,
    /// The handshakes open at the registration's address when it was
    /// marked: only these hold its release back. One begun after the mark
    /// cannot (it finds the engine marked already), so a loop of
    /// handshakes at a dead prefill's address delays its release by one
    /// handshake's length at most, never for as long as the loop runs.
    pub(super) handshakes_before: Vec<TicketId>,
}

/// The KV leases a registration's heartbeats name, and the round built for
/// them. Most engines never have one (their round is the static `HB:`), so
/// the set lives behind one pointer: a record without leases pays 8 bytes
/// for it, not the 48 of a set and a cached round.
#[derive(Default)]
pub(super) struct Leases(Option<Box<LeaseSet>>);

struct LeaseSet {
    requests: BTreeSet<String>,
    /// The round for `requests`, built at the first round after they
    /// change (`None` until then).
    round: Option<HeartbeatMessages>,
}

impl Leases {
    /// Adds request ids; the next round names them.
    pub(super) fn extend(&mut self, requests: Vec<String>) {
        if requests.is_empty() {
            return;
        }
        let set = self.0.get_or_insert_with(|| {
            Box::new(LeaseSet {
                requests: BTreeSet::new(),
                round: None,
            })
        });
        set.requests.extend(requests);
        set.round = None;
    }

    /// Removes request ids; the next round no longer names them.
    pub(super) fn remove(&mut self, requests: &[String]) {
        let Some(set) = self.0.as_mut() else {
            return;
        };
        for r in requests {
            if set.requests.remove(r) {
                set.round = None;
            }
        }
        if set.requests.is_empty() {
            self.0 = None;
        }
    }

    /// Drops every lease (the registration is going).
    pub(super) fn clear(&mut self) {
        self.0 = None;
    }

    /// The request ids, in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = &String> + '_ {
        self.0.iter().flat_map(|set| set.requests.iter())
    }

    /// The heartbeat round for these leases: `HB:` alone without any, else
    /// built once per change and shared by the rounds until the next.
    pub(super) fn round(&mut self) -> HeartbeatMessages {
        let Some(set) = self.0.as_mut() else {
            return HeartbeatMessages::Idle;
        };
        set.round
            .get_or_insert_with(|| heartbeat_round(&set.requests))
            .clone()
    }
}

/// A registration: live, or marked and waiting for its release.
pub(super) struct Peer<R> {
    pub(super) cell: Arc<EngineCell>,
    pub(super) address: PeerAddr,
    pub(super) incarnation: Option<Incarnation>,
    /// The newest handshake started when it was activated: a handshake no
    /// newer than this began before the registration existed.
    pub(super) registered_after: TicketId,
    pub(super) agents: Arc<[AgentName]>,
    /// A second reference to `agents` that a heartbeat round takes with it
    /// and gives back with its outcome (`None` while a round is out): a
    /// round costs no reference count. Cloning `agents` for each round was
    /// an atomic increment on a line the pool's threads had just written
    /// (their drop), a tenth of the driver's time at 10k engines.
    pub(super) round_agents: Option<Arc<[AgentName]>>,
    /// `None` once handed to the transport.
    pub(super) resources: Option<R>,
    /// Boxed: only a marked registration has one, and most never are.
    pub(super) mark: Option<Box<Mark>>,
    /// The KV leases the heartbeats name.
    pub(super) leases: Leases,
    /// The schedule slot of the next heartbeat, if one is scheduled: the
    /// token that finds it in the [`super::schedule::Schedule`].
    pub(super) next_heartbeat: Option<Instant>,
    pub(super) heartbeat_in_flight: bool,
    /// A lease renewal was asked for and has not gone out yet.
    pub(super) renewal_wanted: bool,
    pub(super) last_heartbeat: Option<(Instant, NixlStatus)>,
    pub(super) transient_errors: u64,
    /// Whether every transfer of the registration ended here with
    /// `SUCCESS`: a read given up, or one that ended with an error, may
    /// still be running at the peer, and its release must then leave the
    /// connections to UCX ([`crate::transport::Transfers`]).
    pub(super) transfers: Transfers,
    pub(super) progress: Progress,
    /// The rate cap's state for this registration (its limiter key).
    pub(super) rate: super::rate::RateState,
}

/// What the stall check knows of a registration's reads.
///
/// The check samples the registration's word (reads in flight, completed
/// count) at its own times and hears of given-up reads when they happen,
/// so every time kept here is *when it was seen*: a completion seen at a
/// check happened at or before it, a read seen in flight began at or
/// before it. The stall clock therefore starts as late as the evidence
/// allows, and a mark is never early.
pub(super) struct Progress {
    /// The wrapping count of reads completed, as last seen.
    pub(super) done_seen: u64,
    /// Since when the engine has had a read outstanding (in flight, or
    /// given up unanswered) and no completion: the first time that was
    /// seen. `None` while it has none (idle, or a completion seen since).
    pub(super) quiet_since: Option<Instant>,
    /// When a completion was last seen.
    pub(super) last_completion: Option<Instant>,
    /// Reads given up unanswered since the last completion: they keep the
    /// stall clock running with no read in flight. 32 bits (saturating):
    /// a count, not an identity; the stall check marks the engine long
    /// before 4 * 10^9 of them.
    pub(super) unanswered: u32,
    /// Of those, timed out: the runtime's own verdict, judged at the next
    /// check.
    pub(super) timed_out: u32,
    /// The current quiet stretch has been reported (once per stall).
    pub(super) reported: bool,
}

impl Progress {
    fn new(done_seen: u64) -> Self {
        Progress {
            done_seen,
            quiet_since: None,
            last_completion: None,
            unanswered: 0,
            timed_out: 0,
            reported: false,
        }
    }

    /// A completion was seen at `now` (the completed count is `done`),
    /// with `reads` in flight: the quiet stretch ends; with reads still in
    /// flight a new one starts now.
    pub(super) fn completed(&mut self, now: Instant, done: u64, reads: u64) {
        self.done_seen = done;
        self.last_completion = Some(now);
        self.unanswered = 0;
        self.timed_out = 0;
        self.reported = false;
        self.quiet_since = (reads > 0).then_some(now);
    }

    /// A read outstanding: in flight now, or given up unanswered.
    pub(super) fn outstanding(&self, reads: u64) -> bool {
        reads > 0 || self.unanswered > 0
    }
}

impl<R> Peer<R> {
    pub(super) fn new(
        _now: Instant,
        cell: Arc<EngineCell>,
        address: PeerAddr,
        incarnation: Option<Incarnation>,
        registered_after: TicketId,
        agents: Vec<AgentName>,
        resources: R,
    ) -> Self {
        let (_, done_seen) = cell.progress();
        Peer {
            progress: Progress::new(done_seen),
            cell,
            address,
            incarnation,
            registered_after,
            round_agents: None,
            agents: agents.into(),
            resources: Some(resources),
            mark: None,
            leases: Leases::default(),
            next_heartbeat: None,
            heartbeat_in_flight: false,
            renewal_wanted: false,
            last_heartbeat: None,
            transient_errors: 0,
            transfers: Transfers::Ended,
            rate: Default::default(),
        }
    }

    pub(super) fn id(&self) -> &EngineId {
        self.cell.id()
    }

    pub(super) fn is_live(&self) -> bool {
        self.mark.is_none()
    }

    /// Handed to the transport (or being).
    pub(super) fn is_releasing(&self) -> bool {
        self.resources.is_none()
    }
}

/// The registrations, stored densely: a slab of records and a small index
/// from [`RegistrationId`] to their slot.
///
/// Why not a `HashMap<RegistrationId, Peer>`: a hash table keeps its
/// records in its buckets, and between resizes half of them are empty, so
/// at 1,000 engines a table of ~270-byte records held 2,048 buckets of
/// them (about 570 bytes per engine, every page touched since the buckets
/// are spread at random). Here the records are contiguous (one slot per
/// registration, freed slots reused) and only the 16-byte index entries
/// pay the table's slack; a heartbeat's lookups touch one index entry and
/// one record. Iteration follows the slots, so its order depends only on
/// the sequence of registrations and releases, never on a hash seed: the
/// stall check and the census walk the same order in every run of a seed.
pub(super) struct PeerTable<R> {
    records: slab::Slab<(RegistrationId, Peer<R>)>,
    index: super::Map<RegistrationId, usize>,
}

impl<R> Default for PeerTable<R> {
    fn default() -> Self {
        PeerTable {
            records: slab::Slab::new(),
            index: super::Map::default(),
        }
    }
}

impl<R> PeerTable<R> {
    pub(super) fn get(&self, serial: &RegistrationId) -> Option<&Peer<R>> {
        let slot = *self.index.get(serial)?;
        Some(&self.records[slot].1)
    }

    pub(super) fn get_mut(&mut self, serial: &RegistrationId) -> Option<&mut Peer<R>> {
        let slot = *self.index.get(serial)?;
        Some(&mut self.records[slot].1)
    }

    #[cfg(test)]
    pub(super) fn capacity(&self) -> usize {
        self.records.capacity()
    }

    #[cfg(test)]
    pub(super) fn index_capacity(&self) -> usize {
        self.index.capacity()
    }

    pub(super) fn contains_key(&self, serial: &RegistrationId) -> bool {
        self.index.contains_key(serial)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Adds a registration. Each id is added once (ids are never reused).
    pub(super) fn insert(&mut self, serial: RegistrationId, peer: Peer<R>) {
        let slot = self.records.insert((serial, peer));
        let previous = self.index.insert(serial, slot);
        debug_assert!(previous.is_none(), "{serial:?} added twice");
    }

    /// Where `serial`'s record is, if it is held.
    pub(super) fn key(&self, serial: RegistrationId) -> Option<PeerKey> {
        let slot = *self.index.get(&serial)?;
        Some(PeerKey { serial, slot })
    }

    /// Loads the first line of `key`'s slot and nothing more: a pass of
    /// these over a batch lets the batch's cache misses overlap (the
    /// processor keeps several loads in flight when none depends on
    /// another) instead of each record's coming when its turn does.
    #[inline]
    pub(super) fn warm(&self, key: PeerKey) {
        if let Some((serial, peer)) = self.records.get(key.slot) {
            // The fields a round reads at its send and at its result, which
            // the compiler spreads over the record's lines.
            std::hint::black_box((
                *serial,
                peer.next_heartbeat,
                peer.heartbeat_in_flight,
                peer.mark.is_some(),
                peer.round_agents.is_some(),
                peer.rate.is_some(),
                peer.last_heartbeat.is_some(),
            ));
        }
    }

    /// The record `key` names, if it is still held (not removed, its slot
    /// not reused).
    pub(super) fn at_mut(&mut self, key: PeerKey) -> Option<&mut Peer<R>> {
        match self.records.get_mut(key.slot) {
            Some((serial, peer)) if *serial == key.serial => Some(peer),
            _ => None,
        }
    }

    pub(super) fn remove(&mut self, serial: &RegistrationId) -> Option<Peer<R>> {
        let slot = self.index.remove(serial)?;
        // After mass departures the index gives its buckets back and the
        // slab its vacant tail.
        crate::shrink::after_removal(&mut self.index);
        let (_, peer) = self.records.remove(slot);
        crate::shrink::after_slab_removal(&mut self.records, slot);
        Some(peer)
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &RegistrationId> + '_ {
        self.records.iter().map(|(_, (serial, _))| serial)
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Peer<R>> + '_ {
        self.records.iter().map(|(_, (_, peer))| peer)
    }

    pub(super) fn iter_mut(
        &mut self,
    ) -> impl Iterator<Item = (&RegistrationId, &mut Peer<R>)> + '_ {
        self.records
            .iter_mut()
            .map(|(_, (serial, peer))| (&*serial, peer))
    }

    pub(super) fn into_values(self) -> impl Iterator<Item = Peer<R>> {
        self.records.into_iter().map(|(_, (_, peer))| peer)
    }
}

impl<R> std::ops::Index<&RegistrationId> for PeerTable<R> {
    type Output = Peer<R>;

    fn index(&self, serial: &RegistrationId) -> &Peer<R> {
        self.get(serial).expect("a registration the table holds")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(round: &HeartbeatMessages) -> Vec<String> {
        round
            .iter()
            .map(|m| String::from_utf8(m.to_vec()).unwrap())
            .collect()
    }

    fn ids(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    /// The set is allocated with the first lease and dropped with the
    /// last; the round is built once per change and shared until the next;
    /// removing what is not there, or adding nothing, changes nothing.
    #[test]
    fn leases_live_behind_one_pointer_only_while_there_are_some() {
        let mut leases = Leases::default();
        assert!(matches!(leases.round(), HeartbeatMessages::Idle));
        leases.extend(vec![]);
        assert!(leases.0.is_none(), "adding nothing allocates nothing");
        leases.remove(&ids(&["r9"]));
        assert!(leases.0.is_none());

        leases.extend(ids(&["r2", "r1"]));
        let first = leases.round();
        assert_eq!(texts(&first), ["HB:r1,r2"]);
        match (&first, &leases.round()) {
            (HeartbeatMessages::Leases(a), HeartbeatMessages::Leases(b)) => {
                assert!(Arc::ptr_eq(a, b), "built once, shared until a change")
            }
            other => panic!("{other:?}"),
        }
        leases.remove(&ids(&["r9"]));
        assert!(
            matches!((&first, &leases.round()), (HeartbeatMessages::Leases(a), HeartbeatMessages::Leases(b)) if Arc::ptr_eq(a, b)),
            "removing an unknown id keeps the round"
        );
        leases.remove(&ids(&["r1"]));
        assert_eq!(texts(&leases.round()), ["HB:r2"]);
        assert_eq!(leases.iter().collect::<Vec<_>>(), ["r2"]);
        leases.remove(&ids(&["r2"]));
        assert!(leases.0.is_none(), "the last lease gone, the set is freed");
        assert!(matches!(leases.round(), HeartbeatMessages::Idle));

        leases.extend(ids(&["r3"]));
        leases.clear();
        assert!(leases.0.is_none() && leases.iter().next().is_none());
    }
}
