//! The C++ wrapper's mirror of the engine's structs (include/kvr.hpp) against their field
//! lists (`kvr::FIELD_LISTS`): every config field needs its `PartitionOptions::set_*`
//! method (or a parameter of a grouped one), every cost override a member of
//! `kvr::Overrides`, and every stats or load struct its C struct under a C++ alias (the C
//! check, c_mirror.rs, covers those structs' fields). Naming rule: C's (the engine's name,
//! or with `_ms` for a duration); the exceptions below say where C++ differs.

#[path = "../../tests/mirror/c_text.rs"]
mod c_text;
#[path = "../../tests/mirror/compare.rs"]
mod compare;

use c_text::strip_comments;

use std::collections::BTreeSet;
use std::path::PathBuf;

use compare::{at, extra, omitted, renamed, Exception, Place, Spec};

const OPTS: &str = "setters PartitionOptions::set_";

const fn alias(c_struct: &'static str) -> Place {
    Place::Whole {
        loc: "aliases",
        item: c_struct,
        why: "the C struct under a C++ alias: the C check covers its fields",
    }
}

/// Where C++ mirrors each engine struct.
const PLACES: &[(&str, &[Place])] = &[
    (
        "PartitionConfig",
        &[at(OPTS), at("params PartitionOptions::PartitionOptions")],
    ),
    ("CostConfig", &[at(OPTS)]),
    ("LatencyConfig", &[at(OPTS)]),
    ("CostOverrides", &[at("fields Overrides")]),
    (
        "BusyThresholds",
        &[Place::At {
            loc: OPTS,
            prefix: "busy_",
            strip: "",
        }],
    ),
    ("HintConfig", &[at("params PartitionOptions::set_kv_hints")]),
    (
        "SessionConfig",
        &[at("params PartitionOptions::set_session_affinity")],
    ),
    (
        "IndexerConfig",
        &[
            at(OPTS),
            Place::At {
                loc: "params PartitionOptions::set_remote_indexer",
                prefix: "",
                strip: "remote_",
            },
        ],
    ),
    (
        "ApproxConfig",
        &[at("params PartitionOptions::set_approx_index")],
    ),
    ("IndexStats", &[alias("kvr_index_stats")]),
    ("SelectionStats", &[alias("kvr_selection_stats")]),
    ("SessionStats", &[alias("kvr_session_stats")]),
    ("IndexerStats", &[alias("kvr_indexer_stats")]),
    ("ApproxStats", &[alias("kvr_indexer_stats")]),
    ("ReservationStats", &[alias("kvr_booking_stats")]),
    ("StreamStats", &[alias("kvr_stream_stats")]),
    ("SequenceStats", &[alias("kvr_stream_stats")]),
    ("RankLoad", &[alias("kvr_rank_load")]),
    ("ActiveLoad", &[alias("kvr_active_load")]),
];

/// Where C++ legitimately differs, each with its reason (those of C, whose setters the
/// methods call).
const EXCEPTIONS: &[Exception] = &[
    omitted(
        "PartitionConfig",
        "index_dump",
        "as C: no index dump to read (kvr serve's GET /dump turns it on)",
    ),
    renamed(
        "CostConfig",
        "model",
        OPTS,
        "cost_model",
        "as C: `model` alone would not say which model",
    ),
    extra(
        OPTS,
        "state_dir",
        "as C: the state directory is kvr-state's, not the engine's",
    ),
    omitted("SessionConfig", "shards", "as C: internal sharding"),
    omitted(
        "SessionConfig",
        "max_session_id_bytes",
        "as C: fixed at KVR_MAX_SESSION_ID_BYTES",
    ),
    omitted(
        "SessionConfig",
        "early_release_memory",
        "as C: internal bound of the lease shards",
    ),
    extra(
        "params PartitionOptions::set_session_affinity",
        "soft_penalty_blocks",
        "the payload of SessionConfig.mode's Soft variant",
    ),
    omitted(
        "IndexerConfig",
        "remote_client",
        "as C: libkvr builds the HTTP client from the URL",
    ),
    renamed(
        "IndexerConfig",
        "retention",
        OPTS,
        "approx_retention",
        "as C: named with the approximate index's setters",
    ),
    omitted(
        "ApproxConfig",
        "prune_to",
        "as C: fixed at its default (80 %)",
    ),
];

fn spec() -> Spec<'static> {
    Spec {
        host: "C++ (include/kvr.hpp)",
        places: PLACES,
        rule: |f| vec![f.to_string(), format!("{f}_ms")],
        exceptions: EXCEPTIONS,
    }
}

