//! kvr-zmtp against hand-written ZMTP peers on raw TCP: the 3.0 subscription forms (libzmq
//! can no longer be made to greet as 3.0), PING/PONG contexts, and every kind of bad input,
//! each refused with its counter while the socket keeps serving.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use kvr_zmtp::{Publisher, Subscriber, ZmtpConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{sleep, timeout, Instant};

const WAIT: Duration = Duration::from_secs(5);

fn greeting(major: u8, minor: u8, mechanism: &[u8]) -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xFF;
    g[8] = 1;
    g[9] = 0x7F;
    g[10] = major;
    g[11] = minor;
    g[12..12 + mechanism.len()].copy_from_slice(mechanism);
    g
}

fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    if body.len() > 255 {
        f.push(flags | 0x02);
        f.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        f.push(flags);
        f.push(body.len() as u8);
    }
    f.extend_from_slice(body);
    f
}

fn command(name: &[u8], data: &[u8]) -> Vec<u8> {
    let mut body = vec![name.len() as u8];
    body.extend_from_slice(name);
    body.extend_from_slice(data);
    frame(0x04, &body)
}

fn ready(socket_type: &[u8]) -> Vec<u8> {
    let mut data = vec![11];
    data.extend_from_slice(b"Socket-Type");
    data.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    data.extend_from_slice(socket_type);
    command(b"READY", &data)
}

/// A raw ZMTP peer.
struct Raw {
    s: TcpStream,
}

impl Raw {
    async fn connect(addr: SocketAddr) -> Raw {
        Raw {
            s: TcpStream::connect(addr).await.unwrap(),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).await.unwrap();
    }

    async fn read_exact(&mut self, n: usize) -> Option<Vec<u8>> {
        let mut v = vec![0u8; n];
        match timeout(WAIT, self.s.read_exact(&mut v)).await {
            Ok(Ok(_)) => Some(v),
            _ => None,
        }
    }

    /// (flags, body) of the next frame, None on EOF or after WAIT.
    async fn frame(&mut self) -> Option<(u8, Vec<u8>)> {
        let head = self.read_exact(2).await?;
        let len = if head[0] & 0x02 != 0 {
            let mut rest = vec![head[1]];
            rest.extend(self.read_exact(7).await?);
            u64::from_be_bytes(rest.try_into().unwrap()) as usize
        } else {
            head[1] as usize
        };
        Some((head[0], self.read_exact(len).await?))
    }

    /// True when the peer closed the connection (EOF) within WAIT, skipping frames.
    async fn closed(&mut self) -> bool {
        let deadline = Instant::now() + WAIT;
        let mut b = [0u8; 4096];
        while let Ok(r) = tokio::time::timeout_at(deadline, self.s.read(&mut b)).await {
            match r {
                Ok(0) | Err(_) => return true,
                Ok(_) => {}
            }
        }
        false
    }

    /// Greets as `major.minor` with NULL, reads the peer's greeting and READY, sends ours.
    async fn handshake(&mut self, minor: u8, socket_type: &[u8]) -> Vec<u8> {
        self.send(&greeting(3, minor, b"NULL")).await;
        let g = self.read_exact(64).await.expect("greeting");
        assert_eq!(&g[10..12], &[3, 1], "we greet as 3.1");
        self.send(&ready(socket_type)).await;
        let (flags, body) = self.frame().await.expect("READY");
        assert_eq!(flags, 0x04);
        body
    }
}

fn short() -> ZmtpConfig {
    ZmtpConfig {
        heartbeat_interval: Duration::from_secs(600),
        heartbeat_timeout: Duration::from_secs(600),
        ..ZmtpConfig::default()
    }
}

async fn publisher(cfg: ZmtpConfig) -> Publisher {
    Publisher::bind_with("127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .unwrap()
}

async fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        sleep(Duration::from_millis(10)).await;
    }
}

/// Publishes `topic` once; true when some subscriber's queue took it.
fn reaches(pb: &Publisher, topic: &[u8]) -> bool {
    let before = pb.stats().sent;
    pb.send(topic, Bytes::new());
    pb.stats().sent > before
}

