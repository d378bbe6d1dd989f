//! The event-driven index: which ranks hold which prompt blocks, on which tier.
//!
//! Data path: a rank's KV events ([`KvEvent`]) come in through [`Index::apply`]; the
//! rank's writer state maps the engine's opaque block hashes to places in the prompt trie
//! (`write`, `ranks`), and lookups (`query`) walk the trie without any lock.
//!
//! Contract (DESIGN.md §4): a rank's score is the number of leading query blocks it holds,
//! contiguous from block 0; the index never overcounts; a hole left by a mid-chain removal
//! cuts a score short there; a hybrid rank's score (attention plus Mamba layers) is cut
//! back further, to its last block with a recurrent state (`recurrent`). Nothing that no
//! rank holds is kept for long: a run with no
//! holder, child or writer is retired, so memory follows live blocks.
//!
//! # The trie stored as runs (chain-native)
//!
//! Why: keying one node per block by its chained sequence hash (kvr's first index) makes a
//! lookup of `D` blocks chain `D` hashes and probe `D` table slots. Here a lookup finds the
//! run that starts the prompt (one probe of the branch table, keyed by the first local
//! hash), compares the prompt's local hashes against the run's array (a sequential scan,
//! no hashing), and probes again only where the prompt leaves the run. A prompt cached
//! whole costs one probe and one scan; a prompt nobody holds, one probe.
//!
//! Structure (see `run`, `hold`, `branch`):
//! - a `run::Run` is a stretch of the trie: an append-only array of local hashes, and
//!   per holding rank a `hold::Cover` (how far that rank's walk goes in it, per tier
//!   phase), published together as one immutable state;
//! - children hang off a run at any offset, keyed by (run, offset, next local hash) in the
//!   branch table; runs are never split: a rank that stops holding a block in the middle
//!   of a run just covers less of it;
//! - each rank keeps, behind its mutex, its engine hashes → block places (`run::BlockRef`)
//!   per tier, and per run it holds the exact offsets per tier (`hold::Hold`).
//!
//! Readers take no lock: a branch-table probe and a `state` load with `Acquire`, inside an
//! epoch guard. Writers take their rank's mutex for the event, and one run's mutex at a
//! time (plus a branch-table shard's, a leaf) while they change that run; two ranks contend
//! only when they change the same run at the same moment. A run no rank holds, with no
//! children and no writer inside, is unlinked and retired through the epoch.
//!
//! # Keys
//!
//! An index fed by engine events is keyed by **local** hashes: stores carry them, and
//! lookups take a prompt's local hashes. An index fed by bookings
//! ([`Index::store_sequences`]: the approximate index and the prediction side index) has
//! only sequence hashes, so it is keyed by them: a booked chain is stored with each block's
//! sequence hash as its local hash, and looked up by a prompt's sequence hashes. Both are
//! exact (a sequence hash already names the whole prefix); one index is fed one way.

pub(crate) mod approx;
mod block_map;
mod bookkeeping;
mod branch;
mod capacity;
mod directory;
mod dump;
mod event;
mod evict;
pub(crate) mod hold;
mod place;
mod query;
mod rank_order;
mod ranks;
mod recurrent;
pub(crate) mod remote;
pub(crate) mod run;
mod stats;
#[cfg(loom)]
pub(crate) mod testing;
mod write;

pub(crate) use approx::ApproxRecorder;
pub use approx::{ApproxConfig, ApproxStats};
pub use capacity::{MAX_RESERVED_BLOCKS, MAX_RESERVED_BLOCKS_PER_INDEX};
pub use dump::{DumpedStore, IndexDump};
pub use event::{ApplyOutcome, IndexError, KvEvent, StoredBlock};
pub use query::{OverlapScores, TieredOverlap, TieredScores};
pub use remote::{
    RemoteConfig, RemoteError, RemoteIndex, RemoteStats, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_REQUEST_TIMEOUT,
};
pub use stats::{IndexStats, RankStats};

use crate::hash::mix::HashMixMap;
use crate::ids::RankId;
use crate::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use block_map::BlockMap;
use place::{Place, RunTable};
use ranks::{RankRegistry, Tally, WriterState};

