//! Measures what a flood of distinct topics costs a bound subscription over a real socket,
//! against a clean run: RSS growth and the end-to-end time of a routed publisher's
//! messages afterwards (from the first send until the partition's ingress stats count the
//! last one). One run per process: `socket_flood clean|flood [N [MAX_UNROUTED [PACE]]]`
//! (N defaults to 100,000; MAX_UNROUTED, the subscription's `max_unrouted_topics`, to its
//! default; PACE, how many messages of the phase are sent before waiting until they are
//! heard, to 0: no pacing); `tests/flood/measure.sh` repeats both and takes medians. A measurement, not a test: it
//! asserts nothing about times.
//!
//! Both modes first warm up (N routed messages, so that socket buffers and the PUB queues'
//! slots are touched before RSS is read), then send their phase:
//! - `clean`: N messages under 4 routed topics (one per publisher);
//! - `flood`: N distinct topics (`flood-<i>`, each naming a worker nobody registered) and,
//!   every 64th, two topics naming no worker at all;
//!
//! then time N messages from the first routed publisher. The publishers are in this
//! process (a `zeromq` PUB per publisher over `ipc://`), so their cost is in both runs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvr::config::PartitionConfig;
use kvr::ingress::{Medium, TopicRoute, DEFAULT_MAX_UNROUTED_TOPICS};
use kvr::{Partition, PartitionKey, WorkerInfo};
use kvr_emulator::BatchEncoder;
use kvr_zmq::{subscribe_with, SubscribeConfig, SubscribeOptions};
use tokio::runtime::Runtime;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const PUBLISHERS: u64 = 4;
const BS: u32 = 4;
/// The routed workers' ids: outside the flood's `flood-<i>` range, so the flood never
/// lands on a routed worker.
const ROUTED_BASE: u64 = 1 << 40;
/// How long nothing may move before a wait gives up (and the run reports what it heard).
const STALL: Duration = Duration::from_secs(3);

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn message(topic: &[u8], seq: u64, payload: &[u8]) -> ZmqMessage {
    let mut m = ZmqMessage::from(topic.to_vec());
    m.push_back(seq.to_be_bytes().to_vec().into());
    m.push_back(payload.to_vec().into());
    m
}

fn routed_topic(k: u64) -> Vec<u8> {
    format!("routed-{k}").into_bytes()
}

/// Messages the partition has heard: counted by a stream, dropped and counted (a topic
/// past the caps), or counted as a bad frame (a topic naming no worker).
fn heard(p: &Partition) -> u64 {
    let streams: u64 = p
        .ingress_stats()
        .iter()
        .map(|s| s.messages + s.bad_frames)
        .sum();
    streams + p.indexer_stats().ingress_refused
}

fn routed_heard(p: &Partition, k: u64) -> u64 {
    p.ingress_stats()
        .iter()
        .find(|s| s.worker_id == ROUTED_BASE + k && s.stream == 0)
        .map_or(0, |s| s.messages)
}

/// Drives the runtime (the PUB sockets' writes run on it) until `count` reaches `target`
/// or stops moving for [`STALL`]; returns the last count.
fn wait_for(rt: &Runtime, target: u64, count: impl Fn() -> u64) -> u64 {
    let (mut last, mut moved) = (count(), Instant::now());
    while last < target {
        rt.block_on(async { tokio::time::sleep(Duration::from_micros(500)).await });
        let now = count();
        if now != last {
            (last, moved) = (now, Instant::now());
        } else if moved.elapsed() > STALL {
            break;
        }
    }
    last
}

struct Publishers {
    socks: Vec<PubSocket>,
    /// Each routed publisher's next sequence number.
    seq: Vec<u64>,
}

impl Publishers {
    fn send(&mut self, rt: &Runtime, k: usize, topic: &[u8], seq: u64, payload: &[u8]) {
        rt.block_on(self.socks[k].send(message(topic, seq, payload)))
            .expect("send");
    }

