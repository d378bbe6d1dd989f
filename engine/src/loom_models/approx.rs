//! Loom models of the approximate recorder (`index::approx`): recordings of different
//! ranks take no common lock, so the size bound rests on one atomic count, and a
//! recording racing the forgetting of its rank relies on the retired mark.

use std::time::{Duration, Instant};

use super::{in_child, model, must_fail};
use crate::ids::RankId;
use crate::index::{ApproxConfig, ApproxRecorder, Index};
use crate::sync::faults::Faults;
use crate::sync::Arc;

const TTL: Duration = Duration::from_secs(60);

fn recorder(max_blocks: usize) -> Arc<ApproxRecorder> {
    Arc::new(ApproxRecorder::new(ApproxConfig {
        ttl: TTL,
        max_blocks,
        prune_to: 0.5,
    }))
}

fn held(index: &Index, rank: RankId) -> u64 {
    index.rank_stats(rank).map_or(0, |s| s.tier_blocks[0])
}

/// Ranks 1 and 2 record at once, three new blocks against a bound of two: the records
/// never exceed the bound and their count is exact (the index holds as many blocks);
/// then everything expires.
fn two_ranks_at_the_bound() {
    let (r1, r2) = (RankId::new(1, 0), RankId::new(2, 0));
    let index = Arc::new(Index::with_branch_shards(1, 8));
    let rec = recorder(2);
    let now = Instant::now();
    let (i2, rec2) = (index.clone(), rec.clone());
    let other = loom::thread::spawn(move || {
        rec2.record_sequence(&i2, r1, &[11, 12], now).unwrap();
    });
    rec.record_sequence(&index, r2, &[21], now).unwrap();
    other.join().unwrap();
    let blocks = held(&index, r1) + held(&index, r2);
    assert!(
        blocks <= 2 && rec.len() as u64 == blocks,
        "over the bound or miscounted: {blocks} blocks recorded, len {}",
        rec.len()
    );
    rec.expire(&index, now + TTL);
    assert_eq!(rec.len(), 0);
    assert_eq!(held(&index, r1) + held(&index, r2), 0);
}

#[test]
fn approx_bound_two_ranks() {
    in_child("loom_models::approx::approx_bound_two_ranks", || {
        model(two_ranks_at_the_bound)
    });
}

#[test]
fn approx_bound_two_ranks_negative_split_reservation() {
    must_fail(
        "loom_models::approx::approx_bound_two_ranks_negative_split_reservation",
        Faults {
            split_room_reservation: true,
            ..Faults::default()
        },
        "over the bound or miscounted",
        two_ranks_at_the_bound,
    );
}

/// Rank 1's worker is removed (its records forgotten, then its index entries removed, as
/// `Partition::remove_worker` does) while a booking on it records. Whatever the order,
/// once everything due has expired no record and no index block of rank 1 is left.
fn record_races_forget() {
    let r1 = RankId::new(1, 0);
    let index = Arc::new(Index::with_branch_shards(1, 8));
    let rec = recorder(8);
    let now = Instant::now();
    rec.record_sequence(&index, r1, &[11], now).unwrap();
    let (i2, rec2) = (index.clone(), rec.clone());
    let remover = loom::thread::spawn(move || {
        rec2.forget_rank(r1);
        i2.remove_rank(r1);
    });
    rec.record_sequence(&index, r1, &[11, 12], now).unwrap();
    remover.join().unwrap();
    rec.expire(&index, now + TTL);
    assert_eq!(
        rec.len(),
        0,
        "leaked record: kept where no expiry reaches it"
    );
    assert_eq!(held(&index, r1), 0, "leaked index block of a removed rank");
}

#[test]
fn approx_record_races_forget() {
    in_child("loom_models::approx::approx_record_races_forget", || {
        model(record_races_forget)
    });
}

#[test]
fn approx_record_races_forget_negative_ignore_retired() {
    must_fail(
        "loom_models::approx::approx_record_races_forget_negative_ignore_retired",
        Faults {
            record_ignores_retired: true,
            ..Faults::default()
        },
        "leaked record",
        record_races_forget,
    );
}
