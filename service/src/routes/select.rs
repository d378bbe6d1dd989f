//! `POST /select`, `/select_and_reserve`, `/potential_loads` and `/overlap_scores`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::Json;
use kvr::hash::{sequence_hashes, HashSalt};
use kvr::CostOverrides;
use kvr::TieredScores;
use kvr::{Decision, EngineError, Outcome, PartitionKey, RankId, SessionContext, WorkerId};

use crate::error::{ApiError, Body};
use crate::ids::NameError;
use crate::metrics::SelectionOutcome;
use crate::pending::Pending;
use crate::registry::PartitionEntry;
use crate::wire::prompt::{PromptBody, ResolvedPrompt};
use crate::wire::select::{
    OverlapBody, OverlapScoresBody, RankLoadBody, RankOverlapBody, SelectRequest as SelectBody,
    SelectResponse, SharedCacheBody,
};
use crate::App;

/// A request brought to the engine's terms.
pub(crate) struct Prepared {
    pub entry: Arc<PartitionEntry>,
    pub key: PartitionKey,
    /// Its local block hashes, computed here once for the engine and for the answer.
    pub prompt: ResolvedPrompt,
    pub allowed: Option<Vec<WorkerId>>,
    /// The prompt's LoRA adapter (its hashes are salted with it).
    pub lora_name: Option<String>,
}

pub(crate) fn no_schedulable(key: &PartitionKey) -> ApiError {
    ApiError::unavailable(format!(
        "no schedulable workers for model={} routing_group={}",
        key.model, key.routing_group
    ))
}

/// The prompt tokens a rank would still prefill: the prompt less what it caches, a host
/// or disk block counting by its hit weight (Dynamo's `effective_prefill_tokens`).
fn effective_prefill(p: &kvr::Partition, isl: u64, device: u32, host: u32, disk: u32) -> u64 {
    let bs = u64::from(p.block_size()) as f64;
    let cost = &p.config().cost;
    let cached = f64::from(device) * bs
        + cost.host_cache_hit_weight * f64::from(host) * bs
        + cost.disk_cache_hit_weight * f64::from(disk) * bs;
    (isl as f64 - cached).max(0.0).round() as u64
}

/// The hash salt of a request: the partition's namespace and the LoRA adapter. (The
/// request's `cache_salt` is an extra key of block 0, folded by `PromptBody::resolve` as
/// engines fold vLLM's, so a salted prompt matches exactly the blocks published under the
/// same salt.)
pub(crate) fn salt_of(entry: &PartitionEntry, prompt: &PromptBody) -> HashSalt {
    let ns = entry.partition.config().cache_namespace.as_deref();
    HashSalt::new(prompt.lora_name.as_deref(), ns)
}

/// What an answer reports beyond the decision.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Answered {
    /// `/select`: with the chosen rank's `worker_load` when advisory.
    Selected { worker_load: bool },
    /// `/select_and_reserve`: the booking's sequence hashes, length and prefill tracking.
    Booked { track_prefill: bool },
}

