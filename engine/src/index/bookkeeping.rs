//! A rank writer's bookkeeping, shared by stores (`write`) and evictions (`evict`): the
//! runs an event touched, a name's release, and the event's counter changes.

use smallvec::SmallVec;

use super::ranks::{RankEntry, Tally};
use super::run::BlockRef;
use super::RankWriter;
use crate::sync::atomic::{AtomicU64, Ordering};

/// Blocks whose rank-map slots are prefetched ahead of the one being recorded.
pub(super) const PREFETCH_AHEAD: usize = 8;

/// Runs an event touched, with the pins it holds on each.
#[derive(Default)]
pub(super) struct Touched {
    pub(super) runs: SmallVec<[(usize, u32); 8]>,
}

impl Touched {
    pub(super) fn add(&mut self, addr: usize, pins: u32) {
        // Consecutive blocks mostly share a run: the last entry first.
        if let Some(last) = self.runs.last_mut().filter(|(a, _)| *a == addr) {
            last.1 += pins;
            return;
        }
        match self.runs.iter_mut().find(|(a, _)| *a == addr) {
            Some(e) => e.1 += pins,
            None => self.runs.push((addr, pins)),
        }
    }
}

/// One engine name of the block at `r` on tier `t` went away: release the block unless
/// another name still holds it.
pub(super) fn drop_name(w: &mut RankWriter, t: usize, r: BlockRef, touched: &mut Touched) {
    drop_names(w, t, r.run_addr(), &[r.offset()], touched);
}

/// [`drop_name`] for blocks of one run, at `offsets`: the run's hold is looked up once
/// (an eviction removes a request's blocks, mostly a run's in order).
pub(super) fn drop_names(
    w: &mut RankWriter,
    t: usize,
    run: usize,
    offsets: &[u32],
    touched: &mut Touched,
) {
    let RankWriter {
        holds,
        aliases,
        tally,
        hold_heap,
        states,
        ..
    } = w;
    let mut hold = holds.get_mut(&run);
    let heap = hold.as_ref().map_or(0, |h| h.heap_bytes());
    let mut dropped = false;
    for &offset in offsets {
        if !aliases[t].is_empty() {
            // Another engine hash of this rank names the block: it stays held.
            let block = BlockRef::from_parts(run, offset).0;
            if let Some(n) = aliases[t].get_mut(&block) {
                *n -= 1;
                if *n == 0 {
                    aliases[t].remove(&block);
                }
                continue;
            }
        }
        let Some(hold) = hold.as_deref_mut() else {
            continue;
        };
        if hold.clear(t, offset) {
            dropped = true;
            tally.tier_blocks[t] -= 1;
            if !hold.has_any(offset) {
                tally.holder_blocks -= 1;
                if !states.is_empty() {
                    states.orphaned.push(BlockRef::from_parts(run, offset).0);
                }
            }
        }
    }
    if let Some(hold) = hold {
        // A clear can free the lower tiers' box.
        *hold_heap = *hold_heap + hold.heap_bytes() - heap;
    }
    if dropped {
        touched.add(run, 0);
    }
}

/// Applies one event's counter changes at once.
pub(super) fn settle(entry: &RankEntry<RankWriter>, tally: &mut Tally) {
    let tally = std::mem::take(tally);
    let c = &entry.counters;
    let add = |a: &AtomicU64, d: i64| {
        if d != 0 {
            a.fetch_add(d as u64, Ordering::Relaxed);
        }
    };
    for t in 0..3 {
        add(&c.tier_blocks[t], tally.tier_blocks[t]);
    }
    add(&c.holder_blocks, tally.holder_blocks);
}
