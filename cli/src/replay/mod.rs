//! `kvr replay`: a trace-driven simulation of a routed cluster — how routing quality is
//! measured. The path: workload ([`workload`]) → router under test ([`policy`], kvr's
//! host API) → simulated ranks ([`sim`], [`kv_cache`]) emitting KV events back through
//! kvr's ingress → report ([`report`], [`plot`]).
//!
//! Every policy sees the same arrivals on an identical, freshly built cluster, so their
//! figures compare directly. Defaults follow what Dynamo and llm-d use for such replays
//! (16 workers × 16,384 KV blocks, LRU, Mooncake ids split into finer blocks); the time
//! model's defaults (10k prefill tokens/s per rank, 20 ms per output token) are a mid-size
//! model on one GPU, chosen so prefill dominates TTFT as it does in practice.

mod checks;
pub(crate) mod kv_cache;
pub(crate) mod plot;
pub(crate) mod policy;
#[cfg(test)]
mod replica_tests;
pub(crate) mod replicas;
pub(crate) mod report;
pub(crate) mod routers;
pub(crate) mod sglang_tree;
pub(crate) mod sim;
pub(crate) mod slow;
pub(crate) mod sweep;
#[cfg(test)]
mod tests;
pub(crate) mod workload;

use std::collections::HashSet;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvr::config::PartitionConfig;
use kvr::config::{AffinityMode, SessionConfig};
use kvr::config::{CostConfig, LatencyConfig};
use kvr::Engine;
use kvr::{PartitionKey, WorkerInfo};

use policy::{PolicyKind, Router};
use report::PolicyReport;
use sim::SimConfig;
use workload::{GeneratorConfig, Workload};

/// Ranks a replay may simulate (workers × dp size).
const MAX_RANKS: u64 = 4_096;
/// Conversations the built-in workload may have: each keeps its turns' prompts (a turn's
/// prompt is the conversation so far), so memory and time grow with this: about 2 KiB and
/// 0.35 ms of simulation per conversation and policy at the defaults (`kvr replay --policy
/// round-robin --sessions N`: max RSS 18.8 MB at 1,200, 38.1 MB at 12,000; 0.41 s, 4.2 s).
/// 100,000 is ~80× the default: a few hundred MB and about half a minute per policy.
pub(crate) const MAX_SESSIONS: u32 = 100_000;

