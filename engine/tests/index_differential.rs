//! Differential test of the index against the naive model (`common/model.rs`).
//!
//! Random operation sequences from a seeded RNG drive both the index and the model; after
//! every operation random queries must agree: first the contract's safety property (the
//! index never overcounts and never names a rank the model does not score), then exact
//! equality of `find_matches` (all three entry points) and `find_matches_tiered`, since the
//! test is single-threaded and therefore quiescent. Every few operations the stats must
//! agree exactly too (per rank and in total: holder and tier blocks, refusals, events,
//! nodes).
//!
//! The workload: 18 ranks (7 workers, several with many dp ranks); a pool of prompt chains
//! that share system prefixes and extend each other (multi-turn), drawn with a skewed
//! distribution so the popular ones are held by many ranks at once (heap holder sets);
//! stores from scratch, continuing from a held parent (on any tier), with unknown parents,
//! repeated, re-pointing an external hash to other content, or adding an alias name;
//! host and disk stores; removals mid-chain, of a chain's tail, on the wrong tier, of
//! unknown hashes and of unknown ranks; clears, `remove_rank` and `remove_worker` (the
//! ranks come back later and reuse slots).
//!
//! A failure prints the seed and the last operations. Environment overrides:
//! `KVR_DIFF_SEED` (decimal or 0x-hex) and `KVR_DIFF_OPS`. The op counts are for
//! `--release`; unoptimized builds run a tenth of them.

mod common;

use std::collections::VecDeque;
use std::time::Instant;

use common::model::{self, assert_rank_stats_equal, assert_stats_equal, Model, TIERS};
use common::rng::{env_u64, Rng};
use kvr::config::IndexConfig;
use kvr::{Index, OverlapScores};
use kvr::{KvEvent, RankId, StoredBlock, Tier};

