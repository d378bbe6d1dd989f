//! Loom models of the recurrent-state protocol of hybrid ranks (`index::recurrent`), each
//! with a negative control: a block's state dropped with the block (and the block stored
//! again), states and blocks removed until the run is retired under a reader, and a
//! hybrid rank removed while a reader scores it and its slot is reused.
//!
//! What a reader may see: a hybrid rank's score is its attention prefix cut back to the
//! last block inside it with a state; a reader racing a writer must get a score the rank
//! had at some quiescent point between the writer's events (or nothing), never more.

use super::{churn_epoch, in_child, model, model_reclaiming, must_fail, note_reclaimed};
use crate::ids::{RankId, Tier};
use crate::index::Index;
use crate::index::StoredBlock;
use crate::sync::faults::{self, Faults};
use crate::sync::Arc;

fn rank(w: u64) -> RankId {
    RankId::new(w, 0)
}

/// Blocks with local hashes `locals`, each named by its local hash + 1000.
fn blocks(locals: &[u64]) -> Vec<StoredBlock> {
    locals
        .iter()
        .map(|&l| StoredBlock {
            external_hash: l + 1000,
            local_hash: l,
        })
        .collect()
}

fn tiny() -> Arc<Index> {
    Arc::new(Index::with_branch_shards(1, 8))
}

/// Runs a model's set-up (before any thread is spawned) with no fault injected.
fn set_up<T>(f: impl FnOnce() -> T) -> T {
    let fault = faults::get();
    faults::set(Faults::default());
    let r = f();
    faults::set(fault);
    r
}

/// Rank 1 holds [1, 2] on the device, with a device state at the blocks `states` names
/// (by local hash): a hybrid rank.
fn hybrid_chain(states: &[u64]) -> Arc<Index> {
    set_up(|| {
        let idx = tiny();
        idx.store(rank(1), Tier::Device, None, &blocks(&[1, 2]))
            .unwrap();
        let names: Vec<u64> = states.iter().map(|l| l + 1000).collect();
        let out = idx.store_states(rank(1), Tier::Device, &names);
        assert_eq!(out.stored, states.len());
        idx
    })
}

/// Rank 1's device score for [1, 2], by the device query.
fn device_score(idx: &Index) -> u32 {
    idx.find_matches(&[1, 2]).get(rank(1))
}

/// Rank 1's whole score for [1, 2] (device, host, disk), by the tiered query.
fn tiered_score(idx: &Index) -> u32 {
    idx.find_matches_tiered(&[1, 2])
        .get(rank(1))
        .map_or(0, |o| o.device + o.host + o.disk)
}

/// Rank 1 holds [1, 2] with a state at block 2 (score 2). Its writer drops block 2 (its
/// state goes with it: score 0, the rank is hybrid with no state in its prefix), then
/// stores block 2 again at the same place (score still 0: the state is not back). A
/// reader sees 2 or 0; once the writer is done, 0. A state kept past its block would be
/// credited again when the block comes back: score 2, an overcount.
fn orphaned_state_dropped(score: fn(&Index) -> u32) {
    let idx = hybrid_chain(&[2]);
    assert_eq!(score(&idx), 2);
    let w = idx.clone();
    let writer = loom::thread::spawn(move || {
        w.remove(rank(1), Tier::Device, &[1002]);
        w.store(rank(1), Tier::Device, Some(1001), &blocks(&[2]))
            .unwrap();
    });
    let got = score(&idx);
    assert!(got == 2 || got == 0, "a score the index never had: {got}");
    writer.join().unwrap();
    assert_eq!(
        idx.block_tiers(rank(1), &[1, 2]),
        1,
        "block 2 is held again"
    );
    let after = score(&idx);
    assert_eq!(
        after, 0,
        "overcount: a dropped block's state credited after the block came back ({after})"
    );
}

fn orphaned_state_dropped_device() {
    orphaned_state_dropped(device_score)
}

fn orphaned_state_dropped_tiered() {
    orphaned_state_dropped(tiered_score)
}

#[test]
fn state_dropped_with_block() {
    in_child("loom_models::states::state_dropped_with_block", || {
        model(orphaned_state_dropped_device)
    });
}

#[test]
fn state_dropped_with_block_tiered() {
    in_child(
        "loom_models::states::state_dropped_with_block_tiered",
        || model(orphaned_state_dropped_tiered),
    );
}

#[test]
fn state_dropped_with_block_negative_keep_orphans() {
    must_fail(
        "loom_models::states::state_dropped_with_block_negative_keep_orphans",
        Faults {
            keep_orphaned_states: true,
            ..Faults::default()
        },
        "overcount",
        orphaned_state_dropped_device,
    );
}

#[test]
fn state_dropped_with_block_tiered_negative_keep_orphans() {
    must_fail(
        "loom_models::states::state_dropped_with_block_tiered_negative_keep_orphans",
        Faults {
            keep_orphaned_states: true,
            ..Faults::default()
        },
        "overcount",
        orphaned_state_dropped_tiered,
    );
}

