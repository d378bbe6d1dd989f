//! Selection's candidate inputs as columns, and the bounds of all of them in one pass.
//!
//! Why columns: selection prices every candidate once with the whole prompt counted new
//! (an upper bound, see `select/decide.rs`), so that count, and everything that depends
//! only on the request and the knobs, is the same for every candidate. The pass below
//! takes those out of the loop, and reads each input from its own array, which the
//! compiler turns into a loop two candidates at a time. Every value is computed by the
//! same operations in the same order as [`CostEval::bounds`] (a test checks it bit for
//! bit), so the choice cannot change.

use super::config::CostConfig;
use super::eval::CostEval;
use super::formula::{CandidateLoad, RequestShape};
use super::latency::LatencyPrep;

/// The eligible candidates' cost inputs, one array a field of [`CandidateLoad`], parallel
/// (the `k`-th of each is candidate `k`). Integers as the engine holds them, so
/// [`load`](Self::load) gives back exactly the record the single-candidate path prices.
#[derive(Clone, Debug, Default)]
pub(crate) struct LoadColumns {
    pub(crate) device: Vec<u32>,
    pub(crate) host: Vec<u32>,
    pub(crate) disk: Vec<u32>,
    pub(crate) shared: Vec<u32>,
    pub(crate) prefill_tokens: Vec<u64>,
    pub(crate) decode_blocks: Vec<u64>,
    pub(crate) requests: Vec<u64>,
    pub(crate) kv_blocks: Vec<u64>,
    /// Each candidate's `new_blocks_not_active` (set by the caller after the bounds pass).
    pub(crate) new_blocks: Vec<u64>,
}

/// One candidate's row of [`LoadColumns`] (all but `new_blocks`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LoadRow {
    pub(crate) device: u32,
    pub(crate) host: u32,
    pub(crate) disk: u32,
    pub(crate) shared: u32,
    pub(crate) prefill_tokens: u64,
    pub(crate) decode_blocks: u64,
    pub(crate) requests: u64,
    pub(crate) kv_blocks: u64,
}

impl LoadRow {
    /// The row as one candidate's record, with `new_blocks` of the prompt not active.
    #[inline]
    pub(crate) fn candidate(&self, new_blocks: u64) -> CandidateLoad {
        CandidateLoad {
            device_blocks: u64::from(self.device),
            host_blocks: u64::from(self.host),
            disk_blocks: u64::from(self.disk),
            shared_blocks_beyond_device: u64::from(self.shared),
            active_prefill_tokens: self.prefill_tokens,
            active_decode_blocks: self.decode_blocks,
            new_blocks_not_active: new_blocks,
            active_requests: self.requests,
            total_kv_blocks: self.kv_blocks,
        }
    }
}

/// The columns as slices of one length to fill by index: the slices are taken once, so
/// a row written in a loop is a few stores behind one length check, not a reload and a
/// check a column.
pub(crate) struct RowsMut<'a> {
    device: &'a mut [u32],
    host: &'a mut [u32],
    disk: &'a mut [u32],
    shared: &'a mut [u32],
    prefill_tokens: &'a mut [u64],
    decode_blocks: &'a mut [u64],
    requests: &'a mut [u64],
    kv_blocks: &'a mut [u64],
}

impl RowsMut<'_> {
    /// Writes row `m`. Panics if `m` is not below the length the rows were taken with.
    #[inline(always)]
    pub(crate) fn set(&mut self, m: usize, r: LoadRow) {
        self.device[m] = r.device;
        self.host[m] = r.host;
        self.disk[m] = r.disk;
        self.shared[m] = r.shared;
        self.prefill_tokens[m] = r.prefill_tokens;
        self.decode_blocks[m] = r.decode_blocks;
        self.requests[m] = r.requests;
        self.kv_blocks[m] = r.kv_blocks;
    }
}

