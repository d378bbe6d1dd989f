//! Measures what made-up workers and DP ranks sent through every C entry that takes a
//! worker id or a DP rank cost a partition, against a clean run: RSS growth and the time
//! of a valid `kvr_partition_apply_events` call afterwards. One run per process:
//! `ffi_flood clean|flood [N]` (N defaults to 10,000 made-up ids per entry, and the timed
//! calls to 10 × N); `tests/flood/measure.sh` repeats both and takes medians. A
//! measurement, not a test: it asserts nothing about times.
//!
//! The entries are those `ffi/tests/flood.rs` floods: `kvr_partition_apply_events` (ranks
//! the worker lacks, unregistered workers), `kvr_partition_ingest` (batches naming ranks
//! the worker lacks, made-up stream numbers, made-up workers, undecodable payloads),
//! `kvr_partition_install_replica_booking` (unregistered workers, ranks the worker lacks)
//! and `kvr_partition_publish_load` (one report naming them all). The clean run makes as
//! many calls with worker 1's own ranks (a replica booking is freed after it is
//! installed). Both runs make the clean calls once first, so that what a first call
//! allocates is in place before RSS is read.

use std::ptr;
use std::time::Instant;

use kvr::ingress::Medium;
use kvr_emulator::BatchEncoder;
use kvr_ffi::*;

const BS: u32 = 4;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// An engine with one partition holding worker 1 (dp_size 2).
struct Fixture {
    engine: *mut kvr_engine,
    partition: *mut kvr_partition,
    /// Worker 1's stream 0: the next sequence number.
    seq: u64,
}

impl Fixture {
    fn new() -> Fixture {
        let mut engine = ptr::null_mut();
        let mut opts = ptr::null_mut();
        let mut partition = ptr::null_mut();
        let mut worker = ptr::null_mut();
        // SAFETY: every pointer is a live out-parameter or a handle made just before.
        unsafe {
            assert_eq!(kvr_engine_new(ptr::null(), &mut engine), KVR_OK);
            assert_eq!(kvr_partition_options_new(BS, &mut opts), KVR_OK);
            let (m, g) = ("m", "g");
            let st = kvr_engine_create_partition(
                engine,
                m.as_ptr().cast(),
                m.len(),
                g.as_ptr().cast(),
                g.len(),
                opts,
                &mut partition,
            );
            assert_eq!(st, KVR_OK);
            kvr_partition_options_free(opts);
            assert_eq!(kvr_worker_new(1, 2, &mut worker), KVR_OK);
            assert_eq!(kvr_partition_upsert_worker(partition, worker), KVR_OK);
            kvr_worker_free(worker);
        }
        Fixture {
            engine,
            partition,
            seq: 0,
        }
    }

    fn apply(&self, worker: u64, dp: u32, hash: u64) -> kvr_status {
        let block = kvr_stored_block {
            external_hash: hash,
            local_hash: hash,
        };
        let ev = kvr_event {
            kind: KVR_EVENT_STORED,
            tier: KVR_TIER_DEVICE,
            has_parent: 0,
            reserved: 0,
            parent: 0,
            blocks: &block,
            n_blocks: 1,
            removed: ptr::null(),
            n_removed: 0,
        };
        let mut out = kvr_apply_result::default();
        // SAFETY: live handle; one event whose array is one block.
        unsafe { kvr_partition_apply_events(self.partition, worker, dp, &ev, 1, &mut out) }
    }

    fn ingest(&self, worker: u64, stream: u32, seq: u64, payload: &[u8]) -> kvr_status {
        let mut out = kvr_ingest_result::default();
        // SAFETY: live handle; the slices point to their lengths.
        unsafe {
            kvr_partition_ingest(
                self.partition,
                worker,
                stream,
                ptr::null(),
                0,
                seq,
                payload.as_ptr(),
                payload.len(),
                &mut out,
            )
        }
    }

    /// Worker 1's stream 0, in sequence.
    fn ingest_valid(&mut self, payload: &[u8]) -> kvr_status {
        self.seq += 1;
        self.ingest(1, 0, self.seq, payload)
    }

