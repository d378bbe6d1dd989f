//! The naive reference model of the index (DESIGN.md §4), written to be obviously
//! correct rather than fast: per rank and per tier a map external hash → sequence hash,
//! and nothing else. Derived data (which sequence hashes a rank holds) is kept as a
//! reference count next to it and re-derived from scratch by [`Model::self_check`].
//!
//! Semantics:
//! - `Stored { tier, parent, blocks }`: a `parent` the rank holds on no tier rejects the
//!   whole event (`parent_not_found`). Otherwise `prev` = the parent's sequence hash
//!   (looked up on device, then host, then disk), and each block's sequence hash is
//!   `chain_hash(prev, local)` (or `local` with no `prev`); the block's external hash now
//!   names that sequence hash on `tier`. The event creates the rank even when rejected.
//! - `Removed { tier, hashes }`: each hash stops naming anything on `tier`; hashes not
//!   named there are counted (`block_not_found`).
//! - `Cleared`: every tier of the rank is emptied.
//! - A rank holds sequence hash `S` on tier `t` iff some external hash names `S` on `t`.
//! - `StatesStored { tier, hashes }` (a hybrid model's recurrent state): the rank becomes
//!   hybrid; each hash the rank holds (resolved as a parent is) names a state at that
//!   sequence hash on `tier`, replacing any other name of a state there on that tier;
//!   other hashes are counted. `StatesRemoved` drops names. A state lives only while the
//!   rank holds its block on some tier. A hybrid rank's score is cut back to the last
//!   block inside it with a state (on the device for device scores, any tier for tiered).

use std::collections::{BTreeMap, HashMap, HashSet};

use kvr::hash::chain_hash;
use kvr::{ApplyOutcome, IndexError, TieredOverlap};
use kvr::{KvEvent, RankId, StoredBlock, Tier};

pub(crate) const TIERS: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

/// A change of "rank holds `seq` on `tier`", in the order the model made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Transition {
    pub rank: RankId,
    pub tier: Tier,
    pub seq: u64,
    /// `true`: became held; `false`: stopped being held.
    pub held: bool,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct RankModel {
    /// Per tier: external hash → sequence hash.
    pub names: [HashMap<u64, u64>; 3],
    /// Per tier: sequence hash → number of external hashes naming it (derived).
    pub held: [HashMap<u64, u32>; 3],
    pub stored_events: u64,
    pub removed_events: u64,
    pub cleared_events: u64,
    pub parent_not_found: u64,
    pub block_not_found: u64,
    /// Per tier: state name (external hash) → the sequence hash it is the state of.
    pub states: [HashMap<u64, u64>; 3],
    /// The rank announced recurrent state (kept across clears).
    pub hybrid: bool,
}

impl RankModel {
    /// The longest prefix of `seq[..n]` whose last block has a state on a tier in
    /// `tiers`; `n` itself for a rank that is not hybrid.
    pub(crate) fn reusable(&self, seq: &[u64], n: usize, tiers: &[Tier]) -> usize {
        if !self.hybrid {
            return n;
        }
        (0..n)
            .rev()
            .find(|&j| {
                tiers
                    .iter()
                    .any(|&t| self.states[t as usize].values().any(|&s| s == seq[j]))
            })
            .map_or(0, |j| j + 1)
    }

    pub(crate) fn holds(&self, tier: Tier, seq: u64) -> bool {
        self.held[tier as usize].contains_key(&seq)
    }

    /// The sequence hash `external` names, looked up on device, then host, then disk.
    pub(crate) fn resolve(&self, external: u64) -> Option<u64> {
        self.names.iter().find_map(|m| m.get(&external).copied())
    }

    /// Distinct sequence hashes held on any tier.
    pub(crate) fn holder_blocks(&self) -> u64 {
        let mut all: HashSet<u64> = HashSet::new();
        for t in &self.held {
            all.extend(t.keys().copied());
        }
        all.len() as u64
    }

    pub(crate) fn tier_blocks(&self) -> [u64; 3] {
        [
            self.held[0].len() as u64,
            self.held[1].len() as u64,
            self.held[2].len() as u64,
        ]
    }