/// The body of `class name` or `struct name` (between its braces).
fn body<'a>(code: &'a str, name: &str) -> Option<&'a str> {
    let at = [format!("class {name} "), format!("struct {name} ")]
        .iter()
        .find_map(|h| code.find(h.as_str()))?;
    let open = at + code[at..].find('{')?;
    let mut depth = 0;
    for (i, c) in code[open..].char_indices() {
        depth += match c {
            '{' => 1,
            '}' => -1,
            _ => 0,
        };
        if depth == 0 {
            return Some(&code[open + 1..open + i]);
        }
    }
    None
}

/// The last identifier of a declarator (`uint64_t ttl_ms = 0` → `ttl_ms`).
fn declared_name(decl: &str) -> Option<String> {
    let decl = decl.split('=').next()?.trim_end();
    let start = decl
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    let name = &decl[start..];
    (!name.is_empty()).then(|| name.to_string())
}

/// Identifiers `text` calls (`name(` at a word boundary), with what follows the `(`.
fn calls(text: &str) -> impl Iterator<Item = (&str, &str)> {
    text.match_indices('(').filter_map(move |(i, _)| {
        let head = &text[..i];
        let start = head
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(0, |j| j + 1);
        let name = &head[start..];
        (!name.is_empty()).then(|| (name, &text[i + 1..]))
    })
}

/// The wrapper's mirror as locations: `aliases` (the C types aliased by `using X =
/// kvr_x;`), `setters C::set_` (the `set_…` methods of class C returning `C &`),
/// `params C::m` (the parameters of C's first `m(`), `fields S` (the members of S).
fn cpp_locations(hpp: &str) -> impl Fn(&str) -> Option<BTreeSet<String>> {
    let code = strip_comments(hpp);
    move |loc: &str| {
        if loc == "aliases" {
            return Some(
                code.split(';')
                    .filter_map(|s| s.trim().strip_prefix("using "))
                    .filter_map(|s| s.split_once('=').map(|(_, t)| t.trim().to_string()))
                    .filter(|t| t.starts_with("kvr_"))
                    .collect(),
            );
        }
        let (kind, name) = loc.split_once(' ')?;
        match kind {
            "setters" => {
                let (class, prefix) = name.split_once("::")?;
                let b = body(&code, class)?;
                Some(
                    calls(b)
                        .filter(|(m, _)| m.starts_with(prefix))
                        .filter(|(m, _)| b.contains(&format!("{class} &{m}(")))
                        .map(|(m, _)| m[prefix.len()..].to_string())
                        .collect(),
                )
            }
            "params" => {
                let (class, method) = name.split_once("::")?;
                let b = body(&code, class)?;
                let (_, rest) = calls(b).find(|(m, _)| *m == method)?;
                let params = &rest[..rest.find(')')?];
                Some(params.split(',').filter_map(declared_name).collect())
            }
            "fields" => {
                let b = body(&code, name)?;
                Some(b.split(';').filter_map(declared_name).collect())
            }
            _ => None,
        }
    }
}

fn wrapper() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../include/kvr.hpp");
    std::fs::read_to_string(path).expect("include/kvr.hpp")
}

#[test]
fn cpp_mirrors_every_engine_field() {
    compare::assert_mirrors(&spec(), &cpp_locations(&wrapper()));
}

/// Negative controls: a setter method, an override member and a stats alias taken out of
/// a copy of the wrapper.
#[test]
fn cpp_check_catches_a_removed_method_member_and_alias() {
    let hpp = wrapper();
    let without_method = hpp.replace("&set_itl_base_ms(", "&set_itl_basis_ms(");
    assert_ne!(without_method, hpp);
    compare::assert_catches_removal(
        &spec(),
        &cpp_locations(&without_method),
        "LatencyConfig",
        "itl_base_ms",
    );
    let without_member = hpp.replacen("    std::optional<double> temperature;\n", "", 1);
    assert_ne!(without_member, hpp);
    compare::assert_catches_removal(
        &spec(),
        &cpp_locations(&without_member),
        "CostOverrides",
        "temperature",
    );
    let without_alias = hpp.replace("using SessionStats = kvr_session_stats;", "");
    assert_ne!(without_alias, hpp);
    let errors = compare::differences(&spec(), &cpp_locations(&without_alias));
    assert!(
        errors.iter().any(|e| e.contains("SessionStats is missing")),
        "a removed stats alias was not caught: {errors:?}"
    );
}
