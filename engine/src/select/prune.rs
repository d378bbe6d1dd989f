//! Pruned candidates: at fleet scale, step 3 without reading every rank's counters.
//!
//! Why: a selection over thousands of ranks spent most of its time reading each rank's
//! booking counters (a cache line per rank) and pricing ranks that could not win. Both
//! models' costs only rise with a rank's booked prefill tokens, decode blocks and
//! requests (and fall with nothing else a booking changes), so the cost of a rank with the
//! group's floors (`reservation/floor.rs`) in place of its counters, with no KV pressure
//! and only as much of the prompt counted new as its decode blocks cannot hold, is a
//! lower bound of its cost. A group's floors may each come from another member (the one
//! with least prefill may hold the most decode); its combined floors, of `p + λ·d` at a few
//! weights λ, tighten the bound of each of its ranks, cached or not, to what a single
//! member can reach.
//! The pass:
//!
//! 1. read every group's floor (a few words per 64 ranks) and price, with it, each rank
//!    the lookup found (its cached tiers known) and each group's ranks that hold nothing
//!    of the prompt (all of them alike);
//! 2. read and price for real the rank with the lowest bound, then the group of uncached
//!    ranks with the lowest bound, then every rank and group whose bound does not exceed
//!    the best upper bound so far (the whole prompt counted new; the exact cost can only
//!    be lower).
//!
//! Whatever is left out has a bound above a cost that some priced rank reaches, so it can
//! neither win nor tie at temperature 0; ties are all priced (a bound equal to the best
//! is kept). A group whose ranks were all read raises its floor to their minimum on the
//! way, so bounds that went slack as loads rose tighten again. Floors start at zero and
//! only that raises them, so when queries are held by many ranks and never need an
//! uncached one, no group would be read: the group with the most cached members priced
//! (at least `REFRESH_AFTER`) is read at the end of the pass to raise its floors.
//!
//! A cached rank's bound is its group's floors with its own overlap, so each group's
//! floors are priced once as a cost against any cache credit (`cost/credit_form.rs`),
//! and each cached rank then costs a few multiply-adds, not a cost of its own.
//!
//! A group that counts no live booking (`reservation/idle.rs`) and whose uncached ranks
//! share one capacity prices those ranks as one candidate (`idle.rs`): with every counter
//! at zero they cost the same, and on an idle fleet every rank ties, which made the pass
//! price them all.
//!
//! Used only where that argument holds, else the full walk runs: temperature 0, no credit
//! decay (it reads the exact minimum over all ranks), no session steering, no busy
//! threshold, overload or availability hook, every rank a candidate, cost knobs that do
//! not make a load cheaper, and the booking registry listing exactly the worker set's
//! ranks (same count and fingerprint; then both are in rank order, so a position in one
//! is the same rank in the other). The mean booked prefill the latency model reads is the
//! table's running sum over the ranks, the same figure the full walk sums. (A booking that
//! races its worker's removal may leave the removed rank a counter set; the registries
//! then differ, and the full walk runs until that rank registers or is removed again.)

use super::idle;
use super::overlap::shared_beyond;
use super::scratch::{Candidates, Collapsed, PruneScratch};
use super::{SelectRequest, Selector};
use crate::config::CostConfig;
use crate::cost::{takes_argmin, CostEval, LoadColumns, LoadRow, RequestShape};
use crate::hooks::{BlockRange, HostHooks};
use crate::ids::RankId;
use crate::index::TieredOverlap;
use crate::reservation::{ActiveLoad, ActiveLoads, FloorKind, FloorRead, FLOOR_WORDS};
use crate::workers::{RankSlot, WorkerSet};

/// Below this many ranks the pass is not used: at 256 ranks it halved the median but made
/// the p99 worse than the full walk (`fleet-bench select --workers 32`, docs/benchmarks.md).
pub(crate) const PRUNE_MIN_RANKS: usize = 512;

/// With at least one overlap per this many ranks, the overlaps are matched to ranks by
/// walking the ranks, not by searching for each.
const DENSE_OVERLAPS: usize = 16;

/// How many members ahead a group's walk prefetches their counters.
const PREFETCH_AHEAD: usize = 8;

/// A group that had this many cached members priced in one selection has its floors
/// raised (its members read) before the selection ends.
const REFRESH_AFTER: u32 = 8;

