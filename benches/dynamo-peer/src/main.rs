//! kvr's KV-event ingest side by side with Dynamo 1.6.1's own index crate
//! (`dynamo-kv-router`, from crates.io), on the same fleet's event stream, in one process.
//!
//! The stream is the fleet bench's (`benches/fleet/src/events.rs`, shared by path): one
//! vLLM msgpack batch a rank a round from 1,024 workers × 8 DP ranks, four 16-block stores
//! with their tokens plus the removal of the rank's previous round. Each side does what its
//! router does with such a message, on one thread:
//! - kvr: `Partition::ingest` (sequence check, decode, local hashes from the tokens, apply);
//! - Dynamo: `zmq_wire::decode_event_batch`, `ZmqEventNormalizer::normalize` (which hashes
//!   the tokens) and `into_router_event` on the calling thread, then the events applied by
//!   the index's own writer loop (`SyncIndexer::worker`) on one thread, for its default
//!   concurrent tree (`ConcurrentRadixTreeCompressed`), and `RadixTree::apply_event` for its
//!   single-threaded tree. Dynamo's figure for one core is the block-ops over the decode
//!   time plus the apply time.
//!
//! Round 0 fills every index and is not timed; the timed rounds each store and remove as
//! many blocks. The sides alternate within each repetition; the figure is the median of
//! the repetitions, with min–max.
//!
//! ```sh
//! cargo run --release --manifest-path benches/dynamo-peer/Cargo.toml -- --reps 3
//! cargo run --release --manifest-path benches/dynamo-peer/Cargo.toml -- --quick
//! ```

#[path = "../../fleet/src/events.rs"]
mod events;

use std::time::Instant;

use dynamo_kv_router::indexer::{SyncIndexer, WorkerTask};
use dynamo_kv_router::protocols::{
    KvCacheEventData, LocalBlockHash, RouterEvent, WorkerWithDpRank,
};
use dynamo_kv_router::zmq_wire::{decode_event_batch, ZmqEventNormalizer};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree};
use events::{EventShape, Message, Messages, BS};
use kvr::config::PartitionConfig;
use kvr::{Engine, KvEvent, Partition, PartitionKey, RankId, StoredBlock, Tier, WorkerInfo};

