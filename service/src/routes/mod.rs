//! The HTTP routes, Dynamo 1.6.1's paths (REFERENCE.md §7).

pub mod indexer;
pub mod replicas;
pub mod reservations;
pub mod select;
pub mod workers;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{delete, get, patch, post};
use axum::Router;

use crate::App;

/// Every route of the selection service (and the indexer's), or with `--indexer-only`
/// the indexer's alone.
pub fn router(app: Arc<App>) -> Router {
    let limit = app.args.max_body_bytes;
    let indexer = Router::new()
        .route("/dump", get(indexer::dump))
        .route("/query_tiered_by_hash", post(indexer::query_tiered_by_hash))
        .route("/query_by_hash", post(indexer::query_by_hash))
        .route("/workers", post(workers::upsert).get(workers::list))
        .route("/health", get(workers::health))
        .route("/metrics", get(workers::metrics));
    if app.args.indexer_only {
        return finish(indexer, app, limit);
    }
    let selection = Router::new()
        .route(
            "/workers/{id}",
            patch(workers::patch).delete(workers::remove),
        )
        .route("/select", post(select::select))
        .route("/select_and_reserve", post(select::select_and_reserve))
        .route("/potential_loads", post(select::potential_loads))
        .route("/overlap_scores", post(select::overlap_scores))
        .route("/reservations", post(reservations::reserve))
        .route(
            "/reservations/{id}/prefill_complete",
            post(reservations::prefill_complete),
        )
        .route(
            "/reservations/{id}/output_block",
            post(reservations::output_block),
        )
        .route("/reservations/{id}", delete(reservations::free))
        .route("/ready", get(workers::ready))
        .route("/loads", get(workers::loads))
        .route("/replica_sync/peers", get(replicas::peers))
        .route("/replica_sync/register_peer", post(replicas::register))
        .route("/replica_sync/deregister_peer", post(replicas::deregister));
    finish(indexer.merge(selection), app, limit)
}

/// The fallbacks, metrics middleware and body limit every route shares.
fn finish(routes: Router<Arc<App>>, app: Arc<App>, limit: usize) -> Router {
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(app.clone(), track))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(app)
}

/// Middleware: counts and times every request by its route template.
async fn track(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let matched = req.extensions().get::<MatchedPath>();
    let route = matched.map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let detail = (matched.is_none()).then(|| format!("{} {}", req.method(), req.uri().path()));
    let start = Instant::now();
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    if let Some(why) = crate::refusals::Refusal::of_status(status, detail.is_none()) {
        app.metrics
            .refusals
            .count(why, detail.as_deref().unwrap_or(&route));
    }
    app.metrics.request(route, status, start.elapsed());
    resp
}

async fn not_found() -> crate::error::ApiError {
    crate::error::ApiError::not_found("route not found")
}

async fn method_not_allowed() -> crate::error::ApiError {
    crate::error::ApiError::new(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        "method not allowed",
    )
}