/// What the pruned pass reads.
pub(super) struct PruneInput<'a> {
    pub(super) workers: &'a WorkerSet,
    pub(super) hooks: &'a HostHooks,
    pub(super) loads: &'a ActiveLoads,
    pub(super) overlaps: &'a [TieredOverlap],
    pub(super) shared: &'a [BlockRange],
    pub(super) n_blocks: usize,
}

/// Whether no knob makes a higher load cheaper (NaN counts as no).
fn monotone(cfg: &CostConfig) -> bool {
    let l = &cfg.latency;
    [
        cfg.prefill_load_scale,
        cfg.decode_active_request_weight,
        l.decode_block_us,
        l.itl_per_request_ms,
        l.kv_pressure_ms,
    ]
    .iter()
    .all(|&k| k >= 0.0)
}

/// The first position at or after `from` whose rank is not below `rank`, by galloping
/// (the overlaps come in rank order, so each search starts where the last one ended).
fn gallop(slots: &[RankSlot], from: usize, rank: RankId) -> usize {
    let mut lo = from;
    let mut step = 1;
    let mut hi = from;
    while hi < slots.len() && slots[hi].rank < rank {
        lo = hi + 1;
        hi = from + step;
        step *= 2;
    }
    let hi = hi.min(slots.len());
    lo + slots[lo..hi].partition_point(|s| s.rank < rank)
}

