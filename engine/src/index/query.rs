//! Lookups: how many leading blocks of a prompt each rank holds. Lock-free.
//!
//! A query pins an epoch once, then probes the node table block by block; the probes of
//! the next few blocks are prefetched while the current one is examined, so a long
//! prompt's walk overlaps its cache misses. Ranks drop out at their first missing block;
//! once a single rank is left the walk only tests that rank's bit (the early exit: no
//! more set intersection), and it stops as soon as no rank is left.

use super::event::{RankId, Tier};
use super::holders::{
    entry_slot_of, entry_tiers_of, inline_entries, sole_holder_word, HolderView, Holders,
};
use super::table::{table_key, Probe};
use super::Index;
use crate::hash::extend_sequence_hashes;
use crate::sync::epoch;

/// Blocks probed ahead of the one being examined.
const PREFETCH_AHEAD: usize = 16;

/// Device-tier overlap per rank: the number of leading query blocks it holds.
/// Ranks with no overlap are absent. Sorted by rank. Reuse one value across queries to
/// keep lookups allocation-free (it keeps the walk's buffers too).
#[derive(Clone, Debug, Default)]
pub struct OverlapScores {
    pub(crate) scores: Vec<(RankId, u32)>,
    /// Walk state: slot-sorted ranks still matching, and ranks done with their score.
    pub(crate) active: Vec<u32>,
    pub(crate) done: Vec<(u32, u32)>,
}

impl PartialEq for OverlapScores {
    fn eq(&self, other: &Self) -> bool {
        self.scores == other.scores
    }
}

impl Eq for OverlapScores {}

impl OverlapScores {
    pub fn new() -> Self {
        Self::default()
    }

    /// The overlap of `rank` (0 if absent).
    pub fn get(&self, rank: RankId) -> u32 {
        match self.scores.binary_search_by_key(&rank, |e| e.0) {
            Ok(i) => self.scores[i].1,
            Err(_) => 0,
        }
    }

    pub fn as_slice(&self) -> &[(RankId, u32)] {
        &self.scores
    }

    pub fn iter(&self) -> impl Iterator<Item = (RankId, u32)> + '_ {
        self.scores.iter().copied()
    }

    pub fn len(&self) -> usize {
        self.scores.len()
    }

    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    /// The highest overlap (lowest rank on ties).
    pub fn best(&self) -> Option<(RankId, u32)> {
        self.iter().fold(None, |b, e| match b {
            Some((_, s)) if s >= e.1 => b,
            _ => Some(e),
        })
    }
}

/// One rank's tiered overlap: `device` leading blocks on the device, then `host` further
/// contiguous blocks in host memory, then `disk` further contiguous blocks on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TieredOverlap {
    pub rank: RankId,
    pub device: u32,
    pub host: u32,
    pub disk: u32,
}

/// Tiered overlap per rank (ranks with nothing on any tier are absent). Sorted by rank.
///
/// Reusing one across lookups reuses its buffers too (the walk's per-rank state), so a
/// warmed-up lookup allocates nothing however many ranks hold the prompt.
#[derive(Clone, Debug, Default)]
pub struct TieredScores {
    pub(crate) entries: Vec<TieredOverlap>,
    pub(crate) live: Vec<Walk>,
    pub(crate) done: Vec<Walk>,
}

impl PartialEq for TieredScores {
    fn eq(&self, other: &Self) -> bool {
        self.entries == other.entries
    }
}

impl Eq for TieredScores {}

/// One rank's progress through the tiers during a tiered walk.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Walk {
    pub(crate) slot: u32,
    pub(crate) phase: usize,
    pub(crate) counts: [u32; 3],
}

impl TieredScores {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn get(&self, rank: RankId) -> Option<TieredOverlap> {
        self.entries
            .binary_search_by_key(&rank, |e| e.rank)
            .ok()
            .map(|i| self.entries[i])
    }

    pub fn as_slice(&self) -> &[TieredOverlap] {
        &self.entries
    }