#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    /// A Mooncake JSONL trace (`timestamp` ms, `input_length`, `output_length`,
    /// `hash_ids` of 512 tokens). Without one, the built-in workload is generated.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Policies to compare, comma-separated, or `all`: kvr, kvr-dynamo, kvr-approx,
    /// kvr-predict, round-robin, random, least-loaded, sglang, dynamo-classic.
    #[arg(long, default_value = "all", value_name = "LIST")]
    pub policy: String,
    /// Workers (engines) in the simulated cluster.
    #[arg(long, default_value_t = 16)]
    pub workers: u32,
    /// Data-parallel ranks per worker.
    #[arg(long, default_value_t = 1)]
    pub dp_size: u32,
    /// KV-cache blocks per rank.
    #[arg(long, default_value_t = 16_384)]
    pub kv_blocks: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64)]
    pub block_size: u32,
    /// Prefill throughput per rank, tokens/s.
    #[arg(long, default_value_t = 10_000.0)]
    pub prefill_rate: f64,
    /// Fixed cost of a prefill, ms.
    #[arg(long, default_value_t = 5.0)]
    pub prefill_overhead_ms: f64,
    /// Time per output token of a lone request, ms.
    #[arg(long, default_value_t = 20.0)]
    pub tpot_ms: f64,
    /// Extra time per output token per other decoding request on the rank (fraction).
    #[arg(long, default_value_t = 0.01)]
    pub batch_slowdown: f64,
    /// Requests a rank runs at once (vLLM's max_num_seqs).
    #[arg(long, default_value_t = 256)]
    pub max_running: u32,
    /// Tokens a rank's step processes at most: decodes plus prefill chunks (vLLM's
    /// max_num_batched_tokens).
    #[arg(long, default_value_t = 8_192)]
    pub max_batched_tokens: u32,
    /// Delay from a rank emitting KV events to the router applying them, ms.
    #[arg(long, default_value_t = 20.0)]
    pub event_delay_ms: f64,
    /// Load: a trace's arrivals (or the built-in workload's session starts) come this many
    /// times as fast; a conversation's next turn still waits for the previous answer.
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Seed of the built-in workload and of the policies' random choices.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Built-in workload: sessions (conversations, agent runs, long prompts).
    #[arg(long, default_value_t = GeneratorConfig::default().sessions)]
    pub sessions: u32,
    /// Built-in workload: sessions started per second.
    #[arg(long, default_value_t = GeneratorConfig::default().session_rate)]
    pub session_rate: f64,
    /// Built-in workload: share of sessions that are agent runs (long shared tool
    /// preamble, many short turns).
    #[arg(long, default_value_t = GeneratorConfig::default().agent_share)]
    pub agent_share: f64,
    /// Built-in workload: share of sessions that are one long prompt of unique content.
    #[arg(long, default_value_t = GeneratorConfig::default().unique_share)]
    pub unique_share: f64,
    /// kvr's cost: multiplier on the credited prefill term (Dynamo's
    /// `prefill_load_scale`; > 1 weighs cache hits and prefill balance over decode load).
    #[arg(long, default_value_t = 1.0)]
    pub prefill_load_scale: f64,
    /// `kvr-predict`: how long a booked prompt counts as cached on its rank before the
    /// engine's events confirm it, ms.
    #[arg(long, default_value_t = 2_000.0)]
    pub prediction_ttl_ms: f64,
    /// Session affinity for kvr, kvr-approx and kvr-predict on the built-in workload's
    /// conversations: `hard` (a conversation stays on its rank while it is eligible) or
    /// `soft:N` (its rank's cost lowered by N blocks). Off by default.
    #[arg(long, value_name = "hard|soft:N")]
    pub affinity: Option<String>,
    /// A heterogeneous fleet: the first N workers run F times as slow (prefill and decode),
    /// from S seconds of simulated time on (`N:F@S`), or from the start (`N:F`).
    #[arg(long, value_name = "N:F[@S]")]
    pub slow_workers: Option<String>,
    /// kvr's cost: credit per cached device block (Dynamo's `overlap_score_credit`).
    #[arg(long, default_value_t = 1.0)]
    pub overlap_credit: f64,
    /// kvr's choice: softmax temperature (0 = lowest cost wins).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// kvr's cost: load-dependent decay of the device credit (Dynamo's
    /// `overlap_score_credit_decay`; 0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub credit_decay: f64,
    /// kvr's latency cost: weight of the queue externality (what a cache miss costs the
    /// requests queued behind it; 0 = price only the request's own TTFT).
    #[arg(long, default_value_t = kvr::config::LatencyConfig::default().queue_externality)]
    pub queue_externality: f64,
    /// kvr's cost: block equivalents charged per active request on a rank.
    #[arg(long, default_value_t = 0.0)]
    pub active_request_weight: f64,
    /// Replay at several settings of one knob, every policy at each: `rate=1,4,16` (load
    /// multipliers) or `event-delay-ms=0,20,200,2000`. Prints a table per setting and
    /// TTFT p90 by setting; `--plot` then draws TTFT p90 against the setting.
    #[arg(long, value_name = "KEY=V1,V2,…")]
    pub sweep: Option<String>,
    /// Replay only the first N requests.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also draw TTFT CDFs and hit rates per policy into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// No progress bar (it is drawn only when stderr is a terminal anyway).
    #[arg(long)]
    pub quiet: bool,
    #[command(flatten)]
    pub replicas: replicas::ReplicaArgs,
}

