//! Approximate retention of booked prompts: the index of a deployment without KV events.
//!
//! With no events, nothing tells the router what a rank's cache holds, so (as in Dynamo)
//! each booking is taken as evidence: "rank R now holds this prompt's blocks". Such a
//! record is only a guess, so it expires after a TTL (default 120 s; re-recording a block
//! refreshes it) and the records are size-bounded (default 2^20 blocks; when over, pruned
//! to 80 % of the bound, deepest blocks first, so shared shallow prefixes survive).
//!
//! This is the *approximate TTL primary* of DESIGN.md §5 ("events off"), and later the
//! short-TTL prediction side index of "events on + prediction TTL". It writes into an
//! ordinary [`Index`] ([`Index::store_sequences`]), naming and keying each block by its
//! sequence hash, so queries (by sequence hashes) keep using the lock-free `find_matches*`
//! paths unchanged and two prompts that share a prefix name the same blocks. Recording a booking from `select_and_reserve`
//! (after the booking succeeds) is issue 7's wiring, not this module's.
//!
//! Concurrency: the bookkeeping sits behind one mutex (`crate::sync::Mutex`). That is
//! the booking-recording path only; readers never touch it, so queries stay lock-free.
//! The mutex is held across the index writes so the index and the bookkeeping cannot
//! disagree (a concurrent expiry cannot remove a block a record is re-adding).
//!
//! Time is always a parameter (`now`), never read here, so a simulator can drive virtual
//! time; expiry is lazy (each `record`, or an explicit `expire`), with no thread.
//!
//! Costs: a record is O(its blocks) (a fully recorded prompt touches no index node);
//! expiry pops a deadline-ordered queue, O(1) amortized while `now` is monotonic (a
//! backwards `now` inserts in place instead); a prune is O(records) but frees
//! `(1 - prune_to) * max_blocks` of them. Deepest-first pruning and TTL refreshes that
//! always cover a prompt's whole prefix mean a rank never keeps a block without its
//! parent, so no hole cuts a recorded prefix short.
//!
//! The records assume the index's view of the rank is theirs: a caller that removes or
//! clears a rank in the index must also call [`ApproxRecorder::forget_rank`].

use std::collections::hash_map::Entry;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::event::{IndexError, RankId, Tier};
use super::Index;
use crate::hash::mix::HashMixMap;
use crate::hash::next_sequence_hash;
use crate::sync::Mutex;

/// Retention policy of an [`ApproxRecorder`] (Dynamo's defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ApproxConfig {
    /// How long a recorded block is believed held after its last booking.
    pub ttl: Duration,
    /// Most (rank, block) records kept; above it the deepest are pruned.
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
    /// Records dropped by the size bound.
    pub blocks_pruned: u64,
    /// `record` calls the index refused (e.g. too many ranks).
    pub record_errors: u64,
}

/// What one `record` call changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordOutcome {
    /// Blocks this rank had no live record of (now recorded and stored in the index).
    pub stored: usize,
    /// Blocks already recorded for this rank; their deadline moved to `now + ttl` (never
    /// earlier than it was).
    pub refreshed: usize,
    /// Records (of any rank) that expired during this call.
    pub expired: usize,
    /// Records (of any rank) pruned by the size bound during this call.
    pub pruned: usize,
}

/// When a record expires. `Never` only when `now + ttl` is past what `Instant` can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Deadline {
    At(Instant),
    Never,
}

/// One (rank, block) record.
#[derive(Clone, Copy, Debug)]
struct Rec {
    deadline: Deadline,
    /// Position in its prompt chain (0 = first block): what pruning orders by.
    depth: u32,
    /// Names the record's one live queue entry; changes whenever the deadline does.
    gen: u64,
}

