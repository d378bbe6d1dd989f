//! Runs the built `kvr` binary's `hash` subcommand. Expected hashes are either the pinned
//! vectors of REFERENCE.md §1 or computed here from that spec with xxhash-rust directly,
//! so these tests check the engine's hashing, not the CLI against itself.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use xxhash_rust::xxh3::xxh3_64_with_seed;

const PINNED_LOCAL: [u64; 2] = [9143094415614847814, 12124091508212882195];
const PINNED_SEQ: [u64; 2] = [9143094415614847814, 9510318385840434533];

fn kvr(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvr"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvr");
    let mut pipe = child.stdin.take().expect("stdin pipe");
    if let Some(text) = stdin {
        // kvr may refuse its arguments and exit before reading stdin: a closed pipe then
        // is expected (the exit status and stderr are what the tests check).
        if let Err(e) = pipe.write_all(text.as_bytes()) {
            assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "write stdin: {e}");
        }
    }
    drop(pipe);
    child.wait_with_output().expect("wait for kvr")
}

/// Runs successfully and parses the single output line.
fn hash_ok(args: &[&str], stdin: Option<&str>) -> (Vec<u64>, Vec<u64>) {
    let out = kvr(args, stdin);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kvr {args:?} failed: {stderr}");
    let stdout = String::from_utf8(out.stdout).expect("utf-8 stdout");
    assert!(stdout.ends_with('\n'), "no trailing newline: {stdout:?}");
    assert_eq!(stdout.lines().count(), 1, "expected one line: {stdout:?}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim_end()).expect("JSON output");
    let obj = v.as_object().expect("a JSON object");
    assert_eq!(obj.len(), 2, "unexpected keys: {stdout}");
    let arr = |key: &str| -> Vec<u64> {
        obj[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key} is not an array: {stdout}"))
            .iter()
            .map(|x| x.as_u64().expect("u64 element"))
            .collect()
    };
    (arr("local"), arr("sequence"))
}

/// Fails with a non-zero exit and a message on stderr; returns the message.
fn hash_err(args: &[&str], stdin: Option<&str>) -> String {
    let out = kvr(args, stdin);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "kvr {args:?} should fail");
    assert!(out.stdout.is_empty(), "no output expected on error");
    assert!(!stderr.trim().is_empty(), "no error message for {args:?}");
    stderr
}

/// REFERENCE.md §1, written out literally.
fn spec_hashes(
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    ns: Option<&str>,
) -> (Vec<u64>, Vec<u64>) {
    let mut seed: u64 = 1337;
    if let Some(l) = lora.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(l.as_bytes(), 0));
    }
    if let Some(n) = ns.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(n.as_bytes(), 1));
    }
    let local: Vec<u64> = tokens
        .chunks_exact(block_size)
        .map(|block| {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            xxh3_64_with_seed(&bytes, seed)
        })
        .collect();
    let mut seq = Vec::with_capacity(local.len());
    for (i, &l) in local.iter().enumerate() {
        if i == 0 {
            seq.push(l);
        } else {
            let mut buf = Vec::with_capacity(16);
            buf.extend_from_slice(&u64::to_le_bytes(seq[i - 1]));
            buf.extend_from_slice(&l.to_le_bytes());
            seq.push(xxh3_64_with_seed(&buf, 1337));
        }
    }
    (local, seq)
}

/// Deterministic pseudo-random tokens spanning the whole u32 range.
fn tokens_lcg(n: usize, mut state: u64) -> Vec<u32> {
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 32) as u32
        })
        .collect()
}

fn to_args(tokens: &[u32]) -> Vec<String> {
    tokens.iter().map(u32::to_string).collect()
}

#[test]
fn spec_helper_reproduces_pinned_vectors() {
    let toks: Vec<u32> = (0..8).collect();
    let (l, s) = spec_hashes(&toks, 4, None, None);
    assert_eq!(l, PINNED_LOCAL);
    assert_eq!(s, PINNED_SEQ);
    assert_eq!(xxh3_64_with_seed(b"test data", 1337), 13226331709069118873);
}

#[test]
fn pinned_vector_from_args() {
    let (l, s) = hash_ok(
        &[
            "hash",
            "--block-size",
            "4",
            "0",
            "1",
            "2",
            "3",
            "4",
            "5",
            "6",
            "7",
        ],
        None,
    );
    assert_eq!(l, PINNED_LOCAL);
    assert_eq!(s, PINNED_SEQ);
}

#[test]
fn pinned_vector_exact_output_text() {
    let out = kvr(
        &[
            "hash",
            "--block-size",
            "4",
            "0",
            "1",
            "2",
            "3",
            "4",
            "5",
            "6",
            "7",
        ],
        None,
    );
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "{\"local\":[9143094415614847814,12124091508212882195],\
         \"sequence\":[9143094415614847814,9510318385840434533]}\n"
    );
}

#[test]
fn partial_tail_block_is_dropped() {
    let (l, s) = hash_ok(
        &[
            "hash",
            "--block-size",
            "4",
            "0",
            "1",
            "2",
            "3",
            "4",
            "5",
            "6",
            "7",
            "8",
            "9",
        ],
        None,
    );
    assert_eq!(l, PINNED_LOCAL);
    assert_eq!(s, PINNED_SEQ);
}

#[test]
fn stdin_with_mixed_separators_matches_args() {
    let stdin = " 0,1 2\n3\t4,\r\n 5 ,, 6\n\n7,\n";
    let from_stdin = hash_ok(&["hash", "--block-size", "4"], Some(stdin));
    let from_args = hash_ok(
        &[
            "hash",
            "--block-size",
            "4",
            "0",
            "1",
            "2",
            "3",
            "4",
            "5",
            "6",
            "7",
        ],
        None,
    );
    assert_eq!(from_stdin, from_args);
    assert_eq!(from_stdin.0, PINNED_LOCAL);
}

