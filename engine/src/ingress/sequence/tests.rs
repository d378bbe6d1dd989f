//! The tracker's rules, one test per path (see the module docs).

use super::*;

fn applied(out: &[Action]) -> Vec<u64> {
    out.iter()
        .filter_map(|a| match a {
            Action::Apply { seq, .. } => Some(*seq),
            _ => None,
        })
        .collect()
}

fn clears(out: &[Action]) -> Vec<ClearCause> {
    out.iter()
        .filter_map(|a| match a {
            Action::Clear(c) => Some(*c),
            _ => None,
        })
        .collect()
}

/// A batch of the first publisher instance (payload = its seq).
fn live(t: &mut SequenceTracker, seq: u64) -> Vec<Action> {
    live_of(t, seq, 0)
}

/// A batch of publisher instance `inst` (payloads differ between instances).
fn live_of(t: &mut SequenceTracker, seq: u64, inst: u8) -> Vec<Action> {
    let mut out = Vec::new();
    t.on_live(seq, &[seq as u8, inst], &mut out);
    out
}

fn replayed(t: &mut SequenceTracker, seq: u64, inst: u8) -> Vec<Action> {
    let mut out = Vec::new();
    t.on_replayed(seq, &[seq as u8, inst], &mut out);
    out
}

fn end(t: &mut SequenceTracker, r: ReplayResult) -> Vec<Action> {
    let mut out = Vec::new();
    t.on_replay_end(r, &mut out);
    out
}

fn idle(t: &mut SequenceTracker) -> Vec<Action> {
    let mut out = Vec::new();
    t.on_idle(&mut out);
    out
}

#[test]
fn in_order_batches_apply_and_duplicates_drop() {
    let mut t = SequenceTracker::new(false);
    assert_eq!(applied(&live(&mut t, 0)), vec![0]);
    assert_eq!(applied(&live(&mut t, 1)), vec![1]);
    assert!(live(&mut t, 1).is_empty());
    assert_eq!(t.stats().duplicates, 1);
    assert_eq!(t.stats().last_seq, Some(1));
}

#[test]
fn a_gap_without_replay_clears_then_applies() {
    let mut t = SequenceTracker::new(false);
    live(&mut t, 0);
    let out = live(&mut t, 4);
    assert_eq!(out[0], Action::Clear(ClearCause::GapWithoutReplay));
    assert_eq!(applied(&out), vec![4]);
    let s = t.stats();
    assert_eq!((s.gaps, s.clears, s.batches_lost), (1, 1, 3));
}

#[test]
fn a_restart_clears_then_replays_the_new_instance_from_zero() {
    let mut t = SequenceTracker::new(true);
    for s in 0..6 {
        live(&mut t, s);
    }
    // The new instance's batches 0..2 went out before the reconnect.
    let out = live_of(&mut t, 2, 1);
    assert_eq!(clears(&out), vec![ClearCause::Restart]);
    assert_eq!(out[1], Action::RequestReplay { from_seq: 0 });
    assert!(applied(&out).is_empty(), "held until 0 and 1 are replayed");
    assert_eq!(applied(&replayed(&mut t, 0, 1)), vec![0]);
    assert_eq!(applied(&replayed(&mut t, 1, 1)), vec![1]);
    assert!(replayed(&mut t, 2, 1).is_empty(), "held live copy");
    assert_eq!(applied(&end(&mut t, ReplayResult::Completed)), vec![2]);
    let s = t.stats();
    assert_eq!(
        (s.restarts, s.clears, s.replays_filled, s.batches_lost),
        (1, 1, 1, 0)
    );
    // Without replay: clear and apply.
    let mut t = SequenceTracker::new(false);
    live(&mut t, 0);
    live(&mut t, 1);
    let out = live_of(&mut t, 0, 1);
    assert_eq!(clears(&out), vec![ClearCause::Restart]);
    assert_eq!(applied(&out), vec![0]);
}

#[test]
fn a_restart_that_reaches_the_old_last_seq_is_told_by_its_payload() {
    for replay in [false, true] {
        let mut t = SequenceTracker::new(replay);
        for s in 0..4 {
            live(&mut t, s);
        }
        assert!(
            live(&mut t, 3).is_empty(),
            "the same batch again: a duplicate"
        );
        let out = live_of(&mut t, 3, 1);
        assert_eq!(clears(&out), vec![ClearCause::Restart], "replay {replay}");
        assert_eq!(t.stats().restarts, 1);
        assert_eq!(t.stats().duplicates, 1);
    }
}