/// Rank 1 holds [1, 2] with states at both blocks (score 2). Its writer removes the state
/// of block 2 (score 1), then block 2 (1), then block 1: the run loses its last holder and
/// is retired, its states gone first. A tiered reader (what selection calls) walks the
/// run twice, once for the attention prefix and once for the places of the cut, and sees
/// 2, 1 or nothing; the run is freed only after it is done. Then the reader checks the
/// invariant that keeps a freed run's address from inheriting a state (`recurrent`): once
/// it sees the run unlinked, no state of the rank names the run's places.
fn states_and_run_retired() {
    let frees = faults::frees();
    let idx = hybrid_chain(&[1, 2]);
    let places = idx.places_of(&[1, 2]);
    assert_eq!(places.len(), 2);
    let w = idx.clone();
    let writer = loom::thread::spawn(move || {
        w.remove_states(rank(1), Tier::Device, &[1002]);
        w.remove(rank(1), Tier::Device, &[1002]);
        w.remove(rank(1), Tier::Device, &[1001]);
        churn_epoch();
    });
    let got = idx.find_matches_tiered(&[1, 2]);
    let s = got.get(rank(1)).map_or(0, |o| o.device + o.host + o.disk);
    assert!(
        s <= 2 && got.len() <= 1,
        "a score the index never had: {got:?}"
    );
    if !idx.root_run_linked(1) {
        for &p in &places {
            assert!(
                !idx.has_state_at(rank(1), p),
                "a state names the place of a run already unlinked (retired)"
            );
        }
    }
    writer.join().unwrap();
    assert!(idx.find_matches_tiered(&[1, 2]).is_empty());
    assert!(!idx.root_run_linked(1));
    note_reclaimed(frees);
}

#[test]
fn state_run_retirement() {
    in_child("loom_models::states::state_run_retirement", || {
        model_reclaiming(states_and_run_retired)
    });
}

#[test]
fn state_run_retirement_negative_drop_late() {
    must_fail(
        "loom_models::states::state_run_retirement_negative_drop_late",
        Faults {
            drop_orphans_late: true,
            ..Faults::default()
        },
        "already unlinked",
        states_and_run_retired,
    );
}

/// Rank 1 holds [1, 2] and is marked hybrid, with no state anywhere (a state announced
/// for a block it does not hold is left out): its score is 0, so no query lists it.
/// (No state at a block: the state table then holds only the mark, whose key does not
/// depend on a run's address, which keeps loom's exploration deterministic.)
fn hybrid_without_state() -> Arc<Index> {
    set_up(|| {
        let idx = tiny();
        idx.store(rank(1), Tier::Device, None, &blocks(&[1, 2]))
            .unwrap();
        let out = idx.store_states(rank(1), Tier::Device, &[9999]);
        assert_eq!((out.stored, out.not_found), (0, 1));
        assert!(idx.find_matches(&[1, 2]).is_empty());
        idx
    })
}

/// The hybrid rank without a state is removed while a reader scores [1, 2]: at every
/// quiescent point it scores 0 (before) or is gone (after), so the reader lists nobody.
/// Listing it with its attention prefix (2) would be an overcount.
fn hybrid_rank_removed() {
    let idx = hybrid_without_state();
    let w = idx.clone();
    let writer = loom::thread::spawn(move || {
        assert!(w.remove_rank(rank(1)));
    });
    let got = idx.find_matches(&[1, 2]);
    assert!(
        got.is_empty(),
        "overcount: a removed hybrid rank credited past its states: {got:?}"
    );
    writer.join().unwrap();
    assert!(idx.find_matches(&[1, 2]).is_empty());
}

#[test]
fn hybrid_rank_removal() {
    in_child("loom_models::states::hybrid_rank_removal", || {
        model(hybrid_rank_removed)
    });
}

/// The hybrid rank is removed while the other thread lets the epoch pass and rank 2
/// stores [3] (no state: a plain rank), possibly in rank 1's old slot: rank 2 scores 1,
/// whatever the slot's old owner was; a hybrid mark that outlived its rank would cut it
/// to 0.
fn hybrid_slot_reused() {
    let idx = hybrid_without_state();
    let old_slot = idx.slot_of(rank(1));
    let w = idx.clone();
    let writer = loom::thread::spawn(move || {
        assert!(w.remove_rank(rank(1)));
    });
    churn_epoch();
    idx.store(rank(2), Tier::Device, None, &blocks(&[3]))
        .unwrap();
    let reused = idx.slot_of(rank(2)) == old_slot;
    let b = idx.find_matches(&[3]).get(rank(2));
    assert_eq!(
        b, 1,
        "rank 2 (slot reused: {reused}) inherited the old rank's hybrid mark"
    );
    writer.join().unwrap();
    if reused {
        faults::note_reclaiming_run();
    }
}

/// Loom's preemption bound for the slot-reuse model: at 3 its search (three epoch
/// pins and flushes against a rank removal) runs for minutes and trips loom's own bug;
/// the fault it must catch needs 2 (the writer preempted after handing the slot back,
/// then back to it before the reuse).
const SLOT_REUSE_PREEMPTIONS: usize = 2;

#[test]
fn hybrid_slot_reuse() {
    super::cap_preemptions(SLOT_REUSE_PREEMPTIONS);
    in_child("loom_models::states::hybrid_slot_reuse", || {
        // "Reclaiming" here: some execution gave rank 2 the removed rank's slot.
        model_reclaiming(hybrid_slot_reused)
    });
}

#[test]
fn hybrid_slot_reuse_negative_unmark_after_free() {
    super::cap_preemptions(SLOT_REUSE_PREEMPTIONS);
    must_fail(
        "loom_models::states::hybrid_slot_reuse_negative_unmark_after_free",
        Faults {
            unmark_after_free: true,
            ..Faults::default()
        },
        "inherited the old rank's hybrid mark",
        hybrid_slot_reused,
    );
}
