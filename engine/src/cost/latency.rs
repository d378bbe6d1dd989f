//! The latency model ([`CostModel::Latency`], kvr's default): a candidate's cost is its
//! predicted time to first token in ms, plus charges that only matter near the limits of
//! KV memory or of a per-token latency target.
//!
//! Why TTFT and not Dynamo's sum of blocks: a router exists to cut TTFT, and on most
//! clusters prefill is what a request waits for. Dynamo's cost adds a rank's decode
//! blocks to its prefill blocks one for one, so it spends cache hits to balance decode
//! load that costs the request nothing until memory or per-token latency runs short.
//! Here decode load is a tie-break until then.
//!
//! [`CostModel::Latency`]: super::CostModel::Latency

use super::config::CostConfig;
use super::formula::{credit, CandidateLoad, RequestShape};

/// The latency model's terms for one candidate, all in ms (see [`latency_cost`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatencyBreakdown {
    /// The prefill rate used, tokens/s.
    pub prefill_rate: f64,
    /// Prompt tokens the rank must compute (or bring from a slower tier, weighted):
    /// `max(0, ISL - credit × B)`.
    pub uncached_tokens: f64,
    /// Predicted TTFT: `overhead + (active_prefill_tokens + uncached) / rate`.
    pub ttft_ms: f64,
    /// What the uncached work costs the requests that will queue behind it.
    pub externality_ms: f64,
    /// KV memory pressure charge.
    pub kv_ms: f64,
    /// Per-token latency target charge.
    pub itl_ms: f64,
    /// Decode-load charge: the tie-break, plus the learned decode drag (how much the
    /// rank's decode load lengthens a time to first token there) once the partition learned it.
    pub tiebreak_ms: f64,
    /// `ttft_ms + externality_ms + kv_ms + itl_ms + tiebreak_ms`.
    pub cost_ms: f64,
}

/// The prefill rate a selection uses: the partition's estimate when there is one
/// (`req.prefill_rate > 0`), else the configured prior; never below 1 token/s, so the
/// division stays finite.
#[inline]
pub(super) fn effective_rate(cfg: &CostConfig, req: &RequestShape) -> f64 {
    let r = if req.prefill_rate > 0.0 {
        req.prefill_rate
    } else {
        cfg.latency.prefill_rate_prior
    };
    if r.is_finite() && r >= 1.0 {
        r
    } else {
        1.0
    }
}

/// The latency model's cost of placing the request on candidate `c`, term by term (ms),
/// whichever model `cfg` names.
#[inline]
pub fn latency_cost(cfg: &CostConfig, req: &RequestShape, c: &CandidateLoad) -> LatencyBreakdown {
    LatencyPrep::new(cfg, req).cost(cfg, req, c)
}

/// The decode load `c`'s rank holds before this booking, in blocks (with the configured
/// charge per active request).
#[inline]
fn held_decode_blocks(cfg: &CostConfig, c: &CandidateLoad) -> f64 {
    c.active_decode_blocks as f64 + cfg.decode_active_request_weight * c.active_requests as f64
}

/// The learned decode drag per held decode block, ms: the request shape's, if finite and
/// positive, else 0 (so the cost stays monotone in the load). The latency model charges
/// it `1 + queue_externality` times, as it charges uncached work: the rank's decode load
/// slows this request's prefill and every prefill that queues behind it.
#[inline]
fn drag_ms_per_block(req: &RequestShape) -> f64 {
    let d = req.decode_drag_ms_per_block;
    if d.is_finite() && d > 0.0 {
        d
    } else {
        0.0
    }
}

/// What a latency-model cost needs from the request and the knobs alone, computed once
/// per selection (the divisions stay out of the per-candidate loop).
#[derive(Clone, Copy, Debug)]
pub(super) struct LatencyPrep {
    rate: f64,
    /// ms of prefill per token at `rate`.
    pub(super) ms_per_token: f64,
    /// The externality's ms per uncached token: `queue_externality × behind × ms/token`.
    pub(super) extern_ms_per_token: f64,
    theta: f64,
    /// The pressure charge per unit of KV-use share above the threshold.
    pressure_ms_per_share: f64,
    pub(super) tie_ms_per_block: f64,
}

