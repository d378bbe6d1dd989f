//! Lookups: how many leading blocks of a prompt each rank holds. Lock-free walks down the
//! trie.
//!
//! A walk pins an epoch, finds the run that starts the prompt (one branch-table probe),
//! counts how many of the prompt's keys equal the run's, settles each rank by its cover
//! there, and probes the branch table again only where the prompt goes on past what
//! matched. A prompt nobody holds costs one probe, whatever its length.

use super::rank_order::RankOrder;
use super::run::{Run, View};
use super::Index;
use crate::ids::{RankId, Tier};
use crate::sync::{self, epoch};

/// Device-tier overlap per rank: the number of leading query blocks it holds.
/// Ranks with no overlap are absent. Sorted by rank. Reuse one value across queries to
/// keep lookups allocation-free (it keeps the walk's buffers too).
#[derive(Clone, Debug, Default)]
pub struct OverlapScores {
    pub(crate) scores: Vec<(RankId, u32)>,
    /// Walk state: slot-sorted ranks still matching, and ranks done with their score.
    pub(crate) active: Vec<u32>,
    pub(crate) done: Vec<(u32, u32)>,
    /// The prompt's places, for hybrid ranks (`recurrent`).
    pub(crate) places: Vec<u64>,
    /// The buffers that put the answer in rank order (`rank_order`).
    pub(crate) order: RankOrder<(RankId, u32)>,
}

impl PartialEq for OverlapScores {
    fn eq(&self, other: &Self) -> bool {
        self.scores == other.scores
    }
}

impl Eq for OverlapScores {}

impl OverlapScores {
    /// No scores yet: a value to reuse across lookups.
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

    /// Each rank with its overlap (in blocks), sorted by rank.
    pub fn as_slice(&self) -> &[(RankId, u32)] {
        &self.scores
    }

    /// Each rank with its overlap (in blocks), in rank order.
    pub fn iter(&self) -> impl Iterator<Item = (RankId, u32)> + '_ {
        self.scores.iter().copied()
    }

    /// Ranks with some overlap.
    pub fn len(&self) -> usize {
        self.scores.len()
    }

    /// No rank holds the query's first block on its device.
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
    /// The rank.
    pub rank: RankId,
    /// Leading query blocks it holds on the device.
    pub device: u32,
    /// Further contiguous blocks it holds in host memory.
    pub host: u32,
    /// Further contiguous blocks it holds on disk.
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
    /// The prompt's places, for hybrid ranks (`recurrent`).
    pub(crate) places: Vec<u64>,
    /// The buffers that put the answer in rank order (`rank_order`).
    pub(crate) order: RankOrder<TieredOverlap>,
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
    /// No scores yet: a value to reuse across lookups.
    pub fn new() -> Self {
        Self::default()
    }

    /// The tiered overlap of `rank` (`None` if it holds nothing of the query).
    pub fn get(&self, rank: RankId) -> Option<TieredOverlap> {
        self.entries
            .binary_search_by_key(&rank, |e| e.rank)
            .ok()
            .map(|i| self.entries[i])
    }

    /// Each rank's tiered overlap, sorted by rank.
    pub fn as_slice(&self) -> &[TieredOverlap] {
        &self.entries
    }

    /// Each rank's tiered overlap, in rank order.
    pub fn iter(&self) -> impl Iterator<Item = TieredOverlap> + '_ {
        self.entries.iter().copied()
    }

    /// Ranks that hold some of the query on some tier.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// No rank holds any of the query.
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
    /// [`RemoteIndex`](crate::RemoteIndex), or a test fake). A rank listed twice (whatever its counts) is
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

