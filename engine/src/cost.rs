//! Cost → choice: Dynamo's per-rank cost function and the temperature-controlled pick.
//!
//! This is step 5 of selection (DESIGN.md §7): given, for every surviving candidate rank,
//! its cached prefix (per tier), the host's shared-cache hits beyond it, and the engine's
//! live bookings on it, compute a cost in *block equivalents* (lower wins), then choose.
//! The formula is Dynamo's current default scorer, reproduced term for term from
//! REFERENCE.md §3 so that kvr routes exactly as a Dynamo router configured the same way
//! would; the booking terms it reads (active prefill tokens, active decode blocks with
//! shared prompt blocks counted once per rank) are REFERENCE.md §4.
//!
//! Everything here is a pure function of its arguments: no I/O, no locks, no allocation.
//! The caller owns any buffers ([`fill_costs`] writes into a slice it is given) and the
//! random source ([`SelectionRng`], or anything implementing [`RandomSource`]), which is
//! what makes selection reproducible in tests and replays.

/// Dynamo's default weights and knobs for the cost function (REFERENCE.md §3).
///
/// The defaults are Dynamo's current ones, so an unconfigured kvr scores candidates the
/// way an unconfigured Dynamo router does. Per-request [`CostOverrides`] are folded in by
/// [`CostConfig::resolve`], which yields the [`ResolvedCost`] the hot path reads.
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

impl CostConfig {
    /// Folds per-request overrides into the configured values: an override that is `Some`
    /// wins, `None` keeps the configured value (REFERENCE.md §3: overrides exist for the
    /// credit, the prefill scale, the temperature and the shared multiplier; the tier
    /// weights, the active-request weight and the decay are deployment-wide).
    ///
    /// Values are taken as given (no clamping): validating knobs is the configuration
    /// layer's job, and the functions here stay total for any input (see [`choose`] for
    /// how odd temperatures and NaN costs are handled).
    #[inline]
    pub fn resolve(&self, overrides: &CostOverrides) -> ResolvedCost {
        ResolvedCost {
            overlap_score_credit: overrides
                .overlap_score_credit
                .unwrap_or(self.overlap_score_credit),
            prefill_load_scale: overrides
                .prefill_load_scale
                .unwrap_or(self.prefill_load_scale),
            host_cache_hit_weight: self.host_cache_hit_weight,
            disk_cache_hit_weight: self.disk_cache_hit_weight,
            shared_cache_multiplier: overrides
                .shared_cache_multiplier
                .unwrap_or(self.shared_cache_multiplier),
            temperature: overrides.temperature.unwrap_or(self.temperature),
            decode_active_request_weight: self.decode_active_request_weight,
            credit_decay: self.credit_decay,
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

/// The effective knobs for one selection: a [`CostConfig`] with a request's
/// [`CostOverrides`] applied (see [`CostConfig::resolve`]). Field meanings are those of
/// [`CostConfig`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ResolvedCost {
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub shared_cache_multiplier: f64,
    pub temperature: f64,
    pub decode_active_request_weight: f64,
    pub credit_decay: Option<f64>,
}

impl Default for ResolvedCost {
    fn default() -> Self {
        CostConfig::default().resolve(&CostOverrides::NONE)
    }
}

impl From<&CostConfig> for ResolvedCost {
    fn from(cfg: &CostConfig) -> Self {
        cfg.resolve(&CostOverrides::NONE)
    }
}

/// The request-side inputs of the cost: prompt length, block size, and the one
/// selection-wide quantity the decay needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestShape {
    /// Prompt length in tokens (ISL).
    pub isl_tokens: u64,
    /// Tokens per KV block (B). 0 is treated as 1 so the functions stay total.
    pub block_size: u32,
    /// Minimum `active_prefill_tokens` over this selection's eligible candidates; only the
    /// credit decay reads it (see [`CostConfig::credit_decay`]). [`fill_costs`] computes it
    /// itself; callers of [`cost`] on single candidates must set it (0 is correct when
    /// the decay is off, and makes the decay absolute rather than relative when it is on).
    pub min_active_prefill_tokens: u64,
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
        }
    }

    /// The same request with the selection-wide prefill minimum set.
    #[inline]
    pub const fn with_min_active_prefill_tokens(mut self, min: u64) -> Self {
        self.min_active_prefill_tokens = min;
        self
    }

    /// B as a float, with 0 treated as 1.
    #[inline]
    fn block_size_f64(&self) -> f64 {
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
}

