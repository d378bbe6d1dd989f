//! Index hot paths on the workload: ≥ 1,000,000 holder-blocks over 128 ranks,
//! 128-block chains, in two shapes (see `kvr_benches::Shape`). One thread.
//!
//! Per shape (`single` | `shared8`), the index is built once, then:
//! - `find_matches_<shape>/from_local/{32,128}`: `find_matches_into` — local hashes in.
//!   Elements = queries.
//! - `find_matches_<shape>/tiered/{32,128}`: `find_matches_tiered_into` on the same
//!   queries (nothing on host or disk): the tiered walk selection uses, beside it.
//!   Queries are stored chains drawn uniformly (a long pre-drawn list, cycled), truncated
//!   to 32 or 128 blocks; every query matches its holders in full.
//! - `apply_<shape>/store_steady`: one new 128-block chain stored on its holders (1 or 8
//!   `Stored` events) onto the 1M index; only the stores are timed, and the oldest chain is
//!   removed (untimed) after each, so the index stays at its size. Elements = blocks.
//! - `apply_<shape>/store_remove_pair`: the same, with the removal of the oldest chain timed
//!   too. Elements = block events (blocks stored + blocks removed).
//! - `apply_<shape>/store_fresh_128k`: 131,072 holder-blocks (1,024 single-holder chains or
//!   128 8-way chains) stored into an empty index, growth included. Elements = blocks.
//!
//! - `find_matches_<shape>/miss/{1,32,128,512}`: `find_matches_into` on a prompt nobody
//!   holds (random local hashes): one branch-table probe, whatever the length.
//!
//! The find_matches benches run before the apply benches, which churn the index.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvr::Tier;
use kvr::{Index, OverlapScores, TieredScores};
use kvr_benches::{
    build_index, index_config, ChainEvents, EventGen, QueryOrder, Shape, Workload, WorkloadConfig,
    DEFAULT_SEED,
};

const QUERY_LENS: [usize; 2] = [32, 128];
const FRESH_HOLDER_BLOCKS: usize = 131_072;

fn find_matches(c: &mut Criterion, w: &Workload) {
    let shape = w.config.shape;
    let mut g = c.benchmark_group(format!("find_matches_{}", shape.label()));
    g.throughput(Throughput::Elements(1));
    let mut out = OverlapScores::new();
    for n in QUERY_LENS {
        let mut order = QueryOrder::for_chains(w.chains.len());
        g.bench_function(format!("from_local/{n}"), |b| {
            b.iter(|| {
                let q = &w.chains.local(order.next())[..n];
                w.index.find_matches_into(black_box(q), &mut out);
                black_box(out.len())
            })
        });
        // The same queries through the tiered walk (what selection uses), nothing on the
        // host or disk tiers: its cost beside the device-only walk's.
        let mut order = QueryOrder::for_chains(w.chains.len());
        let mut tiered = TieredScores::new();
        g.bench_function(format!("tiered/{n}"), |b| {
            b.iter(|| {
                let q = &w.chains.local(order.next())[..n];
                w.index.find_matches_tiered_into(black_box(q), &mut tiered);
                black_box(tiered.len())
            })
        });
    }
    // Misses: prompts of random local hashes, a few of them cycled.
    let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for n in [1usize, 32, 128, 512] {
        let prompts: Vec<Vec<u64>> = (0..64).map(|_| (0..n).map(|_| next()).collect()).collect();
        let mut i = 0;
        g.bench_function(format!("miss/{n}"), |b| {
            b.iter(|| {
                i = (i + 1) % prompts.len();
                w.index.find_matches_into(black_box(&prompts[i]), &mut out);
                black_box(out.len())
            })
        });
    }
    g.finish();
}

/// Stores one new chain; returns the time the stores took.
fn timed_store(w: &mut Workload) -> Duration {
    let ev = w.events.next_chain();
    let placements = ev.placements();
    let t = Instant::now();
    black_box(ev.apply(&w.index));
    let d = t.elapsed();
    w.placements.extend(placements);
    d
}

/// Removes the oldest chain from all of its holders; returns the time the removals took.
fn timed_remove_oldest(w: &mut Workload) -> Duration {
    let k = w.config.shape.holders_per_chain();
    let old: Vec<_> = (0..k).filter_map(|_| w.placements.pop_front()).collect();
    let t = Instant::now();
    for p in &old {
        black_box(w.index.remove(p.rank, Tier::Device, &p.external));
    }
    t.elapsed()
}

fn apply(c: &mut Criterion, w: &mut Workload) {
    let shape = w.config.shape;
    let blocks = (w.config.chain_len * shape.holders_per_chain()) as u64;
    let mut g = c.benchmark_group(format!("apply_{}", shape.label()));

    g.throughput(Throughput::Elements(blocks));
    g.bench_function("store_steady", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                total += timed_store(w);
                w.remove_oldest();
            }
            total
        })
    });

    g.throughput(Throughput::Elements(2 * blocks));
    g.bench_function("store_remove_pair", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                total += timed_store(w);
                total += timed_remove_oldest(w);
            }
            total
        })
    });

    let fresh_chains = FRESH_HOLDER_BLOCKS / blocks as usize;
    let mut gen = EventGen::new(&WorkloadConfig::new(shape)).reseeded(DEFAULT_SEED ^ 0xf7e5);
    let events: Vec<ChainEvents> = (0..fresh_chains).map(|_| gen.next_chain()).collect();
    g.throughput(Throughput::Elements((fresh_chains as u64) * blocks));
    g.sample_size(10);
    g.bench_function("store_fresh_128k", |b| {
        b.iter_batched(
            || Index::with_config(index_config()),
            |index| {
                for ev in &events {
                    black_box(ev.apply(&index));
                }
                index // dropped outside the timed region
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn suite(c: &mut Criterion, shape: Shape) {
    let t = Instant::now();
    let mut w = build_index(WorkloadConfig::new(shape));
    let s = w.stats();
    eprintln!(
        "[kvr-benches] {}: built {} holder-blocks, {} nodes, {} chains in {:.1?}; {:.2} B/holder-block",
        shape.label(),
        s.holder_blocks,
        s.nodes,
        w.chains.len(),
        t.elapsed(),
        s.bytes_per_holder_block()
    );
    find_matches(c, &w);
    apply(c, &mut w);
}

fn single(c: &mut Criterion) {
    suite(c, Shape::SingleHolder);
}

fn shared8(c: &mut Criterion) {
    suite(c, Shape::Shared8);
}

criterion_group! {
    name = benches;
    // Modest defaults (the CLI's --warm-up-time / --measurement-time override them).
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = single, shared8
}
criterion_main!(benches);
