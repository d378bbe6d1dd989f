//! What the index holds and what it refused, for operators and for the memory targets.

use super::Index;
use crate::ids::RankId;
use crate::sync::atomic::Ordering;

/// Index-wide figures. Event and refusal counters are totals since creation (removed
/// ranks included); block counts and bytes are current.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Ranks the index tracks.
    pub ranks: u64,
    /// Blocks stored in live runs: the distinct prefixes the index keeps. A block no rank
    /// holds any more stays counted until its run goes (when nothing holds any of it).
    pub nodes: u64,
    /// (rank, block) pairs held on any tier.
    pub holder_blocks: u64,
    /// (rank, block) pairs per tier: device, host, disk.
    pub tier_blocks: [u64; 3],
    /// All index memory: `table_bytes + holder_set_bytes + rank_map_bytes`.
    pub bytes: u64,
    /// The lock-free read structure: the branch table, the recurrent-state table (hybrid
    /// models) and the runs (headers, states with their covers, local-hash arrays).
    pub table_bytes: u64,
    /// Always 0: kvr's first index kept heap holder sets; covers live in the runs' states
    /// (counted in `table_bytes`).
    pub holder_set_bytes: u64,
    /// The ranks' external-hash maps (writer side; estimated from their capacities).
    pub rank_map_bytes: u64,
    /// Always 0: the runs are the lineage a dump needs.
    pub lineage_bytes: u64,
    /// `Stored` events received (those refused for an unknown parent included).
    pub stored_events: u64,
    /// `Removed` events received.
    pub removed_events: u64,
    /// `Cleared` events received.
    pub cleared_events: u64,
    /// Stores rejected because their parent was unknown.
    pub parent_not_found: u64,
    /// Removed hashes that the rank did not hold.
    pub block_not_found: u64,
    /// Events refused because the rank limit was reached.
    pub too_many_ranks: u64,
}

impl IndexStats {
    /// All index bytes per (rank, block) pair.
    pub fn bytes_per_holder_block(&self) -> f64 {
        self.bytes as f64 / self.holder_blocks.max(1) as f64
    }
}

/// One rank's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankStats {
    /// The rank (`None` only in a default value).
    pub rank: Option<RankId>,
    /// Blocks it holds, on any tier.
    pub holder_blocks: u64,
    /// Blocks it holds per tier: device, host, disk.
    pub tier_blocks: [u64; 3],
    /// Its `Stored` events (those refused for an unknown parent included).
    pub stored_events: u64,
    /// Its `Removed` events.
    pub removed_events: u64,
    /// Its `Cleared` events.
    pub cleared_events: u64,
    /// Its stores rejected because their parent was unknown.
    pub parent_not_found: u64,
    /// Removed hashes it did not hold.
    pub block_not_found: u64,
    /// Its external-hash maps, bytes (estimated from their capacities).
    pub rank_map_bytes: u64,
}

impl Index {
    /// The index-wide figures, each counter read on its own (not one consistent snapshot).
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
                + self.states.table_bytes()
                + t.run_bytes.load(Ordering::Relaxed).max(0) as u64,
            ..Default::default()
        };
        for e in self.ranks.entries() {
            let r = rank_stats(&e);
            s.ranks += 1;
            s.holder_blocks += r.holder_blocks;
            for k in 0..3 {
                s.tier_blocks[k] += r.tier_blocks[k];
            }
            s.rank_map_bytes += r.rank_map_bytes;
        }
        s.bytes = s.table_bytes + s.holder_set_bytes + s.rank_map_bytes + s.lineage_bytes;
        s
    }

    /// One rank's figures; `None` if the index does not track it.
    pub fn rank_stats(&self, rank: RankId) -> Option<RankStats> {
        self.ranks.get(rank).map(|e| rank_stats(&e))
    }
}

pub(crate) fn rank_stats<W>(e: &super::ranks::RankEntry<W>) -> RankStats {
    let c = &e.counters;
    let ld = |a: &crate::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    RankStats {
        rank: Some(e.id),
        holder_blocks: ld(&c.holder_blocks),
        tier_blocks: [
            ld(&c.tier_blocks[0]),
            ld(&c.tier_blocks[1]),
            ld(&c.tier_blocks[2]),
        ],
        stored_events: ld(&c.stored_events),
        removed_events: ld(&c.removed_events),
        cleared_events: ld(&c.cleared_events),
        parent_not_found: ld(&c.parent_not_found),
        block_not_found: ld(&c.block_not_found),
        rank_map_bytes: ld(&c.map_bytes),
    }
}
