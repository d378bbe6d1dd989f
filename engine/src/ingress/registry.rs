//! What a partition keeps for the sources feeding it: each stream's counters, the streams
//! a host feeds message by message, which ranks are stale (`crate::freshness`), and the
//! bounds that keep what a peer sends from growing any of it without end.

use std::collections::{HashMap, HashSet};

use crate::freshness::Freshness;
use crate::ids::{RankId, WorkerId};
use crate::index::{ApplyOutcome, IndexError, KvEvent};
use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use crate::sync::{Arc, Mutex, ShardedMap};

use super::counters::{StreamCounters, StreamStats};
use super::door::{Door, EventSink, IngestOutcome, StreamResume};
use super::stream::IngressStream;

/// The most ingress streams one partition keeps (subscriptions' and raw ones together)
/// beyond one per registered DP rank: a stream is one publisher socket, and an engine
/// with data parallelism publishes from each rank, so a fleet of 1,024 workers of 8 ranks
/// has 8,192 of them. A flood of new topics or stream numbers stops at this many past the
/// registered ranks (counted in `IndexerStats::ingress_refused`); only the host's
/// registrations raise the bound.
pub const MAX_INGRESS_STREAMS: usize = 1024;

/// The most resume points a partition keeps whatever its registered ranks: a warm restart
/// sets them before the host registers its workers again, so this bound cannot follow
/// the registered ranks as the stream bound does; it covers 8,192 workers of 8 ranks.
/// They come from the host (its own state directory), never from a peer.
const MAX_RESUME_POINTS: usize = 65_536;

/// The most DP ranks of workers not registered yet that a partition takes events for
/// (engines may publish before the host registers them). Past it, a batch for another
/// such rank is refused and counted, so made-up worker ids cannot create ranks without
/// end. A worker's entries leave this budget when it is registered or removed.
pub const MAX_PENDING_RANKS: usize = 256;

/// The counters of every stream of a partition, by (worker, stream), the streams a host
/// feeds message by message, and the stale ranks.
pub(crate) struct IngressRegistry {
    streams: Mutex<Streams>,
    /// Streams fed through [`IngressRegistry::ingest_raw`] (no replay: kvr does not own the
    /// socket), sharded so messages of different streams never wait on one lock to find
    /// theirs.
    raw: ShardedMap<(WorkerId, u32), Arc<Mutex<IngressStream>>>,
    /// The ranks of workers not registered yet that events were taken for (at most
    /// [`MAX_PENDING_RANKS`]).
    pending: Mutex<HashSet<RankId>>,
    /// Where streams resume after a warm restart: (worker, stream) → the last batch a
    /// previous run applied (seq, payload digest), taken by the stream's creation (at
    /// most [`MAX_RESUME_POINTS`], or the stream bound if higher).
    resume: Mutex<HashMap<(WorkerId, u32), StreamResume>>,
    /// Messages, batches and topics refused for a bound (`IndexerStats::ingress_refused`).
    refused: AtomicU64,
    /// The partition's registered DP ranks (set on every membership change): the stream
    /// bound is [`MAX_INGRESS_STREAMS`] past them.
    registered_ranks: AtomicUsize,
    /// The ranks whose state may be stale, for selection (`crate::freshness`).
    pub(crate) freshness: Freshness,
}

/// The listed streams' counters, and the stream numbers claimed but not registered yet.
#[derive(Default)]
struct Streams {
    listed: Vec<((WorkerId, u32), StreamCounters)>,
    claimed: Vec<(WorkerId, u32)>,
}

impl Streams {
    fn len(&self) -> usize {
        self.listed.len() + self.claimed.len()
    }
}

impl std::fmt::Debug for IngressRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngressRegistry")
            .field("streams", &self.streams.lock().listed.len())
            .finish_non_exhaustive()
    }
}

impl Default for IngressRegistry {
    fn default() -> Self {
        IngressRegistry {
            streams: Mutex::new(Streams::default()),
            raw: ShardedMap::new(),
            pending: Mutex::new(HashSet::new()),
            resume: Mutex::new(HashMap::new()),
            refused: AtomicU64::new(0),
            registered_ranks: AtomicUsize::new(0),
            freshness: Freshness::default(),
        }
    }
}