/// dp size of workers 1..=7 (18 ranks).
const DP_SIZES: [u32; 7] = [4, 1, 2, 4, 3, 1, 3];
/// Above this many external names a rank leans towards removals.
const SOFT_CAP: usize = 300;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    z = (z ^ (z >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    z ^ (z >> 33)
}

/// One prompt of the pool: its local hashes and the engine's (content-addressed)
/// external hashes, so chains sharing a prefix share those blocks' names.
struct Chain {
    locals: Vec<u64>,
    seqs: Vec<u64>,
}

struct World {
    ranks: Vec<RankId>,
    chains: Vec<Chain>,
    /// Indices of the long (> 256 blocks) chains, drawn rarely.
    long: Vec<usize>,
}

impl World {
    fn new(rng: &mut Rng) -> Self {
        let mut ranks = Vec::new();
        for (w, &dp) in DP_SIZES.iter().enumerate() {
            for d in 0..dp {
                ranks.push(RankId::new(w as u64 + 1, d));
            }
        }
        let rand_locals = |rng: &mut Rng, n: usize| -> Vec<u64> {
            (0..n).map(|_| rng.next_u64()).collect::<Vec<u64>>()
        };
        // System prefixes; one starts with local hash 0 (stored under the table's alias key).
        let mut prefixes: Vec<Vec<u64>> = (0..6)
            .map(|_| {
                let n = rng.range(1, 6);
                rand_locals(rng, n)
            })
            .collect();
        prefixes[5][0] = 0;
        let mut chains: Vec<Vec<u64>> = Vec::new();
        for i in 0..96 {
            let mut locals = if i % 3 == 2 || chains.is_empty() {
                Vec::new()
            } else if i % 3 == 1 {
                // A later turn of an earlier conversation.
                let j = rng.below(chains.len());
                chains[j].clone()
            } else if i == 3 {
                // A popular chain whose first block has local (and sequence) hash 0.
                prefixes[5].clone()
            } else {
                prefixes[rng.skewed(prefixes.len())].clone()
            };
            let body = rng.range(1, 20);
            locals.extend(rand_locals(rng, body));
            locals.truncate(48);
            chains.push(locals);
        }
        let mut long = Vec::new();
        for _ in 0..2 {
            let mut locals = prefixes[0].clone();
            let n = rng.range(270, 320);
            locals.extend(rand_locals(rng, n));
            long.push(chains.len());
            chains.push(locals);
        }
        let chains = chains
            .into_iter()
            .map(|locals| Chain {
                seqs: model::seqs(&locals),
                locals,
            })
            .collect();
        World {
            ranks,
            chains,
            long,
        }
    }

    /// The engine's name for block `j` of chain `c` on `rank` (workers differ in salt).
    fn ext(&self, rank: RankId, c: usize, j: usize) -> u64 {
        mix(self.chains[c].seqs[j] ^ (rank.worker_id % 2).wrapping_mul(0xabcd_ef01))
    }

    /// A second name for the same block.
    fn alias(&self, rank: RankId, c: usize, j: usize, variant: u64) -> u64 {
        mix(self.ext(rank, c, j) ^ variant.wrapping_mul(0x1234_5678_9abc_def1))
    }

    fn pick_chain(&self, rng: &mut Rng) -> usize {
        if rng.chance(1, 150) {
            *rng.pick(&self.long)
        } else {
            rng.skewed(self.chains.len() - self.long.len())
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Store {
        rank: RankId,
        tier: Tier,
        parent: Option<u64>,
        blocks: Vec<StoredBlock>,
        via_apply: bool,
    },
    Remove {
        rank: RankId,
        tier: Tier,
        hashes: Vec<u64>,
        via_apply: bool,
    },
    /// A tokenless store: names the rank holds (and some it does not) onto `tier`.
    StoreKnown {
        rank: RankId,
        tier: Tier,
        hashes: Vec<u64>,
    },
    Clear {
        rank: RankId,
        via_apply: bool,
    },
    /// A recurrent group's states at blocks the rank holds (and some it does not).
    StoreStates {
        rank: RankId,
        tier: Tier,
        hashes: Vec<u64>,
    },
    RemoveStates {
        rank: RankId,
        tier: Tier,
        hashes: Vec<u64>,
    },
    RemoveRank(RankId),
    RemoveWorker(u64),
}

impl Op {
    fn rank(&self) -> Option<RankId> {
        match self {
            Op::Store { rank, .. }
            | Op::Remove { rank, .. }
            | Op::StoreKnown { rank, .. }
            | Op::StoreStates { rank, .. }
            | Op::RemoveStates { rank, .. }
            | Op::Clear { rank, .. } => Some(*rank),
            Op::RemoveRank(r) => Some(*r),
            Op::RemoveWorker(_) => None,
        }
    }
}

#[derive(Default, Debug)]
struct Coverage {
    stores: u64,
    stored_blocks: u64,
    parent_not_found: u64,
    removes: u64,
    stores_known: u64,
    states_stored: u64,
    states_removed: u64,
    /// Hybrid ranks whose score a state cut back (the model's scores with and without).
    state_cuts: u64,
    removed_blocks: u64,
    not_found: u64,
    clears: u64,
    remove_ranks: u64,
    remove_workers: u64,
    queries: u64,
    nonzero_scores: u64,
    tiered_host_or_disk: u64,
    max_device_sharing: usize,
    max_live_names: usize,
}

/// Prints the seed and the recent operations if the test panics.
struct FailureReport {
    name: &'static str,
    seed: u64,
    ops: usize,
    op_no: usize,
    recent: VecDeque<Op>,
}

impl FailureReport {
    fn push(&mut self, op: &Op) {
        if self.recent.len() == 12 {
            self.recent.pop_front();
        }
        self.recent.push_back(op.clone());
    }
}

impl Drop for FailureReport {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "\n=== index differential FAILED: test {} seed {} (0x{:x}) at op {} of {}",
                self.name, self.seed, self.seed, self.op_no, self.ops
            );
            eprintln!(
                "    rerun: KVR_DIFF_SEED={} KVR_DIFF_OPS={} cargo test -p kvr --release \
                 --test index_differential {}",
                self.seed,
                self.op_no + 1,
                self.name
            );
            eprintln!("    last operations (oldest first):");
            for op in &self.recent {
                eprintln!("      {op:?}");
            }
        }
    }
}

struct Gen<'w> {
    world: &'w World,
    rng: Rng,
    /// Recent store events per rank, replayed as repeated stores.
    recent_stores: Vec<VecDeque<Op>>,
}