impl ReplayArgs {
    fn sim_config(&self) -> Result<SimConfig, String> {
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("--{name} must be a positive number (got {v})"))
            }
        };
        let non_negative = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!("--{name} must be zero or more (got {v})"))
            }
        };
        for (name, v) in [
            ("workers", self.workers),
            ("dp-size", self.dp_size),
            ("kv-blocks", self.kv_blocks),
            ("block-size", self.block_size),
            ("max-running", self.max_running),
            ("max-batched-tokens", self.max_batched_tokens),
        ] {
            if v == 0 {
                return Err(format!("--{name} must be at least 1"));
            }
        }
        if u64::from(self.workers) * u64::from(self.dp_size) > MAX_RANKS {
            return Err(format!(
                "--workers × --dp-size must be at most {MAX_RANKS} ranks"
            ));
        }
        positive("prefill-rate", self.prefill_rate)?;
        positive("speed", self.speed)?;
        non_negative("prefill-overhead-ms", self.prefill_overhead_ms)?;
        non_negative("tpot-ms", self.tpot_ms)?;
        non_negative("batch-slowdown", self.batch_slowdown)?;
        non_negative("event-delay-ms", self.event_delay_ms)?;
        non_negative("prefill-load-scale", self.prefill_load_scale)?;
        non_negative("overlap-credit", self.overlap_credit)?;
        non_negative("temperature", self.temperature)?;
        non_negative("credit-decay", self.credit_decay)?;
        non_negative("queue-externality", self.queue_externality)?;
        non_negative("active-request-weight", self.active_request_weight)?;
        positive("prediction-ttl-ms", self.prediction_ttl_ms)?;
        let cost = CostConfig {
            prefill_load_scale: self.prefill_load_scale,
            overlap_score_credit: self.overlap_credit,
            temperature: self.temperature,
            credit_decay: (self.credit_decay > 0.0).then_some(self.credit_decay),
            decode_active_request_weight: self.active_request_weight,
            latency: LatencyConfig {
                // The simulated ranks' true rate is the prior; kvr learns it anyway.
                prefill_rate_prior: self.prefill_rate,
                queue_externality: self.queue_externality,
                ..LatencyConfig::default()
            },
            ..CostConfig::default()
        };
        let affinity = match self.affinity.as_deref() {
            None => None,
            Some("hard") => Some(AffinityMode::Hard),
            Some(s) => match s.strip_prefix("soft:").map(str::parse::<f64>) {
                Some(Ok(n)) if n.is_finite() && n >= 0.0 => {
                    Some(AffinityMode::Soft { penalty_blocks: n })
                }
                _ => {
                    return Err(format!(
                        "--affinity must be `hard` or `soft:N` with N ≥ 0 blocks (got {s:?})"
                    ))
                }
            },
        };
        Ok(SimConfig {
            workers: self.workers,
            dp_size: self.dp_size,
            kv_blocks: self.kv_blocks,
            block_size: self.block_size,
            prefill_rate: self.prefill_rate,
            prefill_overhead_ms: self.prefill_overhead_ms,
            tpot_ms: self.tpot_ms,
            batch_slowdown: self.batch_slowdown,
            max_running: self.max_running,
            max_batched_tokens: self.max_batched_tokens,
            event_delay_ms: self.event_delay_ms,
            speed: self.speed,
            seed: self.seed,
            cost,
            prediction_ttl_ms: self.prediction_ttl_ms,
            affinity,
            slow: self
                .slow_workers
                .as_deref()
                .map(|s| slow::SlowWorkers::parse(s, self.workers))
                .transpose()?,
        })
    }

    fn policies(&self) -> Result<Vec<PolicyKind>, String> {
        let mut out = Vec::new();
        for name in self
            .policy
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            if name == "all" {
                out.extend(PolicyKind::ALL);
            } else {
                out.push(PolicyKind::parse(name)?);
            }
        }
        out.dedup();
        if out.is_empty() {
            return Err("--policy names no policy".into());
        }
        Ok(out)
    }

    fn workload(&self) -> Result<Workload, String> {
        self.workload_seeded(self.seed)
    }

    /// The workload with the built-in generator seeded by `seed` (a trace ignores it).
    fn workload_seeded(&self, seed: u64) -> Result<Workload, String> {
        let mut w = match &self.trace {
            Some(path) => workload::load_mooncake(path)?,
            None => {
                if self.sessions == 0 || self.sessions > MAX_SESSIONS {
                    return Err(format!(
                        "--sessions must be between 1 and {MAX_SESSIONS} (got {}): the built-in \
                         workload holds every turn's prompt in memory",
                        self.sessions
                    ));
                }
                if !(self.session_rate.is_finite() && self.session_rate > 0.0) {
                    return Err("--session-rate must be a positive number".into());
                }
                let share = |v: f64| v.is_finite() && (0.0..=1.0).contains(&v);
                if !share(self.agent_share)
                    || !share(self.unique_share)
                    || self.agent_share + self.unique_share > 1.0
                {
                    return Err(
                        "--agent-share and --unique-share must be in [0, 1] and sum to at most 1"
                            .into(),
                    );
                }
                workload::generate(&GeneratorConfig {
                    seed,
                    sessions: self.sessions,
                    session_rate: self.session_rate,
                    agent_share: self.agent_share,
                    unique_share: self.unique_share,
                    ..GeneratorConfig::default()
                })
            }
        };
        if let Some(n) = self.limit {
            if n == 0 {
                return Err("--limit must be at least 1".into());
            }
            w.requests.truncate(n);
        }
        Ok(w)
    }
}

