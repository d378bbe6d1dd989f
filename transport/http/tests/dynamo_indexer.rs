//! kvr's remote client against the REAL Dynamo standalone indexer (`python -m
//! dynamo.indexer`, Dynamo 1.6.1), fed by vLLM-like ZMQ publishers (`dynamo/publish.py`
//! over `tests/e2e/kvpublisher.py`): the overlap kvr reads must be what the published
//! events imply, tier by tier, and a partition whose primary is that indexer must select
//! with it.
//!
//! Needs a python with Dynamo (`ai-dynamo-runtime==1.6.1`): `KVR_DYNAMO_PY`, else
//! `/work/venv/dyn/bin/python` if it exists; and a python with `pyzmq` and `msgspec` for the
//! publishers (that one, else `KVR_PUBLISHER_PY`, else `python3`). Without them the test is
//! skipped with a notice, unless `KVR_REQUIRE_DYNAMO=1`, where it fails.
//!
//! Run: `cargo test -p kvr-remote --release --test dynamo_indexer -- --nocapture`.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvr::config::PartitionConfig;
use kvr::config::RemoteConfig;
use kvr::config::{IndexerConfig, IndexerPolicy};
use kvr::cost::SelectionRng;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::RankId;
use kvr::{Outcome, SelectRequest};
use kvr::{Partition, PartitionKey, WorkerInfo};
use kvr::{RemoteError, TieredOverlap, TieredScores};
use kvr_remote::HttpRemoteIndex;

const B: u32 = 16;
const BLOCKS: usize = 6;

/// `python` if it runs `code`.
fn python_with(python: &str, code: &str) -> bool {
    Command::new(python)
        .args(["-c", code])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The two pythons, or why the test cannot run.
fn pythons() -> Result<(String, String), String> {
    let dynamo = match std::env::var("KVR_DYNAMO_PY") {
        Ok(p) if !p.is_empty() => p,
        _ if Path::new("/work/venv/dyn/bin/python").exists() => "/work/venv/dyn/bin/python".into(),
        _ => return Err("no KVR_DYNAMO_PY and no /work/venv/dyn/bin/python".into()),
    };
    if !python_with(&dynamo, "import dynamo.llm") {
        return Err(format!("{dynamo} cannot import dynamo.llm"));
    }
    let zmq = "import zmq, msgspec";
    let candidates = [
        Some(dynamo.clone()),
        std::env::var("KVR_PUBLISHER_PY").ok(),
        Some("python3".into()),
    ];
    match candidates
        .into_iter()
        .flatten()
        .find(|p| python_with(p, zmq))
    {
        Some(publisher) => Ok((dynamo, publisher)),
        None => Err("no python with pyzmq and msgspec for the publishers".into()),
    }
}

/// Children killed (by their handle) when the test ends, however it ends.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn ov(worker: u64, dp: u32, device: u32, host: u32, disk: u32) -> TieredOverlap {
    TieredOverlap {
        rank: RankId::new(worker, dp),
        device,
        host,
        disk,
    }
}

