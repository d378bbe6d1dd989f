//! The remote primary index client (`kvr_remote::HttpRemoteIndex`) against
//! in-test HTTP/1.1 servers on 127.0.0.1 (std::net only).
//!
//! - a correct server answering from a real `Index` (the round trip must equal the local
//!   index's own `find_matches_tiered`), reusing one connection, with a base path, from
//!   several threads, refusing an unknown partition with a status, and an answer for
//!   another block size refused by the client;
//! - nothing listening → `Connect`, quickly; a server that never answers, answers late, or
//!   stalls its body → `Timeout` within a few request timeouts;
//! - garbage: non-JSON, the wrong shape, an empty body, HTTP 500/404, a rank listed twice,
//!   a count beyond the query, a reply that is not HTTP → each its error kind and counter
//!   (Dynamo 1.6.1's `/query_by_hash` fallback: `tests/query_by_hash.rs`);
//! - invalid base URLs refused at construction; an empty prompt sends nothing.
//!
//! Timeouts are generous (100 ms connect / 300 ms request for the timeout tests, seconds
//! for the others) and bounds are loose (5 × the timeout): these are functional checks on a
//! possibly busy machine, not benchmarks.
//!
//! Run: `cargo test -p kvr-remote --release --test remote_index`.

use std::io::ErrorKind;
use std::net::TcpListener;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use kvr::{Index, RemoteError, RemoteIndex, TieredOverlap, TieredScores};

use kvr::config::RemoteConfig;

use kvr::stats::RemoteStats;
use kvr::PartitionKey;
use kvr::{KvEvent, RankId, StoredBlock, Tier};
use kvr_remote::{
    HttpRemoteIndex, QueryTieredByHashRequest, QueryTieredByHashResponse, QUERY_TIERED_BY_HASH_PATH,
};

mod common;

use common::server::{Reply, TestServer};

// ---------------------------------------------------------------------------------------
// An index to answer from.

const BLOCK_SIZE: u32 = 16;

fn key() -> PartitionKey {
    PartitionKey::new("llama-3-8b", "default")
}

fn store(index: &Index, rank: RankId, tier: Tier, parent: Option<u64>, blocks: &[(u64, u64)]) {
    let blocks: Vec<StoredBlock> = blocks
        .iter()
        .map(|&(external_hash, local_hash)| StoredBlock {
            external_hash,
            local_hash,
        })
        .collect();
    index
        .apply(
            rank,
            &KvEvent::Stored {
                tier,
                parent,
                blocks: &blocks,
            },
        )
        .unwrap();
}

/// Local hashes of the shared prompt (large, as real xxh3 values are: above 2^53).
const PROMPT: [u64; 6] = [
    0x9E37_79B9_7F4A_7C15,
    0xC2B2_AE3D_27D4_EB4F,
    0x1656_67B1_9E37_79F9,
    0x85EB_CA77_C2B2_AE63,
    0x27D4_EB2F_1656_67C5,
    0xFFFF_FFFF_FFFF_FFFE,
];

/// Ranks holding parts of `PROMPT` on every tier, one of them with a worker id near
/// `u64::MAX` (JSON numbers must carry it exactly).
fn populated_index() -> Index {
    let index = Index::new();
    let p = PROMPT;
    let a = RankId::new(7, 0);
    let b = RankId::new(u64::MAX - 1, 3);
    let c = RankId::new(9, 1);
    let d = RankId::new(10, 0);
    store(&index, a, Tier::Device, None, &[(100, p[0]), (101, p[1])]);
    store(&index, a, Tier::Host, Some(101), &[(102, p[2])]);
    store(
        &index,
        a,
        Tier::Disk,
        Some(102),
        &[(103, p[3]), (104, p[4])],
    );
    store(
        &index,
        b,
        Tier::Disk,
        None,
        &[(200, p[0]), (201, p[1]), (202, p[2])],
    );
    store(&index, c, Tier::Device, None, &[(300, p[0])]);
    let all: Vec<(u64, u64)> = p
        .iter()
        .enumerate()
        .map(|(i, &h)| (400 + i as u64, h))
        .collect();
    store(&index, d, Tier::Device, None, &all);
    // Another prompt, sharing nothing with PROMPT.
    store(&index, c, Tier::Host, None, &[(500, 1), (501, 2)]);
    index
}

