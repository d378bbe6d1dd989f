//! Measures what a flood of distinct topics costs a source by topic, against a clean run
//! of as many messages under routed topics: RSS growth and time per message. One run per
//! process (`clean` or `flood` as the argument); `tests/flood/measure.sh` repeats both and
//! takes medians. A measurement, not a test: it asserts nothing.

use std::time::Instant;

use kvr::config::PartitionConfig;
use kvr::ingress::{EventSource, Medium, TopicRoute};
use kvr::{Partition, PartitionKey, WorkerInfo};
use kvr_emulator::BatchEncoder;

const MESSAGES: u64 = 100_000;
const ROUTED: u64 = 4;
const BS: u32 = 4;

fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4
}

fn main() {
    let flood = match std::env::args().nth(1).as_deref() {
        Some("flood") => true,
        Some("clean") => false,
        _ => {
            eprintln!("usage: ingress_flood clean|flood");
            std::process::exit(2);
        }
    };
    let p = Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(BS));
    let routes: Vec<TopicRoute> = (0..ROUTED)
        .map(|w| {
            p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
            TopicRoute {
                topic: format!("routed-{w}").into_bytes(),
                worker_id: w,
                stream: 0,
                replay_endpoint: None,
            }
        })
        .collect();
    let mut source = EventSource::by_topic(&p, routes, None).unwrap();
    // The same small stored batch (one block, as a removal-free engine publishes) for
    // every message of both runs, so they differ only by topic.
    let mut enc = BatchEncoder::new();
    let tokens: Vec<u32> = (0..BS).collect();
    enc.stored(&[1], None, &tokens, BS, Medium::Gpu, None);
    let payload = enc.finish(1.0, None);
    let topics: Vec<Vec<u8>> = (0..MESSAGES)
        .map(|i| {
            if flood {
                format!("flood-{i}").into_bytes()
            } else {
                format!("routed-{}", i % ROUTED).into_bytes()
            }
        })
        .collect();
    let routed: Vec<Vec<u8>> = (0..MESSAGES)
        .map(|i| format!("routed-{}", i % ROUTED).into_bytes())
        .collect();
    let now = Instant::now();
    let rss_before = rss_kib();
    let t = Instant::now();
    for (i, topic) in topics.iter().enumerate() {
        let seq = if flood { 0 } else { i as u64 / ROUTED };
        source.on_message(topic, seq, &payload, now);
    }
    let ns = t.elapsed().as_nanos() as f64 / MESSAGES as f64;
    // Then the routed publishers' messages (after the flood, or after as many clean
    // ones): what the flood costs everybody else on the socket.
    let t = Instant::now();
    for (i, topic) in routed.iter().enumerate() {
        let seq = MESSAGES / ROUTED + i as u64 / ROUTED;
        source.on_message(topic, seq, &payload, now);
    }
    let routed_ns = t.elapsed().as_nanos() as f64 / MESSAGES as f64;
    let rss_after = rss_kib();
    println!(
        "{} messages={MESSAGES} ns_per_message={ns:.0} routed_ns_per_message={routed_ns:.0} rss_growth_kib={} streams={} ingress_refused={}",
        if flood { "flood" } else { "clean" },
        rss_after.saturating_sub(rss_before),
        p.ingress_stats().len(),
        p.indexer_stats().ingress_refused,
    );
}