impl Gen<'_> {
    fn rank_index(&self, r: RankId) -> usize {
        self.world.ranks.iter().position(|x| *x == r).unwrap()
    }

    /// How many leading blocks of chain `c` the rank names on some tier.
    fn progress(&self, model: &Model, rank: RankId, c: usize) -> usize {
        let Some(rm) = model.rank(rank) else {
            return 0;
        };
        let n = self.world.chains[c].locals.len();
        (0..n)
            .take_while(|&j| rm.resolve(self.world.ext(rank, c, j)).is_some())
            .count()
    }

    fn tier(&mut self) -> Tier {
        match self.rng.below(10) {
            0..=6 => Tier::Device,
            7..=8 => Tier::Host,
            _ => Tier::Disk,
        }
    }

    fn next_op(&mut self, model: &Model) -> Op {
        let rng = &mut self.rng;
        let rare = rng.below(1000);
        if rare < 2 {
            let w = rng.range(1, DP_SIZES.len()) as u64;
            return Op::RemoveWorker(if rng.chance(1, 10) { 99 } else { w });
        }
        if rare < 4 {
            return Op::RemoveRank(*rng.pick(&self.world.ranks));
        }
        if rng.chance(1, 200) {
            // A rank nobody created: removals and clears of it are counted, not applied.
            let rank = RankId::new(1000 + rng.below(3) as u64, 0);
            if rng.chance(1, 4) {
                return Op::Clear {
                    rank,
                    via_apply: rng.chance(1, 2),
                };
            }
            let k = rng.range(1, 3);
            return Op::Remove {
                rank,
                tier: TIERS[rng.below(3)],
                hashes: (0..k).map(|_| rng.next_u64()).collect(),
                via_apply: rng.chance(1, 2),
            };
        }
        let rank = *rng.pick(&self.world.ranks);
        if rare < 14 {
            return Op::Clear {
                rank,
                via_apply: rng.chance(1, 2),
            };
        }
        let live = model.rank(rank).map_or(0, |r| r.names_len());
        let remove_pct = if live > SOFT_CAP { 65 } else { 30 };
        // Odd workers serve a hybrid model: their recurrent group announces states.
        if rank.worker_id % 2 == 1 && live > 0 && self.rng.chance(1, 5) {
            return self.gen_states(model, rank);
        }
        if live > 0 && self.rng.chance(1, 12) {
            // Names picked as a removal picks them, copied onto a tier.
            let Op::Remove { hashes, .. } = self.gen_remove(model, rank) else {
                unreachable!("gen_remove makes removals")
            };
            let tier = self.tier();
            return Op::StoreKnown { rank, tier, hashes };
        }
        if live > 0 && self.rng.below(100) < remove_pct {
            self.gen_remove(model, rank)
        } else {
            self.gen_store(model, rank)
        }
    }

    fn gen_store(&mut self, model: &Model, rank: RankId) -> Op {
        let ri = self.rank_index(rank);
        if !self.recent_stores[ri].is_empty() && self.rng.chance(1, 20) {
            // A repeated store (idempotent unless something changed since).
            let k = self.rng.below(self.recent_stores[ri].len());
            return self.recent_stores[ri][k].clone();
        }
        let w = self.world;
        let c = w.pick_chain(&mut self.rng);
        let n = w.chains[c].locals.len();
        let p = self.progress(model, rank, c);
        let mut tier = self.tier();
        let kind = self.rng.below(100);
        let (start, parent) = match kind {
            // Continue the chain from where this rank's names end.
            0..=54 => {
                let start = if p == n { self.rng.below(n) } else { p };
                (start, None)
            }
            // From scratch (a repeated store of the prefix when already held).
            55..=74 => (0, None),
            // From an arbitrary position: parent may be held on another tier, or not at all.
            75..=91 if n >= 2 => (self.rng.range(1, n - 1), None),
            75..=91 => (0, None),
            // An unknown parent.
            _ => (self.rng.below(n), Some(self.rng.next_u64())),
        };
        let parent = parent.or_else(|| (start > 0).then(|| w.ext(rank, c, start - 1)));
        if kind < 55 && start > 0 && self.rng.chance(1, 3) {
            // Offload: the continuation goes to a lower tier than its parent.
            tier = if self.rng.chance(1, 2) {
                Tier::Host
            } else {
                Tier::Disk
            };
        }
        let m = if self.rng.chance(1, 25) {
            0
        } else if self.rng.chance(1, 10) {
            n - start
        } else {
            self.rng.range(1, 8).min(n - start)
        };
        let mut blocks: Vec<StoredBlock> = (start..start + m)
            .map(|j| StoredBlock {
                external_hash: w.ext(rank, c, j),
                local_hash: w.chains[c].locals[j],
            })
            .collect();
        if m > 0 && self.rng.chance(1, 25) {
            // The same name for other content: the name moves to the new block.
            let j = self.rng.below(m);
            blocks[j].local_hash = if self.rng.chance(1, 2) {
                self.rng.next_u64()
            } else {
                let other = w.pick_chain(&mut self.rng);
                let ol = &w.chains[other].locals;
                ol[(start + j).min(ol.len() - 1)]
            };
        }
        if m > 0 && self.rng.chance(1, 20) {
            // A second name for the same block.
            let j = self.rng.below(m);
            let v = self.rng.range(1, 2) as u64;
            blocks[j].external_hash = w.alias(rank, c, start + j, v);
        }
        if m > 1 && self.rng.chance(1, 100) {
            // One name twice in one event.
            let j = self.rng.below(m - 1);
            blocks[j + 1].external_hash = blocks[j].external_hash;
        }
        let op = Op::Store {
            rank,
            tier,
            parent,
            blocks,
            via_apply: self.rng.chance(1, 2),
        };
        let q = &mut self.recent_stores[ri];
        if q.len() == 8 {
            q.pop_front();
        }
        q.push_back(op.clone());
        op
    }

    /// States at a few blocks of the rank's chains (sparse, as vLLM's align mode keeps
    /// them), or their removal.
    fn gen_states(&mut self, model: &Model, rank: RankId) -> Op {
        let rm = model.rank(rank).expect("live rank");
        let tier = self.tier();
        let held: Vec<u64> = {
            let mut v: Vec<u64> = rm.states[tier as usize].keys().copied().collect();
            v.sort_unstable();
            v
        };
        if !held.is_empty() && self.rng.chance(1, 3) {
            let mut hashes: Vec<u64> = (0..self.rng.range(1, 3))
                .map(|_| *self.rng.pick(&held))
                .collect();
            if self.rng.chance(1, 8) {
                hashes.push(self.rng.next_u64());
            }
            return Op::RemoveStates { rank, tier, hashes };
        }
        let w = self.world;
        let mut hashes = Vec::new();
        for _ in 0..self.rng.range(1, 3) {
            let c = w.pick_chain(&mut self.rng);
            let p = self.progress(model, rank, c);
            if p > 0 {
                hashes.push(w.ext(rank, c, self.rng.below(p)));
            }
        }
        if hashes.is_empty() || self.rng.chance(1, 8) {
            // A state of a block the rank does not hold: left out, counted.
            hashes.push(self.rng.next_u64());
        }
        Op::StoreStates { rank, tier, hashes }
    }

    fn gen_remove(&mut self, model: &Model, rank: RankId) -> Op {
        let rm = model.rank(rank).expect("live rank");
        // The tier to take names from: one where the rank has some.
        let tiers: Vec<Tier> = TIERS
            .into_iter()
            .filter(|t| !rm.names[*t as usize].is_empty())
            .collect();
        let from = *self.rng.pick(&tiers);
        let mut names: Vec<u64> = rm.names[from as usize].keys().copied().collect();
        names.sort_unstable();
        let kind = self.rng.below(100);
        let mut hashes: Vec<u64> = Vec::new();
        match kind {
            // Evict a chain's tail (leaves first, as an LRU does).
            0..=39 => {
                let w = self.world;
                let c = w.pick_chain(&mut self.rng);
                let p = self.progress(model, rank, c);
                if p > 0 {
                    let from_j = self.rng.below(p);
                    let to_j = (from_j + self.rng.range(1, 6)).min(p);
                    hashes.extend((from_j..to_j).rev().map(|j| w.ext(rank, c, j)));
                } else {
                    hashes.push(*self.rng.pick(&names));
                }
            }
            // Random names, mid-chain.
            _ => {
                let k = self.rng.range(1, 4);
                for _ in 0..k {
                    hashes.push(*self.rng.pick(&names));
                }
            }
        }
        if self.rng.chance(1, 10) {
            hashes.push(self.rng.next_u64());
        }
        if self.rng.chance(1, 30) {
            let h = hashes[0];
            hashes.push(h);
        }
        let tier = if self.rng.chance(1, 8) {
            // The wrong tier: counted as not found unless also named there.
            TIERS[(from as usize + self.rng.range(1, 2)) % 3]
        } else {
            from
        };
        Op::Remove {
            rank,
            tier,
            hashes,
            via_apply: self.rng.chance(1, 2),
        }
    }

    /// A query: a pool chain's prefix, sometimes truncated, mutated or extended.
    fn query(&mut self) -> Vec<u64> {
        let w = self.world;
        let c = w.pick_chain(&mut self.rng);
        let locals = &w.chains[c].locals;
        let n = locals.len();
        let len = if self.rng.chance(1, 2) {
            n
        } else {
            self.rng.below(n + 1)
        };
        let mut q = locals[..len].to_vec();
        if !q.is_empty() && self.rng.chance(1, 5) {
            let j = self.rng.below(q.len());
            q[j] = if self.rng.chance(1, 2) {
                self.rng.next_u64()
            } else {
                let o = &w.chains[w.pick_chain(&mut self.rng)].locals;
                o[j.min(o.len() - 1)]
            };
        }
        if self.rng.chance(1, 8) {
            let extra = self.rng.range(1, 4);
            for _ in 0..extra {
                q.push(self.rng.next_u64());
            }
        }
        q
    }
}

