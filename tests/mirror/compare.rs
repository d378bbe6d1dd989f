//! The comparison every Rust-side mirror check shares (C, C++, `kvr serve`'s flags and
//! metrics; included with `#[path]` by ffi/tests and service/tests): a host's mirror of the
//! engine's structs against their field lists (`kvr::FIELD_LISTS`, DESIGN.md §13).
//!
//! A host reads its mirror into *locations*: named sets of names (a C struct's fields, the
//! setters of an options object, one function's parameters, the metric families). A
//! [`Spec`] says where each engine struct is mirrored; a field is found when the host's
//! naming rule, applied to it, gives a name in one of its struct's locations. Exceptions
//! say where a host legitimately differs, each with its reason; they are checked too (a
//! stale exception fails). Location names follow one convention where setters are
//! involved: `setters <prefix>` holds the names of the functions `<prefix>…` without the
//! prefix, and `params <function>` the parameters of a grouped setter, which (once one of
//! its parameters mirrors a field) also accounts for the setter itself. Fields that hold another listed struct (`NESTED`) are mirrored
//! through that struct's own entry.

#![allow(dead_code)] // each test file uses its part

use std::collections::{BTreeMap, BTreeSet};

/// Where a host mirrors one engine struct.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Place {
    /// Each field as `prefix + rule(field without strip)` in location `loc`.
    At {
        loc: &'static str,
        prefix: &'static str,
        strip: &'static str,
    },
    /// The whole struct as one item (`item` in `loc`: a C++ alias of the C struct), whose
    /// fields another host's check covers.
    Whole {
        loc: &'static str,
        item: &'static str,
        why: &'static str,
    },
    /// Not mirrored by this host, and why.
    Nowhere(&'static str),
}

/// `field` of every engine struct in location `loc`.
pub(crate) const fn at(loc: &'static str) -> Place {
    Place::At {
        loc,
        prefix: "",
        strip: "",
    }
}

/// A host's legitimate difference from the engine, with its reason.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Exception {
    /// The host does not mirror `strukt.field`.
    Omitted {
        strukt: &'static str,
        field: &'static str,
        why: &'static str,
    },
    /// The host mirrors `strukt.field` as `name` in `loc` (not by its rule).
    Renamed {
        strukt: &'static str,
        field: &'static str,
        loc: &'static str,
        name: &'static str,
        why: &'static str,
    },
    /// `name` in `loc` mirrors no engine field.
    Extra {
        loc: &'static str,
        name: &'static str,
        why: &'static str,
    },
}

pub(crate) const fn omitted(
    strukt: &'static str,
    field: &'static str,
    why: &'static str,
) -> Exception {
    Exception::Omitted { strukt, field, why }
}

pub(crate) const fn renamed(
    strukt: &'static str,
    field: &'static str,
    loc: &'static str,
    name: &'static str,
    why: &'static str,
) -> Exception {
    Exception::Renamed {
        strukt,
        field,
        loc,
        name,
        why,
    }
}

pub(crate) const fn extra(loc: &'static str, name: &'static str, why: &'static str) -> Exception {
    Exception::Extra { loc, name, why }
}

/// A host's mirror: where each engine struct is, its naming rule and its exceptions.
pub(crate) struct Spec<'a> {
    /// Names the host in messages ("C (include/kvr.h)").
    pub host: &'a str,
    /// Engine struct name → its places. Every struct of `kvr::FIELD_LISTS` needs an entry.
    pub places: &'a [(&'static str, &'a [Place])],
    /// The names a field may have in this host, most likely first (e.g. `x`, `x_ms`).
    pub rule: fn(&str) -> Vec<String>,
    pub exceptions: &'a [Exception],
}

/// The names in each location, as the host read them (`None`: the location is not there).
pub(crate) type Locate<'a> = dyn Fn(&str) -> Option<BTreeSet<String>> + 'a;

