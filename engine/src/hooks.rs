//! Inputs the host supplies to selection (seed 001): optional callbacks, each leaving
//! the input it would change as it was when absent.

use crate::sync::StdArc;

use crate::ids::{RankId, WorkerId};

/// A block range `[start, end)` of the prompt that the host's shared KV cache holds.
pub type BlockRange = (u32, u32);

/// What the prefill estimator is asked.
#[derive(Clone, Copy, Debug)]
pub struct PrefillQuery {
    /// The candidate rank.
    pub rank: RankId,
    /// The prompt's length, tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens the rank holds on its device (its device overlap in tokens, at most
    /// `prompt_tokens`).
    pub cached_tokens: u64,
}

type Hook<F> = Option<StdArc<F>>;
/// Projected prefill tokens of a request on a rank, or `None` for the default.
pub type PrefillEstimator = dyn Fn(&PrefillQuery) -> Option<u64> + Send + Sync;
/// Prompt block ranges in the host's shared cache, or why the lookup failed.
pub type SharedCacheLookup = dyn Fn(&[u64]) -> Result<Vec<BlockRange>, String> + Send + Sync;
/// The workers (of those given) that serve a LoRA adapter.
pub type LoraFilter = dyn Fn(&str, &[WorkerId]) -> Vec<WorkerId> + Send + Sync;
/// Which of the ranks tied at the lowest cost to take: called with the candidate ranks and
/// the positions among them of the tied ones (two or more, ascending); returns one of those
/// positions.
pub type TieBreak = dyn Fn(&[RankId], &[usize]) -> Option<usize> + Send + Sync;

/// Inputs the host supplies (seed 001), each optional: an absent hook leaves the input
/// it would change as it was. Hooks are called with no engine lock held.
#[derive(Clone, Default)]
pub struct HostHooks {
    /// Projected prefill tokens of the request on a rank (default: prompt − cached).
    pub prefill_estimator: Hook<PrefillEstimator>,
    /// `true` = the rank is overloaded now (not chosen; all overloaded → `Busy`).
    pub overload: Hook<dyn Fn(RankId) -> bool + Send + Sync>,
    /// `false` = the rank cannot take requests (not a candidate at all).
    pub availability: Hook<dyn Fn(RankId) -> bool + Send + Sync>,
    /// Block ranges of the prompt (by sequence hashes) present in the host's shared KV
    /// cache; an error is logged and counted, and selection goes on without it.
    pub shared_cache: Hook<SharedCacheLookup>,
    /// The workers (of those given) that can serve a LoRA adapter.
    pub lora_filter: Hook<LoraFilter>,
    /// Among ranks tied at the lowest cost (temperature 0, no session pinning), which one:
    /// router replicas that split ties in different ways stop piling onto one rank when
    /// they choose at the same instant. Absent, or an answer not among the tied
    /// positions: a uniform random one.
    pub tie_break: Hook<TieBreak>,
}

impl std::fmt::Debug for HostHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostHooks")
            .field("prefill_estimator", &self.prefill_estimator.is_some())
            .field("overload", &self.overload.is_some())
            .field("availability", &self.availability.is_some())
            .field("shared_cache", &self.shared_cache.is_some())
            .field("lora_filter", &self.lora_filter.is_some())
            .field("tie_break", &self.tie_break.is_some())
            .finish()
    }
}
