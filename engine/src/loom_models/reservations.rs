//! Loom models of the reservation table (`crate::reservation`): bookings racing frees,
//! the expiry sweep, mark-prefill-complete and the removal of their rank, three threads
//! each. No lost and no doubled counter update; exactly one remover per booking; every
//! live booking counted on its rank's current counters (points 1–4 of the module docs).

use std::time::{Duration, Instant};

use super::{model, must_fail};
use crate::ids::RankId;
use crate::reservation::{
    ActiveLoad, BookingRequest, FreeOutcome, FreedBy, ReservationConfig, ReservationTable,
};
use crate::sync::faults::Faults;
use crate::sync::Arc;

const RANK: RankId = RankId::new(1, 0);

/// Two shards (so the ids below may land in different ones) and no sweep thread.
pub(super) fn reservations() -> Arc<ReservationTable> {
    Arc::new(ReservationTable::new(ReservationConfig {
        shards: 2,
        sweep_interval: None,
        ..ReservationConfig::default()
    }))
}

pub(super) fn booking(
    id: u64,
    blocks: &[u64],
    prefill: u64,
    ttl: Option<Duration>,
) -> BookingRequest {
    BookingRequest {
        selection_id: id,
        rank: RANK,
        prompt_blocks: blocks.to_vec(),
        prefill_tokens: prefill,
        expected_output_tokens: 0,
        ttl,
    }
}

fn active(prefill: u64, decode: u64, requests: u64) -> ActiveLoad {
    ActiveLoad {
        active_prefill_tokens: prefill,
        active_decode_blocks: decode,
        active_requests: requests,
    }
}

/// The race left exactly the bookings `ids`, whose counters sum to `want`: checks them
/// exactly, then frees them and checks every counter is back to zero.
fn left_then_drain(t: &ReservationTable, ids: &[u64], want: ActiveLoad) {
    assert_eq!(t.rank_load(RANK), want, "lost or doubled counter update");
    assert_eq!(t.len(), ids.len());
    t.audit().unwrap();
    for &id in ids {
        assert!(matches!(t.free(id), Ok(FreeOutcome::Freed(_))));
    }
    assert_eq!(t.rank_load(RANK), ActiveLoad::default(), "counters leaked");
    t.audit().unwrap();
}

/// Booking 1 (expired) is freed by its caller while a sweep runs and booking 3 is made,
/// sharing block 11 with booking 1 (booking 2 shares block 10). Exactly one of the free
/// and the sweep removes booking 1, its contribution is subtracted once, and the shared
/// blocks stay counted for bookings 2 and 3.
fn free_races_sweep() {
    let t = reservations();
    let now = Instant::now();
    t.book(booking(1, &[10, 11], 32, Some(Duration::ZERO)), now)
        .unwrap();
    t.book(booking(2, &[10], 16, None), now).unwrap();
    let t2 = t.clone();
    let freer = loom::thread::spawn(move || t2.free(1).unwrap());
    let t3 = t.clone();
    let booker = loom::thread::spawn(move || t3.book(booking(3, &[11], 8, None), now).unwrap());
    let swept = t.sweep_expired(now);
    let freed = freer.join().unwrap();
    booker.join().unwrap();
    let by_free = matches!(freed, FreeOutcome::Freed(_));
    assert_eq!(
        usize::from(by_free) + swept,
        1,
        "booking freed {} times ({freed:?}, swept {swept})",
        usize::from(by_free) + swept
    );
    if !by_free {
        assert_eq!(freed, FreeOutcome::AlreadyFreed(FreedBy::Expired));
    }
    left_then_drain(&t, &[2, 3], active(24, 2, 2));
}

#[test]
fn reservation_free_races_sweep() {
    model(free_races_sweep);
}

#[test]
fn reservation_free_races_sweep_negative_release_before_remove() {
    must_fail(
        "loom_models::reservations::reservation_free_races_sweep_negative_release_before_remove",
        Faults {
            release_before_remove: true,
            ..Faults::default()
        },
        "would go negative",
        free_races_sweep,
    );
}