#[test]
fn a_gap_with_replay_verifies_the_last_batch_then_applies_the_range_and_the_held() {
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    let out = live(&mut t, 3);
    assert_eq!(out, vec![Action::RequestReplay { from_seq: 0 }]);
    assert!(live(&mut t, 4).is_empty(), "held while replaying");
    assert!(
        replayed(&mut t, 0, 0).is_empty(),
        "verified, already applied"
    );
    assert_eq!(applied(&replayed(&mut t, 1, 0)), vec![1]);
    assert_eq!(applied(&replayed(&mut t, 2, 0)), vec![2]);
    assert!(
        replayed(&mut t, 3, 0).is_empty(),
        "the live copy of 3 is held"
    );
    let out = end(&mut t, ReplayResult::Completed);
    assert_eq!(applied(&out), vec![3, 4]);
    assert!(clears(&out).is_empty());
    assert_eq!(applied(&live(&mut t, 5)), vec![5]);
    let s = t.stats();
    assert_eq!(
        (s.gaps, s.replays_requested, s.replays_filled, s.clears),
        (1, 1, 1, 0)
    );
    assert!(!s.recovering);
}

#[test]
fn a_gap_whose_replay_shows_another_instance_is_a_restart() {
    // The batch applied last comes back changed.
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    live(&mut t, 1);
    live_of(&mut t, 5, 1);
    let out = replayed(&mut t, 1, 1);
    assert_eq!(
        out,
        vec![
            Action::Clear(ClearCause::Restart),
            Action::RequestReplay { from_seq: 0 }
        ]
    );
    for s in 0..5 {
        assert_eq!(applied(&replayed(&mut t, s, 1)), vec![s]);
    }
    assert_eq!(applied(&end(&mut t, ReplayResult::Completed)), vec![5]);
    assert_eq!((t.stats().restarts, t.stats().clears), (1, 1));
    // The end marker before the batch to verify: the publisher's head is older.
    let mut t = SequenceTracker::new(true);
    for s in 0..9 {
        live(&mut t, s);
    }
    live_of(&mut t, 12, 1);
    let out = end(&mut t, ReplayResult::Completed);
    assert_eq!(clears(&out), vec![ClearCause::Restart]);
    assert_eq!(out[1], Action::RequestReplay { from_seq: 0 });
}

#[test]
fn a_replay_that_cannot_cover_the_gap_clears_before_newer_batches() {
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    live(&mut t, 10);
    // The publisher kept only from 7 on (so batch 0 cannot be verified either).
    let out = replayed(&mut t, 7, 0);
    assert_eq!(clears(&out), vec![ClearCause::ReplayIncomplete]);
    assert_eq!(applied(&out), vec![7]);
    replayed(&mut t, 8, 0);
    replayed(&mut t, 9, 0);
    let out = end(&mut t, ReplayResult::Completed);
    assert!(clears(&out).is_empty(), "cleared once, before 7");
    assert_eq!(applied(&out), vec![10]);
    let s = t.stats();
    assert_eq!(
        (s.replays_partial, s.replays_filled, s.batches_lost),
        (1, 0, 6)
    );
}

#[test]
fn a_failed_replay_clears_and_applies_what_was_held() {
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    live(&mut t, 2);
    live(&mut t, 3);
    let out = end(&mut t, ReplayResult::Failed);
    assert_eq!(out[0], Action::Clear(ClearCause::ReplayIncomplete));
    assert_eq!(applied(&out), vec![2, 3]);
    assert_eq!(applied(&live(&mut t, 4)), vec![4]);
    let s = t.stats();
    assert_eq!(
        (s.replays_failed, s.replays_filled, s.batches_lost),
        (1, 0, 1)
    );
}

#[test]
fn an_idle_probe_finds_a_gap_at_the_end_of_a_burst() {
    let mut t = SequenceTracker::new(true);
    for s in 0..3 {
        live(&mut t, s);
    }
    // Batches 3 and 4 were lost, then the engine went idle.
    assert_eq!(idle(&mut t), vec![Action::RequestReplay { from_seq: 2 }]);
    assert!(replayed(&mut t, 2, 0).is_empty());
    assert_eq!(applied(&replayed(&mut t, 3, 0)), vec![3]);
    assert_eq!(applied(&replayed(&mut t, 4, 0)), vec![4]);
    assert!(end(&mut t, ReplayResult::Completed).is_empty());
    let s = t.stats();
    assert_eq!(
        (s.idle_probes, s.gaps, s.replays_filled, s.clears),
        (1, 1, 1, 0)
    );
    assert_eq!(s.last_seq, Some(4));
    // A quiet probe: only the verified batch comes back.
    idle(&mut t);
    replayed(&mut t, 4, 0);
    assert!(end(&mut t, ReplayResult::Completed).is_empty());
    assert_eq!((t.stats().gaps, t.stats().idle_probes), (1, 2));
}

