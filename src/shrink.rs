//! Giving a table's memory back after mass departures.
//!
//! A hash table keeps its capacity when entries leave: after 10,000
//! members left (issue 30, item 10d) the engine tables still held buckets
//! for 10,000, for as long as the process lived. Each table here is shrunk
//! when it falls below a quarter of its capacity, to twice what it holds
//! (room to grow again before the next resize), so a run of removals costs
//! amortised O(1) each and a table never shrinks and grows back on every
//! call at one size.

use std::collections::HashMap;

use std::hash::{BuildHasher, Hash};

/// Tables this small are never shrunk: their slack is a few KiB, and a
/// table that churns around a few dozen entries would only resize.
const KEEP: usize = 64;

/// A table is shrunk once it holds less than 1 / `SPARSE` of its capacity.
const SPARSE: usize = 4;

/// Call after removing from `map`: shrinks it when it has become sparse.
pub(crate) fn after_removal<K: Eq + Hash, V, S: BuildHasher>(map: &mut HashMap<K, V, S>) {
    if map.capacity() > KEEP && map.len().saturating_mul(SPARSE) < map.capacity() {
        map.shrink_to(map.len().saturating_mul(2).max(KEEP));
    }
}

/// Call after removing `removed` from `slab`: gives its vacant tail back
/// when it has become sparse.
///
/// A slab cannot move its records (timers and calls name their slots, and
/// a stale key finds no record past the end), so what it can give back is
/// the run of vacant slots above its highest record
/// ([`slab::Slab::shrink_to_fit`]); freed slots below stay, and are reused
/// first. The trim rebuilds the slab's free list (a walk over its slots),
/// so it runs only when the removed record was the highest: while the slab
/// is sparse that happens at most once per record still held.
pub(crate) fn after_slab_removal<T>(slab: &mut slab::Slab<T>, removed: usize) {
    if slab.capacity() > KEEP
        && slab.len().saturating_mul(SPARSE) < slab.capacity()
        && slab.iter().next_back().is_none_or(|(top, _)| top < removed)
    {
        slab.shrink_to_fit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slab_gives_its_vacant_tail_back_and_keeps_every_key_it_holds() {
        let mut slab = slab::Slab::new();
        let keys: Vec<usize> = (0..10_000u64).map(|v| slab.insert(v)).collect();
        let full = slab.capacity();
        // The first ten and one in the middle stay.
        for &k in &keys[10..] {
            if k != 5_000 {
                slab.remove(k);
                after_slab_removal(&mut slab, k);
            }
        }
        assert_eq!(slab.len(), 11);
        // Above the highest record (5,000) everything went back.
        assert!(
            slab.capacity() < 5_100,
            "capacity {} (was {full})",
            slab.capacity()
        );
        assert!((0..10).all(|k| slab[k] == k as u64));
        assert_eq!(slab[5_000], 5_000);
        // Its last record gone, the rest of the tail goes back too, and
        // new records take the low slots.
        slab.remove(5_000);
        after_slab_removal(&mut slab, 5_000);
        assert!(slab.capacity() < 16, "capacity {}", slab.capacity());
        assert_eq!(slab.insert(1), 10);
        // A removal below the highest record trims nothing.
        let mut slab: slab::Slab<u64> = (0..1_000u64).map(|v| (v as usize, v)).collect();
        for k in 0..990 {
            slab.remove(k);
            after_slab_removal(&mut slab, k);
        }
        assert!(slab.capacity() >= 1_000);
        assert!((990..1_000).all(|k| slab[k] == k as u64));
    }

    #[test]
    fn a_table_that_lost_most_of_ten_thousand_entries_gives_its_capacity_back() {
        let mut map: HashMap<u64, [u8; 64]> = HashMap::new();
        for k in 0..10_000 {
            map.insert(k, [0; 64]);
        }
        let full = map.capacity();
        for k in 0..9_990 {
            map.remove(&k);
            after_removal(&mut map);
        }
        assert_eq!(map.len(), 10);
        assert!(
            map.capacity() <= 2 * KEEP,
            "capacity {} after 9,990 of 10,000 left (was {full})",
            map.capacity()
        );
        // What stayed is intact.
        assert!((9_990..10_000).all(|k| map.contains_key(&k)));
    }

    #[test]
    fn a_small_or_well_used_table_is_left_alone() {
        // A table's reported capacity also falls by the tombstones some
        // removals leave: each is compared with a twin of the same hasher
        // (same layout) that saw the same removals and no shrinking.
        type Fixed = std::hash::BuildHasherDefault<std::collections::hash_map::DefaultHasher>;
        let twins = |n: u64| -> (HashMap<u64, u64, Fixed>, HashMap<u64, u64, Fixed>) {
            let a: HashMap<u64, u64, Fixed> = (0..n).map(|k| (k, k)).collect();
            (a.clone(), a)
        };
        let (mut map, mut twin) = twins(40);
        map.remove(&0);
        twin.remove(&0);
        after_removal(&mut map);
        assert_eq!(map.capacity(), twin.capacity(), "small: kept");
        let (mut map, mut twin) = twins(1_000);
        for k in 0..500 {
            map.remove(&k);
            twin.remove(&k);
            after_removal(&mut map);
        }
        assert_eq!(map.capacity(), twin.capacity(), "half used: kept");
    }
}
