//! The one door every KV event goes through on its way into a sink's index, whatever
//! brought it: a transport's [`EventSource`](super::EventSource), a host handing in raw
//! messages, or typed events.
//!
//! Three steps, each its own function: **decode and count** (`stream`: a payload into a
//! `DecodedBatch`, failures counted by cause), **translate** (`translate`: a decoded
//! event into a [`KvEvent`] with kvr's local hashes, or a counted skip) and **apply**
//! ([`Door::apply`]: the event into the index, its outcome counted). A [`Door`] is the only
//! way to apply, and [`Door::open`] is the only place that asks whether the sink takes
//! engine events at all (its indexer policy may apply none: events off, or a remote
//! primary), so no entry can skip that check.

use crate::ids::{RankId, WorkerId};
use crate::index::{ApplyOutcome, IndexError, KvEvent};
use crate::sync::StdArc;

use super::counters::StreamCounters;

/// What a sink is: where ingress writes, implemented by the partition, so that this layer
/// never names it. A sink applies one rank's events to the index its policy feeds, clears
/// a worker's ranks, and keeps the counters of the streams feeding it.
pub trait EventSink {
    /// The block size every stored block must have (others are refused and counted).
    fn block_size(&self) -> u32;
    /// The cache namespace that salts every local hash (with each event's LoRA name).
    fn cache_namespace(&self) -> Option<&str>;
    /// Whether engine events reach this sink's index at all; a refusal is counted (one
    /// per message, batch or source refused).
    fn admit_events(&self) -> bool;
    /// Applies one event of `rank`.
    fn apply_event(&self, rank: RankId, event: &KvEvent<'_>) -> Result<ApplyOutcome, IndexError>;
    /// Drops everything `worker` holds on the DP ranks `dp_ranks` (all of its ranks when
    /// empty), as after a gap in its stream (ingress always names the ranks).
    fn clear_ranks(&self, worker: WorkerId, dp_ranks: &[u32]);
    /// Counters for a new stream of `worker`, listed in this sink's stats from now on.
    fn register_stream(&self, worker: WorkerId, stream: u32) -> StreamCounters;
    /// Lists `worker`'s DP ranks `dp_ranks` as stale since `since_unix_ms` (ms since the
    /// Unix epoch), or unlists them (`None`): a stale rank's overlap is not trusted by
    /// selection (by default) until the loss is repaired or the ranks are cleared.
    fn mark_stale(&self, worker: WorkerId, dp_ranks: &[u32], since_unix_ms: Option<u64>);
    /// Whether `worker`'s events may name DP rank `dp`. A rank the worker does not have is
    /// never a selection candidate, so its blocks could only take memory: its batches are
    /// refused and counted (`StreamStats::dp_rank_refused`). Every rank by default.
    fn accepts_dp_rank(&self, worker: WorkerId, dp: u32) -> bool {
        let _ = (worker, dp);
        true
    }
    /// Whether blocks hashed with `len` tokens of lookahead (`crate::hash::lookahead`) may
    /// be indexed: only where selection hashes prompts with that length too, or they
    /// could never match. A refused store is skipped and counted. Required (no default),
    /// so that a sink wrapping another cannot drop it by forgetting to forward it; a sink
    /// that hashes no prompt with lookahead answers `len == 0`.
    fn accepts_lookahead(&self, len: u32) -> bool;
    /// `event` of `rank`, from `origin`, was applied (after [`Self::apply_event`]
    /// succeeded): what a journal of the index records. Required, as
    /// `accepts_lookahead`, so that a sink wrapping another cannot drop it; a sink that
    /// keeps no journal does nothing.
    fn applied(&self, origin: Origin, rank: RankId, event: &KvEvent<'_>);
    /// Every event of the stream batch `origin` names has been handed to
    /// [`Self::applied`]: a journal writes a batch whole or not at all. Required, as
    /// `applied`.
    fn batch_end(&self, origin: Origin);
    /// Where a new stream of `worker` numbered `stream` resumes: the last batch a previous
    /// run applied from it (seq, payload digest), taken once, as a warm restart restored
    /// it; `None` to start afresh. Required, as `applied`.
    fn resume_point(&self, worker: WorkerId, stream: u32) -> Option<StreamResume>;
    /// A stream number for a new stream of `worker` that a source numbers itself (a
    /// route-less topic): the lowest that no stream of this sink has and `taken` does not
    /// name, so streams of different sources never share a number; `None` when the sink
    /// keeps no more streams (the topic is dropped). The lowest `taken` does not name by
    /// default.
    fn claim_stream(&self, worker: WorkerId, taken: &dyn Fn(u32) -> bool) -> Option<u32> {
        let _ = worker;
        (0..=u32::MAX).find(|n| !taken(*n))
    }
    /// Counts one message or topic a source dropped for a bound (its topic would open a
    /// stream past the source's or the sink's cap). Nothing by default.
    fn note_refused(&self) {}
}

/// Implements [`EventSink`] for a pointer to a sink by forwarding every method.
macro_rules! forward_sink {
    ($($ptr:ty),*) => {$(
        impl<S: EventSink + ?Sized> EventSink for $ptr {
            fn block_size(&self) -> u32 {
                (**self).block_size()
            }
            fn cache_namespace(&self) -> Option<&str> {
                (**self).cache_namespace()
            }
            fn admit_events(&self) -> bool {
                (**self).admit_events()
            }
            fn apply_event(
                &self,
                rank: RankId,
                event: &KvEvent<'_>,
            ) -> Result<ApplyOutcome, IndexError> {
                (**self).apply_event(rank, event)
            }
            fn clear_ranks(&self, worker: WorkerId, dp_ranks: &[u32]) {
                (**self).clear_ranks(worker, dp_ranks)
            }
            fn register_stream(&self, worker: WorkerId, stream: u32) -> StreamCounters {
                (**self).register_stream(worker, stream)
            }
            fn mark_stale(&self, worker: WorkerId, dp_ranks: &[u32], since_unix_ms: Option<u64>) {
                (**self).mark_stale(worker, dp_ranks, since_unix_ms)
            }
            fn accepts_dp_rank(&self, worker: WorkerId, dp: u32) -> bool {
                (**self).accepts_dp_rank(worker, dp)
            }
            fn accepts_lookahead(&self, len: u32) -> bool {
                (**self).accepts_lookahead(len)
            }
            fn applied(&self, origin: Origin, rank: RankId, event: &KvEvent<'_>) {
                (**self).applied(origin, rank, event)
            }
            fn batch_end(&self, origin: Origin) {
                (**self).batch_end(origin)
            }
            fn resume_point(&self, worker: WorkerId, stream: u32) -> Option<StreamResume> {
                (**self).resume_point(worker, stream)
            }
            fn claim_stream(&self, worker: WorkerId, taken: &dyn Fn(u32) -> bool) -> Option<u32> {
                (**self).claim_stream(worker, taken)
            }
            fn note_refused(&self) {
                (**self).note_refused()
            }
        }
    )*};
}

// A shared sink is a sink (a subscription holds its partition by `Arc`), and so is a
// borrowed one.
forward_sink!(StdArc<S>, &S);

/// A sink whose policy takes engine events, for one message or batch: the only handle
/// events are applied through.
pub(crate) struct Door<'s, S: ?Sized>(&'s S, Origin);

impl<'s, S: EventSink + ?Sized> Door<'s, S> {
    /// The events-on check, the only one: `None` (counted by the sink) when its indexer
    /// policy applies no engine events. Events applied through it are [`Origin::Direct`]
    /// until [`Door::for_batch`] says otherwise.
    pub(crate) fn open(sink: &'s S) -> Option<Self> {
        sink.admit_events().then_some(Door(sink, Origin::Direct))
    }

