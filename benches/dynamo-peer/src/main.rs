//! kvr side by side with Dynamo 1.6.1's own router crate (`dynamo-kv-router`, from
//! crates.io) at fleet scale, in one process, on the same inputs:
//! - `ingest`: one fleet's KV-event stream (the fleet bench's, `benches/fleet/src/events.rs`,
//!   shared by path: a vLLM msgpack batch a rank a round from 1,024 workers × 8 DP ranks,
//!   four 16-block stores with their tokens plus the removal of the rank's previous round)
//!   through each side's decoder and index, one thread each ([`ingest`]);
//! - `select`: booked selections over the same fleet, each side's index filled from the
//!   same messages, Dynamo's selection service built in process by its own builder
//!   (`select.rs`, built with the `select` feature).
//!
//! The sides alternate within each repetition; figures are medians of the repetitions,
//! with min–max.
//!
//! ```sh
//! cargo run --release --manifest-path benches/dynamo-peer/Cargo.toml -- ingest --reps 5
//! cargo run --release --manifest-path benches/dynamo-peer/Cargo.toml --features select -- select --reps 5
//! cargo run --release --manifest-path benches/dynamo-peer/Cargo.toml --features select -- all --quick
//! ```

#[path = "../../fleet/src/events.rs"]
mod events;
mod ingest;
#[cfg(feature = "select")]
mod select;

use events::EventShape;

struct Args {
    what: String,
    shape: EventShape,
    rounds: usize,
    reps: usize,
    calls: usize,
}

const USAGE: &str = "usage: dynamo-peer ingest|select|all [--quick] [--workers N] [--dp N] [--rounds N] [--reps N] [--calls N]";

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let what = it.next().ok_or(USAGE)?;
    if !matches!(what.as_str(), "ingest" | "select" | "all") {
        return Err(USAGE.into());
    }
    let mut a = Args {
        what,
        shape: EventShape::FLEET,
        rounds: 2,
        reps: 3,
        calls: 2_000,
    };
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
                a.calls = 200;
            }
            "--workers" => a.shape.workers = num("--workers")?.max(1),
            "--dp" => a.shape.dp = num("--dp")?.clamp(1, 64) as u32,
            "--rounds" => a.rounds = num("--rounds")?.max(1) as usize,
            "--reps" => a.reps = num("--reps")?.max(1) as usize,
            "--calls" => a.calls = num("--calls")?.max(2) as usize,
            _ => return Err(format!("unknown argument {flag}\n{USAGE}")),
        }
    }
    Ok(a)
}

/// Median, min and max of `v` (not empty).
pub(crate) fn median_min_max(mut v: Vec<f64>) -> (f64, f64, f64) {
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
    if args.what != "select" {
        ingest::run(args.shape, args.rounds, args.reps);
    }
    if args.what != "ingest" {
        #[cfg(feature = "select")]
        select::run(args.shape, args.calls, args.reps);
        #[cfg(not(feature = "select"))]
        {
            eprintln!("select: build with --features select");
            std::process::exit(2);
        }
    }
}
