//! `GET /metrics` (the real exposition, rendered by the service's own `Metrics`) against the
//! engine's stats field lists (`kvr::FIELD_LISTS`): every stats field the service can read
//! needs its metric family, and a family in a stats group (`kvr_index_*`, `kvr_session_*`,
//! ...) that mirrors no field fails, as does a stale exception. Naming rule:
//! `kvr_<group>_<field>` (a counter's `_total` is the exposition's); the exceptions say
//! where the service legitimately differs, with reasons.

#[path = "../../tests/mirror/compare.rs"]
mod compare;

use std::collections::BTreeSet;

use clap::Parser;
use compare::{extra, omitted, renamed, Exception, Place, Spec};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: kvr_service::ServeArgs,
}

const fn group(loc: &'static str, prefix: &'static str) -> Place {
    Place::At {
        loc,
        prefix,
        strip: "",
    }
}

const INDEX: &str = "families kvr_index_";
const SELECTION: &str = "families kvr_selection";
const BOOKING: &str = "families kvr_booking";
const RATE: &str = "families kvr_prefill_rate";
const DRAG: &str = "families kvr_decode_drag";
const STREAM: &str = "families kvr_kv_stream_";
const EVENTS: &str = "families kvr_kv_events_";
const DYNAMO_RANK: &str = "families dynamo_frontend_worker_";
const KNOBS: &str = "knobs, not figures: service/tests/config_flags.rs checks the flags";

/// Where `/metrics` exports each engine struct's fields.
const PLACES: &[(&str, &[Place])] = &[
    ("PartitionConfig", &[Place::Nowhere(KNOBS)]),
    ("CostConfig", &[Place::Nowhere(KNOBS)]),
    ("LatencyConfig", &[Place::Nowhere(KNOBS)]),
    ("CostOverrides", &[Place::Nowhere(KNOBS)]),
    ("BusyThresholds", &[Place::Nowhere(KNOBS)]),
    ("HintConfig", &[Place::Nowhere(KNOBS)]),
    ("SessionConfig", &[Place::Nowhere(KNOBS)]),
    ("IndexerConfig", &[Place::Nowhere(KNOBS)]),
    ("ApproxConfig", &[Place::Nowhere(KNOBS)]),
    ("IndexStats", &[group(INDEX, "kvr_index_")]),
    ("SelectionStats", &[group(SELECTION, "kvr_selection_")]),
    (
        "SessionStats",
        &[group("families kvr_session_", "kvr_session_")],
    ),
    (
        "IndexerStats",
        &[group("families kvr_indexer_", "kvr_indexer_")],
    ),
    (
        "ApproxStats",
        &[group("families kvr_approx_index_", "kvr_approx_index_")],
    ),
    ("ReservationStats", &[group(BOOKING, "kvr_booking_")]),
    ("StreamStats", &[group(STREAM, "kvr_kv_stream_")]),
    ("SequenceStats", &[group(STREAM, "kvr_kv_stream_")]),
    (
        "RankLoad",
        &[Place::Nowhere(
            "kvr serve receives no load reports: its load view is its own bookings",
        )],
    ),
    ("ActiveLoad", &[group("families kvr_rank_", "kvr_rank_")]),
];

const BYTES_PART: &str = "a breakdown of kvr_index_bytes for Rust diagnostics";
const OUTCOMES: &str = "the service counts each answer's outcome itself: \
                        kvr_selections_total{outcome} (selected, booked, busy, no_worker, error)";
const PER_STREAM: &str = "a label of every kvr_kv_stream_* series";

