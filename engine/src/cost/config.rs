//! The configured knobs of the cost function: the deployment-wide [`CostConfig`] (which
//! model, and each model's knobs) and a request's [`CostOverrides`]. What they fold into
//! is `resolved.rs`.

/// Which cost a selection minimises.
///
/// * [`CostModel::Latency`] (the default): each candidate's **predicted time to first
///   token** in ms — its booked prefill queue plus this prompt's uncached part, at the
///   partition's prefill rate — with decode load as a tie-break that only weighs in
///   fully when KV memory nears full or a per-token latency target is set
///   ([`latency_cost`]).
/// * [`CostModel::Dynamo`]: Dynamo's default scorer in block equivalents, term for term
///   ([`cost_breakdown`]), for a deployment that must route exactly as Dynamo does.
///
/// Why a new default: Dynamo's cost adds decode blocks to prefill blocks one for one, so
/// a rank holding ~80 more decode blocks loses a request to one holding ~20 fewer cached
/// blocks; on an idle or prefill-bound cluster that spreads prefixes, lowers the hit rate
/// and raises TTFT (`kvr replay` shows it; README.md, "Routing quality").
///
/// [`latency_cost`]: super::latency_cost
/// [`cost_breakdown`]: super::cost_breakdown
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CostModel {
    /// Predicted time to first token, ms (the default).
    #[default]
    Latency,
    /// Dynamo's default scorer, in block equivalents.
    Dynamo,
}

impl CostModel {
    /// The model's name in flags, wire formats and reports: `latency` or `dynamo`.
    pub fn name(self) -> &'static str {
        match self {
            CostModel::Latency => "latency",
            CostModel::Dynamo => "dynamo",
        }
    }

    /// Every model, the default first (for listing the valid names in a refusal).
    pub const ALL: [CostModel; 2] = [CostModel::Latency, CostModel::Dynamo];

    /// The model named `s` (as [`CostModel::name`] spells it).
    pub fn parse(s: &str) -> Option<CostModel> {
        CostModel::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// The knobs of the latency model ([`CostModel::Latency`]); see [`latency_cost`] for the
/// formula. Times in ms, rates in tokens per second.
///
/// [`latency_cost`]: super::latency_cost
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatencyConfig {
    /// Prefill throughput of one rank before any is measured, tokens/s (10,000: a
    /// mid-size model on one GPU).
    pub prefill_rate_prior: f64,
    /// Learn the partition's prefill rate online from `mark_prefill_complete` timings
    /// (clamped to [prior / 10, prior × 10]); `false` keeps the prior.
    pub learn_prefill_rate: bool,
    /// Fixed cost of one request's prefill, ms (shifts every candidate alike; it makes
    /// the reported cost a TTFT estimate).
    pub request_overhead_ms: f64,
    /// Share of a rank's KV blocks in use (after this booking) above which KV memory
    /// pressure is charged (0.9).
    pub kv_pressure_threshold: f64,
    /// The pressure charge at full KV memory, ms, rising linearly from the threshold (and
    /// on beyond full): a rank about to run out of blocks queues or preempts.
    pub kv_pressure_ms: f64,
    /// A per-token latency target, ms (`None`, the default: no target). With one, a rank
    /// whose predicted per-token latency exceeds it is charged the excess over the
    /// request's expected output.
    pub itl_target_ms: Option<f64>,
    /// Predicted per-token latency of a lone request, ms (only read with a target).
    pub itl_base_ms: f64,
    /// Predicted extra per-token latency per request running on the rank, ms.
    pub itl_per_request_ms: f64,
    /// Weight of the queue externality (2; 0 = price only this request's TTFT): a
    /// prompt's uncached tokens also delay the requests that will queue behind them on
    /// the rank, about as many as an average candidate has queued now, so under load a
    /// cache miss costs more than its own prefill (see [`latency_cost`]).
    ///
    /// [`latency_cost`]: super::latency_cost
    pub queue_externality: f64,
    /// Tie-break: µs charged per decode block the rank would hold after this booking
    /// (1 µs: 6,400 blocks weigh as one 64-token block of prefill at 10k tokens/s).
    pub decode_block_us: f64,
}

impl Default for LatencyConfig {
    fn default() -> Self {
        Self {
            prefill_rate_prior: 10_000.0,
            learn_prefill_rate: true,
            request_overhead_ms: 5.0,
            kv_pressure_threshold: 0.9,
            kv_pressure_ms: 1_000.0,
            itl_target_ms: None,
            itl_base_ms: 20.0,
            itl_per_request_ms: 0.2,
            queue_externality: 2.0,
            decode_block_us: 1.0,
        }
    }
}

impl LatencyConfig {
    /// The first knob outside its range, by field name (`None`: all in range). The one
    /// statement of the ranges: [`PartitionConfig::validate`] refuses a configuration
    /// with such a knob (`ConfigError::OutOfRange`), and the C ABI's setters refuse the
    /// value that would make one. Ranges: the prior finite and > 0; the threshold in
    /// [0, 1]; a target, if set, finite and > 0; every other time or weight finite and
    /// ≥ 0. Read whichever model is configured, so a switch of model cannot expose a
    /// bad knob.
    ///
    /// [`PartitionConfig::validate`]: crate::config::PartitionConfig::validate
    pub fn out_of_range(&self) -> Option<&'static str> {
        let non_negative = |v: f64| v.is_finite() && v >= 0.0;
        let checks = [
            (
                self.prefill_rate_prior.is_finite() && self.prefill_rate_prior > 0.0,
                "prefill_rate_prior",
            ),
            (
                non_negative(self.request_overhead_ms),
                "request_overhead_ms",
            ),
            (
                non_negative(self.kv_pressure_threshold) && self.kv_pressure_threshold <= 1.0,
                "kv_pressure_threshold",
            ),
            (non_negative(self.kv_pressure_ms), "kv_pressure_ms"),
            (
                self.itl_target_ms.is_none_or(|t| t.is_finite() && t > 0.0),
                "itl_target_ms",
            ),
            (non_negative(self.itl_base_ms), "itl_base_ms"),
            (non_negative(self.itl_per_request_ms), "itl_per_request_ms"),
            (non_negative(self.queue_externality), "queue_externality"),
            (non_negative(self.decode_block_us), "decode_block_us"),
        ];
        checks.iter().find(|(ok, _)| !ok).map(|(_, name)| *name)
    }
}

