//! The cost formulas (REFERENCE.md §3): the request's and a candidate's inputs
//! ([`RequestShape`], [`CandidateLoad`]), Dynamo's current default scorer term by term
//! ([`CostBreakdown`]), the older `dynamo-classic` logit, and the dispatch on the
//! configured model ([`cost`](super::cost()), [`fill_costs`](super::fill_costs); the latency model is `latency.rs`). Pure
//! arithmetic on its arguments; choosing among the results is `choice.rs`.

use super::config::CostConfig;

/// The request-side inputs of the cost: prompt length, block size, and the
/// selection-wide quantities the decay and the latency model need.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestShape {
    /// Prompt length in tokens (ISL).
    pub isl_tokens: u64,
    /// Tokens per KV block (B). 0 is treated as 1 so the functions stay total.
    pub block_size: u32,
    /// Minimum `active_prefill_tokens` over this selection's eligible candidates; only the
    /// credit decay reads it (see [`CostConfig::credit_decay`]). [`fill_costs`](super::fill_costs) computes it
    /// itself; callers of [`cost`](super::cost()) on single candidates must set it (0 is correct when
    /// the decay is off, and makes the decay absolute rather than relative when it is on).
    ///
    /// [`CostConfig::credit_decay`]: super::config::CostConfig::credit_decay
    pub min_active_prefill_tokens: u64,
    /// The partition's prefill rate estimate, tokens/s (the latency model; 0 or less =
    /// the configured prior).
    pub prefill_rate: f64,
    /// The partition's decode drag estimate, ms of time to first token per decode block a rank
    /// holds (the latency model adds it to its per-block charge; 0 = none learned).
    pub decode_drag_ms_per_block: f64,
    /// The request's expected output tokens (the latency model's per-token term).
    pub expected_output_tokens: u64,
    /// Mean `active_prefill_tokens` over this selection's eligible candidates (the
    /// latency model's queue externality; [`fill_costs`](super::fill_costs) sets it).
    pub mean_active_prefill_tokens: f64,
}

impl RequestShape {
    /// A request of `isl_tokens` prompt tokens with `block_size`-token blocks
    /// (`min_active_prefill_tokens` = 0).
    #[inline]
    pub const fn new(isl_tokens: u64, block_size: u32) -> Self {
        Self {
            isl_tokens,
            block_size,
            min_active_prefill_tokens: 0,
            prefill_rate: 0.0,
            decode_drag_ms_per_block: 0.0,
            expected_output_tokens: 0,
            mean_active_prefill_tokens: 0.0,
        }
    }

    /// The same request with the selection-wide quantities taken from `candidates` (the
    /// eligible set): the minimum and the mean of their booked prefill tokens.
    #[inline]
    pub fn with_selection_stats(self, candidates: &[CandidateLoad]) -> Self {
        let mut s = self.with_min_active_prefill_tokens(min_active_prefill_tokens(candidates));
        s.mean_active_prefill_tokens = if candidates.is_empty() {
            0.0
        } else {
            candidates
                .iter()
                .map(|c| c.active_prefill_tokens as f64)
                .sum::<f64>()
                / candidates.len() as f64
        };
        s
    }

    /// The same request with the partition's prefill rate estimate (tokens/s).
    #[inline]
    pub const fn with_prefill_rate(mut self, tokens_per_s: f64) -> Self {
        self.prefill_rate = tokens_per_s;
        self
    }

    /// The same request with the partition's decode drag estimate (ms per decode block).
    #[inline]
    pub const fn with_decode_drag(mut self, ms_per_block: f64) -> Self {
        self.decode_drag_ms_per_block = ms_per_block;
        self
    }

    /// The same request with its expected output length.
    #[inline]
    pub const fn with_expected_output_tokens(mut self, tokens: u64) -> Self {
        self.expected_output_tokens = tokens;
        self
    }

    /// The same request with the selection-wide prefill minimum set.
    #[inline]
    pub const fn with_min_active_prefill_tokens(mut self, min: u64) -> Self {
        self.min_active_prefill_tokens = min;
        self
    }

    /// B as a float, with 0 treated as 1.
    #[inline]
    pub(super) fn block_size_f64(&self) -> f64 {
        f64::from(self.block_size.max(1))
    }

    /// `ceil(ISL / B)`, at least 1 (the decay divides by it).
    #[inline]
    pub fn request_blocks(&self) -> u64 {
        self.isl_tokens
            .div_ceil(u64::from(self.block_size.max(1)))
            .max(1)
    }
}