const EXCEPTIONS: &[Exception] = &[
    renamed(
        "IndexStats",
        "holder_blocks",
        INDEX,
        "kvr_index_blocks",
        "the name dashboards already query",
    ),
    omitted("IndexStats", "table_bytes", BYTES_PART),
    omitted("IndexStats", "holder_set_bytes", BYTES_PART),
    omitted("IndexStats", "rank_map_bytes", BYTES_PART),
    omitted("IndexStats", "lineage_bytes", BYTES_PART),
    extra(
        INDEX,
        "kvr_index_bytes_per_holder_block",
        "derived: kvr_index_bytes / kvr_index_blocks",
    ),
    renamed(
        "SelectionStats",
        "selections",
        SELECTION,
        "kvr_selections",
        OUTCOMES,
    ),
    renamed(
        "SelectionStats",
        "busy",
        SELECTION,
        "kvr_selections",
        OUTCOMES,
    ),
    renamed(
        "SelectionStats",
        "no_worker",
        SELECTION,
        "kvr_selections",
        OUTCOMES,
    ),
    omitted(
        "SelectionStats",
        "shared_cache_failures",
        "kvr serve sets no shared-cache hook: always 0",
    ),
    extra(
        SELECTION,
        "kvr_selection_prompt_tokens",
        "the service's count of the prompt tokens it selected for (the hit rate's terms)",
    ),
    extra(
        SELECTION,
        "kvr_selection_cached_tokens",
        "the service's count of those cached on the chosen rank (the hit rate's terms)",
    ),
    omitted(
        "IndexerStats",
        "policy",
        "an enum the flags choose, not a figure",
    ),
    renamed(
        "ReservationStats",
        "bookings",
        BOOKING,
        "kvr_bookings_active",
        "the name dashboards already query",
    ),
    renamed(
        "ReservationStats",
        "prefill_rate",
        RATE,
        "kvr_prefill_rate_tokens_per_second",
        "with its unit",
    ),
    renamed(
        "ReservationStats",
        "prefill_rate_observations",
        RATE,
        "kvr_prefill_rate_observations",
        "beside the rate",
    ),
    renamed(
        "ReservationStats",
        "decode_drag",
        DRAG,
        "kvr_decode_drag_ms_per_block",
        "with its unit, ms (the field is in seconds)",
    ),
    renamed(
        "ReservationStats",
        "decode_drag_observations",
        DRAG,
        "kvr_decode_drag_observations",
        "beside the drag",
    ),
    omitted("StreamStats", "worker_id", PER_STREAM),
    omitted("StreamStats", "stream", PER_STREAM),
    renamed(
        "StreamStats",
        "blocks_stored",
        EVENTS,
        "kvr_kv_events_applied",
        "summed per model, event_type=stored_blocks (Dynamo's metric)",
    ),
    renamed(
        "StreamStats",
        "blocks_removed",
        EVENTS,
        "kvr_kv_events_applied",
        "summed per model, event_type=removed_blocks (Dynamo's metric)",
    ),
    renamed(
        "StreamStats",
        "events_rejected",
        EVENTS,
        "kvr_kv_events_rejected",
        "summed per model under reason=event",
    ),
    renamed(
        "StreamStats",
        "block_size_mismatches",
        EVENTS,
        "kvr_kv_events_rejected",
        "summed per model under reason=event",
    ),
    renamed(
        "StreamStats",
        "decode_errors",
        EVENTS,
        "kvr_kv_events_rejected",
        "summed per model under reason=frame",
    ),
    renamed(
        "StreamStats",
        "bad_frames",
        EVENTS,
        "kvr_kv_events_rejected",
        "summed per model under reason=frame",
    ),
    renamed(
        "StreamStats",
        "last_batch_unix_ms",
        STREAM,
        "kvr_kv_stream_last_batch_age_seconds",
        "as an age",
    ),
    renamed(
        "StreamStats",
        "stale_since_unix_ms",
        STREAM,
        "kvr_kv_stream_stale_seconds",
        "as an age (0 when fresh)",
    ),
    renamed(
        "StreamStats",
        "health_reason",
        STREAM,
        "kvr_kv_stream_health",
        "the reason label of the state's series",
    ),
    renamed(
        "StreamStats",
        "health_since_unix_ms",
        STREAM,
        "kvr_kv_stream_health_seconds",
        "as an age",
    ),
    renamed(
        "SequenceStats",
        "replays_requested",
        STREAM,
        "kvr_kv_stream_replays",
        "the replays counted, as named first",
    ),
    renamed(
        "SequenceStats",
        "replays_filled",
        STREAM,
        "kvr_kv_stream_replay_outcomes",
        "one family, outcome=filled",
    ),
    renamed(
        "SequenceStats",
        "replays_partial",
        STREAM,
        "kvr_kv_stream_replay_outcomes",
        "one family, outcome=partial",
    ),
    renamed(
        "SequenceStats",
        "replays_failed",
        STREAM,
        "kvr_kv_stream_replay_outcomes",
        "one family, outcome=failed",
    ),
    omitted(
        "SequenceStats",
        "last_seq",
        "a position, not a figure: kvr_kv_stream_last_batch_age_seconds says how fresh",
    ),
    renamed(
        "ActiveLoad",
        "active_decode_blocks",
        DYNAMO_RANK,
        "dynamo_frontend_worker_active_decode_blocks",
        "Dynamo's metric, which dashboards query",
    ),
    renamed(
        "ActiveLoad",
        "active_prefill_tokens",
        DYNAMO_RANK,
        "dynamo_frontend_worker_active_prefill_tokens",
        "Dynamo's metric, which dashboards query",
    ),
];