    pub fn iter(&self) -> impl Iterator<Item = TieredOverlap> + '_ {
        self.entries.iter().copied()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops the ranks `forget` names (their overlap counts as none); returns how many.
    pub(crate) fn forget_ranks(&mut self, forget: impl Fn(RankId) -> bool) -> usize {
        let before = self.entries.len();
        self.entries.retain(|e| !forget(e.rank));
        before - self.entries.len()
    }

    /// Replaces the contents with `entries` (in any order), keeping the buffers: how scores
    /// that do not come from a local walk are built (a remote primary's answer, see
    /// [`super::remote`], or a test fake). A rank listed twice (whatever its counts) is
    /// refused: the scores are left empty and that rank is returned. Entries with nothing
    /// on any tier are dropped, as a walk never lists them.
    pub fn fill_from(
        &mut self,
        entries: impl IntoIterator<Item = TieredOverlap>,
    ) -> Result<(), RankId> {
        self.entries.clear();
        self.entries.extend(entries);
        self.entries.sort_unstable_by_key(|e| e.rank);
        if let Some(w) = self.entries.windows(2).find(|w| w[0].rank == w[1].rank) {
            let rank = w[0].rank;
            self.entries.clear();
            return Err(rank);
        }
        self.entries.retain(|e| (e.device | e.host | e.disk) != 0);
        Ok(())
    }
}

/// Feeds a walk its blocks' holder words in order, with the probes of the next
/// [`PREFETCH_AHEAD`] blocks prepared and prefetched, so their cache misses overlap.
struct ProbeStream<'a, 'g> {
    index: &'a Index,
    seq: &'a [u64],
    guard: &'g epoch::Guard,
    ring: [Probe<'g>; PREFETCH_AHEAD],
    next: usize,
}

impl<'a, 'g> ProbeStream<'a, 'g> {
    #[inline(always)]
    fn new(index: &'a Index, seq: &'a [u64], guard: &'g epoch::Guard) -> Self {
        let first = index.prepare(seq[0], guard);
        let mut ring = [first; PREFETCH_AHEAD];
        for (i, &s) in seq.iter().enumerate().take(PREFETCH_AHEAD) {
            let p = index.prepare(s, guard);
            p.prefetch();
            ring[i] = p;
        }
        ProbeStream {
            index,
            seq,
            guard,
            ring,
            next: 0,
        }
    }

