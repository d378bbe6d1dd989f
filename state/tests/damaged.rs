//! A state directory damaged every way the documentation lists, and a disk that fills:
//! each gives its documented outcome — a refused snapshot starts empty, a damaged or
//! foreign journal segment stops the restore there (what came before is kept), a missing
//! segment the same — with the refused file and its reason reported (the service counts
//! them, `kvr_state_refused_files`), and never an index holding anything its streams did
//! not send. A full disk fails writes (counted), never the partition.
// A test outside the engine: its sync facade is not a test's.
#![allow(clippy::disallowed_types)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{TempDir, Tmpfs};
use kvr::config::PartitionConfig;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::ingress::Medium;
use kvr::{AppliedLog, Partition, PartitionKey, RankId};
use kvr_emulator::BatchEncoder;
use kvr_state::frame::put_frame;
use kvr_state::{restore, Io, IoMode, Restored, StateConfig, StateLog};

const BS: u32 = 4;

fn partition(model: &str) -> Arc<Partition> {
    Arc::new(Partition::new(
        PartitionKey::new(model, "g"),
        PartitionConfig::new(BS),
    ))
}

fn locals(tokens: &[u32]) -> Vec<u64> {
    let h = BlockHasher::new(BS as usize, HashSalt::NONE).unwrap();
    let mut l = Vec::new();
    h.local_hashes(tokens, &mut l);
    l
}

fn prompt(i: u64) -> Vec<u32> {
    (0..16).map(|k| i as u32 * 100 + k).collect()
}

/// Batch `seq`: stores prompt `seq`, and from 3 on evicts prompt `seq - 3`'s tail.
fn batch(seq: u64) -> Vec<u8> {
    let t = prompt(seq);
    let mut e = BatchEncoder::new();
    e.stored(&locals(&t), None, &t, BS, Medium::Gpu, None);
    if seq >= 3 {
        e.removed(&locals(&prompt(seq - 3))[2..], Medium::Gpu);
    }
    e.finish(seq as f64, None)
}

fn answers(p: &Partition, n: u64) -> Vec<u32> {
    (0..n)
        .map(|i| {
            p.index()
                .find_matches_tiered(&locals(&prompt(i)))
                .get(RankId::new(1, 0))
                .map_or(0, |o| o.device)
        })
        .collect()
}

/// The answers after batches 0..k, for every k (0: nothing).
fn prefixes(n: u64) -> Vec<Vec<u32>> {
    let c = partition("m");
    let mut v = vec![answers(&c, n)];
    for s in 0..n {
        c.ingest(1, 0, b"", s, &batch(s));
        v.push(answers(&c, n));
    }
    v
}

fn io() -> Io {
    Io::new(IoMode::from_env_or(IoMode::Auto).unwrap()).unwrap()
}

/// A state directory: a snapshot after batch 5, then batches 6..12 in the journal.
fn made(root: &Path) -> PathBuf {
    let dir = root.join("made");
    let p = partition("m");
    let log = StateLog::start(&p, StateConfig::new(&dir), io(), Vec::new(), 0).unwrap();
    p.attach_applied_log(log.clone() as Arc<dyn AppliedLog>);
    for s in 0..12 {
        p.ingest(1, 0, b"", s, &batch(s));
        if s == 5 {
            assert!(log.snapshot_now());
        }
    }
    assert!(log.flush());
    dir
}

fn copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn file(dir: &Path, prefix: &str) -> PathBuf {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
        .collect();
    v.sort();
    v.pop().unwrap_or_else(|| panic!("no {prefix} file"))
}

/// The header frame's payload rewritten by `patch` (checksum made right again).
fn rewrite_header(bytes: &[u8], patch: &dyn Fn(&mut Vec<u8>)) -> Vec<u8> {
    let len = u32::from_le_bytes(bytes[0..4].try_into().unwrap()) as usize;
    let mut head = bytes[8..8 + len].to_vec();
    patch(&mut head);
    let mut out = Vec::new();
    put_frame(&mut out, &head);
    out.extend_from_slice(&bytes[8 + len..]);
    out
}

