//! A `u64 → u64` map with lock-free reads: the sharded table of `crate::table` (the one
//! under the index's branch table). The engine's selection-id
//! → partition index is one: a lifecycle call finds its booking's partition without a
//! lock; writers serialize per shard.

use crate::sync::epoch;
use crate::table::{table_key, Shard, Shards};

pub(crate) struct IdMap {
    shards: Shards,
}

impl IdMap {
    /// `min_capacity`: slots a shard keeps however few keys it holds. Why: keys that are
    /// never reused (selection ids) leave a tombstone per removal, and a shard is rebuilt
    /// (a new table, the old one retired through the epoch) when live keys and tombstones
    /// fill it; a shard sized for its few live keys was rebuilt every few inserts, and
    /// freeing the retired tables in crossbeam's periodic collection made every 64th
    /// booked selection of the selection harness its slowest.
    pub(crate) fn new(shards: usize, min_capacity: usize) -> Self {
        IdMap {
            shards: Shards::new(shards, min_capacity),
        }
    }

    fn shard(&self, key: u64) -> &Shard {
        self.shards.of(key)
    }

    /// The value of `key`. Lock-free; never waits for a writer.
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        let k = table_key(key);
        let guard = epoch::pin();
        let w = self.shard(k).table(&guard).probe(k).get();
        (w != 0).then_some(w)
    }

    /// Sets `key` to `value` (which must not be 0); returns the old value.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn insert(&self, key: u64, value: u64) -> Option<u64> {
        assert_ne!(value, 0, "0 means absent in an IdMap");
        let k = table_key(key);
        let guard = epoch::pin();
        let old = self.shard(k).set_word(k, value, &guard);
        (old != 0).then_some(old)
    }

    /// Sets `key` to `value` unless it is present; `Err(existing)` if it was.
    pub(crate) fn insert_new(&self, key: u64, value: u64) -> Result<(), u64> {
        assert_ne!(value, 0, "0 means absent in an IdMap");
        let k = table_key(key);
        let guard = epoch::pin();
        match self.shard(k).set_word_if_absent(k, value, &guard) {
            0 => Ok(()),
            existing => Err(existing),
        }
    }

    /// Removes `key`; returns its value.
    pub(crate) fn remove(&self, key: u64) -> Option<u64> {
        let k = table_key(key);
        let guard = epoch::pin();
        let old = self.shard(k).set_word(k, 0, &guard);
        (old != 0).then_some(old)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::IdMap;
    use std::collections::HashMap;

    #[test]
    fn behaves_like_a_hash_map() {
        let m = IdMap::new(4, 8);
        let mut model = HashMap::new();
        let mut x = 0x1234_5678_9abc_def0u64;
        for i in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 5_000;
            match i % 3 {
                0 | 1 => {
                    let v = i + 1;
                    assert_eq!(m.insert(key, v), model.insert(key, v));
                }
                _ => assert_eq!(m.remove(key), model.remove(&key)),
            }
            if i % 997 == 0 {
                for k in 0..5_000 {
                    assert_eq!(m.get(k), model.get(&k).copied());
                }
            }
        }
        assert_eq!(m.get(0), model.get(&0).copied());
        let fresh = 1u64 << 40;
        assert_eq!(m.insert_new(fresh, 5), Ok(()));
        assert_eq!(m.insert_new(fresh, 6), Err(5));
        assert_eq!(m.get(fresh), Some(5));
    }
}
