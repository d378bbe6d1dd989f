//! `kvr-service-load`: one benchmark run against one selection service (kvr serve or
//! Dynamo's select_service) — register a simulated fleet, check its KV events reach the
//! service's index, then measure saturation (closed loop) and latency at fixed offered
//! loads (open loop). Prints one JSON object on stdout; `run.sh` drives the services and
//! aggregates the runs into the table. See README.md.

mod client;
mod cpu;
mod fleet;
mod load;
mod workload;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::json;

use client::{Api, BodyForm};
use fleet::{Batch, Fleet};
use load::Ctx;
use workload::{sequence_hashes, LenDist, Workload, WorkloadConfig};

#[derive(Debug, Parser)]
// `args_override_self`: a flag given twice takes its last value, so run.sh's smoke
// defaults can be overridden after `--`.
#[command(
    about = "Load generator for the selection service (kvr serve / Dynamo select_service)",
    args_override_self = true
)]
struct Args {
    /// The service's HTTP port on 127.0.0.1.
    #[arg(long)]
    port: u16,
    /// A label for the output (e.g. kvr, dynamo).
    #[arg(long, default_value = "service")]
    service: String,
    /// PID of the server process, for its VmRSS / VmHWM after the run.
    #[arg(long)]
    server_pid: Option<u32>,
    /// The core the server is pinned to (for the CPU other processes took on it).
    #[arg(long)]
    server_core: Option<usize>,
    /// The core this generator is pinned to.
    #[arg(long)]
    loadgen_core: Option<usize>,
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Worker i publishes its KV events on tcp://127.0.0.1:(zmq_base_port + i).
    #[arg(long, default_value_t = 29000)]
    zmq_base_port: u16,
    /// Each worker's prefix-cache capacity in blocks (beyond it, LRU leaves are evicted).
    #[arg(long, default_value_t = 8192)]
    cache_blocks: usize,
    #[arg(long, default_value = "bench")]
    model: String,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Closed-loop warm-up before measuring (fills the caches and the index), seconds.
    #[arg(long, default_value_t = 5.0)]
    warmup: f64,
    /// Length of each measured phase, seconds.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Closed-loop concurrencies (saturation = the best of them).
    #[arg(long, value_delimiter = ',', default_value = "8,32,128")]
    conc: Vec<usize>,
    /// Open-loop offered loads, operations per second (none: skip the open loop).
    #[arg(long, value_delimiter = ',')]
    rates: Vec<f64>,
    /// Open loop: at most this many operations in flight.
    #[arg(long, default_value_t = 4096)]
    max_inflight: usize,
    #[arg(long, default_value_t = 1024)]
    min_len: usize,
    #[arg(long, default_value_t = 8192)]
    max_len: usize,
    #[arg(long, value_enum, default_value_t = LenDist::Log)]
    len_dist: LenDist,
    /// Shared system prompts.
    #[arg(long, default_value_t = 32)]
    groups: usize,
    #[arg(long, default_value_t = 512)]
    group_min: usize,
    #[arg(long, default_value_t = 2048)]
    group_max: usize,
    /// Probability that a prompt continues an earlier conversation.
    #[arg(long, default_value_t = 0.3)]
    multi_turn: f64,
    #[arg(long, default_value_t = 512)]
    sessions: usize,
    /// Every prompt exactly this many tokens (the per-op CPU mode; overrides the
    /// lengths drawn between --min-len and --max-len).
    #[arg(long)]
    prompt_tokens: Option<usize>,
    /// The form of the select_and_reserve body.
    #[arg(long, value_enum, default_value_t = BodyForm::Json)]
    body: BodyForm,
}

fn main() {
    let args = Args::parse();
    // One worker thread per core this process may run on (run.sh pins it to one).
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("runtime");
    match rt.block_on(run(&args, threads)) {
        Ok(out) => println!("{out}"),
        Err(e) => {
            eprintln!("[load] error: {e}");
            std::process::exit(1);
        }
    }
}

fn log(msg: impl AsRef<str>) {
    eprintln!("[load] {}", msg.as_ref());
}

