//! Approximate retention of booked prompts: the index of a deployment without KV events.
//!
//! With no events, nothing tells the router what a rank's cache holds, so (as in Dynamo)
//! each booking is taken as evidence: "rank R now holds this prompt's blocks". Such a
//! record is only a guess, so it expires after a TTL (default 120 s; re-recording a block
//! refreshes it) and the records are size-bounded (default 2^20 blocks).
//!
//! This is the *approximate TTL primary* of DESIGN.md §5 ("events off"), and the short-TTL
//! prediction side index of "events on + prediction TTL". It writes into an ordinary
//! [`Index`] ([`Index::store_sequences`]), naming and keying each block by its sequence
//! hash, so queries (by sequence hashes) keep using the lock-free `find_matches*` paths
//! unchanged and two prompts that share a prefix name the same blocks. Bookings are
//! recorded by `select_and_reserve` and `reserve` after the booking stands.
//!
//! # Concurrency: no lock shared by the ranks on the booking path
//!
//! Each rank's records sit behind that rank's own mutex ([`records::RankRecords`]); the
//! rank → records map is an immutable snapshot read without a lock (arc-swap), replaced
//! under a registry mutex only when a rank records for the first time or is forgotten.
//! A booking ([`ApproxRecorder::record`]) takes its rank's mutex, and nested in it the
//! index's write locks for that rank, so the records and the index cannot disagree (an
//! expiry cannot remove a block a record is re-adding). It expires its own rank's due
//! records (O(1) amortized), never another rank's.
//!
//! The size bound is kept without a shared lock: a recording reserves room for its new
//! records on one atomic count (`len`, a compare-and-swap loop) before storing them, so
//! the records never exceed `max_blocks`. At the bound the index keeps recording, as a
//! bounded LRU would: the booking evicts its own rank's least recently booked records
//! (earliest deadline first, whole bookings, never the blocks of the prompt it records),
//! under the rank mutex it already holds. Only if its rank holds too few (a new or
//! little-used rank while others hold the bound) does it release that mutex and prune
//! across ranks, deepest records first down to `prune_to` of the bound (so shared shallow
//! prefixes survive), under a maintenance mutex, one rank's mutex at a time; then it
//! records what fits. A prompt longer than the room a prune leaves is recorded up to the
//! last block that fits (a prefix: never a block without its parent), the rest is counted
//! (`blocks_over_bound`) and the next maintenance pass ([`ApproxRecorder::expire`]: the
//! booking table's sweep calls it, at least every half TTL) prunes again.
//!
//! Loom model `loom_models::approx`: two ranks record at the bound at once (never over it;
//! negative control `split_room_reservation`), and a recording races the forgetting of
//! its rank (nothing left where no expiry reaches it; negative control
//! `record_ignores_retired`).
//!
//! Time is always a parameter (`now`), never read here, so a simulator can drive virtual
//! time; expiry is lazy (each `record` for its rank, or `expire`), with no thread.
//!
//! Costs: a record is O(its blocks) (a fully recorded prompt touches no index node),
//! plus at the bound O(evicted) for its rank's evictions;
//! expiry pops a per-rank deadline-ordered queue, O(1) amortized while `now` is monotonic
//! (a backwards `now` inserts in place instead); a prune is O(records) but frees
//! `(1 - prune_to) * max_blocks` of them. Deepest-first pruning and TTL refreshes that
//! always cover a prompt's whole prefix mean a rank never keeps a block without its
//! parent, so no hole cuts a recorded prefix short.
//!
//! The records assume the index's view of the rank is theirs: a caller that removes or
//! clears a rank in the index must also call [`ApproxRecorder::forget_rank`] (first, so a
//! booking racing the removal cannot leave blocks in the index that no record expires).

mod prune;
mod records;
#[cfg(all(test, not(loom)))]
mod tests;

use std::time::{Duration, Instant};

#[cfg(any(test, feature = "testing"))]
use smallvec::SmallVec;

use crate::ids::{RankId, Tier};

use super::event::IndexError;
use super::Index;
use crate::hash::mix::{HashMix, HashMixMap};
#[cfg(any(test, feature = "testing"))]
use crate::hash::next_sequence_hash;
use crate::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use crate::sync::{Arc, Mutex, Snapshot, StdArc};
use records::{Deadline, RankRecords, RankState};
use std::collections::HashSet;
use std::hash::BuildHasherDefault;

