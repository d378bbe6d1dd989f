//! Partitions: one `(model, routing_group)` each, with its block size, index, workers,
//! load view, bookings and host hooks (DESIGN.md §2, §6).
//!
//! Workers come and go while selections run: the worker set is an immutable snapshot
//! swapped whole (arc-swap), so a selection sees one consistent membership.

use std::collections::BTreeMap;
use std::sync::Arc as StdArc;
use std::time::Duration;

use crate::cost::CostConfig;
use crate::hash::{BlockHasher, HashSalt};
use crate::index::{DpRank, Index, IndexConfig, RankId, WorkerId};
use crate::indexer::{IndexState, IndexerConfig, IndexerConfigError, IndexerPolicy, IndexerStats};
use crate::load::LoadView;
use crate::reservation::{ForgetListener, Listeners, ReservationConfig, ReservationTable};
use crate::session::{SessionConfig, SessionStats, SessionTable};
use crate::sync::{Arc, Mutex, Snapshot, SnapshotGuard};

pub use crate::ids::PartitionKey;

/// What a worker does in a (possibly disaggregated) deployment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackendRole {
    /// Prefill and decode on the same worker.
    #[default]
    Aggregated,
    Prefill,
    Decode,
}

/// A worker's metadata, as the host registers it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerInfo {
    pub worker_id: WorkerId,
    /// Data-parallel ranks (at least 1): ranks are `(worker_id, 0..dp_size)`.
    pub dp_size: u32,
    pub role: BackendRole,
    /// Per rank, the endpoint a peer uses to pull KV blocks from it (for transfer hints).
    pub control_endpoints: Vec<Option<String>>,
    /// Device KV blocks per rank (0 = unknown; busy thresholds on decode blocks need it).
    pub total_kv_blocks: u64,
    /// Largest prefill batch per rank in tokens (0 = unknown).
    pub max_batched_tokens: u64,
    /// LoRA adapters loaded on the worker.
    pub lora_adapters: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

impl WorkerInfo {
    pub fn new(worker_id: WorkerId, dp_size: u32) -> Self {
        Self {
            worker_id,
            dp_size: dp_size.max(1),
            ..Self::default()
        }
    }

    pub fn ranks(&self) -> impl Iterator<Item = RankId> + '_ {
        (0..self.dp_size.max(1)).map(move |d| RankId::new(self.worker_id, d as DpRank))
    }
}

/// Per-partition busy thresholds (Dynamo's): a rank over any set threshold is busy and is
/// not chosen; if every candidate is busy the selection answers `Busy`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BusyThresholds {
    /// Busy when active decode blocks exceed this fraction of the rank's total KV blocks.
    pub decode_blocks_fraction: Option<f64>,
    /// Busy when active prefill tokens exceed this many.
    pub prefill_tokens: Option<u64>,
    /// Busy when active prefill tokens exceed this fraction of max batched tokens.
    pub prefill_tokens_fraction: Option<f64>,
}

/// When a booked selection may carry a `kv_hint` (DESIGN.md §7): a peer rank that holds
/// a longer device prefix than the chosen one and can serve it over its control endpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct HintConfig {
    /// The source's device prefix must exceed the chosen rank's by at least this many
    /// blocks (a short transfer is not worth a round trip).
    pub min_advantage_blocks: u32,
    /// Most blocks one hint asks to move.
    pub max_transfer_blocks: u32,
    /// Roles whose ranks may serve transfers.
    pub source_roles: Vec<BackendRole>,
}

impl Default for HintConfig {
    fn default() -> Self {
        HintConfig {
            min_advantage_blocks: 4,
            max_transfer_blocks: 4_096,
            // A decode worker's cache is busy serving its own sequences; prefill and
            // aggregated workers hand theirs out.
            source_roles: vec![BackendRole::Prefill, BackendRole::Aggregated],
        }
    }
}

