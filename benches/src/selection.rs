//! The selection workload: one partition of ranks holding shared prefixes and private
//! chains, with live bookings and reported loads, for the selection suites (the criterion
//! bench and the fleet-scale runs).

use crate::{random_tokens, SplitMix64, DEFAULT_SEED};
use kvr::{RankId, StoredBlock, Tier};

/// Size and shape of a selection workload (see [`build_selection`]).
///
/// A partition of `ranks` ranks, `dp_size` data-parallel ranks to a worker (so
/// `ranks / dp_size` workers), block size `block_size`. A pool of `pool_prompts` prompts of `pool_tokens` tokens stands for the
/// popular shared prefixes (system prompts, documents, long conversations). Each rank holds
/// (on its device tier) a prefix of `prefixes_per_rank` pool prompts, drawn at random, each
/// of a log-uniform length between one block and the whole prompt, so that a query's
/// overlap differs from rank to rank: many ranks hold nothing of it, some a few blocks,
/// some all of it. Each rank also holds `private_blocks_per_rank` blocks of chains nobody
/// else holds (its own conversations: index size, no overlap), and carries
/// `bookings_per_rank` live bookings of prefixes of prompts it holds (half of them past
/// prefill, some with output blocks), so the cost's prefill, decode and
/// new-blocks-not-active terms are all non-zero. Every rank has reported a load.
/// The adapter every `lora_every`-th worker serves.
pub const LORA: &str = "fleet-lora";

#[derive(Clone, Copy, Debug)]
pub struct SelectionConfig {
    pub ranks: usize,
    /// Data-parallel ranks per worker (divides `ranks`; 1 = a worker per rank).
    pub dp_size: u32,
    /// Every `lora_every`-th worker (from worker 0) serves the adapter [`LORA`]; 0 = none
    /// does, so a request naming it narrows the candidates to 1 in `lora_every` workers.
    pub lora_every: usize,
    pub block_size: u32,
    pub pool_prompts: usize,
    pub pool_tokens: usize,
    pub prefixes_per_rank: usize,
    pub private_blocks_per_rank: usize,
    pub bookings_per_rank: usize,
    pub seed: u64,
    /// The partition's cost model (`KVR_SEL_COST=dynamo|latency` in the selection bench,
    /// default latency: kvr's default), so the two compare side by side.
    pub cost_model: kvr::config::CostModel,
}

impl SelectionConfig {
    /// The workload at `ranks` ranks: block size 16, 64 pool prompts of 8,192
    /// tokens, 8 prefixes, 1,024 private blocks and 4 live bookings per rank.
    pub fn new(ranks: usize) -> Self {
        SelectionConfig {
            ranks,
            dp_size: 1,
            lora_every: 0,
            block_size: 16,
            pool_prompts: 64,
            pool_tokens: 8_192,
            prefixes_per_rank: 8,
            private_blocks_per_rank: 1_024,
            bookings_per_rank: 4,
            seed: DEFAULT_SEED ^ 0x005e_1ec7,
            cost_model: std::env::var("KVR_SEL_COST")
                .ok()
                .and_then(|m| kvr::config::CostModel::parse(&m))
                .unwrap_or_default(),
        }
    }

    fn pool_blocks(&self) -> usize {
        self.pool_tokens / self.block_size as usize
    }
}

/// A built selection workload: an engine with one partition, ready to select on.
#[derive(Debug)]
pub struct SelectionWorkload {
    pub config: SelectionConfig,
    pub engine: std::sync::Arc<kvr::Engine>,
    pub key: kvr::PartitionKey,
    /// The shared prompts, `pool_tokens` tokens each.
    pub pool: Vec<Vec<u32>>,
    /// Live bookings made while building (they stay for the workload's lifetime).
    pub live_bookings: usize,
    /// (rank, device block) pairs stored in the partition's index.
    pub holder_blocks: u64,
}

/// Log-uniform in `1..=max`.
fn log_uniform(rng: &mut SplitMix64, max: usize) -> usize {
    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    ((max as f64).powf(u) as usize).clamp(1, max)
}