fn apply_op(index: &Index, model: &mut Model, op: &Op, cov: &mut Coverage) {
    match op {
        Op::Store {
            rank,
            tier,
            parent,
            blocks,
            via_apply,
        } => {
            let want = model.store(*rank, *tier, *parent, blocks);
            let got = if *via_apply {
                index
                    .apply(
                        *rank,
                        &KvEvent::Stored {
                            tier: *tier,
                            parent: *parent,
                            blocks,
                        },
                    )
                    .map(|o| o.stored)
            } else {
                index.store(*rank, *tier, *parent, blocks)
            };
            assert_eq!(got, want, "store outcome (index vs model)");
            cov.stores += 1;
            match want {
                Ok(n) => cov.stored_blocks += n as u64,
                Err(_) => cov.parent_not_found += 1,
            }
        }
        Op::Remove {
            rank,
            tier,
            hashes,
            via_apply,
        } => {
            let want = model.remove(*rank, *tier, hashes);
            let got = if *via_apply {
                index
                    .apply(
                        *rank,
                        &KvEvent::Removed {
                            tier: *tier,
                            external_hashes: hashes,
                        },
                    )
                    .expect("Removed is never refused")
            } else {
                index.remove(*rank, *tier, hashes)
            };
            assert_eq!(got, want, "remove outcome (index vs model)");
            cov.removes += 1;
            cov.removed_blocks += want.removed as u64;
            cov.not_found += want.not_found as u64;
        }
        Op::StoreKnown { rank, tier, hashes } => {
            let want = model.store_known(*rank, *tier, hashes);
            let got = index
                .apply(
                    *rank,
                    &KvEvent::StoredKnown {
                        tier: *tier,
                        external_hashes: hashes,
                    },
                )
                .expect("StoredKnown is never refused");
            assert_eq!(got, want, "tokenless store outcome (index vs model)");
            cov.stores_known += 1;
            cov.stored_blocks += want.stored as u64;
        }
        Op::StoreStates { rank, tier, hashes } => {
            let want = model.store_states(*rank, *tier, hashes);
            let got = index
                .apply(
                    *rank,
                    &KvEvent::StatesStored {
                        tier: *tier,
                        external_hashes: hashes,
                    },
                )
                .expect("StatesStored is never refused");
            assert_eq!(got, want, "state store outcome (index vs model)");
            cov.states_stored += want.stored as u64;
        }
        Op::RemoveStates { rank, tier, hashes } => {
            let want = model.remove_states(*rank, *tier, hashes);
            let got = index
                .apply(
                    *rank,
                    &KvEvent::StatesRemoved {
                        tier: *tier,
                        external_hashes: hashes,
                    },
                )
                .expect("StatesRemoved is never refused");
            assert_eq!(got, want, "state removal outcome (index vs model)");
            cov.states_removed += want.removed as u64;
        }
        Op::Clear { rank, via_apply } => {
            let want = model.clear(*rank);
            let got = if *via_apply {
                index
                    .apply(*rank, &KvEvent::Cleared)
                    .expect("Cleared is never refused")
                    .removed
            } else {
                index.clear(*rank)
            };
            assert_eq!(got, want, "clear outcome (index vs model)");
            cov.clears += 1;
        }
        Op::RemoveRank(rank) => {
            let want = model.remove_rank(*rank);
            assert_eq!(index.remove_rank(*rank), want, "remove_rank outcome");
            cov.remove_ranks += 1;
        }
        Op::RemoveWorker(w) => {
            let want = model.remove_worker(*w);
            assert_eq!(index.remove_worker(*w), want, "remove_worker outcome");
            cov.remove_workers += 1;
        }
    }
}

