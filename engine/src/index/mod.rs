//! The event-driven index: which ranks hold which prompt blocks, on which tier.
//!
//! Data path: a rank's KV events ([`KvEvent`]) come in through [`Index::apply`]; the rank's
//! writer state turns the engine's opaque block hashes into kvr's chained sequence hashes
//! (`ranks`), and each block becomes a holder bit on a node of the flat, sharded node
//! table (`table`, `holders`). Lookups (`query`) probe that table without any lock.
//!
//! Contract (DESIGN.md §4): a rank's score is the number of leading query blocks it holds,
//! contiguous from block 0; the index never overcounts; a hole left by a mid-chain removal
//! may cut a score short. Nodes no rank holds are dropped, so memory follows live blocks.

pub mod approx;
mod block_map;
mod dump;
mod event;
mod holders;
mod lineage;
mod query;
mod ranks;
pub mod remote;
pub mod runs;
mod stats;
pub(crate) mod table;
#[cfg(loom)]
pub(crate) mod testing;

pub use approx::{ApproxConfig, ApproxRecorder, ApproxStats, RecordOutcome};
pub use dump::{DumpedStore, IndexDump};
pub use event::{ApplyOutcome, DpRank, IndexError, KvEvent, RankId, StoredBlock, Tier, WorkerId};
pub use lineage::Link;
pub use query::{OverlapScores, TieredOverlap, TieredScores};
pub use remote::{RemoteConfig, RemoteError, RemoteIndex, RemoteStats};
pub use runs::RunIndex;
pub use stats::{IndexStats, RankStats};
/// A fast hasher for already-random or small integer keys (ranks, hashes).
pub type RankHasher = crate::hash::mix::HashMix;

use crate::hash::next_sequence_hash;
use crate::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use crate::sync::epoch;
use ranks::{RankEntry, RankRegistry, RankWriter, Tally};
use table::{table_key, Shard};

/// Blocks of a `Stored` event whose memory is prefetched ahead of the one being applied.
const APPLY_PREFETCH_AHEAD: usize = 4;
/// Blocks of a removal handled per pass pair (the buffer of their sequence hashes lives on
/// the stack).
const REMOVE_CHUNK: usize = 64;

/// Runs `apply` on each of `items` in order, `prefetch` running `APPLY_PREFETCH_AHEAD`
/// items ahead of it (both get the item's index and the writer state).
fn pipelined<S, T: Copy>(
    state: &mut S,
    items: &[T],
    prefetch: impl Fn(&S, usize, T),
    mut apply: impl FnMut(&mut S, usize, T),
) {
    for (i, &x) in items.iter().enumerate().take(APPLY_PREFETCH_AHEAD) {
        prefetch(state, i, x);
    }
    for (i, &x) in items.iter().enumerate() {
        if let Some(&next) = items.get(i + APPLY_PREFETCH_AHEAD) {
            prefetch(state, i + APPLY_PREFETCH_AHEAD, next);
        }
        apply(state, i, x);
    }
}

/// The most ranks one index tracks at once (holder entries keep an 18-bit slot).
pub const MAX_RANKS: u32 = holders::MAX_SLOTS;

/// Sizing of an index.
#[derive(Clone, Copy, Debug)]
pub struct IndexConfig {
    /// Node-table shards (rounded up to a power of two). Writers of different ranks
    /// contend only when they touch the same shard at the same moment.
    pub shards: usize,
    /// Smallest capacity of a shard's table, in nodes.
    pub min_shard_capacity: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            shards: 256,
            min_shard_capacity: 64,
        }
    }
}

/// Totals kept across ranks (including ranks since removed).
#[derive(Default)]
struct Totals {
    stored_events: AtomicU64,
    removed_events: AtomicU64,
    cleared_events: AtomicU64,
    parent_not_found: AtomicU64,
    block_not_found: AtomicU64,
    too_many_ranks: AtomicU64,
    holder_set_bytes: AtomicI64,
}

/// The event-driven radix index, lock-free for lookups (stored flat: one node per sequence
/// hash). Writers take the rank's and the block shard's mutexes ([`crate::docs::locking`]).
pub struct Index {
    shards: Box<[Shard]>,
    shard_mask: u64,
    ranks: RankRegistry,
    totals: Totals,
    /// Owns the heap holder sets; declared after `shards` so it is dropped after them.
    interner: holders::Interner,
    /// Each block's parent and local hash, for [`Index::dump`] (`None`: not kept).
    lineage: Option<lineage::Lineage>,
    /// Keep each rank's device blocks' engine names by sequence hash (`engine_names`).
    engine_names: bool,
}

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.stats();
        f.debug_struct("Index")
            .field("shards", &self.shards.len())
            .field("ranks", &s.ranks)
            .field("holder_blocks", &s.holder_blocks)
            .finish_non_exhaustive()
    }
}

