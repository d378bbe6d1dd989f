//! Idle groups: each floor group counts the live bookings its members hold, so that a
//! selection can tell that every member's counters are zero without reading them.
//!
//! Why: on a fleet with nothing booked (a new or quiet partition), every rank ties at the
//! same cost for a prompt nobody holds, so the pruned pass (`select/prune.rs`) had to read
//! and price all of them to choose uniformly among the ties: about 350 µs at 8,192 ranks.
//! A group whose count reads zero, and whose uncached members have one capacity, is one
//! candidate that stands for all of them; the choice among ties is then weighted by how
//! many ranks each candidate stands for, which keeps it uniform over ranks.
//!
//! The protocol, on the group's `bookings` word:
//! - a booking adds one (`AcqRel`) **before** it adds to any counter of its rank;
//! - a release subtracts one (`Release`) **after** it has subtracted from every counter of
//!   its rank;
//! - a selection loads it (`Acquire`).
//!
//! So a member's counter can be above zero only inside the span between one of its
//! bookings' two steps on the word, and a selection that reads zero there sees a point in
//! the word's order where every member's counters are zero: what the group stands for is
//! a state it really had during the selection, as any counter a selection reads is. The
//! counter increments are `Release` for this (a reader that sees a booking's counter also
//! sees its step on the word; on x86 the same instruction as `Relaxed`). The loom model is
//! `loom_models::idle`, with its negative control (the step on the word after the
//! counters). The exact audit checks each group's count against its members' live
//! bookings.

use super::floor::LoadFloor;
use crate::sync::atomic::Ordering;

impl LoadFloor {
    /// A member is about to add a booking to its counters.
    #[inline]
    pub(super) fn booking_started(&self) {
        self.bookings.fetch_add(1, Ordering::AcqRel);
    }

    /// A member has subtracted a booking from all of its counters.
    #[inline]
    pub(super) fn booking_ended(&self) {
        self.bookings.fetch_sub(1, Ordering::Release);
    }

    /// The live bookings the members hold: zero means every member's counters are zero.
    #[inline]
    pub(crate) fn bookings(&self) -> u64 {
        self.bookings.load(Ordering::Acquire)
    }
}
