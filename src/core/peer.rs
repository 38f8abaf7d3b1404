//! One registration as the core keeps it, and the table that stores them.

use std::sync::Arc;

use super::accounting::ReadAccounting;
use super::fate::Fate;
use super::heartbeat::Beat;
use super::identity::Who;
use super::key::PeerKey;
use super::stall::Progress;
use crate::names::EngineId;
use crate::registration::RegistrationId;

/// A registration: live, or marked and waiting for its release. Each
/// rule's part of it is that rule's type, its fields private to the rule's
/// file; they are kept together in one record so that a heartbeat, a
/// status and a release each touch one record (the slab's locality, which
/// the 10k-engine benchmarks measure).
pub(super) struct Peer<R, A> {
    /// The registration's read accounting: the counts the rules decide on.
    pub(super) cell: Arc<A>,
    /// Who it is (`identity.rs`).
    pub(super) who: Who,
    /// Its heartbeats (`heartbeat.rs`).
    pub(super) beat: Beat,
    /// Its mark and release (`fate.rs`).
    pub(super) fate: Fate<R>,
    /// What the stall check has seen of its reads (`stall.rs`).
    pub(super) progress: Progress,
}

impl<R, A: ReadAccounting> Peer<R, A> {
    pub(super) fn new(cell: Arc<A>, who: Who, resources: R) -> Self {
        let (_, done_seen) = cell.progress();
        Peer {
            progress: Progress::new(done_seen),
            cell,
            who,
            beat: Beat::default(),
            fate: Fate::new(resources),
        }
    }

    pub(super) fn id(&self) -> &EngineId {
        self.cell.id()
    }

    pub(super) fn is_live(&self) -> bool {
        self.fate.is_live()
    }

    /// Handed to the transport (or being).
    pub(super) fn is_releasing(&self) -> bool {
        self.fate.is_releasing()
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
pub(super) struct PeerTable<R, A> {
    records: slab::Slab<(RegistrationId, Peer<R, A>)>,
    index: super::Map<RegistrationId, usize>,
}

impl<R, A> Default for PeerTable<R, A> {
    fn default() -> Self {
        PeerTable {
            records: slab::Slab::new(),
            index: super::Map::default(),
        }
    }
}

impl<R, A> PeerTable<R, A> {
    pub(super) fn get(&self, serial: &RegistrationId) -> Option<&Peer<R, A>> {
        let slot = *self.index.get(serial)?;
        Some(&self.records[slot].1)
    }

    pub(super) fn get_mut(&mut self, serial: &RegistrationId) -> Option<&mut Peer<R, A>> {
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
    pub(super) fn insert(&mut self, serial: RegistrationId, peer: Peer<R, A>) {
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
            std::hint::black_box((*serial, peer.beat.touch(), peer.fate.is_live()));
        }
    }

    /// The record `key` names, if it is still held (not removed, its slot
    /// not reused).
    pub(super) fn at_mut(&mut self, key: PeerKey) -> Option<&mut Peer<R, A>> {
        match self.records.get_mut(key.slot) {
            Some((serial, peer)) if *serial == key.serial => Some(peer),
            _ => None,
        }
    }

    pub(super) fn remove(&mut self, serial: &RegistrationId) -> Option<Peer<R, A>> {
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

    pub(super) fn values(&self) -> impl Iterator<Item = &Peer<R, A>> + '_ {
        self.records.iter().map(|(_, (_, peer))| peer)
    }

    pub(super) fn iter_mut(
        &mut self,
    ) -> impl Iterator<Item = (&RegistrationId, &mut Peer<R, A>)> + '_ {
        self.records
            .iter_mut()
            .map(|(_, (serial, peer))| (&*serial, peer))
    }

    pub(super) fn into_values(self) -> impl Iterator<Item = Peer<R, A>> {
        self.records.into_iter().map(|(_, (_, peer))| peer)
    }
}

impl<R, A> std::ops::Index<&RegistrationId> for PeerTable<R, A> {
    type Output = Peer<R, A>;

    fn index(&self, serial: &RegistrationId) -> &Peer<R, A> {
        self.get(serial).expect("a registration the table holds")
    }
}
