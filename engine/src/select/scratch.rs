//! Per-thread buffers a selection reuses.

use crate::cost::{CreditForm, LoadColumns};
use crate::ids::{RankId, WorkerId};
use crate::index::{TieredOverlap, TieredScores};
use crate::reservation::FloorRead;
use crate::workers::RankSlot;

/// The candidate stage's buffers: every list a selection builds, whatever its size.
#[derive(Default)]
pub(super) struct Candidates {
    /// Candidate ranks with their workers' KV capacity, after the allow-set, the pin,
    /// LoRA narrowing and availability (unused when every rank is a candidate).
    pub(super) slots: Vec<RankSlot>,
    /// The eligible ones (not overloaded, not busy), parallel to `cols` and `costs`.
    pub(super) eligible: Vec<RankId>,
    /// Their cost inputs, a column per field: the cost pass reads only the columns it
    /// needs, with no record built per candidate.
    pub(super) cols: LoadColumns,
    pub(super) costs: Vec<f64>,
    /// Each cost minus its `new_blocks_not_active` share: the pruning bound.
    pub(super) lower: Vec<f64>,
    /// Narrowing's worker pools (allowed, then serving the LoRA adapter), as positions
    /// in the worker set's id order; the allow-set sorted; the pool's ids for the LoRA
    /// hook.
    pub(super) pool: Vec<u32>,
    pub(super) narrowed: Vec<u32>,
    pub(super) allowed: Vec<WorkerId>,
    pub(super) pool_ids: Vec<WorkerId>,
    /// Positions (into `eligible`) tied at the lowest cost, for the host's tie-break.
    pub(super) tied: Vec<usize>,
    /// The pruned pass's lists (`prune.rs`).
    pub(super) prune: PruneScratch,
}

/// The pruned pass's buffers.
#[derive(Default)]
pub(super) struct PruneScratch {
    /// Each group's floor as read, what its combined floors add to any member's bound
    /// (before the clamp check and margin), and the bound of its uncached ranks.
    pub(super) floors: Vec<FloorRead>,
    pub(super) group_extra: Vec<f64>,
    pub(super) group_lb: Vec<f64>,
    /// Each group's floors as a cost against any cache credit, for its cached members'
    /// bounds.
    pub(super) group_form: Vec<CreditForm>,
    pub(super) group_done: Vec<bool>,
    /// How many of each group's cached members were priced.
    pub(super) group_hot_priced: Vec<u32>,
    /// The ranks the lookup found: (position, index in the overlaps, bound).
    pub(super) hot: Vec<(u32, u32, f64)>,
    /// The same positions as bits, cleared when the next pass starts (the choice among
    /// an idle group's ranks reads them after the pass).
    pub(super) hot_bits: Vec<u64>,
    /// Idle groups priced as one candidate each, in candidate order (`prune.rs`).
    pub(super) collapsed: Vec<Collapsed>,
}

/// An idle group whose uncached ranks one candidate stands for: every member's counters
/// were zero and those ranks share one capacity, so they cost the same.
#[derive(Clone, Copy, Debug)]
pub(super) struct Collapsed {
    /// The candidate's position in `eligible`.
    pub(super) at: u32,
    /// The group's index in the registry snapshot's groups.
    pub(super) group: u32,
    /// How many ranks it stands for (its uncached members).
    pub(super) ranks: u32,
}

impl PruneScratch {
    pub(super) fn clear(&mut self, ranks: usize, groups: usize) {
        self.floors.clear();
        self.group_extra.clear();
        self.group_lb.clear();
        self.group_form.clear();
        self.group_done.clear();
        self.group_done.resize(groups, false);
        self.group_hot_priced.clear();
        self.group_hot_priced.resize(groups, 0);
        self.hot.clear();
        self.hot_bits.clear();
        self.hot_bits.resize(ranks / 64 + 1, 0);
        self.collapsed.clear();
    }
}

/// Per-thread buffers a selection reuses, so an advisory selection allocates nothing once
/// a thread has warmed up (the C ABI's "no allocation on the routing path"). Taken out of
/// the thread-local slot and put back, never borrowed across a call: a host hook that
/// selects again from inside a selection just gets fresh (empty) buffers.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) local: Vec<u64>,
    pub(super) tiered: TieredScores,
    /// The prediction side index's overlaps and the merge of both (prediction mode).
    pub(super) predicted: TieredScores,
    pub(super) merged: Vec<TieredOverlap>,
    pub(super) candidates: Candidates,
}

std::thread_local! {
    static SCRATCH: std::cell::Cell<Option<Box<Scratch>>> = const { std::cell::Cell::new(None) };
}

impl Scratch {
    pub(super) fn take() -> Box<Scratch> {
        SCRATCH.with(|c| c.take()).unwrap_or_default()
    }

    pub(super) fn put(s: Box<Scratch>) {
        SCRATCH.with(|c| c.set(Some(s)));
    }
}

/// Puts the scratch back when a decision ends, on every return path.
pub(super) struct PutBack(pub(super) Option<Box<Scratch>>);

impl Drop for PutBack {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            Scratch::put(s);
        }
    }
}