impl IngressRegistry {
    /// Counters for a new stream of `worker_id`, listed in the stats.
    pub(crate) fn register(&self, worker_id: WorkerId, stream: u32) -> StreamCounters {
        let s = StreamCounters::new(worker_id, stream);
        let mut streams = self.streams.lock();
        streams.claimed.retain(|&k| k != (worker_id, stream));
        streams.listed.push(((worker_id, stream), s.clone()));
        s
    }

    /// The lowest stream number of `worker` that no stream of the partition has (listed or
    /// claimed) and `taken` does not name, claimed for the caller's next
    /// [`IngressRegistry::register`]; `None` at [`MAX_INGRESS_STREAMS`] (the caller counts
    /// what it drops). So two
    /// sources never number a worker's streams alike.
    pub(crate) fn claim_stream(
        &self,
        worker: WorkerId,
        taken: &dyn Fn(u32) -> bool,
    ) -> Option<u32> {
        let mut streams = self.streams.lock();
        if streams.len() >= self.stream_limit() {
            return None;
        }
        let used: HashSet<u32> = streams
            .listed
            .iter()
            .map(|(k, _)| *k)
            .chain(streams.claimed.iter().copied())
            .filter(|k| k.0 == worker)
            .map(|k| k.1)
            .collect();
        let n = (0..=u32::MAX).find(|n| !used.contains(n) && !taken(*n))?;
        streams.claimed.push((worker, n));
        Some(n)
    }

    /// The most streams the partition keeps now: [`MAX_INGRESS_STREAMS`] past its
    /// registered ranks.
    fn stream_limit(&self) -> usize {
        MAX_INGRESS_STREAMS.saturating_add(self.registered_ranks.load(Ordering::Relaxed))
    }

    /// The partition's registered DP ranks, after a membership change.
    pub(crate) fn set_registered_ranks(&self, ranks: usize) {
        self.registered_ranks.store(ranks, Ordering::Relaxed);
    }

    /// Whether events may create rank `rank` of a worker not registered yet: it was taken
    /// before, or the budget ([`MAX_PENDING_RANKS`]) has room (then it is noted).
    pub(crate) fn admit_pending(&self, rank: RankId) -> bool {
        let mut p = self.pending.lock();
        if p.contains(&rank) {
            return true;
        }
        if p.len() >= MAX_PENDING_RANKS {
            return false;
        }
        p.insert(rank);
        true
    }

    /// Notes where `worker`'s stream `stream` resumes (replacing an earlier point); false
    /// (nothing noted) past [`MAX_RESUME_POINTS`] points, or the stream bound if higher.
    pub(crate) fn set_resume_point(&self, at: StreamResume) -> bool {
        let mut r = self.resume.lock();
        let key = (at.worker_id, at.stream);
        if r.len() >= self.stream_limit().max(MAX_RESUME_POINTS) && !r.contains_key(&key) {
            return false;
        }
        // Stale from now: the stream, once created, keeps them listed until it has
        // caught up (a stream never created leaves them uncredited).
        self.freshness.mark(
            at.worker_id,
            &at.dp_ranks,
            Some(super::counters::now_unix_ms()),
        );
        r.insert(key, at);
        true
    }

    /// Takes where `worker`'s stream `stream` resumes, if a restart noted it.
    pub(crate) fn take_resume_point(&self, worker: WorkerId, stream: u32) -> Option<StreamResume> {
        self.resume.lock().remove(&(worker, stream))
    }

    /// `worker` was registered: its ranks leave the pending budget.
    pub(crate) fn worker_registered(&self, worker: WorkerId) {
        self.pending.lock().retain(|r| r.worker_id != worker);
    }