async fn run(a: &Args, threads: usize) -> Result<serde_json::Value, String> {
    let api = Api::new(a.port);
    wait_for(Duration::from_secs(60), || async {
        api.get_json("/health").await.is_ok()
    })
    .await
    .map_err(|_| format!("no /health on port {} within 60 s", a.port))?;
    let fleet = Fleet::bind(a.workers, a.zmq_base_port, a.cache_blocks, a.block_size).await?;
    register(&api, a).await?;
    probe(&api, &fleet, a).await?;

    let workload = Workload::new(WorkloadConfig {
        seed: a.seed,
        block_size: a.block_size,
        min_len: a.min_len,
        max_len: a.max_len,
        len_dist: a.len_dist,
        groups: a.groups,
        group_min: a.group_min,
        group_max: a.group_max,
        multi_turn: a.multi_turn,
        sessions: a.sessions,
        fixed_len: a.prompt_tokens.filter(|&l| l > 0),
    });
    let ctx = Arc::new(Ctx {
        api,
        fleet: fleet.clone(),
        workload: Mutex::new(workload),
        model: a.model.clone(),
        body: a.body,
    });
    let max_conc = a.conc.iter().copied().max().unwrap_or(8);
    if a.warmup > 0.0 {
        let w = load::closed(&ctx, max_conc.min(32), Duration::from_secs_f64(a.warmup)).await;
        log(format!(
            "warm-up: {:.0} ops/s, hit rate {:.3} (held {:.3}), {} errors",
            w.ops_s, w.hit_rate, w.held_rate, w.errors
        ));
    }
    let dur = Duration::from_secs_f64(a.duration);
    let mut phases = Vec::new();
    let cores = cpu::Cores {
        server_pid: a.server_pid.map(|p| p.to_string()),
        server_core: a.server_core,
        loadgen_core: a.loadgen_core,
    };
    for &c in &a.conc {
        let before = cores.sample();
        let mut r = load::closed(&ctx, c, dur).await;
        cores.fill(before, &mut r);
        log(format!(
            "closed C={c}: {:.0} ops/s, {:.0} req/s, select p50 {} us p99 {} us, hit {:.3} (held {:.3}), {} errors, cpu load {:.2} server {:.2} others on server core {:.2}, server {:.0} us/op",
            r.ops_s, r.requests_s, r.select_p50_us, r.select_p99_us, r.hit_rate, r.held_rate, r.errors,
            r.loadgen_cpu.unwrap_or(f64::NAN), r.server_cpu.unwrap_or(f64::NAN),
            r.server_core_others.unwrap_or(f64::NAN),
            r.server_cpu_us_per_op.unwrap_or(f64::NAN)
        ));
        phases.push(r);
    }
    for &rate in &a.rates {
        let before = cores.sample();
        let mut r = load::open(&ctx, rate, dur, a.max_inflight).await;
        cores.fill(before, &mut r);
        log(format!(
            "open {rate:.0} ops/s: achieved {:.0}, select p50 {} us p99 {} us, hit {:.3}, {} errors, {} late, start lag p50 {} us p99 {} us, cpu load {:.2} server {:.2}",
            r.ops_s, r.select_p50_us, r.select_p99_us, r.hit_rate, r.errors, r.late_starts,
            r.start_lag_p50_us, r.start_lag_p99_us,
            r.loadgen_cpu.unwrap_or(f64::NAN), r.server_cpu.unwrap_or(f64::NAN)
        ));
        phases.push(r);
    }
    // Let the last events land before reading the server's memory.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss, hwm) = a.server_pid.map_or((None, None), memory_kb);
    let st = &fleet.stats;
    use std::sync::atomic::Ordering::Relaxed;
    Ok(json!({
        "service": a.service,
        "workers": a.workers,
        "seed": a.seed,
        "cache_blocks": a.cache_blocks,
        "prompt_tokens": a.prompt_tokens,
        "body": format!("{:?}", a.body).to_lowercase(),
        "loadgen_threads": threads,
        "prompts": ctx.workload.lock().unwrap().drawn,
        "phases": phases,
        "rss_kb": rss,
        "hwm_kb": hwm,
        "events": {
            "batches": st.batches.load(Relaxed),
            "stored_blocks": st.stored_blocks.load(Relaxed),
            "removed_blocks": st.removed_blocks.load(Relaxed),
            "cached_blocks_at_end": fleet.cached_blocks(),
        },
    }))
}

