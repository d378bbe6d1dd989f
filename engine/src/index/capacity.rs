//! Sizing a rank's engine-hash map for its worker's KV capacity.
//!
//! Why: a rank map grown block by block rehashes every entry about twice on the way to
//! its size (growth ×1.5); on an index built from empty those rehashes were about a third
//! of the store time (`perf` of the side-by-side bench). An engine's device cache holds at
//! most its capacity, which the host registers (`WorkerInfo::total_kv_blocks`, Dynamo's
//! `kv_total_blocks`), and a running engine's cache stays near full, so a map sized once
//! for it is the size the map reaches anyway, at its highest load, with no growth.
//!
//! When: at the rank's first accepted store, not at registration, so a registration no
//! engine ever publishes for costs nothing, and refused events still create nothing
//! (`engine/tests/garbage_events.rs`). Bounded by [`MAX_RESERVED_BLOCKS`] per rank and by
//! [`MAX_RESERVED_BLOCKS_PER_INDEX`] for all the ranks of an index (one partition's), so
//! neither a registered number nor many ranks can drive an unbounded allocation (a
//! worker of 1,024 DP ranks at the per-rank bound alone would have taken 13 GiB): a rank
//! past the index's budget gets what is left of it, then grows its map as it fills, with
//! a growth step stopping at the capacity's size rather than passing it (so a full
//! cache's map ends as dense as a reserved one: at 64M holder-blocks, where the budget
//! covers an eighth of the ranks, maps grown in plain 1.5× steps sat 64-96 % full). A
//! clear keeps the size (the cache refills); removing the rank frees it and gives its
//! share back to the budget.

use crate::ids::{RankId, Tier, WorkerId};

use super::{Index, IndexError, RankWriter};
use crate::hash::mix::HashMixMap;
use crate::sync::Mutex;

/// The most blocks one rank's map is sized for ahead (about 13 MiB of map).
pub const MAX_RESERVED_BLOCKS: u64 = 1 << 20;

/// The most blocks all the ranks of one index (a partition's) are sized for ahead
/// together, 8 × [`MAX_RESERVED_BLOCKS`] (about 105 MiB of maps): e.g. 80 ranks of
/// 100,000 blocks each. Ranks past it grow their maps as they fill.
pub const MAX_RESERVED_BLOCKS_PER_INDEX: u64 = 8 * MAX_RESERVED_BLOCKS;

/// Registered device capacities by worker (blocks per rank). A leaf lock, taken once per
/// rank lifetime by its writer and by the host's registration: never on a read path.
/// Also the blocks of [`MAX_RESERVED_BLOCKS_PER_INDEX`] the ranks' maps took so far.
#[derive(Default)]
pub(crate) struct Capacities(Mutex<HashMixMap<WorkerId, u64>>, Mutex<u64>);

impl Capacities {
    /// Takes up to `blocks` of the index's sizing budget: what it may size for.
    fn take(&self, blocks: u64) -> u64 {
        let mut used = self.1.lock();
        let n = blocks.min(MAX_RESERVED_BLOCKS_PER_INDEX.saturating_sub(*used));
        *used += n;
        n
    }

    fn give_back(&self, blocks: u64) {
        let mut used = self.1.lock();
        *used = used.saturating_sub(blocks);
    }

    /// The blocks of the budget taken now.
    fn taken(&self) -> u64 {
        *self.1.lock()
    }

    fn set(&self, worker: WorkerId, blocks: u64) {
        let mut m = self.0.lock();
        if blocks == 0 {
            m.remove(&worker);
        } else {
            m.insert(worker, blocks);
        }
    }

    fn get(&self, worker: WorkerId) -> u64 {
        // Under loom, a rank's first store does not take this leaf lock: it orders
        // nothing (a sizing hint), and would only multiply the models' interleavings.
        #[cfg(loom)]
        {
            let _ = worker;
            0
        }
        #[cfg(not(loom))]
        self.0.lock().get(&worker).copied().unwrap_or(0)
    }
}

impl Index {
    /// Registers `worker`'s device KV capacity, in blocks per rank (0 forgets it). Each of
    /// its ranks' device maps is sized for it at the rank's first accepted store (module
    /// docs); ranks already sized keep their size.
    pub fn set_worker_capacity(&self, worker: WorkerId, device_blocks_per_rank: u64) {
        self.capacities.set(worker, device_blocks_per_rank);
    }

    /// Sizes `rank`'s map on `tier` for `blocks` blocks now (bounded by
    /// [`MAX_RESERVED_BLOCKS`] and by what is left of [`MAX_RESERVED_BLOCKS_PER_INDEX`])
    /// and keeps that size through evictions and clears. It creates the rank's entry, as
    /// its first event would: the host's word for a rank it registered, not the wire's.
    pub fn reserve_blocks(&self, rank: RankId, tier: Tier, blocks: u64) -> Result<(), IndexError> {
        self.with_writer(rank, true, |_, w| {
            w.sized = true;
            self.size_map(w, tier, capped(blocks));
        })
        .map(|_| ())
    }

    /// The blocks of [`MAX_RESERVED_BLOCKS_PER_INDEX`] the ranks' maps were sized for.
    pub fn reserved_blocks(&self) -> u64 {
        self.capacities.taken()
    }

    /// A removed rank's share of the sizing budget goes back to it.
    pub(super) fn release_reserved(&self, w: &mut RankWriter) {
        self.capacities.give_back(std::mem::take(&mut w.reserved));
    }

    /// At a rank's first accepted store: sizes its device map for its worker's registered
    /// capacity, if any.
    pub(super) fn size_once(&self, rank: RankId, w: &mut RankWriter) {
        if w.sized {
            return;
        }
        w.sized = true;
        let want = capped(self.capacities.get(rank.worker_id));
        if want > 0 {
            self.size_map(w, Tier::Device, want);
        }
    }

    /// Sizes the rank's `tier` map for `want` blocks, as much of it ahead as the index's
    /// budget has left, and caps the growth of the rest at that size (module docs).
    fn size_map(&self, w: &mut RankWriter, tier: Tier, want: u64) {
        let n = self.capacities.take(want);
        w.reserved += n;
        let map = &mut w.blocks[tier as usize];
        map.reserve(n as usize);
        if n < want {
            map.cap_growth(want as usize);
        }
    }
}

/// A capacity in blocks, bounded by [`MAX_RESERVED_BLOCKS`].
fn capped(blocks: u64) -> u64 {
    blocks.min(MAX_RESERVED_BLOCKS)
}
