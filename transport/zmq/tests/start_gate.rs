//! A subscriber behind a closed start gate opens no socket and calls no sink method (no
//! link report, no tick, no message, though a publisher is sending); once the gate opens it
//! starts as any other; and it stops promptly while still waiting.
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::{Duration, Instant};

use kvr::ingress::SourceAction;
use kvr_zmq::transport::{FrameSink, ReplayEnd, Subscriber, SubscriberConfig};
use kvr_zmq::StartGate;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

/// Every sink call, by name.
struct Calls(Sender<&'static str>);

impl FrameSink for Calls {
    fn on_message(&mut self, _: &[u8], _: u64, _: &[u8]) -> SourceAction {
        let _ = self.0.send("message");
        SourceAction::Continue
    }
    fn on_replayed(&mut self, _: u32, _: &[u8], _: u64, _: &[u8]) -> SourceAction {
        let _ = self.0.send("replayed");
        SourceAction::Continue
    }
    fn on_replay_end(&mut self, _: u32, _: ReplayEnd) -> SourceAction {
        let _ = self.0.send("replay_end");
        SourceAction::Continue
    }
    fn on_tick(&mut self, _: &mut Vec<SourceAction>) {
        let _ = self.0.send("tick");
    }
    fn on_bad_frame(&mut self, _: &'static str) {
        let _ = self.0.send("bad_frame");
    }
    fn on_link(&mut self, _: Option<kvr::ingress::HealthReason>) {
        let _ = self.0.send("link");
    }
}

fn gated(endpoint: &str, gate: &StartGate) -> (Subscriber, Receiver<&'static str>) {
    let mut cfg = SubscriberConfig::connect(endpoint);
    cfg.tick_interval = Some(Duration::from_millis(10));
    cfg.start_gate = Some(gate.clone());
    let (tx, rx) = channel();
    (Subscriber::start(cfg, Box::new(Calls(tx))).unwrap(), rx)
}

#[test]
fn nothing_runs_until_the_gate_opens() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (mut publisher, endpoint) = rt.block_on(async {
        let mut p = PubSocket::new();
        let bound = p.bind("tcp://127.0.0.1:0").await.unwrap();
        (p, bound.to_string())
    });
    let gate = StartGate::new();
    let (mut sub, rx) = gated(&endpoint, &gate);
    // The publisher's socket tasks run while the runtime is driven.
    let pause = |d| rt.block_on(async move { tokio::time::sleep(d).await });
    let send = |p: &mut PubSocket, seq: u64| {
        let mut m = ZmqMessage::from(b"kv".to_vec());
        m.push_back(seq.to_be_bytes().to_vec().into());
        m.push_back(b"x".to_vec().into());
        rt.block_on(p.send(m)).unwrap();
    };
    for seq in 0..30 {
        send(&mut publisher, seq);
        pause(Duration::from_millis(10));
    }
    let early: Vec<_> = rx.try_iter().collect();
    assert!(
        early.is_empty(),
        "sink called behind a closed gate: {early:?}"
    );
    assert!(!gate.is_open());
    gate.open();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    let mut seq = 100;
    while !seen.contains(&"message") {
        assert!(Instant::now() < deadline, "nothing after opening: {seen:?}");
        send(&mut publisher, seq);
        seq += 1;
        pause(Duration::from_millis(20));
        seen.extend(rx.try_iter());
    }
    assert!(seen.contains(&"link") && seen.contains(&"tick"), "{seen:?}");
    sub.stop();

    // Stopped while waiting: prompt, and no sink call ever.
    let closed = StartGate::new();
    let (mut sub, rx) = gated(&endpoint, &closed);
    std::thread::sleep(Duration::from_millis(50));
    let t = Instant::now();
    sub.stop();
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(!sub.is_running());
    closed.open();
    assert_eq!(rx.try_iter().count(), 0);
}
