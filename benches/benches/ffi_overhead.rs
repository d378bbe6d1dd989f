//! What the C ABI adds to a call (issue 4 item 6): advisory selection through
//! `kvr_partition_select` (with the `kvr_request_set_tokens` a C host makes before it)
//! against `Engine::select` through a partition handle on the same partition, 64 ranks, 256-token prompts.
//!
//! Workload: `kvr_benches::build_selection` at 64 ranks (block size 16), 512 queries of 256
//! tokens, cycled; both paths hash the tokens and run the same selection.
//!
//! - Criterion: `ffi_overhead/rust_select` and `ffi_overhead/c_abi_select`.
//! - Then a paired harness: `KVR_FFI_ROUNDS` rounds (default 1,001), each timing
//!   `KVR_FFI_CALLS` calls (default 1,000) of one path and then the other (order
//!   alternating by round), as mean ns per call. Short rounds keep the two paths of a
//!   pair within a few milliseconds of each other, so the machine's drift cancels out
//!   (rounds of 20,000 calls gave differences from +8 to +99 ns across runs; rounds of
//!   1,000 gave +38 to +60 ns). It prints the median of each path, the
//!   median of the per-round differences (C ABI − Rust) and of the per-round ratios, and
//!   writes them as JSON to `KVR_FFI_JSON` (default `<target>/kvr-bench/ffi.json`).
//!
//! Run: `cargo bench -p kvr-benches --bench ffi_overhead`. Without `--bench` it runs a
//! small smoke version (and checks both paths agree on the chosen rank).

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use criterion::Criterion;
use kvr::{Outcome, SelectRequest};
use kvr_benches::{build_selection, SelectionConfig};
use kvr_ffi::{
    kvr_decision, kvr_partition, kvr_partition_select, kvr_request, kvr_request_free,
    kvr_request_new, kvr_request_set_tokens, KVR_OK,
};

struct Setup {
    engine: Arc<kvr::Engine>,
    partition: Arc<kvr::Partition>,
    handle: Box<kvr_partition>,
    request: *mut kvr_request,
    queries: Vec<Vec<u32>>,
}

impl Drop for Setup {
    fn drop(&mut self) {
        // SAFETY: `request` came from kvr_request_new and is freed once, here.
        unsafe { kvr_request_free(self.request) };
    }
}

fn setup(queries: usize) -> Setup {
    let w = build_selection(SelectionConfig::new(64));
    let partition = w
        .engine
        .partition(&w.key)
        .expect("the workload's partition");
    let handle = Box::new(kvr_partition::from_parts(
        w.engine.clone(),
        partition.clone(),
    ));
    let mut request = std::ptr::null_mut();
    // SAFETY: `request` is a valid out-pointer.
    assert_eq!(unsafe { kvr_request_new(&mut request) }, KVR_OK);
    Setup {
        engine: w.engine.clone(),
        partition,
        handle,
        request,
        queries: w.queries(256, queries, 0xFF1),
    }
}

impl Setup {
    fn rust(&self, q: &[u32]) -> u64 {
        match self
            .engine
            .select(&self.partition, &SelectRequest::tokens(q))
        {
            Ok(Outcome::Selected(d)) => d.rank.worker_id,
            other => panic!("selection failed: {other:?}"),
        }
    }

    fn c_abi(&self, q: &[u32]) -> u64 {
        let mut out = kvr_decision::default();
        // SAFETY: the request and partition handles are live; `q` outlives both calls (the
        // request borrows it only until the selection returns); `out` is writable.
        let rc = unsafe {
            kvr_request_set_tokens(self.request, q.as_ptr(), q.len());
            kvr_partition_select(&*self.handle, self.request, &mut out)
        };
        assert_eq!(rc, KVR_OK, "kvr_partition_select");
        out.worker_id
    }

    /// Mean ns per call of `calls` calls of one path, starting at query `start`.
    fn time(&self, c_abi: bool, calls: usize, start: usize) -> f64 {
        let n = self.queries.len();
        let t = Instant::now();
        for i in 0..calls {
            let q = &self.queries[(start + i) % n];
            black_box(if c_abi { self.c_abi(q) } else { self.rust(q) });
        }
        t.elapsed().as_nanos() as f64 / calls as f64
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("finite timings"));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let bench_mode = std::env::args().any(|a| a == "--bench");
    let s = setup(512);
    // Both paths must make the same kind of decision on the same partition (the RNG is
    // per call, so compare on ranks whose choice is unique: check the prefix overlap
    // instead of the worker id).
    for q in s.queries.iter().take(8) {
        let (a, b) = (s.rust(q), s.c_abi(q));
        let p = &s.partition;
        let mut local = Vec::new();
        p.hasher().local_hashes(q, &mut local);
        let overlap = p.index().find_matches(&local);
        let (oa, ob) = (
            overlap.get(kvr::RankId::new(a, 0)),
            overlap.get(kvr::RankId::new(b, 0)),
        );
        assert!(
            oa.abs_diff(ob) <= 1,
            "paths disagree: rust chose worker {a} ({oa} blocks), C ABI {b} ({ob} blocks)"
        );
    }
    if !bench_mode {
        s.time(false, 200, 0);
        s.time(true, 200, 0);
        println!("ffi_overhead: smoke run ok");
        return;
    }

    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("ffi_overhead");
    let n = s.queries.len();
    let mut i = 0;
    g.bench_function("rust_select", |b| {
        b.iter(|| {
            i += 1;
            s.rust(&s.queries[i % n])
        })
    });
    g.bench_function("c_abi_select", |b| {
        b.iter(|| {
            i += 1;
            s.c_abi(&s.queries[i % n])
        })
    });
    g.finish();

    let rounds = env_usize("KVR_FFI_ROUNDS", 1_001);
    let calls = env_usize("KVR_FFI_CALLS", 1_000);
    let (mut rust, mut cabi, mut diff, mut ratio) = (vec![], vec![], vec![], vec![]);
    s.time(false, calls, 0);
    s.time(true, calls, 0);
    for r in 0..rounds {
        let start = r * 7919;
        let (a, b) = if r % 2 == 0 {
            let a = s.time(false, calls, start);
            (a, s.time(true, calls, start))
        } else {
            let b = s.time(true, calls, start);
            (s.time(false, calls, start), b)
        };
        rust.push(a);
        cabi.push(b);
        diff.push(b - a);
        ratio.push(b / a);
    }
    let (mr, mc, md, mq) = (median(rust), median(cabi), median(diff), median(ratio));
    println!(
        "ffi_overhead (64 ranks, 256 tokens, {rounds} rounds x {calls} calls, medians): \
         rust {mr:.0} ns/call, C ABI {mc:.0} ns/call, C ABI - rust {md:+.1} ns, ratio {mq:.4}"
    );
    let path = std::env::var_os("KVR_FFI_JSON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
            target.join("kvr-bench/ffi.json")
        });
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("create the JSON output directory");
    }
    let json = format!(
        "{{\"rounds\": {rounds}, \"calls\": {calls}, \"rust_ns\": {mr:.2}, \"c_abi_ns\": {mc:.2}, \
         \"diff_ns\": {md:.2}, \"ratio\": {mq:.5}}}\n"
    );
    std::fs::write(&path, json).expect("write the JSON");
    println!("ffi_overhead: wrote {}", path.display());
}
