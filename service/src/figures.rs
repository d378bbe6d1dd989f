//! The engine's figures as metric families of `GET /metrics`: one table per engine stats
//! struct, one row per field it exports (the mirror service/tests/metrics_fields.rs
//! checks against the engine's field lists). Per partition (`model` label), per stream
//! (`model`, `worker_id`, `stream`) or per rank (`worker_id`, `dp_rank`).
//!
//! Names: `kvr_<group>_<field>`; a counter's exposition adds `_total`.

use kvr::stats::IndexerStats;
use kvr::stats::ReservationStats;
use kvr::stats::SelectionStats;
use kvr::stats::SequenceStats;
use kvr::stats::SessionStats;
use kvr::stats::StreamStats;
use kvr::stats::{ApproxStats, IndexStats};
use kvr::ActiveLoad;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

/// A series' labels.
pub type Labels = Vec<(&'static str, String)>;

/// How a figure is read: a total since start, or a level now.
#[derive(Clone, Copy, Debug)]
pub enum Read<S> {
    Counter(fn(&S) -> u64),
    Gauge(fn(&S) -> i64),
}

/// One exported field: its family's name and help, and how to read it.
#[derive(Debug)]
pub struct Figure<S> {
    pub name: &'static str,
    pub help: &'static str,
    pub read: Read<S>,
}

pub(crate) const fn counter<S>(
    name: &'static str,
    help: &'static str,
    f: fn(&S) -> u64,
) -> Figure<S> {
    Figure {
        name,
        help,
        read: Read::Counter(f),
    }
}

pub(crate) const fn gauge<S>(
    name: &'static str,
    help: &'static str,
    f: fn(&S) -> i64,
) -> Figure<S> {
    Figure {
        name,
        help,
        read: Read::Gauge(f),
    }
}

pub const INDEX: &[Figure<IndexStats>] = &[
    gauge(
        "kvr_index_ranks",
        "Ranks holding blocks in the index",
        |s| s.ranks as i64,
    ),
    gauge(
        "kvr_index_blocks",
        "Holder-blocks in the index (a block held by two ranks counts twice)",
        |s| s.holder_blocks as i64,
    ),
    gauge("kvr_index_nodes", "Distinct blocks in the index", |s| {
        s.nodes as i64
    }),
    gauge("kvr_index_bytes", "Heap bytes of the index", |s| {
        s.bytes as i64
    }),
    counter(
        "kvr_index_stored_events",
        "Stored events received (refused ones too)",
        |s| s.stored_events,
    ),
    counter("kvr_index_removed_events", "Removed events received", |s| {
        s.removed_events
    }),
    counter("kvr_index_cleared_events", "Cleared events received", |s| {
        s.cleared_events
    }),
    counter(
        "kvr_index_parent_not_found",
        "Stores refused: their parent was unknown",
        |s| s.parent_not_found,
    ),
    counter(
        "kvr_index_block_not_found",
        "Removed hashes the rank did not hold",
        |s| s.block_not_found,
    ),
    counter(
        "kvr_index_too_many_ranks",
        "Events refused: the rank limit was reached",
        |s| s.too_many_ranks,
    ),
];

/// The per-tier family of `IndexStats::tier_blocks` (a `tier` label).
pub const TIER_BLOCKS: (&str, &str) = (
    "kvr_index_tier_blocks",
    "Holder-blocks in the index per tier (device, host, disk)",
);
pub const TIERS: [&str; 3] = ["device", "host", "disk"];

pub const SELECTION: &[Figure<SelectionStats>] = &[counter(
    "kvr_selection_stale_overlaps_ignored",
    "Ranks whose overlap a lookup did not credit because their stream was stale",
    |s| s.stale_overlaps_ignored,
)];

pub const SESSION: &[Figure<SessionStats>] = &[
    gauge(
        "kvr_session_entries",
        "Sessions held (idle-expired ones not yet reaped too)",
        |s| s.entries as i64,
    ),
    gauge(
        "kvr_session_leases",
        "Live leases (bookings) of the sessions",
        |s| s.leases as i64,
    ),
    counter(
        "kvr_session_bindings_created",
        "Sessions bound by a first booking",
        |s| s.bindings_created,
    ),
    counter(
        "kvr_session_rebinds",
        "Bindings moved to another rank",
        |s| s.rebinds,
    ),
    counter(
        "kvr_session_forced_rebinds",
        "Rebinds forced: the bound rank left or could not take the turn",
        |s| s.forced_rebinds,
    ),
    counter(
        "kvr_session_bindings_dropped",
        "Bindings dropped because their rank left",
        |s| s.bindings_dropped,
    ),
    counter(
        "kvr_session_finals_released",
        "Sessions released when a final turn's last booking ended",
        |s| s.finals_released,
    ),
    counter(
        "kvr_session_evicted",
        "Idle sessions evicted to make room",
        |s| s.evicted,
    ),
    counter(
        "kvr_session_refused",
        "New sessions refused: the table was full of sessions with live bookings",
        |s| s.refused,
    ),
    counter("kvr_session_reaped", "Idle-expired sessions removed", |s| {
        s.reaped
    }),
    counter("kvr_session_leases_released", "Leases released", |s| {
        s.leases_released
    }),
    counter(
        "kvr_session_unknown_lease_releases",
        "Releases of leases no session held",
        |s| s.unknown_lease_releases,
    ),
    counter(
        "kvr_session_early_releases",
        "Bookings bound after their lease was already released",
        |s| s.early_releases,
    ),
    counter(
        "kvr_session_duplicate_leases",
        "Binds refused: the lease belonged to another session",
        |s| s.duplicate_leases,
    ),
    counter(
        "kvr_session_invalid_session_ids",
        "Session ids refused (empty or too long)",
        |s| s.invalid_session_ids,
    ),
];

pub const INDEXER: &[Figure<IndexerStats>] = &[
    counter(
        "kvr_indexer_bookings_recorded",
        "Bookings recorded into the approximate index",
        |s| s.bookings_recorded,
    ),
    counter(
        "kvr_indexer_record_failures",
        "Recordings that failed (the bookings stood)",
        |s| s.record_failures,
    ),
    counter(
        "kvr_indexer_remote_queries",
        "Overlap queries sent to the remote primary",
        |s| s.remote_queries,
    ),
    counter(
        "kvr_indexer_remote_failures",
        "Remote queries that failed (the selection went on without overlap)",
        |s| s.remote_failures,
    ),
    counter(
        "kvr_indexer_events_ignored",
        "Event messages handed to a partition whose policy applies none",
        |s| s.events_ignored,
    ),
    counter(
        "kvr_indexer_ingress_refused",
        "Engine messages, batches and topics refused because they would create ingress state past a bound",
        |s| s.ingress_refused,
    ),
];

pub const APPROX: &[Figure<ApproxStats>] = &[
    counter(
        "kvr_approx_index_records",
        "Bookings the approximate index recorded",
        |s| s.records,
    ),
    counter(
        "kvr_approx_index_blocks_recorded",
        "(rank, block) records created",
        |s| s.blocks_recorded,
    ),
    counter(
        "kvr_approx_index_blocks_refreshed",
        "Records a later booking named again",
        |s| s.blocks_refreshed,
    ),
    counter(
        "kvr_approx_index_blocks_expired",
        "Records dropped by their TTL",
        |s| s.blocks_expired,
    ),
    counter(
        "kvr_approx_index_blocks_pruned",
        "Records dropped by the size bound",
        |s| s.blocks_pruned,
    ),
    counter(
        "kvr_approx_index_record_errors",
        "Recordings the index refused",
        |s| s.record_errors,
    ),
    counter(
        "kvr_approx_index_blocks_over_bound",
        "Booked blocks not recorded: the records were at the bound",
        |s| s.blocks_over_bound,
    ),
];

pub const BOOKING: &[Figure<ReservationStats>] = &[
    gauge(
        "kvr_booking_tracked_ranks",
        "Ranks with booking counters",
        |s| s.tracked_ranks as i64,
    ),
    counter(
        "kvr_booking_expired",
        "Bookings freed by expiry sweeps",
        |s| s.expired_total,
    ),
    counter(
        "kvr_booking_counter_underflows",
        "Counter subtractions that would have gone below zero (0 unless kvr has a bug)",
        |s| s.counter_underflows,
    ),
    gauge(
        "kvr_booking_sweeper_started",
        "1 once the expiry sweep thread has started",
        |s| i64::from(s.sweeper_started),
    ),
];

pub const STREAM: &[Figure<StreamStats>] = &[
    counter(
        "kvr_kv_stream_messages",
        "Messages received on the stream (live and replayed)",
        |s| s.messages,
    ),
    counter(
        "kvr_kv_stream_bytes",
        "Payload bytes received on the stream",
        |s| s.bytes,
    ),
    counter(
        "kvr_kv_stream_batches",
        "Batches decoded and applied",
        |s| s.batches,
    ),
    counter(
        "kvr_kv_stream_events",
        "Events of the applied batches",
        |s| s.events,
    ),
    counter(
        "kvr_kv_stream_dp_rank_refused",
        "Batches refused: they name a DP rank the worker does not have",
        |s| s.dp_rank_refused,
    ),
    counter(
        "kvr_kv_stream_events_skipped_group",
        "Events skipped: not the KV-cache group routing follows",
        |s| s.events_skipped_group,
    ),
    counter(
        "kvr_kv_stream_group_switches",
        "Times the followed KV-cache group changed",
        |s| s.group_switches,
    ),
    counter(
        "kvr_kv_stream_events_skipped_medium",
        "Events skipped: a medium kvr does not know",
        |s| s.events_skipped_medium,
    ),
    counter(
        "kvr_kv_stream_events_skipped_malformed",
        "Stores skipped: token ids that do not fill their blocks",
        |s| s.events_skipped_malformed,
    ),
    counter(
        "kvr_kv_stream_tokenless_blocks_unknown",
        "Blocks of tokenless stores held on no tier, left out",
        |s| s.tokenless_blocks_unknown,
    ),
    counter(
        "kvr_kv_stream_link_failures",
        "Failed connects or binds to the stream's endpoint, and lost connections",
        |s| s.link_failures,
    ),
];

pub const SEQUENCE: &[Figure<SequenceStats>] = &[
    counter(
        "kvr_kv_stream_gaps",
        "Sequence gaps seen on the stream",
        |s| s.gaps,
    ),
    counter(
        "kvr_kv_stream_duplicates",
        "Batches seen twice on the stream (skipped)",
        |s| s.duplicates,
    ),
    counter(
        "kvr_kv_stream_clears",
        "Times the stream's ranks were cleared (unrecoverable gap, restart)",
        |s| s.clears,
    ),
    counter(
        "kvr_kv_stream_batches_lost",
        "Batches lost on the stream",
        |s| s.batches_lost,
    ),
    counter(
        "kvr_kv_stream_restarts",
        "New publisher instances found on the stream",
        |s| s.restarts,
    ),
    counter(
        "kvr_kv_stream_idle_probes",
        "Replays asked of a silent stream's publisher to find losses and restarts",
        |s| s.idle_probes,
    ),
    gauge(
        "kvr_kv_stream_recovering",
        "1 while a replay of the stream is in flight",
        |s| i64::from(s.recovering),
    ),
];

pub const RANK: &[Figure<ActiveLoad>] = &[
    gauge(
        "dynamo_frontend_worker_active_decode_blocks",
        "Booked decode blocks per rank",
        |s| s.active_decode_blocks as i64,
    ),
    gauge(
        "dynamo_frontend_worker_active_prefill_tokens",
        "Booked prefill tokens per rank",
        |s| s.active_prefill_tokens as i64,
    ),
    gauge(
        "kvr_rank_active_requests",
        "Booked requests per rank",
        |s| s.active_requests as i64,
    ),
];

/// The rows of one table's families, filled per partition, stream or rank.
#[derive(Debug)]
pub struct Rows<S: 'static> {
    table: &'static [Figure<S>],
    counters: Vec<Vec<(Labels, ConstCounter<u64>)>>,
    gauges: Vec<Vec<(Labels, ConstGauge<i64>)>>,
}

