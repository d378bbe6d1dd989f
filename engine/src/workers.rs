//! The workers of a partition as the host registers them (DESIGN.md §6): metadata per
//! worker, and the immutable set a selection reads once.

use std::collections::BTreeMap;

use crate::ids::{DpRank, RankId, WorkerId};
use crate::sync::StdArc;

/// What a worker does in a (possibly disaggregated) deployment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackendRole {
    /// Prefill and decode on the same worker.
    #[default]
    Aggregated,
    /// Prefill only (disaggregated).
    Prefill,
    /// Decode only (disaggregated).
    Decode,
}

/// A worker's metadata, as the host registers it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerInfo {
    /// The worker's id.
    pub worker_id: WorkerId,
    /// Data-parallel ranks (at least 1): ranks are `(worker_id, dp_start..dp_start + dp_size)`.
    pub dp_size: u32,
    /// The worker's first DP rank (Dynamo's `data_parallel_start_rank`: a worker of a
    /// multi-node DP group holds ranks from there; 0 for most workers).
    pub dp_start: DpRank,
    /// What the worker does (transfer hints take their sources by role).
    pub role: BackendRole,
    /// Per rank, the endpoint a peer uses to pull KV blocks from it (for transfer hints).
    pub control_endpoints: Vec<Option<String>>,
    /// Device KV blocks per rank (0 = unknown; busy thresholds on decode blocks need it).
    /// It also sizes each rank's index map once, at the rank's first stored block
    /// (`kvr::index` module `capacity`): at most `MAX_RESERVED_BLOCKS` blocks per rank,
    /// and `MAX_RESERVED_BLOCKS_PER_INDEX` for all of the partition's ranks together
    /// (ranks past that budget grow their maps as they fill).
    pub total_kv_blocks: u64,
    /// Largest prefill batch per rank in tokens (0 = unknown).
    pub max_batched_tokens: u64,
    /// LoRA adapters loaded on the worker.
    pub lora_adapters: Vec<String>,
    /// The host's own labels; kept with the metadata, read by nothing in the engine.
    pub labels: BTreeMap<String, String>,
}

impl WorkerInfo {
    /// A worker of `dp_size` ranks (0 taken as 1) from DP rank 0; other fields default.
    pub fn new(worker_id: WorkerId, dp_size: u32) -> Self {
        Self {
            worker_id,
            dp_size: dp_size.max(1),
            ..Self::default()
        }
    }

    /// The worker's ranks, `dp_start` first.
    pub fn ranks(&self) -> impl Iterator<Item = RankId> + '_ {
        let start = self.dp_start;
        (0..self.dp_size.max(1)).map(move |d| RankId::new(self.worker_id, start + d as DpRank))
    }

    /// Whether `dp` is one of this worker's DP ranks.
    pub fn has_rank(&self, dp: DpRank) -> bool {
        dp >= self.dp_start && dp - self.dp_start < self.dp_size.max(1)
    }

    /// The per-rank slot of `dp` in [`WorkerInfo::control_endpoints`].
    pub fn rank_index(&self, dp: DpRank) -> Option<usize> {
        self.has_rank(dp).then(|| (dp - self.dp_start) as usize)
    }
}

/// One rank of the set and its worker's KV capacity: what a selection's candidate walk
/// reads of every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RankSlot {
    pub(crate) rank: RankId,
    pub(crate) kv_blocks: u64,
}

/// The partition's workers, as one immutable version.
#[derive(Clone, Debug, Default)]
pub struct WorkerSet {
    /// Sorted by worker id: a lookup is a binary search over one array, and a walk in id
    /// order reads it front to back (at a thousand workers a tree's lookups were a cost
    /// selection's narrowing paid per candidate worker). Shared, so the copy every
    /// membership change makes copies pointers, not each worker's strings and maps.
    workers: Vec<StdArc<WorkerInfo>>,
    /// Every rank in the order selection walks them (workers by id, then DP rank), kept
    /// with the workers: a selection reads this array instead of each worker's metadata
    /// per rank.
    slots: Vec<RankSlot>,
    /// Where each worker's ranks start in `slots` (parallel to `workers`).
    first_slot: Vec<u32>,
    /// The wrapping sum of the slots' [`RankId::fingerprint`]s: a selection compares it
    /// with the booking registry's to know both list the same ranks.
    fingerprint: u64,
}

