//! Picks a few small inputs of a fuzz corpus that together exercise every path a target
//! counts (its `Summary`), for the committed seeds:
//!
//! ```text
//! cargo run --manifest-path fuzz/Cargo.toml --release --example pick_seeds -- \
//!     <ingest_frames|event_sequence|recovery|ext_proc> <corpus dir> <out dir> [count, default 6]
//! ```
//!
//! Greedy: each pick adds the most to `min(counter, 20)` summed over the counters (ties:
//! the smaller input); files are written as `<out>/<target>-<k>`.

use std::path::PathBuf;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: pick_seeds <target> <corpus dir> <out dir> [count]");
        std::process::exit(2);
    }
    let target = args[1].as_str();
    let run: fn(&[u8]) -> Vec<(&'static str, u64)> = match target {
        "ingest_frames" => |d| kvr_fuzz::ingest_frames::run_summary(d).fields(),
        "event_sequence" => |d| kvr_fuzz::event_sequence::run_summary(d).fields(),
        "recovery" => |d| kvr_fuzz::recovery::run_summary(d).fields(),
        "ext_proc" => |d| kvr_fuzz::ext_proc::run_summary(d).fields(),
        t => panic!("no summary for target {t}"),
    };
    let count: usize = args.get(4).map_or(6, |c| c.parse().unwrap());
    let mut files: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&args[2])
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect();
    files.sort();
    // An input that fails (a finding) is not a seed: it belongs under regressions/.
    std::panic::set_hook(Box::new(|_| {}));
    let mut sums: Vec<Vec<u64>> = Vec::new();
    files.retain(|(p, b)| match std::panic::catch_unwind(|| run(b)) {
        Ok(s) => {
            sums.push(s.into_iter().map(|f| f.1).collect());
            true
        }
        Err(_) => {
            eprintln!("skipped (fails): {}", p.display());
            false
        }
    });
    let _ = std::panic::take_hook();
    let names: Vec<&str> = run(&[]).into_iter().map(|f| f.0).collect();
    let cap = 20u64;
    let mut have = vec![0u64; names.len()];
    let mut picked = vec![false; files.len()];
    std::fs::create_dir_all(&args[3]).unwrap();
    for k in 0..count {
        let gain = |s: &Vec<u64>| -> u64 {
            s.iter()
                .zip(&have)
                .map(|(x, h)| (h + x).min(cap) - (*h).min(cap))
                .sum()
        };
        let Some(best) = (0..files.len())
            .filter(|&i| !picked[i] && gain(&sums[i]) > 0)
            .max_by_key(|&i| (gain(&sums[i]), std::cmp::Reverse(files[i].1.len())))
        else {
            break;
        };
        picked[best] = true;
        for (h, x) in have.iter_mut().zip(&sums[best]) {
            *h += x;
        }
        let out = PathBuf::from(&args[3]).join(format!("{target}-{k}"));
        std::fs::write(&out, &files[best].1).unwrap();
        eprintln!(
            "{} <- {} ({} bytes)",
            out.display(),
            files[best].0.display(),
            files[best].1.len()
        );
    }
    for (n, h) in names.iter().zip(&have) {
        eprintln!("  {n}: {h}");
    }
}