/// Retention policy of the approximate index, which bookings feed (Dynamo's defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ApproxConfig {
    /// How long a recorded block is believed held after its last booking.
    pub ttl: Duration,
    /// Most (rank, block) records kept. A booking that would go over evicts its rank's
    /// least recently booked records to make room; if its rank holds too few, it prunes
    /// across ranks (deepest first, down to `prune_to`) and records what then fits.
    pub max_blocks: usize,
    /// Fraction of `max_blocks` a prune leaves (clamped to 0..=1; NaN means 0.8), so
    /// pruning happens in batches, not on every booking once full.
    pub prune_to: f64,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        ApproxConfig {
            ttl: Duration::from_secs(120),
            max_blocks: 1 << 20,
            prune_to: 0.8,
        }
    }
}

/// Totals since the recorder was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApproxStats {
    /// Successful `record` calls with at least one block.
    pub records: u64,
    /// (rank, block) records created.
    pub blocks_recorded: u64,
    /// Existing records a booking named again.
    pub blocks_refreshed: u64,
    /// Records dropped because their TTL ran out.
    pub blocks_expired: u64,
    /// Records dropped to keep the size bound: evicted by a booking (its rank's least
    /// recently booked) or pruned across ranks (deepest first).
    pub blocks_pruned: u64,
    /// `record` calls the index refused (e.g. too many ranks).
    pub record_errors: u64,
    /// Blocks of booked prompts not recorded because the records were at the bound even
    /// after evicting and pruning.
    pub blocks_over_bound: u64,
}

/// What one `record` call changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // public in `kvr::testing`
pub struct RecordOutcome {
    /// Blocks this rank had no live record of (now recorded and stored in the index).
    pub stored: usize,
    /// Blocks already recorded for this rank; their deadline moved to `now + ttl` (never
    /// earlier than it was).
    pub refreshed: usize,
    /// Records of this rank that expired during this call.
    pub expired: usize,
    /// Blocks of the prompt (from the first that did not fit on) not recorded because the
    /// records were at `max_blocks` even after evicting and pruning (a prompt longer
    /// than the room a prune leaves); the next [`ApproxRecorder::expire`] prunes.
    pub over_bound: usize,
    /// Records evicted to make room for this prompt: the least recently booked of this
    /// rank (counted in [`ApproxStats::blocks_pruned`]).
    pub evicted: usize,
}

/// One recording's inputs, as [`ApproxRecorder::record_locked`] takes them.
#[derive(Clone, Copy)]
struct Attempt<'a> {
    seqs: &'a [u64],
    deadline: Deadline,
    now: Instant,
    /// Whether a shortage of room may be answered by `None` (prune, then retry) rather
    /// than by recording a prefix.
    may_defer: bool,
}

/// Where records are written: the [`Index`]; a seam so unit tests can make it refuse.
trait Sink {
    fn store(&self, rank: RankId, seqs: &[u64]) -> Result<usize, IndexError>;
    fn remove(&self, rank: RankId, seqs: &[u64]);
}

impl Sink for Index {
    fn store(&self, rank: RankId, seqs: &[u64]) -> Result<usize, IndexError> {
        Index::store_sequences(self, rank, Tier::Device, seqs)
    }

    fn remove(&self, rank: RankId, seqs: &[u64]) {
        Index::remove(self, rank, Tier::Device, seqs);
    }
}

/// Rank → its records, replaced whole when a rank comes or goes.
type RankMap = HashMixMap<RankId, Arc<RankRecords>>;

/// A test hook called with the rank while a recording holds that rank's mutex.
type RecordHook = StdArc<dyn Fn(RankId) + Send + Sync>;

#[derive(Default)]
struct Counters {
    records: AtomicU64,
    blocks_recorded: AtomicU64,
    blocks_refreshed: AtomicU64,
    blocks_expired: AtomicU64,
    blocks_pruned: AtomicU64,
    record_errors: AtomicU64,
    blocks_over_bound: AtomicU64,
}