fn check_query(
    index: &Index,
    model: &Model,
    q: &[u64],
    reuse: &mut OverlapScores,
    cov: &mut Coverage,
) {
    let want = model.find_matches(q);
    let got = index.find_matches(q);
    // The contract's safety property first, so a failure says which it is.
    for (r, s) in got.iter() {
        let m = want.iter().find(|e| e.0 == r).map_or(0, |e| e.1);
        assert!(
            m > 0,
            "OVERCOUNT: index scores rank {r} = {s}, the model does not score it; query {q:?}"
        );
        assert!(
            s <= m,
            "OVERCOUNT: index scores rank {r} = {s} > model {m}; query {q:?}"
        );
    }
    assert_eq!(
        got.as_slice(),
        want.as_slice(),
        "find_matches (index vs model); query {q:?}"
    );
    for w in got.as_slice().windows(2) {
        assert!(w[0].0 < w[1].0, "results sorted by rank");
    }
    index.find_matches_into(q, reuse);
    assert_eq!(reuse, &got, "find_matches_into vs find_matches");

    let want_t = model.find_matches_tiered(q);
    let got_t = index.find_matches_tiered(q);
    for t in got_t.iter() {
        let m = want_t.iter().find(|e| e.rank == t.rank);
        assert!(
            m.is_some(),
            "OVERCOUNT (tiered): index has {t:?}, the model has nothing; query {q:?}"
        );
    }
    assert_eq!(
        got_t.as_slice(),
        want_t.as_slice(),
        "find_matches_tiered (index vs model); query {q:?}"
    );
    cov.queries += 1;
    cov.nonzero_scores += got.len() as u64;
    cov.tiered_host_or_disk += got_t.iter().filter(|t| t.host + t.disk > 0).count() as u64;
    let mut plain = model.clone();
    for rm in plain.ranks.values_mut() {
        rm.hybrid = false;
    }
    let uncut = plain.find_matches(q);
    cov.state_cuts += uncut
        .iter()
        .filter(|(r, s)| want.iter().find(|e| e.0 == *r).map_or(0, |e| e.1) < *s)
        .count() as u64;
}

