//! The workers the service was told about: their records (Dynamo's `/workers` shape), the
//! partition each belongs to, and the KV-event subscriptions the service runs for them.
//!
//! A worker is a member of its partition from its first registration (so its events are
//! indexed and its bookings kept through lifecycle changes), but only *schedulable*
//! workers are candidates: while any member is not, selections pass the partition's
//! schedulable set as the allow-list ([`PartitionEntry::schedulable`]).
//!
//! Registration changes take one mutex (rare); the request path reads an immutable
//! snapshot of the partitions through `arc-swap` and takes no lock.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use kvr::{Engine, Partition, PartitionConfig, PartitionKey, WorkerId, WorkerInfo};
use kvr_zmq::{SubscribeConfig, Subscription};

use crate::error::ApiError;
use crate::wire::worker::{Lifecycle, WorkerPatch, WorkerRecord, WorkerRequest};

/// The most DP ranks one registration may declare (each rank is a subscription thread).
pub const MAX_DP_SIZE: u32 = 1024;

/// What the request path needs of a partition.
#[derive(Debug)]
pub struct PartitionEntry {
    pub partition: Arc<Partition>,
    /// The schedulable members, or `None` when every member is schedulable (no
    /// allow-list needed).
    pub schedulable: Option<Arc<Vec<WorkerId>>>,
    pub schedulable_count: usize,
    /// Member id → its endpoint (answers carry it).
    pub endpoints: Arc<HashMap<WorkerId, Option<String>>>,
}

impl PartitionEntry {
    pub fn is_schedulable(&self, id: WorkerId) -> bool {
        match &self.schedulable {
            None => self.endpoints.contains_key(&id),
            Some(s) => s.binary_search(&id).is_ok(),
        }
    }
}

type Partitions = HashMap<PartitionKey, Arc<PartitionEntry>>;

struct Worker {
    record: WorkerRecord,
    subscriptions: Vec<Subscription>,
}

/// Builds a new partition's configuration (the service's flags and environment).
pub type PartitionFactory = dyn Fn(u32) -> PartitionConfig + Send + Sync;

/// Workers by id (ids are global across partitions, as in Dynamo) and the partitions.
pub struct Registry {
    engine: Arc<Engine>,
    workers: Mutex<BTreeMap<WorkerId, Worker>>,
    partitions: ArcSwap<Partitions>,
    config_for: Box<PartitionFactory>,
    use_kv_events: bool,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

/// vLLM's rule for a DP rank's endpoints: the rank is added to the base port.
pub fn offset_port(endpoint: &str, rank: u32) -> String {
    if rank == 0 {
        return endpoint.to_string();
    }
    match endpoint.rsplit_once(':') {
        Some((host, port)) => match port.parse::<u32>() {
            Ok(p) => format!("{host}:{}", p + rank),
            Err(_) => endpoint.to_string(),
        },
        None => endpoint.to_string(),
    }
}

impl Registry {
    pub fn new(engine: Arc<Engine>, use_kv_events: bool, config_for: Box<PartitionFactory>) -> Self {
        Self {
            engine,
            workers: Mutex::new(BTreeMap::new()),
            partitions: ArcSwap::from_pointee(HashMap::new()),
            config_for,
            use_kv_events,
        }
    }

    /// The partition of `key`, lock-free.
    pub fn partition(&self, key: &PartitionKey) -> Option<Arc<PartitionEntry>> {
        self.partitions.load().get(key).cloned()
    }

    pub fn partitions(&self) -> Vec<Arc<PartitionEntry>> {
        let mut v: Vec<_> = self.partitions.load().values().cloned().collect();
        v.sort_by(|a, b| a.partition.key().cmp(b.partition.key()));
        v
    }