/// Restores a damaged copy of `dir`: what the restore said, and the index's answers.
fn damaged(root: &Path, dir: &Path, name: &str, harm: &dyn Fn(&Path)) -> (Restored, Vec<u32>) {
    let d = root.join(name);
    copy(dir, &d);
    harm(&d);
    let q = partition("m");
    let r = restore(&d, &q);
    (r, answers(&q, 12))
}

#[test]
fn every_damage_gives_its_documented_outcome() {
    let tmp = TempDir::new("damaged");
    let dir = made(tmp.path());
    let truth = prefixes(12);
    let whole = {
        let q = partition("m");
        let r = restore(&dir, &q);
        assert_eq!((r.refused_files.len(), r.stopped.clone()), (0, None));
        answers(&q, 12)
    };
    assert_eq!(&whole, truth.last().unwrap(), "the undamaged directory");
    let snapshot = |d: &Path| file(d, "snapshot");
    let journal = |d: &Path| file(d, "journal");
    let flip = |p: PathBuf, at: usize| {
        let mut b = std::fs::read(&p).unwrap();
        let i = at.min(b.len() - 1);
        b[i] ^= 0x10;
        std::fs::write(p, b).unwrap();
    };
    let cut = |p: PathBuf, by: u64| {
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        let len = f.metadata().unwrap().len();
        f.set_len(len.saturating_sub(by)).unwrap();
    };
    let other_partition = |p: PathBuf| {
        let b = std::fs::read(&p).unwrap();
        // The model's name is right after the magic, version and kind: "m" becomes "n".
        let b = rewrite_header(&b, &|h| {
            let at = 8 + 2 + 1 + 2;
            assert_eq!(h[at], b'm');
            h[at] = b'n';
        });
        std::fs::write(p, b).unwrap();
    };
    // (name, damage, the refused file's reason, whether the snapshot's state is kept)
    type Harm = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, Harm, Option<&str>, bool)> = vec![
        (
            "snapshot empty",
            Box::new(move |d| std::fs::write(snapshot(d), b"").unwrap()),
            Some("empty"),
            false,
        ),
        (
            "snapshot truncated",
            Box::new(move |d| cut(snapshot(d), 9)),
            Some("truncated"),
            false,
        ),
        (
            "snapshot bit flip",
            Box::new(move |d| flip(snapshot(d), 200)),
            Some(""),
            false,
        ),
        (
            "snapshot another version",
            Box::new(move |d| {
                let p = snapshot(d);
                let b = rewrite_header(&std::fs::read(&p).unwrap(), &|h| {
                    h[8..10].copy_from_slice(&9u16.to_le_bytes())
                });
                std::fs::write(p, b).unwrap();
            }),
            Some("version"),
            false,
        ),
        (
            "snapshot another partition",
            Box::new(move |d| other_partition(snapshot(d))),
            Some("other_partition"),
            false,
        ),
        (
            "snapshot not kvr",
            Box::new(move |d| std::fs::write(snapshot(d), b"{\"not\": \"ours\"}").unwrap()),
            Some("not_kvr"),
            false,
        ),
        (
            "journal truncated",
            Box::new(move |d| cut(journal(d), 5)),
            None,
            true,
        ),
        (
            "journal bit flip",
            Box::new(move |d| flip(journal(d), 300)),
            None,
            true,
        ),
        (
            "journal empty",
            Box::new(move |d| std::fs::write(journal(d), b"").unwrap()),
            Some("empty"),
            true,
        ),
        (
            "journal another partition",
            Box::new(move |d| other_partition(journal(d))),
            Some("other_partition"),
            true,
        ),
        (
            "journal another version",
            Box::new(move |d| {
                let p = journal(d);
                let b = rewrite_header(&std::fs::read(&p).unwrap(), &|h| {
                    h[8..10].copy_from_slice(&9u16.to_le_bytes())
                });
                std::fs::write(p, b).unwrap();
            }),
            Some("version"),
            true,
        ),
    ];
    for (name, harm, reason, kept) in cases {
        let (r, got) = damaged(tmp.path(), &dir, &name.replace(' ', "-"), &*harm);
        match reason {
            Some(why) => {
                assert_eq!(r.refused_files.len(), 1, "{name}: one file refused: {r:?}");
                assert!(r.refused_files[0].1.starts_with(why), "{name}: {r:?}");
            }
            None => assert!(r.refused_files.is_empty(), "{name}: {r:?}"),
        }
        assert!(
            r.stopped.is_some(),
            "{name}: the restore says where it stopped: {r:?}"
        );
        if kept {
            // The snapshot (after batch 5) and what of the journal reads.
            let k = truth.iter().position(|t| *t == got);
            assert!(
                k.is_some_and(|k| (6..12).contains(&k)),
                "{name}: {got:?}, {r:?}"
            );
        } else {
            assert_eq!(
                got, truth[0],
                "{name}: a refused snapshot starts empty: {r:?}"
            );
            assert!(r.streams.is_empty(), "{name}: no stream resumes: {r:?}");
        }
    }
    // A missing segment: the restore stops before it, the snapshot's state kept.
    let (r, got) = damaged(tmp.path(), &dir, "gap", &|d| {
        let j = journal(d);
        let n: u64 = j.file_name().unwrap().to_string_lossy()["journal-".len()..]
            .trim_end_matches(".kvr")
            .parse()
            .unwrap();
        std::fs::rename(&j, d.join(format!("journal-{}.kvr", n + 1))).unwrap();
    });
    assert!(
        r.stopped.as_deref().is_some_and(|s| s.contains("missing")),
        "{r:?}"
    );
    assert_eq!(got, truth[6], "the snapshot's state only");
}

