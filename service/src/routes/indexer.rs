//! The standalone indexer's routes (Dynamo's `python -m dynamo.indexer`), served by
//! `kvr serve` beside the selection routes, or alone with `--indexer-only`:
//! `POST /query_tiered_by_hash` (REFERENCE.md §7's tiered shape), `POST /query_by_hash`
//! (1.6.1's shape), and `GET /dump` for both (peer recovery).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvr::TieredScores;
use kvr_remote::{
    InstanceOverlap, QueryByHashResponse, QueryTieredByHashRequest, QueryTieredByHashResponse,
};

use crate::error::ApiError;
use crate::registry::PartitionEntry;
use crate::wire::dump::{partition_dump, partition_name, Dump};
use crate::App;

/// `GET /dump`: every partition's index as Dynamo's events.
pub async fn dump(State(app): State<Arc<App>>) -> Json<Dump> {
    Json(app.dump())
}

impl App {
    /// `GET /dump` without HTTP (also the Python bindings' `indexer_snapshot`).
    pub fn dump(&self) -> Dump {
        let mut out = Dump::new();
        for entry in self.registry.partitions() {
            let p = &entry.partition;
            let d = p.dump_index();
            if d.skipped_blocks > 0 {
                tracing::debug!(partition = %partition_name(p.key()), skipped = d.skipped_blocks, "dump left out blocks it cannot re-create");
            }
            out.insert(partition_name(p.key()), partition_dump(p.block_size(), &d));
        }
        out
    }
}

/// A tiered query's partition and scores; errors in the indexer's words.
fn query(
    app: &App,
    body: &[u8],
) -> Result<(Arc<PartitionEntry>, Vec<u64>, TieredScores), Box<Response>> {
    let req: Result<_, Response> = QueryTieredByHashRequest::from_json(body).map_err(|e| {
        crate::error::count_bad_body();
        let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
        (
            status,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            e.body(),
        )
            .into_response()
    });
    let req = req.map_err(Box::new)?;
    let key = req.partition_key();
    let entry: Result<_, Response> = app.registry.partition(&key).ok_or_else(|| {
        ApiError::not_found(format!(
            "no indexer for model={} routing_group={}",
            key.model, key.routing_group
        ))
        .into_response()
    });
    let entry = entry.map_err(Box::new)?;
    let local = req.local_hashes();
    let mut scores = TieredScores::new();
    entry.partition.overlap(&local, &mut scores);
    Ok((entry, local, scores))
}

/// `POST /query_tiered_by_hash`.
pub async fn query_tiered_by_hash(State(app): State<Arc<App>>, body: Bytes) -> Response {
    match query(&app, &body) {
        Ok((entry, _, scores)) => Json(QueryTieredByHashResponse::from_scores(
            &scores,
            entry.partition.block_size(),
        ))
        .into_response(),
        Err(r) => *r,
    }
}

/// `POST /query_by_hash` (Dynamo 1.6.1's indexer): device tokens per worker and rank, and
/// per worker the cumulative device/host/disk match of its best rank.
pub async fn query_by_hash(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let (entry, _, scores) = match query(&app, &body) {
        Ok(q) => q,
        Err(r) => return *r,
    };
    let bs = u64::from(entry.partition.block_size());
    let mut out = QueryByHashResponse::default();
    let mut best: BTreeMap<u64, InstanceOverlap> = BTreeMap::new();
    for o in scores.iter() {
        let w = o.rank.worker_id;
        let dev = u64::from(o.device) * bs;
        out.scores.entry(w).or_default().insert(o.rank.dp_rank, dev);
        let inst = best.entry(w).or_default();
        inst.dp.insert(o.rank.dp_rank, dev);
        let cpu = dev + u64::from(o.host) * bs;
        let disk = cpu + u64::from(o.disk) * bs;
        if disk > inst.disk || (disk == inst.disk && dev > inst.gpu) {
            inst.gpu = dev;
            inst.cpu = cpu;
            inst.disk = disk;
            inst.longest_matched = disk;
        }
    }
    out.instances = best;
    Json(out).into_response()
}
