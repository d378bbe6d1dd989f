//! Picking: a request's model, prompt tokens and constraints in; the endpoints to send it
//! to (best first, then fallbacks) and its booking out.
//!
//! The booking path is the selection service's own (`App::select_and_reserve`, the same
//! interface `kvr serve` answers `POST /select_and_reserve` with), so bookings, session
//! affinity, metrics and (later) replica sync behave alike in both hosts.
//!
//! Decisions:
//! - the request's `model` names a pool model, or a LoRA adapter pods declare (vLLM
//!   serves adapters under their own names): then only those pods are candidates; any
//!   other name is 404;
//! - fallbacks are the best ranks of the other workers (advisory selections that book
//!   nothing), so a refusing pod's retry goes elsewhere;
//! - a subset hint narrows candidates to the workers it names; if the chosen rank of a
//!   multi-rank worker is not in it, the selection is pinned to a named rank of it;
//! - every rank busy: 429 with shedding on (the default), else the least-loaded pick.

use std::collections::HashSet;
use std::sync::Arc;

use arc_swap::ArcSwap;

use kvr_service::wire::prompt::PromptBody;
use kvr_service::wire::select::{OverlapScoresBody, PinnedWorker, SelectRequest, SelectResponse};
use kvr_service::App;

use crate::pool::Membership;

/// What a pick needs from the request.
#[derive(Debug, Default)]
pub struct PickInput<'a> {
    pub model: Option<&'a str>,
    /// Moved into the pick (and kept there: [`Pick::tokens`]).
    pub tokens: Vec<u32>,
    /// The endpoints the request may go to (the subset hint); `None` = the pool's.
    pub subset: Option<Vec<String>>,
    pub session: Option<String>,
    pub expected_output_tokens: Option<u64>,
}

/// Why no endpoint was picked, with the status the client gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PickError {
    /// 404: no pool model has this name (and there is no default model for adapters).
    UnknownModel(String),
    /// 503: no endpoint can take the request (none eligible, subset empty or unknown).
    NoEndpoint(String),
    /// 429: every eligible rank is over its busy threshold.
    Busy(String),
    /// 400: the selection refused the request (a malformed prompt).
    Refused(String),
}

impl PickError {
    pub fn status(&self) -> u16 {
        match self {
            PickError::UnknownModel(_) => 404,
            PickError::NoEndpoint(_) => 503,
            PickError::Busy(_) => 429,
            PickError::Refused(_) => 400,
        }
    }

    /// The metric label and error type.
    pub fn kind(&self) -> &'static str {
        match self {
            PickError::UnknownModel(_) => "unknown_model",
            PickError::NoEndpoint(_) => "no_endpoint",
            PickError::Busy(_) => "busy",
            PickError::Refused(_) => "refused",
        }
    }

    pub fn message(&self) -> &str {
        match self {
            PickError::UnknownModel(m)
            | PickError::NoEndpoint(m)
            | PickError::Busy(m)
            | PickError::Refused(m) => m,
        }
    }
}

/// How picks are made.
#[derive(Clone, Debug)]
pub struct PickConfig {
    /// Fallback endpoints after the best one.
    pub fallbacks: usize,
    /// Answer 429 when every rank is busy (else pick anyway).
    pub shed_when_busy: bool,
}

/// The picker: the service's state and the pool membership in force.
#[derive(Debug)]
pub struct Picker {
    pub app: Arc<App>,
    pool: ArcSwap<Membership>,
    pub config: PickConfig,
}

/// A booked request: freed when dropped unless freed before (a broken stream frees at
/// once, never waits for a timer).
#[derive(Debug)]
pub struct Booking {
    app: Arc<App>,
    id: Option<String>,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub block_size: u32,
}

impl Booking {
    /// The request's first response bytes arrived: its prefill is done.
    pub fn prefill_complete(&self) {
        if let Some(id) = &self.id {
            let _ = self.app.prefill_complete(id);
        }
    }

    /// One more output block.
    pub fn output_block(&self) {
        if let Some(id) = &self.id {
            let _ = self.app.output_block(id, None);
        }
    }

    /// Ends the booking (idempotent). Returns whether it was live.
    pub fn free(&mut self) -> bool {
        match self.id.take() {
            Some(id) => {
                let _ = self.app.free(&id);
                true
            }
            None => false,
        }
    }

    pub fn is_live(&self) -> bool {
        self.id.is_some()
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.free();
    }
}

/// A pick: where to send the request, and its booking.
#[derive(Debug)]
pub struct Pick {
    /// `ip:port`, best first.
    pub endpoints: Vec<String>,
    pub booking: Booking,
    /// Prompt tokens the chosen rank holds, as kvr predicts.
    pub predicted_cached_tokens: u64,
    /// Prompt tokens an eligible rank held on its device beyond the chosen rank's: the
    /// cache given up for load (0 when the chosen rank held the most).
    pub cache_given_up_tokens: u64,
    pub prompt_tokens: u64,
    /// The prompt's tokens (kept for a rebooking on the endpoint that served).
    pub tokens: Vec<u32>,
    /// The model the request was booked under, and its LoRA adapter if any.
    pub model: String,
    pub lora: Option<String>,
}

