//! The heartbeat schedule: the one place heartbeat deadlines live.
//!
//! Deadlines go to [`HEARTBEAT_SLOT`] boundaries and are kept in a map
//! from slot to the registrations due then, so engines due within one
//! slot are served in one wake-up of the driver instead of one each (at 10k
//! engines a wake-up per millisecond was most of the service's CPU), and
//! the next deadline is the map's first key. A registration is in at most
//! one slot; its peer record holds which, so it can be moved or removed.
//!
//! A deadline that may be served a little early (a jittered round's) goes
//! to the nearest boundary ([`Schedule::insert_near`]); one that must not
//! (a round the rate cap deferred) to the next ([`Schedule::insert`]).
//!
//! Not a `DelayQueue`: the core takes `now` as an argument and never reads
//! a clock, so its timers must be plain data the driver sleeps towards.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

/// Heartbeat deadlines go to multiples of this (from the service's start),
/// or of half the heartbeat interval where that is shorter (see
/// [`slot_for`]).
///
/// A jittered round goes to the nearest boundary, so it is served within
/// half a slot of its deadline, either side: 10 ms at most, the lateness
/// 10 ms slots rounded up used to allow, at half the wake-ups (each slot
/// wakes the driver and a transport thread; on a 2-core VM a wake-up after
/// 10 ms asleep costs 50 to 130 us of CPU, and 100 slots a second were
/// most of the service's CPU at 10k engines). A round that must not come
/// early (deferred by the rate cap) goes to the boundary after its
/// deadline: up to one slot late. Next to a jitter of hundreds of
/// milliseconds this changes no engine's schedule in any way that matters;
/// every bound in this crate includes it.
pub const HEARTBEAT_SLOT: Duration = Duration::from_millis(20);

/// The slot for heartbeats every `interval`: [`HEARTBEAT_SLOT`], or half
/// the interval if that is shorter (5 ms at the shortest interval, 10 ms),
/// so that even the shortest interval keeps its rounds apart and a round's
/// nearest boundary is always after the round before it.
pub(crate) fn slot_for(interval: Option<Duration>) -> Duration {
    interval.map_or(HEARTBEAT_SLOT, |i| (i / 2).min(HEARTBEAT_SLOT))
}

/// Registrations (`K`: how the core finds their records) by the slot
/// their next heartbeat is due in.
pub(crate) struct Schedule<K> {
    origin: Instant,
    /// The slot, in nanoseconds (never 0).
    slot: u64,
    slots: BTreeMap<Instant, Vec<K>>,
    len: usize,
    /// Emptied slot vectors, kept for the next slots (one allocation and
    /// its growth per slot, 100 slots a second, otherwise).
    spare: Vec<Vec<K>>,
}

/// Spare slot vectors kept at most.
const SPARES: usize = 8;

impl<K: Copy + PartialEq> Schedule<K> {
    /// A schedule whose slots are `slot` long ([`slot_for`]), counted from
    /// `origin`.
    pub(crate) fn new(origin: Instant, slot: Duration) -> Self {
        // In u64 nanoseconds: a u128 division per heartbeat was measurable.
        let slot = u64::try_from(slot.as_nanos()).unwrap_or(u64::MAX).max(1);
        Schedule {
            origin,
            slot,
            slots: BTreeMap::new(),
            len: 0,
            spare: Vec::new(),
        }
    }

    /// `at`, rounded up to the next slot boundary (counted from the origin).
    fn slot_of(&self, at: Instant) -> Instant {
        // In u64 nanoseconds (584 years from the origin; past that,
        // saturated).
        let slot = self.slot;
        let since = at.saturating_duration_since(self.origin);
        let since = u64::try_from(since.as_nanos())
            .unwrap_or(u64::MAX)
            .min(u64::MAX - slot);
        self.origin + Duration::from_nanos(since.div_ceil(slot) * slot)
    }

    /// Puts `serial` in the first slot not before `at`; returns the slot.
    pub(crate) fn insert(&mut self, serial: K, at: Instant) -> Instant {
        self.put(serial, self.slot_of(at))
    }

    /// Puts `serial` in the slot nearest `at` (half a slot early at most;
    /// due at once if that slot has passed); returns the slot.
    pub(crate) fn insert_near(&mut self, serial: K, at: Instant) -> Instant {
        let early = at
            .checked_sub(Duration::from_nanos(self.slot / 2))
            .unwrap_or(self.origin)
            .max(self.origin);
        self.put(serial, self.slot_of(early))
    }

