//! Each stream's counters, as a sink keeps them for the stats.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::ids::WorkerId;
use crate::sync::{Arc, Mutex};

use super::health::{HealthReason, SourceHealth};
use super::sequence::SequenceStats;

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
    /// Stores skipped because they cannot be used (their token ids do not fill their
    /// blocks, a per-block list has the wrong length, their blocks' lookahead lengths
    /// differ, or the partition already hashes prompts with as many lookahead lengths as
    /// it keeps); the batch's other events apply.
    pub events_skipped_malformed: u64,
    /// Blocks of tokenless stores (an offloading connector's host or disk copies, named
    /// by engine hash only) that the rank held on no tier: their tokens are unknown, so
    /// they are left out of the index.
    pub tokenless_blocks_unknown: u64,
    /// Batches that failed to decode, by cause (`DecodeErrorKind::name`, count); each
    /// cleared the ranks its stream fed (what it held is unknown).
    pub decode_errors: Vec<(&'static str, u64)>,
    /// Messages whose frames were malformed (reported by the transport).
    pub bad_frames: u64,
    /// The stream's sequence tracking.
    pub sequence: SequenceStats,
    /// Wall-clock time of the last applied batch, ms since the Unix epoch (0 = never).
    pub last_batch_unix_ms: u64,
    /// Since when the stream's ranks may be stale (a known loss being replayed), ms since
    /// the Unix epoch; 0 = not stale. A degraded or dead stream's ranks are stale too
    /// (`SourceHealth`).
    pub stale_since_unix_ms: u64,
    /// The stream's health: exact, recovering, degraded or dead (`ingress::health`).
    pub health: SourceHealth,
    /// Why it is in that state.
    pub health_reason: HealthReason,
    /// Since when it is in that state with that reason, ms since the Unix epoch (0 = since
    /// it was registered, exact).
    pub health_since_unix_ms: u64,
    /// Times the transport failed to reach the publisher (failed connects or binds, lost
    /// connections).
    pub link_failures: u64,
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

/// One stream's live counters: the sink lists them in its stats, the stream updates them.
/// Opaque; a sink makes one per stream ([`EventSink::register_stream`]).
///
/// [`EventSink::register_stream`]: super::EventSink::register_stream
#[derive(Clone, Debug)]
pub struct StreamCounters(pub(crate) Arc<Mutex<StreamStats>>);

impl StreamCounters {
    /// Counters for a new stream of `worker_id`, every decode-error cause at 0.
    pub fn new(worker_id: WorkerId, stream: u32) -> Self {
        StreamCounters(Arc::new(Mutex::new(StreamStats {
            worker_id,
            stream,
            decode_errors: super::DecodeErrorKind::ALL
                .iter()
                .map(|k| (k.name(), 0))
                .collect(),
            ..StreamStats::default()
        })))
    }

    /// A copy of the counters now.
    pub fn snapshot(&self) -> StreamStats {
        self.0.lock().clone()
    }
}

/// Wall-clock ms since the Unix epoch (at least 1: 0 means "never" in the stats).
pub(crate) fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_millis() as u64)
        .max(1)
}