/// Share of prompt tokens an infinite cache shared by all ranks would serve: each
/// request's leading complete blocks that any earlier request already computed (its
/// prompt, or its answer's complete blocks, as the ranks cache them), short of the block
/// holding its last token (always recomputed, as on the ranks).
pub(crate) fn oracle_hit_rate(w: &Workload, block_size: u32) -> f64 {
    let hasher = policy::hasher(block_size);
    let (mut local, mut seq, mut tokens) = (Vec::new(), Vec::new(), Vec::new());
    let mut seen = HashSet::new();
    let mut cached = 0u64;
    for r in &w.requests {
        r.tokens_into(&mut tokens);
        let prompt_blocks = tokens.len() / block_size as usize;
        let usable = tokens.len().saturating_sub(1) / block_size as usize;
        // The answer's tokens after the prompt's: the chained hashes of the prompt's
        // complete blocks are the first ones of the whole sequence's.
        tokens.extend(
            (0..r.output_tokens.saturating_sub(1)).map(|j| workload::token_at(r.output_content, j)),
        );
        hasher.hash_tokens(&tokens, &mut local, &mut seq);
        let hits = seq[..prompt_blocks]
            .iter()
            .take_while(|h| seen.contains(*h))
            .count()
            .min(usable);
        cached += hits as u64 * u64::from(block_size);
        seen.extend(seq.iter().copied());
    }
    let prompt = w.prompt_tokens();
    if prompt == 0 {
        0.0
    } else {
        cached as f64 / prompt as f64
    }
}

/// A fresh engine with one partition holding the cluster's workers, and its router.
pub(crate) fn router_for(kind: PolicyKind, cfg: &SimConfig) -> Router {
    replica_router_for(kind, cfg, 0, 0.0)
}

/// [`router_for`] as replica `index` of several (`Router::set_replica`); replica 0 with
/// band 0 is the single router.
pub(crate) fn replica_router_for(
    kind: PolicyKind,
    cfg: &SimConfig,
    index: u32,
    tie_band: f64,
) -> Router {
    let seed = match index {
        0 => cfg.seed,
        k => cfg.seed ^ u64::from(k).wrapping_mul(0x9e37_79b9_7f4a_7c15),
    };
    let engine = Engine::with_seed(seed);
    let key = PartitionKey::new("replay", "default");
    let partition = engine
        .create_partition(
            key,
            PartitionConfig {
                cost: kind.cost(cfg.cost),
                indexer: kind.indexer(Duration::from_secs_f64(cfg.prediction_ttl_ms / 1e3)),
                sessions: cfg
                    .affinity
                    .filter(|_| kind.selects_in_engine())
                    .map(|mode| SessionConfig {
                        mode,
                        ..SessionConfig::default()
                    }),
                ..PartitionConfig::new(cfg.block_size)
            },
        )
        .expect("a new engine has no partitions, and the indexer configurations are valid");
    for w in 0..cfg.workers {
        let mut info = WorkerInfo::new(u64::from(w), cfg.dp_size);
        info.total_kv_blocks = u64::from(cfg.kv_blocks);
        partition.upsert_worker(info).unwrap();
    }
    let mut router = Router::new(kind, engine, partition, cfg.ranks(), cfg.seed);
    router.set_replica(index, cfg.seed, tie_band);
    router
}

/// Runs every policy; returns the workload and the per-policy results.
pub(crate) fn replay(
    cfg: &SimConfig,
    w: &Workload,
    policies: &[PolicyKind],
    bar: &ProgressBar,
) -> Vec<sim::RunResult> {
    policies
        .iter()
        .enumerate()
        .map(|(k, &kind)| {
            bar.reset();
            bar.set_length(w.requests.len() as u64);
            bar.set_message(format!("{} ({}/{})", kind.name(), k + 1, policies.len()));
            let mut router = router_for(kind, cfg);
            sim::run(cfg, w, &mut router, || bar.inc(1))
        })
        .collect()
}

