//! A candidate's cost as a function of its cache credit alone, its loads held fixed.
//!
//! Why: the pruned pass (`select/prune.rs`) bounds every rank that holds some of the prompt
//! with its group's load floors and its own overlap. At fleet scale that is a thousand
//! costs a selection, all with one of a few hundred load rows, and a cost took as long as
//! the rest of the bound. Both models read the cache only through the credit (`credit`
//! in `formula.rs`), and only through one clamped term:
//!
//! ```text
//! cost = fixed + scale · max(raw − weight · credit, 0)
//! ```
//!
//! (Dynamo's: `scale` = `prefill_load_scale`, `raw` the prompt and booked prefill in
//! blocks, `weight` 1; the latency model's: `scale` the ms an uncached token costs with
//! its externality, `raw` the prompt's tokens, `weight` the block size.) So one cost per
//! load row gives `fixed`, and each overlap then costs a few multiply-adds.
//!
//! `fixed` is the cost less the clamped term, so it carries the cost's rounding; a value
//! is lowered by a margin far above that rounding, so it never exceeds the cost computed
//! directly (it serves as a lower bound), and stays within a part in 10^11 of it (a test
//! checks both on random inputs).

use super::config::CostModel;
use super::eval::CostEval;
use super::formula::{cost_breakdown, credit, credit_weights, weighted_credit, CandidateLoad};

/// Relative margin a [`CreditForm`] value is lowered by.
const MARGIN: f64 = 1e-12;

/// One load row's cost against any cache credit (see the module docs).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CreditForm {
    fixed: f64,
    scale: f64,
    raw: f64,
    weight: f64,
    /// The credit's weights ([`credit_weights`], the device's under the row's decay).
    per_block: [f64; 4],
    /// Whether more booked prefill raises the cost whatever the credit (the latency
    /// model); else only where the clamped term is above 0 (Dynamo's).
    slope_always: bool,
}

impl CreditForm {
    /// The cost and prefill slope ([`CostEval::cost_and_prefill_slope`]) of the row with
    /// these cached blocks in place of its own, lowered by the margin.
    #[inline]
    pub(crate) fn cost_and_prefill_slope(
        &self,
        device: u32,
        host: u32,
        disk: u32,
        shared: u32,
    ) -> (f64, bool) {
        let blocks = [device, host, disk, shared].map(f64::from);
        let credit = weighted_credit(self.per_block, blocks);
        let open = self.raw - self.weight * credit;
        let term = self.scale * open.max(0.0);
        let cost = self.fixed + term;
        let margin = MARGIN * (self.fixed.abs() + term.abs());
        (cost - margin, self.slope_always || open > 0.0)
    }
}

impl CostEval<'_> {
    /// The cost and prefill slope of `c` (as
    /// [`cost_and_prefill_slope`](Self::cost_and_prefill_slope)), and `c`'s loads as a
    /// [`CreditForm`] for any other overlap.
    #[inline]
    pub(crate) fn credit_form(&self, c: &CandidateLoad) -> ((f64, bool), CreditForm) {
        let cfg = self.cfg();
        let req = self.req();
        let (decay, own_credit) = credit(cfg, req, c);
        let per_block = credit_weights(cfg, decay);
        let (exact, scale, raw, weight, slope_always) = match (cfg.model, self.latency()) {
            (CostModel::Latency, Some(p)) => (
                self.cost_and_prefill_slope(c),
                p.ms_per_token + p.extern_ms_per_token,
                req.isl_tokens as f64,
                req.block_size_f64(),
                true,
            ),
            _ => {
                // As `cost_and_prefill_slope` under Dynamo's model, from one breakdown.
                let b = cost_breakdown(cfg, req, c);
                let exact = (b.cost, b.adjusted_prefill_blocks > 0.0);
                (
                    exact,
                    cfg.prefill_load_scale,
                    b.raw_prefill_blocks,
                    1.0,
                    false,
                )
            }
        };
        let own = scale * (raw - weight * own_credit).max(0.0);
        let form = CreditForm {
            fixed: exact.0 - own,
            scale,
            raw,
            weight,
            per_block,
            slope_always,
        };
        (exact, form)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::config::CostConfig;
    use crate::cost::{CostOverrides, RequestShape};

    /// On random loads, overlaps, knobs and requests, under both models with the credit
    /// decay on and off, a form's value never exceeds the cost computed directly and is
    /// within a part in 10^11 of it, and its prefill slope is the direct one (away from
    /// the clamp's edge, where rounding may fall either way).
    #[test]
    fn a_form_is_the_cost_just_below_it_at_every_overlap() {
        let mut next = super::super::tests::draws(0x853c_49e6_748f_ea9b);
        let mut checked = [0usize; 2];
        for round in 0..600 {
            let mut cfg = [CostConfig::default(), CostConfig::dynamo()][round % 2];
            cfg.credit_decay = [None, Some(0.5)][next(2) as usize];
            cfg.host_cache_hit_weight = [0.25, 0.5, 1.0][next(3) as usize];
            cfg.shared_cache_multiplier = [0.0, 0.3, 1.0][next(3) as usize];
            cfg.prefill_load_scale = [1.0, 0.5, 2.0][next(3) as usize];
            cfg.latency.itl_target_ms = [None, Some(25.0)][next(2) as usize];
            let cfg = cfg.resolve(&CostOverrides::default());
            let block_size = [16, 12, 64][next(3) as usize];
            let mut req = RequestShape::new(1 + next(8_000), block_size)
                .with_prefill_rate([0.0, 12_000.0][next(2) as usize])
                .with_expected_output_tokens(next(200));
            req.mean_active_prefill_tokens = next(40_000) as f64;
            req.min_active_prefill_tokens = next(2_000);
            let eval = CostEval::new(&cfg, &req);
            let row = CandidateLoad {
                active_prefill_tokens: next(50_000),
                active_decode_blocks: next(1_600),
                new_blocks_not_active: next(500),
                active_requests: next(40),
                total_kv_blocks: [0, 1_000, 2_000][next(3) as usize],
                shared_blocks_beyond_device: next(20),
                ..CandidateLoad::default()
            };
            let (own, form) = eval.credit_form(&row);
            assert_eq!(own, eval.cost_and_prefill_slope(&row));
            for _ in 0..20 {
                let c = CandidateLoad {
                    device_blocks: next(600),
                    host_blocks: next(60),
                    disk_blocks: next(60),
                    shared_blocks_beyond_device: next(30),
                    ..row
                };
                let (want, want_slope) = eval.cost_and_prefill_slope(&c);
                let (got, slope) = form.cost_and_prefill_slope(
                    c.device_blocks as u32,
                    c.host_blocks as u32,
                    c.disk_blocks as u32,
                    c.shared_blocks_beyond_device as u32,
                );
                assert!(got <= want, "{got} above {want}: {:?} {c:?}", cfg.model);
                assert!(
                    want - got <= 1e-11 * want.abs().max(1.0),
                    "{got} against {want}: {:?} {c:?}",
                    cfg.model
                );
                let (_, credit_blocks) = credit(&cfg, &req, &c);
                let edge = (form.raw - form.weight * credit_blocks).abs() < 1e-9 * form.raw;
                if !edge {
                    assert_eq!(slope, want_slope, "{:?} {c:?}", cfg.model);
                    checked[usize::from(want_slope)] += 1;
                }
            }
        }
        // Both sides of the clamp were reached.
        assert!(checked.iter().all(|&n| n > 100), "{checked:?}");
    }
}