impl Picker {
    pub fn new(app: Arc<App>, pool: Membership, config: PickConfig) -> Self {
        Picker {
            app,
            pool: ArcSwap::from_pointee(pool),
            config,
        }
    }

    pub fn set_pool(&self, pool: Membership) {
        self.pool.store(Arc::new(pool));
    }

    pub fn pool(&self) -> Arc<Membership> {
        self.pool.load_full()
    }

    /// The pool model, LoRA adapter and serving workers a request's `model` names.
    fn resolve_model(
        pool: &Membership,
        model: Option<&str>,
    ) -> Result<(String, Option<String>, Vec<u64>), PickError> {
        let serving = |m: &str| -> Vec<u64> {
            pool.workers
                .iter()
                .filter(|(_, w)| *w == m)
                .map(|(id, _)| *id)
                .collect()
        };
        let name = match model {
            Some(m) => m,
            None => pool
                .default_model
                .as_deref()
                .ok_or_else(|| PickError::UnknownModel("the request names no model".into()))?,
        };
        let base = serving(name);
        if !base.is_empty() {
            return Ok((name.to_owned(), None, base));
        }
        match pool.adapters.get(name) {
            Some((base, workers)) => Ok((base.clone(), Some(name.to_owned()), workers.clone())),
            None => Err(PickError::UnknownModel(format!(
                "model {name:?} is not served by this pool"
            ))),
        }
    }

    /// Whether the pool serves `model` (a base model or an adapter): 404 if not, checked
    /// before a prompt is tokenized for it.
    /// The pool model a request's `model` names: itself, or the base model of a LoRA
    /// adapter pods declare (whose tokenizer is the base model's).
    pub fn check_model(&self, model: Option<&str>) -> Result<String, PickError> {
        Self::resolve_model(&self.pool(), model).map(|(base, _, _)| base)
    }

    /// Picks and books.
    pub fn pick(&self, input: PickInput<'_>) -> Result<Pick, PickError> {
        let pool = self.pool();
        let (model, lora, serving) = Self::resolve_model(&pool, input.model)?;
        // The endpoints the request may go to, and their workers.
        let (allowed_eps, allowed_workers): (Option<HashSet<&str>>, Vec<u64>) = match &input.subset
        {
            None => (None, serving.clone()),
            Some(subset) => {
                let eps: HashSet<&str> = subset
                    .iter()
                    .map(String::as_str)
                    .filter(|e| {
                        pool.by_endpoint
                            .get(*e)
                            .is_some_and(|ep| serving.contains(&ep.worker_id))
                    })
                    .collect();
                let mut workers: Vec<u64> =
                    eps.iter().map(|e| pool.by_endpoint[*e].worker_id).collect();
                workers.sort_unstable();
                workers.dedup();
                (Some(eps), workers)
            }
        };
        if allowed_workers.is_empty() {
            return Err(PickError::NoEndpoint(match input.subset {
                Some(_) => "no endpoint of the subset hint serves this model".into(),
                None => format!("no endpoint serves model {model:?}"),
            }));
        }
        // One request for every call of this pick (the overlaps, the booking, a pin,
        // the fallbacks): only its constraints change, the prompt is never copied.
        let mut req = SelectRequest {
            model_name: model.clone(),
            routing_group: "default".into(),
            prompt: PromptBody {
                token_ids: Some(input.tokens),
                lora_name: lora.clone(),
                ..Default::default()
            },
            expected_output_tokens: input.expected_output_tokens,
            session_id: input.session,
            allowed_worker_ids: Some(allowed_workers.clone()),
            advisory: Some(true),
            ..Default::default()
        };
        let before = self.app.overlap_scores(&req).ok();
        req.advisory = None;
        let mut chosen = self.book(&req)?;
        if let Some(eps) = &allowed_eps {
            let in_subset = |r: &SelectResponse| {
                pool.endpoint_of(r.worker_id, r.dp_rank)
                    .is_some_and(|e| eps.contains(e))
            };
            if !in_subset(&chosen.0) {
                // A rank of the chosen worker the hint does not name: pin to one it does.
                let rank = pool
                    .by_endpoint
                    .iter()
                    .filter(|(e, ep)| {
                        eps.contains(e.as_str()) && ep.worker_id == chosen.0.worker_id
                    })
                    .map(|(_, ep)| ep.dp_rank)
                    .min();
                let worker_id = chosen.0.worker_id;
                drop(chosen);
                req.pinned_worker = rank.map(|dp_rank| PinnedWorker { worker_id, dp_rank });
                chosen = self.book(&req)?;
                req.pinned_worker = None;
            }
        }
        let (resp, booking) = chosen;
        let first = pool
            .endpoint_of(resp.worker_id, resp.dp_rank)
            .ok_or_else(|| {
                PickError::NoEndpoint("the chosen rank has no endpoint in the pool".into())
            })?
            .to_owned();
        let mut endpoints = vec![first];
        let mut left: Vec<u64> = allowed_workers
            .iter()
            .copied()
            .filter(|w| *w != resp.worker_id)
            .collect();
        req.advisory = Some(true);
        while endpoints.len() <= self.config.fallbacks && !left.is_empty() {
            req.allowed_worker_ids = Some(left.clone());
            let Ok(r) = self.app.select(&req) else {
                break;
            };
            left.retain(|w| *w != r.worker_id);
            if let Some(e) = pool.endpoint_of(r.worker_id, r.dp_rank) {
                if allowed_eps.as_ref().is_none_or(|s| s.contains(e)) {
                    endpoints.push(e.to_owned());
                }
            }
        }
        let cache_given_up_tokens = Self::given_up(
            before.as_ref(),
            &allowed_workers,
            &allowed_eps,
            &pool,
            &resp,
        );
        let tokens = req.prompt.token_ids.take().unwrap_or_default();
        Ok(Pick {
            endpoints,
            cache_given_up_tokens,
            predicted_cached_tokens: resp.overlap.gpu,
            prompt_tokens: tokens.len() as u64,
            tokens,
            booking,
            model,
            lora,
        })
    }

