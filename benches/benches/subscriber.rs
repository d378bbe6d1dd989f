//! kvr's subscriber at sustained rate over loopback (issue 5 item 8): a Rust ZMQ PUB
//! (the same `zeromq` crate) floods vLLM 0.33 batches at one kvr subscription; the
//! figure is batches and blocks applied per second, from the first to the last batch
//! applied, with lost batches (PUB high-water mark) reported.
//!
//! Each batch: 4 `BlockStored` events of 16 blocks (block size 16) and, after the first
//! round, the removal of the previous batch's 64 blocks, so the index stays small. The
//! publisher sends `KVR_SUB_BATCHES` batches (default 20,000) per run, three runs; the
//! median run is reported. Run: `cargo bench -p kvr-benches --bench subscriber`
//! (without `--bench`: a smoke run of 200 batches). With `KVR_SUBSCRIBER_JSON=path` it
//! also writes the runs and the median run as JSON (`benches/summary.sh` reads it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvr::config::PartitionConfig;
use kvr::ingress::Medium;
use kvr::{Partition, PartitionKey};
use kvr_emulator::BatchEncoder;
use kvr_zmq::subscribe::{subscribe, SubscribeConfig};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const BS: usize = 16;

fn batch(round: u64, prev: Option<&[u64]>, hashes: &mut Vec<u64>) -> Vec<u8> {
    let mut b = BatchEncoder::new();
    hashes.clear();
    for s in 0..4u64 {
        let base = (round * 4 + s) * 16 + 1;
        let ids: Vec<u64> = (base..base + 16).collect();
        let tokens: Vec<u32> = (0..(16 * BS) as u64)
            .map(|t| ((base * 31 + t) & 0xffff) as u32)
            .collect();
        b.stored(&ids, None, &tokens, BS as u32, Medium::Gpu, None);
        hashes.extend_from_slice(&ids);
    }
    if let Some(prev) = prev {
        b.removed(prev, Medium::Gpu);
    }
    b.finish(1.0, Some(0))
}

fn message(seq: u64, payload: &[u8]) -> ZmqMessage {
    let mut m = ZmqMessage::from(b"".to_vec());
    m.push_back(seq.to_be_bytes().to_vec().into());
    m.push_back(payload.to_vec().into());
    m
}

struct Run {
    batches_per_s: f64,
    blocks_per_s: f64,
    applied: u64,
    lost: u64,
}

impl Run {
    fn json(&self) -> String {
        format!(
            "{{\"applied\": {}, \"lost\": {}, \"batches_per_s\": {:.1}, \"blocks_per_s\": {:.1}}}",
            self.applied, self.lost, self.batches_per_s, self.blocks_per_s
        )
    }
}

fn run(n: u64) -> Run {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (mut publisher, endpoint) = rt.block_on(async {
        let mut s = PubSocket::new();
        let ep = s.bind("tcp://127.0.0.1:0").await.expect("bind PUB");
        (s, ep.to_string())
    });
    let p = Arc::new(Partition::new(
        PartitionKey::new("bench", "g"),
        PartitionConfig::new(BS as u32),
    ));
    let mut sub = subscribe(
        p.clone(),
        SubscribeConfig::Connect {
            endpoint,
            replay_endpoint: None,
            topic: Vec::new(),
            worker_id: 1,
            stream: 0,
        },
    )
    .expect("subscribe");
    let stats = |p: &Partition| p.ingress_stats().into_iter().next().unwrap_or_default();
    // Warm up: an empty batch as seq 0 until the subscription has it (slow joiner).
    let empty = BatchEncoder::new().finish(0.0, Some(0));
    let deadline = Instant::now() + Duration::from_secs(20);
    while stats(&p).batches == 0 {
        assert!(
            Instant::now() < deadline,
            "the subscription never connected"
        );
        rt.block_on(publisher.send(message(0, &empty))).unwrap();
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(20)).await });
    }
    // Prebuild, then flood.
    let mut payloads = Vec::with_capacity(n as usize);
    let (mut prev, mut cur) = (Vec::new(), Vec::new());
    for round in 0..n {
        payloads.push(batch(
            round,
            (round > 0).then_some(prev.as_slice()),
            &mut cur,
        ));
        std::mem::swap(&mut prev, &mut cur);
    }
    let before = stats(&p);
    let t = Instant::now();
    for (i, pl) in payloads.iter().enumerate() {
        rt.block_on(publisher.send(message(i as u64 + 1, pl)))
            .unwrap();
    }
    // Wait until the last batch is applied (or nothing moves for a second).
    let (mut last, mut last_change) = (before.batches, Instant::now());
    loop {
        let s = stats(&p);
        if s.sequence.last_seq == Some(n) && s.batches >= last {
            break;
        }
        if s.batches != last {
            last = s.batches;
            last_change = Instant::now();
        } else if last_change.elapsed() > Duration::from_secs(1) {
            break;
        }
        // Drive the runtime: the PUB socket's writes run on it.
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(2)).await });
    }
    let took = t.elapsed().as_secs_f64();
    let s = stats(&p);
    sub.stop();
    let applied = s.batches - before.batches;
    Run {
        batches_per_s: applied as f64 / took,
        blocks_per_s: (s.blocks_stored + s.blocks_removed
            - before.blocks_stored
            - before.blocks_removed) as f64
            / took,
        applied,
        lost: s.sequence.batches_lost,
    }
}

fn main() {
    let bench_mode = std::env::args().any(|a| a == "--bench");
    let n: u64 = if bench_mode {
        std::env::var("KVR_SUB_BATCHES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000)
    } else {
        200
    };
    let runs = if bench_mode { 3 } else { 1 };
    let mut results: Vec<Run> = (0..runs).map(|_| run(n)).collect();
    results.sort_by(|a, b| a.blocks_per_s.total_cmp(&b.blocks_per_s));
    for r in &results {
        println!(
            "subscriber run: {} of {n} batches applied ({} lost), {:.0} batches/s, {:.2} M blocks/s",
            r.applied,
            r.lost,
            r.batches_per_s,
            r.blocks_per_s / 1e6
        );
    }
    let m = &results[results.len() / 2];
    println!(
        "subscriber (median of {runs}): {:.0} batches/s, {:.2} M blocks/s over loopback",
        m.batches_per_s,
        m.blocks_per_s / 1e6
    );
    if let Ok(path) = std::env::var("KVR_SUBSCRIBER_JSON") {
        let runs_json: Vec<String> = results.iter().map(Run::json).collect();
        let json = format!(
            "{{\n  \"batches\": {n},\n  \"blocks_per_batch\": {},\n  \"runs\": [\n    {}\n  ],\n  \"median\": {}\n}}\n",
            2 * 4 * 16,
            runs_json.join(",\n    "),
            m.json()
        );
        std::fs::write(&path, json).unwrap_or_else(|e| panic!("writing {path}: {e}"));
        println!("subscriber: wrote {path}");
    }
    if !bench_mode {
        assert!(m.applied > 0, "nothing arrived");
    }
}
