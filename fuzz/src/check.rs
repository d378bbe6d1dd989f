//! Checks shared by the differential targets: the index against the naive model, by
//! stats and by prefix queries over chains the run has stored.

use std::collections::HashMap;

use kvr::hash::chain_hash;
use kvr::{Index, OverlapScores, TieredScores};
use kvr::{RankId, StoredBlock, Tier};

use crate::model::{assert_rank_stats_equal, assert_stats_equal, seqs, Model};

/// Runs the index's deferred frees now (it retires tables and holder sets through
/// crossbeam-epoch, which frees them at a later pin), so an input frees what it allocated:
/// libFuzzer runs a leak check — a scan of the whole heap — after every input with more
/// mallocs than frees, which cost more than the inputs themselves with a reused index.
pub fn collect_garbage() {
    for _ in 0..8 {
        crossbeam_epoch::pin().flush();
    }
}

/// An input's start on a reused index (`what` names it): the index must be empty (no
/// rank, node, holder or holder-set byte), and the model's event counters start from the
/// index's running totals (kept across inputs, as across removed ranks).
pub fn start_on_reused(index: &Index, what: &str, model: &mut Model) {
    let s = index.stats();
    assert_eq!(
        (
            s.ranks,
            s.nodes,
            s.holder_blocks,
            s.holder_set_bytes,
            s.tier_blocks
        ),
        (0, 0, 0, 0, [0; 3]),
        "a reused {what} must start empty"
    );
    model.stored_events = s.stored_events;
    model.removed_events = s.removed_events;
    model.cleared_events = s.cleared_events;
    model.parent_not_found = s.parent_not_found;
    model.block_not_found = s.block_not_found;
}

/// Every block the model ever stored, as a link of its chain: sequence hash → (the
/// sequence hash before it, its local hash). Walking links back from any stored block
/// gives a query prefix that ends exactly there.
#[derive(Default)]
pub struct Links {
    links: HashMap<u64, (Option<u64>, u64)>,
    /// Sequence hashes in the order first stored (deterministic picks).
    order: Vec<u64>,
}

/// The longest chain a query walks back.
const MAX_CHAIN: usize = 256;

