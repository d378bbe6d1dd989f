//! A KV-event stream's health as the service answers it (`/ready`, the Python bindings).

use kvr::stats::StreamStats;
use kvr::WorkerId;
use serde::{Deserialize, Serialize};

/// One stream's health, as `/ready` lists it.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct SourceState {
    pub model_name: String,
    pub routing_group: String,
    pub worker_id: WorkerId,
    /// The stream: the DP rank whose endpoint it is.
    pub stream: u32,
    /// `exact`, `recovering`, `degraded` or `dead`.
    pub state: String,
    /// Why, in words (e.g. "cannot connect (refused or timed out)").
    pub reason: String,
    /// Since when, ms since the Unix epoch (0: since the subscription started).
    pub since_unix_ms: u64,
    /// Batches that failed to decode (every cause).
    pub decode_errors: u64,
    /// Failed connects or binds and lost connections.
    pub link_failures: u64,
}

impl SourceState {
    pub(crate) fn of(model: &str, group: &str, s: &StreamStats) -> Self {
        SourceState {
            model_name: model.to_string(),
            routing_group: group.to_string(),
            worker_id: s.worker_id,
            stream: s.stream,
            state: s.health.name().to_string(),
            reason: s.health_reason.text().to_string(),
            since_unix_ms: s.health_since_unix_ms,
            decode_errors: s.decode_errors.iter().map(|c| c.1).sum(),
            link_failures: s.link_failures,
        }
    }
}
