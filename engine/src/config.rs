//! Every configuration, in one place: how a partition hashes, scores and books
//! ([`PartitionConfig`] and the parts it holds: the cost, the indexer policy, sessions,
//! busy thresholds, transfer hints), each layer below the partition reading its part.

use std::time::Duration;

use crate::workers::BackendRole;

pub use crate::cost::config::{CostConfig, CostModel, LatencyConfig};
pub use crate::index::{
    ApproxConfig, IndexConfig, RemoteConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_REQUEST_TIMEOUT,
};
pub use crate::indexer::{
    IndexerConfig, IndexerConfigError, IndexerPolicy, ResolvedIndexer, Retention,
};
pub use crate::reservation::ReservationConfig;
pub use crate::session::{
    AffinityMode, SessionConfig, DEFAULT_MAX_SESSION_ID_BYTES, EARLY_RELEASE_WINDOW,
    MIN_ENTRIES_PER_SHARD,
};

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
    /// Tokens per KV block (the engines' block size): prompts are cut and hashed by it.
    pub block_size: u32,
    /// Cache namespace salt of every local hash (LoRA salts come per request).
    pub cache_namespace: Option<String>,
    /// The cost function: which model, and its knobs.
    pub cost: CostConfig,
    /// Busy thresholds (none set by default).
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
    /// Keep what [`Partition::dump_index`](crate::Partition::dump_index) needs to write the
    /// index out as events (each block's parent and local hash: a 32-byte slot per
    /// distinct block, tables at most 3/4 full): for a peer to recover from (Dynamo's
    /// `/dump`). Off by default.
    pub index_dump: bool,
    /// Credit a stale rank's overlap anyway (`crate::freshness`): a rank whose stream has
    /// a known loss being replayed, or is degraded or dead (`SourceHealth`: unreachable,
    /// silent, state cleared, decode errors, reconnected). Off by default: such a rank may
    /// hold blocks kvr did not see evicted, so its overlap counts as none until the
    /// stream's repair is in the index; it still competes on load.
    pub trust_stale_overlap: bool,
}

impl PartitionConfig {
    /// A configuration with this block size (in tokens) and every other setting at its
    /// default.
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
            index_dump: false,
            trust_stale_overlap: false,
        }
    }
}

/// Why a partition configuration is refused: what Rust and the C ABI refuse alike (the C
/// setters refuse each value as `KVR_ERR_INVALID_ARGUMENT`; creating a partition whose
/// options contradict each other is `KVR_ERR_INVALID_CONFIG`, with this as the reason).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// `block_size` is 0.
    ZeroBlockSize,
    /// `booking_ttl` is zero: every booking would expire as it is made.
    ZeroBookingTtl,
    /// A cost knob or busy threshold (named) is NaN or infinite.
    NotFinite(&'static str),
    /// A transfer-hint setting (named) is refused: `max_transfer_blocks` 0, or no
    /// source role.
    Hints(&'static str),
    /// A session-affinity setting (named) is refused: a negative or non-finite soft
    /// penalty.
    Sessions(&'static str),
    /// A latency-model knob (named) is outside its range: NaN or infinite, a prefill-rate
    /// prior that is not positive, a negative time or weight, a pressure threshold
    /// outside [0, 1], or a per-token target that is not positive.
    OutOfRange(&'static str),
    /// The indexer configuration (DESIGN.md §5), e.g. a remote primary with events off.
    Indexer(IndexerConfigError),
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigError::ZeroBlockSize => write!(f, "the block size must be at least 1"),
            ConfigError::ZeroBookingTtl => write!(f, "the booking TTL must be positive"),
            ConfigError::NotFinite(what) => write!(f, "{what} must be finite"),
            ConfigError::Hints(what) => write!(f, "transfer hints: {what}"),
            ConfigError::Sessions(what) => write!(f, "session affinity: {what}"),
            ConfigError::OutOfRange(what) => write!(f, "{what} is out of range"),
            ConfigError::Indexer(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ConfigError {}

impl From<IndexerConfigError> for ConfigError {
    fn from(e: IndexerConfigError) -> Self {
        ConfigError::Indexer(e)
    }
}

impl PartitionConfig {
    /// Whether a partition can be built with this configuration: the checks the C ABI's
    /// setters and `kvr_partition_options_check` make, in one place, so a Rust host is
    /// refused what a C host is (Rust no longer clamps a block size of 0 to 1).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validated().map(drop)
    }

    /// [`PartitionConfig::validate`], keeping the indexer policy it resolved, so the
    /// partition that is built from it does not resolve it again.
    pub(crate) fn validated(&self) -> Result<ResolvedIndexer, ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::ZeroBlockSize);
        }
        if self.booking_ttl.is_zero() {
            return Err(ConfigError::ZeroBookingTtl);
        }
        let c = &self.cost;
        let knobs = [
            (c.overlap_score_credit, "overlap_score_credit"),
            (c.prefill_load_scale, "prefill_load_scale"),
            (c.host_cache_hit_weight, "host_cache_hit_weight"),
            (c.disk_cache_hit_weight, "disk_cache_hit_weight"),
            (c.shared_cache_multiplier, "shared_cache_multiplier"),
            (c.temperature, "temperature"),
            (
                c.decode_active_request_weight,
                "decode_active_request_weight",
            ),
            (c.credit_decay.unwrap_or(0.0), "credit_decay"),
            (
                self.busy.decode_blocks_fraction.unwrap_or(0.0),
                "decode_blocks_fraction",
            ),
            (
                self.busy.prefill_tokens_fraction.unwrap_or(0.0),
                "prefill_tokens_fraction",
            ),
        ];
        if let Some((_, name)) = knobs.iter().find(|(v, _)| !v.is_finite()) {
            return Err(ConfigError::NotFinite(name));
        }
        if let Some(name) = c.latency.out_of_range() {
            return Err(ConfigError::OutOfRange(name));
        }
        if let Some(h) = &self.hints {
            if h.max_transfer_blocks == 0 {
                return Err(ConfigError::Hints("max_transfer_blocks must be at least 1"));
            }
            if h.source_roles.is_empty() {
                return Err(ConfigError::Hints("at least one source role is needed"));
            }
        }
        if let Some(s) = &self.sessions {
            if let AffinityMode::Soft { penalty_blocks } = s.mode {
                if !(penalty_blocks.is_finite() && penalty_blocks >= 0.0) {
                    return Err(ConfigError::Sessions(
                        "the soft penalty must be finite and not negative",
                    ));
                }
            }
        }
        Ok(self.indexer.check()?)
    }
}
