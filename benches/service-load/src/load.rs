//! The operation (select_and_reserve → prefill_complete → DELETE, with the KV events of
//! the prefill in between) and the two ways of offering it: closed loop (C connections,
//! back to back: the saturation throughput) and open loop (a constant arrival rate,
//! latency from each operation's intended send time, so that a stalled server is not
//! hidden by the generator waiting for it: no coordinated omission).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::sync::Semaphore;

use crate::client::{select_body, Api, BodyForm, Failed};
use crate::fleet::Fleet;
use crate::workload::Workload;

/// What every operation needs.
#[derive(Debug)]
pub(crate) struct Ctx {
    pub api: Api,
    pub fleet: Arc<Fleet>,
    pub workload: Mutex<Workload>,
    pub model: String,
    pub body: BodyForm,
}

/// Counters and histograms of one phase (latencies in microseconds).
#[derive(Debug)]
pub(crate) struct Stats {
    pub select: Histogram<u64>,
    pub chain: Histogram<u64>,
    /// Open loop: from an operation's intended send time to its task starting (the
    /// generator's own delay, included in the latencies).
    pub start_lag: Histogram<u64>,
    pub ops: u64,
    pub requests: u64,
    pub errors: BTreeMap<String, u64>,
    pub prompt_tokens: u64,
    /// Tokens the service reported matched (`overlap.gpu`) on the worker it chose.
    pub overlap_tokens: u64,
    /// Tokens that worker really held (the fleet's own caches): a perfect index's answer.
    pub held_tokens: u64,
    /// Answers whose `sequence_hashes` disagreed with ours (when the service sends them).
    pub hash_mismatches: u64,
}

impl Stats {
    pub(crate) fn new() -> Self {
        let h = || Histogram::new_with_bounds(1, 120_000_000, 3).expect("bounds");
        Stats {
            select: h(),
            chain: h(),
            start_lag: h(),
            ops: 0,
            requests: 0,
            errors: BTreeMap::new(),
            prompt_tokens: 0,
            overlap_tokens: 0,
            held_tokens: 0,
            hash_mismatches: 0,
        }
    }

    fn error(&mut self, what: &str, f: &Failed) {
        let key = match f.0 {
            Some(s) => format!("{what} {}", s.as_u16()),
            None => format!("{what} transport"),
        };
        let n = self.errors.entry(key.clone()).or_default();
        if *n == 0 {
            // The first of each kind, for diagnosis (the counts are in the output).
            eprintln!("[load] first {key}: {}", f.1);
        }
        *n += 1;
    }
}

impl Default for Stats {
    fn default() -> Self {
        Self::new()
    }
}

fn micros(d: Duration) -> u64 {
    (d.as_micros() as u64).clamp(1, 120_000_000)
}

/// One operation; latencies are measured from `intended` (its scheduled send time).
pub(crate) async fn operation(ctx: &Ctx, stats: &Mutex<Stats>, intended: Instant) {
    let prompt = ctx.workload.lock().unwrap().next_prompt();
    let body = select_body(ctx.body, &ctx.model, &prompt.tokens);
    let check = prompt.index.is_multiple_of(crate::client::HASH_CHECK_EVERY);
    let sel = match ctx.api.select_and_reserve(ctx.body, body, check).await {
        Ok(s) => s,
        Err(f) => {
            stats.lock().unwrap().error("select_and_reserve", &f);
            return;
        }
    };
    let select_us = micros(intended.elapsed());
    let w = sel.worker_id as usize;
    let held = if w < ctx.fleet.len() {
        // The prefill ran on w: its engine now holds the prompt's blocks and says so.
        ctx.fleet.serve(w, &prompt.tokens, &prompt.hashes)
    } else {
        0
    };
    let mismatch = sel.sequence_hashes.as_ref().is_some_and(|s| {
        s.len() != prompt.hashes.len()
            || s.iter()
                .zip(prompt.hashes.iter())
                .any(|(a, b)| *a as u64 != *b)
    });
    let mut ok = 1;
    let pc = ctx.api.prefill_complete(&sel.selection_id).await;
    ok += pc.is_ok() as u64;
    let fr = ctx.api.free(&sel.selection_id).await;
    ok += fr.is_ok() as u64;
    let chain_us = micros(intended.elapsed());
    let mut s = stats.lock().unwrap();
    s.select.record(select_us).expect("clamped");
    s.requests += ok;
    s.prompt_tokens += prompt.tokens.len() as u64;
    s.overlap_tokens += sel.overlap.gpu;
    s.held_tokens += (held * ctx.fleet.block_size) as u64;
    s.hash_mismatches += mismatch as u64;
    if w >= ctx.fleet.len() {
        *s.errors.entry("unknown worker_id".into()).or_default() += 1;
    }
    if let Err(f) = &pc {
        s.error("prefill_complete", f);
    }
    if let Err(f) = &fr {
        s.error("free", f);
    }
    if pc.is_ok() && fr.is_ok() {
        s.chain.record(chain_us).expect("clamped");
        s.ops += 1;
    }
}

