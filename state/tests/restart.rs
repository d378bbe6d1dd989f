//! A partition's state written by the journal's writer and read back at a restart: after a
//! graceful close (the final snapshot), after a crash (the journal since the snapshot), a
//! torn journal (a true prefix, with where each stream was), and a writer that dropped
//! events (its gap is not read; the snapshot after it is).
// A test outside the engine: its sync facade is not a test's.
#![allow(clippy::disallowed_types)]

use std::path::Path;
use std::sync::Arc;

use kvr::config::PartitionConfig;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::ingress::Medium;
use kvr::{AppliedLog, KvEvent, Partition, PartitionKey, RankId, StoredBlock, Tier};
use kvr_emulator::BatchEncoder;
use kvr_state::{restore, Io, IoMode, StateConfig, StateLog};

const BS: u32 = 4;

fn partition() -> Arc<Partition> {
    Arc::new(Partition::new(
        PartitionKey::new("m", "g"),
        PartitionConfig::new(BS),
    ))
}

fn prompt(i: u64) -> Vec<u32> {
    // Shared heads (i % 3), own tails.
    let mut t: Vec<u32> = (0..8).map(|k| (i % 3) as u32 * 100 + k).collect();
    t.extend((0..8).map(|k| 10_000 + i as u32 * 16 + k));
    t
}

fn locals(tokens: &[u32]) -> Vec<u64> {
    let h = BlockHasher::new(BS as usize, HashSalt::NONE).unwrap();
    let mut l = Vec::new();
    h.local_hashes(tokens, &mut l);
    l
}

/// Batch `seq` of worker `w`'s stream: stores prompt `seq` (engine hashes = local ^ w),
/// and from seq 4 on removes the tail of prompt `seq - 4`.
fn batch(w: u64, seq: u64) -> Vec<u8> {
    let t = prompt(seq);
    let l = locals(&t);
    let eh: Vec<u64> = l.iter().map(|h| h ^ w).collect();
    let mut e = BatchEncoder::new();
    e.stored(&eh, None, &t, BS, Medium::Gpu, None);
    if seq >= 4 {
        let old = locals(&prompt(seq - 4));
        e.removed(&[old[3] ^ w], Medium::Gpu);
    }
    e.finish(seq as f64, None)
}

/// Every prompt's device overlap per rank.
fn answers(p: &Partition, n: u64) -> Vec<Vec<(RankId, u32)>> {
    (0..n)
        .map(|i| {
            let l = locals(&prompt(i));
            let mut v: Vec<(RankId, u32)> = p
                .index()
                .find_matches_tiered(&l)
                .iter()
                .map(|o| (o.rank, o.device))
                .collect();
            v.sort();
            v
        })
        .collect()
}

fn start(p: &Arc<Partition>, dir: &Path, cfg: impl FnOnce(&mut StateConfig)) -> Arc<StateLog> {
    let r = restore(dir, p);
    let mut c = StateConfig::new(dir);
    cfg(&mut c);
    let log = StateLog::start(p, c, Io::new(mode()).unwrap(), r.streams, r.next_segment).unwrap();
    assert!(p.attach_applied_log(log.clone() as Arc<dyn AppliedLog>));
    log
}