impl LatencyPrep {
    #[inline]
    pub(super) fn new(cfg: &CostConfig, req: &RequestShape) -> Self {
        let l = &cfg.latency;
        let rate = effective_rate(cfg, req);
        let ms_per_token = 1e3 / rate;
        let behind =
            (req.mean_active_prefill_tokens / (req.isl_tokens.max(1) as f64)).clamp(0.0, 16.0);
        let theta = l.kv_pressure_threshold.clamp(0.0, 0.999);
        Self {
            rate,
            ms_per_token,
            extern_ms_per_token: l.queue_externality * behind * ms_per_token,
            theta,
            pressure_ms_per_share: l.kv_pressure_ms / (1.0 - theta),
            tie_ms_per_block: l.decode_block_us * 1e-3
                + (1.0 + l.queue_externality.max(0.0)) * drag_ms_per_block(req),
        }
    }

    /// The part of `c`'s cost due to its `new_blocks_not_active` (its tie-break share and
    /// the pressure they add): the cost with them, minus the cost with none.
    #[inline]
    pub(super) fn new_blocks_share(&self, cfg: &CostConfig, c: &CandidateLoad) -> f64 {
        let n = c.new_blocks_not_active as f64;
        let held = held_decode_blocks(cfg, c);
        self.tie_ms_per_block * n + self.kv_ms(held + n, c) - self.kv_ms(held, c)
    }

    /// The KV pressure charge of `decode` blocks on `c`'s rank (0 with its capacity
    /// unknown, or below the threshold).
    #[inline]
    fn kv_ms(&self, decode: f64, c: &CandidateLoad) -> f64 {
        self.kv_ms_of(decode, c.total_kv_blocks)
    }

    /// [`kv_ms`](Self::kv_ms) on a rank of `total_kv_blocks` capacity.
    #[inline(always)]
    pub(super) fn kv_ms_of(&self, decode: f64, total_kv_blocks: u64) -> f64 {
        if total_kv_blocks == 0 {
            return 0.0;
        }
        self.kv_ms_known(decode, total_kv_blocks)
    }

    /// [`kv_ms_of`](Self::kv_ms_of) for a known capacity (`total_kv_blocks > 0`):
    /// without the test, so a loop over candidates can be vectorized.
    #[inline(always)]
    pub(super) fn kv_ms_known(&self, decode: f64, total_kv_blocks: u64) -> f64 {
        self.pressure_ms_per_share * (decode / total_kv_blocks as f64 - self.theta).max(0.0)
    }

    /// The cost and the cost minus [`new_blocks_share`](Self::new_blocks_share).
    #[inline(always)]
    pub(super) fn bounds(
        &self,
        cfg: &CostConfig,
        req: &RequestShape,
        c: &CandidateLoad,
    ) -> (f64, f64) {
        let upper = self.cost(cfg, req, c).cost_ms;
        (upper, upper - self.new_blocks_share(cfg, c))
    }

