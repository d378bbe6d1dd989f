//! Evictions on the run index: removals by engine hash, a rank's prefix-cache reset, and
//! a rank's or a worker's departure. A removal resolves each engine hash through the
//! rank's map to its block and clears the rank's hold bit there, a run's blocks under one
//! hold lookup; the runs touched get the rank's cover republished as a store's do.

use smallvec::SmallVec;

use super::bookkeeping::{drop_names, settle, Touched, PREFETCH_AHEAD};
use super::event::ApplyOutcome;
use super::ranks::RankEntry;
use super::{Index, RankWriter};
use crate::ids::{RankId, Tier};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::epoch;

impl Index {
    /// Removes blocks (by the engine's hashes) from `rank`'s `tier`. Unknown hashes are
    /// counted as `block_not_found`; the rest still apply.
    pub fn remove(&self, rank: RankId, tier: Tier, external_hashes: &[u64]) -> ApplyOutcome {
        let counted = |c: Option<&AtomicU64>, n: usize| {
            if n > 0 {
                self.totals
                    .block_not_found
                    .fetch_add(n as u64, Ordering::Relaxed);
                if let Some(c) = c {
                    c.fetch_add(n as u64, Ordering::Relaxed);
                }
            }
        };
        self.totals.removed_events.fetch_add(1, Ordering::Relaxed);
        let r = self.with_writer(rank, false, |entry, w| {
            entry
                .counters
                .removed_events
                .fetch_add(1, Ordering::Relaxed);
            let guard = epoch::pin();
            let t = tier as usize;
            let mut out = ApplyOutcome::default();
            let mut touched = Touched::default();
            // The run whose blocks are being removed, and their offsets: dropped together.
            let (mut run, mut offsets) = (0usize, SmallVec::<[u32; 128]>::new());
            for &h in external_hashes.iter().take(PREFETCH_AHEAD) {
                w.blocks[t].prefetch(h);
            }
            for (j, &h) in external_hashes.iter().enumerate() {
                if let Some(&next) = external_hashes.get(j + PREFETCH_AHEAD) {
                    w.blocks[t].prefetch(next);
                }
                match w.blocks[t].remove(h) {
                    Some(p) => {
                        let r = w.runs.block_ref(p);
                        if tier == Tier::Device && w.names.get(r.0) == Some(h) {
                            w.names.remove(r.0);
                        }
                        if r.run_addr() != run && !offsets.is_empty() {
                            drop_names(w, t, run, &offsets, &mut touched);
                            offsets.clear();
                        }
                        run = r.run_addr();
                        offsets.push(r.offset());
                        out.removed += 1;
                    }
                    None => out.not_found += 1,
                }
            }
            if !offsets.is_empty() {
                drop_names(w, t, run, &offsets, &mut touched);
            }
            self.finish(entry.slot, w, &touched, &guard);
            counted(Some(&entry.counters.block_not_found), out.not_found);
            out
        });
        match r {
            Ok(Some(out)) => out,
            _ => {
                counted(None, external_hashes.len());
                ApplyOutcome {
                    not_found: external_hashes.len(),
                    ..Default::default()
                }
            }
        }
    }

    /// Drops every block of `rank` (a prefix-cache reset). Returns the names removed.
    pub fn clear(&self, rank: RankId) -> usize {
        self.totals.cleared_events.fetch_add(1, Ordering::Relaxed);
        self.with_writer(rank, false, |entry, w| {
            entry
                .counters
                .cleared_events
                .fetch_add(1, Ordering::Relaxed);
            self.empty_rank(entry, w)
        })
        .ok()
        .flatten()
        .unwrap_or(0)
    }

    fn empty_rank(&self, entry: &RankEntry<RankWriter>, w: &mut RankWriter) -> usize {
        let guard = epoch::pin();
        let removed: usize = w.blocks.iter().map(|m| m.len()).sum();
        for t in 0..3 {
            w.blocks[t].clear();
            w.aliases[t] = Default::default();
        }
        w.names = Default::default();
        w.states.clear(&self.states, entry.slot, false, &guard);
        let mut touched = Touched::default();
        for (&addr, hold) in w.holds.iter_mut() {
            let (tiers, any) = hold.counts();
            for (total, n) in w.tally.tier_blocks.iter_mut().zip(tiers) {
                *total -= n;
            }
            w.tally.holder_blocks -= any;
            let heap = hold.heap_bytes();
            hold.clear_all();
            w.hold_heap = w.hold_heap + hold.heap_bytes() - heap;
            touched.add(addr, 0);
        }
        self.finish(entry.slot, w, &touched, &guard);
        settle(entry, &mut w.tally);
        entry
            .counters
            .map_bytes
            .store(w.map_bytes(), Ordering::Relaxed);
        removed
    }

    /// Drops every rank of `worker_id`. Returns the number of ranks removed.
    pub fn remove_worker(&self, worker_id: u64) -> usize {
        let mut n = 0;
        for entry in self.ranks.entries() {
            if entry.id.worker_id != worker_id {
                continue;
            }
            let mut w = entry.writer.lock();
            if w.removed {
                continue;
            }
            self.empty_rank(&entry, &mut w);
            w.removed = true;
            self.release_reserved(&mut w);
            self.forget_rank(&entry, &mut w);
            n += 1;
        }
        n
    }

    /// Removes one rank entirely (its blocks, counters and slot).
    pub fn remove_rank(&self, rank: RankId) -> bool {
        let Some(entry) = self.ranks.get(rank) else {
            return false;
        };
        let mut w = entry.writer.lock();
        if w.removed {
            return false;
        }
        self.empty_rank(&entry, &mut w);
        w.removed = true;
        self.release_reserved(&mut w);
        self.forget_rank(&entry, &mut w);
        true
    }

    /// Forgets a removed rank whose holders are emptied: its hybrid mark (and any state
    /// left) is cleared after its slot stops translating to it, so a reader that sees the
    /// mark gone also sees the rank gone (else it would list the rank with its whole
    /// attention prefix), and before the slot can be reused (else a new rank in it would
    /// be hybrid).
    fn forget_rank(&self, entry: &RankEntry<RankWriter>, w: &mut RankWriter) {
        let unmark = |w: &mut RankWriter| {
            w.states
                .clear(&self.states, entry.slot, true, &epoch::pin())
        };
        #[cfg(loom)]
        if crate::sync::faults::get().unmark_after_free {
            self.ranks.forget(entry, || {});
            unmark(w);
            return;
        }
        self.ranks.forget(entry, || unmark(w));
    }
}
