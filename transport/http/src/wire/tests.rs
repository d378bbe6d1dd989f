//! The wire types against the JSON Dynamo writes and reads (shapes probed on Dynamo
//! 1.6.1's indexer, REFERENCE §7 for the tiered answer).

use kvr::PartitionKey;
use kvr::{Index, RemoteError, TieredOverlap, TieredScores};
use kvr::{KvEvent, RankId, StoredBlock, Tier};

use super::by_hash::QueryByHashResponse;
use super::tiered::{QueryTieredByHashRequest, QueryTieredByHashResponse};
use crate::client::{endpoint_of, RequestRef};

fn store(index: &Index, rank: RankId, tier: Tier, parent: Option<u64>, blocks: &[(u64, u64)]) {
    let blocks: Vec<StoredBlock> = blocks
        .iter()
        .map(|&(external_hash, local_hash)| StoredBlock {
            external_hash,
            local_hash,
        })
        .collect();
    let ev = KvEvent::Stored {
        tier,
        parent,
        blocks: &blocks,
    };
    index.apply(rank, &ev).unwrap();
}

/// Ranks with device, host and disk blocks of the prompt [1, 2, 3, 4, 5].
fn populated() -> Index {
    let index = Index::new();
    let a = RankId::new(7, 0);
    let b = RankId::new(u64::MAX - 1, 3);
    let c = RankId::new(9, 1);
    store(&index, a, Tier::Device, None, &[(100, 1), (101, 2)]);
    store(&index, a, Tier::Host, Some(101), &[(102, 3)]);
    store(&index, a, Tier::Disk, Some(102), &[(103, 4), (104, 5)]);
    store(&index, b, Tier::Disk, None, &[(200, 1), (201, 2), (202, 3)]);
    store(&index, c, Tier::Device, None, &[(300, 1)]);
    index
}

fn overlap(worker: u64, dp: u32, device: u32, host: u32, disk: u32) -> TieredOverlap {
    TieredOverlap {
        rank: RankId::new(worker, dp),
        device,
        host,
        disk,
    }
}

fn tiered(json: &str) -> QueryTieredByHashResponse {
    serde_json::from_str(json).unwrap()
}

fn bad_body(r: Result<(), RemoteError>, what: &str) {
    match r {
        Err(RemoteError::BadBody(m)) => assert!(m.contains(what), "{m:?} lacks {what:?}"),
        other => panic!("expected BadBody({what}), got {other:?}"),
    }
}

#[test]
fn hashes_travel_as_signed_i64() {
    let big = 11400714819323198485u64; // 0x9E37..., above i64::MAX
    assert_eq!(super::hash_to_wire(big), -7046029254386353131);
    assert_eq!(super::hash_from_wire(-7046029254386353131), big);
    assert_eq!(super::hash_to_wire(u64::MAX), -1);
    assert_eq!(super::hash_to_wire(42), 42);
    let req = QueryTieredByHashRequest::new(&PartitionKey::new("m", "g"), &[big, 42, u64::MAX]);
    assert_eq!(req.block_hashes, vec![-7046029254386353131, 42, -1]);
    assert_eq!(req.local_hashes(), vec![big, 42, u64::MAX]);
}

#[test]
fn request_json_is_dynamos_shape() {
    let key = PartitionKey::new("llama", "default");
    let hashes = [11400714819323198485, 42];
    let req = QueryTieredByHashRequest::new(&key, &hashes);
    let json = serde_json::to_string(&req).unwrap();
    assert_eq!(
        json,
        r#"{"block_hashes":[-7046029254386353131,42],"model_name":"llama","routing_group":"default"}"#
    );
    // The client's borrowed form writes the same bytes.
    let borrowed = serde_json::to_string(&RequestRef {
        block_hashes: &hashes,
        model_name: &key.model,
        routing_group: &key.routing_group,
    })
    .unwrap();
    assert_eq!(borrowed, json);
    let back = QueryTieredByHashRequest::from_json(json.as_bytes()).unwrap();
    assert_eq!(back, req);
    assert_eq!(back.partition_key(), key);
}

