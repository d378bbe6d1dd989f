//! What a sink keeps for the sources feeding it: each stream's counters, the streams a
//! host feeds message by message, and which ranks are stale (`crate::freshness`).

use std::time::{SystemTime, UNIX_EPOCH};

use crate::freshness::Freshness;
use crate::ids::WorkerId;
use crate::sync::{Arc, Mutex, ShardedMap};

use super::decode::DecodeErrorKind;
use super::door::{Door, EventSink, IngestOutcome};
use super::sequence::SequenceStats;
use super::stream::IngressStream;

/// One stream's counters (a partition's `ingress_stats`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// The worker whose events the stream carries.
    pub worker_id: WorkerId,
    /// The stream's number within the worker (e.g. its DP rank's socket).
    pub stream: u32,
    /// Messages received (live and replayed).
    pub messages: u64,
    /// Payload bytes received.
    pub bytes: u64,
    /// Batches decoded and applied.
    pub batches: u64,
    /// Events in those batches.
    pub events: u64,
    /// Blocks newly stored by them.
    pub blocks_stored: u64,
    /// Blocks removed by them.
    pub blocks_removed: u64,
    /// Events the index refused (unknown parent, rank limit), and the events of batches
    /// refused for their DP rank.
    pub events_rejected: u64,
    /// Batches refused because they name a DP rank the worker does not have (outside its
    /// `dp_start..dp_start + dp_size`, or at least `MAX_DP_SIZE` for a worker not yet
    /// registered): the wire never picks which ranks exist.
    pub dp_rank_refused: u64,
    /// Stores refused because their block size is not the partition's.
    pub block_size_mismatches: u64,
    /// Events skipped because their KV-cache group is not the one routing follows
    /// (hybrid-attention models).
    pub events_skipped_group: u64,
    /// Times the routing group changed (the stream's ranks were cleared).
    pub group_switches: u64,
    /// Events skipped because their `medium` is not a name kvr knows.
    pub events_skipped_medium: u64,
    /// Batches that failed to decode, by cause (`DecodeErrorKind::name`, count).
    pub decode_errors: Vec<(&'static str, u64)>,
    /// Messages whose frames were malformed (reported by the transport).
    pub bad_frames: u64,
    /// The stream's sequence tracking.
    pub sequence: SequenceStats,
    /// Wall-clock time of the last applied batch, ms since the Unix epoch (0 = never).
    pub last_batch_unix_ms: u64,
    /// Since when the stream's ranks may be stale (a known loss being replayed), ms since
    /// the Unix epoch; 0 = not stale.
    pub stale_since_unix_ms: u64,
}

impl StreamStats {
    /// The stream's freshness: live, recovering (a replay in flight), or stale.
    pub fn freshness(&self) -> StreamFreshness {
        match (self.stale_since_unix_ms, self.sequence.recovering) {
            (0, false) => StreamFreshness::Live,
            (0, true) => StreamFreshness::Recovering,
            (since, _) => StreamFreshness::Stale {
                since_unix_ms: since,
            },
        }
    }
}

/// A stream's freshness.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamFreshness {
    /// No replay in flight: the index follows the stream.
    Live,
    /// A replay in flight with no loss known (a join, a probe, a restart's rebuild).
    Recovering,
    /// A loss is known and being replayed: the stream's ranks' overlap is not trusted
    /// (by default) until it is filled or the ranks are cleared.
    Stale {
        /// When the loss became known, ms since the Unix epoch.
        since_unix_ms: u64,
    },
}

/// The counters of every stream of a sink, by (worker, stream), the streams a host feeds
/// message by message, and the stale ranks. Opaque: a sink owns one and hands it to
/// ingress ([`EventSink::streams`]).
pub struct IngressRegistry {
    streams: Mutex<Vec<Arc<Mutex<StreamStats>>>>,
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
    pub(crate) fn register(&self, worker_id: WorkerId, stream: u32) -> Arc<Mutex<StreamStats>> {
        let s = Arc::new(Mutex::new(StreamStats {
            worker_id,
            stream,
            decode_errors: DecodeErrorKind::ALL.iter().map(|k| (k.name(), 0)).collect(),
            ..StreamStats::default()
        }));
        self.streams.lock().push(s.clone());
        s
    }

    /// Sequence-checks, decodes and applies one message of `worker_id`'s stream `stream`
    /// handed in by the host (no replay: kvr does not own the socket), through the sink's
    /// door: a sink that takes no engine events ignores it (counted), and keeps no stream
    /// for it. Messages of one stream are serialized on that stream's lock; other streams
    /// proceed in parallel.
    pub(crate) fn ingest_raw(
        sink: &impl EventSink,
        worker_id: WorkerId,
        stream: u32,
        seq: u64,
        payload: &[u8],
    ) -> IngestOutcome {
        let Some(door) = Door::open(sink) else {
            return IngestOutcome::default();
        };
        let s = sink
            .streams()
            .raw
            .get_or_insert_with((worker_id, stream), || {
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
            .retain(|s| s.lock().worker_id != worker_id);
        self.freshness.forget_worker(worker_id);
    }

    /// A copy of every stream's counters.
    pub(crate) fn stats(&self) -> Vec<StreamStats> {
        self.streams
            .lock()
            .iter()
            .map(|s| s.lock().clone())
            .collect()
    }
}

/// Wall-clock ms since the Unix epoch (at least 1: 0 means "never" in the stats).
pub(crate) fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_millis() as u64)
        .max(1)
}
