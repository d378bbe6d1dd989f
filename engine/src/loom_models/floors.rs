//! The load floors (`reservation/floor.rs`): a selection raising a group's floor to the
//! minimum it read races a member's decrement, or a rank joining the group; the floor
//! must end at or below every member's counter (it is what lets a selection skip them).
//!
//! * A decrement that changes no bound still steps `gen`, so a raise that read the word
//!   before it fails its compare-and-swap (negative control `floor_lower_keeps_gen`: the
//!   raise publishes the minimum it read before the decrement).
//! * A raise checks the membership version its snapshot recorded, so one walking a
//!   member list without the joining rank cannot lift the bound the join set to 0
//!   (negative control `floor_raise_ignores_version`).
//! * Two writers decrement one rank's prefill and decode counters at once: each then reads
//!   the other counter with a read-modify-write, so at least one of them computes the
//!   rank's combined figure after both and lowers the combined bound to it (negative
//!   control `floor_combined_reads_with_load`: with plain loads, both can read the other
//!   counter's old value, and the bound stays above the rank's figure).
//!
//! The counters are updated and read with the orderings `reservation` uses (`Relaxed`
//! increments, [`COUNTER_RMW`] decrements, then the floor's `AcqRel` lower; `Relaxed`
//! reads after the floor's `Acquire` load).

use super::{model, must_fail};
use crate::reservation::floor::{
    combined_after, FloorKind, FloorMix, LoadFloor, COUNTER_RMW, FLOOR_WORDS, MIXES,
};
use crate::reservation::ActiveLoad;
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::faults::Faults;
use crate::sync::Arc;

const NEEDLE: &str = "floor above a member's counter";

/// The three counters' minimums (the combined figures at 0).
fn mins(p: u64, d: u64, r: u64) -> [u64; FLOOR_WORDS] {
    let mut m = [0; FLOOR_WORDS];
    m[..3].copy_from_slice(&[p, d, r]);
    m
}

fn bound(f: &LoadFloor) -> u64 {
    f.read().bound(FloorKind::PrefillTokens)
}

/// Members a (10) and b (1), the floor at 1. One thread raises b to 10 and then lowers a
/// to 3; the other reads the floor, both counters, and raises to their minimum.
fn lower_races_raise() {
    let a = Arc::new(AtomicU64::new(10));
    let b = Arc::new(AtomicU64::new(1));
    let floor = Arc::new(LoadFloor::default());
    let start = floor.read();
    floor.raise(start, start.version_of_words(), mins(1, 0, 0));
    let (a2, b2, f2) = (a.clone(), b.clone(), floor.clone());
    let writer = loom::thread::spawn(move || {
        b2.fetch_add(9, Ordering::Relaxed);
        let left = a2.fetch_sub(7, COUNTER_RMW) - 7;
        f2.lower(FloorKind::PrefillTokens, left);
    });
    let seen = floor.read();
    let m = a.load(Ordering::Relaxed).min(b.load(Ordering::Relaxed));
    floor.raise(seen, start.version_of_words(), mins(m, 0, 0));
    writer.join().unwrap();
    let least = a.load(Ordering::Relaxed).min(b.load(Ordering::Relaxed));
    assert!(
        bound(&floor) <= least,
        "{NEEDLE}: {} > {least}",
        bound(&floor)
    );
}

/// Member a (5), the floor at 2 (slack: a rose since). A rank joins (its counters 0)
/// while a selection whose snapshot lists only a reads the floor and a, and raises.
fn join_races_raise() {
    let a = Arc::new(AtomicU64::new(5));
    let floor = Arc::new(LoadFloor::default());
    let start = floor.read();
    let old_members = start.version_of_words();
    floor.raise(start, old_members, mins(2, 0, 0));
    let (a2, f2) = (a.clone(), floor.clone());
    let raiser = loom::thread::spawn(move || {
        let seen = f2.read();
        let m = a2.load(Ordering::Relaxed);
        f2.raise(seen, old_members, mins(m, 0, 0));
    });
    floor.join();
    raiser.join().unwrap();
    // The new member's counter is 0.
    assert!(bound(&floor) == 0, "{NEEDLE}: {} > 0", bound(&floor));
}

/// One rank at prefill 5, decode 5, the combined bound at its figure. One writer frees 3
/// prefill tokens, the other 4 decode blocks, each as `Inner::sub_rank` does: an `AcqRel`
/// decrement, the other counter read by `combined_after`, the combined bound lowered.
fn combined_decrements_race() {
    let mix = FloorMix::around(1.0);
    let p = Arc::new(AtomicU64::new(5));
    let d = Arc::new(AtomicU64::new(5));
    let floor = Arc::new(LoadFloor::default());
    let start = floor.read();
    let at_start = mix.figures(ActiveLoad {
        active_prefill_tokens: 5,
        active_decode_blocks: 5,
        active_requests: 0,
    });
    floor.raise(start, start.version_of_words(), at_start);
    let writer = |mine: Arc<AtomicU64>, other: Arc<AtomicU64>, kind, n| {
        let floor = floor.clone();
        move || {
            let left = mine.fetch_sub(n, COUNTER_RMW) - n;
            floor.lower(kind, left);
            floor.lower_combined(combined_after(mix, kind, left, &other));
        }
    };
    let prefill = loom::thread::spawn(writer(p.clone(), d.clone(), FloorKind::PrefillTokens, 3));
    writer(d.clone(), p.clone(), FloorKind::DecodeBlocks, 4)();
    prefill.join().unwrap();
    let figures = mix.of(p.load(Ordering::Relaxed), d.load(Ordering::Relaxed));
    let r = floor.read();
    for (k, figure) in figures.into_iter().enumerate().take(MIXES) {
        let combined = r.combined(k);
        assert!(
            combined <= figure,
            "{NEEDLE}: combined {combined} > {figure}"
        );
    }
}

#[test]
fn floor_combined_decrements_race() {
    model(combined_decrements_race);
}

#[test]
fn floor_combined_decrements_race_negative_reads_with_load() {
    must_fail(
        "loom_models::floors::floor_combined_decrements_race_negative_reads_with_load",
        Faults {
            floor_combined_reads_with_load: true,
            ..Faults::default()
        },
        NEEDLE,
        combined_decrements_race,
    );
}

#[test]
fn floor_lower_races_raise() {
    model(lower_races_raise);
}

#[test]
fn floor_lower_races_raise_negative_keeps_gen() {
    must_fail(
        "loom_models::floors::floor_lower_races_raise_negative_keeps_gen",
        Faults {
            floor_lower_keeps_gen: true,
            ..Faults::default()
        },
        NEEDLE,
        lower_races_raise,
    );
}

#[test]
fn floor_join_races_raise() {
    model(join_races_raise);
}

#[test]
fn floor_join_races_raise_negative_ignores_version() {
    must_fail(
        "loom_models::floors::floor_join_races_raise_negative_ignores_version",
        Faults {
            floor_raise_ignores_version: true,
            ..Faults::default()
        },
        NEEDLE,
        join_races_raise,
    );
}
