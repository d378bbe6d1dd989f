//! What a replica's sync did: events sent and dropped, received and how each was applied.

use std::sync::atomic::{AtomicU64, Ordering};

/// How a peer's event was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// It changed this replica's bookings.
    Applied,
    /// An add for an id that is live here already, or a prefill completion already seen:
    /// nothing to do (Dynamo's rule).
    Duplicate,
    /// No partition with its model and routing group here.
    UnknownPartition,
    /// The partition's block size differs: its hashes name other blocks.
    BlockSizeMismatch,
    /// Its worker or DP rank is not registered here (a peer never creates workers).
    UnknownRank,
    /// A completion or free for an id not live here.
    UnknownBooking,
    /// A completion or free naming another rank than the booking's (Dynamo ignores it).
    WrongRank,
    /// Over a bound (too many blocks, too many named ids).
    Refused,
}

/// Counters of one replica's sync (monotonic).
#[derive(Debug, Default)]
pub(crate) struct SyncCounters {
    pub(crate) sent: AtomicU64,
    pub(crate) received: AtomicU64,
    pub(crate) own: AtomicU64,
    pub(crate) undecodable: AtomicU64,
    pub(crate) unknown_topic: AtomicU64,
    pub(crate) peer_gone: AtomicU64,
    pub(crate) outcomes: [AtomicU64; 8],
}

/// A moment's copy of [`SyncCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncStats {
    /// Events published to the peers.
    pub sent: u64,
    /// Messages received from the peers.
    pub received: u64,
    /// Received messages this replica sent itself (its own router id), skipped.
    pub own: u64,
    /// Received payloads that are not booking events.
    pub undecodable: u64,
    /// Received messages on a topic this replica does not read.
    pub unknown_topic: u64,
    /// Events applied.
    pub applied: u64,
    /// Adds of live ids and repeated completions: nothing to do.
    pub duplicate: u64,
    /// Events for a partition this replica lacks.
    pub unknown_partition: u64,
    /// Events for a partition with another block size here.
    pub block_size_mismatch: u64,
    /// Events naming a worker or rank not registered here.
    pub unknown_rank: u64,
    /// Completions and frees of ids not live here.
    pub unknown_booking: u64,
    /// Completions and frees naming another rank than the booking's.
    pub wrong_rank: u64,
    /// Events over a bound.
    pub refused: u64,
    /// Peers' bookings dropped because their peer went silent, was deregistered or
    /// restarted.
    pub peer_gone: u64,
}

impl SyncStats {
    /// Every counter with its name, in one place (the service's metrics and Python's dict
    /// read it).
    pub fn named(&self) -> [(&'static str, u64); 14] {
        [
            ("sent", self.sent),
            ("received", self.received),
            ("own", self.own),
            ("undecodable", self.undecodable),
            ("unknown_topic", self.unknown_topic),
            ("applied", self.applied),
            ("duplicate", self.duplicate),
            ("unknown_partition", self.unknown_partition),
            ("block_size_mismatch", self.block_size_mismatch),
            ("unknown_rank", self.unknown_rank),
            ("unknown_booking", self.unknown_booking),
            ("wrong_rank", self.wrong_rank),
            ("refused", self.refused),
            ("peer_gone", self.peer_gone),
        ]
    }
}

impl SyncCounters {
    pub(crate) fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn outcome(&self, a: Applied) {
        Self::bump(&self.outcomes[a as usize]);
    }

    /// A moment's copy.
    pub(crate) fn snapshot(&self) -> SyncStats {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let o = |a: Applied| l(&self.outcomes[a as usize]);
        SyncStats {
            sent: l(&self.sent),
            received: l(&self.received),
            own: l(&self.own),
            undecodable: l(&self.undecodable),
            unknown_topic: l(&self.unknown_topic),
            applied: o(Applied::Applied),
            duplicate: o(Applied::Duplicate),
            unknown_partition: o(Applied::UnknownPartition),
            block_size_mismatch: o(Applied::BlockSizeMismatch),
            unknown_rank: o(Applied::UnknownRank),
            unknown_booking: o(Applied::UnknownBooking),
            wrong_rank: o(Applied::WrongRank),
            refused: o(Applied::Refused),
            peer_gone: l(&self.peer_gone),
        }
    }
}
