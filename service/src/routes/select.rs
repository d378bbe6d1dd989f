//! `POST /select`, `/select_and_reserve`, `/potential_loads` and `/overlap_scores`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::Json;
use kvr::cost::CostOverrides;
use kvr::hash::{sequence_hashes, BlockHasher, HashSalt};
use kvr::index::TieredScores;
use kvr::{Decision, EngineError, Outcome, PartitionKey, RankId, SessionContext, WorkerId};

use crate::error::{ApiError, Body};
use crate::ids::NameError;
use crate::metrics::SelectionOutcome;
use crate::pending::Pending;
use crate::registry::PartitionEntry;
use crate::wire::prompt::{wire_hash, PromptBody, ResolvedPrompt};
use crate::wire::select::{
    OverlapBody, OverlapScoresBody, RankLoadBody, RankOverlapBody, SelectRequest as SelectBody,
    SelectResponse, SharedCacheBody,
};
use crate::App;

/// A request brought to the engine's terms.
pub(crate) struct Prepared {
    pub entry: Arc<PartitionEntry>,
    pub key: PartitionKey,
    /// The prompt's length in tokens.
    pub prompt_tokens: u64,
    /// Local hashes of the prompt's complete blocks (computed here once, for the engine
    /// and for the answer's overlap).
    pub local: Vec<u64>,
    pub allowed: Option<Vec<WorkerId>>,
}

pub(crate) fn no_schedulable(key: &PartitionKey) -> ApiError {
    ApiError::unavailable(format!(
        "no schedulable workers for model={} routing_group={}",
        key.model, key.routing_group
    ))
}

/// The hash salt of a request: the partition's namespace, the LoRA adapter, and the
/// request's `cache_salt` (mixed into the namespace, so a salted prompt matches only
/// blocks published under the same salt: none, as engines' events do not carry it — no
/// overlap rather than a wrong one, as Dynamo answers).
pub(crate) fn salt_of(entry: &PartitionEntry, prompt: &PromptBody) -> HashSalt {
    let ns = entry.partition.config().cache_namespace.as_deref();
    match prompt.cache_salt.as_deref().filter(|s| !s.is_empty()) {
        None => HashSalt::new(prompt.lora_name.as_deref(), ns),
        Some(salt) => {
            let salted = format!("{}\u{1f}cache_salt\u{1f}{salt}", ns.unwrap_or(""));
            HashSalt::new(prompt.lora_name.as_deref(), Some(&salted))
        }
    }
}

impl App {
    pub(crate) fn prepare(
        &self,
        model: &str,
        group: &str,
        prompt: &PromptBody,
        allowed: Option<&[u64]>,
    ) -> Result<Prepared, ApiError> {
        let key = PartitionKey::new(model, group);
        if self.registry.is_empty() {
            return Err(ApiError::unavailable(
                "no schedulable workers are available",
            ));
        }
        let entry = self
            .registry
            .partition(&key)
            .ok_or_else(|| no_schedulable(&key))?;
        if entry.schedulable_count == 0 {
            return Err(no_schedulable(&key));
        }
        if !prompt.is_present() {
            return Err(if prompt.block_hashes.is_none() {
                ApiError::bad_request("block_hashes is required without token_ids")
            } else {
                ApiError::bad_request("sequence_hashes is required without token_ids")
            });
        }
        let bs = entry.partition.block_size();
        let salt = salt_of(&entry, prompt);
        let (local, prompt_tokens) = match prompt.resolve(bs, salt)? {
            ResolvedPrompt::LocalHashes {
                hashes,
                prompt_tokens,
            } => (hashes, prompt_tokens),
            ResolvedPrompt::Tokens(t) => {
                let mut local = Vec::new();
                BlockHasher::new(bs as usize, salt)
                    .map_err(|e| ApiError::internal(e.to_string()))?
                    .local_hashes(&t, &mut local);
                (local, t.len() as u64)
            }
        };
        let allowed = match allowed {
            None => None,
            Some(a) => {
                let v: Vec<WorkerId> = a
                    .iter()
                    .copied()
                    .filter(|&w| entry.is_schedulable(w))
                    .collect();
                if v.is_empty() {
                    return Err(ApiError::unavailable(
                        "no endpoints available to route work",
                    ));
                }
                Some(v)
            }
        };
        Ok(Prepared {
            entry,
            key,
            prompt_tokens,
            local,
            allowed,
        })
    }

