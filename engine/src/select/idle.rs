//! Idle groups in the pruned pass: one candidate for a group's uncached ranks when none of
//! its members holds a booking (`reservation/idle.rs`), and the choice that keeps ties
//! uniform over ranks.
//!
//! Why: with nothing booked, a prompt no rank holds costs the same on every rank of one
//! capacity, so every rank ties and the pass priced all of them (8,192 counter lines and
//! costs at fleet scale) only to pick one uniformly. A group that counts no live booking
//! is priced once, through its first uncached member, and stands for all its uncached
//! ranks; at the choice each candidate weighs as many ranks as it stands for, and the
//! draw that falls on a group names one of those ranks. So every tied rank is chosen with
//! the same probability as when each was priced on its own.
//!
//! Only in the pruned pass (temperature 0, no session steering), and not when the host
//! breaks ties itself: its hook is shown every tied rank.

use super::scratch::{Candidates, Collapsed};
use crate::cost::{choose_argmin_weighted, RandomSource};
use crate::reservation::ActiveLoads;
use crate::workers::RankSlot;

/// The members at positions not marked in `hot_bits` (the ranks that hold nothing of the
/// prompt), in member order.
fn uncached<'a>(members: &'a [u32], hot_bits: &'a [u64]) -> impl Iterator<Item = usize> + 'a {
    members
        .iter()
        .map(|&pos| pos as usize)
        .filter(move |&pos| hot_bits[pos / 64] & (1 << (pos % 64)) == 0)
}

/// The first uncached member and how many there are, when there are at least two and they
/// all have one capacity (so, with no load, one cost); otherwise `None`.
pub(super) fn alike(members: &[u32], hot_bits: &[u64], slots: &[RankSlot]) -> Option<(usize, u32)> {
    let mut it = uncached(members, hot_bits);
    let first = it.next()?;
    let kv = slots[first].kv_blocks;
    let mut ranks = 1u32;
    for pos in it {
        if slots[pos].kv_blocks != kv {
            return None;
        }
        ranks += 1;
    }
    (ranks > 1).then_some((first, ranks))
}

/// The choice at temperature 0 when the pass collapsed idle groups (`None` when it did
/// not): the least cost, ties weighted by the ranks each candidate stands for; a group's
/// candidate is replaced in `c.eligible` by the member the draw names (its cost inputs are
/// that member's too).
pub(super) fn choose(
    c: &mut Candidates,
    loads: &ActiveLoads,
    slots: &[RankSlot],
    rng: &mut impl RandomSource,
) -> Option<usize> {
    if c.prune.collapsed.is_empty() {
        return None;
    }
    let collapsed = &c.prune.collapsed;
    let of = |k: usize| -> Option<&Collapsed> {
        collapsed
            .binary_search_by_key(&k, |g| g.at as usize)
            .ok()
            .map(|i| &collapsed[i])
    };
    let (k, r) =
        choose_argmin_weighted(&c.costs, |k| of(k).map_or(1, |g| u64::from(g.ranks)), rng)?;
    if let Some(g) = of(k) {
        let members = &loads.groups()[g.group as usize].members;
        let pos = uncached(members, &c.prune.hot_bits).nth(r as usize)?;
        c.eligible[k] = slots[pos].rank;
    }
    Some(k)
}
