//! [`DecodeDrag`]: how much a rank's decode load lengthens a request's time to first
//! token there, learned online from the `mark_prefill_complete` timings that also give
//! the prefill rate (`rate.rs`).
//!
//! An engine runs prefill chunks in the same steps as one token for every decoding
//! request, and a step's time grows with the KV the decoders read. So on a rank holding
//! many decode blocks a request waits longer for the step it joins and for each step of
//! its prefill, and a router that prices queued and uncached tokens alone keeps sending
//! cache hits to a rank whose decoders make every step slow: sessions pile onto it.
//!
//! Each completed local booking is one observation of its time to first token `y` (from
//! its booking), the tokens it waited for `u` (the rank's booked prefill tokens when it
//! was booked, plus its own) and the decode blocks `x` the rank held then (what the
//! selection saw). The drag is `x`'s coefficient in the least-squares fit
//! `y ≈ a·u + drag·x + c`, from exponentially weighted averages of `y`, `u`, `x` and their
//! products (the 2 × 2 normal equations of the centred fit). Fitting `u` beside `x` keeps
//! a queue that grows with the decode load from being charged twice (the queue is priced
//! by its tokens already); fitting through the averages keeps a per-request overhead out
//! of both slopes. With no spread in `x`, or `x` moving in step with `u`, there is nothing
//! to learn and the drag is unknown.
//!
//! The eight averages sit in four [`EwmaPair`]s, each folded by compare-and-swap (the
//! prefill rate's protocol and loom model). A reader may see some pairs updated by an
//! observation and others not yet: one observation's weight out of step, which moves the
//! fit by about that weight's share; the estimate steers a cost, it counts nothing.
//! Reading it is four atomic loads (selection stays lock-free).

use super::rate::EwmaPair;
use crate::sync::atomic::{AtomicU64, Ordering};

/// Observations before the drag is used.
pub(super) const MIN_OBSERVATIONS: u64 = 32;

/// The learned decode drag of one partition (see the module docs).
pub(crate) struct DecodeDrag {
    /// `(y, u)`, `(x, u²)`, `(x², u·x)`, `(y·u, y·x)`.
    pairs: [EwmaPair; 4],
    observations: AtomicU64,
}

impl Default for DecodeDrag {
    fn default() -> Self {
        Self {
            pairs: std::array::from_fn(|_| EwmaPair::with_weight(Self::ALPHA)),
            observations: AtomicU64::new(0),
        }
    }
}

impl DecodeDrag {
    /// Weight of a new observation: slower than the rate's, because a fit of two slopes
    /// needs more points than a ratio to settle.
    pub(crate) const ALPHA: f32 = 1.0 / 64.0;

    /// The four pairs one observation folds in, in [`pairs`](Self::pairs) order.
    pub(crate) fn terms(y: f32, u: f32, x: f32) -> [(f32, f32); 4] {
        [(y, u), (x, u * u), (x * x, u * x), (y * u, y * x)]
    }

    /// Folds in one request: `ttft_secs` to its first token from its booking, after
    /// `tokens` of prefill (queued ahead of it and its own), on a rank holding
    /// `decode_blocks` when it was booked. Non-finite or negative times are ignored.
    pub(crate) fn observe(&self, ttft_secs: f64, tokens: u64, decode_blocks: u64) {
        if !ttft_secs.is_finite() || ttft_secs < 0.0 {
            return;
        }
        self.observations.fetch_add(1, Ordering::Relaxed);
        let terms = Self::terms(ttft_secs as f32, tokens as f32, decode_blocks as f32);
        for (pair, (a, b)) in self.pairs.iter().zip(terms) {
            pair.observe(a, b);
        }
    }

    /// Seconds of time to first token per decode block held, once [`MIN_OBSERVATIONS`]
    /// requests were seen on ranks of different decode loads; never negative.
    pub(crate) fn get(&self) -> Option<f64> {
        if self.observations.load(Ordering::Relaxed) < MIN_OBSERVATIONS {
            return None;
        }
        let [(y, u), (x, uu), (xx, ux), (yu, yx)] = self.pairs.each_ref().map(|p| {
            let (a, b) = p.get();
            (f64::from(a), f64::from(b))
        });
        let var_u = uu - u * u;
        let var_x = xx - x * x;
        let cov_ux = ux - u * x;
        let cov_yu = yu - y * u;
        let cov_yx = yx - y * x;
        // Too little spread in the loads (rounding alone is ~1e-7 of `xx`), or the loads
        // moving in step with the queues: no separate slope.
        if var_x.is_nan() || var_x <= 1e-3 * xx || var_x < 1.0 {
            return None;
        }
        let slope = if var_u > 1e-3 * uu && var_u >= 1.0 {
            let det = var_u * var_x - cov_ux * cov_ux;
            if det.is_nan() || det <= 1e-3 * var_u * var_x {
                return None;
            }
            (var_u * cov_yx - cov_ux * cov_yu) / det
        } else {
            // Every request waited for the same tokens: the load's slope alone.
            cov_yx / var_x
        };
        slope.is_finite().then(|| slope.max(0.0))
    }

    /// The four packed pairs, for the loom model.
    #[cfg(loom)]
    pub(crate) fn packed(&self) -> [u64; 4] {
        self.pairs.each_ref().map(|p| p.packed())
    }

    /// Requests observed.
    pub(crate) fn observations(&self) -> u64 {
        self.observations.load(Ordering::Relaxed)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// TTFT = 50 ms + 0.1 ms a token + `per_block` s a decode block, over loads and
    /// queues that vary apart.
    fn feed(d: &DecodeDrag, n: usize, per_block: f64, start: usize) {
        let loads = [0u64, 2_000, 6_000, 10_000];
        let tokens = [500u64, 3_000, 1_000, 8_000, 2_000];
        for i in start..start + n {
            let (x, u) = (loads[i % 4], tokens[i % 5]);
            d.observe(0.05 + 1e-4 * u as f64 + per_block * x as f64, u, x);
        }
    }

    #[test]
    fn the_drag_is_the_decode_loads_slope_beside_the_queues() {
        let d = DecodeDrag::default();
        feed(&d, MIN_OBSERVATIONS as usize - 1, 20e-6, 0);
        assert_eq!(d.get(), None, "too few observations");
        feed(&d, 600, 20e-6, MIN_OBSERVATIONS as usize - 1);
        let slope = d.get().unwrap();
        assert!((slope - 20e-6).abs() < 1e-6, "{slope}");
        // A queue that grows with the load is not charged to the load.
        let d = DecodeDrag::default();
        for i in 0..600u64 {
            let x = (i % 4) * 2_000;
            let u = 1_000 + x / 2 + (i % 3) * 700;
            d.observe(0.05 + 1e-4 * u as f64, u, x);
        }
        let slope = d.get().unwrap();
        assert!(slope.abs() < 1e-6, "{slope}");
    }

    #[test]
    fn equal_loads_teach_nothing_and_the_drag_is_never_negative() {
        let d = DecodeDrag::default();
        for k in 0..100u64 {
            d.observe(0.1 + 1e-4 * (k % 5) as f64, 1_000 * (k % 5), 5_000);
        }
        assert_eq!(d.get(), None, "no spread in the loads");
        let d = DecodeDrag::default();
        feed(&d, 200, -5e-6, 0);
        assert_eq!(d.get(), Some(0.0));
        let n = d.observations();
        d.observe(f64::NAN, 1, 1);
        d.observe(-1.0, 1, 1);
        assert_eq!(d.observations(), n);
    }
}
