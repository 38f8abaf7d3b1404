//! The heartbeat schedule: the one place heartbeat deadlines live.
//!
//! Deadlines are rounded up to [`HEARTBEAT_SLOT`] boundaries and kept in a
//! map from slot to the registrations due then, so engines due within one
//! slot are served in one wake-up of the driver instead of one each (at 10k
//! engines a wake-up per millisecond was most of the service's CPU), and
//! the next deadline is the map's first key. A registration is in at most
//! one slot; its peer record holds which, so it can be moved or removed.
//!
//! Not a `DelayQueue`: the core takes `now` as an argument and never reads
//! a clock, so its timers must be plain data the driver sleeps towards.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

/// Heartbeat deadlines are rounded up to multiples of this. Next to a
/// jitter of hundreds of milliseconds this changes no engine's schedule in
/// any way that matters; every bound in this crate includes it.
pub const HEARTBEAT_SLOT: Duration = Duration::from_millis(10);

/// Registrations (`K`: how the core finds their records) by the slot
/// their next heartbeat is due in.
pub(crate) struct Schedule<K> {
    origin: Instant,
    slots: BTreeMap<Instant, Vec<K>>,
    len: usize,
    /// Emptied slot vectors, kept for the next slots (one allocation and
    /// its growth per slot, 100 slots a second, otherwise).
    spare: Vec<Vec<K>>,
}

/// Spare slot vectors kept at most.
const SPARES: usize = 8;

impl<K: Copy + PartialEq> Schedule<K> {
    pub(crate) fn new(origin: Instant) -> Self {
        Schedule {
            origin,
            slots: BTreeMap::new(),
            len: 0,
            spare: Vec::new(),
        }
    }

    /// `at`, rounded up to the next slot boundary (counted from the origin).
    pub(crate) fn slot_of(&self, at: Instant) -> Instant {
        // In u64 nanoseconds (584 years from the origin; past that,
        // saturated): a u128 division per heartbeat was measurable.
        const SLOT: u64 = HEARTBEAT_SLOT.as_nanos() as u64;
        let since = at.saturating_duration_since(self.origin);
        let since = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX - SLOT);
        self.origin + Duration::from_nanos(since.div_ceil(SLOT) * SLOT)
    }

    /// Puts `serial` in the slot of `at`; returns the slot.
    pub(crate) fn insert(&mut self, serial: K, at: Instant) -> Instant {
        let slot = self.slot_of(at);
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

    #[test]
    fn deadlines_round_up_to_slots_and_come_out_in_order() {
        let origin = Instant::now();
        let mut s = Schedule::new(origin);
        let a = s.insert(RegistrationId(1), origin + Duration::from_millis(15));
        let b = s.insert(RegistrationId(2), origin + Duration::from_millis(11));
        let c = s.insert(RegistrationId(3), origin + Duration::from_millis(3));
        assert_eq!(a, origin + Duration::from_millis(20));
        assert_eq!(a, b);
        assert_eq!(c, origin + Duration::from_millis(10));
        assert_eq!(s.next(), Some(c));
        assert!(s.pop_due(origin + Duration::from_millis(9)).is_none());
        assert_eq!(
            s.pop_due(origin + Duration::from_millis(10)),
            Some((c, vec![RegistrationId(3)]))
        );
        s.remove(RegistrationId(1), a);
        assert_eq!(s.len(), 1);
        assert_eq!(
            s.pop_due(origin + Duration::from_secs(1)),
            Some((a, vec![RegistrationId(2)]))
        );
        assert_eq!(s.len(), 0);
        assert_eq!(s.next(), None);
    }
}