    /// Device tokens the best eligible rank held beyond the chosen one's, from the
    /// overlaps read before the booking (a booking-fed index learns the booked prompt).
    fn given_up(
        scores: Option<&OverlapScoresBody>,
        allowed: &[u64],
        allowed_eps: &Option<HashSet<&str>>,
        pool: &Membership,
        chosen: &SelectResponse,
    ) -> u64 {
        let Some(scores) = scores else {
            return 0;
        };
        let eligible = scores.workers.iter().filter(|w| {
            allowed.contains(&w.worker_id)
                && allowed_eps.as_ref().is_none_or(|eps| {
                    pool.endpoint_of(w.worker_id, w.dp_rank)
                        .is_some_and(|e| eps.contains(e))
                })
        });
        let best = eligible
            .map(|w| u64::from(w.device_blocks))
            .max()
            .unwrap_or(0);
        let mine = scores
            .workers
            .iter()
            .find(|w| (w.worker_id, w.dp_rank) == (chosen.worker_id, chosen.dp_rank))
            .map_or(0, |w| u64::from(w.device_blocks));
        best.saturating_sub(mine) * u64::from(scores.block_size)
    }

    fn book(&self, b: &SelectRequest) -> Result<(SelectResponse, Booking), PickError> {
        match self.app.select_and_reserve(b) {
            Ok(r) => {
                let booking = Booking {
                    app: self.app.clone(),
                    id: r.selection_id.clone(),
                    worker_id: r.worker_id,
                    dp_rank: r.dp_rank,
                    block_size: r.block_size,
                };
                Ok((r, booking))
            }
            Err(e) => Err(match e.status.as_u16() {
                429 if !self.config.shed_when_busy => {
                    return self.book_least_loaded(b);
                }
                429 => PickError::Busy(e.message),
                400 | 413 | 422 => PickError::Refused(e.message),
                _ => PickError::NoEndpoint(e.message),
            }),
        }
    }

    /// Every rank busy and shedding off: book the rank the selection would pick anyway,
    /// through an explicit reservation on the advisory choice.
    fn book_least_loaded(&self, b: &SelectRequest) -> Result<(SelectResponse, Booking), PickError> {
        let mut advisory = b.clone();
        advisory.advisory = Some(true);
        let r = self
            .app
            .select(&advisory)
            .map_err(|e| PickError::NoEndpoint(e.message))?;
        let mut pinned = b.clone();
        pinned.pinned_worker = Some(PinnedWorker {
            worker_id: r.worker_id,
            dp_rank: r.dp_rank,
        });
        self.app
            .select_and_reserve(&pinned)
            .map(|r| {
                let booking = Booking {
                    app: self.app.clone(),
                    id: r.selection_id.clone(),
                    worker_id: r.worker_id,
                    dp_rank: r.dp_rank,
                    block_size: r.block_size,
                };
                (r, booking)
            })
            .map_err(|e| PickError::Busy(e.message))
    }

    /// Moves `booking` to the rank of `served` (a fallback served the request): a new
    /// booking there for the same prompt, the old one freed. `false` if `served` is not
    /// a pool endpoint (the booking stays).
    pub fn rebook(&self, pick: &mut Pick, served: &str) -> bool {
        let pool = self.pool();
        let Some(ep) = pool.by_endpoint.get(served) else {
            return false;
        };
        if (ep.worker_id, ep.dp_rank) == (pick.booking.worker_id, pick.booking.dp_rank) {
            return true;
        }
        let body = SelectRequest {
            model_name: pick.model.clone(),
            routing_group: "default".into(),
            prompt: PromptBody {
                token_ids: Some(pick.tokens.clone()),
                lora_name: pick.lora.clone(),
                ..Default::default()
            },
            pinned_worker: Some(PinnedWorker {
                worker_id: ep.worker_id,
                dp_rank: ep.dp_rank,
            }),
            allowed_worker_ids: Some(vec![ep.worker_id]),
            ..Default::default()
        };
        pick.booking.free();
        match self.book(&body) {
            Ok((_, b)) => {
                pick.booking = b;
                true
            }
            Err(_) => false,
        }
    }
}
