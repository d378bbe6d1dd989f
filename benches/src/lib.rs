//! Shared workload builders of the benchmark suites.
//!
//! Everything is deterministic: random numbers come from a seeded splitmix64, so two runs
//! build the same index and ask the same queries.
//!
//! The index workload (see [`build_index`]) is a set of random chains of `chain_len`
//! blocks stored over `ranks` ranks in one of two [`Shape`]s, until the index holds at
//! least `total_holder_blocks` (rank, block) pairs. Queries are stored chains picked
//! uniformly at random (with replacement, from a long pre-drawn list, so the whole index
//! is the working set), truncated to the query length.

use std::collections::VecDeque;

pub mod selection;
pub mod timing;

pub use selection::{build_selection, SelectionConfig, SelectionWorkload};

use kvr::config::IndexConfig;
use kvr::hash::sequence_hashes;
use kvr::stats::IndexStats;
use kvr::Index;
use kvr::{RankId, StoredBlock, Tier};

/// The seed every suite uses unless it says otherwise.
pub const DEFAULT_SEED: u64 = 0x6b76_725f_6265_6e63; // "kvr_benc"

/// splitmix64: small, fast, and good enough to draw hashes and indices.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        // The state advances by the golden ratio; the output is its SplitMix64 mix.
        let z = kvr::hash::splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z
    }

    /// Uniform in `0..n` (multiply-shift; the bias is negligible for small `n`).
    #[inline]
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

/// How chains are spread over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shape {
    /// Every chain is stored on exactly one rank (round-robin over the ranks).
    SingleHolder,
    /// Every chain is stored on 8 distinct random ranks (same local hashes, distinct
    /// external hashes per rank): every node has 8 holders.
    Shared8,
}

impl Shape {
    pub const ALL: [Shape; 2] = [Shape::SingleHolder, Shape::Shared8];

    /// Ranks that store each chain.
    pub fn holders_per_chain(self) -> usize {
        match self {
            Shape::SingleHolder => 1,
            Shape::Shared8 => 8,
        }
    }

    /// Short name used in bench ids.
    pub fn label(self) -> &'static str {
        match self {
            Shape::SingleHolder => "single",
            Shape::Shared8 => "shared8",
        }
    }
}

/// Size and shape of an index workload.
#[derive(Clone, Copy, Debug)]
pub struct WorkloadConfig {
    pub shape: Shape,
    /// Build until the index holds at least this many (rank, block) pairs.
    pub total_holder_blocks: usize,
    pub ranks: usize,
    /// Blocks per stored chain (one `Stored` event per chain and holder).
    pub chain_len: usize,
    pub seed: u64,
}

impl WorkloadConfig {
    /// The workload: ≥ 1,000,000 holder-blocks, 128 ranks, 128-block chains.
    pub fn new(shape: Shape) -> Self {
        WorkloadConfig {
            shape,
            total_holder_blocks: 1_000_000,
            ranks: 128,
            chain_len: 128,
            seed: DEFAULT_SEED,
        }
    }

    /// Chains needed to reach `total_holder_blocks`.
    pub fn chains(&self) -> usize {
        let per_chain = self.chain_len * self.shape.holders_per_chain();
        self.total_holder_blocks.div_ceil(per_chain)
    }
}

/// The 128 (or `n`) ranks of a workload: 8 data-parallel ranks per worker.
pub fn rank_ids(n: usize) -> Vec<RankId> {
    (0..n)
        .map(|r| RankId::new((r / 8) as u64, (r % 8) as u32))
        .collect()
}

/// Stored chains, flat: chain `i` is `local[i * chain_len..][..chain_len]`.
#[derive(Clone, Debug, Default)]
pub struct Chains {
    chain_len: usize,
    local: Vec<u64>,
    seq: Vec<u64>,
}

impl Chains {
    pub fn new(chain_len: usize) -> Self {
        Chains {
            chain_len,
            ..Default::default()
        }
    }

    pub fn push(&mut self, local: &[u64]) {
        assert_eq!(local.len(), self.chain_len);
        self.local.extend_from_slice(local);
        self.seq.extend(sequence_hashes(local));
    }

    pub fn len(&self) -> usize {
        self.local.len().checked_div(self.chain_len).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.local.is_empty()
    }

    pub fn chain_len(&self) -> usize {
        self.chain_len
    }

    /// Local hashes of chain `i`.
    pub fn local(&self, i: usize) -> &[u64] {
        &self.local[i * self.chain_len..][..self.chain_len]
    }

    /// Sequence hashes of chain `i`.
    pub fn seq(&self, i: usize) -> &[u64] {
        &self.seq[i * self.chain_len..][..self.chain_len]
    }
}

