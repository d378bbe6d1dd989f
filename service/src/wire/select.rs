//! `POST /select`, `/select_and_reserve`, `/potential_loads`, `/overlap_scores` and the
//! reservation routes: bodies and answers with Dynamo 1.6.1's field names and defaults.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::prompt::PromptBody;

pub fn default_name() -> String {
    "default".to_string()
}

/// `router_config_override`: per-request knobs (absent = the service's). Out-of-range
/// values are refused while the body is read (422), with Dynamo 1.6.1's messages.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(try_from = "RawOverride")]
pub struct RouterConfigOverride {
    #[serde(default)]
    pub overlap_score_credit: Option<f64>,
    #[serde(default)]
    pub prefill_load_scale: Option<f64>,
    #[serde(default)]
    pub router_temperature: Option<f64>,
    #[serde(default)]
    pub assume_kv_reuse: Option<bool>,
    #[serde(default)]
    pub track_prefill_tokens: Option<bool>,
    #[serde(default)]
    pub shared_cache_multiplier: Option<f64>,
}

/// [`RouterConfigOverride`] as read, before its ranges are checked.
#[derive(Deserialize)]
struct RawOverride {
    #[serde(default)]
    overlap_score_credit: Option<f64>,
    #[serde(default)]
    prefill_load_scale: Option<f64>,
    #[serde(default)]
    router_temperature: Option<f64>,
    #[serde(default)]
    assume_kv_reuse: Option<bool>,
    #[serde(default)]
    track_prefill_tokens: Option<bool>,
    #[serde(default)]
    shared_cache_multiplier: Option<f64>,
}

impl TryFrom<RawOverride> for RouterConfigOverride {
    type Error = &'static str;

    fn try_from(r: RawOverride) -> Result<Self, Self::Error> {
        let bad = |v: Option<f64>| v.is_some_and(|x| !x.is_finite() || x < 0.0);
        if bad(r.overlap_score_credit) {
            return Err("overlap_score_credit must be a finite, non-negative number");
        }
        if bad(r.prefill_load_scale) {
            return Err("prefill_load_scale must be finite and non-negative");
        }
        if bad(r.router_temperature) {
            return Err("router_temperature must be finite and non-negative");
        }
        if r.shared_cache_multiplier
            .is_some_and(|x| !(0.0..=1.0).contains(&x))
        {
            return Err("shared_cache_multiplier must be between 0 and 1");
        }
        Ok(RouterConfigOverride {
            overlap_score_credit: r.overlap_score_credit,
            prefill_load_scale: r.prefill_load_scale,
            router_temperature: r.router_temperature,
            assume_kv_reuse: r.assume_kv_reuse,
            track_prefill_tokens: r.track_prefill_tokens,
            shared_cache_multiplier: r.shared_cache_multiplier,
        })
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct SessionContextBody {
    pub session_id: String,
    #[serde(default)]
    pub parent_session_id: Option<String>,
    #[serde(default)]
    pub session_final: bool,
    #[serde(default)]
    pub input_trigger: Option<InputTrigger>,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum InputTrigger {
    UserMessage,
    ToolResult,
    Other,
}

impl InputTrigger {
    pub fn as_str(self) -> &'static str {
        match self {
            InputTrigger::UserMessage => "user_message",
            InputTrigger::ToolResult => "tool_result",
            InputTrigger::Other => "other",
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct PinnedWorker {
    pub worker_id: u64,
    /// Required, as in Dynamo (a body without it is refused with 422).
    pub dp_rank: u32,
}

/// The body of `/select`, `/select_and_reserve`, `/potential_loads` and `/overlap_scores`
/// Read through [`super::flat::SelectRequest`] on the hot path (the prompt fields inline:
/// `#[serde(flatten)]` buffers the whole body into serde's `Content` first, a third of the
/// service's CPU on 8k-token prompts); this flattened form is parsed only for the error
/// text of a body that fails, which then reads exactly as Dynamo's (flattened too).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct SelectRequest {
    #[serde(default = "default_name")]
    pub model_name: String,
    #[serde(default = "default_name")]
    pub routing_group: String,
    #[serde(default)]
    pub selection_id: Option<String>,
    #[serde(flatten)]
    pub prompt: PromptBody,
    #[serde(default)]
    pub router_config_override: Option<RouterConfigOverride>,
    #[serde(default)]
    pub expected_output_tokens: Option<u64>,
    #[serde(default)]
    pub priority_jump: Option<f64>,
    #[serde(default)]
    pub strict_priority: Option<bool>,
    /// Legacy flat session id (used only without `session_context`).
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub session_context: Option<SessionContextBody>,
    #[serde(default)]
    pub affinity_target: Option<u64>,
    #[serde(default)]
    pub pinned_worker: Option<PinnedWorker>,
    #[serde(default)]
    pub allowed_worker_ids: Option<Vec<u64>>,
    /// `/select` only: answer the projected load without caching a pending selection.
    #[serde(default)]
    pub advisory: Option<bool>,
}

/// `overlap` of an answer: matched **tokens**; `gpu ≤ cpu ≤ disk` (cumulative over tiers).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct OverlapBody {
    pub longest_matched: u64,
    pub gpu: u64,
    /// Device tokens per DP rank of the chosen worker.
    pub dp: BTreeMap<String, u64>,
    pub cpu: u64,
    pub disk: u64,
}

/// The answer of `/select` and `/select_and_reserve`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct SelectResponse {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selection_id: Option<String>,
    /// Booked answers: the prompt's sequence hashes, its length and whether its prefill is
    /// tracked, so a replica or a client can mirror the booking.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sequence_hashes: Option<Vec<i64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isl_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub track_prefill_tokens: Option<bool>,
    pub model_name: String,
    pub routing_group: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub endpoint: Option<String>,
    pub block_size: u32,
    pub overlap: OverlapBody,
    pub effective_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    /// Advisory `/select` only: the chosen rank's load and capacity.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_load: Option<WorkerLoadBody>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_hint: Option<KvHintBody>,
}

/// `worker_load` of an advisory answer.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct WorkerLoadBody {
    pub active_prefill_tokens: u64,
    /// Dynamo's default capacity (10,000,000 tokens) when none is configured.
    pub prefill_token_capacity: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_kv_blocks: Option<u64>,
}

/// Dynamo's prefill-token capacity of a rank with no configured limit.
pub const DEFAULT_PREFILL_TOKEN_CAPACITY: u64 = 10_000_000;

/// A transfer hint: a peer rank holding more of the prompt that can send it.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct KvHintBody {
    pub source_worker_id: u64,
    pub source_dp_rank: u32,
    pub source_control_endpoint: String,
    pub start_block: u32,
    pub hinted_blocks: u32,
    /// The source engine's own hashes of the hinted blocks (as Dynamo's
    /// `router_hint.block_hashes`: signed i64 bits).
    pub block_hashes: Vec<i64>,
}

