//! A thin handle on one node-table shard for the loom models (compiled under loom only).

use super::table::Shard;
use super::Tier;
use crate::sync::epoch;

pub(crate) struct ShardProbe(Shard, u64, super::holders::Interner);

impl ShardProbe {
    pub(crate) fn new(min_capacity: usize) -> Self {
        let s = Shard::new(min_capacity);
        let bytes = s.table_bytes();
        ShardProbe(s, bytes, super::holders::Interner::new())
    }

    pub(crate) fn table_bytes_initial(&self) -> u64 {
        self.1
    }

    pub(crate) fn table_bytes_now(&self) -> u64 {
        self.0.table_bytes()
    }

    /// Adds or removes `slot` as a device holder of `key`, as a writer does.
    pub(crate) fn set(&self, key: u64, slot: u32, add: bool) {
        let guard = epoch::pin();
        self.0
            .update(key, slot, Tier::Device.bit(), add, &self.2, &guard);
    }

    /// The slots holding `key`, as a reader sees them (sorted).
    pub(crate) fn read(&self, key: u64) -> Vec<u32> {
        let guard = epoch::pin();
        let w = self.0.table(&guard).probe(key).get();
        let mut v = Vec::new();
        // SAFETY: loaded with Acquire inside `guard`, which is still pinned.
        unsafe { w.for_each(|s, _| v.push(s)) };
        v.sort_unstable();
        v
    }
}
