//! The partition as the sink of its workers' KV events: ingress decodes and sequence-checks
//! messages and writes them here through [`EventSink`], gated by the indexer policy.

use super::Partition;
use crate::index::{ApplyOutcome, IndexError, KvEvent, RankId, WorkerId};
use crate::ingress::ingest::{EventSink, IngestOutcome, IngressRegistry, StreamStats};

impl EventSink for Partition {
    fn block_size(&self) -> u32 {
        Partition::block_size(self)
    }

    fn cache_namespace(&self) -> Option<&str> {
        self.config().cache_namespace.as_deref()
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

    fn streams(&self) -> &IngressRegistry {
        &self.ingress
    }
}

impl Partition {
    /// Hands kvr one engine message (its frames: topic, sequence number, msgpack payload)
    /// of `worker_id`'s stream `stream` (e.g. the DP rank of the socket it came from):
    /// it is sequence-checked, decoded and applied. Without replay (the host owns the
    /// socket), a gap or a restart clears the stream's ranks. Messages of one stream must
    /// be handed in order from one thread at a time (the stream is locked meanwhile);
    /// other streams proceed in parallel.
    pub fn ingest(
        &self,
        worker_id: WorkerId,
        stream: u32,
        _topic: &[u8],
        seq: u64,
        payload: &[u8],
    ) -> IngestOutcome {
        // Events off or a remote primary: the local index takes no events (counted in
        // `indexer_stats().events_ignored`).
        if !self.indexing.accepts_events() {
            return IngestOutcome::default();
        }
        self.ingress
            .ingest_raw(self, worker_id, stream, seq, payload)
    }

    /// Counters of every ingress stream of this partition.
    pub fn ingress_stats(&self) -> Vec<StreamStats> {
        self.ingress.stats()
    }
}