/// One candidate rank's inputs to the cost: its cached prefix per tier (from the tiered
/// index), the host's shared-cache hits beyond it, and the engine's live bookings on it.
///
/// The tier counts follow the index's `TieredOverlap`: `device` leading blocks on the
/// device, then `host` further contiguous blocks in host memory, then `disk` further
/// blocks on disk, so a block is credited once, at the tier it would be served from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CandidateLoad {
    /// Leading prompt blocks cached on this rank's device.
    pub device_blocks: u64,
    /// Further prompt blocks cached in this rank's host memory.
    pub host_blocks: u64,
    /// Further prompt blocks cached on this rank's disk.
    pub disk_blocks: u64,
    /// Prompt blocks the host's shared KV cache holds beyond this rank's device prefix.
    pub shared_blocks_beyond_device: u64,
    /// Prefill tokens booked on this rank and not yet marked prefill-complete.
    pub active_prefill_tokens: u64,
    /// Decode blocks booked on this rank (shared prompt blocks counted once per rank,
    /// REFERENCE.md §4).
    pub active_decode_blocks: u64,
    /// This request's blocks that are not already active on this rank, i.e. what booking
    /// it here would add to `active_decode_blocks` (the caller dedups against the rank's
    /// refcounted active prompt blocks).
    pub new_blocks_not_active: u64,
    /// Requests booked on this rank.
    pub active_requests: u64,
    /// The rank's KV-cache capacity in blocks (0 = unknown; the latency model's memory
    /// pressure term is then off).
    pub total_kv_blocks: u64,
}

/// The cost of one candidate, term by term (all in block equivalents). Useful for
/// explaining a decision and for tests; [`cost`](super::cost()) is its `cost` field.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostBreakdown {
    /// `(active_prefill_tokens + ISL) / B`.
    pub raw_prefill_blocks: f64,
    /// The device-credit decay factor in (0, 1] (1 when the decay is off).
    pub decay: f64,
    /// Total credit subtracted from the prefill term.
    pub credit_blocks: f64,
    /// `max(0, raw_prefill_blocks - credit_blocks)`.
    pub adjusted_prefill_blocks: f64,
    /// `active_decode_blocks + new_blocks_not_active`.
    pub decode_blocks: f64,
    /// `decode_active_request_weight * active_requests`.
    pub active_request_blocks: f64,
    /// `prefill_load_scale * adjusted_prefill_blocks + decode_blocks + active_request_blocks`.
    pub cost: f64,
}

/// The device-credit decay factor for candidate `c` (see [`CostConfig::credit_decay`]).
///
/// [`CostConfig::credit_decay`]: super::config::CostConfig::credit_decay
#[inline]
fn credit_decay_factor(cfg: &CostConfig, req: &RequestShape, c: &CandidateLoad) -> f64 {
    match cfg.credit_decay {
        Some(d) if d > 0.0 => {
            let excess_tokens = c
                .active_prefill_tokens
                .saturating_sub(req.min_active_prefill_tokens);
            let excess_blocks = excess_tokens as f64 / req.block_size_f64();
            let normalized = excess_blocks / req.request_blocks() as f64;
            1.0 / (1.0 + d * normalized)
        }
        _ => 1.0,
    }
}

/// The device-credit decay and the total cache credit of candidate `c`, in blocks: each
/// tier's cached blocks at its weight (both models read the cache through this).
#[inline]
pub(super) fn credit(cfg: &CostConfig, req: &RequestShape, c: &CandidateLoad) -> (f64, f64) {
    let decay = credit_decay_factor(cfg, req, c);
    let blocks = weighted_credit(
        credit_weights(cfg, decay),
        [
            c.device_blocks as f64,
            c.host_blocks as f64,
            c.disk_blocks as f64,
            c.shared_blocks_beyond_device as f64,
        ],
    );
    (decay, blocks)
}

/// The credit per cached device block (under `decay`), host block, disk block and shared
/// block beyond the device prefix.
#[inline]
pub(super) fn credit_weights(cfg: &CostConfig, decay: f64) -> [f64; 4] {
    [
        cfg.overlap_score_credit * decay,
        cfg.host_cache_hit_weight,
        cfg.disk_cache_hit_weight,
        cfg.shared_cache_multiplier,
    ]
}

