//! Freshness: which ranks' index state may be stale right now, for selection to distrust.
//!
//! A stream is **live** (no replay in flight), **recovering** (a replay in flight: a join,
//! a probe, a restart's replay) or **stale** (a loss is known and not yet repaired: a
//! replay is filling a gap while batches applied before it stay counted, and the lost
//! batches may have evicted some of them — `SequenceTracker::stale`). A stale stream's
//! ranks are listed here with the time they became stale; when the replay fills the gap,
//! or the stream's ranks are cleared, they leave the list.
//!
//! Selection loads the list **before** it reads the index, and by default treats a listed
//! rank's overlap as zero (`PartitionConfig::trust_stale_overlap` = false): a stale rank
//! is still chosen by load, just not credited for blocks it may no longer hold. Ingress
//! unlists a rank only **after** the repair it waited for (the replayed range applied, or
//! the clear) is in the index, in the same thread, so a selection that sees a rank unlisted
//! reads the repaired index (the `Snapshot` store/load pair is a release/acquire edge; the
//! loom model `freshness_unlist_after_repair` checks the order, and its negative control
//! unlists first).

use crate::ids::{RankId, WorkerId};
use crate::sync::{Mutex, Snapshot, SnapshotGuard};

/// The stale ranks of a partition, sorted, each with when it became stale (ms since the
/// Unix epoch).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StaleRanks {
    ranks: Vec<(RankId, u64)>,
}

impl StaleRanks {
    /// No rank is stale.
    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    /// Whether `rank` is stale.
    pub fn contains(&self, rank: RankId) -> bool {
        self.since(rank).is_some()
    }

    /// When `rank` became stale, if it is.
    pub fn since(&self, rank: RankId) -> Option<u64> {
        self.ranks
            .binary_search_by_key(&rank, |e| e.0)
            .ok()
            .map(|i| self.ranks[i].1)
    }

    /// Each stale rank with when it became stale (ms since the Unix epoch), in rank order.
    pub fn iter(&self) -> impl Iterator<Item = (RankId, u64)> + '_ {
        self.ranks.iter().copied()
    }
}

/// The partition's list, swapped whole (rare: a stream turns stale or fresh).
pub(crate) struct Freshness {
    current: Snapshot<StaleRanks>,
    /// Serializes writers (read, modify, store).
    writer: Mutex<()>,
}

impl Default for Freshness {
    fn default() -> Self {
        Freshness {
            current: Snapshot::new(StaleRanks::default()),
            writer: Mutex::new(()),
        }
    }
}

impl std::fmt::Debug for Freshness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Freshness")
            .field("stale", &self.current.guard().ranks.len())
            .finish()
    }
}

impl Freshness {
    /// The list for one selection (load it before reading the index).
    pub(crate) fn now(&self) -> SnapshotGuard<StaleRanks> {
        self.current.guard()
    }

    /// Lists `worker`'s DP ranks `dp_ranks` as stale since `since` (`Some`), or unlists
    /// them (`None`). Call `None` only after the repair is in the index.
    pub(crate) fn mark(&self, worker: WorkerId, dp_ranks: &[u32], since: Option<u64>) {
        let _w = self.writer.lock();
        let cur = self.current.load();
        let mut next = StaleRanks::clone(&cur);
        for &dp in dp_ranks {
            let rank = RankId::new(worker, dp);
            match (next.ranks.binary_search_by_key(&rank, |e| e.0), since) {
                (Ok(_), Some(_)) => {} // stale already: keep the first time
                (Err(i), Some(t)) => next.ranks.insert(i, (rank, t)),
                (Ok(i), None) => {
                    next.ranks.remove(i);
                }
                (Err(_), None) => {}
            }
        }
        if next != *cur {
            self.current.store(next);
        }
    }

    /// Unlists every rank of a removed worker.
    pub(crate) fn forget_worker(&self, worker: WorkerId) {
        let _w = self.writer.lock();
        let cur = self.current.guard();
        if cur.ranks.iter().any(|e| e.0.worker_id == worker) {
            let mut next = StaleRanks::clone(&cur);
            next.ranks.retain(|e| e.0.worker_id != worker);
            drop(cur);
            self.current.store(next);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn marks_and_unmarks_keep_the_first_time_and_only_named_ranks() {
        let f = Freshness::default();
        f.mark(1, &[0, 1], Some(10));
        f.mark(1, &[1], Some(20));
        f.mark(2, &[0], Some(30));
        let s = f.now();
        assert_eq!(s.since(RankId::new(1, 1)), Some(10));
        assert!(s.contains(RankId::new(2, 0)) && !s.contains(RankId::new(2, 1)));
        drop(s);
        f.mark(1, &[0], None);
        assert!(!f.now().contains(RankId::new(1, 0)));
        assert!(f.now().contains(RankId::new(1, 1)));
        f.forget_worker(1);
        assert_eq!(f.now().iter().count(), 1);
    }
}