    /// Counts one message, batch or topic refused for a bound.
    pub(crate) fn note_refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Messages, batches and topics refused for a bound so far.
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Sequence-checks, decodes and applies one message of `worker_id`'s stream `stream`
    /// handed in by the host (no replay: kvr does not own the socket), through the sink's
    /// door: a sink that takes no engine events ignores it (counted), and keeps no stream
    /// for it. A new stream is opened only if `may_open` (the sink's say on the worker)
    /// and the partition has fewer than [`MAX_INGRESS_STREAMS`]; else the message is
    /// refused and counted. Messages of one stream are serialized on that stream's lock;
    /// other streams proceed in parallel.
    pub(crate) fn ingest_raw(
        &self,
        sink: &impl EventSink,
        worker_id: WorkerId,
        stream: u32,
        seq: u64,
        payload: &[u8],
        may_open: impl FnOnce() -> bool,
    ) -> IngestOutcome {
        let counting = CountingRefusals {
            sink,
            refused: std::cell::Cell::new(0),
        };
        let Some(door) = Door::open(&counting) else {
            return IngestOutcome::default();
        };
        let key = (worker_id, stream);
        let s = match self.raw.get(&key) {
            Some(s) => s,
            None => {
                let full = self.streams.lock().len() >= self.stream_limit();
                if full || !may_open() {
                    self.note_refused();
                    return IngestOutcome {
                        refused: 1,
                        stream_refused: true,
                        ..IngestOutcome::default()
                    };
                }
                self.raw.get_or_insert_with(key, || {
                    Arc::new(Mutex::new(IngressStream::new(
                        sink, worker_id, stream, false,
                    )))
                })
            }
        };
        let mut s = s.lock();
        let mut out = s.on_live(&door, seq, payload);
        out.refused = counting.refused.get();
        out.batches_applied = out.batches_applied.saturating_sub(out.refused);
        out
    }

    /// Drops a removed worker's streams: their sequence state (a rejoin starts fresh) and
    /// their counters.
    pub(crate) fn forget_worker(&self, worker_id: WorkerId) {
        for ((w, stream), _) in self.raw.entries() {
            if w == worker_id {
                self.raw.remove(&(w, stream));
            }
        }
        self.streams.lock().listed.retain(|(k, _)| k.0 != worker_id);
        self.resume.lock().retain(|k, _| k.0 != worker_id);
        self.worker_registered(worker_id);
        self.freshness.forget_worker(worker_id);
    }

    /// A copy of every stream's counters.
    pub(crate) fn stats(&self) -> Vec<StreamStats> {
        self.streams
            .lock()
            .listed
            .iter()
            .map(|(_, s)| s.snapshot())
            .collect()
    }
}

/// A sink seen through one raw message: every batch it refuses for its DP rank is
/// counted, so the host's outcome says so (the stream's own counters count it too).
struct CountingRefusals<'s, S: ?Sized> {
    sink: &'s S,
    refused: std::cell::Cell<u32>,
}

impl<S: EventSink + ?Sized> EventSink for CountingRefusals<'_, S> {
    fn block_size(&self) -> u32 {
        self.sink.block_size()
    }
    fn cache_namespace(&self) -> Option<&str> {
        self.sink.cache_namespace()
    }
    fn admit_events(&self) -> bool {
        self.sink.admit_events()
    }
    fn apply_event(&self, rank: RankId, event: &KvEvent<'_>) -> Result<ApplyOutcome, IndexError> {
        self.sink.apply_event(rank, event)
    }
    fn clear_ranks(&self, worker: WorkerId, dp_ranks: &[u32]) {
        self.sink.clear_ranks(worker, dp_ranks)
    }
    fn register_stream(&self, worker: WorkerId, stream: u32) -> StreamCounters {
        self.sink.register_stream(worker, stream)
    }
    fn mark_stale(&self, worker: WorkerId, dp_ranks: &[u32], since_unix_ms: Option<u64>) {
        self.sink.mark_stale(worker, dp_ranks, since_unix_ms)
    }
    fn accepts_dp_rank(&self, worker: WorkerId, dp: u32) -> bool {
        let ok = self.sink.accepts_dp_rank(worker, dp);
        if !ok {
            self.refused.set(self.refused.get() + 1);
        }
        ok
    }
    fn accepts_lookahead(&self, len: u32) -> bool {
        self.sink.accepts_lookahead(len)
    }
    fn applied(&self, origin: super::door::Origin, rank: RankId, event: &KvEvent<'_>) {
        self.sink.applied(origin, rank, event)
    }
    fn batch_end(&self, origin: super::door::Origin) {
        self.sink.batch_end(origin)
    }
    fn resume_point(&self, worker: WorkerId, stream: u32) -> Option<StreamResume> {
        self.sink.resume_point(worker, stream)
    }
    fn claim_stream(&self, worker: WorkerId, taken: &dyn Fn(u32) -> bool) -> Option<u32> {
        self.sink.claim_stream(worker, taken)
    }
    fn note_refused(&self) {
        self.sink.note_refused()
    }
}
