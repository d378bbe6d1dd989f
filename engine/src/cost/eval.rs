//! The cost under the configured model: the one place that dispatches between Dynamo's
//! scorer (`formula.rs`) and the latency model (`latency.rs`), so neither of those imports
//! the other.

use super::config::CostConfig;
use super::config::CostModel;
use super::formula::{cost_breakdown, CandidateLoad, RequestShape};
use super::latency::{effective_rate, LatencyPrep};

/// The cost of placing the request on candidate `c` under the configured model (lower
/// wins): [`latency_cost`] (ms) or Dynamo's [`cost_breakdown`] (block equivalents). For
/// many candidates of one request, [`CostEval`] prepares the request's part once.
///
/// [`latency_cost`]: super::latency_cost
#[inline]
pub fn cost(cfg: &CostConfig, req: &RequestShape, c: &CandidateLoad) -> f64 {
    CostEval::new(cfg, req).cost(c)
}

/// One request's costs under the configured model, with what depends only on the request
/// and the knobs computed once.
#[derive(Clone, Copy, Debug)]
pub struct CostEval<'a> {
    cfg: &'a CostConfig,
    req: RequestShape,
    latency: Option<LatencyPrep>,
}

impl<'a> CostEval<'a> {
    /// Prepares the costs of `req` under `cfg` (with the latency model, its per-request
    /// part is computed here, once).
    #[inline]
    pub fn new(cfg: &'a CostConfig, req: &RequestShape) -> Self {
        Self {
            cfg,
            req: *req,
            latency: (cfg.model == CostModel::Latency).then(|| LatencyPrep::new(cfg, req)),
        }
    }

    /// The knobs and the request, for the columns pass (`columns.rs`).
    pub(super) fn cfg(&self) -> &CostConfig {
        self.cfg
    }

    pub(super) fn req(&self) -> &RequestShape {
        &self.req
    }

    /// The latency model's per-request part (`None` under Dynamo's).
    pub(super) fn latency(&self) -> Option<&LatencyPrep> {
        self.latency.as_ref()
    }

    /// How much the cost rises per booked prefill token and per held decode block, for
    /// the load floors' combined bound (`select/prune.rs`): Dynamo's
    /// `prefill_load_scale / block size` and 1; the latency model's ms per token and
    /// tie-break ms per block (its KV-pressure term only adds). Under Dynamo's model the
    /// prefill slope holds only where its prefill term is above its clamp at 0
    /// ([`cost_and_prefill_slope`](Self::cost_and_prefill_slope)).
    #[inline]
    pub(crate) fn load_slopes(&self) -> (f64, f64) {
        match &self.latency {
            Some(p) => (p.ms_per_token, p.tie_ms_per_block),
            None => (self.cfg.prefill_load_scale / self.req.block_size_f64(), 1.0),
        }
    }

    /// The cost of `c` and whether more booked prefill raises it at the prefill slope
    /// of [`load_slopes`](Self::load_slopes): always under the latency model; under
    /// Dynamo's only where its prefill term is above its clamp at 0 (its credit does not
    /// cover the prompt and the booked prefill). One cost computation gives both.
    #[inline]
    pub(crate) fn cost_and_prefill_slope(&self, c: &CandidateLoad) -> (f64, bool) {
        match &self.latency {
            Some(p) => (p.cost(self.cfg, &self.req, c).cost_ms, true),
            None => {
                let b = cost_breakdown(self.cfg, &self.req, c);
                // `max(raw - credit, 0)`: 0 at the clamp and for a NaN difference.
                (b.cost, b.adjusted_prefill_blocks > 0.0)
            }
        }
    }

    /// The cost of candidate `c` (see [`cost`]).
    #[inline]
    pub fn cost(&self, c: &CandidateLoad) -> f64 {
        match &self.latency {
            Some(p) => p.cost(self.cfg, &self.req, c).cost_ms,
            None => cost_breakdown(self.cfg, &self.req, c).cost,
        }
    }

    /// `(cost, cost - new_blocks_share)` of `c`: the upper and lower bounds selection
    /// prunes with, taken in its one pass over the candidates (the same values as
    /// [`cost`](Self::cost) and [`new_blocks_share`](Self::new_blocks_share) apart).
    #[inline]
    pub fn bounds(&self, c: &CandidateLoad) -> (f64, f64) {
        match &self.latency {
            Some(p) => p.bounds(self.cfg, &self.req, c),
            None => {
                let upper = cost_breakdown(self.cfg, &self.req, c).cost;
                (upper, upper - c.new_blocks_not_active as f64)
            }
        }
    }

    /// The part of `c`'s cost due to its `new_blocks_not_active` (exactly: the cost with
    /// them minus the cost with none). Both models' costs only rise with that count, so
    /// selection prices every candidate with the whole prompt counted new (an upper
    /// bound), and a candidate whose cost minus this share exceeds the best upper bound
    /// cannot win and is never resolved.
    #[inline]
    pub fn new_blocks_share(&self, c: &CandidateLoad) -> f64 {
        match &self.latency {
            Some(p) => p.new_blocks_share(self.cfg, c),
            None => c.new_blocks_not_active as f64,
        }
    }
}

/// How many booked prefill tokens cost as much as one held decode block under `cfg` at its
/// prior prefill rate (the ratio of [`CostEval::load_slopes`] with no learned rate): the
/// weight a partition's load floors combine the two counters with (`reservation/floor.rs`).
pub(crate) fn decode_block_in_tokens(cfg: &CostConfig, block_size: u32) -> f64 {
    let (per_token, per_block) =
        CostEval::new(cfg, &RequestShape::new(1, block_size)).load_slopes();
    per_block / per_token
}

/// `blocks` of prefill in the configured model's unit: block equivalents for Dynamo's,
/// ms at the request's prefill rate for the latency model. Soft session affinity's
/// penalty (given in blocks) is converted with it.
#[inline]
pub fn blocks_in_cost_units(cfg: &CostConfig, req: &RequestShape, blocks: f64) -> f64 {
    match cfg.model {
        CostModel::Latency => blocks * req.block_size_f64() * 1e3 / effective_rate(cfg, req),
        CostModel::Dynamo => blocks,
    }
}

/// Costs of all `candidates` into `out` (same order), with the decay's selection-wide
/// minimum computed from `candidates` (overriding `req.min_active_prefill_tokens`).
/// `candidates` must be exactly the eligible set, as in Dynamo: the minimum is taken over
/// the ranks that can actually be chosen.
///
/// # Panics
/// If `out.len() != candidates.len()` (a caller bug; silently truncating would drop
/// candidates from the choice).
pub fn fill_costs(
    cfg: &CostConfig,
    req: &RequestShape,
    candidates: &[CandidateLoad],
    out: &mut [f64],
) {
    assert_eq!(
        out.len(),
        candidates.len(),
        "fill_costs: output slice length must match the candidate count"
    );
    let req = req.with_selection_stats(candidates);
    let eval = CostEval::new(cfg, &req);
    for (slot, c) in out.iter_mut().zip(candidates) {
        *slot = eval.cost(c);
    }
}
