//! The engine: partitions, selection ids, and the booking lifecycle routed to the right
//! partition (DESIGN.md §2, §8). Constructing an engine spawns nothing and needs no async
//! runtime; a partition's expiry sweep starts with its first booking.

use crate::sync::{std_atomic, StdArc};
use std::cell::RefCell;
use std::time::Instant;

use crate::config::ConfigError;
use crate::config::PartitionConfig;
use crate::cost::SelectionRng;
use crate::idmap::IdMap;
use crate::ids::PartitionKey;
use crate::ids::RankId;
use crate::ids::SelectionId;
use crate::partition::Partition;
use crate::reservation::{
    BookingRequest, BookingStatus, BookingView, ForgetListener, FreeOutcome, ReservationError,
};
use crate::select::{Decision, Outcome, SelectError, SelectRequest};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::{Mutex, ShardedMap, Snapshot};

/// Why an engine call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EngineError {
    /// No partition has this key (or the handle names one removed, or another engine's).
    UnknownPartition(PartitionKey),
    /// A partition with this key exists already.
    PartitionExists(PartitionKey),
    /// No booking has this id (never made, or freed and forgotten).
    UnknownSelectionId(SelectionId),
    /// A caller's id is taken by a live booking (an error, never an overwrite).
    DuplicateSelectionId(SelectionId),
    /// The rank named is not a rank of the partition's workers.
    UnknownRank(RankId),
    /// Any other refusal of the partition's reservation table.
    Reservation(ReservationError),
    /// A partition's configuration was refused (e.g. a remote index with events off).
    InvalidConfig(ConfigError),
}

impl std::fmt::Display for EngineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngineError::UnknownPartition(k) => {
                write!(
                    f,
                    "no partition for model {:?}, group {:?}",
                    k.model, k.routing_group
                )
            }
            EngineError::PartitionExists(k) => {
                write!(
                    f,
                    "partition for model {:?}, group {:?} exists",
                    k.model, k.routing_group
                )
            }
            EngineError::UnknownSelectionId(id) => write!(f, "unknown selection id {id}"),
            EngineError::DuplicateSelectionId(id) => write!(f, "selection id {id} is in use"),
            EngineError::UnknownRank(r) => write!(f, "rank {r} is not in the partition"),
            EngineError::Reservation(e) => write!(f, "{e}"),
            EngineError::InvalidConfig(m) => write!(f, "invalid configuration: {m}"),
        }
    }
}

impl std::error::Error for EngineError {}

impl From<ReservationError> for EngineError {
    fn from(e: ReservationError) -> Self {
        match e {
            ReservationError::DuplicateSelectionId(id) => EngineError::DuplicateSelectionId(id),
            ReservationError::UnknownSelectionId(id) => EngineError::UnknownSelectionId(id),
            other => EngineError::Reservation(other),
        }
    }
}

impl From<SelectError> for EngineError {
    fn from(e: SelectError) -> Self {
        match e {
            SelectError::Reservation(r) => r.into(),
            SelectError::UnknownRank(r) => EngineError::UnknownRank(r),
        }
    }
}

std::thread_local! {
    /// Each thread's tie-break RNG per engine (by engine uid), most recent last; a few
    /// entries, since a thread rarely serves more than one or two engines.
    static RNGS: RefCell<Vec<(u64, SelectionRng)>> = const { RefCell::new(Vec::new()) };
}

std::thread_local! {
    /// Each thread's block of selection ids per engine: (engine uid, next, end).
    static IDS: RefCell<Vec<(u64, u64, u64)>> = const { RefCell::new(Vec::new()) };
}

/// Selection ids a thread takes from the engine's counter at a time.
const ID_BLOCK: u64 = 1024;

/// Engines remembered per thread by [`RNGS`] and [`IDS`].
const RNGS_PER_THREAD: usize = 8;

/// Distinguishes engines in [`RNGS`].
static ENGINE_UIDS: std_atomic::AtomicU64 = std_atomic::AtomicU64::new(1);

/// How often a booking with a minted id is retried when the minted id is taken (a caller
/// chose it, or it is remembered as freed recently).
const MINT_ATTEMPTS: usize = 8;

/// The partition an engine call acts on: by key (one lookup), or a handle the caller
/// already holds (no lookup, no allocation: hosts behind the C ABI route through handles).
/// Every engine call taking one accepts `&PartitionKey`, `&Partition` or
/// `&Arc<Partition>`.
#[derive(Clone, Copy, Debug)]
pub enum PartitionRef<'a> {
    /// By key.
    Key(&'a PartitionKey),
    /// A partition of this engine the caller holds.
    Handle(&'a Partition),
}

impl<'a> From<&'a PartitionKey> for PartitionRef<'a> {
    fn from(key: &'a PartitionKey) -> Self {
        PartitionRef::Key(key)
    }
}