/// What a walk tracks across the runs a prompt passes through: which ranks still hold
/// every block so far, and the settled ones with their counts.
trait Walker {
    /// The run that starts the prompt, `m` of its blocks matched.
    fn first_run(&mut self, v: &View<'_>, m: usize);
    /// A later run, `pos` blocks matched before it and `m` in it.
    fn next_run(&mut self, v: &View<'_>, pos: usize, m: usize);
    /// Whether some rank still holds every block matched so far.
    fn any_live(&self) -> bool;
}

impl Index {
    /// The one lock-free walk both queries share: from `run`, the run that starts the
    /// prompt ([`Index::start`]), through each run the prompt follows, handing `state` each
    /// run's view and how many of the prompt's blocks it matches, until no rank holds the
    /// whole prefix, the prompt leaves the trie or it ends. Returns how many blocks
    /// matched.
    #[inline(always)]
    fn walk<'g>(
        &self,
        mut run: &'g Run,
        locals: &[u64],
        guard: &'g epoch::Guard,
        state: &mut impl Walker,
    ) -> usize {
        let mut pos = 0usize;
        let mut first_run = true;
        loop {
            let v = run.view(guard);
            let m = v.matching(&locals[pos..]);
            if m == 0 {
                break;
            }
            if first_run {
                first_run = false;
                state.first_run(&v, m);
            } else {
                state.next_run(&v, pos, m);
            }
            pos += m;
            if !state.any_live() || pos == locals.len() {
                break;
            }
            let here = run as *const _ as usize;
            match self.branches.find(here, m as u32, locals[pos], guard) {
                Some(c) => run = c,
                None => break,
            }
        }
        pos
    }

    /// The run that starts the prompt (one branch-table probe), if any: a miss ends here.
    #[inline(always)]
    fn start<'g>(&self, locals: &[u64], guard: &'g epoch::Guard) -> Option<&'g Run> {
        self.branches.find(0, 0, *locals.first()?, guard)
    }

    /// Device overlap of a prompt given as local hashes.
    pub fn find_matches(&self, locals: &[u64]) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_into(locals, &mut out);
        out
    }

    /// As [`Index::find_matches`], into a reused result (allocation-free once warm).
    pub fn find_matches_into(&self, locals: &[u64], out: &mut OverlapScores) {
        out.scores.clear();
        let guard = sync::query_pin();
        let Some(run) = self.start(locals, &guard) else {
            return;
        };
        let mut walk = DeviceWalk {
            active: std::mem::take(&mut out.active),
            done: std::mem::take(&mut out.done),
        };
        walk.active.clear();
        walk.done.clear();
        let pos = self.walk(run, locals, &guard, &mut walk);
        let DeviceWalk {
            mut active,
            mut done,
        } = walk;
        done.extend(active.drain(..).map(|s| (s, pos as u32)));
        self.cut_to_states(locals, &guard, &mut done, &mut out.places);
        // Translate after the walk: every slot read above is still owned by its rank while
        // `guard` is pinned (slots are reused only past the epoch).
        let rank_of = self.ranks.translator(&guard);
        out.scores.extend(
            done.iter()
                .filter_map(|&(s, score)| rank_of(s).map(|r| (r, score))),
        );
        out.order.sort(&mut out.scores, |e| e.0);
        out.active = active;
        out.done = done;
    }

    /// Tiered overlap of a prompt given as local hashes.
    pub fn find_matches_tiered(&self, locals: &[u64]) -> TieredScores {
        let mut out = TieredScores::new();
        self.find_matches_tiered_into(locals, &mut out);
        out
    }

    /// Per rank the device prefix, then how many further contiguous blocks the host tier
    /// holds, then the disk tier; into a reused result.
    pub fn find_matches_tiered_into(&self, locals: &[u64], out: &mut TieredScores) {
        out.entries.clear();
        let guard = sync::query_pin();
        let Some(run) = self.start(locals, &guard) else {
            return;
        };
        let mut walk = TieredWalk {
            live: std::mem::take(&mut out.live),
            done: std::mem::take(&mut out.done),
        };
        walk.live.clear();
        walk.done.clear();
        self.walk(run, locals, &guard, &mut walk);
        let TieredWalk { mut live, mut done } = walk;
        done.append(&mut live);
        self.cut_tiered_to_states(locals, &guard, &mut done, &mut out.places);
        let rank_of = self.ranks.translator(&guard);
        out.entries.extend(done.iter().filter_map(|w| {
            rank_of(w.slot).map(|rank| TieredOverlap {
                rank,
                device: w.counts[0],
                host: w.counts[1],
                disk: w.counts[2],
            })
        }));
        out.order.sort(&mut out.entries, |e| e.rank);
        out.live = live;
        out.done = done;
    }
}

/// The device walk: slot-sorted ranks holding every block so far (`active`), and ranks
/// settled with their device prefix (`done`).
struct DeviceWalk {
    active: Vec<u32>,
    done: Vec<(u32, u32)>,
}

impl Walker for DeviceWalk {
    #[inline(always)]
    fn first_run(&mut self, v: &View<'_>, m: usize) {
        for c in v.covers.iter().filter(|c| c.d > 0) {
            if (c.d as usize) < m {
                self.done.push((c.slot, c.d as u32));
            } else {
                self.active.push(c.slot);
            }
        }
    }

    #[inline(always)]
    fn next_run(&mut self, v: &View<'_>, pos: usize, m: usize) {
        let (active, done) = (&mut self.active, &mut self.done);
        if active.len() == 1 {
            let s = active[0];
            let d = v.cover(s).map_or(0, |c| c.d as usize);
            if d < m {
                done.push((s, (pos + d) as u32));
                active.clear();
            }
            return;
        }
        // Both slot-sorted: one merge pass.
        let covers = v.covers;
        let mut j = 0;
        active.retain(|&s| {
            while j < covers.len() && covers[j].slot < s {
                j += 1;
            }
            let d = match covers.get(j) {
                Some(c) if c.slot == s => c.d as usize,
                _ => 0,
            };
            if d < m {
                done.push((s, (pos + d) as u32));
            }
            d >= m
        });
    }

    #[inline(always)]
    fn any_live(&self) -> bool {
        !self.active.is_empty()
    }
}

