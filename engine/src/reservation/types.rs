//! The reservation table's vocabulary: selection ids, the booking request and the table's
//! configuration, and what a booking looks like from outside (its view, status, origin,
//! how it was freed, outcomes, errors, stats), plus the per-rank [`ActiveLoad`] the cost
//! reads. Plain data: no locks, no atomics.

use std::fmt;
use std::time::{Duration, Instant};

use crate::ids::RankId;

/// A selection's id: unique across the engine (DESIGN.md §2).
use crate::ids::SelectionId;

/// The largest prefill-token count, expected-output-token count or output-block count one
/// booking may carry (2^40). Far above any real request; it keeps the per-rank sums of
/// millions of bookings far from `u64` overflow, so counters are exact.
pub const MAX_PER_BOOKING: u64 = 1 << 40;

/// What a booking adds to its rank (REFERENCE.md §4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BookingRequest {
    /// The booking's id (a live or recently freed one is refused).
    pub selection_id: SelectionId,
    /// The rank booked.
    pub rank: RankId,
    /// Sequence hashes of the prompt's complete blocks, first block first. They are a hash
    /// chain, so equal hashes mean equal prefixes; a block shared with another booking on
    /// the same rank is counted once there.
    pub prompt_blocks: Vec<u64>,
    /// Prefill tokens the rank has to compute (the prompt minus what it has cached, as
    /// the caller estimates it); dropped by `mark_prefill_complete`.
    pub prefill_tokens: u64,
    /// The caller's expectation of the output length. Recorded and reported; it adds no
    /// load by itself (decode load grows through `add_output_blocks`, as in Dynamo).
    pub expected_output_tokens: u64,
    /// Time to live from booking; `None` = the table's default.
    pub ttl: Option<Duration>,
}

/// Configuration of one partition's reservation table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReservationConfig {
    /// Number of shards (rounded up to a power of two, at least 1). More shards, less
    /// contention between concurrent bookings; 64 suits a few dozen selecting threads.
    pub shards: usize,
    /// Time to live of a booking that names none (Dynamo's current expiry: 3,600 s).
    pub default_ttl: Duration,
    /// The partition's block size in tokens (used to express expected output in blocks).
    pub block_size: u32,
    /// Period of the background sweep, started on the first booking; `None` = never start
    /// one (the owner calls [`ReservationTable::sweep_expired`] itself). Dynamo checks
    /// every 30 s.
    ///
    /// [`ReservationTable::sweep_expired`]: super::ReservationTable::sweep_expired
    pub sweep_interval: Option<Duration>,
    /// How many freed ids each shard remembers, so a second `free` is answered
    /// `AlreadyFreed` rather than `UnknownSelectionId` (0 = remember none).
    pub recently_freed_per_shard: usize,
}

impl Default for ReservationConfig {
    fn default() -> Self {
        Self {
            shards: 64,
            default_ttl: Duration::from_secs(3_600),
            block_size: 16,
            sweep_interval: Some(Duration::from_secs(30)),
            recently_freed_per_shard: 256,
        }
    }
}

/// Where a booking came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BookingOrigin {
    /// Booked by a selection of this engine.
    Local,
    /// Received from a replica peer (another router instance sharing the workers):
    /// [`ReservationTable::install_replica_booking`].
    ///
    /// [`ReservationTable::install_replica_booking`]: super::ReservationTable::install_replica_booking
    Replica,
}

/// Who freed a booking.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FreedBy {
    /// `free` was called.
    Caller,
    /// It passed its expiry and a sweep freed it.
    Expired,
    /// Its rank left the partition (`remove_rank`).
    RankRemoved,
}

/// What a table knows about an id ([`ReservationTable::status`]).
///
/// [`ReservationTable::status`]: super::ReservationTable::status
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BookingStatus {
    /// Booked and not freed; where the booking came from.
    Live(BookingOrigin),
    /// Freed, and still remembered.
    Freed(FreedBy),
}

/// The engine's live bookings on one rank: the booking terms of the cost function.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ActiveLoad {
    /// Prefill tokens of bookings not yet marked prefill-complete.
    pub active_prefill_tokens: u64,
    /// Distinct prompt blocks of the rank's bookings plus their output blocks.
    pub active_decode_blocks: u64,
    /// Live bookings on the rank.
    pub active_requests: u64,
}

impl ActiveLoad {
    /// No live booking load on the rank.
    pub fn is_zero(&self) -> bool {
        *self == ActiveLoad::default()
    }
}