/// The credit, in blocks, of `blocks` (device, host, disk, shared) at `weights`
/// ([`credit_weights`]).
#[inline(always)]
pub(super) fn weighted_credit(weights: [f64; 4], blocks: [f64; 4]) -> f64 {
    let ([d, h, k, s], [bd, bh, bk, bs]) = (weights, blocks);
    d * bd + h * bh + k * bk + s * bs
}

/// Dynamo's cost of placing the request on candidate `c` ([`CostModel::Dynamo`](super::CostModel::Dynamo)), with
/// every term (REFERENCE.md §3), in block equivalents.
///
/// ```text
/// credit  = overlap_score_credit * decay * device
///         + host_w * host + disk_w * disk + shared_mult * shared_beyond_device
/// prefill = (active_prefill_tokens + ISL) / B
/// decode  = active_decode_blocks + new_blocks_not_active
/// cost    = prefill_load_scale * max(0, prefill - credit) + decode
///         + decode_active_request_weight * active_requests
/// ```
///
/// Dynamo uses `ISL / B` for a rank it has no load entry for; with no bookings
/// `active_prefill_tokens` is 0 and the formula gives exactly that, so no special case is
/// needed. The prefill term is fractional (no rounding), as in Dynamo. The clamp at 0
/// keeps a rank whose cache covers more than the outstanding prefill from looking
/// *cheaper* than free prefill, so among fully cached ranks decode load decides.
#[inline]
pub fn cost_breakdown(cfg: &CostConfig, req: &RequestShape, c: &CandidateLoad) -> CostBreakdown {
    let b = req.block_size_f64();
    let (decay, credit_blocks) = credit(cfg, req, c);
    // Sum in f64: u64 + u64 could overflow on absurd inputs; f64 cannot.
    let raw_prefill_blocks = (c.active_prefill_tokens as f64 + req.isl_tokens as f64) / b;
    let adjusted_prefill_blocks = (raw_prefill_blocks - credit_blocks).max(0.0);
    let decode_blocks = c.active_decode_blocks as f64 + c.new_blocks_not_active as f64;
    let active_request_blocks = cfg.decode_active_request_weight * c.active_requests as f64;
    let cost =
        cfg.prefill_load_scale * adjusted_prefill_blocks + decode_blocks + active_request_blocks;
    CostBreakdown {
        raw_prefill_blocks,
        decay,
        credit_blocks,
        adjusted_prefill_blocks,
        decode_blocks,
        active_request_blocks,
        cost,
    }
}

/// The minimum `active_prefill_tokens` over `candidates` (0 for an empty slice): the
/// reference point of the credit decay.
#[inline]
pub fn min_active_prefill_tokens(candidates: &[CandidateLoad]) -> u64 {
    candidates
        .iter()
        .map(|c| c.active_prefill_tokens)
        .min()
        .unwrap_or(0)
}

/// Dynamo's 2025 default for the classic formula's `overlap_score_weight`.
pub const CLASSIC_OVERLAP_SCORE_WEIGHT: f64 = 1.0;

/// The older (2025) Dynamo logit, kept for the `dynamo-classic` policy (REFERENCE.md §3):
///
/// ```text
/// logit = overlap_score_weight * (active_prefill_tokens + ISL - overlap * B) / B
///       + active_decode_blocks + new_blocks_not_active
/// ```
///
/// `overlap` is the device prefix (`c.device_blocks`); the classic router knew no other
/// tier, so host/disk/shared hits and the new knobs are ignored. As in Dynamo's
/// `new_tokens`, `ISL - overlap * B` saturates at 0 (a cached prefix longer than the
/// prompt, e.g. after a block-size mismatch, adds no prefill rather than subtracting).
/// Lower is better; [`choose`] picks among these exactly as among [`cost`](super::cost())s.
///
/// [`choose`]: super::choose
#[inline]
pub fn classic_logit(overlap_score_weight: f64, req: &RequestShape, c: &CandidateLoad) -> f64 {
    let bs = u64::from(req.block_size.max(1));
    let cached_tokens = c.device_blocks.saturating_mul(bs);
    let new_tokens = req.isl_tokens.saturating_sub(cached_tokens);
    let prefill_blocks = (c.active_prefill_tokens as f64 + new_tokens as f64) / bs as f64;
    overlap_score_weight * prefill_blocks
        + c.active_decode_blocks as f64
        + c.new_blocks_not_active as f64
}
