//! One version for everything kvr ships: the crates (the workspace's version, which this
//! crate inherits), the C header's `KVR_VERSION_*`, and the Python wheel's crate (outside
//! the workspace, so it states its own). A release bumps them together; this test fails
//! when one is left behind. (`KVR_ABI_VERSION` counts incompatible ABI changes separately.)
//! CHANGELOG.md says what each version brought.

use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The value of `#define NAME value` in `header`.
fn define(header: &str, name: &str) -> Option<u32> {
    header.lines().find_map(|l| {
        let rest = l.trim().strip_prefix("#define ")?.strip_prefix(name)?;
        rest.trim().parse().ok()
    })
}

/// The `version = "…"` of table `[section]` in a TOML file (Cargo.toml's `package`,
/// pyproject.toml's `project`).
fn package_version(toml: &str, section: &str) -> Option<String> {
    let header = format!("[{section}]");
    let mut in_package = false;
    for line in toml.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            in_package = t == header;
        } else if in_package {
            if let Some(v) = t.strip_prefix("version") {
                let v = v.trim_start().strip_prefix('=')?.trim();
                return Some(v.trim_matches('"').to_string());
            }
        }
    }
    None
}

#[test]
fn the_header_the_crates_and_the_wheel_share_one_version() {
    let crate_version = env!("CARGO_PKG_VERSION");
    let header = std::fs::read_to_string(root().join("include/kvr.h")).expect("include/kvr.h");
    let c = [
        define(&header, "KVR_VERSION_MAJOR"),
        define(&header, "KVR_VERSION_MINOR"),
        define(&header, "KVR_VERSION_PATCH"),
    ];
    let c: Vec<String> = c
        .iter()
        .map(|v| v.expect("KVR_VERSION_* in kvr.h").to_string())
        .collect();
    assert_eq!(
        c.join("."),
        crate_version,
        "include/kvr.h's KVR_VERSION_* vs the crates'"
    );
    for (file, section) in [
        ("python/Cargo.toml", "package"),
        ("python/pyproject.toml", "project"),
    ] {
        let text = std::fs::read_to_string(root().join(file)).expect(file);
        assert_eq!(
            package_version(&text, section).as_deref(),
            Some(crate_version),
            "{file}'s version (the wheel's) vs the crates'"
        );
    }
}

#[test]
fn the_parsers_read_what_they_should() {
    assert_eq!(
        define("#define KVR_VERSION_MINOR 4\n", "KVR_VERSION_MINOR"),
        Some(4)
    );
    assert_eq!(
        define("#define KVR_VERSION_MINORX 4\n", "KVR_VERSION_MINOR"),
        None
    );
    let toml = "[lib]\nversion = \"9\"\n[package]\nname = \"x\"\nversion = \"1.2.3\"\n";
    assert_eq!(package_version(toml, "package").as_deref(), Some("1.2.3"));
    assert_eq!(package_version(toml, "project"), None);
}