impl Default for Index {
    fn default() -> Self {
        Self::new()
    }
}

impl Index {
    pub fn new() -> Self {
        Self::with_config(IndexConfig::default())
    }

    pub fn with_config(config: IndexConfig) -> Self {
        let n = config.shards.max(1).next_power_of_two();
        Index {
            shards: (0..n)
                .map(|_| Shard::new(config.min_shard_capacity))
                .collect(),
            shard_mask: n as u64 - 1,
            ranks: RankRegistry::new(),
            totals: Totals::default(),
            interner: holders::Interner::new(),
            lineage: None,
            engine_names: false,
        }
    }

    /// Also keeps each block's parent and local hash, so [`Index::dump`] can write the
    /// index out as events (a 32-byte slot per distinct block, tables at most 3/4 full;
    /// see `lineage`). Set before any store: blocks stored before it cannot be dumped.
    pub fn with_lineage(mut self, keep: bool) -> Self {
        self.lineage = keep.then(lineage::Lineage::new);
        self
    }

    /// Also keep, per rank, its device blocks' engine hashes by sequence hash (+16 B per
    /// device holder-block, about), so a transfer hint can name the source's own blocks
    /// ([`engine_names`](Self::engine_names)).
    pub fn with_engine_names(mut self, keep: bool) -> Self {
        self.engine_names = keep;
        self
    }

    /// The engine's hashes of `rank`'s device blocks `seqs` (kvr sequence hashes), in
    /// order, into `out` (cleared), stopping at the first block the rank does not hold on
    /// its device or whose name is not kept. Takes the rank's writer lock briefly.
    pub fn engine_names(&self, rank: RankId, seqs: &[u64], out: &mut Vec<u64>) {
        out.clear();
        if !self.engine_names {
            return;
        }
        let _ = self.with_writer(rank, false, |_, w| {
            out.extend(seqs.iter().map_while(|&s| w.names.get(s)));
        });
    }

    /// Whether this index keeps lineage (can be dumped).
    pub fn keeps_lineage(&self) -> bool {
        self.lineage.is_some()
    }

    /// Whether any rank holds `seq` on any tier (lock-free).
    fn is_held(&self, seq: u64, guard: &epoch::Guard) -> bool {
        let key = table_key(seq);
        !self.shard(key).table(guard).probe(key).get().is_empty()
    }

    #[inline(always)]
    pub(crate) fn shard(&self, key: u64) -> &Shard {
        &self.shards[(key & self.shard_mask) as usize]
    }

    /// Applies one event of `rank`. Events of one rank must be applied in order.
    pub fn apply(&self, rank: RankId, event: &KvEvent<'_>) -> Result<ApplyOutcome, IndexError> {
        match *event {
            KvEvent::Stored {
                tier,
                parent,
                blocks,
            } => self
                .store(rank, tier, parent, blocks)
                .map(|stored| ApplyOutcome {
                    stored,
                    ..Default::default()
                }),
            KvEvent::Removed {
                tier,
                external_hashes,
            } => Ok(self.remove(rank, tier, external_hashes)),
            KvEvent::Cleared => Ok(ApplyOutcome {
                removed: self.clear(rank),
                ..Default::default()
            }),
        }
    }

    /// Runs `f` on the rank's live writer state, creating the rank if needed.
    fn with_writer<R>(
        &self,
        rank: RankId,
        create: bool,
        f: impl FnOnce(&RankEntry, &mut RankWriter) -> R,
    ) -> Result<Option<R>, IndexError> {
        loop {
            let entry = if create {
                match self.ranks.get_or_create(rank) {
                    Some(e) => e,
                    None => {
                        self.totals.too_many_ranks.fetch_add(1, Ordering::Relaxed);
                        return Err(IndexError::TooManyRanks);
                    }
                }
            } else {
                match self.ranks.get(rank) {
                    Some(e) => e,
                    None => return Ok(None),
                }
            };
            let mut w = entry.writer.lock();
            if w.removed {
                // Removed between lookup and lock: resolve the rank again.
                continue;
            }
            let r = f(&entry, &mut w);
            self.settle(&entry, &mut w.tally);
            entry
                .counters
                .map_bytes
                .store(w.map_bytes(), Ordering::Relaxed);
            return Ok(Some(r));
        }
    }

