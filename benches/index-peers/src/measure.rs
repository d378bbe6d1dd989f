//! One run of one backend on one workload: every figure of the table, as a JSON record.
//!
//! Runs in its own process (see `main`), so its resident-set growth is the backend's alone.
//! Phases, in order: build (store throughput from empty, growth included), memory (heap
//! bytes the counting allocator saw stay allocated, and RSS growth, per holder-block),
//! exactness (every answer against the workload's exact one), lookup latency per call
//! (hdrhistogram) for each query set, concurrent readers with and without a writer, then
//! steady churn (a new request stored and the oldest evicted, on every holder).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::alloc;
use crate::backend::Backend;
use crate::workload::{self, Generator, Profile, Queries, Query, Request, Store};

/// What one run is asked to do.
#[derive(Clone, Debug)]
pub(crate) struct RunSpec {
    pub profile: Profile,
    pub holder_blocks: usize,
    pub seed: u64,
    /// Per-call samples for each query set.
    pub queries: usize,
    /// Seconds of each concurrency phase (0: skip).
    pub concurrency_secs: f64,
    /// Requests of the churn phase.
    pub churn_requests: usize,
    /// The capacity registered per worker, over what the fullest holds (`--capacity-scale`).
    pub capacity_scale: f64,
}

/// Latency of one query set, nanoseconds per call.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Latency {
    pub p50: f64,
    pub p99: f64,
    pub mean: f64,
}

/// The record of one run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Record {
    pub backend: String,
    pub profile: String,
    pub holder_blocks: usize,
    pub nodes_hint: usize,
    pub store_blocks_per_s: f64,
    pub churn_blocks_per_s: f64,
    /// The churn split: nanoseconds per holder-block its stores took, and its evictions.
    #[serde(default)]
    pub churn_store_ns: f64,
    #[serde(default)]
    pub churn_evict_ns: f64,
    pub heap_bytes_per_holder_block: f64,
    pub rss_bytes_per_holder_block: f64,
    /// The index's own account, where it keeps one: its read structure and its writer
    /// maps, bytes per holder-block.
    #[serde(default)]
    pub own_read_bytes_per_holder_block: Option<f64>,
    #[serde(default)]
    pub own_writer_bytes_per_holder_block: Option<f64>,
    /// Query set name → latency (`cold32`, `cold128`, `hot32`, `hot128`, `miss{n}`, `splice`).
    pub latency: Vec<(String, Latency)>,
    /// Queries whose answer credited some worker more blocks than it holds, and fewer.
    pub overcounts: usize,
    pub undercounts: usize,
    pub checked: usize,
    /// Two readers, no writer: queries/s (all readers).
    pub readers2_qps: f64,
    /// One reader beside one writer: the reader's queries/s and the writer's blocks/s.
    pub reader_with_writer_qps: f64,
    pub writer_blocks_per_s: f64,
    pub timer_overhead_ns: f64,
    /// One dependent load over a walk as large as the backend's heap (`chase`), timed in
    /// the same process after everything else: what a miss costs at this footprint.
    #[serde(default)]
    pub dependent_load_ns: f64,
}

/// Workers in `got` credited more than `expect` gives them (missing = 0).
pub(crate) fn overcounts(got: &[(u32, u32)], expect: &[(u32, u32)]) -> usize {
    got.iter()
        .filter(|(w, n)| {
            let e = expect.iter().find(|(x, _)| x == w).map_or(0, |e| e.1);
            *n > e
        })
        .count()
}

/// Workers in `expect` credited less by `got`.
pub(crate) fn undercounts(got: &[(u32, u32)], expect: &[(u32, u32)]) -> usize {
    expect
        .iter()
        .filter(|(w, n)| {
            let g = got.iter().find(|(x, _)| x == w).map_or(0, |g| g.1);
            g < *n
        })
        .count()
}

fn apply<B: Backend>(b: &B, w: &mut B::Writers, stores: &[Store]) -> usize {
    let mut n = 0;
    for s in stores {
        b.store(w, s.worker, s.parent, &s.blocks);
        n += s.blocks.len();
    }
    n
}

/// Evicts `req` from every holder; returns the blocks removed.
fn evict<B: Backend>(b: &B, w: &mut B::Writers, gen: &Generator, req: &Request) -> usize {
    let own = Generator::own_engine_hashes(req);
    for worker in gen.holders(req.group) {
        b.remove(w, worker, &own);
    }
    own.len() * gen.profile.holders()
}