impl WorkerSet {
    /// Adds `info` or replaces its worker's metadata; the replaced metadata, if any.
    pub(crate) fn insert(&mut self, info: WorkerInfo) -> Option<WorkerInfo> {
        let old = match self.position(info.worker_id) {
            Ok(i) => Some(std::mem::replace(&mut self.workers[i], StdArc::new(info))),
            Err(i) => {
                self.workers.insert(i, StdArc::new(info));
                None
            }
        };
        let old = old.map(StdArc::unwrap_or_clone);
        self.index_ranks();
        old
    }

    /// Removes a worker; its metadata, if it was in the set.
    pub(crate) fn remove(&mut self, id: WorkerId) -> Option<WorkerInfo> {
        let old = self.position(id).ok().map(|i| self.workers.remove(i));
        self.index_ranks();
        old.map(StdArc::unwrap_or_clone)
    }

    fn position(&self, id: WorkerId) -> Result<usize, usize> {
        self.workers.binary_search_by_key(&id, |w| w.worker_id)
    }

    fn index_ranks(&mut self) {
        self.slots.clear();
        self.first_slot.clear();
        self.fingerprint = 0;
        for info in &self.workers {
            for rank in info.ranks() {
                self.fingerprint = self.fingerprint.wrapping_add(rank.fingerprint());
            }
            self.first_slot.push(self.slots.len() as u32);
            self.slots.extend(info.ranks().map(|rank| RankSlot {
                rank,
                kv_blocks: info.total_kv_blocks,
            }));
        }
    }

    /// See the field.
    pub(crate) fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Every rank with its worker's KV capacity, in [`iter`](Self::iter) order.
    pub(crate) fn slots(&self) -> &[RankSlot] {
        &self.slots
    }

    /// The ranks of the `i`-th worker in id order (as [`in_order`](Self::in_order)).
    pub(crate) fn slots_of(&self, i: usize) -> &[RankSlot] {
        let start = self.first_slot[i] as usize;
        let end = self
            .first_slot
            .get(i + 1)
            .map_or(self.slots.len(), |&e| e as usize);
        &self.slots[start..end]
    }

    /// The workers in id order, as a slice (positions index [`slots_of`](Self::slots_of)).
    pub(crate) fn in_order(&self) -> &[StdArc<WorkerInfo>] {
        &self.workers
    }

    /// The position of worker `id` in [`in_order`](Self::in_order).
    pub(crate) fn position_of(&self, id: WorkerId) -> Option<usize> {
        self.position(id).ok()
    }

    /// The worker `id`'s metadata.
    pub fn get(&self, id: WorkerId) -> Option<&WorkerInfo> {
        self.position(id).ok().map(|i| &*self.workers[i])
    }

    /// Every worker, in id order.
    pub fn iter(&self) -> impl Iterator<Item = &WorkerInfo> + '_ {
        self.workers.iter().map(|w| &**w)
    }

    /// How many workers.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether there is no worker.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}

/// Longest control endpoint a worker may register, in bytes (a DNS name is at most 253,
/// plus scheme, port and path); the C ABI's `kvr_kv_hint` holds one inline.
pub const MAX_CONTROL_ENDPOINT_LEN: usize = 511;

/// Most data-parallel ranks one worker may have. A caller's `dp_size` drives per-rank
/// allocations (endpoints, load slots, index ranks), so it is bounded; the largest DP
/// deployments in the field (wide expert parallelism) use a few hundred; 4,096 is
/// Dynamo 1.6.1's limit. Nothing is allocated per possible rank, only per registered one.
pub const MAX_DP_SIZE: u32 = 4096;

/// Why a worker's metadata is refused (by Rust and the C ABI alike).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkerError {
    /// `dp_size` is 0: a worker has at least one rank.
    ZeroDpSize,
    /// `dp_size` is over [`MAX_DP_SIZE`].
    DpSizeTooLarge {
        /// The `dp_size` given.
        dp_size: u32,
    },
    /// More control endpoints than ranks.
    TooManyEndpoints {
        /// Control endpoints given.
        endpoints: usize,
        /// The worker's `dp_size`.
        dp_size: u32,
    },
    /// `dp_start + dp_size` overflows a DP rank.
    RanksOverflow,
    /// A control endpoint longer than [`MAX_CONTROL_ENDPOINT_LEN`] bytes.
    EndpointTooLong {
        /// The endpoint's index in `control_endpoints` (its DP rank minus `dp_start`).
        dp_rank: u32,
        /// The endpoint's length, bytes.
        len: usize,
    },
    /// An empty LoRA adapter name.
    EmptyLoraName,
}