/// Builds a selection workload (deterministic in `config.seed`).
pub fn build_selection(config: SelectionConfig) -> SelectionWorkload {
    use kvr::config::PartitionConfig;
    use kvr::Engine;
    use kvr::RankLoad;
    use kvr::SelectRequest;
    use kvr::{PartitionKey, WorkerInfo};

    let bs = config.block_size as usize;
    let pool_blocks = config.pool_blocks();
    assert!(pool_blocks >= 1, "pool prompts shorter than one block");
    let mut rng = SplitMix64::new(config.seed);
    let engine = std::sync::Arc::new(Engine::with_seed(config.seed));
    let key = PartitionKey::new("bench-model", "default");
    let part = engine
        .create_partition(
            key.clone(),
            PartitionConfig {
                cost: kvr::config::CostConfig {
                    model: config.cost_model,
                    ..kvr::config::CostConfig::default()
                },
                ..PartitionConfig::new(config.block_size)
            },
        )
        .expect("a fresh engine has no partitions");
    let hasher = *part.hasher();

    let pool: Vec<Vec<u32>> = (0..config.pool_prompts)
        .map(|i| random_tokens(config.pool_tokens, config.seed ^ (0x9001 + i as u64)))
        .collect();
    let pool_local: Vec<Vec<u64>> = pool
        .iter()
        .map(|p| {
            let mut l = Vec::new();
            hasher.local_hashes(p, &mut l);
            l
        })
        .collect();

    let dp = config.dp_size.max(1) as usize;
    assert_eq!(config.ranks % dp, 0, "ranks not a multiple of dp_size");
    let ranks: Vec<RankId> = (0..config.ranks)
        .map(|r| RankId::new((r / dp) as u64, (r % dp) as u32))
        .collect();
    for w in 0..config.ranks / dp {
        let mut info = WorkerInfo::new(w as u64, dp as u32);
        info.total_kv_blocks = 65_536;
        info.max_batched_tokens = 16_384;
        if config.lora_every > 0 && w % config.lora_every == 0 {
            info.lora_adapters = vec![LORA.to_string()];
        }
        part.upsert_worker(info).unwrap();
    }

    let index = part.index();
    let mut holder_blocks = 0u64;
    let mut held: Vec<Vec<(usize, usize)>> = Vec::with_capacity(config.ranks);
    let mut blocks: Vec<StoredBlock> = Vec::new();
    for &rank in &ranks {
        // Shared prefixes.
        let mut mine: Vec<(usize, usize)> = Vec::with_capacity(config.prefixes_per_rank);
        while mine.len() < config.prefixes_per_rank.min(config.pool_prompts) {
            let p = rng.below(config.pool_prompts);
            if mine.iter().any(|&(q, _)| q == p) {
                continue;
            }
            let len = log_uniform(&mut rng, pool_blocks);
            blocks.clear();
            blocks.extend(pool_local[p][..len].iter().map(|&l| StoredBlock {
                external_hash: rng.next_u64(),
                local_hash: l,
            }));
            holder_blocks += index
                .store(rank, Tier::Device, None, &blocks)
                .expect("a parentless store cannot fail") as u64;
            mine.push((p, len));
        }
        // Private chains, 128 blocks each (the last one shorter).
        let mut left = config.private_blocks_per_rank;
        while left > 0 {
            let n = left.min(128);
            blocks.clear();
            blocks.extend((0..n).map(|_| StoredBlock {
                external_hash: rng.next_u64(),
                local_hash: rng.next_u64(),
            }));
            holder_blocks += index
                .store(rank, Tier::Device, None, &blocks)
                .expect("a parentless store cannot fail") as u64;
            left -= n;
        }
        held.push(mine);
    }

    // Live bookings: prefixes of prompts the rank holds (some a little longer than what
    // it caches), half past prefill, some with output blocks.
    let mut live_bookings = 0;
    for (r, &rank) in ranks.iter().enumerate() {
        for b in 0..config.bookings_per_rank {
            let Some(&(p, len)) = held[r].get(rng.below(held[r].len().max(1))) else {
                break;
            };
            let blocks = (len + rng.below(4)).min(pool_blocks);
            let tokens = &pool[p][..blocks * bs];
            let d = engine
                .reserve(&key, rank, Some(&SelectRequest::tokens(tokens)), None, None)
                .expect("booking a member rank");
            let id = d.selection_id.expect("a booking has an id");
            if b % 2 == 1 {
                engine.mark_prefill_complete(id).expect("live booking");
                engine
                    .add_output_blocks(id, 1 + rng.below(32) as u64)
                    .expect("live booking");
            }
            live_bookings += 1;
        }
    }

    // Host-reported load of every rank.
    let reports: Vec<(RankId, RankLoad)> = ranks
        .iter()
        .map(|&r| {
            (
                r,
                RankLoad {
                    kv_blocks_used: rng.below(32_768) as u64,
                    kv_blocks_total: 65_536,
                    waiting_requests: rng.below(4) as u32,
                    running_requests: config.bookings_per_rank as u32,
                    pending_prefill_tokens: rng.below(8_192) as u64,
                },
            )
        })
        .collect();
    part.load_view().publish(&reports);

    SelectionWorkload {
        config,
        engine,
        key,
        pool,
        live_bookings,
        holder_blocks,
    }
}