#[test]
fn a_full_disk_fails_writes_not_the_partition_and_what_is_on_it_restores() {
    let fs = match Tmpfs::mount("full", "size=64k") {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let dir = fs.path().join("p");
    let p = partition("m");
    let mut cfg = StateConfig::new(&dir);
    // No snapshot is due before the disk is full: the journal fills it.
    cfg.snapshot_after_bytes = 1 << 30;
    let log = StateLog::start(&p, cfg, io(), Vec::new(), 0).unwrap();
    p.attach_applied_log(log.clone() as Arc<dyn AppliedLog>);
    let n = 1200u64;
    for s in 0..n {
        p.ingest(1, 0, b"", s, &batch(s));
        if s % 20 == 0 {
            log.flush();
        }
    }
    log.flush();
    let st = log.stats();
    assert!(
        st.write_failures + st.snapshot_failures > 0,
        "64 KiB never filled: {st:?}"
    );
    // The partition kept applying and answering.
    let c = partition("m");
    for s in 0..n {
        c.ingest(1, 0, b"", s, &batch(s));
    }
    assert_eq!(answers(&p, n), answers(&c, n));
    // What is on the disk restores a true prefix of the stream (or nothing).
    let q = partition("m");
    let r = restore(&dir, &q);
    let got = answers(&q, n);
    let c = partition("m");
    let mut found = got == answers(&c, n);
    for s in 0..n {
        c.ingest(1, 0, b"", s, &batch(s));
        found |= got == answers(&c, n);
    }
    assert!(found, "not a prefix of the stream: {r:?}, {st:?}");
    log.close();
}

#[test]
fn a_directory_that_cannot_be_created_is_an_error_at_start() {
    let tmp = TempDir::new("unwritable");
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let p = partition("m");
    let e = StateLog::start(&p, StateConfig::new(file.join("p")), io(), Vec::new(), 0)
        .expect_err("a directory under a regular file");
    assert_eq!(e.kind(), std::io::ErrorKind::NotADirectory, "{e}");
    // Nothing to restore there either: an empty restore, not a panic.
    let r = restore(&file.join("p"), &p);
    assert_eq!((r.snapshot, r.records), (None, 0));
}