    /// The same door, for the events of a stream's batch `seq`.
    pub(crate) fn for_batch(
        &self,
        worker_id: WorkerId,
        stream: u32,
        seq: u64,
        digest: u64,
    ) -> Self {
        Door(
            self.0,
            Origin::Stream {
                worker_id,
                stream,
                seq,
                digest,
            },
        )
    }

    /// Where this door's events come from.
    pub(crate) fn origin(&self) -> Origin {
        self.1
    }

    /// The sink behind the door.
    pub(crate) fn sink(&self) -> &'s S {
        self.0
    }

    /// Applies one event of `rank` and counts what it did.
    pub(crate) fn apply(&self, rank: RankId, event: &KvEvent<'_>, out: &mut EventsOutcome) {
        match self.0.apply_event(rank, event) {
            Ok(o) => {
                self.0.applied(self.1, rank, event);
                out.applied += 1;
                out.blocks_stored += o.stored as u64;
                out.blocks_removed += o.removed as u64;
                out.blocks_not_found += o.not_found as u64;
            }
            Err(e) => {
                out.rejected += 1;
                out.first_refusal.get_or_insert(e);
            }
        }
    }
}

/// Applies a batch of one rank's typed events in order, through the door: a sink whose
/// policy takes no engine events ignores the batch (counted). An event the index refuses
/// (unknown parent, too many ranks) is skipped and counted; the rest still apply.
pub(crate) fn apply_events<'e>(
    sink: &impl EventSink,
    rank: RankId,
    events: impl IntoIterator<Item = KvEvent<'e>>,
) -> EventsOutcome {
    let mut out = EventsOutcome::default();
    let Some(door) = Door::open(sink) else {
        out.ignored = true;
        return out;
    };
    for ev in events {
        door.apply(rank, &ev, &mut out);
    }
    out
}