impl SelectionWorkload {
    /// `count` prompts of `tokens` tokens: each starts with a prefix of a pool prompt of a
    /// uniformly drawn number of blocks (0 to all of the prompt's blocks) and continues
    /// with fresh random tokens, so overlaps range from none to the whole prompt.
    pub fn queries(&self, tokens: usize, count: usize, seed: u64) -> Vec<Vec<u32>> {
        let bs = self.config.block_size as usize;
        let mut rng = SplitMix64::new(seed);
        (0..count)
            .map(|_| {
                let p = rng.below(self.pool.len());
                let max_shared = tokens.min(self.config.pool_tokens) / bs;
                let shared = rng.below(max_shared + 1) * bs;
                let mut q = Vec::with_capacity(tokens);
                q.extend_from_slice(&self.pool[p][..shared]);
                q.extend((shared..tokens).map(|_| (rng.next_u64() >> 47) as u32));
                q
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_workload_books_and_frees_back_to_its_bookings() {
        use kvr::{Outcome, SelectRequest};
        let cfg = SelectionConfig {
            pool_prompts: 8,
            pool_tokens: 512,
            private_blocks_per_rank: 200,
            ..SelectionConfig::new(8)
        };
        let w = build_selection(cfg);
        let p = w.engine.partition(&w.key).unwrap();
        assert_eq!(w.live_bookings, 8 * cfg.bookings_per_rank);
        assert_eq!(p.bookings().len(), w.live_bookings);
        assert_eq!(p.index().stats().holder_blocks, w.holder_blocks);
        let before: Vec<_> = p.bookings().loads().ranks().collect();
        let qs = w.queries(256, 32, 7);
        assert!(qs.iter().all(|q| q.len() == 256));
        let mut chosen = std::collections::HashSet::new();
        for q in &qs {
            let req = SelectRequest::tokens(q);
            let Outcome::Selected(d) = w.engine.select_and_reserve(&w.key, &req).unwrap() else {
                panic!("no rank selected");
            };
            chosen.insert(d.rank);
            w.engine.free(d.selection_id.unwrap()).unwrap();
            assert!(matches!(
                w.engine.select(&w.key, &req).unwrap(),
                Outcome::Selected(_)
            ));
        }
        assert!(chosen.len() > 1, "every query went to one rank");
        assert_eq!(p.bookings().len(), w.live_bookings);
        let after: Vec<_> = p.bookings().loads().ranks().collect();
        assert_eq!(before, after);
        p.bookings().audit().unwrap();
    }
}