impl LoadColumns {
    /// Every column `n` long, as slices to fill by index; [`truncate`](Self::truncate)
    /// to the rows written afterwards. Inlined, so the caller's writes see that every
    /// slice is `n` long (one bounds check a row, not one a column; a build that did not
    /// inline it spent about 1,300 more instructions a selection at 64 ranks).
    #[inline(always)]
    pub(crate) fn rows(&mut self, n: usize) -> RowsMut<'_> {
        self.resize(n);
        RowsMut {
            device: &mut self.device[..n],
            host: &mut self.host[..n],
            disk: &mut self.disk[..n],
            shared: &mut self.shared[..n],
            prefill_tokens: &mut self.prefill_tokens[..n],
            decode_blocks: &mut self.decode_blocks[..n],
            requests: &mut self.requests[..n],
            kv_blocks: &mut self.kv_blocks[..n],
        }
    }

    /// Every column `n` long (new entries zero).
    fn resize(&mut self, n: usize) {
        self.device.resize(n, 0);
        self.host.resize(n, 0);
        self.disk.resize(n, 0);
        self.shared.resize(n, 0);
        self.prefill_tokens.resize(n, 0);
        self.decode_blocks.resize(n, 0);
        self.requests.resize(n, 0);
        self.kv_blocks.resize(n, 0);
        self.new_blocks.resize(n, 0);
    }

    /// Appends a row (`new_blocks` 0, set by the caller later).
    pub(crate) fn push(&mut self, r: LoadRow) {
        self.device.push(r.device);
        self.host.push(r.host);
        self.disk.push(r.disk);
        self.shared.push(r.shared);
        self.prefill_tokens.push(r.prefill_tokens);
        self.decode_blocks.push(r.decode_blocks);
        self.requests.push(r.requests);
        self.kv_blocks.push(r.kv_blocks);
        self.new_blocks.push(0);
    }

    pub(crate) fn truncate(&mut self, n: usize) {
        self.device.truncate(n);
        self.host.truncate(n);
        self.disk.truncate(n);
        self.shared.truncate(n);
        self.prefill_tokens.truncate(n);
        self.decode_blocks.truncate(n);
        self.requests.truncate(n);
        self.kv_blocks.truncate(n);
        self.new_blocks.truncate(n);
    }

    pub(crate) fn len(&self) -> usize {
        self.device.len()
    }

    /// Candidate `k` as one record (`new_blocks_not_active` from `new_blocks`).
    #[inline]
    pub(crate) fn load(&self, k: usize) -> CandidateLoad {
        LoadRow {
            device: self.device[k],
            host: self.host[k],
            disk: self.disk[k],
            shared: self.shared[k],
            prefill_tokens: self.prefill_tokens[k],
            decode_blocks: self.decode_blocks[k],
            requests: self.requests[k],
            kv_blocks: self.kv_blocks[k],
        }
        .candidate(self.new_blocks[k])
    }

    /// `req` with the selection-wide quantities of these candidates, the same values as
    /// [`RequestShape::with_selection_stats`] over their records, in one pass. The mean
    /// is summed as integers (u128, so it cannot overflow): when the sum is at most 2^53
    /// every partial f64 sum would have been exact, so it equals the f64 sum in order,
    /// bit for bit, without its chain of dependent adds.
    pub(crate) fn selection_stats(&self, req: RequestShape) -> RequestShape {
        let p = &self.prefill_tokens;
        if p.is_empty() {
            return req.with_selection_stats(&[]);
        }
        let (min, sum) = p.iter().fold((u64::MAX, 0u128), |(min, sum), &x| {
            (min.min(x), sum + u128::from(x))
        });
        let sum = if sum <= 1 << f64::MANTISSA_DIGITS {
            sum as f64
        } else {
            p.iter().map(|&x| x as f64).sum::<f64>()
        };
        let mut s = req.with_min_active_prefill_tokens(min);
        s.mean_active_prefill_tokens = sum / p.len() as f64;
        s
    }
}

