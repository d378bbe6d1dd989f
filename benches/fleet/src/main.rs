//! kvr at fleet scale. `fleet-bench select` measures selection over 1,024 workers of 8
//! data-parallel ranks (8,192 candidates) beside the same workload at 64 ranks, with and
//! without a filter narrowing the candidates, the time to add and remove a worker, and the
//! memory per holder-block. `--quick` runs every path in seconds for CI (its figures mean
//! nothing). Figures print as a markdown table and go to `--out` as JSON.

mod events;
mod ingest;
mod report;
mod select;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use report::Report;
use select::SelectPlan;

#[derive(Parser, Debug)]
#[command(name = "fleet-bench", about = "kvr at fleet scale")]
struct Cli {
    #[command(subcommand)]
    part: Part,
    /// Seconds instead of minutes: small sizes, few calls (a smoke; figures mean nothing).
    #[arg(long, global = true)]
    quick: bool,
    /// Write the figures here as JSON.
    #[arg(long, global = true)]
    out: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Part {
    /// KV events of 1,024 workers × 8 ranks on one thread: block-ops/s, and the lag from
    /// publish to indexed at a paced rate beside a selecting thread.
    Ingest {
        #[arg(long)]
        workers: Option<u64>,
        #[arg(long)]
        dp: Option<u32>,
        /// Block-ops per second offered in the lag part.
        #[arg(long)]
        lag_rate: Option<f64>,
        #[arg(long)]
        lag_secs: Option<f64>,
        #[arg(long)]
        reps: Option<usize>,
        /// KV capacity registered per rank (0: none).
        #[arg(long)]
        capacity: Option<u64>,
    },
    /// Selection at 1,024 workers × 8 ranks, worker churn, memory.
    Select {
        #[arg(long)]
        workers: Option<usize>,
        #[arg(long)]
        dp: Option<u32>,
        /// Prompt length in tokens.
        #[arg(long)]
        tokens: Option<usize>,
        /// Timed calls per case and round.
        #[arg(long)]
        calls: Option<usize>,
        /// Rounds per case (the cases interleaved round by round).
        #[arg(long)]
        reps: Option<usize>,
        /// Private (unshared) blocks per rank: the index's size.
        #[arg(long)]
        private_blocks: Option<usize>,
        /// Only the cases whose name contains this (the churn part runs either way).
        #[arg(long, default_value = "")]
        only: String,
    },
}

/// The selection target at fleet scale: `select_and_reserve` p99 at 8,192 ranks.
const SELECT_P99_GOAL_NS: f64 = 20_000.0;

fn main() {
    let cli = Cli::parse();
    let mut report = Report::default();
    match cli.part {
        Part::Ingest {
            workers,
            dp,
            lag_rate,
            lag_secs,
            reps,
            capacity,
        } => {
            let base = if cli.quick {
                ingest::IngestPlan::quick()
            } else {
                ingest::IngestPlan::full()
            };
            let plan = ingest::IngestPlan {
                workers: workers.unwrap_or(base.workers),
                dp: dp.unwrap_or(base.dp),
                lag_rate: lag_rate.unwrap_or(base.lag_rate),
                lag_secs: lag_secs.unwrap_or(base.lag_secs),
                reps: reps.unwrap_or(base.reps).max(1),
                capacity: capacity.unwrap_or(base.capacity),
                ..base
            };
            ingest::run(&plan, &mut report);
        }
        Part::Select {
            workers,
            dp,
            tokens,
            calls,
            reps,
            private_blocks,
            only,
        } => {
            let base = if cli.quick {
                SelectPlan::quick()
            } else {
                SelectPlan::full()
            };
            let plan = SelectPlan {
                workers: workers.unwrap_or(base.workers),
                dp: dp.unwrap_or(base.dp),
                tokens: tokens.unwrap_or(base.tokens),
                calls: calls.unwrap_or(base.calls).max(1),
                reps: reps.unwrap_or(base.reps).max(1),
                private_blocks_per_rank: private_blocks.unwrap_or(base.private_blocks_per_rank),
                churn_workers: base.churn_workers,
                only,
            };
            select::run(&plan, &mut report);
            let ranks = plan.workers * plan.dp as usize;
            if let Some(f) = report.get(&format!("select_and_reserve/{ranks}r/all")) {
                let p99 = f.p99.expect("latency figures carry a p99").median;
                report.note(format!(
                    "goal: select_and_reserve p99 at {ranks} ranks {:.2} µs against ≤ {:.0} µs: {}",
                    p99 / 1e3,
                    SELECT_P99_GOAL_NS / 1e3,
                    if cli.quick {
                        "not judged (--quick)"
                    } else if p99 <= SELECT_P99_GOAL_NS {
                        "met"
                    } else {
                        "missed"
                    }
                ));
            }
        }
    }
    println!();
    print!("{}", report.table());
    if let Some(path) = cli.out {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        if let Err(e) = std::fs::write(&path, report.json()) {
            eprintln!("fleet-bench: cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
    }
}
