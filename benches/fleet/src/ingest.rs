//! Ingest at fleet scale: KV-event messages of `workers` workers × `dp` ranks (one stream
//! a rank, as engines with data parallelism publish) decoded and applied by one thread,
//! through `Partition::ingest` (sequence check, decode, local hashes from the tokens,
//! index apply), as a pipeline that serves every subscription would.
//!
//! Each message is one vLLM batch of `stores` stored chains of `chain` blocks with their
//! tokens, and from the second round on the removal of what the same rank stored a round
//! before, so the index keeps its size. Two measurements:
//! - **throughput**: block-ops (blocks stored + removed) per second of one thread applying
//!   the prebuilt rounds back to back (round 0, which fills the index, not timed);
//! - **lag**: a pacer thread hands messages to the ingest thread at a fixed block-op rate,
//!   each stamped with its intended send time, while a third thread selects
//!   (`select_and_reserve` + `free`) on the same partition without pause; lag is the time
//!   from the intended send to the message applied (coordinated omission included).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvr::{Outcome, SelectRequest};

use crate::events::{ingest_all, partition, EventShape, Message, Messages};
use crate::report::{Figure, Report, Spread};

#[derive(Clone, Debug)]
pub(crate) struct IngestPlan {
    pub workers: u64,
    pub dp: u32,
    pub stores: usize,
    pub chain: usize,
    /// Timed rounds of the throughput part (each a message from every rank).
    pub rounds: usize,
    pub reps: usize,
    /// Block-ops per second the pacer offers in the lag part.
    pub lag_rate: f64,
    pub lag_secs: f64,
    /// Registered KV capacity per rank (0: none, maps grow as blocks arrive).
    pub capacity: u64,
}

impl IngestPlan {
    pub(crate) fn full() -> Self {
        let f = EventShape::FLEET;
        IngestPlan {
            workers: f.workers,
            dp: f.dp,
            stores: f.stores,
            chain: f.chain,
            rounds: 2,
            reps: 3,
            lag_rate: 1_000_000.0,
            lag_secs: 3.0,
            capacity: 0,
        }
    }

    pub(crate) fn quick() -> Self {
        IngestPlan {
            workers: 64,
            dp: 8,
            rounds: 1,
            reps: 1,
            lag_rate: 100_000.0,
            lag_secs: 0.3,
            ..Self::full()
        }
    }

    pub(crate) fn shape(&self) -> EventShape {
        EventShape {
            workers: self.workers,
            dp: self.dp,
            stores: self.stores,
            chain: self.chain,
        }
    }

    fn ranks(&self) -> u64 {
        self.shape().ranks()
    }
}

pub(crate) fn run(plan: &IngestPlan, report: &mut Report) {
    report.note(format!(
        "ingest: {} workers × {} ranks, messages of {} × {}-block stores (+ the previous round's removal), capacity {}",
        plan.workers, plan.dp, plan.stores, plan.chain, plan.capacity
    ));
    let mut rates = Vec::new();
    for _ in 0..plan.reps {
        let mut gen = Messages::new(plan.shape());
        let fill = gen.round();
        let timed: Vec<Vec<Message>> = (0..plan.rounds).map(|_| gen.round()).collect();
        let (_e, p) = partition(plan.shape(), plan.capacity);
        ingest_all(&p, &fill);
        let ops: u64 = timed.iter().flatten().map(|m| m.ops).sum();
        let t0 = Instant::now();
        for r in &timed {
            ingest_all(&p, r);
        }
        rates.push(ops as f64 / t0.elapsed().as_secs_f64());
        let held = p.index().stats().holder_blocks;
        assert_eq!(held, plan.ranks() * (plan.stores * plan.chain) as u64);
    }
    report.push(Figure {
        name: "ingest/block_ops_per_s_one_thread".into(),
        unit: "ops/s",
        p50: Spread::of(rates),
        p99: None,
    });
    lag(plan, report);
}

/// The lag part: paced messages, one ingest thread, one selecting thread.
fn lag(plan: &IngestPlan, report: &mut Report) {
    let (e, p) = partition(plan.shape(), plan.capacity);
    let mut gen = Messages::new(plan.shape());
    ingest_all(&p, &gen.round());
    let ops_per_round = plan.shape().ops_per_round() as f64;
    let rounds = ((plan.lag_rate * plan.lag_secs) / ops_per_round)
        .ceil()
        .max(1.0) as usize;
    let msgs: Vec<Message> = (0..rounds).flat_map(|_| gen.round()).collect();
    let (tx, rx) = mpsc::sync_channel::<(Instant, usize)>(1 << 16);
    let stop = AtomicBool::new(false);
    let query: Vec<u32> = (0..256).collect();
    let (lags, selections, sel_secs) = std::thread::scope(|s| {
        let selector = s.spawn(|| {
            let (mut n, t0) = (0u64, Instant::now());
            while !stop.load(Ordering::Relaxed) {
                let req = SelectRequest::tokens(&query);
                if let Ok(Outcome::Selected(d)) = e.select_and_reserve(&p, &req) {
                    let _ = e.free(d.selection_id.expect("a booked decision has an id"));
                    n += 1;
                }
            }
            (n, t0.elapsed().as_secs_f64())
        });
        let ingest = s.spawn(|| {
            let mut lags = Vec::with_capacity(msgs.len());
            for (due, k) in rx {
                let m = &msgs[k];
                let o = p.ingest(m.worker, m.dp, b"", m.seq, &m.payload);
                assert_eq!(o.batches_applied, 1, "paced message not applied: {o:?}");
                lags.push(due.elapsed().as_nanos() as u64);
            }
            lags
        });
        // The pacer: message k is due when the block-ops before it are at the rate.
        let t0 = Instant::now();
        let mut done_ops = 0u64;
        for (k, m) in msgs.iter().enumerate() {
            let due = t0 + Duration::from_secs_f64(done_ops as f64 / plan.lag_rate);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            tx.send((due, k)).expect("the ingest thread is alive");
            done_ops += m.ops;
        }
        drop(tx);
        let lags = ingest.join().expect("ingest thread");
        stop.store(true, Ordering::Relaxed);
        let (n, secs) = selector.join().expect("selector thread");
        (lags, n, secs)
    });
    report.note(format!(
        "lag: {} messages offered at {:.0} block-ops/s; {selections} selections beside them ({:.0}/s)",
        lags.len(),
        plan.lag_rate,
        selections as f64 / sel_secs.max(1e-9)
    ));
    let mut sorted = lags;
    sorted.sort_unstable();
    let at = |q: f64| {
        sorted[((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1] as f64
    };
    report.push(Figure {
        name: format!("ingest/lag_at_{:.0}_ops_per_s", plan.lag_rate),
        unit: "ns",
        p50: Spread::of(vec![at(0.5)]),
        p99: Some(Spread::of(vec![at(0.99)])),
    });
}