/// A server answering from `index` as `kvr serve` would: Dynamo's statuses (400/422 for a
/// bad body, 404 with an `{"error"}` body for another partition), an empty 404 elsewhere.
fn index_server(index: Arc<Index>, path: &'static str) -> TestServer {
    TestServer::start(move |req| {
        if req.method != "POST" || req.path != path {
            return Reply::Json(404, String::new());
        }
        let q = match QueryTieredByHashRequest::from_json(&req.body) {
            Ok(q) => q,
            Err(e) => return Reply::Json(e.status, e.body()),
        };
        if q.partition_key() != key() {
            return Reply::Json(404, r#"{"error":"no indexer for that partition"}"#.into());
        }
        let scores = index.find_matches_tiered(&q.local_hashes());
        let resp = QueryTieredByHashResponse::from_scores(&scores, BLOCK_SIZE);
        Reply::Json(200, serde_json::to_string(&resp).unwrap())
    })
}

fn client(url: &str, connect_ms: u64, request_ms: u64) -> HttpRemoteIndex {
    HttpRemoteIndex::new(RemoteConfig {
        base_url: url.to_string(),
        connect_timeout: Duration::from_millis(connect_ms),
        request_timeout: Duration::from_millis(request_ms),
    })
    .unwrap()
}

/// Generous timeouts for the tests that expect an answer.
fn patient_client(url: &str) -> HttpRemoteIndex {
    client(url, 2_000, 5_000)
}

/// Scores with an entry in them, to check that a call empties its output.
fn non_empty_scores() -> TieredScores {
    let mut t = TieredScores::new();
    t.fill_from([TieredOverlap {
        rank: RankId::new(1, 0),
        device: 1,
        host: 0,
        disk: 0,
    }])
    .unwrap();
    t
}

fn stats(queries: u64, f: impl FnOnce(&mut RemoteStats)) -> RemoteStats {
    let mut s = RemoteStats {
        queries,
        ..Default::default()
    };
    f(&mut s);
    s
}

// ---------------------------------------------------------------------------------------
// (a) a correct server

#[test]
fn client_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<HttpRemoteIndex>();
    let _: Option<&dyn RemoteIndex> = None;
}

