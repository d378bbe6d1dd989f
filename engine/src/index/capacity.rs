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
//! (`engine/tests/garbage_events.rs`). Bounded by [`MAX_RESERVED_BLOCKS`] per rank, so a
//! registered number cannot drive an unbounded allocation. A clear keeps the size (the
//! cache refills); removing the rank frees it.

use crate::ids::{RankId, Tier, WorkerId};

use super::{Index, IndexError, RankWriter};
use crate::hash::mix::HashMixMap;
use crate::sync::Mutex;

/// The most blocks one rank's map is sized for ahead (about 20 MiB of map).
pub const MAX_RESERVED_BLOCKS: u64 = 1 << 20;

/// Registered device capacities by worker (blocks per rank). A leaf lock, taken once per
/// rank lifetime by its writer and by the host's registration: never on a read path.
#[derive(Default)]
pub(crate) struct Capacities(Mutex<HashMixMap<WorkerId, u64>>);

impl Capacities {
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
    /// [`MAX_RESERVED_BLOCKS`]) and keeps that size through evictions and clears. It
    /// creates the rank's entry, as its first event would: the host's word for a rank it
    /// registered, not the wire's.
    pub fn reserve_blocks(&self, rank: RankId, tier: Tier, blocks: u64) -> Result<(), IndexError> {
        let n = capped(blocks);
        self.with_writer(rank, true, |_, w| {
            w.sized = true;
            w.blocks[tier as usize].reserve(n)
        })
        .map(|_| ())
    }

    /// At a rank's first accepted store: sizes its device map for its worker's registered
    /// capacity, if any.
    pub(super) fn size_once(&self, rank: RankId, w: &mut RankWriter) {
        if w.sized {
            return;
        }
        w.sized = true;
        let n = capped(self.capacities.get(rank.worker_id));
        if n > 0 {
            w.blocks[Tier::Device as usize].reserve(n);
        }
    }
}

/// A capacity in blocks as a map size, bounded by [`MAX_RESERVED_BLOCKS`].
fn capped(blocks: u64) -> usize {
    blocks.min(MAX_RESERVED_BLOCKS) as usize
}
