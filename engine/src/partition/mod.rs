//! Partitions: one `(model, routing_group)` each, with its block size, index, workers,
//! load view, bookings and host hooks (DESIGN.md §2, §6).
//!
//! Workers come and go while selections run: the worker set is an immutable snapshot
//! swapped whole (arc-swap), so a selection sees one consistent membership.

use crate::config::ConfigError;
use crate::cost::decode_block_in_tokens;
use crate::hash::{BlockHasher, HashSalt};
use crate::ids::{RankId, WorkerId};
use crate::index::{Index, IndexConfig};
use crate::indexer::{IndexState, IndexerPolicy, IndexerStats};
use crate::ingress::registry::IngressRegistry;
use crate::load::{LoadView, RankLoad};
use crate::lookahead::LookaheadLengths;
use crate::reservation::{
    BookingRequest, FloorMix, ForgetListener, Listeners, ReservationConfig, ReservationTable,
    SweepListener,
};
use crate::select::SelectionCounters;
use crate::session::{SessionStats, SessionTable};
use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::{Arc, Mutex, Snapshot, StdArc};

mod ingest;
mod log;
mod routing;

pub use log::AppliedLog;

use crate::config::PartitionConfig;
use crate::hooks::HostHooks;
use crate::ids::PartitionKey;
use crate::workers::{WorkerError, WorkerInfo, WorkerSet};

/// The longest a replica peer's booking lives here (Dynamo's replica-booking expiry,
/// 300 s): a longer TTL, or none (the partition's default), is cut to it.
pub const MAX_REPLICA_BOOKING_TTL: std::time::Duration = std::time::Duration::from_secs(300);

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
    /// Set once a replica booking was installed here: only such partitions are scanned for
    /// a caller's selection id (replica bookings are not in the engine's id index).
    replicas: AtomicBool,
    /// Serializes membership changes (copy-on-write of the worker set).
    membership: Mutex<()>,
    pub(crate) counters: SelectionCounters,
    /// Counters and sequence state of the event streams feeding this partition.
    ingress: IngressRegistry,
    /// The lookahead lengths its engines hash with (selection hashes prompts with each).
    lookahead: LookaheadLengths,
    /// What the index applied and cleared goes here too, once attached (`log`).
    applied_log: crate::sync::StdOnceLock<StdArc<dyn AppliedLog>>,
}

impl std::fmt::Debug for Partition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Partition")
            .field("key", &self.key)
            .field("block_size", &self.block_size())
            .field("workers", &self.workers.load().len())
            .field("policy", self.indexer_policy())
            .finish_non_exhaustive()
    }
}

