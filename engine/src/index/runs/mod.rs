//! The run index: the prompt trie stored as runs of local hashes (chain-native).
//!
//! Why: the flat index keys one node per block by its chained sequence hash, so a lookup
//! of `D` blocks chains `D` hashes and probes `D` table slots. Here a lookup follows the
//! trie: it finds the run that starts the prompt (one probe of the branch table, keyed by
//! the first local hash), compares the prompt's local hashes against the run's array (a
//! sequential scan, no hashing), and probes the branch table again only where the prompt
//! leaves the run. A prompt cached whole costs one probe and one scan.
//!
//! Structure (see `run`, `hold`, `branch`):
//! - a [`run::Run`] is a stretch of the trie: an append-only array of local hashes, and
//!   per holding rank a [`hold::Cover`] (how far that rank's walk goes in it, per tier
//!   phase), published together as one immutable state;
//! - children hang off a run at any offset, keyed by (run, offset, next local hash) in the
//!   branch table; runs are never split: a rank that stops holding a block in the middle
//!   of a run just covers less of it;
//! - each rank keeps, behind its mutex, its engine hashes → block places ([`run::BlockRef`])
//!   per tier, and per run it holds the exact offsets per tier ([`hold::Hold`]).
//!
//! Readers take no lock: a branch-table probe and a `state` load with `Acquire`, inside an
//! epoch guard. Writers take their rank's mutex for the event, and one run's mutex at a
//! time (plus a branch-table shard's, a leaf) while they change that run; two ranks contend
//! only when they change the same run at the same moment. A run no rank holds, with no
//! children and no writer inside, is unlinked and retired through the epoch.

mod branch;
pub(crate) mod hold;
pub(crate) mod run;
mod walk;
mod write;

use super::block_map::BlockMap as RankMap;
use super::event::RankId;
use super::ranks::{RankRegistry, Tally, WriterState};
use super::stats::{IndexStats, RankStats};
use crate::hash::mix::HashMixMap;
use crate::sync::atomic::{AtomicI64, AtomicU64, Ordering};

pub use walk::{RunScores, RunTieredScores};

/// Writer-side state of one rank of a run index, behind its mutex.
#[derive(Default)]
pub(crate) struct RunRankWriter {
    pub(crate) tally: Tally,
    /// Per tier: the engine's block hash → where the block lives ([`run::BlockRef`]).
    pub(crate) blocks: [RankMap; 3],
    /// Per tier: blocks this rank stored under more than one engine hash, with the number
    /// of extra names. The block is released only when its last name goes.
    pub(crate) aliases: [HashMixMap<u64, u32>; 3],
    /// Per run this rank holds blocks of (by address): which offsets, per tier.
    pub(crate) holds: HashMixMap<usize, hold::Hold>,
    pub(crate) removed: bool,
    /// Device tier, kept only `with_engine_names`: block → the engine hash last stored.
    pub(crate) names: RankMap,
}

impl WriterState for RunRankWriter {
    fn removed() -> Self {
        RunRankWriter {
            removed: true,
            ..Default::default()
        }
    }
}

impl RunRankWriter {
    /// Where the block an engine hash names lives (device, then host, then disk).
    pub(crate) fn resolve(&self, external: u64) -> Option<run::BlockRef> {
        self.blocks
            .iter()
            .find_map(|m| m.get(external))
            .map(run::BlockRef)
    }

    pub(crate) fn map_bytes(&self) -> u64 {
        let alias = |cap: usize| (cap * 8 / 7 * (12 + 1)) as u64;
        let holds = (self.holds.capacity() * 8 / 7)
            * (std::mem::size_of::<(usize, hold::Hold)>() + 1)
            + self
                .holds
                .values()
                .map(hold::Hold::heap_bytes)
                .sum::<usize>();
        self.blocks.iter().map(|m| m.bytes() as u64).sum::<u64>()
            + self.names.bytes() as u64
            + self
                .aliases
                .iter()
                .map(|m| alias(m.capacity()))
                .sum::<u64>()
            + holds as u64
    }
}