/// The most ranks holding one block on the device.
fn max_device_sharing(model: &Model) -> usize {
    let mut n: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    for rm in model.ranks.values() {
        for seq in rm.held[Tier::Device as usize].keys() {
            *n.entry(*seq).or_insert(0) += 1;
        }
    }
    n.values().copied().max().unwrap_or(0)
}

fn run(
    name: &'static str,
    seed: u64,
    ops: usize,
    config: IndexConfig,
    stats_every: usize,
) -> Coverage {
    let index = Index::with_config(config);
    let started = Instant::now();
    let mut report = FailureReport {
        name,
        seed,
        ops,
        op_no: 0,
        recent: VecDeque::new(),
    };
    let mut rng = Rng::new(seed);
    let world = World::new(&mut rng);
    let mut gen = Gen {
        world: &world,
        rng,
        recent_stores: vec![VecDeque::new(); world.ranks.len()],
    };
    let mut model = Model::new();
    let mut cov = Coverage::default();
    let mut reuse = OverlapScores::new();
    for i in 0..ops {
        report.op_no = i;
        let op = gen.next_op(&model);
        report.push(&op);
        apply_op(&index, &mut model, &op, &mut cov);
        for _ in 0..2 {
            let q = gen.query();
            check_query(&index, &model, &q, &mut reuse, &mut cov);
        }
        let ctx = || format!("seed {seed} op {i}");
        if i % stats_every == 0 || i + 1 == ops {
            assert_stats_equal(&index, &model, &ctx);
        } else if let Some(r) = op.rank() {
            // The rank the operation touched, every time.
            assert_rank_stats_equal(&index, &model, r, &ctx);
        }
        if i % 1000 == 0 || i + 1 == ops {
            model.self_check();
            cov.max_device_sharing = cov.max_device_sharing.max(max_device_sharing(&model));
            let live = model.ranks.values().map(|r| r.names_len()).sum();
            cov.max_live_names = cov.max_live_names.max(live);
        }
    }
    // Drain: remove everything; the index must come back to nothing.
    for r in model.ranks() {
        let want = model.clear(r);
        assert_eq!(index.clear(r), want, "final clear of {r}");
    }
    assert_stats_equal(&index, &model, &|| format!("seed {seed}, after clearing"));
    let s = index.stats();
    assert_eq!((s.nodes, s.holder_blocks, s.holder_set_bytes), (0, 0, 0));
    for w in 1..=DP_SIZES.len() as u64 {
        assert_eq!(index.remove_worker(w), model.remove_worker(w));
    }
    assert!(index.ranks().is_empty());
    eprintln!(
        "{name}: seed {seed} ({ops} ops) ok in {:.2?}: {cov:?}",
        started.elapsed()
    );
    drop(report);
    cov
}