    /// Sets or clears `tier` of `entry` on node `seq`; keeps the counters.
    fn set_holder(
        &self,
        slot: u32,
        tally: &mut Tally,
        seq: u64,
        tier: Tier,
        set: bool,
        guard: &epoch::Guard,
    ) {
        let key = table_key(seq);
        let ch = self
            .shard(key)
            .update(key, slot, tier.bit(), set, &self.interner, guard);
        Self::account(tally, ch, tier);
    }

    /// Stores `blocks` on `rank`'s `tier`, chained after `parent`. Returns the number of
    /// blocks newly stored. An unknown parent rejects the whole store.
    pub fn store(
        &self,
        rank: RankId,
        tier: Tier,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<usize, IndexError> {
        // Only a store that can add a block creates its rank: a refused event (an unknown
        // parent on a rank that holds nothing) or an empty one leaves no rank behind, so
        // garbage events cannot grow the rank directory.
        let create = parent.is_none() && !blocks.is_empty();
        let stored = self.with_writer(rank, create, |entry, w| {
            entry.counters.stored_events.fetch_add(1, Ordering::Relaxed);
            self.totals.stored_events.fetch_add(1, Ordering::Relaxed);
            let mut prev = match parent {
                None => None,
                Some(p) => match w.resolve(p) {
                    Some(seq) => Some(seq),
                    None => {
                        entry
                            .counters
                            .parent_not_found
                            .fetch_add(1, Ordering::Relaxed);
                        self.totals.parent_not_found.fetch_add(1, Ordering::Relaxed);
                        return Err(IndexError::ParentNotFound { parent: p });
                    }
                },
            };
            // The whole chain first, so the rank map's and the node table's slots of the
            // next few blocks can be prefetched while the current one is applied.
            let mut seqs: smallvec::SmallVec<[u64; 128]> = smallvec::SmallVec::new();
            let first_parent = prev;
            for b in blocks {
                let seq = next_sequence_hash(prev, b.local_hash);
                seqs.push(seq);
                prev = Some(seq);
            }
            // Block i's link, for the lineage (only asked of blocks this store gives their
            // first holder).
            let link = |i: usize| lineage::Link {
                parent: if i == 0 {
                    first_parent
                } else {
                    Some(seqs[i - 1])
                },
                local: blocks[i].local_hash,
            };
            let lineage = self
                .lineage
                .as_ref()
                .map(|l| (l, &link as &dyn Fn(usize) -> lineage::Link));
            Ok(self.store_chain(entry, w, tier, |i| blocks[i].external_hash, &seqs, lineage))
        })?;
        stored.unwrap_or_else(|| {
            // No such rank, and this store would not make one: counted, nothing else.
            self.totals.stored_events.fetch_add(1, Ordering::Relaxed);
            match parent {
                Some(p) => {
                    self.totals.parent_not_found.fetch_add(1, Ordering::Relaxed);
                    Err(IndexError::ParentNotFound { parent: p })
                }
                None => Ok(0),
            }
        })
    }

    /// Stores a chain given by its sequence hashes (first block first), each block named
    /// by its sequence hash as its external hash: how kvr records what it booked (the
    /// approximate index), where no engine names the blocks. Returns blocks newly stored.
    pub fn store_sequences(
        &self,
        rank: RankId,
        tier: Tier,
        seqs: &[u64],
    ) -> Result<usize, IndexError> {
        self.with_writer(rank, true, |entry, w| {
            entry.counters.stored_events.fetch_add(1, Ordering::Relaxed);
            self.totals.stored_events.fetch_add(1, Ordering::Relaxed);
            // No lineage: these blocks have no local hash (they go to an approximate
            // index, which is never dumped as events).
            self.store_chain(entry, w, tier, |i| seqs[i], seqs, None)
        })?
        .ok_or(IndexError::TooManyRanks)
    }

    /// Sets `tier` on each of `seqs` for the writer's rank, block `i` named `external(i)`;
    /// with a lineage, a block given its first holder (of any rank) has its link `links(i)`
    /// recorded.
    fn store_chain(
        &self,
        entry: &RankEntry,
        w: &mut RankWriter,
        tier: Tier,
        external: impl Fn(usize) -> u64,
        seqs: &[u64],
        lineage: Option<(&lineage::Lineage, &dyn Fn(usize) -> lineage::Link)>,
    ) -> usize {
        let t = tier as usize;
        let guard = epoch::pin();
        let mut stored = 0;
        // The blocks this store gives their first holder, recorded after their updates: a
        // prune running meanwhile sees them held, or finds no entry of theirs to drop (see
        // `lineage`). Recorded whenever full, so the buffer never leaves the stack.
        let mut born: smallvec::SmallVec<[(u64, lineage::Link); 64]> = smallvec::SmallVec::new();
        let record = |l: &lineage::Lineage, born: &mut smallvec::SmallVec<_>| {
            l.record_all(born, |s| self.is_held(s, &guard));
            born.clear();
        };
        let prefetch = |w: &RankWriter, i: usize, seq: u64| {
            w.blocks[t].prefetch(external(i));
            self.prefetch_node(seq, &guard);
        };
        pipelined(w, seqs, prefetch, |w, i, seq| {
            if self.engine_names && tier == Tier::Device {
                w.names.insert(seq, external(i));
            }
            match w.blocks[t].insert(external(i), seq) {
                Some(old) if old == seq => return,
                Some(old) => self.drop_name(entry, w, old, tier, &guard),
                None => {}
            }
            let key = table_key(seq);
            let ch =
                self.shard(key)
                    .update(key, entry.slot, tier.bit(), true, &self.interner, &guard);
            if let (true, Some((l, links))) = (ch.born, lineage) {
                born.push((seq, links(i)));
                if born.len() == born.inline_size() {
                    record(l, &mut born);
                }
            }
            if ch.before & tier.bit() != 0 {
                // Another external hash of this rank already names this block.
                *w.aliases[t].entry(seq).or_insert(0) += 1;
                return;
            }
            Self::account(&mut w.tally, ch, tier);
            stored += 1;
        });
        if let (Some((l, _)), false) = (lineage, born.is_empty()) {
            record(l, &mut born);
        }
        stored
    }

    /// Hints the CPU to start loading `seq`'s home slot in the node table.
    fn prefetch_node(&self, seq: u64, guard: &epoch::Guard) {
        let key = table_key(seq);
        self.shard(key).table(guard).probe(key).prefetch();
    }

    /// Keeps the rank's and the index's counters in step with one holder change.
    fn account(tally: &mut Tally, ch: table::TierChange, tier: Tier) {
        tally.heap_bytes += ch.heap_delta as i64;
        let bit = tier.bit();
        match (ch.before & bit != 0, ch.after & bit != 0) {
            (false, true) => tally.tier_blocks[tier as usize] += 1,
            (true, false) => tally.tier_blocks[tier as usize] -= 1,
            _ => {}
        }
        if ch.before == 0 && ch.after != 0 {
            tally.holder_blocks += 1;
        } else if ch.before != 0 && ch.after == 0 {
            tally.holder_blocks -= 1;
        }
    }

    /// Applies one event's counter changes at once (one atomic update per counter per
    /// event, not per block).
    fn settle(&self, entry: &RankEntry, tally: &mut Tally) {
        let tally = std::mem::take(tally);
        let c = &entry.counters;
        let add = |a: &AtomicU64, d: i64| {
            if d != 0 {
                a.fetch_add(d as u64, Ordering::Relaxed);
            }
        };
        for t in 0..3 {
            add(&c.tier_blocks[t], tally.tier_blocks[t]);
        }
        add(&c.holder_blocks, tally.holder_blocks);
        if tally.heap_bytes != 0 {
            self.totals
                .holder_set_bytes
                .fetch_add(tally.heap_bytes, Ordering::Relaxed);
        }
    }

    /// One external name of `seq` on `tier` went away: drop the holder bit unless
    /// another name still holds it.
    fn drop_name(
        &self,
        entry: &RankEntry,
        w: &mut RankWriter,
        seq: u64,
        tier: Tier,
        guard: &epoch::Guard,
    ) {
        let t = tier as usize;
        if let Some(n) = w.aliases[t].get_mut(&seq) {
            *n -= 1;
            if *n == 0 {
                w.aliases[t].remove(&seq);
            }
            return;
        }
        self.set_holder(entry.slot, &mut w.tally, seq, tier, false, guard);
    }

    /// Removes blocks (by the engine's hashes) from `rank`'s `tier`. Unknown hashes are
    /// counted as `block_not_found`; the rest still apply.
    pub fn remove(&self, rank: RankId, tier: Tier, external_hashes: &[u64]) -> ApplyOutcome {
        let counted = |entry: Option<&RankEntry>, n: usize| {
            if n > 0 {
                self.totals
                    .block_not_found
                    .fetch_add(n as u64, Ordering::Relaxed);
                if let Some(e) = entry {
                    e.counters
                        .block_not_found
                        .fetch_add(n as u64, Ordering::Relaxed);
                }
            }
        };
        self.totals.removed_events.fetch_add(1, Ordering::Relaxed);
        let r = self.with_writer(rank, false, |entry, w| {
            entry
                .counters
                .removed_events
                .fetch_add(1, Ordering::Relaxed);
            let guard = epoch::pin();
            let t = tier as usize;
            let mut out = ApplyOutcome::default();
            // Two passes over each chunk, each prefetching a few blocks ahead: the names
            // out of the rank map, then the holder bits off the nodes. (A name's removal
            // and its node's update need not interleave: `drop_name` reads only the
            // aliases and the node.) Chunks keep the buffer on the stack: no allocation per
            // event, whatever its size.
            let mut seqs = [0u64; REMOVE_CHUNK];
            for chunk in external_hashes.chunks(REMOVE_CHUNK) {
                let mut n = 0;
                let names = |w: &RankWriter, _, h: u64| w.blocks[t].prefetch(h);
                pipelined(w, chunk, names, |w, _, h| match w.blocks[t].remove(h) {
                    Some(seq) => {
                        if tier == Tier::Device && w.names.get(seq) == Some(h) {
                            w.names.remove(seq);
                        }
                        seqs[n] = seq;
                        n += 1;
                    }
                    None => out.not_found += 1,
                });
                out.removed += n;
                let nodes = |_: &RankWriter, _, seq| self.prefetch_node(seq, &guard);
                pipelined(w, &seqs[..n], nodes, |w, _, seq| {
                    self.drop_name(entry, w, seq, tier, &guard)
                });
            }
            counted(Some(entry), out.not_found);
            out
        });
        match r {
            Ok(Some(out)) => out,
            _ => {
                counted(None, external_hashes.len());
                ApplyOutcome {
                    not_found: external_hashes.len(),
                    ..Default::default()
                }
            }
        }
    }

    /// Drops every block of `rank` (a prefix-cache reset). Returns the blocks removed.
    pub fn clear(&self, rank: RankId) -> usize {
        self.totals.cleared_events.fetch_add(1, Ordering::Relaxed);
        self.with_writer(rank, false, |entry, w| {
            entry
                .counters
                .cleared_events
                .fetch_add(1, Ordering::Relaxed);
            self.empty_rank(entry, w)
        })
        .ok()
        .flatten()
        .unwrap_or(0)
    }

    fn empty_rank(&self, entry: &RankEntry, w: &mut RankWriter) -> usize {
        let guard = epoch::pin();
        let mut removed = 0;
        for tier in Tier::ALL {
            let t = tier as usize;
            let mut blocks = std::mem::take(&mut w.blocks[t]);
            if tier == Tier::Device {
                w.names = Default::default();
            }
            w.aliases[t].clear();
            w.aliases[t].shrink_to_fit();
            for (_, seq) in blocks.drain() {
                // Aliases were dropped above, so every name clears the bit (idempotent).
                self.set_holder(entry.slot, &mut w.tally, seq, tier, false, &guard);
                removed += 1;
            }
        }
        self.settle(entry, &mut w.tally);
        entry
            .counters
            .map_bytes
            .store(w.map_bytes(), Ordering::Relaxed);
        removed
    }

    /// Drops every rank of `worker_id`. Returns the number of ranks removed.
    pub fn remove_worker(&self, worker_id: WorkerId) -> usize {
        let mut n = 0;
        for entry in self.ranks.entries() {
            if entry.id.worker_id != worker_id {
                continue;
            }
            let mut w = entry.writer.lock();
            if w.removed {
                continue;
            }
            self.empty_rank(&entry, &mut w);
            w.removed = true;
            self.ranks.forget(&entry);
            n += 1;
        }
        n
    }

    /// Removes one rank entirely (its blocks, counters and slot).
    pub fn remove_rank(&self, rank: RankId) -> bool {
        let Some(entry) = self.ranks.get(rank) else {
            return false;
        };
        let mut w = entry.writer.lock();
        if w.removed {
            return false;
        }
        self.empty_rank(&entry, &mut w);
        w.removed = true;
        self.ranks.forget(&entry);
        true
    }

    /// The ranks the index currently tracks, sorted.
    pub fn ranks(&self) -> Vec<RankId> {
        let mut v: Vec<RankId> = self.ranks.entries().iter().map(|e| e.id).collect();
        v.sort_unstable();
        v
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