impl CostEval<'_> {
    /// Every candidate's [`bounds`](Self::bounds) with `new_blocks` blocks not active
    /// (the same count for all), into `upper` and `lower`; returns the least upper bound
    /// (NaNs ignored, as by `f64::min`).
    pub(crate) fn bounds_all(
        &self,
        cols: &LoadColumns,
        new_blocks: u64,
        upper: &mut Vec<f64>,
        lower: &mut Vec<f64>,
    ) -> f64 {
        let n = cols.len();
        upper.clear();
        upper.resize(n, 0.0);
        lower.clear();
        lower.resize(n, 0.0);
        let (cfg, req) = (self.cfg(), self.req());
        let k = Kernel {
            cfg: *cfg,
            req: *req,
            isl: req.isl_tokens as f64,
            block_size: req.block_size_f64(),
            n: new_blocks as f64,
        };
        let v = View::of(cols);
        let out = (&mut upper[..n], &mut lower[..n]);
        match (self.latency(), cfg.credit_decay) {
            (Some(&p), Some(d)) if d > 0.0 => k.latency(p, &v, out, |t| k.decay(d, t)),
            (Some(&p), _) => k.latency(p, &v, out, |_| 1.0),
            (None, Some(d)) if d > 0.0 => k.dynamo(&v, out, |t| k.decay(d, t)),
            (None, _) => k.dynamo(&v, out, |_| 1.0),
        }
        upper.iter().fold(f64::INFINITY, |m, &u| m.min(u))
    }
}

/// The columns as slices of one length, so indexing them in the pass needs no checks.
struct View<'a> {
    device: &'a [u32],
    host: &'a [u32],
    disk: &'a [u32],
    shared: &'a [u32],
    prefill_tokens: &'a [u64],
    decode_blocks: &'a [u64],
    requests: &'a [u64],
    kv_blocks: &'a [u64],
}

impl<'a> View<'a> {
    fn of(c: &'a LoadColumns) -> Self {
        let n = c.len();
        Self {
            device: &c.device[..n],
            host: &c.host[..n],
            disk: &c.disk[..n],
            shared: &c.shared[..n],
            prefill_tokens: &c.prefill_tokens[..n],
            decode_blocks: &c.decode_blocks[..n],
            requests: &c.requests[..n],
            kv_blocks: &c.kv_blocks[..n],
        }
    }
}

/// What the pass needs from the request and the knobs, copied once a selection.
struct Kernel {
    cfg: CostConfig,
    req: RequestShape,
    isl: f64,
    block_size: f64,
    /// The candidates' (common) `new_blocks_not_active`, as f64.
    n: f64,
}

impl Kernel {
    /// `credit_decay_factor` (formula.rs) for a candidate with `tokens` booked prefill.
    #[inline]
    fn decay(&self, d: f64, tokens: u64) -> f64 {
        let excess_tokens = tokens.saturating_sub(self.req.min_active_prefill_tokens);
        let excess_blocks = excess_tokens as f64 / self.block_size;
        let normalized = excess_blocks / self.req.request_blocks() as f64;
        1.0 / (1.0 + d * normalized)
    }

    /// `credit` (formula.rs) of candidate `k` with decay factor `decay`.
    #[inline(always)]
    fn credit(&self, v: &View<'_>, k: usize, decay: f64) -> f64 {
        let c = &self.cfg;
        c.overlap_score_credit * decay * f64::from(v.device[k])
            + c.host_cache_hit_weight * f64::from(v.host[k])
            + c.disk_cache_hit_weight * f64::from(v.disk[k])
            + c.shared_cache_multiplier * f64::from(v.shared[k])
    }

