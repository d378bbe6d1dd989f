//! Loom models of the run index's protocols (`index::runs`), each with a negative control:
//! a new state published over a grown local-hash array, a new run linked into the branch
//! table (a fresh key, or a dead key revived), and a run unlinked and retired while a
//! reader walks it (with `find_matches`, and with the tiered query selection uses).

use super::{churn_epoch, in_child, model, model_reclaiming, must_fail, note_reclaimed};
use crate::ids::{RankId, Tier};
use crate::index::Index as RunIndex;
use crate::index::StoredBlock;
use crate::sync::faults::{self, Faults};
use crate::sync::Arc;

fn rank(w: u64) -> RankId {
    RankId::new(w, 0)
}

fn blocks(locals: &[u64]) -> Vec<StoredBlock> {
    locals
        .iter()
        .map(|&l| StoredBlock {
            external_hash: l + 1000,
            local_hash: l,
        })
        .collect()
}

fn tiny() -> Arc<RunIndex> {
    Arc::new(RunIndex::with_branch_shards(1, 8))
}

/// Runs a model's set-up (before any thread is spawned) with no fault injected, so a
/// negative control weakens only the step under test.
fn set_up<T>(f: impl FnOnce() -> T) -> T {
    let fault = faults::get();
    faults::set(Faults::default());
    let r = f();
    faults::set(fault);
    r
}

/// Rank 1 extends its run past the array's capacity (a new array, a new state) while a
/// reader looks the chain up: it sees the old state (2 blocks) or the new one (3), whole.
fn append_grows_and_publishes() {
    let idx = set_up(|| {
        let idx = tiny();
        idx.store(rank(1), Tier::Device, None, &blocks(&[1, 2]))
            .unwrap();
        idx
    });
    let w = idx.clone();
    let writer = loom::thread::spawn(move || {
        w.store(rank(1), Tier::Device, Some(1002), &blocks(&[3]))
            .unwrap();
        churn_epoch();
    });
    let got = idx.find_matches(&[1, 2, 3]).get(rank(1));
    assert!(got == 2 || got == 3, "torn run state: {got}");
    writer.join().unwrap();
    assert_eq!(idx.find_matches(&[1, 2, 3]).get(rank(1)), 3);
}

#[test]
fn run_state_publication() {
    in_child("loom_models::runs::run_state_publication", || {
        model(append_grows_and_publishes)
    });
}

#[test]
fn run_state_publication_negative_relaxed_state() {
    must_fail(
        "loom_models::runs::run_state_publication_negative_relaxed_state",
        Faults {
            relaxed_run_state: true,
            ..Faults::default()
        },
        "Causality violation",
        append_grows_and_publishes,
    );
}

/// The same growth, checked for reclamation: the outgrown array goes once readers are
/// done, never before. (Leaner than the publication model: each extra step widens the
/// search, and loom 0.7's store history then trips its own assertion, tokio-rs/loom#252.)
fn append_reclaims_outgrown_array() {
    let frees = faults::frees();
    let idx = tiny();
    idx.store(rank(1), Tier::Device, None, &blocks(&[1, 2]))
        .unwrap();
    let w = idx.clone();
    let writer = loom::thread::spawn(move || {
        w.store(rank(1), Tier::Device, Some(1002), &blocks(&[3]))
            .unwrap();
    });
    let got = idx.find_matches(&[1, 2, 3]).get(rank(1));
    assert!(got == 2 || got == 3, "torn run state: {got}");
    writer.join().unwrap();
    note_reclaimed(frees);
}

#[test]
fn run_locals_reclamation() {
    in_child("loom_models::runs::run_locals_reclamation", || {
        model_reclaiming(append_reclaims_outgrown_array)
    });
}

#[test]
fn run_locals_reclamation_negative_free_now() {
    must_fail(
        "loom_models::runs::run_locals_reclamation_negative_free_now",
        Faults {
            free_locals_now: true,
            ..Faults::default()
        },
        "Causality violation",
        append_reclaims_outgrown_array,
    );
}

/// Rank 2 starts a prompt (a new run linked into the branch table) while a reader looks
/// it up: nothing, or the whole run with its cover.
fn new_run_linked() {
    let idx = tiny();
    let w = idx.clone();
    let writer = loom::thread::spawn(move || {
        w.store(rank(2), Tier::Device, None, &blocks(&[7, 8]))
            .unwrap();
    });
    let got = idx.find_matches(&[7, 8]).get(rank(2));
    assert!(got == 0 || got == 2, "torn new run: {got}");
    writer.join().unwrap();
    assert_eq!(idx.find_matches(&[7, 8]).get(rank(2)), 2);
}

#[test]
fn run_link_publication() {
    in_child("loom_models::runs::run_link_publication", || {
        model(new_run_linked)
    });
}

#[test]
fn run_link_publication_negative_relaxed_key() {
    must_fail(
        "loom_models::runs::run_link_publication_negative_relaxed_key",
        Faults {
            relaxed_slot_key: true,
            ..Faults::default()
        },
        "Causality violation",
        new_run_linked,
    );
}

#[test]
fn run_link_publication_negative_relaxed_key_load() {
    must_fail(
        "loom_models::runs::run_link_publication_negative_relaxed_key_load",
        Faults {
            relaxed_key_load: true,
            ..Faults::default()
        },
        "Causality violation",
        new_run_linked,
    );
}

