//! Runs the built `kvr` binary's `replay` subcommand: the `--json` schema, the plot, and
//! every kind of bad input refused with a message and a non-zero exit.

use std::path::PathBuf;
use std::process::{Command, Output};

fn kvr(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvr"))
        .arg("replay")
        .args(args)
        .output()
        .expect("run kvr")
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvr-replay-cli-{}-{name}", std::process::id()))
}

/// A small, fast built-in workload.
const SMALL: &[&str] = &["--sessions", "40", "--workers", "4", "--kv-blocks", "4096"];

fn keys(v: &serde_json::Value) -> Vec<&str> {
    let mut k: Vec<&str> = v
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    k.sort_unstable();
    k
}

#[test]
fn json_output_is_one_object_of_the_documented_schema() {
    let out = kvr(&[SMALL, &["--json"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(keys(&v), ["policies", "workload"]);
    assert_eq!(v["workload"]["name"], "built-in");
    let policies = v["policies"].as_array().unwrap();
    let names: Vec<_> = policies
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "kvr",
            "kvr-dynamo",
            "kvr-approx",
            "kvr-predict",
            "round-robin",
            "random",
            "least-loaded",
            "sglang",
            "dynamo-classic"
        ]
    );
    for p in policies {
        assert_eq!(
            keys(p),
            [
                "block_ops_per_s",
                "bytes_per_holder_block",
                "cached_tokens",
                "e2e_ms",
                "events_applied",
                "hit_rate",
                "learned_prefill_rate",
                "load_imbalance",
                "oracle_hit_rate",
                "policy",
                "prompt_tokens",
                "requests",
                "requests_per_rank",
                "select_ns",
                "tpot_ms",
                "ttft_ms"
            ]
        );
        assert_eq!(keys(&p["ttft_ms"]), ["p50", "p90", "p99"]);
        assert_eq!(keys(&p["select_ns"]), ["p50", "p99"]);
        assert_eq!(keys(&p["tpot_ms"]), ["p50", "p90", "p99"]);
        assert_eq!(keys(&p["e2e_ms"]), ["p50", "p90", "p99"]);
        assert!(p["tpot_ms"]["p50"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["e2e_ms"]["p50"].as_f64().unwrap() >= p["ttft_ms"]["p50"].as_f64().unwrap());
        let f = |k: &str| p[k].as_f64().unwrap();
        let hit = f("hit_rate");
        assert!(
            (0.0..=1.0).contains(&hit) && hit <= f("oracle_hit_rate") + 1e-9,
            "{p}"
        );
        assert!((hit - f("cached_tokens") / f("prompt_tokens")).abs() < 1e-9);
        assert!(p["ttft_ms"]["p50"].as_f64().unwrap() <= p["ttft_ms"]["p99"].as_f64().unwrap());
        assert!(f("load_imbalance") >= 1.0);
        assert!(p["requests"].as_u64().unwrap() > 0);
        let served: u64 = p["requests_per_rank"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .sum();
        assert_eq!(served, p["requests"].as_u64().unwrap(), "{p}");
    }
    assert!(policies[0]["events_applied"].as_u64().unwrap() > 0);
    assert!(
        policies[3]["events_applied"].as_u64().unwrap() > 0,
        "kvr-predict reads events"
    );
    assert_eq!(policies[4]["events_applied"].as_u64().unwrap(), 0);
    // kvr learned the simulated ranks' prefill rate from its prefill completions (the
    // default 10k tokens/s per rank, slowed by the decode steps prefill shares).
    let rate = policies[0]["learned_prefill_rate"].as_f64().unwrap();
    assert!((2_000.0..=12_000.0).contains(&rate), "{rate}");
}

#[test]
fn a_sweep_reports_every_policy_at_every_setting() {
    let svg = temp("sweep.svg");
    let out = kvr(&[
        SMALL,
        &[
            "--policy",
            "kvr,least-loaded",
            "--sweep",
            "rate=1,4",
            "--json",
            "--plot",
            svg.to_str().unwrap(),
        ],
    ]
    .concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["sweep"]["key"], "rate");
    let points = v["sweep"]["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    for (p, want) in points.iter().zip([1.0, 4.0]) {
        assert_eq!(p["value"].as_f64().unwrap(), want);
        let names: Vec<_> = p["policies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["policy"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["kvr", "least-loaded"]);
    }
    let body = std::fs::read_to_string(&svg).unwrap();
    assert!(body.contains("<svg") && body.contains("least-loaded") && body.contains("4×"));
    std::fs::remove_file(svg).ok();
    let text = kvr(&[
        SMALL,
        &["--policy", "kvr", "--sweep", "event-delay-ms=0,500"],
    ]
    .concat());
    let stdout = String::from_utf8(text.stdout).unwrap();
    assert!(
        stdout.contains("TTFT p90 (s) by event-delay-ms") && stdout.contains("500 ms"),
        "{stdout}"
    );
}

#[test]
fn table_and_plot() {
    let svg = temp("plot.svg");
    let out = kvr(&[
        SMALL,
        &[
            "--policy",
            "kvr,round-robin",
            "--plot",
            svg.to_str().unwrap(),
        ],
    ]
    .concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("oracle hit rate"), "{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("kvr ")), "{stdout}");
    assert!(
        stdout.lines().any(|l| l.starts_with("round-robin ")),
        "{stdout}"
    );
    assert!(!stdout.contains("sglang"));
    let body = std::fs::read_to_string(&svg).unwrap();
    assert!(body.contains("<svg") && body.contains("round-robin"));
    std::fs::remove_file(svg).ok();
}

#[test]
fn mooncake_trace_runs() {
    let trace = temp("ok.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 20, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 100, \"input_length\": 1500, \"output_length\": 20, \"hash_ids\": [1, 2, 3]}\n\
         {\"timestamp\": 200, \"input_length\": 600, \"output_length\": 20, \"hash_ids\": [4, 5]}\n",
    )
    .unwrap();
    let out = kvr(&[
        "--trace",
        trace.to_str().unwrap(),
        "--workers",
        "2",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["workload"]["requests"], 3);
    // The second request's first 1000 tokens were the first one's: 15 blocks of 64.
    let oracle = v["policies"][0]["oracle_hit_rate"].as_f64().unwrap();
    assert!((oracle - 960.0 / 3100.0).abs() < 1e-9, "{oracle}");
    std::fs::remove_file(trace).ok();
}

fn refused(args: &[&str], want: &str) {
    let out = kvr(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(
        stderr.contains(want),
        "{args:?}: {stderr:?} should contain {want:?}"
    );
    assert!(
        out.stdout.is_empty(),
        "{args:?} printed {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn bad_input_is_refused_with_a_message() {
    refused(&["--workers", "0"], "--workers must be at least 1");
    refused(&["--kv-blocks", "0"], "--kv-blocks must be at least 1");
    refused(&["--block-size", "0"], "--block-size must be at least 1");
    refused(&["--dp-size", "0"], "--dp-size must be at least 1");
    refused(&["--speed", "0"], "--speed must be a positive number");
    refused(
        &["--prefill-rate=-5"],
        "--prefill-rate must be a positive number",
    );
    refused(&["--speed", "nan"], "--speed must be a positive number");
    refused(&["--workers", "5000"], "at most 4096 ranks");
    refused(&["--policy", "fastest"], "unknown policy \"fastest\"");
    refused(&["--policy", ","], "names no policy");
    refused(&["--sweep", "rate=0"], "--sweep must be rate=N");
    refused(&["--sweep", "speed=1,2"], "--sweep must be rate=N");
    refused(&["--temperature=-1"], "--temperature must be zero or more");
    refused(
        &["--queue-externality", "nan"],
        "--queue-externality must be zero or more",
    );
    refused(
        &["--max-batched-tokens", "0"],
        "--max-batched-tokens must be at least 1",
    );
    refused(
        &["--agent-share", "0.8", "--unique-share", "0.5"],
        "sum to at most 1",
    );
    refused(
        &["--sessions", "0"],
        "--sessions must be between 1 and 100000",
    );
    refused(
        &["--sessions", "100000000"],
        "--sessions must be between 1 and 100000",
    );
    refused(&["--limit", "0"], "--limit must be at least 1");
    refused(&["--workers", "many"], "invalid value");
    refused(&["--kv-blocks", "10"], "needs");
    refused(
        &["--affinity", "sticky"],
        "--affinity must be `hard` or `soft:N`",
    );
    refused(&["--affinity", "soft:-1"], "--affinity must be");

    let bad = temp("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
         {\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": \"x\"}\n",
    )
    .unwrap();
    refused(
        &["--trace", bad.to_str().unwrap()],
        "bad.jsonl:2: not a trace record",
    );
    std::fs::write(&bad, "").unwrap();
    refused(
        &["--trace", bad.to_str().unwrap()],
        "the trace holds no requests",
    );
    std::fs::remove_file(&bad).ok();
    refused(&["--trace", "/nonexistent/t.jsonl"], "/nonexistent/t.jsonl");
    refused(
        &[SMALL, &["--plot", "/nonexistent/dir/p.svg"]].concat(),
        "/nonexistent/dir/p.svg",
    );
    // The plot's path is checked before anything else is read or built: here the trace
    // does not exist either, and the plot is what is reported.
    refused(
        &[
            "--plot",
            "/nonexistent/dir/p.svg",
            "--trace",
            "/nonexistent/t.jsonl",
        ],
        "cannot write plot /nonexistent/dir/p.svg",
    );
    let dir = std::env::temp_dir();
    refused(
        &[SMALL, &["--plot", dir.to_str().unwrap()]].concat(),
        "it is a directory",
    );
}

/// `kvr replay | head -1`: the reader closes the pipe before the table is written; the
/// command ends quietly with success (it panicked with exit 101 before).
#[test]
fn a_closed_stdout_pipe_ends_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvr"))
        .arg("replay")
        .args(SMALL)
        .args(["--policy", "round-robin"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run kvr");
    drop(child.stdout.take()); // the read end closes before kvr writes anything
    let out = child.wait_with_output().expect("wait for kvr");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn router_replicas_print_one_row_per_policy_replicas_and_sync() {
    let out = kvr(&[
        SMALL,
        &[
            "--policy",
            "least-loaded",
            "--routers",
            "1,2",
            "--sync",
            "none,dynamo,jetstream",
        ],
    ]
    .concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("least-loaded"))
        .collect();
    // One replica runs once (sync changes nothing there), two run once per sync mode.
    assert_eq!(rows.len(), 4, "{stdout}");
    assert!(
        stdout.contains("load CoV") && stdout.contains("race"),
        "{stdout}"
    );
    for (row, sync) in rows.iter().zip(["-", "none", "dynamo", "jetstream"]) {
        assert!(row.split_whitespace().nth(2) == Some(sync), "{row}");
    }
    for (flags, want) in [
        (&["--routers", "0"][..], "--routers takes replica counts"),
        (&["--routers", "2", "--sync", "gossip"], "unknown sync mode"),
        (
            &["--routers", "2", "--sync-loss", "1.5"],
            "--sync-loss must be",
        ),
        (
            &["--routers", "2", "--router-spread", "x"],
            "--router-spread must be",
        ),
        (&["--routers", "2", "--sweep", "rate=1,2"], "do not combine"),
        (&["--sync", "jetstream"], "apply only with --routers"),
        (&["--seeds", "3"], "apply only with --routers"),
    ] {
        refused(flags, want);
    }
}
