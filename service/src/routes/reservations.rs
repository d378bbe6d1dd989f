//! `POST /reservations` (claim a pending selection, or book an explicit one),
//! `POST /reservations/{id}/prefill_complete`, `/output_block`, `DELETE /reservations/{id}`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use kvr::{EngineError, PartitionKey, RankId};

use crate::error::{ApiError, Body};
use crate::registry::PartitionEntry;
use crate::routes::select::{engine_error, no_schedulable};
use crate::wire::select::{
    OutputBlockBody, ReservationRequest as ReservationBody, ReservationResponse, StatusOk, OK,
};
use crate::App;

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("reservation {id} not found"))
}

/// `POST /reservations`.
pub async fn reserve(
    State(app): State<Arc<App>>,
    Body(b): Body<ReservationBody>,
) -> Result<(StatusCode, Json<ReservationResponse>), ApiError> {
    Ok((StatusCode::CREATED, Json(app.reserve(&b)?)))
}

/// Dynamo's words for a rank its worker does not have.
fn unknown_rank(r: RankId) -> ApiError {
    ApiError::not_found(format!(
        "Worker WorkerWithDpRank {{ worker_id: {}, dp_rank: {} }} not found",
        r.worker_id, r.dp_rank
    ))
}

/// Books `req` on `rank` under the caller's selection id and answers it; a refusal frees
/// the id again.
fn book(
    app: &App,
    b: &ReservationBody,
    entry: &PartitionEntry,
    rank: RankId,
    req: &kvr::SelectRequest<'_>,
    prefill_tokens: Option<u64>,
    unknown: impl FnOnce(RankId) -> ApiError,
) -> Result<ReservationResponse, ApiError> {
    let key = entry.partition.key();
    let id = app.name_new(&b.selection_id, key)?;
    match app
        .engine
        .reserve(&entry.partition, rank, Some(req), prefill_tokens, Some(id))
    {
        Ok(d) => {
            // A claimed selection announces the prefill it booked; an explicit booking
            // (`prefill_tokens` given) none, and no output length (as Dynamo sends them).
            let claimed = prefill_tokens.is_none();
            let booked_prefill = entry
                .partition
                .bookings()
                .get(id)
                .map_or(0, |v| v.prefill_tokens);
            app.publish_booked(
                &entry.partition,
                id,
                &b.selection_id,
                claimed.then_some((booked_prefill, true)),
                claimed.then_some(req.expected_output_tokens),
                req.lora_name,
            );
            Ok(ReservationResponse {
                selection_id: b.selection_id.clone(),
                model_name: key.model.clone(),
                routing_group: key.routing_group.clone(),
                worker_id: d.rank.worker_id,
                dp_rank: d.rank.dp_rank,
                endpoint: entry.endpoints.get(&d.rank.worker_id).cloned().flatten(),
            })
        }
        Err(e) => {
            app.ids.forget(&b.selection_id);
            Err(match e {
                EngineError::UnknownRank(r) => unknown(r),
                other => engine_error(other),
            })
        }
    }
}

fn claim(
    app: &App,
    b: &ReservationBody,
    key: &PartitionKey,
) -> Result<ReservationResponse, ApiError> {
    let missing = || {
        ApiError::not_found(format!(
            "no pending selection {} for model={} routing_group={} (expired, already used, or never selected)",
            b.selection_id, key.model, key.routing_group
        ))
    };
    let entry = app.registry.partition(key).ok_or_else(missing)?;
    let pending = app
        .pending
        .take(&b.selection_id, key, Instant::now())
        .ok_or_else(missing)?;
    let mut req = pending.prompt.request();
    req.lora_name = pending.lora_name.as_deref();
    req.expected_output_tokens = pending.expected_output_tokens;
    // The chosen worker may have left between the selection and its claim.
    book(app, b, &entry, pending.rank, &req, None, |_| missing())
}

