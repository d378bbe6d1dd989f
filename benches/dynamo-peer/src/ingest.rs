//! Ingest side by side: each side does what its router does with an engine's KV-event
//! message, on one thread.
//! - kvr: `Partition::ingest` (sequence check, decode, local hashes from the tokens, apply);
//! - Dynamo: `zmq_wire::decode_event_batch`, `ZmqEventNormalizer::normalize` (which hashes
//!   the tokens) and `into_router_event` on the calling thread, then the events applied by
//!   the index's own writer loop (`SyncIndexer::worker`) on one thread, for its default
//!   concurrent tree (`ConcurrentRadixTreeCompressed`), and `RadixTree::apply_event` for its
//!   single-threaded tree. Dynamo's figure for one core is the block-ops over the decode
//!   time plus the apply time.
//!
//! Also each index's apply alone, on the events Dynamo decoded (the same hashes on both
//! sides). Round 0 fills every index and is not timed; the timed rounds each store and
//! remove as many blocks.

use std::sync::Arc;
use std::time::Instant;

use dynamo_kv_router::indexer::{SyncIndexer, WorkerTask};
use dynamo_kv_router::protocols::{
    KvCacheEventData, LocalBlockHash, RouterEvent, WorkerWithDpRank,
};
use dynamo_kv_router::zmq_wire::{decode_event_batch, ZmqEventNormalizer};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree};
use kvr::{KvEvent, RankId, StoredBlock, Tier};

use crate::events::{ingest_all, partition, EventShape, Message, Messages, BS};
use crate::median_min_max;

/// kvr: one thread's block-ops per second through `Partition::ingest`.
fn kvr_rate(shape: EventShape, fill: &[Message], timed: &[Vec<Message>]) -> f64 {
    let (_e, p) = partition(shape, 0);
    ingest_all(&p, fill);
    let ops: u64 = timed.iter().flatten().map(|m| m.ops).sum();
    assert_eq!(ops, shape.ops_per_round() * timed.len() as u64);
    let t0 = Instant::now();
    for r in timed {
        ingest_all(&p, r);
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
    let (_e, p) = partition(shape, 0);
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
pub(crate) fn dynamo_decode(
    norm: &mut ZmqEventNormalizer,
    msgs: &[Message],
    out: &mut Vec<RouterEvent>,
) {
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
    let tree = Arc::new(ConcurrentRadixTreeCompressed::new());
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
    // Copied before the clock starts: the radix tree below applies the originals.
    let timed_copy = timed_events.clone();
    let t0 = Instant::now();
    acked(&tx, timed_copy);
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

/// Runs `reps` repetitions, the sides alternating within each; prints the table.
pub(crate) fn run(s: EventShape, rounds: usize, reps: usize) {
    println!(
        "ingest side by side: {} workers × {} ranks, messages of {} × {}-block stores (+ the previous round's removal), {} timed rounds, {} repetitions",
        s.workers, s.dp, s.stores, s.chain, rounds, reps
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
    for _ in 0..reps {
        let mut gen = Messages::new(s);
        let fill = gen.round();
        let timed: Vec<Vec<Message>> = (0..rounds).map(|_| gen.round()).collect();
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
