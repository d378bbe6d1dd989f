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

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::BuildHasherDefault;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::index::RankId;
#[cfg(not(loom))]
use crate::sync::atomic::AtomicBool;
use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
use crate::sync::faults;
use crate::sync::{Arc, Mutex, Snapshot, SnapshotGuard};

/// A selection's id: unique across the engine (DESIGN.md §2).
pub type SelectionId = u64;

/// The largest prefill-token count, expected-output-token count or output-block count one
/// booking may carry (2^40). Far above any real request; it keeps the per-rank sums of
/// millions of bookings far from `u64` overflow, so counters are exact.
pub const MAX_PER_BOOKING: u64 = 1 << 40;

/// What a booking adds to its rank (REFERENCE.md §4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BookingRequest {
    pub selection_id: SelectionId,
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BookingStatus {
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
    pub fn is_zero(&self) -> bool {
        *self == ActiveLoad::default()
    }
}

/// A booking as the table holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BookingView {
    pub selection_id: SelectionId,
    pub rank: RankId,
    pub origin: BookingOrigin,
    /// Prompt blocks of the booking.
    pub prompt_blocks: usize,
    /// Prompt blocks this booking made active on its rank when it was booked (the ones no
    /// other live booking on the rank held): what it added to `active_decode_blocks`.
    pub new_prompt_blocks: u64,
    pub prefill_tokens: u64,
    pub prefill_complete: bool,
    pub expected_output_tokens: u64,
    /// `ceil(expected_output_tokens / block_size)`.
    pub expected_output_blocks: u64,
    pub output_blocks: u64,
    pub created: Instant,
    /// `created + ttl`; `None` if that is beyond what `Instant` can represent (never).
    pub expires_at: Option<Instant>,
    /// The rank's load as read right after the operation (including this booking).
    pub rank_load: ActiveLoad,
}

/// What one free released from its rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Released {
    pub rank: RankId,
    /// Prefill tokens subtracted (0 if the booking was already prefill-complete).
    pub prefill_tokens: u64,
    /// Prompt blocks that became inactive on the rank (no other booking held them).
    pub prompt_blocks_released: u64,
    /// Output blocks subtracted.
    pub output_blocks: u64,
}

/// The answer to [`ReservationTable::free`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeOutcome {
    /// This call freed the booking.
    Freed(Released),
    /// Someone freed it before (within the shard's recently-freed memory); nothing changed.
    AlreadyFreed(FreedBy),
}

/// Errors of the reservation table; each is a caller's mistake or a race it lost, never a
/// corrupted table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReservationStats {
    /// Live bookings.
    pub bookings: usize,
    /// Ranks with a counter set (ranks that ever booked and were not removed).
    pub tracked_ranks: usize,
    /// Bookings freed by sweeps so far.
    pub expired_total: u64,
    /// Subtractions that would have taken a counter below zero (and saturated instead).
    /// The protocol makes this impossible; anything but 0 is a bug.
    pub counter_underflows: u64,
    /// Whether the background sweep thread was started.
    pub sweeper_started: bool,
}

// ---------------------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------------------

/// Deterministic on purpose (loom replays executions and needs the same map layout); the
/// index's one cheap hasher for 64-bit keys (selection ids may be sequential; block hashes
/// are already random).
type Mix = crate::index::RankHasher;
type MixMap<K, V> = HashMap<K, V, BuildHasherDefault<Mix>>;
type RankMap = MixMap<RankId, Arc<RankState>>;

