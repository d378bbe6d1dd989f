//! Side-by-side index benchmark: kvr against SMG's chain index (kv-index 2.0.0) and
//! positional indexer (kv-index 1.7.0) and a naive exact map, on one deterministic
//! workload (see `workload`), one backend per process (see `measure`), runs interleaved so
//! that the machine's drift falls on every backend alike.
//!
//! ```text
//! cargo run --release -p kvr-index-peers -- --sizes 1M,4M,16M --runs 3 --out target/index-peers
//! cargo run --release -p kvr-index-peers -- --quick          # the CI smoke: tiny, one run
//! ```
//! It prints the tables (markdown) and writes `results.json`, `tables.md` and
//! `lookup-vs-size.svg` into `--out`.

mod alloc;
mod backend;
mod chase;
mod measure;
mod plot;
mod report;
mod smg;
mod workload;

use std::process::Command;

use clap::Parser;

use backend::{Kvr, KvrReserved, Naive, NAMES};
use measure::{Record, RunSpec};
use workload::Profile;

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

#[derive(Parser, Debug)]
#[command(about = "kvr's index side by side with SMG's and a naive exact map")]
struct Args {
    /// Index sizes in holder-blocks (suffix K or M), comma-separated.
    #[arg(long, default_value = "1M,4M,16M", value_delimiter = ',')]
    sizes: Vec<String>,
    /// Profiles: single (one holder per block), shared8 (eight).
    #[arg(long, default_value = "single,shared8", value_delimiter = ',')]
    profiles: Vec<String>,
    /// Backends: kvr, kvr-reserved (each worker's map sized for its share first),
    /// smg-chain, smg-positional, naive.
    #[arg(
        long,
        default_value = "kvr,kvr-reserved,smg-chain,smg-positional,naive",
        value_delimiter = ','
    )]
    backends: Vec<String>,
    /// Runs of every (size, profile, backend); the tables give medians.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Per-call samples per query set (a quarter of that for misses and splices).
    #[arg(long, default_value_t = 20_000)]
    queries: usize,
    /// Seconds of each concurrency phase (0 skips them).
    #[arg(long, default_value_t = 1.0)]
    concurrency_secs: f64,
    /// Requests stored (and as many evicted) in the churn phase.
    #[arg(long, default_value_t = 2_000)]
    churn_requests: usize,
    #[arg(long, default_value_t = 0x6b76_725f_7065_6572)]
    seed: u64,
    /// The capacity registered for each worker (backends that take one: `kvr-reserved`),
    /// as a multiple of what the fullest worker holds after the build: above 1, rank maps
    /// run at a lower load, trading bytes for write speed.
    #[arg(long, default_value_t = 1.0)]
    capacity_scale: f64,
    /// Where to write results.json, tables.md and the plot.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// The CI smoke: 20K holder-blocks, one run, short phases.
    #[arg(long)]
    quick: bool,
    /// Render the tables and plot from saved `results.json` files (comma-separated)
    /// instead of running: sizes, profiles and backends as found in them.
    #[arg(long, value_delimiter = ',')]
    from_json: Vec<std::path::PathBuf>,
    /// Internal: run one backend in this process and print its record.
    #[arg(long, hide = true)]
    child: Option<String>,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1_000),
        Some('M' | 'm') => (&s[..s.len() - 1], 1_000_000),
        _ => (s, 1),
    };
    let n: usize = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    match n.checked_mul(mul) {
        Some(v) if (1_000..=256_000_000).contains(&v) => Ok(v),
        _ => Err(format!("size {s:?} outside 1K..256M holder-blocks")),
    }
}

fn run_child(backend: &str, spec: &RunSpec) -> Result<Record, String> {
    Ok(match backend {
        "kvr" => measure::run::<Kvr>(backend, spec),
        "kvr-reserved" => measure::run::<KvrReserved>(backend, spec),
        "smg-chain" => measure::run::<smg::SmgChain>(backend, spec),
        "smg-positional" => measure::run::<smg::SmgPositional>(backend, spec),
        "naive" => measure::run::<Naive>(backend, spec),
        other => return Err(format!("unknown backend {other:?}; known: {NAMES:?}")),
    })
}

