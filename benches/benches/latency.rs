//! Per-call find_matches latency (p50/p99) and index memory, on the workload.
//!
//! Not a criterion suite (`harness = false`, plain `main`): for each shape the index is
//! built once; then each variant runs a warm-up and `KVR_LAT_CALLS` (default 200,000)
//! timed calls, each timed alone with `std::time::Instant`, and reports percentiles of the
//! raw per-call times (the timer's own cost, printed as `timer_overhead`, is not
//! subtracted). Before each call the query's hashes are copied into a reused buffer,
//! outside the timed region, as a router has them after hashing the request; the index
//! itself is cold-ish: every call draws a random stored chain.
//!
//! Also prints bytes per holder-block, as the index counts them (`IndexStats`: table,
//! holder sets, rank maps) and as the process's resident set grew while the stores were
//! applied (allocator overhead included; approximate).
//!
//! Run: `cargo bench -p kvr-benches --bench latency`. With `KVR_LATENCY_JSON=path` it also
//! writes the results as JSON. Without `--bench` (e.g. under `cargo test --benches`) it
//! runs a small smoke version. `KVR_LAT_CALLS=n` sets the calls per variant and
//! `KVR_LAT_ONLY=substring` keeps only the variants whose name contains it;
//! `KVR_LAT_HOLDER_BLOCKS=n` resizes the index (default 1,000,000; for experiments).

use std::fmt::Write as _;
use std::hint::black_box;
use std::time::Instant;

use kvr::OverlapScores;
use kvr_benches::timing::{print_table, summarize, timer_overhead, Lat};
use kvr_benches::{build_index, QueryOrder, Shape, Workload, WorkloadConfig};

const QUERY_LENS: [usize; 2] = [32, 128];

#[derive(Clone, Copy)]
enum Variant {
    FromLocal,
}

fn measure(w: &Workload, variant: Variant, n: usize, calls: usize, warmup: usize) -> Vec<u64> {
    let mut order = QueryOrder::for_chains(w.chains.len());
    let mut out = OverlapScores::new();
    let mut buf: Vec<u64> = Vec::with_capacity(n);
    let mut ns = Vec::with_capacity(calls);
    let holders = w.config.shape.holders_per_chain();
    for k in 0..warmup + calls {
        let i = order.next();
        buf.clear();
        match variant {
            Variant::FromLocal => buf.extend_from_slice(&w.chains.local(i)[..n]),
        }
        let t = Instant::now();
        match variant {
            Variant::FromLocal => w.index.find_matches_into(black_box(&buf), &mut out),
        }
        let d = t.elapsed();
        // Untimed sanity check: every query is a stored chain, held in full.
        assert_eq!(out.len(), holders, "query {i} matched the wrong ranks");
        if k >= warmup {
            ns.push(d.as_nanos() as u64);
        }
    }
    ns
}

/// Transparent huge pages backing this process (a TLB-reach diagnostic).
fn anon_huge_pages() -> Option<String> {
    let s = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = s.lines().find(|l| l.starts_with("AnonHugePages:"))?;
    Some(line["AnonHugePages:".len()..].trim().to_string())
}

fn main() {
    let bench_mode = std::env::args().any(|a| a == "--bench");
    let calls: usize = std::env::var("KVR_LAT_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if bench_mode { 200_000 } else { 2_000 });
    let warmup = (calls / 10).max(1_000);
    // KVR_LAT_ONLY=substring: run only the find_matches variants whose name contains it.
    let only = std::env::var("KVR_LAT_ONLY").unwrap_or_default();
    let name_of =
        |shape: Shape, vname: &str, n: usize| format!("find_matches_{}/{vname}/{n}", shape.label());
    const VARIANTS: [(Variant, &str); 1] = [(Variant::FromLocal, "from_local")];

    let mut lats = Vec::new();
    let mut mems = String::new();
    let mut json = String::from("{\n  \"results\": [\n");

    let t = timer_overhead(calls);
    lats.push(summarize("timer_overhead".into(), t));

    for shape in Shape::ALL {
        let wanted = |vname: &str, n: usize| name_of(shape, vname, n).contains(only.as_str());
        if !QUERY_LENS
            .iter()
            .any(|&n| VARIANTS.iter().any(|v| wanted(v.1, n)))
        {
            continue;
        }
        let mut cfg = WorkloadConfig::new(shape);
        if !bench_mode {
            cfg.total_holder_blocks = 50_000;
        }
        if let Some(n) = std::env::var("KVR_LAT_HOLDER_BLOCKS")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            cfg.total_holder_blocks = n;
        }
        let t0 = Instant::now();
        let w = build_index(cfg);
        let build = t0.elapsed();
        let s = w.stats();
        let hb = s.holder_blocks as f64;
        let _ = writeln!(
            mems,
            "memory {:<8} holder_blocks={} nodes={} chains={} distinct_queried={} built_in={:.2?}\n\
             \x20 bytes/holder-block: total={:.2} = table {:.2} + holder_sets {:.2} + rank_maps {:.2}\n\
             \x20 bytes/node: table {:.2}; rss growth while storing: {}; process AnonHugePages: {}",
            shape.label(),
            s.holder_blocks,
            s.nodes,
            w.chains.len(),
            QueryOrder::for_chains(w.chains.len()).distinct(),
            build,
            s.bytes_per_holder_block(),
            s.table_bytes as f64 / hb,
            s.holder_set_bytes as f64 / hb,
            s.rank_map_bytes as f64 / hb,
            s.table_bytes as f64 / s.nodes.max(1) as f64,
            match w.rss_growth {
                Some(b) => format!("{:.2} B/holder-block", b as f64 / hb),
                None => "n/a".into(),
            },
            anon_huge_pages().unwrap_or_else(|| "n/a".into()),
        );
        let _ = writeln!(
            json,
            "    {{\"name\": \"memory/{}\", \"holder_blocks\": {}, \"nodes\": {}, \"bytes\": {}, \
             \"table_bytes\": {}, \"holder_set_bytes\": {}, \"rank_map_bytes\": {}, \
             \"bytes_per_holder_block\": {:.3}, \"rss_growth_bytes\": {}}},",
            shape.label(),
            s.holder_blocks,
            s.nodes,
            s.bytes,
            s.table_bytes,
            s.holder_set_bytes,
            s.rank_map_bytes,
            s.bytes_per_holder_block(),
            w.rss_growth
                .map_or_else(|| "null".to_string(), |b| b.to_string()),
        );
        for n in QUERY_LENS {
            for (variant, vname) in VARIANTS {
                if wanted(vname, n) {
                    let ns = measure(&w, variant, n, calls, warmup);
                    lats.push(summarize(name_of(shape, vname, n), ns));
                }
            }
        }
    }

    print_table("latency (ns, per call)", 40, &lats);
    print!("{mems}");

    let entries: Vec<String> = lats.iter().map(Lat::json_entry).collect();
    json.push_str(&entries.join(",\n"));
    json.push_str("\n  ]\n}\n");
    if let Ok(path) = std::env::var("KVR_LATENCY_JSON") {
        std::fs::write(&path, json).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
}