/// The cost function's model and knobs (REFERENCE.md §3).
///
/// The default model is [`CostModel::Latency`]; [`CostConfig::dynamo`] is Dynamo's
/// current default scorer, so a kvr configured with it scores candidates the way an
/// unconfigured Dynamo router does. The weights below are Dynamo's defaults and serve
/// both models (the latency model reads the cache credits as the share of a block's
/// prefill a cached copy saves, so a host block's 0.75 means its transfer costs a quarter
/// of recomputing it). Per-request [`CostOverrides`] are folded in by
/// [`CostConfig::resolve`], which yields the `CostConfig` the hot path reads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostConfig {
    /// Which cost is minimised.
    pub model: CostModel,
    /// The latency model's knobs (read only with [`CostModel::Latency`]).
    pub latency: LatencyConfig,
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
    /// The latency model with Dynamo's weights.
    fn default() -> Self {
        Self {
            model: CostModel::Latency,
            latency: LatencyConfig::default(),
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

impl CostConfig {
    /// Dynamo's default scorer with Dynamo's default knobs: routes as an unconfigured
    /// Dynamo router does.
    pub fn dynamo() -> Self {
        Self {
            model: CostModel::Dynamo,
            ..Self::default()
        }
    }
}

/// Per-request overrides of the knobs Dynamo lets a request change (REFERENCE.md §3).
/// `None` = use the configured value.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostOverrides {
    /// Replaces [`CostConfig::overlap_score_credit`].
    pub overlap_score_credit: Option<f64>,
    /// Replaces [`CostConfig::prefill_load_scale`].
    pub prefill_load_scale: Option<f64>,
    /// Replaces [`CostConfig::temperature`].
    pub temperature: Option<f64>,
    /// Replaces [`CostConfig::shared_cache_multiplier`].
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