fn main() {
    let mut args = Args::parse();
    if args.quick {
        args.sizes = vec!["20K".into()];
        args.runs = 1;
        args.queries = 2_000;
        args.concurrency_secs = 0.1;
        args.churn_requests = 200;
    }
    let sizes: Vec<usize> = match args.sizes.iter().map(|s| parse_size(s)).collect() {
        Ok(v) => v,
        Err(e) => fail(&e),
    };
    let profiles: Vec<Profile> = args
        .profiles
        .iter()
        .map(|p| Profile::parse(p).unwrap_or_else(|| fail(&format!("unknown profile {p:?}"))))
        .collect();
    for b in &args.backends {
        if !NAMES.contains(&b.as_str()) {
            fail(&format!("unknown backend {b:?}; known: {NAMES:?}"));
        }
    }
    if let Some(out) = &args.out {
        if let Err(e) = std::fs::create_dir_all(out) {
            fail(&format!("cannot create {}: {e}", out.display()));
        }
    }

    if let Some(backend) = &args.child {
        let spec = RunSpec {
            profile: profiles[0],
            holder_blocks: sizes[0],
            seed: args.seed,
            queries: args.queries,
            concurrency_secs: args.concurrency_secs,
            churn_requests: args.churn_requests,
            capacity_scale: args.capacity_scale,
        };
        match run_child(backend, &spec) {
            Ok(rec) => println!("{}", serde_json::to_string(&rec).expect("serializable")),
            Err(e) => fail(&e),
        }
        return;
    }

    if !args.from_json.is_empty() {
        let mut records: Vec<Record> = Vec::new();
        for p in &args.from_json {
            let text = std::fs::read_to_string(p)
                .unwrap_or_else(|e| fail(&format!("{}: {e}", p.display())));
            let mut r: Vec<Record> = serde_json::from_str(&text)
                .unwrap_or_else(|e| fail(&format!("{}: {e}", p.display())));
            records.append(&mut r);
        }
        let mut backends: Vec<String> = Vec::new();
        for r in &records {
            if !backends.contains(&r.backend) {
                backends.push(r.backend.clone());
            }
        }
        let runs = records
            .iter()
            .filter(|r| r.backend == backends[0] && r.profile == records[0].profile)
            .filter(|r| r.holder_blocks == records[0].holder_blocks)
            .count();
        render(
            &records,
            &sizes,
            &profiles,
            &backends,
            runs,
            args.out.as_deref(),
        );
        return;
    }
    let exe = std::env::current_exe().unwrap_or_else(|e| fail(&format!("own path: {e}")));
    let total = args.runs * sizes.len() * profiles.len() * args.backends.len();
    let mut records: Vec<Record> = Vec::with_capacity(total);
    let mut k = 0;
    for run in 0..args.runs {
        for &size in &sizes {
            for &profile in &profiles {
                for backend in &args.backends {
                    k += 1;
                    eprintln!(
                        "[{k}/{total}] run {} {backend} {} {}",
                        run + 1,
                        profile.label(),
                        report::size_label(size)
                    );
                    let out = Command::new(&exe)
                        .args(["--child", backend])
                        .args(["--sizes", &size.to_string()])
                        .args(["--profiles", profile.label()])
                        .args(["--queries", &args.queries.to_string()])
                        .args(["--concurrency-secs", &args.concurrency_secs.to_string()])
                        .args(["--churn-requests", &args.churn_requests.to_string()])
                        .args(["--seed", &args.seed.to_string()])
                        .args(["--capacity-scale", &args.capacity_scale.to_string()])
                        .output()
                        .unwrap_or_else(|e| fail(&format!("spawn: {e}")));
                    if !out.status.success() {
                        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
                        fail(&format!(
                            "{backend} {} failed: {}",
                            profile.label(),
                            out.status
                        ));
                    }
                    let line = String::from_utf8_lossy(&out.stdout);
                    let rec: Record = serde_json::from_str(line.trim())
                        .unwrap_or_else(|e| fail(&format!("bad record from {backend}: {e}")));
                    records.push(rec);
                }
            }
        }
    }

    render(
        &records,
        &sizes,
        &profiles,
        &args.backends,
        args.runs,
        args.out.as_deref(),
    );
    let inexact: Vec<String> = records
        .iter()
        .filter(|r| {
            r.backend.starts_with("kvr") || r.backend == "naive" || r.backend == "smg-chain"
        })
        .filter(|r| r.overcounts > 0)
        .map(|r| format!("{} {} {}", r.backend, r.profile, r.holder_blocks))
        .collect();
    if !inexact.is_empty() {
        fail(&format!("an exact backend overcounted: {inexact:?}"));
    }
}

/// Prints the tables and, with `out`, writes results.json, tables.md and the plot there.
fn render(
    records: &[Record],
    sizes: &[usize],
    profiles: &[Profile],
    backends: &[String],
    runs: usize,
    out: Option<&std::path::Path>,
) {
    let tables = report::tables(records, sizes, profiles, backends, runs);
    println!("{tables}");
    if let Some(out) = out {
        let write = |name: &str, body: &str| {
            let p = out.join(name);
            std::fs::write(&p, body).unwrap_or_else(|e| fail(&format!("{}: {e}", p.display())));
        };
        write(
            "results.json",
            &serde_json::to_string_pretty(&records).expect("serializable"),
        );
        write("tables.md", &tables);
        write(
            "lookup-vs-size.svg",
            &plot::lookup_vs_size(records, sizes, backends),
        );
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("index-peers: {msg}");
    std::process::exit(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_absurd_ones_are_refused() {
        assert_eq!(parse_size("1M"), Ok(1_000_000));
        assert_eq!(parse_size("20K"), Ok(20_000));
        assert!(parse_size("0").is_err());
        assert!(parse_size("999999M").is_err());
        assert!(parse_size("x").is_err());
    }
}