/// One BlockStored: (vLLM medium, first block, end block).
type Store = (&'static str, usize, usize);

/// The publishers: (Dynamo's `--workers` key, the batch's DP rank, its stores). Device
/// and host copies of one block share its engine hash, as vLLM's do.
const PUBLISHERS: [(&str, u32, &[Store]); 5] = [
    // Device 0..3, host 0..5 (3 and 4 beyond the device), disk 5: 3 + 2 + 1.
    ("1", 0, &[("GPU", 0, 3), ("CPU", 0, 5), ("STORAGE", 5, 6)]),
    // Device 0..2, host 2..4 only, disk 4: 2 + 2 + 1.
    ("2", 0, &[("GPU", 0, 2), ("CPU", 2, 4), ("STORAGE", 4, 5)]),
    // Nothing on the device: host 0..2, disk 2: 0 + 2 + 1.
    ("3", 0, &[("CPU", 0, 2), ("STORAGE", 2, 3)]),
    // Worker 4 has two DP ranks: device 0..1 on rank 0; device 0..2 + host 2..5 on rank 1.
    ("4", 0, &[("GPU", 0, 1)]),
    ("4:1", 1, &[("GPU", 0, 2), ("CPU", 2, 5)]),
];

/// The prompt: 6 blocks, and their local hashes, at least one above 2^63 (so that a
/// client writing them unsigned would be refused: Dynamo reads i64).
fn prompt() -> (Vec<u32>, Vec<u64>) {
    let tokens: Vec<u32> = (0..B * BLOCKS as u32).map(|i| 7_000 + 13 * i).collect();
    let mut local = Vec::new();
    BlockHasher::new(B as usize, HashSalt::NONE)
        .unwrap()
        .local_hashes(&tokens, &mut local);
    assert!(local.iter().any(|&h| h > i64::MAX as u64), "{local:x?}");
    (tokens, local)
}

/// Starts the publishers and the indexer subscribed to them; returns the indexer's URL once
/// the events are published, and the publishers' stdin (closing it ends them).
fn start(dynamo: &str, publisher: &str, tokens: &[u32], procs: &mut Procs) -> (String, ChildStdin) {
    let spec = serde_json::json!({
        "block_size": B,
        "tokens": tokens,
        "publishers": PUBLISHERS.iter().map(|(_, dp, stores)| serde_json::json!({
            "dp_rank": dp,
            "stores": stores.iter().map(|(m, a, b)| serde_json::json!({"medium": m, "from": a, "to": b})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    });
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/dynamo/publish.py");
    let mut pubs = Command::new(publisher)
        .arg(&script)
        .arg(spec.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("publisher");
    let mut lines = BufReader::new(pubs.stdout.take().unwrap()).lines();
    let mut stdin: ChildStdin = pubs.stdin.take().unwrap();
    procs.0.push(pubs);
    let ready = lines.next().expect("READY").unwrap();
    let ready: serde_json::Value =
        serde_json::from_str(ready.strip_prefix("READY ").expect(&ready)).unwrap();
    let workers: Vec<String> = PUBLISHERS
        .iter()
        .zip(ready["endpoints"].as_array().unwrap())
        .map(|((w, _, _), ep)| format!("{w}={}", ep.as_str().unwrap()))
        .collect();
    let port = free_port();
    let log = std::env::temp_dir().join(format!("kvr-dynamo-indexer-{port}.log"));
    eprintln!("dynamo.indexer on port {port}, log {}", log.display());
    let indexer = Command::new(dynamo)
        .args(["-m", "dynamo.indexer", "--port", &port.to_string()])
        .args(["--block-size", &B.to_string(), "--model-name", "m"])
        .args(["--routing-group", "g", "--threads", "1"])
        .args(["--workers", &workers.join(",")])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("dynamo.indexer");
    procs.0.push(indexer);
    let url = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while ureq::get(format!("{url}/health")).call().is_err() {
        assert!(Instant::now() < deadline, "dynamo.indexer not up at {url}");
        std::thread::sleep(Duration::from_millis(100));
    }
    writeln!(stdin, "GO").unwrap();
    let published = lines.next().expect("PUBLISHED").unwrap();
    assert_eq!(published, "PUBLISHED");
    (url, stdin)
}

/// Queries until the answer stops changing into `want` (events arrive asynchronously).
fn query_until(
    client: &HttpRemoteIndex,
    key: &PartitionKey,
    local: &[u64],
    want: &[TieredOverlap],
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut out = TieredScores::new();
    loop {
        client.query_tiered(key, B, local, &mut out).unwrap();
        if out.as_slice() == want || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(out.as_slice(), want, "via {}", client.endpoint());
}

#[test]
fn kvr_reads_the_real_dynamo_indexer() {
    let (dynamo, publisher) = match pythons() {
        Ok(p) => p,
        Err(why) => {
            assert!(
                std::env::var("KVR_REQUIRE_DYNAMO").as_deref() != Ok("1"),
                "KVR_REQUIRE_DYNAMO=1 but Dynamo cannot run: {why}"
            );
            eprintln!("SKIPPED: the real Dynamo indexer test: {why}");
            return;
        }
    };
    let (tokens, local) = prompt();
    let mut procs = Procs(Vec::new());
    let (url, _publishers_stdin) = start(&dynamo, &publisher, &tokens, &mut procs);
    let key = PartitionKey::new("m", "g");
    let client = HttpRemoteIndex::new(RemoteConfig {
        base_url: url.clone(),
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
    })
    .unwrap();
    // Dynamo 1.6.1 has no /query_tiered_by_hash: the client falls back to /query_by_hash,
    // whose summary is per worker, so worker 4 (two DP ranks) keeps its device counts only.
    let mut out = TieredScores::new();
    client.query_tiered(&key, B, &local, &mut out).unwrap();
    let by_hash = client.endpoint().ends_with("/query_by_hash");
    let w4_1 = if by_hash {
        ov(4, 1, 2, 0, 0)
    } else {
        ov(4, 1, 2, 3, 0)
    };
    let want = [
        ov(1, 0, 3, 2, 1),
        ov(2, 0, 2, 2, 1),
        ov(3, 0, 0, 2, 1),
        ov(4, 0, 1, 0, 0),
        w4_1,
    ];
    query_until(&client, &key, &local, &want);
    eprintln!("Dynamo answered through {}", client.endpoint());
    // Prefixes: the overlap never runs past the query.
    let w4_1_prefix = ov(4, 1, 2, if by_hash { 0 } else { 1 }, 0);
    let prefix = [
        ov(1, 0, 3, 0, 0),
        ov(2, 0, 2, 1, 0),
        ov(3, 0, 0, 2, 1),
        ov(4, 0, 1, 0, 0),
        w4_1_prefix,
    ];
    query_until(&client, &key, &local[..3], &prefix);
    // Dynamo keys blocks by their LOCAL hashes: the chained sequence hashes match block 0
    // only (seq[0] = local[0]), and the engines' own hashes match nothing.
    let (mut seq_local, mut seq) = (Vec::new(), Vec::new());
    BlockHasher::new(B as usize, HashSalt::NONE)
        .unwrap()
        .hash_tokens(&tokens, &mut seq_local, &mut seq);
    client.query_tiered(&key, B, &seq, &mut out).unwrap();
    assert!(
        out.iter().all(|o| o.device + o.host + o.disk <= 1),
        "{out:?}"
    );
    let engine: Vec<u64> = (0..BLOCKS as u64)
        .map(|i| 0xF000_0000_0000_0000 + i)
        .collect();
    client.query_tiered(&key, B, &engine, &mut out).unwrap();
    assert!(out.is_empty(), "{out:?}");
    // Dynamo's refusals, as the client reports them.
    let unknown = PartitionKey::new("m", "nope");
    assert_eq!(
        client.query_tiered(&unknown, B, &local, &mut out),
        Err(RemoteError::Status(404))
    );
    if by_hash {
        // Its counts are tokens: for a partition of 32-token blocks, 48 is not whole.
        let r = client.query_tiered(&key, 32, &local, &mut out);
        assert!(
            matches!(&r, Err(RemoteError::BadBody(m)) if m.contains("32-token")),
            "{r:?}"
        );
    }

    // A partition whose primary is that indexer selects with its overlap.
    let indexer = kvr_remote::with_http_client(&IndexerConfig {
        remote_url: Some(url),
        remote_connect_timeout: Duration::from_secs(2),
        remote_request_timeout: Duration::from_secs(5),
        ..IndexerConfig::default()
    })
    .unwrap();
    let p = Arc::new(
        Partition::try_new(
            key,
            PartitionConfig {
                indexer,
                ..PartitionConfig::new(B)
            },
        )
        .unwrap(),
    );
    assert!(matches!(
        p.indexer_stats().policy,
        IndexerPolicy::RemotePrimary { .. }
    ));
    for (w, dp) in [(1, 1), (2, 1), (3, 1), (4, 2)] {
        p.upsert_worker(WorkerInfo::new(w, dp)).unwrap();
    }
    let mut rng = SelectionRng::from_seed(1);
    let mut select = |allowed: Option<&[u64]>| {
        let mut req = SelectRequest::tokens(&tokens);
        req.allowed_workers = allowed;
        match p.select(&req, &mut rng) {
            Outcome::Selected(d) => (
                d.rank,
                d.overlap.device_blocks,
                d.overlap.host_blocks,
                d.overlap.disk_blocks,
            ),
            o => panic!("{o:?}"),
        }
    };
    assert_eq!(select(None), (RankId::new(1, 0), 3, 2, 1));
    assert_eq!(select(Some(&[2, 3])), (RankId::new(2, 0), 2, 2, 1));
    assert_eq!(select(Some(&[4])), (RankId::new(4, 1), 2, w4_1.host, 0));
    let s = p.indexer_stats();
    assert_eq!((s.remote_queries, s.remote_failures), (3, 0));
}
