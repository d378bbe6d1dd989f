//! End to end over real TCP: five emulated vLLM/SGLang publishers in Python
//! (`tests/e2e/scenario.py`: both encodings, every hash kind, PUB bind and connect, DP
//! ranks, dropped batches, restarts, a replay ROUTER) feed kvr's own subscriber; after
//! each phase the partition's index must equal the publishers' ground truth.
//!
//! Needs `python3` with `pyzmq` and `msgspec`; skipped (with a notice) without them
//! unless `KVR_REQUIRE_PYZMQ=1` (CI), where their absence fails.
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvr::config::PartitionConfig;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::ingress::TopicRoute;
use kvr::RankId;
use kvr::{Partition, PartitionKey};
use kvr_zmq::subscribe::{subscribe, SubscribeConfig, Subscription};
use serde_json::Value;

fn python_ready() -> bool {
    Command::new("python3")
        .args(["-c", "import zmq, msgspec"])
        .status()
        .is_ok_and(|s| s.success())
}

/// (worker, dp rank, tier index) → the blocks the rank holds on that tier, each as its
/// prompt's local hashes up to and including it.
type Truth = BTreeMap<(u64, u32, usize), BTreeSet<Vec<u64>>>;

fn tier_index(name: &str) -> usize {
    match name {
        "device" => 0,
        "host" => 1,
        "disk" => 2,
        other => panic!("unknown tier {other}"),
    }
}