impl Links {
    /// The sequence hashes `blocks` get when stored on `rank` after `parent`, as the model
    /// computes them (`None` if the model refuses the store: unknown parent). Call before
    /// the model applies the store (the store may move the parent's name).
    pub fn record(
        &mut self,
        model: &Model,
        rank: RankId,
        parent: Option<u64>,
        blocks: &[StoredBlock],
        touched: &mut Vec<u64>,
    ) {
        let mut prev = match parent {
            None => None,
            Some(p) => match model.rank(rank).and_then(|rm| rm.resolve(p)) {
                Some(s) => Some(s),
                None => return,
            },
        };
        for b in blocks {
            let seq = match prev {
                None => b.local_hash,
                Some(p) => chain_hash(p, b.local_hash),
            };
            if let std::collections::hash_map::Entry::Vacant(e) = self.links.entry(seq) {
                e.insert((prev, b.local_hash));
                self.order.push(seq);
            }
            touched.push(seq);
            prev = Some(seq);
        }
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The `k`-th sequence hash first stored (modulo the number stored).
    pub fn nth(&self, k: usize) -> Option<u64> {
        (!self.order.is_empty()).then(|| self.order[k % self.order.len()])
    }

    /// The local hashes of the whole chain ending at `seq` (root first), if it is known to
    /// its root: what the index is looked up by.
    pub fn locals_to(&self, seq: u64) -> Option<Vec<u64>> {
        let mut locals = Vec::new();
        let mut cur = seq;
        while locals.len() <= self.order.len() {
            let &(prev, local) = self.links.get(&cur)?;
            locals.push(local);
            match prev {
                None => {
                    locals.reverse();
                    return Some(locals);
                }
                Some(p) => cur = p,
            }
        }
        None
    }

    /// The chain ending at `seq`: (sequence hashes, local hashes), root first. The locals
    /// are `Some` only if the walk reached a root (a block stored without a parent).
    pub fn chain(&self, seq: u64) -> (Vec<u64>, Option<Vec<u64>>) {
        let mut seqs = vec![seq];
        let mut locals = Vec::new();
        let mut cur = seq;
        let mut complete = false;
        while seqs.len() <= MAX_CHAIN {
            let Some(&(prev, local)) = self.links.get(&cur) else {
                break;
            };
            locals.push(local);
            match prev {
                None => {
                    complete = true;
                    break;
                }
                Some(p) => {
                    seqs.push(p);
                    cur = p;
                }
            }
        }
        if !complete {
            // A cut walk: the last pushed sequence hash has no local.
            seqs.truncate(locals.len().max(1));
        }
        seqs.reverse();
        locals.reverse();
        (seqs, complete.then_some(locals))
    }
}

/// Reusable query outputs, and what the queries found so far.
#[derive(Default)]
pub struct Scratch {
    scores: OverlapScores,
    tiered: TieredScores,
    /// Queries run.
    pub queries: u64,
    /// Queries some rank scored on the device.
    pub device_hits: u64,
    /// Queries four or more ranks scored on the device (a run with many covers).
    pub shared_hits: u64,
    /// Queries some rank scored on host or disk.
    pub lower_tier_hits: u64,
    /// Queries a hybrid rank (one that announced recurrent state) scored on the device,
    /// and ones where its states cut its device score below the blocks it holds.
    pub state_hits: u64,
    pub state_cuts: u64,
}

/// Index vs model on one query (a prompt's local hashes, as the index is looked up):
/// device and tiered scores.
pub fn check_query(
    index: &Index,
    model: &Model,
    locals: &[u64],
    scratch: &mut Scratch,
    ctx: &dyn Fn() -> String,
) {
    let want = model.find_matches(locals);
    index.find_matches_into(locals, &mut scratch.scores);
    assert_eq!(
        scratch.scores.as_slice(),
        want.as_slice(),
        "find_matches (index vs model); locals {locals:x?}; {}",
        ctx()
    );
    scratch.queries += 1;
    scratch.device_hits += u64::from(!want.is_empty());
    let (hits, cuts) = state_effect(model, locals);
    scratch.state_hits += u64::from(hits);
    scratch.state_cuts += u64::from(cuts);
    scratch.shared_hits += u64::from(want.len() >= 4);
    let want_t = model.find_matches_tiered(locals);
    scratch.lower_tier_hits += u64::from(want_t.iter().any(|t| t.host + t.disk > 0));
    index.find_matches_tiered_into(locals, &mut scratch.tiered);
    assert_eq!(
        scratch.tiered.as_slice(),
        want_t.as_slice(),
        "find_matches_tiered (index vs model); locals {locals:x?}; {}",
        ctx()
    );
}

/// Whether, on the model, a hybrid rank scores `locals` on the device, and whether one's
/// states cut its score below the blocks it holds there.
fn state_effect(model: &Model, locals: &[u64]) -> (bool, bool) {
    let (mut hits, mut cuts) = (false, false);
    let mut seq: Option<Vec<u64>> = None;
    for rm in model.ranks.values().filter(|rm| rm.hybrid) {
        let seq = seq.get_or_insert_with(|| seqs(locals));
        let held = seq
            .iter()
            .take_while(|s| rm.holds(Tier::Device, **s))
            .count();
        let reusable = rm.reusable(seq, held, &[Tier::Device]);
        hits |= reusable > 0;
        cuts |= reusable < held;
    }
    (hits, cuts)
}

/// The whole comparison after one step: stats, exact — all of them (total and every rank)
/// if `full`, else the rank list and the stats of `ranks` (the ranks the step touched; the
/// model derives its stats naively, so the full check is the costly part) — then queries
/// for the chains ending at the first and the last `touched` block and at two blocks
/// stored earlier picked by `pick`; the first of those also extended by a block nobody
/// stored and cut in half.
#[allow(clippy::too_many_arguments)]
pub fn check_all(
    index: &Index,
    model: &Model,
    links: &Links,
    touched: &[u64],
    pick: usize,
    full: bool,
    ranks: &[RankId],
    scratch: &mut Scratch,
    ctx: &dyn Fn() -> String,
) {
    if full {
        assert_stats_equal(index, model, ctx);
    } else {
        assert_eq!(index.ranks(), model.ranks(), "ranks differ; {}", ctx());
        for r in ranks {
            assert_rank_stats_equal(index, model, *r, ctx);
        }
    }
    // The chain through the last block touched covers the ones before it in that store;
    // the first block touched starts another chain when the step stored several.
    let mut ends: Vec<u64> = Vec::with_capacity(4);
    ends.extend(touched.last());
    if let Some(&f) = touched.first() {
        if ends.first() != Some(&f) {
            ends.push(f);
        }
    }
    if let Some(s) = links.nth(pick) {
        ends.push(s);
    }
    if let Some(s) = links.nth(pick.wrapping_mul(7).wrapping_add(3)) {
        ends.push(s);
    }
    for (k, end) in ends.into_iter().enumerate() {
        // A chain not known to its root (a walk cut at MAX_CHAIN) cannot be asked.
        let (_, Some(mut locals)) = links.chain(end) else {
            continue;
        };
        check_query(index, model, &locals, scratch, ctx);
        if k == 0 {
            // One step past the end, and a prefix cut in the middle.
            locals.push(0x5eed);
            check_query(index, model, &locals, scratch, ctx);
            locals.truncate(locals.len() / 2);
            if !locals.is_empty() {
                check_query(index, model, &locals, scratch, ctx);
            }
        }
    }
}