/// The next message at `peer` whose topic does not end in `.w` (warm-up probes).
async fn next_message(peer: &mut Raw) -> (Vec<u8>, Vec<u8>) {
    loop {
        let (flags, topic) = peer.frame().await.expect("topic frame");
        let (flags2, payload) = peer.frame().await.expect("payload frame");
        assert_eq!(
            (flags, flags2),
            (0x01, 0x00),
            "MORE on the topic frame only"
        );
        if !topic.ends_with(b".w") {
            return (topic, payload);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_takes_both_subscription_forms_and_filters() {
    let pb = publisher(short()).await;
    // A 3.0 peer subscribes with 0x01-messages, a 3.1 peer with SUBSCRIBE commands.
    let mut v30 = Raw::connect(pb.local_addr()).await;
    let body = v30.handshake(0, b"SUB").await;
    assert_eq!(&body[..], b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB");
    v30.send(&frame(0, b"\x01dyn.a")).await;
    let mut v31 = Raw::connect(pb.local_addr()).await;
    v31.handshake(1, b"XSUB").await;
    v31.send(&command(b"SUBSCRIBE", b"dyn.b")).await;
    eventually("dyn.a subscribed", || reaches(&pb, b"dyn.a.w")).await;
    eventually("dyn.b subscribed", || reaches(&pb, b"dyn.b.w")).await;
    assert!(!reaches(&pb, b"zzz"));
    assert!(!reaches(&pb, b"dyn."), "a topic shorter than the prefix");
    pb.send(b"dyn.a.1", Bytes::from_static(b"A"));
    pb.send(b"dyn.b.1", Bytes::from_static(b"B"));
    assert_eq!(
        next_message(&mut v30).await,
        (b"dyn.a.1".to_vec(), b"A".to_vec())
    );
    assert_eq!(
        next_message(&mut v31).await,
        (b"dyn.b.1".to_vec(), b"B".to_vec())
    );
    assert_eq!(pb.stats().subscribers, 2);
    // Cancel both ways.
    v30.send(&frame(0, b"\x00dyn.a")).await;
    v31.send(&command(b"CANCEL", b"dyn.b")).await;
    eventually("dyn.a cancelled", || !reaches(&pb, b"dyn.a.w")).await;
    eventually("dyn.b cancelled", || !reaches(&pb, b"dyn.b.w")).await;
    // Other messages from a subscriber are ignored, as libzmq's PUB does.
    v31.send(&frame(0, b"hello")).await;
    eventually("ignored message", || pb.stats().ignored_messages == 1).await;
    assert_eq!(pb.stats().disconnects, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pings_are_answered_with_their_context_and_unknown_commands_ignored() {
    let pb = publisher(short()).await;
    let mut c = Raw::connect(pb.local_addr()).await;
    c.handshake(1, b"SUB").await;
    c.send(&command(b"JOIN", b"group")).await;
    c.send(&command(b"PING", b"\x00\x96ctx-123")).await;
    let (flags, body) = c.frame().await.expect("PONG");
    assert_eq!(flags, 0x04);
    assert_eq!(&body[..], b"\x04PONGctx-123");
    let s = pb.stats();
    assert_eq!(
        (s.pings_answered, s.unknown_commands, s.disconnects),
        (1, 1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_pings_carry_the_ttl_and_silence_closes() {
    let cfg = ZmtpConfig {
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_millis(400),
        heartbeat_ttl: Duration::from_secs(15),
        ..ZmtpConfig::default()
    };
    let pb = publisher(cfg).await;
    let mut c = Raw::connect(pb.local_addr()).await;
    c.handshake(1, b"SUB").await;
    // Dynamo's PING: TTL 0x0096 (15 s in deciseconds), empty context.
    let (flags, body) = c.frame().await.expect("PING");
    assert_eq!((flags, &body[..]), (0x04, &b"\x04PING\x00\x96"[..]));
    c.send(&command(b"PONG", b"")).await;
    // Then we stay silent: the publisher closes after 400 ms without traffic.
    assert!(c.closed().await);
    eventually("counted", || pb.stats().disconnects == 1).await;
    let s = pb.stats();
    assert_eq!(
        (s.timeouts, s.disconnects, s.pongs_received),
        (1, 1, 1),
        "{s:?}"
    );
    assert!(s.pings_sent >= 2, "{s:?}");
}

/// Connects, sends `bytes`, and expects the publisher to close the connection.
async fn refused(pb: &Publisher, bytes: &[u8]) {
    let mut c = Raw::connect(pb.local_addr()).await;
    c.send(bytes).await;
    assert!(c.closed().await, "connection not closed after {bytes:02x?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_greetings_and_ready_are_refused_and_counted() {
    let cfg = ZmtpConfig {
        handshake_timeout: Duration::from_millis(300),
        ..short()
    };
    let pb = publisher(cfg).await;
    refused(&pb, b"GET / HTTP/1.1\r\n\r\n").await;
    // ZMTP 2.0: signature, revision 1, socket type; then it waits for ours.
    refused(&pb, &greeting(1, 0, b"")[..12]).await;
    refused(&pb, &greeting(2, 0, b"NULL")).await;
    refused(&pb, &greeting(3, 1, b"CURVE")).await;
    let mut g = greeting(3, 1, b"NULL");
    g[9] = 0;
    refused(&pb, &g).await;
    // A truncated greeting: the handshake times out.
    refused(&pb, &greeting(3, 1, b"NULL")[..30]).await;
    let valid = greeting(3, 1, b"NULL");
    let after_greeting = |rest: Vec<u8>| [valid.clone(), rest].concat();
    refused(&pb, &after_greeting(ready(b"PUB"))).await;
    refused(&pb, &after_greeting(ready(b"DEALER"))).await;
    refused(&pb, &after_greeting(command(b"PING", b"\x00\x01"))).await;
    refused(&pb, &after_greeting(frame(0, b"message first"))).await;
    refused(
        &pb,
        &after_greeting(command(b"READY", b"\x0bSocket-Type\x00\x00\x00\x09SUB")),
    )
    .await;
    refused(&pb, &after_greeting(command(b"ERROR", b"\x04nope"))).await;
    eventually("12 refused", || pb.stats().refused == 12).await;
    let s = pb.stats();
    assert_eq!((s.accepted, s.subscribers), (0, 0), "{s:?}");
    // Still serving.
    let mut ok = Raw::connect(pb.local_addr()).await;
    ok.handshake(1, b"SUB").await;
    eventually("a good subscriber", || pb.stats().subscribers == 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_close_the_connection_and_are_counted() {
    let cfg = ZmtpConfig {
        max_frame: 1024,
        ..short()
    };
    let pb = publisher(cfg).await;
    let cases: Vec<Vec<u8>> = vec![
        // An absurd long size: refused from its header, nothing allocated.
        [vec![0x02], u64::MAX.to_be_bytes().to_vec()].concat(),
        // Just above the bound.
        [vec![0x02], 1025u64.to_be_bytes().to_vec()].concat(),
        // Command name length past the frame's end.
        vec![0x04, 5, 9, b'P', b'I', b'N', b'G'],
        vec![0x04, 0],
        vec![0x04, 1, 0],
        // Reserved flag bits; a command with MORE.
        vec![0x10, 0],
        vec![0x05, 1, 0],
        // PING without its TTL.
        command(b"PING", b"\x00"),
    ];
    for bytes in &cases {
        let mut c = Raw::connect(pb.local_addr()).await;
        c.handshake(1, b"SUB").await;
        c.send(bytes).await;
        assert!(c.closed().await, "not closed after {bytes:02x?}");
    }
    eventually("all counted", || {
        pb.stats().disconnects == cases.len() as u64
    })
    .await;
    let s = pb.stats();
    assert_eq!((s.oversized, s.protocol_errors), (2, 6), "{s:?}");
    // A frame exactly at the bound is fine.
    let mut c = Raw::connect(pb.local_addr()).await;
    c.handshake(1, b"SUB").await;
    c.send(&frame(0, &vec![7u8; 1024])).await;
    eventually("ignored", || pb.stats().ignored_messages == 1).await;
    assert_eq!(pb.stats().disconnects, cases.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_are_bounded() {
    let pb = publisher(short()).await;
    let mut c = Raw::connect(pb.local_addr()).await;
    c.handshake(1, b"SUB").await;
    for i in 0..70 {
        c.send(&command(b"SUBSCRIBE", format!("t{i:02}").as_bytes()))
            .await;
    }
    c.send(&command(b"SUBSCRIBE", &[b'x'; 257])).await;
    eventually("refusals", || pb.stats().subscriptions_refused == 7).await;
    assert!(reaches(&pb, b"t63"));
    assert!(!reaches(&pb, b"t64"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_subscriber_drops_at_the_hwm_without_blocking_send() {
    let cfg = ZmtpConfig { hwm: 4, ..short() };
    let pb = publisher(cfg).await;
    let mut stuck = Raw::connect(pb.local_addr()).await;
    stuck.handshake(1, b"SUB").await;
    stuck.send(&command(b"SUBSCRIBE", b"")).await;
    eventually("subscribed", || reaches(&pb, b"w")).await;
    let payload = Bytes::from(vec![0u8; 256 * 1024]);
    let start = Instant::now();
    for _ in 0..200 {
        pb.send(b"big", payload.clone());
    }
    let spent = start.elapsed();
    let s = pb.stats();
    // 50 MiB offered to a peer that reads nothing: the socket buffers take a few MiB,
    // the queue 4 messages, the rest is dropped.
    assert_eq!(s.sent + s.dropped_full, 201, "{s:?}");
    assert!(s.dropped_full > 100, "{s:?}");
    assert!(spent < Duration::from_secs(2), "send blocked: {spent:?}");
    drop(stuck);
}

/// A listener for a raw PUB, and its endpoint.
async fn raw_pub() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ep = format!("tcp://{}", l.local_addr().unwrap());
    (l, ep)
}

async fn accept_sub(l: &TcpListener, minor: u8) -> Raw {
    let (s, _) = l.accept().await.unwrap();
    let mut r = Raw { s };
    let body = r.handshake(minor, b"PUB").await;
    assert_eq!(&body[..], b"\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB");
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_subscribes_in_the_peers_version_and_checks_messages() {
    for minor in [0u8, 1] {
        let (l, ep) = raw_pub().await;
        let topics = vec![Bytes::from_static(b"dyn.a"), Bytes::from_static(b"dyn.b")];
        let (sub, mut rx) = Subscriber::with_config(topics, 16, short());
        assert_eq!(sub.connect(&ep), Ok(true));
        let mut p = accept_sub(&l, minor).await;
        for t in [&b"dyn.a"[..], b"dyn.b"] {
            let want = if minor == 0 {
                frame(0, &[&[1u8][..], t].concat())
            } else {
                command(b"SUBSCRIBE", t)
            };
            let (flags, body) = p.frame().await.expect("subscription");
            assert_eq!(frame(flags, &body), want, "ZMTP 3.{minor}");
        }
        // One good message among malformed ones and an unknown command.
        p.send(&frame(0, b"one frame")).await;
        p.send(&[frame(1, b"dyn.a"), frame(1, b"x"), frame(0, b"y")].concat())
            .await;
        p.send(&command(b"JOIN", b"")).await;
        p.send(&[frame(1, b"zzz"), frame(0, b"not ours")].concat())
            .await;
        p.send(&[frame(1, b"dyn.b.1"), frame(0, &[9u8; 300])].concat())
            .await;
        let m = timeout(WAIT, rx.recv()).await.unwrap().unwrap();
        assert_eq!(
            (&m.topic[..], m.payload.len(), &m.peer),
            (&b"dyn.b.1"[..], 300, &ep)
        );
        let s = sub.stats();
        assert_eq!(
            (
                s.received,
                s.malformed,
                s.unknown_commands,
                s.unsubscribed,
                s.connected
            ),
            (1, 2, 1, 1, 1),
            "{s:?}"
        );
        // The peer's PING is answered.
        p.send(&command(b"PING", b"\x00\x96")).await;
        let (flags, body) = p.frame().await.expect("PONG");
        assert_eq!((flags, &body[..]), (0x04, &b"\x04PONG"[..]));
        sub.close();
        assert!(p.closed().await);
        assert!(sub.endpoints().is_empty());
        assert_eq!(sub.connect(&ep), Ok(false), "closed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_drops_the_newest_when_the_channel_is_full() {
    let (l, ep) = raw_pub().await;
    let (sub, mut rx) = Subscriber::with_config(vec![Bytes::new()], 2, short());
    sub.connect(&ep).unwrap();
    let mut p = accept_sub(&l, 1).await;
    p.frame().await.expect("SUBSCRIBE");
    for i in 0..10u8 {
        p.send(&[frame(1, b"t"), frame(0, &[i])].concat()).await;
    }
    eventually("all seen", || {
        let s = sub.stats();
        s.received + s.dropped_full == 10
    })
    .await;
    assert_eq!(sub.stats().dropped_full, 8);
    assert_eq!(rx.recv().await.unwrap().payload, Bytes::from_static(&[0]));
    assert_eq!(rx.recv().await.unwrap().payload, Bytes::from_static(&[1]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_refuses_what_it_cannot_connect_to_and_reconnects() {
    let (sub, _rx) = Subscriber::with_config(vec![Bytes::new()], 2, short());
    for (ep, why) in [
        ("ipc:///tmp/x.sock", "ipc:// is not supported"),
        ("inproc://x", "inproc:// is not supported"),
        ("tcp://*:5555", "wildcard"),
        ("http://x:1", "unsupported scheme `http`"),
        ("tcp://h:99999", "number too large"),
    ] {
        let e = sub.connect(ep).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("invalid ZMQ endpoint `{ep}`: ")) && e.contains(why),
            "{e}"
        );
    }
    assert!(sub.endpoints().is_empty());
    // Nothing listening yet: it keeps trying, then connects once a PUB appears.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let ep = format!("tcp://127.0.0.1:{port}");
    assert_eq!(sub.connect(&ep), Ok(true));
    sleep(Duration::from_millis(400)).await;
    assert!(sub.stats().reconnects >= 2, "{:?}", sub.stats());
    let pb = Publisher::bind_with(format!("127.0.0.1:{port}").parse().unwrap(), short())
        .await
        .unwrap();
    eventually("connected", || {
        sub.stats().connected == 1 && pb.stats().subscribers == 1
    })
    .await;
    assert_eq!(sub.endpoints(), vec![ep.clone()]);
    assert!(sub.disconnect(&ep));
    assert!(!sub.disconnect(&ep));
    eventually("dropped", || {
        pb.stats().subscribers == 0 && sub.stats().connected == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_max_peers_are_refused_handshaking_ones_included() {
    let cfg = ZmtpConfig {
        max_peers: 2,
        ..short()
    };
    let pb = publisher(cfg).await;
    // Two connections that never greet hold both places.
    let a = Raw::connect(pb.local_addr()).await;
    let mut b = Raw::connect(pb.local_addr()).await;
    b.read_exact(64).await.expect("b is greeted");
    let mut c = Raw::connect(pb.local_addr()).await;
    assert!(c.closed().await, "third connection not refused");
    assert_eq!(pb.stats().refused, 1);
    drop(a);
    // The place is given back once the first connection's task has seen it close.
    let mut ok = false;
    let deadline = Instant::now() + WAIT;
    while !ok && Instant::now() < deadline {
        let mut d = Raw::connect(pb.local_addr()).await;
        ok = d.read_exact(64).await.is_some();
        sleep(Duration::from_millis(10)).await;
    }
    assert!(ok, "a place never freed: {:?}", pb.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_and_the_last_handle_drop_end_everything() {
    for by_drop in [false, true] {
        let pb = publisher(short()).await;
        let addr = pb.local_addr();
        let mut c = Raw::connect(addr).await;
        c.handshake(1, b"SUB").await;
        eventually("subscriber", || pb.stats().subscribers == 1).await;
        let other = pb.clone();
        if by_drop {
            drop(pb);
            drop(other);
        } else {
            drop(other);
            pb.close();
        }
        assert!(
            c.closed().await,
            "connection kept after close (by_drop {by_drop})"
        );
        let deadline = Instant::now() + WAIT;
        while TcpStream::connect(addr).await.is_ok() {
            assert!(
                Instant::now() < deadline,
                "still listening (by_drop {by_drop})"
            );
            sleep(Duration::from_millis(10)).await;
        }
    }
}

/// xorshift: reproducible garbage.
fn garbage(state: &mut u64, max_len: u64) -> Vec<u8> {
    let mut next = || {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    };
    let len = next() % max_len;
    (0..len).map(|_| next() as u8).collect()
}

/// Random bytes after a valid handshake and after a valid greeting prefix: every connection
/// ends counted (a panicking connection task would leave its subscriber in the table and
/// miss the count), and the publisher still serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_never_breaks_the_publisher() {
    let cfg = ZmtpConfig {
        handshake_timeout: Duration::from_millis(200),
        heartbeat_timeout: Duration::from_millis(300),
        max_frame: 4096,
        ..short()
    };
    let pb = publisher(cfg).await;
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    const N: u64 = 150;
    for i in 0..N {
        let mut c = Raw::connect(pb.local_addr()).await;
        c.handshake(1, b"SUB").await;
        let mut bytes = garbage(&mut seed, 300);
        if i % 3 == 0 {
            // Start as a frame header so that more of it gets parsed as frames.
            bytes.insert(0, (i % 8) as u8);
        }
        c.send(&bytes).await;
        drop(c);
    }
    eventually("every link counted", || {
        let s = pb.stats();
        s.disconnects == N && s.subscribers == 0
    })
    .await;
    for i in 0..N {
        let mut c = Raw::connect(pb.local_addr()).await;
        let mut bytes = greeting(3, (i % 2) as u8, b"NULL")[..(i as usize % 70).min(64)].to_vec();
        bytes.extend(garbage(&mut seed, 100));
        let _ = c.s.write_all(&bytes).await;
        drop(c);
    }
    eventually("every handshake ended", || {
        let s = pb.stats();
        s.refused + s.accepted == 2 * N && s.subscribers == 0
    })
    .await;
    let mut ok = Raw::connect(pb.local_addr()).await;
    ok.handshake(1, b"SUB").await;
    eventually("still serving", || pb.stats().subscribers == 1).await;
}

/// Degenerate settings (zero intervals, "forever" timeouts, zero capacities) neither panic
/// nor spin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_settings_are_tolerated() {
    let cfg = ZmtpConfig {
        heartbeat_interval: Duration::ZERO,
        heartbeat_timeout: Duration::MAX,
        heartbeat_ttl: Duration::MAX,
        hwm: 0,
        max_frame: usize::MAX,
        reconnect_interval: Duration::ZERO,
        reconnect_interval_max: Duration::ZERO,
        ..ZmtpConfig::default()
    };
    let pb = publisher(cfg.clone()).await;
    let mut c = Raw::connect(pb.local_addr()).await;
    c.handshake(1, b"SUB").await;
    // PINGs every millisecond, TTL saturated at 0xFFFF deciseconds.
    let (flags, body) = c.frame().await.expect("PING");
    assert_eq!((flags, &body[..]), (0x04, &b"\x04PING\xff\xff"[..]));
    let (sub, _rx) = Subscriber::with_config(vec![Bytes::new()], 0, cfg);
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    sub.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
    sleep(Duration::from_millis(200)).await;
    let tries = sub.stats().reconnects;
    assert!((2..1000).contains(&tries), "{tries} attempts in 200 ms");
}