    fn replica(&self, id: u64, worker: u64, dp: u32) -> kvr_status {
        let blocks = [1u64, 2];
        let b = kvr_replica_booking {
            selection_id: id,
            worker_id: worker,
            dp_rank: dp,
            reserved: 0,
            prompt_blocks: blocks.as_ptr(),
            n_prompt_blocks: blocks.len(),
            prefill_tokens: 8,
            expected_output_tokens: 0,
            ttl_ms: 60_000,
        };
        // SAFETY: live handle; the booking's array points to its length.
        unsafe { kvr_partition_install_replica_booking(self.partition, &b) }
    }

    fn free_booking(&self, id: u64) {
        let mut freed = 0;
        // SAFETY: live handle, writable out.
        unsafe { kvr_engine_free_booking(self.engine, id, &mut freed) };
    }

    fn publish_load(&self, loads: &[kvr_rank_load]) -> kvr_status {
        let mut v = 0;
        // SAFETY: live handle; the slice points to its length.
        unsafe { kvr_partition_publish_load(self.partition, loads.as_ptr(), loads.len(), &mut v) }
    }

    fn ranks(&self) -> u64 {
        let mut s = std::mem::MaybeUninit::<kvr_index_stats>::zeroed();
        // SAFETY: live handle, writable out; read only once written (KVR_OK).
        unsafe {
            assert_eq!(
                kvr_partition_index_stats(self.partition, s.as_mut_ptr()),
                KVR_OK
            );
            s.assume_init().ranks
        }
    }

    fn streams(&self) -> usize {
        let mut n = 0usize;
        // SAFETY: live handle; an empty buffer only reports the count.
        unsafe { kvr_partition_ingress_stats(self.partition, ptr::null_mut(), 0, &mut n) };
        n
    }

    fn ingress_refused(&self) -> u64 {
        let mut s = kvr_indexer_stats::default();
        // SAFETY: live handle, writable out.
        unsafe { kvr_partition_indexer_stats(self.partition, &mut s) };
        s.ingress_refused
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // SAFETY: handles made by `new`, freed once.
        unsafe {
            kvr_partition_free(self.partition);
            kvr_engine_free(self.engine);
        }
    }
}

fn load(worker: u64, dp: u32) -> kvr_rank_load {
    kvr_rank_load {
        worker_id: worker,
        dp_rank: dp,
        kv_blocks_used: 1,
        ..kvr_rank_load::default()
    }
}

/// Everything a run sends, encoded before RSS is read.
struct Inputs {
    /// Batches naming worker 1's ranks 0 and 1 in turn.
    valid: Vec<Vec<u8>>,
    /// Batches naming ranks worker 1 lacks.
    bogus_rank: Vec<Vec<u8>>,
    /// Batches naming no rank (the stream's own).
    rankless: Vec<Vec<u8>>,
    valid_loads: Vec<kvr_rank_load>,
    bogus_loads: Vec<kvr_rank_load>,
}

impl Inputs {
    fn new(n: u64) -> Inputs {
        let mut enc = BatchEncoder::new();
        let tokens: Vec<u32> = (0..BS).collect();
        let mut batch = |dp: Option<u32>, seed: u64| {
            enc.stored(&[seed], None, &tokens, BS, Medium::Gpu, None);
            enc.finish(1.0, dp)
        };
        let mut valid_loads = vec![load(1, 0), load(1, 1)];
        let mut bogus_loads = valid_loads.clone();
        for i in 0..n {
            valid_loads.extend([load(1, 0), load(1, 1)]);
            bogus_loads.extend([load(1_000 + i, 0), load(1, 2 + i as u32)]);
        }
        Inputs {
            valid: (0..4 * n).map(|i| batch(Some(i as u32 % 2), i)).collect(),
            bogus_rank: (1..=n)
                .map(|i| {
                    let dp = 2 + (i as u32).wrapping_mul(2_654_435_761) % (u32::MAX - 2);
                    batch(Some(dp), i)
                })
                .collect(),
            rankless: (0..n).map(|i| batch(None, i)).collect(),
            valid_loads,
            bogus_loads,
        }
    }
}