fn workload_json(w: &Workload, cfg: &SimConfig) -> serde_json::Value {
    let mut params = serde_json::Map::new();
    for (k, v) in &w.params {
        params.insert((*k).into(), (*v).into());
    }
    serde_json::json!({
        "name": w.name,
        "requests": w.requests.len(),
        "prompt_tokens": w.prompt_tokens(),
        "duration_s": w.duration_ms() / 1e3,
        "generator": params,
        "workers": cfg.workers,
        "dp_size": cfg.dp_size,
        "kv_blocks": cfg.kv_blocks,
        "block_size": cfg.block_size,
        "prefill_rate": cfg.prefill_rate,
        "prefill_overhead_ms": cfg.prefill_overhead_ms,
        "tpot_ms": cfg.tpot_ms,
        "batch_slowdown": cfg.batch_slowdown,
        "max_running": cfg.max_running,
        "max_batched_tokens": cfg.max_batched_tokens,
        "event_delay_ms": cfg.event_delay_ms,
        "speed": cfg.speed,
        "seed": cfg.seed,
        "prefill_load_scale": cfg.cost.prefill_load_scale,
        "overlap_credit": cfg.cost.overlap_score_credit,
        "temperature": cfg.cost.temperature,
        "credit_decay": cfg.cost.credit_decay,
        "active_request_weight": cfg.cost.decode_active_request_weight,
        "queue_externality": cfg.cost.latency.queue_externality,
        "prediction_ttl_ms": cfg.prediction_ttl_ms,
        "affinity": cfg.affinity.map(|a| format!("{a:?}")),
        "slow_workers": cfg.slow.map(|s| serde_json::json!({
            "workers": s.workers, "factor": s.factor, "from_s": s.from_ms / 1e3,
        })),
    })
}

pub(crate) fn run(args: &ReplayArgs) -> Result<(), String> {
    // Output paths first: a bad one fails before any work, not after the simulation.
    if let Some(path) = &args.plot {
        plot::check_writable(path)?;
    }
    let cfg = args.sim_config()?;
    let policies = args.policies()?;
    let sweep = args.sweep.as_deref().map(sweep::parse).transpose()?;
    let plan = args.replicas.plan()?;
    if plan.is_some() && sweep.is_some() {
        return Err(
            "--routers and --sweep do not combine: replicas make a table of their own".into(),
        );
    }
    let w = args.workload()?;
    for (i, r) in w.requests.iter().enumerate() {
        let need = cfg.blocks_needed(r.input_tokens, r.output_tokens);
        if need > cfg.kv_blocks {
            return Err(format!(
                "request {} ({} prompt + {} output tokens) needs {need} KV blocks, more than \
                 --kv-blocks {}",
                i + 1,
                r.input_tokens,
                r.output_tokens,
                cfg.kv_blocks
            ));
        }
    }
    let oracle = oracle_hit_rate(&w, cfg.block_size);
    // One pass of the bar per policy (its message says which), as wide as the terminal.
    let bar = if args.quiet || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        ProgressBar::with_draw_target(Some(w.requests.len() as u64), ProgressDrawTarget::stderr())
    };
    bar.set_style(
        ProgressStyle::with_template("{msg} [{wide_bar}] {pos}/{len} requests, {eta} left")
            .map_err(|e| e.to_string())?
            .progress_chars("=> "),
    );
    if let Some(plan) = plan {
        return run_replicas(args, &cfg, &w, &policies, &plan, &bar);
    }
    if let Some((key, values)) = sweep {
        return run_sweep(args, &cfg, &w, &policies, key, &values, oracle, &bar);
    }
    let results = replay(&cfg, &w, &policies, &bar);
    bar.finish_and_clear();

    let reports: Vec<PolicyReport> = results
        .iter()
        .map(|r| PolicyReport::new(r, oracle))
        .collect();
    if let Some(path) = &args.plot {
        let series: Vec<plot::PlotSeries<'_>> = results
            .iter()
            .zip(&reports)
            .map(|(r, p)| plot::PlotSeries {
                policy: r.policy,
                hit_rate: p.hit_rate,
                oracle_hit_rate: oracle,
                ttft_ms: &r.ttft_ms,
            })
            .collect();
        let title = format!(
            "{}: {} requests, {} workers × {} KV blocks",
            w.name,
            w.requests.len(),
            cfg.workers * cfg.dp_size,
            cfg.kv_blocks
        );
        plot::write_svg(path, &title, &series)?;
    }
    let text = if args.json {
        let out = serde_json::json!({
            "workload": workload_json(&w, &cfg),
            "policies": reports,
        });
        format!("{out}\n")
    } else {
        let wall: f64 = results.iter().map(|r| r.wall_secs).sum();
        format!(
            "workload {}: {} requests over {:.0} s, {} prompt tokens; {} ranks × {} KV blocks of {} tokens\n\
             oracle hit rate (one infinite cache): {:.1} %\n\n{}\n(simulated in {wall:.1} s of wall time)\n",
            w.name,
            w.requests.len(),
            w.duration_ms() / 1e3 / cfg.speed,
            w.prompt_tokens(),
            cfg.workers * cfg.dp_size,
            cfg.kv_blocks,
            cfg.block_size,
            oracle * 100.0,
            report::table(&reports),
        )
    };
    crate::output::emit(&text)?;
    let problems: Vec<String> = results
        .iter()
        .flat_map(|r| r.problems.iter().map(move |p| format!("{}: {p}", r.policy)))
        .collect();
    if !problems.is_empty() {
        return Err(format!(
            "the simulation broke its invariants:\n  {}",
            problems.join("\n  ")
        ));
    }
    Ok(())
}

