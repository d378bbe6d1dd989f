//! `/replica_sync/*`: the peers whose bookings this replica applies, as Dynamo's service
//! answers them (201 new, 200 known, 404 "peer not found", 400 a bad endpoint, 409 when
//! replica sync is off).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;

use crate::error::{ApiError, Body};
use crate::wire::select::{StatusOk, OK};
use crate::App;

/// The body of `register_peer` and `deregister_peer`.
#[derive(Debug, Deserialize)]
pub struct PeerBody {
    pub endpoint: String,
}

/// `GET /replica_sync/peers`: sorted; empty when replica sync is off.
pub async fn peers(State(app): State<Arc<App>>) -> Json<Vec<String>> {
    Json(app.replica_peers())
}

/// `POST /replica_sync/register_peer`.
pub async fn register(
    State(app): State<Arc<App>>,
    Body(b): Body<PeerBody>,
) -> Result<(StatusCode, Json<StatusOk>), ApiError> {
    let new = app.register_replica_peer(&b.endpoint)?;
    let status = if new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(OK)))
}

/// `POST /replica_sync/deregister_peer`.
pub async fn deregister(
    State(app): State<Arc<App>>,
    Body(b): Body<PeerBody>,
) -> Result<Json<StatusOk>, ApiError> {
    if app.deregister_replica_peer(&b.endpoint)? {
        Ok(Json(OK))
    } else {
        Err(ApiError::not_found("peer not found"))
    }
}

impl crate::error::WireBody for PeerBody {
    type Fast = PeerBody;
}