/// A queue entry: live iff the record of (`rank`, `seq`) still has generation `gen`.
#[derive(Clone, Copy, Debug)]
struct Due {
    at: Instant,
    gen: u64,
    rank: RankId,
    seq: u64,
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

/// Queue entries kept beyond twice the live records before stale ones are swept.
const COMPACT_SLACK: usize = 64;

#[derive(Default)]
struct State {
    /// rank → sequence hash → record. Per rank so `forget_rank` is one removal.
    ranks: HashMixMap<RankId, HashMixMap<u64, Rec>>,
    /// Live records across ranks.
    len: usize,
    /// Deadline-ordered. Every live record with a finite deadline has exactly one live
    /// entry; refreshes, prunes and `forget_rank` leave stale ones, skipped when popped
    /// and swept when they outnumber the live ones.
    queue: VecDeque<Due>,
    next_gen: u64,
    stats: ApproxStats,
    /// Reused buffers: (rank, depth, seq) to remove; seqs of one rank.
    removed: Vec<(RankId, u32, u64)>,
    remove_buf: Vec<u64>,
}

impl State {
    /// Queues a deadline, keeping the queue sorted: appended when time is monotonic
    /// (constant TTL), inserted in place when `now` went backwards.
    fn enqueue(queue: &mut VecDeque<Due>, due: Due) {
        match queue.back() {
            Some(b) if b.at > due.at => {
                let i = queue.partition_point(|d| d.at <= due.at);
                queue.insert(i, due);
            }
            _ => queue.push_back(due),
        }
    }

    fn is_live(&self, d: &Due) -> bool {
        self.ranks
            .get(&d.rank)
            .and_then(|m| m.get(&d.seq))
            .is_some_and(|r| r.gen == d.gen)
    }

    /// Drops stale queue entries once they outnumber the live records, so the queue
    /// stays O(records) however often hot prompts are refreshed (amortized O(1)).
    fn maybe_compact(&mut self) {
        if self.queue.len() > 2 * self.len + COMPACT_SLACK {
            let mut q = std::mem::take(&mut self.queue);
            q.retain(|d| self.is_live(d));
            self.queue = q;
        }
    }

    /// Removes the records in `self.removed` from `index`, per rank, deepest first, so
    /// a concurrent reader sees a shorter prefix rather than a hole.
    fn remove_from_index(&mut self, index: &impl Sink) {
        let mut removed = std::mem::take(&mut self.removed);
        let mut buf = std::mem::take(&mut self.remove_buf);
        removed.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        for group in removed.chunk_by(|a, b| a.0 == b.0) {
            buf.clear();
            buf.extend(group.iter().map(|e| e.2));
            index.remove(group[0].0, &buf);
        }
        removed.clear();
        self.removed = removed;
        self.remove_buf = buf;
    }

    /// Expires every record whose deadline is `<= now`. Returns how many.
    fn expire(&mut self, index: &impl Sink, now: Instant) -> usize {
        let mut n = 0;
        while self.queue.front().is_some_and(|d| d.at <= now) {
            let Some(d) = self.queue.pop_front() else {
                break;
            };
            let Some(m) = self.ranks.get_mut(&d.rank) else {
                continue;
            };
            if let Entry::Occupied(e) = m.entry(d.seq) {
                if e.get().gen == d.gen {
                    let r = e.remove();
                    self.removed.push((d.rank, r.depth, d.seq));
                    n += 1;
                    if m.is_empty() {
                        self.ranks.remove(&d.rank);
                    }
                }
            }
        }
        if n > 0 {
            self.len -= n;
            self.stats.blocks_expired += n as u64;
            self.remove_from_index(index);
        }
        self.maybe_compact();
        n
    }