impl<'a> From<&'a Partition> for PartitionRef<'a> {
    fn from(p: &'a Partition) -> Self {
        PartitionRef::Handle(p)
    }
}

impl<'a> From<&'a StdArc<Partition>> for PartitionRef<'a> {
    fn from(p: &'a StdArc<Partition>) -> Self {
        PartitionRef::Handle(p)
    }
}

/// A partition a call resolved: the caller's handle, or the one its key named.
enum Resolved<'a> {
    Handle(&'a Partition),
    Keyed(StdArc<Partition>),
}

impl std::ops::Deref for Resolved<'_> {
    type Target = Partition;
    fn deref(&self) -> &Partition {
        match self {
            Resolved::Handle(p) => p,
            Resolved::Keyed(p) => p,
        }
    }
}

/// The selection engine.
pub struct Engine {
    partitions: ShardedMap<PartitionKey, StdArc<Partition>>,
    /// Partitions by number (index = number), for the id index; swapped whole when a
    /// partition comes or goes (rare), read lock-free.
    numbered: Snapshot<Vec<Option<StdArc<Partition>>>>,
    numbering: Mutex<()>,
    /// Selection id → number of the partition holding the booking this engine made.
    /// Lock-free reads; replica bookings are found by scanning the partitions.
    by_selection: StdArc<IdMap>,
    next_id: AtomicU64,
    seed: u64,
    threads: AtomicU64,
    uid: u64,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("partitions", &self.partitions.len())
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl Default for Engine {
    fn default() -> Self {
        Self::new()
    }
}

impl Engine {
    /// An engine whose random tie-breaks are seeded from the clock.
    pub fn new() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self::with_seed(seed)
    }

    /// An engine whose random choices are a function of `seed` (per thread, in the order
    /// threads first select).
    pub fn with_seed(seed: u64) -> Self {
        Engine {
            partitions: ShardedMap::new(),
            numbered: Snapshot::new(vec![None]),
            numbering: Mutex::new(()),
            // 64 shards of at least 128 slots (128 KiB): rebuilt once per ~100 bookings
            // of a shard, not every few (`IdMap::new`).
            by_selection: StdArc::new(if cfg!(loom) {
                IdMap::new(1, 8)
            } else {
                IdMap::new(64, 128)
            }),
            next_id: AtomicU64::new(1),
            seed,
            threads: AtomicU64::new(0),
            uid: ENGINE_UIDS.fetch_add(1, std_atomic::Ordering::Relaxed),
        }
    }

    /// Creates a partition of `config` under `key`: refused when the key is taken or the
    /// configuration is invalid.
    pub fn create_partition(
        &self,
        key: PartitionKey,
        config: PartitionConfig,
    ) -> Result<StdArc<Partition>, EngineError> {
        let _n = self.numbering.lock();
        let mut created = false;
        let numbered = self.numbered.load();
        let number = numbered.len() as u64;
        if self.partitions.get(&key).is_some() {
            return Err(EngineError::PartitionExists(key));
        }
        // Bookings the partition frees on its own (expiry, a rank leaving) leave the id
        // index with them.
        let ids = self.by_selection.clone();
        let forget: ForgetListener = StdArc::new(move |id| {
            ids.remove(id);
        });
        let partition = Partition::with_forget_listener(key.clone(), config, forget)
            .map_err(EngineError::InvalidConfig)?;
        let p = self.partitions.get_or_insert_with(key.clone(), || {
            created = true;
            StdArc::new(partition.with_number(number))
        });
        if !created {
            return Err(EngineError::PartitionExists(key));
        }
        let mut next = (*numbered).clone();
        next.push(Some(p.clone()));
        self.numbered.store(next);
        Ok(p)
    }

    /// The partition under `key`.
    pub fn partition(&self, key: &PartitionKey) -> Result<StdArc<Partition>, EngineError> {
        self.partitions
            .get(key)
            .ok_or_else(|| EngineError::UnknownPartition(key.clone()))
    }

