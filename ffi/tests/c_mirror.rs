//! The C ABI's mirror of the engine's structs (include/kvr.h) against their field lists
//! (`kvr::FIELD_LISTS`): a stats or load field missing from its `kvr_*` struct, or a config
//! field without its `kvr_partition_options_set_*` setter (or a parameter of a grouped
//! setter), fails here, as does a C field or setter that mirrors nothing. Naming rule: the
//! engine's name, or with `_ms` for a duration; the exceptions below say where C differs.

#[path = "../../tests/mirror/c_text.rs"]
mod c_text;
#[path = "../../tests/mirror/compare.rs"]
mod compare;

use c_text::strip_comments;

use std::collections::BTreeSet;
use std::path::PathBuf;

use compare::{at, extra, omitted, renamed, Exception, Place, Spec};

const OPTS: &str = "setters kvr_partition_options_set_";

/// Where C mirrors each engine struct.
const PLACES: &[(&str, &[Place])] = &[
    (
        "PartitionConfig",
        &[at(OPTS), at("params kvr_partition_options_new")],
    ),
    ("CostConfig", &[at(OPTS)]),
    ("LatencyConfig", &[at(OPTS)]),
    ("CostOverrides", &[at("params kvr_request_set_overrides")]),
    (
        "BusyThresholds",
        &[Place::At {
            loc: OPTS,
            prefix: "busy_",
            strip: "",
        }],
    ),
    (
        "HintConfig",
        &[at("params kvr_partition_options_set_kv_hints")],
    ),
    (
        "SessionConfig",
        &[at("params kvr_partition_options_set_session_affinity")],
    ),
    (
        "IndexerConfig",
        &[
            at(OPTS),
            Place::At {
                loc: "params kvr_partition_options_set_remote_indexer",
                prefix: "",
                strip: "remote_",
            },
        ],
    ),
    (
        "ApproxConfig",
        &[at("params kvr_partition_options_set_approx_index")],
    ),
    ("IndexStats", &[at("struct kvr_index_stats")]),
    ("SelectionStats", &[at("struct kvr_selection_stats")]),
    ("SessionStats", &[at("struct kvr_session_stats")]),
    ("IndexerStats", &[at("struct kvr_indexer_stats")]),
    (
        "ApproxStats",
        &[Place::At {
            loc: "struct kvr_indexer_stats",
            prefix: "approx_",
            strip: "",
        }],
    ),
    ("ReservationStats", &[at("struct kvr_booking_stats")]),
    ("StreamStats", &[at("struct kvr_stream_stats")]),
    ("SequenceStats", &[at("struct kvr_stream_stats")]),
    ("RankLoad", &[at("struct kvr_rank_load")]),
    ("ActiveLoad", &[at("struct kvr_active_load")]),
];

const PADDING: &str = "padding (always 0), keeps the next field aligned";

/// Where C legitimately differs, each with its reason.
const EXCEPTIONS: &[Exception] = &[
    omitted(
        "PartitionConfig",
        "index_dump",
        "C has no index dump to read (kvr serve's GET /dump turns it on)",
    ),
    extra(
        OPTS,
        "state_dir",
        "the state directory is kvr-state's, not the engine's: libkvr restores and journals the partition (turning index_dump on)",
    ),
    renamed(
        "CostConfig",
        "model",
        OPTS,
        "cost_model",
        "`model` alone would not say which model among the partition's options",
    ),
    omitted(
        "SessionConfig",
        "shards",
        "internal sharding; the default suits any host",
    ),
    omitted(
        "SessionConfig",
        "max_session_id_bytes",
        "fixed in the C ABI: KVR_MAX_SESSION_ID_BYTES, which kvr_request_set_session checks",
    ),
    omitted(
        "SessionConfig",
        "early_release_memory",
        "internal bound of the lease shards (kvr::session's module docs)",
    ),
    extra(
        "params kvr_partition_options_set_session_affinity",
        "soft_penalty_blocks",
        "the payload of SessionConfig.mode's Soft variant (AffinityMode::Soft)",
    ),
    omitted(
        "IndexerConfig",
        "remote_client",
        "libkvr builds the HTTP client from the URL (kvr-remote)",
    ),
    renamed(
        "IndexerConfig",
        "retention",
        OPTS,
        "approx_retention",
        "named with the approximate index's setters it goes with",
    ),
    omitted(
        "ApproxConfig",
        "prune_to",
        "fixed at its default (80 %) in the C ABI",
    ),
    omitted(
        "IndexStats",
        "table_bytes",
        "a breakdown of `bytes` for Rust diagnostics",
    ),
    omitted(
        "IndexStats",
        "holder_set_bytes",
        "a breakdown of `bytes`; always 0 in the run index",
    ),
    omitted(
        "IndexStats",
        "rank_map_bytes",
        "a breakdown of `bytes` for Rust diagnostics",
    ),
    omitted(
        "IndexStats",
        "lineage_bytes",
        "a breakdown of `bytes`; always 0 in the run index",
    ),
    extra(
        "struct kvr_session_stats",
        "enabled",
        "whether affinity is on (Rust has Option<SessionStats>)",
    ),
    extra("struct kvr_session_stats", "reserved", PADDING),
    extra("struct kvr_indexer_stats", "reserved", PADDING),
    renamed(
        "ReservationStats",
        "prefill_rate",
        "params kvr_partition_prefill_rate",
        "out_rate",
        "read lock-free by kvr_partition_prefill_rate, not with the booking table's figures",
    ),
    renamed(
        "ReservationStats",
        "prefill_rate_observations",
        "params kvr_partition_prefill_rate",
        "out_observations",
        "read lock-free by kvr_partition_prefill_rate, with the rate",
    ),
    renamed(
        "ReservationStats",
        "decode_drag",
        "params kvr_partition_decode_drag",
        "out_drag",
        "read lock-free by kvr_partition_decode_drag, not with the booking table's figures",
    ),
    renamed(
        "ReservationStats",
        "decode_drag_observations",
        "params kvr_partition_decode_drag",
        "out_observations",
        "read lock-free by kvr_partition_decode_drag, with the drag",
    ),
    extra("struct kvr_booking_stats", "reserved", PADDING),
    extra("struct kvr_stream_stats", "reserved", PADDING),
    extra("struct kvr_stream_stats", "reserved2", PADDING),
    extra(
        "struct kvr_stream_stats",
        "replays_incomplete",
        "replays_partial + replays_failed, kept from ABI 1",
    ),
    extra(
        "struct kvr_rank_load",
        "worker_id",
        "the rank the figures are for (Rust keys RankLoad by RankId)",
    ),
    extra(
        "struct kvr_rank_load",
        "dp_rank",
        "the rank the figures are for (Rust keys RankLoad by RankId)",
    ),
    extra("struct kvr_rank_load", "reserved", PADDING),
];

