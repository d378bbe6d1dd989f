//! The partition as the sink of its workers' KV events: ingress sequence-checks, decodes
//! and translates messages and writes them here through [`EventSink`], and every entry
//! goes through ingress's door, which asks [`EventSink::admit_events`] (the indexer
//! policy) first.

use super::Partition;
use crate::ids::{RankId, WorkerId};
use crate::index::{ApplyOutcome, IndexError, KvEvent};
use crate::ingress::counters::{StreamCounters, StreamStats};
use crate::ingress::door::{self, EventSink, EventsOutcome, IngestOutcome};
use crate::workers::MAX_DP_SIZE;

impl EventSink for Partition {
    fn block_size(&self) -> u32 {
        Partition::block_size(self)
    }

    fn cache_namespace(&self) -> Option<&str> {
        self.config().cache_namespace.as_deref()
    }

    /// Events off or a remote primary: the local index takes no events (counted in
    /// `indexer_stats().events_ignored`).
    fn admit_events(&self) -> bool {
        self.indexing.accepts_events()
    }

    fn apply_event(&self, rank: RankId, event: &KvEvent<'_>) -> Result<ApplyOutcome, IndexError> {
        self.index.apply(rank, event)
    }

    fn clear_ranks(&self, worker: WorkerId, dp_ranks: &[u32]) {
        for rank in self.index.ranks() {
            if rank.worker_id == worker && (dp_ranks.is_empty() || dp_ranks.contains(&rank.dp_rank))
            {
                self.index.clear(rank);
            }
        }
    }

    fn register_stream(&self, worker: WorkerId, stream: u32) -> StreamCounters {
        self.ingress.register(worker, stream)
    }

    fn mark_stale(&self, worker: WorkerId, dp_ranks: &[u32], since_unix_ms: Option<u64>) {
        self.ingress.freshness.mark(worker, dp_ranks, since_unix_ms);
    }

    /// A registered worker's own ranks; below [`MAX_DP_SIZE`] for one not registered yet
    /// (engines may publish before the host registers them).
    fn accepts_dp_rank(&self, worker: WorkerId, dp: u32) -> bool {
        match self.workers().get(worker) {
            Some(w) => w.has_rank(dp),
            None => dp < MAX_DP_SIZE,
        }
    }

    /// Up to `MAX_LOOKAHEAD_LENGTHS` distinct lengths, each then hashed by selection.
    fn accepts_lookahead(&self, len: u32) -> bool {
        self.lookahead.note(len)
    }
}

impl Partition {
    /// Hands kvr one engine message (its frames: topic, sequence number, msgpack payload)
    /// of `worker_id`'s stream `stream` (e.g. the DP rank of the socket it came from):
    /// it is sequence-checked, decoded and applied. Without replay (the host owns the
    /// socket), a gap or a restart clears the stream's ranks. Messages of one stream must
    /// be handed in order from one thread at a time (the stream is locked meanwhile);
    /// other streams proceed in parallel. A partition whose indexer policy applies no
    /// engine events (KV events off, or a remote primary) ignores the message and counts
    /// it (`indexer_stats().events_ignored`).
    pub fn ingest(
        &self,
        worker_id: WorkerId,
        stream: u32,
        _topic: &[u8],
        seq: u64,
        payload: &[u8],
    ) -> IngestOutcome {
        self.ingress
            .ingest_raw(self, worker_id, stream, seq, payload)
    }

    /// Applies a batch of one rank's events in order, as the indexer policy says: a
    /// partition that applies no engine events (KV events off, or a remote primary)
    /// ignores the batch and counts it (`indexer_stats().events_ignored`). An event the
    /// index refuses (unknown parent, too many ranks) is skipped and counted; the rest
    /// still apply. The rank need not be a registered worker (engines may publish before
    /// the host registers them).
    pub fn apply_events<'e>(
        &self,
        rank: RankId,
        events: impl IntoIterator<Item = KvEvent<'e>>,
    ) -> EventsOutcome {
        door::apply_events(self, rank, events)
    }

    /// Counters of every ingress stream of this partition.
    pub fn ingress_stats(&self) -> Vec<StreamStats> {
        self.ingress.stats()
    }
}