impl App {
    /// Brings a request to the engine's terms; the prompt's tokens move into the
    /// [`Prepared`] (the body keeps the rest).
    pub(crate) fn prepare(
        &self,
        model: &str,
        group: &str,
        prompt: &mut PromptBody,
        allowed: Option<&[u64]>,
    ) -> Result<Prepared, ApiError> {
        let key = PartitionKey::new(model, group);
        let Some(entry) = self.registry.partition(&key) else {
            // Dynamo's words differ on a service with no workers at all (asked only here,
            // off the hot path: it takes the registry's lock).
            return Err(if self.registry.is_empty() {
                ApiError::unavailable("no schedulable workers are available")
            } else {
                no_schedulable(&key)
            });
        };
        if entry.schedulable_count() == 0 {
            return Err(no_schedulable(&key));
        }
        if !prompt.is_present() {
            return Err(if prompt.block_hashes.is_none() {
                ApiError::bad_request("block_hashes is required without token_ids")
            } else {
                ApiError::bad_request("sequence_hashes is required without token_ids")
            });
        }
        let salt = salt_of(&entry, prompt);
        let resolved = prompt.resolve_taking(entry.partition.block_size(), salt)?;
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
            prompt: resolved,
            allowed,
            lora_name: prompt.lora_name.clone(),
        })
    }

    /// The device/host/disk overlap of every rank, for the answer (its lookahead ranks
    /// matched through the prompt's tokens, when it came as tokens).
    fn tiered(&self, prep: &Prepared) -> TieredScores {
        let mut scores = TieredScores::new();
        let mut req = prep.prompt.request();
        req.lora_name = prep.lora_name.as_deref();
        prep.entry.partition.overlap_for(&req, &mut scores);
        scores
    }

    pub(crate) fn answer(
        &self,
        prep: &Prepared,
        d: &Decision,
        selection_id: Option<String>,
        how: Answered,
    ) -> SelectResponse {
        let (booked, track_prefill, advisory) = match how {
            Answered::Selected { worker_load } => (false, true, worker_load),
            Answered::Booked { track_prefill } => (true, track_prefill, false),
        };
        let p = &prep.entry.partition;
        let bs = u64::from(p.block_size());
        let worker = d.rank.worker_id;
        let workers = p.workers();
        let info = workers.get(worker);
        let ranks: Vec<RankId> = info.map_or_else(|| vec![d.rank], |w| w.ranks().collect());
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
        let isl = prep.prompt.prompt_tokens;
        let effective = effective_prefill(p, isl, o.device_blocks, o.host_blocks, o.disk_blocks);
        SelectResponse {
            selection_id,
            sequence_hashes: booked.then(|| {
                sequence_hashes(&prep.prompt.hashes)
                    .into_iter()
                    .map(kvr_remote::hash_to_wire)
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
            potential_decode_blocks: d.projected_decode_blocks
                + u64::from(!isl.is_multiple_of(bs.max(1))),
            worker_load: advisory.then(|| crate::wire::select::WorkerLoadBody {
                active_prefill_tokens: p.bookings().rank_load(d.rank).active_prefill_tokens,
                prefill_token_capacity: crate::wire::select::DEFAULT_PREFILL_TOKEN_CAPACITY,
                total_kv_blocks: info.map(|i| i.total_kv_blocks).filter(|&n| n > 0),
            }),
            kv_hint: d.kv_hint.as_ref().map(|h| crate::wire::select::KvHintBody {
                source_worker_id: h.source.worker_id,
                source_dp_rank: h.source.dp_rank,
                source_control_endpoint: h.control_endpoint.clone(),
                start_block: h.block_range.0,
                hinted_blocks: h.block_range.1.saturating_sub(h.block_range.0),
                block_hashes: h
                    .block_hashes
                    .iter()
                    .map(|&b| kvr_remote::hash_to_wire(b))
                    .collect(),
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
        m.prompt_tokens.inc_by(prep.prompt.prompt_tokens);
        m.cached_tokens.inc_by(d.cached_tokens);
    }
}

/// The engine request of a prepared body.
pub(crate) fn engine_request<'a>(prep: &'a Prepared, b: &'a SelectBody) -> kvr::SelectRequest<'a> {
    let mut req = prep.prompt.request();
    req.lora_name = b.prompt.lora_name.as_deref();
    req.allowed_workers = prep.allowed.as_deref();
    req.pinned_worker = b.pinned_worker.map(|p| p.worker_id);
    req.pinned_dp_rank = b.pinned_worker.map(|p| p.dp_rank);
    req.session = session_of(b);
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

impl App {
    /// [`App::prepare`] for a selection body (its tokens move out).
    fn prepare_select(&self, b: &mut SelectBody) -> Result<Prepared, ApiError> {
        self.prepare(
            &b.model_name,
            &b.routing_group,
            &mut b.prompt,
            b.allowed_worker_ids.as_deref(),
        )
    }

    /// A selection pinned to a rank no schedulable worker has (an unknown worker, or a
    /// `dp_rank` outside its ranks) is unavailable, as Dynamo answers it (503): routing it
    /// elsewhere would hide the caller's mistake. A pin outside `allowed_worker_ids` is left
    /// to the engine (it does not survive the allow-set).
    fn check_pin(prep: &Prepared, b: &SelectBody) -> Result<(), ApiError> {
        let Some(pin) = b.pinned_worker else {
            return Ok(());
        };
        let allowed = prep
            .allowed
            .as_ref()
            .is_none_or(|a| a.contains(&pin.worker_id));
        let has_rank = prep.entry.is_schedulable(pin.worker_id)
            && prep
                .entry
                .partition
                .workers()
                .get(pin.worker_id)
                .is_some_and(|w| w.has_rank(pin.dp_rank));
        if allowed && !has_rank {
            return Err(ApiError::unavailable(
                "no endpoints available to route work",
            ));
        }
        Ok(())
    }
}

/// `POST /select`: the decision and projected load, nothing booked. With a
/// `selection_id` (and not `advisory`), the decision waits in the pending-selection cache
/// for its claim (`POST /reservations`).
pub async fn select(
    State(app): State<Arc<App>>,
    Body(mut b): Body<SelectBody>,
) -> Result<Json<SelectResponse>, ApiError> {
    Ok(Json(app.select_taking(&mut b)?))
}

/// `POST /select_and_reserve`: the decision, booked on the chosen rank before answering.
pub async fn select_and_reserve(
    State(app): State<Arc<App>>,
    Body(mut b): Body<SelectBody>,
) -> Result<Json<SelectResponse>, ApiError> {
    Ok(Json(app.select_and_reserve_taking(&mut b)?))
}

/// The selection operations without HTTP (the routes' core; the Python bindings call
/// them too, so both answer alike by construction). The `_taking` forms move the body's
/// tokens into the engine request instead of copying them (the routes own their bodies).
impl App {
    /// `POST /select`.
    pub fn select(&self, b: &SelectBody) -> Result<SelectResponse, ApiError> {
        self.select_taking(&mut b.clone())
    }

    /// `POST /select_and_reserve`.
    pub fn select_and_reserve(&self, b: &SelectBody) -> Result<SelectResponse, ApiError> {
        self.select_and_reserve_taking(&mut b.clone())
    }

    /// [`App::select`], the body's tokens moved out.
    pub fn select_taking(&self, b: &mut SelectBody) -> Result<SelectResponse, ApiError> {
        let app = self;
        let prep = app.prepare_select(b)?;
        Self::check_pin(&prep, b)?;
        let req = engine_request(&prep, b);
        let outcome = app
            .engine
            .select(&prep.entry.partition, &req)
            .map_err(engine_error)?;
        let Outcome::Selected(d) = &outcome else {
            return Err(outcome_error(app, &prep.key, &outcome));
        };
        app.count(&prep, d, false);
        if let (Some(id), false) = (&b.selection_id, b.advisory.unwrap_or(false)) {
            app.pending.insert(
                id,
                Pending {
                    key: prep.key.clone(),
                    rank: d.rank,
                    prompt: prep.prompt.clone(),
                    lora_name: b.prompt.lora_name.clone(),
                    expected_output_tokens: b.expected_output_tokens.unwrap_or(0),
                },
                Instant::now(),
            );
        }
        let worker_load = b.advisory.unwrap_or(false);
        Ok(app.answer(
            &prep,
            d,
            b.selection_id.clone(),
            Answered::Selected { worker_load },
        ))
    }

    /// [`App::select_and_reserve`], the body's tokens moved out.
    pub fn select_and_reserve_taking(
        &self,
        b: &mut SelectBody,
    ) -> Result<SelectResponse, ApiError> {
        let app = self;
        let prep = app.prepare_select(b)?;
        Self::check_pin(&prep, b)?;
        let mut req = engine_request(&prep, b);
        let named = match &b.selection_id {
            Some(s) => Some(app.name_new(s, &prep.key)?),
            None => None,
        };
        req.selection_id = named;
        let result = app.engine.select_and_reserve(&prep.entry.partition, &req);
        let d = match result {
            Ok(Outcome::Selected(d)) => d,
            refused => {
                // Nothing was booked under the caller's id: it is free again.
                if let Some(s) = &b.selection_id {
                    app.ids.forget(s);
                }
                return Err(match refused {
                    Ok(o) => outcome_error(app, &prep.key, &o),
                    Err(e) => {
                        app.metrics.selection(SelectionOutcome::Error);
                        engine_error(e)
                    }
                });
            }
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
        app.count(&prep, &d, true);
        let wire_id = b.selection_id.clone().unwrap_or_else(|| app.ids.render(id));
        let answer = app.answer(
            &prep,
            &d,
            Some(wire_id.clone()),
            Answered::Booked {
                track_prefill: track,
            },
        );
        app.publish_booked(
            &prep.entry.partition,
            id,
            &wire_id,
            Some((answer.effective_prefill_tokens, track)),
            b.expected_output_tokens,
            b.prompt.lora_name.as_deref(),
        );
        Ok(answer)
    }
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
    Body(mut b): Body<SelectBody>,
) -> Result<Json<Vec<RankLoadBody>>, ApiError> {
    Ok(Json(app.potential_loads_taking(&mut b)?))
}

/// `POST /overlap_scores`: every member rank's tiered overlap with the prompt.
pub async fn overlap_scores(
    State(app): State<Arc<App>>,
    Body(mut b): Body<SelectBody>,
) -> Result<Json<OverlapScoresBody>, ApiError> {
    Ok(Json(app.overlap_scores_taking(&mut b)?))
}

/// The projections without HTTP (the routes' core, also the Python bindings').
impl App {
    /// `POST /potential_loads`.
    pub fn potential_loads(&self, b: &SelectBody) -> Result<Vec<RankLoadBody>, ApiError> {
        self.potential_loads_taking(&mut b.clone())
    }

    /// `POST /overlap_scores`.
    pub fn overlap_scores(&self, b: &SelectBody) -> Result<OverlapScoresBody, ApiError> {
        self.overlap_scores_taking(&mut b.clone())
    }

    /// [`App::potential_loads`], the body's tokens moved out.
    pub fn potential_loads_taking(
        &self,
        b: &mut SelectBody,
    ) -> Result<Vec<RankLoadBody>, ApiError> {
        let app = self;
        let prep = app.prepare_select(b)?;
        let p = &prep.entry.partition;
        let scores = app.tiered(&prep);
        let seq = sequence_hashes(&prep.prompt.hashes);
        let loads = p.bookings().loads();
        let bs = u64::from(p.block_size());
        let isl = prep.prompt.prompt_tokens;
        let mut out = Vec::new();
        for w in p
            .workers()
            .iter()
            .filter(|w| prep.entry.is_schedulable(w.worker_id))
        {
            for rank in w.ranks() {
                let active = loads.get(rank);
                let (dev, host, disk) = scores
                    .get(rank)
                    .map_or((0, 0, 0), |o| (o.device, o.host, o.disk));
                let effective = effective_prefill(p, isl, dev, host, disk);
                out.push(RankLoadBody {
                    worker_id: rank.worker_id,
                    dp_rank: rank.dp_rank,
                    // Saturating: a body may claim an absurd `isl_tokens`.
                    potential_prefill_tokens: active
                        .active_prefill_tokens
                        .saturating_add(effective),
                    // Blocks already active on the rank count once (as Dynamo's do here).
                    potential_decode_blocks: active
                        .active_decode_blocks
                        .saturating_add(loads.new_blocks_not_active(rank, &seq))
                        .saturating_add(u64::from(isl % bs.max(1) != 0)),
                    active_requests: active.active_requests,
                });
            }
        }
        Ok(out)
    }

    /// [`App::overlap_scores`], the body's tokens moved out.
    pub fn overlap_scores_taking(&self, b: &mut SelectBody) -> Result<OverlapScoresBody, ApiError> {
        let app = self;
        let prep = app.prepare(&b.model_name, &b.routing_group, &mut b.prompt, None)?;
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
        Ok(OverlapScoresBody {
            block_size: p.block_size(),
            num_blocks: prep.prompt.hashes.len() as u64,
            workers,
            shared_cache: SharedCacheBody::default(),
        })
    }
}