fn spec() -> Spec<'static> {
    Spec {
        host: "C (include/kvr.h)",
        places: PLACES,
        rule: |f| vec![f.to_string(), format!("{f}_ms")],
        exceptions: EXCEPTIONS,
    }
}

/// The identifier a C declarator declares (`uint64_t tier_blocks[3]` → `tier_blocks`).
fn declared_name(decl: &str) -> Option<String> {
    let decl = decl.split('[').next()?.trim_end();
    let name: String = decl
        .chars()
        .rev()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    (!name.is_empty()).then_some(name)
}

/// The header's mirror as locations: `struct kvr_x` (its fields), `setters <prefix>` (the
/// functions named `<prefix>…`, by the rest of their names), `params kvr_f` (the
/// parameters of kvr_f other than handles and lengths).
fn c_locations(header: &str) -> impl Fn(&str) -> Option<BTreeSet<String>> {
    let code = strip_comments(header);
    move |loc: &str| {
        let (kind, name) = loc.split_once(' ')?;
        match kind {
            "struct" => {
                let open = format!("typedef struct {name} {{");
                let start = code.find(&open)? + open.len();
                let body = &code[start..start + code[start..].find('}')?];
                Some(body.split(';').filter_map(declared_name).collect())
            }
            "setters" => Some(
                functions(&code)
                    .map(|(f, _)| f)
                    .filter_map(|f| f.strip_prefix(name).map(str::to_string))
                    .collect(),
            ),
            "params" => {
                let (_, params) = functions(&code).find(|(f, _)| f == name)?;
                Some(
                    params
                        .split(',')
                        .filter(|p| !p.contains("struct kvr_") && p.trim() != "void")
                        .filter_map(declared_name)
                        .filter(|p| p != "len" && !p.ends_with("_len"))
                        .collect(),
                )
            }
            _ => None,
        }
    }
}

/// The functions `code` declares: (name, parameter list).
fn functions(code: &str) -> impl Iterator<Item = (String, String)> + '_ {
    code.split(';').filter_map(|decl| {
        let open = decl.find('(')?;
        let head = decl[..open].trim_end();
        let name = declared_name(head)?;
        // A declaration has a return type before the name (not a function-pointer typedef).
        if !name.starts_with("kvr_") || head.len() == name.len() || head.contains("typedef") {
            return None;
        }
        let close = decl.rfind(')')?;
        Some((name, decl[open + 1..close].to_string()))
    })
}

fn header() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../include/kvr.h");
    std::fs::read_to_string(path).expect("include/kvr.h")
}

#[test]
fn c_mirrors_every_engine_field() {
    compare::assert_mirrors(&spec(), &c_locations(&header()));
}

/// Negative controls: a stats field and a setter taken out of a copy of the header.
#[test]
fn c_check_catches_a_removed_field_and_setter() {
    let h = header();
    let without_field = h.replacen("  uint64_t too_many_ranks;\n", "", 1);
    assert_ne!(without_field, h);
    compare::assert_catches_removal(
        &spec(),
        &c_locations(&without_field),
        "IndexStats",
        "too_many_ranks",
    );
    let without_setter = h.replace(
        "kvr_partition_options_set_itl_base_ms(",
        "kvr_partition_options_set_itl_basis_ms(",
    );
    assert_ne!(without_setter, h);
    compare::assert_catches_removal(
        &spec(),
        &c_locations(&without_setter),
        "LatencyConfig",
        "itl_base_ms",
    );
    let errors = compare::differences(&spec(), &c_locations(&without_setter));
    assert!(
        errors
            .iter()
            .any(|e| e.contains("`itl_basis_ms` in setters") && e.contains("extra")),
        "a setter that mirrors nothing was not reported: {errors:?}"
    );
}