/// Records bookings into an [`Index`] and retires them by TTL and size bound (module
/// docs: per-rank recording, maintenance off the booking path).
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // public in `kvr::testing`
pub struct ApproxRecorder {
    config: ApproxConfig,
    /// Records kept after a prune (`prune_to * max_blocks`, rounded down).
    target: usize,
    ranks: Snapshot<RankMap>,
    /// Serializes replacements of `ranks` (a rank's first recording, `forget_rank`).
    /// Never held with another lock.
    ranks_write: Mutex<()>,
    /// Live records across ranks; each rank's share changes under that rank's mutex,
    /// room for new records is reserved before they are stored.
    len: AtomicUsize,
    /// A recording was cut short by the bound: the next maintenance pass prunes.
    prune_wanted: AtomicBool,
    /// Serializes maintenance passes (`expire`); no booking takes it.
    maintenance: Mutex<()>,
    counters: Counters,
    hooked: AtomicBool,
    hook: Snapshot<Option<RecordHook>>,
}

impl std::fmt::Debug for ApproxRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApproxRecorder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Default for ApproxRecorder {
    fn default() -> Self {
        Self::new(ApproxConfig::default())
    }
}

impl ApproxRecorder {
    /// A recorder with no records, retaining as `config` says.
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // public in `kvr::testing`
    pub fn new(config: ApproxConfig) -> Self {
        let f = if config.prune_to.is_nan() {
            ApproxConfig::default().prune_to
        } else {
            config.prune_to.clamp(0.0, 1.0)
        };
        // Float to int saturates; `min` guards the rounding of huge bounds.
        let target = ((f * config.max_blocks as f64).floor() as usize).min(config.max_blocks);
        ApproxRecorder {
            config,
            target,
            ranks: Snapshot::new(RankMap::default()),
            ranks_write: Mutex::new(()),
            len: AtomicUsize::new(0),
            prune_wanted: AtomicBool::new(false),
            maintenance: Mutex::new(()),
            counters: Counters::default(),
            hooked: AtomicBool::new(false),
            hook: Snapshot::new(None),
        }
    }

    /// The retention policy it was made with (as given: `prune_to` unclamped).
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // public in `kvr::testing`
    pub fn config(&self) -> &ApproxConfig {
        &self.config
    }

    /// Records that `rank` holds the prompt whose complete blocks have these local
    /// hashes (first block first) on the device tier, as of `now`.
    ///
    /// Blocks the rank has no record of are stored into `index` (the chain from its root
    /// up to the last such block: idempotent for blocks already held); recorded ones get
    /// deadline `now + ttl` (never shortened, should `now` go backwards). Then whatever of
    /// this rank's records is due at `now` expires. With the records at `max_blocks`, the
    /// prompt is recorded up to the first new block that does not fit (module docs).
    /// An index refusal (too many ranks) changes nothing, is counted and is returned.
    #[cfg(any(test, feature = "testing"))]
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // public in `kvr::testing`
    pub fn record(
        &self,
        index: &Index,
        rank: RankId,
        local_hashes: &[u64],
        now: Instant,
    ) -> Result<RecordOutcome, IndexError> {
        let mut seqs: SmallVec<[u64; 128]> = SmallVec::with_capacity(local_hashes.len());
        let mut prev = None;
        for &l in local_hashes {
            let s = next_sequence_hash(prev, l);
            seqs.push(s);
            prev = Some(s);
        }
        self.record_into(index, rank, &seqs, now)
    }

    /// [`ApproxRecorder::record`] of a prompt given by its sequence hashes (a booking's
    /// prompt blocks), first block first.
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // public in `kvr::testing`
    pub fn record_sequence(
        &self,
        index: &Index,
        rank: RankId,
        seqs: &[u64],
        now: Instant,
    ) -> Result<RecordOutcome, IndexError> {
        self.record_into(index, rank, seqs, now)
    }

    /// The rank's records: one lock-free snapshot load, or on the rank's first recording
    /// a new entry published under the registry mutex.
    fn rank_records(&self, rank: RankId) -> Arc<RankRecords> {
        if let Some(r) = self.ranks.guard().get(&rank) {
            return r.clone();
        }
        let _w = self.ranks_write.lock();
        let cur = self.ranks.load();
        if let Some(r) = cur.get(&rank) {
            return r.clone();
        }
        let r = Arc::new(RankRecords::new(rank));
        let mut next = (*cur).clone();
        next.insert(rank, r.clone());
        self.ranks.store(next);
        r
    }