/// Per-call latency of `qs` (after a warm-up pass over up to 1,000 of them).
fn latency<B: Backend>(b: &B, qs: &[Query]) -> Latency {
    let mut s = B::Scratch::default();
    for q in qs.iter().take(1_000) {
        std::hint::black_box(b.lookup(&mut s, q));
    }
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
    let start = Instant::now();
    for q in qs {
        let t = Instant::now();
        std::hint::black_box(b.lookup(&mut s, std::hint::black_box(q)));
        h.record(t.elapsed().as_nanos().max(1) as u64)
            .expect("in range");
    }
    let total = start.elapsed();
    Latency {
        p50: h.value_at_quantile(0.5) as f64,
        p99: h.value_at_quantile(0.99) as f64,
        mean: total.as_nanos() as f64 / qs.len().max(1) as f64,
    }
}

fn timer_overhead() -> f64 {
    let mut h = Histogram::<u64>::new(3).expect("histogram");
    for _ in 0..100_000 {
        let t = Instant::now();
        h.record(t.elapsed().as_nanos() as u64).expect("in range");
    }
    h.value_at_quantile(0.5) as f64
}

/// Runs every phase on backend `B`.
pub(crate) fn run<B: Backend>(name: &str, spec: &RunSpec) -> Record {
    let mut gen = Generator::new(spec.profile, spec.seed);
    let built = workload::build(&mut gen, spec.holder_blocks);
    let reqs = &built.requests;
    let n = spec.queries;
    let mut sets: Vec<(String, Vec<Query>)> = vec![
        ("cold32".into(), Queries::cold(&mut gen, reqs, 32, n)),
        ("cold128".into(), Queries::cold(&mut gen, reqs, 128, n)),
        ("hot32".into(), Queries::hot(&mut gen, reqs, 32, n)),
        ("hot128".into(), Queries::hot(&mut gen, reqs, 128, n)),
        ("splice".into(), Queries::splice(&mut gen, reqs, n / 4)),
    ];
    for len in [1, 32, 128, 512] {
        sets.push((format!("miss{len}"), Queries::miss(&mut gen, len, n / 4)));
    }

    // Build: everything the run keeps is allocated; what the heap and RSS gain now is the
    // backend's.
    let heap0 = alloc::live_bytes();
    let rss0 = rss_bytes();
    let t = Instant::now();
    let (b, mut w) = B::new(workload::WORKERS);
    // The workers' capacity: what the fullest of them holds after the build (every worker
    // the same size, as in a deployment of one model on one GPU type).
    let mut held = vec![0u64; workload::WORKERS];
    for s in &built.stores {
        held[s.worker as usize] += s.blocks.len() as u64;
    }
    let capacity =
        (held.iter().copied().max().unwrap_or(0) as f64 * spec.capacity_scale.max(0.0)) as u64;
    for worker in 0..workload::WORKERS as u32 {
        b.expect(&mut w, worker, capacity);
    }
    let stored = apply(&b, &mut w, &built.stores);
    let build_time = t.elapsed();
    let heap = alloc::live_bytes().saturating_sub(heap0);
    let rss = rss_bytes()
        .zip(rss0)
        .map_or(0, |(a, z)| a.saturating_sub(z));
    let hb = built.holder_blocks as f64;
    let mut rec = Record {
        backend: name.into(),
        profile: spec.profile.label().into(),
        holder_blocks: built.holder_blocks,
        nodes_hint: built.holder_blocks / spec.profile.holders(),
        store_blocks_per_s: stored as f64 / build_time.as_secs_f64(),
        heap_bytes_per_holder_block: heap as f64 / hb,
        rss_bytes_per_holder_block: rss as f64 / hb,
        timer_overhead_ns: timer_overhead(),
        own_read_bytes_per_holder_block: b.own_bytes().map(|(r, _)| r as f64 / hb),
        own_writer_bytes_per_holder_block: b.own_bytes().map(|(_, w)| w as f64 / hb),
        ..Default::default()
    };
    drop(built.stores);

    // Exactness on every query of every set.
    let mut s = B::Scratch::default();
    let mut out = Vec::new();
    for (_, qs) in &sets {
        for q in qs {
            b.lookup(&mut s, q);
            b.answer(&s, &mut out);
            let over = overcounts(&out, &q.expect);
            let under = undercounts(&out, &q.expect);
            rec.overcounts += (over > 0) as usize;
            rec.undercounts += (under > 0) as usize;
            rec.checked += 1;
        }
    }

    for (name, qs) in &sets {
        rec.latency.push((name.clone(), latency(&b, qs)));
    }

    if spec.concurrency_secs > 0.0 {
        let cold = &sets[1].1;
        concurrency(&b, &mut w, &mut gen, cold, spec, &mut rec);
    }

    // Steady churn: a new request stored on its holders, the oldest evicted from its.
    let mut live: std::collections::VecDeque<Request> = built.requests.into();
    let fresh: Vec<Request> = (0..spec.churn_requests)
        .map(|_| gen.next_request())
        .collect();
    let mut stores = Vec::new();
    let events: Vec<Vec<Store>> = fresh
        .iter()
        .map(|r| {
            stores.clear();
            gen.stores(r, &mut stores);
            std::mem::take(&mut stores)
        })
        .collect();
    let t = Instant::now();
    // Blocks stored and evicted, and the time each took (a clock read per event, ~100
    // blocks, is noise beside them).
    let (mut stored, mut evicted) = (0, 0);
    let (mut store_t, mut evict_t) = (Duration::ZERO, Duration::ZERO);
    for (r, ev) in fresh.into_iter().zip(&events) {
        let t0 = Instant::now();
        stored += apply(&b, &mut w, ev);
        let t1 = Instant::now();
        store_t += t1 - t0;
        if let Some(old) = live.pop_front() {
            evicted += evict(&b, &mut w, &gen, &old);
            evict_t += t1.elapsed();
        }
        live.push_back(r);
    }
    rec.churn_blocks_per_s = (stored + evicted) as f64 / t.elapsed().as_secs_f64();
    rec.churn_store_ns = store_t.as_nanos() as f64 / stored.max(1) as f64;
    rec.churn_evict_ns = evict_t.as_nanos() as f64 / evicted.max(1) as f64;
    rec.dependent_load_ns = crate::chase::dependent_load_ns(heap, spec.seed);
    rec
}

