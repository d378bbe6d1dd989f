//! How long a restarted router takes to get its index back, and what keeping it on disk
//! costs the ingest path.
//!
//! A partition is filled with N holder-blocks (ranks holding prompts that share heads,
//! like system prompts), through the engines' own path: KV-event batches decoded and
//! applied. Then, for each way back, the time until the index is whole again in a new
//! partition:
//!
//! - `snapshot+journal (uring|plain)`: kvr-state's restore of what the journal's writer
//!   kept (a snapshot, and the last 10 % of the batches in the journal after it), on the
//!   given I/O path; the files are read from the page cache;
//! - `peer /dump (kvr shape)`: a peer's `/dump` body (the JSON kvr and Dynamo serve)
//!   made, parsed and applied, without the network;
//! - `re-ingest every batch`: what a cold start would need if the engines could replay
//!   their whole history (they keep their last ~10,000 batches only, so a cold start
//!   never gets this far).
//!
//! Then ingest throughput: the same batches into a fresh partition with the journal's
//! writer attached and without, alternating, each `--reps` times.
//!
//! cargo run --release -p kvr-restart-bench -- --blocks 1000000 --reps 3

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use kvr::config::PartitionConfig;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::ingress::Medium;
use kvr::{AppliedLog, KvEvent, Partition, PartitionKey};
use kvr_emulator::BatchEncoder;
use kvr_state::{partition_dir, restore, Io, IoMode, StateConfig, StateLog};

#[derive(Parser, Debug)]
struct Args {
    /// Holder-blocks to fill the partition with (comma-separated for several runs).
    #[arg(long, value_delimiter = ',', default_value = "1000000")]
    blocks: Vec<u64>,
    /// Repetitions of each measurement (medians and ranges are reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Only the ingest throughput (journal off and on), not the restores.
    #[arg(long)]
    ingest_only: bool,
    /// The journal's growth that makes a snapshot due, in MiB (default: kvr-state's own,
    /// 256); smaller, snapshots are taken during the ingest runs, and cost them what they
    /// cost.
    #[arg(long)]
    snapshot_after_mib: Option<u64>,
    /// Where the state files go (a fresh directory under it per run).
    #[arg(long, default_value_t = std::env::temp_dir().display().to_string())]
    dir: String,
}

const BS: u32 = 16;
const RANKS: u64 = 32;
const PROMPT_BLOCKS: usize = 32;
const HEADS: u32 = 64;

fn partition() -> Arc<Partition> {
    Arc::new(Partition::new(
        PartitionKey::new("bench", "default"),
        PartitionConfig::new(BS),
    ))
}

/// Prompt `i`: one of `HEADS` shared heads (8 blocks), then its own tail.
fn prompt(i: u64) -> Vec<u32> {
    let head = (i % u64::from(HEADS)) as u32;
    let mut t: Vec<u32> = (0..8 * BS).map(|k| head * 1_000_003 + k).collect();
    let own = i as u32;
    t.extend((0..(PROMPT_BLOCKS as u32 - 8) * BS).map(|k| 7_000_000 + own.wrapping_mul(7919) + k));
    t
}

/// The KV-event batches that leave about `blocks` holder-blocks: each rank stores
/// prompts in turn (a batch each), and evicts the tail of its oldest now and then.
fn batches(blocks: u64) -> Vec<(u64, u64, Vec<u8>)> {
    let h = BlockHasher::new(BS as usize, HashSalt::NONE).unwrap();
    let per_rank = blocks / RANKS;
    let mut out = Vec::new();
    let mut local = Vec::new();
    for r in 0..RANKS {
        let mut held = 0u64;
        let mut seq = 0u64;
        let mut i = r * 1_000_000;
        let mut stored: Vec<u64> = Vec::new();
        while held < per_rank {
            let t = prompt(i);
            local.clear();
            h.local_hashes(&t, &mut local);
            let engine: Vec<u64> = local.iter().map(|x| x ^ (r << 56) ^ 0x5eed).collect();
            let mut e = BatchEncoder::new();
            e.stored(&engine, None, &t, BS, Medium::Gpu, None);
            // A shared head is held once per rank: its first prompt counts it.
            held += if i % u64::from(HEADS) == (r * 1_000_000) % u64::from(HEADS)
                && stored.len() < HEADS as usize
            {
                PROMPT_BLOCKS as u64
            } else {
                (PROMPT_BLOCKS - 8) as u64
            };
            stored.push(i);
            if stored.len().is_multiple_of(8) {
                // Evict the last 4 blocks of the oldest prompt still whole.
                let old = stored[stored.len() / 2];
                local.clear();
                h.local_hashes(&prompt(old), &mut local);
                let gone: Vec<u64> = local[PROMPT_BLOCKS - 4..]
                    .iter()
                    .map(|x| x ^ (r << 56) ^ 0x5eed)
                    .collect();
                e.removed(&gone, Medium::Gpu);
                held = held.saturating_sub(4);
            }
            out.push((r + 1, seq, e.finish(seq as f64, None)));
            seq += 1;
            i += 1;
        }
    }
    out
}