    /// Reserves room for up to `want` new records; returns how many fit.
    fn reserve(&self, want: usize) -> usize {
        if want == 0 {
            return 0;
        }
        let max = self.config.max_blocks;
        #[cfg(loom)]
        if crate::sync::faults::get().split_room_reservation {
            // Negative control: load, then store (two recordings can take the same room).
            let len = self.len.load(Ordering::Relaxed);
            let granted = want.min(max.saturating_sub(len));
            self.len.store(len + granted, Ordering::Relaxed);
            return granted;
        }
        let mut granted = 0;
        let _ = self
            .len
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |len| {
                granted = want.min(max.saturating_sub(len));
                (granted > 0).then_some(len + granted)
            });
        granted
    }

    fn record_into(
        &self,
        index: &impl Sink,
        rank: RankId,
        seqs: &[u64],
        now: Instant,
    ) -> Result<RecordOutcome, IndexError> {
        if seqs.is_empty() {
            return Ok(RecordOutcome::default());
        }
        let deadline = match now.checked_add(self.config.ttl) {
            Some(t) => Deadline::At(t),
            None => Deadline::Never,
        };
        let mut evicted = 0;
        let mut pruned = false;
        loop {
            let rr = self.rank_records(rank);
            let mut st = rr.state.lock();
            #[cfg(loom)]
            let retired = st.retired && !crate::sync::faults::get().record_ignores_retired;
            #[cfg(not(loom))]
            let retired = st.retired;
            if retired {
                // Forgotten after we looked it up: the next lookup finds (or makes) the
                // new records.
                continue;
            }
            let attempt = Attempt {
                seqs,
                deadline,
                now,
                may_defer: !pruned,
            };
            if let Some(out) = self.record_locked(index, rank, &mut st, &attempt, &mut evicted)? {
                return Ok(out);
            }
            // The rank's own records could not make room: prune across ranks (rank
            // mutex released, one rank's at a time), then record what fits.
            drop(st);
            self.prune_now(index);
            pruned = true;
        }
    }

    /// The size bound's prune, run by a booking its own rank's records could not make
    /// room for (the rank is new or holds little while others hold the bound).
    fn prune_now(&self, index: &impl Sink) {
        let _m = self.maintenance.lock();
        let ranks = self.ranks.load();
        self.prune(index, &ranks);
    }

    /// Makes room for `want` more records: reserves what is free, then evicts the rank's
    /// least recently booked records (never the prompt's) for the rest. Returns
    /// the room reserved; adds what it evicted to `evicted`.
    fn make_room(
        &self,
        index: &impl Sink,
        rank: RankId,
        st: &mut RankState,
        seqs: &[u64],
        want: usize,
        evicted: &mut usize,
    ) -> usize {
        let mut granted = self.reserve(want);
        if granted < want {
            let keep: HashSet<u64, BuildHasherDefault<HashMix>> = seqs.iter().copied().collect();
            let n = st.evict_oldest(index, rank, want - granted, &keep);
            if n > 0 {
                // Under the rank's mutex, as every change of its share of `len`.
                self.len.fetch_sub(n, Ordering::Relaxed);
                self.counters
                    .blocks_pruned
                    .fetch_add(n as u64, Ordering::Relaxed);
                *evicted += n;
                granted += self.reserve(want - granted);
            }
        }
        granted
    }

    /// [`ApproxRecorder::record`] with the rank's mutex held. `None` (nothing recorded,
    /// no room kept) when the attempt may defer and there is not room for the whole
    /// prompt even after evicting the rank's least recent records.
    fn record_locked(
        &self,
        index: &impl Sink,
        rank: RankId,
        st: &mut RankState,
        attempt: &Attempt<'_>,
        evicted: &mut usize,
    ) -> Result<Option<RecordOutcome>, IndexError> {
        let Attempt {
            seqs,
            deadline,
            now,
            may_defer,
        } = *attempt;
        if self.hooked.load(Ordering::Relaxed) {
            if let Some(h) = &*self.hook.load() {
                h(rank);
            }
        }
        // The bound: room for the new blocks (evicting the rank's least recent records
        // if need be), or, failing that, for those up to the first that does not fit (a
        // prefix of the prompt, so no record lacks its parent).
        let new = seqs.iter().filter(|&&s| !st.holds(s)).count();
        let granted = self.make_room(index, rank, st, seqs, new, evicted);
        if granted < new && may_defer {
            self.len.fetch_sub(granted, Ordering::Relaxed);
            return Ok(None);
        }
        let keep = if granted == new {
            seqs.len()
        } else {
            self.prune_wanted.store(true, Ordering::Relaxed);
            seqs.iter()
                .enumerate()
                .filter(|(_, &s)| !st.holds(s))
                .nth(granted)
                .map_or(seqs.len(), |(i, _)| i)
        };
        let over_bound = seqs.len() - keep;
        let seqs = &seqs[..keep];
        if let Some(last) = seqs.iter().rposition(|&s| !st.holds(s)) {
            if let Err(e) = index.store(rank, &seqs[..=last]) {
                self.len.fetch_sub(granted, Ordering::Relaxed);
                self.counters.record_errors.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
        }
        let applied = st.apply(seqs, deadline);
        // A prompt naming one block twice reserved room twice.
        let expired = st.expire(index, rank, now);
        self.len.fetch_sub(
            granted - applied.stored.min(granted) + expired,
            Ordering::Relaxed,
        );
        let out = RecordOutcome {
            stored: applied.stored,
            refreshed: applied.refreshed,
            expired,
            over_bound,
            evicted: *evicted,
        };
        self.count(&out);
        Ok(Some(out))
    }

    fn count(&self, out: &RecordOutcome) {
        let c = &self.counters;
        c.records.fetch_add(1, Ordering::Relaxed);
        c.blocks_recorded
            .fetch_add(out.stored as u64, Ordering::Relaxed);
        c.blocks_refreshed
            .fetch_add(out.refreshed as u64, Ordering::Relaxed);
        c.blocks_expired
            .fetch_add(out.expired as u64, Ordering::Relaxed);
        c.blocks_over_bound
            .fetch_add(out.over_bound as u64, Ordering::Relaxed);
    }

    /// The maintenance pass: removes every record whose deadline is `<= now` from
    /// `index`, rank by rank, then, if a booking found the records at the bound, prunes
    /// the deepest down to `prune_to` of it. Returns how many expired. Serialized with
    /// other passes; takes one rank's mutex at a time, so bookings go on meanwhile.
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // public in `kvr::testing`
    pub fn expire(&self, index: &Index, now: Instant) -> usize {
        self.maintain(index, now)
    }

    fn maintain(&self, index: &impl Sink, now: Instant) -> usize {
        let _m = self.maintenance.lock();
        let ranks = self.ranks.load();
        let mut expired = 0;
        for rr in ranks.values() {
            let mut st = rr.state.lock();
            let n = st.expire(index, rr.rank, now);
            self.len.fetch_sub(n, Ordering::Relaxed);
            expired += n;
        }
        self.counters
            .blocks_expired
            .fetch_add(expired as u64, Ordering::Relaxed);
        if self.prune_wanted.swap(false, Ordering::Relaxed) {
            self.prune(index, &ranks);
        }
        expired
    }

    /// Forgets every record of `rank`, without touching the index: for when the caller
    /// removes or clears the rank there (call this first: else a booking in between could
    /// store blocks that no record expires).
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // public in `kvr::testing`
    pub fn forget_rank(&self, rank: RankId) {
        let gone = {
            let _w = self.ranks_write.lock();
            let cur = self.ranks.load();
            let Some(r) = cur.get(&rank).cloned() else {
                return;
            };
            let mut next = (*cur).clone();
            next.remove(&rank);
            self.ranks.store(next);
            r
        };
        let mut st = gone.state.lock();
        let n = st.retire();
        self.len.fetch_sub(n, Ordering::Relaxed);
    }

    /// Live (rank, block) records.
    #[cfg(any(test, feature = "testing"))]
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // public in `kvr::testing`
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// No live record.
    #[cfg(any(test, feature = "testing"))]
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // public in `kvr::testing`
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Totals since the recorder was made.
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))] // public in `kvr::testing`
    pub fn stats(&self) -> ApproxStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ApproxStats {
            records: get(&c.records),
            blocks_recorded: get(&c.blocks_recorded),
            blocks_refreshed: get(&c.blocks_refreshed),
            blocks_expired: get(&c.blocks_expired),
            blocks_pruned: get(&c.blocks_pruned),
            record_errors: get(&c.record_errors),
            blocks_over_bound: get(&c.blocks_over_bound),
        }
    }

    /// Test hook: `hook` is called with the rank each time a recording holds that rank's
    /// mutex (before it touches the index). Not part of the API.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn set_record_hook(&self, hook: Option<RecordHook>) {
        self.hooked.store(hook.is_some(), Ordering::Relaxed);
        self.hook.store(hook);
    }
}