    /// The device/host/disk overlap of every rank, for the answer.
    fn tiered(&self, prep: &Prepared) -> TieredScores {
        let mut scores = TieredScores::new();
        prep.entry.partition.overlap(&prep.local, &mut scores);
        scores
    }

    pub(crate) fn answer(
        &self,
        prep: &Prepared,
        d: &Decision,
        selection_id: Option<String>,
        booked: bool,
        track_prefill: bool,
        advisory: bool,
    ) -> SelectResponse {
        let p = &prep.entry.partition;
        let bs = u64::from(p.block_size());
        let worker = d.rank.worker_id;
        let ranks: Vec<RankId> = p
            .workers()
            .get(worker)
            .map(|w| w.ranks().collect())
            .unwrap_or_else(|| vec![d.rank]);
        // One rank: its overlap is the decision's (no second index lookup).
        let scores = (ranks.len() > 1).then(|| self.tiered(prep));
        let dp = ranks
            .into_iter()
            .map(|r| {
                let dev = match &scores {
                    Some(s) => s.get(r).map_or(0, |o| o.device),
                    None => d.overlap.device_blocks,
                };
                (r.dp_rank.to_string(), u64::from(dev) * bs)
            })
            .collect();
        let o = &d.overlap;
        let gpu = u64::from(o.device_blocks) * bs;
        let cpu = gpu + u64::from(o.host_blocks) * bs;
        let disk = cpu + u64::from(o.disk_blocks) * bs;
        let longest = disk;
        let isl = prep.prompt_tokens;
        let cost = &p.config().cost;
        let cached = gpu as f64
            + cost.host_cache_hit_weight * (u64::from(o.host_blocks) * bs) as f64
            + cost.disk_cache_hit_weight * (u64::from(o.disk_blocks) * bs) as f64;
        let effective = (isl as f64 - cached).max(0.0).round() as u64;
        SelectResponse {
            selection_id,
            sequence_hashes: booked.then(|| {
                sequence_hashes(&prep.local)
                    .into_iter()
                    .map(wire_hash)
                    .collect()
            }),
            isl_tokens: booked.then_some(isl),
            track_prefill_tokens: booked.then_some(track_prefill),
            model_name: prep.key.model.clone(),
            routing_group: prep.key.routing_group.clone(),
            worker_id: worker,
            dp_rank: d.rank.dp_rank,
            endpoint: prep.entry.endpoints.get(&worker).cloned().flatten(),
            block_size: p.block_size(),
            overlap: OverlapBody {
                longest_matched: longest,
                gpu,
                dp,
                cpu,
                disk,
            },
            effective_prefill_tokens: effective,
            // The rank's decode blocks with this request on it, counting the partial last
            // block as Dynamo does (kvr counts a prompt block the rank already has active
            // once, as Dynamo's own `/loads` does; Dynamo's projection counts it again).
            potential_decode_blocks: d.projected_decode_blocks + u64::from(isl % bs.max(1) != 0),
            worker_load: advisory.then(|| {
                let info = p.workers().get(worker).cloned();
                crate::wire::select::WorkerLoadBody {
                    active_prefill_tokens: p.bookings().rank_load(d.rank).active_prefill_tokens,
                    prefill_token_capacity: crate::wire::select::DEFAULT_PREFILL_TOKEN_CAPACITY,
                    total_kv_blocks: info.map(|i| i.total_kv_blocks).filter(|&n| n > 0),
                }
            }),
            kv_hint: d.kv_hint.as_ref().map(|h| crate::wire::select::KvHintBody {
                source_worker_id: h.source.worker_id,
                source_dp_rank: h.source.dp_rank,
                source_control_endpoint: h.control_endpoint.clone(),
                start_block: h.block_range.0,
                hinted_blocks: h.block_range.1.saturating_sub(h.block_range.0),
            }),
        }
    }