fn ingest(p: &Partition, batches: &[(u64, u64, Vec<u8>)]) {
    for (w, seq, b) in batches {
        p.ingest(*w, 0, b"", *seq, b);
    }
}

/// CPU seconds this process has used (user + system, every thread).
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// CPU seconds the calling thread has used.
fn thread_cpu_seconds() -> f64 {
    // SAFETY: clock_gettime writes into the zeroed timespec it is given.
    let mut t: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

fn holder_blocks(p: &Partition) -> u64 {
    p.index().stats().holder_blocks
}

fn median(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn fmt((m, lo, hi): (f64, f64, f64)) -> String {
    format!("{m:.3} s ({lo:.3}–{hi:.3})")
}

/// A state directory written by the journal's writer: a snapshot after 90 % of the
/// batches, the rest in the journal. Returns the directory and the writer's snapshot
/// time (s).
fn kept(root: &Path, mode: IoMode, b: &[(u64, u64, Vec<u8>)]) -> (PathBuf, f64) {
    let p = partition();
    let dir = partition_dir(root, &kvr_state::format::Identity::of(&p));
    let _ = std::fs::remove_dir_all(&dir);
    let log = StateLog::start(
        &p,
        StateConfig::new(&dir),
        Io::new(mode).unwrap(),
        Vec::new(),
        0,
    )
    .unwrap();
    p.attach_applied_log(log.clone() as Arc<dyn AppliedLog>);
    let cut = b.len() * 9 / 10;
    ingest(&p, &b[..cut]);
    let t = Instant::now();
    assert!(log.snapshot_now());
    let snap = t.elapsed().as_secs_f64();
    ingest(&p, &b[cut..]);
    assert!(log.flush());
    let st = log.stats();
    assert_eq!(
        st.events_dropped, 0,
        "the bench must not overrun the writer: {st:?}"
    );
    (dir, snap)
}

fn main() {
    let args = Args::parse();
    let root = PathBuf::from(&args.dir).join(format!("kvr-restart-bench-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    println!("| holder-blocks | way back | time to a whole index | notes |");
    println!("|---|---|---|---|");
    for &n in &args.blocks {
        let b = batches(n);
        let reference = partition();
        let t = Instant::now();
        ingest(&reference, &b);
        let reingest_once = t.elapsed().as_secs_f64();
        let hb = holder_blocks(&reference);
        let want = reference.dump_index();
        let ways: &[(&str, IoMode)] = if args.ingest_only {
            &[]
        } else {
            &[("uring", IoMode::Uring), ("plain", IoMode::Plain)]
        };
        for &(name, mode) in ways {
            let (dir, snap_s) = kept(&root, mode, &b);
            let bytes: u64 = std::fs::read_dir(&dir)
                .unwrap()
                .flatten()
                .map(|e| e.metadata().unwrap().len())
                .sum();
            let mut times = Vec::new();
            for _ in 0..args.reps {
                let q = partition();
                let t = Instant::now();
                let r = restore(&dir, &q);
                times.push(t.elapsed().as_secs_f64());
                assert_eq!(r.stopped, None, "{r:?}");
                assert_eq!(
                    q.dump_index().stores.len(),
                    want.stores.len(),
                    "restored whole"
                );
            }
            println!(
                "| {hb} | snapshot + journal ({name}) | {} | {:.0} MiB on disk; the snapshot took {snap_s:.3} s to write |",
                fmt(median(&mut times)),
                bytes as f64 / (1 << 20) as f64
            );
        }
        if !args.ingest_only {
            // A peer's /dump.
            let mut times = Vec::new();
            let mut body_len = 0;
            for _ in 0..args.reps {
                let t = Instant::now();
                let d = reference.dump_index();
                let mut dump = kvr_service::wire::dump::Dump::new();
                dump.insert(
                    kvr_service::wire::dump::partition_name(reference.key()),
                    kvr_service::wire::dump::partition_dump(BS, &d),
                );
                let body = serde_json::to_vec(&dump).unwrap();
                body_len = body.len();
                let made = t.elapsed().as_secs_f64();
                let t = Instant::now();
                let parsed: kvr_service::wire::dump::Dump = serde_json::from_slice(&body).unwrap();
                let q = partition();
                for part in parsed.values() {
                    for s in kvr_service::wire::dump::stores_of(part).unwrap() {
                        q.apply_events(
                            s.rank,
                            [KvEvent::Stored {
                                tier: s.tier,
                                parent: s.parent,
                                blocks: &s.blocks,
                            }],
                        );
                    }
                }
                times.push(made + t.elapsed().as_secs_f64());
                assert_eq!(holder_blocks(&q), hb - want.skipped_blocks);
            }
            println!(
                "| {hb} | peer /dump (kvr's shape, no network) | {} | {:.0} MiB of JSON, made, parsed and applied |",
                fmt(median(&mut times)),
                body_len as f64 / (1 << 20) as f64
            );
            let mut times = vec![reingest_once];
            for _ in 1..args.reps {
                let q = partition();
                let t = Instant::now();
                ingest(&q, &b);
                times.push(t.elapsed().as_secs_f64());
            }
            println!(
                "| {hb} | re-ingest every batch ({} batches) | {} | what a cold start needs if the engines could replay it all |",
                b.len(),
                fmt(median(&mut times))
            );
        }
        // Ingest throughput: journal off, on through io_uring, on through plain writes,
        // in turn, each `reps` times.
        let kinds: [(&str, Option<IoMode>); 3] = [
            ("off", None),
            ("uring", Some(IoMode::Uring)),
            ("plain", Some(IoMode::Plain)),
        ];
        let mut rates = vec![Vec::new(); 3];
        let mut cpu = vec![Vec::new(); 3];
        let mut own = vec![Vec::new(); 3];
        let mut snaps = vec![Vec::new(); 3];
        let mut journal_mib = vec![Vec::new(); 3];
        for rep in 0..args.reps {
            for k in 0..3 {
                let k = (k + rep) % 3;
                let p = partition();
                let log = kinds[k].1.map(|mode| {
                    let dir = root.join(format!("ingest-{rep}-{k}"));
                    let _ = std::fs::remove_dir_all(&dir);
                    let mut cfg = StateConfig::new(&dir);
                    if let Some(m) = args.snapshot_after_mib {
                        cfg.snapshot_after_bytes = m << 20;
                    }
                    let log =
                        StateLog::start(&p, cfg, Io::new(mode).unwrap(), Vec::new(), 0).unwrap();
                    p.attach_applied_log(log.clone() as Arc<dyn AppliedLog>);
                    log
                });
                let t = Instant::now();
                let c = cpu_seconds();
                let tc = thread_cpu_seconds();
                ingest(&p, &b);
                let s = t.elapsed().as_secs_f64();
                own[k].push((thread_cpu_seconds() - tc) / b.len() as f64 * 1e6);
                if let Some(log) = &log {
                    assert!(log.flush());
                    let st = log.stats();
                    assert_eq!(st.events_dropped, 0, "the writer fell behind: {st:?}");
                    journal_mib[k].push(st.bytes_written as f64 / (1 << 20) as f64);
                }
                rates[k].push(b.len() as f64 / s);
                cpu[k].push((cpu_seconds() - c) / b.len() as f64 * 1e6);
                // No final snapshot: what it costs is not ingest's. A snapshot still
                // running ends here, not in the next measurement.
                if let Some(log) = log {
                    log.stop();
                    // The first snapshot is the empty index's, at start.
                    snaps[k].push(log.stats().snapshots.saturating_sub(1) as f64);
                }
            }
        }
        // Each rep's on/off ratio (the kinds ran one after the other in it).
        let mut ratios: Vec<Vec<f64>> = (0..3)
            .map(|k| (0..args.reps).map(|i| rates[k][i] / rates[0][i]).collect())
            .collect();
        let (off, lo, ho) = median(&mut rates[0]);
        let off_cpu = median(&mut cpu[0]).0;
        let off_own = median(&mut own[0]).0;
        println!(
            "| {hb} | ingest, journal off | {off:.0} batches/s ({lo:.0}–{ho:.0}) | CPU per batch {off_cpu:.2} µs (every thread), {off_own:.2} µs on the ingesting thread |"
        );
        for k in 1..3 {
            let (r, l, h) = median(&mut rates[k]);
            let c = median(&mut cpu[k]).0;
            let o = median(&mut own[k]).0;
            println!(
                "| {hb} | ingest, journal on ({}) | {r:.0} batches/s ({l:.0}–{h:.0}) | {:.3} of off (each rep's ratio: median {:.3}, {:.3}–{:.3}); CPU per batch {c:.2} µs (the writer's and the kernel's I/O threads included), {o:.2} µs on the ingesting thread; {:.0} MiB of journal, {:.0} snapshot(s) begun during the run (median) |",
                kinds[k].0,
                r / off,
                median(&mut ratios[k]).0,
                median(&mut ratios[k]).1,
                median(&mut ratios[k]).2,
                median(&mut journal_mib[k]).0,
                median(&mut snaps[k]).0,
            );
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}