    /// Removes the partition under `key` with its bookings (their ids are forgotten);
    /// `false` if there was none. Handles to it stay valid for reads, and engine calls
    /// through them are refused.
    pub fn remove_partition(&self, key: &PartitionKey) -> bool {
        let _n = self.numbering.lock();
        let Some(p) = self.partitions.remove(key) else {
            return false;
        };
        let mut next = (*self.numbered.load()).clone();
        next[p.number() as usize] = None;
        self.numbered.store(next);
        // Its bookings go with it: their ids leave the index (a booking racing in through
        // a handle is caught lazily by `owner_of`/`claim_id`).
        for id in p.bookings().live_ids() {
            self.by_selection.remove(id);
        }
        true
    }

    /// A fresh engine-unique selection id (never 0). Each thread takes ids from the
    /// engine's counter a block at a time and hands them out itself, so threads booking
    /// at once do not all write one cache line; ids are unique, not globally ordered.
    pub fn mint_selection_id(&self) -> SelectionId {
        IDS.with(|cell| {
            let mut list = cell.borrow_mut();
            let at = match list.iter().position(|b| b.0 == self.uid) {
                Some(at) => at,
                None => {
                    if list.len() >= RNGS_PER_THREAD {
                        list.remove(0);
                    }
                    list.push((self.uid, 0, 0));
                    list.len() - 1
                }
            };
            let block = &mut list[at];
            if block.1 == block.2 {
                let start = self.next_id.fetch_add(ID_BLOCK, Ordering::Relaxed);
                *block = (self.uid, start, start + ID_BLOCK);
            }
            block.1 += 1;
            block.1 - 1
        })
    }

    /// Runs `f` with this thread's RNG for this engine, taken out of the thread-local list
    /// for the call (so a host hook that selects again from inside a selection gets its
    /// own RNG instead of a borrow conflict).
    fn with_rng<R>(&self, f: impl FnOnce(&mut SelectionRng) -> R) -> R {
        let taken = RNGS.with(|cell| {
            let mut list = cell.borrow_mut();
            let at = list.iter().position(|(uid, _)| *uid == self.uid)?;
            Some(list.remove(at).1)
        });
        let mut rng = taken.unwrap_or_else(|| {
            let n = self.threads.fetch_add(1, Ordering::Relaxed);
            SelectionRng::from_seed(self.seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        });
        let r = f(&mut rng);
        RNGS.with(|cell| {
            let mut list = cell.borrow_mut();
            if list.len() >= RNGS_PER_THREAD {
                list.remove(0);
            }
            list.push((self.uid, rng));
        });
        r
    }

    /// Advisory selection on `at` (a key or a handle): decision and projected load,
    /// nothing booked.
    pub fn select<'a>(
        &self,
        at: impl Into<PartitionRef<'a>>,
        req: &SelectRequest<'_>,
    ) -> Result<Outcome, EngineError> {
        let p = self.resolve(at.into())?;
        Ok(self.with_rng(|rng| p.select(req, rng)))
    }