    fn count(&self, prep: &Prepared, d: &Decision, booked: bool) {
        let m = &self.metrics;
        m.selection(if booked {
            SelectionOutcome::Booked
        } else {
            SelectionOutcome::Selected
        });
        m.prompt_tokens.inc_by(prep.prompt_tokens);
        m.cached_tokens.inc_by(d.cached_tokens);
    }
}

/// The rank a request pins (`pinned_worker` with a `dp_rank`), if it is a rank of a
/// schedulable member. The engine pins workers; a pinned rank is served here.
fn pinned_rank(prep: &Prepared, b: &SelectBody) -> Option<RankId> {
    let pin = b.pinned_worker?;
    let dp = pin.dp_rank?;
    let w = prep.entry.partition.workers().get(pin.worker_id).cloned()?;
    (prep.entry.is_schedulable(pin.worker_id) && w.has_rank(dp))
        .then(|| RankId::new(pin.worker_id, dp))
}

/// The decision an advisory selection pinned to `rank` amounts to: its overlap and the
/// load this prompt would add there.
fn pinned_decision(app: &App, prep: &Prepared, rank: RankId) -> Decision {
    let p = &prep.entry.partition;
    let scores = app.tiered(prep);
    let o = scores.get(rank);
    let (device, host, disk) = o.map_or((0, 0, 0), |o| (o.device, o.host, o.disk));
    let isl = prep.prompt_tokens;
    let cached = (u64::from(device) * u64::from(p.block_size())).min(isl);
    let loads = p.bookings().loads();
    let seq = sequence_hashes(&prep.local);
    Decision {
        rank,
        selection_id: None,
        overlap: kvr::select::Overlap {
            device_blocks: device,
            host_blocks: host,
            disk_blocks: disk,
            shared_blocks: 0,
        },
        cached_tokens: cached,
        projected_prefill_tokens: isl - cached,
        projected_decode_blocks: loads.get(rank).active_decode_blocks
            + loads.new_blocks_not_active(rank, &seq),
        cost: 0.0,
        session: None,
        session_route: None,
        kv_hint: None,
    }
}

/// The engine request of a prepared body.
pub(crate) fn engine_request<'a>(
    prep: &'a Prepared,
    b: &'a SelectBody,
    session: &'a Option<SessionContext>,
) -> kvr::SelectRequest<'a> {
    let mut req = kvr::SelectRequest::local_hashes(&prep.local, prep.prompt_tokens);
    req.lora_name = b.prompt.lora_name.as_deref();
    req.allowed_workers = prep.allowed.as_deref();
    req.pinned_worker = b.pinned_worker.map(|p| p.worker_id);
    req.session = session.clone();
    req.legacy_session_id = b.session_id.as_deref();
    req.expected_output_tokens = b.expected_output_tokens.unwrap_or(0);
    if let Some(o) = &b.router_config_override {
        req.overrides = CostOverrides {
            overlap_score_credit: o.overlap_score_credit,
            prefill_load_scale: o.prefill_load_scale,
            temperature: o.router_temperature,
            shared_cache_multiplier: o.shared_cache_multiplier,
        };
    }
    req
}

fn session_of(b: &SelectBody) -> Option<SessionContext> {
    b.session_context.as_ref().map(|s| SessionContext {
        session_id: s.session_id.clone(),
        parent_session_id: s.parent_session_id.clone(),
        session_final: s.session_final,
        input_trigger: s.input_trigger.map(|t| t.as_str().to_string()),
    })
}

pub(crate) fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::DuplicateSelectionId(_) => {
            ApiError::conflict("selection is already reserved or being reserved")
        }
        EngineError::UnknownSelectionId(id) => {
            ApiError::not_found(format!("reservation {id} not found"))
        }
        EngineError::UnknownPartition(k) => no_schedulable(&k),
        EngineError::UnknownRank(r) => ApiError::not_found(format!("rank {r} not found")),
        other => ApiError::bad_request(other.to_string()),
    }
}

