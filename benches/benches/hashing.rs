//! Block hashing throughput: tokens → local + sequence hashes (what a router does for
//! every request before it can ask the index).
//!
//! - `hashing/hash_tokens/bs{16,64}`: a 4,096-token prompt, elements = tokens.
//! - `hashing/sequence_chain/{32,128}`: local → sequence hashes only (the extra work
//!   what a booking records per rank, and what a client may send precomputed), elements =
//!   blocks.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvr::hash::HashSalt;
use kvr::hash::{extend_sequence_hashes, BlockHasher};
use kvr_benches::{random_tokens, SplitMix64, DEFAULT_SEED};

const PROMPT_TOKENS: usize = 4096;

fn hash_tokens(c: &mut Criterion) {
    let mut g = c.benchmark_group("hashing/hash_tokens");
    let tokens = random_tokens(PROMPT_TOKENS, DEFAULT_SEED);
    g.throughput(Throughput::Elements(PROMPT_TOKENS as u64));
    for bs in [16usize, 64] {
        let hasher = BlockHasher::new(bs, HashSalt::NONE).expect("non-zero block size");
        let (mut local, mut seq) = (Vec::new(), Vec::new());
        g.bench_function(BenchmarkId::from_parameter(format!("bs{bs}")), |b| {
            b.iter(|| {
                hasher.hash_tokens(black_box(&tokens), &mut local, &mut seq);
                black_box((&local, &seq));
            })
        });
    }
    g.finish();
}

fn sequence_chain(c: &mut Criterion) {
    let mut g = c.benchmark_group("hashing/sequence_chain");
    let mut rng = SplitMix64::new(DEFAULT_SEED);
    for n in [32usize, 128] {
        let locals: Vec<u64> = (0..n).map(|_| rng.next_u64()).collect();
        let mut out = Vec::with_capacity(n);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                out.clear();
                extend_sequence_hashes(None, black_box(&locals), &mut out);
                black_box(&out);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, hash_tokens, sequence_chain);
criterion_main!(benches);
