//! Idle groups (`reservation/idle.rs`): a group's count of its members' live bookings
//! must span every change a booking makes to its rank's counters, so that a selection
//! that reads the count at zero may take every member's counters as zero.
//!
//! * The release side, read as a selection reads (the count with `Acquire`, then the
//!   counters with `Relaxed`): once the reader knows the booking was made, a zero count
//!   can only be the release's, which came after its subtractions, so the counters read
//!   zero (negative control `group_unbooking_early`: the count drops first and the reader
//!   sees the booking's counters beside a zero count).
//! * The booking side, read the other way (the counters with `Acquire`, then the count):
//!   a counter the booking raised is seen only with the count it raised before, unless
//!   the release has begun (negative control `group_booking_late`: the count rises after
//!   the counters, and a reader sees them raised beside a zero count).
//!
//! One booking and its release on one rank (a thread), one reader (the model's thread).

use std::time::Instant;

use super::reservations::{booking, reservations};
use super::{model, must_fail};
use crate::ids::RankId;
use crate::reservation::{ActiveLoad, ReservationTable};
use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::faults::Faults;
use crate::sync::Arc;

const NEEDLE: &str = "counters outside the group's count";
const RANK: RankId = RankId::new(1, 0);

/// A table with the rank registered, and a client thread that books on it, sets the flag
/// (between the booking and the release: the booking is made, the release not begun),
/// then frees.
fn client() -> (
    Arc<ReservationTable>,
    Arc<AtomicBool>,
    loom::thread::JoinHandle<()>,
) {
    let t = reservations();
    t.ensure_ranks(&[RANK]);
    let between = Arc::new(AtomicBool::new(false));
    let (t2, b2) = (t.clone(), between.clone());
    let client = loom::thread::spawn(move || {
        t2.book(booking(1, &[10], 8, None), Instant::now()).unwrap();
        b2.store(true, Ordering::Release);
        t2.free(1).unwrap();
    });
    (t, between, client)
}

/// The reader checks the release side.
fn release_side() {
    let (t, booked, client) = client();
    if booked.load(Ordering::Acquire) {
        let loads = t.loads();
        if loads.groups()[0].floor.bookings() == 0 {
            let load = loads.load_at(0);
            assert_eq!(
                load,
                ActiveLoad::default(),
                "{NEEDLE}: {load:?} at a zero count"
            );
        }
    }
    client.join().unwrap();
    t.audit().unwrap();
}

#[test]
fn idle_group_count_spans_the_release() {
    model(release_side);
}

#[test]
fn idle_group_count_spans_the_release_negative_unbooking_early() {
    must_fail(
        "loom_models::idle::idle_group_count_spans_the_release_negative_unbooking_early",
        Faults {
            group_unbooking_early: true,
            ..Faults::default()
        },
        NEEDLE,
        release_side,
    );
}

/// The reader checks the booking side (the flag: the release may have begun).
fn booking_side() {
    let (t, freeing, client) = client();
    let loads = t.loads();
    let load = loads.load_at_acquire(0);
    let count = loads.groups()[0].floor.bookings();
    if load != ActiveLoad::default() && count == 0 && !freeing.load(Ordering::Acquire) {
        panic!("{NEEDLE}: {load:?} before the release, at a zero count");
    }
    client.join().unwrap();
    t.audit().unwrap();
}

#[test]
fn idle_group_count_spans_the_booking() {
    model(booking_side);
}

#[test]
fn idle_group_count_spans_the_booking_negative_booking_late() {
    must_fail(
        "loom_models::idle::idle_group_count_spans_the_booking_negative_booking_late",
        Faults {
            group_booking_late: true,
            ..Faults::default()
        },
        NEEDLE,
        booking_side,
    );
}
