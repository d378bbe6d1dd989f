//! include/kvr.hpp, the C++ wrapper, calls every function include/kvr.h declares: a new C
//! entry point without a C++ wrapper fails here (tests/cpp runs the wrappers). The few
//! C functions the wrapper deliberately does not call are listed with the reason.

use std::collections::BTreeSet;
use std::path::PathBuf;

/// C functions kvr.hpp need not call, and why.
const NOT_WRAPPED: &[(&str, &str)] = &[(
    "kvr_partition_select_and_reserve",
    "Partition::select_and_reserve calls kvr_partition_select_and_reserve_with_hint, \
     which does the same and also returns the hint",
)];

/// Names of the functions `header` declares: `kvr_…(` at the start of a declaration line
/// (after the return type), not in comments or macros.
fn declared_functions(header: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in header.lines() {
        let t = line.trim_start();
        if t.starts_with('*') || t.starts_with("/*") || t.starts_with('#') || t.starts_with("//") {
            continue;
        }
        let Some(open) = t.find('(') else { continue };
        let head = &t[..open];
        let Some(name) = head
            .split(|c: char| c.is_whitespace() || c == '*')
            .next_back()
        else {
            continue;
        };
        // A declaration has a return type before the name (not a call or a macro body).
        if name.starts_with("kvr_") && head.len() > name.len() && !head.contains('=') {
            out.insert(name.to_string());
        }
    }
    out
}

/// `code` without its `//` comments and string literals (kvr.hpp names each C function in
/// a string for its errors, and in comments: neither is a call).
fn code_only(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    for line in code.lines() {
        let mut in_str = false;
        let mut prev = ' ';
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            if in_str {
                if c == '"' && prev != '\\' {
                    in_str = false;
                }
            } else if c == '"' {
                in_str = true;
            } else if c == '/' && chars.peek() == Some(&'/') {
                break;
            } else {
                out.push(c);
            }
            prev = c;
        }
        out.push('\n');
    }
    out
}

/// Whether `code` (see [`code_only`]) calls `name`: the name, not part of a longer
/// identifier, followed by `(`, or its address taken (`&name`, handed to a helper that
/// calls it).
fn called(code: &str, name: &str) -> bool {
    code.match_indices(name).any(|(i, _)| {
        let rest = code[i + name.len()..].trim_start();
        let before = code[..i].chars().next_back();
        let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        let after = code[i + name.len()..].chars().next();
        !ident(before) && (rest.starts_with('(') || (before == Some('&') && !ident(after)))
    })
}

#[test]
fn the_cpp_wrapper_calls_every_c_function() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let h = std::fs::read_to_string(root.join("include/kvr.h")).expect("include/kvr.h");
    let hpp = std::fs::read_to_string(root.join("include/kvr.hpp")).expect("include/kvr.hpp");
    let hpp = code_only(&hpp);
    let declared = declared_functions(&h);
    assert!(
        declared.len() > 90,
        "found only {} C functions",
        declared.len()
    );
    assert!(declared.contains("kvr_partition_ingest") && declared.contains("kvr_abi_version"));
    let exempt: BTreeSet<&str> = NOT_WRAPPED.iter().map(|(n, _)| *n).collect();
    let missing: Vec<&String> = declared
        .iter()
        .filter(|n| !exempt.contains(n.as_str()) && !called(&hpp, n))
        .collect();
    assert!(
        missing.is_empty(),
        "include/kvr.hpp does not call {missing:?}: wrap them, or list them in NOT_WRAPPED \
         with the reason"
    );
    for (name, _) in NOT_WRAPPED {
        assert!(
            declared.contains(*name),
            "NOT_WRAPPED names {name}, which kvr.h no longer declares"
        );
    }
}

#[test]
fn the_declaration_scan_finds_what_it_should() {
    let h = "/**\n * kvr_not_this(x)\n */\nkvr_status kvr_a(int x);\nconst char *kvr_b(void);\n\
             #define KVR_X() kvr_c(1)\nuint32_t kvr_d(void);\n";
    let got: Vec<String> = declared_functions(h).into_iter().collect();
    assert_eq!(got, ["kvr_a", "kvr_b", "kvr_d"]);
    assert!(called(&code_only("x = kvr_a (1);"), "kvr_a"));
    assert!(!called(&code_only("kvr_ab(1);"), "kvr_a"));
    assert!(!called(&code_only("f(\"kvr_a\"); // kvr_a(1)"), "kvr_a"));
    assert!(!called(&code_only("kvr_a"), "kvr_a"));
    assert!(called(&code_only("read(&kvr_a, \"kvr_a\")"), "kvr_a"));
    assert!(!called(&code_only("read(&kvr_ab)"), "kvr_a"));
}
