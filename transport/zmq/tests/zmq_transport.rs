//! The ZMQ transport (`kvr_zmq::transport`) over real TCP on 127.0.0.1: publishers
//! and replay ROUTERs written here with the same `zeromq` crate, and a libzmq publisher
//! (pyzmq, `tests/pyzmq_interop/publisher.py`) for interoperability.
//!
//! The pyzmq tests are skipped with a notice when `python3 -c "import zmq"` fails, unless
//! `KVR_REQUIRE_PYZMQ=1` (CI), which makes them fail instead.
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvr::ingress::SourceAction;
use kvr_zmq::transport::{bad_frame, FrameSink, ReplayEnd, Subscriber, SubscriberConfig};
use tokio::runtime::Runtime;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// What the sink saw, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Ev {
    Live {
        topic: Vec<u8>,
        seq: u64,
        payload: Vec<u8>,
    },
    Replayed {
        topic: Vec<u8>,
        seq: u64,
        payload: Vec<u8>,
    },
    End(ReplayEnd),
    Bad(&'static str),
}

impl Ev {
    fn live(topic: &[u8], seq: u64, payload: &[u8]) -> Ev {
        Ev::Live {
            topic: topic.to_vec(),
            seq,
            payload: payload.to_vec(),
        }
    }

    fn replayed(topic: &[u8], seq: u64, payload: &[u8]) -> Ev {
        Ev::Replayed {
            topic: topic.to_vec(),
            seq,
            payload: payload.to_vec(),
        }
    }

    fn is_live_on(&self, t: &[u8]) -> bool {
        matches!(self, Ev::Live { topic, .. } if topic == t)
    }
}

/// Checks made by the sink itself.
#[derive(Default)]
struct SinkChecks {
    /// Set by the test once `stop()` has returned.
    stopped: AtomicBool,
    /// A sink method ran while `stopped` was set.
    called_after_stop: AtomicBool,
    /// Sink calls that ran on a thread other than the ingest pipeline's (`kvr-ingest`).
    wrong_thread: AtomicUsize,
    calls: AtomicUsize,
}

/// Forwards everything to a channel; asks for a replay on the first live message whose
/// topic is `replay_on_topic`.
struct RecordingSink {
    tx: Sender<Ev>,
    replay_on_topic: Option<(Vec<u8>, u64)>,
    checks: Arc<SinkChecks>,
}

impl RecordingSink {
    fn call(&self, ev: Ev) {
        let checks = &self.checks;
        checks.calls.fetch_add(1, Ordering::SeqCst);
        if checks.stopped.load(Ordering::SeqCst) {
            checks.called_after_stop.store(true, Ordering::SeqCst);
        }
        let named = std::thread::current()
            .name()
            .is_some_and(|n| n == "kvr-ingest");
        if !named {
            checks.wrong_thread.fetch_add(1, Ordering::SeqCst);
        }
        let _ = self.tx.send(ev);
    }
}

impl FrameSink for RecordingSink {
    fn on_message(&mut self, topic: &[u8], seq: u64, payload: &[u8]) -> SourceAction {
        self.call(Ev::live(topic, seq, payload));
        match &self.replay_on_topic {
            Some((t, from_seq)) if t == topic => {
                let from_seq = *from_seq;
                self.replay_on_topic = None;
                SourceAction::Replay {
                    id: 0,
                    from_seq,
                    endpoint: None,
                }
            }
            _ => SourceAction::Continue,
        }
    }

    fn on_replayed(&mut self, _id: u32, topic: &[u8], seq: u64, payload: &[u8]) -> SourceAction {
        self.call(Ev::replayed(topic, seq, payload));
        SourceAction::Continue
    }

    fn on_replay_end(&mut self, _id: u32, end: ReplayEnd) -> SourceAction {
        self.call(Ev::End(end));
        SourceAction::Continue
    }

    fn on_bad_frame(&mut self, why: &'static str) {
        self.call(Ev::Bad(why));
    }
}

struct Harness {
    sub: Subscriber,
    rx: Receiver<Ev>,
    checks: Arc<SinkChecks>,
    seen: Vec<Ev>,
}

