//! What an index is told: ranks, storage tiers and the three KV events.

use crate::ids::Tier;

/// One block of a `Stored` event: the engine's own opaque hash (used only to resolve
/// parents and removals for that rank) and kvr's local hash of the block's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    /// The engine's hash of the block: how this rank's later events name it.
    pub external_hash: u64,
    /// kvr's local hash of the block's tokens: what lookups match.
    pub local_hash: u64,
}

/// A KV-cache event from one rank, borrowing its block lists (no allocation to apply).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEvent<'a> {
    /// `blocks` extend the chain ending at `parent` (an external hash this rank stored
    /// earlier), or start a prompt when `parent` is `None`.
    Stored {
        /// The tier the blocks are now held on.
        tier: Tier,
        /// The external hash of the block before the first one; `None` = a prompt's start.
        parent: Option<u64>,
        /// The stored blocks, first block first.
        blocks: &'a [StoredBlock],
    },
    /// Blocks the rank already holds (on any tier), named only by their engine hashes,
    /// are now also held on `tier`: how an offloading connector announces the host or
    /// disk copy of a device block without its tokens. A hash the rank does not hold
    /// names a block whose tokens kvr never saw: it is left out and counted
    /// ([`ApplyOutcome::not_found`]).
    StoredKnown {
        /// The tier the blocks are now (also) held on.
        tier: Tier,
        /// The engine's hashes of the blocks.
        external_hashes: &'a [u64],
    },
    /// The rank evicted these blocks from `tier`.
    Removed {
        /// The tier the blocks left.
        tier: Tier,
        /// The engine's hashes of the blocks.
        external_hashes: &'a [u64],
    },
    /// The rank dropped its whole cache (prefix-cache reset).
    Cleared,
    /// A hybrid model's recurrent (Mamba, linear-attention) group holds its state, on
    /// `tier`, at the end of the blocks these engine hashes name: the engine can reuse a
    /// prefix only up to a block where it holds such a state. A rank that announces one
    /// is scored that way from then on. A hash naming no block the rank holds is left
    /// out and counted ([`ApplyOutcome::not_found`]).
    StatesStored {
        /// The tier the states are held on.
        tier: Tier,
        /// The engine's hashes of the blocks whose end the states belong to.
        external_hashes: &'a [u64],
    },
    /// The recurrent group dropped the states these engine hashes name from `tier`.
    StatesRemoved {
        /// The tier the states left.
        tier: Tier,
        /// The engine's hashes the states were announced under.
        external_hashes: &'a [u64],
    },
}

/// Why an event was refused. Refusals are counted per rank and in total.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum IndexError {
    /// A `Stored` event named a parent this rank does not hold; the whole store is
    /// rejected, since its blocks' prefixes are unknown.
    ParentNotFound {
        /// The external hash of the unknown parent.
        parent: u64,
    },
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
    /// Removed hashes this rank did not hold on that tier (counted as `block_not_found`),
    /// or hashes of a [`KvEvent::StoredKnown`] it held on no tier (left out).
    pub not_found: usize,
}
