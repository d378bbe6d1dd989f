//! A partition's selection counters.

use crate::sync::atomic::{AtomicU64, Ordering};

/// Selection counters of one partition.
#[derive(Default)]
pub(crate) struct SelectionCounters {
    /// Bumped by every selection: striped, so threads do not share its cache line.
    pub(crate) selections: crate::counter::StripedCounter,
    pub(crate) busy: AtomicU64,
    pub(crate) no_worker: AtomicU64,
    pub(crate) shared_cache_failures: AtomicU64,
    pub(crate) stale_overlaps_ignored: AtomicU64,
}

/// Selection counters of one partition, as read at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SelectionStats {
    /// Selections made, advisory and booked (`Busy` and `NoWorker` answers included).
    pub selections: u64,
    /// Selections answered `Busy`.
    pub busy: u64,
    /// Selections answered `NoWorker`.
    pub no_worker: u64,
    /// Shared-cache lookups that failed (selection went on without their hits).
    pub shared_cache_failures: u64,
    /// Ranks whose overlap a lookup did not credit because their state was stale
    /// (`crate::freshness`).
    pub stale_overlaps_ignored: u64,
}

impl SelectionCounters {
    pub(crate) fn snapshot(&self) -> SelectionStats {
        SelectionStats {
            selections: self.selections.get(),
            busy: self.busy.load(Ordering::Relaxed),
            no_worker: self.no_worker.load(Ordering::Relaxed),
            shared_cache_failures: self.shared_cache_failures.load(Ordering::Relaxed),
            stale_overlaps_ignored: self.stale_overlaps_ignored.load(Ordering::Relaxed),
        }
    }
}