#[test]
fn an_idle_probe_finds_a_restart_of_an_idle_engine() {
    let mut t = SequenceTracker::new(true);
    for s in 0..5 {
        live(&mut t, s);
    }
    // The new instance sent 0..2, all missed: its head (2) is older than 4.
    idle(&mut t);
    let out = end(&mut t, ReplayResult::Completed);
    assert_eq!(
        out,
        vec![
            Action::Clear(ClearCause::Restart),
            Action::RequestReplay { from_seq: 0 }
        ]
    );
    for s in 0..3 {
        assert_eq!(applied(&replayed(&mut t, s, 1)), vec![s]);
    }
    assert!(end(&mut t, ReplayResult::Completed).is_empty());
    assert_eq!(t.stats().last_seq, Some(2));
    assert_eq!(t.stats().restarts, 1);
}

#[test]
fn a_failed_probe_clears_nothing_and_never_holds_the_live_stream() {
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    idle(&mut t);
    assert_eq!(
        applied(&live(&mut t, 1)),
        vec![1],
        "contiguous: applied at once"
    );
    assert_eq!(applied(&live(&mut t, 2)), vec![2]);
    assert!(end(&mut t, ReplayResult::Failed).is_empty());
    let s = t.stats();
    assert_eq!((s.replays_failed, s.clears, s.last_seq), (1, 0, Some(2)));
}

/// Found by fuzz target `recovery`: a probe in flight, batches 2 and 3 lost on the live
/// stream, 4 held; the probe fails. Applying 4 over the hole without a clear left what 2
/// and 3 removed in the index for good.
#[test]
fn a_failed_probe_with_a_gap_behind_it_clears_before_the_held_batches() {
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    live(&mut t, 1);
    idle(&mut t);
    assert!(
        applied(&live(&mut t, 4)).is_empty(),
        "held: 2 and 3 missing"
    );
    let out = end(&mut t, ReplayResult::Failed);
    assert_eq!(clears(&out), vec![ClearCause::ReplayIncomplete]);
    assert_eq!(applied(&out), vec![4]);
    let s = t.stats();
    assert_eq!((s.replays_failed, s.clears, s.batches_lost), (1, 1, 2));
}

#[test]
fn a_loss_during_a_probe_of_a_dead_endpoint_clears_when_the_probe_fails() {
    // Found by tests/recovery (loss-during-idle-probe): the probe's replay endpoint never
    // answers, batch 2 is lost, 3 arrives and waits. The failed probe must clear before
    // applying 3: the lost batch may have evicted what the index still counts.
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    live(&mut t, 1);
    idle(&mut t);
    assert!(live(&mut t, 3).is_empty(), "past the gap: held");
    assert_eq!(t.stats().gaps, 1, "the loss is known at once");
    let out = end(&mut t, ReplayResult::Failed);
    assert_eq!(clears(&out), vec![ClearCause::ReplayIncomplete]);
    assert_eq!(applied(&out), vec![3]);
    let s = t.stats();
    assert_eq!((s.replays_failed, s.batches_lost, s.gaps), (1, 1, 1));
    // A probe that fills the same loss applies the range, then the held batch.
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    idle(&mut t);
    live(&mut t, 2);
    assert!(replayed(&mut t, 0, 0).is_empty(), "the verified batch");
    assert_eq!(applied(&replayed(&mut t, 1, 0)), vec![1]);
    let out = end(&mut t, ReplayResult::Completed);
    assert_eq!((clears(&out), applied(&out)), (vec![], vec![2]));
    let s = t.stats();
    assert_eq!((s.replays_filled, s.gaps, s.clears), (1, 1, 0));
}