#[test]
fn fewer_tokens_than_a_block_gives_empty_arrays() {
    let empty = (vec![], vec![]);
    assert_eq!(
        hash_ok(&["hash", "--block-size", "4", "1", "2", "3"], None),
        empty
    );
    assert_eq!(hash_ok(&["hash", "--block-size", "4"], Some("")), empty);
    assert_eq!(
        hash_ok(&["hash", "--block-size", "4"], Some(" \n, \t\n")),
        empty
    );
}

#[test]
fn salted_hashes_match_spec() {
    let toks: Vec<u32> = (0..40).map(|i| i * 7 + 3).collect();
    let targs = to_args(&toks);
    let salts: [(Option<&str>, Option<&str>); 5] = [
        (Some("my-adapter"), None),
        (None, Some("tenant-a")),
        (Some("my-adapter"), Some("tenant-a")),
        (Some(""), Some("")),
        (Some("ünïcode-lora"), Some("ns/with spaces")),
    ];
    let mut seen = Vec::new();
    for (lora, ns) in salts {
        let mut args: Vec<&str> = vec!["hash", "--block-size", "8"];
        if let Some(l) = lora {
            args.extend(["--lora-name", l]);
        }
        if let Some(n) = ns {
            args.extend(["--cache-namespace", n]);
        }
        args.extend(targs.iter().map(String::as_str));
        let got = hash_ok(&args, None);
        assert_eq!(
            got,
            spec_hashes(&toks, 8, lora, ns),
            "lora {lora:?}, ns {ns:?}"
        );
        assert_eq!(got.0.len(), 5);
        seen.push(got.0[0]);
    }
    // Empty names are absent: same as unsalted.
    assert_eq!(seen[3], spec_hashes(&toks, 8, None, None).0[0]);
    // LoRA and namespace salts are distinct and combine.
    assert_ne!(seen[0], seen[1]);
    assert_ne!(seen[0], seen[2]);
    assert_ne!(seen[1], seen[2]);
    assert_ne!(seen[0], seen[3]);
}

#[test]
fn long_input_with_lora_matches_spec() {
    let toks = tokens_lcg(10_000, 0x6b7672);
    let text: String = toks
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let sep = ["\n", " ", ",", "\t", ", "][i % 5];
            format!("{t}{sep}")
        })
        .collect();
    let args = ["hash", "--block-size", "16", "--lora-name", "long-lora"];
    let got = hash_ok(&args, Some(&text));
    let want = spec_hashes(&toks, 16, Some("long-lora"), None);
    assert_eq!(got.0.len(), 625);
    assert_eq!(got, want);

    // Same tokens as arguments, plus a namespace, with a partial tail.
    let tail = &toks[..9_999];
    let targs = to_args(tail);
    let mut args: Vec<&str> = vec![
        "hash",
        "--block-size",
        "16",
        "--lora-name",
        "long-lora",
        "--cache-namespace",
        "ns",
    ];
    args.extend(targs.iter().map(String::as_str));
    let got = hash_ok(&args, None);
    assert_eq!(got.0.len(), 624);
    assert_eq!(got, spec_hashes(tail, 16, Some("long-lora"), Some("ns")));
}

#[test]
fn extreme_token_values() {
    let toks = [u32::MAX, 0, u32::MAX, 1];
    let targs = to_args(&toks);
    let mut args = vec!["hash", "--block-size", "2"];
    args.extend(targs.iter().map(String::as_str));
    assert_eq!(hash_ok(&args, None), spec_hashes(&toks, 2, None, None));
}

#[test]
fn non_numeric_token_is_rejected() {
    let msg = hash_err(&["hash", "--block-size", "4", "1", "abc", "3"], None);
    assert!(msg.contains("abc") && msg.contains("position 2"), "{msg}");
    let msg = hash_err(&["hash", "--block-size", "4"], Some("1, 2\n3 abc 5"));
    assert!(msg.contains("abc") && msg.contains("position 4"), "{msg}");
}

#[test]
fn negative_token_is_rejected() {
    let msg = hash_err(&["hash", "--block-size", "4", "0", "-1"], None);
    assert!(msg.contains("-1") && msg.contains("position 2"), "{msg}");
    assert!(msg.contains("negative"), "{msg}");
    let msg = hash_err(&["hash", "--block-size", "4"], Some("-1"));
    assert!(msg.contains("-1") && msg.contains("position 1"), "{msg}");
}

#[test]
fn token_above_u32_max_is_rejected() {
    let msg = hash_err(&["hash", "--block-size", "4", "4294967296"], None);
    assert!(
        msg.contains("4294967296") && msg.contains("position 1"),
        "{msg}"
    );
    let msg = hash_err(&["hash", "--block-size", "4"], Some("1 2 3 4294967296"));
    assert!(
        msg.contains("4294967296") && msg.contains("position 4"),
        "{msg}"
    );
    // u32::MAX itself is fine.
    hash_ok(&["hash", "--block-size", "1", "4294967295"], None);
}

#[test]
fn zero_block_size_is_rejected() {
    let msg = hash_err(&["hash", "--block-size", "0", "1", "2"], None);
    assert!(msg.contains("block"), "{msg}");
    let msg = hash_err(&["hash", "--block-size", "0"], Some("1 2"));
    assert!(msg.contains("block"), "{msg}");
}

#[test]
fn bad_block_size_and_missing_block_size_are_rejected() {
    hash_err(&["hash", "--block-size", "-4", "1"], None);
    hash_err(&["hash", "--block-size", "x", "1"], None);
    hash_err(&["hash", "1", "2"], None);
}
