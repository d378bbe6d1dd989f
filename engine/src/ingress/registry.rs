//! What a partition keeps for the sources feeding it: each stream's counters, the streams
//! a host feeds message by message, and which ranks are stale (`crate::freshness`).

use crate::freshness::Freshness;
use crate::ids::WorkerId;
use crate::sync::{Arc, Mutex, ShardedMap};

use super::counters::{StreamCounters, StreamStats};
use super::door::{Door, EventSink, IngestOutcome};
use super::stream::IngressStream;

/// The counters of every stream of a partition, by (worker, stream), the streams a host
/// feeds message by message, and the stale ranks.
pub(crate) struct IngressRegistry {
    streams: Mutex<Vec<StreamCounters>>,
    /// Streams fed through [`IngressRegistry::ingest_raw`] (no replay: kvr does not own the
    /// socket), sharded so messages of different streams never wait on one lock to find
    /// theirs.
    raw: ShardedMap<(WorkerId, u32), Arc<Mutex<IngressStream>>>,
    /// The ranks whose state may be stale, for selection (`crate::freshness`).
    pub(crate) freshness: Freshness,
}

impl std::fmt::Debug for IngressRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngressRegistry")
            .field("streams", &self.streams.lock().len())
            .finish_non_exhaustive()
    }
}

impl Default for IngressRegistry {
    fn default() -> Self {
        IngressRegistry {
            streams: Mutex::new(Vec::new()),
            raw: ShardedMap::new(),
            freshness: Freshness::default(),
        }
    }
}

impl IngressRegistry {
    /// Counters for a new stream of `worker_id`, listed in the stats.
    pub(crate) fn register(&self, worker_id: WorkerId, stream: u32) -> StreamCounters {
        let s = StreamCounters::new(worker_id, stream);
        self.streams.lock().push(s.clone());
        s
    }

    /// Sequence-checks, decodes and applies one message of `worker_id`'s stream `stream`
    /// handed in by the host (no replay: kvr does not own the socket), through the sink's
    /// door: a sink that takes no engine events ignores it (counted), and keeps no stream
    /// for it. Messages of one stream are serialized on that stream's lock; other streams
    /// proceed in parallel.
    pub(crate) fn ingest_raw(
        &self,
        sink: &impl EventSink,
        worker_id: WorkerId,
        stream: u32,
        seq: u64,
        payload: &[u8],
    ) -> IngestOutcome {
        let Some(door) = Door::open(sink) else {
            return IngestOutcome::default();
        };
        let s = self.raw.get_or_insert_with((worker_id, stream), || {
            Arc::new(Mutex::new(IngressStream::new(
                sink, worker_id, stream, false,
            )))
        });
        let mut s = s.lock();
        s.on_live(&door, seq, payload)
    }

    /// Drops a removed worker's streams: their sequence state (a rejoin starts fresh) and
    /// their counters.
    pub(crate) fn forget_worker(&self, worker_id: WorkerId) {
        for ((w, stream), _) in self.raw.entries() {
            if w == worker_id {
                self.raw.remove(&(w, stream));
            }
        }
        self.streams
            .lock()
            .retain(|s| s.0.lock().worker_id != worker_id);
        self.freshness.forget_worker(worker_id);
    }

    /// A copy of every stream's counters.
    pub(crate) fn stats(&self) -> Vec<StreamStats> {
        self.streams
            .lock()
            .iter()
            .map(StreamCounters::snapshot)
            .collect()
    }
}