#[test]
fn answers_equal_the_local_index() {
    let index = Arc::new(populated_index());
    let server = index_server(index.clone(), QUERY_TIERED_BY_HASH_PATH);
    let client = patient_client(&server.url());
    let prompts: Vec<Vec<u64>> = vec![
        PROMPT.to_vec(),
        PROMPT[..1].to_vec(),
        PROMPT[..3].to_vec(),
        PROMPT[1..].to_vec(), // no rank holds block 0 of this one
        vec![1, 2, 3],
        vec![42],
        [PROMPT.as_slice(), &[7, 8, 9]].concat(),
    ];
    let mut out = non_empty_scores();
    for prompt in &prompts {
        client
            .query_tiered(&key(), BLOCK_SIZE, prompt, &mut out)
            .unwrap();
        let local = index.find_matches_tiered(prompt);
        assert_eq!(out, local, "prompt {prompt:x?}");
        assert_eq!(out.as_slice(), local.as_slice());
    }
    // Spot checks of what went over the wire.
    client
        .query_tiered(&key(), BLOCK_SIZE, &PROMPT, &mut out)
        .unwrap();
    assert_eq!(
        out.get(RankId::new(7, 0)),
        Some(TieredOverlap {
            rank: RankId::new(7, 0),
            device: 2,
            host: 1,
            disk: 2
        })
    );
    let far = out.get(RankId::new(u64::MAX - 1, 3)).unwrap();
    assert_eq!((far.device, far.host, far.disk), (0, 0, 3));
    assert_eq!(out.get(RankId::new(10, 0)).unwrap().device, 6);
    assert_eq!(out.len(), 4);

    let n = prompts.len() as u64 + 1;
    assert_eq!(client.stats(), stats(n, |s| s.ok = n));
    // One persistent connection served every query.
    assert_eq!(server.connections(), 1);
    let received = server.received();
    assert_eq!(received.len(), n as usize);
    for r in &received {
        assert_eq!(r.method, "POST");
        assert_eq!(r.path, "/query_tiered_by_hash");
        assert_eq!(r.content_type.as_deref(), Some("application/json"));
    }
    // The request is Dynamo's JSON, hashes as exact signed numbers.
    let last: serde_json::Value = serde_json::from_slice(&received[n as usize - 1].body).unwrap();
    let signed: Vec<i64> = PROMPT.iter().map(|&h| h as i64).collect();
    assert_eq!(
        last,
        serde_json::json!({
            "block_hashes": signed,
            "model_name": "llama-3-8b",
            "routing_group": "default",
        })
    );
    assert_eq!(last["block_hashes"][5].as_i64(), Some(-2));
    assert_eq!(last["block_hashes"][0].as_i64(), Some(-7046029254386353131));
}

#[test]
fn works_through_the_trait_and_a_base_path() {
    let index = Arc::new(populated_index());
    let server = index_server(index.clone(), "/kv/v1/query_tiered_by_hash");
    let client = patient_client(&format!("{}/kv/v1/", server.url()));
    assert_eq!(
        client.endpoint(),
        format!("{}/kv/v1/query_tiered_by_hash", server.url())
    );
    let remote: &dyn RemoteIndex = &client;
    let mut out = TieredScores::new();
    remote
        .query_tiered(&key(), BLOCK_SIZE, &PROMPT, &mut out)
        .unwrap();
    assert_eq!(out, index.find_matches_tiered(&PROMPT));
    assert!(!out.is_empty());
}

