//! `kvr serve` and a Python vLLM-style publisher (tests/e2e/kvpublisher.py) SIGKILLed in
//! the middle of a stream of batches: the service keeps answering every route, and a new
//! publisher on the same endpoint (seq from 0) is followed (its stores and removals reach
//! `/overlap_scores`). Skipped when python3 lacks pyzmq/msgspec, unless
//! `KVR_REQUIRE_PYZMQ=1`.
//!
//! Shown able to fail: `engine/src/ingress/sequence.rs` dropping a sequence that went back
//! as a duplicate → "store 2 4: /overlap_scores shows 0 device blocks, want 4". (Disabling
//! the transport's own reconnect-on-disconnect was *not* caught: the zeromq socket
//! reconnects by itself.)

use super::*;

// ---------------------------------------------------------------------------------------
// 3. A publisher killed mid-stream, then restarted.
// ---------------------------------------------------------------------------------------

fn device_blocks(c: &mut Client, model: &str, toks: &[u32]) -> u64 {
    let r = c.post_json(
        "POST",
        "/overlap_scores",
        &json!({"model_name": model, "token_ids": toks}),
    );
    assert_eq!(r.status, 200, "{:?}", r.error_text());
    r.json()["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["device_blocks"].as_u64().unwrap())
        .max()
        .unwrap_or(0)
}

/// Publishes `cmd` (idempotent) until `/overlap_scores` of `toks` shows `want` device
/// blocks; republishes every second (a PUB drops what it sends before the SUBSCRIBE
/// arrived). Returns how long it took.
fn publish_until(
    c: &mut Client,
    p: &mut Publisher,
    cmd: &str,
    toks: &[u32],
    want: u64,
) -> Duration {
    let t = Instant::now();
    let mut last_pub = None::<Instant>;
    loop {
        if last_pub.is_none_or(|l| l.elapsed() > Duration::from_secs(1)) {
            let a = p.cmd(cmd);
            assert!(a.starts_with("SEQ "), "{cmd}: {a}");
            last_pub = Some(Instant::now());
        }
        let got = device_blocks(c, "pk", toks);
        if got == want {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "{cmd}: /overlap_scores shows {got} device blocks, want {want}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn all_routes_answer(c: &mut Client, ctx: &str) {
    for path in ["/health", "/ready", "/workers", "/loads", "/metrics"] {
        assert_eq!(c.get(path).status, 200, "{ctx}: GET {path}");
    }
    let p = json!({"model_name": "pk", "token_ids": tokens(5, 64)});
    for path in ["/select", "/potential_loads", "/overlap_scores"] {
        let r = quick(&format!("{ctx}: POST {path}"), || {
            c.post_json("POST", path, &p)
        });
        assert_eq!(r.status, 200, "{ctx}: POST {path}: {:?}", r.error_text());
    }
    let r = c.post_json(
        "POST",
        "/select_and_reserve",
        &json!({"model_name": "pk", "selection_id": "pk-1", "token_ids": tokens(5, 64)}),
    );
    assert_eq!(
        r.status,
        200,
        "{ctx}: select_and_reserve: {:?}",
        r.error_text()
    );
    for path in [
        "/reservations/pk-1/prefill_complete",
        "/reservations/pk-1/output_block",
    ] {
        let r = c.post_json("POST", path, &json!({}));
        assert_eq!(r.status, 200, "{ctx}: POST {path}: {:?}", r.error_text());
    }
    assert_eq!(c.delete("/reservations/pk-1").status, 200, "{ctx}: free");
    let r = c.post_json("PATCH", "/workers/1", &json!({"total_kv_blocks": 1000}));
    assert_eq!(r.status, 200, "{ctx}: PATCH: {:?}", r.error_text());
    assert_eq!(r.json()["lifecycle"], "schedulable", "{ctx}");
}

#[test]
fn killed_publisher_mid_stream_then_restarted_publisher_is_followed() {
    if !python_ready() {
        return;
    }
    let server = Server::start();
    let mut c = server.client();
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut p = Publisher::start(port);
    let rec = register(
        &mut c,
        json!({"worker_id": 1, "model_name": "pk", "endpoint": "http://w1",
               "kv_events_endpoint": format!("tcp://127.0.0.1:{port}"), "block_size": 16}),
    );
    assert_eq!(rec["lifecycle"], "schedulable");
    register(
        &mut c,
        json!({"worker_id": 2, "model_name": "pk", "endpoint": "http://w2",
               "kv_events_endpoint": "tcp://127.0.0.1:1", "block_size": 16}),
    );
    assert_eq!(p.cmd("peer 10"), "PEER 1", "the service never connected");
    let p1 = tokens(1, 64);
    let took = publish_until(&mut c, &mut p, "store 1 4", &p1, 4);
    eprintln!("first publisher's stores indexed after {took:?}");

    // A stream of batches, killed in the middle.
    writeln!(p.stdin, "stream").unwrap();
    p.stdin.flush().unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || *p.streamed.lock().unwrap()
            >= 300),
        "the publisher did not stream"
    );
    // Selections are served while the stream runs...
    for i in 0..20 {
        let r = quick(&format!("select during the stream #{i}"), || {
            c.post_json(
                "POST",
                "/select",
                &json!({"model_name": "pk", "token_ids": p1}),
            )
        });
        assert_eq!(r.status, 200, "{:?}", r.error_text());
    }
    p.child.kill().unwrap(); // SIGKILL
    let status = p.child.wait().unwrap();
    let streamed = *p.streamed.lock().unwrap();
    eprintln!("publisher killed ({status}) after streaming at least {streamed} batches");
    drop(p);

    // ... and after the kill.
    for i in 0..5 {
        all_routes_answer(&mut c, &format!("after the kill #{i}"));
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = c.post_json(
        "POST",
        "/select",
        &json!({"model_name": "pk", "token_ids": p1}),
    );
    assert_eq!(r.status, 200);
    eprintln!(
        "after the kill: P1 device blocks {} (chosen worker {})",
        device_blocks(&mut c, "pk", &p1),
        r.json()["worker_id"]
    );

    // A restart: a new publisher on the same endpoint, seq from 0.
    let mut p = Publisher::start(port);
    assert_eq!(p.cmd("peer 10"), "PEER 1", "the service never reconnected");
    let p2 = tokens(2, 64);
    let took = publish_until(&mut c, &mut p, "store 2 4", &p2, 4);
    eprintln!(
        "restarted publisher's stores indexed after {took:?}; the first one's P1 now shows {} device blocks",
        device_blocks(&mut c, "pk", &p1)
    );
    let r = c.post_json(
        "POST",
        "/select",
        &json!({"model_name": "pk", "token_ids": p2}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["worker_id"], 1, "P2 is cached on worker 1 only");
    assert_eq!(r.json()["overlap"]["gpu"], 64, "{}", r.json());
    // Its removals are followed too.
    let took = publish_until(&mut c, &mut p, "remove 2 4", &p2, 0);
    eprintln!("restarted publisher's removals indexed after {took:?}");
    let p3 = tokens(3, 32);
    publish_until(&mut c, &mut p, "store 3 2", &p3, 2);
    all_routes_answer(&mut c, "after the restart");
}