/// One chain stored on one rank: what it takes to remove it again.
#[derive(Clone, Debug)]
pub struct Placement {
    pub rank: RankId,
    pub external: Vec<u64>,
}

/// One new chain and the `Stored` events that place it on its holders.
#[derive(Clone, Debug)]
pub struct ChainEvents {
    pub local: Vec<u64>,
    /// One 128-block (chain_len) store per holder rank, `parent = None`.
    pub stores: Vec<(RankId, Vec<StoredBlock>)>,
}

impl ChainEvents {
    /// Blocks the events store in total (chain_len × holders).
    pub fn blocks(&self) -> usize {
        self.stores.iter().map(|(_, b)| b.len()).sum()
    }

    /// Applies every store to `index`. Returns the blocks newly stored.
    #[inline]
    pub fn apply(&self, index: &Index) -> usize {
        self.stores
            .iter()
            .map(|(rank, blocks)| {
                index
                    .store(*rank, Tier::Device, None, blocks)
                    .expect("a parentless store on ≤ 128 ranks cannot fail")
            })
            .sum()
    }

    /// What it takes to remove these stores again, one placement per holder.
    pub fn placements(&self) -> Vec<Placement> {
        self.stores
            .iter()
            .map(|(rank, blocks)| Placement {
                rank: *rank,
                external: blocks.iter().map(|b| b.external_hash).collect(),
            })
            .collect()
    }
}

/// Generates fresh random chains and their store events in a workload's shape.
#[derive(Clone, Debug)]
pub struct EventGen {
    shape: Shape,
    ranks: Vec<RankId>,
    chain_len: usize,
    rng: SplitMix64,
    next_rank: usize,
}

impl EventGen {
    pub fn new(config: &WorkloadConfig) -> Self {
        EventGen {
            shape: config.shape,
            ranks: rank_ids(config.ranks),
            chain_len: config.chain_len,
            rng: SplitMix64::new(config.seed),
            next_rank: 0,
        }
    }

    /// The same generator with another seed (for chains disjoint from the built set).
    pub fn reseeded(mut self, seed: u64) -> Self {
        self.rng = SplitMix64::new(seed);
        self
    }

    pub fn ranks(&self) -> &[RankId] {
        &self.ranks
    }

    /// The next chain: random local hashes, holder ranks, random external hashes per rank.
    pub fn next_chain(&mut self) -> ChainEvents {
        let local: Vec<u64> = (0..self.chain_len).map(|_| self.rng.next_u64()).collect();
        let holders: Vec<usize> = match self.shape {
            Shape::SingleHolder => {
                let r = self.next_rank;
                self.next_rank = (self.next_rank + 1) % self.ranks.len();
                vec![r]
            }
            Shape::Shared8 => {
                let k = self.shape.holders_per_chain().min(self.ranks.len());
                let mut picked: Vec<usize> = Vec::with_capacity(k);
                while picked.len() < k {
                    let r = self.rng.below(self.ranks.len());
                    if !picked.contains(&r) {
                        picked.push(r);
                    }
                }
                picked
            }
        };
        let stores = holders
            .into_iter()
            .map(|r| {
                let blocks = local
                    .iter()
                    .map(|&l| StoredBlock {
                        external_hash: self.rng.next_u64(),
                        local_hash: l,
                    })
                    .collect();
                (self.ranks[r], blocks)
            })
            .collect();
        ChainEvents { local, stores }
    }
}

/// A built index with everything needed to query it and to churn it.
#[derive(Debug)]
pub struct Workload {
    pub config: WorkloadConfig,
    pub index: Index,
    /// The stored chains, in store order (chain `i` of `chains` is placement group `i`).
    pub chains: Chains,
    /// Live placements, oldest first (`holders_per_chain` per chain).
    pub placements: VecDeque<Placement>,
    /// Makes further chains, disjoint from the stored ones, for the apply benches.
    pub events: EventGen,
    /// Growth of the process's resident set while the stores were applied: the index's
    /// real footprint including allocator overhead (approximate; Linux only).
    pub rss_growth: Option<u64>,
}

impl Workload {
    /// Removes the oldest stored chain from all of its holders (the steady-state churn:
    /// the benches store one new chain with [`ChainEvents::apply`], push its placements,
    /// and call this). Returns the blocks removed.
    pub fn remove_oldest(&mut self) -> usize {
        let k = self.config.shape.holders_per_chain();
        let mut removed = 0;
        for _ in 0..k {
            if let Some(p) = self.placements.pop_front() {
                removed += self.index.remove(p.rank, Tier::Device, &p.external).removed;
            }
        }
        removed
    }