/// How a partition hashes, scores and books.
#[derive(Clone, Debug)]
pub struct PartitionConfig {
    pub block_size: u32,
    /// Cache namespace salt of every local hash (LoRA salts come per request).
    pub cache_namespace: Option<String>,
    pub cost: CostConfig,
    pub busy: BusyThresholds,
    /// Lifetime of a booking nobody frees (Dynamo current: 3,600 s).
    pub booking_ttl: Duration,
    /// Which index answers overlap queries and which bookings feed one (DESIGN.md §5).
    pub indexer: IndexerConfig,
    /// Transfer hints on booked responses; `None` (the default) = the partition consumes
    /// none, and selection keeps no per-rank overlaps beyond the choice.
    pub hints: Option<HintConfig>,
    /// Session affinity (DESIGN.md §9); `None` (the default) = sessions are carried
    /// through to the decision but steer nothing.
    pub sessions: Option<SessionConfig>,
}

impl PartitionConfig {
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            cache_namespace: None,
            cost: CostConfig::default(),
            busy: BusyThresholds::default(),
            booking_ttl: Duration::from_secs(3_600),
            indexer: IndexerConfig::default(),
            hints: None,
            sessions: None,
        }
    }
}

/// A block range `[start, end)` of the prompt that the host's shared KV cache holds.
pub type BlockRange = (u32, u32);

/// What the prefill estimator is asked.
#[derive(Clone, Copy, Debug)]
pub struct PrefillQuery {
    pub rank: RankId,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

type Hook<F> = Option<StdArc<F>>;
/// Projected prefill tokens of a request on a rank, or `None` for the default.
pub type PrefillEstimator = dyn Fn(&PrefillQuery) -> Option<u64> + Send + Sync;
/// Prompt block ranges in the host's shared cache, or why the lookup failed.
pub type SharedCacheLookup = dyn Fn(&[u64]) -> Result<Vec<BlockRange>, String> + Send + Sync;
/// The workers (of those given) that serve a LoRA adapter.
pub type LoraFilter = dyn Fn(&str, &[WorkerId]) -> Vec<WorkerId> + Send + Sync;

/// Inputs the host supplies (seed 001), each optional: an absent hook leaves the input
/// it would change as it was. Hooks are called with no engine lock held.
#[derive(Clone, Default)]
pub struct HostHooks {
    /// Projected prefill tokens of the request on a rank (default: prompt − cached).
    pub prefill_estimator: Hook<PrefillEstimator>,
    /// `true` = the rank is overloaded now (not chosen; all overloaded → `Busy`).
    pub overload: Hook<dyn Fn(RankId) -> bool + Send + Sync>,
    /// `false` = the rank cannot take requests (not a candidate at all).
    pub availability: Hook<dyn Fn(RankId) -> bool + Send + Sync>,
    /// Block ranges of the prompt (by sequence hashes) present in the host's shared KV
    /// cache; an error is logged and counted, and selection goes on without it.
    pub shared_cache: Hook<SharedCacheLookup>,
    /// The workers (of those given) that can serve a LoRA adapter.
    pub lora_filter: Hook<LoraFilter>,
}

impl std::fmt::Debug for HostHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostHooks")
            .field("prefill_estimator", &self.prefill_estimator.is_some())
            .field("overload", &self.overload.is_some())
            .field("availability", &self.availability.is_some())
            .field("shared_cache", &self.shared_cache.is_some())
            .field("lora_filter", &self.lora_filter.is_some())
            .finish()
    }
}

/// The partition's workers, as one immutable version.
#[derive(Clone, Debug, Default)]
pub struct WorkerSet {
    workers: BTreeMap<WorkerId, WorkerInfo>,
}

impl WorkerSet {
    pub fn get(&self, id: WorkerId) -> Option<&WorkerInfo> {
        self.workers.get(&id)
    }

    pub fn iter(&self) -> impl Iterator<Item = &WorkerInfo> + '_ {
        self.workers.values()
    }

    pub fn len(&self) -> usize {
        self.workers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}

