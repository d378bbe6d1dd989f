//! Every flag form of Dynamo 1.6.1's `python -m dynamo.select_service --help` starts
//! `kvr serve` (the real parser, then the start-up checks `App::new` runs), and the
//! invalid forms are refused with Dynamo's own messages (probed against Dynamo 1.6.1;
//! tests/compat/README.md).

use std::io::Write;

use clap::Parser;
use kvr_service::ServeArgs;

#[derive(Parser, Debug)]
#[command(name = "kvr serve", no_binary_name = true)]
struct Serve {
    #[command(flatten)]
    args: ServeArgs,
}

/// Parses `argv` and runs the start-up checks: `Ok(warnings)` or the error text.
fn start(argv: &[&str]) -> Result<Vec<String>, String> {
    let s = Serve::try_parse_from(argv).map_err(|e| e.to_string())?;
    s.args.check_dynamo_flags()
}

/// A key file of `len` bytes, removed when dropped.
struct KeyFile(std::path::PathBuf);

impl KeyFile {
    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for KeyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn key_file(len: usize) -> KeyFile {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let p = std::env::temp_dir().join(format!(
        "kvr-dynamo-flags-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::File::create(&p)
        .and_then(|mut f| f.write_all(&vec![7u8; len]))
        .unwrap();
    KeyFile(p)
}

#[test]
fn every_dynamo_flag_form_starts() {
    let key = key_file(32);
    let forms: Vec<Vec<&str>> = vec![
        vec!["--port", "8092"],
        vec!["--threads", "4"],
        vec!["--indexer-peers", "http://a:1,http://b:2"],
        vec!["--replica-sync-port", "5555"],
        vec!["--replica-sync-peers", "tcp://a:1,tcp://b:2"],
        vec!["--session-affinity-ttl-secs", "30"],
        vec!["--selection-cache-ttl-secs", "5"],
        vec!["--selection-cache-max-entries", "10"],
        vec!["--selection-cache-max-bytes", "1000"],
        vec!["--router-assume-kv-reuse"],
        vec!["--no-router-assume-kv-reuse"],
        vec!["--router-tracking-hash", "public-xxh3-v1"],
        vec![
            "--router-tracking-hash",
            "keyed-xxh3-v1",
            "--router-tracking-key-file",
            key.path(),
            "--router-tracking-key-id",
            "epoch-1",
        ],
        // kvr's older spelling, still accepted.
        vec!["--router-assume-kv-reuse", "false"],
        vec!["--router-assume-kv-reuse=true"],
    ];
    for argv in &forms {
        let warnings = start(argv).unwrap_or_else(|e| panic!("{argv:?} refused: {e}"));
        let accepted_not_applied = argv.contains(&"--no-router-assume-kv-reuse")
            || argv.contains(&"keyed-xxh3-v1")
            || argv.contains(&"false");
        assert_eq!(
            !warnings.is_empty(),
            accepted_not_applied,
            "{argv:?}: {warnings:?}"
        );
    }
    let s = Serve::try_parse_from(["--no-router-assume-kv-reuse"]).unwrap();
    assert!(s.args.no_router_assume_kv_reuse);
    let s = Serve::try_parse_from(["--router-assume-kv-reuse"]).unwrap();
    assert!(s.args.knobs.router_assume_kv_reuse);
}

#[test]
fn invalid_forms_are_refused_with_dynamos_messages() {
    let k32 = key_file(32);
    let k31 = key_file(31);
    let missing = "/nonexistent/kvr-tracking-key";
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--router-tracking-hash", "bogus"],
            "invalid value 'bogus' for '--router-tracking-hash <ROUTER_TRACKING_HASH>': \
             router_tracking_hash must be public-xxh3-v1 or keyed-xxh3-v1, got \"bogus\"",
        ),
        (
            vec!["--router-tracking-key-file", k32.path()],
            "router tracking key options require router_tracking_hash=keyed-xxh3-v1",
        ),
        (
            vec!["--router-tracking-key-id", "e1"],
            "router tracking key options require router_tracking_hash=keyed-xxh3-v1",
        ),
        (
            vec!["--router-tracking-hash", "keyed-xxh3-v1"],
            "keyed-xxh3-v1 requires router_tracking_key_file",
        ),
        (
            vec![
                "--router-tracking-hash",
                "keyed-xxh3-v1",
                "--router-tracking-key-file",
                k32.path(),
            ],
            "keyed-xxh3-v1 requires a nonempty router_tracking_key_id",
        ),
        (
            vec![
                "--router-tracking-hash",
                "keyed-xxh3-v1",
                "--router-tracking-key-file",
                k31.path(),
                "--router-tracking-key-id",
                "e1",
            ],
            "router tracking key file must contain exactly 32 raw bytes; found 31",
        ),
        (
            vec![
                "--router-tracking-hash",
                "keyed-xxh3-v1",
                "--router-tracking-key-file",
                missing,
                "--router-tracking-key-id",
                "e1",
            ],
            "failed to read router tracking key file",
        ),
    ];
    for (argv, want) in &cases {
        match start(argv) {
            Ok(w) => panic!("{argv:?} started (warnings {w:?}); Dynamo refuses it"),
            Err(e) => assert!(e.contains(want), "{argv:?}: got {e:?}, want {want:?}"),
        }
    }
}
