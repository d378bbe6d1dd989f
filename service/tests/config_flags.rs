//! `kvr serve`'s flags (service/src/args.rs, read through clap's own introspection of the
//! real parser) against the engine's config field lists (`kvr::FIELD_LISTS`): every
//! engine knob the service exposes needs its flag, with an environment variable; a
//! scheduling flag (`Knobs`) that mirrors no engine field fails, as does a stale
//! exception. Naming rule: the engine's name, optionally Dynamo's `router_` prefix or a
//! `_ms`/`_secs` unit. Exceptions: where the service legitimately differs, with reasons.

#[path = "../../tests/mirror/compare.rs"]
mod compare;

use std::collections::BTreeSet;

use clap::{Args, Command};
use compare::{at, extra, omitted, renamed, Exception, Place, Spec};
use kvr_service::args::Knobs;
use kvr_service::ServeArgs;

/// The scheduling flags (`Knobs`), each of which must mirror an engine field.
const KNOBS: &str = "knobs";
/// Every flag of `kvr serve` (service settings too: not checked for extras).
const FLAGS: &str = "serve flags";

const FIGURES: &str = "figures, not knobs: GET /metrics (service/tests/metrics_fields.rs)";
const ENGINE_DEFAULT: &str = "the engine's default: not among Dynamo 1.6.1 select_service's \
                              flags, nor one kvr serve adds";

/// Where `kvr serve` takes each engine struct's fields.
const PLACES: &[(&str, &[Place])] = &[
    ("PartitionConfig", &[at(KNOBS)]),
    ("CostConfig", &[at(KNOBS)]),
    ("LatencyConfig", &[at(KNOBS)]),
    (
        "CostOverrides",
        &[Place::Nowhere(
            "per request: router_config_override in the select body",
        )],
    ),
    (
        "BusyThresholds",
        &[Place::Nowhere(
            "not exposed: kvr serve keeps Dynamo's flag set, which has no busy thresholds \
             (an in-process host sets them: C, Go, Python's Engine)",
        )],
    ),
    (
        "HintConfig",
        &[Place::Nowhere(
            "kvr serve answers no transfer hints: its select answer has no hint field",
        )],
    ),
    ("SessionConfig", &[at(KNOBS)]),
    ("IndexerConfig", &[at(KNOBS)]),
    ("ApproxConfig", &[Place::Nowhere(ENGINE_DEFAULT)]),
    ("IndexStats", &[Place::Nowhere(FIGURES)]),
    ("SelectionStats", &[Place::Nowhere(FIGURES)]),
    ("SessionStats", &[Place::Nowhere(FIGURES)]),
    ("IndexerStats", &[Place::Nowhere(FIGURES)]),
    ("ApproxStats", &[Place::Nowhere(FIGURES)]),
    ("ReservationStats", &[Place::Nowhere(FIGURES)]),
    ("StreamStats", &[Place::Nowhere(FIGURES)]),
    ("SequenceStats", &[Place::Nowhere(FIGURES)]),
    (
        "RankLoad",
        &[Place::Nowhere(
            "reported by engines (worker load), not configured",
        )],
    ),
    ("ActiveLoad", &[Place::Nowhere(FIGURES)]),
];

const EXCEPTIONS: &[Exception] = &[
    omitted(
        "PartitionConfig",
        "block_size",
        "each worker's registration carries its kv_block_size",
    ),
    omitted(
        "PartitionConfig",
        "cache_namespace",
        "kvr serve hashes as Dynamo 1.6.1's service, without a namespace",
    ),
    renamed(
        "PartitionConfig",
        "booking_ttl",
        KNOBS,
        "router_ttl_secs",
        "Dynamo's flag (DYN_ROUTER_TTL_SECS), in seconds",
    ),
    omitted(
        "PartitionConfig",
        "index_dump",
        "always on: GET /dump (peer recovery) needs it",
    ),
    renamed(
        "CostConfig",
        "model",
        KNOBS,
        "cost_model",
        "`model` alone would not say which model",
    ),
    omitted(
        "CostConfig",
        "shared_cache_multiplier",
        "kvr serve sets no shared-cache hook: nothing to multiply",
    ),
    renamed(
        "SessionConfig",
        "idle_ttl",
        FLAGS,
        "session_affinity_ttl_secs",
        "Dynamo's flag; it also turns affinity on",
    ),
    omitted(
        "SessionConfig",
        "mode",
        "hard affinity, as Dynamo's service",
    ),
    omitted("SessionConfig", "max_entries", ENGINE_DEFAULT),
    omitted("SessionConfig", "shards", ENGINE_DEFAULT),
    omitted("SessionConfig", "max_session_id_bytes", ENGINE_DEFAULT),
    omitted("SessionConfig", "early_release_memory", ENGINE_DEFAULT),
    omitted("IndexerConfig", "prediction_ttl", ENGINE_DEFAULT),
    renamed(
        "IndexerConfig",
        "remote_url",
        FLAGS,
        "remote_indexer_url",
        "Dynamo's flag (DYN_ROUTER_REMOTE_INDEXER_URL); also switches local events off",
    ),
    omitted(
        "IndexerConfig",
        "remote_connect_timeout",
        "kvr-remote's default (50 ms)",
    ),
    omitted(
        "IndexerConfig",
        "remote_request_timeout",
        "kvr-remote's default (200 ms)",
    ),
    omitted(
        "IndexerConfig",
        "remote_client",
        "built from the URL (kvr_remote::with_http_client)",
    ),
    omitted("IndexerConfig", "retention", ENGINE_DEFAULT),
    extra(
        KNOBS,
        "router_track_prefill_tokens",
        "a booking's option (Dynamo's), per request in router_config_override too; not a \
         partition config field",
    ),
    extra(
        KNOBS,
        "router_assume_kv_reuse",
        "Dynamo's flag, accepted: kvr always dedups a rank's shared prompt blocks",
    ),
];

