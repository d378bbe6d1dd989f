//! The client against an indexer without `/query_tiered_by_hash` (Dynamo 1.6.1's answers an
//! unknown route with an empty 404): it falls back to `/query_by_hash`, once, and keeps it;
//! a 404 with an `{"error"}` body (an unknown partition) is a status, not a missing route.
//!
//! Run: `cargo test -p kvr-remote --release --test query_by_hash`.

mod common;

use std::time::Duration;

use common::server::{Reply, TestServer};
use kvr::config::RemoteConfig;
use kvr::stats::RemoteStats;
use kvr::PartitionKey;
use kvr::RankId;
use kvr::{RemoteError, TieredOverlap, TieredScores};
use kvr_remote::{HttpRemoteIndex, QueryTieredByHashRequest, QUERY_BY_HASH_PATH};

/// What Dynamo 1.6.1's `/query_by_hash` answered for workers 1 and 2 (probed): tokens,
/// cumulative per worker.
const ANSWER: &str = r#"{"scores":{"1":{"0":48},"2":{"0":32}},"frequencies":[],"instances":{"1":{"longest_matched":96,"gpu":48,"dp":{"0":48},"cpu":80,"disk":96},"2":{"longest_matched":80,"gpu":32,"dp":{"0":32},"cpu":64,"disk":80}}}"#;

const HASHES: [u64; 6] = [u64::MAX, 1, 2, 3, 4, 1 << 63];

fn key() -> PartitionKey {
    PartitionKey::new("m", "g")
}

fn client(url: &str) -> HttpRemoteIndex {
    HttpRemoteIndex::new(RemoteConfig {
        base_url: url.into(),
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
    })
    .unwrap()
}

/// A 1.6.1 indexer under `prefix`: only `/query_by_hash`; `unknown` is a partition it
/// answers 404 for, as Dynamo does.
fn dynamo_1_6_1(prefix: &'static str) -> TestServer {
    TestServer::start(move |req| {
        if req.path != format!("{prefix}{QUERY_BY_HASH_PATH}") {
            return Reply::Json(404, String::new());
        }
        // Dynamo's body: the same request, hashes as i64.
        let q = QueryTieredByHashRequest::from_json(&req.body).unwrap();
        match q.model_name.as_str() {
            "m" => Reply::Json(200, ANSWER.into()),
            "garbage" => Reply::Json(200, r#"{"block_size":16,"tiered":{}}"#.into()),
            _ => Reply::Json(
                404,
                r#"{"error":"no indexer for model=x routing_group=g"}"#.into(),
            ),
        }
    })
}

fn overlap(worker: u64, device: u32, host: u32, disk: u32) -> TieredOverlap {
    TieredOverlap {
        rank: RankId::new(worker, 0),
        device,
        host,
        disk,
    }
}

#[test]
fn a_missing_tiered_route_falls_back_to_query_by_hash_once() {
    let server = dynamo_1_6_1("/kv");
    let client = client(&format!("{}/kv", server.url()));
    assert!(client.endpoint().ends_with("/kv/query_tiered_by_hash"));
    let mut out = TieredScores::new();
    for _ in 0..2 {
        client.query_tiered(&key(), 16, &HASHES, &mut out).unwrap();
        assert_eq!(out.as_slice(), &[overlap(1, 3, 2, 1), overlap(2, 2, 2, 1)]);
    }
    assert_eq!(
        client.endpoint(),
        format!("{}/kv/query_by_hash", server.url())
    );
    // The tiered route was tried once; both queries then went to /query_by_hash, with the
    // same body.
    let paths: Vec<String> = server.received().iter().map(|r| r.path.clone()).collect();
    assert_eq!(
        paths,
        [
            "/kv/query_tiered_by_hash",
            "/kv/query_by_hash",
            "/kv/query_by_hash"
        ]
    );
    let bodies: Vec<Vec<u8>> = server.received().into_iter().map(|r| r.body).collect();
    assert!(bodies.iter().all(|b| *b == bodies[0]));
    let sent: serde_json::Value = serde_json::from_slice(&bodies[0]).unwrap();
    assert_eq!(sent["block_hashes"][0].as_i64(), Some(-1));
    assert_eq!(sent["block_hashes"][5].as_i64(), Some(i64::MIN));
    // One outcome per query, however many requests it took.
    assert_eq!(
        client.stats(),
        RemoteStats {
            queries: 2,
            ok: 2,
            ..Default::default()
        }
    );
    // On the fallback route, errors are reported as on the tiered one.
    let unknown = PartitionKey::new("x", "g");
    assert_eq!(
        client.query_tiered(&unknown, 16, &HASHES, &mut out),
        Err(RemoteError::Status(404))
    );
    let garbage = PartitionKey::new("garbage", "g");
    match client.query_tiered(&garbage, 16, &HASHES, &mut out) {
        Err(RemoteError::BadBody(m)) => assert!(m.contains("not a query_by_hash answer"), "{m}"),
        other => panic!("{other:?}"),
    }
    // Tokens of another block size: 48 is not whole 32-token blocks.
    match client.query_tiered(&key(), 32, &HASHES, &mut out) {
        Err(RemoteError::BadBody(m)) => assert!(m.contains("32-token blocks"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(out.is_empty());
    assert!(client.endpoint().ends_with("/kv/query_by_hash"));
}

#[test]
fn an_unknown_partition_is_not_a_missing_route() {
    // A tiered server that does not serve the partition: 404 with Dynamo's error body.
    let server = TestServer::start(|_| Reply::Json(404, r#"{"error":"no indexer"}"#.into()));
    let client = client(&server.url());
    let mut out = TieredScores::new();
    for _ in 0..2 {
        assert_eq!(
            client.query_tiered(&key(), 16, &HASHES, &mut out),
            Err(RemoteError::Status(404))
        );
    }
    assert!(client.endpoint().ends_with("/query_tiered_by_hash"));
    assert_eq!(server.received().len(), 2, "no fallback request");
    // Any other status is not a missing route either.
    let server = TestServer::start(|_| Reply::Json(500, String::new()));
    let client = self::client(&server.url());
    assert_eq!(
        client.query_tiered(&key(), 16, &HASHES, &mut out),
        Err(RemoteError::Status(500))
    );
    assert!(client.endpoint().ends_with("/query_tiered_by_hash"));
    assert_eq!(server.received().len(), 1);
}
