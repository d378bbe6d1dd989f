//! `/workers` CRUD, `GET /health`, `GET /ready`, `GET /loads`, `GET /metrics`.

use std::sync::Arc;

use kvr::stats::SourceHealth;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;

use crate::error::{ApiError, Body};
use crate::wire::select::{PartitionLoadsBody, RankLoadBody, StatusOk, OK};
use crate::wire::worker::{
    Lifecycle, PartitionFilter, ReadyBody, WorkerPatch, WorkerRecord, WorkerRequest,
};
use crate::App;

/// `POST /workers`: registers (201) or replaces a worker; its KV events are subscribed.
pub async fn upsert(
    State(app): State<Arc<App>>,
    Body(req): Body<WorkerRequest>,
) -> Result<(StatusCode, Json<WorkerRecord>), ApiError> {
    Ok((StatusCode::CREATED, Json(app.upsert_worker(req)?)))
}

/// `GET /workers?model_name=&routing_group=`.
pub async fn list(
    State(app): State<Arc<App>>,
    Query(f): Query<PartitionFilter>,
) -> Json<Vec<WorkerRecord>> {
    Json(app.list_workers(&f))
}

pub async fn patch(
    State(app): State<Arc<App>>,
    Path(id): Path<u64>,
    Body(p): Body<WorkerPatch>,
) -> Result<Json<WorkerRecord>, ApiError> {
    Ok(Json(app.patch_worker(id, p)?))
}

/// `DELETE /workers/{id}`: its subscriptions stop and its state leaves the partition.
pub async fn remove(
    State(app): State<Arc<App>>,
    Path(id): Path<u64>,
) -> Result<Json<WorkerRecord>, ApiError> {
    Ok(Json(app.delete_worker(id)?))
}

pub async fn health() -> Json<StatusOk> {
    Json(OK)
}

/// `GET /ready`: 200 once a worker is schedulable (and peer recovery, if any, ended).
pub async fn ready(State(app): State<Arc<App>>) -> (StatusCode, Json<ReadyBody>) {
    let body = app.ready();
    let status = if body.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body))
}

/// `GET /loads?model_name=&routing_group=`: every member rank's booked load.
pub async fn loads(
    State(app): State<Arc<App>>,
    Query(f): Query<PartitionFilter>,
) -> Json<Vec<PartitionLoadsBody>> {
    Json(app.loads(&f))
}

/// The worker operations without HTTP (the routes' core, also the Python bindings').
impl App {
    /// `POST /workers`: registers or replaces a worker; its KV events are subscribed.
    pub fn upsert_worker(&self, req: WorkerRequest) -> Result<WorkerRecord, ApiError> {
        let record = self.registry.upsert(req)?;
        tracing::info!(worker_id = record.worker_id, model = %record.model_name, routing_group = %record.routing_group, lifecycle = ?record.lifecycle, "worker registered");
        Ok(record)
    }

    /// `GET /workers`, filtered.
    pub fn list_workers(&self, f: &PartitionFilter) -> Vec<WorkerRecord> {
        self.registry
            .records()
            .into_iter()
            .filter(|r| f.matches(&r.model_name, &r.routing_group))
            .collect()
    }

    /// `PATCH /workers/{id}`.
    pub fn patch_worker(&self, id: u64, p: WorkerPatch) -> Result<WorkerRecord, ApiError> {
        self.registry.patch(id, p)
    }

    /// `DELETE /workers/{id}`.
    pub fn delete_worker(&self, id: u64) -> Result<WorkerRecord, ApiError> {
        let r = self
            .registry
            .remove(id)
            .ok_or_else(|| ApiError::not_found(format!("worker {id} not found")))?;
        tracing::info!(worker_id = id, "worker removed");
        Ok(r)
    }

    /// `GET /ready`'s body: ready once a worker is schedulable (and peer recovery, if
    /// any, ended), and, with `--ready-requires-kv-events`, no KV-event stream is dead.
    /// The streams that are not exact are listed either way.
    pub fn ready(&self) -> ReadyBody {
        let workers = self.registry.records();
        let schedulable = workers
            .iter()
            .filter(|w| w.lifecycle == Lifecycle::Schedulable)
            .count();
        let mut sources = self.kv_event_sources();
        sources.retain(|s| s.state != SourceHealth::Exact.name());
        let dead = sources.iter().any(|s| s.state == SourceHealth::Dead.name());
        let events_ok = !(dead && self.args.ready_requires_kv_events);
        let coverage = self
            .ready_gate
            .coverage(&self.registry, self.args.ready_min_exact_share);
        let covered = self.ready_gate.ready(&coverage, self.args.ready_wait_secs);
        ReadyBody {
            ready: schedulable > 0 && self.recovered() && events_ok && covered,
            schedulable_workers: schedulable,
            workers,
            coverage: (!sources.is_empty()).then_some(coverage),
            kv_event_sources: sources,
        }
    }

    /// `GET /loads`, filtered: every member rank's booked load.
    pub fn loads(&self, f: &PartitionFilter) -> Vec<PartitionLoadsBody> {
        let mut out = Vec::new();
        for entry in self.registry.partitions() {
            let p = &entry.partition;
            let key = p.key();
            if !f.matches(&key.model, &key.routing_group) {
                continue;
            }
            let loads = p.bookings().loads();
            let mut ranks = Vec::new();
            for w in p.workers().iter() {
                for rank in w.ranks() {
                    let l = loads.get(rank);
                    ranks.push(RankLoadBody {
                        worker_id: rank.worker_id,
                        dp_rank: rank.dp_rank,
                        potential_prefill_tokens: l.active_prefill_tokens,
                        potential_decode_blocks: l.active_decode_blocks,
                        active_requests: l.active_requests,
                    });
                }
            }
            out.push(PartitionLoadsBody {
                model_name: key.model.clone(),
                routing_group: key.routing_group.clone(),
                loads: ranks,
                pending_count: 0,
                pending_isl_tokens: 0,
            });
        }
        out
    }
}

pub async fn metrics(State(app): State<Arc<App>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.encode(),
    )
}
