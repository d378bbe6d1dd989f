// Shared by the service's robustness tests (tests/robustness/main.rs `include!`s it; each
// test module there has the same in-process server, hand-written HTTP client and helpers). The client is
// hand-written (no dev-dependency): the tests need full control of the request bytes (no
// content type, wrong ones, invalid UTF-8, bodies at the 8 MiB limit) and must tell a
// dropped connection from an answer.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::{json, Value};


// ---------------------------------------------------------------------------------------
// The service, in-process.
// ---------------------------------------------------------------------------------------

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: kvr_service::ServeArgs,
}

struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    fn start() -> Self {
        Self::start_with(&[])
    }

    /// A server with extra `kvr serve` flags.
    fn start_with(extra: &[&str]) -> Self {
        let mut argv = vec!["kvr-serve", "--shutdown-grace-secs", "2"];
        argv.extend_from_slice(extra);
        let cli = Cli::parse_from(argv);
        let app = kvr_service::App::new(cli.args).expect("App::new");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                kvr_service::serve_on(listener, app, async move {
                    let _ = stop_rx.await;
                })
                .await
                .expect("serve_on");
            });
        });
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("server address");
        Server {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    fn client(&self) -> Client {
        Client {
            addr: self.addr,
            conn: None,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------
// A minimal HTTP/1.1 client (keep-alive, Content-Length or chunked answers).
// ---------------------------------------------------------------------------------------

#[derive(Debug)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {}: body is not JSON ({e}): {:?}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The `error` string of a `{"error": "..."}` body, if it is one.
    fn error_text(&self) -> Option<String> {
        let v: Value = serde_json::from_slice(&self.body).ok()?;
        let o = v.as_object()?;
        o.get("error")?.as_str().map(str::to_string)
    }
}

struct Client {
    addr: SocketAddr,
    conn: Option<BufReader<TcpStream>>,
}

const READ_TIMEOUT: Duration = Duration::from_secs(20);

impl Client {
    fn get(&mut self, path: &str) -> Resp {
        self.request("GET", path, None, b"")
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    fn delete(&mut self, path: &str) -> Resp {
        self.request("DELETE", path, None, b"")
            .unwrap_or_else(|e| panic!("DELETE {path}: {e}"))
    }

    fn post_json(&mut self, method: &str, path: &str, body: &Value) -> Resp {
        let bytes = serde_json::to_vec(body).unwrap();
        self.request(method, path, Some("application/json"), &bytes)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// One request; `Err` when no answer came (connection refused, reset or closed before
    /// an answer, timeout). A reused keep-alive connection the server closed meanwhile is
    /// retried once on a fresh one; a fresh connection that gives no answer is an error.
    fn request(
        &mut self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Result<Resp, String> {
        for attempt in 0..2 {
            let reused = self.conn.is_some();
            if self.conn.is_none() {
                let s = TcpStream::connect(self.addr).map_err(|e| format!("connect: {e}"))?;
                s.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
                s.set_nodelay(true).unwrap();
                self.conn = Some(BufReader::new(s));
            }
            match self.exchange(method, path, content_type, body) {
                Ok((resp, keep)) => {
                    if !keep {
                        self.conn = None;
                    }
                    return Ok(resp);
                }
                Err((e, answered_nothing)) => {
                    self.conn = None;
                    if reused && answered_nothing && attempt == 0 {
                        continue;
                    }
                    return Err(e);
                }
            }
        }
        unreachable!()
    }

    /// `Err((why, no byte of an answer was read))`.
    fn exchange(
        &mut self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Result<(Resp, bool), (String, bool)> {
        let conn = self.conn.as_mut().unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: kvr\r\nContent-Length: {}\r\n",
            body.len()
        );
        if let Some(ct) = content_type {
            head.push_str(&format!("Content-Type: {ct}\r\n"));
        }
        head.push_str("\r\n");
        let stream = conn.get_mut();
        // Large bodies are written by another thread, so an early answer (413, 415) is
        // read while the rest is still being sent.
        let writer = if body.len() > 256 << 10 {
            let mut w = stream.try_clone().unwrap();
            let mut all = head.into_bytes();
            all.extend_from_slice(body);
            Some(std::thread::spawn(move || w.write_all(&all)))
        } else {
            let mut all = head.into_bytes();
            all.extend_from_slice(body);
            if let Err(e) = stream.write_all(&all) {
                return Err((format!("write: {e}"), true));
            }
            None
        };
        let r = read_response(conn);
        if let Some(w) = writer {
            let _ = w.join();
        }
        r
    }
}

fn read_response(conn: &mut BufReader<TcpStream>) -> Result<(Resp, bool), (String, bool)> {
    let mut line = String::new();
    match conn.read_line(&mut line) {
        Ok(0) => return Err(("connection closed before an answer".into(), true)),
        Ok(_) => {}
        Err(e) => return Err((format!("read status line: {e}"), true)),
    }
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| (format!("bad status line {line:?}"), false))?;
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        conn.read_line(&mut h)
            .map_err(|e| (format!("read header: {e}"), false))?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h
            .split_once(':')
            .ok_or_else(|| (format!("bad header {h:?}"), false))?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    let find = |name: &str| {
        headers
            .iter()
            .find(|(k, _): &&(String, String)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if let Some(n) = find("content-length") {
        let n: usize = n
            .parse()
            .map_err(|_| (format!("bad content-length {n}"), false))?;
        body.resize(n, 0);
        conn.read_exact(&mut body)
            .map_err(|e| (format!("read body: {e}"), false))?;
    } else if find("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            conn.read_line(&mut size)
                .map_err(|e| (format!("read chunk size: {e}"), false))?;
            let n = usize::from_str_radix(size.trim(), 16)
                .map_err(|_| (format!("bad chunk size {size:?}"), false))?;
            let mut chunk = vec![0; n + 2];
            conn.read_exact(&mut chunk)
                .map_err(|e| (format!("read chunk: {e}"), false))?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else if status != 204 && status != 304 {
        return Err(("answer without a length".into(), false));
    }
    let keep = !find("connection").is_some_and(|v| v.eq_ignore_ascii_case("close"));
    Ok((
        Resp {
            status,
            headers,
            body,
        },
        keep,
    ))
}

// ---------------------------------------------------------------------------------------
// Helpers.
// ---------------------------------------------------------------------------------------

/// xorshift64* (no RNG crate needed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

fn tokens(tag: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| tag * 1000 + i).collect()
}

/// A path segment for an arbitrary selection id.
fn percent_encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn register(c: &mut Client, body: Value) -> Value {
    let r = c.post_json("POST", "/workers", &body);
    assert_eq!(r.status, 201, "register {body}: {:?}", r.error_text());
    r.json()
}

fn bad_bodies_counter(c: &mut Client) -> u64 {
    let r = c.get("/metrics");
    assert_eq!(r.status, 200);
    let text = String::from_utf8(r.body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("kvr_http_bad_bodies_total "))
        .unwrap_or_else(|| panic!("no kvr_http_bad_bodies_total in /metrics:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

fn assert_alive(c: &mut Client, ctx: &str) {
    let h = c.get("/health");
    assert_eq!(h.status, 200, "{ctx}: /health");
    assert_eq!(h.json(), json!({"status": "ok"}), "{ctx}: /health");
    let s = c.post_json(
        "POST",
        "/select",
        &json!({"model_name": "m", "token_ids": tokens(1, 64)}),
    );
    assert_eq!(s.status, 200, "{ctx}: valid /select: {:?}", s.error_text());
    let w = s.json()["worker_id"].as_u64().unwrap();
    assert!(w == 1 || w == 2, "{ctx}: /select chose worker {w}");
}


fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `f` and asserts it took under a second (a liveness bound, not a benchmark).
fn quick<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "{what} took {took:?}");
    r
}