/// SplitMix64's finalizer: picks the shard from the id's well-mixed bits.
#[inline]
fn shard_hash(id: SelectionId) -> u64 {
    let mut z = id.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One live booking.
#[derive(Clone)]
struct Booking {
    /// The counter set the booking was added to (kept, not looked up again, so a release
    /// always subtracts from the very counters it added to, even if the rank was removed
    /// and re-created meanwhile).
    rank: Arc<RankState>,
    origin: BookingOrigin,
    prompt_blocks: Vec<u64>,
    new_prompt_blocks: u64,
    prefill_tokens: u64,
    prefill_done: bool,
    expected_output_tokens: u64,
    output_blocks: u64,
    created: Instant,
    expires_at: Option<Instant>,
}

/// A rank's counters (lock-free reads) and prompt-block refcounts (behind its mutex).
struct RankState {
    rank: RankId,
    counters: CachePadded<Counters>,
    blocks: Mutex<RankBlocks>,
}

#[derive(Default)]
struct Counters {
    prefill_tokens: AtomicU64,
    decode_blocks: AtomicU64,
    requests: AtomicU64,
    /// Distinct active prompt blocks (= the refcount map's length), so a rank with none
    /// answers `new_blocks_not_active` without its lock.
    prompt_blocks: AtomicU64,
}

#[derive(Default)]
struct RankBlocks {
    /// Active prompt block → number of live bookings on this rank that hold it (≥ 1;
    /// an entry is removed when it reaches 0).
    refs: MixMap<u64, u64>,
    /// Set (under this mutex) when the rank is removed: a booking that finds it set
    /// retries with the rank's new state, so none is added to a dead counter set.
    retired: bool,
}

impl RankBlocks {
    /// Gives memory back once the rank has gone (mostly) idle, so a burst does not pin
    /// its high-water mark forever.
    fn maybe_shrink(&mut self) {
        let cap = self.refs.capacity();
        if self.refs.is_empty() {
            if cap > 0 {
                self.refs = MixMap::default();
            }
        } else if cap > 256 && self.refs.len() * 8 < cap {
            self.refs.shrink_to(self.refs.len() * 2);
        }
    }
}

impl RankState {
    fn new(rank: RankId) -> Self {
        Self {
            rank,
            counters: CachePadded::new(Counters::default()),
            blocks: Mutex::new(RankBlocks::default()),
        }
    }

    fn load(&self) -> ActiveLoad {
        ActiveLoad {
            active_prefill_tokens: self.counters.prefill_tokens.load(Ordering::Relaxed),
            active_decode_blocks: self.counters.decode_blocks.load(Ordering::Relaxed),
            active_requests: self.counters.requests.load(Ordering::Relaxed),
        }
    }

    fn new_blocks_not_active(&self, blocks: &[u64]) -> u64 {
        if blocks.is_empty() || self.counters.prompt_blocks.load(Ordering::Relaxed) == 0 {
            return blocks.len() as u64;
        }
        let b = self.blocks.lock();
        blocks.iter().filter(|h| !b.refs.contains_key(h)).count() as u64
    }

    fn new_blocks_not_active_chain(&self, chain: &[u64]) -> u64 {
        if chain.is_empty() || self.counters.prompt_blocks.load(Ordering::Relaxed) == 0 {
            return chain.len() as u64;
        }
        let b = self.blocks.lock();
        let active = |h: &u64| b.refs.contains_key(h);
        // The common answers take one lookup each: the first block is not active (nothing
        // of the chain is), or the last one is (all of it is).
        let n = chain.len();
        if !active(&chain[0]) {
            return n as u64;
        }
        if active(&chain[n - 1]) {
            return 0;
        }
        (n - 1 - chain[1..n - 1].partition_point(active)) as u64
    }
}

/// The bounded memory of recently freed ids of one shard (FIFO eviction).
#[derive(Default)]
struct RecentlyFreed {
    order: VecDeque<SelectionId>,
    by: MixMap<SelectionId, FreedBy>,
}

impl RecentlyFreed {
    fn record(&mut self, id: SelectionId, by: FreedBy, cap: usize) {
        if cap == 0 {
            return;
        }
        if self.by.insert(id, by).is_none() {
            self.order.push_back(id);
            if self.order.len() > cap {
                if let Some(old) = self.order.pop_front() {
                    self.by.remove(&old);
                }
            }
        }
    }

    fn get(&self, id: SelectionId) -> Option<FreedBy> {
        self.by.get(&id).copied()
    }
}

#[derive(Default)]
struct Shard {
    live: MixMap<SelectionId, Booking>,
    freed: RecentlyFreed,
    /// No live booking of this shard expires before this (a lower bound, exact after a
    /// sweep); `None` = none expires. Lets a sweep skip a shard without scanning it.
    earliest_expiry: Option<Instant>,
}

/// Everything but the sweeper handle; the sweep thread holds a weak reference to it.
struct Inner {
    config: ReservationConfig,
    mask: usize,
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    ranks: Snapshot<RankMap>,
    /// Serializes registry writers (copy, insert/remove, swap). Never held with another lock.
    ranks_write: Mutex<()>,
    expired_total: AtomicU64,
    underflows: AtomicU64,
    /// Raised by the table's `Drop` so the sweep thread exits at once.
    #[cfg(not(loom))]
    shutdown: AtomicBool,
    /// Told the id of every booking freed by the table itself (expiry, rank removal), so
    /// an index of ids kept outside the table (the engine's) can drop it too.
    on_forget: Option<ForgetListener>,
    /// Told the id of every booking that ends, however (free, expiry, rank removal):
    /// what a booking owns outside the table (a session lease) is released with it.
    on_end: Option<ForgetListener>,
    /// Called with `now` at the end of every expiry sweep, with no lock of the table
    /// held: what else expires on the table's clock (an approximate index's records)
    /// rides on its sweep instead of needing a thread of its own.
    on_sweep: Option<SweepListener>,
}

/// See [`ReservationTable::with_forget_listener`].
pub type ForgetListener = std::sync::Arc<dyn Fn(SelectionId) + Send + Sync>;

/// See [`Listeners::sweep`].
pub type SweepListener = std::sync::Arc<dyn Fn(Instant) + Send + Sync>;

/// What a table tells its owner (see [`ReservationTable::with_listeners`]).
#[derive(Clone, Default)]
pub struct Listeners {
    /// Told the id of every booking the table frees on its own (expiry, rank removal).
    pub forget: Option<ForgetListener>,
    /// Told the id of every booking that ends, however it ends.
    pub end: Option<ForgetListener>,
    /// Called with the sweep's `now` after every expiry sweep (the background one and
    /// [`ReservationTable::sweep_expired`]).
    pub sweep: Option<SweepListener>,
}

/// Adds to a counter (an atomic read-modify-write; see the module docs, point 4).
#[inline]
fn add(counter: &AtomicU64, n: u64) {
    if n == 0 {
        return;
    }
    #[cfg(loom)]
    if faults::get().split_counter_rmw {
        let v = counter.load(Ordering::Relaxed);
        counter.store(v + n, Ordering::Relaxed);
        return;
    }
    counter.fetch_add(n, Ordering::Relaxed);
}

impl Inner {
    fn new(mut config: ReservationConfig) -> Self {
        let shards = config.shards.clamp(1, 1 << 16).next_power_of_two();
        config.shards = shards;
        Self {
            mask: shards - 1,
            shards: (0..shards)
                .map(|_| CachePadded::new(Mutex::new(Shard::default())))
                .collect(),
            ranks: Snapshot::new(RankMap::default()),
            ranks_write: Mutex::new(()),
            expired_total: AtomicU64::new(0),
            underflows: AtomicU64::new(0),
            #[cfg(not(loom))]
            shutdown: AtomicBool::new(false),
            on_forget: None,
            on_end: None,
            on_sweep: None,
            config,
        }
    }

    #[inline]
    fn shard(&self, id: SelectionId) -> &Mutex<Shard> {
        &self.shards[shard_hash(id) as usize & self.mask]
    }

    /// Subtracts from a counter, never below zero (module docs, last paragraph).
    #[inline]
    fn sub(&self, counter: &AtomicU64, n: u64, what: &'static str) {
        if n == 0 {
            return;
        }
        #[cfg(loom)]
        if faults::get().split_counter_rmw {
            let v = counter.load(Ordering::Relaxed);
            if v < n {
                self.underflow(what, v, n);
            }
            counter.store(v.saturating_sub(n), Ordering::Relaxed);
            return;
        }
        let prev = counter
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(n))
            })
            .unwrap_or_else(|v| v);
        if prev < n {
            self.underflow(what, prev, n);
        }
    }

    #[cold]
    fn underflow(&self, what: &'static str, have: u64, sub: u64) {
        self.underflows.fetch_add(1, Ordering::Relaxed);
        if cfg!(any(debug_assertions, loom)) {
            panic!("booking counter {what} would go negative: {have} - {sub}");
        }
    }

    /// The rank's counter set, created (and published in a new registry snapshot) on the
    /// rank's first booking.
    fn rank_state(&self, rank: RankId) -> Arc<RankState> {
        if let Some(s) = self.ranks.guard().get(&rank) {
            return s.clone();
        }
        let _w = self.ranks_write.lock();
        let cur = self.ranks.load();
        if let Some(s) = cur.get(&rank) {
            return s.clone();
        }
        let state = Arc::new(RankState::new(rank));
        let mut next = (*cur).clone();
        next.insert(rank, state.clone());
        self.ranks.store(next);
        state
    }

    fn insert(
        &self,
        req: BookingRequest,
        now: Instant,
        origin: BookingOrigin,
    ) -> Result<BookingView, ReservationError> {
        let id = req.selection_id;
        if req.prefill_tokens > MAX_PER_BOOKING {
            return Err(ReservationError::TooLarge(id, "prefill_tokens"));
        }
        if req.expected_output_tokens > MAX_PER_BOOKING {
            return Err(ReservationError::TooLarge(id, "expected_output_tokens"));
        }
        let expires_at = now.checked_add(req.ttl.unwrap_or(self.config.default_ttl));
        let shard = self.shard(id);
        let mut prompt_blocks = req.prompt_blocks;
        loop {
            let state = self.rank_state(req.rank);
            let mut g = shard.lock();
            if g.live.contains_key(&id) || g.freed.get(id).is_some() {
                return Err(ReservationError::DuplicateSelectionId(id));
            }
            // Point 1 of the module docs: counters first, then the booking, all under the
            // shard lock.
            let new_prompt_blocks = {
                let mut b = state.blocks.lock();
                if b.retired {
                    // The rank was removed after we looked it up; its registry entry is
                    // gone, so the next lookup creates (or finds) the new state.
                    continue;
                }
                let mut new = 0u64;
                for &h in &prompt_blocks {
                    let c = b.refs.entry(h).or_insert(0);
                    if *c == 0 {
                        new += 1;
                    }
                    *c += 1;
                }
                state
                    .counters
                    .prompt_blocks
                    .store(b.refs.len() as u64, Ordering::Relaxed);
                add(&state.counters.decode_blocks, new);
                new
            };
            add(&state.counters.prefill_tokens, req.prefill_tokens);
            add(&state.counters.requests, 1);
            let booking = Booking {
                rank: state,
                origin,
                prompt_blocks: std::mem::take(&mut prompt_blocks),
                new_prompt_blocks,
                prefill_tokens: req.prefill_tokens,
                prefill_done: false,
                expected_output_tokens: req.expected_output_tokens,
                output_blocks: 0,
                created: now,
                expires_at,
            };
            let view = self.view(id, &booking);
            if let Some(e) = expires_at {
                g.earliest_expiry = Some(g.earliest_expiry.map_or(e, |x| x.min(e)));
            }
            g.live.insert(id, booking);
            return Ok(view);
        }
    }

    fn view(&self, id: SelectionId, b: &Booking) -> BookingView {
        BookingView {
            selection_id: id,
            rank: b.rank.rank,
            origin: b.origin,
            prompt_blocks: b.prompt_blocks.len(),
            new_prompt_blocks: b.new_prompt_blocks,
            prefill_tokens: b.prefill_tokens,
            prefill_complete: b.prefill_done,
            expected_output_tokens: b.expected_output_tokens,
            expected_output_blocks: b
                .expected_output_tokens
                .div_ceil(u64::from(self.config.block_size.max(1))),
            output_blocks: b.output_blocks,
            created: b.created,
            expires_at: b.expires_at,
            rank_load: b.rank.load(),
        }
    }

    /// Subtracts a booking that the caller has taken out of its shard (point 2).
    fn release(&self, b: &Booking) -> Released {
        let st = &b.rank;
        let mut gone = 0u64;
        if !b.prompt_blocks.is_empty() {
            let mut rb = st.blocks.lock();
            for h in &b.prompt_blocks {
                match rb.refs.get_mut(h) {
                    Some(c) if *c > 1 => *c -= 1,
                    Some(_) => {
                        rb.refs.remove(h);
                        gone += 1;
                    }
                    None => self.underflow("prompt block refcount", 0, 1),
                }
            }
            rb.maybe_shrink();
            st.counters
                .prompt_blocks
                .store(rb.refs.len() as u64, Ordering::Relaxed);
            self.sub(&st.counters.decode_blocks, gone, "active_decode_blocks");
        }
        self.sub(
            &st.counters.decode_blocks,
            b.output_blocks,
            "active_decode_blocks",
        );
        let prefill = if b.prefill_done { 0 } else { b.prefill_tokens };
        self.sub(
            &st.counters.prefill_tokens,
            prefill,
            "active_prefill_tokens",
        );
        self.sub(&st.counters.requests, 1, "active_requests");
        Released {
            rank: st.rank,
            prefill_tokens: prefill,
            prompt_blocks_released: gone,
            output_blocks: b.output_blocks,
        }
    }

    /// Takes `id` out of its locked shard, remembering why; the caller releases it after
    /// dropping the lock.
    fn take(&self, g: &mut Shard, id: SelectionId, by: FreedBy) -> Option<Booking> {
        let b = g.live.remove(&id)?;
        g.freed.record(id, by, self.config.recently_freed_per_shard);
        Some(b)
    }

    fn free(&self, id: SelectionId) -> Result<FreeOutcome, ReservationError> {
        #[cfg(loom)]
        if faults::get().release_before_remove {
            return self.free_releasing_before_remove(id);
        }
        let mut g = self.shard(id).lock();
        match self.take(&mut g, id, FreedBy::Caller) {
            Some(b) => {
                drop(g);
                Ok(FreeOutcome::Freed(self.release(&b)))
            }
            None => match g.freed.get(id) {
                Some(by) => Ok(FreeOutcome::AlreadyFreed(by)),
                None => Err(ReservationError::UnknownSelectionId(id)),
            },
        }
    }

    /// The negative control of point 2: subtract a booking still in its shard, then
    /// remove it. A sweep in between takes and releases it too.
    #[cfg(loom)]
    fn free_releasing_before_remove(
        &self,
        id: SelectionId,
    ) -> Result<FreeOutcome, ReservationError> {
        let peeked = self.shard(id).lock().live.get(&id).cloned();
        let Some(b) = peeked else {
            return match self.shard(id).lock().freed.get(id) {
                Some(by) => Ok(FreeOutcome::AlreadyFreed(by)),
                None => Err(ReservationError::UnknownSelectionId(id)),
            };
        };
        let released = self.release(&b);
        let mut g = self.shard(id).lock();
        self.take(&mut g, id, FreedBy::Caller);
        Ok(FreeOutcome::Freed(released))
    }

    fn mark_prefill_complete(&self, id: SelectionId) -> Result<(), ReservationError> {
        let mut g = self.shard(id).lock();
        let Some(b) = g.live.get_mut(&id) else {
            // A freed booking holds no prefill tokens: the state the call asks for holds.
            return match g.freed.get(id) {
                Some(_) => Ok(()),
                None => Err(ReservationError::UnknownSelectionId(id)),
            };
        };
        if b.prefill_done {
            return Ok(());
        }
        #[cfg(loom)]
        if faults::get().prefill_flag_after_release {
            // Negative control of point 3: subtract outside the lock, flag afterwards.
            let (st, tokens) = (b.rank.clone(), b.prefill_tokens);
            drop(g);
            self.sub(&st.counters.prefill_tokens, tokens, "active_prefill_tokens");
            if let Some(b) = self.shard(id).lock().live.get_mut(&id) {
                b.prefill_done = true;
            }
            return Ok(());
        }
        b.prefill_done = true;
        let (st, tokens) = (&b.rank, b.prefill_tokens);
        self.sub(&st.counters.prefill_tokens, tokens, "active_prefill_tokens");
        Ok(())
    }

    fn add_output_blocks(&self, id: SelectionId, n: u64) -> Result<(), ReservationError> {
        let mut g = self.shard(id).lock();
        let Some(b) = g.live.get_mut(&id) else {
            return match g.freed.get(id) {
                Some(by) => Err(ReservationError::AlreadyFreed(id, by)),
                None => Err(ReservationError::UnknownSelectionId(id)),
            };
        };
        let total = b
            .output_blocks
            .checked_add(n)
            .filter(|t| *t <= MAX_PER_BOOKING)
            .ok_or(ReservationError::TooLarge(id, "output_blocks"))?;
        b.output_blocks = total;
        add(&b.rank.counters.decode_blocks, n);
        Ok(())
    }

    /// Tells the listener (if any) about bookings the table freed on its own. Called with
    /// no lock held.
    fn forget(&self, ids: &[SelectionId]) {
        if let Some(f) = &self.on_forget {
            for &id in ids {
                f(id);
            }
        }
        self.ended(ids);
    }

    fn ended(&self, ids: &[SelectionId]) {
        if let Some(f) = &self.on_end {
            for &id in ids {
                f(id);
            }
        }
    }

    fn sweep_expired(&self, now: Instant) -> usize {
        let mut expired: Vec<Booking> = Vec::new();
        let mut ids: Vec<SelectionId> = Vec::new();
        let mut total = 0;
        for shard in self.shards.iter() {
            let mut g = shard.lock();
            match g.earliest_expiry {
                Some(e) if e <= now => {}
                _ => continue,
            }
            ids.clear();
            let mut next: Option<Instant> = None;
            for (id, b) in &g.live {
                match b.expires_at {
                    Some(e) if e <= now => ids.push(*id),
                    Some(e) => next = Some(next.map_or(e, |x| x.min(e))),
                    None => {}
                }
            }
            g.earliest_expiry = next;
            for &id in &ids {
                if let Some(b) = self.take(&mut g, id, FreedBy::Expired) {
                    expired.push(b);
                }
            }
            drop(g);
            total += expired.len();
            for b in expired.drain(..) {
                self.release(&b);
            }
            self.forget(&ids);
        }
        if total > 0 {
            self.expired_total
                .fetch_add(total as u64, Ordering::Relaxed);
        }
        if let Some(f) = &self.on_sweep {
            f(now);
        }
        total
    }

    fn remove_rank(&self, rank: RankId) -> usize {
        let removed = {
            let _w = self.ranks_write.lock();
            let cur = self.ranks.load();
            match cur.get(&rank) {
                None => None,
                Some(state) => {
                    let state = state.clone();
                    let mut next = (*cur).clone();
                    next.remove(&rank);
                    self.ranks.store(next);
                    Some(state)
                }
            }
        };
        let Some(state) = removed else { return 0 };
        // Out of the registry first, then retired: a booking that sees the flag finds the
        // registry already without the old state.
        state.blocks.lock().retired = true;
        let mut freed = 0;
        let mut taken: Vec<Booking> = Vec::new();
        let mut ids: Vec<SelectionId> = Vec::new();
        for shard in self.shards.iter() {
            let mut g = shard.lock();
            ids.clear();
            ids.extend(
                g.live
                    .iter()
                    .filter(|(_, b)| Arc::ptr_eq(&b.rank, &state))
                    .map(|(id, _)| *id),
            );
            for &id in &ids {
                if let Some(b) = self.take(&mut g, id, FreedBy::RankRemoved) {
                    taken.push(b);
                }
            }
            drop(g);
            freed += taken.len();
            for b in taken.drain(..) {
                self.release(&b);
            }
            self.forget(&ids);
        }
        freed
    }

    fn audit(&self) -> Result<(), String> {
        struct Expect {
            state: Arc<RankState>,
            load: ActiveLoad,
            refs: MixMap<u64, u64>,
        }
        let guards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        let registry = self.ranks.load();
        let mut expect: Vec<Expect> = registry
            .values()
            .map(|s| Expect {
                state: s.clone(),
                load: ActiveLoad::default(),
                refs: MixMap::default(),
            })
            .collect();
        for g in &guards {
            for b in g.live.values() {
                let i = match expect.iter().position(|e| Arc::ptr_eq(&e.state, &b.rank)) {
                    Some(i) => i,
                    None => {
                        expect.push(Expect {
                            state: b.rank.clone(),
                            load: ActiveLoad::default(),
                            refs: MixMap::default(),
                        });
                        expect.len() - 1
                    }
                };
                let e = &mut expect[i];
                e.load.active_requests += 1;
                if !b.prefill_done {
                    e.load.active_prefill_tokens += b.prefill_tokens;
                }
                e.load.active_decode_blocks += b.output_blocks;
                for &h in &b.prompt_blocks {
                    *e.refs.entry(h).or_insert(0) += 1;
                }
            }
        }
        for e in &mut expect {
            e.load.active_decode_blocks += e.refs.len() as u64;
            let blocks = e.state.blocks.lock();
            if blocks.refs != e.refs {
                return Err(format!(
                    "rank {}: prompt-block refcounts differ from the live bookings' ({} vs {} blocks)",
                    e.state.rank,
                    blocks.refs.len(),
                    e.refs.len()
                ));
            }
            let prompt = e.state.counters.prompt_blocks.load(Ordering::Relaxed);
            if prompt != e.refs.len() as u64 {
                return Err(format!(
                    "rank {}: distinct prompt blocks counter {prompt} != {}",
                    e.state.rank,
                    e.refs.len()
                ));
            }
            let have = e.state.load();
            if have != e.load {
                return Err(format!(
                    "rank {}: counters {have:?} != recomputed {:?}",
                    e.state.rank, e.load
                ));
            }
        }
        let under = self.underflows.load(Ordering::Relaxed);
        if under != 0 {
            return Err(format!("{under} counter underflows"));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// The table
// ---------------------------------------------------------------------------------------

/// One partition's bookings: sharded by selection id, with live per-rank counters.
///
/// All methods take `&self` and may be called from any number of threads. The sweep
/// thread (if [`ReservationConfig::sweep_interval`] is set) starts on the first booking and
/// ends when the table is dropped.
pub struct ReservationTable {
    inner: Arc<Inner>,
    #[cfg(not(loom))]
    sweeper: SweeperSlot,
}

/// The lazily started sweep thread.
#[cfg(not(loom))]
#[derive(Default)]
struct SweeperSlot {
    /// Raised by the one booking that starts the thread; read on every booking (one
    /// relaxed load once it is set).
    started: AtomicBool,
    /// Threads spawned by this table: 0 or 1.
    spawned: AtomicUsize,
    handle: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Set by the thread as it exits (tests observe the end of the thread with it).
    exited: Arc<AtomicBool>,
}

/// Raises a flag when dropped: the sweep thread's exit, however it exits.
#[cfg(not(loom))]
struct RaiseOnDrop(Arc<AtomicBool>);

#[cfg(not(loom))]
impl Drop for RaiseOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

impl fmt::Debug for ReservationTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReservationTable")
            .field("config", &self.inner.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl ReservationTable {
    /// A table with no bookings. Spawns nothing and allocates only the shards.
    pub fn new(config: ReservationConfig) -> Self {
        Self::with_listeners(config, Listeners::default())
    }

    /// A table that calls `f(id)` for every booking it frees on its own (expiry sweep,
    /// [`ReservationTable::remove_rank`]), after releasing it and with no lock held; the
    /// engine uses it to drop such ids from its selection-id index.
    pub fn with_forget_listener(config: ReservationConfig, f: ForgetListener) -> Self {
        Self::with_listeners(
            config,
            Listeners {
                forget: Some(f),
                ..Listeners::default()
            },
        )
    }

    /// A table with listeners: a forget listener (see
    /// [`ReservationTable::with_forget_listener`]), an end listener, told `id` whenever a
    /// booking ends however it ends (a free by anyone, expiry, rank removal), and a sweep
    /// listener; each is called after the table's work and with no lock of it held.
    pub fn with_listeners(config: ReservationConfig, listeners: Listeners) -> Self {
        let mut inner = Inner::new(config);
        inner.on_forget = listeners.forget;
        inner.on_end = listeners.end;
        inner.on_sweep = listeners.sweep;
        Self {
            inner: Arc::new(inner),
            #[cfg(not(loom))]
            sweeper: SweeperSlot::default(),
        }
    }

    /// The configuration in effect (`shards` rounded up to a power of two).
    pub fn config(&self) -> &ReservationConfig {
        &self.inner.config
    }

    /// Books `req` on its rank at time `now`: adds its prefill tokens, its prompt blocks
    /// not already active on the rank, and one request. Expires at `now + ttl`.
    ///
    /// An id that is live or was freed recently is refused
    /// ([`ReservationError::DuplicateSelectionId`]); nothing changes then. Starts the
    /// background sweep on the table's first booking.
    pub fn book(&self, req: BookingRequest, now: Instant) -> Result<BookingView, ReservationError> {
        let view = self.inner.insert(req, now, BookingOrigin::Local)?;
        #[cfg(not(loom))]
        self.sweep_on_first_booking();
        Ok(view)
    }

    /// Installs a booking a replica peer made (another router instance booking the same
    /// workers): exactly as [`book`](Self::book), so its load counts in this table's
    /// counters, but flagged [`BookingOrigin::Replica`].
    ///
    /// Replica bookings are found by the engine's partition scan rather than its
    /// selection-id → partition index (DESIGN.md §8). `now` is this process's clock: a
    /// peer's instant means nothing here, so the caller converts the peer's remaining
    /// lifetime into `req.ttl`. Because freed ids are remembered, a replica message that
    /// arrives after the booking was freed is refused as a duplicate instead of
    /// resurrecting it.
    pub fn install_replica_booking(
        &self,
        req: BookingRequest,
        now: Instant,
    ) -> Result<BookingView, ReservationError> {
        let view = self.inner.insert(req, now, BookingOrigin::Replica)?;
        #[cfg(not(loom))]
        self.sweep_on_first_booking();
        Ok(view)
    }

    /// Drops the booking's prefill tokens (its prefill ran). Idempotent: a second call, or
    /// a call on a recently freed booking, is `Ok` and changes nothing.
    pub fn mark_prefill_complete(&self, id: SelectionId) -> Result<(), ReservationError> {
        self.inner.mark_prefill_complete(id)
    }

    /// Adds `n` output blocks to the booking's decode load (its total is in
    /// [`get`](Self::get)). A freed booking is [`ReservationError::AlreadyFreed`] (the
    /// blocks would count nowhere).
    pub fn add_output_blocks(&self, id: SelectionId, n: u64) -> Result<(), ReservationError> {
        self.inner.add_output_blocks(id, n)
    }

    /// Frees the booking: drops its prefill tokens (if not yet complete), its prompt blocks
    /// no other booking on the rank holds, its output blocks and the request.
    ///
    /// Freeing twice does not double-decrement: the second call returns
    /// `Ok(FreeOutcome::AlreadyFreed(by))` while the shard remembers the id (Dynamo logs a
    /// warning and does nothing; kvr tells the caller who freed it). An id never booked or
    /// long forgotten is `Err(ReservationError::UnknownSelectionId(id))`.
    pub fn free(&self, id: SelectionId) -> Result<FreeOutcome, ReservationError> {
        let r = self.inner.free(id);
        if let Ok(FreeOutcome::Freed(_)) = &r {
            self.inner.ended(&[id]);
        }
        r
    }

    /// Ids of the live bookings (a moment's view; for bulk clean-up, not the hot path).
    pub fn live_ids(&self) -> Vec<SelectionId> {
        let mut ids = Vec::new();
        for shard in self.inner.shards.iter() {
            ids.extend(shard.lock().live.keys().copied());
        }
        ids
    }

    /// Whether a booking with this id is live.
    pub fn contains(&self, id: SelectionId) -> bool {
        self.inner.shard(id).lock().live.contains_key(&id)
    }

    /// Whether this table knows the id: live (and from where), or recently freed (and by
    /// whom). Lets an owner with several tables route a repeated `free` or
    /// `mark_prefill_complete` to the table that remembers the id, so it is answered
    /// idempotently instead of as unknown.
    pub fn status(&self, id: SelectionId) -> Option<BookingStatus> {
        let g = self.inner.shard(id).lock();
        match g.live.get(&id) {
            Some(b) => Some(BookingStatus::Live(b.origin)),
            None => g.freed.get(id).map(BookingStatus::Freed),
        }
    }

    /// The live booking with this id.
    pub fn get(&self, id: SelectionId) -> Option<BookingView> {
        let g = self.inner.shard(id).lock();
        g.live.get(&id).map(|b| self.inner.view(id, b))
    }

    /// The engine's live bookings on `rank` (zero for a rank with none). Lock-free: one
    /// registry snapshot load and three atomic loads.
    pub fn rank_load(&self, rank: RankId) -> ActiveLoad {
        self.loads().get(rank)
    }

    /// The per-rank counters as of now, for one selection: load once, then read any number
    /// of ranks without touching the shared registry again.
    pub fn loads(&self) -> ActiveLoads {
        ActiveLoads {
            ranks: self.inner.ranks.guard(),
        }
    }

    /// How many of `prompt_blocks` are not active on `rank`: what booking the request there
    /// would add to `active_decode_blocks` (the cost's decode term). Takes the rank's
    /// refcount lock briefly (not at all if the rank has no active prompt blocks).
    pub fn new_blocks_not_active(&self, rank: RankId, prompt_blocks: &[u64]) -> u64 {
        self.loads().new_blocks_not_active(rank, prompt_blocks)
    }

    /// Frees every booking whose expiry is at or before `now`; returns how many. Each
    /// shard is locked on its own, and skipped without a scan if nothing in it can have
    /// expired.
    pub fn sweep_expired(&self, now: Instant) -> usize {
        self.inner.sweep_expired(now)
    }

    /// A rank left the partition: frees all its bookings (recorded as
    /// [`FreedBy::RankRemoved`]) and forgets its counters. Returns how many were freed. A
    /// booking racing with the removal either is freed by it or starts the rank afresh.
    pub fn remove_rank(&self, rank: RankId) -> usize {
        self.inner.remove_rank(rank)
    }

    /// Live bookings: the shards' sizes, each read under its lock (no table-wide counter
    /// that every booking and free would write: that line would bounce between threads).
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| s.lock().live.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn stats(&self) -> ReservationStats {
        ReservationStats {
            bookings: self.len(),
            tracked_ranks: self.inner.ranks.load().len(),
            expired_total: self.inner.expired_total.load(Ordering::Relaxed),
            counter_underflows: self.inner.underflows.load(Ordering::Relaxed),
            #[cfg(not(loom))]
            sweeper_started: self.sweeper.started.load(Ordering::Relaxed),
            #[cfg(loom)]
            sweeper_started: false,
        }
    }

    /// Recomputes every counter and refcount from the live bookings and compares them
    /// exactly; also fails if any subtraction ever underflowed. Locks every shard and rank
    /// in turn: meant for tests and diagnostics on a table no other thread is using (a
    /// free in flight has removed its booking but may not have subtracted it yet).
    pub fn audit(&self) -> Result<(), String> {
        self.inner.audit()
    }

    /// Starts the background sweep thread with period `interval`, unless one was started
    /// already (then this is a no-op, whatever its interval). Bookings call it with
    /// [`ReservationConfig::sweep_interval`]; an owner that configured `None` may start
    /// the sweep itself. The thread holds only a weak reference to the table and ends
    /// when the table is dropped. (Under loom there is no sweep thread.)
    pub fn ensure_sweeper(&self, interval: Duration) {
        #[cfg(not(loom))]
        self.start_sweeper(interval);
        #[cfg(loom)]
        let _ = interval;
    }

    /// Starts the configured sweep on a booking.
    #[cfg(not(loom))]
    fn sweep_on_first_booking(&self) {
        if let Some(interval) = self.inner.config.sweep_interval {
            self.start_sweeper(interval);
        }
    }

    #[cfg(not(loom))]
    fn start_sweeper(&self, interval: Duration) {
        let slot = &self.sweeper;
        if slot.started.load(Ordering::Relaxed)
            || slot
                .started
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let weak = Arc::downgrade(&self.inner);
        let exited = RaiseOnDrop(slot.exited.clone());
        let spawned = std::thread::Builder::new()
            .name("kvr-reservation-sweep".into())
            .spawn(move || {
                let _exited = exited;
                loop {
                    // Woken early only by the table's `Drop` (or spuriously: an early
                    // sweep is harmless).
                    std::thread::park_timeout(interval);
                    let Some(inner) = weak.upgrade() else { return };
                    if inner.shutdown.load(Ordering::Acquire) {
                        return;
                    }
                    inner.sweep_expired(Instant::now());
                }
            });
        // If the thread cannot be spawned (resources exhausted), sweeping stays available
        // through `sweep_expired`; retrying on every booking would only make it worse.
        if let Ok(handle) = spawned {
            slot.spawned.fetch_add(1, Ordering::Relaxed);
            *slot.handle.lock() = Some(handle);
        }
    }
}

impl Drop for ReservationTable {
    /// Stops the sweep thread and waits for it (at most the end of a sweep in progress).
    fn drop(&mut self) {
        #[cfg(not(loom))]
        if let Some(handle) = self.sweeper.handle.lock().take() {
            self.inner.shutdown.store(true, Ordering::Release);
            handle.thread().unpark();
            // A panic in the sweep (a broken invariant) was reported by the thread itself;
            // do not panic again in drop.
            let _ = handle.join();
        }
    }
}

/// One selection's view of the per-rank counters ([`ReservationTable::loads`]).
pub struct ActiveLoads {
    /// A read guard, not a cloned `Arc`: every selection takes one, and a reference-count
    /// increment on the one registry would be a cache line all selecting threads write.
    ranks: SnapshotGuard<RankMap>,
}

impl ActiveLoads {
    /// The rank's live counters (zero for a rank with no counter set). Lock-free.
    pub fn get(&self, rank: RankId) -> ActiveLoad {
        self.ranks
            .get(&rank)
            .map_or_else(ActiveLoad::default, |s| s.load())
    }

    /// How many of `prompt_blocks` are not active on `rank` (each element counted; the
    /// sequence hashes of one prompt are distinct by construction). Takes the rank's
    /// refcount lock for one lookup per block, or no lock if the rank has no active
    /// prompt blocks.
    pub fn new_blocks_not_active(&self, rank: RankId, prompt_blocks: &[u64]) -> u64 {
        match self.ranks.get(&rank) {
            Some(s) => s.new_blocks_not_active(prompt_blocks),
            None => prompt_blocks.len() as u64,
        }
    }

    /// As [`new_blocks_not_active`](Self::new_blocks_not_active) for a prompt given as its
    /// hash chain from the first block, in O(log n) lookups instead of n.
    ///
    /// Why it is exact then: every booking's prompt blocks are such a chain, and a chain
    /// hash names its whole prefix, so the blocks active on a rank are closed under
    /// prefixes. Hence the active blocks of `chain` are a prefix of it, found by binary
    /// search. (If bookings on the rank were made with lists that are not chains from the
    /// first block, this can differ from the linear count.)
    pub fn new_blocks_not_active_chain(&self, rank: RankId, chain: &[u64]) -> u64 {
        match self.ranks.get(&rank) {
            Some(s) => s.new_blocks_not_active_chain(chain),
            None => chain.len() as u64,
        }
    }

    /// Ranks with a counter set.
    pub fn ranks(&self) -> impl Iterator<Item = (RankId, ActiveLoad)> + '_ {
        self.ranks.iter().map(|(r, s)| (*r, s.load()))
    }
}

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const R0: RankId = RankId::new(1, 0);
    const R1: RankId = RankId::new(1, 1);
    const R2: RankId = RankId::new(2, 0);

    fn manual() -> ReservationTable {
        ReservationTable::new(ReservationConfig {
            sweep_interval: None,
            ..ReservationConfig::default()
        })
    }

    fn req(id: SelectionId, rank: RankId, blocks: &[u64], prefill: u64) -> BookingRequest {
        BookingRequest {
            selection_id: id,
            rank,
            prompt_blocks: blocks.to_vec(),
            prefill_tokens: prefill,
            expected_output_tokens: 0,
            ttl: None,
        }
    }

    fn load(prefill: u64, decode: u64, requests: u64) -> ActiveLoad {
        ActiveLoad {
            active_prefill_tokens: prefill,
            active_decode_blocks: decode,
            active_requests: requests,
        }
    }

    /// All counters zero, refcount maps empty and freed, no underflow ever.
    fn assert_drained(t: &ReservationTable) {
        assert_eq!(t.len(), 0);
        assert!(t.is_empty());
        t.audit().unwrap();
        for (rank, l) in t.loads().ranks() {
            assert!(l.is_zero(), "rank {rank}: {l:?}");
        }
        for s in t.inner.ranks.load().values() {
            let b = s.blocks.lock();
            assert!(b.refs.is_empty(), "rank {}: refcounts left", s.rank);
            assert_eq!(
                b.refs.capacity(),
                0,
                "rank {}: refcount map not freed",
                s.rank
            );
            assert_eq!(s.counters.prompt_blocks.load(Ordering::Relaxed), 0);
        }
        assert_eq!(t.stats().counter_underflows, 0);
    }

    /// A deterministic xorshift generator (no external crate).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// The chain of sequence hashes of the first `len` blocks of document `doc`: equal
    /// documents share prefixes, as real prompts with a common prefix do.
    fn chain(doc: u64, len: usize) -> Vec<u64> {
        (0..len as u64)
            .map(|i| shard_hash(doc.wrapping_mul(1_000_003) ^ (i << 48)) | 1)
            .collect()
    }

    #[test]
    fn booking_adds_prefill_tokens_prompt_blocks_and_one_request() {
        let t = manual();
        let now = Instant::now();
        let v = t.book(req(1, R0, &[10, 11, 12], 48), now).unwrap();
        assert_eq!(v.new_prompt_blocks, 3);
        assert_eq!(v.rank_load, load(48, 3, 1));
        assert_eq!(t.rank_load(R0), load(48, 3, 1));
        assert_eq!(t.rank_load(R1), ActiveLoad::default());
        assert_eq!(v.origin, BookingOrigin::Local);
        assert_eq!(v.expires_at, Some(now + Duration::from_secs(3_600)));
        assert!(t.contains(1));
        assert_eq!(t.get(1).unwrap(), v);
        t.audit().unwrap();
    }

    #[test]
    fn shared_prompt_blocks_count_once_per_rank() {
        let t = manual();
        let now = Instant::now();
        t.book(req(1, R0, &[10, 11, 12], 48), now).unwrap();
        let v = t.book(req(2, R0, &[10, 11, 13, 14], 64), now).unwrap();
        assert_eq!(v.new_prompt_blocks, 2, "10 and 11 are already active on R0");
        // distinct blocks: 10, 11, 12, 13, 14.
        assert_eq!(t.rank_load(R0), load(112, 5, 2));
        // The shared blocks stay while either booking holds them.
        assert!(
            matches!(t.free(1).unwrap(), FreeOutcome::Freed(r) if r.prompt_blocks_released == 1)
        );
        assert_eq!(t.rank_load(R0), load(64, 4, 1));
        t.free(2).unwrap();
        assert_drained(&t);
    }

    #[test]
    fn shared_prompt_blocks_count_separately_on_different_ranks() {
        let t = manual();
        let now = Instant::now();
        t.book(req(1, R0, &[10, 11], 32), now).unwrap();
        let v = t.book(req(2, R1, &[10, 11], 32), now).unwrap();
        assert_eq!(v.new_prompt_blocks, 2);
        assert_eq!(t.rank_load(R0), load(32, 2, 1));
        assert_eq!(t.rank_load(R1), load(32, 2, 1));
    }

    #[test]
    fn duplicate_selection_id_is_an_error_not_an_overwrite() {
        let t = manual();
        let now = Instant::now();
        t.book(req(7, R0, &[1], 16), now).unwrap();
        assert_eq!(
            t.book(req(7, R1, &[2, 3], 99), now),
            Err(ReservationError::DuplicateSelectionId(7))
        );
        assert_eq!(
            t.install_replica_booking(req(7, R0, &[2], 1), now),
            Err(ReservationError::DuplicateSelectionId(7))
        );
        assert_eq!(t.get(7).unwrap().rank, R0);
        assert_eq!(t.rank_load(R0), load(16, 1, 1));
        assert_eq!(t.rank_load(R1), ActiveLoad::default());
        assert_eq!(t.len(), 1);
        t.audit().unwrap();
    }

    #[test]
    fn free_of_unknown_id_is_a_clear_error() {
        let t = manual();
        assert_eq!(t.free(42), Err(ReservationError::UnknownSelectionId(42)));
        assert_eq!(
            t.mark_prefill_complete(42),
            Err(ReservationError::UnknownSelectionId(42))
        );
        assert_eq!(
            t.add_output_blocks(42, 1),
            Err(ReservationError::UnknownSelectionId(42))
        );
        assert_eq!(
            ReservationError::UnknownSelectionId(42).to_string(),
            "unknown selection id 42"
        );
        assert!(!t.contains(42));
        assert_drained(&t);
    }

    #[test]
    fn second_free_is_already_freed_and_does_not_double_decrement() {
        let t = manual();
        let now = Instant::now();
        t.book(req(1, R0, &[10, 11], 32), now).unwrap();
        t.book(req(2, R0, &[10], 16), now).unwrap();
        let first = t.free(1).unwrap();
        assert_eq!(
            first,
            FreeOutcome::Freed(Released {
                rank: R0,
                prefill_tokens: 32,
                prompt_blocks_released: 1,
                output_blocks: 0
            })
        );
        let after_first = t.rank_load(R0);
        assert_eq!(after_first, load(16, 1, 1));
        for _ in 0..3 {
            assert_eq!(t.free(1), Ok(FreeOutcome::AlreadyFreed(FreedBy::Caller)));
            assert_eq!(t.rank_load(R0), after_first);
        }
        t.free(2).unwrap();
        assert_drained(&t);
    }

    #[test]
    fn freed_id_cannot_be_booked_again_while_remembered() {
        let t = manual();
        let now = Instant::now();
        t.book(req(1, R0, &[10], 16), now).unwrap();
        t.free(1).unwrap();
        // A late replica message for a freed booking must not resurrect it.
        assert_eq!(
            t.install_replica_booking(req(1, R0, &[10], 16), now),
            Err(ReservationError::DuplicateSelectionId(1))
        );
        assert_drained(&t);
    }

    #[test]
    fn recently_freed_memory_is_bounded() {
        let t = ReservationTable::new(ReservationConfig {
            shards: 1,
            recently_freed_per_shard: 4,
            sweep_interval: None,
            ..ReservationConfig::default()
        });
        let now = Instant::now();
        for id in 0..10 {
            t.book(req(id, R0, &[id], 1), now).unwrap();
            t.free(id).unwrap();
        }
        let g = t.inner.shards[0].lock();
        assert_eq!(g.freed.order.len(), 4);
        assert_eq!(g.freed.by.len(), 4);
        drop(g);
        // The last four are remembered, older ones are unknown again.
        for id in 6..10 {
            assert_eq!(t.free(id), Ok(FreeOutcome::AlreadyFreed(FreedBy::Caller)));
        }
        assert_eq!(t.free(0), Err(ReservationError::UnknownSelectionId(0)));
        assert_drained(&t);
    }

    #[test]
    fn mark_prefill_complete_is_idempotent() {
        let t = manual();
        let now = Instant::now();
        t.book(req(1, R0, &[10, 11], 32), now).unwrap();
        t.book(req(2, R0, &[12], 16), now).unwrap();
        assert_eq!(t.mark_prefill_complete(1), Ok(()));
        assert_eq!(t.rank_load(R0), load(16, 3, 2));
        assert_eq!(t.mark_prefill_complete(1), Ok(()));
        assert_eq!(t.rank_load(R0), load(16, 3, 2));
        assert!(t.get(1).unwrap().prefill_complete);
        // Freeing a prefill-complete booking does not subtract its prefill again.
        let FreeOutcome::Freed(r) = t.free(1).unwrap() else {
            panic!()
        };
        assert_eq!(r.prefill_tokens, 0);
        assert_eq!(t.rank_load(R0), load(16, 1, 1));
        // ... and marking a freed booking is a no-op, not an error.
        assert_eq!(t.mark_prefill_complete(1), Ok(()));
        t.free(2).unwrap();
        assert_drained(&t);
    }

    #[test]
    fn mark_prefill_complete_drops_only_prefill_tokens() {
        let t = manual();
        t.book(req(1, R0, &[10, 11], 32), Instant::now()).unwrap();
        t.add_output_blocks(1, 2).unwrap();
        t.mark_prefill_complete(1).unwrap();
        assert_eq!(t.rank_load(R0), load(0, 4, 1));
    }

    #[test]
    fn add_output_blocks_adds_to_decode_load_and_free_drops_it() {
        let t = manual();
        t.book(req(1, R0, &[10], 16), Instant::now()).unwrap();
        assert_eq!(t.add_output_blocks(1, 3), Ok(()));
        assert_eq!(t.add_output_blocks(1, 2), Ok(()));
        assert_eq!(t.add_output_blocks(1, 0), Ok(()));
        assert_eq!(t.rank_load(R0), load(16, 6, 1));
        assert_eq!(t.get(1).unwrap().output_blocks, 5);
        let FreeOutcome::Freed(r) = t.free(1).unwrap() else {
            panic!()
        };
        assert_eq!(r.output_blocks, 5);
        assert_drained(&t);
    }

    #[test]
    fn add_output_blocks_to_a_freed_booking_is_an_error() {
        let t = manual();
        t.book(req(1, R0, &[10], 16), Instant::now()).unwrap();
        t.free(1).unwrap();
        assert_eq!(
            t.add_output_blocks(1, 1),
            Err(ReservationError::AlreadyFreed(1, FreedBy::Caller))
        );
        assert_drained(&t);
    }

    #[test]
    fn counts_above_the_per_booking_maximum_are_refused() {
        let t = manual();
        let now = Instant::now();
        assert_eq!(
            t.book(req(1, R0, &[], MAX_PER_BOOKING + 1), now),
            Err(ReservationError::TooLarge(1, "prefill_tokens"))
        );
        t.book(req(2, R0, &[], MAX_PER_BOOKING), now).unwrap();
        assert_eq!(
            t.add_output_blocks(2, u64::MAX),
            Err(ReservationError::TooLarge(2, "output_blocks"))
        );
        assert_eq!(t.rank_load(R0), load(MAX_PER_BOOKING, 0, 1));
        t.free(2).unwrap();
        assert_drained(&t);
    }

    #[test]
    fn expected_output_is_recorded_in_blocks_and_adds_no_load() {
        let t = manual();
        let mut r = req(1, R0, &[10], 16);
        r.expected_output_tokens = 33;
        let v = t.book(r, Instant::now()).unwrap();
        assert_eq!(v.expected_output_blocks, 3);
        assert_eq!(t.rank_load(R0), load(16, 1, 1));
    }

    #[test]
    fn new_blocks_not_active_counts_the_blocks_the_rank_does_not_hold() {
        let t = manual();
        let now = Instant::now();
        assert_eq!(
            t.new_blocks_not_active(R0, &[10, 11, 12]),
            3,
            "unknown rank"
        );
        t.book(req(1, R0, &[10, 11], 32), now).unwrap();
        assert_eq!(t.new_blocks_not_active(R0, &[10, 11, 12]), 1);
        assert_eq!(t.new_blocks_not_active(R0, &[]), 0);
        assert_eq!(t.new_blocks_not_active(R1, &[10, 11, 12]), 3);
        // It is exactly what booking there adds.
        let v = t.book(req(2, R0, &[10, 11, 12], 48), now).unwrap();
        assert_eq!(v.new_prompt_blocks, 1);
        t.free(1).unwrap();
        t.free(2).unwrap();
        // An idle rank answers without its lock, and says "all new".
        assert_eq!(t.new_blocks_not_active(R0, &[10, 11, 12]), 3);
    }

    #[test]
    fn chain_count_agrees_with_the_linear_count_on_hash_chains() {
        let t = manual();
        let now = Instant::now();
        let mut rng = Rng(0x5eed);
        let mut id = 0;
        for _ in 0..200 {
            let doc = rng.below(6);
            let len = 1 + rng.below(12) as usize;
            t.book(req(id, R0, &chain(doc, len), 1), now).unwrap();
            id += 1;
            if rng.below(3) == 0 {
                let _ = t.free(rng.below(id));
            }
            let loads = t.loads();
            for doc in 0..8 {
                for len in 0..14 {
                    let c = chain(doc, len);
                    assert_eq!(
                        loads.new_blocks_not_active_chain(R0, &c),
                        loads.new_blocks_not_active(R0, &c),
                        "doc {doc} len {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn expired_bookings_are_swept() {
        let t = manual();
        let now = Instant::now();
        let mut short = req(1, R0, &[10, 11], 32);
        short.ttl = Some(Duration::from_secs(5));
        t.book(short, now).unwrap();
        t.book(req(2, R0, &[10], 16), now).unwrap(); // default ttl: 3,600 s
        assert_eq!(t.sweep_expired(now + Duration::from_secs(4)), 0);
        assert!(t.contains(1));
        assert_eq!(t.sweep_expired(now + Duration::from_secs(5)), 1);
        assert!(!t.contains(1));
        assert_eq!(t.rank_load(R0), load(16, 1, 1));
        assert_eq!(t.free(1), Ok(FreeOutcome::AlreadyFreed(FreedBy::Expired)));
        assert_eq!(t.sweep_expired(now + Duration::from_secs(3_599)), 0);
        assert_eq!(t.sweep_expired(now + Duration::from_secs(3_600)), 1);
        assert_eq!(t.stats().expired_total, 2);
        assert_drained(&t);
    }

    #[test]
    fn the_default_ttl_is_dynamos_current_hour() {
        assert_eq!(
            ReservationConfig::default().default_ttl,
            Duration::from_secs(3_600)
        );
    }

    #[test]
    fn a_ttl_beyond_the_clock_never_expires() {
        let t = manual();
        let now = Instant::now();
        let mut r = req(1, R0, &[10], 16);
        r.ttl = Some(Duration::MAX);
        assert_eq!(t.book(r, now).unwrap().expires_at, None);
        assert_eq!(t.sweep_expired(now + Duration::from_secs(1 << 40)), 0);
        t.free(1).unwrap();
        assert_drained(&t);
    }

    #[test]
    fn sweep_skips_shards_with_nothing_expired() {
        let t = ReservationTable::new(ReservationConfig {
            shards: 4,
            sweep_interval: None,
            ..ReservationConfig::default()
        });
        let now = Instant::now();
        for id in 0..64 {
            t.book(req(id, R0, &[id], 1), now).unwrap();
        }
        for s in t.inner.shards.iter() {
            assert_eq!(
                s.lock().earliest_expiry,
                Some(now + Duration::from_secs(3_600))
            );
        }
        assert_eq!(t.sweep_expired(now), 0);
    }

    #[test]
    fn remove_rank_frees_its_bookings_only() {
        let t = manual();
        let now = Instant::now();
        t.book(req(1, R0, &[10, 11], 32), now).unwrap();
        t.book(req(2, R0, &[10], 16), now).unwrap();
        t.book(req(3, R2, &[10], 16), now).unwrap();
        assert_eq!(t.remove_rank(R0), 2);
        assert_eq!(t.remove_rank(R0), 0);
        assert_eq!(t.rank_load(R0), ActiveLoad::default());
        assert_eq!(t.rank_load(R2), load(16, 1, 1));
        assert_eq!(
            t.free(1),
            Ok(FreeOutcome::AlreadyFreed(FreedBy::RankRemoved))
        );
        assert_eq!(t.stats().tracked_ranks, 1);
        // The rank can come back and starts from zero.
        t.book(req(4, R0, &[10], 8), now).unwrap();
        assert_eq!(t.rank_load(R0), load(8, 1, 1));
        t.free(3).unwrap();
        t.free(4).unwrap();
        assert_drained(&t);
    }

    #[test]
    fn bookings_racing_remove_rank_are_freed_by_it_or_start_the_rank_afresh() {
        for round in 0..50 {
            let t = Arc::new(manual());
            let now = Instant::now();
            let booker = {
                let t = t.clone();
                std::thread::spawn(move || {
                    for id in 0..200 {
                        t.book(req(id, R0, &chain(id % 3, 4), 16), now).unwrap();
                    }
                })
            };
            let mut removed = 0;
            for _ in 0..20 {
                removed += t.remove_rank(R0);
            }
            booker.join().unwrap();
            t.audit().unwrap();
            assert_eq!(removed + t.len(), 200, "round {round}");
            assert_eq!(t.rank_load(R0).active_requests as usize, t.len());
            t.remove_rank(R0);
            assert_drained(&t);
        }
    }

    #[test]
    fn replica_bookings_count_like_local_ones_and_are_flagged() {
        let t = manual();
        let now = Instant::now();
        t.book(req(1, R0, &[10, 11], 32), now).unwrap();
        let mut r = req(2, R0, &[10, 12], 32);
        r.ttl = Some(Duration::from_secs(10));
        let v = t.install_replica_booking(r, now).unwrap();
        assert_eq!(v.origin, BookingOrigin::Replica);
        assert_eq!(v.new_prompt_blocks, 1);
        assert_eq!(t.rank_load(R0), load(64, 3, 2));
        assert_eq!(t.get(2).unwrap().origin, BookingOrigin::Replica);
        assert_eq!(t.sweep_expired(now + Duration::from_secs(10)), 1);
        t.free(1).unwrap();
        assert_drained(&t);
    }

    /// Random operations against a reference model: after every step each rank's counters
    /// equal the model's, and none ever underflowed.
    #[test]
    fn counters_never_go_negative() {
        let t = ReservationTable::new(ReservationConfig {
            shards: 4,
            sweep_interval: None,
            recently_freed_per_shard: 1 << 20,
            ..ReservationConfig::default()
        });
        let ranks = [R0, R1, R2];
        let start = Instant::now();
        let mut rng = Rng(0xdead_beef);
        // Reference: id → (rank index, blocks, prefill, prefill_done, output, expiry secs).
        type Model = HashMap<u64, (usize, Vec<u64>, u64, bool, u64, u64)>;
        let mut model = Model::new();
        let mut clock = 0u64;
        let mut next_id = 0u64;
        for step in 0..20_000 {
            match rng.below(10) {
                0..=3 => {
                    let ri = rng.below(3) as usize;
                    let blocks = chain(rng.below(5), rng.below(6) as usize);
                    let prefill = rng.below(100);
                    let ttl = 1 + rng.below(50);
                    let mut r = req(next_id, ranks[ri], &blocks, prefill);
                    r.ttl = Some(Duration::from_secs(ttl));
                    t.book(r, start + Duration::from_secs(clock)).unwrap();
                    model.insert(next_id, (ri, blocks, prefill, false, 0, clock + ttl));
                    next_id += 1;
                }
                4 => {
                    let id = rng.below(next_id + 1);
                    let r = t.mark_prefill_complete(id);
                    if let Some(m) = model.get_mut(&id) {
                        m.3 = true;
                        assert_eq!(r, Ok(()));
                    }
                }
                5 => {
                    let id = rng.below(next_id + 1);
                    let n = rng.below(4);
                    let r = t.add_output_blocks(id, n);
                    if let Some(m) = model.get_mut(&id) {
                        m.4 += n;
                        assert_eq!(r, Ok(()));
                        assert_eq!(t.get(id).unwrap().output_blocks, m.4);
                    } else {
                        assert!(r.is_err());
                    }
                }
                6..=8 => {
                    let id = rng.below(next_id + 1);
                    let r = t.free(id);
                    match model.remove(&id) {
                        Some(_) => assert!(matches!(r, Ok(FreeOutcome::Freed(_)))),
                        None if id < next_id => {
                            assert!(matches!(r, Ok(FreeOutcome::AlreadyFreed(_))))
                        }
                        None => assert_eq!(r, Err(ReservationError::UnknownSelectionId(id))),
                    }
                }
                _ => {
                    clock += rng.below(5);
                    let swept = t.sweep_expired(start + Duration::from_secs(clock));
                    let before = model.len();
                    model.retain(|_, m| m.5 > clock);
                    assert_eq!(swept, before - model.len());
                }
            }
            for (ri, &rank) in ranks.iter().enumerate() {
                let mut want = ActiveLoad::default();
                let mut distinct = std::collections::HashSet::new();
                for m in model.values().filter(|m| m.0 == ri) {
                    want.active_requests += 1;
                    if !m.3 {
                        want.active_prefill_tokens += m.2;
                    }
                    want.active_decode_blocks += m.4;
                    distinct.extend(m.1.iter().copied());
                }
                want.active_decode_blocks += distinct.len() as u64;
                assert_eq!(t.rank_load(rank), want, "step {step} rank {rank}");
            }
            assert_eq!(t.stats().counter_underflows, 0);
        }
        t.audit().unwrap();
        t.sweep_expired(start + Duration::from_secs(clock + 1_000));
        assert_drained(&t);
    }

    #[test]
    fn the_underflow_guard_saturates_and_counts() {
        let t = manual();
        let c = AtomicU64::new(3);
        let r =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.inner.sub(&c, 5, "test")));
        // Debug builds stop at the broken invariant; release builds never go below zero.
        assert_eq!(r.is_err(), cfg!(debug_assertions));
        if !cfg!(debug_assertions) {
            assert_eq!(c.load(Ordering::Relaxed), 0);
        }
        assert_eq!(t.stats().counter_underflows, 1);
    }

    #[test]
    fn counters_do_not_leak_and_refcount_maps_are_freed() {
        let t = manual();
        let now = Instant::now();
        for id in 0..5_000u64 {
            t.book(
                req(id, RankId::new(id % 4, 0), &chain(id % 7, 40), 100),
                now,
            )
            .unwrap();
        }
        assert!(t
            .inner
            .ranks
            .load()
            .values()
            .all(|s| s.blocks.lock().refs.len() > 40));
        for id in 0..5_000u64 {
            if id % 3 == 0 {
                t.mark_prefill_complete(id).unwrap();
            }
            if id % 5 == 0 {
                t.add_output_blocks(id, 7).unwrap();
            }
        }
        t.audit().unwrap();
        for id in 0..5_000u64 {
            t.free(id).unwrap();
        }
        assert_drained(&t);
    }

    fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn constructing_spawns_nothing_and_first_booking_starts_the_sweep() {
        let t = ReservationTable::new(ReservationConfig {
            sweep_interval: Some(Duration::from_secs(3_600)),
            ..ReservationConfig::default()
        });
        assert!(!t.stats().sweeper_started);
        assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 0);
        assert!(t.sweeper.handle.lock().is_none());
        // Non-booking calls start nothing either.
        let _ = t.free(1);
        let _ = t.rank_load(R0);
        t.sweep_expired(Instant::now());
        assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 0);

        t.book(req(1, R0, &[1], 1), Instant::now()).unwrap();
        assert!(t.stats().sweeper_started);
        assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 1);
        for id in 2..100 {
            t.book(req(id, R0, &[id], 1), Instant::now()).unwrap();
        }
        assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 1);
        let h = t.sweeper.handle.lock();
        let h = h.as_ref().unwrap();
        assert_eq!(h.thread().name(), Some("kvr-reservation-sweep"));
        assert!(!h.is_finished());
    }

    #[test]
    fn concurrent_first_bookings_start_exactly_one_sweeper() {
        for _ in 0..20 {
            let t = Arc::new(ReservationTable::new(ReservationConfig::default()));
            let threads: Vec<_> = (0..4u64)
                .map(|k| {
                    let t = t.clone();
                    std::thread::spawn(move || {
                        t.book(req(k, R0, &[k], 1), Instant::now()).unwrap();
                    })
                })
                .collect();
            for th in threads {
                th.join().unwrap();
            }
            assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 1);
        }
    }

    #[test]
    fn dropping_the_table_ends_the_sweep_thread() {
        // An hour-long interval: only the drop can end the thread in time.
        let t = ReservationTable::new(ReservationConfig {
            sweep_interval: Some(Duration::from_secs(3_600)),
            ..ReservationConfig::default()
        });
        t.book(req(1, R0, &[1], 1), Instant::now()).unwrap();
        let exited = t.sweeper.exited.clone();
        let weak = Arc::downgrade(&t.inner);
        assert!(!exited.load(Ordering::Acquire));
        let started = Instant::now();
        drop(t);
        assert!(
            exited.load(Ordering::Acquire),
            "the sweep thread outlived the table"
        );
        assert!(
            weak.upgrade().is_none(),
            "the table's state outlived the table"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn the_sweep_thread_holds_only_a_weak_reference() {
        let t = ReservationTable::new(ReservationConfig {
            sweep_interval: Some(Duration::from_millis(1)),
            ..ReservationConfig::default()
        });
        t.book(req(1, R0, &[1], 1), Instant::now()).unwrap();
        // Between sweeps the thread holds no strong reference.
        wait_for("an idle sweeper", || Arc::strong_count(&t.inner) == 1);
        assert_eq!(Arc::weak_count(&t.inner), 1);
    }

    #[test]
    fn the_background_sweep_frees_expired_bookings() {
        let t = ReservationTable::new(ReservationConfig {
            sweep_interval: Some(Duration::from_millis(2)),
            ..ReservationConfig::default()
        });
        let mut r = req(1, R0, &[10, 11], 32);
        r.ttl = Some(Duration::ZERO);
        t.book(r, Instant::now()).unwrap();
        t.book(req(2, R0, &[10], 16), Instant::now()).unwrap();
        wait_for("the sweep", || !t.contains(1));
        assert!(t.contains(2));
        assert_eq!(t.rank_load(R0), load(16, 1, 1));
        assert_eq!(t.free(1), Ok(FreeOutcome::AlreadyFreed(FreedBy::Expired)));
    }

    #[test]
    fn ensure_sweeper_starts_one_thread_when_none_is_configured() {
        let t = manual();
        t.book(req(1, R0, &[1], 1), Instant::now()).unwrap();
        assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 0);
        t.ensure_sweeper(Duration::from_millis(1));
        t.ensure_sweeper(Duration::from_millis(1));
        assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 1);
        let mut r = req(2, R0, &[2], 1);
        r.ttl = Some(Duration::ZERO);
        t.book(r, Instant::now()).unwrap();
        wait_for("the sweep", || !t.contains(2));
        assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn status_tells_live_from_recently_freed_from_unknown() {
        let t = manual();
        let now = Instant::now();
        t.book(req(1, R0, &[1], 1), now).unwrap();
        t.install_replica_booking(req(2, R0, &[1], 1), now).unwrap();
        assert_eq!(t.status(1), Some(BookingStatus::Live(BookingOrigin::Local)));
        assert_eq!(
            t.status(2),
            Some(BookingStatus::Live(BookingOrigin::Replica))
        );
        t.free(1).unwrap();
        assert_eq!(t.status(1), Some(BookingStatus::Freed(FreedBy::Caller)));
        assert_eq!(t.status(3), None);
    }

    #[test]
    fn no_sweep_interval_means_no_thread() {
        let t = manual();
        t.book(req(1, R0, &[1], 1), Instant::now()).unwrap();
        assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 0);
        assert!(t.sweeper.handle.lock().is_none());
    }

    /// 4 threads book and free 1,000,000 requests (release; 40,000 in debug) over 64 ranks
    /// with overlapping prompt blocks, marking prefill and adding output on the way, while
    /// a sweeper thread and the background sweep expire the short-lived ones; every
    /// thread also reads loads. Afterwards every counter is exactly 0 and every refcount
    /// map empty and freed.
    #[test]
    fn stress_four_threads_book_and_free_a_million_requests_over_64_ranks() {
        const THREADS: u64 = 4;
        const TOTAL: u64 = if cfg!(debug_assertions) {
            40_000
        } else {
            1_000_000
        };
        const WINDOW: usize = 24;
        let t = Arc::new(ReservationTable::new(ReservationConfig {
            sweep_interval: Some(Duration::from_millis(1)),
            recently_freed_per_shard: 4_096,
            ..ReservationConfig::default()
        }));
        let done = Arc::new(AtomicBool::new(false));
        let sweeper = {
            let (t, done) = (t.clone(), done.clone());
            std::thread::spawn(move || {
                let mut swept = 0;
                while !done.load(Ordering::Acquire) {
                    swept += t.sweep_expired(Instant::now());
                    std::thread::yield_now();
                }
                swept
            })
        };
        let started = Instant::now();
        let workers: Vec<_> = (0..THREADS)
            .map(|k| {
                let t = t.clone();
                std::thread::spawn(move || {
                    let mut rng = Rng(0x9e37_79b9 ^ ((k + 1) * 0x1234_5678_9abc));
                    let mut window: VecDeque<u64> = VecDeque::new();
                    let (mut freed, mut expired) = (0u64, 0u64);
                    let mut check = 0u64;
                    for i in 0..TOTAL / THREADS {
                        let id = (k << 48) | i;
                        let rank = RankId::new(rng.below(64), 0);
                        let blocks = chain(rng.below(32), 1 + rng.below(16) as usize);
                        let ttl = if rng.below(8) == 0 {
                            Duration::ZERO
                        } else {
                            Duration::from_secs(600)
                        };
                        let loads = t.loads();
                        check = check.wrapping_add(
                            loads.new_blocks_not_active_chain(rank, &blocks)
                                + loads.get(rank).active_decode_blocks,
                        );
                        let mut r = req(id, rank, &blocks, 16 * blocks.len() as u64);
                        r.ttl = Some(ttl);
                        t.book(r, Instant::now()).unwrap();
                        window.push_back(id);
                        match rng.below(4) {
                            0 => {
                                let _ = t.mark_prefill_complete(id);
                            }
                            1 => {
                                let _ = t.add_output_blocks(id, 1 + rng.below(3));
                            }
                            _ => {}
                        }
                        if window.len() > WINDOW {
                            let at = rng.below(WINDOW as u64) as usize;
                            let victim = window.swap_remove_front(at).unwrap();
                            match t.free(victim) {
                                Ok(FreeOutcome::Freed(_)) => freed += 1,
                                Ok(FreeOutcome::AlreadyFreed(FreedBy::Expired)) => expired += 1,
                                other => panic!("free {victim:?}: {other:?}"),
                            }
                        }
                    }
                    for id in window {
                        match t.free(id) {
                            Ok(FreeOutcome::Freed(_)) => freed += 1,
                            Ok(FreeOutcome::AlreadyFreed(FreedBy::Expired)) => expired += 1,
                            other => panic!("free {id}: {other:?}"),
                        }
                    }
                    std::hint::black_box(check);
                    (freed, expired)
                })
            })
            .collect();
        let (mut freed, mut expired) = (0, 0);
        for w in workers {
            let (f, e) = w.join().unwrap();
            freed += f;
            expired += e;
        }
        done.store(true, Ordering::Release);
        sweeper.join().unwrap();
        let elapsed = started.elapsed();
        assert_eq!(freed + expired, TOTAL);
        assert_eq!(t.stats().expired_total, expired);
        assert!(expired > 0, "the sweep never raced the frees");
        assert_eq!(t.stats().tracked_ranks, 64);
        assert_drained(&t);
        eprintln!(
            "reservation stress: {TOTAL} bookings+frees by {THREADS} threads in {elapsed:?} \
             ({:.2} M/s), {expired} expired before their free",
            TOTAL as f64 / elapsed.as_secs_f64() / 1e6
        );
    }
}