impl std::fmt::Display for WorkerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerError::ZeroDpSize => write!(f, "dp_size must be at least 1"),
            WorkerError::DpSizeTooLarge { dp_size } => {
                write!(f, "dp_size {dp_size} is over the limit of {MAX_DP_SIZE}")
            }
            WorkerError::RanksOverflow => write!(f, "dp_start + dp_size overflows a DP rank"),
            WorkerError::TooManyEndpoints { endpoints, dp_size } => {
                write!(f, "{endpoints} control endpoints for {dp_size} ranks")
            }
            WorkerError::EndpointTooLong { dp_rank, len } => write!(
                f,
                "rank {dp_rank}'s control endpoint is {len} bytes (at most \
                 {MAX_CONTROL_ENDPOINT_LEN})"
            ),
            WorkerError::EmptyLoraName => write!(f, "a LoRA adapter name is empty"),
        }
    }
}

impl std::error::Error for WorkerError {}

impl WorkerInfo {
    /// Whether the metadata can be registered: what the C ABI refuses, in one place.
    pub fn validate(&self) -> Result<(), WorkerError> {
        if self.dp_start.checked_add(self.dp_size).is_none() {
            return Err(WorkerError::RanksOverflow);
        }
        if self.dp_size == 0 {
            return Err(WorkerError::ZeroDpSize);
        }
        if self.dp_size > MAX_DP_SIZE {
            return Err(WorkerError::DpSizeTooLarge {
                dp_size: self.dp_size,
            });
        }
        if self.control_endpoints.len() > self.dp_size as usize {
            return Err(WorkerError::TooManyEndpoints {
                endpoints: self.control_endpoints.len(),
                dp_size: self.dp_size,
            });
        }
        for (d, ep) in self.control_endpoints.iter().enumerate() {
            if let Some(ep) = ep.as_deref().filter(|e| e.len() > MAX_CONTROL_ENDPOINT_LEN) {
                return Err(WorkerError::EndpointTooLong {
                    dp_rank: d as u32,
                    len: ep.len(),
                });
            }
        }
        if self.lora_adapters.iter().any(|a| a.is_empty()) {
            return Err(WorkerError::EmptyLoraName);
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// The rank array selection walks is the map's ranks, in order, with each worker's
    /// capacity, after every kind of change to the set.
    #[test]
    fn the_rank_slots_follow_the_map() {
        let expected = |set: &WorkerSet| -> Vec<RankSlot> {
            set.iter()
                .flat_map(|w| {
                    w.ranks().map(|rank| RankSlot {
                        rank,
                        kv_blocks: w.total_kv_blocks,
                    })
                })
                .collect()
        };
        let worker = |id: u64, dp_start: DpRank, dp_size: u32, kv: u64| WorkerInfo {
            dp_start,
            total_kv_blocks: kv,
            ..WorkerInfo::new(id, dp_size)
        };
        let mut set = WorkerSet::default();
        assert!(set.slots().is_empty());
        assert!(set.insert(worker(7, 0, 2, 100)).is_none());
        assert!(set.insert(worker(3, 4, 3, 50)).is_none());
        assert!(set.insert(worker(9, 0, 1, 0)).is_none());
        assert_eq!(set.slots(), expected(&set));
        assert_eq!(set.slots().len(), 6);
        assert_eq!(set.slots()[0].rank, RankId::new(3, 4));
        // Replaced metadata (more ranks, another capacity), then a removal.
        assert!(set.insert(worker(7, 0, 4, 200)).is_some());
        assert_eq!(set.slots(), expected(&set));
        assert!(set.remove(3).is_some());
        assert!(set.remove(3).is_none());
        assert_eq!(set.slots(), expected(&set));
        assert_eq!(set.slots().len(), 5);
    }
}