#[derive(Default)]
struct Totals {
    stored_events: AtomicU64,
    removed_events: AtomicU64,
    cleared_events: AtomicU64,
    parent_not_found: AtomicU64,
    block_not_found: AtomicU64,
    too_many_ranks: AtomicU64,
    /// Stores cut short by a branch-key collision (blocks left unindexed).
    branch_collisions: AtomicU64,
    /// Live runs and their bytes (run, state, locals array).
    runs: AtomicI64,
    run_bytes: AtomicI64,
    /// Blocks in live runs' arrays.
    run_blocks: AtomicI64,
}

/// The run index (module docs). Lookups are lock-free.
pub struct RunIndex {
    branches: branch::Branches,
    ranks: RankRegistry<RunRankWriter>,
    totals: Totals,
    engine_names: bool,
}

impl std::fmt::Debug for RunIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.stats();
        f.debug_struct("RunIndex")
            .field("ranks", &s.ranks)
            .field("holder_blocks", &s.holder_blocks)
            .finish_non_exhaustive()
    }
}

impl Default for RunIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl RunIndex {
    pub fn new() -> Self {
        Self::with_branch_shards(64, 64)
    }

    /// An index with `shards` branch-table shards of at least `min_capacity` slots (the
    /// loom models use tiny ones).
    pub(crate) fn with_branch_shards(shards: usize, min_capacity: usize) -> Self {
        RunIndex {
            branches: branch::Branches::new(shards, min_capacity),
            ranks: RankRegistry::new(),
            totals: Totals::default(),
            engine_names: false,
        }
    }

    /// Also keep, per rank, its device blocks' engine hashes, for transfer hints.
    pub fn with_engine_names(mut self, keep: bool) -> Self {
        self.engine_names = keep;
        self
    }

    /// The ranks the index currently tracks, sorted.
    pub fn ranks(&self) -> Vec<RankId> {
        let mut v: Vec<RankId> = self.ranks.entries().iter().map(|e| e.id).collect();
        v.sort_unstable();
        v
    }

    pub fn stats(&self) -> IndexStats {
        let t = &self.totals;
        let mut s = IndexStats {
            stored_events: t.stored_events.load(Ordering::Relaxed),
            removed_events: t.removed_events.load(Ordering::Relaxed),
            cleared_events: t.cleared_events.load(Ordering::Relaxed),
            parent_not_found: t.parent_not_found.load(Ordering::Relaxed),
            block_not_found: t.block_not_found.load(Ordering::Relaxed),
            too_many_ranks: t.too_many_ranks.load(Ordering::Relaxed),
            nodes: t.run_blocks.load(Ordering::Relaxed).max(0) as u64,
            table_bytes: self.branches.table_bytes()
                + t.run_bytes.load(Ordering::Relaxed).max(0) as u64,
            ..Default::default()
        };
        for e in self.ranks.entries() {
            let r = super::stats::rank_stats(&e);
            s.ranks += 1;
            s.holder_blocks += r.holder_blocks;
            for k in 0..3 {
                s.tier_blocks[k] += r.tier_blocks[k];
            }
            s.rank_map_bytes += r.rank_map_bytes;
        }
        s.bytes = s.table_bytes + s.holder_set_bytes + s.rank_map_bytes;
        s
    }

    /// Live runs, and stores cut short by a branch-key collision.
    pub fn run_counts(&self) -> (u64, u64) {
        (
            self.totals.runs.load(Ordering::Relaxed).max(0) as u64,
            self.totals.branch_collisions.load(Ordering::Relaxed),
        )
    }

    /// Counters of one rank (`None` if unknown).
    pub fn rank_stats(&self, rank: RankId) -> Option<RankStats> {
        self.ranks.get(rank).map(|e| super::stats::rank_stats(&e))
    }
}

impl Drop for RunIndex {
    fn drop(&mut self) {
        // Every run still linked is reachable only from the branch table and the ranks'
        // maps, all going away with `&mut self`: free them now.
        for e in self.ranks.entries() {
            let mut w = e.writer.lock();
            w.holds.clear();
        }
        self.branches.drain_runs();
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