    pub fn stats(&self) -> IndexStats {
        self.index.stats()
    }
}

/// The index configuration every suite uses (the engine's default).
pub fn index_config() -> IndexConfig {
    IndexConfig::default()
}

/// Builds the workload's index: `config.chains()` random chains, each stored (one
/// `Stored` event of `chain_len` blocks, no parent) on its holder ranks.
pub fn build_index(config: WorkloadConfig) -> Workload {
    let mut gen = EventGen::new(&config);
    let n = config.chains();
    let mut chains = Chains::new(config.chain_len);
    let mut placements = VecDeque::with_capacity(n * config.shape.holders_per_chain());
    let events: Vec<ChainEvents> = (0..n).map(|_| gen.next_chain()).collect();
    for ev in &events {
        chains.push(&ev.local);
        placements.extend(ev.placements());
    }
    // Everything the benches keep is allocated; what RSS gains now is the index's.
    let rss_before = rss_bytes();
    let index = Index::with_config(index_config());
    for ev in &events {
        ev.apply(&index);
    }
    let rss_growth = rss_before
        .zip(rss_bytes())
        .map(|(a, b)| b.saturating_sub(a));
    drop(events);
    let events = gen.reseeded(config.seed ^ 0xdead_beef_cafe_f00d);
    Workload {
        config,
        index,
        chains,
        placements,
        events,
        rss_growth,
    }
}

/// A long list of uniformly drawn chain indices (with replacement), cycled by the benches
/// so that consecutive queries hit unrelated parts of the index.
#[derive(Clone, Debug)]
pub struct QueryOrder {
    order: Vec<u32>,
    next: usize,
}

impl QueryOrder {
    /// `len` draws from `0..chains`.
    pub fn new(chains: usize, len: usize, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        QueryOrder {
            order: (0..len).map(|_| rng.below(chains) as u32).collect(),
            next: 0,
        }
    }

    /// The default: 2^16 draws, or 8 per chain if the index has more chains.
    pub fn for_chains(chains: usize) -> Self {
        Self::new(chains, (chains * 8).max(1 << 16), DEFAULT_SEED ^ 0x9)
    }

    #[inline]
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> usize {
        let i = self.order[self.next] as usize;
        self.next += 1;
        if self.next == self.order.len() {
            self.next = 0;
        }
        i
    }

    /// Distinct chains among the draws.
    pub fn distinct(&self) -> usize {
        let mut v = self.order.clone();
        v.sort_unstable();
        v.dedup();
        v.len()
    }
}

/// Resident set size of this process in bytes (Linux `/proc/self/statm`), if readable.
pub fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// A deterministic prompt of `n` tokens (ids below 2^17, like real vocabularies).
pub fn random_tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| (rng.next_u64() >> 47) as u32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(shape: Shape) -> WorkloadConfig {
        WorkloadConfig {
            total_holder_blocks: 20_000,
            ranks: 16,
            chain_len: 32,
            ..WorkloadConfig::new(shape)
        }
    }

    #[test]
    fn shapes_hold_what_they_claim() {
        for shape in Shape::ALL {
            let cfg = small(shape);
            let w = build_index(cfg);
            let s = w.stats();
            let k = shape.holders_per_chain() as u64;
            assert_eq!(w.chains.len(), cfg.chains());
            assert_eq!(s.holder_blocks, (cfg.chains() * cfg.chain_len) as u64 * k);
            assert!(s.holder_blocks >= cfg.total_holder_blocks as u64);
            assert_eq!(s.nodes, (cfg.chains() * cfg.chain_len) as u64);
            let mut out = kvr::OverlapScores::new();
            for i in [0, w.chains.len() / 2, w.chains.len() - 1] {
                w.index.find_matches_into(w.chains.local(i), &mut out);
                assert_eq!(out.len() as u64, k);
                assert!(out.iter().all(|(_, n)| n as usize == cfg.chain_len));
            }
        }
    }

    #[test]
    fn churn_keeps_size() {
        for shape in Shape::ALL {
            let mut w = build_index(small(shape));
            let before = w.stats().holder_blocks;
            for _ in 0..10 {
                let ev = w.events.next_chain();
                assert_eq!(ev.apply(&w.index), ev.blocks());
                w.placements.extend(ev.placements());
                assert_eq!(w.remove_oldest(), ev.blocks());
            }
            assert_eq!(w.stats().holder_blocks, before);
        }
    }

    #[test]
    fn deterministic() {
        let a = build_index(small(Shape::Shared8));
        let b = build_index(small(Shape::Shared8));
        assert_eq!(a.chains.seq(3), b.chains.seq(3));
        assert_eq!(a.stats().bytes, b.stats().bytes);
    }
}
