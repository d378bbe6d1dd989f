//! The configured knobs of the cost function: the deployment-wide [`CostConfig`]
//! (Dynamo's defaults) and a request's [`CostOverrides`]. What they fold into is
//! `resolved.rs`.

/// Dynamo's default weights and knobs for the cost function (REFERENCE.md §3).
///
/// The defaults are Dynamo's current ones, so an unconfigured kvr scores candidates the
/// way an unconfigured Dynamo router does. Per-request [`CostOverrides`] are folded in by
/// [`CostConfig::resolve`], which yields the [`ResolvedCost`] the hot path reads.
///
/// [`ResolvedCost`]: super::ResolvedCost
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostConfig {
    /// Credit per device-resident cached block (before decay). 1.0 = a cached device block
    /// saves exactly one block of prefill work.
    pub overlap_score_credit: f64,
    /// Multiplier on the (credited) prefill term; >1 favours cache locality / prefill
    /// balance over decode balance.
    pub prefill_load_scale: f64,
    /// Credit per cached block in host memory (cheaper to bring back than recompute, but
    /// not free): 0.75.
    pub host_cache_hit_weight: f64,
    /// Credit per cached block on disk: 0.25.
    pub disk_cache_hit_weight: f64,
    /// Credit per block the host's shared KV cache holds beyond this rank's device prefix.
    /// 0 (off) by default, as in Dynamo.
    pub shared_cache_multiplier: f64,
    /// Selection temperature: 0 = argmin with uniform random tie-break; > 0 = softmax over
    /// range-normalised costs (see [`choose`]).
    ///
    /// [`choose`]: super::choose
    pub temperature: f64,
    /// Block equivalents charged per active request on the rank (0 = off).
    pub decode_active_request_weight: f64,
    /// Load-dependent decay of the device credit; `None` = off (Dynamo's default, where
    /// `overlap_score_credit_decay` is 0).
    ///
    /// With `Some(d)` (and `d > 0`) the device credit is multiplied by
    /// `decay = 1 / (1 + d * excess_prefill_blocks / request_blocks)`, where, as in
    /// Dynamo's `DefaultWorkerScorer` (`lib/kv-router/src/scheduling/selector`):
    ///
    /// * `excess_prefill_blocks = (active_prefill_tokens - min_active_prefill_tokens) / B`
    ///   (saturating at 0; fractional, not rounded), with `min_active_prefill_tokens` the
    ///   minimum of `active_prefill_tokens` over the *eligible candidates of this
    ///   selection* (see [`RequestShape::min_active_prefill_tokens`], [`fill_costs`]);
    /// * `request_blocks = ceil(ISL / B)` (at least 1 here; Dynamo asserts ISL > 0).
    ///
    /// Why: a rank that already has more prefill backlog than the least-loaded candidate
    /// keeps only part of its cache credit, so a hot prefix does not pile every request onto
    /// one congested rank; the least-loaded rank(s) always keep the full credit. Normalising
    /// by the request's own size makes the penalty relative: a backlog of one request's
    /// worth of blocks halves the credit at `d = 1`.
    ///
    /// `Some(d)` with `d <= 0` or NaN behaves as off (decay 1), as Dynamo only applies the
    /// decay when the coefficient is positive. (Dynamo also skips it when the router does
    /// not track prefill tokens; kvr always tracks its own bookings, so that case does not
    /// arise here.)
    ///
    /// [`RequestShape::min_active_prefill_tokens`]: super::RequestShape::min_active_prefill_tokens
    /// [`fill_costs`]: super::fill_costs
    pub credit_decay: Option<f64>,
}

impl Default for CostConfig {
    fn default() -> Self {
        Self {
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            shared_cache_multiplier: 0.0,
            temperature: 0.0,
            decode_active_request_weight: 0.0,
            credit_decay: None,
        }
    }
}

/// Per-request overrides of the knobs Dynamo lets a request change (REFERENCE.md §3).
/// `None` = use the configured value.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostOverrides {
    pub overlap_score_credit: Option<f64>,
    pub prefill_load_scale: Option<f64>,
    pub temperature: Option<f64>,
    pub shared_cache_multiplier: Option<f64>,
}

impl CostOverrides {
    /// No overrides.
    pub const NONE: CostOverrides = CostOverrides {
        overlap_score_credit: None,
        prefill_load_scale: None,
        temperature: None,
        shared_cache_multiplier: None,
    };
}
