//! [`ActiveLoads`]: one selection's lock-free view of the per-rank counters, a read guard
//! on the rank registry's snapshot taken once per selection.

use super::rank::{FloorGroup, RankMap, RankState};
use super::types::ActiveLoad;
use crate::ids::RankId;
use crate::sync::Arc;
use crate::sync::SnapshotGuard;

/// One selection's view of the per-rank counters ([`ReservationTable::loads`]).
///
/// [`ReservationTable::loads`]: super::ReservationTable::loads
pub struct ActiveLoads {
    /// A read guard, not a cloned `Arc`: every selection takes one, and a reference-count
    /// increment on the one registry would be a cache line all selecting threads write.
    pub(super) ranks: SnapshotGuard<RankMap>,
}

impl std::fmt::Debug for ActiveLoads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActiveLoads").finish_non_exhaustive()
    }
}

impl ActiveLoads {
    /// The rank's live counters (zero for a rank with no counter set). Lock-free.
    pub fn get(&self, rank: RankId) -> ActiveLoad {
        self.ranks
            .get(&rank)
            .map_or_else(ActiveLoad::default, |s| s.load())
    }

    /// How many of `prompt_blocks` are not active on `rank` (each element counted; the
    /// sequence hashes of one prompt are distinct by construction). Takes the rank's
    /// refcount lock for one lookup per block, or no lock if the rank has no active
    /// prompt blocks.
    pub fn new_blocks_not_active(&self, rank: RankId, prompt_blocks: &[u64]) -> u64 {
        match self.ranks.get(&rank) {
            Some(s) => s.new_blocks_not_active(prompt_blocks),
            None => prompt_blocks.len() as u64,
        }
    }

    /// As [`new_blocks_not_active`](Self::new_blocks_not_active) for a prompt given as its
    /// hash chain from the first block, in O(log n) lookups instead of n.
    ///
    /// Why it is exact then: every booking's prompt blocks are such a chain, and a chain
    /// hash names its whole prefix, so the blocks active on a rank are closed under
    /// prefixes. Hence the active blocks of `chain` are a prefix of it, found by binary
    /// search. (If bookings on the rank were made with lists that are not chains from the
    /// first block, this can differ from the linear count.)
    pub fn new_blocks_not_active_chain(&self, rank: RankId, chain: &[u64]) -> u64 {
        match self.ranks.get(&rank) {
            Some(s) => s.new_blocks_not_active_chain(chain),
            None => chain.len() as u64,
        }
    }

    /// A walk over the counters in rank order: for a selection's candidates, which come
    /// in rank order, each lookup is a step forward instead of a hash probe, and the
    /// states a few ranks ahead are prefetched, so their cache misses overlap.
    pub(crate) fn cursor(&self) -> LoadCursor<'_> {
        LoadCursor {
            states: self.ranks.in_rank_order(),
            at: 0,
        }
    }

    /// How many ranks have a counter set, and their fingerprint (`RankMap`).
    pub(crate) fn fingerprint(&self) -> (usize, u64) {
        (self.ranks.in_rank_order().len(), self.ranks.fingerprint())
    }

    /// The floor groups of the ranks (`floor.rs`).
    pub(crate) fn groups(&self) -> &[FloorGroup] {
        self.ranks.groups()
    }

    /// Rank-order position → index in [`groups`](Self::groups).
    pub(crate) fn group_at(&self) -> &[u32] {
        self.ranks.group_at()
    }

    /// The live counters of the rank at rank-order position `pos`. Lock-free.
    #[inline]
    pub(crate) fn load_at(&self, pos: usize) -> ActiveLoad {
        self.ranks.in_rank_order()[pos].1.load()
    }

    /// [`load_at`](Self::load_at) with `Acquire` reads (`loom_models::idle`).
    #[cfg(loom)]
    pub(crate) fn load_at_acquire(&self, pos: usize) -> ActiveLoad {
        self.ranks.in_rank_order()[pos].1.load_acquire()
    }

    /// Hints the CPU to load the counters of the rank at position `pos` (if any).
    #[inline]
    pub(crate) fn prefetch_at(&self, pos: usize) {
        if let Some((_, s)) = self.ranks.in_rank_order().get(pos) {
            prefetch(s);
        }
    }

    /// Ranks with a counter set.
    pub fn ranks(&self) -> impl Iterator<Item = (RankId, ActiveLoad)> + '_ {
        self.ranks.iter().map(|(r, s)| (*r, s.load()))
    }
}

/// How many states ahead of the current one [`LoadCursor`] prefetches.
const PREFETCH_AHEAD: usize = 8;

/// [`ActiveLoads::cursor`]: the live counters of ranks asked for in ascending order
/// (asked out of order it starts over, so the answer is always right).
pub(crate) struct LoadCursor<'a> {
    states: &'a [(RankId, Arc<RankState>)],
    at: usize,
}

impl LoadCursor<'_> {
    /// The rank's live counters (zero for a rank with no counter set). Lock-free.
    #[inline]
    pub(crate) fn get(&mut self, rank: RankId) -> ActiveLoad {
        if self.at > 0 && self.states[self.at - 1].0 >= rank {
            self.at = 0;
        }
        if self.at == 0 {
            for (_, s) in self.states.iter().take(PREFETCH_AHEAD) {
                prefetch(s);
            }
        }
        while self.states.get(self.at).is_some_and(|(r, _)| *r < rank) {
            self.at += 1;
        }
        if let Some((_, s)) = self.states.get(self.at + PREFETCH_AHEAD) {
            prefetch(s);
        }
        match self.states.get(self.at) {
            Some((r, s)) if *r == rank => {
                self.at += 1;
                s.load()
            }
            _ => ActiveLoad::default(),
        }
    }
}

/// Hints the CPU to load the line of `state`'s counters (never faults).
#[inline]
fn prefetch(state: &RankState) {
    crate::prefetch::prefetch_line(state.counters_addr());
}
