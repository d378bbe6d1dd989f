//! A thin handle on one table shard for the loom models (compiled under loom only).

use crate::sync::epoch;
use crate::table::Shard;

pub(crate) struct ShardProbe(Shard, u64);

impl ShardProbe {
    pub(crate) fn new(min_capacity: usize) -> Self {
        let s = Shard::new(min_capacity);
        let bytes = s.table_bytes();
        ShardProbe(s, bytes)
    }

    pub(crate) fn table_bytes_initial(&self) -> u64 {
        self.1
    }

    pub(crate) fn table_bytes_now(&self) -> u64 {
        self.0.table_bytes()
    }

    /// Sets `key`'s word (0 removes it), as a writer does.
    pub(crate) fn set(&self, key: u64, word: u64) {
        let guard = epoch::pin();
        self.0.set_word(key, word, &guard);
    }

    /// `key`'s word as a reader sees it (0: absent).
    pub(crate) fn read(&self, key: u64) -> u64 {
        let guard = epoch::pin();
        self.0.table(&guard).probe(key).get()
    }
}