struct Args {
    shape: EventShape,
    rounds: usize,
    reps: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        shape: EventShape {
            workers: 1_024,
            dp: 8,
            stores: 4,
            chain: 16,
        },
        rounds: 2,
        reps: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num = |name: &str| -> Result<u64, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or(format!("{name} needs a number"))
        };
        match flag.as_str() {
            "--quick" => {
                a.shape.workers = 64;
                a.rounds = 1;
                a.reps = 1;
            }
            "--workers" => a.shape.workers = num("--workers")?.max(1),
            "--dp" => a.shape.dp = num("--dp")?.clamp(1, 64) as u32,
            "--rounds" => a.rounds = num("--rounds")?.max(1) as usize,
            "--reps" => a.reps = num("--reps")?.max(1) as usize,
            "-h" | "--help" => {
                return Err(
                    "usage: dynamo-peer [--quick] [--workers N] [--dp N] [--rounds N] [--reps N]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

/// A partition with the fleet's workers registered (no capacities: maps grow).
fn kvr_partition(shape: EventShape) -> (Engine, std::sync::Arc<Partition>) {
    let e = Engine::with_seed(11);
    let key = PartitionKey::new("fleet", "ingest");
    let p = e
        .create_partition(key, PartitionConfig::new(BS))
        .expect("a fresh engine has no partitions");
    for w in 0..shape.workers {
        p.upsert_worker(WorkerInfo::new(w, shape.dp))
            .expect("valid worker metadata");
    }
    (e, p)
}

/// kvr: one thread's block-ops per second through `Partition::ingest`.
fn kvr_rate(shape: EventShape, fill: &[Message], timed: &[Vec<Message>]) -> f64 {
    let (_e, p) = kvr_partition(shape);
    let apply = |msgs: &[Message]| {
        for m in msgs {
            let o = p.ingest(m.worker, m.dp, b"", m.seq, &m.payload);
            assert!(
                o.batches_applied == 1 && o.decode_errors == 0 && o.refused == 0,
                "kvr refused worker {} rank {}: {o:?}",
                m.worker,
                m.dp
            );
        }
    };
    apply(fill);
    let ops: u64 = timed.iter().flatten().map(|m| m.ops).sum();
    assert_eq!(ops, shape.ops_per_round() * timed.len() as u64);
    let t0 = Instant::now();
    for r in timed {
        apply(r);
    }
    let rate = ops as f64 / t0.elapsed().as_secs_f64();
    let held = p.index().stats().holder_blocks;
    assert_eq!(held, shape.ranks() * (shape.stores * shape.chain) as u64);
    rate
}

/// A router event as kvr's index takes it, the same hashes (what the apply costs does not
/// depend on which function made them).
enum Owned {
    Stored(Option<u64>, Vec<StoredBlock>),
    Removed(Vec<u64>),
}

fn owned(evs: &[RouterEvent]) -> Vec<(RankId, Owned)> {
    evs.iter()
        .map(|e| {
            let rank = RankId::new(e.worker_id, e.event.dp_rank);
            let o = match &e.event.data {
                KvCacheEventData::Stored(s) => Owned::Stored(
                    s.parent_hash.map(|h| h.0),
                    s.blocks
                        .iter()
                        .map(|b| StoredBlock {
                            external_hash: b.block_hash.0,
                            local_hash: b.tokens_hash.0,
                        })
                        .collect(),
                ),
                KvCacheEventData::Removed(r) => {
                    Owned::Removed(r.block_hashes.iter().map(|h| h.0).collect())
                }
                KvCacheEventData::Cleared => unreachable!("the stream clears nothing"),
            };
            (rank, o)
        })
        .collect()
}

/// kvr's index apply alone (`Partition::apply_events`), events already decoded and hashed.
fn kvr_apply_rate(shape: EventShape, fill: &[RouterEvent], timed: &[RouterEvent], ops: u64) -> f64 {
    let (_e, p) = kvr_partition(shape);
    let apply = |evs: &[(RankId, Owned)]| {
        for (rank, o) in evs {
            let ev = match o {
                Owned::Stored(parent, blocks) => KvEvent::Stored {
                    tier: Tier::Device,
                    parent: *parent,
                    blocks,
                },
                Owned::Removed(hashes) => KvEvent::Removed {
                    tier: Tier::Device,
                    external_hashes: hashes,
                },
            };
            let out = p.apply_events(*rank, [ev]);
            assert!(out.applied == 1, "kvr applies {rank:?}: {out:?}");
        }
    };
    apply(&owned(fill));
    let timed = owned(timed);
    let t0 = Instant::now();
    apply(&timed);
    let rate = ops as f64 / t0.elapsed().as_secs_f64();
    let held = p.index().stats().holder_blocks;
    assert_eq!(held, shape.ranks() * (shape.stores * shape.chain) as u64);
    rate
}

/// Dynamo's decode path: the batch decoded, each event normalized (its tokens hashed) and
/// made a router event, as its ZMQ listener does before handing events to the index.
fn dynamo_decode(norm: &mut ZmqEventNormalizer, msgs: &[Message], out: &mut Vec<RouterEvent>) {
    for m in msgs {
        let batch = decode_event_batch(&m.payload).expect("Dynamo decodes the vLLM batch");
        let worker = WorkerWithDpRank::new(m.worker, m.dp);
        for (i, raw) in batch.events.into_iter().enumerate() {
            let placed = norm
                .normalize(raw, m.seq * 16 + i as u64, worker)
                .expect("a device-tier event is kept");
            out.push(
                placed
                    .into_router_event()
                    .expect("a local placement is a router event"),
            );
        }
    }
}

/// The last stored chain in `events` (the last round's, so never removed): its worker and
/// its blocks' local hashes.
fn probe(events: &[RouterEvent]) -> (WorkerWithDpRank, Vec<LocalBlockHash>) {
    let ev = events
        .iter()
        .rev()
        .find(|e| matches!(e.event.data, KvCacheEventData::Stored(_)))
        .expect("a store in the round");
    let KvCacheEventData::Stored(s) = &ev.event.data else {
        unreachable!()
    };
    let w = WorkerWithDpRank::new(ev.worker_id, ev.event.dp_rank);
    (w, s.blocks.iter().map(|b| b.tokens_hash).collect())
}

struct DynamoRates {
    /// kvr's index apply alone on the events Dynamo decoded.
    kvr_apply: f64,
    /// Decode + normalize only, block-ops/s of the decoding thread.
    decode: f64,
    /// The concurrent tree's writer loop alone.
    crtc_apply: f64,
    /// The single-threaded tree's `apply_event` alone.
    radix_apply: f64,
}

fn dynamo_rates(shape: EventShape, fill: &[Message], timed: &[Vec<Message>]) -> DynamoRates {
    let ops: u64 = timed.iter().flatten().map(|m| m.ops).sum();
    let mut norm = ZmqEventNormalizer::new(BS);
    let mut fill_events = Vec::new();
    dynamo_decode(&mut norm, fill, &mut fill_events);
    let mut timed_events = Vec::with_capacity(fill_events.len() * 2 * timed.len());
    let t0 = Instant::now();
    for r in timed {
        dynamo_decode(&mut norm, r, &mut timed_events);
    }
    let decode = ops as f64 / t0.elapsed().as_secs_f64();
    let (who, chain) = probe(&timed_events);
    let kvr_apply = kvr_apply_rate(shape, &fill_events, &timed_events, ops);

    // The concurrent tree: one writer loop, fed through its channel; the fill applied and
    // acknowledged before the clock starts, the last timed event acknowledged to stop it.
    let tree = std::sync::Arc::new(ConcurrentRadixTreeCompressed::new());
    let (tx, rx) = flume::unbounded::<WorkerTask>();
    let writer = {
        let tree = tree.clone();
        std::thread::spawn(move || tree.worker(rx, None))
    };
    let acked = |tx: &flume::Sender<WorkerTask>, mut evs: Vec<RouterEvent>| {
        let last = evs.pop().expect("events to apply");
        for e in evs {
            tx.send(WorkerTask::Event(e)).expect("the writer is alive");
        }
        let (resp, done) = tokio::sync::oneshot::channel();
        tx.send(WorkerTask::EventWithAck { event: last, resp })
            .expect("the writer is alive");
        assert!(
            done.blocking_recv().expect("the writer answers"),
            "the last event applied"
        );
    };
    acked(&tx, fill_events.clone());
    let t0 = Instant::now();
    acked(&tx, timed_events.clone());
    let crtc_apply = ops as f64 / t0.elapsed().as_secs_f64();
    let found = tree.find_matches(&chain, false);
    assert_eq!(
        found.scores.get(&who).copied(),
        Some(shape.chain as u32),
        "Dynamo's concurrent tree holds the probed chain"
    );
    drop(tx);
    writer
        .join()
        .expect("writer thread")
        .expect("writer loop ends cleanly");

    let mut radix = RadixTree::new();
    for e in fill_events {
        radix
            .apply_event(e)
            .expect("Dynamo's tree applies the fill");
    }
    let t0 = Instant::now();
    for e in timed_events {
        radix
            .apply_event(e)
            .expect("Dynamo's tree applies the round");
    }
    let radix_apply = ops as f64 / t0.elapsed().as_secs_f64();
    let found = radix.find_matches(chain, false);
    assert_eq!(
        found.scores.get(&who).copied(),
        Some(shape.chain as u32),
        "Dynamo's radix tree holds the probed chain"
    );
    DynamoRates {
        kvr_apply,
        decode,
        crtc_apply,
        radix_apply,
    }
}

/// One core doing both halves: the rate whose inverse is the sum of the halves' inverses.
fn serial(a: f64, b: f64) -> f64 {
    1.0 / (1.0 / a + 1.0 / b)
}

fn median_min_max(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let s = args.shape;
    println!(
        "ingest side by side: {} workers × {} ranks, messages of {} × {}-block stores (+ the previous round's removal), {} timed rounds, {} repetitions",
        s.workers, s.dp, s.stores, s.chain, args.rounds, args.reps
    );
    let mut rows: Vec<(&str, Vec<f64>)> = vec![
        ("kvr: Partition::ingest, one thread", vec![]),
        ("Dynamo: decode + hash + concurrent tree, one core", vec![]),
        ("Dynamo: decode + hash + radix tree, one core", vec![]),
        ("kvr: index apply alone (Partition::apply_events)", vec![]),
        ("Dynamo: decode + hash alone", vec![]),
        ("Dynamo: concurrent tree's writer alone", vec![]),
        ("Dynamo: radix tree's apply alone", vec![]),
    ];
    let mut ratios = Vec::new();
    for _ in 0..args.reps {
        let mut gen = Messages::new(s);
        let fill = gen.round();
        let timed: Vec<Vec<Message>> = (0..args.rounds).map(|_| gen.round()).collect();
        let k = kvr_rate(s, &fill, &timed);
        let d = dynamo_rates(s, &fill, &timed);
        let crtc = serial(d.decode, d.crtc_apply);
        let radix = serial(d.decode, d.radix_apply);
        for (row, v) in rows.iter_mut().zip([
            k,
            crtc,
            radix,
            d.kvr_apply,
            d.decode,
            d.crtc_apply,
            d.radix_apply,
        ]) {
            row.1.push(v);
        }
        ratios.push(k / crtc.max(radix));
    }
    println!("| path | M block-ops/s, median (min–max) |");
    println!("|---|---|");
    for (name, v) in rows {
        let (m, lo, hi) = median_min_max(v);
        println!(
            "| {name} | {:.2} ({:.2}–{:.2}) |",
            m / 1e6,
            lo / 1e6,
            hi / 1e6
        );
    }
    let (m, lo, hi) = median_min_max(ratios);
    println!("kvr ÷ Dynamo's faster tree, one core: {m:.2}× ({lo:.2}–{hi:.2})");
}
