//! Selection (DESIGN.md §7, seed 001): prompt → hashes → overlap (index + host shared
//! cache) → eligible candidates → cost → choice → (booked mode) booking.
//!
//! Two modes share one decision path: advisory selection ([`Partition::select`](crate::partition::Partition::select)) returns
//! the decision and the projected load and books nothing; [`Partition::select_and_reserve`](crate::partition::Partition::select_and_reserve)
//! books the chosen rank before returning. Hooks are called with no engine lock held.

//!
//! The stages live one per file: [`request`](SelectRequest) in, candidates, the decision,
//! the transfer hint, booking. A `Selector` borrows the parts of a partition that a
//! selection reads, so this layer never names the partition that owns them.

mod candidates;
mod counters;
mod decide;
mod decision;
mod explicit;
mod hint;
mod idle;
mod lookahead;
mod overlap;
mod prune;
mod request;
mod scratch;

use crate::config::PartitionConfig;
use crate::freshness::Freshness;
use crate::hash::BlockHasher;
use crate::hooks::HostHooks;
use crate::ids::PartitionKey;
use crate::index::Index;
use crate::indexer::IndexState;
use crate::load::LoadView;
use crate::lookahead::LookaheadLengths;
use crate::reservation::ReservationTable;
use crate::session::SessionTable;
use crate::sync::{Snapshot, SnapshotGuard};
use crate::workers::WorkerSet;

pub(crate) use counters::SelectionCounters;
pub use counters::SelectionStats;
pub use decision::{Decision, KvHint, Outcome, Overlap, SelectError, SessionRoute};
pub use request::{Prompt, SelectRequest};

/// The parts of one partition a selection reads and books into, borrowed for one call.
pub(crate) struct Selector<'a> {
    pub(crate) key: &'a PartitionKey,
    pub(crate) config: &'a PartitionConfig,
    pub(crate) hasher: &'a BlockHasher,
    pub(crate) index: &'a Index,
    pub(crate) indexing: &'a IndexState,
    pub(crate) load: &'a LoadView,
    pub(crate) bookings: &'a ReservationTable,
    pub(crate) workers: &'a Snapshot<WorkerSet>,
    pub(crate) hooks: &'a Snapshot<HostHooks>,
    pub(crate) sessions: Option<&'a SessionTable>,
    pub(crate) counters: &'a SelectionCounters,
    pub(crate) freshness: &'a Freshness,
    pub(crate) lookahead: &'a LookaheadLengths,
}

impl Selector<'_> {
    fn config(&self) -> &PartitionConfig {
        self.config
    }

    fn key(&self) -> &PartitionKey {
        self.key
    }

    fn hasher(&self) -> &BlockHasher {
        self.hasher
    }

    fn block_size(&self) -> u32 {
        self.config.block_size.max(1)
    }

    /// The worker set for reads within one call (no reference-count traffic).
    fn workers_now(&self) -> SnapshotGuard<WorkerSet> {
        self.workers.guard()
    }

    /// The hooks for calls within one selection.
    fn hooks_now(&self) -> SnapshotGuard<HostHooks> {
        self.hooks.guard()
    }
}
