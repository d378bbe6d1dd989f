//! kvr-zmtp against real libzmq (pyzmq's, `tests/pyzmq/peer.py`), with libzmq's heartbeats
//! short (PING every 200 ms, timeout and TTL 600 ms): a libzmq SUB on our Publisher and our
//! Subscriber on a libzmq PUB stay connected through 3 s of silence and still deliver,
//! topic-filtered. The negative controls switch our PONG off (and our own PINGs, which
//! libzmq also counts as traffic) and show libzmq dropping the link, i.e. that the checks
//! can fail. Skipped, with the reason printed, when no Python has pyzmq (unless
//! `KVR_REQUIRE_PYZMQ=1`).

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvr_zmtp::{Message, Publisher, PublisherStats, Subscriber, SubscriberStats, ZmtpConfig};
use support::{free_port, hex, python, PyPeer};
use tokio::sync::mpsc::Receiver;

const IDLE: Duration = Duration::from_secs(3);
/// Our own PING interval when the test must not rely on it (longer than the test).
const NO_PING: Duration = Duration::from_secs(600);

fn cfg(answer_pings: bool, our_ping: Duration) -> ZmtpConfig {
    ZmtpConfig {
        heartbeat_interval: our_ping,
        heartbeat_timeout: Duration::from_secs(2),
        heartbeat_ttl: Duration::from_secs(2),
        reconnect_interval: Duration::from_millis(50),
        reconnect_interval_max: Duration::from_millis(200),
        answer_pings,
        ..ZmtpConfig::default()
    }
}

/// Publishes probes until `peer` (a SUB) receives one: the subscription has arrived.
async fn until_subscribed(pb: &Publisher, peer: &mut PyPeer) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        pb.send(b"dyn.a.probe", Bytes::from_static(b"p"));
        if peer.next_msg(Duration::from_millis(100)).is_some() {
            return Ok(());
        }
    }
    Err(format!(
        "libzmq SUB never received a probe: {:?}",
        pb.stats()
    ))
}

/// The next non-probe message at `peer`.
fn next_real(peer: &mut PyPeer, wait: Duration) -> Option<Vec<Vec<u8>>> {
    let deadline = Instant::now() + wait;
    loop {
        let m = peer.next_msg(deadline.saturating_duration_since(Instant::now()))?;
        if m.first().map(|t| &t[..]) != Some(b"dyn.a.probe") {
            return Some(m);
        }
    }
}

/// A libzmq SUB (subscribed to `dyn.a`) on our Publisher: filtered delivery, 3 s idle, then
/// delivery again; Err when the link dropped meanwhile or a message went missing.
async fn our_pub_libzmq_sub(
    answer_pings: bool,
    our_ping: Duration,
) -> Result<PublisherStats, String> {
    let py = python().expect("checked by the caller");
    let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let pb = Publisher::bind_with(local, cfg(answer_pings, our_ping))
        .await
        .unwrap();
    let ep = format!("tcp://{}", pb.local_addr());
    let mut peer = PyPeer::spawn(&py, &["sub", &ep, &hex(b"dyn.a")]);
    until_subscribed(&pb, &mut peer).await?;
    pb.send(b"zzz", Bytes::from_static(b"not subscribed"));
    pb.send(b"dyn.a.one", Bytes::from_static(b"1"));
    let got = next_real(&mut peer, Duration::from_secs(5)).ok_or("dyn.a.one not received")?;
    if got != vec![b"dyn.a.one".to_vec(), b"1".to_vec()] {
        return Err(format!(
            "expected [dyn.a.one, 1] first (zzz filtered), got {got:?}"
        ));
    }
    tokio::time::sleep(IDLE).await;
    peer.poll_events();
    let stats = pb.stats();
    if stats.accepted != 1 || stats.disconnects != 0 || peer.count("disconnected") != 0 {
        return Err(format!(
            "link dropped while idle: {stats:?}, libzmq events {:?}",
            peer.events
        ));
    }
    pb.send(b"dyn.a.after", Bytes::from_static(b"2"));
    let got = next_real(&mut peer, Duration::from_secs(5)).ok_or("nothing after idle")?;
    if got != vec![b"dyn.a.after".to_vec(), b"2".to_vec()] {
        return Err(format!("after idle: {got:?}"));
    }
    peer.stop();
    Ok(pb.stats())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn libzmq_sub_on_our_publisher_survives_idle_by_pong() {
    if python().is_none() {
        return;
    }
    let s = our_pub_libzmq_sub(true, NO_PING).await.unwrap();
    assert!(s.pings_answered >= 10, "libzmq pinged every 200 ms: {s:?}");
    assert_eq!(s.pings_sent, 0, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn libzmq_sub_answers_our_pings() {
    if python().is_none() {
        return;
    }
    let s = our_pub_libzmq_sub(true, Duration::from_millis(200))
        .await
        .unwrap();
    assert!(s.pings_sent >= 10 && s.pongs_received >= 10, "{s:?}");
}

/// Negative control: without our PONG (and without our PINGs), libzmq drops the link.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_libzmq_sub_drops_our_publisher_without_pong() {
    if python().is_none() {
        return;
    }
    let err = our_pub_libzmq_sub(false, NO_PING).await.unwrap_err();
    eprintln!("as expected: {err}");
    assert!(err.contains("link dropped while idle"), "{err}");
}

/// Receives until a message other than a probe arrives.
async fn next_real_rx(rx: &mut Receiver<Message>, wait: Duration) -> Option<Message> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let m = tokio::time::timeout_at(deadline, rx.recv()).await.ok()??;
        if m.topic != "dyn.a.probe" {
            return Some(m);
        }
    }
}

