//! The table's shared state (`Inner`: shards, rank registry, totals, listeners) and the
//! operations on bookings that keep the counter protocol of the module docs: booking (add
//! before publish, point 1), release and free (whoever removes releases, point 2), the
//! prefill gate (point 3), output blocks, and freeing a removed rank's bookings.

use std::time::Instant;

use crossbeam_utils::CachePadded;

use super::drag::DecodeDrag;
use super::floor::{combined_after, FloorKind, FloorMix, COUNTER_RMW};
use super::listeners::{ForgetListener, SweepListener};
use super::rank::{add, add_reading, RankMap, RankState};
use super::rate::PrefillRate;
use super::shard::{shard_hash, Booking, Shard};
use super::types::{
    BookingOrigin, BookingRequest, BookingView, FreeOutcome, FreedBy, Released, ReservationConfig,
    ReservationError, MAX_PER_BOOKING,
};
use crate::ids::RankId;
use crate::ids::SelectionId;
#[cfg(not(loom))]
use crate::sync::atomic::AtomicBool;
use crate::sync::atomic::{AtomicU64, Ordering};
#[cfg(loom)]
use crate::sync::faults;
use crate::sync::{Arc, Mutex, Snapshot};

/// Everything but the sweeper handle; the sweep thread holds a weak reference to it.
pub(super) struct Inner {
    pub(super) config: ReservationConfig,
    mask: usize,
    pub(super) shards: Box<[CachePadded<Mutex<Shard>>]>,
    pub(super) ranks: Snapshot<RankMap>,
    /// Serializes registry writers (copy, insert/remove, swap). Never held with another lock.
    ranks_write: Mutex<()>,
    pub(super) expired_total: AtomicU64,
    pub(super) underflows: AtomicU64,
    /// Every rank's `active_prefill_tokens` summed (a selection's mean, without a pass
    /// over the ranks).
    pub(super) prefill_sum: CachePadded<AtomicU64>,
    /// Raised by the table's `Drop` so the sweep thread exits at once.
    #[cfg(not(loom))]
    pub(super) shutdown: AtomicBool,
    /// Told the id of every booking freed by the table itself (expiry, rank removal), so
    /// an index of ids kept outside the table (the engine's) can drop it too.
    pub(super) on_forget: Option<ForgetListener>,
    /// Told the id of every booking that ends, however (free, expiry, rank removal):
    /// what a booking owns outside the table (a session lease) is released with it.
    pub(super) on_end: Option<ForgetListener>,
    /// Called with `now` at the end of every expiry sweep, with no lock of the table
    /// held: what else expires on the table's clock (an approximate index's records)
    /// rides on its sweep instead of needing a thread of its own.
    pub(super) on_sweep: Option<SweepListener>,
    /// The partition's learned prefill rate (`rate.rs`).
    pub(super) prefill_rate: PrefillRate,
    /// How much a rank's decode load lengthens a time to first token there (`drag.rs`).
    pub(super) decode_drag: DecodeDrag,
    /// The weight of the floors' combined bound (`floor.rs`), set before the table is shared.
    pub(super) floor_mix: FloorMix,
    /// The zero of the ranks' last-prefill-completion clocks.
    epoch: Instant,
}