/// One partition.
pub struct Partition {
    key: PartitionKey,
    /// The engine's number for this partition (0 = not in an engine).
    number: u64,
    config: PartitionConfig,
    hasher: BlockHasher,
    /// Shared with the booking table's sweep listener when bookings feed it (events off).
    pub(crate) index: StdArc<Index>,
    pub(crate) load: LoadView,
    pub(crate) bookings: StdArc<ReservationTable>,
    workers: Snapshot<WorkerSet>,
    hooks: Snapshot<HostHooks>,
    /// The indexer policy and its approximate / side index.
    pub(crate) indexing: IndexState,
    /// Session affinity; its leases end with their bookings (the table's end listener).
    pub(crate) sessions: Option<StdArc<SessionTable>>,
    /// Serializes membership changes (copy-on-write of the worker set).
    membership: Mutex<()>,
    pub(crate) counters: crate::select::SelectionCounters,
    /// Counters and sequence state of the event streams feeding this partition.
    ingress: crate::ingress::ingest::IngressRegistry,
}

impl Partition {
    /// A partition of `config`.
    ///
    /// # Panics
    ///
    /// If `config.indexer` is refused ([`IndexerConfig::resolve`]); [`Partition::try_new`]
    /// and `Engine::create_partition` return the refusal instead.
    pub fn new(key: PartitionKey, config: PartitionConfig) -> Self {
        Self::try_new(key, config).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A partition of `config`, or why its indexer configuration is refused.
    pub fn try_new(key: PartitionKey, config: PartitionConfig) -> Result<Self, IndexerConfigError> {
        Self::build(key, config, None)
    }

    /// As [`Partition::try_new`], with a listener told the id of every booking the
    /// partition's table frees on its own ([`ReservationTable::with_forget_listener`]).
    pub fn with_forget_listener(
        key: PartitionKey,
        config: PartitionConfig,
        forget: ForgetListener,
    ) -> Result<Self, IndexerConfigError> {
        Self::build(key, config, Some(forget))
    }

    fn build(
        key: PartitionKey,
        config: PartitionConfig,
        forget: Option<ForgetListener>,
    ) -> Result<Self, IndexerConfigError> {
        let indexing = IndexState::new(&config.indexer.resolve()?, &config.indexer)?;
        let bs = config.block_size.max(1);
        let salt = HashSalt::new(None, config.cache_namespace.as_deref());
        let index = StdArc::new(if cfg!(loom) {
            Index::with_config(IndexConfig {
                shards: 1,
                min_shard_capacity: 8,
            })
        } else {
            Index::new()
        });
        let defaults = ReservationConfig::default();
        let table_config = ReservationConfig {
            // Loom models keep every structure minimal.
            shards: if cfg!(loom) { 1 } else { 64 },
            block_size: bs,
            default_ttl: config.booking_ttl,
            // Approximate records expire on the table's sweep: often enough for their TTL.
            sweep_interval: indexing.sweep_interval(defaults.sweep_interval),
            ..defaults
        };
        let sessions = config
            .sessions
            .clone()
            .map(|c| StdArc::new(SessionTable::new(c)));
        // A session's lease ends with its booking, however the booking ends.
        let end: Option<ForgetListener> = sessions.clone().map(|t| {
            StdArc::new(move |id| {
                t.release_lease(id, std::time::Instant::now());
            }) as ForgetListener
        });
        let listeners = Listeners {
            forget,
            end,
            sweep: indexing.sweep_listener(&index),
        };
        let bookings = ReservationTable::with_listeners(table_config, listeners);
        Ok(Partition {
            key,
            number: 0,
            hasher: BlockHasher::new(bs as usize, salt).expect("block size is at least 1"),
            config,
            index,
            load: LoadView::new(),
            bookings: StdArc::new(bookings),
            workers: Snapshot::new(WorkerSet::default()),
            hooks: Snapshot::new(HostHooks::default()),
            indexing,
            sessions,
            membership: Mutex::new(()),
            counters: Default::default(),
            ingress: Default::default(),
        })
    }

    /// The session-affinity table's counters, if the partition keeps one.
    pub fn session_stats(&self) -> Option<SessionStats> {
        self.sessions.as_ref().map(|t| t.stats())
    }

    /// Whether the indexer policy applies engine events to [`Partition::index`] (not with
    /// KV events off or a remote primary). `false` also counts one ignored message
    /// (`indexer_stats().events_ignored`): hosts that apply events themselves ask this
    /// before each batch, as [`Partition::ingest`] does.
    pub fn accepts_events(&self) -> bool {
        self.indexing.accepts_events()
    }

    /// Fault injection for tests: the next `n` recordings of bookings into the approximate
    /// index fail as a full index would. Not part of the API.
    #[doc(hidden)]
    pub fn fail_next_records_for_test(&self, n: u64) {
        self.indexing.fail_next_records(n);
    }

    /// The indexer policy in force (DESIGN.md §5).
    pub fn indexer_policy(&self) -> &IndexerPolicy {
        &self.indexing.policy
    }

    /// The indexer policy in force and its counters.
    pub fn indexer_stats(&self) -> IndexerStats {
        self.indexing.stats()
    }

    pub fn key(&self) -> &PartitionKey {
        &self.key
    }

    pub(crate) fn with_number(mut self, number: u64) -> Self {
        self.number = number;
        self
    }

    pub(crate) fn ingress(&self) -> &crate::ingress::ingest::IngressRegistry {
        &self.ingress
    }

    pub(crate) fn number(&self) -> u64 {
        self.number
    }

    pub fn config(&self) -> &PartitionConfig {
        &self.config
    }

    pub fn block_size(&self) -> u32 {
        self.config.block_size.max(1)
    }

    /// The hasher of this partition's prompts (block size and namespace salt; a request's
    /// LoRA adapter salts on top, see [`crate::select`]).
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// The KV index of this partition (feed it the workers' events).
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Host-reported load (publish batches here).
    pub fn load_view(&self) -> &LoadView {
        &self.load
    }

    /// The engine's bookings on this partition.
    pub fn bookings(&self) -> &ReservationTable {
        &self.bookings
    }

    pub fn workers(&self) -> Arc<WorkerSet> {
        self.workers.load()
    }

    pub fn hooks(&self) -> Arc<HostHooks> {
        self.hooks.load()
    }

    /// The worker set for reads within one call (no reference-count traffic).
    pub(crate) fn workers_now(&self) -> SnapshotGuard<WorkerSet> {
        self.workers.guard()
    }

    /// The hooks for calls within one selection.
    pub(crate) fn hooks_now(&self) -> SnapshotGuard<HostHooks> {
        self.hooks.guard()
    }

    pub fn set_hooks(&self, hooks: HostHooks) {
        self.hooks.store(hooks);
    }

    /// Adds a worker or replaces its metadata. Returns `true` if it was new.
    pub fn upsert_worker(&self, info: WorkerInfo) -> bool {
        let _m = self.membership.lock();
        let cur = self.workers.load();
        let mut next = (*cur).clone();
        let new = next.workers.insert(info.worker_id, info).is_none();
        self.workers.store(next);
        new
    }

    /// Removes a worker: from the membership first (no new selection picks it), then its
    /// index entries, its reported load and its bookings.
    pub fn remove_worker(&self, id: WorkerId) -> bool {
        let removed = {
            let _m = self.membership.lock();
            let cur = self.workers.load();
            let mut next = (*cur).clone();
            let removed = next.workers.remove(&id);
            self.workers.store(next);
            removed
        };
        let Some(info) = removed else {
            return false;
        };
        self.index.remove_worker(id);
        self.load.remove_worker(id);
        for rank in info.ranks() {
            self.bookings.remove_rank(rank);
            if let Some(t) = &self.sessions {
                // The next turn of a session bound here rebinds (counted as forced).
                t.forget_rank(rank);
            }
        }
        true
    }
}
