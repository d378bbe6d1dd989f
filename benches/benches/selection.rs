//! Selection on the engine (issue 3 item 9): booked selection plus free, and advisory
//! selection, at 8, 64 and 512 ranks for a 256-token and an 8,192-token prompt.
//!
//! Workload (`kvr_benches::build_selection`, deterministic): one partition, block size 16,
//! one worker of data-parallel size 1 per rank; a pool of 64 shared 8,192-token prompts of
//! which each rank holds 8 prefixes of log-uniform length (overlaps differ per rank),
//! 1,024 private blocks per rank, 4 live bookings per rank (half past prefill, some with
//! output blocks), and a reported load per rank. Queries start with a prefix of a pool
//! prompt of a uniform number of blocks (none to all) and go on with fresh tokens; they
//! are drawn from a pre-built list, cycled. Prompts go in as tokens, so every call hashes.
//!
//! Criterion (one iteration = one selection; elements = selections):
//! - `select_and_reserve_free/1thread/<R>r/<T>t`: `Engine::select_and_reserve` then
//!   `Engine::free` of the same id (load stays flat), one thread.
//! - `select_and_reserve_free/2threads/<R>r/<T>t`: the same on two threads sharing one
//!   `Arc<Engine>`, each pinned to its own CPU (`KVR_BENCH_NO_PIN=1`: not pinned), each
//!   doing half of the iterations (`iter_custom`: wall time from a common start, spawn
//!   excluded). Per-iteration time is wall time / total selections, so 1thread median /
//!   2threads median is the throughput ratio.
//! - `select/<R>r/<T>t`: advisory `Engine::select` (books nothing).
//!
//! After the criterion runs of each case a timing harness (plain loop, `std::time::Instant`
//! around each call; the timer's own cost is printed as `timer_overhead`, not subtracted)
//! measures per-call p50/p99 of `select_and_reserve`, `free`, the pair, and `select`, over
//! `KVR_SEL_CALLS` calls (default 100,000) for the target case (64 ranks, 256
//! tokens) and over as many as fit in about a second (2,000 at least) for the others, and
//! the throughput of one thread against two (half as many selections, the same work split
//! over two pinned threads; median of 3 alternating rounds each). Results are printed and written as JSON to
//! `KVR_SELECTION_JSON` (default `<target>/kvr-bench/selection.json`) for
//! `benches/summary.sh`. `KVR_SEL_ONLY=substring` keeps the cases (`<R>r/<T>t`) whose name
//! contains it, for both parts; `KVR_SEL_THROUGHPUT=0` skips the one-against-two-threads
//! throughput (for a single-threaded profile of the per-call loops).
//!
//! Run: `cargo bench -p kvr-benches --bench selection [-- criterion options]`. Without
//! `--bench` (e.g. `cargo test --benches`) it runs a small smoke version.

use std::fmt::Write as _;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvr::Engine;
use kvr::PartitionKey;
use kvr::{Outcome, SelectRequest};
use kvr_benches::timing::{print_table, summarize, timer_overhead, Lat};
use kvr_benches::{build_selection, SelectionConfig, SelectionWorkload, DEFAULT_SEED};

const RANKS: [usize; 3] = [8, 64, 512];
const PROMPT_TOKENS: [usize; 2] = [256, 8_192];
/// Pre-built queries per prompt size (cycled).
const QUERIES: usize = 512;

// ---------------------------------------------------------------------------------------
// Thread pinning (Linux: sched_setaffinity from the C library std already links)
// ---------------------------------------------------------------------------------------

#[cfg(target_os = "linux")]
mod affinity {
    /// cpu_set_t of 1,024 CPUs.
    const WORDS: usize = 16;

    extern "C" {
        fn sched_getaffinity(pid: i32, size: usize, mask: *mut u64) -> i32;
        fn sched_setaffinity(pid: i32, size: usize, mask: *const u64) -> i32;
    }

    /// CPUs this thread may run on.
    pub(crate) fn allowed() -> Vec<usize> {
        let mut mask = [0u64; WORDS];
        // SAFETY: `mask` is a writable buffer of exactly the size passed; pid 0 is the
        // calling thread.
        let rc = unsafe { sched_getaffinity(0, std::mem::size_of_val(&mask), mask.as_mut_ptr()) };
        if rc != 0 {
            return Vec::new();
        }
        (0..WORDS * 64)
            .filter(|&c| mask[c / 64] & (1 << (c % 64)) != 0)
            .collect()
    }

