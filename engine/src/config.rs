//! How a partition hashes, scores and books: the configuration every layer below the
//! partition reads its part of.

use std::time::Duration;

use crate::cost::CostConfig;
use crate::indexer::IndexerConfig;
use crate::session::SessionConfig;
use crate::workers::BackendRole;

/// Per-partition busy thresholds (Dynamo's): a rank over any set threshold is busy and is
/// not chosen; if every candidate is busy the selection answers `Busy`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BusyThresholds {
    /// Busy when active decode blocks exceed this fraction of the rank's total KV blocks.
    pub decode_blocks_fraction: Option<f64>,
    /// Busy when active prefill tokens exceed this many.
    pub prefill_tokens: Option<u64>,
    /// Busy when active prefill tokens exceed this fraction of max batched tokens.
    pub prefill_tokens_fraction: Option<f64>,
}

/// When a booked selection may carry a `kv_hint` (DESIGN.md §7): a peer rank that holds
/// a longer device prefix than the chosen one and can serve it over its control endpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct HintConfig {
    /// The source's device prefix must exceed the chosen rank's by at least this many
    /// blocks (a short transfer is not worth a round trip).
    pub min_advantage_blocks: u32,
    /// Most blocks one hint asks to move.
    pub max_transfer_blocks: u32,
    /// Roles whose ranks may serve transfers.
    pub source_roles: Vec<BackendRole>,
}

impl Default for HintConfig {
    fn default() -> Self {
        HintConfig {
            min_advantage_blocks: 4,
            max_transfer_blocks: 4_096,
            // A decode worker's cache is busy serving its own sequences; prefill and
            // aggregated workers hand theirs out.
            source_roles: vec![BackendRole::Prefill, BackendRole::Aggregated],
        }
    }
}

/// How a partition hashes, scores and books.
#[derive(Clone, Debug)]
pub struct PartitionConfig {
    pub block_size: u32,
    /// Cache namespace salt of every local hash (LoRA salts come per request).
    pub cache_namespace: Option<String>,
    pub cost: CostConfig,
    pub busy: BusyThresholds,
    /// Lifetime of a booking nobody frees (Dynamo current: 3,600 s).
    pub booking_ttl: Duration,
    /// Which index answers overlap queries and which bookings feed one (DESIGN.md §5).
    pub indexer: IndexerConfig,
    /// Transfer hints on booked responses; `None` (the default) = the partition consumes
    /// none, and selection keeps no per-rank overlaps beyond the choice.
    pub hints: Option<HintConfig>,
    /// Session affinity (DESIGN.md §9); `None` (the default) = sessions are carried
    /// through to the decision but steer nothing.
    pub sessions: Option<SessionConfig>,
}

impl PartitionConfig {
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            cache_namespace: None,
            cost: CostConfig::default(),
            busy: BusyThresholds::default(),
            booking_ttl: Duration::from_secs(3_600),
            indexer: IndexerConfig::default(),
            hints: None,
            sessions: None,
        }
    }
}