fn outcome_error(app: &App, key: &PartitionKey, o: &Outcome) -> ApiError {
    match o {
        Outcome::Busy => {
            app.metrics.selection(SelectionOutcome::Busy);
            ApiError::new(
                axum::http::StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "all workers are busy for model={} routing_group={}",
                    key.model, key.routing_group
                ),
            )
        }
        _ => {
            app.metrics.selection(SelectionOutcome::NoWorker);
            no_schedulable(key)
        }
    }
}

/// `POST /select`: the decision and projected load, nothing booked. With a
/// `selection_id` (and not `advisory`), the decision waits in the pending-selection cache
/// for its claim (`POST /reservations`).
pub async fn select(
    State(app): State<Arc<App>>,
    Body(b): Body<SelectBody>,
) -> Result<Json<SelectResponse>, ApiError> {
    let prep = app.prepare(
        &b.model_name,
        &b.routing_group,
        &b.prompt,
        b.allowed_worker_ids.as_deref(),
    )?;
    let session = session_of(&b);
    let req = engine_request(&prep, &b, &session);
    let outcome = match pinned_rank(&prep, &b) {
        Some(rank) => Outcome::Selected(pinned_decision(&app, &prep, rank)),
        None => app
            .engine
            .select_in(&prep.entry.partition, &req)
            .map_err(engine_error)?,
    };
    let Outcome::Selected(d) = &outcome else {
        return Err(outcome_error(&app, &prep.key, &outcome));
    };
    app.count(&prep, d, false);
    if let (Some(id), false) = (&b.selection_id, b.advisory.unwrap_or(false)) {
        app.pending.insert(
            id,
            Pending {
                key: prep.key.clone(),
                rank: d.rank,
                prompt: ResolvedPrompt::LocalHashes {
                    hashes: prep.local.clone(),
                    prompt_tokens: prep.prompt_tokens,
                },
                lora_name: b.prompt.lora_name.clone(),
                expected_output_tokens: b.expected_output_tokens.unwrap_or(0),
            },
            Instant::now(),
        );
    }
    let advisory = b.advisory.unwrap_or(false);
    Ok(Json(app.answer(
        &prep,
        d,
        b.selection_id.clone(),
        false,
        true,
        advisory,
    )))
}

/// `POST /select_and_reserve`: the decision, booked on the chosen rank before answering.
pub async fn select_and_reserve(
    State(app): State<Arc<App>>,
    Body(b): Body<SelectBody>,
) -> Result<Json<SelectResponse>, ApiError> {
    let prep = app.prepare(
        &b.model_name,
        &b.routing_group,
        &b.prompt,
        b.allowed_worker_ids.as_deref(),
    )?;
    let session = session_of(&b);
    let mut req = engine_request(&prep, &b, &session);
    let named = match &b.selection_id {
        Some(s) => Some(app.name_new(s, &prep.key)?),
        None => None,
    };
    req.selection_id = named;
    let result = match pinned_rank(&prep, &b) {
        Some(rank) => app
            .engine
            .reserve_in(&prep.entry.partition, rank, Some(&req), None, named)
            .map(Outcome::Selected),
        None => app
            .engine
            .select_and_reserve_in(&prep.entry.partition, &req),
    };
    let outcome = match result {
        Ok(o) => o,
        Err(e) => {
            if let Some(s) = &b.selection_id {
                app.ids.forget(s);
            }
            app.metrics.selection(SelectionOutcome::Error);
            return Err(engine_error(e));
        }
    };
    let Outcome::Selected(d) = &outcome else {
        if let Some(s) = &b.selection_id {
            app.ids.forget(s);
        }
        return Err(outcome_error(&app, &prep.key, &outcome));
    };
    let id = d.selection_id.unwrap_or(0);
    let track = b
        .router_config_override
        .as_ref()
        .and_then(|o| o.track_prefill_tokens)
        .unwrap_or(app.args.knobs.router_track_prefill_tokens);
    if !track {
        // Untracked prefill: the booking carries decode blocks only.
        let _ = app.engine.mark_prefill_complete(id);
    }
    app.count(&prep, d, true);
    let wire_id = b.selection_id.clone().unwrap_or_else(|| app.ids.render(id));
    Ok(Json(app.answer(
        &prep,
        d,
        Some(wire_id),
        true,
        track,
        false,
    )))
}