impl Partition {
    /// A partition of `config`.
    ///
    /// # Panics
    ///
    /// If `config` is refused ([`PartitionConfig::validate`]); [`Partition::try_new`] and
    /// `Engine::create_partition` return the refusal instead.
    pub fn new(key: PartitionKey, config: PartitionConfig) -> Self {
        Self::try_new(key, config).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A partition of `config`, or why it is refused ([`PartitionConfig::validate`]).
    pub fn try_new(key: PartitionKey, config: PartitionConfig) -> Result<Self, ConfigError> {
        Self::build(key, config, None)
    }

    /// As [`Partition::try_new`], with a listener told the id of every booking the
    /// partition's table frees on its own ([`ReservationTable::with_forget_listener`]).
    pub fn with_forget_listener(
        key: PartitionKey,
        config: PartitionConfig,
        forget: ForgetListener,
    ) -> Result<Self, ConfigError> {
        Self::build(key, config, Some(forget))
    }

    fn build(
        key: PartitionKey,
        config: PartitionConfig,
        forget: Option<ForgetListener>,
    ) -> Result<Self, ConfigError> {
        let resolved = config.validated()?;
        let indexing = IndexState::new(&resolved, &config.indexer)?;
        let bs = config.block_size.max(1);
        let salt = HashSalt::new(None, config.cache_namespace.as_deref());
        let index = StdArc::new(
            if cfg!(loom) {
                Index::with_config(IndexConfig {
                    shards: 1,
                    min_shard_capacity: 8,
                })
            } else {
                Index::new()
            }
            .with_lineage(config.index_dump)
            // Transfer hints name the source's own block hashes.
            .with_engine_names(config.hints.is_some()),
        );
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
        // Approximate records expire on the booking table's sweep between bookings (a
        // booking's own recording expires them lazily too); the sweep runs at least every
        // half TTL (`IndexState::sweep_interval`), so a record is gone within 1.5 TTL.
        let sweep = indexing.recorder.clone().map(|rec| {
            let records = indexing.side.clone().unwrap_or_else(|| index.clone());
            StdArc::new(move |now| {
                rec.expire(&records, now);
            }) as SweepListener
        });
        let listeners = Listeners { forget, end, sweep };
        // The load floors combine prefill and decode as the partition's cost weighs them.
        let mix = FloorMix::around(decode_block_in_tokens(&config.cost, bs));
        let bookings = ReservationTable::with_listeners(table_config, listeners, mix);
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
            replicas: AtomicBool::new(false),
            membership: Mutex::new(()),
            counters: Default::default(),
            ingress: Default::default(),
            lookahead: LookaheadLengths::default(),
            applied_log: Default::default(),
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

    /// The indexer policy in force (DESIGN.md §5).
    pub fn indexer_policy(&self) -> &IndexerPolicy {
        &self.indexing.policy
    }

    /// The indexer policy in force and its counters.
    pub fn indexer_stats(&self) -> IndexerStats {
        IndexerStats {
            ingress_refused: self.ingress.refused(),
            ..self.indexing.stats()
        }
    }

    /// A replica peer's booking as this partition takes it: on a rank of a registered
    /// worker only (`None` otherwise: a peer never creates ranks here), and living at most
    /// [`MAX_REPLICA_BOOKING_TTL`] (its own TTL, else the partition's, capped), so a
    /// peer's bookings cannot outlive the peer's own state by much.
    pub(crate) fn admit_replica_booking(&self, booking: BookingRequest) -> Option<BookingRequest> {
        let member = self
            .workers()
            .get(booking.rank.worker_id)
            .is_some_and(|w| w.has_rank(booking.rank.dp_rank));
        if !member {
            return None;
        }
        let ttl = booking.ttl.unwrap_or(self.config.booking_ttl);
        Some(BookingRequest {
            ttl: Some(ttl.min(MAX_REPLICA_BOOKING_TTL)),
            ..booking
        })
    }

    /// Whether a replica booking was ever installed here.
    pub(crate) fn holds_replica_bookings(&self) -> bool {
        self.replicas.load(Ordering::SeqCst)
    }

    pub(crate) fn note_replica_booking(&self) {
        self.replicas.store(true, Ordering::SeqCst);
    }

    /// The partition's key (model, routing group).
    pub fn key(&self) -> &PartitionKey {
        &self.key
    }

    pub(crate) fn with_number(mut self, number: u64) -> Self {
        self.number = number;
        self
    }

    pub(crate) fn number(&self) -> u64 {
        self.number
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &PartitionConfig {
        &self.config
    }

    /// The primary index as the `Stored` events that rebuild it (parents first); empty,
    /// with every block counted as skipped, unless the partition was configured with
    /// `index_dump`. See [`Index::dump`].
    pub fn dump_index(&self) -> crate::index::IndexDump {
        self.index.dump()
    }

    /// [`Partition::dump_index`] with the blocks under holes too (`IndexDump::holes`):
    /// the snapshot a restart of this partition restores exactly.
    pub fn dump_index_with_holes(&self) -> crate::index::IndexDump {
        self.index.dump_with_holes()
    }

    /// Tokens per KV block (at least 1).
    pub fn block_size(&self) -> u32 {
        self.config.block_size.max(1)
    }

    /// The hasher of this partition's prompts (block size and namespace salt; a request's
    /// LoRA adapter salts on top).
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// The KV index of this partition (feed it the workers' events).
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Host-reported load (read it here; publish through [`Partition::publish_load`],
    /// which keeps the view to registered ranks).
    pub fn load_view(&self) -> &LoadView {
        &self.load
    }

    /// Publishes one batch of load reports (selections see all of it or none of it;
    /// later entries for a rank win), keeping only registered workers' own ranks: the
    /// load of any other rank could never be read, so it is not stored. Returns the load
    /// view's new version and how many entries were skipped so.
    pub fn publish_load(&self, batch: &[(RankId, RankLoad)]) -> (u64, usize) {
        let workers = self.workers();
        let member = |r: &RankId| {
            workers
                .get(r.worker_id)
                .is_some_and(|w| w.has_rank(r.dp_rank))
        };
        if batch.iter().all(|(r, _)| member(r)) {
            return (self.load.publish(batch), 0);
        }
        let kept: Vec<_> = batch.iter().filter(|(r, _)| member(r)).copied().collect();
        (self.load.publish(&kept), batch.len() - kept.len())
    }

    /// The engine's bookings on this partition.
    pub fn bookings(&self) -> &ReservationTable {
        &self.bookings
    }

    /// The registered workers, as of now (a snapshot: later changes do not show in it).
    pub fn workers(&self) -> Arc<WorkerSet> {
        self.workers.load()
    }

    /// The host hooks selection calls.
    pub fn hooks(&self) -> Arc<HostHooks> {
        self.hooks.load()
    }

    /// Replaces the host hooks (selections already running keep the ones they started
    /// with).
    pub fn set_hooks(&self, hooks: HostHooks) {
        self.hooks.store(hooks);
    }

    /// Adds a worker or replaces its metadata: `Ok(true)` if it was new. Metadata that
    /// [`WorkerInfo::validate`] refuses is refused here (as the C ABI does).
    pub fn upsert_worker(&self, info: WorkerInfo) -> Result<bool, WorkerError> {
        info.validate()?;
        let _m = self.membership.lock();
        let cur = self.workers.load();
        let mut next = (*cur).clone();
        // Its ranks' index maps are sized for this at their first store (`index::capacity`).
        self.index
            .set_worker_capacity(info.worker_id, info.total_kv_blocks);
        let id = info.worker_id;
        let ranks: Vec<RankId> = info.ranks().collect();
        let new = next.insert(info).is_none();
        // Before the set is published: a stream of a rank the new set has is never refused
        // for want of room.
        self.ingress.set_registered_ranks(next.slots().len());
        self.workers.store(next);
        // Its ranks are the host's word now, no longer the pending budget's.
        self.ingress.worker_registered(id);
        // Its ranks' booking counters, made now in one go rather than one registry copy
        // at each rank's first booking (on the selection path).
        self.bookings.ensure_ranks(&ranks);
        Ok(new)
    }

    /// Removes a worker: from the membership first (no new selection picks it), then
    /// everything kept for its ranks: index entries, the approximate recorder's records
    /// and the prediction side index, reported load, bookings, session bindings and its
    /// ingress streams (one lifecycle, so a worker that rejoins starts as new everywhere).
    pub fn remove_worker(&self, id: WorkerId) -> bool {
        let removed = {
            let _m = self.membership.lock();
            let cur = self.workers.load();
            let mut next = (*cur).clone();
            let removed = next.remove(id);
            self.ingress.set_registered_ranks(next.slots().len());
            self.workers.store(next);
            removed
        };
        let Some(info) = removed else {
            return false;
        };
        self.forget_worker_state(&info);
        true
    }

    /// The one end of a worker's per-rank state, so a worker removed and added again
    /// starts as new everywhere: its primary index entries, the approximate recorder's
    /// records and the prediction side index (else a rejoined rank on an events-off
    /// partition stays unindexed until the records' TTL, as the recorder would take its
    /// bookings for repeats), its reported load, its bookings, its session bindings, and
    /// the ingress streams of its engine messages (a rejoin starts a fresh sequence).
    fn forget_worker_state(&self, info: &WorkerInfo) {
        let id = info.worker_id;
        // The recorder's records first, then the index: a booking recorded in between
        // then lands in fresh records (which expire) and its blocks are removed, instead
        // of leaving blocks in the index that no record would ever expire.
        self.indexing.forget_worker(id, info.ranks());
        self.index.set_worker_capacity(id, 0);
        self.index.remove_worker(id);
        if let Some(log) = self.log() {
            log.worker_removed(id);
        }
        self.load.remove_worker(id);
        let ranks: Vec<RankId> = info.ranks().collect();
        self.bookings.remove_ranks(&ranks);
        for rank in ranks {
            if let Some(t) = &self.sessions {
                // The next turn of a session bound here rebinds (counted as forced).
                t.forget_rank(rank);
            }
        }
        self.ingress.forget_worker(id);
    }
}