    fn put(&mut self, serial: K, slot: Instant) -> Instant {
        let spare = &mut self.spare;
        self.slots
            .entry(slot)
            .or_insert_with(|| spare.pop().unwrap_or_default())
            .push(serial);
        self.len += 1;
        slot
    }

    /// Takes `serial` out of `slot`.
    pub(crate) fn remove(&mut self, serial: K, slot: Instant) {
        if let Some(serials) = self.slots.get_mut(&slot) {
            if let Some(i) = serials.iter().position(|&s| s == serial) {
                serials.swap_remove(i);
                self.len -= 1;
                if serials.is_empty() {
                    if let Some(empty) = self.slots.remove(&slot) {
                        self.recycle(empty);
                    }
                }
            }
        }
    }

    /// The earliest slot with a registration in it.
    pub(crate) fn next(&self) -> Option<Instant> {
        self.slots.keys().next().copied()
    }

    /// Gives back a slot vector [`Schedule::pop_due`] returned, once
    /// served: the next slots reuse it.
    pub(crate) fn recycle(&mut self, mut serials: Vec<K>) {
        if self.spare.len() < SPARES {
            serials.clear();
            self.spare.push(serials);
        }
    }

    /// Takes the earliest slot if it is due at `now` (give its vector back
    /// with [`Schedule::recycle`]).
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(Instant, Vec<K>)> {
        let entry = self.slots.first_entry()?;
        if *entry.key() > now {
            return None;
        }
        let (slot, serials) = entry.remove_entry();
        self.len -= serials.len();
        Some((slot, serials))
    }

    /// Registrations scheduled.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registration::RegistrationId;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn deadlines_round_up_to_slots_and_come_out_in_order() {
        // In slots: 0.75, 0.55 and 0.15 of the way from the origin.
        let origin = Instant::now();
        let slot = HEARTBEAT_SLOT;
        let mut s = Schedule::new(origin, slot);
        let a = s.insert(RegistrationId(1), origin + slot * 3 / 2);
        let b = s.insert(RegistrationId(2), origin + slot * 11 / 10);
        let c = s.insert(RegistrationId(3), origin + slot * 3 / 10);
        assert_eq!(a, origin + slot * 2);
        assert_eq!(a, b);
        assert_eq!(c, origin + slot);
        assert_eq!(s.next(), Some(c));
        assert!(s.pop_due(origin + slot - ms(1)).is_none());
        assert_eq!(s.pop_due(origin + slot), Some((c, vec![RegistrationId(3)])));
        s.remove(RegistrationId(1), a);
        assert_eq!(s.len(), 1);
        assert_eq!(
            s.pop_due(origin + Duration::from_secs(1)),
            Some((a, vec![RegistrationId(2)]))
        );
        assert_eq!(s.len(), 0);
        assert_eq!(s.next(), None);
    }

    /// A near deadline is served within half a slot of it, either side,
    /// and never before the origin; an exact boundary stays where it is.
    #[test]
    fn near_deadlines_go_to_the_nearest_boundary() {
        let origin = Instant::now();
        let slot = HEARTBEAT_SLOT;
        let half = slot / 2;
        let mut s = Schedule::new(origin, slot);
        let cases = [
            (slot * 5, slot * 5),
            (slot * 5 + ms(1), slot * 5),
            (slot * 5 + half - ms(1), slot * 5),
            (slot * 5 + half, slot * 5),
            (slot * 5 + half + ms(1), slot * 6),
            (slot * 5 - half + ms(1), slot * 5),
            // Halfway: the earlier of the two.
            (slot * 5 - half, slot * 4),
            (ms(1), Duration::ZERO),
            (Duration::ZERO, Duration::ZERO),
        ];
        for (i, (at, want)) in cases.into_iter().enumerate() {
            let got = s.insert_near(RegistrationId(i as u64), origin + at);
            assert_eq!(got, origin + want, "deadline {at:?}");
            let off = if got >= origin + at {
                got - (origin + at)
            } else {
                (origin + at) - got
            };
            assert!(off <= half, "deadline {at:?} served {off:?} away");
        }
        // A deadline before the origin (a clock that started earlier) is
        // due at the first slot.
        let before = origin.checked_sub(slot).unwrap_or(origin);
        assert_eq!(s.insert_near(RegistrationId(99), before), origin);
        assert_eq!(s.insert(RegistrationId(100), before), origin);
    }
}