#[test]
fn a_restart_while_a_replay_is_in_flight_is_a_restart() {
    // Found by fuzz target `recovery`: during a replay, live batches below the replay's
    // next number were taken for duplicates, so a new instance's first batches went
    // unnoticed and the old instance's blocks stayed.
    let mut t = SequenceTracker::new(true);
    for s in 0..4 {
        live(&mut t, s);
    }
    idle(&mut t); // a probe from 3 in flight
    let out = live_of(&mut t, 0, 1);
    assert_eq!(clears(&out), vec![ClearCause::Restart]);
    assert_eq!(applied(&out), vec![0]);
    assert!(!t.replaying(), "the old instance's replay is abandoned");
    assert_eq!(t.stats().restarts, 1);
    // Its late batches find no replay: ignored.
    assert!(replayed(&mut t, 3, 0).is_empty());
    // A gap replay, then the same number as the held batch with another payload.
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    live(&mut t, 2); // gap: 2 held, replay from 0
    assert!(
        live(&mut t, 2).is_empty(),
        "the same batch again: a duplicate"
    );
    let out = live_of(&mut t, 2, 1);
    assert_eq!(clears(&out), vec![ClearCause::Restart]);
    assert_eq!(out.last(), Some(&Action::RequestReplay { from_seq: 0 }));
    let s = t.stats();
    assert_eq!((s.restarts, s.duplicates), (1, 1));
}

#[test]
fn a_restart_after_a_join_replay_brought_the_old_batches_is_a_restart() {
    // Found by fuzz target `recovery`: a join replay applied the old instance's batch 0,
    // then the new instance's batch 0 came live and was taken for its duplicate.
    let mut t = SequenceTracker::new(true);
    idle(&mut t); // the probe right after subscribing: a join, nothing applied
    assert_eq!(applied(&replayed(&mut t, 0, 0)), vec![0]);
    assert!(
        live(&mut t, 0).is_empty(),
        "the same batch live: a duplicate"
    );
    let out = live_of(&mut t, 0, 1);
    assert_eq!(clears(&out), vec![ClearCause::Restart]);
    assert_eq!(applied(&out), vec![0]);
    assert_eq!((t.stats().restarts, t.stats().duplicates), (1, 1));
}

#[test]
fn an_old_instance_replay_behind_the_new_instance_live_batches_is_a_restart() {
    // Found by fuzz target `recovery` (fuzz/regressions/recovery/): a join probe's replay
    // was answered by the old instance, which then restarted; the new instance's batch 0
    // came live first and applied at once, its batch 2 was held; the old batch 0 was then
    // taken for the one applied and the old batch 1 applied after it: an overcount. Now
    // a join's live batches wait for its replay, and a replayed batch must equal the
    // batch of its number held (or applied).
    let mut t = SequenceTracker::new(true);
    idle(&mut t); // join probe: replay from 0 in flight
    assert!(
        live_of(&mut t, 0, 1).is_empty(),
        "a join's live batch waits"
    );
    assert!(live_of(&mut t, 2, 1).is_empty());
    assert!(
        replayed(&mut t, 0, 1).is_empty(),
        "the batch held, brought again unchanged: nothing to do"
    );
    let out = replayed(&mut t, 0, 0); // the old instance's batch 0
    assert_eq!(clears(&out), vec![ClearCause::Restart]);
    assert_eq!(out.last(), Some(&Action::RequestReplay { from_seq: 0 }));
    assert!(applied(&out).is_empty());
    // The new replay (of the new instance) brings 0 to 2; the held 0 and 2 apply, with a
    // clear between them (a replayed batch does not fill a hole among held ones).
    for s in 0..3 {
        assert!(replayed(&mut t, s, 1).is_empty());
    }
    let out = end(&mut t, ReplayResult::Completed);
    assert_eq!(applied(&out), vec![0, 2]);
    assert_eq!(clears(&out), vec![ClearCause::GapWithoutReplay]);
    assert_eq!(t.stats().restarts, 1);

    // The old replay without the batch held (no longer buffered): nothing ties its
    // batches to the new instance's, so none of them is applied; the hole among the held
    // batches clears (an undercount, never an overcount).
    let mut t = SequenceTracker::new(true);
    idle(&mut t);
    live_of(&mut t, 0, 1);
    live_of(&mut t, 3, 1);
    assert!(replayed(&mut t, 1, 0).is_empty());
    assert!(replayed(&mut t, 2, 0).is_empty());
    let out = end(&mut t, ReplayResult::Completed);
    assert_eq!(applied(&out), vec![0, 3]);
    assert_eq!(clears(&out), vec![ClearCause::GapWithoutReplay]);
}

