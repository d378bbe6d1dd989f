//! The engine's public surface is the root and five modules (config, stats, hash, cost,
//! ingress), plus `testing` behind its feature: a module made public by accident (or a
//! facade module dropped) fails here. Items inside them are held to one name each by the
//! crate's lints (`unreachable_pub`, `unnameable_types`) and its private modules.

use std::collections::BTreeSet;

#[test]
fn the_public_modules_are_the_facade() {
    let lib = include_str!("../src/lib.rs");
    let mut public = BTreeSet::new();
    let mut gated = false;
    for line in lib.lines().map(str::trim) {
        if line.starts_with("#[cfg(feature = \"testing\")]") {
            gated = true;
            continue;
        }
        if let Some(rest) = line.strip_prefix("pub mod ") {
            let name = rest.trim_end_matches(';');
            public.insert(if gated {
                format!("{name} (testing)")
            } else {
                name.to_string()
            });
        } else if line.starts_with("pub(") && line.contains(" mod ") {
            panic!("a module visible to part of the crate only belongs in the list of private modules: {line}");
        }
        gated = false;
    }
    let want: BTreeSet<String> = [
        "config",
        "cost",
        "hash",
        "ingress",
        "stats",
        "testing (testing)",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(public, want, "engine/src/lib.rs's public modules");
}
