//! What an index is told: ranks, storage tiers and the three KV events.

/// An inference worker (engine process or pod).
pub type WorkerId = u64;
/// A data-parallel rank inside a worker.
pub type DpRank = u32;

/// The unit every index entry, load figure and booking is keyed by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankId {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
}

impl RankId {
    pub const fn new(worker_id: WorkerId, dp_rank: DpRank) -> Self {
        Self { worker_id, dp_rank }
    }
}

impl std::fmt::Display for RankId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}

/// Where a rank keeps a block: GPU memory (the primary tier), host memory or disk
/// (vLLM's `medium` = "GPU" | "CPU" | "STORAGE").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Tier {
    Device = 0,
    Host = 1,
    Disk = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    pub(crate) const fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// One block of a `Stored` event: the engine's own opaque hash (used only to resolve
/// parents and removals for that rank) and kvr's local hash of the block's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    pub external_hash: u64,
    pub local_hash: u64,
}

/// A KV-cache event from one rank, borrowing its block lists (no allocation to apply).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEvent<'a> {
    /// `blocks` extend the chain ending at `parent` (an external hash this rank stored
    /// earlier), or start a prompt when `parent` is `None`.
    Stored {
        tier: Tier,
        parent: Option<u64>,
        blocks: &'a [StoredBlock],
    },
    /// The rank evicted these blocks from `tier`.
    Removed {
        tier: Tier,
        external_hashes: &'a [u64],
    },
    /// The rank dropped its whole cache (prefix-cache reset).
    Cleared,
}

/// Why an event was refused. Refusals are counted per rank and in total.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexError {
    /// A `Stored` event named a parent this rank does not hold; the whole store is
    /// rejected, since its blocks' prefixes are unknown.
    ParentNotFound { parent: u64 },
    /// The index already tracks the maximum number of ranks ([`super::MAX_RANKS`]).
    TooManyRanks,
}

impl std::fmt::Display for IndexError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IndexError::ParentNotFound { parent } => {
                write!(f, "parent block {parent} is not stored on this rank")
            }
            IndexError::TooManyRanks => {
                write!(f, "too many ranks (at most {})", super::MAX_RANKS)
            }
        }
    }
}

impl std::error::Error for IndexError {}

/// What applying one event changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Blocks newly stored on the event's tier (a repeated store adds nothing).
    pub stored: usize,
    /// Blocks removed from the event's tier (or, for `Cleared`, from every tier).
    pub removed: usize,
    /// Removed hashes this rank did not hold on that tier (counted as `block_not_found`).
    pub not_found: usize,
}