    /// If over `max_blocks`, removes the deepest records (then the soonest to expire,
    /// then by rank and hash, a total order) until `target` are left. Returns how many.
    fn prune(&mut self, index: &impl Sink, max_blocks: usize, target: usize) -> usize {
        if self.len <= max_blocks {
            return 0;
        }
        let excess = self.len - target.min(max_blocks);
        // Depth histogram: only records at or below the cut depth need sorting.
        let mut hist: Vec<usize> = Vec::new();
        for m in self.ranks.values() {
            for r in m.values() {
                let d = r.depth as usize;
                if d >= hist.len() {
                    hist.resize(d + 1, 0);
                }
                hist[d] += 1;
            }
        }
        let mut cut = hist.len();
        let mut deeper = 0;
        while cut > 0 && deeper < excess {
            cut -= 1;
            deeper += hist[cut];
        }
        let mut cands: Vec<(u32, Deadline, RankId, u64)> = Vec::with_capacity(deeper);
        for (&rank, m) in &self.ranks {
            for (&seq, r) in m {
                if r.depth as usize >= cut {
                    cands.push((r.depth, r.deadline, rank, seq));
                }
            }
        }
        cands.sort_unstable_by(|a, b| {
            b.0.cmp(&a.0)
                .then(a.1.cmp(&b.1))
                .then(a.2.cmp(&b.2))
                .then(a.3.cmp(&b.3))
        });
        cands.truncate(excess);
        for &(depth, _, rank, seq) in &cands {
            if let Some(m) = self.ranks.get_mut(&rank) {
                m.remove(&seq);
                if m.is_empty() {
                    self.ranks.remove(&rank);
                }
            }
            self.removed.push((rank, depth, seq));
        }
        let n = cands.len();
        self.len -= n;
        self.stats.blocks_pruned += n as u64;
        self.remove_from_index(index);
        self.maybe_compact();
        n
    }
}

/// Records bookings into an [`Index`] and retires them by TTL and size bound.
pub struct ApproxRecorder {
    config: ApproxConfig,
    /// Records kept after a prune (`prune_to * max_blocks`, rounded down).
    target: usize,
    state: Mutex<State>,
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
            state: Mutex::new(State::default()),
        }
    }

    pub fn config(&self) -> &ApproxConfig {
        &self.config
    }

    /// Records that `rank` holds the prompt whose complete blocks have these local
    /// hashes (first block first) on the device tier, as of `now`.
    ///
    /// Blocks the rank has no record of are stored into `index` (the chain from its root
    /// up to the last such block: idempotent for blocks already held); recorded ones get
    /// deadline `now + ttl` (never shortened, should `now` go backwards). Then whatever is
    /// due at `now` expires and, if over the bound, the deepest records are pruned.
    /// An index refusal (too many ranks) changes nothing, is counted and is returned.
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
    pub fn record_sequence(
        &self,
        index: &Index,
        rank: RankId,
        seqs: &[u64],
        now: Instant,
    ) -> Result<RecordOutcome, IndexError> {
        self.record_into(index, rank, seqs, now)
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

        let mut guard = self.state.lock();
        let st = &mut *guard;
        let known = st.ranks.get(&rank);
        let last_new = seqs
            .iter()
            .rposition(|s| !known.is_some_and(|m| m.contains_key(s)));
        if let Some(last) = last_new {
            if let Err(e) = index.store(rank, &seqs[..=last]) {
                st.stats.record_errors += 1;
                return Err(e);
            }
        }

        let mut out = RecordOutcome::default();
        let mut gen = st.next_gen;
        let recs = st.ranks.entry(rank).or_default();
        for (depth, &seq) in seqs.iter().enumerate() {
            match recs.entry(seq) {
                Entry::Occupied(mut e) => {
                    out.refreshed += 1;
                    let r = e.get_mut();
                    if deadline > r.deadline {
                        gen += 1;
                        r.deadline = deadline;
                        r.gen = gen;
                        if let Deadline::At(at) = deadline {
                            State::enqueue(&mut st.queue, Due { at, gen, rank, seq });
                        }
                    }
                }
                Entry::Vacant(e) => {
                    out.stored += 1;
                    gen += 1;
                    e.insert(Rec {
                        deadline,
                        depth: u32::try_from(depth).unwrap_or(u32::MAX),
                        gen,
                    });
                    if let Deadline::At(at) = deadline {
                        State::enqueue(&mut st.queue, Due { at, gen, rank, seq });
                    }
                }
            }
        }
        st.next_gen = gen;
        st.len += out.stored;
        st.stats.records += 1;
        st.stats.blocks_recorded += out.stored as u64;
        st.stats.blocks_refreshed += out.refreshed as u64;

        out.expired = st.expire(index, now);
        out.pruned = st.prune(index, self.config.max_blocks, self.target);
        Ok(out)
    }

    /// Removes every record whose deadline is `<= now` from `index`. Returns how many.
    pub fn expire(&self, index: &Index, now: Instant) -> usize {
        self.state.lock().expire(index, now)
    }

    /// Forgets every record of `rank`, without touching the index: for when the caller
    /// removed or cleared the rank there (else later expiries would name blocks it no
    /// longer holds, and records would claim blocks the index lost).
    pub fn forget_rank(&self, rank: RankId) {
        let mut st = self.state.lock();
        if let Some(m) = st.ranks.remove(&rank) {
            st.len -= m.len();
            st.maybe_compact();
        }
    }

    /// Live (rank, block) records.
    pub fn len(&self) -> usize {
        self.state.lock().len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn stats(&self) -> ApproxStats {
        self.state.lock().stats
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::hash::sequence_hashes;

    fn rank(w: u64) -> RankId {
        RankId::new(w, 0)
    }

    #[test]
    fn queue_stays_bounded_under_hot_refreshes() {
        let index = Index::new();
        let rec = ApproxRecorder::default();
        let t0 = Instant::now();
        let prompt: Vec<u64> = (1..=50).collect();
        for i in 0..10_000u64 {
            rec.record(&index, rank(1), &prompt, t0 + Duration::from_millis(i))
                .unwrap();
        }
        let st = rec.state.lock();
        assert_eq!(st.len, 50);
        assert!(
            st.queue.len() <= 2 * st.len + COMPACT_SLACK + prompt.len(),
            "queue grew to {}",
            st.queue.len()
        );
    }

    #[test]
    fn gen_and_queue_invariants_after_backwards_time() {
        let index = Index::new();
        let rec = ApproxRecorder::default();
        let t0 = Instant::now() + Duration::from_secs(1000);
        rec.record(&index, rank(1), &[1, 2, 3], t0).unwrap();
        rec.record(&index, rank(2), &[4, 5], t0 - Duration::from_secs(500))
            .unwrap();
        rec.record(&index, rank(1), &[1, 9], t0 - Duration::from_secs(900))
            .unwrap();
        let st = rec.state.lock();
        // Sorted queue, and exactly one live entry per record.
        assert!(st
            .queue
            .iter()
            .zip(st.queue.iter().skip(1))
            .all(|(a, b)| a.at <= b.at));
        let live = st.queue.iter().filter(|d| st.is_live(d)).count();
        assert_eq!(live, st.len);
        assert_eq!(st.len, 6);
    }

    /// An index that refuses every store (as at `MAX_RANKS`; filling a real index to
    /// that takes minutes, see the ignored integration test).
    struct Refusing<'a>(&'a Index);

    impl Sink for Refusing<'_> {
        fn store(&self, _: RankId, _: &[u64]) -> Result<usize, IndexError> {
            Err(IndexError::TooManyRanks)
        }
        fn remove(&self, rank: RankId, seqs: &[u64]) {
            Sink::remove(self.0, rank, seqs)
        }
    }

    #[test]
    fn index_refusal_is_returned_counted_and_changes_nothing() {
        let index = Index::new();
        let rec = ApproxRecorder::default();
        let t0 = Instant::now();
        rec.record(&index, rank(1), &[1, 2], t0).unwrap();
        let refusing = Refusing(&index);
        let r = rec.record_into(&refusing, rank(2), &[1, 2], t0 + Duration::from_secs(1));
        assert_eq!(r, Err(IndexError::TooManyRanks));
        // A prompt with a new block is refused whole: its known prefix is not refreshed.
        let r = rec.record_into(&refusing, rank(1), &[1, 2, 3], t0 + Duration::from_secs(1));
        assert_eq!(r, Err(IndexError::TooManyRanks));
        let s = rec.stats();
        assert_eq!((s.record_errors, s.records, s.blocks_recorded), (2, 1, 2));
        assert_eq!(s.blocks_refreshed, 0);
        assert_eq!(rec.len(), 2);
        // The refused calls refreshed nothing: the first record's deadline still holds.
        assert_eq!(rec.expire(&index, t0 + ApproxConfig::default().ttl), 2);
        assert!(index.find_matches(&sequence_hashes(&[1, 2])).is_empty());
    }

    #[test]
    fn nan_and_out_of_range_prune_to_are_clamped() {
        let mk = |p: f64| {
            ApproxRecorder::new(ApproxConfig {
                max_blocks: 100,
                prune_to: p,
                ..Default::default()
            })
            .target
        };
        assert_eq!(mk(f64::NAN), 80);
        assert_eq!(mk(2.0), 100);
        assert_eq!(mk(-1.0), 0);
        assert_eq!(mk(0.8), 80);
    }

    #[test]
    fn huge_ttl_never_expires_and_does_not_panic() {
        let index = Index::new();
        let rec = ApproxRecorder::new(ApproxConfig {
            ttl: Duration::MAX,
            ..Default::default()
        });
        let t0 = Instant::now();
        rec.record(&index, rank(1), &[1, 2], t0).unwrap();
        assert_eq!(rec.expire(&index, t0 + Duration::from_secs(1 << 40)), 0);
        assert_eq!(rec.len(), 2);
        // An index fed by bookings is keyed by sequence hashes.
        assert_eq!(
            index.find_matches(&sequence_hashes(&[1, 2])).get(rank(1)),
            2
        );
    }
}