#[test]
fn one_client_serves_many_threads() {
    let index = Arc::new(populated_index());
    let server = index_server(index.clone(), QUERY_TIERED_BY_HASH_PATH);
    let client = Arc::new(patient_client(&server.url()));
    let threads: Vec<_> = (0..3)
        .map(|t| {
            let (client, index) = (client.clone(), index.clone());
            thread::spawn(move || {
                let mut out = TieredScores::new();
                for i in 0..20 {
                    let prompt = &PROMPT[..1 + (i + t) % PROMPT.len()];
                    client
                        .query_tiered(&key(), BLOCK_SIZE, prompt, &mut out)
                        .unwrap();
                    assert_eq!(out, index.find_matches_tiered(prompt));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(client.stats(), stats(60, |s| s.ok = 60));
    // Connections are pooled, not opened per query.
    assert!(server.connections() <= 6, "{}", server.connections());
}

#[test]
fn unknown_partition_is_a_status_and_another_block_size_refused() {
    let server = index_server(Arc::new(populated_index()), QUERY_TIERED_BY_HASH_PATH);
    let client = patient_client(&server.url());
    let mut out = non_empty_scores();
    let other = PartitionKey::new("llama-3-8b", "canary");
    assert_eq!(
        client.query_tiered(&other, BLOCK_SIZE, &PROMPT, &mut out),
        Err(RemoteError::Status(404))
    );
    assert!(out.is_empty());
    // The answer names its block size (16): a partition of 32 refuses it.
    out = non_empty_scores();
    match client.query_tiered(&key(), 32, &PROMPT, &mut out) {
        Err(RemoteError::BadBody(m)) => assert!(m.contains("block size 16"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(out.is_empty());
    // The client goes on working, on the tiered route (a 404 with an error body is not a
    // missing route).
    client
        .query_tiered(&key(), BLOCK_SIZE, &PROMPT, &mut out)
        .unwrap();
    assert_eq!(out.len(), 4);
    assert!(client.endpoint().ends_with(QUERY_TIERED_BY_HASH_PATH));
    assert_eq!(
        client.stats(),
        stats(3, |s| {
            s.status_errors = 1;
            s.bad_bodies = 1;
            s.ok = 1
        })
    );
}

#[test]
fn connections_closed_by_the_server_are_not_reused() {
    let index = Arc::new(populated_index());
    for announce in [true, false] {
        let i = index.clone();
        let server = TestServer::start(move |req| {
            let q = QueryTieredByHashRequest::from_json(&req.body).unwrap();
            let scores = i.find_matches_tiered(&q.local_hashes());
            let resp = QueryTieredByHashResponse::from_scores(&scores, BLOCK_SIZE);
            Reply::JsonThenClose(announce, serde_json::to_string(&resp).unwrap())
        });
        let client = patient_client(&server.url());
        let mut out = TieredScores::new();
        for _ in 0..3 {
            if !announce {
                // Let the unannounced close reach the client: a close racing a reuse is a
                // failed query (the client does not retry a POST), as documented.
                thread::sleep(Duration::from_millis(300));
            }
            client
                .query_tiered(&key(), BLOCK_SIZE, &PROMPT, &mut out)
                .unwrap();
            assert_eq!(out, index.find_matches_tiered(&PROMPT));
        }
        assert_eq!(server.connections(), 3, "announced close: {announce}");
        assert_eq!(client.stats(), stats(3, |s| s.ok = 3));
    }
}

// ---------------------------------------------------------------------------------------
// (b) nothing listening

#[test]
fn refused_connection_is_a_connect_error() {
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }; // closed again: nothing listens there now
    let client = client(&format!("http://{addr}"), 100, 300);
    let mut out = non_empty_scores();
    let t = Instant::now();
    let r = client.query_tiered(&key(), BLOCK_SIZE, &PROMPT, &mut out);
    let took = t.elapsed();
    assert!(matches!(r, Err(RemoteError::Connect(_))), "{r:?}");
    assert!(out.is_empty());
    assert!(took < Duration::from_millis(1_500), "{took:?}");
    assert_eq!(client.stats(), stats(1, |s| s.connect_errors = 1));
    assert!(r.unwrap_err().to_string().contains("cannot connect"));
}

// ---------------------------------------------------------------------------------------
// (c), (e) timeouts

const REQUEST_TIMEOUT: Duration = Duration::from_millis(300);

/// Runs one query of a client with 100 ms / 300 ms timeouts; expects a timeout within
/// 5 × the request timeout (and not long before the request timeout).
fn expect_timeout(server: &TestServer) {
    let client = client(&server.url(), 100, REQUEST_TIMEOUT.as_millis() as u64);
    let mut out = non_empty_scores();
    let t = Instant::now();
    let r = client.query_tiered(&key(), BLOCK_SIZE, &PROMPT, &mut out);
    let took = t.elapsed();
    assert_eq!(r, Err(RemoteError::Timeout));
    assert!(out.is_empty());
    assert!(took < 5 * REQUEST_TIMEOUT, "took {took:?}");
    assert!(took >= REQUEST_TIMEOUT / 2, "took {took:?}");
    assert_eq!(client.stats(), stats(1, |s| s.timeouts = 1));
    assert_eq!(server.received().len(), 1);
}

#[test]
fn a_server_that_never_answers_times_out() {
    let server = TestServer::start(|_| Reply::Hang);
    expect_timeout(&server);
}

#[test]
fn an_answer_after_the_timeout_is_a_timeout() {
    let index = Arc::new(populated_index());
    let server = TestServer::start(move |_| {
        let resp =
            QueryTieredByHashResponse::from_scores(&index.find_matches_tiered(&PROMPT), BLOCK_SIZE);
        let body = serde_json::to_string(&resp).unwrap();
        Reply::Delay(2 * REQUEST_TIMEOUT, Box::new(Reply::Json(200, body)))
    });
    expect_timeout(&server);
}

#[test]
fn a_body_stalled_past_the_timeout_is_a_timeout() {
    let index = Arc::new(populated_index());
    let server = TestServer::start(move |_| {
        let resp =
            QueryTieredByHashResponse::from_scores(&index.find_matches_tiered(&PROMPT), BLOCK_SIZE);
        let body = serde_json::to_string(&resp).unwrap();
        Reply::SlowBody(2 * REQUEST_TIMEOUT, body)
    });
    expect_timeout(&server);
}

// ---------------------------------------------------------------------------------------
// (d) garbage

/// A tiered answer of rank 3/0 with these blocks per tier.
fn rank_json(device: u32, host: u32, disk: u32) -> String {
    let mut t = TieredScores::new();
    t.fill_from([TieredOverlap {
        rank: RankId::new(3, 0),
        device,
        host,
        disk,
    }])
    .unwrap();
    serde_json::to_string(&QueryTieredByHashResponse::from_scores(&t, BLOCK_SIZE)).unwrap()
}

#[test]
fn bad_answers_are_refused_and_counted() {
    // The first hash of the query picks the server's misbehaviour.
    let server = TestServer::start(|req| {
        let q = QueryTieredByHashRequest::from_json(&req.body).unwrap();
        let r = r#"{"worker_id":3,"dp_rank":0}"#;
        let device = |scores: String| {
            format!(
                r#"{{"block_size":16,"tiered":{{"device":{{"scores":[{scores}],"frequencies":[]}}}}}}"#
            )
        };
        match q.block_hashes[0] {
            1 => Reply::Json(200, "hello, this is not JSON".into()),
            2 => Reply::Json(200, r#"{"ranks":5}"#.into()),
            3 => Reply::Json(200, r#"[{"worker_id":3,"dp_rank":0}]"#.into()),
            4 => Reply::Json(200, String::new()),
            // `block_size` missing.
            5 => Reply::Json(200, r#"{"tiered":{"device":{"scores":[]}}}"#.into()),
            6 => Reply::Json(500, r#"{"error":"boom"}"#.into()),
            7 => Reply::Json(200, device(format!("[{r},1],[{r},1]"))),
            // The query has 3 blocks.
            8 => Reply::Json(200, rank_json(4, 0, 0)),
            9 => Reply::Json(200, rank_json(1, 1, 2)),
            10 => Reply::Raw(b"this is not HTTP at all\r\n\r\n"),
            11 => Reply::Json(200, rank_json(1, 0, 2)),
            _ => Reply::Json(404, r#"{"error":"no indexer"}"#.into()),
        }
    });
    let client = patient_client(&server.url());
    let mut out = TieredScores::new();
    let mut query = |first: u64| {
        out = non_empty_scores();
        let r = client.query_tiered(&key(), BLOCK_SIZE, &[first, 20, 30], &mut out);
        if r.is_err() {
            assert!(out.is_empty(), "query {first}: output left non-empty");
        }
        r
    };
    let bad_body = |r: Result<(), RemoteError>, what: &str| match r {
        Err(RemoteError::BadBody(m)) => assert!(m.contains(what), "{m:?} lacks {what:?}"),
        other => panic!("expected BadBody({what}), got {other:?}"),
    };
    bad_body(query(1), "not a tiered answer");
    bad_body(query(2), "not a tiered answer");
    bad_body(query(3), "not a tiered answer");
    bad_body(query(4), "not a tiered answer");
    bad_body(query(5), "not a tiered answer");
    assert_eq!(query(6), Err(RemoteError::Status(500)));
    bad_body(query(7), "3/0 listed twice in device");
    bad_body(query(8), "3-block query");
    bad_body(query(9), "3-block query");
    let r = query(10);
    assert!(matches!(r, Err(RemoteError::Other(_))), "{r:?}");
    assert_eq!(query(12), Err(RemoteError::Status(404)));
    // After all that, a valid answer still comes through (exactly as many blocks as asked).
    query(11).unwrap();
    assert_eq!(
        out.as_slice(),
        &[TieredOverlap {
            rank: RankId::new(3, 0),
            device: 1,
            host: 0,
            disk: 2,
        }]
    );
    assert_eq!(
        client.stats(),
        RemoteStats {
            queries: 12,
            ok: 1,
            connect_errors: 0,
            timeouts: 0,
            status_errors: 2,
            bad_bodies: 8,
            other_errors: 1,
        }
    );
}

// ---------------------------------------------------------------------------------------
// (f) invalid URLs

#[test]
fn invalid_urls_are_refused_at_construction() {
    for url in [
        "https://127.0.0.1:8443",
        "https://index.svc",
        "http://",
        "http://:8080",
        "http:///query",
        "127.0.0.1:8080",
        "garbage",
        "not a url at all",
        "",
        "ftp://127.0.0.1",
        "http://127.0.0.1:0",
        "http://127.0.0.1:70000",
        "http://127.0.0.1:8080/?x=1",
        "http://user:secret@127.0.0.1:8080",
    ] {
        match HttpRemoteIndex::new(RemoteConfig::new(url)) {
            Err(RemoteError::InvalidUrl(m)) => assert!(!m.is_empty()),
            other => panic!("{url:?}: expected InvalidUrl, got {other:?}"),
        }
    }
    let e = HttpRemoteIndex::new(RemoteConfig::new("https://index")).unwrap_err();
    assert!(e.to_string().contains("https is not supported"), "{e}");
    // The defaults.
    let cfg = RemoteConfig::new("http://127.0.0.1:1");
    assert_eq!(cfg.connect_timeout, Duration::from_millis(50));
    assert_eq!(cfg.request_timeout, Duration::from_millis(200));
    assert!(HttpRemoteIndex::new(cfg).is_ok());
}

// ---------------------------------------------------------------------------------------
// (g) empty prompt

#[test]
fn an_empty_prompt_sends_nothing() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let client = patient_client(&format!("http://{}", listener.local_addr().unwrap()));
    let mut out = non_empty_scores();
    client
        .query_tiered(&key(), BLOCK_SIZE, &[], &mut out)
        .unwrap();
    assert!(out.is_empty());
    assert_eq!(client.stats(), RemoteStats::default());
    // Nobody connected.
    thread::sleep(Duration::from_millis(50));
    match listener.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("expected no connection, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// A test fake through the trait (what the selection will be tested with).

/// Answers every query with this tiered JSON.
struct Fake(&'static str);

impl RemoteIndex for Fake {
    fn query_tiered(
        &self,
        _key: &PartitionKey,
        block_size: u32,
        local_hashes: &[u64],
        out: &mut TieredScores,
    ) -> Result<(), RemoteError> {
        let answer: QueryTieredByHashResponse = serde_json::from_str(self.0).unwrap();
        answer.to_scores(block_size, local_hashes.len(), out)
    }
}

#[test]
fn a_fake_serves_through_the_trait() {
    let fake = Fake(
        r#"{"block_size":16,"tiered":{"device":{"scores":[[{"worker_id":5,"dp_rank":0},2]],"frequencies":[]},"lower_tier":[]}}"#,
    );
    let remote: &dyn RemoteIndex = &fake;
    let mut out = TieredScores::new();
    remote.query_tiered(&key(), 16, &[1, 2], &mut out).unwrap();
    assert_eq!(out.get(RankId::new(5, 0)).unwrap().device, 2);
    assert!(matches!(
        remote.query_tiered(&key(), 16, &[1], &mut out),
        Err(RemoteError::BadBody(_))
    ));
}