impl App {
    /// An engine number for a caller's new selection id; 409 if it names a live booking.
    pub(crate) fn name_new(&self, s: &str, key: &PartitionKey) -> Result<u64, ApiError> {
        // Dynamo books an empty id, which no `/reservations/{id}` route can then name (the
        // booking lingers until its TTL): refused here.
        if s.is_empty() {
            return Err(ApiError::bad_request("selection_id must not be empty"));
        }
        self.ids
            .name(s, key, || self.engine.mint_selection_id())
            .map_err(|e| match e {
                NameError::Taken => ApiError::conflict(format!(
                    "selection {s} is already reserved or being reserved"
                )),
                NameError::Full => ApiError::new(
                    axum::http::StatusCode::TOO_MANY_REQUESTS,
                    "too many caller-named selections are live",
                ),
            })
    }
}

/// `POST /potential_loads`: every schedulable rank's load if this prompt were booked there.
pub async fn potential_loads(
    State(app): State<Arc<App>>,
    Body(b): Body<SelectBody>,
) -> Result<Json<Vec<RankLoadBody>>, ApiError> {
    let prep = app.prepare(
        &b.model_name,
        &b.routing_group,
        &b.prompt,
        b.allowed_worker_ids.as_deref(),
    )?;
    let p = &prep.entry.partition;
    let scores = app.tiered(&prep);
    let seq = sequence_hashes(&prep.local);
    let loads = p.bookings().loads();
    let bs = u64::from(p.block_size());
    let cost = &p.config().cost;
    let isl = prep.prompt_tokens;
    let mut out = Vec::new();
    for w in p
        .workers()
        .iter()
        .filter(|w| prep.entry.is_schedulable(w.worker_id))
    {
        for rank in w.ranks() {
            let active = loads.get(rank);
            let o = scores.get(rank);
            let cached = o.map_or(0.0, |o| {
                (u64::from(o.device) * bs) as f64
                    + cost.host_cache_hit_weight * (u64::from(o.host) * bs) as f64
                    + cost.disk_cache_hit_weight * (u64::from(o.disk) * bs) as f64
            });
            let effective = (isl as f64 - cached).max(0.0).round() as u64;
            out.push(RankLoadBody {
                worker_id: rank.worker_id,
                dp_rank: rank.dp_rank,
                potential_prefill_tokens: active.active_prefill_tokens + effective,
                // Blocks already active on the rank count once (as Dynamo's do here).
                potential_decode_blocks: active.active_decode_blocks
                    + loads.new_blocks_not_active(rank, &seq)
                    + u64::from(isl % bs.max(1) != 0),
                active_requests: active.active_requests,
            });
        }
    }
    Ok(Json(out))
}

/// `POST /overlap_scores`: every member rank's tiered overlap with the prompt.
pub async fn overlap_scores(
    State(app): State<Arc<App>>,
    Body(b): Body<SelectBody>,
) -> Result<Json<OverlapScoresBody>, ApiError> {
    let prep = app.prepare(&b.model_name, &b.routing_group, &b.prompt, None)?;
    let p = &prep.entry.partition;
    let scores = app.tiered(&prep);
    let mut workers = Vec::new();
    for w in p.workers().iter() {
        for rank in w.ranks() {
            let o = scores.get(rank);
            let (dev, host, disk) = o.map_or((0, 0, 0), |o| (o.device, o.host, o.disk));
            workers.push(RankOverlapBody {
                worker_id: rank.worker_id,
                dp_rank: rank.dp_rank,
                device_blocks: dev,
                host_pinned_blocks: dev + host,
                disk_blocks: dev + host + disk,
                host_pinned_extension_blocks: host,
                disk_extension_blocks: disk,
                shared_beyond_device_blocks: None,
            });
        }
    }
    Ok(Json(OverlapScoresBody {
        block_size: p.block_size(),
        num_blocks: prep.local.len() as u64,
        workers,
        shared_cache: SharedCacheBody::default(),
    }))
}