    fn send_routed(&mut self, rt: &Runtime, k: u64, payload: &[u8]) {
        let seq = self.seq[k as usize];
        self.seq[k as usize] += 1;
        self.send(rt, k as usize, &routed_topic(k), seq, payload);
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let flood = match args.next().as_deref() {
        Some("flood") => true,
        Some("clean") => false,
        _ => {
            eprintln!("usage: socket_flood clean|flood [N [MAX_UNROUTED [PACE]]]");
            std::process::exit(2);
        }
    };
    let n: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let max_unrouted = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(DEFAULT_MAX_UNROUTED_TOPICS);
    let pace = args.next().and_then(|a| a.parse().ok()).unwrap_or(0);
    println!("{}", run(flood, n, max_unrouted, pace));
}

/// One run; its figures as one line of `key=value`. With `pace` > 0 the phase waits
/// until every `pace` messages sent are heard (what the phase leaves without the
/// backlog of an unpaced burst).
fn run(flood: bool, n: u64, max_unrouted_topics: usize, pace: u64) -> String {
    let p = Arc::new(Partition::new(
        PartitionKey::new("m", "g"),
        PartitionConfig::new(BS),
    ));
    let routes: Vec<TopicRoute> = (0..PUBLISHERS)
        .map(|k| {
            p.upsert_worker(WorkerInfo::new(ROUTED_BASE + k, 1))
                .expect("worker");
            TopicRoute {
                topic: routed_topic(k),
                worker_id: ROUTED_BASE + k,
                stream: 0,
                replay_endpoint: None,
            }
        })
        .collect();
    let dir = std::env::temp_dir().join(format!("kvr-socket-flood-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let endpoint = format!("ipc://{}", dir.join("sub.sock").display());
    let mut sub = subscribe_with(
        p.clone(),
        SubscribeConfig::Bind {
            endpoint: endpoint.clone(),
            routes,
        },
        SubscribeOptions {
            max_unrouted_topics,
            ..SubscribeOptions::default()
        },
    )
    .expect("subscribe");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut pubs = Publishers {
        socks: (0..PUBLISHERS)
            .map(|_| {
                rt.block_on(async {
                    let mut s = PubSocket::new();
                    s.connect(&endpoint).await.expect("connect");
                    s
                })
            })
            .collect(),
        seq: vec![0; PUBLISHERS as usize],
    };
    // The same one-block stored batch for every message, so the runs differ only by topic.
    let mut enc = BatchEncoder::new();
    let tokens: Vec<u32> = (0..BS).collect();
    enc.stored(&[1], None, &tokens, BS, Medium::Gpu, None);
    let payload = enc.finish(1.0, None);

    // Every publisher is heard before anything is measured (the slow-joiner effect).
    let deadline = Instant::now() + Duration::from_secs(20);
    while (0..PUBLISHERS).any(|k| routed_heard(&p, k) < 2) {
        for k in 0..PUBLISHERS {
            pubs.send_routed(&rt, k, &payload);
        }
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(20)).await });
        assert!(Instant::now() < deadline, "the subscriber never heard us");
    }
    // Warm-up: as many routed messages as the phase sends, in both modes.
    let target = heard(&p) + n;
    for i in 0..n {
        pubs.send_routed(&rt, i % PUBLISHERS, &payload);
    }
    wait_for(&rt, target, || heard(&p));

    let rss_before = rss_kib();
    let refused_before = p.indexer_stats().ingress_refused;
    let start = heard(&p);
    let t = Instant::now();
    let mut sent = 0u64;
    for i in 0..n {
        let k = i % PUBLISHERS;
        if flood {
            let topic = format!("flood-{i}");
            pubs.send(&rt, k as usize, topic.as_bytes(), 0, &payload);
            sent += 1;
            if i % 64 == 0 {
                pubs.send(&rt, k as usize, b"no-worker", 0, &payload);
                pubs.send(&rt, k as usize, b"\xff\xfe", 0, &payload);
                sent += 2;
            }
        } else {
            pubs.send_routed(&rt, k, &payload);
            sent += 1;
        }
        if pace > 0 && (i + 1) % pace == 0 {
            wait_for(&rt, start + sent, || heard(&p));
        }
    }
    let phase_heard = wait_for(&rt, start + sent, || heard(&p)) - start;
    let phase_ns = t.elapsed().as_nanos() as f64 / phase_heard.max(1) as f64;

    // Then the first routed publisher's messages: what the phase costs the others.
    let before = routed_heard(&p, 0);
    let t = Instant::now();
    for _ in 0..n {
        pubs.send_routed(&rt, 0, &payload);
    }
    let timed_heard = wait_for(&rt, before + n, || routed_heard(&p, 0)) - before;
    let routed_ns = t.elapsed().as_nanos() as f64 / timed_heard.max(1) as f64;
    let rss_after = rss_kib();

    let lost: u64 = p
        .ingress_stats()
        .iter()
        .map(|s| s.sequence.batches_lost)
        .sum();
    let streams = p.ingress_stats().len();
    let refused = p.indexer_stats().ingress_refused - refused_before;
    sub.stop();
    let _ = std::fs::remove_dir_all(&dir);
    format!(
        "socket-{} messages={n} sent={sent} heard={phase_heard} ns_per_message={phase_ns:.0} routed={timed_heard} routed_ns_per_message={routed_ns:.0} rss_growth_kib={} streams={streams} ingress_refused={refused} batches_lost={lost}",
        if flood { "flood" } else { "clean" },
        rss_after.saturating_sub(rss_before),
    )
}

#[cfg(test)]
mod tests {
    /// A smoke run with small counts: it runs, hears everything, and prints every key
    /// `tests/flood/measure.sh` reads. Times are not checked.
    #[test]
    fn smoke() {
        for (flood, streams) in [(false, 4), (true, 4 + 256)] {
            let line = super::run(flood, 1_000, super::DEFAULT_MAX_UNROUTED_TOPICS, 0);
            let value = |key: &str| -> u64 {
                line.split_whitespace()
                    .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("no {key} in {line}"))
            };
            for key in ["ns_per_message", "routed_ns_per_message", "rss_growth_kib"] {
                value(key);
            }
            assert_eq!(value("heard"), value("sent"), "{line}");
            assert_eq!(value("routed"), 1_000, "{line}");
            assert_eq!(value("streams"), streams, "{line}");
        }
    }
}