    /// Creates the partition for `key` if missing (peer recovery, before any worker).
    pub fn ensure_partition(&self, key: &PartitionKey, block_size: u32) -> Result<Arc<Partition>, ApiError> {
        let workers = self.lock();
        let p = self.partition_for(key, block_size)?;
        self.publish(&workers);
        Ok(p)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<WorkerId, Worker>> {
        // A panic while holding the lock cannot leave the map half-changed in a way that
        // matters (entries are replaced whole), so a poisoned lock is used as is.
        self.workers.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn records(&self) -> Vec<WorkerRecord> {
        self.lock().values().map(|w| w.record.clone()).collect()
    }

    pub fn record(&self, id: WorkerId) -> Option<WorkerRecord> {
        self.lock().get(&id).map(|w| w.record.clone())
    }

    fn partition_for(&self, key: &PartitionKey, block_size: u32) -> Result<Arc<Partition>, ApiError> {
        if let Ok(p) = self.engine.partition(key) {
            if p.block_size() != block_size {
                return Err(ApiError::conflict(format!(
                    "block_size {block_size} differs from {} of model={} routing_group={}",
                    p.block_size(),
                    key.model,
                    key.routing_group
                )));
            }
            return Ok(p);
        }
        let config = (self.config_for)(block_size);
        self.engine
            .create_partition(key.clone(), config)
            .map_err(|e| ApiError::bad_request(e.to_string()))
    }

    /// Why a registration is not schedulable (Dynamo's `not_schedulable_reasons`).
    fn reasons(&self, r: &WorkerRequest) -> Vec<String> {
        let mut reasons = Vec::new();
        if r.endpoint.as_deref().map_or(true, str::is_empty) {
            reasons.push("endpoint is required".to_string());
        }
        if r.block_size.is_none() {
            reasons.push("block_size is required".to_string());
        }
        if self.use_kv_events {
            for rank in 0..r.data_parallel_size.unwrap_or(1).max(1) {
                if events_endpoint(r, rank).is_none() {
                    reasons.push(format!("kv_events endpoint is required for dp_rank {rank}"));
                }
            }
        }
        reasons
    }

    /// `POST /workers`: registers or replaces a worker. Returns its record.
    pub fn upsert(&self, r: WorkerRequest) -> Result<WorkerRecord, ApiError> {
        let dp = r.data_parallel_size.unwrap_or(1);
        if dp == 0 || dp > MAX_DP_SIZE {
            return Err(ApiError::bad_request(format!(
                "data_parallel_size must be in 1..={MAX_DP_SIZE}, got {dp}"
            )));
        }
        if r.data_parallel_start_rank.unwrap_or(0) != 0 {
            return Err(ApiError::bad_request(
                "data_parallel_start_rank other than 0 is not supported by kvr serve",
            ));
        }
        if r.block_size == Some(0) {
            return Err(ApiError::bad_request("block_size must be at least 1"));
        }
        let key = PartitionKey::new(r.model_name.clone(), r.routing_group.clone());
        let mut workers = self.lock();
        // A worker moving partitions leaves the old one first.
        if let Some(old) = workers.get(&r.worker_id) {
            if old.record.model_name != r.model_name || old.record.routing_group != r.routing_group
            {
                let old = workers.remove(&r.worker_id).expect("present");
                self.retire(old);
            }
        }
        let partition = match r.block_size {
            Some(bs) => Some(self.partition_for(&key, bs)?),
            None => None,
        };
        let reasons = self.reasons(&r);
        let requested = r.lifecycle;
        let lifecycle = match (reasons.is_empty(), requested) {
            (false, _) => Lifecycle::Incomplete,
            (true, Some(Lifecycle::Draining)) => Lifecycle::Draining,
            (true, Some(Lifecycle::Unschedulable)) => Lifecycle::Unschedulable,
            (true, _) => Lifecycle::Schedulable,
        };
        let record = WorkerRecord::from_request(&r, lifecycle, reasons);
        let previous = workers.remove(&r.worker_id);
        let same_events = previous.as_ref().is_some_and(|p| {
            p.record.kv_events_endpoint == record.kv_events_endpoint
                && p.record.kv_events_endpoints == record.kv_events_endpoints
                && p.record.replay_endpoint == record.replay_endpoint
                && p.record.data_parallel_size == record.data_parallel_size
        });
        let mut subscriptions = Vec::new();
        if let Some(mut prev) = previous {
            if same_events {
                subscriptions = std::mem::take(&mut prev.subscriptions);
            } else {
                for s in &mut prev.subscriptions {
                    s.stop();
                }
            }
        }
        if let Some(p) = &partition {
            let mut info = WorkerInfo::new(r.worker_id, dp);
            info.total_kv_blocks = r.total_kv_blocks.unwrap_or(0);
            info.max_batched_tokens = r.max_num_batched_tokens.unwrap_or(0);
            info.control_endpoints = vec![r.endpoint.clone(); dp as usize];
            if let Err(e) = p.upsert_worker(info) {
                return Err(ApiError::bad_request(e.to_string()));
            }
            if subscriptions.is_empty() && self.use_kv_events && p.indexer_policy().applies_events() {
                subscriptions = subscribe_ranks(p, &r);
            }
        }
        workers.insert(
            r.worker_id,
            Worker {
                record: record.clone(),
                subscriptions,
            },
        );
        self.publish(&workers);
        Ok(record)
    }

    /// `PATCH /workers/{id}`.
    pub fn patch(&self, id: WorkerId, patch: WorkerPatch) -> Result<WorkerRecord, ApiError> {
        let current = self
            .record(id)
            .ok_or_else(|| ApiError::not_found(format!("worker {id} not found")))?;
        let mut req = request_of(&current);
        if let Some(e) = patch.endpoint {
            req.endpoint = Some(e);
        }
        if let Some(e) = patch.kv_events_endpoint {
            req.kv_events_endpoint = Some(e);
        }
        if let Some(e) = patch.kv_events_endpoints {
            req.kv_events_endpoints = Some(e);
        }
        if let Some(e) = patch.replay_endpoint {
            req.replay_endpoint = Some(e);
        }
        if let Some(n) = patch.max_num_batched_tokens {
            req.max_num_batched_tokens = Some(n);
        }
        if let Some(n) = patch.total_kv_blocks {
            req.total_kv_blocks = Some(n);
        }
        req.lifecycle = patch.lifecycle.or(match current.lifecycle {
            Lifecycle::Draining | Lifecycle::Unschedulable => Some(current.lifecycle),
            _ => None,
        });
        self.upsert(req)
    }

    /// `DELETE /workers/{id}`: the worker's subscriptions stop and its state leaves the
    /// partition (index entries, bookings, sessions). Returns its last record.
    pub fn remove(&self, id: WorkerId) -> Option<WorkerRecord> {
        let mut workers = self.lock();
        let w = workers.remove(&id)?;
        let mut record = w.record.clone();
        record.lifecycle = Lifecycle::Unschedulable;
        record.not_schedulable_reasons.clear();
        self.retire(w);
        self.publish(&workers);
        Some(record)
    }

    /// Stops every subscription (graceful shutdown: after the HTTP server drained).
    pub fn stop_all(&self) {
        let mut workers = self.lock();
        for w in workers.values_mut() {
            for s in &mut w.subscriptions {
                s.stop();
            }
        }
    }

    fn retire(&self, mut w: Worker) {
        for s in &mut w.subscriptions {
            s.stop();
        }
        let key = PartitionKey::new(w.record.model_name.clone(), w.record.routing_group.clone());
        if let Ok(p) = self.engine.partition(&key) {
            p.remove_worker(w.record.worker_id);
        }
    }

    /// Rebuilds the request path's snapshot from the records (under the registry lock).
    fn publish(&self, workers: &BTreeMap<WorkerId, Worker>) {
        let mut next: Partitions = HashMap::new();
        let mut members: HashMap<PartitionKey, (Vec<WorkerId>, HashMap<WorkerId, Option<String>>, usize)> =
            HashMap::new();
        for p in self.partitions.load().values() {
            members.entry(p.partition.key().clone()).or_default();
        }
        for w in workers.values() {
            let key = PartitionKey::new(w.record.model_name.clone(), w.record.routing_group.clone());
            let (sched, endpoints, total) = members.entry(key).or_default();
            *total += 1;
            if w.record.lifecycle == Lifecycle::Schedulable {
                sched.push(w.record.worker_id);
                endpoints.insert(w.record.worker_id, w.record.endpoint.clone());
            }
        }
        for (key, (sched, endpoints, total)) in members {
            let Ok(partition) = self.engine.partition(&key) else {
                continue;
            };
            let count = sched.len();
            let schedulable = (count != total).then(|| Arc::new(sched));
            next.insert(
                key,
                Arc::new(PartitionEntry {
                    partition,
                    schedulable,
                    schedulable_count: count,
                    endpoints: Arc::new(endpoints),
                }),
            );
        }
        self.partitions.store(Arc::new(next));
    }
}

/// The KV-events endpoint of a DP rank: `kv_events_endpoints["<rank>"]`, else (rank 0 or
/// a single endpoint for all ranks, vLLM's port offset) `kv_events_endpoint`.
fn events_endpoint(r: &WorkerRequest, rank: u32) -> Option<String> {
    if let Some(map) = &r.kv_events_endpoints {
        if let Some(e) = map.get(&rank.to_string()) {
            return Some(e.clone());
        }
    }
    r.kv_events_endpoint
        .as_deref()
        .filter(|e| !e.is_empty())
        .map(|e| offset_port(e, rank))
}

fn subscribe_ranks(p: &Arc<Partition>, r: &WorkerRequest) -> Vec<Subscription> {
    let mut subs = Vec::new();
    for rank in 0..r.data_parallel_size.unwrap_or(1).max(1) {
        let Some(endpoint) = events_endpoint(r, rank) else {
            continue;
        };
        let cfg = SubscribeConfig::Connect {
            endpoint: endpoint.clone(),
            replay_endpoint: r.replay_endpoint.as_deref().map(|e| offset_port(e, rank)),
            topic: Vec::new(),
            worker_id: r.worker_id,
            stream: rank,
        };
        match kvr_zmq::subscribe(p.clone(), cfg) {
            Ok(s) => {
                tracing::info!(worker_id = r.worker_id, dp_rank = rank, %endpoint, "subscribed to KV events");
                subs.push(s);
            }
            Err(e) => {
                tracing::warn!(worker_id = r.worker_id, dp_rank = rank, %endpoint, error = %e, "KV-event subscription refused");
            }
        }
    }
    subs
}

/// A record back into the request that produced it (PATCH merges into it).
fn request_of(r: &WorkerRecord) -> WorkerRequest {
    WorkerRequest {
        worker_id: r.worker_id,
        model_name: r.model_name.clone(),
        routing_group: r.routing_group.clone(),
        endpoint: r.endpoint.clone(),
        kv_events_endpoint: r.kv_events_endpoint.clone(),
        kv_events_endpoints: r.kv_events_endpoints.clone(),
        replay_endpoint: r.replay_endpoint.clone(),
        block_size: r.block_size,
        data_parallel_start_rank: r.data_parallel_start_rank,
        data_parallel_size: r.data_parallel_size,
        max_num_batched_tokens: r.max_num_batched_tokens,
        total_kv_blocks: r.total_kv_blocks,
        stable_routing_id: r.stable_routing_id.clone(),
        is_eagle: r.is_eagle,
        taints: r.taints.clone(),
        topology_domains: r.topology_domains.clone(),
        kv_transfer_domain: r.kv_transfer_domain.clone(),
        kv_transfer_enforcement: r.kv_transfer_enforcement.clone(),
        kv_transfer_preferred_weight: r.kv_transfer_preferred_weight,
        lifecycle: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_ports_follow_vllm() {
        assert_eq!(offset_port("tcp://127.0.0.1:5557", 0), "tcp://127.0.0.1:5557");
        assert_eq!(offset_port("tcp://127.0.0.1:5557", 2), "tcp://127.0.0.1:5559");
        assert_eq!(offset_port("ipc:///tmp/x", 1), "ipc:///tmp/x");
    }
}
