//! The partition as the sink of its workers' KV events: ingress sequence-checks, decodes
//! and translates messages and writes them here through [`EventSink`], and every entry
//! goes through ingress's door, which asks [`EventSink::admit_events`] (the indexer
//! policy) first.

use super::Partition;
use crate::ids::{RankId, WorkerId};
use crate::index::{ApplyOutcome, IndexError, KvEvent};
use crate::ingress::counters::{StreamCounters, StreamStats};
use crate::ingress::door::{self, EventSink, EventsOutcome, IngestOutcome, Origin, StreamResume};
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
        if let Some(log) = self.log() {
            log.cleared(worker, dp_ranks);
        }
    }

    fn applied(&self, origin: Origin, rank: RankId, event: &KvEvent<'_>) {
        if let Some(log) = self.log() {
            log.applied(origin, rank, event);
        }
    }

    fn batch_end(&self, origin: Origin) {
        if let Some(log) = self.log() {
            log.batch_end(origin);
        }
    }

    fn resume_point(&self, worker: WorkerId, stream: u32) -> Option<StreamResume> {
        self.ingress.take_resume_point(worker, stream)
    }

    fn register_stream(&self, worker: WorkerId, stream: u32) -> StreamCounters {
        self.ingress.register(worker, stream)
    }

    fn mark_stale(&self, worker: WorkerId, dp_ranks: &[u32], since_unix_ms: Option<u64>) {
        self.ingress.freshness.mark(worker, dp_ranks, since_unix_ms);
    }

    /// A registered worker's own ranks; for one not registered yet (engines may publish
    /// before the host registers them), a rank below [`MAX_DP_SIZE`] within the
    /// partition's budget of such ranks ([`MAX_PENDING_RANKS`](crate::ingress::MAX_PENDING_RANKS)).
    fn accepts_dp_rank(&self, worker: WorkerId, dp: u32) -> bool {
        match self.workers().get(worker) {
            Some(w) => w.has_rank(dp),
            None => dp < MAX_DP_SIZE && self.ingress.admit_pending(RankId::new(worker, dp)),
        }
    }

    /// Up to `MAX_LOOKAHEAD_LENGTHS` distinct lengths, each then hashed by selection.
    fn accepts_lookahead(&self, len: u32) -> bool {
        self.lookahead.note(len)
    }

    fn claim_stream(&self, worker: WorkerId, taken: &dyn Fn(u32) -> bool) -> Option<u32> {
        self.ingress.claim_stream(worker, taken)
    }

    fn note_refused(&self) {
        self.ingress.note_refused();
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
    ///
    /// Nothing handed in creates state without bound: a batch naming a DP rank its worker
    /// does not have is refused (`IngestOutcome::refused`, the stream's `dp_rank_refused`),
    /// and a message that would open a new stream past [`MAX_INGRESS_STREAMS`](crate::ingress::MAX_INGRESS_STREAMS) beyond the registered ranks, or for a
    /// worker not registered past the pending-rank budget ([`MAX_PENDING_RANKS`](crate::ingress::MAX_PENDING_RANKS), with
    /// `stream` as its DP rank), is refused and counted
    /// (`indexer_stats().ingress_refused`).
    pub fn ingest(
        &self,
        worker_id: WorkerId,
        stream: u32,
        _topic: &[u8],
        seq: u64,
        payload: &[u8],
    ) -> IngestOutcome {
        let may_open = || {
            self.workers().get(worker_id).is_some()
                || (stream < MAX_DP_SIZE
                    && self.ingress.admit_pending(RankId::new(worker_id, stream)))
        };
        self.ingress
            .ingest_raw(self, worker_id, stream, seq, payload, may_open)
    }

    /// Applies a batch of one rank's events in order, as the indexer policy says: a
    /// partition that applies no engine events (KV events off, or a remote primary)
    /// ignores the batch and counts it (`indexer_stats().events_ignored`). An event the
    /// index refuses (unknown parent, too many ranks) is skipped and counted; the rest
    /// still apply. The rank is checked as a stream's batch is: a registered worker's
    /// own DP rank, or, for a worker not registered yet (engines may publish before the
    /// host registers them), a rank below [`MAX_DP_SIZE`] within the pending-rank budget
    /// ([`MAX_PENDING_RANKS`](crate::ingress::MAX_PENDING_RANKS)); any other is refused whole (`EventsOutcome::rank_refused`,
    /// counted in `indexer_stats().ingress_refused`).
    pub fn apply_events<'e>(
        &self,
        rank: RankId,
        events: impl IntoIterator<Item = KvEvent<'e>>,
    ) -> EventsOutcome {
        if self.indexing.policy.applies_events()
            && !self.accepts_dp_rank(rank.worker_id, rank.dp_rank)
        {
            self.ingress.note_refused();
            return EventsOutcome {
                rank_refused: true,
                rejected: events.into_iter().count() as u64,
                ..EventsOutcome::default()
            };
        }
        door::apply_events(self, rank, events)
    }

    /// Counters of every ingress stream of this partition.
    pub fn ingress_stats(&self) -> Vec<StreamStats> {
        self.ingress.stats()
    }
}