/// Bookings 1 and 2 are marked prefill-complete while booking 1 is freed: booking 1's
/// prefill tokens are subtracted exactly once, whichever comes first, and booking 2's
/// once.
fn mark_prefill_races_free() {
    let t = reservations();
    let now = Instant::now();
    t.book(booking(1, &[10], 32, None), now).unwrap();
    t.book(booking(2, &[10], 16, None), now).unwrap();
    let t2 = t.clone();
    let marker = loom::thread::spawn(move || t2.mark_prefill_complete(1));
    let t3 = t.clone();
    let other = loom::thread::spawn(move || t3.mark_prefill_complete(2));
    let freed = t.free(1).unwrap();
    assert_eq!(marker.join().unwrap(), Ok(()));
    assert_eq!(other.join().unwrap(), Ok(()));
    assert!(matches!(freed, FreeOutcome::Freed(_)));
    left_then_drain(&t, &[2], active(0, 1, 1));
}

#[test]
fn reservation_mark_prefill_races_free() {
    model(mark_prefill_races_free);
}

#[test]
fn reservation_mark_prefill_races_free_negative_flag_after_release() {
    must_fail(
        "loom_models::reservations::reservation_mark_prefill_races_free_negative_flag_after_release",
        Faults {
            prefill_flag_after_release: true,
            ..Faults::default()
        },
        "would go negative",
        mark_prefill_races_free,
    );
}

/// Two bookings on a rank race the free of a third on the same rank, all sharing block
/// 10 (ids 1, 2 and 3 spread over the two shards, so nothing but the counters' atomicity
/// and the rank's refcount lock orders them). No update is lost.
fn book_races_free() {
    let t = reservations();
    let now = Instant::now();
    t.book(booking(1, &[10, 11], 32, None), now).unwrap();
    let t2 = t.clone();
    let freer = loom::thread::spawn(move || t2.free(1).unwrap());
    let t3 = t.clone();
    let booker = loom::thread::spawn(move || t3.book(booking(3, &[10, 12], 8, None), now).unwrap());
    t.book(booking(2, &[10], 16, None), now).unwrap();
    assert!(matches!(freer.join().unwrap(), FreeOutcome::Freed(_)));
    booker.join().unwrap();
    left_then_drain(&t, &[2, 3], active(24, 2, 2));
}

#[test]
fn reservation_book_races_free() {
    model(book_races_free);
}

#[test]
fn reservation_book_races_free_negative_split_rmw() {
    must_fail(
        "loom_models::reservations::reservation_book_races_free_negative_split_rmw",
        Faults {
            split_counter_rmw: true,
            ..Faults::default()
        },
        "lost or doubled counter update",
        book_races_free,
    );
}

/// The rank is removed (`remove_rank`, as `Partition::remove_worker` does) while two
/// bookings on it are made. The contract (`ReservationTable::remove_rank`): a booking
/// racing the removal either is freed by it or starts the rank afresh, so every live
/// booking is counted on the rank's current counters; never on the removed rank's,
/// where nothing would see or free it.
fn book_races_remove_rank() {
    let t = reservations();
    let now = Instant::now();
    t.book(booking(1, &[10], 32, None), now).unwrap();
    let t2 = t.clone();
    let remover = loom::thread::spawn(move || t2.remove_rank(RANK));
    let t3 = t.clone();
    let booker = loom::thread::spawn(move || t3.book(booking(2, &[10], 16, None), now).unwrap());
    t.book(booking(3, &[11], 8, None), now).unwrap();
    let removed = remover.join().unwrap();
    booker.join().unwrap();
    assert_eq!(
        t.rank_load(RANK).active_requests as usize,
        t.len(),
        "a live booking is not counted on its rank (booked on the removed rank's counters)"
    );
    let mut live = 0;
    for id in 1..=3 {
        if t.get(id).is_some() {
            live += 1;
        } else {
            assert_eq!(
                t.free(id),
                Ok(FreeOutcome::AlreadyFreed(FreedBy::RankRemoved)),
                "booking {id}"
            );
        }
    }
    assert!(t.get(1).is_none(), "booking 1 outlived its rank's removal");
    assert_eq!(removed + live, 3, "removed {removed}, live {live}");
    t.audit().unwrap();
    t.remove_rank(RANK);
    assert_eq!(t.len(), 0, "a booking outlived the removal of its rank");
    assert_eq!(t.rank_load(RANK), ActiveLoad::default(), "counters leaked");
    t.audit().unwrap();
}

#[test]
fn reservation_book_races_remove_rank() {
    model(book_races_remove_rank);
}

#[test]
fn reservation_book_races_remove_rank_negative_ignore_retired() {
    must_fail(
        "loom_models::reservations::reservation_book_races_remove_rank_negative_ignore_retired",
        Faults {
            book_ignores_retired: true,
            ..Faults::default()
        },
        "a live booking is not counted on its rank",
        book_races_remove_rank,
    );
}
