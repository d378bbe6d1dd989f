//! Ingest throughput (issue 5 item 8): engine messages decoded and applied, in blocks per
//! second on one core.
//!
//! Workload (deterministic): 64 workers of one rank and one stream each, block size 16; each message is one vLLM 0.33 batch (tagged maps) of 4
//! `BlockStored` events of 16 blocks each (a prompt chain continued by parent, with
//! tokens) and, from the second round on, one `BlockRemoved` of the 64 blocks the same
//! rank stored a round earlier — so the index stays the same size. Messages are built
//! before timing and handed to `Partition::ingest` in order, with consecutive sequence
//! numbers per stream.
//!
//! - `ingest/decode_only`: `decode_batch` of the messages (elements = blocks).
//! - `ingest/decode_apply`: `Partition::ingest` (sequence check, decode, local hashes from
//!   the tokens, index apply; elements = blocks stored + removed).
//!
//! Run: `cargo bench -p kvr-benches --bench ingest`. Without `--bench` it runs a smoke
//! version that checks the index stays bounded.

use std::hint::black_box;

use criterion::{Criterion, Throughput};
use kvr::config::PartitionConfig;
use kvr::ingress::{decode_batch, DecodedBatch, Medium};
use kvr::{Partition, PartitionKey};
use kvr_emulator::BatchEncoder;

const BS: usize = 16;
const RANKS: u64 = 64;
const STORES: usize = 4;
const CHAIN: usize = 16;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // The state advances by the golden ratio; the output is its SplitMix64 mix.
        let z = kvr::hash::splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z
    }
}

/// (worker, seq, payload, blocks in it) for `rounds` rounds over every rank.
fn messages(rounds: usize) -> Vec<(u64, u64, Vec<u8>, u64)> {
    let mut rng = Rng(7);
    let mut out = Vec::new();
    let mut prev: Vec<Vec<u64>> = vec![Vec::new(); RANKS as usize];
    let mut next_hash = 1u64;
    for round in 0..rounds {
        for w in 0..RANKS {
            let mut batch = BatchEncoder::new();
            let mut this = Vec::new();
            for _ in 0..STORES {
                let tokens: Vec<u32> = (0..CHAIN * BS).map(|_| (rng.next() >> 40) as u32).collect();
                let hashes: Vec<u64> = (0..CHAIN)
                    .map(|_| {
                        next_hash += 1;
                        next_hash
                    })
                    .collect();
                batch.stored(&hashes, None, &tokens, BS as u32, Medium::Gpu, None);
                this.extend_from_slice(&hashes);
            }
            let mut blocks = this.len() as u64;
            let old = std::mem::replace(&mut prev[w as usize], this);
            if !old.is_empty() {
                batch.removed(&old, Medium::Gpu);
                blocks += old.len() as u64;
            }
            let msg = batch.finish(1.0, Some(0));
            out.push((w, round as u64, msg, blocks));
        }
    }
    out
}

fn main() {
    let bench_mode = std::env::args().any(|a| a == "--bench");
    let rounds = if bench_mode { 40 } else { 4 };
    let msgs = messages(rounds);
    let blocks: u64 = msgs.iter().map(|m| m.3).sum();
    let p = Partition::new(
        PartitionKey::new("bench", "g"),
        PartitionConfig::new(BS as u32),
    );
    // Smoke: everything applies and the index stays one round of blocks big.
    for (w, seq, m, _) in &msgs {
        let o = p.ingest(*w, 0, b"", *seq, m);
        assert_eq!((o.batches_applied, o.decode_errors, o.clears), (1, 0, 0));
    }
    let held = p.index().stats().holder_blocks;
    assert_eq!(held, RANKS * (STORES * CHAIN) as u64, "index bounded");
    if !bench_mode {
        println!(
            "ingest: smoke run ok ({} messages, {blocks} blocks)",
            msgs.len()
        );
        return;
    }

    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(blocks));
    let mut batch = DecodedBatch::default();
    g.bench_function("decode_only", |b| {
        b.iter(|| {
            for (_, _, m, _) in &msgs {
                decode_batch(m, &mut batch).unwrap();
                black_box(&batch);
            }
        })
    });
    // Each iteration replays all rounds with sequence numbers continuing, on a partition
    // whose streams are already past round 0 (so every message is in order).
    let mut base = rounds as u64;
    let fresh = Partition::new(
        PartitionKey::new("bench", "g"),
        PartitionConfig::new(BS as u32),
    );
    for (w, seq, m, _) in &msgs {
        fresh.ingest(*w, 0, b"", *seq, m);
    }
    g.bench_function("decode_apply", |b| {
        b.iter(|| {
            for (w, seq, m, _) in &msgs {
                black_box(fresh.ingest(*w, 0, b"", base + seq, m));
            }
            base += rounds as u64;
        })
    });
    g.finish();
}