impl Harness {
    fn start(cfg: SubscriberConfig, replay_on_topic: Option<(&[u8], u64)>) -> Harness {
        let (tx, rx) = channel();
        let checks = Arc::new(SinkChecks::default());
        let sink = RecordingSink {
            tx,
            replay_on_topic: replay_on_topic.map(|(t, s)| (t.to_vec(), s)),
            checks: Arc::clone(&checks),
        };
        let sub = Subscriber::start(cfg, Box::new(sink)).expect("start subscriber");
        assert_eq!(sub.thread_name(), "kvr-ingest");
        Harness {
            sub,
            rx,
            checks,
            seen: Vec::new(),
        }
    }

    fn drain(&mut self) {
        while let Ok(ev) = self.rx.try_recv() {
            self.seen.push(ev);
        }
    }

    /// Waits (driving `rt`, whose tasks serve the test's sockets) until `done(seen)`.
    fn wait_for(&mut self, rt: &Runtime, what: &str, done: impl Fn(&[Ev]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            self.drain();
            if done(&self.seen) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; seen: {}",
                summary(&self.seen)
            );
            pause(rt, Duration::from_millis(5));
        }
    }

    /// Sends `[warm_topic, seq, ""]` every 20 ms until the sink has seen one: the SUB is
    /// then connected and subscribed, and nothing later is lost to the slow-joiner effect.
    fn warm_up(&mut self, rt: &Runtime, publisher: &mut PubSocket, warm_topic: &[u8]) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut n = 0u64;
        loop {
            self.drain();
            if self.seen.iter().any(|e| e.is_live_on(warm_topic)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "subscriber never received a warm-up message; seen: {}",
                summary(&self.seen)
            );
            send(rt, publisher, &[warm_topic, &n.to_be_bytes(), b""]);
            n += 1;
            pause(rt, Duration::from_millis(20));
        }
    }

    /// Stops the subscriber, checking that it is prompt and that no sink call follows.
    fn stop(mut self) -> Vec<Ev> {
        let t = Instant::now();
        self.sub.stop();
        let took = t.elapsed();
        self.checks.stopped.store(true, Ordering::SeqCst);
        assert!(took < Duration::from_secs(2), "stop() took {took:?}");
        assert!(!self.sub.is_running());
        self.sub.stop(); // idempotent
        assert_eq!(self.checks.wrong_thread.load(Ordering::SeqCst), 0);
        self.drain();
        self.seen
    }
}

fn summary(seen: &[Ev]) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for e in seen {
        let key = match e {
            Ev::Live { topic, .. } => format!("live {}", String::from_utf8_lossy(topic)),
            Ev::Replayed { .. } => "replayed".to_string(),
            Ev::End(end) => format!("end {end:?}"),
            Ev::Bad(why) => format!("bad {why}"),
        };
        *counts.entry(key).or_default() += 1;
    }
    format!("{counts:?}")
}