    /// The holder word of the next block. Never called past the end of `seq`.
    #[inline(always)]
    fn next_word(&mut self) -> Holders {
        let i = self.next;
        self.next += 1;
        let p = self.ring[i % PREFETCH_AHEAD];
        if let Some(&ahead) = self.seq.get(i + PREFETCH_AHEAD) {
            let q = self.index.prepare(ahead, self.guard);
            q.prefetch();
            self.ring[i % PREFETCH_AHEAD] = q;
        }
        p.get()
    }
}

impl Index {
    #[inline(always)]
    fn prepare<'g>(&self, seq: u64, guard: &'g epoch::Guard) -> Probe<'g> {
        let key = table_key(seq);
        self.shard(key).table(guard).probe(key)
    }

    /// Hashes `local_hashes` into `seq` (cleared first) unless nobody holds block 0, so a
    /// miss costs the same whatever the prompt's length: block 0 is hashed and its slot
    /// prefetched, the next [`PREFETCH_AHEAD`] blocks are hashed while that load is in
    /// flight, and the rest only if block 0 has a holder (on any tier). Returns whether
    /// it has (`false`: no rank holds any prefix of the prompt; `seq` is then partial).
    #[inline]
    fn hash_if_block0_held(
        &self,
        local_hashes: &[u64],
        seq: &mut Vec<u64>,
        guard: &epoch::Guard,
    ) -> bool {
        seq.clear();
        let Some((&first, rest)) = local_hashes.split_first() else {
            return false;
        };
        extend_sequence_hashes(None, &[first], seq);
        let probe = self.prepare(seq[0], guard);
        probe.prefetch();
        let (head, tail) = rest.split_at(rest.len().min(PREFETCH_AHEAD));
        extend_sequence_hashes(Some(seq[0]), head, seq);
        if probe.get().is_empty() {
            return false;
        }
        extend_sequence_hashes(seq.last().copied(), tail, seq);
        true
    }

    /// Device overlap of a prompt given as local (per-block) hashes.
    pub fn find_matches(&self, local_hashes: &[u64]) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_into(local_hashes, &mut out);
        out
    }

    /// As [`Index::find_matches`], into a reused result.
    pub fn find_matches_into(&self, local_hashes: &[u64], out: &mut OverlapScores) {
        // The chain in one of the thread's spare buffers: no allocation once warm,
        // whether or not the caller reuses `out`.
        let mut seq = crate::recycle::take_hashes();
        // One pin serves the first probe and the walk.
        let guard = epoch::pin();
        if self.hash_if_block0_held(local_hashes, &mut seq, &guard) {
            self.device_walk(&seq, out, &guard);
        } else {
            out.scores.clear();
        }
        crate::recycle::give_hashes(seq);
    }

    /// Device overlap of a prompt given as sequence hashes (see [`crate::hash`]): the
    /// index work alone. Takes no lock and never waits for a writer.
    pub fn find_matches_by_sequence(&self, seq: &[u64], out: &mut OverlapScores) {
        self.device_walk(seq, out, &epoch::pin());
    }

    /// [`Index::find_matches_by_sequence`] inside the caller's pin.
    fn device_walk(&self, seq: &[u64], out: &mut OverlapScores, guard: &epoch::Guard) {
        out.scores.clear();
        let n = seq.len();
        if n == 0 {
            return;
        }
        let mut words = ProbeStream::new(self, seq, guard);
        let dev = Tier::Device.bit();
        let mut active = std::mem::take(&mut out.active);
        let mut done = std::mem::take(&mut out.done);
        active.clear();
        done.clear();
        let mut prev = words.next_word();
        // SAFETY: the word was loaded with Acquire inside `guard`, which stays pinned for
        // the whole walk (this holds for every `view`/`tiers_of`/`for_each` below).
        unsafe {
            prev.for_each(|slot, tiers| {
                if tiers & dev != 0 {
                    active.push(slot)
                }
            })
        };
        let mut sole = if active.len() == 1 {
            sole_holder_word(active[0], dev)
        } else {
            0
        };
        let mut i = 1;
        while i < n && !active.is_empty() {
            let w = words.next_word();
            let at = i as u32;
            if w == prev {
                // Same holders as the previous block (holder sets are interned, so equal
                // sets are equal words): the active ranks all continue.
                i += 1;
                continue;
            }
            prev = w;
            if active.len() == 1 && sole == 0 {
                sole = sole_holder_word(active[0], dev);
            }
            if active.len() == 1 {
                // Early exit from set intersection: one comparison per block while the
                // rank is the node's sole, device-only holder, else one bit test.
                // SAFETY: see above.
                if w.0 != sole && unsafe { w.tiers_of(active[0]) } & dev == 0 {
                    done.push((active[0], at));
                    active.clear();
                }
            } else {
                // SAFETY: see above.
                match unsafe { w.view() } {
                    HolderView::Empty => done.extend(active.drain(..).map(|s| (s, at))),
                    HolderView::Inline(word) => active.retain(|s| {
                        let held = inline_entries(word).any(|(e, t)| e == *s && t & dev != 0);
                        if !held {
                            done.push((*s, at));
                        }
                        held
                    }),
                    HolderView::Heap(entries) => {
                        // Both sides are slot-sorted: one merge pass.
                        let mut j = 0;
                        active.retain(|s| {
                            while j < entries.len() && entry_slot_of(entries[j]) < *s {
                                j += 1;
                            }
                            let held = j < entries.len()
                                && entry_slot_of(entries[j]) == *s
                                && entry_tiers_of(entries[j]) & dev != 0;
                            if !held {
                                done.push((*s, at));
                            }
                            held
                        });
                    }
                }
            }
            i += 1;
        }
        done.extend(active.drain(..).map(|s| (s, n as u32)));
        // Translate after the walk: every slot read above is still owned by its rank
        // while `guard` is pinned, and a rank created meanwhile is already listed.
        let rank_of = self.ranks.translator(guard);
        out.scores.extend(
            done.iter()
                .filter_map(|&(s, score)| rank_of(s).map(|r| (r, score))),
        );
        out.scores.sort_unstable_by_key(|e| e.0);
        out.active = active;
        out.done = done;
    }

    /// Tiered overlap of a prompt given as local hashes.
    pub fn find_matches_tiered(&self, local_hashes: &[u64]) -> TieredScores {
        let mut out = TieredScores::new();
        self.find_matches_tiered_into(local_hashes, &mut out);
        out
    }

    /// As [`Index::find_matches_tiered`], into a reused result.
    pub fn find_matches_tiered_into(&self, local_hashes: &[u64], out: &mut TieredScores) {
        // The chain in one of the thread's spare buffers: no allocation once warm,
        // whether or not the caller reuses `out`.
        let mut seq = crate::recycle::take_hashes();
        // One pin serves the first probe and the walk.
        let guard = epoch::pin();
        if self.hash_if_block0_held(local_hashes, &mut seq, &guard) {
            self.tiered_walk(&seq, out, &guard);
        } else {
            out.entries.clear();
        }
        crate::recycle::give_hashes(seq);
    }

    /// Tiered overlap by sequence hashes: per rank the device prefix `d`, then how many
    /// further contiguous blocks the host tier holds, then the disk tier.
    pub fn find_matches_tiered_by_sequence(&self, seq: &[u64], out: &mut TieredScores) {
        self.tiered_walk(seq, out, &epoch::pin());
    }

    /// [`Index::find_matches_tiered_by_sequence`] inside the caller's pin.
    fn tiered_walk(&self, seq: &[u64], out: &mut TieredScores, guard: &epoch::Guard) {
        out.entries.clear();
        let n = seq.len();
        if n == 0 {
            return;
        }
        fn step(w: &mut Walk, tiers: u8) -> bool {
            while w.phase < 3 && tiers & (1 << w.phase) == 0 {
                w.phase += 1;
            }
            if w.phase < 3 {
                w.counts[w.phase] += 1;
                true
            } else {
                false
            }
        }
        let mut words = ProbeStream::new(self, seq, guard);
        let mut live = std::mem::take(&mut out.live);
        let mut done = std::mem::take(&mut out.done);
        live.clear();
        done.clear();
        // SAFETY: loaded with Acquire inside `guard`, which stays pinned for the whole walk
        // (this holds for every `for_each`/`tiers_of` below).
        unsafe {
            words.next_word().for_each(|slot, tiers| {
                let mut w = Walk {
                    slot,
                    phase: 0,
                    counts: [0; 3],
                };
                if step(&mut w, tiers) {
                    live.push(w);
                }
            })
        };
        let mut i = 1;
        while i < n && !live.is_empty() {
            let word = words.next_word();
            let mut k = 0;
            while k < live.len() {
                // SAFETY: see above.
                let tiers = unsafe { word.tiers_of(live[k].slot) };
                if step(&mut live[k], tiers) {
                    k += 1;
                } else {
                    done.push(live.swap_remove(k));
                }
            }
            i += 1;
        }
        done.append(&mut live);
        let rank_of = self.ranks.translator(guard);
        out.entries.extend(done.iter().filter_map(|w| {
            rank_of(w.slot).map(|rank| TieredOverlap {
                rank,
                device: w.counts[0],
                host: w.counts[1],
                disk: w.counts[2],
            })
        }));
        out.entries.sort_unstable_by_key(|e| e.rank);
        out.live = live;
        out.done = done;
    }
}