/// The cost of one candidate, term by term (all in block equivalents). Useful for
/// explaining a decision and for tests; [`cost`] is its `cost` field.
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
#[inline]
fn credit_decay_factor(cfg: &ResolvedCost, req: &RequestShape, c: &CandidateLoad) -> f64 {
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

/// The cost of placing the request on candidate `c`, with every term (REFERENCE.md §3).
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
pub fn cost_breakdown(cfg: &ResolvedCost, req: &RequestShape, c: &CandidateLoad) -> CostBreakdown {
    let b = req.block_size_f64();
    let decay = credit_decay_factor(cfg, req, c);
    let credit_blocks = cfg.overlap_score_credit * decay * c.device_blocks as f64
        + cfg.host_cache_hit_weight * c.host_blocks as f64
        + cfg.disk_cache_hit_weight * c.disk_blocks as f64
        + cfg.shared_cache_multiplier * c.shared_blocks_beyond_device as f64;
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

/// The cost of placing the request on candidate `c` (lower wins). REFERENCE.md §3; see
/// [`cost_breakdown`] for the terms.
#[inline]
pub fn cost(cfg: &ResolvedCost, req: &RequestShape, c: &CandidateLoad) -> f64 {
    cost_breakdown(cfg, req, c).cost
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

/// Costs of all `candidates` into `out` (same order), with the decay's selection-wide
/// minimum computed from `candidates` (overriding `req.min_active_prefill_tokens`).
/// `candidates` must be exactly the eligible set, as in Dynamo: the minimum is taken over
/// the ranks that can actually be chosen.
///
/// # Panics
/// If `out.len() != candidates.len()` (a caller bug; silently truncating would drop
/// candidates from the choice).
pub fn fill_costs(
    cfg: &ResolvedCost,
    req: &RequestShape,
    candidates: &[CandidateLoad],
    out: &mut [f64],
) {
    assert_eq!(
        out.len(),
        candidates.len(),
        "fill_costs: output slice length must match the candidate count"
    );
    let req = req.with_min_active_prefill_tokens(min_active_prefill_tokens(candidates));
    for (slot, c) in out.iter_mut().zip(candidates) {
        *slot = cost(cfg, &req, c);
    }
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
/// Lower is better; [`choose`] picks among these exactly as among [`cost`]s.
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

/// A source of uniform random bits for [`choose`]: the small part of an RNG interface
/// selection needs. Implemented by [`SelectionRng`]; hosts may plug in their own.
pub trait RandomSource {
    /// 64 uniformly random bits.
    fn next_u64(&mut self) -> u64;

    /// Uniform in [0, 1): the top 53 bits of [`next_u64`](Self::next_u64) scaled by 2^-53.
    #[inline]
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n`, without modulo bias (Lemire's multiply-and-reject). Returns 0 for
    /// `n == 0` rather than panicking (callers never ask for that).
    #[inline]
    fn below(&mut self, n: u64) -> u64 {
        if n <= 1 {
            return 0;
        }
        let mut m = u128::from(self.next_u64()) * u128::from(n);
        let mut low = m as u64;
        if low < n {
            // 2^64 mod n: the size of the biased sliver at the bottom of each bucket.
            let threshold = n.wrapping_neg() % n;
            while low < threshold {
                m = u128::from(self.next_u64()) * u128::from(n);
                low = m as u64;
            }
        }
        (m >> 64) as u64
    }
}

impl<R: RandomSource + ?Sized> RandomSource for &mut R {
    #[inline]
    fn next_u64(&mut self) -> u64 {
        (**self).next_u64()
    }
}

/// A tiny seedable RNG (SplitMix64) so selection is deterministic under a fixed seed.
///
/// Why SplitMix64: 8 bytes of state, a handful of instructions per draw, every seed
/// (including 0) gives a full-period, well-mixed stream, and it needs no dependency. It
/// is not cryptographic, which selection does not need. It is not `Sync`-shared: keep one
/// per thread (or per selection) and seed it from wherever determinism is wanted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectionRng {
    state: u64,
}

impl SelectionRng {
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    /// An RNG whose whole output stream is a function of `seed`.
    #[inline]
    pub const fn from_seed(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(Self::GAMMA);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        RandomSource::next_f64(self)
    }
}

impl RandomSource for SelectionRng {
    #[inline]
    fn next_u64(&mut self) -> u64 {
        SelectionRng::next_u64(self)
    }
}

/// The ordering key of a cost: NaN counts as +inf (the worst cost), so a NaN can never
/// win and never poisons a comparison.
#[inline]
fn key(c: f64) -> f64 {
    if c.is_nan() {
        f64::INFINITY
    } else {
        c
    }
}

/// The index of the `r`-th (0-based) cost whose key equals `target`.
#[inline]
fn nth_with_key(costs: &[f64], target: f64, r: u64) -> Option<usize> {
    costs
        .iter()
        .enumerate()
        .filter(|&(_, &c)| key(c) == target)
        .nth(usize::try_from(r).ok()?)
        .map(|(i, _)| i)
}

/// Argmin with a uniform random choice among exact ties (`temperature == 0`).
fn choose_argmin<R: RandomSource + ?Sized>(costs: &[f64], rng: &mut R) -> Option<usize> {
    let mut best = f64::INFINITY;
    let mut ties: u64 = 0;
    let mut first = 0;
    for (i, &c) in costs.iter().enumerate() {
        let k = key(c);
        if ties == 0 || k < best {
            best = k;
            ties = 1;
            first = i;
        } else if k == best {
            ties += 1;
        }
    }
    match ties {
        0 => None,
        1 => Some(first),
        n => nth_with_key(costs, best, rng.below(n)),
    }
}

/// Softmax over range-normalised costs (`temperature > 0`); see [`choose`].
fn choose_softmax<R: RandomSource + ?Sized>(
    costs: &[f64],
    temperature: f64,
    rng: &mut R,
) -> Option<usize> {
    // Pass 1: the minimum key, and the maximum among finite keys.
    let mut lo = f64::INFINITY;
    let mut hi_finite = f64::NEG_INFINITY;
    for &c in costs {
        let k = key(c);
        lo = lo.min(k);
        if k.is_finite() {
            hi_finite = hi_finite.max(k);
        }
    }
    if !lo.is_finite() {
        // lo = +inf: every cost is +inf/NaN; lo = -inf: the -inf ones dominate any
        // finite range. Either way: uniform among the entries at `lo`.
        return choose_argmin(costs, rng);
    }
    // Work in halves: `0.5 * a - 0.5 * b` is exactly half of `a - b` for normal floats but
    // cannot overflow, so costs spanning more than f64::MAX still normalise correctly.
    let half_range = 0.5 * hi_finite - 0.5 * lo;
    if half_range <= 0.0 {
        // All finite costs equal: uniform among them (+inf/NaN excluded).
        return choose_argmin(costs, rng);
    }
    // weight = exp(-((k - lo) / (max - min)) / T) in (0, 1]; the minimum has weight 1, so
    // the sum is >= 1 and never underflows to 0. +inf/NaN costs get weight 0.
    let weight = |c: f64| {
        let k = key(c);
        if k.is_finite() {
            (-((0.5 * k - 0.5 * lo) / half_range) / temperature).exp()
        } else {
            0.0
        }
    };
    // Pass 2: the normaliser. Pass 3: invert the CDF. Recomputing exp beats allocating.
    let total: f64 = costs.iter().map(|&c| weight(c)).sum();
    let u = rng.next_f64() * total;
    let mut cumulative = 0.0;
    let mut last_positive = None;
    for (i, &c) in costs.iter().enumerate() {
        let w = weight(c);
        if w > 0.0 {
            cumulative += w;
            last_positive = Some(i);
            if u < cumulative {
                return Some(i);
            }
        }
    }
    // Rounding can leave u just above the accumulated sum: give it to the last candidate
    // with positive weight (never to a +inf/NaN one).
    last_positive
}

/// Chooses one index from `costs` (lower is better), per DESIGN.md §7 step 5 and
/// REFERENCE.md §3.
///
/// * `temperature == 0`: the minimum cost; exact ties are broken **uniformly at random**
///   (not first-wins, which would bias load towards low rank ids whenever several ranks
///   look identical, e.g. an idle cluster). Consumes one draw only when there is a tie.
/// * `temperature > 0`: samples `i` with `p_i ∝ exp(-(cost_i - min) / ((max - min) * T))`.
///   Normalising by the range makes `T` scale-free: `T` is "how much of the spread between
///   best and worst to ignore", whatever the absolute size of the costs. All costs equal →
///   uniform. `T = +inf` → uniform.
/// * Empty `costs` → `None`; otherwise always `Some`.
///
/// Non-finite inputs never panic:
/// * a NaN cost is treated as `+inf` (the worst), so it is chosen only when every cost is
///   `+inf`/NaN (then uniformly among all);
/// * under softmax, `+inf`/NaN costs get probability 0 and the range is taken over the
///   finite costs; if any cost is `-inf`, the choice is uniform among the `-inf` ones (the
///   limit of the formula);
/// * a negative or NaN temperature is treated as 0 (argmin).
pub fn choose<R: RandomSource + ?Sized>(
    costs: &[f64],
    temperature: f64,
    rng: &mut R,
) -> Option<usize> {
    if costs.is_empty() {
        return None;
    }
    if temperature > 0.0 {
        choose_softmax(costs, temperature, rng)
    } else {
        choose_argmin(costs, rng)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    fn defaults() -> ResolvedCost {
        ResolvedCost::default()
    }

    #[test]
    fn defaults_match_dynamo() {
        let c = CostConfig::default();
        assert_eq!(c.overlap_score_credit, 1.0);
        assert_eq!(c.prefill_load_scale, 1.0);
        assert_eq!(c.host_cache_hit_weight, 0.75);
        assert_eq!(c.disk_cache_hit_weight, 0.25);
        assert_eq!(c.shared_cache_multiplier, 0.0);
        assert_eq!(c.temperature, 0.0);
        assert_eq!(c.decode_active_request_weight, 0.0);
        assert_eq!(c.credit_decay, None);
        assert_eq!(ResolvedCost::from(&c), c.resolve(&CostOverrides::NONE));
    }

    #[test]
    fn no_load() {
        // ISL 100, B 16: prefill 6.25; 7 new blocks; no credit.
        let req = RequestShape::new(100, 16);
        let c = CandidateLoad {
            new_blocks_not_active: 7,
            ..Default::default()
        };
        let b = cost_breakdown(&defaults(), &req, &c);
        assert!(close(b.raw_prefill_blocks, 6.25));
        assert!(close(b.credit_blocks, 0.0));
        assert!(close(b.decode_blocks, 7.0));
        assert!(close(b.cost, 13.25));
        assert!(close(cost(&defaults(), &req, &c), 13.25));
    }

    #[test]
    fn loaded_with_device_credit() {
        // (64 + 100)/16 = 10.25; credit 4 → 6.25; decode 10 + 7 = 17 → 23.25.
        let req = RequestShape::new(100, 16);
        let c = CandidateLoad {
            device_blocks: 4,
            active_prefill_tokens: 64,
            active_decode_blocks: 10,
            new_blocks_not_active: 7,
            ..Default::default()
        };
        assert!(close(cost(&defaults(), &req, &c), 23.25));
    }

    #[test]
    fn host_and_disk_credit() {
        // ISL 160, B 16 → 10; credit 2 + 0.75*4 + 0.25*4 = 6 → 4; decode 10 → 14.
        let req = RequestShape::new(160, 16);
        let c = CandidateLoad {
            device_blocks: 2,
            host_blocks: 4,
            disk_blocks: 4,
            new_blocks_not_active: 10,
            ..Default::default()
        };
        let b = cost_breakdown(&defaults(), &req, &c);
        assert!(close(b.credit_blocks, 6.0));
        assert!(close(b.cost, 14.0));
    }

    #[test]
    fn shared_multiplier() {
        let req = RequestShape::new(160, 16);
        let c = CandidateLoad {
            device_blocks: 2,
            shared_blocks_beyond_device: 4,
            new_blocks_not_active: 10,
            ..Default::default()
        };
        // Default multiplier 0: shared hits ignored → 10 - 2 + 10 = 18.
        assert!(close(cost(&defaults(), &req, &c), 18.0));
        let cfg = CostConfig {
            shared_cache_multiplier: 0.5,
            ..Default::default()
        }
        .resolve(&CostOverrides::NONE);
        // credit 2 + 0.5*4 = 4 → 6 + 10 = 16.
        assert!(close(cost(&cfg, &req, &c), 16.0));
    }

    #[test]
    fn credit_above_prefill_clamps_to_zero() {
        // prefill 10, credit 10 + 0.75*4 = 13 → max(0, -3) = 0; cost = decode only.
        let req = RequestShape::new(160, 16);
        let c = CandidateLoad {
            device_blocks: 10,
            host_blocks: 4,
            active_decode_blocks: 5,
            new_blocks_not_active: 0,
            ..Default::default()
        };
        let b = cost_breakdown(&defaults(), &req, &c);
        assert!(close(b.adjusted_prefill_blocks, 0.0));
        assert!(close(b.cost, 5.0));
    }

    #[test]
    fn prefill_scale_and_active_request_weight() {
        let cfg = CostConfig {
            prefill_load_scale: 2.0,
            decode_active_request_weight: 3.0,
            ..Default::default()
        }
        .resolve(&CostOverrides::NONE);
        // prefill (32 + 160)/16 = 12, credit 2 → 10, scaled 20; decode 4 + 10; requests 2*3.
        let req = RequestShape::new(160, 16);
        let c = CandidateLoad {
            device_blocks: 2,
            active_prefill_tokens: 32,
            active_decode_blocks: 4,
            new_blocks_not_active: 10,
            active_requests: 2,
            ..Default::default()
        };
        assert!(close(cost(&cfg, &req, &c), 20.0 + 14.0 + 6.0));
    }

    #[test]
    fn decay_on() {
        let cfg = CostConfig {
            credit_decay: Some(1.0),
            ..Default::default()
        }
        .resolve(&CostOverrides::NONE);
        // ISL 160, B 16: request_blocks 10. Candidate: 320 active prefill tokens, 6 device.
        let c = CandidateLoad {
            device_blocks: 6,
            active_prefill_tokens: 320,
            new_blocks_not_active: 10,
            ..Default::default()
        };
        // Minimum 0: excess 20 blocks / 10 = 2 → decay 1/3 → credit 2;
        // prefill (320 + 160)/16 = 30 → 28; + decode 10 = 38.
        let req = RequestShape::new(160, 16);
        let b = cost_breakdown(&cfg, &req, &c);
        assert!(close(b.decay, 1.0 / 3.0));
        assert!(close(b.credit_blocks, 2.0));
        assert!(close(b.cost, 38.0));
        // Minimum 160: excess 10 blocks / 10 = 1 → decay 1/2 → credit 3 → 27 + 10 = 37.
        let req = req.with_min_active_prefill_tokens(160);
        let b = cost_breakdown(&cfg, &req, &c);
        assert!(close(b.decay, 0.5));
        assert!(close(b.cost, 37.0));
        // The least-loaded rank keeps its full credit.
        let req = req.with_min_active_prefill_tokens(320);
        assert!(close(cost_breakdown(&cfg, &req, &c).decay, 1.0));
        // Decay only touches device credit: host credit is unchanged.
        let h = CandidateLoad {
            host_blocks: 4,
            ..c
        };
        let req = RequestShape::new(160, 16);
        assert!(close(
            cost_breakdown(&cfg, &req, &h).credit_blocks,
            2.0 + 3.0
        ));
        // Off (None) and non-positive coefficients give decay 1.
        for d in [None, Some(0.0), Some(-1.0), Some(f64::NAN)] {
            let cfg = ResolvedCost {
                credit_decay: d,
                ..cfg
            };
            assert!(close(cost_breakdown(&cfg, &req, &c).decay, 1.0));
        }
    }

    #[test]
    fn fill_costs_uses_the_batch_minimum() {
        let cfg = CostConfig {
            credit_decay: Some(1.0),
            ..Default::default()
        }
        .resolve(&CostOverrides::NONE);
        let req = RequestShape::new(160, 16);
        let cands = [
            CandidateLoad {
                device_blocks: 6,
                active_prefill_tokens: 320,
                new_blocks_not_active: 10,
                ..Default::default()
            },
            CandidateLoad {
                active_prefill_tokens: 160,
                new_blocks_not_active: 10,
                ..Default::default()
            },
        ];
        let mut out = [0.0; 2];
        fill_costs(&cfg, &req, &cands, &mut out);
        assert_eq!(min_active_prefill_tokens(&cands), 160);
        assert!(close(out[0], 37.0));
        // (160 + 160)/16 = 20 + 10.
        assert!(close(out[1], 30.0));
        assert_eq!(min_active_prefill_tokens(&[]), 0);
    }

    #[test]
    #[should_panic(expected = "output slice length")]
    fn fill_costs_rejects_mismatched_output() {
        let mut out = [0.0; 1];
        fill_costs(
            &defaults(),
            &RequestShape::new(16, 16),
            &[CandidateLoad::default(); 2],
            &mut out,
        );
    }

    #[test]
    fn zero_block_size_and_zero_isl_are_total() {
        let cfg = CostConfig {
            credit_decay: Some(1.0),
            ..Default::default()
        }
        .resolve(&CostOverrides::NONE);
        let c = CandidateLoad {
            device_blocks: 1,
            active_prefill_tokens: 8,
            ..Default::default()
        };
        assert!(cost(&cfg, &RequestShape::new(10, 0), &c).is_finite());
        assert!(cost(&cfg, &RequestShape::new(0, 16), &c).is_finite());
        assert_eq!(RequestShape::new(0, 16).request_blocks(), 1);
        assert_eq!(RequestShape::new(17, 16).request_blocks(), 2);
    }

    #[test]
    fn overrides_take_precedence() {
        let cfg = CostConfig {
            overlap_score_credit: 2.0,
            prefill_load_scale: 3.0,
            temperature: 0.7,
            shared_cache_multiplier: 0.1,
            host_cache_hit_weight: 0.5,
            credit_decay: Some(2.0),
            ..Default::default()
        };
        let none = cfg.resolve(&CostOverrides::default());
        assert_eq!(none.overlap_score_credit, 2.0);
        assert_eq!(none.prefill_load_scale, 3.0);
        assert_eq!(none.temperature, 0.7);
        assert_eq!(none.shared_cache_multiplier, 0.1);

        let r = cfg.resolve(&CostOverrides {
            overlap_score_credit: Some(0.0),
            prefill_load_scale: Some(1.5),
            temperature: Some(0.0),
            shared_cache_multiplier: Some(1.0),
        });
        assert_eq!(r.overlap_score_credit, 0.0);
        assert_eq!(r.prefill_load_scale, 1.5);
        assert_eq!(r.temperature, 0.0);
        assert_eq!(r.shared_cache_multiplier, 1.0);
        // Not overridable: kept from the config.
        assert_eq!(r.host_cache_hit_weight, 0.5);
        assert_eq!(r.credit_decay, Some(2.0));

        // And the override changes the cost: credit 0 ignores the device prefix.
        let req = RequestShape::new(160, 16);
        let c = CandidateLoad {
            device_blocks: 4,
            new_blocks_not_active: 10,
            ..Default::default()
        };
        // 1.5 * 10 + 10 = 25.
        assert!(close(cost(&r, &req, &c), 25.0));
        // Partial override: only the temperature.
        let t = cfg.resolve(&CostOverrides {
            temperature: Some(2.0),
            ..CostOverrides::NONE
        });
        assert_eq!(t.temperature, 2.0);
        assert_eq!(t.overlap_score_credit, 2.0);
    }

    #[test]
    fn classic_logit_formula() {
        // (32 + 100 - 4*16)/16 = 4.25; + 5 + 3 = 12.25.
        let req = RequestShape::new(100, 16);
        let c = CandidateLoad {
            device_blocks: 4,
            host_blocks: 100, // ignored by the classic formula
            active_prefill_tokens: 32,
            active_decode_blocks: 5,
            new_blocks_not_active: 3,
            ..Default::default()
        };
        assert!(close(
            classic_logit(CLASSIC_OVERLAP_SCORE_WEIGHT, &req, &c),
            12.25
        ));
        assert!(close(classic_logit(2.0, &req, &c), 16.5));
        // Overlap beyond the prompt saturates: new tokens 0 → 32/16 = 2 + 8.
        let over = CandidateLoad {
            device_blocks: 10,
            ..c
        };
        assert!(close(classic_logit(1.0, &req, &over), 10.0));
    }

    #[test]
    fn rng_is_deterministic_and_in_range() {
        let mut a = SelectionRng::from_seed(42);
        let mut b = SelectionRng::from_seed(42);
        let mut c = SelectionRng::from_seed(43);
        let xs: Vec<u64> = (0..16).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..16).map(|_| b.next_u64()).collect();
        let zs: Vec<u64> = (0..16).map(|_| c.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
        // Seed 0 is fine (no all-zero stream).
        let mut z = SelectionRng::from_seed(0);
        assert_ne!(z.next_u64(), 0);
        let mut r = SelectionRng::from_seed(7);
        for _ in 0..100_000 {
            let f = r.next_f64();
            assert!((0.0..1.0).contains(&f));
            assert!(r.below(3) < 3);
        }
        assert_eq!(r.below(0), 0);
        assert_eq!(r.below(1), 0);
    }

    #[test]
    fn empty_is_none() {
        let mut rng = SelectionRng::from_seed(1);
        assert_eq!(choose(&[], 0.0, &mut rng), None);
        assert_eq!(choose(&[], 1.0, &mut rng), None);
    }

    #[test]
    fn argmin_picks_the_minimum() {
        for seed in 0..100 {
            let mut rng = SelectionRng::from_seed(seed);
            assert_eq!(choose(&[3.0, 1.0, 2.0], 0.0, &mut rng), Some(1));
            assert_eq!(choose(&[0.5], 0.0, &mut rng), Some(0));
            assert_eq!(choose(&[-1.0, 4.0, -1.5], 0.0, &mut rng), Some(2));
        }
    }

    fn frequencies(costs: &[f64], t: f64, draws: usize, seed: u64) -> Vec<f64> {
        let mut rng = SelectionRng::from_seed(seed);
        let mut counts = vec![0usize; costs.len()];
        for _ in 0..draws {
            counts[choose(costs, t, &mut rng).unwrap()] += 1;
        }
        counts.iter().map(|&n| n as f64 / draws as f64).collect()
    }

    fn assert_uniform_over(freq: &[f64], idx: &[usize]) {
        let p = 1.0 / idx.len() as f64;
        for (i, &f) in freq.iter().enumerate() {
            if idx.contains(&i) {
                assert!(
                    (f - p).abs() <= 0.05 * p,
                    "index {i}: {f} vs {p} ({freq:?})"
                );
            } else {
                assert_eq!(f, 0.0, "index {i} must never win ({freq:?})");
            }
        }
    }

    #[test]
    fn tie_break_is_uniform() {
        // Three tied minima among five: each ~1/3 over 30,000 draws (σ ≈ 0.8 %).
        let freq = frequencies(&[5.0, 1.0, 1.0, 9.0, 1.0], 0.0, 30_000, 11);
        assert_uniform_over(&freq, &[1, 2, 4]);
    }

    #[test]
    fn softmax_matches_the_formula() {
        let costs = [10.0, 11.0, 12.0];
        for t in [0.5f64, 2.0] {
            // p_i ∝ exp(-(c_i - 10) / (2 * t)).
            let w: Vec<f64> = costs
                .iter()
                .map(|&c: &f64| (-(c - 10.0) / (2.0 * t)).exp())
                .collect();
            let s: f64 = w.iter().sum();
            let freq = frequencies(&costs, t, 100_000, 5);
            for i in 0..3 {
                let p = w[i] / s;
                assert!(
                    (freq[i] - p).abs() < 0.01,
                    "T={t} i={i}: {} vs {p}",
                    freq[i]
                );
            }
        }
    }

    /// A random source that always returns the same fraction, to test the CDF inversion.
    struct Fixed(f64);
    impl RandomSource for Fixed {
        fn next_u64(&mut self) -> u64 {
            unreachable!("only next_f64 is used by softmax")
        }
        fn next_f64(&mut self) -> f64 {
            self.0
        }
    }

    #[test]
    fn softmax_inverts_the_cdf_exactly() {
        // T = 0.5, range 2: weights 1, e^-1, e^-2 → p ≈ 0.665, 0.245, 0.090.
        let costs = [0.0, 1.0, 2.0];
        let s = 1.0 + (-1.0f64).exp() + (-2.0f64).exp();
        let p0 = 1.0 / s;
        let p1 = (-1.0f64).exp() / s;
        assert_eq!(choose(&costs, 0.5, &mut Fixed(0.0)), Some(0));
        assert_eq!(choose(&costs, 0.5, &mut Fixed(p0 - 1e-6)), Some(0));
        assert_eq!(choose(&costs, 0.5, &mut Fixed(p0 + 1e-6)), Some(1));
        assert_eq!(choose(&costs, 0.5, &mut Fixed(p0 + p1 - 1e-6)), Some(1));
        assert_eq!(choose(&costs, 0.5, &mut Fixed(p0 + p1 + 1e-6)), Some(2));
        // Even an out-of-contract 1.0 lands on a valid candidate.
        assert_eq!(choose(&costs, 0.5, &mut Fixed(1.0)), Some(2));
        // Scale-free: multiplying every cost leaves the choice unchanged.
        let scaled = [0.0, 100.0, 200.0];
        assert_eq!(choose(&scaled, 0.5, &mut Fixed(p0 + 1e-6)), Some(1));
        // A range wider than f64::MAX does not overflow: same weights as [0, 1, 2].
        let huge = [-f64::MAX, 0.0, f64::MAX];
        assert_eq!(choose(&huge, 0.5, &mut Fixed(p0 - 1e-6)), Some(0));
        assert_eq!(choose(&huge, 0.5, &mut Fixed(p0 + 1e-6)), Some(1));
        assert_eq!(choose(&huge, 0.5, &mut Fixed(p0 + p1 + 1e-6)), Some(2));
    }

    #[test]
    fn softmax_all_equal_is_uniform() {
        let freq = frequencies(&[4.0, 4.0, 4.0], 1.0, 30_000, 3);
        assert_uniform_over(&freq, &[0, 1, 2]);
        // Infinite temperature is uniform too.
        let freq = frequencies(&[1.0, 2.0, 3.0], f64::INFINITY, 30_000, 4);
        assert_uniform_over(&freq, &[0, 1, 2]);
    }

    #[test]
    fn nan_and_infinities_never_panic() {
        let mut rng = SelectionRng::from_seed(9);
        for t in [0.0, 0.5, 2.0] {
            for _ in 0..1_000 {
                // NaN is the worst cost: never chosen while a real cost exists.
                assert_eq!(choose(&[f64::NAN, 2.0, 1.0], 0.0, &mut rng), Some(2));
                let i = choose(&[f64::NAN, 2.0, 1.0], t, &mut rng).unwrap();
                assert_ne!(i, 0);
                // +inf likewise.
                let i = choose(&[0.0, f64::INFINITY, 1.0], t, &mut rng).unwrap();
                assert_ne!(i, 1);
                // -inf wins outright.
                assert_eq!(choose(&[1.0, f64::NEG_INFINITY, 0.0], t, &mut rng), Some(1));
                // All NaN / +inf: still a valid index.
                let i = choose(&[f64::NAN, f64::NAN, f64::INFINITY], t, &mut rng).unwrap();
                assert!(i < 3);
                // A single finite cost among NaNs under softmax (zero finite range).
                assert_eq!(choose(&[f64::NAN, 3.0], t, &mut rng), Some(1));
            }
        }
        // All-NaN ties are broken uniformly, like any other tie.
        let freq = frequencies(&[f64::NAN; 3], 0.0, 30_000, 12);
        assert_uniform_over(&freq, &[0, 1, 2]);
        let freq = frequencies(&[f64::NAN; 3], 1.0, 30_000, 13);
        assert_uniform_over(&freq, &[0, 1, 2]);
    }

    #[test]
    fn odd_temperatures_mean_argmin() {
        let mut rng = SelectionRng::from_seed(2);
        for t in [-1.0, f64::NAN, -0.0] {
            for _ in 0..100 {
                assert_eq!(choose(&[3.0, 1.0, 2.0], t, &mut rng), Some(1));
            }
        }
    }

    #[test]
    fn deterministic_under_a_fixed_seed() {
        let costs = [3.0, 1.0, 1.0, 2.0, 1.0];
        let run = |seed: u64, t: f64| -> Vec<usize> {
            let mut rng = SelectionRng::from_seed(seed);
            (0..64)
                .map(|_| choose(&costs, t, &mut rng).unwrap())
                .collect()
        };
        for t in [0.0, 0.5] {
            assert_eq!(run(77, t), run(77, t));
            assert_ne!(run(77, t), run(78, t));
        }
        // A generic `&mut R` source works too (the blanket impl).
        let mut rng = SelectionRng::from_seed(77);
        let mut by_ref = &mut rng;
        assert!(choose(&costs, 0.0, &mut by_ref).is_some());
    }
}
