//! A thin handle on one table shard for the loom models (compiled under loom only).

use crate::ids::RankId;
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

impl super::Index {
    /// The slot `rank` has now (`None`: unknown rank), so a model can tell a reused slot.
    pub(crate) fn slot_of(&self, rank: RankId) -> Option<u32> {
        self.ranks.get(rank).map(|e| e.slot)
    }
}

impl super::Index {
    /// The places (block words) of the prompt `keys` as far as the trie has them now.
    pub(crate) fn places_of(&self, keys: &[u64]) -> Vec<u64> {
        let guard = epoch::pin();
        let mut out = Vec::new();
        self.places(keys, 0..keys.len(), &guard, &mut out);
        out
    }

    /// Whether a run starting with local hash `first` is linked at the trie's root.
    pub(crate) fn root_run_linked(&self, first: u64) -> bool {
        let guard = epoch::pin();
        self.branches.find(0, 0, first, &guard).is_some()
    }

    /// Whether the state table has a state (any tier) of `rank` at `place`.
    pub(crate) fn has_state_at(&self, rank: RankId, place: u64) -> bool {
        let Some(slot) = self.slot_of(rank) else {
            return false;
        };
        let guard = epoch::pin();
        self.states.reusable(slot, &[place], 0b111, &guard) == 1
    }
}