    /// `LatencyPrep::bounds` for every candidate. The per-token target and an unknown
    /// capacity (`kv_ms` is 0 there) are settled once for the selection, not tested a
    /// candidate: with every capacity known the loop has no branch and is vectorized.
    #[inline(always)]
    fn latency(
        &self,
        p: LatencyPrep,
        v: &View<'_>,
        out: (&mut [f64], &mut [f64]),
        decay: impl Fn(u64) -> f64 + Copy,
    ) {
        let l = &self.cfg.latency;
        let out_tokens = self.req.expected_output_tokens as f64;
        let itl = |target: f64| {
            move |requests: f64| {
                let predicted = l.itl_base_ms + l.itl_per_request_ms * (requests + 1.0);
                (predicted - target).max(0.0) * out_tokens
            }
        };
        let known = |d: f64, t: u64| p.kv_ms_known(d, t);
        let any = |d: f64, t: u64| p.kv_ms_of(d, t);
        let all_known = v.kv_blocks.iter().all(|&t| t != 0);
        match (l.itl_target_ms, all_known) {
            (None, true) => self.latency_pass(&p, v, out, decay, |_| 0.0, known),
            (None, false) => self.latency_pass(&p, v, out, decay, |_| 0.0, any),
            (Some(t), true) => self.latency_pass(&p, v, out, decay, itl(t), known),
            (Some(t), false) => self.latency_pass(&p, v, out, decay, itl(t), any),
        }
    }

    /// The latency pass with the decay, the per-token charge (of a rank's booked
    /// requests) and the KV charge (of decode blocks on a capacity) given. Not inlined:
    /// as a function of its own, its output slices are known to alias nothing it reads,
    /// which is what lets the compiler vectorize it.
    #[inline(never)]
    fn latency_pass(
        &self,
        p: &LatencyPrep,
        v: &View<'_>,
        (upper, lower): (&mut [f64], &mut [f64]),
        decay: impl Fn(u64) -> f64,
        itl: impl Fn(f64) -> f64,
        kv: impl Fn(f64, u64) -> f64,
    ) {
        let l = &self.cfg.latency;
        let w = self.cfg.decode_active_request_weight;
        let new_share = p.tie_ms_per_block * self.n;
        for k in 0..upper.len().min(lower.len()).min(v.device.len()) {
            let tokens = v.prefill_tokens[k];
            let credit_blocks = self.credit(v, k, decay(tokens));
            let uncached = (self.isl - credit_blocks * self.block_size).max(0.0);
            let ttft = l.request_overhead_ms + p.ms_per_token * (tokens as f64 + uncached);
            let externality = p.extern_ms_per_token * uncached;
            let requests = v.requests[k] as f64;
            let held = v.decode_blocks[k] as f64 + w * requests;
            let decode = held + self.n;
            let total = v.kv_blocks[k];
            let kv_decode = kv(decode, total);
            let cost = ttft + externality + kv_decode + itl(requests) + p.tie_ms_per_block * decode;
            upper[k] = cost;
            lower[k] = cost - (new_share + kv_decode - kv(held, total));
        }
    }

    /// Dynamo's `cost_breakdown(..).cost`, and that minus the new blocks, for every
    /// candidate. Not inlined, as `latency_pass`.
    #[inline(never)]
    fn dynamo(
        &self,
        v: &View<'_>,
        (upper, lower): (&mut [f64], &mut [f64]),
        decay: impl Fn(u64) -> f64,
    ) {
        let c = &self.cfg;
        for k in 0..upper.len().min(lower.len()).min(v.device.len()) {
            let tokens = v.prefill_tokens[k];
            let credit_blocks = self.credit(v, k, decay(tokens));
            let raw = (tokens as f64 + self.isl) / self.block_size;
            let adjusted = (raw - credit_blocks).max(0.0);
            let decode = v.decode_blocks[k] as f64 + self.n;
            let requests = c.decode_active_request_weight * v.requests[k] as f64;
            let cost = c.prefill_load_scale * adjusted + decode + requests;
            upper[k] = cost;
            lower[k] = cost - self.n;
        }
    }
}