/// `KVR_DIFF_OPS`, else `default` (a tenth of it in unoptimized builds; the full runs
/// are meant for `--release`).
fn env_ops(default: usize) -> usize {
    let default = if cfg!(debug_assertions) {
        default / 10
    } else {
        default
    };
    env_u64("KVR_DIFF_OPS").map_or(default, |n| n as usize)
}

/// Checks that the workload exercised what it is meant to.
fn assert_coverage(c: &Coverage, ops: usize) {
    if ops < 20_000 {
        // Too short a run to promise every kind of operation.
        return;
    }
    assert!(c.parent_not_found > 0, "no unknown parents: {c:?}");
    assert!(c.not_found > 0, "no unknown removals: {c:?}");
    assert!(c.stores_known > 0, "no tokenless stores: {c:?}");
    assert!(
        c.states_stored > 0 && c.states_removed > 0 && c.state_cuts > 0,
        "no recurrent states stored, removed, or cutting a score: {c:?}"
    );
    assert!(
        c.clears > 0 && c.remove_ranks > 0,
        "no clears/removals: {c:?}"
    );
    assert!(c.max_device_sharing >= 8, "no 8-way sharing: {c:?}");
    assert!(c.tiered_host_or_disk > 0, "no host/disk overlap: {c:?}");
    assert!(
        c.nonzero_scores > c.queries / 2,
        "queries rarely hit anything: {c:?}"
    );
}

#[test]
fn differential_main() {
    let seed = env_u64("KVR_DIFF_SEED").unwrap_or(0x6b76_7221);
    let ops = env_ops(200_000);
    let c = run("differential_main", seed, ops, IndexConfig::default(), 16);
    assert_coverage(&c, ops);
    assert!(
        c.remove_workers > 0 || ops < 20_000,
        "no remove_worker: {c:?}"
    );
}

#[test]
fn differential_seeds() {
    let ops = env_ops(25_000);
    let seeds: Vec<u64> = match env_u64("KVR_DIFF_SEED") {
        Some(s) => vec![s],
        None => (1..=6).collect(),
    };
    for seed in seeds {
        let c = run("differential_seeds", seed, ops, IndexConfig::default(), 4);
        assert_coverage(&c, ops);
    }
}

/// Tiny tables: one shard of 4 slots (rebuilds and shrinks all the time) and a few
/// shards with small tables.
#[test]
fn differential_tiny_tables() {
    let ops = env_ops(40_000);
    let seed = env_u64("KVR_DIFF_SEED").unwrap_or(77);
    for (shards, min_shard_capacity) in [(1, 4), (4, 8)] {
        let c = run(
            "differential_tiny_tables",
            seed ^ shards as u64,
            ops,
            IndexConfig {
                shards,
                min_shard_capacity,
            },
            4,
        );
        assert_coverage(&c, ops);
    }
}