/// Both I/O paths: `KVR_STATE_IO` picks one (CI runs the tests with each).
fn mode() -> IoMode {
    IoMode::from_env_or(IoMode::Auto).unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn feed(p: &Partition, seqs: std::ops::Range<u64>) {
    for s in seqs {
        for w in [1u64, 2] {
            p.ingest(w, 0, b"", s, &batch(w, s));
        }
    }
}

fn direct(p: &Partition) {
    let l = locals(&prompt(50));
    let blocks: Vec<StoredBlock> = l
        .iter()
        .map(|&h| StoredBlock {
            external_hash: h ^ 9,
            local_hash: h,
        })
        .collect();
    p.apply_events(
        RankId::new(9, 0),
        [KvEvent::Stored {
            tier: Tier::Device,
            parent: None,
            blocks: &blocks,
        }],
    );
}

#[test]
fn a_graceful_restart_and_a_crash_both_come_back_with_the_same_index() {
    let tmp = tempdir("restart");
    let dir = tmp.join("p");
    let p = partition();
    let log = start(&p, &dir, |_| {});
    feed(&p, 0..10);
    direct(&p);
    assert!(log.snapshot_now());
    // Past the snapshot: only in the journal.
    feed(&p, 10..16);
    // Worker 2 loses batches (no replay): its rank is cleared, then batch 20 applies.
    p.ingest(2, 0, b"", 20, &batch(2, 20));
    assert!(log.flush());
    let crash = tmp.join("crash");
    copy_dir(&dir, &crash);
    let want = answers(&p, 60);
    assert!(want.iter().filter(|a| !a.is_empty()).count() > 10);

    // A crash: the snapshot and the journal after it.
    let q = partition();
    let r = restore(&crash, &q);
    assert_eq!(r.stopped, None, "{r:?}");
    assert!(r.snapshot.is_some() && r.records > 0, "{r:?}");
    assert_eq!(answers(&q, 60), want);
    let w1 = r
        .streams
        .iter()
        .find(|m| m.worker_id == 1)
        .expect("worker 1's place");
    assert_eq!(
        (w1.stream, w1.last.map(|l| l.0), w1.dp_ranks.clone()),
        (0, Some(15), vec![0])
    );
    // The stream goes on from there: batch 16 applies, nothing is cleared.
    q.ingest(1, 0, b"", 16, &batch(1, 16));
    p.ingest(1, 0, b"", 16, &batch(1, 16));
    assert_eq!(answers(&q, 60), answers(&p, 60));

    // Negative control: without the journal, the crash copy loses what followed.
    let journal_less = tmp.join("journal-less");
    copy_dir(&crash, &journal_less);
    for e in std::fs::read_dir(&journal_less).unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("journal") {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    let z = partition();
    restore(&journal_less, &z);
    assert_ne!(answers(&z, 60), want);

    // A graceful close: a final snapshot, nothing to replay.
    log.close();
    let g = partition();
    let r = restore(&dir, &g);
    assert_eq!((r.records, r.stopped.clone()), (0, None), "{r:?}");
    assert_eq!(answers(&g, 60), answers(&p, 60));
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn a_torn_journal_restores_a_true_prefix_with_its_streams_places() {
    let tmp = tempdir("torn");
    let dir = tmp.join("p");
    let p = partition();
    let log = start(&p, &dir, |_| {});
    for s in 0..12 {
        p.ingest(1, 0, b"", s, &batch(1, s));
        assert!(log.flush(), "one append per batch");
    }
    let seg = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("journal")
        })
        .unwrap();
    let len = std::fs::metadata(&seg).unwrap().len();
    let mut seen = std::collections::HashSet::new();
    for cut in (0..len).step_by(7) {
        let d = tmp.join(format!("cut{cut}"));
        copy_dir(&dir, &d);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.join(seg.file_name().unwrap()))
            .unwrap();
        f.set_len(cut).unwrap();
        let q = partition();
        let r = restore(&d, &q);
        // What it holds is the stream's first batches applied, at least through its
        // resume point: the snapshot may have been taken a little after the segment it
        // heads began (batches in both), and replay from the resume point goes on
        // from there; never anything the stream did not send.
        let upto = r
            .streams
            .iter()
            .find(|m| m.worker_id == 1)
            .and_then(|m| m.last.map(|l| l.0));
        let got = answers(&q, 20);
        let c = partition();
        let mut prefixes = vec![answers(&c, 20)];
        for s in 0..12 {
            c.ingest(1, 0, b"", s, &batch(1, s));
            prefixes.push(answers(&c, 20));
        }
        let from = upto.map_or(0, |m| m as usize + 1);
        assert!(
            prefixes[from..].contains(&got),
            "cut at {cut}: not batches 0..k for any k >= the resume point: {r:?}"
        );
        seen.insert(upto);
        let _ = std::fs::remove_dir_all(&d);
    }
    assert!(seen.len() > 5, "cuts fall in many records: {seen:?}");
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn a_writer_that_drops_events_records_the_gap_and_its_snapshot_covers_it() {
    let tmp = tempdir("gap");
    let dir = tmp.join("p");
    let p = partition();
    let log = start(&p, &dir, |c| c.queue_messages = 1);
    feed(&p, 0..40);
    assert!(log.snapshot_now());
    let st = log.stats();
    assert!(
        st.events_dropped > 0,
        "a queue of one must drop in a burst: {st:?}"
    );
    assert!(st.snapshots >= 2, "{st:?}");
    let q = partition();
    let r = restore(&dir, &q);
    assert_eq!(answers(&q, 60), answers(&p, 60), "{r:?}");
    let _ = std::fs::remove_dir_all(&tmp);
}

fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvr-state-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_snapshot_keeps_blocks_whose_parent_is_gone_for_when_it_comes_back() {
    // Prompts sharing a head; the head is evicted with one prompt's tail (the other
    // prompt's tail stays, under a parent the rank no longer holds), the snapshot is
    // taken then, and the head is stored again by a third prompt: the second prompt's
    // tail counts again, after a restart as before it.
    let tmp = tempdir("holes");
    let dir = tmp.join("p");
    let p = partition();
    let log = start(&p, &dir, |_| {});
    let head: Vec<u32> = (0..8).collect();
    let with_tail = |t: u32| {
        let mut v = head.clone();
        v.extend((0..8).map(|k| 1000 * t + k));
        v
    };
    let store = |seq: u64, tokens: &[u32]| {
        let l = locals(tokens);
        let mut e = BatchEncoder::new();
        e.stored(&l, None, tokens, BS, Medium::Gpu, None);
        p.ingest(1, 0, b"", seq, &e.finish(seq as f64, None));
    };
    let probe = |q: &Partition| -> Vec<u32> {
        (1..=3)
            .map(|t| {
                q.index()
                    .find_matches_tiered(&locals(&with_tail(t)))
                    .get(RankId::new(1, 0))
                    .map_or(0, |o| o.device)
            })
            .collect()
    };
    store(0, &with_tail(1));
    store(1, &with_tail(2));
    let mut e = BatchEncoder::new();
    e.removed(&locals(&with_tail(1)), Medium::Gpu);
    p.ingest(1, 0, b"", 2, &e.finish(2.0, None));
    assert!(log.snapshot_now());
    store(3, &with_tail(3));
    assert!(log.flush());
    assert_eq!(probe(&p), vec![2, 4, 4]);
    let q = partition();
    let r = restore(&dir, &q);
    assert_eq!(probe(&q), vec![2, 4, 4], "{r:?}");
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn a_snapshot_waits_for_the_journal_to_outgrow_the_last_one() {
    // Due after every byte of journal: the growth relative to the last snapshot decides
    // (none at all: a snapshot after nearly every write, the negative control).
    for (percent, expect_more) in [(0, true), (1_000_000, false)] {
        let tmp = tempdir(&format!("growth-{percent}"));
        let dir = tmp.join("p");
        let p = partition();
        let log = start(&p, &dir, |c| {
            c.snapshot_after_bytes = 1;
            c.snapshot_growth_percent = percent;
        });
        assert!(log.snapshot_now());
        let before = log.stats().snapshots;
        for s in 0..20 {
            feed(&p, s..s + 1);
            assert!(log.flush());
        }
        log.stop();
        let st = log.stats();
        let more = st.snapshots - before;
        if expect_more {
            assert!(more >= 2, "{percent} %: {st:?}");
        } else {
            assert_eq!(more, 0, "{percent} %: {st:?}");
        }
        // Either way the restart gets everything back.
        let q = partition();
        let r = restore(&dir, &q);
        assert_eq!(answers(&q, 30), answers(&p, 30), "{r:?}");
        let _ = std::fs::remove_dir_all(&tmp);
    }
}
