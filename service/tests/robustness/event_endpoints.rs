//! `kvr serve` with a worker whose KV-event endpoint accepts TCP and never speaks, and one
//! whose port nobody listens on: 201 and schedulable, selections keep answering (each
//! under 1 s), DELETE answers under 1 s and its subscription stops (connections closed,
//! no reconnect).
//!
//! Shown able to fail: `registry.rs::retire` leaking the subscriptions (`mem::forget`) →
//! "reconnected to the silent endpoint after DELETE".

use super::*;

// ---------------------------------------------------------------------------------------
// 2. KV-event endpoints that never answer.
// ---------------------------------------------------------------------------------------

/// A TCP port that accepts connections and never sends a byte; it records how many
/// connections it accepted and how many of them the peer has closed.
struct SilentPeer {
    port: u16,
    accepted: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl SilentPeer {
    fn start() -> Self {
        Self::on(TcpListener::bind("127.0.0.1:0").unwrap())
    }

    fn on(l: TcpListener) -> Self {
        let port = l.local_addr().unwrap().port();
        l.set_nonblocking(true).unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let open = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, o, s) = (accepted.clone(), open.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut conns: Vec<Option<TcpStream>> = Vec::new();
            while !s.load(Ordering::Relaxed) {
                if let Ok((c, _)) = l.accept() {
                    c.set_nonblocking(true).unwrap();
                    conns.push(Some(c));
                    a.fetch_add(1, Ordering::Relaxed);
                }
                // Read (and drop) whatever the peer sends; EOF or reset = closed.
                for slot in &mut conns {
                    if let Some(c) = slot {
                        let mut buf = [0u8; 4096];
                        match c.read(&mut buf) {
                            Ok(0) => *slot = None,
                            Ok(_) => {}
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                            Err(_) => *slot = None,
                        }
                    }
                }
                o.store(conns.iter().flatten().count(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        SilentPeer {
            port,
            accepted,
            open,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for SilentPeer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn silent_and_dead_kv_event_endpoints_do_not_stall_the_service() {
    let server = Server::start();
    let mut c = server.client();
    let silent = SilentPeer::start();
    let dead_port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    for (id, port) in [(11u64, silent.port), (12, dead_port)] {
        let rec = quick(&format!("register worker {id}"), || {
            register(
                &mut c,
                json!({"worker_id": id, "model_name": "silent", "endpoint": format!("http://w{id}"),
                       "kv_events_endpoint": format!("tcp://127.0.0.1:{port}"), "block_size": 16}),
            )
        });
        assert_eq!(rec["lifecycle"], "schedulable", "{rec}");
    }
    // The subscriber did reach the silent peer (and is now stuck in its handshake).
    assert!(
        wait_until(Duration::from_secs(5), || silent
            .accepted
            .load(Ordering::Relaxed)
            > 0),
        "the service never connected to the silent KV-event endpoint"
    );
    let ready = c.get("/ready");
    assert_eq!(ready.status, 200);
    assert_eq!(ready.json()["schedulable_workers"], 2);

    let started = Instant::now();
    for i in 0..60u32 {
        let id = 11 + u64::from(i % 2);
        let body = match i % 3 {
            0 => {
                json!({"model_name": "silent", "token_ids": tokens(i, 48), "pinned_worker": {"worker_id": id, "dp_rank": 0}})
            }
            1 => {
                json!({"model_name": "silent", "token_ids": tokens(i, 48), "allowed_worker_ids": [id]})
            }
            _ => json!({"model_name": "silent", "token_ids": tokens(i, 48)}),
        };
        let r = quick(&format!("select #{i}"), || {
            c.post_json("POST", "/select", &body)
        });
        assert_eq!(r.status, 200, "select #{i}: {:?}", r.error_text());
        if i % 3 != 2 {
            assert_eq!(r.json()["worker_id"], id, "select #{i}");
        }
    }
    let r = quick("select_and_reserve", || {
        c.post_json(
            "POST",
            "/select_and_reserve",
            &json!({"model_name": "silent", "selection_id": "s-1", "token_ids": tokens(3, 48)}),
        )
    });
    assert_eq!(r.status, 200, "{:?}", r.error_text());
    let o = quick("overlap_scores", || {
        c.post_json(
            "POST",
            "/overlap_scores",
            &json!({"model_name": "silent", "token_ids": tokens(3, 48)}),
        )
    });
    assert_eq!(o.status, 200);
    assert_eq!(
        o.json()["workers"].as_array().unwrap().len(),
        2,
        "{}",
        o.json()
    );
    assert_eq!(c.delete("/reservations/s-1").status, 200);
    eprintln!(
        "60 selections against silent/dead KV endpoints in {:?}",
        started.elapsed()
    );

    // DELETE answers promptly, and the subscriptions stop.
    for id in [11u64, 12] {
        let r = quick(&format!("DELETE /workers/{id}"), || {
            c.delete(&format!("/workers/{id}"))
        });
        assert_eq!(r.status, 200, "{:?}", r.error_text());
        assert_eq!(r.json()["lifecycle"], "unschedulable");
    }
    assert!(
        wait_until(Duration::from_secs(3), || silent
            .open
            .load(Ordering::Relaxed)
            == 0),
        "the silent endpoint's connection stayed open after DELETE ({} open)",
        silent.open.load(Ordering::Relaxed)
    );
    let accepted = silent.accepted.load(Ordering::Relaxed);
    // Someone listening on the dead port now would be connected to within the
    // subscriber's 500 ms reconnect interval if it were still running.
    let late = SilentPeer::on(TcpListener::bind(("127.0.0.1", dead_port)).unwrap());
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        silent.accepted.load(Ordering::Relaxed),
        accepted,
        "the service reconnected to the silent endpoint after DELETE"
    );
    assert_eq!(
        late.accepted.load(Ordering::Relaxed),
        0,
        "the service still connects to the dead endpoint after DELETE"
    );
    assert_eq!(c.get("/workers").json(), json!([]));
    assert_eq!(c.get("/health").status, 200);
}
