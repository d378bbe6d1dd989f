//! [`ReservationTable`], the public face of the reservations: one partition's bookings,
//! each operation delegated to the shared state, plus the slot of the sweep thread the
//! table starts on its first booking and stops when dropped.

use std::fmt;
use std::time::{Duration, Instant};

use super::floor::FloorMix;
use super::inner::Inner;
use super::listeners::{ForgetListener, Listeners};
use super::loads::ActiveLoads;
#[cfg(not(loom))]
use super::sweep::SweeperSlot;
use super::types::{
    ActiveLoad, BookingOrigin, BookingRequest, BookingStatus, BookingView, FreeOutcome,
    ReservationConfig, ReservationError, ReservationStats,
};
use crate::ids::RankId;
use crate::ids::SelectionId;
use crate::sync::atomic::Ordering;
use crate::sync::Arc;

/// One partition's bookings: sharded by selection id, with live per-rank counters.
///
/// All methods take `&self` and may be called from any number of threads. The sweep
/// thread (if [`ReservationConfig::sweep_interval`] is set) starts on the first booking and
/// ends when the table is dropped.
///
/// [`ReservationConfig::sweep_interval`]: super::ReservationConfig::sweep_interval
pub struct ReservationTable {
    pub(super) inner: Arc<Inner>,
    #[cfg(not(loom))]
    pub(super) sweeper: SweeperSlot,
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
        Self::with_listeners(config, Listeners::default(), FloorMix::default())
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
            FloorMix::default(),
        )
    }

    /// A table with listeners: a forget listener (see
    /// [`ReservationTable::with_forget_listener`]), an end listener, told `id` whenever a
    /// booking ends however it ends (a free by anyone, expiry, rank removal), and a sweep
    /// listener; each is called after the table's work and with no lock of it held.
    /// `mix` weighs decode blocks against prefill tokens in the load floors' combined
    /// bound (`floor.rs`).
    pub(crate) fn with_listeners(
        config: ReservationConfig,
        listeners: Listeners,
        mix: FloorMix,
    ) -> Self {
        let mut inner = Inner::new(config);
        inner.floor_mix = mix;
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
    ///
    /// [`ReservationError::DuplicateSelectionId`]: super::ReservationError::DuplicateSelectionId
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
    ///
    /// [`BookingOrigin::Replica`]: super::BookingOrigin::Replica
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
    /// a call on a recently freed booking, is `Ok` and changes nothing. The call's time
    /// (now) is an observation of the partition's prefill rate
    /// ([`prefill_rate`](Self::prefill_rate)).
    pub fn mark_prefill_complete(&self, id: SelectionId) -> Result<(), ReservationError> {
        self.inner.mark_prefill_complete(id, Instant::now())
    }

    /// [`mark_prefill_complete`](Self::mark_prefill_complete) at time `now` (a replay's
    /// simulated clock, or a host that timestamps its events).
    pub fn mark_prefill_complete_at(
        &self,
        id: SelectionId,
        now: Instant,
    ) -> Result<(), ReservationError> {
        self.inner.mark_prefill_complete(id, now)
    }

    /// The partition's prefill throughput per rank learned from `mark_prefill_complete`
    /// timings, tokens/s: `None` until a few prefills were observed. Lock-free (one
    /// atomic load). How it is estimated: `reservation/rate.rs`.
    pub fn prefill_rate(&self) -> Option<f64> {
        self.inner.prefill_rate.get()
    }

    /// Prefill completions folded into [`ReservationTable::prefill_rate`] so far.
    /// Lock-free (one atomic load), unlike [`ReservationTable::stats`], which counts the
    /// live bookings under every shard's lock.
    pub fn prefill_rate_observations(&self) -> u64 {
        self.inner.prefill_rate.observations()
    }

    /// How much a rank's decode load lengthens a request's time to first token there,
    /// seconds per decode block it holds, learned from the same timings as
    /// [`prefill_rate`](Self::prefill_rate): `None` until enough requests completed their
    /// prefill on ranks of different loads. Lock-free (two atomic loads). How it is estimated:
    /// `reservation/drag.rs`.
    pub fn decode_drag(&self) -> Option<f64> {
        self.inner.decode_drag.get()
    }

    /// Prefill completions folded into [`ReservationTable::decode_drag`] so far.
    /// Lock-free (one atomic load).
    pub fn decode_drag_observations(&self) -> u64 {
        self.inner.decode_drag.observations()
    }

    /// The estimator's packed averages (loom models).
    #[cfg(loom)]
    pub(crate) fn prefill_rate_packed(&self) -> u64 {
        self.inner.prefill_rate.packed()
    }

    /// Adds `n` output blocks to the booking's decode load (its total is in
    /// [`get`](Self::get)). A freed booking is [`ReservationError::AlreadyFreed`] (the
    /// blocks would count nowhere). Additive, as Dynamo's `add_output_block`: a caller
    /// that may retry a call should use [`set_output_blocks`](Self::set_output_blocks).
    ///
    /// [`ReservationError::AlreadyFreed`]: super::ReservationError::AlreadyFreed
    pub fn add_output_blocks(&self, id: SelectionId, n: u64) -> Result<(), ReservationError> {
        self.inner.add_output_blocks(id, n)
    }

    /// The booking has produced `total` output blocks so far (a block index + 1): raises
    /// its output blocks to `total`, so a retried call adds nothing (idempotent; a lower
    /// total than booked changes nothing). Returns the blocks added.
    pub fn set_output_blocks(&self, id: SelectionId, total: u64) -> Result<u64, ReservationError> {
        self.inner.set_output_blocks(id, total)
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

    /// The prompt blocks (sequence hashes) a live booking holds, first block first: what
    /// a replica peer needs to book the same request (`None` when the id is not live).
    pub fn prompt_blocks(&self, id: SelectionId) -> Option<Vec<u64>> {
        let g = self.inner.shard(id).lock();
        g.live.get(&id).map(|b| b.prompt_blocks.clone())
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

    /// Every rank's `active_prefill_tokens` summed, kept as they change (a selection's
    /// mean without a pass over the ranks).
    pub(crate) fn prefill_sum(&self) -> u64 {
        self.inner
            .prefill_sum
            .load(crate::sync::atomic::Ordering::Relaxed)
    }

    /// The weight of the floors' combined bound (`floor.rs`), fixed for the table's life.
    pub(crate) fn floor_mix(&self) -> FloorMix {
        self.inner.floor_mix
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
    ///
    /// [`FreedBy::RankRemoved`]: super::FreedBy::RankRemoved
    pub fn remove_rank(&self, rank: RankId) -> usize {
        self.inner.remove_rank(rank)
    }

    /// Makes the counters of each of `ranks` that has none yet (a worker's, as it
    /// registers), in one copy of the rank registry instead of one at each rank's first
    /// booking.
    pub(crate) fn ensure_ranks(&self, ranks: &[RankId]) {
        self.inner.ensure_ranks(ranks);
    }

    /// [`remove_rank`](Self::remove_rank) for each of `ranks` (a worker's), in one pass
    /// over the bookings. Returns how many bookings were freed.
    pub fn remove_ranks(&self, ranks: &[RankId]) -> usize {
        self.inner.remove_ranks(ranks)
    }

    /// Live bookings: the shards' sizes, each read under its lock (no table-wide counter
    /// that every booking and free would write: that line would bounce between threads).
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| s.lock().live.len()).sum()
    }

    /// Whether the table holds no live booking.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The table's counters.
    pub fn stats(&self) -> ReservationStats {
        ReservationStats {
            bookings: self.len(),
            tracked_ranks: self.inner.ranks.load().len(),
            expired_total: self.inner.expired_total.load(Ordering::Relaxed),
            counter_underflows: self.inner.underflows.load(Ordering::Relaxed),
            prefill_rate: self.inner.prefill_rate.get(),
            prefill_rate_observations: self.inner.prefill_rate.observations(),
            decode_drag: self.inner.decode_drag.get(),
            decode_drag_observations: self.inner.decode_drag.observations(),
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
    ///
    /// [`ReservationConfig::sweep_interval`]: super::ReservationConfig::sweep_interval
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
        self.sweeper.start(&self.inner, interval);
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