/// `POST /reservations`: claims a pending selection, or (with `worker_id`) books an
/// explicit one.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct ReservationRequest {
    pub selection_id: String,
    #[serde(default = "default_name")]
    pub model_name: String,
    #[serde(default = "default_name")]
    pub routing_group: String,
    #[serde(default)]
    pub worker_id: Option<u64>,
    #[serde(default)]
    pub dp_rank: Option<u32>,
    #[serde(flatten)]
    pub prompt: PromptBody,
    #[serde(default)]
    pub expected_output_tokens: Option<u64>,
    /// Dynamo's field, type-checked as Dynamo does; an explicit booking adds no prefill
    /// tokens whatever it says (tests/compat/README.md).
    #[serde(default, skip_serializing)]
    pub track_prefill_tokens: Option<bool>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct ReservationResponse {
    pub selection_id: String,
    pub model_name: String,
    pub routing_group: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub endpoint: Option<String>,
}

/// `POST /reservations/{id}/output_block`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct OutputBlockBody {
    #[serde(default)]
    pub decay_fraction: Option<f64>,
}

/// One rank's load in `/loads` and `/potential_loads`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct RankLoadBody {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u64,
}

/// One partition in `GET /loads`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct PartitionLoadsBody {
    pub model_name: String,
    pub routing_group: String,
    pub loads: Vec<RankLoadBody>,
    /// kvr has no admission queue: always 0 (Dynamo counts requests its queue holds).
    pub pending_count: u64,
    pub pending_isl_tokens: u64,
}

/// One rank in `POST /overlap_scores`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct RankOverlapBody {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub device_blocks: u32,
    /// Cumulative: device plus the host blocks that extend it.
    pub host_pinned_blocks: u32,
    /// Cumulative: device, host and the disk blocks that extend them.
    pub disk_blocks: u32,
    pub host_pinned_extension_blocks: u32,
    pub disk_extension_blocks: u32,
    pub shared_beyond_device_blocks: Option<u32>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct SharedCacheBody {
    pub enabled: bool,
    pub total_hit_blocks: u64,
    pub ranges: Vec<[u32; 2]>,
    pub error: Option<String>,
}

/// The answer of `POST /overlap_scores`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct OverlapScoresBody {
    pub block_size: u32,
    pub num_blocks: u64,
    pub workers: Vec<RankOverlapBody>,
    pub shared_cache: SharedCacheBody,
}

/// `{"status":"ok"}`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct StatusOk {
    pub status: &'static str,
}

pub const OK: StatusOk = StatusOk { status: "ok" };

impl crate::error::WireBody for OutputBlockBody {
    type Fast = Self;
}