/// Rank 1 stored and removed the prompt [7, 8] (its run was unlinked: the branch-table
/// slot keeps its key with an empty word). Rank 2 stores the same prompt while a reader
/// looks it up: the new run revives the dead slot (a word stored over a published key),
/// and the reader sees nothing, or the whole run with rank 2's cover.
fn dead_link_revived() {
    let idx = set_up(|| {
        let idx = tiny();
        idx.store(rank(1), Tier::Device, None, &blocks(&[7, 8]))
            .unwrap();
        idx.remove(rank(1), Tier::Device, &[1007, 1008]);
        assert!(idx.find_matches(&[7, 8]).is_empty());
        idx
    });
    let w = idx.clone();
    let writer = loom::thread::spawn(move || {
        w.store(rank(2), Tier::Device, None, &blocks(&[7, 8]))
            .unwrap();
    });
    let got = idx.find_matches(&[7, 8]);
    assert!(got.get(rank(1)) == 0, "a removed rank came back: {got:?}");
    let got = got.get(rank(2));
    assert!(got == 0 || got == 2, "torn revived run: {got}");
    writer.join().unwrap();
    assert_eq!(idx.find_matches(&[7, 8]).get(rank(2)), 2);
}

#[test]
fn run_link_revival() {
    in_child("loom_models::runs::run_link_revival", || {
        model(dead_link_revived)
    });
}

#[test]
fn run_link_revival_negative_relaxed_word() {
    must_fail(
        "loom_models::runs::run_link_revival_negative_relaxed_word",
        Faults {
            relaxed_slot_word: true,
            ..Faults::default()
        },
        "Causality violation",
        dead_link_revived,
    );
}

#[test]
fn run_link_revival_negative_relaxed_word_load() {
    must_fail(
        "loom_models::runs::run_link_revival_negative_relaxed_word_load",
        Faults {
            relaxed_word_load: true,
            ..Faults::default()
        },
        "Causality violation",
        dead_link_revived,
    );
}

/// Rank 1 removes its whole chain (the run loses its last holder, is unlinked and
/// retired) while a reader walks it: the reader sees the chain or nothing, and the run is
/// freed only after the reader is done.
fn last_holder_leaves() {
    let frees = faults::frees();
    let idx = tiny();
    idx.store(rank(1), Tier::Device, None, &blocks(&[1, 2]))
        .unwrap();
    let w = idx.clone();
    let writer = loom::thread::spawn(move || {
        w.remove(rank(1), Tier::Device, &[1001, 1002]);
        churn_epoch();
    });
    let got = idx.find_matches(&[1, 2]).get(rank(1));
    assert!(got == 0 || got == 2, "torn removal: {got}");
    writer.join().unwrap();
    assert!(idx.find_matches(&[1, 2]).is_empty());
    note_reclaimed(frees);
}

#[test]
fn run_retirement() {
    in_child("loom_models::runs::run_retirement", || {
        model_reclaiming(last_holder_leaves)
    });
}

#[test]
fn run_retirement_negative_free_now() {
    must_fail(
        "loom_models::runs::run_retirement_negative_free_now",
        Faults {
            free_run_now: true,
            ..Faults::default()
        },
        "Causality violation",
        last_holder_leaves,
    );
}

/// As [`last_holder_leaves`], read by the tiered query (`find_matches_tiered_into`, what
/// selection calls): the reader sees the chain or nothing, and the run is freed only
/// after the reader is done.
fn last_holder_leaves_tiered() {
    let frees = faults::frees();
    let idx = tiny();
    idx.store(rank(1), Tier::Device, None, &blocks(&[1, 2]))
        .unwrap();
    let w = idx.clone();
    let writer = loom::thread::spawn(move || {
        w.remove(rank(1), Tier::Device, &[1001, 1002]);
        churn_epoch();
    });
    let got = idx.find_matches_tiered(&[1, 2]);
    let device = got.get(rank(1)).map_or(0, |o| o.device);
    assert!(device == 0 || device == 2, "torn removal: {got:?}");
    assert!(got.len() <= 1, "{got:?}");
    writer.join().unwrap();
    assert!(idx.find_matches_tiered(&[1, 2]).is_empty());
    note_reclaimed(frees);
}

#[test]
fn run_retirement_tiered() {
    in_child("loom_models::runs::run_retirement_tiered", || {
        model_reclaiming(last_holder_leaves_tiered)
    });
}

#[test]
fn run_retirement_tiered_negative_free_now() {
    must_fail(
        "loom_models::runs::run_retirement_tiered_negative_free_now",
        Faults {
            free_run_now: true,
            ..Faults::default()
        },
        "Causality violation",
        last_holder_leaves_tiered,
    );
}

#[test]
fn run_retirement_negative_unpinned_query() {
    must_fail(
        "loom_models::runs::run_retirement_negative_unpinned_query",
        Faults {
            unpinned_query: true,
            ..Faults::default()
        },
        "Causality violation",
        last_holder_leaves,
    );
}

#[test]
fn run_retirement_tiered_negative_unpinned_query() {
    must_fail(
        "loom_models::runs::run_retirement_tiered_negative_unpinned_query",
        Faults {
            unpinned_query: true,
            ..Faults::default()
        },
        "Causality violation",
        last_holder_leaves_tiered,
    );
}