/// Where a KV-event stream resumes when its ranks already hold state it did not apply
/// itself (`Partition::resume_stream`): after a warm restart, the last batch the previous
/// run applied; after a peer's dump, nothing known (the stream joins).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StreamResume {
    /// The worker whose stream it is.
    pub worker_id: WorkerId,
    /// The stream's number ([`Origin::Stream`]'s).
    pub stream: u32,
    /// The last batch applied: its sequence number and the digest of its payload
    /// (`Origin::Stream`'s). `None`: no batch is known (the state came from a peer's
    /// dump): the stream joins, replaying what its publisher still buffers.
    pub last: Option<(u64, u64)>,
    /// The DP ranks the stream feeds (what a restart or a loss clears, and what stays
    /// stale until the stream has caught up).
    pub dp_ranks: Vec<u32>,
}

/// Where an applied event came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A batch of a KV-event stream.
    Stream {
        /// The worker whose stream it is.
        worker_id: WorkerId,
        /// The stream's number (its DP rank, for a stream per rank).
        stream: u32,
        /// The batch's sequence number.
        seq: u64,
        /// The digest of the batch's payload: a restart that resumes the stream from
        /// `seq` asks its publisher to send this batch back unchanged (`resume`).
        digest: u64,
    },
    /// A host's own call (`Partition::apply_events`, a peer's dump, a restore).
    Direct,
}

/// What applying a batch of events did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EventsOutcome {
    /// The policy applies no engine events here: nothing was applied (counted).
    pub ignored: bool,
    /// The sink refused the batch's rank ([`EventSink::accepts_dp_rank`]): a DP rank the
    /// worker does not have, or a worker not registered past the pending-rank budget.
    /// Nothing was applied; every event counts in `rejected`.
    pub rank_refused: bool,
    /// Events applied.
    pub applied: u64,
    /// Events the index refused (skipped; counted per rank).
    pub rejected: u64,
    /// The first refusal's reason.
    pub first_refusal: Option<IndexError>,
    /// Blocks newly stored.
    pub blocks_stored: u64,
    /// Blocks removed.
    pub blocks_removed: u64,
    /// Removed hashes the rank did not hold on that tier.
    pub blocks_not_found: u64,
}

/// What one message did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IngestOutcome {
    /// Batches applied (0 if held for a replay or dropped as a duplicate; several when a
    /// replay ends).
    pub batches_applied: u32,
    /// Times the stream's ranks were cleared (a gap that could not be filled, a restart).
    pub clears: u32,
    /// A replay should be requested from this sequence number (sources with replay only).
    pub replay_from: Option<u64>,
    /// Batches that failed to decode.
    pub decode_errors: u32,
    /// Batches refused (not applied, not in `batches_applied`): they name a DP rank the
    /// worker does not have, or the message would open a stream past a bound (raw
    /// messages only; a source's refusals show in its stream's counters).
    pub refused: u32,
    /// The message would have opened a stream past a bound (raw messages only): nothing
    /// of it was read, no stream was kept (`IndexerStats::ingress_refused`).
    pub stream_refused: bool,
}
