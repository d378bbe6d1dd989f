//! The effective knobs of one selection: [`ResolvedCost`], what the hot path reads, and
//! [`CostConfig::resolve`], which folds a request's [`CostOverrides`] into the configured
//! values to make one.

use super::config::{CostConfig, CostOverrides};

/// The effective knobs for one selection: a [`CostConfig`] with a request's
/// [`CostOverrides`] applied (see [`CostConfig::resolve`]). The same type, so no field
/// list is kept twice.
pub(crate) type ResolvedCost = CostConfig;

impl From<&CostConfig> for ResolvedCost {
    fn from(cfg: &CostConfig) -> Self {
        cfg.resolve(&CostOverrides::NONE)
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
    ///
    /// [`choose`]: super::choose
    #[inline]
    pub fn resolve(&self, overrides: &CostOverrides) -> ResolvedCost {
        ResolvedCost {
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
