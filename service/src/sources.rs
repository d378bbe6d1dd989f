//! KV-event sources seen from outside: each subscribed stream's health (exact,
//! recovering, degraded, dead: `kvr::stats::SourceHealth`), for `/ready`, the Python
//! bindings and the log. A wrong or dead endpoint is never silent: the log says so once
//! per change of state, `/ready` lists it, `/metrics` counts it.

use std::collections::HashMap;

use crate::wire::source::SourceState;
use crate::App;
use kvr::stats::{HealthReason, SourceHealth, StreamStats};
use kvr::WorkerId;

impl App {
    /// Every KV-event stream's health, by partition, worker and stream.
    pub fn kv_event_sources(&self) -> Vec<SourceState> {
        let mut out = Vec::new();
        for entry in self.registry.partitions() {
            let key = entry.partition.key();
            for s in entry.partition.ingress_stats() {
                out.push(SourceState::of(&key.model, &key.routing_group, &s));
            }
        }
        out.sort_by(|a, b| {
            (&a.model_name, &a.routing_group, a.worker_id, a.stream).cmp(&(
                &b.model_name,
                &b.routing_group,
                b.worker_id,
                b.stream,
            ))
        });
        out
    }
}

/// The identity of a stream across polls.
type StreamKey = (String, String, WorkerId, u32);

/// Remembers each stream's last logged reason, so that a change is logged once.
#[derive(Debug, Default)]
pub struct HealthLog {
    last: HashMap<StreamKey, HealthReason>,
}

impl HealthLog {
    /// Logs every stream whose state changed since the last call: a warning when it
    /// turns degraded or dead, an info line when it comes back. A stream first seen
    /// exact or recovering is not logged (its subscription was). Returns how many lines.
    pub fn log_changes(&mut self, app: &App) -> usize {
        let mut logged = 0;
        let mut seen = HashMap::with_capacity(self.last.len());
        for entry in app.registry.partitions() {
            let key = entry.partition.key();
            for s in entry.partition.ingress_stats() {
                let id: StreamKey = (
                    key.model.clone(),
                    key.routing_group.clone(),
                    s.worker_id,
                    s.stream,
                );
                let now = s.health_reason;
                let before = self.last.get(&id).copied();
                if before != Some(now) && log_one(&key.model, &key.routing_group, &s, before) {
                    logged += 1;
                }
                seen.insert(id, now);
            }
        }
        self.last = seen;
        logged
    }
}

/// Logs one stream's change from `before` (`None`: first seen); false if not worth a line.
fn log_one(model: &str, group: &str, s: &StreamStats, before: Option<HealthReason>) -> bool {
    let (state, reason) = (s.health.name(), s.health_reason.text());
    let was = before.map_or("new", |r| r.health().name());
    match s.health {
        SourceHealth::Dead | SourceHealth::Degraded => {
            tracing::warn!(model = %model, routing_group = %group, worker_id = s.worker_id, dp_rank = s.stream, state, reason, was, link_failures = s.link_failures, "KV-event source {state}: {reason}");
            true
        }
        SourceHealth::Exact | SourceHealth::Recovering => {
            let bad = before.is_some_and(|r| r.health() >= SourceHealth::Degraded);
            if bad {
                tracing::info!(model = %model, routing_group = %group, worker_id = s.worker_id, dp_rank = s.stream, state, reason, was, "KV-event source back: {state}");
            }
            bad
        }
    }
}