/// One phase's figures, as the driver script reads them.
#[derive(Debug, Serialize)]
pub(crate) struct PhaseResult {
    pub kind: &'static str,
    pub concurrency: Option<usize>,
    pub offered_ops_s: Option<f64>,
    pub secs: f64,
    pub ops: u64,
    pub requests: u64,
    pub ops_s: f64,
    pub requests_s: f64,
    pub errors: u64,
    pub error_kinds: BTreeMap<String, u64>,
    pub select_p50_us: u64,
    pub select_p99_us: u64,
    pub select_max_us: u64,
    pub chain_p50_us: u64,
    pub chain_p99_us: u64,
    /// overlap.gpu / prompt tokens: how much of the prompts the service found cached.
    pub hit_rate: f64,
    /// held / prompt tokens: how much the chosen workers really had cached.
    pub held_rate: f64,
    pub hash_mismatches: u64,
    /// Operations an open-loop phase had to start late (the in-flight cap was reached).
    pub late_starts: u64,
    pub start_lag_p50_us: u64,
    pub start_lag_p99_us: u64,
    /// CPU the generator / the server used during the phase, in cores.
    pub loadgen_cpu: Option<f64>,
    pub server_cpu: Option<f64>,
    /// CPU other processes used on the server's / the generator's core, in cores.
    pub server_core_others: Option<f64>,
    pub loadgen_core_others: Option<f64>,
    /// The server's own CPU time (user + system, all threads) over the phase divided by
    /// the operations completed in it, in microseconds: what an operation costs the
    /// server, whatever share of its core it got.
    pub server_cpu_us_per_op: Option<f64>,
    /// The same for the generator.
    pub loadgen_cpu_us_per_op: Option<f64>,
}

fn result(
    kind: &'static str,
    conc: Option<usize>,
    rate: Option<f64>,
    s: &Stats,
    secs: f64,
    late: u64,
) -> PhaseResult {
    let ratio = |a: u64| {
        if s.prompt_tokens == 0 {
            0.0
        } else {
            a as f64 / s.prompt_tokens as f64
        }
    };
    PhaseResult {
        kind,
        concurrency: conc,
        offered_ops_s: rate,
        secs,
        ops: s.ops,
        requests: s.requests,
        ops_s: s.ops as f64 / secs,
        requests_s: s.requests as f64 / secs,
        errors: s.errors.values().sum(),
        error_kinds: s.errors.clone(),
        select_p50_us: s.select.value_at_quantile(0.50),
        select_p99_us: s.select.value_at_quantile(0.99),
        select_max_us: s.select.max(),
        chain_p50_us: s.chain.value_at_quantile(0.50),
        chain_p99_us: s.chain.value_at_quantile(0.99),
        hit_rate: ratio(s.overlap_tokens),
        held_rate: ratio(s.held_tokens),
        hash_mismatches: s.hash_mismatches,
        late_starts: late,
        start_lag_p50_us: s.start_lag.value_at_quantile(0.50),
        start_lag_p99_us: s.start_lag.value_at_quantile(0.99),
        loadgen_cpu: None,
        server_cpu: None,
        server_core_others: None,
        loadgen_core_others: None,
        server_cpu_us_per_op: None,
        loadgen_cpu_us_per_op: None,
    }
}

/// Closed loop: `conc` tasks issue operations back to back for `dur`.
pub(crate) async fn closed(ctx: &Arc<Ctx>, conc: usize, dur: Duration) -> PhaseResult {
    let stats = Arc::new(Mutex::new(Stats::new()));
    let start = Instant::now();
    let deadline = start + dur;
    let tasks: Vec<_> = (0..conc)
        .map(|_| {
            let (ctx, stats) = (ctx.clone(), stats.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    operation(&ctx, &stats, Instant::now()).await;
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    let secs = start.elapsed().as_secs_f64();
    let s = stats.lock().unwrap();
    result("closed", Some(conc), None, &s, secs, 0)
}

/// Open loop: operation i is due at start + i/rate whatever the answers do; at most
/// `max_inflight` run at once (past that an operation starts late, and its lateness
/// counts in its latency). The pacing runs on its own OS thread: tokio's timer has a
/// 1 ms granularity, which would add up to 1 ms of the generator's own to every
/// latency; a thread's sleep wakes within tens of microseconds.
pub(crate) async fn open(
    ctx: &Arc<Ctx>,
    rate: f64,
    dur: Duration,
    max_inflight: usize,
) -> PhaseResult {
    let stats = Arc::new(Mutex::new(Stats::new()));
    let sem = Arc::new(Semaphore::new(max_inflight));
    let n = (rate * dur.as_secs_f64()).round().max(1.0) as u64;
    let handle = tokio::runtime::Handle::current();
    let start = Instant::now();
    let pacer = {
        let (ctx, stats, sem) = (ctx.clone(), stats.clone(), sem.clone());
        std::thread::spawn(move || {
            let mut late = 0;
            for i in 0..n {
                let intended = start + Duration::from_secs_f64(i as f64 / rate);
                let now = Instant::now();
                if intended > now {
                    std::thread::sleep(intended - now);
                }
                let permit = match sem.clone().try_acquire_owned() {
                    Ok(p) => p,
                    Err(_) => {
                        late += 1;
                        handle.block_on(sem.clone().acquire_owned()).expect("open")
                    }
                };
                let (ctx, stats) = (ctx.clone(), stats.clone());
                handle.spawn(async move {
                    let lag = micros(intended.elapsed());
                    stats
                        .lock()
                        .unwrap()
                        .start_lag
                        .record(lag)
                        .expect("clamped");
                    operation(&ctx, &stats, intended).await;
                    drop(permit);
                });
            }
            late
        })
    };
    let late = tokio::task::spawn_blocking(move || pacer.join().expect("pacer"))
        .await
        .expect("join");
    // Wait for the stragglers (bounded: a hung server must not hang the benchmark).
    let drain = tokio::time::timeout(
        Duration::from_secs(60),
        sem.acquire_many(max_inflight as u32),
    )
    .await;
    if drain.is_err() {
        let mut s = stats.lock().unwrap();
        *s.errors.entry("unfinished after 60 s".into()).or_default() += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let s = stats.lock().unwrap();
    result("open", None, Some(rate), &s, secs, late)
}