/// The tiered walk: per rank still walking, its tier phase and counts so far (`live`), and
/// the settled ones (`done`).
struct TieredWalk {
    live: Vec<Walk>,
    done: Vec<Walk>,
}

impl Walker for TieredWalk {
    #[inline(always)]
    fn first_run(&mut self, v: &View<'_>, m: usize) {
        for c in v.covers {
            let r = c.walk(0, m as u32);
            let w = Walk {
                slot: c.slot,
                phase: r.phase.unwrap_or(0) as usize,
                counts: r.counts,
            };
            match r.phase {
                Some(_) => self.live.push(w),
                None if r.counts != [0; 3] => self.done.push(w),
                None => {}
            }
        }
    }

    #[inline(always)]
    fn next_run(&mut self, v: &View<'_>, _pos: usize, m: usize) {
        let covers = v.covers;
        let done = &mut self.done;
        let mut j = 0;
        self.live.retain_mut(|w| {
            while j < covers.len() && covers[j].slot < w.slot {
                j += 1;
            }
            let c = match covers.get(j) {
                Some(c) if c.slot == w.slot => *c,
                _ => Default::default(),
            };
            let r = c.walk(w.phase as u8, m as u32);
            for t in 0..3 {
                w.counts[t] += r.counts[t];
            }
            match r.phase {
                Some(p) => {
                    w.phase = p as usize;
                    true
                }
                None => {
                    done.push(*w);
                    false
                }
            }
        });
    }

    #[inline(always)]
    fn any_live(&self) -> bool {
        !self.live.is_empty()
    }
}

impl Index {
    /// The engine's hashes of `rank`'s device blocks at positions `range` of the prompt
    /// `keys`, in order, into `out` (cleared), stopping at the first block the rank does not
    /// hold on its device or whose name is not kept: what a transfer hint names. Empty
    /// unless the index keeps names ([`Index::with_engine_names`]). Walks the trie without
    /// a lock, then reads the rank's names under its writer lock, briefly.
    pub fn engine_names(
        &self,
        rank: RankId,
        keys: &[u64],
        range: std::ops::Range<usize>,
        out: &mut Vec<u64>,
    ) {
        out.clear();
        if !self.engine_names || range.is_empty() || range.end > keys.len() {
            return;
        }
        let Some(entry) = self.ranks.get(rank) else {
            return;
        };
        let guard = epoch::pin();
        let mut places: Vec<u64> = Vec::with_capacity(range.len());
        self.places(keys, range, &guard, &mut places);
        let w = entry.writer.lock();
        if w.removed {
            return;
        }
        let device = Tier::Device as usize;
        out.extend(places.iter().map_while(|&r| {
            let name = w.names.get(r)?;
            (w.blocks[device].get(name).map(|p| w.runs.block_ref(p).0) == Some(r)).then_some(name)
        }));
    }
}

impl Index {
    /// The places (`BlockRef` words) of positions `range` of the prompt `keys`, as far as
    /// the trie has them (a prompt that leaves the trie early gives fewer).
    pub(super) fn places(
        &self,
        keys: &[u64],
        range: std::ops::Range<usize>,
        guard: &epoch::Guard,
        out: &mut Vec<u64>,
    ) {
        let Some(&first) = keys.first() else {
            return;
        };
        let Some(mut run) = self.branches.find(0, 0, first, guard) else {
            return;
        };
        let end = range.end.min(keys.len());
        let mut pos = 0usize;
        while pos < end {
            let v = run.view(guard);
            let m = v.matching(&keys[pos..end]);
            for off in 0..m {
                if pos + off >= range.start {
                    out.push(super::run::BlockRef::new(run, off as u32).0);
                }
            }
            pos += m;
            if m == 0 || pos >= end {
                break;
            }
            match self
                .branches
                .find(run as *const _ as usize, m as u32, keys[pos], guard)
            {
                Some(c) => run = c,
                None => break,
            }
        }
    }

    /// On which tiers `rank` holds the last block of the prompt `keys` (bit `t` for tier
    /// `t`; 0: not held, or the prompt is not in the index), whatever it holds before it:
    /// a block-level check for tests and diagnostics (lookups score prefixes). Takes the
    /// rank's writer lock briefly.
    pub fn block_tiers(&self, rank: RankId, keys: &[u64]) -> u8 {
        let Some(entry) = self.ranks.get(rank) else {
            return 0;
        };
        let guard = epoch::pin();
        let mut places = Vec::with_capacity(1);
        self.places(
            keys,
            keys.len().saturating_sub(1)..keys.len(),
            &guard,
            &mut places,
        );
        let Some(&r) = places.first() else {
            return 0;
        };
        let r = super::run::BlockRef(r);
        let w = entry.writer.lock();
        match w.holds.get(&r.run_addr()) {
            Some(h) if !w.removed => (0..3)
                .filter(|&t| h.has(t, r.offset()))
                .fold(0u8, |m, t| m | 1 << t),
            _ => 0,
        }
    }
}
