//! The load view: what hosts report about each rank's load, as one immutable snapshot.
//!
//! Hosts (a metrics scraper, the engine's own stats endpoint, a gateway) report load in
//! batches; each batch is merged into a new immutable [`LoadSnapshot`] that replaces the
//! old one atomically (arc-swap). A selection loads the snapshot once and uses that one
//! version for every candidate, so it never sees half a batch and never blocks a
//! publisher (DESIGN.md §6). Publishers serialize among themselves on a small mutex; the
//! copy is O(ranks), which is fine at a batch rate of a few per second per partition.
//!
//! The engine's own bookings (active prefill tokens and decode blocks it handed out) are
//! not here: they change on every selection and live in the reservation tables.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use crate::hash::mix::HashMix;

/// Ranks are small integers: a cheap hasher, not SipHash (looked up per candidate).
type RankMapOf<V> = HashMap<RankId, V, BuildHasherDefault<HashMix>>;

use crate::ids::{RankId, WorkerId};
use crate::sync::{Arc, Mutex, Snapshot, SnapshotGuard};

/// Load figures a host reports for one rank. All fields are optional in spirit: a host
/// that does not know a figure leaves it at zero.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankLoad {
    /// KV-cache blocks in use on the device.
    pub kv_blocks_used: u64,
    /// KV-cache blocks the device has in total (0 = unknown).
    pub kv_blocks_total: u64,
    /// Requests queued, not yet scheduled.
    pub waiting_requests: u32,
    /// Requests being prefilled or decoded.
    pub running_requests: u32,
    /// Prefill tokens the engine reports as scheduled but not yet computed.
    pub pending_prefill_tokens: u64,
}

impl RankLoad {
    /// Fraction of the device KV cache in use (0 when the total is unknown).
    pub fn kv_usage(&self) -> f64 {
        if self.kv_blocks_total == 0 {
            0.0
        } else {
            self.kv_blocks_used as f64 / self.kv_blocks_total as f64
        }
    }
}

/// One immutable version of every rank's reported load.
#[derive(Clone, Debug, Default)]
pub struct LoadSnapshot {
    version: u64,
    loads: RankMapOf<RankLoad>,
}

impl LoadSnapshot {
    /// Increases by one with every published batch.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The last reported load of `rank` (`None` if it never reported).
    pub fn get(&self, rank: RankId) -> Option<&RankLoad> {
        self.loads.get(&rank)
    }

    /// Ranks that have reported.
    pub fn len(&self) -> usize {
        self.loads.len()
    }

    /// No rank has reported.
    pub fn is_empty(&self) -> bool {
        self.loads.is_empty()
    }

    /// Every reported rank with its last load, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (RankId, &RankLoad)> + '_ {
        self.loads.iter().map(|(r, l)| (*r, l))
    }
}

/// The published load view of one partition.
pub struct LoadView {
    current: Snapshot<LoadSnapshot>,
    /// Serializes publishers (read-modify-write of the snapshot); never taken by readers.
    publish: Mutex<()>,
}

impl std::fmt::Debug for LoadView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadView").finish_non_exhaustive()
    }
}

impl Default for LoadView {
    fn default() -> Self {
        Self::new()
    }
}

impl LoadView {
    /// An empty view (no rank has reported).
    pub fn new() -> Self {
        LoadView {
            current: Snapshot::new(LoadSnapshot::default()),
            publish: Mutex::new(()),
        }
    }

    /// The current snapshot: load it once per selection and use it throughout.
    pub fn snapshot(&self) -> Arc<LoadSnapshot> {
        self.current.load()
    }

    /// The current snapshot as a cheap guard, for reads within one call.
    pub(crate) fn snapshot_now(&self) -> SnapshotGuard<LoadSnapshot> {
        self.current.guard()
    }

    /// Publishes one batch of reports: later entries for the same rank win. Readers see
    /// either none or all of the batch, and concurrent publishers' batches are applied one
    /// after the other, none lost (loom model `load_snapshot_batches`).
    pub fn publish(&self, batch: &[(RankId, RankLoad)]) -> u64 {
        #[cfg(loom)]
        if crate::sync::faults::get().load_publish_per_entry {
            // Negative control: one swap per entry, in order (readers see half a batch).
            let mut version = 0;
            for (rank, load) in batch {
                version = self.update(|loads| {
                    loads.insert(*rank, *load);
                });
            }
            return version;
        }
        self.update(|loads| {
            for (rank, load) in batch {
                loads.insert(*rank, *load);
            }
        })
    }

    /// Forgets every rank of `worker` (it left the partition).
    pub fn remove_worker(&self, worker: WorkerId) -> u64 {
        self.update(|loads| loads.retain(|r, _| r.worker_id != worker))
    }

    fn update(&self, f: impl FnOnce(&mut RankMapOf<RankLoad>)) -> u64 {
        // Negative control: no publisher lock (two copy-apply-swaps interleave).
        #[cfg(loom)]
        let _p = (!crate::sync::faults::get().load_publish_unlocked).then(|| self.publish.lock());
        #[cfg(not(loom))]
        let _p = self.publish.lock();
        let cur = self.current.load();
        let mut loads = cur.loads.clone();
        f(&mut loads);
        let version = cur.version + 1;
        self.current.store(LoadSnapshot { version, loads });
        version
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn load(used: u64) -> RankLoad {
        RankLoad {
            kv_blocks_used: used,
            kv_blocks_total: 100,
            ..RankLoad::default()
        }
    }

    #[test]
    fn batches_merge_and_version() {
        let v = LoadView::new();
        let a = RankId::new(1, 0);
        let b = RankId::new(1, 1);
        let c = RankId::new(2, 0);
        assert_eq!(v.publish(&[(a, load(10)), (b, load(20))]), 1);
        let before = v.snapshot();
        assert_eq!(v.publish(&[(a, load(11)), (c, load(30)), (a, load(12))]), 2);
        let s = v.snapshot();
        assert_eq!(s.get(a).unwrap().kv_blocks_used, 12, "later entry wins");
        assert_eq!(
            s.get(b).unwrap().kv_blocks_used,
            20,
            "unreported ranks keep theirs"
        );
        assert_eq!(s.len(), 3);
        // A snapshot loaded earlier is unchanged.
        assert_eq!(before.version(), 1);
        assert_eq!(before.get(a).unwrap().kv_blocks_used, 10);
        assert!(before.get(c).is_none());
        assert_eq!(v.remove_worker(1), 3);
        assert_eq!(v.snapshot().len(), 1);
        assert!((s.get(c).unwrap().kv_usage() - 0.3).abs() < 1e-12);
    }

    #[test]
    fn readers_never_see_half_a_batch() {
        let v = crate::sync::StdArc::new(LoadView::new());
        let ranks: Vec<RankId> = (0..32).map(|w| RankId::new(w, 0)).collect();
        let writer = {
            let v = v.clone();
            let ranks = ranks.clone();
            std::thread::spawn(move || {
                for round in 1..=2_000u64 {
                    let batch: Vec<_> = ranks.iter().map(|r| (*r, load(round))).collect();
                    v.publish(&batch);
                }
            })
        };
        let mut seen = 0;
        while seen < 2_000 {
            let s = v.snapshot();
            let mut values = s.iter().map(|(_, l)| l.kv_blocks_used);
            if let Some(first) = values.next() {
                assert!(
                    values.all(|x| x == first),
                    "torn snapshot at {}",
                    s.version()
                );
                assert_eq!(first, s.version());
                assert_eq!(s.len(), 32);
            }
            seen = s.version();
        }
        writer.join().unwrap();
    }
}