#[test]
fn request_parsing_is_dynamos() {
    let ok = QueryTieredByHashRequest::from_json(
        br#"{"block_hashes":[-1,5],"model_name":"m","later":{"x":1},"block_size":16}"#,
    )
    .unwrap();
    assert_eq!(ok.partition_key(), PartitionKey::new("m", "default"));
    assert_eq!(ok.local_hashes(), vec![u64::MAX, 5]);
    // A null cache_salt is absent; a string is refused with 400, as Dynamo does.
    let null = br#"{"block_hashes":[],"model_name":"m","cache_salt":null}"#;
    assert!(QueryTieredByHashRequest::from_json(null).is_ok());
    let salted = br#"{"block_hashes":[1],"model_name":"m","cache_salt":"s"}"#;
    let e = QueryTieredByHashRequest::from_json(salted).unwrap_err();
    assert_eq!(e.status, 400);
    assert!(e.message.contains("cache_salt"), "{e:?}");
    assert!(
        e.body().starts_with(r#"{"error":"cache_salt"#),
        "{}",
        e.body()
    );
    // Not JSON: 400; the wrong shape or types: 422.
    let e = QueryTieredByHashRequest::from_json(b"nope").unwrap_err();
    assert_eq!(e.status, 400);
    for bad in [
        r#"{"block_hashes":[18446744073709551615],"model_name":"m"}"#,
        r#"{"block_hashes":["1"],"model_name":"m"}"#,
        r#"{"block_hashes":[1.5],"model_name":"m"}"#,
        r#"{"block_hashes":[1]}"#,
        r#"{"block_hashes":[1],"model_name":7}"#,
        r#"{"model_name":"m"}"#,
        r#"[]"#,
    ] {
        let e = QueryTieredByHashRequest::from_json(bad.as_bytes()).unwrap_err();
        assert_eq!(e.status, 422, "{bad}: {e:?}");
    }
}

#[test]
fn from_scores_writes_dynamos_json() {
    let mut scores = TieredScores::new();
    scores
        .fill_from([overlap(1, 0, 3, 2, 0), overlap(2, 1, 0, 0, 4)])
        .unwrap();
    let resp = QueryTieredByHashResponse::from_scores(&scores, 16);
    assert_eq!(
        serde_json::to_string(&resp).unwrap(),
        concat!(
            r#"{"block_size":16,"tiered":{"device":{"scores":[[{"worker_id":1,"dp_rank":0},3]],"#,
            r#""frequencies":[]},"lower_tier":[["host_pinned",{"hits":[[{"worker_id":1,"dp_rank":0},2]]}],"#,
            r#"["disk",{"hits":[[{"worker_id":2,"dp_rank":1},4]]}]]}}"#
        )
    );
    let empty = QueryTieredByHashResponse::from_scores(&TieredScores::new(), 4);
    assert_eq!(
        serde_json::to_string(&empty).unwrap(),
        r#"{"block_size":4,"tiered":{"device":{"scores":[],"frequencies":[]},"lower_tier":[["host_pinned",{"hits":[]}],["disk",{"hits":[]}]]}}"#
    );
}

#[test]
fn scores_round_trip_through_a_response() {
    let index = populated();
    let prompt = [1, 2, 3, 4, 5, 6];
    let local = index.find_matches_tiered(&prompt);
    assert_eq!(local.len(), 3);
    assert_eq!(local.get(RankId::new(7, 0)), Some(overlap(7, 0, 2, 1, 2)));
    let mut resp = QueryTieredByHashResponse::from_scores(&local, 16);
    // The order on the wire is free: the client sorts.
    resp.tiered.device.scores.reverse();
    let json = serde_json::to_string(&resp).unwrap();
    let mut back = TieredScores::new();
    tiered(&json)
        .to_scores(16, prompt.len(), &mut back)
        .unwrap();
    assert_eq!(back, local);
    // Exactly as many blocks as the counts is fine.
    resp.to_scores(16, 5, &mut back).unwrap();
    assert_eq!(back, local);
}

/// The lower tiers' hits are further blocks after the previous tier's match, not a count
/// from the first block: device 3 then host 2 is 3 + 2 blocks.
#[test]
fn lower_tier_hits_extend_the_previous_tier() {
    let resp = tiered(
        r#"{"block_size":16,"tiered":{"device":{"scores":[[{"worker_id":1,"dp_rank":0},3]],"frequencies":[]},
            "lower_tier":[["host_pinned",{"hits":[[{"worker_id":1,"dp_rank":0},2],[{"worker_id":3,"dp_rank":0},2]]}],
                          ["disk",{"hits":[[{"worker_id":1,"dp_rank":0},1],[{"worker_id":3,"dp_rank":0},1]]}],
                          ["external",{"hits":[[{"worker_id":1,"dp_rank":0},9],[{"worker_id":4,"dp_rank":0},6]]}]]},
            "later":true}"#,
    );
    let mut out = TieredScores::new();
    resp.to_scores(16, 6, &mut out).unwrap();
    // `external` is ignored: rank 4 holds nothing kvr scores, rank 1 keeps 3 + 2 + 1.
    assert_eq!(
        out.as_slice(),
        &[overlap(1, 0, 3, 2, 1), overlap(3, 0, 0, 2, 1)]
    );
    // No lower tiers at all (an indexer that saw no lower-tier event), no frequencies.
    let device_only = tiered(
        r#"{"block_size":16,"tiered":{"device":{"scores":[[{"worker_id":5,"dp_rank":2},1]]}}}"#,
    );
    device_only.to_scores(16, 1, &mut out).unwrap();
    assert_eq!(out.as_slice(), &[overlap(5, 2, 1, 0, 0)]);
}