    /// Pins the calling thread to `cpu`. Returns whether it worked.
    pub(crate) fn pin(cpu: usize) -> bool {
        if cpu >= WORDS * 64 {
            return false;
        }
        let mut mask = [0u64; WORDS];
        mask[cpu / 64] |= 1 << (cpu % 64);
        // SAFETY: `mask` is a readable buffer of exactly the size passed; pid 0 is the
        // calling thread.
        unsafe { sched_setaffinity(0, std::mem::size_of_val(&mask), mask.as_ptr()) == 0 }
    }
}

#[cfg(not(target_os = "linux"))]
mod affinity {
    pub fn allowed() -> Vec<usize> {
        Vec::new()
    }
    pub fn pin(_cpu: usize) -> bool {
        false
    }
}

/// The two CPUs the two-thread runs pin to (`None`: do not pin).
fn pin_cpus() -> Option<[usize; 2]> {
    if std::env::var("KVR_BENCH_NO_PIN").is_ok_and(|v| v == "1") {
        return None;
    }
    match affinity::allowed()[..] {
        [a, b, ..] => Some([a, b]),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------
// The operations
// ---------------------------------------------------------------------------------------

#[inline]
fn reserve(engine: &Engine, key: &PartitionKey, q: &[u32]) -> u64 {
    match engine.select_and_reserve(key, &SelectRequest::tokens(black_box(q))) {
        Ok(Outcome::Selected(d)) => d.selection_id.expect("a booked decision has an id"),
        other => panic!("select_and_reserve: {other:?}"),
    }
}

#[inline]
fn free(engine: &Engine, id: u64) {
    black_box(engine.free(id).expect("freeing a live booking"));
}

#[inline]
fn reserve_free(engine: &Engine, key: &PartitionKey, q: &[u32]) {
    let id = reserve(engine, key, q);
    free(engine, id);
}

#[inline]
fn advisory(engine: &Engine, key: &PartitionKey, q: &[u32]) {
    match engine.select(key, &SelectRequest::tokens(black_box(q))) {
        Ok(o @ Outcome::Selected(_)) => {
            black_box(o);
        }
        other => panic!("select: {other:?}"),
    }
}

/// `iters` booked selections split over two threads (each pinned to one of `cpus`), each
/// starting at its own place in `qs`. Returns the wall time from the common start (after
/// both threads exist) to the end of the later one.
fn two_threads(
    engine: &Engine,
    key: &PartitionKey,
    qs: &[Vec<u32>],
    iters: u64,
    start: usize,
    cpus: Option<[usize; 2]>,
) -> Duration {
    let barrier = Barrier::new(2);
    let halves = [iters / 2, iters - iters / 2];
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|t| {
                let barrier = &barrier;
                let n = halves[t];
                s.spawn(move || {
                    if let Some(c) = cpus {
                        affinity::pin(c[t]);
                    }
                    let first = start + t * qs.len() / 2;
                    barrier.wait();
                    let t0 = Instant::now();
                    for i in first..first + n as usize {
                        reserve_free(engine, key, &qs[i % qs.len()]);
                    }
                    (t0, Instant::now())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench thread panicked"))
            .collect()
    });
    let t0 = spans.iter().map(|s| s.0).min().expect("two spans");
    let t1 = spans.iter().map(|s| s.1).max().expect("two spans");
    t1 - t0
}

// ---------------------------------------------------------------------------------------
// Criterion part
// ---------------------------------------------------------------------------------------

fn case_name(ranks: usize, tokens: usize) -> String {
    format!("{ranks}r/{tokens}t")
}

fn criterion_case(
    c: &mut Criterion,
    w: &SelectionWorkload,
    tokens: usize,
    qs: &[Vec<u32>],
    cpus: Option<[usize; 2]>,
) {
    let case = case_name(w.config.ranks, tokens);
    let (engine, key) = (&*w.engine, &w.key);
    {
        let mut g = c.benchmark_group("select_and_reserve_free");
        g.throughput(Throughput::Elements(1));
        let mut i = 0usize;
        g.bench_function(format!("1thread/{case}"), |b| {
            b.iter(|| {
                reserve_free(engine, key, &qs[i % qs.len()]);
                i += 1;
            })
        });
        let mut start = 0usize;
        g.bench_function(format!("2threads/{case}"), |b| {
            b.iter_custom(|iters| {
                let d = two_threads(engine, key, qs, iters, start, cpus);
                start += iters as usize;
                d
            })
        });
        g.finish();
    }
    let mut g = c.benchmark_group("select");
    g.throughput(Throughput::Elements(1));
    let mut i = 0usize;
    g.bench_function(&case, |b| {
        b.iter(|| {
            advisory(engine, key, &qs[i % qs.len()]);
            i += 1;
        })
    });
    g.finish();
}

// ---------------------------------------------------------------------------------------
// Timing harness (per-call percentiles, thread scaling)
// ---------------------------------------------------------------------------------------

struct Scaling {
    name: String,
    calls: usize,
    one_thread_per_s: f64,
    two_threads_per_s: f64,
    pinned: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn harness_case(
    w: &SelectionWorkload,
    tokens: usize,
    qs: &[Vec<u32>],
    calls: usize,
    cpus: Option<[usize; 2]>,
    lats: &mut Vec<Lat>,
    scaling: &mut Vec<Scaling>,
) {
    let case = case_name(w.config.ranks, tokens);
    let (engine, key) = (&*w.engine, &w.key);
    let warmup = (calls / 10).max(100);
    let q = |k: usize| &qs[k % qs.len()][..];

    // Booked: select_and_reserve and free, each timed alone, and the pair.
    let (mut r_ns, mut f_ns, mut p_ns) = (
        Vec::with_capacity(calls),
        Vec::with_capacity(calls),
        Vec::with_capacity(calls),
    );
    for k in 0..warmup + calls {
        let t0 = Instant::now();
        let id = reserve(engine, key, q(k));
        let t1 = Instant::now();
        free(engine, id);
        let t2 = Instant::now();
        if k >= warmup {
            r_ns.push((t1 - t0).as_nanos() as u64);
            f_ns.push((t2 - t1).as_nanos() as u64);
            p_ns.push((t2 - t0).as_nanos() as u64);
        }
    }
    lats.push(summarize(format!("select_and_reserve/{case}"), r_ns));
    lats.push(summarize(format!("free/{case}"), f_ns));
    lats.push(summarize(
        format!("select_and_reserve_free/1thread/{case}"),
        p_ns,
    ));

    // Advisory.
    let mut s_ns = Vec::with_capacity(calls);
    for k in 0..warmup + calls {
        let t0 = Instant::now();
        advisory(engine, key, q(k));
        let d = t0.elapsed();
        if k >= warmup {
            s_ns.push(d.as_nanos() as u64);
        }
    }
    lats.push(summarize(format!("select/{case}"), s_ns));

    // Throughput, one thread against two (same total work), 3 rounds each, alternating
    // (`KVR_SEL_THROUGHPUT=0` skips it, so a profile of the harness is single-threaded).
    if std::env::var("KVR_SEL_THROUGHPUT").is_ok_and(|v| v == "0") {
        return;
    }
    let n = (calls / 2).max(100);
    let (mut one, mut two) = (Vec::new(), Vec::new());
    for round in 0..3 {
        let t0 = Instant::now();
        for k in 0..n {
            reserve_free(engine, key, q(k + round));
        }
        one.push(n as f64 / t0.elapsed().as_secs_f64());
        let d = two_threads(engine, key, qs, n as u64, round, cpus);
        two.push(n as f64 / d.as_secs_f64());
    }
    scaling.push(Scaling {
        name: format!("select_and_reserve_free/{case}"),
        calls: n,
        one_thread_per_s: median(one),
        two_threads_per_s: median(two),
        pinned: cpus.is_some(),
    });
}

/// Calls per timed loop of a case: `calls` for the target case (64 ranks, 256
/// tokens), otherwise as many as fit in about one second (at least 2,000, at most
/// `calls`), so the slow cases do not stretch the suite.
fn harness_calls(
    w: &SelectionWorkload,
    tokens: usize,
    qs: &[Vec<u32>],
    calls: usize,
    bench_mode: bool,
) -> usize {
    if !bench_mode || (w.config.ranks == 64 && tokens == 256) {
        return calls;
    }
    let probe = 200;
    let t0 = Instant::now();
    for k in 0..probe {
        reserve_free(&w.engine, &w.key, &qs[k % qs.len()]);
    }
    let per_call = t0.elapsed().as_secs_f64() / probe as f64;
    ((1.0 / per_call) as usize).clamp(2_000, calls.max(2_000))
}

/// `<target>/kvr-bench/selection.json`, from this executable's place
/// (`<target>/<profile>/deps/selection-<hash>`).
fn default_json_path() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let target = exe.ancestors().nth(3)?;
    Some(target.join("kvr-bench").join("selection.json"))
}

fn write_json(lats: &[Lat], scaling: &[Scaling], builds: &[String]) {
    let mut entries: Vec<String> = lats.iter().map(Lat::json_entry).collect();
    entries.extend(scaling.iter().map(|s| {
        format!(
            "    {{\"name\": \"scaling/{}\", \"calls\": {}, \"one_thread_per_s\": {:.1}, \
             \"two_threads_per_s\": {:.1}, \"ratio\": {:.4}, \"pinned\": {}}}",
            s.name,
            s.calls,
            s.one_thread_per_s,
            s.two_threads_per_s,
            s.two_threads_per_s / s.one_thread_per_s,
            s.pinned
        )
    }));
    entries.extend(builds.iter().cloned());
    let json = format!("{{\n  \"results\": [\n{}\n  ]\n}}\n", entries.join(",\n"));
    let path = match std::env::var("KVR_SELECTION_JSON") {
        Ok(p) => Some(PathBuf::from(p)),
        Err(_) => default_json_path(),
    };
    if let Some(path) = path {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        std::fs::write(&path, json).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        eprintln!("selection: wrote {}", path.display());
    }
}

fn main() {
    let bench_mode = std::env::args().any(|a| a == "--bench");
    let mut c = Criterion::default().configure_from_args();
    let calls: usize = std::env::var("KVR_SEL_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if bench_mode { 100_000 } else { 1_000 });
    let only = std::env::var("KVR_SEL_ONLY").unwrap_or_default();
    let cpus = pin_cpus();

    let mut lats = vec![summarize("timer_overhead".into(), timer_overhead(calls))];
    let mut scaling = Vec::new();
    let mut builds = Vec::new();
    let mut log = String::new();

    for ranks in RANKS {
        let wanted: Vec<usize> = PROMPT_TOKENS
            .into_iter()
            .filter(|&t| case_name(ranks, t).contains(only.as_str()))
            .collect();
        if wanted.is_empty() {
            continue;
        }
        let mut cfg = SelectionConfig::new(ranks);
        if !bench_mode {
            cfg.private_blocks_per_rank = 64;
        }
        let t0 = Instant::now();
        let w = build_selection(cfg);
        let built = t0.elapsed();
        let p = w
            .engine
            .partition(&w.key)
            .expect("the workload's partition");
        let stats = p.index().stats();
        let _ = writeln!(
            log,
            "workload {ranks:>3} ranks: holder_blocks={} nodes={} live_bookings={} built_in={built:.2?}",
            stats.holder_blocks, stats.nodes, w.live_bookings
        );
        builds.push(format!(
            "    {{\"name\": \"workload/{ranks}r\", \"ranks\": {ranks}, \"holder_blocks\": {}, \
             \"nodes\": {}, \"live_bookings\": {}, \"build_s\": {:.3}}}",
            stats.holder_blocks,
            stats.nodes,
            w.live_bookings,
            built.as_secs_f64()
        ));
        let baseline = p.bookings().len();
        for tokens in wanted {
            let qs = w.queries(tokens, QUERIES, DEFAULT_SEED ^ (tokens as u64));
            criterion_case(&mut c, &w, tokens, &qs, cpus);
            let n = harness_calls(&w, tokens, &qs, calls, bench_mode);
            harness_case(&w, tokens, &qs, n, cpus, &mut lats, &mut scaling);
            // Book-then-free leaves exactly the workload's own bookings.
            assert_eq!(p.bookings().len(), baseline, "bookings leaked");
        }
        p.bookings().audit().expect("counters exact after the runs");
    }
    c.final_summary();

    println!();
    print!("{log}");
    print_table("selection latency (ns, per call)", 44, &lats);
    println!(
        "{:<44} {:>8} {:>14} {:>14} {:>7}  (pinned: {})",
        "selection throughput (selections/s)",
        "calls",
        "1 thread",
        "2 threads",
        "2t/1t",
        match cpus {
            Some([a, b]) => format!("cpus {a},{b}"),
            None => "no".into(),
        }
    );
    for s in &scaling {
        println!(
            "{:<44} {:>8} {:>14.0} {:>14.0} {:>6.2}×",
            s.name,
            s.calls,
            s.one_thread_per_s,
            s.two_threads_per_s,
            s.two_threads_per_s / s.one_thread_per_s
        );
    }
    write_json(&lats, &scaling, &builds);
}
