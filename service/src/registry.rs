//! The workers the service was told about: their records (Dynamo's `/workers` shape), the
//! partition each belongs to, and the KV-event subscriptions the service runs for them.
//!
//! A worker is a member of its partition (its events indexed, its bookings kept) exactly
//! while it is schedulable: one that becomes incomplete (a block-size mismatch, a missing
//! endpoint) leaves it, as in Dynamo, so every member is a candidate and selections need
//! no allow-list of their own.
//!
//! Registration changes take one mutex (rare); the request path reads an immutable
//! snapshot of the partitions through `arc-swap`: finding a request's partition takes no
//! lock (the service makes no lock-free claim beyond that: the pending-selection cache, the
//! caller-named ids and the metrics families each take a mutex or a read lock).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use kvr::config::PartitionConfig;
use kvr::{Engine, Partition, PartitionKey, WorkerId, WorkerInfo};
use kvr_zmq::{SubscribeConfig, SubscribeOptions, Subscription};

use crate::error::ApiError;
use crate::wire::worker::{Lifecycle, WorkerPatch, WorkerRecord, WorkerRequest};

/// The engine's bound on a worker's DP ranks (refused with Dynamo's 400 shape above it).
pub use kvr::MAX_DP_SIZE;

/// What the request path needs of a partition.
#[derive(Debug)]
pub struct PartitionEntry {
    pub partition: Arc<Partition>,
    /// Member id → its endpoint (answers carry it). Members are all schedulable: a worker
    /// that is not leaves the partition.
    pub endpoints: Arc<HashMap<WorkerId, Option<String>>>,
}

impl PartitionEntry {
    pub fn schedulable_count(&self) -> usize {
        self.endpoints.len()
    }

    pub fn is_schedulable(&self, id: WorkerId) -> bool {
        self.endpoints.contains_key(&id)
    }
}

type Partitions = HashMap<PartitionKey, Arc<PartitionEntry>>;

struct Worker {
    /// What the worker was registered with (PATCH merges into it).
    request: WorkerRequest,
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
    subscribe_options: SubscribeOptions,
    /// `--state-dir`: partitions restored and journaled, registrations kept.
    state: std::sync::OnceLock<Arc<crate::state::ServiceState>>,
    /// The host hooks every partition gets when it is created.
    hooks: std::sync::OnceLock<kvr::HostHooks>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

/// vLLM's rule for a DP rank's endpoints: the rank's index in the worker is added to the
/// base port (the worker's replay endpoint serves its first rank).
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
    pub fn new(
        engine: Arc<Engine>,
        use_kv_events: bool,
        config_for: Box<PartitionFactory>,
    ) -> Self {
        Self {
            engine,
            workers: Mutex::new(BTreeMap::new()),
            partitions: ArcSwap::from_pointee(HashMap::new()),
            config_for,
            use_kv_events,
            subscribe_options: SubscribeOptions::default(),
            state: std::sync::OnceLock::new(),
            hooks: std::sync::OnceLock::new(),
        }
    }

    /// Keeps partitions and registrations in `state` (before any worker registers).
    pub fn set_state(&self, state: Arc<crate::state::ServiceState>) {
        let _ = self.state.set(state);
    }

    /// The host hooks of every partition created from now on (before any worker
    /// registers; a second call is ignored).
    pub fn set_partition_hooks(&self, hooks: kvr::HostHooks) {
        let _ = self.hooks.set(hooks);
    }

    /// Registers again the workers a previous run kept (`--state-dir`), each partition
    /// restored before its streams start; the registrations file is written once, after.
    /// Returns how many were registered.
    pub fn replay_saved_workers(&self) -> usize {
        let Some(state) = self.state.get() else {
            return 0;
        };
        let saved = state.saved_workers();
        state.suspend_saves(true);
        let mut n = 0;
        for r in saved {
            let id = r.worker_id;
            match self.upsert(r) {
                Ok(_) => n += 1,
                Err(e) => {
                    tracing::warn!(worker_id = id, error = %e.message, "state: a kept registration is refused")
                }
            }
        }
        state.suspend_saves(false);
        self.publish(&self.lock());
        n
    }