#[test]
fn bad_tiered_answers_are_refused() {
    let r = r#"{"worker_id":3,"dp_rank":0}"#;
    let mut out = populated().find_matches_tiered(&[1]);
    let mut check = |json: String, what: &str| {
        out.fill_from([overlap(1, 0, 1, 0, 0)]).unwrap();
        bad_body(tiered(&json).to_scores(16, 3, &mut out), what);
        assert!(out.is_empty(), "{json}");
    };
    let dev = |scores: &str, lower: &str| {
        format!(
            r#"{{"block_size":16,"tiered":{{"device":{{"scores":[{scores}],"frequencies":[]}},"lower_tier":[{lower}]}}}}"#
        )
    };
    check(
        dev(&format!("[{r},1]"), "").replace(":16,", ":32,"),
        "block size 32",
    );
    check(
        dev(&format!("[{r},1],[{r},1]"), ""),
        "3/0 listed twice in device",
    );
    check(
        dev("", &format!(r#"["disk",{{"hits":[[{r},1],[{r},0]]}}]"#)),
        "3/0 listed twice in disk",
    );
    check(
        dev("", r#"["disk",{"hits":[]}],["host_pinned",{"hits":[]}]"#),
        "out of order",
    );
    check(
        dev(
            "",
            r#"["host_pinned",{"hits":[]}],["host_pinned",{"hits":[]}]"#,
        ),
        "listed twice or out of order",
    );
    // The query has 3 blocks.
    check(dev(&format!("[{r},4]"), ""), "3-block query");
    check(
        dev(
            &format!("[{r},1]"),
            &format!(r#"["host_pinned",{{"hits":[[{r},1]]}}],["disk",{{"hits":[[{r},2]]}}]"#),
        ),
        "3-block query",
    );
    // Shapes serde refuses (the client reports them as BadBody too).
    for bad in [
        r#"{"tiered":{"device":{"scores":[]}}}"#,
        r#"{"block_size":16,"tiered":{"device":{"scores":[[{"worker_id":1,"dp_rank":0},-1]]}}}"#,
        r#"{"block_size":16,"tiered":{"device":{"scores":[[{"worker_id":"1","dp_rank":0},1]]}}}"#,
        r#"{"block_size":16,"tiered":{"device":{"scores":[]},"lower_tier":[["tape",{"hits":[]}]]}}"#,
        r#"{"ranks":[]}"#,
    ] {
        assert!(
            serde_json::from_str::<QueryTieredByHashResponse>(bad).is_err(),
            "{bad}"
        );
    }
}

/// The answer Dynamo 1.6.1's `/query_by_hash` gave for events of three single-rank
/// workers and one with two DP ranks (probed).
#[test]
fn query_by_hash_answers_convert() {
    let json = r#"{"scores":{"1":{"0":48},"2":{"0":32},"4":{"0":16,"1":32}},"frequencies":[],
        "instances":{"1":{"longest_matched":96,"gpu":48,"dp":{"0":48},"cpu":80,"disk":96},
                     "2":{"longest_matched":80,"gpu":32,"dp":{"0":32},"cpu":64,"disk":80},
                     "3":{"longest_matched":48,"gpu":0,"dp":{"0":0},"cpu":32,"disk":48},
                     "4":{"longest_matched":80,"gpu":32,"dp":{"1":32,"0":16},"cpu":80,"disk":80}}}"#;
    let resp: QueryByHashResponse = serde_json::from_str(json).unwrap();
    let mut out = TieredScores::new();
    resp.to_scores(16, 6, &mut out).unwrap();
    assert_eq!(
        out.as_slice(),
        &[
            overlap(1, 0, 3, 2, 1),
            overlap(2, 0, 2, 2, 1),
            overlap(3, 0, 0, 2, 1),
            // Two ranks: the worker's host blocks belong to one of them, which one is
            // not said, so only the device counts are kept.
            overlap(4, 0, 1, 0, 0),
            overlap(4, 1, 2, 0, 0),
        ]
    );
    let empty: QueryByHashResponse =
        serde_json::from_str(r#"{"scores":{},"frequencies":[],"instances":{}}"#).unwrap();
    empty.to_scores(16, 6, &mut out).unwrap();
    assert!(out.is_empty());
}

#[test]
fn bad_query_by_hash_answers_are_refused() {
    let mut out = TieredScores::new();
    let mut check = |json: &str, what: &str| {
        out.fill_from([overlap(1, 0, 1, 0, 0)]).unwrap();
        let resp: QueryByHashResponse = serde_json::from_str(json).unwrap();
        bad_body(resp.to_scores(16, 3, &mut out), what);
        assert!(out.is_empty(), "{json}");
    };
    check(
        r#"{"scores":{"1":{"0":24}}}"#,
        "not a whole number of 16-token blocks",
    );
    let inst = |gpu: u64, cpu: u64, disk: u64| {
        format!(
            r#"{{"scores":{{"1":{{"0":{gpu}}}}},"instances":{{"1":{{"gpu":{gpu},"dp":{{"0":{gpu}}},"cpu":{cpu},"disk":{disk}}}}}}}"#
        )
    };
    check(&inst(32, 16, 48), "not cumulative");
    check(&inst(16, 32, 24), "not cumulative");
    check(&inst(16, 40, 48), "not a whole number");
    check(&inst(16, 48, 64), "3-block query");
    check(r#"{"scores":{"1":{"0":64}}}"#, "3-block query");
    for bad in [
        r#"{"scores":{"x":{"0":16}}}"#,
        r#"{"scores":{"1":{"0":-16}}}"#,
        r#"{"instances":{}}"#,
    ] {
        assert!(
            serde_json::from_str::<QueryByHashResponse>(bad).is_err(),
            "{bad}"
        );
    }
}

#[test]
fn endpoints() {
    for (base, want) in [
        (
            "http://127.0.0.1:8080",
            "http://127.0.0.1:8080/query_tiered_by_hash",
        ),
        (
            "http://127.0.0.1:8080/",
            "http://127.0.0.1:8080/query_tiered_by_hash",
        ),
        (
            "HTTP://index.svc:80/kv/",
            "http://index.svc:80/kv/query_tiered_by_hash",
        ),
        ("http://index", "http://index/query_tiered_by_hash"),
        (
            "http://[::1]:9000",
            "http://[::1]:9000/query_tiered_by_hash",
        ),
        (" http://h:1 ", "http://h:1/query_tiered_by_hash"),
    ] {
        assert_eq!(endpoint_of(base).unwrap().to_string(), want, "{base}");
    }
}

#[test]
fn invalid_urls() {
    for base in [
        "",
        "   ",
        "https://index:443",
        "HTTPS://index",
        "ftp://index",
        "http://",
        "http:///path",
        "http://:8080",
        "index:8080",
        "/query",
        "garbage",
        "http://user:pw@index",
        "http://index:0",
        "http://index:99999",
        "http://index:port",
        "http://index:",
        "http://index:-1",
        "http://[::1]:65536",
        "http://index/?a=1",
        "http://in dex",
    ] {
        assert!(
            matches!(endpoint_of(base), Err(RemoteError::InvalidUrl(_))),
            "{base:?} -> {:?}",
            endpoint_of(base)
        );
    }
    let https = endpoint_of("https://index").unwrap_err().to_string();
    assert!(https.contains("https is not supported"), "{https}");
}