/// Every difference between the host's mirror and the engine's lists, one line each.
pub(crate) fn differences(spec: &Spec<'_>, locate: &Locate<'_>) -> Vec<String> {
    let host = spec.host;
    let mut errors = Vec::new();
    let mut cache: BTreeMap<&str, Option<BTreeSet<String>>> = BTreeMap::new();
    let mut names = |loc: &'static str| cache.entry(loc).or_insert_with(|| locate(loc)).clone();
    // Names claimed by an engine field, per location.
    let mut claimed: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    let mut checked_locs = BTreeSet::new();
    let places: BTreeMap<&str, &[Place]> = spec.places.iter().copied().collect();
    for known in places.keys() {
        if !kvr::FIELD_LISTS.iter().any(|l| l.name == *known) {
            errors.push(format!("{host}: places name {known}, not an engine struct"));
        }
    }
    for list in kvr::FIELD_LISTS {
        let s = list.name;
        let Some(&ps) = places.get(s) else {
            errors.push(format!(
                "{host}: engine struct {s} has no place in this host's check (where does the \
                 host mirror it? or Place::Nowhere with the reason)"
            ));
            continue;
        };
        for p in ps {
            match *p {
                Place::At { loc, .. } => {
                    if names(loc).is_none() {
                        errors.push(format!("{host}: {s}'s location `{loc}` is not there"));
                    }
                    checked_locs.insert(loc);
                }
                Place::Whole { loc, item, .. } => {
                    if !names(loc).is_some_and(|n| n.contains(item)) {
                        errors.push(format!("{host}: {s} is missing: no `{item}` in {loc}"));
                    }
                }
                Place::Nowhere(_) => {}
            }
        }
        if !ps.iter().any(|p| matches!(p, Place::At { .. })) {
            continue;
        }
        for &field in list.fields {
            let omit = spec.exceptions.iter().find(|e| {
                matches!(e, Exception::Omitted { strukt, field: f, .. } if *strukt == s && *f == field)
            });
            let rename = spec.exceptions.iter().find_map(|e| match *e {
                Exception::Renamed {
                    strukt,
                    field: f,
                    loc,
                    name,
                    ..
                } if strukt == s && f == field => Some((loc, name)),
                _ => None,
            });
            let nested = list.nested.iter().any(|(f, _)| *f == field);
            let mut found = None;
            if let Some((loc, name)) = rename {
                if names(loc).is_some_and(|n| n.contains(name)) {
                    found = Some((loc, name.to_string()));
                }
            } else {
                'search: for p in ps {
                    if let Place::At { loc, prefix, strip } = *p {
                        let Some(have) = names(loc) else { continue };
                        let base = field.strip_prefix(strip).unwrap_or(field);
                        for candidate in (spec.rule)(base) {
                            let candidate = format!("{prefix}{candidate}");
                            if have.contains(&candidate) {
                                found = Some((loc, candidate));
                                break 'search;
                            }
                        }
                    }
                }
            }
            match (found, omit, nested) {
                (Some((loc, name)), None, _) => {
                    // A grouped setter (`params <prefix><name>`) is the setter `<name>` of
                    // the location `setters <prefix>`.
                    if let Some(function) = loc.strip_prefix("params ") {
                        for p in spec.places.iter().flat_map(|(_, ps)| ps.iter()) {
                            if let Place::At { loc: setters, .. } = *p {
                                let prefix = setters.strip_prefix("setters ").unwrap_or("\0");
                                if let Some(setter) = function.strip_prefix(prefix) {
                                    claimed.entry(setters).or_default().insert(setter.into());
                                }
                            }
                        }
                    }
                    claimed.entry(loc).or_default().insert(name);
                }
                (Some((loc, name)), Some(_), _) => errors.push(format!(
                    "{host}: {s}.{field} is listed as omitted, but {loc} has `{name}`: drop the \
                     exception"
                )),
                (None, Some(_), _) | (None, None, true) => {}
                (None, None, false) => {
                    let looked: Vec<String> = match rename {
                        Some((loc, name)) => vec![format!("`{name}` in {loc}")],
                        None => ps
                            .iter()
                            .filter_map(|p| match *p {
                                Place::At { loc, prefix, strip } => {
                                    let base = field.strip_prefix(strip).unwrap_or(field);
                                    let c: Vec<String> = (spec.rule)(base)
                                        .into_iter()
                                        .map(|c| format!("`{prefix}{c}`"))
                                        .collect();
                                    Some(format!("{} in {loc}", c.join(" or ")))
                                }
                                _ => None,
                            })
                            .collect(),
                    };
                    errors.push(format!(
                        "{host}: {s}.{field} is missing (looked for {})",
                        looked.join("; ")
                    ));
                }
            }
        }
    }
    // Extra names: in a checked location, claimed by no field and no exception.
    for loc in checked_locs {
        let Some(have) = names(loc) else { continue };
        let mine = claimed.get(loc).cloned().unwrap_or_default();
        for name in have {
            let excused = spec.exceptions.iter().any(
                |e| matches!(e, Exception::Extra { loc: l, name: n, .. } if *l == loc && *n == name),
            );
            if !mine.contains(&name) && !excused {
                errors.push(format!(
                    "{host}: `{name}` in {loc} is extra: it mirrors no engine field"
                ));
            }
        }
    }
    for e in spec.exceptions {
        if let Exception::Extra { loc, name, .. } = *e {
            if !names(loc).is_some_and(|n| n.contains(name)) {
                errors.push(format!(
                    "{host}: exception for `{name}` in {loc}, which is not there: drop it"
                ));
            }
        }
    }
    errors
}

/// Fails with every difference, one per line.
pub(crate) fn assert_mirrors(spec: &Spec<'_>, locate: &Locate<'_>) {
    let errors = differences(spec, locate);
    assert!(
        errors.is_empty(),
        "{} mirror(s) differ from the engine's field lists (kvr::FIELD_LISTS; \
         engine/src/fields.rs):\n  {}",
        errors.len(),
        errors.join("\n  ")
    );
}

/// The negative control: `mutate` removes the mirror of `strukt.field` from the host's
/// source, and the check must then name it as missing.
pub(crate) fn assert_catches_removal(
    spec: &Spec<'_>,
    locate: &Locate<'_>,
    strukt: &str,
    field: &str,
) {
    let errors = differences(spec, locate);
    let want = format!("{strukt}.{field} is missing");
    assert!(
        errors.iter().any(|e| e.contains(&want)),
        "{}: removing {strukt}.{field}'s mirror was not caught; the check said:\n  {}",
        spec.host,
        errors.join("\n  ")
    );
}