/// Polls `ok` every 50 ms until it holds or `limit` passes.
async fn wait_for<F, Fut>(limit: Duration, mut ok: F) -> Result<(), ()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if ok().await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(())
}

/// `POST /workers` for 0..n, then waits until `GET /ready` counts them schedulable.
async fn register(api: &Api, a: &Args) -> Result<(), String> {
    for i in 0..a.workers {
        let body = json!({
            "worker_id": i,
            "model_name": a.model,
            "endpoint": format!("http://w{i}"),
            "kv_events_endpoint": format!("tcp://127.0.0.1:{}", a.zmq_base_port as usize + i),
            "block_size": a.block_size,
        });
        api.post_json("/workers", &body)
            .await
            .map_err(|f| format!("POST /workers {i}: {f:?}"))?;
    }
    wait_for(Duration::from_secs(30), || async {
        match api.get_json("/ready").await {
            Ok(v) => v["schedulable_workers"].as_u64().unwrap_or(0) >= a.workers as u64,
            Err(_) => false,
        }
    })
    .await
    .map_err(|_| format!("{} workers not schedulable within 30 s", a.workers))?;
    log(format!("{} workers registered and schedulable", a.workers));
    Ok(())
}

/// A one-block prompt only worker `w` will hold (token ids above any vocabulary).
fn probe_tokens(w: usize, bs: usize) -> Vec<u32> {
    (0..bs)
        .map(|j| 4_000_000_000 - (w * bs + j) as u32)
        .collect()
}

/// Checks that every worker's events reach the index (ZMQ drops what is published
/// before a subscription is up): each worker stores a probe block until
/// `POST /overlap_scores` reports it on that worker, then removes it.
async fn probe(api: &Api, fleet: &Fleet, a: &Args) -> Result<(), String> {
    let bs = a.block_size;
    let mut pending: Vec<usize> = (0..a.workers).collect();
    let end = Instant::now() + Duration::from_secs(30);
    while !pending.is_empty() {
        if Instant::now() > end {
            return Err(format!(
                "KV events of workers {pending:?} never reached the index"
            ));
        }
        for &w in &pending {
            let t = probe_tokens(w, bs);
            let mut b = Batch::default();
            b.stored(&sequence_hashes(&t, bs), None, &t, bs);
            fleet.send(w, b);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut still = Vec::new();
        for &w in &pending {
            let body = json!({"model_name": a.model, "token_ids": probe_tokens(w, bs)});
            match api.post_json("/overlap_scores", &body).await {
                Ok(b) => {
                    let v: serde_json::Value = serde_json::from_slice(&b).unwrap_or_default();
                    let seen = v["workers"].as_array().is_some_and(|ws| {
                        ws.iter().any(|x| {
                            x["worker_id"].as_u64() == Some(w as u64)
                                && x["device_blocks"].as_u64().unwrap_or(0) > 0
                        })
                    });
                    if !seen {
                        still.push(w);
                    }
                }
                Err(f) if matches!(f.0.map(|s| s.as_u16()), Some(404 | 405)) => {
                    log("no /overlap_scores: cannot check events arrive; waiting 2 s instead");
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    return Ok(());
                }
                Err(f) => return Err(format!("/overlap_scores: {f:?}")),
            }
        }
        pending = still;
    }
    for w in 0..a.workers {
        let mut b = Batch::default();
        b.removed(&sequence_hashes(&probe_tokens(w, bs), bs));
        fleet.send(w, b);
    }
    log("every worker's KV events reach the index");
    Ok(())
}

/// VmRSS and VmHWM (peak RSS) of a process, in kB.
fn memory_kb(pid: u32) -> (Option<u64>, Option<u64>) {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return (None, None);
    };
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    };
    (field("VmRSS:"), field("VmHWM:"))
}
