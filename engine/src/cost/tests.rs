//! Unit tests of the cost function and the choice (formerly `cost.rs`'s test module).

use super::*;
use crate::config::CostConfig;

/// A xorshift stream from `seed` (not 0): each call a draw below its argument.
pub(super) fn draws(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut x = seed;
    move |n| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

fn defaults() -> CostConfig {
    CostConfig::dynamo()
}

#[test]
fn defaults_match_dynamo() {
    assert_eq!(CostConfig::default().model, CostModel::Latency);
    let c = CostConfig::dynamo();
    assert_eq!(c.model, CostModel::Dynamo);
    assert_eq!(c.overlap_score_credit, 1.0);
    assert_eq!(c.prefill_load_scale, 1.0);
    assert_eq!(c.host_cache_hit_weight, 0.75);
    assert_eq!(c.disk_cache_hit_weight, 0.25);
    assert_eq!(c.shared_cache_multiplier, 0.0);
    assert_eq!(c.temperature, 0.0);
    assert_eq!(c.decode_active_request_weight, 0.0);
    assert_eq!(c.credit_decay, None);
    assert_eq!(
        c,
        c.resolve(&CostOverrides::NONE),
        "no override changes nothing"
    );
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
        ..CostConfig::dynamo()
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
        ..CostConfig::dynamo()
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
        ..CostConfig::dynamo()
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
        let cfg = CostConfig {
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
        ..CostConfig::dynamo()
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
        ..CostConfig::dynamo()
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
        ..CostConfig::dynamo()
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

/// `CostEval::bounds` is the cost and the cost minus its new-blocks share, bit for bit,
/// under both models, on loads near and above the KV-pressure threshold too.
#[test]
fn bounds_are_the_cost_and_the_cost_minus_the_new_blocks_share() {
    for cfg in [CostConfig::default(), CostConfig::dynamo()] {
        let cfg = cfg.resolve(&CostOverrides::default());
        let req = RequestShape::new(4_096, 16).with_prefill_rate(12_000.0);
        let eval = CostEval::new(&cfg, &req);
        let mut next = draws(0x2545_f491_4f6c_dd1d);
        for _ in 0..2_000 {
            let c = CandidateLoad {
                device_blocks: next(300),
                host_blocks: next(50),
                disk_blocks: next(50),
                shared_blocks_beyond_device: next(20),
                active_prefill_tokens: next(50_000),
                active_decode_blocks: next(1_200),
                new_blocks_not_active: next(300),
                active_requests: next(40),
                total_kv_blocks: [0, 1_000, 1_500][next(3) as usize],
            };
            let (upper, lower) = eval.bounds(&c);
            assert_eq!(upper.to_bits(), eval.cost(&c).to_bits(), "{c:?}");
            assert_eq!(
                lower.to_bits(),
                (eval.cost(&c) - eval.new_blocks_share(&c)).to_bits(),
                "{c:?}"
            );
            assert!(lower <= upper);
        }
    }
}

/// The columns pass (`CostEval::bounds_all`, what selection prices with) gives every
/// candidate exactly `CostEval::bounds` of its record, bit for bit, under both models
/// with the decay and the per-token target on and off, for odd block sizes and for
/// counts near `u64::MAX`; and the columns' selection stats are the records'.
#[test]
fn the_columns_pass_is_bounds_bit_for_bit() {
    let mut next = draws(0x9e37_79b9_7f4a_7c15);
    let mut configs = Vec::new();
    for base in [CostConfig::default(), CostConfig::dynamo()] {
        for decay in [None, Some(0.5), Some(0.0)] {
            for itl in [None, Some(25.0)] {
                let mut cfg = base;
                cfg.credit_decay = decay;
                cfg.latency.itl_target_ms = itl;
                cfg.latency.kv_pressure_threshold = 0.6;
                configs.push(cfg.resolve(&CostOverrides::default()));
            }
        }
    }
    for (round, cfg) in configs.iter().cycle().take(configs.len() * 8).enumerate() {
        let huge = round % 4 == 3;
        let all_known = next(2) == 0;
        let big = |v: u64, next: &mut dyn FnMut(u64) -> u64| {
            if huge && next(4) == 0 {
                u64::MAX - next(1 << 20)
            } else {
                v
            }
        };
        let mut cols = LoadColumns::default();
        let candidates = 1 + next(70) as usize;
        for _ in 0..candidates {
            cols.device.push(next(300) as u32);
            cols.host.push(next(50) as u32);
            cols.disk.push(next(50) as u32);
            cols.shared.push(next(20) as u32);
            let t = next(50_000);
            cols.prefill_tokens.push(big(t, &mut next));
            let d = next(1_600);
            cols.decode_blocks.push(big(d, &mut next));
            cols.requests.push([0, 1, next(60)][next(3) as usize]);
            // In half the rounds every capacity is known (the pass without the test).
            let skip = u64::from(all_known);
            cols.kv_blocks
                .push([0, 1_000, 1_500, 2_000][(skip + next(4 - skip)) as usize]);
        }
        let block_size = [16, 12, 0, 64][next(4) as usize];
        let whole = next(300);
        let req = RequestShape::new(next(5_000), block_size)
            .with_prefill_rate(12_000.0)
            .with_expected_output_tokens(next(200));
        cols.new_blocks.resize(candidates, whole);
        let records: Vec<CandidateLoad> = (0..candidates).map(|k| cols.load(k)).collect();
        let shape = cols.selection_stats(req);
        let want = req.with_selection_stats(&records);
        assert_eq!(
            shape.min_active_prefill_tokens,
            want.min_active_prefill_tokens
        );
        assert_eq!(
            shape.mean_active_prefill_tokens.to_bits(),
            want.mean_active_prefill_tokens.to_bits()
        );
        let eval = CostEval::new(cfg, &shape);
        let (mut upper, mut lower) = (Vec::new(), Vec::new());
        let min = eval.bounds_all(&cols, whole, &mut upper, &mut lower);
        for (k, c) in records.iter().enumerate() {
            let (u, l) = eval.bounds(c);
            assert_eq!(upper[k].to_bits(), u.to_bits(), "{:?} {c:?}", cfg.model);
            assert_eq!(lower[k].to_bits(), l.to_bits(), "{:?} {c:?}", cfg.model);
        }
        let want_min = records
            .iter()
            .map(|c| eval.cost(c))
            .fold(f64::INFINITY, f64::min);
        assert_eq!(min, want_min);
    }
}