#[test]
fn a_live_batch_below_the_replay_that_it_did_not_bring_is_a_restart() {
    // Found by fuzz target `recovery` (fuzz/regressions/recovery/): the join replay of the
    // old instance brought 1 (0 no longer buffered); the new instance's 0 came live and
    // was taken for a duplicate; the old replay's 2 then applied: an overcount.
    let mut t = SequenceTracker::new(true);
    idle(&mut t);
    assert_eq!(applied(&replayed(&mut t, 1, 0)), vec![1]);
    let out = live_of(&mut t, 0, 1);
    assert_eq!(clears(&out), vec![ClearCause::Restart]);
    assert_eq!(applied(&out), vec![0]);
    assert!(!t.replaying(), "the old instance's replay is abandoned");
    assert!(
        replayed(&mut t, 2, 0).is_empty(),
        "its late batches are ignored"
    );
    // A batch the replay did bring, live again: a duplicate, as before.
    let mut t = SequenceTracker::new(true);
    idle(&mut t);
    replayed(&mut t, 0, 0);
    replayed(&mut t, 1, 0);
    assert!(live(&mut t, 1).is_empty());
    assert_eq!((t.stats().duplicates, t.stats().restarts), (1, 0));
}

#[test]
fn a_join_probe_that_hears_nothing_back_counts_as_failed() {
    let mut t = SequenceTracker::new(true);
    idle(&mut t);
    assert!(end(&mut t, ReplayResult::Failed).is_empty());
    let s = t.stats();
    assert_eq!((s.replays_failed, s.replays_filled, s.clears), (1, 0, 0));
}

#[test]
fn a_probe_right_after_subscribing_brings_what_the_publisher_holds() {
    let mut t = SequenceTracker::new(true);
    assert_eq!(idle(&mut t), vec![Action::RequestReplay { from_seq: 0 }]);
    for s in 0..4 {
        assert_eq!(applied(&replayed(&mut t, s, 0)), vec![s]);
    }
    assert!(end(&mut t, ReplayResult::Completed).is_empty());
    assert_eq!(applied(&live(&mut t, 4)), vec![4]);
    assert_eq!((t.stats().gaps, t.stats().clears), (0, 0));
    // Without replay there is nothing to probe.
    assert!(idle(&mut SequenceTracker::new(false)).is_empty());
}

#[test]
fn huge_sequence_jumps_saturate_the_lost_counter_instead_of_overflowing() {
    // Found by fuzz target ingest_frames (fuzz/regressions/ingest_frames/).
    let mut t = SequenceTracker::new(false);
    live(&mut t, 0);
    live(&mut t, u64::MAX);
    live(&mut t, 0);
    live(&mut t, 3);
    assert_eq!(t.stats().batches_lost, u64::MAX);
    // And a held batch at u64::MAX ends a replay without overflowing.
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    live(&mut t, 5);
    live(&mut t, u64::MAX);
    let out = end(&mut t, ReplayResult::Failed);
    assert_eq!(applied(&out), vec![5, u64::MAX]);
    assert_eq!(t.stats().last_seq, Some(u64::MAX));
}

#[test]
fn joining_late_with_replay_asks_for_what_the_publisher_still_holds() {
    let mut t = SequenceTracker::new(true);
    assert_eq!(live(&mut t, 5), vec![Action::RequestReplay { from_seq: 0 }]);
    for s in 0..5 {
        assert_eq!(applied(&replayed(&mut t, s, 0)), vec![s]);
    }
    assert_eq!(applied(&end(&mut t, ReplayResult::Completed)), vec![5]);
    assert_eq!(t.stats().clears, 0);
}

fn fence(t: &mut SequenceTracker, seq: u64, inst: u8) -> Vec<Action> {
    let mut out = Vec::new();
    t.on_fence(seq, &[seq as u8, inst, 0xcc], &mut out);
    out
}

fn replays(out: &[Action]) -> Vec<u64> {
    out.iter()
        .filter_map(|a| match a {
            Action::RequestReplay { from_seq } => Some(*from_seq),
            _ => None,
        })
        .collect()
}

#[test]
fn a_fence_in_sequence_is_an_ordinary_batch() {
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    let out = fence(&mut t, 1, 0);
    assert_eq!((applied(&out), clears(&out)), (vec![1], vec![]));
    assert!(fence(&mut t, 1, 0).is_empty(), "its duplicate drops");
    assert_eq!(t.stats().duplicates, 1);
}