    /// How workers' KV-event subscriptions recover (idle probe, replay timeout).
    pub fn with_subscribe_options(mut self, options: SubscribeOptions) -> Self {
        self.subscribe_options = options;
        self
    }

    /// The partition of `key` (an arc-swap load; no lock).
    pub fn partition(&self, key: &PartitionKey) -> Option<Arc<PartitionEntry>> {
        self.partitions.load().get(key).cloned()
    }

    pub fn partitions(&self) -> Vec<Arc<PartitionEntry>> {
        let mut v: Vec<_> = self.partitions.load().values().cloned().collect();
        v.sort_by(|a, b| a.partition.key().cmp(b.partition.key()));
        v
    }

    /// Creates the partition for `key` if missing (peer recovery, before any worker).
    pub fn ensure_partition(
        &self,
        key: &PartitionKey,
        block_size: u32,
    ) -> Result<Arc<Partition>, ApiError> {
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

    /// Every record, by (model, routing group, worker id) as Dynamo lists them.
    pub fn records(&self) -> Vec<WorkerRecord> {
        let mut v: Vec<WorkerRecord> = self.lock().values().map(|w| w.record.clone()).collect();
        v.sort_by(|a, b| {
            (&a.model_name, &a.routing_group, a.worker_id).cmp(&(
                &b.model_name,
                &b.routing_group,
                b.worker_id,
            ))
        });
        v
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn partition_for(
        &self,
        key: &PartitionKey,
        block_size: u32,
    ) -> Result<Arc<Partition>, ApiError> {
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
        let p = self
            .engine
            .create_partition(key.clone(), config)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        if let Some(hooks) = self.hooks.get() {
            p.set_hooks(hooks.clone());
        }
        if let Some(state) = self.state.get() {
            // The kept workers are members before the restore, so their ranks' blocks are
            // taken as a registered worker's (not within the unregistered ranks' budget).
            for r in state.saved_workers_of(key) {
                if self.reasons(&r, key).is_empty() {
                    let _ = p.upsert_worker(worker_info(&r));
                }
            }
            state.attach(&p);
        }
        Ok(p)
    }

    /// Why a registration is not schedulable (Dynamo's `not_schedulable_reasons`, in its
    /// order): what is missing first, then the first reconciliation failure.
    fn reasons(&self, r: &WorkerRequest, key: &PartitionKey) -> Vec<String> {
        let mut reasons = Vec::new();
        if r.endpoint.as_deref().is_none_or(str::is_empty) {
            reasons.push("endpoint is required".to_string());
        }
        if r.block_size.unwrap_or(0) == 0 {
            reasons.push("block_size must be greater than 0".to_string());
        }
        let dp = r.data_parallel_size.unwrap_or(1);
        if dp == 0 {
            reasons.push("data_parallel_size must be greater than 0".to_string());
        }
        let start = r.data_parallel_start_rank.unwrap_or(0);
        if start.checked_add(dp).is_none() {
            reasons.push("data_parallel_start_rank + data_parallel_size overflows".to_string());
            return reasons;
        }
        if self.use_kv_events {
            for rank in start..start + dp {
                if events_endpoint(r, rank).is_none() {
                    reasons.push(format!("kv_events endpoint is required for dp_rank {rank}"));
                }
            }
        }
        if !reasons.is_empty() {
            return reasons;
        }
        if let (Ok(p), Some(bs)) = (self.engine.partition(key), r.block_size) {
            if p.block_size() != bs {
                reasons.push(format!(
                    "reconciliation failed: block_size mismatch for model={} routing_group={}: existing={} requested={bs}",
                    key.model,
                    key.routing_group,
                    p.block_size()
                ));
                return reasons;
            }
        }
        if self.use_kv_events {
            for rank in start..start + dp {
                let Some(e) = events_endpoint(r, rank) else {
                    continue;
                };
                if let Err(why) = check_zmq_endpoint(&e) {
                    reasons.push(format!(
                        "reconciliation failed: invalid kv_events endpoint for worker {} dp_rank {rank}: invalid ZMQ endpoint `{e}`: {why}",
                        r.worker_id
                    ));
                    return reasons;
                }
            }
        }
        reasons
    }

    /// `POST /workers`: registers or replaces a worker (always answered 201, as Dynamo:
    /// what is wrong with it is in its `not_schedulable_reasons`). A schedulable worker is
    /// a member of its partition and its KV events are subscribed; any other is not.
    pub fn upsert(&self, r: WorkerRequest) -> Result<WorkerRecord, ApiError> {
        // Refused outright, as Dynamo does (400), before anything changes: a size over the
        // limit would drive per-rank work (reasons, endpoints, subscriptions).
        if let Some(dp) = r.data_parallel_size.filter(|&dp| dp > MAX_DP_SIZE) {
            return Err(ApiError::bad_request(format!(
                "data_parallel_size {dp} exceeds the maximum {MAX_DP_SIZE}"
            )));
        }
        let key = PartitionKey::new(r.model_name.clone(), r.routing_group.clone());
        let mut workers = self.lock();
        let previous = workers.remove(&r.worker_id);
        let reasons = self.reasons(&r, &key);
        let lifecycle = if reasons.is_empty() {
            Lifecycle::Schedulable
        } else {
            Lifecycle::Incomplete
        };
        let record = WorkerRecord::from_request(&r, lifecycle, reasons);
        let mut subscriptions = Vec::new();
        if let Some(mut prev) = previous {
            let same_partition = prev.record.model_name == r.model_name
                && prev.record.routing_group == r.routing_group;
            let same_events = same_partition
                && prev.record.lifecycle == Lifecycle::Schedulable
                && lifecycle == Lifecycle::Schedulable
                && prev.record.kv_events_endpoint == record.kv_events_endpoint
                && prev.record.kv_events_endpoints == record.kv_events_endpoints
                && prev.record.replay_endpoint == record.replay_endpoint
                && prev.record.data_parallel_size == record.data_parallel_size;
            if same_events {
                subscriptions = std::mem::take(&mut prev.subscriptions);
            } else if prev.record.lifecycle == Lifecycle::Schedulable
                && (!same_partition || lifecycle != Lifecycle::Schedulable)
            {
                self.retire(prev);
            } else {
                for s in &mut prev.subscriptions {
                    s.stop();
                }
            }
        }
        if lifecycle == Lifecycle::Schedulable {
            let bs = r.block_size.unwrap_or(0);
            let p = self.partition_for(&key, bs)?;
            if let Err(e) = p.upsert_worker(worker_info(&r)) {
                return Err(ApiError::bad_request(e.to_string()));
            }
            if subscriptions.is_empty() && self.use_kv_events && p.indexer_policy().applies_events()
            {
                subscriptions = subscribe_ranks(&p, &r, &self.subscribe_options);
            }
        }
        workers.insert(
            r.worker_id,
            Worker {
                request: r,
                record: record.clone(),
                subscriptions,
            },
        );
        self.publish(&workers);
        Ok(record)
    }

    /// `PATCH /workers/{id}`.
    pub fn patch(&self, id: WorkerId, patch: WorkerPatch) -> Result<WorkerRecord, ApiError> {
        let mut req = self
            .lock()
            .get(&id)
            .map(|w| w.request.clone())
            .ok_or_else(|| ApiError::not_found(format!("worker {id} not found")))?;
        macro_rules! take {
            ($($f:ident),*) => {$(
                if patch.$f.is_some() {
                    req.$f = patch.$f;
                }
            )*};
        }
        take!(
            endpoint,
            kv_events_endpoint,
            kv_events_endpoints,
            replay_endpoint,
            block_size,
            data_parallel_start_rank,
            data_parallel_size,
            max_num_batched_tokens,
            total_kv_blocks,
            stable_routing_id,
            is_eagle,
            kv_transfer_domain,
            kv_transfer_enforcement,
            kv_transfer_preferred_weight
        );
        if let Some(t) = patch.taints {
            req.taints = t;
        }
        if let Some(t) = patch.topology_domains {
            req.topology_domains = t;
        }
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
        let mut members: HashMap<PartitionKey, HashMap<WorkerId, Option<String>>> = HashMap::new();
        for p in self.partitions.load().values() {
            members.entry(p.partition.key().clone()).or_default();
        }
        for w in workers.values() {
            let key =
                PartitionKey::new(w.record.model_name.clone(), w.record.routing_group.clone());
            let endpoints = members.entry(key).or_default();
            if w.record.lifecycle == Lifecycle::Schedulable {
                endpoints.insert(w.record.worker_id, w.record.endpoint.clone());
            }
        }
        for (key, endpoints) in members {
            let Ok(partition) = self.engine.partition(&key) else {
                continue;
            };
            next.insert(
                key,
                Arc::new(PartitionEntry {
                    partition,
                    endpoints: Arc::new(endpoints),
                }),
            );
        }
        self.partitions.store(Arc::new(next));
        if let Some(state) = self.state.get() {
            state.save_workers(&workers.values().map(|w| &w.request).collect::<Vec<_>>());
        }
    }
}

/// The partition's view of a schedulable registration.
fn worker_info(r: &WorkerRequest) -> WorkerInfo {
    let dp = r.data_parallel_size.unwrap_or(1);
    let mut info = WorkerInfo::new(r.worker_id, dp);
    info.dp_start = r.data_parallel_start_rank.unwrap_or(0);
    info.total_kv_blocks = r.total_kv_blocks.unwrap_or(0);
    info.max_batched_tokens = r.max_num_batched_tokens.unwrap_or(0);
    info.control_endpoints = vec![r.endpoint.clone(); dp as usize];
    info
}

/// The KV-events endpoint of a DP rank: `kv_events_endpoints["<rank>"]`, else, for a
/// worker of one rank only, `kv_events_endpoint` (Dynamo's rule: a worker of several ranks
/// names each rank's endpoint).
fn events_endpoint(r: &WorkerRequest, rank: u32) -> Option<String> {
    if let Some(map) = &r.kv_events_endpoints {
        if let Some(e) = map.get(&rank.to_string()).filter(|e| !e.is_empty()) {
            return Some(e.clone());
        }
    }
    if rank != r.data_parallel_start_rank.unwrap_or(0) || r.data_parallel_size.unwrap_or(1) != 1 {
        return None;
    }
    r.kv_events_endpoint.clone().filter(|e| !e.is_empty())
}

/// What is wrong with a ZMQ endpoint, in Dynamo's words where it has some.
fn check_zmq_endpoint(e: &str) -> Result<(), String> {
    let Some((scheme, rest)) = e.split_once("://") else {
        return Err("missing scheme".to_string());
    };
    match scheme {
        "tcp" | "ipc" | "inproc" => {}
        other => return Err(format!("unsupported scheme `{other}`")),
    }
    if rest.is_empty() {
        return Err("missing address".to_string());
    }
    kvr_zmq::validate(&SubscribeConfig::Connect {
        endpoint: e.to_string(),
        replay_endpoint: None,
        topic: Vec::new(),
        worker_id: 0,
        stream: 0,
    })
    .map_err(|err| err.to_string())
}

fn subscribe_ranks(
    p: &Arc<Partition>,
    r: &WorkerRequest,
    options: &SubscribeOptions,
) -> Vec<Subscription> {
    let mut subs = Vec::new();
    let start = r.data_parallel_start_rank.unwrap_or(0);
    for (i, rank) in (start..start + r.data_parallel_size.unwrap_or(1).max(1)).enumerate() {
        let Some(endpoint) = events_endpoint(r, rank) else {
            continue;
        };
        let cfg = SubscribeConfig::Connect {
            endpoint: endpoint.clone(),
            replay_endpoint: r
                .replay_endpoint
                .as_deref()
                .map(|e| offset_port(e, i as u32)),
            topic: Vec::new(),
            worker_id: r.worker_id,
            stream: rank,
        };
        match kvr_zmq::subscribe_with(p.clone(), cfg, options.clone()) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_ports_follow_vllm() {
        assert_eq!(
            offset_port("tcp://127.0.0.1:5557", 0),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(
            offset_port("tcp://127.0.0.1:5557", 2),
            "tcp://127.0.0.1:5559"
        );
        assert_eq!(offset_port("ipc:///tmp/x", 1), "ipc:///tmp/x");
    }
}