    /// External names on all tiers.
    pub(crate) fn names_len(&self) -> usize {
        self.names.iter().map(|m| m.len()).sum()
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Model {
    pub ranks: BTreeMap<RankId, RankModel>,
    pub stored_events: u64,
    pub removed_events: u64,
    pub cleared_events: u64,
    pub parent_not_found: u64,
    pub block_not_found: u64,
    /// When `Some`, every holder transition is appended here.
    pub log: Option<Vec<Transition>>,
}

/// The sequence hashes of a prompt given as local hashes: `seq[0] = local[0]`,
/// `seq[i] = chain_hash(seq[i-1], local[i])`.
pub(crate) fn seqs(locals: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(locals.len());
    let mut prev: Option<u64> = None;
    for &l in locals {
        let s = match prev {
            None => l,
            Some(p) => chain_hash(p, l),
        };
        out.push(s);
        prev = Some(s);
    }
    out
}

fn name_added(
    rm: &mut RankModel,
    log: &mut Option<Vec<Transition>>,
    rank: RankId,
    tier: Tier,
    seq: u64,
) -> bool {
    let n = rm.held[tier as usize].entry(seq).or_insert(0);
    *n += 1;
    let newly = *n == 1;
    if newly {
        if let Some(l) = log {
            l.push(Transition {
                rank,
                tier,
                seq,
                held: true,
            });
        }
    }
    newly
}

fn name_dropped(
    rm: &mut RankModel,
    log: &mut Option<Vec<Transition>>,
    rank: RankId,
    tier: Tier,
    seq: u64,
) {
    let t = tier as usize;
    let n = rm.held[t]
        .get_mut(&seq)
        .expect("model: dropped a name of an unheld block");
    *n -= 1;
    if *n == 0 {
        rm.held[t].remove(&seq);
        if !rm.held.iter().any(|h| h.contains_key(&seq)) {
            for names in rm.states.iter_mut() {
                names.retain(|_, s| *s != seq);
            }
        }
        if let Some(l) = log {
            l.push(Transition {
                rank,
                tier,
                seq,
                held: false,
            });
        }
    }
}

fn empty_rank(rm: &mut RankModel, log: &mut Option<Vec<Transition>>, rank: RankId) -> usize {
    let mut removed = 0;
    for tier in TIERS {
        let names = std::mem::take(&mut rm.names[tier as usize]);
        for (_, seq) in names {
            name_dropped(rm, log, rank, tier, seq);
            removed += 1;
        }
        assert!(rm.held[tier as usize].is_empty());
    }
    removed
}

impl Model {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn apply(
        &mut self,
        rank: RankId,
        event: &KvEvent<'_>,
    ) -> Result<ApplyOutcome, IndexError> {
        match *event {
            KvEvent::Stored {
                tier,
                parent,
                blocks,
            } => self
                .store(rank, tier, parent, blocks)
                .map(|stored| ApplyOutcome {
                    stored,
                    ..Default::default()
                }),
            KvEvent::StoredKnown {
                tier,
                external_hashes,
            } => Ok(self.store_known(rank, tier, external_hashes)),
            KvEvent::Removed {
                tier,
                external_hashes,
            } => Ok(self.remove(rank, tier, external_hashes)),
            KvEvent::Cleared => Ok(ApplyOutcome {
                removed: self.clear(rank),
                ..Default::default()
            }),
            KvEvent::StatesStored {
                tier,
                external_hashes,
            } => Ok(self.store_states(rank, tier, external_hashes)),
            KvEvent::StatesRemoved {
                tier,
                external_hashes,
            } => Ok(self.remove_states(rank, tier, external_hashes)),
        }
    }

    pub(crate) fn store_states(
        &mut self,
        rank: RankId,
        tier: Tier,
        external_hashes: &[u64],
    ) -> ApplyOutcome {
        self.stored_events += 1;
        let mut out = ApplyOutcome::default();
        let Some(rm) = self.ranks.get_mut(&rank) else {
            out.not_found = external_hashes.len();
            return out;
        };
        rm.stored_events += 1;
        rm.hybrid = true;
        let t = tier as usize;
        for &h in external_hashes {
            let Some(seq) = rm.resolve(h) else {
                out.not_found += 1;
                continue;
            };
            let fresh = !rm.states[t].values().any(|&s| s == seq);
            rm.states[t].retain(|&n, s| n == h || *s != seq);
            rm.states[t].insert(h, seq);
            out.stored += usize::from(fresh);
        }
        out
    }

    pub(crate) fn remove_states(
        &mut self,
        rank: RankId,
        tier: Tier,
        external_hashes: &[u64],
    ) -> ApplyOutcome {
        self.removed_events += 1;
        let mut out = ApplyOutcome::default();
        let Some(rm) = self.ranks.get_mut(&rank) else {
            out.not_found = external_hashes.len();
            return out;
        };
        rm.removed_events += 1;
        for h in external_hashes {
            match rm.states[tier as usize].remove(h) {
                Some(_) => out.removed += 1,
                None => out.not_found += 1,
            }
        }
        out
    }

    /// Returns the blocks that became held on `tier` (a name moved onto a block another
    /// name already holds, or a repeated name, adds nothing).
    pub(crate) fn store(
        &mut self,
        rank: RankId,
        tier: Tier,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<usize, IndexError> {
        self.stored_events += 1;
        // As the index: a store that cannot add a block to an unknown rank creates none.
        if (parent.is_some() || blocks.is_empty()) && !self.ranks.contains_key(&rank) {
            return match parent {
                Some(p) => {
                    self.parent_not_found += 1;
                    Err(IndexError::ParentNotFound { parent: p })
                }
                None => Ok(0),
            };
        }
        let rm = self.ranks.entry(rank).or_default();
        rm.stored_events += 1;
        let mut prev = match parent {
            None => None,
            Some(p) => match rm.resolve(p) {
                Some(s) => Some(s),
                None => {
                    rm.parent_not_found += 1;
                    self.parent_not_found += 1;
                    return Err(IndexError::ParentNotFound { parent: p });
                }
            },
        };
        let t = tier as usize;
        let mut stored = 0;
        for b in blocks {
            let seq = match prev {
                None => b.local_hash,
                Some(p) => chain_hash(p, b.local_hash),
            };
            prev = Some(seq);
            match rm.names[t].insert(b.external_hash, seq) {
                Some(old) if old == seq => continue,
                Some(old) => name_dropped(rm, &mut self.log, rank, tier, old),
                None => {}
            }
            if name_added(rm, &mut self.log, rank, tier, seq) {
                stored += 1;
            }
        }
        Ok(stored)
    }

    /// The blocks the rank holds on some tier, named by `external_hashes`, are now held
    /// on `tier` too, under those names; unknown names are counted, not stored.
    pub(crate) fn store_known(
        &mut self,
        rank: RankId,
        tier: Tier,
        external_hashes: &[u64],
    ) -> ApplyOutcome {
        self.stored_events += 1;
        let mut out = ApplyOutcome::default();
        let Some(rm) = self.ranks.get_mut(&rank) else {
            out.not_found = external_hashes.len();
            return out;
        };
        rm.stored_events += 1;
        let t = tier as usize;
        for &h in external_hashes {
            let Some(seq) = rm.resolve(h) else {
                out.not_found += 1;
                continue;
            };
            match rm.names[t].insert(h, seq) {
                Some(old) if old == seq => continue,
                Some(old) => name_dropped(rm, &mut self.log, rank, tier, old),
                None => {}
            }
            if name_added(rm, &mut self.log, rank, tier, seq) {
                out.stored += 1;
            }
        }
        out
    }

    pub(crate) fn remove(
        &mut self,
        rank: RankId,
        tier: Tier,
        external_hashes: &[u64],
    ) -> ApplyOutcome {
        self.removed_events += 1;
        let mut out = ApplyOutcome::default();
        match self.ranks.get_mut(&rank) {
            None => out.not_found = external_hashes.len(),
            Some(rm) => {
                rm.removed_events += 1;
                for h in external_hashes {
                    match rm.names[tier as usize].remove(h) {
                        Some(seq) => {
                            name_dropped(rm, &mut self.log, rank, tier, seq);
                            out.removed += 1;
                        }
                        None => out.not_found += 1,
                    }
                }
                rm.block_not_found += out.not_found as u64;
            }
        }
        self.block_not_found += out.not_found as u64;
        out
    }

    /// Returns the external names dropped (on all tiers).
    pub(crate) fn clear(&mut self, rank: RankId) -> usize {
        self.cleared_events += 1;
        match self.ranks.get_mut(&rank) {
            None => 0,
            Some(rm) => {
                rm.cleared_events += 1;
                empty_rank(rm, &mut self.log, rank)
            }
        }
    }

    pub(crate) fn remove_rank(&mut self, rank: RankId) -> bool {
        match self.ranks.remove(&rank) {
            None => false,
            Some(mut rm) => {
                empty_rank(&mut rm, &mut self.log, rank);
                true
            }
        }
    }

    pub(crate) fn remove_worker(&mut self, worker_id: u64) -> usize {
        let gone: Vec<RankId> = self
            .ranks
            .keys()
            .filter(|r| r.worker_id == worker_id)
            .copied()
            .collect();
        for r in &gone {
            self.remove_rank(*r);
        }
        gone.len()
    }

    pub(crate) fn ranks(&self) -> Vec<RankId> {
        self.ranks.keys().copied().collect()
    }

    pub(crate) fn rank(&self, rank: RankId) -> Option<&RankModel> {
        self.ranks.get(&rank)
    }

    /// Device score per rank (sorted, zero scores absent).
    pub(crate) fn find_matches(&self, locals: &[u64]) -> Vec<(RankId, u32)> {
        self.find_matches_by_sequence(&seqs(locals))
    }

    pub(crate) fn find_matches_by_sequence(&self, seq: &[u64]) -> Vec<(RankId, u32)> {
        let mut out = Vec::new();
        for (r, rm) in &self.ranks {
            let d = seq
                .iter()
                .take_while(|s| rm.holds(Tier::Device, **s))
                .count();
            let d = rm.reusable(seq, d, &[Tier::Device]);
            if d > 0 {
                out.push((*r, d as u32));
            }
        }
        out
    }

    /// Tiered score per rank (sorted; ranks with nothing absent).
    pub(crate) fn find_matches_tiered(&self, locals: &[u64]) -> Vec<TieredOverlap> {
        self.find_matches_tiered_by_sequence(&seqs(locals))
    }

    pub(crate) fn find_matches_tiered_by_sequence(&self, seq: &[u64]) -> Vec<TieredOverlap> {
        let mut out = Vec::new();
        for (r, rm) in &self.ranks {
            let run = |from: usize, tier: Tier| {
                seq[from..]
                    .iter()
                    .take_while(|s| rm.holds(tier, **s))
                    .count()
            };
            let d = run(0, Tier::Device);
            let h = run(d, Tier::Host);
            let k = run(d + h, Tier::Disk);
            let total = rm.reusable(seq, d + h + k, &TIERS);
            let d = d.min(total);
            let h = h.min(total - d);
            let k = total - d - h;
            if d + h + k > 0 {
                out.push(TieredOverlap {
                    rank: *r,
                    device: d as u32,
                    host: h as u32,
                    disk: k as u32,
                });
            }
        }
        out
    }

    /// (rank, block) pairs held on any tier.
    pub(crate) fn holder_blocks(&self) -> u64 {
        self.ranks.values().map(|r| r.holder_blocks()).sum()
    }

    pub(crate) fn tier_blocks(&self) -> [u64; 3] {
        let mut t = [0u64; 3];
        for r in self.ranks.values() {
            let rt = r.tier_blocks();
            for k in 0..3 {
                t[k] += rt[k];
            }
        }
        t
    }

    /// Distinct sequence hashes held by anyone on any tier.
    pub(crate) fn nodes(&self) -> u64 {
        let mut all: HashSet<u64> = HashSet::new();
        for r in self.ranks.values() {
            for t in &r.held {
                all.extend(t.keys().copied());
            }
        }
        all.len() as u64
    }

    /// Re-derives every rank's held counts from its names and compares.
    pub(crate) fn self_check(&self) {
        for (r, rm) in &self.ranks {
            for t in 0..3 {
                let mut counts: HashMap<u64, u32> = HashMap::new();
                for seq in rm.names[t].values() {
                    *counts.entry(*seq).or_insert(0) += 1;
                }
                assert_eq!(counts, rm.held[t], "model self-check: rank {r} tier {t}");
                for seq in rm.states[t].values() {
                    assert!(
                        rm.held.iter().any(|h| h.contains_key(seq)),
                        "model self-check: rank {r} has a state at a block it does not hold"
                    );
                }
            }
        }
    }

    /// Folds in a model of disjoint ranks (the concurrent test keeps one per writer).
    pub(crate) fn merge(&mut self, other: Model) {
        for (r, rm) in other.ranks {
            assert!(
                self.ranks.insert(r, rm).is_none(),
                "merged models share rank {r}"
            );
        }
        self.stored_events += other.stored_events;
        self.removed_events += other.removed_events;
        self.cleared_events += other.cleared_events;
        self.parent_not_found += other.parent_not_found;
        self.block_not_found += other.block_not_found;
    }
}

/// Checks the index's stats and rank list against the model exactly (quiescent only).
pub(crate) fn assert_stats_equal(index: &kvr::Index, model: &Model, ctx: &dyn Fn() -> String) {
    assert_eq!(index.ranks(), model.ranks(), "ranks differ; {}", ctx());
    let s = index.stats();
    for r in model.ranks.keys() {
        assert_rank_stats_equal(index, model, *r, ctx);
    }
    let got = (
        s.ranks,
        s.holder_blocks,
        s.tier_blocks,
        s.parent_not_found,
        s.block_not_found,
        s.stored_events,
        s.removed_events,
        s.cleared_events,
        s.too_many_ranks,
    );
    let want = (
        model.ranks.len() as u64,
        model.holder_blocks(),
        model.tier_blocks(),
        model.parent_not_found,
        model.block_not_found,
        model.stored_events,
        model.removed_events,
        model.cleared_events,
        0,
    );
    assert_eq!(
        got,
        want,
        "index stats (ranks, holder_blocks, tier_blocks, parent_not_found, \
         block_not_found, stored, removed, cleared, too_many_ranks) vs model; {}",
        ctx()
    );
    assert_eq!(
        s.bytes,
        s.table_bytes + s.holder_set_bytes + s.rank_map_bytes,
        "bytes is the sum of its parts; {}",
        ctx()
    );
    // The index keeps every held prefix (in a live run); it may keep a few more (blocks of
    // runs someone still holds part of).
    assert!(
        s.nodes >= model.nodes(),
        "index keeps {} blocks, fewer than the {} held; {}",
        s.nodes,
        model.nodes(),
        ctx()
    );
}

/// Checks one rank's stats against the model exactly (quiescent only).
pub(crate) fn assert_rank_stats_equal(
    index: &kvr::Index,
    model: &Model,
    rank: RankId,
    ctx: &dyn Fn() -> String,
) {
    let Some(rm) = model.rank(rank) else {
        assert!(
            index.rank_stats(rank).is_none(),
            "index has rank_stats({rank}), the model has no such rank; {}",
            ctx()
        );
        return;
    };
    let rs = index
        .rank_stats(rank)
        .unwrap_or_else(|| panic!("index lacks rank_stats({rank}); {}", ctx()));
    let got = (
        rs.rank,
        rs.holder_blocks,
        rs.tier_blocks,
        rs.parent_not_found,
        rs.block_not_found,
        rs.stored_events,
        rs.removed_events,
        rs.cleared_events,
    );
    let want = (
        Some(rank),
        rm.holder_blocks(),
        rm.tier_blocks(),
        rm.parent_not_found,
        rm.block_not_found,
        rm.stored_events,
        rm.removed_events,
        rm.cleared_events,
    );
    assert_eq!(
        got,
        want,
        "rank {rank}: (rank, holder_blocks, tier_blocks, parent_not_found, block_not_found, \
         stored, removed, cleared) index vs model; {}",
        ctx()
    );
}
