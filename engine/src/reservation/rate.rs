//! [`PrefillRate`]: the partition's prefill throughput, learned online from the timings
//! of `mark_prefill_complete`, for the latency cost model.
//!
//! Each completed local booking is one observation: its prefill tokens and its *service
//! time*, from the later of its booking and the previous prefill completion on the same
//! rank to this completion. Taking the later start keeps a request that queued behind
//! another from being charged the other's prefill (its wait is not its work), and because
//! the rank's last completion is advanced with one atomic `fetch_max`, two completions
//! racing on one rank get disjoint windows. Several prefills finishing in one engine step
//! give one window with the time and the rest windows of ~0: the estimate is therefore a
//! ratio of averages, `EWMA(tokens) / EWMA(seconds)`, which such zero windows do not
//! break (an average of per-request rates would).
//!
//! The two averages are packed into one `AtomicU64` (two `f32`s) and folded in with a
//! compare-and-swap loop, so concurrent observations are never lost and a reader never
//! sees the two halves of different updates. Reading it is one atomic load (selection is
//! lock-free). Loom model `prefill_rate_observations_race`; negative control
//! `lossy_rate_update` (load, then store) must lose an observation.

use crate::sync::atomic::{AtomicU64, Ordering};
#[cfg(loom)]
use crate::sync::faults;

/// Weight of a new observation in both averages.
const ALPHA: f32 = 1.0 / 16.0;

/// Observations before the estimate is used (a few, so one odd first prefill does not
/// set the rate).
pub(super) const MIN_OBSERVATIONS: u64 = 8;

fn pack(tokens: f32, secs: f32) -> u64 {
    (u64::from(tokens.to_bits()) << 32) | u64::from(secs.to_bits())
}

fn unpack(v: u64) -> (f32, f32) {
    (f32::from_bits((v >> 32) as u32), f32::from_bits(v as u32))
}

/// The fold of one observation into the packed averages (into none yet: sets them).
#[cfg(loom)]
pub(crate) fn fold(v: u64, tokens: f32, secs: f32) -> u64 {
    fold_weighted(v, tokens, secs, ALPHA)
}

/// [`fold`] with the new observation weighted `alpha`.
pub(crate) fn fold_weighted(v: u64, a: f32, b: f32, alpha: f32) -> u64 {
    if v == 0 {
        return pack(a, b);
    }
    let (x, y) = unpack(v);
    pack(x + alpha * (a - x), y + alpha * (b - y))
}

/// Two exponentially weighted averages packed in one atomic word, folded in together by
/// compare-and-swap (see the module docs): the prefill rate's, and each of the decode
/// drag's two pairs (`drag.rs`).
pub(crate) struct EwmaPair {
    word: AtomicU64,
    /// Weight of a new observation.
    alpha: f32,
}

impl Default for EwmaPair {
    fn default() -> Self {
        Self::with_weight(ALPHA)
    }
}

impl EwmaPair {
    /// Averages that weight each new observation `alpha`.
    pub(crate) fn with_weight(alpha: f32) -> Self {
        Self {
            word: AtomicU64::new(0),
            alpha,
        }
    }

    /// Folds in one observation of both quantities; none is lost to a concurrent fold.
    pub(crate) fn observe(&self, a: f32, b: f32) {
        #[cfg(loom)]
        if faults::get().lossy_rate_update {
            let v = self.word.load(Ordering::Relaxed);
            self.word
                .store(fold_weighted(v, a, b, self.alpha), Ordering::Relaxed);
            return;
        }
        let alpha = self.alpha;
        let _ = self
            .word
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(fold_weighted(v, a, b, alpha))
            });
    }

    /// The two averages (both 0 before the first observation).
    pub(crate) fn get(&self) -> (f32, f32) {
        unpack(self.word.load(Ordering::Relaxed))
    }

    /// The packed word, for the loom model.
    #[cfg(loom)]
    pub(crate) fn packed(&self) -> u64 {
        self.word.load(Ordering::Relaxed)
    }
}

/// The learned prefill rate of one partition (see the module docs).
#[derive(Default)]
pub(crate) struct PrefillRate {
    averages: EwmaPair,
    observations: AtomicU64,
}

impl PrefillRate {
    /// Folds in one prefill: `tokens` computed in `secs` of service time. Non-finite or
    /// negative times and empty prefills are ignored.
    pub(crate) fn observe(&self, tokens: u64, secs: f64) {
        if tokens == 0 || !secs.is_finite() || secs < 0.0 {
            return;
        }
        self.observations.fetch_add(1, Ordering::Relaxed);
        self.averages.observe(tokens as f32, secs as f32);
    }

    /// Tokens per second, once [`MIN_OBSERVATIONS`] prefills were seen and some took time.
    pub(crate) fn get(&self) -> Option<f64> {
        if self.observations.load(Ordering::Relaxed) < MIN_OBSERVATIONS {
            return None;
        }
        let (t, s) = self.averages.get();
        (s > 0.0 && t > 0.0).then(|| f64::from(t) / f64::from(s))
    }

    /// Prefills observed.
    pub(crate) fn observations(&self) -> u64 {
        self.observations.load(Ordering::Relaxed)
    }

    /// The packed averages, for the loom model.
    #[cfg(loom)]
    pub(crate) fn packed(&self) -> u64 {
        self.averages.packed()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_rate_is_a_ratio_of_averages_and_needs_a_few_observations() {
        let r = PrefillRate::default();
        for _ in 0..MIN_OBSERVATIONS - 1 {
            r.observe(1_000, 0.1);
        }
        assert_eq!(r.get(), None);
        r.observe(1_000, 0.1);
        let rate = r.get().unwrap();
        assert!((rate - 10_000.0).abs() < 1.0, "{rate}");
        // Zero-length windows (prefills ending in the same step) lower the time average
        // and the token average alike; the rate stays finite and near the truth.
        for _ in 0..4 {
            r.observe(1_000, 0.2);
            r.observe(1_000, 0.0);
        }
        let rate = r.get().unwrap();
        assert!(
            rate.is_finite() && rate > 5_000.0 && rate < 20_000.0,
            "{rate}"
        );
        // Garbage is ignored.
        let n = r.observations();
        r.observe(0, 1.0);
        r.observe(10, f64::NAN);
        r.observe(10, -1.0);
        assert_eq!(r.observations(), n);
    }
}
