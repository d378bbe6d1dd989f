//! A flood on a bound socket: 100,000 distinct topics (and topics naming no worker) from
//! several publishers must leave the partition with a bounded number of streams, count
//! what it dropped, and keep a routed publisher's messages flowing. Counts only; the
//! flood's cost is measured by `examples/socket_flood.rs` (`tests/flood/measure.sh`,
//! docs/benchmarks.md).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvr::config::PartitionConfig;
use kvr::ingress::{TopicRoute, DEFAULT_MAX_UNROUTED_TOPICS};
use kvr::{Partition, PartitionKey, WorkerInfo};
use kvr_zmq::{subscribe, SubscribeConfig};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const TOPICS: u64 = 100_000;
const PUBLISHERS: u64 = 4;

fn message(topic: &[u8], seq: u64, payload: &[u8]) -> ZmqMessage {
    let mut m = ZmqMessage::from(topic.to_vec());
    m.push_back(seq.to_be_bytes().to_vec().into());
    m.push_back(payload.to_vec().into());
    m
}

fn routed_messages(p: &Partition) -> u64 {
    p.ingress_stats()
        .iter()
        .find(|s| s.worker_id == 1 && s.stream == 0)
        .map_or(0, |s| s.messages)
}

#[test]
fn distinct_topics_on_a_bound_socket_stay_bounded() {
    let p = Arc::new(Partition::new(
        PartitionKey::new("m", "g"),
        PartitionConfig::new(4),
    ));
    p.upsert_worker(WorkerInfo::new(1, 1)).unwrap();
    let dir = std::env::temp_dir().join(format!("kvr-flood-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let endpoint = format!("ipc://{}", dir.join("sub.sock").display());
    let route = TopicRoute {
        topic: b"routed".to_vec(),
        worker_id: 1,
        stream: 0,
        replay_endpoint: None,
    };
    let mut sub = subscribe(
        p.clone(),
        SubscribeConfig::Bind {
            endpoint: endpoint.clone(),
            routes: vec![route],
        },
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut pubs: Vec<PubSocket> = (0..PUBLISHERS)
        .map(|_| {
            rt.block_on(async {
                let mut s = PubSocket::new();
                s.connect(&endpoint).await.expect("connect");
                s
            })
        })
        .collect();
    // Every publisher is heard before the flood (the slow-joiner effect would drop it).
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seq = 0;
    while routed_messages(&p) < 2 * PUBLISHERS {
        for s in &mut pubs {
            rt.block_on(s.send(message(b"routed", seq, b""))).unwrap();
            seq += 1;
        }
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(20)).await });
        assert!(
            Instant::now() < deadline,
            "the subscriber never heard the publishers"
        );
    }
    for i in 0..TOPICS {
        let s = &mut pubs[(i % PUBLISHERS) as usize];
        let topic = format!("flood-{i}");
        rt.block_on(s.send(message(topic.as_bytes(), 0, b"\xc1")))
            .unwrap();
        if i % 64 == 0 {
            // Garbage topics: no digits, not UTF-8.
            rt.block_on(s.send(message(b"no-worker", 0, b""))).unwrap();
            rt.block_on(s.send(message(b"\xff\xfe", 0, b""))).unwrap();
        }
        if i % 1_000 == 0 {
            // Give the subscriber time, so that the PUB queues do not drop the flood.
            rt.block_on(async { tokio::time::sleep(Duration::from_millis(2)).await });
        }
    }
    // The routed publisher is still heard after the flood.
    let before = routed_messages(&p);
    let deadline = Instant::now() + Duration::from_secs(30);
    while routed_messages(&p) <= before {
        rt.block_on(pubs[0].send(message(b"routed", seq, b"")))
            .unwrap();
        seq += 1;
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(20)).await });
        assert!(
            Instant::now() < deadline,
            "the routed publisher was starved"
        );
    }
    let refused = p.indexer_stats().ingress_refused;
    sub.stop();
    let streams = p.ingress_stats().len();
    assert_eq!(
        streams,
        1 + DEFAULT_MAX_UNROUTED_TOPICS,
        "the routed stream and the capped route-less ones"
    );
    // Nearly every flood topic reaches the subscriber (paced); every one past the cap is
    // dropped and counted.
    assert!(refused > TOPICS / 2, "refused {refused}");
    assert!(refused <= TOPICS - DEFAULT_MAX_UNROUTED_TOPICS as u64);
    let _ = std::fs::remove_dir_all(&dir);
}
