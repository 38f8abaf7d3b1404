//! The heartbeat schedule: the one place heartbeat deadlines live.
//!
//! Deadlines go to [`HEARTBEAT_SLOT`] boundaries and are kept by slot
//! (see [`Schedule`]), so engines due within one slot are served in one
//! wake-up of the driver instead of one each (at 10k engines a wake-up per
//! millisecond was most of the service's CPU). A registration is in at
//! most one slot; its peer record holds which, so it can be moved or
//! removed.
//!
//! A deadline that may be served a little early (a jittered round's) goes
//! to the nearest boundary ([`Schedule::insert_near`]); one that must not
//! (a round the rate cap deferred) to the next ([`Schedule::insert`]).
//!
//! Not a `DelayQueue`: the core takes `now` as an argument and never reads
//! a clock, so its timers must be plain data the driver sleeps towards.

use std::collections::BTreeMap;
use std::time::Duration;

use std::time::Instant;

/// Heartbeat deadlines go to multiples of this (from the service's start),
/// or of half the heartbeat interval where that is shorter (5 ms at the
/// shortest interval, 10 ms).
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
///
/// A timing wheel: the [`WHEEL`] slots from `base` on are buckets of a
/// ring, found by the slot's number (an insert is an index and a push; a
/// map's search per round was a twentieth of the service's CPU at 10k
/// engines), with a bitmap of the buckets in use for finding the next.
/// A slot outside the ring's window (a deadline further out than the ring
/// reaches, or one already passed) goes to an ordered map; every question
/// asks both, so the map is only slower, never different.
pub(crate) struct Schedule<K> {
    origin: Instant,
    /// The slot, in nanoseconds (never 0).
    slot: u64,
    /// Slot numbers (from `origin`) `base..base + WHEEL` may be in the
    /// ring, at their number modulo [`WHEEL`].
    base: u64,
    ring: Box<[Vec<K>]>,
    /// Bit `i`: `ring[i]` is not empty.
    used: [u64; WHEEL / 64],
    /// Registrations in the ring.
    in_ring: usize,
    /// Slots outside the ring's window, by number.
    far: BTreeMap<u64, Vec<K>>,
    len: usize,
    /// Emptied slot vectors, kept for the next slots (one allocation and
    /// its growth per slot, 50 slots a second, otherwise).
    spare: Vec<Vec<K>>,
}