fn spec() -> Spec<'static> {
    Spec {
        host: "kvr serve flags (service/src/args.rs)",
        places: PLACES,
        rule: |f| {
            vec![
                f.to_string(),
                format!("router_{f}"),
                format!("{f}_ms"),
                format!("{f}_secs"),
            ]
        },
        exceptions: EXCEPTIONS,
    }
}

/// A flag's name as the engine's fields are named (`--itl-base-ms` → `itl_base_ms`).
fn flag_name(a: &clap::Arg) -> Option<String> {
    a.get_long().map(|l| l.replace('-', "_"))
}

/// The parsers' flags as locations: `knobs` (Knobs'), `serve flags` (all of ServeArgs').
fn flag_locations(knobs: &Command, serve: &Command) -> impl Fn(&str) -> Option<BTreeSet<String>> {
    let names =
        |c: &Command| -> BTreeSet<String> { c.get_arguments().filter_map(flag_name).collect() };
    let (k, s) = (names(knobs), names(serve));
    move |loc: &str| match loc {
        KNOBS => Some(k.clone()),
        FLAGS => Some(s.clone()),
        _ => None,
    }
}

fn commands() -> (Command, Command) {
    (
        Knobs::augment_args(Command::new("knobs")),
        ServeArgs::augment_args(Command::new("serve")),
    )
}

/// Every flag that mirrors an engine field (every knob, and the renamed service flags)
/// needs an environment variable: `KVR_…` or Dynamo's `DYN_ROUTER_…`, ending with the
/// flag's name (without `router_`).
fn env_differences(knobs: &Command, serve: &Command) -> Vec<String> {
    let mirroring: BTreeSet<String> = knobs
        .get_arguments()
        .filter_map(flag_name)
        .chain(EXCEPTIONS.iter().filter_map(|e| match *e {
            Exception::Renamed {
                loc: FLAGS, name, ..
            } => Some(name.to_string()),
            _ => None,
        }))
        .collect();
    let mut errors = Vec::new();
    for a in serve.get_arguments() {
        let Some(name) = flag_name(a) else { continue };
        if !mirroring.contains(&name) {
            continue;
        }
        let want = name.trim_start_matches("router_").to_uppercase();
        match a.get_env().and_then(|e| e.to_str()) {
            None => errors.push(format!("kvr serve: --{} has no environment variable", a.get_long().unwrap_or_default())),
            Some(env) if !(env.starts_with("KVR_") || env.starts_with("DYN_ROUTER_")) || !env.ends_with(&want) => {
                errors.push(format!("kvr serve: --{}'s environment variable {env} is not KVR_…{want} or DYN_ROUTER_…{want}", a.get_long().unwrap_or_default()))
            }
            Some(_) => {}
        }
    }
    errors
}

#[test]
fn serve_flags_mirror_every_engine_knob() {
    let (knobs, serve) = commands();
    compare::assert_mirrors(&spec(), &flag_locations(&knobs, &serve));
    let errors = env_differences(&knobs, &serve);
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// Negative controls: a knob's flag renamed, and a knob's environment variable removed,
/// in the real parser.
#[test]
fn flags_check_catches_a_removed_flag_and_env() {
    let (knobs, serve) = commands();
    let rename = |c: Command| c.mut_arg("itl_base_ms", |a| a.long("itl-basis-ms"));
    let (k, s) = (rename(knobs.clone()), rename(serve.clone()));
    compare::assert_catches_removal(
        &spec(),
        &flag_locations(&k, &s),
        "LatencyConfig",
        "itl_base_ms",
    );
    let no_env = |c: Command| c.mut_arg("credit_decay", |a| a.env(None));
    let errors = env_differences(&no_env(knobs), &no_env(serve));
    assert!(
        errors
            .iter()
            .any(|e| e.contains("--credit-decay has no environment variable")),
        "a knob without its environment variable was not caught: {errors:?}"
    );
}