/// Sends probes from `peer` (a PUB) until our Subscriber receives one.
async fn until_receiving(peer: &mut PyPeer, rx: &mut Receiver<Message>) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        peer.send(b"dyn.a.probe", b"p");
        if let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(100), rx.recv()).await {
            return Ok(());
        }
    }
    Err("our Subscriber never received a probe".into())
}

/// Our Subscriber (topic `dyn.a`) on a libzmq PUB: filtered delivery, 3 s idle, delivery again.
async fn our_sub_libzmq_pub(
    answer_pings: bool,
    our_ping: Duration,
) -> Result<(SubscriberStats, Subscriber, Receiver<Message>, u16), String> {
    let py = python().expect("checked by the caller");
    let port = free_port();
    let ep = format!("tcp://127.0.0.1:{port}");
    let mut peer = PyPeer::spawn(&py, &["pub", &port.to_string()]);
    let (sub, mut rx) = Subscriber::with_config(
        vec![Bytes::from_static(b"dyn.a")],
        64,
        cfg(answer_pings, our_ping),
    );
    assert_eq!(sub.connect(&ep), Ok(true));
    assert_eq!(sub.connect(&ep), Ok(false));
    until_receiving(&mut peer, &mut rx).await?;
    peer.send(b"zzz", b"not subscribed");
    peer.send(b"dyn.a.one", b"1");
    let m = next_real_rx(&mut rx, Duration::from_secs(5))
        .await
        .ok_or("dyn.a.one not received")?;
    if (&m.topic[..], &m.payload[..], m.peer.as_str()) != (b"dyn.a.one", b"1", ep.as_str()) {
        return Err(format!(
            "expected dyn.a.one first (zzz filtered by libzmq), got {m:?}"
        ));
    }
    tokio::time::sleep(IDLE).await;
    peer.poll_events();
    let stats = sub.stats();
    if stats.connects != 1 || stats.disconnects != 0 || peer.count("disconnected") != 0 {
        return Err(format!(
            "link dropped while idle: {stats:?}, libzmq events {:?}",
            peer.events
        ));
    }
    peer.send(b"dyn.a.after", b"2");
    let m = next_real_rx(&mut rx, Duration::from_secs(5))
        .await
        .ok_or("nothing after idle")?;
    if (&m.topic[..], &m.payload[..]) != (b"dyn.a.after", b"2") {
        return Err(format!("after idle: {m:?}"));
    }
    let stats = sub.stats();
    if stats.unsubscribed != 0 {
        return Err(format!(
            "libzmq sent unsubscribed topics: our SUBSCRIBE was not understood: {stats:?}"
        ));
    }
    peer.stop();
    Ok((stats, sub, rx, port))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn our_subscriber_on_libzmq_pub_survives_idle_and_publisher_restart() {
    let Some(py) = python() else { return };
    let (s, sub, mut rx, port) = our_sub_libzmq_pub(true, NO_PING).await.unwrap();
    assert!(s.pings_answered >= 10, "libzmq pinged every 200 ms: {s:?}");
    // The libzmq PUB was stopped; a new one on the same port: we reconnect and receive.
    let deadline = Instant::now() + Duration::from_secs(5);
    while sub.stats().connected != 0 {
        assert!(
            Instant::now() < deadline,
            "link not seen down: {:?}",
            sub.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut peer = PyPeer::spawn(&py, &["pub", &port.to_string()]);
    until_receiving(&mut peer, &mut rx).await.unwrap();
    let s = sub.stats();
    assert_eq!(s.connects, 2, "{s:?}");
    assert!(s.reconnects >= 1, "{s:?}");
    assert_eq!(sub.endpoints(), vec![format!("tcp://127.0.0.1:{port}")]);
    assert!(sub.disconnect(&format!("tcp://127.0.0.1:{port}")));
    assert!(sub.endpoints().is_empty());
    peer.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn libzmq_pub_answers_our_pings() {
    if python().is_none() {
        return;
    }
    let (s, ..) = our_sub_libzmq_pub(true, Duration::from_millis(200))
        .await
        .unwrap();
    assert!(s.pings_sent >= 10 && s.pongs_received >= 10, "{s:?}");
}

/// Negative control: without our PONG (and without our PINGs), libzmq's PUB drops us.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_libzmq_pub_drops_our_subscriber_without_pong() {
    if python().is_none() {
        return;
    }
    let err = our_sub_libzmq_pub(false, NO_PING)
        .await
        .expect_err("must fail");
    eprintln!("as expected: {err}");
    assert!(err.contains("link dropped while idle"), "{err}");
}
