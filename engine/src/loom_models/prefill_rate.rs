//! The prefill-rate estimator (`reservation/rate.rs`): two prefills of one rank complete
//! at once, from different shards.
//!
//! * `fetch_max` on the rank's last completion gives the two observations disjoint
//!   service windows: booked at 0 and completed at 1 s and 2 s, the windows are (1 s,
//!   1 s) if the 1 s completion advances the clock first, else (2 s, 0 s) — never the
//!   overlapping (1 s, 2 s) a load-then-store would give (negative control
//!   `split_last_prefill_max`), which charges the 2 s prefill for the other's work too.
//! * The compare-and-swap fold of the two averages loses neither observation (negative
//!   control `lossy_rate_update`).
//! * The decode drag (`reservation/drag.rs`) folds each observation into four such
//!   pairs: two concurrent observations leave each pair with both folded in, in either
//!   order (same negative control).

use std::time::{Duration, Instant};

use super::reservations::{booking, reservations};
use super::{model, must_fail};
use crate::reservation::drag::DecodeDrag;
use crate::reservation::rate::{fold, fold_weighted};
use crate::sync::faults::Faults;

const TOKENS: u64 = 32;

/// Every packed value the two observations may leave: either window split, folded in
/// either order.
fn valid_outcomes() -> Vec<u64> {
    let t = TOKENS as f32;
    let orders = |a: f32, b: f32| [fold(fold(0, t, a), t, b), fold(fold(0, t, b), t, a)];
    let mut v = orders(1.0, 1.0).to_vec();
    v.extend(orders(2.0, 0.0));
    v
}

fn completions_race() {
    let table = reservations();
    let t0 = Instant::now();
    table.book(booking(1, &[10], TOKENS, None), t0).unwrap();
    table.book(booking(2, &[20], TOKENS, None), t0).unwrap();
    let t2 = table.clone();
    let other = loom::thread::spawn(move || {
        t2.mark_prefill_complete_at(2, t0 + Duration::from_secs(2))
            .unwrap()
    });
    table
        .mark_prefill_complete_at(1, t0 + Duration::from_secs(1))
        .unwrap();
    other.join().unwrap();
    let got = table.prefill_rate_packed();
    assert!(
        valid_outcomes().contains(&got),
        "prefill-rate observation lost or overlapping windows: {got:#018x}"
    );
}

#[test]
fn prefill_rate_completions_race() {
    model(completions_race);
}

#[test]
fn prefill_rate_completions_race_negative_lossy_update() {
    must_fail(
        "loom_models::prefill_rate::prefill_rate_completions_race_negative_lossy_update",
        Faults {
            lossy_rate_update: true,
            ..Faults::default()
        },
        "prefill-rate observation lost",
        completions_race,
    );
}

#[test]
fn prefill_rate_completions_race_negative_split_max() {
    must_fail(
        "loom_models::prefill_rate::prefill_rate_completions_race_negative_split_max",
        Faults {
            split_last_prefill_max: true,
            ..Faults::default()
        },
        "prefill-rate observation lost",
        completions_race,
    );
}

/// Two observations of the decode drag from two threads.
fn drag_observations_race() {
    let drag = crate::sync::Arc::new(DecodeDrag::default());
    let d2 = drag.clone();
    let other = loom::thread::spawn(move || d2.observe(0.5, 2, 4));
    drag.observe(0.25, 3, 1);
    other.join().unwrap();
    let a = DecodeDrag::ALPHA;
    let first = DecodeDrag::terms(0.25, 3.0, 1.0);
    let second = DecodeDrag::terms(0.5, 2.0, 4.0);
    let got = drag.packed();
    for k in 0..4 {
        let (p, q) = (first[k], second[k]);
        let either = [
            fold_weighted(fold_weighted(0, p.0, p.1, a), q.0, q.1, a),
            fold_weighted(fold_weighted(0, q.0, q.1, a), p.0, p.1, a),
        ];
        assert!(
            either.contains(&got[k]),
            "decode-drag observation lost in pair {k}: {:#018x}",
            got[k]
        );
    }
}

#[test]
fn decode_drag_observations_race() {
    model(drag_observations_race);
}

#[test]
fn decode_drag_observations_race_negative_lossy_update() {
    must_fail(
        "loom_models::prefill_rate::decode_drag_observations_race_negative_lossy_update",
        Faults {
            lossy_rate_update: true,
            ..Faults::default()
        },
        "decode-drag observation lost",
        drag_observations_race,
    );
}