    /// [`latency_cost`] with this preparation.
    #[inline(always)]
    pub(super) fn cost(
        &self,
        cfg: &CostConfig,
        req: &RequestShape,
        c: &CandidateLoad,
    ) -> LatencyBreakdown {
        let l = &cfg.latency;
        let (_, credit_blocks) = credit(cfg, req, c);
        let uncached_tokens =
            (req.isl_tokens as f64 - credit_blocks * req.block_size_f64()).max(0.0);
        let ttft_ms = l.request_overhead_ms
            + self.ms_per_token * (c.active_prefill_tokens as f64 + uncached_tokens);
        let externality_ms = self.extern_ms_per_token * uncached_tokens;
        let decode = held_decode_blocks(cfg, c) + c.new_blocks_not_active as f64;
        let kv_ms = self.kv_ms(decode, c);
        let itl_ms = match l.itl_target_ms {
            Some(target) => {
                let predicted =
                    l.itl_base_ms + l.itl_per_request_ms * (c.active_requests as f64 + 1.0);
                (predicted - target).max(0.0) * req.expected_output_tokens as f64
            }
            None => 0.0,
        };
        let tiebreak_ms = self.tie_ms_per_block * decode;
        LatencyBreakdown {
            prefill_rate: self.rate,
            uncached_tokens,
            ttft_ms,
            externality_ms,
            kv_ms,
            itl_ms,
            tiebreak_ms,
            cost_ms: ttft_ms + externality_ms + kv_ms + itl_ms + tiebreak_ms,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::config::{CostConfig, LatencyConfig};
    use crate::cost::cost;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn ttft_is_queue_plus_uncached_at_the_rate() {
        let cfg = CostConfig::default();
        // ISL 1,000, B 100: 4 device blocks cached → 600 uncached; 400 queued; 10k/s.
        let req = RequestShape::new(1_000, 100);
        let c = CandidateLoad {
            device_blocks: 4,
            active_prefill_tokens: 400,
            active_decode_blocks: 1_000,
            new_blocks_not_active: 6,
            ..CandidateLoad::default()
        };
        let b = latency_cost(&cfg, &req, &c);
        assert!(close(b.uncached_tokens, 600.0));
        assert!(close(b.ttft_ms, 5.0 + 100.0));
        assert!(close(b.tiebreak_ms, 1.006));
        assert_eq!((b.kv_ms, b.itl_ms), (0.0, 0.0));
        assert!(close(cost(&cfg, &req, &c), b.cost_ms));
        // The learned rate replaces the prior; host blocks cost a quarter of a block.
        let req = req.with_prefill_rate(20_000.0);
        let c = CandidateLoad {
            host_blocks: 4,
            ..c
        };
        let b = latency_cost(&cfg, &req, &c);
        assert!(close(b.uncached_tokens, 300.0));
        assert!(close(b.ttft_ms, 5.0 + 35.0));
    }

    #[test]
    fn cache_beats_decode_load_until_memory_runs_short() {
        let cfg = CostConfig::default();
        let req = RequestShape::new(6_400, 64);
        // A holds 50 more cached blocks but 2,000 more decode blocks than B.
        let a = CandidateLoad {
            device_blocks: 80,
            active_decode_blocks: 4_000,
            new_blocks_not_active: 20,
            total_kv_blocks: 16_384,
            ..CandidateLoad::default()
        };
        let b = CandidateLoad {
            device_blocks: 30,
            active_decode_blocks: 2_000,
            new_blocks_not_active: 70,
            total_kv_blocks: 16_384,
            ..CandidateLoad::default()
        };
        assert!(cost(&cfg, &req, &a) < cost(&cfg, &req, &b));
        // Dynamo's cost prefers B (decode blocks outweigh cached ones).
        let dynamo = CostConfig::dynamo();
        assert!(cost(&dynamo, &req, &a) > cost(&dynamo, &req, &b));
        // A nearly full: the pressure charge (ms at full memory) turns it.
        let full = CandidateLoad {
            active_decode_blocks: 16_000,
            ..a
        };
        let k = latency_cost(&cfg, &req, &full);
        assert!(k.kv_ms > 700.0, "{k:?}");
        assert!(cost(&cfg, &req, &full) > cost(&cfg, &req, &b));
        // Unknown capacity: no pressure term.
        let unknown = CandidateLoad {
            total_kv_blocks: 0,
            ..full
        };
        assert_eq!(latency_cost(&cfg, &req, &unknown).kv_ms, 0.0);
    }

    #[test]
    fn under_load_a_miss_also_pays_for_the_queue_behind_it() {
        let cfg = CostConfig::default();
        // 6,400-token prompt; A holds 60 blocks but has 3,200 tokens queued; B holds none
        // and is idle. Alone, A's TTFT is 3,200 + 2,560 = 5,760 tokens, B's 6,400: A.
        let cached = CandidateLoad {
            device_blocks: 60,
            active_prefill_tokens: 3_200,
            ..CandidateLoad::default()
        };
        let idle = CandidateLoad::default();
        let both = [cached, idle];
        let req = RequestShape::new(6_400, 64).with_selection_stats(&both);
        assert_eq!(req.mean_active_prefill_tokens, 1_600.0);
        let (a, b) = (
            latency_cost(&cfg, &req, &cached),
            latency_cost(&cfg, &req, &idle),
        );
        // behind = 1,600 / 6,400 = 0.25: B's 6,400 uncached tokens cost 2 × 0.25 × 640 ms.
        assert!(close(b.externality_ms, 320.0), "{b:?}");
        assert!(close(a.externality_ms, 2.0 * 0.25 * 256.0), "{a:?}");
        assert!(a.cost_ms < b.cost_ms);
        // Off: only the request's own TTFT counts (the same choice here, by less).
        let greedy = CostConfig {
            latency: LatencyConfig {
                queue_externality: 0.0,
                ..LatencyConfig::default()
            },
            ..CostConfig::default()
        };
        assert_eq!(latency_cost(&greedy, &req, &idle).externality_ms, 0.0);
        // An idle cluster: no queue, no externality.
        let calm = RequestShape::new(6_400, 64).with_selection_stats(&[idle, idle]);
        assert_eq!(latency_cost(&cfg, &calm, &idle).externality_ms, 0.0);
    }

    #[test]
    fn a_per_token_target_charges_the_excess_over_the_output() {
        let cfg = CostConfig {
            latency: LatencyConfig {
                itl_target_ms: Some(25.0),
                ..LatencyConfig::default()
            },
            ..CostConfig::default()
        };
        let req = RequestShape::new(640, 64).with_expected_output_tokens(100);
        // 20 + 0.2 × 49 = 29.8 ms per token: 4.8 over the target × 100 tokens.
        let busy = CandidateLoad {
            active_requests: 48,
            ..CandidateLoad::default()
        };
        assert!(close(latency_cost(&cfg, &req, &busy).itl_ms, 480.0));
        let idle = CandidateLoad::default();
        assert_eq!(latency_cost(&cfg, &req, &idle).itl_ms, 0.0);
    }

    #[test]
    fn absurd_rates_and_sizes_stay_finite() {
        let mut cfg = CostConfig::default();
        cfg.latency.prefill_rate_prior = 0.0;
        let req = RequestShape::new(u64::MAX, 0).with_prefill_rate(f64::NAN);
        let c = CandidateLoad {
            active_prefill_tokens: u64::MAX,
            active_decode_blocks: u64::MAX,
            total_kv_blocks: 1,
            ..CandidateLoad::default()
        };
        assert!(latency_cost(&cfg, &req, &c).cost_ms.is_finite());
    }

    #[test]
    fn the_new_blocks_share_is_exactly_what_they_add() {
        let cfg = CostConfig::default();
        let req = RequestShape::new(6_400, 64);
        for (decode, total) in [(0, 0), (14_700, 16_384), (20_000, 16_384), (10, 100)] {
            let with = CandidateLoad {
                active_decode_blocks: decode,
                total_kv_blocks: total,
                active_requests: 1,
                new_blocks_not_active: 100,
                ..CandidateLoad::default()
            };
            let without = CandidateLoad {
                new_blocks_not_active: 0,
                ..with
            };
            let eval = crate::cost::CostEval::new(&cfg, &req);
            let share = eval.new_blocks_share(&with);
            let diff = eval.cost(&with) - eval.cost(&without);
            assert!(
                (share - diff).abs() < 1e-9,
                "{decode}/{total}: {share} vs {diff}"
            );
            assert!(share >= 0.0);
        }
    }
}
