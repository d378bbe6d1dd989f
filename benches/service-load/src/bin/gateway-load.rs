//! A closed-loop HTTP/1.1 load client for the gateway benchmark (tests/gateway/bench.py):
//! C connections, each sending POSTs back to back for a fixed time, the bodies taken in
//! turn from the given files (or, with `--shared-order`, each file once in order across all
//! connections). Prints one JSON line: answers by status, requests/s of 2xx answers and
//! their latency percentiles. It is in Rust so that the client is not what
//! limits 64 streams on a small machine (a Python client with threads would be).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

#[derive(Parser, Debug)]
#[command(about = "Closed-loop HTTP/1.1 POST load: C connections for S seconds; one JSON line out")]
struct Args {
    /// Loopback port to send to.
    #[arg(long)]
    port: u16,
    /// Request path.
    #[arg(long, default_value = "/v1/completions")]
    path: String,
    /// Concurrent connections (one request in flight on each).
    #[arg(long, default_value_t = 1)]
    conc: usize,
    /// Seconds to send for.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// One order for all connections: each request takes the next file, so each file is
    /// sent once until the list wraps (a conversation's turns in order; `wrapped` in the
    /// output says whether it did).
    #[arg(long)]
    shared_order: bool,
    /// JSON request bodies, one per file, sent in turn (connection i starts at file i).
    #[arg(required = true)]
    bodies: Vec<String>,
}

/// What one connection saw.
struct Tally {
    latency_us: Histogram<u64>,
    statuses: BTreeMap<String, u64>,
}

impl Tally {
    fn new() -> Self {
        Tally {
            // 1 µs to 100 s, 3 significant digits.
            latency_us: Histogram::new_with_bounds(1, 100_000_000, 3).expect("valid bounds"),
            statuses: BTreeMap::new(),
        }
    }
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(port: u16) -> Result<Sender, String> {
    let stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

async fn one(sender: &mut Sender, path: &str, body: Bytes) -> Result<u16, String> {
    let req = Request::post(path)
        .header("host", "gateway")
        .header("content-type", "application/json")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    sender.ready().await.map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    resp.into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(status)
}

async fn drive(
    port: u16,
    path: String,
    bodies: Vec<Bytes>,
    first: usize,
    shared: Option<Arc<AtomicUsize>>,
    until: Instant,
) -> Tally {
    let mut t = Tally::new();
    let mut next = first;
    let mut sender = None;
    while Instant::now() < until {
        if sender.is_none() {
            match connect(port).await {
                Ok(s) => sender = Some(s),
                Err(e) => {
                    *t.statuses.entry(e).or_default() += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            }
        }
        let i = match &shared {
            Some(n) => n.fetch_add(1, Ordering::Relaxed),
            None => {
                next += 1;
                next - 1
            }
        };
        let body = bodies[i % bodies.len()].clone();
        let start = Instant::now();
        match one(sender.as_mut().expect("connected above"), &path, body).await {
            Ok(status) => {
                if (200..300).contains(&status) {
                    let us = start.elapsed().as_micros().max(1) as u64;
                    t.latency_us.saturating_record(us);
                }
                *t.statuses.entry(status.to_string()).or_default() += 1;
            }
            Err(e) => {
                *t.statuses.entry(format!("error: {e}")).or_default() += 1;
                sender = None;
            }
        }
    }
    t
}

fn main() {
    let a = Args::parse();
    let bodies: Vec<Bytes> = a
        .bodies
        .iter()
        .map(|p| match std::fs::read(p) {
            Ok(b) => Bytes::from(b),
            Err(e) => {
                eprintln!("gateway-load: {p}: {e}");
                std::process::exit(2);
            }
        })
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let shared = a.shared_order.then(|| Arc::new(AtomicUsize::new(0)));
    let (tallies, elapsed) = rt.block_on(async {
        let start = Instant::now();
        let until = start + Duration::from_secs_f64(a.secs);
        let tasks: Vec<_> = (0..a.conc)
            .map(|i| {
                let d = drive(
                    a.port,
                    a.path.clone(),
                    bodies.clone(),
                    i,
                    shared.clone(),
                    until,
                );
                tokio::spawn(d)
            })
            .collect();
        let mut tallies = Vec::new();
        for t in tasks {
            tallies.push(t.await.expect("a load task"));
        }
        (tallies, start.elapsed().as_secs_f64())
    });
    let mut all = Tally::new();
    for t in tallies {
        all.latency_us.add(&t.latency_us).expect("same bounds");
        for (k, v) in t.statuses {
            *all.statuses.entry(k).or_default() += v;
        }
    }
    let ok = all.latency_us.len();
    let ms = |q: f64| all.latency_us.value_at_quantile(q) as f64 / 1000.0;
    let out = serde_json::json!({
        "conc": a.conc,
        "elapsed_s": elapsed,
        "ok": ok,
        "statuses": all.statuses,
        "rps": ok as f64 / elapsed,
        "p50_ms": ms(0.5),
        "p90_ms": ms(0.9),
        "p99_ms": ms(0.99),
        "mean_ms": all.latency_us.mean() / 1000.0,
        "wrapped": shared.is_some_and(|n| n.load(Ordering::Relaxed) > bodies.len()),
    });
    println!("{out}");
}
