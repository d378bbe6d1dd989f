//! Replays every committed fuzz input on stable: each file of `fuzz/seeds/<target>/` and
//! `fuzz/regressions/<target>/` (kept crashers, fixed since) through the target's logic in
//! `kvr_fuzz::<target>::run`, which panics on a finding.
//!
//! Run: `cargo test --manifest-path fuzz/Cargo.toml` (from the repository root).

use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// The files of `fuzz/<sub>/<target>/` (not `.gitkeep`), sorted by name; empty if the
/// directory does not exist.
fn inputs(sub: &str, target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = fuzz_dir().join(sub).join(target);
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<_> = rd
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| n != ".gitkeep"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    out.sort();
    out
}

/// Runs every seed and regression of `target`; returns how many seeds there were.
fn replay(target: &str, run: fn(&[u8])) -> usize {
    let seeds = inputs("seeds", target);
    for (sub, files) in [
        ("seeds", &seeds),
        ("regressions", &inputs("regressions", target)),
    ] {
        for (name, bytes) in files {
            eprintln!("{target}: {sub}/{name} ({} bytes)", bytes.len());
            run(bytes);
        }
    }
    seeds.len()
}

/// Every target with a directory under `fuzz/seeds/` or `fuzz/regressions/` must be one
/// this test knows (so a new target's inputs are not silently skipped).
#[test]
fn every_target_is_replayed() {
    let known = [
        "decode",
        "ingest_frames",
        "event_sequence",
        "recovery",
        "service_bodies",
        "ext_proc",
        "replica_wire",
    ];
    for sub in ["seeds", "regressions"] {
        for e in std::fs::read_dir(fuzz_dir().join(sub)).unwrap() {
            let e = e.unwrap();
            if e.path().is_dir() {
                let name = e.file_name().to_string_lossy().into_owned();
                assert!(
                    known.contains(&name.as_str()),
                    "fuzz/{sub}/{name}: no replay for it"
                );
            }
        }
    }
    for src in std::fs::read_dir(fuzz_dir().join("fuzz_targets")).unwrap() {
        let p = src.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        assert!(
            known.contains(&name.as_str()),
            "fuzz target {name}: no replay for it"
        );
    }
}

#[test]
fn replay_decode() {
    assert!(replay("decode", kvr_fuzz::decode::run) >= 10);
}

#[test]
fn replay_ingest_frames() {
    assert!(replay("ingest_frames", kvr_fuzz::ingest_frames::run) >= 3);
}

#[test]
fn replay_event_sequence() {
    assert!(replay("event_sequence", kvr_fuzz::event_sequence::run) >= 3);
}

#[test]
fn replay_recovery() {
    assert!(replay("recovery", kvr_fuzz::recovery::run) >= 3);
}

#[test]
fn replay_service_bodies() {
    assert!(replay("service_bodies", kvr_fuzz::service_bodies::run) >= 11);
}

#[test]
fn replay_replica_wire() {
    assert!(replay("replica_wire", kvr_fuzz::replica_wire::run) >= 4);
}

#[test]
fn replay_ext_proc() {
    assert!(replay("ext_proc", kvr_fuzz::ext_proc::run) >= 4);
}

/// The committed seeds of the differential targets, together, exercise every path their
/// summaries count (so a change of the input format that leaves them shallow is caught).
#[test]
fn seeds_cover_every_path() {
    let mut f = kvr_fuzz::ingest_frames::Summary::default();
    for (_, bytes) in inputs("seeds", "ingest_frames") {
        f.add(&kvr_fuzz::ingest_frames::run_summary(&bytes));
    }
    for (name, n) in f.fields() {
        assert!(n > 0, "ingest_frames seeds never exercise {name}: {f:?}");
    }
    let mut e = kvr_fuzz::event_sequence::Summary::default();
    for (_, bytes) in inputs("seeds", "event_sequence") {
        e.add(&kvr_fuzz::event_sequence::run_summary(&bytes));
    }
    for (name, n) in e.fields() {
        assert!(n > 0, "event_sequence seeds never exercise {name}: {e:?}");
    }
    let mut x = kvr_fuzz::ext_proc::Summary::default();
    for (_, bytes) in inputs("seeds", "ext_proc") {
        x.add(&kvr_fuzz::ext_proc::run_summary(&bytes));
    }
    for (name, n) in x.fields() {
        assert!(n > 0, "ext_proc seeds never exercise {name}: {x:?}");
    }
    let mut r = kvr_fuzz::recovery::Summary::default();
    for (_, bytes) in inputs("seeds", "recovery") {
        r.add(&kvr_fuzz::recovery::run_summary(&bytes));
    }
    for (name, n) in r.fields() {
        assert!(n > 0, "recovery seeds never exercise {name}: {r:?}");
    }
}

/// The inputs' truncations are their nearest neighbours: every prefix of every seed runs
/// too (the targets read their input front to back, so a prefix is a shorter run).
#[test]
fn replay_prefixes() {
    for (target, run) in [
        ("ingest_frames", kvr_fuzz::ingest_frames::run as fn(&[u8])),
        ("event_sequence", kvr_fuzz::event_sequence::run),
        ("recovery", kvr_fuzz::recovery::run),
        ("ext_proc", kvr_fuzz::ext_proc::run),
    ] {
        for (_, bytes) in inputs("seeds", target) {
            let step = (bytes.len() / 16).max(1);
            for cut in (0..bytes.len()).step_by(step) {
                run(&bytes[..cut]);
            }
        }
    }
}