/// A booking as the table holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BookingView {
    /// The booking's id.
    pub selection_id: SelectionId,
    /// The rank it is booked on.
    pub rank: RankId,
    /// Where it came from.
    pub origin: BookingOrigin,
    /// Prompt blocks of the booking.
    pub prompt_blocks: usize,
    /// Prompt blocks this booking made active on its rank when it was booked (the ones no
    /// other live booking on the rank held): what it added to `active_decode_blocks`.
    pub new_prompt_blocks: u64,
    /// Prefill tokens booked (counted on the rank until prefill completes).
    pub prefill_tokens: u64,
    /// Whether `mark_prefill_complete` has dropped its prefill tokens from the rank.
    pub prefill_complete: bool,
    /// The caller's expected output length, tokens (recorded, adds no load).
    pub expected_output_tokens: u64,
    /// `ceil(expected_output_tokens / block_size)`.
    pub expected_output_blocks: u64,
    /// Output blocks added so far, counted in the rank's decode load.
    pub output_blocks: u64,
    /// When the table booked it.
    pub created: Instant,
    /// `created + ttl`; `None` if that is beyond what `Instant` can represent (never).
    pub expires_at: Option<Instant>,
    /// The rank's load as read right after the operation (including this booking).
    pub rank_load: ActiveLoad,
}

/// What one free released from its rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Released {
    /// The rank the booking was on.
    pub rank: RankId,
    /// Prefill tokens subtracted (0 if the booking was already prefill-complete).
    pub prefill_tokens: u64,
    /// Prompt blocks that became inactive on the rank (no other booking held them).
    pub prompt_blocks_released: u64,
    /// Output blocks subtracted.
    pub output_blocks: u64,
}

/// The answer to [`ReservationTable::free`].
///
/// [`ReservationTable::free`]: super::ReservationTable::free
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FreeOutcome {
    /// This call freed the booking.
    Freed(Released),
    /// Someone freed it before (within the shard's recently-freed memory); nothing changed.
    AlreadyFreed(FreedBy),
}

/// Errors of the reservation table; each is a caller's mistake or a race it lost, never a
/// corrupted table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReservationError {
    /// The id is live, or was freed recently: booking it again is refused, not an
    /// overwrite.
    DuplicateSelectionId(SelectionId),
    /// No live booking has this id, and none was freed recently.
    UnknownSelectionId(SelectionId),
    /// The booking was freed already (so output blocks cannot be added to it).
    AlreadyFreed(SelectionId, FreedBy),
    /// A count above [`MAX_PER_BOOKING`].
    TooLarge(SelectionId, &'static str),
}

impl fmt::Display for ReservationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DuplicateSelectionId(id) => {
                write!(
                    f,
                    "selection id {id} is already booked or was freed recently"
                )
            }
            Self::UnknownSelectionId(id) => write!(f, "unknown selection id {id}"),
            Self::AlreadyFreed(id, by) => write!(f, "selection id {id} was already freed ({by:?})"),
            Self::TooLarge(id, what) => {
                write!(f, "selection id {id}: {what} exceeds {MAX_PER_BOOKING}")
            }
        }
    }
}

impl std::error::Error for ReservationError {}

/// Counters about the table itself.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReservationStats {
    /// Live bookings.
    pub bookings: usize,
    /// Ranks with a counter set: every registered rank of a partition (made as its worker
    /// registers), and any other rank that booked; a removed rank leaves.
    pub tracked_ranks: usize,
    /// Bookings freed by sweeps so far.
    pub expired_total: u64,
    /// Subtractions that would have taken a counter below zero (and saturated instead).
    /// The protocol makes this impossible; anything but 0 is a bug.
    pub counter_underflows: u64,
    /// Whether the background sweep thread was started.
    pub sweeper_started: bool,
    /// The learned prefill rate per rank, tokens/s (`None` until a few prefills were
    /// observed; see [`ReservationTable::prefill_rate`]).
    ///
    /// [`ReservationTable::prefill_rate`]: super::ReservationTable::prefill_rate
    pub prefill_rate: Option<f64>,
    /// Prefill completions observed by the rate estimator.
    pub prefill_rate_observations: u64,
    /// The learned decode drag, seconds of time to first token per decode block a rank
    /// holds (`None` until enough prefills were observed on ranks of different loads; see
    /// [`ReservationTable::decode_drag`]).
    ///
    /// [`ReservationTable::decode_drag`]: super::ReservationTable::decode_drag
    pub decode_drag: Option<f64>,
    /// Prefill completions observed by the drag estimator.
    pub decode_drag_observations: u64,
}