/// Slots the ring holds: 10.24 s of 20 ms slots, more than the default
/// interval and jitter (5 s +/- 0.5 s) reach.
const WHEEL: usize = 512;

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
            base: 0,
            ring: (0..WHEEL).map(|_| Vec::new()).collect(),
            used: [0; WHEEL / 64],
            in_ring: 0,
            far: BTreeMap::new(),
            len: 0,
            spare: Vec::new(),
        }
    }

    /// Nanoseconds from the origin to `at` (0 before it; saturated 584
    /// years after it).
    fn since(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.origin);
        u64::try_from(since.as_nanos())
            .unwrap_or(u64::MAX)
            .min(u64::MAX - self.slot)
    }

    /// The number of the first slot boundary not before `at`.
    fn number_up(&self, at: Instant) -> u64 {
        self.since(at).div_ceil(self.slot)
    }

    /// The instant slot number `n` begins.
    fn instant(&self, n: u64) -> Instant {
        self.origin + Duration::from_nanos(n.saturating_mul(self.slot))
    }

    /// Puts `serial` in the first slot not before `at`; returns the slot.
    pub(crate) fn insert(&mut self, serial: K, at: Instant) -> Instant {
        let n = self.number_up(at);
        self.put(serial, n)
    }

    /// Puts `serial` in the slot nearest `at` (half a slot early at most;
    /// due at once if that slot has passed); returns the slot.
    pub(crate) fn insert_near(&mut self, serial: K, at: Instant) -> Instant {
        let n = self
            .since(at)
            .saturating_sub(self.slot / 2)
            .div_ceil(self.slot);
        self.put(serial, n)
    }

    fn put(&mut self, serial: K, n: u64) -> Instant {
        if self.in_ring == 0 {
            // An empty ring starts wherever the first slot is.
            self.base = n;
        }
        if n >= self.base && n - self.base < WHEEL as u64 {
            let i = n as usize % WHEEL;
            let bucket = &mut self.ring[i];
            if bucket.capacity() == 0 {
                if let Some(spare) = self.spare.pop() {
                    *bucket = spare;
                }
            }
            bucket.push(serial);
            self.used[i / 64] |= 1 << (i % 64);
            self.in_ring += 1;
        } else {
            let spare = &mut self.spare;
            self.far
                .entry(n)
                .or_insert_with(|| spare.pop().unwrap_or_default())
                .push(serial);
        }
        self.len += 1;
        self.instant(n)
    }

    /// Takes `serial` out of `slot`.
    pub(crate) fn remove(&mut self, serial: K, slot: Instant) {
        let n = self.number_up(slot);
        if n >= self.base && n - self.base < WHEEL as u64 {
            let i = n as usize % WHEEL;
            let bucket = &mut self.ring[i];
            if let Some(at) = bucket.iter().position(|&s| s == serial) {
                bucket.swap_remove(at);
                self.in_ring -= 1;
                self.len -= 1;
                if bucket.is_empty() {
                    self.used[i / 64] &= !(1 << (i % 64));
                }
                return;
            }
        }
        if let Some(serials) = self.far.get_mut(&n) {
            if let Some(at) = serials.iter().position(|&s| s == serial) {
                serials.swap_remove(at);
                self.len -= 1;
                if serials.is_empty() {
                    if let Some(empty) = self.far.remove(&n) {
                        self.recycle(empty);
                    }
                }
            }
        }
    }

    /// The number of the ring's earliest slot in use.
    fn ring_first(&self) -> Option<u64> {
        if self.in_ring == 0 {
            return None;
        }
        // The window's slots in order are the ring's indices from
        // `base`'s onwards, wrapping once.
        let start = self.base as usize % WHEEL;
        let words = WHEEL / 64;
        for k in 0..=words {
            let w = (start / 64 + k) % words;
            let mut bits = self.used[w];
            if k == 0 {
                bits &= u64::MAX << (start % 64);
            }
            if bits != 0 {
                let i = w * 64 + bits.trailing_zeros() as usize;
                let ahead = (i + WHEEL - start) % WHEEL;
                return Some(self.base + ahead as u64);
            }
        }
        unreachable!("in_ring counts a registration the bitmap does not show")
    }

    /// The earliest slot with a registration in it, by number.
    fn first(&self) -> Option<u64> {
        let far = self.far.keys().next().copied();
        match (self.ring_first(), far) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The earliest slot with a registration in it.
    pub(crate) fn next(&self) -> Option<Instant> {
        self.first().map(|n| self.instant(n))
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
    /// with [`Schedule::recycle`]). A slot can come out twice (once from
    /// the ring, once from the map), each time with its own registrations.
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(Instant, Vec<K>)> {
        let n = self.first()?;
        if self.instant(n) > now {
            return None;
        }
        let serials = match self.far.first_entry() {
            Some(entry) if *entry.key() == n => entry.remove(),
            _ => {
                let i = n as usize % WHEEL;
                self.used[i / 64] &= !(1 << (i % 64));
                let serials = std::mem::take(&mut self.ring[i]);
                self.in_ring -= serials.len();
                // Every slot before `n` is empty: the window moves on.
                self.base = n + 1;
                serials
            }
        };
        self.len -= serials.len();
        Some((self.instant(n), serials))
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

    #[derive(Clone, Debug)]
    enum Op {
        /// A deadline `ms` from now (negative: already passed), nearest or
        /// not before.
        Insert { ms: i64, near: bool },
        /// Takes out the `i`-th scheduled registration (modulo how many).
        Remove { i: usize },
        /// Moves the clock on and pops every slot due.
        Advance { ms: u64 },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            // Mostly within the ring's reach, some far beyond it or passed.
            4 => (-100i64..3_000, any::<bool>()).prop_map(|(ms, near)| Op::Insert { ms, near }),
            1 => (-30_000i64..30_000, any::<bool>()).prop_map(|(ms, near)| Op::Insert { ms, near }),
            1 => any::<usize>().prop_map(|i| Op::Remove { i }),
            3 => (0u64..400).prop_map(|ms| Op::Advance { ms }),
            1 => (0u64..20_000).prop_map(|ms| Op::Advance { ms }),
        ]
    }

    proptest::proptest! {
        /// The ring and its map answer exactly as one ordered map of
        /// slots would (the schedule before the ring), whatever the order
        /// of inserts, removals and pops, with slots of either length.
        #[test]
        fn the_ring_behaves_as_an_ordered_map_of_slots(
            ops in proptest::collection::vec(op(), 1..300),
            short in proptest::prelude::any::<bool>(),
        ) {
            let slot = if short { ms(5) } else { HEARTBEAT_SLOT };
            let origin = Instant::now();
            // Start a while after the origin, so that passed deadlines can
            // fall before it too.
            let mut now = origin + Duration::from_secs(1);
            let mut s = Schedule::new(origin, slot);
            let mut model: BTreeMap<Instant, Vec<u64>> = BTreeMap::new();
            let mut scheduled: Vec<(u64, Instant)> = Vec::new();
            let mut next_key = 0u64;
            let slot_ns = slot.as_nanos() as u64;
            let round = |at: Instant, near: bool| {
                let since = at.saturating_duration_since(origin).as_nanos() as u64;
                let since = if near { since.saturating_sub(slot_ns / 2) } else { since };
                origin + Duration::from_nanos(since.div_ceil(slot_ns) * slot_ns)
            };
            for op in ops {
                match op {
                    Op::Insert { ms: d, near } => {
                        let at = if d >= 0 {
                            now + ms(d as u64)
                        } else {
                            now.checked_sub(ms(d.unsigned_abs())).unwrap_or(origin)
                        };
                        let key = next_key;
                        next_key += 1;
                        let got = if near { s.insert_near(key, at) } else { s.insert(key, at) };
                        let want = round(at, near);
                        proptest::prop_assert_eq!(got, want);
                        model.entry(want).or_default().push(key);
                        scheduled.push((key, want));
                    }
                    Op::Remove { i } => {
                        if scheduled.is_empty() {
                            continue;
                        }
                        let (key, at) = scheduled.swap_remove(i % scheduled.len());
                        s.remove(key, at);
                        let keys = model.get_mut(&at).unwrap();
                        keys.retain(|&k| k != key);
                        if keys.is_empty() {
                            model.remove(&at);
                        }
                    }
                    Op::Advance { ms: d } => {
                        now += ms(d);
                        let mut got = Vec::new();
                        let mut last = None;
                        while let Some((at, keys)) = s.pop_due(now) {
                            proptest::prop_assert!(last <= Some(at), "slots out of order");
                            last = Some(at);
                            got.extend(keys.iter().map(|&k| (at, k)));
                            s.recycle(keys);
                        }
                        let mut want = Vec::new();
                        while let Some(entry) = model.first_entry() {
                            if *entry.key() > now {
                                break;
                            }
                            let (at, keys) = entry.remove_entry();
                            want.extend(keys.into_iter().map(|k| (at, k)));
                        }
                        got.sort();
                        want.sort();
                        scheduled.retain(|(k, _)| !want.iter().any(|(_, w)| w == k));
                        proptest::prop_assert_eq!(got, want);
                    }
                }
                proptest::prop_assert_eq!(s.next(), model.keys().next().copied());
                proptest::prop_assert_eq!(s.len(), scheduled.len());
            }
        }
    }
}
