//! A manual check against a real Dynamo 1.6.1 selection service (driven by
//! `tests/dynamo/dynamo_link.py`): our Subscriber on Dynamo's replica-sync PUB and our
//! Publisher as a replica-sync peer of Dynamo's SUB, both with Dynamo's default heartbeats.
//!
//! `dynamo_link --dynamo-pub tcp://127.0.0.1:P [--idle SECS]` prints `listening ADDR`, then
//! stats lines while idle, then `idle-done ...`, and then takes commands on stdin:
//! `recv SECS` (print the next message), `publish TOPIC_HEX PAYLOAD_HEX`, `stats`, `quit`.
//! `--no-heartbeats` (the negative control) neither answers PINGs nor sends any, nor times
//! out: Dynamo should then drop both links.

use std::time::Duration;

use bytes::Bytes;
use kvr_zmtp::{Publisher, Subscriber, ZmtpConfig};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let dynamo_pub = arg("--dynamo-pub").expect("--dynamo-pub tcp://host:port");
    let idle: u64 = arg("--idle").map_or(30, |s| s.parse().expect("--idle SECS"));

    let mut cfg = ZmtpConfig::default();
    if args.iter().any(|a| a == "--no-heartbeats") {
        cfg.answer_pings = false;
        cfg.heartbeat_interval = Duration::from_secs(3600);
        cfg.heartbeat_timeout = Duration::from_secs(3600);
    }
    let pb = Publisher::bind_with("127.0.0.1:0".parse().unwrap(), cfg.clone())
        .await
        .expect("bind");
    let topics = vec![Bytes::from_static(b"dynamo.slot-tracker.v1")];
    let (sub, mut rx) = Subscriber::with_config(topics, 64, cfg);
    sub.connect(&dynamo_pub).expect("endpoint");
    println!("listening {}", pb.local_addr());

    let start = tokio::time::Instant::now();
    while start.elapsed() < Duration::from_secs(idle) {
        tokio::time::sleep(Duration::from_secs(5)).await;
        println!(
            "stats t+{}s sub={:?} pub={:?}",
            start.elapsed().as_secs(),
            sub.stats(),
            pb.stats()
        );
    }
    // Messages that arrived while idle (there should be none) are reported, not hidden.
    while let Ok(m) = rx.try_recv() {
        println!(
            "early-message topic={:?}",
            String::from_utf8_lossy(&m.topic)
        );
    }
    println!("idle-done sub={:?} pub={:?}", sub.stats(), pb.stats());

    let (tx, mut lines) = tokio::sync::mpsc::channel::<String>(16);
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { break };
            if tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    while let Some(line) = lines.recv().await {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["recv", secs] => {
                let wait = Duration::from_secs(secs.parse().unwrap_or(5));
                match tokio::time::timeout(wait, rx.recv()).await {
                    Ok(Some(m)) => println!(
                        "received topic={} payload={} peer={}",
                        String::from_utf8_lossy(&m.topic),
                        hex(&m.payload),
                        m.peer
                    ),
                    _ => println!("no-message"),
                }
            }
            ["publish", topic, payload] => match (unhex(topic), unhex(payload)) {
                (Some(t), Some(p)) => {
                    pb.send(&t, Bytes::from(p));
                    println!("published pub={:?}", pb.stats());
                }
                _ => println!("bad-hex"),
            },
            ["stats"] => println!("stats sub={:?} pub={:?}", sub.stats(), pb.stats()),
            ["quit"] => break,
            _ => println!("unknown-command"),
        }
    }
    sub.close();
    pb.close();
}