fn truth_of(phase: &Value, block_size: usize) -> Truth {
    let mut t = Truth::new();
    for r in phase["ranks"].as_array().expect("ranks") {
        let key = (
            r["worker_id"].as_u64().unwrap(),
            r["dp_rank"].as_u64().unwrap() as u32,
            tier_index(r["tier"].as_str().unwrap()),
        );
        let set = t.entry(key).or_default();
        for b in r["blocks"].as_array().unwrap() {
            let lora = b["lora_name"].as_str();
            let tokens: Vec<u32> = b["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let h = BlockHasher::new(block_size, HashSalt::new(lora, None)).unwrap();
            let (mut local, mut seq) = (Vec::new(), Vec::new());
            h.hash_tokens(&tokens, &mut local, &mut seq);
            assert!(!seq.is_empty(), "a held block has a full prefix");
            set.insert(local);
        }
    }
    t
}

/// Differences between the index and the truth (empty = equal).
fn compare(p: &Partition, truth: &Truth) -> Vec<String> {
    let mut diffs = Vec::new();
    for ((w, dp, tier), seqs) in truth {
        let rank = RankId::new(*w, *dp);
        let held = p
            .index()
            .rank_stats(rank)
            .map_or(0, |s| s.tier_blocks[*tier]);
        if held != seqs.len() as u64 {
            diffs.push(format!(
                "{rank} tier {tier}: index holds {held} blocks, truth {}",
                seqs.len()
            ));
            continue;
        }
        for prefix in seqs {
            if p.index().block_tiers(rank, prefix) & (1 << tier) == 0 {
                let last = prefix.last().copied().unwrap_or(0);
                diffs.push(format!(
                    "{rank} tier {tier}: block (local {last:#x}) missing"
                ));
            }
        }
    }
    diffs
}

#[test]
fn subscriber_index_equals_the_publishers_ground_truth_after_every_phase() {
    if !python_ready() {
        assert!(
            std::env::var("KVR_REQUIRE_PYZMQ").as_deref() != Ok("1"),
            "KVR_REQUIRE_PYZMQ=1 but python3 with pyzmq and msgspec is missing"
        );
        eprintln!("SKIPPED: python3 with pyzmq and msgspec not found");
        return;
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/e2e/scenario.py");
    let mut child = Command::new("python3")
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start scenario.py");
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next_line = || lines.next().expect("scenario output").expect("utf-8 line");

    let ready = next_line();
    let ready: Value =
        serde_json::from_str(ready.strip_prefix("READY ").expect("READY line")).unwrap();
    let block_size = ready["block_size"].as_u64().unwrap() as u32;
    let partition = Arc::new(Partition::new(
        PartitionKey::new("e2e", "default"),
        PartitionConfig::new(block_size),
    ));

    // Subscriptions: connect to every publisher that binds; bind every endpoint the
    // others connect to, routing their topics to workers.
    let mut subs: Vec<Subscription> = Vec::new();
    let mut routes: BTreeMap<String, Vec<TopicRoute>> = BTreeMap::new();
    for w in ready["workers"].as_array().unwrap() {
        let worker_id = w["worker_id"].as_u64().unwrap();
        for pbl in w["publishers"].as_array().unwrap() {
            let endpoint = pbl["pub"].as_str().unwrap().to_string();
            let replay = pbl["replay"].as_str().map(str::to_string);
            let topic = pbl["topic"].as_str().unwrap().as_bytes().to_vec();
            let stream = pbl["dp_rank"].as_u64().unwrap() as u32;
            if pbl["mode"] == "bind" {
                subs.push(
                    subscribe(
                        partition.clone(),
                        SubscribeConfig::Connect {
                            endpoint,
                            replay_endpoint: replay,
                            topic,
                            worker_id,
                            stream,
                        },
                    )
                    .expect("subscribe (connect)"),
                );
            } else {
                routes.entry(endpoint).or_default().push(TopicRoute {
                    topic,
                    worker_id,
                    stream,
                    replay_endpoint: replay,
                });
            }
        }
    }
    for ep in ready["subscriber_binds"].as_array().unwrap() {
        let ep = ep.as_str().unwrap().to_string();
        let r = routes.remove(&ep).unwrap_or_default();
        subs.push(
            subscribe(
                partition.clone(),
                SubscribeConfig::Bind {
                    endpoint: ep,
                    routes: r,
                },
            )
            .expect("subscribe (bind)"),
        );
    }
    writeln!(stdin, "GO").unwrap();

    let phases = ready["phases"].as_u64().unwrap();
    for n in 1..=phases {
        let line = next_line();
        let mut parts = line.splitn(3, ' ');
        assert_eq!(parts.next(), Some("PHASE"), "got {line:?}");
        assert_eq!(parts.next(), Some(n.to_string().as_str()));
        let path = parts.next().expect("truth path");
        let phase: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let truth = truth_of(&phase, block_size as usize);
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut diffs = compare(&partition, &truth);
        while !diffs.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            diffs = compare(&partition, &truth);
        }
        assert!(
            diffs.is_empty(),
            "phase {n} ({}): the index differs from the ground truth:\n{}\nstreams: {:#?}",
            phase["name"],
            diffs.join("\n"),
            partition.ingress_stats()
        );
        eprintln!(
            "phase {n} ({}): index equals the ground truth",
            phase["name"]
        );
        writeln!(stdin, "NEXT").unwrap();
    }
    assert_eq!(next_line(), "DONE");
    for s in &mut subs {
        s.stop();
        assert!(!s.is_running());
    }
    let stats = partition.ingress_stats();
    let total = |f: fn(&kvr::stats::StreamStats) -> u64| stats.iter().map(f).sum::<u64>();
    assert!(total(|s| s.sequence.gaps) >= 3, "gaps: {stats:#?}");
    assert!(
        total(|s| s.sequence.replays_filled) >= 1,
        "replays: {stats:#?}"
    );
    assert!(total(|s| s.sequence.restarts) >= 3, "restarts: {stats:#?}");
    assert!(total(|s| s.sequence.clears) >= 5, "clears: {stats:#?}");
    let decode_errors: u64 = stats
        .iter()
        .flat_map(|s| s.decode_errors.iter().map(|c| c.1))
        .sum();
    assert_eq!(decode_errors, 0, "{stats:#?}");
    assert!(child.wait().unwrap().success());
}
