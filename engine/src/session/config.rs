//! What the table is given: a turn's [`SessionContext`], the table's [`SessionConfig`]
//! (affinity mode, bounds, idle TTL) and its limits, and under loom the negative-control
//! faults of the models.

use std::time::Duration;

/// Structured session context (seed 001); it takes precedence over a legacy flat session
/// id. Carried through to the decision; the affinity table comes with DESIGN.md §9.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionContext {
    /// The session's id: what the affinity table binds (empty or too long: not recorded).
    pub session_id: String,
    /// The parent session: a session with no binding of its own starts from its parent's.
    pub parent_session_id: Option<String>,
    /// This is the session's last turn: release its binding once its leases end.
    pub session_final: bool,
    /// What started this turn (the typed selector's trigger), passed through.
    pub input_trigger: Option<String>,
}

/// How long a lease released before its bind is remembered (see the module docs). Far
/// longer than the gap between a booking and its bind, which is microseconds.
pub const EARLY_RELEASE_WINDOW: Duration = Duration::from_secs(60);

/// Session shards are halved until each gets at least this many entries (or one is left).
pub const MIN_ENTRIES_PER_SHARD: usize = 16;

/// How the binding steers a selection.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum AffinityMode {
    /// Pin: a turn goes to the bound rank unless that rank left or is not eligible (then
    /// it rebinds, counted as forced). Dynamo's default.
    #[default]
    Hard,
    /// Prefer: the bound rank's cost is lowered by `penalty_blocks` (cost units are
    /// blocks; lower cost wins). A negative or non-finite penalty is taken as 0.
    Soft {
        /// The bound rank's cost discount, in blocks (converted to the model's unit).
        penalty_blocks: f64,
    },
}

/// Configuration of one partition's session table.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionConfig {
    /// How a binding steers a selection (default `Hard`).
    pub mode: AffinityMode,
    /// Most sessions the table holds (default 65,536), enforced per shard (module docs,
    /// "Bounds"). 0 is taken as 1.
    pub max_entries: usize,
    /// An entry without leases is dropped this long after its last activity (default
    /// 600 s; the module docs say why).
    pub idle_ttl: Duration,
    /// Number of session shards and of lease shards (rounded up to a power of two, at
    /// least 1). Session shards are then halved while a shard would get fewer than
    /// [`MIN_ENTRIES_PER_SHARD`] entries, so a small table is not split into shards too
    /// small for eviction to choose well.
    pub shards: usize,
    /// Longest session id accepted, in bytes (default 256, as Dynamo).
    pub max_session_id_bytes: usize,
    /// How many leases released before their bind each lease shard remembers (module
    /// docs; 0 = none: a bind that comes after its lease's release then holds the lease
    /// for good, and its entry never expires).
    pub early_release_memory: usize,
}

/// [`SessionConfig::max_session_id_bytes`]'s default (the C ABI's fixed limit).
pub const DEFAULT_MAX_SESSION_ID_BYTES: usize = 256;

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            mode: AffinityMode::Hard,
            max_entries: 65_536,
            idle_ttl: Duration::from_secs(600),
            shards: 64,
            max_session_id_bytes: DEFAULT_MAX_SESSION_ID_BYTES,
            early_release_memory: 64,
        }
    }
}

/// Negative-control faults of the loom models (each breaks one step of the protocol).
#[cfg(loom)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SessionFaults {
    /// `release_lease` decides "last lease of a final session" in one critical section
    /// and removes the entry in a second one.
    pub(crate) split_last_lease_release: bool,
    /// `bind` ignores the memory of leases released before their bind.
    pub(crate) ignore_early_release: bool,
}