/// Two readers alone; then one reader beside a writer that stores fresh requests and
/// evicts its own beyond a window (the readers' queries stay live and exact).
fn concurrency<B: Backend>(
    b: &B,
    w: &mut B::Writers,
    gen: &mut Generator,
    qs: &[Query],
    spec: &RunSpec,
    rec: &mut Record,
) {
    let secs = Duration::from_secs_f64(spec.concurrency_secs);
    let reader = |stop: &AtomicBool, count: &AtomicU64, offset: usize| {
        let mut s = B::Scratch::default();
        let mut i = offset;
        let mut k = 0u64;
        while !stop.load(Ordering::Relaxed) {
            std::hint::black_box(b.lookup(&mut s, &qs[i % qs.len()]));
            i += 1;
            k += 1;
        }
        count.fetch_add(k, Ordering::Relaxed);
    };
    // Two readers.
    let stop = AtomicBool::new(false);
    let count = AtomicU64::new(0);
    let t = Instant::now();
    std::thread::scope(|sc| {
        for r in 0..2 {
            let (stop, count) = (&stop, &count);
            sc.spawn(move || reader(stop, count, r * qs.len() / 2));
        }
        std::thread::sleep(secs);
        stop.store(true, Ordering::Relaxed);
    });
    rec.readers2_qps = count.load(Ordering::Relaxed) as f64 / t.elapsed().as_secs_f64();

    // One reader, one writer. The writer's requests are drawn before the clock starts.
    let fresh: Vec<Request> = (0..4_096).map(|_| gen.next_request()).collect();
    let events: Vec<Vec<Store>> = fresh
        .iter()
        .map(|r| {
            let mut v = Vec::new();
            gen.stores(r, &mut v);
            v
        })
        .collect();
    let stop = AtomicBool::new(false);
    let count = AtomicU64::new(0);
    let mut written = 0usize;
    let t = Instant::now();
    let gen_ro: &Generator = gen;
    std::thread::scope(|sc| {
        let (stop_r, count_r) = (&stop, &count);
        sc.spawn(move || reader(stop_r, count_r, 0));
        const WINDOW: usize = 256;
        let mut k = 0;
        while t.elapsed() < secs {
            let i = k % fresh.len();
            if k >= WINDOW {
                let old = &fresh[(k - WINDOW) % fresh.len()];
                written += evict(b, w, gen_ro, old);
            }
            written += apply(b, w, &events[i]);
            k += 1;
        }
        stop.store(true, Ordering::Relaxed);
        // Leave nothing of the writer's behind for the churn phase.
        for j in k.saturating_sub(WINDOW)..k {
            evict(b, w, gen_ro, &fresh[j % fresh.len()]);
        }
    });
    let elapsed = t.elapsed().as_secs_f64();
    rec.reader_with_writer_qps = count.load(Ordering::Relaxed) as f64 / elapsed;
    rec.writer_blocks_per_s = written as f64 / elapsed;
}

/// Resident set size of this process in bytes (Linux `/proc/self/statm`).
pub(crate) fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}
