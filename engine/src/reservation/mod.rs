//! Reservations: the engine's own record of the load it handed out, per partition.
//!
//! A selection in booked mode *reserves* the chosen rank: the booking adds the request's
//! prefill tokens, its prompt blocks and one request to that rank's live counters, so the
//! next selection's cost sees the load before the worker reports it (DESIGN.md §8,
//! REFERENCE.md §4). The counters follow Dynamo's active-sequence semantics:
//!
//! - `active_prefill_tokens`: prefill tokens of bookings not yet marked prefill-complete;
//! - `active_decode_blocks`: the *distinct* prompt blocks of the rank's bookings (a prompt
//!   block shared by several bookings on the same rank counts once: refcounted per
//!   `(rank, block hash)`), plus every booking's output blocks;
//! - `active_requests`: live bookings.
//!
//! `mark_prefill_complete` drops the prefill tokens; `free` drops everything; bookings
//! that outlive their expiry (`created + ttl`, Dynamo's current 3,600 s by default) are
//! freed by a sweep. The background sweep thread starts on the first booking, never at
//! construction (an engine can be built without a runtime and spawns nothing until used),
//! and holds only a weak reference to the table, so it ends with it.
//!
//! # Layout
//!
//! - **Shards** (64 by default): `selection_id → Booking` maps, each behind its own mutex,
//!   plus a bounded memory of recently freed ids. An id's shard is a hash of the id, so
//!   bookings of all ranks spread over all shards and no operation takes a global lock.
//! - **Rank states**: per rank, the three counters (atomics, read without any lock) and,
//!   behind the rank's mutex, the refcount of each active prompt block. The rank → state
//!   registry is an immutable map swapped whole (arc-swap) when a rank first books, so a
//!   selection reads it lock-free ([`ReservationTable::loads`]).
//!
//! # Why the counters neither go negative nor leak
//!
//! 1. *Add before publish.* [`ReservationTable::book`] adds the booking's contribution to
//!    its rank's counters while holding the id's shard lock, before inserting the booking
//!    into the shard. Whoever later finds the booking in the shard finds it after the
//!    increments (the shard mutex orders them).
//! 2. *Whoever removes, releases — exactly once.* `free`, the sweep and `remove_rank` each
//!    take the booking *out of the shard under the shard lock* and only then subtract its
//!    contribution. Removal is the linearization point: of any number of concurrent
//!    removers exactly one gets the booking, the others see it gone (and, via the
//!    recently-freed memory, why). So each contribution is subtracted at most once, only
//!    after it was added (never negative), and every removed booking is subtracted (no
//!    leak). The loom model `reservation_free_races_sweep` checks this, and its negative
//!    control (`release_before_remove`: subtract, then remove) must fail.
//! 3. *The prefill part has its own gate.* `mark_prefill_complete` flips the booking's
//!    `prefill_done` flag and subtracts the prefill tokens under the shard lock; a release
//!    subtracts them only if the flag was clear when the booking was removed (same lock).
//!    Loom model `reservation_mark_prefill_races_free`, negative control
//!    `prefill_flag_after_release`.
//! 4. *Counters are atomic read-modify-writes.* Bookings of one rank live in different
//!    shards, so two shards' critical sections update the same rank's counters at once:
//!    a load-then-store would lose one update. Loom model `reservation_book_races_free`,
//!    negative control `split_counter_rmw`.
//! 5. *Prompt-block refcounts and the decode counter change together under the rank's
//!    mutex*, so at every quiescent point `active_decode_blocks = |active prompt blocks| +
//!    Σ output blocks` ([`ReservationTable::audit`] checks this exactly).
//! 6. *A booking never lands on a removed rank's counters.* `remove_rank` takes the rank's
//!    state out of the registry, then marks it retired (under the rank's mutex), then
//!    frees the rank's bookings shard by shard. A booking that looked the state up before
//!    the removal finds the mark under the same mutex and retries with the rank's new
//!    state; so a booking racing the removal is either freed by it or counted afresh,
//!    never left on counters nothing reads or frees. Loom model
//!    `reservation_book_races_remove_rank`, negative control `book_ignores_retired`.
//!
//! As a last line of defence every subtraction is checked: an underflow (which the
//! protocol above rules out) panics in debug builds and under loom, and in release builds
//! saturates at zero and is counted ([`ReservationStats::counter_underflows`]).
//!
//! Lock order: shard, then rank. The registry's writer lock is only ever taken alone.
//!
//! # What a reader sees
//!
//! [`ReservationTable::rank_load`] reads each counter atomically but the three not as one
//! snapshot: a booking concurrent with the read may be seen in one counter and not yet in
//! another. Selection is already approximate with respect to concurrent bookings, so this
//! costs nothing; what matters is that a quiescent table reads exactly.
//!
//! # Freeing twice, and ids that come back
//!
//! Dynamo logs a warning and does nothing when a request is freed twice. kvr makes free
//! idempotent: each shard remembers its last `recently_freed_per_shard` freed ids and why
//! they went (caller, expiry, rank removal), so a second `free` returns
//! `Ok(FreeOutcome::AlreadyFreed(by))` and changes no counter; an id never booked, or
//! freed so long ago that it was forgotten, is `Err(UnknownSelectionId)`. The same memory
//! makes a late duplicate harmless: booking (or installing from a replica) an id that is
//! live *or recently freed* is `Err(DuplicateSelectionId)`, so a replica message that
//! arrives after the free cannot resurrect a booking that would then leak until expiry.

mod audit;
pub(crate) mod drag;
pub(crate) mod floor;
mod idle;
mod inner;
mod listeners;
mod loads;
mod rank;
pub(crate) mod rate;
mod shard;
mod sweep;
mod table;
mod types;

pub(crate) use floor::{FloorKind, FloorMix, FloorRead, FLOOR_WORDS};
pub use listeners::ForgetListener;
pub(crate) use listeners::{Listeners, SweepListener};
pub use loads::ActiveLoads;
pub use table::ReservationTable;
pub use types::{
    ActiveLoad, BookingOrigin, BookingRequest, BookingStatus, BookingView, FreeOutcome, FreedBy,
    Released, ReservationConfig, ReservationError, ReservationStats, MAX_PER_BOOKING,
};

#[cfg(all(test, not(loom)))]
mod tests;