#[test]
fn a_fence_after_a_gap_or_from_a_restored_instance_needs_no_replay() {
    // A gap: what was lost came before the clear, so nothing is asked again.
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    let out = fence(&mut t, 5, 0);
    assert_eq!(replays(&out), Vec::<u64>::new());
    assert_eq!(
        (clears(&out), applied(&out)),
        (vec![ClearCause::Restart], vec![5])
    );
    assert_eq!(t.stats().gaps, 1);
    assert_eq!(
        applied(&live(&mut t, 6)),
        vec![6],
        "and the stream goes on from it"
    );
    // A clone restored from an older checkpoint: its numbers go on from the checkpoint's.
    let out = fence(&mut t, 3, 1);
    assert_eq!(
        (clears(&out), applied(&out)),
        (vec![ClearCause::Restart], vec![3])
    );
    assert_eq!(replays(&out), Vec::<u64>::new());
    assert_eq!(t.stats().restarts, 1);
    assert_eq!(applied(&live_of(&mut t, 4, 1)), vec![4]);
}

#[test]
fn a_fence_ends_a_replay_in_flight() {
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    assert_eq!(replays(&live(&mut t, 3)), vec![0], "a gap: replay asked");
    assert!(t.replaying());
    let out = fence(&mut t, 4, 0);
    assert_eq!(
        (clears(&out), applied(&out)),
        (vec![ClearCause::Restart], vec![4])
    );
    assert!(!t.replaying() && !t.stale());
    // The late replay finds none in flight and is ignored.
    assert!(replayed(&mut t, 1, 0).is_empty());
    // A join that meets a fence applies it at once, no replay asked.
    let mut t = SequenceTracker::new(true);
    let out = fence(&mut t, 9, 0);
    assert_eq!(
        (clears(&out), applied(&out), replays(&out)),
        (vec![ClearCause::Restart], vec![9], vec![])
    );
}

#[test]
fn a_resumed_stream_probes_from_its_last_batch_and_fences_a_new_instance() {
    let last = (7, digest(&[7, 0]));
    // The same instance sends batch 7 back unchanged, then 8: nothing is cleared.
    let mut t = SequenceTracker::resumed(true, Some(last));
    assert!(
        t.stale(),
        "stale until the replay covers what was sent meanwhile"
    );
    assert_eq!(replays(&idle(&mut t)), vec![7]);
    assert!(
        replayed(&mut t, 7, 0).is_empty(),
        "batch 7 was applied already"
    );
    assert_eq!(applied(&replayed(&mut t, 8, 0)), vec![8]);
    assert!(t.stale());
    assert!(clears(&end(&mut t, ReplayResult::Completed)).is_empty());
    assert_eq!(t.stats().last_seq, Some(8));
    assert!(!t.stale());
    // The publisher's replay never answers: what it sent meanwhile is unknown, cleared
    // (a fresh stream's probe failing clears nothing: no loss is known).
    let mut t = SequenceTracker::resumed(true, Some(last));
    idle(&mut t);
    assert_eq!(
        clears(&end(&mut t, ReplayResult::Failed)),
        vec![ClearCause::ReplayIncomplete]
    );
    assert!(!t.stale());
    let mut t = SequenceTracker::new(true);
    live(&mut t, 0);
    idle(&mut t);
    assert!(clears(&end(&mut t, ReplayResult::Failed)).is_empty());
    // Without replay: the next batch continues it and ends the staleness.
    let mut t = SequenceTracker::resumed(false, Some(last));
    assert!(t.stale());
    assert_eq!(applied(&live(&mut t, 8)), vec![8]);
    assert!(!t.stale());
    // A new instance (batch 7 differs): cleared, and everything read again from 0.
    let mut t = SequenceTracker::resumed(true, Some(last));
    idle(&mut t);
    let out = replayed(&mut t, 7, 1);
    assert_eq!(clears(&out), vec![ClearCause::Restart]);
    assert_eq!(replays(&out), vec![0]);
    // Negative control: a fresh tracker takes that batch as new.
    let mut t = SequenceTracker::new(true);
    assert_eq!(replays(&idle(&mut t)), vec![0]);
}

#[test]
fn a_stream_over_a_peers_dump_is_stale_until_its_join_replay_ends() {
    let mut t = SequenceTracker::resumed(true, None);
    assert!(t.stale());
    assert_eq!(
        replays(&idle(&mut t)),
        vec![0],
        "a join: from the first batch"
    );
    assert_eq!(applied(&replayed(&mut t, 0, 0)), vec![0]);
    assert!(t.stale(), "history older than the dump is being replayed");
    assert!(clears(&end(&mut t, ReplayResult::Completed)).is_empty());
    assert!(!t.stale());
    // Negative control: a plain join is never stale (nothing of it is in the index).
    let mut t = SequenceTracker::new(true);
    idle(&mut t);
    assert!(!t.stale());
}