/// `--routers`: every policy with each number of replicas and sync, one table.
fn run_replicas(
    args: &ReplayArgs,
    cfg: &SimConfig,
    first: &Workload,
    policies: &[PolicyKind],
    plan: &replicas::ReplicaPlan,
    bar: &ProgressBar,
) -> Result<(), String> {
    let workload = |seed: u64| -> Result<(Workload, f64), String> {
        let w = if seed == cfg.seed || args.trace.is_some() {
            first.clone()
        } else {
            args.workload_seeded(seed)?
        };
        let oracle = oracle_hit_rate(&w, cfg.block_size);
        Ok((w, oracle))
    };
    let (rows, problems) = replicas::run(plan, cfg, policies, workload, bar)?;
    let text = if args.json {
        let out = serde_json::json!({
            "workload": workload_json(first, cfg),
            "replicas": rows,
        });
        format!("{out}\n")
    } else {
        format!(
            "workload {}: {} requests, {} prompt tokens; {} ranks × {} KV blocks of {} tokens; \
             medians over {} seed(s) from {}\n\n{}",
            first.name,
            first.requests.len(),
            first.prompt_tokens(),
            cfg.workers * cfg.dp_size,
            cfg.kv_blocks,
            cfg.block_size,
            plan.seeds,
            cfg.seed,
            replicas::table(&rows),
        )
    };
    crate::output::emit(&text)?;
    if !problems.is_empty() {
        return Err(format!(
            "the simulation broke its invariants:\n  {}",
            problems.join("\n  ")
        ));
    }
    Ok(())
}

/// `--sweep`: every policy at every setting, then the tables (or JSON) and the plot.
#[allow(clippy::too_many_arguments)]
fn run_sweep(
    args: &ReplayArgs,
    cfg: &SimConfig,
    w: &Workload,
    policies: &[PolicyKind],
    key: sweep::SweepKey,
    values: &[f64],
    oracle: f64,
    bar: &ProgressBar,
) -> Result<(), String> {
    let mut points = Vec::new();
    let mut problems = Vec::new();
    for &v in values {
        let at = key.apply(cfg, v);
        let results = replay(&at, w, policies, bar);
        for r in &results {
            problems.extend(
                r.problems
                    .iter()
                    .map(|p| format!("{} at {}: {p}", r.policy, key.label(v))),
            );
        }
        points.push(sweep::SweepPoint {
            value: v,
            reports: results
                .iter()
                .map(|r| PolicyReport::new(r, oracle))
                .collect(),
        });
    }
    bar.finish_and_clear();
    if let Some(path) = &args.plot {
        let title = format!(
            "{}: TTFT p90 by {}, {} ranks × {} KV blocks",
            w.name,
            key.name(),
            cfg.workers * cfg.dp_size,
            cfg.kv_blocks
        );
        sweep::write_svg(path, &title, key, &points, policies)?;
    }
    let text = if args.json {
        sweep::json(key, w, &workload_json(w, cfg), &points)
    } else {
        format!(
            "workload {}: {} requests, {} prompt tokens; {} ranks × {} KV blocks of {} tokens\n\
             oracle hit rate (one infinite cache): {:.1} %\n\n{}",
            w.name,
            w.requests.len(),
            w.prompt_tokens(),
            cfg.workers * cfg.dp_size,
            cfg.kv_blocks,
            cfg.block_size,
            oracle * 100.0,
            sweep::table(key, &points),
        )
    };
    crate::output::emit(&text)?;
    if !problems.is_empty() {
        return Err(format!(
            "the simulation broke its invariants:\n  {}",
            problems.join("\n  ")
        ));
    }
    Ok(())
}