impl Selector<'_> {
    /// The pruned candidates into `c.eligible` / `c.cols`, and the request shape with its
    /// selection-wide figures; `None` when the pass does not apply (the caller walks every
    /// rank). See the module docs.
    pub(super) fn pruned_candidates(
        &self,
        req: &SelectRequest<'_>,
        every_rank: bool,
        input: &PruneInput<'_>,
        cfg: &CostConfig,
        shape: RequestShape,
        c: &mut Candidates,
    ) -> Option<RequestShape> {
        c.prune.collapsed.clear();
        if cfg!(loom) {
            return None;
        }
        let slots = input.workers.slots();
        let n = slots.len();
        let busy = self.config().busy;
        let steered = self.sessions.is_some() && req.effective_session().is_some();
        if !every_rank
            || n < PRUNE_MIN_RANKS
            || steered
            || !takes_argmin(cfg.temperature)
            || cfg.credit_decay.is_some_and(|d| d > 0.0)
            || !monotone(cfg)
            || busy.decode_blocks_fraction.is_some()
            || busy.prefill_tokens.is_some()
            || busy.prefill_tokens_fraction.is_some()
            || input.hooks.overload.is_some()
            || input.loads.fingerprint() != (n, input.workers.fingerprint())
        {
            return None;
        }
        let loads = input.loads;
        let groups = loads.groups();
        let group_at = loads.group_at();
        let sum = self.bookings.prefill_sum();
        let mut shape = shape.with_min_active_prefill_tokens(0);
        shape.mean_active_prefill_tokens = sum as f64 / n as f64;
        let eval = CostEval::new(cfg, &shape);

        // 1. Bounds: every group's floor read before any counter (floor.rs's raise).
        let cold_shared = shared_beyond(input.shared, 0, input.n_blocks as u32);
        let whole = input.n_blocks as u64;
        // A candidate's row: its cached tiers (none for an uncached rank) and `a`'s loads.
        let row = |t: Option<&TieredOverlap>, a: ActiveLoad, kv_blocks: u64| {
            let device = t.map_or(0, |o| o.device);
            LoadRow {
                device,
                host: t.map_or(0, |o| o.host),
                disk: t.map_or(0, |o| o.disk),
                shared: match t {
                    Some(_) => shared_beyond(input.shared, device, input.n_blocks as u32),
                    None => cold_shared,
                },
                prefill_tokens: a.active_prefill_tokens,
                decode_blocks: a.active_decode_blocks,
                requests: a.active_requests,
                kv_blocks,
            }
        };
        // The bound: the group's floors for the loads, no KV pressure (capacity unknown),
        // and as new only what the decode blocks cannot hold (a rank's active prompt
        // blocks are among them, so decode + new is at least max(decode, whole)).
        let floored = |f: &FloorRead, t: Option<&TieredOverlap>| {
            let floors = ActiveLoad {
                active_prefill_tokens: f.bound(FloorKind::PrefillTokens),
                active_decode_blocks: f.bound(FloorKind::DecodeBlocks),
                active_requests: f.bound(FloorKind::Requests),
            };
            row(t, floors, 0).candidate(whole.saturating_sub(floors.active_decode_blocks))
        };
        // The combined bounds (floor.rs) tighten a group's: for slopes `a` per prefill
        // token and `t` per decode block (`load_slopes`), a member's cost over `base`
        // (prefill and decode each at their own floor) is at least
        // `a·(G(t/a) − F_p − (t/a)·max(F_d, whole))`, where `G(λ)` bounds the least
        // `p + λ·d` over the members (`MixAt::bound`), since `a·p + t·max(d, whole)`
        // is at least `a·(p + (t/a)·d)`. The figure depends on the group alone, so it
        // tightens the bound of its uncached ranks and of each cached member alike (a
        // cached rank's overlap lowers its prompt's prefill, not the slope of its booked
        // prefill or the decode blocks the prompt adds). Where Dynamo's prefill term sits
        // at its clamp, prefill adds nothing and neither does this. A relative margin
        // keeps the rounding of the sum from lifting it above a member's priced cost.
        let (a, t) = eval.load_slopes();
        let lambda = t / a;
        let mix = self.bookings.floor_mix();
        let around = mix.at(lambda);
        let extra_of = |f: &FloorRead| {
            if a > 0.0 {
                let fp = f.bound(FloorKind::PrefillTokens) as f64;
                let fd = f.bound(FloorKind::DecodeBlocks) as f64;
                a * (around.bound(f) - fp - lambda * fd.max(whole as f64))
            } else {
                0.0
            }
        };
        // `slope`: whether more booked prefill raises the cost at `a` (not at Dynamo's
        // clamp); the bound `base` plus the group's `extra` then.
        let tighten = |extra: f64, (base, slope): (f64, bool)| {
            if !slope || extra.is_nan() || extra <= 0.0 {
                return base;
            }
            let extra = extra - 1e-9 * (base.abs() + extra);
            if extra > 0.0 {
                base + extra
            } else {
                base
            }
        };
        // An idle group's uncached ranks may be priced as one (`idle.rs`), unless the host
        // breaks ties itself: it is shown every tied rank.
        let may_collapse = input.hooks.tie_break.is_none();
        let p = &mut c.prune;
        p.clear(n, groups.len());
        for g in groups {
            let f = g.floor.read();
            let extra = extra_of(&f);
            let (cost, form) = eval.credit_form(&floored(&f, None));
            p.group_lb.push(tighten(extra, cost));
            p.group_form.push(form);
            p.group_extra.push(extra);
            p.floors.push(f);
        }
        let mut at = 0;
        let dense = input.overlaps.len() * DENSE_OVERLAPS >= n;
        for (k, o) in input.overlaps.iter().enumerate() {
            at = if dense {
                // Many overlaps: a step at a time is cheaper than a search each.
                while at < n && slots[at].rank < o.rank {
                    at += 1;
                }
                at
            } else {
                gallop(slots, at, o.rank)
            };
            if at == n {
                break;
            }
            if slots[at].rank != o.rank {
                continue; // a rank the index knows and the worker set does not
            }
            let g = group_at[at] as usize;
            // The group's floors with this rank's overlap: its form, not a cost each.
            let shared = shared_beyond(input.shared, o.device, input.n_blocks as u32);
            let cost = p.group_form[g].cost_and_prefill_slope(o.device, o.host, o.disk, shared);
            let lb = tighten(p.group_extra[g], cost);
            p.hot.push((at as u32, k as u32, lb));
            p.hot_bits[at / 64] |= 1 << (at % 64);
        }

        // 2. Price: the best bounds first, then whatever can still win or tie.
        let mut best = f64::INFINITY;
        c.eligible.clear();
        c.cols.truncate(0);
        let price = |pos: usize,
                     t: Option<&TieredOverlap>,
                     c_eligible: &mut Vec<RankId>,
                     cols: &mut LoadColumns,
                     best: &mut f64|
         -> ActiveLoad {
            let a = loads.load_at(pos);
            let row = row(t, a, slots[pos].kv_blocks);
            let upper = eval.cost(&row.candidate(whole));
            if upper < *best {
                *best = upper;
            }
            c_eligible.push(slots[pos].rank);
            cols.push(row);
            a
        };
        // A NaN bound is kept (priced), never taken as proof that a rank cannot win.
        let keep = |lb: f64, best: f64| lb <= best || lb.is_nan();
        // Reads a group's members and raises its floors to their minimum; with `priced`,
        // also prices its uncached members (its cached ones are priced as hot ranks).
        let walk = |g: usize,
                    priced: bool,
                    p: &mut PruneScratch,
                    c_eligible: &mut Vec<RankId>,
                    cols: &mut LoadColumns,
                    best: &mut f64| {
            p.group_done[g] |= priced;
            let group = &groups[g];
            // No booking in the group: its uncached ranks cost the same if they share a
            // capacity; the first stands for all unless its counters show a booking that
            // came since (then every member is priced, that one already).
            let mut first = None;
            if priced && may_collapse && group.floor.bookings() == 0 {
                if let Some((pos, ranks)) = idle::alike(&group.members, &p.hot_bits, slots) {
                    let at = c_eligible.len() as u32;
                    let a = price(pos, None, c_eligible, cols, best);
                    if a == ActiveLoad::default() {
                        p.collapsed.push(Collapsed {
                            at,
                            group: g as u32,
                            ranks,
                        });
                        return; // the floors are at 0 already: nothing to raise
                    }
                    first = Some((pos, a));
                }
            }
            let mut mins = [u64::MAX; FLOOR_WORDS];
            for (i, &pos) in group.members.iter().enumerate() {
                if let Some(&ahead) = group.members.get(i + PREFETCH_AHEAD) {
                    loads.prefetch_at(ahead as usize);
                }
                let pos = pos as usize;
                let a = if let Some((_, a)) = first.filter(|&(f, _)| f == pos) {
                    a
                } else if !priced || p.hot_bits[pos / 64] & (1 << (pos % 64)) != 0 {
                    loads.load_at(pos)
                } else {
                    price(pos, None, c_eligible, cols, best)
                };
                for (m, v) in mins.iter_mut().zip(mix.figures(a)) {
                    *m = (*m).min(v);
                }
            }
            group.floor.raise(p.floors[g], group.version, mins);
        };
        // The hot rank with the lowest bound, then the others that can still win.
        let first_hot = (0..p.hot.len()).min_by(|&a, &b| p.hot[a].2.total_cmp(&p.hot[b].2));
        for (step, i) in first_hot.into_iter().chain(0..p.hot.len()).enumerate() {
            // Only a rank that can still win will be read (its bound is next to it).
            if let Some(&(ahead, _, lb)) = p.hot.get(i + PREFETCH_AHEAD) {
                if keep(lb, best) {
                    loads.prefetch_at(ahead as usize);
                }
            }
            let (pos, k, lb) = p.hot[i];
            if (step > 0 && Some(i) == first_hot) || !keep(lb, best) {
                continue; // priced first, or cannot win
            }
            let t = Some(&input.overlaps[k as usize]);
            price(pos as usize, t, &mut c.eligible, &mut c.cols, &mut best);
            p.group_hot_priced[group_at[pos as usize] as usize] += 1;
        }
        // The group of uncached ranks with the lowest bound, then the others.
        let first_group =
            (0..groups.len()).min_by(|&a, &b| p.group_lb[a].total_cmp(&p.group_lb[b]));
        for g in first_group.into_iter().chain(0..groups.len()) {
            if !p.group_done[g] && keep(p.group_lb[g], best) {
                walk(g, true, p, &mut c.eligible, &mut c.cols, &mut best);
            }
        }
        // A group whose cached members kept getting priced has floors below its loads
        // (floors rise only when a pass reads every member, and queries that many ranks
        // hold may never need the uncached ones): read its members to raise them.
        let stale = (0..groups.len()).max_by_key(|&g| p.group_hot_priced[g]);
        if let Some(g) = stale.filter(|&g| p.group_hot_priced[g] >= REFRESH_AFTER) {
            if !p.group_done[g] {
                walk(g, false, p, &mut c.eligible, &mut c.cols, &mut best);
            }
        }
        if c.eligible.is_empty() {
            c.prune.collapsed.clear();
            return None; // cannot happen with ranks; the full walk decides
        }
        Some(shape)
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
