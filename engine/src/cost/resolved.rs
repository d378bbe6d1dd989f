//! The effective knobs of one selection: [`CostConfig::resolve`] folds a request's
//! [`CostOverrides`] into the configured values, giving the `CostConfig` the hot path
//! reads (the same type, so no field list is kept twice).

use super::config::{CostConfig, CostOverrides};

impl CostConfig {
    /// Folds per-request overrides into the configured values: an override that is `Some`
    /// wins, `None` keeps the configured value (REFERENCE.md §3: overrides exist for the
    /// credit, the prefill scale, the temperature and the shared multiplier; the tier
    /// weights, the active-request weight and the decay are deployment-wide).
    ///
    /// Values are taken as given (no clamping): validating knobs is the configuration
    /// layer's job, and the functions here stay total for any input (see [`choose`] for
    /// how odd temperatures and NaN costs are handled).
    ///
    /// [`choose`]: super::choose
    #[inline]
    pub fn resolve(&self, overrides: &CostOverrides) -> CostConfig {
        CostConfig {
            overlap_score_credit: overrides
                .overlap_score_credit
                .unwrap_or(self.overlap_score_credit),
            prefill_load_scale: overrides
                .prefill_load_scale
                .unwrap_or(self.prefill_load_scale),
            shared_cache_multiplier: overrides
                .shared_cache_multiplier
                .unwrap_or(self.shared_cache_multiplier),
            temperature: overrides.temperature.unwrap_or(self.temperature),
            // The tier weights, the active-request weight and the decay: as configured.
            ..*self
        }
    }
}