fn spec() -> Spec<'static> {
    Spec {
        host: "kvr serve /metrics",
        places: PLACES,
        rule: |f| {
            let mut names = vec![f.to_string()];
            if let Some(base) = f.strip_suffix("_total") {
                names.push(base.to_string());
            }
            names
        },
        exceptions: EXCEPTIONS,
    }
}

/// The exposition's families (`# TYPE name kind`) as locations `families <prefix>`.
fn metric_locations(text: &str) -> impl Fn(&str) -> Option<BTreeSet<String>> {
    let families: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    move |loc: &str| {
        let prefix = loc.strip_prefix("families ")?;
        Some(
            families
                .iter()
                .filter(|f| f.starts_with(prefix))
                .cloned()
                .collect(),
        )
    }
}

/// The service's real exposition, with one worker registered (so per-partition series
/// have rows; session affinity on, so the session table's too; events off, so the worker
/// needs no publisher).
fn exposition() -> String {
    let argv = [
        "kvr-serve",
        "--session-affinity-ttl-secs",
        "60",
        "--router-use-kv-events",
        "false",
    ];
    let app = kvr_service::App::new(Cli::parse_from(argv).args).expect("App::new");
    let worker = serde_json::json!({"worker_id": 1, "endpoint": "http://w1", "block_size": 16});
    let worker = serde_json::from_value(worker).expect("a worker body");
    app.registry.upsert(worker).expect("upsert");
    app.metrics.encode()
}

#[test]
fn metrics_export_every_engine_figure() {
    let text = exposition();
    compare::assert_mirrors(&spec(), &metric_locations(&text));
    // The per-partition families have their partition's row, not just a descriptor.
    for sample in [
        "kvr_index_stored_events_total{model=\"default:default\"} 0",
        "kvr_indexer_events_ignored_total{model=\"default:default\"} 0",
        "kvr_booking_tracked_ranks{model=\"default:default\"} 1",
        "kvr_index_tier_blocks{model=\"default:default\",tier=\"host\"} 0",
        "kvr_session_entries{model=\"default:default\"} 0",
    ] {
        assert!(text.contains(sample), "no `{sample}` in:\n{text}");
    }
}

/// The negative control: a family taken out of a copy of the exposition must be reported.
#[test]
fn metrics_check_catches_a_removed_family() {
    let text = exposition();
    let without: String = text
        .lines()
        .filter(|l| !l.contains("kvr_session_duplicate_leases"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(without, text);
    compare::assert_catches_removal(
        &spec(),
        &metric_locations(&without),
        "SessionStats",
        "duplicate_leases",
    );
}
