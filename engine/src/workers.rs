//! The workers of a partition as the host registers them (DESIGN.md §6): metadata per
//! worker, and the immutable set a selection reads once.

use std::collections::BTreeMap;

use crate::ids::{DpRank, RankId, WorkerId};

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

/// The partition's workers, as one immutable version.
#[derive(Clone, Debug, Default)]
pub struct WorkerSet {
    pub(crate) workers: BTreeMap<WorkerId, WorkerInfo>,
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
