//! Cost → choice: Dynamo's per-rank cost function and the temperature-controlled pick.
//!
//! This is step 5 of selection (DESIGN.md §7): given, for every surviving candidate rank,
//! its cached prefix (per tier), the host's shared-cache hits beyond it, and the engine's
//! live bookings on it, compute a cost (lower wins), then choose. Two models
//! ([`CostModel`]): the default prices a candidate in ms of predicted TTFT
//! ([`latency_cost`]); [`CostModel::Dynamo`] is Dynamo's current default scorer in block
//! equivalents, reproduced term for term from REFERENCE.md §3 so that kvr can route
//! exactly as a Dynamo router configured the same way would. The booking terms both read
//! (active prefill tokens, active decode blocks with shared prompt blocks counted once
//! per rank) are REFERENCE.md §4.
//!
//! Everything here is a pure function of its arguments: no I/O, no locks, no allocation.
//! The caller owns any buffers ([`fill_costs`] writes into a slice it is given) and the
//! random source ([`SelectionRng`], or anything implementing [`RandomSource`]), which is
//! what makes selection reproducible in tests and replays.

mod choice;
mod columns;
pub(crate) mod config;
mod credit_form;
mod eval;
mod formula;
mod latency;
mod resolved;
mod rng;

pub use choice::choose;
pub(crate) use choice::{choose_argmin_weighted, takes_argmin, ties_at_min};
pub(crate) use columns::{LoadColumns, LoadRow};
pub(crate) use config::{CostModel, CostOverrides};
pub(crate) use credit_form::CreditForm;
pub(crate) use eval::decode_block_in_tokens;
pub use eval::{blocks_in_cost_units, cost, fill_costs, CostEval};
pub use formula::{
    classic_logit, cost_breakdown, min_active_prefill_tokens, CandidateLoad, CostBreakdown,
    RequestShape, CLASSIC_OVERLAP_SCORE_WEIGHT,
};
pub use latency::{latency_cost, LatencyBreakdown};
pub use rng::{RandomSource, SelectionRng};

#[cfg(all(test, not(loom)))]
mod tests;
