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
pub(super) fn after_removal<K: Eq + Hash, V, S: BuildHasher>(map: &mut HashMap<K, V, S>) {
    if map.capacity() > KEEP && map.len().saturating_mul(SPARSE) < map.capacity() {
        map.shrink_to(map.len().saturating_mul(2).max(KEEP));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