/// Sleeps while driving `rt` (its tasks serve the test's sockets).
fn pause(rt: &Runtime, d: Duration) {
    rt.block_on(async { tokio::time::sleep(d).await });
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn message(frames: &[&[u8]]) -> ZmqMessage {
    let mut msg = ZmqMessage::from(frames[0].to_vec());
    for f in &frames[1..] {
        msg.push_back(f.to_vec().into());
    }
    msg
}

fn send(rt: &Runtime, socket: &mut PubSocket, frames: &[&[u8]]) {
    rt.block_on(socket.send(message(frames))).expect("publish");
}

fn bind_pub(rt: &Runtime, endpoint: &str) -> (PubSocket, String) {
    rt.block_on(async {
        let mut socket = PubSocket::new();
        let bound = socket.bind(endpoint).await.expect("bind PUB");
        (socket, bound.to_string())
    })
}

fn connect_pub(rt: &Runtime, endpoint: &str) -> PubSocket {
    rt.block_on(async {
        let mut socket = PubSocket::new();
        socket.connect(endpoint).await.expect("connect PUB");
        socket
    })
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn config(endpoint: &str, bind: bool) -> SubscriberConfig {
    SubscriberConfig {
        endpoint: endpoint.to_string(),
        bind,
        topic: Vec::new(),
        replay_endpoint: None,
        reconnect_interval: Duration::from_millis(100),
        replay_timeout: Duration::from_secs(5),
        tick_interval: None,
        start_gate: None,
    }
}

fn payload_for(seq: u64) -> Vec<u8> {
    match seq % 4 {
        0 => Vec::new(),
        1 => format!("batch-{seq}").into_bytes(),
        2 => (0..100_000u32).map(|i| (i ^ seq as u32) as u8).collect(),
        _ => vec![seq as u8; 777],
    }
}

fn live_on(seen: &[Ev], topic: &[u8]) -> Vec<(u64, Vec<u8>)> {
    seen.iter()
        .filter_map(|e| match e {
            Ev::Live {
                topic: t,
                seq,
                payload,
            } if t == topic => Some((*seq, payload.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn connect_to_bound_publisher_delivers_frames() {
    let rt = runtime();
    let (mut publisher, endpoint) = bind_pub(&rt, "tcp://127.0.0.1:0");
    let mut h = Harness::start(config(&endpoint, false), None);
    assert!(h.sub.is_running());
    h.warm_up(&rt, &mut publisher, b"warm");
    for seq in 0..200u64 {
        send(
            &rt,
            &mut publisher,
            &[b"kv", &seq.to_be_bytes(), &payload_for(seq)],
        );
    }
    h.wait_for(&rt, "200 messages", |s| live_on(s, b"kv").len() >= 200);
    let seen = h.stop();
    let expected: Vec<_> = (0..200u64).map(|s| (s, payload_for(s))).collect();
    assert_eq!(live_on(&seen, b"kv"), expected);
    assert!(!seen.iter().any(|e| matches!(e, Ev::Bad(_))));
}

#[test]
fn bound_subscriber_receives_from_connecting_publishers() {
    let rt = runtime();
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    let mut h = Harness::start(config(&endpoint, true), None);
    let mut p0 = connect_pub(&rt, &endpoint);
    let mut p1 = connect_pub(&rt, &endpoint);
    h.warm_up(&rt, &mut p0, b"warm0");
    h.warm_up(&rt, &mut p1, b"warm1");
    for seq in 0..50u64 {
        send(&rt, &mut p0, &[b"w0", &seq.to_be_bytes(), b"zero"]);
        send(&rt, &mut p1, &[b"w1", &seq.to_be_bytes(), b"one"]);
    }
    h.wait_for(&rt, "50 messages from each publisher", |s| {
        live_on(s, b"w0").len() >= 50 && live_on(s, b"w1").len() >= 50
    });
    let seen = h.stop();
    let w0: Vec<_> = (0..50u64).map(|s| (s, b"zero".to_vec())).collect();
    let w1: Vec<_> = (0..50u64).map(|s| (s, b"one".to_vec())).collect();
    assert_eq!(live_on(&seen, b"w0"), w0);
    assert_eq!(live_on(&seen, b"w1"), w1);
}

#[test]
fn bind_star_endpoint_listens_on_all_interfaces() {
    let rt = runtime();
    let port = free_port();
    let mut h = Harness::start(config(&format!("tcp://*:{port}"), true), None);
    let mut publisher = connect_pub(&rt, &format!("tcp://127.0.0.1:{port}"));
    h.warm_up(&rt, &mut publisher, b"warm");
    h.stop();
}

#[test]
fn bind_is_retried_until_the_port_is_free() {
    let rt = runtime();
    let squatter = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", squatter.local_addr().unwrap().port());
    let mut h = Harness::start(config(&endpoint, true), None);
    pause(&rt, Duration::from_millis(300));
    assert!(h.sub.is_running());
    drop(squatter);
    let mut publisher = connect_pub(&rt, &endpoint);
    h.warm_up(&rt, &mut publisher, b"warm");
    h.stop();
}

#[test]
fn connect_is_retried_until_the_publisher_is_up_and_after_it_restarts() {
    let rt = runtime();
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    // Nothing listens yet.
    let mut h = Harness::start(config(&endpoint, false), None);
    pause(&rt, Duration::from_millis(300));
    assert!(h.sub.is_running());

    let (mut first, _) = bind_pub(&rt, &endpoint);
    h.warm_up(&rt, &mut first, b"warm-first");
    send(
        &rt,
        &mut first,
        &[b"kv", &1u64.to_be_bytes(), b"from first"],
    );
    h.wait_for(&rt, "the first publisher's message", |s| {
        live_on(s, b"kv").len() == 1
    });
    let errors = rt.block_on(first.close());
    assert!(errors.is_empty(), "{errors:?}");
    pause(&rt, Duration::from_millis(200));

    // A restarted publisher on the same port: seq starts from 0 again.
    let (mut second, _) = bind_pub(&rt, &endpoint);
    h.warm_up(&rt, &mut second, b"warm-second");
    send(
        &rt,
        &mut second,
        &[b"kv", &0u64.to_be_bytes(), b"from second"],
    );
    h.wait_for(&rt, "the second publisher's message", |s| {
        live_on(s, b"kv").len() == 2
    });
    let seen = h.stop();
    assert_eq!(
        live_on(&seen, b"kv"),
        vec![(1, b"from first".to_vec()), (0, b"from second".to_vec())]
    );
}

#[test]
fn malformed_messages_are_reported_not_delivered() {
    let rt = runtime();
    let (mut publisher, endpoint) = bind_pub(&rt, "tcp://127.0.0.1:0");
    let mut h = Harness::start(config(&endpoint, false), None);
    h.warm_up(&rt, &mut publisher, b"warm");
    send(&rt, &mut publisher, &[b"kv", &1u64.to_be_bytes()]);
    send(
        &rt,
        &mut publisher,
        &[b"kv", &2u64.to_be_bytes(), b"p", b"extra"],
    );
    send(&rt, &mut publisher, &[b"kv", &[0u8; 7], b"p"]);
    send(&rt, &mut publisher, &[b"kv", &[0u8; 9], b"p"]);
    send(&rt, &mut publisher, &[b"kv", &[], b"p"]);
    send(&rt, &mut publisher, &[b"kv", &5u64.to_be_bytes(), b"good"]);
    h.wait_for(&rt, "the good message", |s| !live_on(s, b"kv").is_empty());
    let seen = h.stop();
    let after_warm: Vec<_> = seen
        .into_iter()
        .filter(|e| !e.is_live_on(b"warm"))
        .collect();
    assert_eq!(
        after_warm,
        vec![
            Ev::Bad(bad_frame::FRAME_COUNT),
            Ev::Bad(bad_frame::FRAME_COUNT),
            Ev::Bad(bad_frame::SEQ_SIZE),
            Ev::Bad(bad_frame::SEQ_SIZE),
            Ev::Bad(bad_frame::SEQ_SIZE),
            Ev::live(b"kv", 5, b"good"),
        ]
    );
}

#[test]
fn topic_prefix_filter() {
    let rt = runtime();
    let (mut publisher, endpoint) = bind_pub(&rt, "tcp://127.0.0.1:0");
    let cfg = SubscriberConfig {
        topic: b"kv".to_vec(),
        ..config(&endpoint, false)
    };
    let mut h = Harness::start(cfg, None);
    h.warm_up(&rt, &mut publisher, b"kv-warm");
    send(&rt, &mut publisher, &[b"other", &1u64.to_be_bytes(), b"no"]);
    send(&rt, &mut publisher, &[b"k", &2u64.to_be_bytes(), b"no"]);
    send(&rt, &mut publisher, &[b"kv1", &3u64.to_be_bytes(), b"yes"]);
    send(&rt, &mut publisher, &[b"kv", &4u64.to_be_bytes(), b"yes"]);
    h.wait_for(&rt, "the last message", |s| !live_on(s, b"kv").is_empty());
    let seen = h.stop();
    let topics: Vec<_> = seen
        .iter()
        .filter(|e| !e.is_live_on(b"kv-warm"))
        .cloned()
        .collect();
    assert_eq!(
        topics,
        vec![Ev::live(b"kv1", 3, b"yes"), Ev::live(b"kv", 4, b"yes")]
    );
}

/// The frames of each request a test ROUTER received.
type Requests = Arc<Mutex<Vec<Vec<Vec<u8>>>>>;

/// A replay ROUTER served by a task on the test's runtime: records each request's
/// frames, then answers with `batches` (seq ≥ start, under topic "kv") and the end marker
/// unless `silent`.
fn spawn_router(
    rt: &Runtime,
    batches: Vec<(u64, Vec<u8>)>,
    silent: bool,
    reply_gap: Duration,
) -> (String, Requests) {
    let batches = batches
        .into_iter()
        .map(|(seq, payload)| (b"kv".to_vec(), seq, payload))
        .collect();
    spawn_router_under(rt, batches, silent, reply_gap)
}

/// [`spawn_router`] replying each batch under its own topic.
fn spawn_router_under(
    rt: &Runtime,
    batches: Vec<(Vec<u8>, u64, Vec<u8>)>,
    silent: bool,
    reply_gap: Duration,
) -> (String, Requests) {
    let requests = Arc::new(Mutex::new(Vec::new()));
    let (mut router, endpoint) = rt.block_on(async {
        let mut router = RouterSocket::new();
        let bound = router.bind("tcp://127.0.0.1:0").await.expect("bind ROUTER");
        (router, bound.to_string())
    });
    let seen = Arc::clone(&requests);
    rt.spawn(async move {
        while let Ok(request) = router.recv().await {
            let frames: Vec<Vec<u8>> = request.iter().map(|f| f.to_vec()).collect();
            seen.lock().unwrap().push(frames.clone());
            if silent || frames.len() != 3 || !frames[1].is_empty() || frames[2].len() != 8 {
                continue;
            }
            let start = u64::from_be_bytes(frames[2][..].try_into().unwrap());
            let identity = frames[0].clone();
            for (topic, seq, payload) in batches.iter().filter(|(_, s, _)| *s >= start) {
                tokio::time::sleep(reply_gap).await;
                let reply = message(&[&identity, b"", topic, &seq.to_be_bytes(), payload]);
                router.send(reply).await.expect("replay reply");
            }
            let end = message(&[&identity, b"", b"", &[0xff; 8], b""]);
            router.send(end).await.expect("end marker");
        }
    });
    (endpoint, requests)
}

/// Replayed batches pass the subscription's topic filter as live ones do: a publisher's
/// replay resends every topic it has.
#[test]
fn replayed_batches_pass_the_topic_filter() {
    let rt = runtime();
    let batches = vec![
        (b"other".to_vec(), 3, b"no".to_vec()),
        (b"kv".to_vec(), 4, b"yes".to_vec()),
        (b"k".to_vec(), 5, b"no".to_vec()),
        (b"kv-1".to_vec(), 6, b"yes".to_vec()),
    ];
    let (replay_endpoint, _) = spawn_router_under(&rt, batches, false, Duration::ZERO);
    let (mut publisher, endpoint) = bind_pub(&rt, "tcp://127.0.0.1:0");
    let cfg = SubscriberConfig {
        topic: b"kv".to_vec(),
        replay_endpoint: Some(replay_endpoint),
        ..config(&endpoint, false)
    };
    let mut h = Harness::start(cfg, Some((b"kv-warm", 3)));
    h.warm_up(&rt, &mut publisher, b"kv-warm");
    h.wait_for(&rt, "the replay's end", |s| {
        s.iter().any(|e| matches!(e, Ev::End(_)))
    });
    let seen = h.stop();
    let replayed: Vec<_> = seen
        .iter()
        .filter(|e| matches!(e, Ev::Replayed { .. }))
        .cloned()
        .collect();
    assert_eq!(
        replayed,
        vec![
            Ev::replayed(b"kv", 4, b"yes"),
            Ev::replayed(b"kv-1", 6, b"yes")
        ]
    );
}

#[test]
fn replay_delivers_batches_then_completes_while_live_messages_flow() {
    let rt = runtime();
    let batches: Vec<_> = (0..8u64).map(|s| (s, payload_for(s))).collect();
    let (replay_endpoint, requests) = spawn_router(&rt, batches, false, Duration::from_millis(100));
    let (mut publisher, endpoint) = bind_pub(&rt, "tcp://127.0.0.1:0");
    let cfg = SubscriberConfig {
        replay_endpoint: Some(replay_endpoint),
        ..config(&endpoint, false)
    };
    let mut h = Harness::start(cfg, Some((b"warm", 3)));
    h.warm_up(&rt, &mut publisher, b"warm");
    // Live batches while the replay is served (one reply every 100 ms).
    let mut live = 10u64;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        h.drain();
        if h.seen.iter().any(|e| matches!(e, Ev::End(_))) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no replay end; {}",
            summary(&h.seen)
        );
        send(&rt, &mut publisher, &[b"kv", &live.to_be_bytes(), b"live"]);
        live += 1;
        pause(&rt, Duration::from_millis(20));
    }
    let seen = h.stop();

    let requests = requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 1, "{requests:?}");
    assert_eq!(requests[0].len(), 3, "ROUTER gets [identity, \"\", seq]");
    assert_eq!(requests[0][1], b"");
    assert_eq!(requests[0][2], 3u64.to_be_bytes());

    let replayed: Vec<_> = seen
        .iter()
        .filter(|e| matches!(e, Ev::Replayed { .. }))
        .cloned()
        .collect();
    let expected: Vec<_> = (3..8u64)
        .map(|s| Ev::replayed(b"kv", s, &payload_for(s)))
        .collect();
    assert_eq!(replayed, expected);
    let ends: Vec<_> = seen.iter().filter(|e| matches!(e, Ev::End(_))).collect();
    assert_eq!(ends, vec![&Ev::End(ReplayEnd::Completed)]);
    let end_at = seen.iter().position(|e| matches!(e, Ev::End(_))).unwrap();
    let last_replayed = seen
        .iter()
        .rposition(|e| matches!(e, Ev::Replayed { .. }))
        .unwrap();
    assert!(last_replayed < end_at, "the end marker comes last");
    // Live messages kept flowing while the replay was served.
    let first_replayed = seen
        .iter()
        .position(|e| matches!(e, Ev::Replayed { .. }))
        .unwrap();
    assert!(
        seen[first_replayed..end_at]
            .iter()
            .any(|e| e.is_live_on(b"kv")),
        "no live message between the first replayed batch and the end"
    );
    let live_seqs: Vec<_> = live_on(&seen, b"kv").iter().map(|(s, _)| *s).collect();
    assert_eq!(
        live_seqs,
        (10..10 + live_seqs.len() as u64).collect::<Vec<_>>()
    );
}

#[test]
fn replay_times_out_when_the_router_never_answers() {
    let rt = runtime();
    let (replay_endpoint, requests) = spawn_router(&rt, Vec::new(), true, Duration::ZERO);
    let (mut publisher, endpoint) = bind_pub(&rt, "tcp://127.0.0.1:0");
    let cfg = SubscriberConfig {
        replay_endpoint: Some(replay_endpoint),
        replay_timeout: Duration::from_millis(300),
        ..config(&endpoint, false)
    };
    let mut h = Harness::start(cfg, Some((b"warm", 0)));
    h.warm_up(&rt, &mut publisher, b"warm");
    let t = Instant::now();
    h.wait_for(&rt, "the replay end", |s| {
        s.iter().any(|e| matches!(e, Ev::End(_)))
    });
    let waited = t.elapsed();
    let seen = h.stop();
    let ends: Vec<_> = seen.iter().filter(|e| matches!(e, Ev::End(_))).collect();
    assert_eq!(ends, vec![&Ev::End(ReplayEnd::TimedOut)]);
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert_eq!(requests.lock().unwrap().len(), 1);
}

#[test]
fn replay_times_out_when_nothing_listens() {
    let rt = runtime();
    let (mut publisher, endpoint) = bind_pub(&rt, "tcp://127.0.0.1:0");
    let cfg = SubscriberConfig {
        replay_endpoint: Some(format!("tcp://127.0.0.1:{}", free_port())),
        replay_timeout: Duration::from_millis(300),
        ..config(&endpoint, false)
    };
    let mut h = Harness::start(cfg, Some((b"warm", 0)));
    h.warm_up(&rt, &mut publisher, b"warm");
    h.wait_for(&rt, "the replay end", |s| {
        s.iter().any(|e| matches!(e, Ev::End(_)))
    });
    let seen = h.stop();
    let ends: Vec<_> = seen.iter().filter(|e| matches!(e, Ev::End(_))).collect();
    assert_eq!(ends, vec![&Ev::End(ReplayEnd::TimedOut)]);
}

#[test]
fn replay_without_endpoint_is_not_configured() {
    let rt = runtime();
    let (mut publisher, endpoint) = bind_pub(&rt, "tcp://127.0.0.1:0");
    let mut h = Harness::start(config(&endpoint, false), Some((b"warm", 0)));
    h.warm_up(&rt, &mut publisher, b"warm");
    h.wait_for(&rt, "the replay end", |s| {
        s.iter().any(|e| matches!(e, Ev::End(_)))
    });
    let seen = h.stop();
    let ends: Vec<_> = seen.iter().filter(|e| matches!(e, Ev::End(_))).collect();
    assert_eq!(ends, vec![&Ev::End(ReplayEnd::NotConfigured)]);
}

#[test]
fn stop_joins_promptly_under_load_and_no_sink_call_follows() {
    let rt = runtime();
    let (publisher, endpoint) = bind_pub(&rt, "tcp://127.0.0.1:0");
    let (replay_endpoint, _requests) = spawn_router(&rt, Vec::new(), true, Duration::ZERO);
    let cfg = SubscriberConfig {
        // A replay that never ends is in flight when stop() is called.
        replay_endpoint: Some(replay_endpoint),
        replay_timeout: Duration::from_secs(60),
        ..config(&endpoint, false)
    };
    let mut h = Harness::start(cfg, Some((b"kv", 0)));
    // Flood from another thread (its own runtime) until told to stop.
    let flooding = Arc::new(AtomicBool::new(true));
    let flag = Arc::clone(&flooding);
    let flooder = std::thread::spawn(move || {
        let rt = runtime();
        let mut publisher = publisher;
        let mut seq = 0u64;
        let deadline = Instant::now() + Duration::from_secs(30);
        while flag.load(Ordering::SeqCst) && Instant::now() < deadline {
            send(
                &rt,
                &mut publisher,
                &[b"kv", &seq.to_be_bytes(), &[7u8; 512]],
            );
            seq += 1;
            if seq.is_multiple_of(64) {
                pause(&rt, Duration::from_millis(1));
            }
        }
        seq
    });
    h.wait_for(&rt, "1000 live messages", |s| {
        live_on(s, b"kv").len() >= 1000
    });
    let checks = Arc::clone(&h.checks);
    h.stop();
    let calls_at_stop = checks.calls.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(200));
    flooding.store(false, Ordering::SeqCst);
    let sent = flooder.join().unwrap();
    assert!(sent > 1000);
    assert!(!checks.called_after_stop.load(Ordering::SeqCst));
    assert_eq!(checks.calls.load(Ordering::SeqCst), calls_at_stop);
}

#[test]
fn stop_is_prompt_while_connecting_to_nothing() {
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    let cfg = SubscriberConfig {
        reconnect_interval: Duration::from_secs(30),
        ..config(&endpoint, false)
    };
    let h = Harness::start(cfg, None);
    std::thread::sleep(Duration::from_millis(200));
    assert!(h.sub.is_running());
    let seen = h.stop();
    assert!(seen.is_empty());
}

#[test]
fn drop_stops_the_subscriber_and_frees_a_bound_port() {
    let rt = runtime();
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    {
        let mut h = Harness::start(config(&endpoint, true), None);
        let mut publisher = connect_pub(&rt, &endpoint);
        h.warm_up(&rt, &mut publisher, b"warm");
        // Dropped here (Drop runs stop()).
    }
    // The port is free again: a second subscriber binds it.
    let mut h = Harness::start(config(&endpoint, true), None);
    let mut publisher = connect_pub(&rt, &endpoint);
    h.warm_up(&rt, &mut publisher, b"warm");
    h.stop();
}

#[test]
fn ipc_endpoints_work() {
    let rt = runtime();
    let path = std::env::temp_dir().join(format!("kvr-transport-{}.ipc", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let endpoint = format!("ipc://{}", path.display());
    let mut h = Harness::start(config(&endpoint, true), None);
    let mut publisher = connect_pub(&rt, &endpoint);
    h.warm_up(&rt, &mut publisher, b"warm");
    send(
        &rt,
        &mut publisher,
        &[b"kv", &9u64.to_be_bytes(), b"over ipc"],
    );
    h.wait_for(&rt, "the ipc message", |s| !live_on(s, b"kv").is_empty());
    let seen = h.stop();
    assert_eq!(live_on(&seen, b"kv"), vec![(9, b"over ipc".to_vec())]);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn invalid_endpoints_are_rejected_at_start() {
    let bad = [
        config("not an endpoint", false),
        config("tcp://127.0.0.1", false),
        config("tcp://*:5557", false), // `*` can only be bound
        SubscriberConfig {
            replay_endpoint: Some("udp://127.0.0.1:1".into()),
            ..config("tcp://127.0.0.1:5557", false)
        },
    ];
    for cfg in bad {
        let (tx, _rx) = channel();
        let sink = RecordingSink {
            tx,
            replay_on_topic: None,
            checks: Arc::default(),
        };
        let err = Subscriber::start(cfg.clone(), Box::new(sink)).unwrap_err();
        assert_eq!(
            err.kind(),
            std::io::ErrorKind::InvalidInput,
            "{cfg:?}: {err}"
        );
    }
}

// ---- libzmq interop (pyzmq) ----

/// Whether `python3` with pyzmq is available; fails instead of skipping when
/// `KVR_REQUIRE_PYZMQ=1`.
fn pyzmq_available(test: &str) -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import zmq"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let required = std::env::var("KVR_REQUIRE_PYZMQ").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "{test}: KVR_REQUIRE_PYZMQ=1 but `python3 -c \"import zmq\"` fails (pip install pyzmq)"
        );
        eprintln!("{test}: SKIPPED: python3 with pyzmq is not available (pip install pyzmq)");
    }
    ok
}

fn spawn_python_publisher(mode: &str, pub_endpoint: &str, router_port: u16) -> Child {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pyzmq_interop/publisher.py");
    let mut child = Command::new("python3")
        .arg(script)
        .args([mode, pub_endpoint, &router_port.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn python3");
    // Wait for its "ready" line: both sockets exist.
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().and_then(|l| l.ok()).unwrap_or_default();
    assert_eq!(first, "publisher: ready", "the publisher did not start");
    std::thread::spawn(move || lines.for_each(|l| eprintln!("{}", l.unwrap_or_default())));
    child
}

/// Waits for the script to exit (bounded), returning its exit code and stderr.
fn wait_child(mut child: Child) -> (Option<i32>, String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    (status.and_then(|s| s.code()), stderr)
}

fn pyzmq_interop(mode: &str) {
    let rt = runtime();
    let router_port = free_port();
    let (pub_endpoint, bind) = match mode {
        // The script's PUB binds; kvr connects.
        "bind" => (format!("tcp://127.0.0.1:{}", free_port()), false),
        // kvr binds; the script's PUB connects (vLLM without `*` in its endpoint).
        _ => (format!("tcp://127.0.0.1:{}", free_port()), true),
    };
    let cfg = SubscriberConfig {
        topic: b"kv".to_vec(),
        replay_endpoint: Some(format!("tcp://127.0.0.1:{router_port}")),
        ..config(&pub_endpoint, bind)
    };
    let (child, mut h) = if bind {
        let h = Harness::start(cfg, Some((b"kv-warmup", 4)));
        (spawn_python_publisher(mode, &pub_endpoint, router_port), h)
    } else {
        let child = spawn_python_publisher(mode, &pub_endpoint, router_port);
        (child, Harness::start(cfg, Some((b"kv-warmup", 4))))
    };
    h.wait_for(&rt, "kv-done and the replay end", |s| {
        s.iter().any(|e| e.is_live_on(b"kv-done")) && s.iter().any(|e| matches!(e, Ev::End(_)))
    });
    let (code, stderr) = wait_child(child);
    let seen = h.stop();
    assert_eq!(code, Some(0), "publisher.py failed: {stderr}");

    let payload = |seq: u64| -> Vec<u8> {
        if seq == 15 {
            vec![b'x'; 300_000]
        } else {
            format!("batch-{seq}").into_bytes()
        }
    };
    let replayed: Vec<_> = seen
        .iter()
        .filter(|e| matches!(e, Ev::Replayed { .. }))
        .cloned()
        .collect();
    let expected: Vec<_> = (4..10u64)
        .map(|s| Ev::replayed(b"kv", s, &payload(s)))
        .collect();
    assert_eq!(replayed, expected);
    let ends: Vec<_> = seen.iter().filter(|e| matches!(e, Ev::End(_))).collect();
    assert_eq!(ends, vec![&Ev::End(ReplayEnd::Completed)]);
    let live: Vec<_> = (10..20u64).map(|s| (s, payload(s))).collect();
    assert_eq!(live_on(&seen, b"kv"), live);
    let bad: Vec<_> = seen.iter().filter(|e| matches!(e, Ev::Bad(_))).collect();
    assert_eq!(
        bad,
        vec![
            &Ev::Bad(bad_frame::FRAME_COUNT),
            &Ev::Bad(bad_frame::SEQ_SIZE)
        ]
    );
    assert!(
        !seen.iter().any(|e| e.is_live_on(b"other")),
        "the topic filter let `other` through"
    );
}

#[test]
fn pyzmq_interop_subscriber_connects() {
    if pyzmq_available("pyzmq_interop_subscriber_connects") {
        pyzmq_interop("bind");
    }
}

#[test]
fn pyzmq_interop_subscriber_binds() {
    if pyzmq_available("pyzmq_interop_subscriber_binds") {
        pyzmq_interop("connect");
    }
}