    /// Booked selection on `at` (a key or a handle): the chosen rank is booked before this
    /// returns, under the request's selection id or one the engine mints.
    pub fn select_and_reserve<'a>(
        &self,
        at: impl Into<PartitionRef<'a>>,
        req: &SelectRequest<'_>,
    ) -> Result<Outcome, EngineError> {
        let p = self.resolve(at.into())?;
        let p = &*p;
        let _pin = call_pin();
        let mut attempts = 0;
        loop {
            let id = self.claim_id(p, req.selection_id)?;
            let r = self.with_rng(|rng| p.select_and_reserve(req, id, Instant::now(), rng));
            self.settle_claim(id, r.as_ref().ok());
            match r {
                Err(SelectError::Reservation(ReservationError::DuplicateSelectionId(_)))
                    if req.selection_id.is_none() && attempts < MINT_ATTEMPTS =>
                {
                    attempts += 1; // a minted id the table still remembers: mint again
                }
                r => return Ok(r?),
            }
        }
    }

    /// Books a request on a rank the caller chose, in `at` (a key or a handle). With a
    /// prompt, its blocks join the rank's active blocks; without, only `prefill_tokens`
    /// are booked.
    pub fn reserve<'a>(
        &self,
        at: impl Into<PartitionRef<'a>>,
        rank: RankId,
        prompt: Option<&SelectRequest<'_>>,
        prefill_tokens: Option<u64>,
        selection_id: Option<SelectionId>,
    ) -> Result<Decision, EngineError> {
        let p = self.resolve(at.into())?;
        let p = &*p;
        let mut attempts = 0;
        loop {
            let id = self.claim_id(p, selection_id)?;
            let r = p.reserve(rank, prompt, prefill_tokens, id, Instant::now());
            let outcome = r.as_ref().ok().map(|d| Outcome::Selected(d.clone()));
            self.settle_claim(id, outcome.as_ref());
            match r {
                Err(SelectError::Reservation(ReservationError::DuplicateSelectionId(_)))
                    if selection_id.is_none() && attempts < MINT_ATTEMPTS =>
                {
                    attempts += 1;
                }
                r => return Ok(r?),
            }
        }
    }

    /// The partition `at` names: a key's, or a handle that is a live partition of this
    /// engine (not removed, not another engine's: one lock-free load of the numbered
    /// list).
    fn resolve<'a>(&self, at: PartitionRef<'a>) -> Result<Resolved<'a>, EngineError> {
        match at {
            PartitionRef::Key(key) => self.partition(key).map(Resolved::Keyed),
            PartitionRef::Handle(p) => {
                let numbered = self.numbered.guard();
                match numbered.get(p.number() as usize) {
                    Some(Some(q)) if std::ptr::eq(StdArc::as_ptr(q), p) => Ok(Resolved::Handle(p)),
                    _ => Err(EngineError::UnknownPartition(p.key().clone())),
                }
            }
        }
    }

    /// Installs a booking received from a replica peer in `at` (a key or a handle). It is
    /// not indexed by id: the lifecycle calls find it by scanning the partitions
    /// (DESIGN.md §8). Its rank must be a registered worker's (else `UnknownRank`), and it
    /// lives at most [`MAX_REPLICA_BOOKING_TTL`](crate::MAX_REPLICA_BOOKING_TTL).
    pub fn install_replica_booking<'a>(
        &self,
        at: impl Into<PartitionRef<'a>>,
        booking: BookingRequest,
    ) -> Result<(), EngineError> {
        let p = self.resolve(at.into())?;
        let p = &*p;
        // A registered rank only, its lifetime capped (`Partition::admit_replica_booking`).
        let rank = booking.rank;
        let booking = p
            .admit_replica_booking(booking)
            .ok_or(EngineError::UnknownRank(rank))?;
        // Selection ids are unique across the engine (DESIGN.md §2): not a booking of this
        // engine's, nor one live in another partition.
        let id = booking.selection_id;
        let live_elsewhere = self.by_selection.get(id).is_some()
            || self.partitions.entries().into_iter().any(|(_, q)| {
                !std::ptr::eq(StdArc::as_ptr(&q), p)
                    && matches!(q.bookings.status(id), Some(BookingStatus::Live(_)))
            });
        if live_elsewhere {
            return Err(EngineError::DuplicateSelectionId(id));
        }
        let now = Instant::now();
        let blocks = p
            .indexing
            .recorder
            .is_some()
            .then(|| booking.prompt_blocks.clone());
        // Marked before the booking is installed, so a claim that checks after its own
        // insert looks at this partition's table.
        p.note_replica_booking();
        // The table starts its configured sweep on its first booking, replicas included.
        p.bookings.install_replica_booking(booking, now)?;
        // A cached booking replayed from a peer is a booking too: recorded after it stands.
        if let Some(blocks) = blocks {
            p.indexing.record_booking(&p.index, rank, &blocks, now);
        }
        Ok(())
    }

    /// Reserves `id` (minted or the caller's) in the id → partition index.
    ///
    /// A minted id that a caller already took is skipped (minting again). A caller's id
    /// whose entry names a removed partition is a leftover of that partition and is
    /// reclaimed; any other entry makes it a duplicate.
    fn claim_id(&self, p: &Partition, id: Option<SelectionId>) -> Result<SelectionId, EngineError> {
        let Some(id) = id else {
            loop {
                let id = self.mint_selection_id();
                if self.by_selection.insert_new(id, p.number()).is_ok() {
                    if self.live_replica_elsewhere(p, id) {
                        self.by_selection.remove(id);
                        continue;
                    }
                    return Ok(id);
                }
            }
        };
        match self.by_selection.insert_new(id, p.number()) {
            Ok(()) => {}
            Err(number) if self.partition_numbered(number).is_none() => {
                self.by_selection.remove(id);
                self.by_selection
                    .insert_new(id, p.number())
                    .map_err(|_| EngineError::DuplicateSelectionId(id))?;
            }
            Err(_) => return Err(EngineError::DuplicateSelectionId(id)),
        }
        // Replica bookings are not in the id index: an id live as one in another partition
        // is taken too (DESIGN.md §2: ids are unique across the engine). Claimed first and
        // checked after, so a replica installed meanwhile is seen by one side or the other
        // except in the window between its check and its insert (see
        // `install_replica_booking`).
        if self.live_replica_elsewhere(p, id) {
            self.by_selection.remove(id);
            return Err(EngineError::DuplicateSelectionId(id));
        }
        Ok(id)
    }

    /// Whether `id` is a live booking of a partition other than `p` that holds replica
    /// bookings (the only bookings the id index does not name). No allocation: one
    /// snapshot read of the numbered list, and a table lookup per such partition.
    fn live_replica_elsewhere(&self, p: &Partition, id: SelectionId) -> bool {
        let numbered = self.numbered.guard();
        numbered.iter().flatten().any(|q| {
            !std::ptr::eq(StdArc::as_ptr(q), p)
                && q.holds_replica_bookings()
                && matches!(q.bookings.status(id), Some(BookingStatus::Live(_)))
        })
    }

    /// The live partition with this number, if any.
    fn partition_numbered(&self, number: u64) -> Option<StdArc<Partition>> {
        self.numbered
            .guard()
            .get(number as usize)
            .and_then(|p| p.clone())
    }

    /// Keeps the id claimed only if a booking was made (which also started the
    /// partition's sweep: the table does on its first booking).
    fn settle_claim(&self, id: SelectionId, outcome: Option<&Outcome>) {
        if !matches!(outcome, Some(Outcome::Selected(_))) {
            self.by_selection.remove(id);
        }
    }

    /// The partition holding booking `id`: the id index first, then a scan of the
    /// partitions (replica bookings; and ids freed recently, so a repeated call is answered
    /// by the table that remembers it, idempotently).
    fn owner_of(&self, id: SelectionId) -> Result<StdArc<Partition>, EngineError> {
        if let Some(number) = self.by_selection.get(id) {
            match self.partition_numbered(number) {
                Some(p) if p.bookings.status(id).is_some() => return Ok(p),
                Some(_) => {}
                // The partition was removed after the booking was indexed: a leftover.
                None => {
                    self.by_selection.remove(id);
                }
            }
        }
        #[cfg(loom)]
        if crate::sync::faults::get().skip_partition_scan {
            return Err(EngineError::UnknownSelectionId(id));
        }
        self.partitions
            .entries()
            .into_iter()
            .map(|(_, p)| p)
            .find(|p| p.bookings.status(id).is_some())
            .ok_or(EngineError::UnknownSelectionId(id))
    }

    /// Whether the id index names a partition for `id` (loom models: no stale entries).
    #[cfg(loom)]
    pub(crate) fn indexed(&self, id: SelectionId) -> bool {
        self.by_selection.get(id).is_some()
    }

    /// A live booking, wherever it is (its partition's table): local or a replica's,
    /// with its partition. `None` for an id that is not live.
    pub fn booking(&self, id: SelectionId) -> Option<(StdArc<Partition>, BookingView)> {
        let p = self.owner_of(id).ok()?;
        let view = p.bookings.get(id)?;
        Some((p, view))
    }

    /// The request's prefill is done: its prefill tokens leave the rank's load.
    pub fn mark_prefill_complete(&self, id: SelectionId) -> Result<(), EngineError> {
        Ok(self.owner_of(id)?.bookings.mark_prefill_complete(id)?)
    }

    /// The request produced `n` more output blocks (decode load).
    pub fn add_output_blocks(&self, id: SelectionId, n: u64) -> Result<(), EngineError> {
        Ok(self.owner_of(id)?.bookings.add_output_blocks(id, n)?)
    }

    /// The booking has produced `total` output blocks: idempotent (a retry adds nothing),
    /// unlike [`add_output_blocks`](Self::add_output_blocks). Returns the blocks added.
    pub fn set_output_blocks(&self, id: SelectionId, total: u64) -> Result<u64, EngineError> {
        Ok(self.owner_of(id)?.bookings.set_output_blocks(id, total)?)
    }

    /// The request finished: everything it booked is released.
    pub fn free(&self, id: SelectionId) -> Result<FreeOutcome, EngineError> {
        let _pin = call_pin();
        let p = self.owner_of(id)?;
        let out = p.bookings.free(id)?;
        self.by_selection.remove(id);
        Ok(out)
    }
}

/// One epoch pin around a whole booked selection or free. The pins inside (the id map's,
/// the index walk's) nest in it, and a nested pin is a counter increment; crossbeam runs
/// its garbage collection on every 128th outermost pin of a thread, so this makes that
/// once per 128 calls instead of once per 128 pins (every 32nd selection in the selection
/// harness, whose every 32nd call was the slowest: a per-call dump, commit ed80769).
#[inline]
fn call_pin() -> crate::sync::epoch::Guard {
    crate::sync::epoch::pin()
}