impl Inner {
    pub(super) fn new(mut config: ReservationConfig) -> Self {
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
            prefill_sum: CachePadded::new(AtomicU64::new(0)),
            #[cfg(not(loom))]
            shutdown: AtomicBool::new(false),
            on_forget: None,
            on_end: None,
            on_sweep: None,
            prefill_rate: PrefillRate::default(),
            decode_drag: DecodeDrag::default(),
            floor_mix: FloorMix::default(),
            epoch: Instant::now(),
            config,
        }
    }

    #[inline]
    pub(super) fn shard(&self, id: SelectionId) -> &Mutex<Shard> {
        &self.shards[shard_hash(id) as usize & self.mask]
    }

    /// Subtracts from a counter, never below zero (module docs, last paragraph); the
    /// value it left (`None` when `n` is 0 and nothing changed).
    #[inline]
    pub(super) fn sub(&self, counter: &AtomicU64, n: u64, what: &'static str) -> Option<u64> {
        if n == 0 {
            return None;
        }
        #[cfg(loom)]
        if faults::get().split_counter_rmw {
            let v = counter.load(Ordering::Relaxed);
            if v < n {
                self.underflow(what, v, n);
            }
            counter.store(v.saturating_sub(n), Ordering::Relaxed);
            return Some(v.saturating_sub(n));
        }
        // `COUNTER_RMW` (AcqRel), not Relaxed: the combined floor's writers (`floor.rs`).
        let prev = counter
            .fetch_update(COUNTER_RMW, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(n))
            })
            .unwrap_or_else(|v| v);
        if prev < n {
            self.underflow(what, prev, n);
        }
        Some(prev.saturating_sub(n))
    }

    /// Subtracts from one of `st`'s counters and lowers its group's floor to what is left,
    /// and the combined bound to the rank's figure (`floor.rs`), keeping the prefill sum
    /// with them.
    #[inline]
    pub(super) fn sub_rank(&self, st: &RankState, kind: FloorKind, n: u64, what: &'static str) {
        if let Some(left) = self.sub(st.counters.of(kind), n, what) {
            st.floor.lower(kind, left);
            if let Some(other) = st.counters.partner(kind) {
                let now = combined_after(self.floor_mix, kind, left, other);
                st.floor.lower_combined(now);
            }
            if kind == FloorKind::PrefillTokens {
                self.sub(&self.prefill_sum, n, "prefill token sum");
            }
        }
    }

    #[cold]
    pub(super) fn underflow(&self, what: &'static str, have: u64, sub: u64) {
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
        let (mut states, floors) = cur.fresh_states(&[rank]);
        let state = states.pop().expect("one rank, one state");
        self.ranks.store(cur.with_all(vec![state.clone()], floors));
        state
    }

    /// Makes the booking state of each of `ranks` that has none, in one registry rebuild:
    /// a worker's ranks when it registers, so its first bookings do not each copy the
    /// registry (at thousands of ranks a copy costs most of a millisecond).
    pub(super) fn ensure_ranks(&self, ranks: &[RankId]) {
        let _w = self.ranks_write.lock();
        let cur = self.ranks.load();
        let mut missing: Vec<RankId> = ranks
            .iter()
            .copied()
            .filter(|r| cur.get(r).is_none())
            .collect();
        missing.sort_unstable();
        missing.dedup();
        if !missing.is_empty() {
            let (fresh, floors) = cur.fresh_states(&missing);
            self.ranks.store(cur.with_all(fresh, floors));
        }
    }

    pub(super) fn insert(
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
            // shard lock. The decode drag's observation (`Booking::load_before`) is the
            // rank's load just before this booking's own additions.
            let (new_prompt_blocks, decode_blocks_before) = {
                let mut b = state.blocks.lock();
                #[cfg(loom)]
                let retired = b.retired && !faults::get().book_ignores_retired;
                #[cfg(not(loom))]
                let retired = b.retired;
                if retired {
                    // The rank was removed after we looked it up; its registry entry is
                    // gone, so the next lookup creates (or finds) the new state.
                    continue;
                }
                // Counted in its group before any counter of the rank moves (`idle.rs`).
                #[cfg(loom)]
                let late = faults::get().group_booking_late;
                #[cfg(not(loom))]
                let late = false;
                if !late {
                    state.floor.booking_started();
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
                let before = add_reading(&state.counters.decode_blocks, new);
                (new, before)
            };
            let prefill_before = add_reading(&state.counters.prefill_tokens, req.prefill_tokens);
            let load_before = (prefill_before, decode_blocks_before);
            add(&self.prefill_sum, req.prefill_tokens);
            add(&state.counters.requests, 1);
            #[cfg(loom)]
            if faults::get().group_booking_late {
                state.floor.booking_started();
            }
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
                load_before,
            };
            let view = self.view(id, &booking);
            if let Some(e) = expires_at {
                g.earliest_expiry = Some(g.earliest_expiry.map_or(e, |x| x.min(e)));
            }
            g.live.insert(id, booking);
            return Ok(view);
        }
    }

    pub(super) fn view(&self, id: SelectionId, b: &Booking) -> BookingView {
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
    pub(super) fn release(&self, b: &Booking) -> Released {
        let st = &b.rank;
        #[cfg(loom)]
        let early = faults::get().group_unbooking_early;
        #[cfg(not(loom))]
        let early = false;
        if early {
            st.floor.booking_ended();
        }
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
            self.sub_rank(st, FloorKind::DecodeBlocks, gone, "active_decode_blocks");
        }
        self.sub_rank(
            st,
            FloorKind::DecodeBlocks,
            b.output_blocks,
            "active_decode_blocks",
        );
        let prefill = if b.prefill_done { 0 } else { b.prefill_tokens };
        self.sub_rank(
            st,
            FloorKind::PrefillTokens,
            prefill,
            "active_prefill_tokens",
        );
        self.sub_rank(st, FloorKind::Requests, 1, "active_requests");
        // Uncounted in its group after every counter of the rank (`idle.rs`).
        if !early {
            st.floor.booking_ended();
        }
        Released {
            rank: st.rank,
            prefill_tokens: prefill,
            prompt_blocks_released: gone,
            output_blocks: b.output_blocks,
        }
    }

    /// Takes `id` out of its locked shard, remembering why; the caller releases it after
    /// dropping the lock.
    pub(super) fn take(&self, g: &mut Shard, id: SelectionId, by: FreedBy) -> Option<Booking> {
        let b = g.live.remove(&id)?;
        g.freed.record(id, by, self.config.recently_freed_per_shard);
        Some(b)
    }

    pub(super) fn free(&self, id: SelectionId) -> Result<FreeOutcome, ReservationError> {
        #[cfg(loom)]
        if faults::get().release_before_remove {
            return self.free_releasing_before_remove(id);
        }
        let mut g = self.shard(id).lock();
        match self.take(&mut g, id, FreedBy::Caller) {
            Some(b) => {
                drop(g);
                let released = self.release(&b);
                // The prompt's hash buffer serves this thread's next selection.
                crate::recycle::give_hashes(b.prompt_blocks);
                Ok(FreeOutcome::Freed(released))
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

    /// Nanoseconds from the table's epoch to `t` (0 for an instant before it).
    fn clock_ns(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// One observation of the prefill rate: `tokens` served from the later of the
    /// booking's creation and the rank's previous completion until `now` (`rate.rs`);
    /// and of the decode drag: the booking's time to first token against the tokens it
    /// waited for and the decode blocks its rank held when it was booked (`drag.rs`).
    fn observe_prefill(&self, b: &Booking, now: Instant) {
        let (rank, tokens, created) = (&b.rank, b.prefill_tokens, b.created);
        let t = self.clock_ns(now);
        let last = &rank.counters.last_prefill_done_ns;
        #[cfg(loom)]
        let prev = if faults::get().split_last_prefill_max {
            let p = last.load(Ordering::Relaxed);
            last.store(p.max(t), Ordering::Relaxed);
            p
        } else {
            last.fetch_max(t, Ordering::Relaxed)
        };
        #[cfg(not(loom))]
        let prev = last.fetch_max(t, Ordering::Relaxed);
        let booked = self.clock_ns(created);
        let secs = t.saturating_sub(booked.max(prev)) as f64 / 1e9;
        let (queued, decode_blocks) = b.load_before;
        let ttft = t.saturating_sub(booked) as f64 / 1e9;
        self.decode_drag
            .observe(ttft, queued.saturating_add(tokens), decode_blocks);
        self.prefill_rate.observe(tokens, secs);
    }

    pub(super) fn mark_prefill_complete(
        &self,
        id: SelectionId,
        now: Instant,
    ) -> Result<(), ReservationError> {
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
            self.sub_rank(
                &st,
                FloorKind::PrefillTokens,
                tokens,
                "active_prefill_tokens",
            );
            if let Some(b) = self.shard(id).lock().live.get_mut(&id) {
                b.prefill_done = true;
            }
            return Ok(());
        }
        b.prefill_done = true;
        self.sub_rank(
            &b.rank,
            FloorKind::PrefillTokens,
            b.prefill_tokens,
            "active_prefill_tokens",
        );
        // A replica's booking was made on another clock: its timing says nothing here.
        if b.origin == BookingOrigin::Local {
            self.observe_prefill(b, now);
        }
        Ok(())
    }

    pub(super) fn add_output_blocks(
        &self,
        id: SelectionId,
        n: u64,
    ) -> Result<(), ReservationError> {
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

    /// Raises the booking's output blocks to `total` (no change when it already has as
    /// many): a retry of the same total adds nothing. Returns the blocks added.
    pub(super) fn set_output_blocks(
        &self,
        id: SelectionId,
        total: u64,
    ) -> Result<u64, ReservationError> {
        let mut g = self.shard(id).lock();
        let Some(b) = g.live.get_mut(&id) else {
            return match g.freed.get(id) {
                Some(by) => Err(ReservationError::AlreadyFreed(id, by)),
                None => Err(ReservationError::UnknownSelectionId(id)),
            };
        };
        if total > MAX_PER_BOOKING {
            return Err(ReservationError::TooLarge(id, "output_blocks"));
        }
        let added = total.saturating_sub(b.output_blocks);
        if added > 0 {
            b.output_blocks = total;
            add(&b.rank.counters.decode_blocks, added);
        }
        Ok(added)
    }

    /// Tells the listener (if any) about bookings the table freed on its own. Called with
    /// no lock held.
    pub(super) fn forget(&self, ids: &[SelectionId]) {
        if let Some(f) = &self.on_forget {
            for &id in ids {
                f(id);
            }
        }
        self.ended(ids);
    }

    pub(super) fn ended(&self, ids: &[SelectionId]) {
        if let Some(f) = &self.on_end {
            for &id in ids {
                f(id);
            }
        }
    }

    pub(super) fn remove_rank(&self, rank: RankId) -> usize {
        self.remove_ranks(&[rank])
    }

    /// [`remove_rank`](Self::remove_rank) for several ranks at once (a worker's): one
    /// registry rebuild and one pass over the bookings, not one of each a rank.
    pub(super) fn remove_ranks(&self, ranks: &[RankId]) -> usize {
        let removed: Vec<Arc<RankState>> = {
            let _w = self.ranks_write.lock();
            let cur = self.ranks.load();
            let states: Vec<Arc<RankState>> =
                ranks.iter().filter_map(|r| cur.get(r).cloned()).collect();
            if !states.is_empty() {
                self.ranks.store(cur.without_all(ranks));
            }
            states
        };
        if removed.is_empty() {
            return 0;
        }
        // Out of the registry first, then retired: a booking that sees the flag finds the
        // registry already without the old state.
        for state in &removed {
            state.blocks.lock().retired = true;
        }
        let mut freed = 0;
        let mut taken: Vec<Booking> = Vec::new();
        let mut ids: Vec<SelectionId> = Vec::new();
        for shard in self.shards.iter() {
            let mut g = shard.lock();
            ids.clear();
            ids.extend(
                g.live
                    .iter()
                    .filter(|(_, b)| removed.iter().any(|s| Arc::ptr_eq(&b.rank, s)))
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
}