fn explicit(
    app: &App,
    b: &ReservationBody,
    key: &PartitionKey,
    worker: u64,
) -> Result<ReservationResponse, ApiError> {
    let entry = app
        .registry
        .partition(key)
        .ok_or_else(|| no_schedulable(key))?;
    if !entry.is_schedulable(worker) {
        return Err(ApiError::not_found(format!(
            "schedulable worker {worker} not found for model={} routing_group={}",
            key.model, key.routing_group
        )));
    }
    let rank = RankId::new(worker, b.dp_rank.unwrap_or(0));
    let in_worker = entry
        .partition
        .workers()
        .get(worker)
        .is_some_and(|w| w.has_rank(rank.dp_rank));
    if !in_worker {
        return Err(unknown_rank(rank));
    }
    if b.prompt.token_ids.is_none() && b.prompt.sequence_hashes.is_none() {
        return Err(ApiError::bad_request(
            "sequence_hashes is required without token_ids",
        ));
    }
    let salt = crate::routes::select::salt_of(&entry, &b.prompt);
    let prompt = b.prompt.resolve(entry.partition.block_size(), salt)?;
    // An explicit booking replaces any pending selection of its id (a later claim: 404).
    let _ = app.pending.take(&b.selection_id, key, Instant::now());
    let mut req = prompt.request();
    req.lora_name = b.prompt.lora_name.as_deref();
    req.expected_output_tokens = b.expected_output_tokens.unwrap_or(0);
    // Explicit bookings add no prefill tokens (Dynamo's rule: the caller chose the rank,
    // and prefill accounting follows the router's own selections).
    book(app, b, &entry, rank, &req, Some(0), unknown_rank)
}

fn lookup(app: &App, id: &str) -> Result<u64, ApiError> {
    app.ids.lookup(id).ok_or_else(|| not_found(id))
}

fn lifecycle_error(id: &str, e: EngineError) -> ApiError {
    match e {
        EngineError::UnknownSelectionId(_) => not_found(id),
        other => engine_error(other),
    }
}

/// `POST /reservations/{id}/prefill_complete`.
pub async fn prefill_complete(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Json<StatusOk>, ApiError> {
    app.prefill_complete(&id)?;
    Ok(Json(OK))
}

/// `POST /reservations/{id}/output_block`: one more output block (decode load).
pub async fn output_block(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    Body(b): Body<OutputBlockBody>,
) -> Result<Json<StatusOk>, ApiError> {
    app.output_block(&id, b.decay_fraction)?;
    Ok(Json(OK))
}

/// `DELETE /reservations/{id}`: the booking ends; everything it added leaves the load.
pub async fn free(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Json<StatusOk>, ApiError> {
    app.free(&id)?;
    Ok(Json(OK))
}

/// The booking operations without HTTP (the routes' core, also the Python bindings').
impl App {
    /// `POST /reservations`: claims a pending selection, or books an explicit one.
    pub fn reserve(&self, b: &ReservationBody) -> Result<ReservationResponse, ApiError> {
        let key = PartitionKey::new(b.model_name.clone(), b.routing_group.clone());
        match b.worker_id {
            None => claim(self, b, &key),
            Some(worker) => explicit(self, b, &key, worker),
        }
    }

    /// `POST /reservations/{id}/prefill_complete`.
    pub fn prefill_complete(&self, id: &str) -> Result<(), ApiError> {
        let n = lookup(self, id)?;
        let booking = self.engine.booking(n);
        let first = booking.as_ref().is_some_and(|(_, v)| !v.prefill_complete);
        self.engine
            .mark_prefill_complete(n)
            .map_err(|e| lifecycle_error(id, e))?;
        if first {
            self.publish_lifecycle(id, booking, kvr_replica::EventData::PrefillComplete);
        }
        Ok(())
    }

    /// `POST /reservations/{id}/output_block`: `decay_fraction` must be in [0, 1]; kvr
    /// checks it and books a whole block (Dynamo scales the booking's decode blocks by it,
    /// which kvr does not: see the compatibility notes).
    pub fn output_block(&self, id: &str, decay_fraction: Option<f64>) -> Result<(), ApiError> {
        if let Some(f) = decay_fraction {
            if !(0.0..=1.0).contains(&f) {
                return Err(ApiError::bad_request(
                    "decay_fraction must be between 0.0 and 1.0",
                ));
            }
        }
        let n = lookup(self, id)?;
        self.engine
            .add_output_blocks(n, 1)
            .map_err(|e| lifecycle_error(id, e))
    }

    /// `DELETE /reservations/{id}`.
    pub fn free(&self, id: &str) -> Result<(), ApiError> {
        let n = lookup(self, id)?;
        let booking = self.engine.booking(n);
        let r = self.engine.free(n);
        self.ids.forget(id);
        match r.map_err(|e| lifecycle_error(id, e))? {
            kvr::FreeOutcome::Freed(_) => {
                self.publish_lifecycle(id, booking, kvr_replica::EventData::Free);
                Ok(())
            }
            // Freed before, or ended with its worker: Dynamo answers 404 for both.
            _ => Err(not_found(id)),
        }
    }
}