/// As many calls through each entry as the flood makes, with worker 1's own ranks.
fn clean_calls(f: &mut Fixture, inputs: &Inputs, n: u64, ids: &mut u64) -> u64 {
    let mut calls = 0;
    for i in 0..2 * n {
        f.apply(1, (i % 2) as u32, 7);
        *ids += 1;
        f.replica(*ids, 1, (i % 2) as u32);
        f.free_booking(*ids);
        calls += 2;
    }
    for payload in &inputs.valid {
        f.ingest_valid(payload);
        calls += 1;
    }
    f.publish_load(&inputs.valid_loads);
    calls + 1
}

/// The flood: `n` made-up ids through each way every entry takes one.
fn flood_calls(f: &mut Fixture, inputs: &Inputs, n: u64, ids: &mut u64) -> u64 {
    let mut calls = 0;
    for i in 0..n {
        f.apply(1, 2 + i as u32, 7);
        f.apply(1_000 + i, 0, 7);
        *ids += 1;
        f.replica(*ids, 1_000 + i, 0);
        *ids += 1;
        f.replica(*ids, 1, 2 + i as u32);
        calls += 4;
    }
    for msg in &inputs.bogus_rank {
        f.ingest_valid(msg);
    }
    for (i, msg) in inputs.rankless.iter().enumerate() {
        let i = i as u64;
        f.ingest(1, 2 + i as u32, 0, msg);
        f.ingest(1_000 + i, 0, 0, msg);
        f.ingest(500_000 + i, (i % 4096) as u32, 0, b"\xc1garbage");
    }
    calls += 4 * n;
    f.publish_load(&inputs.bogus_loads);
    calls + 1
}

fn main() {
    let mut args = std::env::args().skip(1);
    let flood = match args.next().as_deref() {
        Some("flood") => true,
        Some("clean") => false,
        _ => {
            eprintln!("usage: ffi_flood clean|flood [N]");
            std::process::exit(2);
        }
    };
    let n: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(10_000);
    println!("{}", run(flood, n));
}

/// One run; its figures as one line of `key=value`.
fn run(flood: bool, n: u64) -> String {
    let timed = 10 * n;

    let mut f = Fixture::new();
    let inputs = Inputs::new(n);
    let mut ids = 0;
    clean_calls(&mut f, &inputs, n, &mut ids);

    let rss_before = rss_kib();
    let refused_before = f.ingress_refused();
    let t = Instant::now();
    let calls = if flood {
        flood_calls(&mut f, &inputs, n, &mut ids)
    } else {
        clean_calls(&mut f, &inputs, n, &mut ids)
    };
    let phase_ns = t.elapsed().as_nanos() as f64 / calls as f64;

    // Then valid calls on worker 1's rank 0: what the phase costs everybody else.
    let t = Instant::now();
    let mut ok = 0u64;
    for _ in 0..timed {
        ok += u64::from(f.apply(1, 0, 7) == KVR_OK);
    }
    let apply_ns = t.elapsed().as_nanos() as f64 / timed as f64;
    let rss_after = rss_kib();
    let line = format!(
        "ffi-{} ids={n} calls={calls} ns_per_call={phase_ns:.0} applies={timed} applied={ok} apply_ns_per_call={apply_ns:.0} rss_growth_kib={} ranks={} streams={} ingress_refused={}",
        if flood { "flood" } else { "clean" },
        rss_after.saturating_sub(rss_before),
        f.ranks(),
        f.streams(),
        f.ingress_refused() - refused_before,
    );
    drop(inputs);
    line
}

#[cfg(test)]
mod tests {
    /// A smoke run with small counts: it runs, every timed call applies, the flood stays
    /// within the caps, and every key `tests/flood/measure.sh` reads is printed. Times are
    /// not checked.
    #[test]
    fn smoke() {
        for (flood, ranks) in [
            (false, 2),
            (true, 2 + kvr::ingress::MAX_PENDING_RANKS as u64),
        ] {
            let line = super::run(flood, 500);
            let value = |key: &str| -> u64 {
                line.split_whitespace()
                    .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("no {key} in {line}"))
            };
            for key in ["ns_per_call", "apply_ns_per_call", "rss_growth_kib"] {
                value(key);
            }
            assert_eq!(value("applied"), value("applies"), "{line}");
            assert_eq!(value("ranks"), ranks, "{line}");
            assert_eq!(value("ingress_refused") > 0, flood, "{line}");
        }
    }
}