/// The most ranks one index tracks at once (covers keep a 32-bit slot; the registry hands
/// out at most this many).
pub const MAX_RANKS: u32 = ranks::MAX_SLOTS;

/// Sizing of an index's branch table.
#[derive(Clone, Copy, Debug)]
pub struct IndexConfig {
    /// Branch-table shards (rounded up to a power of two). Writers creating or retiring
    /// runs contend only when they touch the same shard at the same moment.
    pub shards: usize,
    /// Smallest capacity of a shard's table, in entries.
    pub min_shard_capacity: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            shards: 64,
            min_shard_capacity: 64,
        }
    }
}

/// Writer-side state of one rank, behind its mutex.
#[derive(Default)]
pub(crate) struct RankWriter {
    pub(crate) tally: Tally,
    /// Per tier: the engine's block hash → where the block lives (a `place::Place`: 12
    /// bytes an entry, where a `run::BlockRef` would take 16).
    pub(crate) blocks: [BlockMap<Place>; 3],
    /// The runs this rank holds blocks of, by the index its places name them by.
    pub(crate) runs: RunTable,
    /// Per tier: blocks this rank stored under more than one engine hash, with the number
    /// of extra names. The block is released only when its last name goes.
    pub(crate) aliases: [HashMixMap<u64, u32>; 3],
    /// Per run this rank holds blocks of (by address): which offsets, per tier.
    pub(crate) holds: HashMixMap<usize, hold::Hold>,
    /// Heap bytes of the holds' spilled bitmaps (runs over 128 blocks), kept as they
    /// change so an event's byte count stays O(1).
    pub(crate) hold_heap: usize,
    pub(crate) removed: bool,
    /// The device map was sized for the worker's capacity, or found none to size for
    /// (`capacity`): checked once per rank.
    pub(crate) sized: bool,
    /// Blocks of the index's sizing budget this rank's maps took (`capacity`), given back
    /// when the rank is removed.
    pub(crate) reserved: u64,
    /// Device tier, kept only `with_engine_names`: block → the engine hash last stored.
    pub(crate) names: BlockMap<u64>,
    /// Where this rank's recurrent group holds state (hybrid models, `recurrent`).
    pub(crate) states: recurrent::StateBook,
}

impl WriterState for RankWriter {
    fn removed() -> Self {
        RankWriter {
            removed: true,
            ..Default::default()
        }
    }
}

impl RankWriter {
    /// Where the block an engine hash names lives (device, then host, then disk).
    pub(crate) fn resolve(&self, external: u64) -> Option<run::BlockRef> {
        self.blocks
            .iter()
            .find_map(|m| m.get(external))
            .map(|p| self.runs.block_ref(p))
    }

    /// The rank's entries of tier `t`: engine hash and the block it names.
    pub(crate) fn held(&self, t: usize) -> impl Iterator<Item = (u64, run::BlockRef)> + '_ {
        self.blocks[t]
            .iter()
            .map(|(external, p)| (external, self.runs.block_ref(p)))
    }

    pub(crate) fn map_bytes(&self) -> u64 {
        let alias = |cap: usize| (cap * 8 / 7 * (12 + 1)) as u64;
        let holds = (self.holds.capacity() * 8 / 7)
            * (std::mem::size_of::<(usize, hold::Hold)>() + 1)
            + self.hold_heap;
        self.blocks.iter().map(|m| m.bytes() as u64).sum::<u64>()
            + self.names.bytes() as u64
            + self
                .aliases
                .iter()
                .map(|m| alias(m.capacity()))
                .sum::<u64>()
            + holds as u64
            + self.runs.bytes() as u64
            + self.states.bytes()
    }
}