impl<S> Rows<S> {
    pub fn new(table: &'static [Figure<S>]) -> Self {
        Self {
            table,
            counters: table.iter().map(|_| Vec::new()).collect(),
            gauges: table.iter().map(|_| Vec::new()).collect(),
        }
    }

    /// One row of every family: `stats` under `labels`.
    pub fn push(&mut self, labels: &Labels, stats: &S) {
        for (i, f) in self.table.iter().enumerate() {
            match f.read {
                Read::Counter(read) => {
                    self.counters[i].push((labels.clone(), ConstCounter::new(read(stats))))
                }
                Read::Gauge(read) => {
                    self.gauges[i].push((labels.clone(), ConstGauge::new(read(stats))))
                }
            }
        }
    }

    /// Every family of the table, with a descriptor even when it has no row.
    pub fn encode(&self, enc: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        for (i, f) in self.table.iter().enumerate() {
            match f.read {
                Read::Counter(_) => {
                    family(enc, f.name, f.help, MetricType::Counter, &self.counters[i])?
                }
                Read::Gauge(_) => family(enc, f.name, f.help, MetricType::Gauge, &self.gauges[i])?,
            }
        }
        Ok(())
    }
}

/// One metric family: its descriptor and its rows.
pub fn family<M: EncodeMetric>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: &[(Labels, M)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in rows {
        v.encode(m.encode_family(labels)?)?;
    }
    Ok(())
}
