//! `POST /workers`, `PATCH /workers/{id}` and the worker record Dynamo 1.6.1 answers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::select::default_name;

/// A worker's place in the schedule (Dynamo's `lifecycle`).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Lifecycle {
    /// Registered without what selection needs (an endpoint, a KV-events endpoint per rank).
    #[default]
    Incomplete,
    Schedulable,
    /// Keeps its bookings and index, takes no new selections.
    Draining,
    Unschedulable,
}

/// The body of `POST /workers` (upsert).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct WorkerRequest {
    pub worker_id: u64,
    #[serde(default = "default_name")]
    pub model_name: String,
    #[serde(default = "default_name")]
    pub routing_group: String,
    #[serde(default)]
    pub endpoint: Option<String>,
    /// The KV-events PUB endpoint of a worker with one DP rank.
    #[serde(default)]
    pub kv_events_endpoint: Option<String>,
    /// Per DP rank (`{"<rank>": "tcp://…"}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_endpoints: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    #[serde(default)]
    pub block_size: Option<u32>,
    #[serde(default)]
    pub data_parallel_start_rank: Option<u32>,
    #[serde(default)]
    pub data_parallel_size: Option<u32>,
    #[serde(default)]
    pub max_num_batched_tokens: Option<u64>,
    #[serde(default)]
    pub total_kv_blocks: Option<u64>,
    #[serde(default)]
    pub stable_routing_id: Option<String>,
    #[serde(default)]
    pub is_eagle: Option<bool>,
    #[serde(default)]
    pub taints: Vec<String>,
    #[serde(default)]
    pub topology_domains: BTreeMap<String, String>,
    #[serde(default)]
    pub kv_transfer_domain: Option<String>,
    #[serde(default)]
    pub kv_transfer_enforcement: Option<KvTransferEnforcement>,
    #[serde(default)]
    pub kv_transfer_preferred_weight: Option<f64>,
    /// Dynamo's routing-hint and event-source fields: type-checked as Dynamo does (a
    /// wrong type is refused with 422), not used by kvr, not in the record.
    #[serde(default, skip_serializing)]
    pub router_hint_worker_type: Option<String>,
    #[serde(default, skip_serializing)]
    pub router_hint_source_control_endpoints: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default, skip_serializing)]
    pub kv_event_source_mode: Option<String>,
}

/// The record the routes answer: the request's fields plus the lifecycle and, while not
/// schedulable, why.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct WorkerRecord {
    pub worker_id: u64,
    pub model_name: String,
    pub routing_group: String,
    pub lifecycle: Lifecycle,
    pub endpoint: Option<String>,
    pub kv_events_endpoint: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events_endpoints: Option<BTreeMap<String, String>>,
    pub replay_endpoint: Option<String>,
    pub block_size: Option<u32>,
    pub data_parallel_start_rank: Option<u32>,
    pub data_parallel_size: Option<u32>,
    pub max_num_batched_tokens: Option<u64>,
    pub total_kv_blocks: Option<u64>,
    pub stable_routing_id: Option<String>,
    pub is_eagle: Option<bool>,
    pub taints: Vec<String>,
    pub topology_domains: BTreeMap<String, String>,
    pub kv_transfer_domain: Option<String>,
    pub kv_transfer_enforcement: Option<KvTransferEnforcement>,
    pub kv_transfer_preferred_weight: Option<f64>,
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub not_schedulable_reasons: Vec<String>,
}

impl WorkerRecord {
    pub fn from_request(r: &WorkerRequest, lifecycle: Lifecycle, reasons: Vec<String>) -> Self {
        Self {
            worker_id: r.worker_id,
            model_name: r.model_name.clone(),
            routing_group: r.routing_group.clone(),
            lifecycle,
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
            kv_transfer_enforcement: r.kv_transfer_enforcement,
            kv_transfer_preferred_weight: r.kv_transfer_preferred_weight,
            not_schedulable_reasons: reasons,
        }
    }
}

/// `kv_transfer_enforcement`: Dynamo's two values (anything else is refused with 422).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum KvTransferEnforcement {
    Required,
    Preferred,
}

/// The body of `PATCH /workers/{id}`: any subset of the request's fields; `null` means
/// "not given". The ids and `lifecycle` are not patch fields (ignored, as Dynamo does:
/// the lifecycle is derived from the record).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename = "WorkerPatchRequest")]
pub struct WorkerPatch {
    #[serde(default)]
    pub block_size: Option<u32>,
    #[serde(default)]
    pub data_parallel_start_rank: Option<u32>,
    #[serde(default)]
    pub data_parallel_size: Option<u32>,
    #[serde(default)]
    pub stable_routing_id: Option<String>,
    #[serde(default)]
    pub is_eagle: Option<bool>,
    #[serde(default)]
    pub taints: Option<Vec<String>>,
    #[serde(default)]
    pub topology_domains: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub kv_transfer_domain: Option<String>,
    #[serde(default)]
    pub kv_transfer_enforcement: Option<KvTransferEnforcement>,
    #[serde(default)]
    pub kv_transfer_preferred_weight: Option<f64>,
    /// Dynamo's routing-hint and event-source fields: type-checked as Dynamo does (a
    /// wrong type is refused with 422), not used by kvr, not in the record.
    #[serde(default, skip_serializing)]
    pub router_hint_worker_type: Option<String>,
    #[serde(default, skip_serializing)]
    pub router_hint_source_control_endpoints: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default, skip_serializing)]
    pub kv_event_source_mode: Option<String>,
    #[serde(default)]
    pub endpoint: Option<String>,
    #[serde(default)]
    pub kv_events_endpoint: Option<String>,
    #[serde(default)]
    pub kv_events_endpoints: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    #[serde(default)]
    pub max_num_batched_tokens: Option<u64>,
    #[serde(default)]
    pub total_kv_blocks: Option<u64>,
}

/// `GET /workers?model_name=&routing_group=` and `/loads`' filter.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct PartitionFilter {
    #[serde(default)]
    pub model_name: Option<String>,
    #[serde(default)]
    pub routing_group: Option<String>,
}

impl PartitionFilter {
    pub fn matches(&self, model: &str, group: &str) -> bool {
        self.model_name.as_deref().is_none_or(|m| m == model)
            && self.routing_group.as_deref().is_none_or(|g| g == group)
    }
}

/// `GET /ready`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct ReadyBody {
    pub ready: bool,
    pub schedulable_workers: usize,
    pub workers: Vec<WorkerRecord>,
    /// kvr's addition: the KV-event streams that are not exact (recovering, degraded,
    /// dead), absent when every stream is exact (Dynamo's body then).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_event_sources: Vec<super::source::SourceState>,
    /// kvr's addition: the streams by state and the exact share `/ready` waits for;
    /// absent when every stream is exact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coverage: Option<Coverage>,
}

/// The streams by state, as `/ready` reports them.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct Coverage {
    pub exact: usize,
    pub recovering: usize,
    pub degraded: usize,
    pub dead: usize,
    /// exact / all streams (1 with no stream).
    pub exact_share: f64,
    /// The share `/ready` waits for (0: it does not wait).
    pub min_exact_share: f64,
    /// Seconds from start until the share was first reached (absent: not yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reached_after_secs: Option<f64>,
    /// `/ready` stopped waiting for the share: `--ready-wait-secs` passed first.
    #[serde(default)]
    pub wait_bound_passed: bool,
}

impl crate::error::WireBody for WorkerRequest {
    type Fast = Self;
}

impl crate::error::WireBody for WorkerPatch {
    type Fast = Self;
}
