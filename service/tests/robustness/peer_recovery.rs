//! `kvr serve --indexer-peers` against peers whose `/dump` is garbage, truncated, refused
//! or valid: a bad dump is refused whole (nothing of it applied), counted in
//! `kvr_recovery_failures_total`, and the next peer is tried; with no usable peer the
//! service starts empty and still becomes ready; a valid dump after bad ones is applied
//! (its blocks score in `/overlap_scores` without any event). Selections are answered
//! throughout.

use super::*;

/// A one-route HTTP server answering every request with `status` and `body` (a peer).
fn peer(status: u16, body: Vec<u8>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            let head = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(&body);
        }
    });
    format!("http://{addr}")
}

/// A dump of one partition `m:default` (block size 16): worker 1 rank 0 holds a 2-block
/// chain on the device tier.
fn valid_dump(local: &[u64]) -> Vec<u8> {
    json!({"m:default": {"block_size": 16, "events": [
        {"worker_id": 1, "storage_tier": "device", "residency_domain": "worker",
         "event": {"event_id": 0, "dp_rank": 0, "data": {"stored": {
            "parent_hash": null, "start_position": null, "blocks": [
                {"block_hash": 1001, "tokens_hash": local[0], "mm_extra_info": null},
                {"block_hash": 1002, "tokens_hash": local[1], "mm_extra_info": null}]}}}}]}})
    .to_string()
    .into_bytes()
}

fn metric(c: &mut Client, name: &str) -> u64 {
    let r = c.get("/metrics");
    let text = String::from_utf8_lossy(&r.body).to_string();
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

fn register_worker(c: &mut Client) {
    let r = c.post_json(
        "POST",
        "/workers",
        &json!({"worker_id": 1, "model_name": "m", "endpoint": "http://w1",
                "kv_events_endpoint": "tcp://127.0.0.1:9", "block_size": 16}),
    );
    assert_eq!(r.status, 201);
}

fn device_blocks(c: &mut Client, toks: &[u32]) -> u64 {
    let r = c.post_json(
        "POST",
        "/overlap_scores",
        &json!({"model_name": "m", "token_ids": toks}),
    );
    assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
    r.json()["workers"][0]["device_blocks"].as_u64().unwrap()
}

fn wait_ready(c: &mut Client) {
    assert!(
        wait_until(Duration::from_secs(20), || c.get("/ready").status == 200),
        "the service never became ready"
    );
}

/// A server started with `--indexer-peers` set to `peers`, its worker registered, once
/// ready (recovery over).
fn recovered_from(peers: &[String]) -> (Server, Client) {
    let server = Server::start_with(&["--indexer-peers", &peers.join(",")]);
    let mut c = server.client();
    register_worker(&mut c);
    wait_ready(&mut c);
    (server, c)
}

fn prompt() -> (Vec<u32>, Vec<u64>) {
    let toks: Vec<u32> = (0..40).collect();
    let mut local = Vec::new();
    kvr::hash::BlockHasher::new(16, kvr::hash::HashSalt::new(None, None))
        .unwrap()
        .local_hashes(&toks, &mut local);
    (toks, local)
}

#[test]
fn bad_peer_dumps_are_refused_counted_and_the_service_starts_empty() {
    let (toks, local) = prompt();
    let mut truncated = valid_dump(&local);
    truncated.truncate(truncated.len() / 2);
    let peers = [
        peer(200, b"\x00\xffnot json at all".to_vec()),
        peer(200, truncated),
        peer(200, br#"{"m:default": {"block_size": 16, "events": [{"worker_id": 1, "storage_tier": "tape", "event": {"event_id": 0, "data": {"stored": {"blocks": []}}}}]}}"#.to_vec()),
        peer(500, b"{}".to_vec()),
        "http://127.0.0.1:9".to_string(),
    ];
    let (_server, mut c) = recovered_from(&peers);
    assert_eq!(metric(&mut c, "kvr_recovery_attempts"), 5);
    assert_eq!(metric(&mut c, "kvr_recovery_failures"), 5);
    assert_eq!(metric(&mut c, "kvr_recovery_events"), 0);
    assert_eq!(
        device_blocks(&mut c, &toks),
        0,
        "nothing of a bad dump is applied"
    );
    let r = c.post_json(
        "POST",
        "/select",
        &json!({"model_name": "m", "token_ids": toks}),
    );
    assert_eq!(r.status, 200);
}

#[test]
fn a_valid_dump_after_bad_ones_is_applied() {
    let (toks, local) = prompt();
    let peers = [peer(200, b"[1, 2".to_vec()), peer(200, valid_dump(&local))];
    let (_server, mut c) = recovered_from(&peers);
    assert_eq!(metric(&mut c, "kvr_recovery_failures"), 1);
    assert_eq!(metric(&mut c, "kvr_recovery_events"), 1);
    // Credited once the worker's stream has started (a recovered rank gets no overlap
    // credit before: its stream could replay history older than the dump).
    wait_until(Duration::from_secs(5), || device_blocks(&mut c, &toks) == 2);
    assert_eq!(
        device_blocks(&mut c, &toks),
        2,
        "the dump's chain scores without events"
    );
    // And the service's own dump carries it on (a peer of a peer).
    let d = c.get("/dump").json();
    let blocks = &d["m:default"]["events"][0]["event"]["data"]["stored"]["blocks"];
    assert_eq!(blocks.as_array().map(Vec::len), Some(2), "{d}");
}