#[derive(Default)]
struct Totals {
    stored_events: AtomicU64,
    removed_events: AtomicU64,
    cleared_events: AtomicU64,
    parent_not_found: AtomicU64,
    block_not_found: AtomicU64,
    too_many_ranks: AtomicU64,
    /// Stores cut short by a branch-key collision (blocks left unindexed).
    branch_collisions: AtomicU64,
    /// Blocks left unindexed because their rank held blocks of as many runs as it may
    /// (`place::MAX_HELD_RUNS`).
    held_run_limit: AtomicU64,
    /// Live runs and their bytes (run, state, locals array).
    runs: AtomicI64,
    run_bytes: AtomicI64,
    /// Blocks in live runs' arrays.
    run_blocks: AtomicI64,
}

/// The index (module docs). Lookups are lock-free.
pub struct Index {
    branches: branch::Branches,
    ranks: RankRegistry<RankWriter>,
    totals: Totals,
    engine_names: bool,
    /// Fed by [`Index::store_sequences`] (keyed by sequence hashes): not dumpable as
    /// engine events.
    keyed_by_sequence: AtomicBool,
    /// Workers' device KV capacities, for sizing their ranks' maps (`capacity`).
    capacities: capacity::Capacities,
    /// Recurrent states of hybrid ranks (`recurrent`), and whether any rank ever
    /// announced one (queries skip the cut until then).
    states: recurrent::StateTable,
    has_states: AtomicBool,
}

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.stats();
        f.debug_struct("Index")
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
    /// An empty index with the default branch-table sizing.
    pub fn new() -> Self {
        Self::with_config(IndexConfig::default())
    }

    /// An empty index whose branch table is sized by `config`.
    pub fn with_config(config: IndexConfig) -> Self {
        Self::with_branch_shards(config.shards, config.min_shard_capacity)
    }

    /// Kept for callers of kvr's first index, which needed it to dump: every index can be
    /// dumped now (a run's local hashes and its place in the trie are the lineage).
    pub fn with_lineage(self, _keep: bool) -> Self {
        self
    }

    /// Whether this index can be written out as engine events ([`Index::dump`]): unless
    /// it is keyed by sequence hashes (fed by bookings).
    pub fn keeps_lineage(&self) -> bool {
        !self.keyed_by_sequence.load(Ordering::Relaxed)
    }

    /// An index with `shards` branch-table shards of at least `min_capacity` slots (the
    /// loom models use tiny ones).
    pub(crate) fn with_branch_shards(shards: usize, min_capacity: usize) -> Self {
        Index {
            branches: branch::Branches::new(shards, min_capacity),
            ranks: RankRegistry::new(),
            totals: Totals::default(),
            engine_names: false,
            keyed_by_sequence: AtomicBool::new(false),
            capacities: Default::default(),
            states: recurrent::StateTable::new(),
            has_states: AtomicBool::new(false),
        }
    }

    /// Also keep, per rank, its device blocks' engine hashes, for transfer hints.
    pub fn with_engine_names(mut self, keep: bool) -> Self {
        self.engine_names = keep;
        self
    }

    /// The ranks the index currently tracks, sorted.
    pub fn ranks(&self) -> Vec<RankId> {
        let mut v: Vec<RankId> = self.ranks.entries().iter().map(|e| e.id).collect();
        v.sort_unstable();
        v
    }

    /// Cells of the slot → rank directory (the loom models check its growth).
    #[cfg(loom)]
    pub(crate) fn directory_capacity(&self) -> usize {
        self.ranks.directory_capacity()
    }

    /// Live runs, and stores cut short by a branch-key collision.
    pub fn run_counts(&self) -> (u64, u64) {
        (
            self.totals.runs.load(Ordering::Relaxed).max(0) as u64,
            self.totals.branch_collisions.load(Ordering::Relaxed),
        )
    }

    /// Blocks stores left unindexed because their rank already held blocks of 2^21 runs
    /// (`place`): an undercount, counted here, never an overcount.
    pub fn held_run_limit_hits(&self) -> u64 {
        self.totals.held_run_limit.load(Ordering::Relaxed)
    }
}

impl Drop for Index {
    fn drop(&mut self) {
        // Every run still linked is reachable only from the branch table and the ranks'
        // maps, all going away with `&mut self`: free them now.
        for e in self.ranks.entries() {
            let mut w = e.writer.lock();
            w.holds.clear();
        }
        self.branches.drain_runs();
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
