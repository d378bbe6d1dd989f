//! A dead KV-event endpoint is never silent: `kvr serve` with a worker whose
//! `kv_events_endpoint` nobody listens on shows it within 10 s in the log (one warning),
//! in `/ready` (200, the stream listed `dead`) and in `/metrics`
//! (`kvr_kv_stream_health{state="dead"} 1`); with `--ready-requires-kv-events`, `/ready`
//! answers 503; an endpoint that accepts TCP and never speaks ZMQ is dead too. Negative control: a live vLLM-style publisher (Python, skipped without
//! pyzmq unless `KVR_REQUIRE_PYZMQ=1`) shows `exact` and is not listed.
//!
//! Shown able to fail: with the transport's `on_link` report removed
//! (`transport/zmq/src/transport/mod.rs`, `Step::Link` doing nothing) the dead worker
//! stays exact and the first test fails at "dead within 10 s".

use super::*;

/// The service's log, captured (one subscriber for the whole test binary).
fn captured_log() -> Arc<Mutex<Vec<u8>>> {
    static LOG: std::sync::OnceLock<Arc<Mutex<Vec<u8>>>> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        let writer = move || LogWriter(sink.clone());
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(writer)
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .try_init()
            .expect("one log subscriber");
        buf
    })
    .clone()
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn log_lines(log: &Arc<Mutex<Vec<u8>>>, needle: &str) -> Vec<String> {
    String::from_utf8_lossy(&log.lock().unwrap())
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

/// A TCP port nobody listens on (bound, then closed).
fn dead_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn worker(id: u64, endpoint: &str) -> Value {
    json!({"worker_id": id, "model_name": "fresh", "endpoint": format!("http://w{id}.invalid"),
           "kv_events_endpoint": endpoint, "block_size": 16})
}

/// The `/ready` body's entry for `worker_id`, if listed.
fn ready_entry(ready: &Value, worker_id: u64) -> Option<Value> {
    ready["kv_event_sources"]
        .as_array()?
        .iter()
        .find(|s| s["worker_id"] == worker_id)
        .cloned()
}

/// `kvr_kv_stream_health{..., worker_id="W", state="S", ...} 1` in the exposition.
fn metrics_state(c: &mut Client, worker_id: u64, state: &str) -> bool {
    let r = c.get("/metrics");
    assert_eq!(r.status, 200);
    let text = String::from_utf8(r.body).unwrap();
    let (w, s) = (
        format!("worker_id=\"{worker_id}\""),
        format!("state=\"{state}\""),
    );
    text.lines().any(|l| {
        l.starts_with("kvr_kv_stream_health{")
            && l.contains(&w)
            && l.contains(&s)
            && l.ends_with(" 1")
    })
}

/// Worker ids no other test in this binary registers: the log capture is process-wide.
const DEAD: u64 = 4101;
const LIVE: u64 = 4102;

#[test]
fn a_dead_endpoint_shows_in_the_log_ready_and_metrics_within_10s_and_a_live_one_is_exact() {
    let log = captured_log();
    let (dead_tag, live_tag) = (format!("worker_id={DEAD}"), format!("worker_id={LIVE}"));
    let server = Server::start();
    let mut c = server.client();
    let live = python_ready().then(|| {
        let port = dead_port();
        (Publisher::start(port), port)
    });
    let t = Instant::now();
    register(
        &mut c,
        worker(DEAD, &format!("tcp://127.0.0.1:{}", dead_port())),
    );
    if let Some((_, port)) = &live {
        register(&mut c, worker(LIVE, &format!("tcp://127.0.0.1:{port}")));
    }
    let dead_everywhere = wait_until(Duration::from_secs(10), || {
        let ready = c.get("/ready");
        let listed = ready.status == 200
            && ready_entry(&ready.json(), DEAD).is_some_and(|e| e["state"] == "dead");
        let logged = log_lines(&log, "KV-event source dead")
            .iter()
            .any(|l| l.contains(&dead_tag));
        listed && logged && metrics_state(&mut c, DEAD, "dead")
    });
    let took = t.elapsed();
    assert!(
        dead_everywhere,
        "dead within 10 s: /ready {}, log {:?}",
        c.get("/ready").json(),
        log_lines(&log, &dead_tag)
    );
    eprintln!("dead endpoint visible in log, /ready and /metrics after {took:?}");
    let entry = ready_entry(&c.get("/ready").json(), DEAD).unwrap();
    assert_eq!(entry["reason"], "cannot connect (refused or timed out)");
    // Each failed attempt is counted; the state change is logged once.
    std::thread::sleep(Duration::from_secs(2));
    let failures = ready_entry(&c.get("/ready").json(), DEAD).unwrap()["link_failures"]
        .as_u64()
        .unwrap();
    assert!(failures >= 2, "link_failures {failures}");
    let warnings = log_lines(&log, "KV-event source dead");
    let w1 = warnings.iter().filter(|l| l.contains(&dead_tag)).count();
    assert_eq!(w1, 1, "one warning per change of state: {warnings:#?}");

    // Negative control: the live publisher's stream is exact.
    let Some((mut publisher, _)) = live else {
        return;
    };
    assert!(publisher.cmd("peer 10").starts_with("PEER 1"));
    assert!(publisher.cmd("store 1 2").starts_with("SEQ "));
    let exact = wait_until(Duration::from_secs(10), || {
        metrics_state(&mut c, LIVE, "exact")
    });
    assert!(exact, "live publisher exact in /metrics");
    let ready = c.get("/ready").json();
    assert!(
        ready_entry(&ready, LIVE).is_none(),
        "an exact stream is not listed: {ready}"
    );
    assert!(
        !log_lines(&log, "KV-event source")
            .iter()
            .any(|l| l.contains(&live_tag)),
        "nothing logged for the live publisher"
    );
}

#[test]
fn an_endpoint_that_accepts_tcp_and_never_speaks_zmq_is_dead() {
    // The kernel completes the TCP handshake (the listener's backlog); no ZMQ greeting
    // ever comes, so each connect attempt times out.
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = mute.local_addr().unwrap().port();
    let server = Server::start();
    let mut c = server.client();
    register(&mut c, worker(3, &format!("tcp://127.0.0.1:{port}")));
    let dead = wait_until(Duration::from_secs(10), || {
        ready_entry(&c.get("/ready").json(), 3).is_some_and(|e| e["state"] == "dead")
    });
    assert!(dead, "dead within 10 s: {}", c.get("/ready").json());
    assert!(metrics_state(&mut c, 3, "dead"));
    drop(mute);
}

#[test]
fn ready_requires_kv_events_makes_a_dead_endpoint_fail_readiness() {
    let server = Server::start_with(&["--ready-requires-kv-events", "true"]);
    let mut c = server.client();
    register(&mut c, worker(7, "tcp://127.0.0.1:9"));
    let unready = wait_until(Duration::from_secs(10), || c.get("/ready").status == 503);
    let body = c.get("/ready").json();
    assert!(unready, "503 within 10 s: {body}");
    assert_eq!(ready_entry(&body, 7).unwrap()["state"], "dead");
    assert_eq!(body["schedulable_workers"], 1);
}
