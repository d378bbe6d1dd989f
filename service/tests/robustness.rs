//! Robustness of `kvr serve` over real HTTP (the service in-process on 127.0.0.1:0 through
//! `serve_on`, a oneshot as its shutdown signal, a tiny HTTP/1.1 client over `TcpStream`):
//!
//! - `malformed_bodies_never_5xx_nor_drop_and_leave_state_intact`: 10,000 malformed bodies
//!   (seeded xorshift) across every POST/PATCH route: each answer is a 4xx with a JSON
//!   `{"error": "..."}` body (or a 2xx where the body happens to be valid, undone when it
//!   booked), never a 5xx other than the documented "no schedulable worker" 503s of valid
//!   bodies, never a dropped connection; `/health` and a valid `/select` keep answering
//!   between batches; the state made before (workers, a booking) is unchanged at the end;
//!   `kvr_http_bad_bodies_total` grew by at least the number of body rejections seen.
//! - `silent_and_dead_kv_event_endpoints_do_not_stall_the_service`: a worker whose KV-event
//!   endpoint accepts TCP and never speaks, and one whose port nobody listens on: 201 and
//!   schedulable, selections keep answering (each under 1 s), DELETE answers under 1 s and
//!   its subscription stops (connections closed, no reconnect).
//! - `killed_publisher_mid_stream_then_restarted_publisher_is_followed`: a Python vLLM-style
//!   publisher (tests/e2e/kvpublisher.py) is SIGKILLed in the middle of a stream of batches;
//!   the service keeps answering every route, and a new publisher on the same endpoint (seq
//!   from 0) is followed (its stores and removals reach `/overlap_scores`). Skipped when
//!   python3 lacks pyzmq/msgspec, unless `KVR_REQUIRE_PYZMQ=1`.
//!
//! Each was shown able to fail by a temporary mutation (not committed): a panic in
//! `error.rs::rejection_error` on "duplicate field" → the malformed-bodies test fails with
//! "no answer: connection closed before an answer"; no `count_bad_body()` there → it fails
//! on `kvr_http_bad_bodies_total 0 → 0`; `registry.rs::retire` leaking the subscriptions
//! (`mem::forget`) → the silent/dead test fails with "reconnected to the silent endpoint
//! after DELETE"; `engine/src/ingress/sequence.rs` dropping a sequence that went back as a
//! duplicate → the publisher test fails with "store 2 4: /overlap_scores shows 0 device
//! blocks, want 4". (Disabling the transport's own reconnect-on-disconnect was *not*
//! caught: the zeromq socket reconnects by itself.)
//!
//! The HTTP client is hand-written (no dev-dependency): the tests need full control of the
//! request bytes (no content type, wrong ones, invalid UTF-8, bodies at the 8 MiB limit) and
//! must tell a dropped connection from an answer.

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
        let cli = Cli::parse_from(["kvr-serve", "--shutdown-grace-secs", "2"]);
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

// ---------------------------------------------------------------------------------------
// 1. Malformed bodies.
// ---------------------------------------------------------------------------------------

const PH: &str = "__KVR_PLACEHOLDER__";
const LIMIT: usize = 8 << 20;

/// A POST/PATCH route and valid bodies for it (templates the generator breaks).
struct Route {
    method: &'static str,
    paths: Vec<&'static str>,
    templates: Vec<Value>,
}

fn routes() -> Vec<Route> {
    let toks = tokens(1, 40);
    vec![
        Route {
            method: "POST",
            paths: vec!["/workers"],
            templates: vec![
                json!({"worker_id": 1000, "model_name": "fuzz", "endpoint": "http://fz",
                       "kv_events_endpoint": "tcp://127.0.0.1:1", "block_size": 16,
                       "data_parallel_size": 1, "total_kv_blocks": 100,
                       "max_num_batched_tokens": 8192, "taints": ["t"],
                       "topology_domains": {"zone": "a"}, "kv_transfer_preferred_weight": 0.5,
                       "is_eagle": false, "stable_routing_id": "s"}),
                json!({"worker_id": 1001, "model_name": "fuzz", "endpoint": "http://fz",
                       "kv_events_endpoints": {"0": "tcp://127.0.0.1:1", "1": "tcp://127.0.0.1:2"},
                       "block_size": 16, "data_parallel_size": 2,
                       "data_parallel_start_rank": 0, "replay_endpoint": "tcp://127.0.0.1:3"}),
            ],
        },
        Route {
            method: "PATCH",
            paths: vec!["/workers/1000", "/workers/999999"],
            templates: vec![json!({"endpoint": "http://fz2", "block_size": 16,
                                   "total_kv_blocks": 5, "taints": [],
                                   "kv_events_endpoint": "tcp://127.0.0.1:1"})],
        },
        Route {
            method: "POST",
            paths: vec!["/select"],
            templates: vec![
                json!({"model_name": "m", "token_ids": toks, "advisory": true,
                       "allowed_worker_ids": [1, 2], "selection_id": "fz-sel",
                       "router_config_override": {"router_temperature": 0.0, "overlap_score_credit": 1.0},
                       "expected_output_tokens": 10, "priority_jump": 0.0, "lora_name": null}),
                json!({"model_name": "m", "routing_group": "default",
                       "block_hashes": [1, 2], "sequence_hashes": [3, 4], "isl_tokens": 32,
                       "pinned_worker": {"worker_id": 2, "dp_rank": 0}}),
                json!({"model_name": "m", "token_ids": toks, "session_id": "s1",
                       "session_context": {"session_id": "s1", "session_final": false},
                       "cache_salt": "salt", "block_mm_infos": [null, {"mm_objects": [{"mm_hash": 7}]}]}),
            ],
        },
        Route {
            method: "POST",
            paths: vec!["/select_and_reserve"],
            templates: vec![
                json!({"model_name": "m", "token_ids": toks}),
                json!({"model_name": "m", "selection_id": "fz-sr", "token_ids": toks,
                       "expected_output_tokens": 3, "allowed_worker_ids": [1]}),
            ],
        },
        Route {
            method: "POST",
            paths: vec!["/potential_loads", "/overlap_scores"],
            templates: vec![
                json!({"model_name": "m", "token_ids": toks}),
                json!({"model_name": "m", "block_hashes": [5, 6], "sequence_hashes": [7, 8],
                       "isl_tokens": 32}),
            ],
        },
        Route {
            method: "POST",
            paths: vec!["/reservations"],
            templates: vec![
                json!({"selection_id": "fz-r", "model_name": "m", "worker_id": 1,
                       "dp_rank": 0, "token_ids": toks}),
                json!({"selection_id": "fz-sel", "model_name": "m"}),
            ],
        },
        Route {
            method: "POST",
            paths: vec![
                "/reservations/fz-booking/prefill_complete",
                "/reservations/fz-nope/prefill_complete",
            ],
            templates: vec![json!({})],
        },
        Route {
            method: "POST",
            paths: vec![
                "/reservations/fz-booking/output_block",
                "/reservations/fz-nope/output_block",
            ],
            templates: vec![json!({"decay_fraction": 0.5}), json!({})],
        },
    ]
}

/// Every key path (objects only) of a JSON value, with the value there.
fn key_paths(v: &Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    if let Value::Object(m) = v {
        for (k, child) in m {
            prefix.push(k.clone());
            out.push(prefix.clone());
            key_paths(child, prefix, out);
            prefix.pop();
        }
    }
}

fn set_path(v: &mut Value, path: &[String], new: Value) {
    let mut cur = v;
    for k in &path[..path.len() - 1] {
        cur = cur.get_mut(k).unwrap();
    }
    cur[path.last().unwrap().as_str()] = new;
}

/// `template` with the value at a random key path replaced by the raw JSON text `raw`.
fn with_raw_field(rng: &mut Rng, template: &Value, raw: &str) -> Vec<u8> {
    let mut paths = Vec::new();
    key_paths(template, &mut Vec::new(), &mut paths);
    if paths.is_empty() {
        return format!("{{\"decay_fraction\":{raw}}}").into_bytes();
    }
    let p = rng.pick(&paths).clone();
    // A booking named "" cannot be freed over HTTP (`DELETE /reservations/` is no route),
    // so it would stay in the load until its TTL: not generated (see the report).
    let raw = if raw == "\"\"" && p.last().is_some_and(|k| k == "selection_id") {
        "\" \""
    } else {
        raw
    };
    let mut v = template.clone();
    set_path(&mut v, &p, Value::String(PH.into()));
    serde_json::to_string(&v)
        .unwrap()
        .replacen(&format!("\"{PH}\""), raw, 1)
        .into_bytes()
}

const WRONG_TYPES: &[&str] = &[
    "null",
    "true",
    "false",
    "0",
    "7", // (not 1, 2 or 3: a valid worker_id of the baseline would replace that worker)
    "-1",
    "1.5",
    "\"s\"",
    "\"\"",
    "[]",
    "[1]",
    "[\"x\"]",
    "{}",
    "{\"a\":1}",
    "[[[]]]",
    "[null]",
    "\"1\"",
];
const HUGE_NUMBERS: &[&str] = &[
    "1e400",
    "-1e400",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999999999999999999",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "1.7976931348623157e308",
    "5e-324",
    "1e308",
    "123456789012345678901234567890.5",
];
const NEGATIVE_NUMBERS: &[&str] = &[
    "-1",
    "-0",
    "-0.0",
    "-4294967296",
    "-9223372036854775808",
    "-9223372036854775809",
    "-1e10",
    "-0.5",
    "-18446744073709551615",
];
const CONTENT_TYPES: &[Option<&str>] = &[
    None,
    Some("text/plain"),
    Some("application/x-www-form-urlencoded"),
    Some("multipart/form-data; boundary=x"),
    Some("application/jsonx"),
    Some("json"),
    Some(""),
    Some("application/xml"),
    Some("application/json; charset=utf-8"),
    Some("application/vnd.api+json"),
    Some("APPLICATION/JSON"),
    // (A control character in the header is not HTTP: hyper answers 400 with an empty body
    // before the service sees it, so it is no body test and is not sent.)
];

/// One malformed (or occasionally valid) body: (content type, bytes, kind).
fn malformed(
    rng: &mut Rng,
    template: &Value,
    big: bool,
) -> (Option<String>, Vec<u8>, &'static str) {
    let valid = serde_json::to_vec(template).unwrap();
    let ct = Some("application/json".to_string());
    if big {
        // A huge array near the body limit: under it (parsed), or just over (413).
        let target = LIMIT - (64 << 10) + rng.below(128 << 10);
        let elem: &[u8] =
            rng.pick::<&[u8]>(&[&b"1,"[..], b"4294967295,", b"-1,", b"[],", b"\"x\","]);
        let mut body = b"{\"model_name\":\"m\",\"token_ids\":[".to_vec();
        while body.len() + elem.len() + 2 < target {
            body.extend_from_slice(elem);
        }
        body.extend_from_slice(if rng.chance(50) { b"7]}" } else { b"\"end\"]}" });
        return (ct, body, "huge-array");
    }
    match rng.below(15) {
        0 => {
            let n = rng.below(300);
            let bytes = (0..n).map(|_| rng.next() as u8).collect();
            (ct, bytes, "random-bytes")
        }
        1 => {
            let cut = rng.below(valid.len().max(1));
            (ct, valid[..cut].to_vec(), "truncated")
        }
        2 | 3 => {
            let raw = *rng.pick(WRONG_TYPES);
            (ct, with_raw_field(rng, template, raw), "wrong-type")
        }
        4 => {
            let raw = *rng.pick(HUGE_NUMBERS);
            (ct, with_raw_field(rng, template, raw), "huge-number")
        }
        5 => {
            let raw = *rng.pick(NEGATIVE_NUMBERS);
            (ct, with_raw_field(rng, template, raw), "negative-number")
        }
        6 => {
            let depth = if rng.chance(20) {
                100_000
            } else {
                1 + rng.below(300)
            };
            let open = *rng.pick(&["[", "{\"a\":", "[{\"x\":"]);
            let nested = open.repeat(depth);
            let body = if rng.chance(50) {
                nested.into_bytes()
            } else {
                with_raw_field(rng, template, &nested)
            };
            (ct, body, "deep-nesting")
        }
        7 => {
            let ct = rng.pick(CONTENT_TYPES).map(str::to_string);
            let body = if rng.chance(30) { Vec::new() } else { valid };
            (ct, body, "content-type")
        }
        8 => {
            let mut b = valid;
            for _ in 0..1 + rng.below(3) {
                let at = rng.below(b.len() + 1);
                b.insert(at, 0);
            }
            (ct, b, "nul-bytes")
        }
        9 => {
            let mut b = valid;
            let bad: &[u8] = rng.pick::<&[u8]>(&[
                &[0xff][..],
                &[0xc0, 0x80],
                &[0xed, 0xa0, 0x80],
                &[0xf8, 0x88, 0x80, 0x80, 0x80],
                &[0xe2, 0x82],
                &[0x80],
            ]);
            // Inside a string when there is one, else anywhere.
            let at = b
                .iter()
                .enumerate()
                .filter(|(_, c)| **c == b'"')
                .map(|(i, _)| i + 1)
                .nth(rng.below(4))
                .unwrap_or_else(|| rng.below(b.len() + 1))
                .min(b.len());
            b.splice(at..at, bad.iter().copied());
            (ct, b, "invalid-utf8")
        }
        10 => {
            let mut b = valid;
            for _ in 0..1 + rng.below(4) {
                let at = rng.below(b.len());
                b[at] ^= 1 << rng.below(8);
            }
            (ct, b, "bit-flips")
        }
        11 => {
            let top = *rng.pick(&[
                "[1,2]", "\"s\"", "1", "null", "true", "[]", "{}", "", " ", "\n", "[{}]",
            ]);
            (ct, top.as_bytes().to_vec(), "not-an-object")
        }
        12 => {
            // A duplicated key.
            let s = String::from_utf8(valid).unwrap();
            let body = match s.find(',') {
                Some(i) if s.len() > 2 => format!("{{{},{}", &s[1..i], &s[1..]),
                _ => s,
            };
            (ct, body.into_bytes(), "duplicate-key")
        }
        13 => {
            let raw = rng.pick(&[
                "\"\\u0000\"",
                "\"\\ud800\"",
                "\"\\uZZZZ\"",
                "\"a\\\"",
                "NaN",
                "Infinity",
                "01",
                "1.",
                ".5",
                "+1",
                "0x10",
                "'s'",
                "tru",
            ]);
            (ct, with_raw_field(rng, template, raw), "bad-literal")
        }
        _ => (ct, valid, "valid"),
    }
}

/// What the fuzz loop must undo or remember of a 2xx answer.
fn account_success(
    c: &mut Client,
    path: &str,
    resp: &Resp,
    fuzz_workers: &mut BTreeSet<u64>,
    booked: &mut usize,
) {
    let v = resp.json();
    match path {
        "/workers" => {
            let id = v["worker_id"].as_u64().expect("record with worker_id");
            assert!(
                ![1, 2, 3].contains(&id),
                "a fuzz body replaced worker {id}: {v}"
            );
            // ("default" when a fuzzed `model_name` became null; never the baseline's m.)
            assert_ne!(v["model_name"], "m", "{v}");
            fuzz_workers.insert(id);
        }
        "/select_and_reserve" | "/reservations" => {
            let id = v["selection_id"]
                .as_str()
                .expect("selection_id")
                .to_string();
            assert_ne!(id, "base-booking");
            let f = c.delete(&format!("/reservations/{}", percent_encode(&id)));
            assert_eq!(
                f.status,
                200,
                "freeing {id:?} booked by a fuzz body: {:?}",
                f.error_text()
            );
            *booked += 1;
        }
        _ => {}
    }
}

#[test]
fn malformed_bodies_never_5xx_nor_drop_and_leave_state_intact() {
    let server = Server::start();
    let mut c = server.client();
    // The valid state: two workers of model m, one booking on it; a sacrificial worker and
    // booking in model "fuzz" (fuzz bodies may touch those).
    for id in [1u64, 2] {
        register(
            &mut c,
            json!({"worker_id": id, "model_name": "m", "endpoint": format!("http://w{id}"),
                   "kv_events_endpoint": "tcp://127.0.0.1:1", "block_size": 16}),
        );
    }
    register(
        &mut c,
        json!({"worker_id": 3, "model_name": "fuzz", "endpoint": "http://w3",
               "kv_events_endpoint": "tcp://127.0.0.1:1", "block_size": 16}),
    );
    let b = c.post_json(
        "POST",
        "/select_and_reserve",
        &json!({"model_name": "m", "selection_id": "base-booking", "token_ids": tokens(9, 64)}),
    );
    assert_eq!(b.status, 200, "{:?}", b.error_text());
    let b = c.post_json(
        "POST",
        "/select_and_reserve",
        &json!({"model_name": "fuzz", "selection_id": "fz-booking", "token_ids": tokens(8, 32)}),
    );
    assert_eq!(b.status, 200, "{:?}", b.error_text());
    let workers_before = c.get("/workers?model_name=m").json();
    let loads_before = c.get("/loads?model_name=m").json();
    assert_eq!(workers_before.as_array().unwrap().len(), 2);
    assert_eq!(
        loads_before[0]["loads"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["active_requests"].as_u64().unwrap())
            .sum::<u64>(),
        1,
        "{loads_before}"
    );
    let bad_before = bad_bodies_counter(&mut c);
    assert_alive(&mut c, "before");

    let routes = routes();
    let mut rng = Rng(0x0005_eed0_f4b0_d1e5);
    let total = 10_000;
    let big_every = 500; // 20 bodies near the 8 MiB limit
    let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
    let mut by_kind: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut rejections = 0u64; // answers the body parser gave (counted by the service)
    let mut documented_503 = 0usize;
    let mut fuzz_workers = BTreeSet::new();
    let mut booked = 0usize;
    let started = Instant::now();
    for i in 0..total {
        let route = &routes[i % routes.len()];
        let path = *rng.pick(&route.paths);
        let template = rng.pick(&route.templates).clone();
        let (ct, body, kind) = malformed(&mut rng, &template, i % big_every == big_every - 1);
        *by_kind.entry(kind).or_default() += 1;
        let resp = c
            .request(route.method, path, ct.as_deref(), &body)
            .unwrap_or_else(|e| {
                panic!(
                    "#{i} {} {path} ({kind}, ct {ct:?}): no answer: {e}; body {:?}",
                    route.method,
                    String::from_utf8_lossy(&body[..body.len().min(300)])
                )
            });
        *by_status.entry(resp.status).or_default() += 1;
        let show = || {
            format!(
                "#{i} {} {path} ({kind}, ct {ct:?}, {} bytes) → {} {:?}; body {:?}",
                route.method,
                body.len(),
                resp.status,
                String::from_utf8_lossy(&resp.body[..resp.body.len().min(300)]),
                String::from_utf8_lossy(&body[..body.len().min(300)])
            )
        };
        match resp.status {
            200..=299 => {
                assert!(
                    serde_json::from_slice::<Value>(&resp.body).is_ok(),
                    "{}",
                    show()
                );
                account_success(&mut c, path, &resp, &mut fuzz_workers, &mut booked);
            }
            400..=499 => {
                let err = resp
                    .error_text()
                    .unwrap_or_else(|| panic!("4xx without a JSON error body: {}", show()));
                assert!(
                    resp.header("content-type")
                        .is_some_and(|v| v.starts_with("application/json")),
                    "{}",
                    show()
                );
                if err.starts_with("Failed to parse the request body as JSON")
                    || err.starts_with("Failed to deserialize the JSON body")
                    || err.starts_with("Expected request with `Content-Type")
                    || err.starts_with("Failed to buffer the request body")
                {
                    rejections += 1;
                }
            }
            503 => {
                // Documented answers of a *valid* body whose partition or allowed set has
                // no schedulable worker (a fuzzed `allowed_worker_ids`, say).
                let err = resp.error_text().unwrap_or_default();
                let legit = serde_json::from_slice::<Value>(&body).is_ok()
                    && (err.starts_with("no schedulable workers")
                        || err == "no endpoints available to route work");
                assert!(legit, "5xx: {}", show());
                documented_503 += 1;
            }
            _ => panic!("unexpected status: {}", show()),
        }
        if i % 500 == 499 {
            assert_alive(&mut c, &format!("after body #{i}"));
        }
    }
    let elapsed = started.elapsed();
    eprintln!(
        "{total} bodies in {elapsed:.1?}: statuses {by_status:?}; kinds {by_kind:?}; \
         {rejections} parser rejections, {documented_503} documented 503s, \
         {booked} fuzz bookings freed, fuzz workers {fuzz_workers:?}"
    );
    assert_alive(&mut c, "at the end");
    // Most bodies must have been refused (the generator really is malformed).
    assert!(
        by_status.range(400..500).map(|(_, n)| n).sum::<usize>() > total * 7 / 10,
        "{by_status:?}"
    );

    // The valid state is intact.
    assert_eq!(c.get("/workers?model_name=m").json(), workers_before);
    assert_eq!(c.get("/loads?model_name=m").json(), loads_before);
    let all: BTreeSet<u64> = c
        .get("/workers")
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["worker_id"].as_u64().unwrap())
        .collect();
    let expected: BTreeSet<u64> = [1, 2, 3].into_iter().chain(fuzz_workers).collect();
    assert_eq!(all, expected);
    // The counter of malformed bodies grew by at least what the parser refused here
    // (it is process-wide: the other tests only add to it).
    let bad_after = bad_bodies_counter(&mut c);
    assert!(
        bad_after >= bad_before + rejections && rejections > 0,
        "kvr_http_bad_bodies_total {bad_before} → {bad_after}, {rejections} rejections seen"
    );
    // The booking made before is still there (and can be freed once).
    assert_eq!(c.delete("/reservations/base-booking").status, 200);
    assert_eq!(c.delete("/reservations/base-booking").status, 404);
}

// ---------------------------------------------------------------------------------------
// 2. KV-event endpoints that never answer.
// ---------------------------------------------------------------------------------------

/// A TCP port that accepts connections and never sends a byte; it records how many
/// connections it accepted and how many of them the peer has closed.
struct SilentPeer {
    port: u16,
    accepted: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl SilentPeer {
    fn start() -> Self {
        Self::on(TcpListener::bind("127.0.0.1:0").unwrap())
    }

    fn on(l: TcpListener) -> Self {
        let port = l.local_addr().unwrap().port();
        l.set_nonblocking(true).unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let open = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, o, s) = (accepted.clone(), open.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut conns: Vec<Option<TcpStream>> = Vec::new();
            while !s.load(Ordering::Relaxed) {
                if let Ok((c, _)) = l.accept() {
                    c.set_nonblocking(true).unwrap();
                    conns.push(Some(c));
                    a.fetch_add(1, Ordering::Relaxed);
                }
                // Read (and drop) whatever the peer sends; EOF or reset = closed.
                for slot in &mut conns {
                    if let Some(c) = slot {
                        let mut buf = [0u8; 4096];
                        match c.read(&mut buf) {
                            Ok(0) => *slot = None,
                            Ok(_) => {}
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                            Err(_) => *slot = None,
                        }
                    }
                }
                o.store(conns.iter().flatten().count(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        SilentPeer {
            port,
            accepted,
            open,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for SilentPeer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
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

#[test]
fn silent_and_dead_kv_event_endpoints_do_not_stall_the_service() {
    let server = Server::start();
    let mut c = server.client();
    let silent = SilentPeer::start();
    let dead_port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    for (id, port) in [(11u64, silent.port), (12, dead_port)] {
        let rec = quick(&format!("register worker {id}"), || {
            register(
                &mut c,
                json!({"worker_id": id, "model_name": "silent", "endpoint": format!("http://w{id}"),
                       "kv_events_endpoint": format!("tcp://127.0.0.1:{port}"), "block_size": 16}),
            )
        });
        assert_eq!(rec["lifecycle"], "schedulable", "{rec}");
    }
    // The subscriber did reach the silent peer (and is now stuck in its handshake).
    assert!(
        wait_until(Duration::from_secs(5), || silent
            .accepted
            .load(Ordering::Relaxed)
            > 0),
        "the service never connected to the silent KV-event endpoint"
    );
    let ready = c.get("/ready");
    assert_eq!(ready.status, 200);
    assert_eq!(ready.json()["schedulable_workers"], 2);

    let started = Instant::now();
    for i in 0..60u32 {
        let id = 11 + u64::from(i % 2);
        let body = match i % 3 {
            0 => {
                json!({"model_name": "silent", "token_ids": tokens(i, 48), "pinned_worker": {"worker_id": id}})
            }
            1 => {
                json!({"model_name": "silent", "token_ids": tokens(i, 48), "allowed_worker_ids": [id]})
            }
            _ => json!({"model_name": "silent", "token_ids": tokens(i, 48)}),
        };
        let r = quick(&format!("select #{i}"), || {
            c.post_json("POST", "/select", &body)
        });
        assert_eq!(r.status, 200, "select #{i}: {:?}", r.error_text());
        if i % 3 != 2 {
            assert_eq!(r.json()["worker_id"], id, "select #{i}");
        }
    }
    let r = quick("select_and_reserve", || {
        c.post_json(
            "POST",
            "/select_and_reserve",
            &json!({"model_name": "silent", "selection_id": "s-1", "token_ids": tokens(3, 48)}),
        )
    });
    assert_eq!(r.status, 200, "{:?}", r.error_text());
    let o = quick("overlap_scores", || {
        c.post_json(
            "POST",
            "/overlap_scores",
            &json!({"model_name": "silent", "token_ids": tokens(3, 48)}),
        )
    });
    assert_eq!(o.status, 200);
    assert_eq!(
        o.json()["workers"].as_array().unwrap().len(),
        2,
        "{}",
        o.json()
    );
    assert_eq!(c.delete("/reservations/s-1").status, 200);
    eprintln!(
        "60 selections against silent/dead KV endpoints in {:?}",
        started.elapsed()
    );

    // DELETE answers promptly, and the subscriptions stop.
    for id in [11u64, 12] {
        let r = quick(&format!("DELETE /workers/{id}"), || {
            c.delete(&format!("/workers/{id}"))
        });
        assert_eq!(r.status, 200, "{:?}", r.error_text());
        assert_eq!(r.json()["lifecycle"], "unschedulable");
    }
    assert!(
        wait_until(Duration::from_secs(3), || silent
            .open
            .load(Ordering::Relaxed)
            == 0),
        "the silent endpoint's connection stayed open after DELETE ({} open)",
        silent.open.load(Ordering::Relaxed)
    );
    let accepted = silent.accepted.load(Ordering::Relaxed);
    // Someone listening on the dead port now would be connected to within the
    // subscriber's 500 ms reconnect interval if it were still running.
    let late = SilentPeer::on(TcpListener::bind(("127.0.0.1", dead_port)).unwrap());
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        silent.accepted.load(Ordering::Relaxed),
        accepted,
        "the service reconnected to the silent endpoint after DELETE"
    );
    assert_eq!(
        late.accepted.load(Ordering::Relaxed),
        0,
        "the service still connects to the dead endpoint after DELETE"
    );
    assert_eq!(c.get("/workers").json(), json!([]));
    assert_eq!(c.get("/health").status, 200);
}

// ---------------------------------------------------------------------------------------
// 3. A publisher killed mid-stream, then restarted.
// ---------------------------------------------------------------------------------------

fn python_ready() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import zmq, msgspec"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var("KVR_REQUIRE_PYZMQ").as_deref() != Ok("1"),
            "KVR_REQUIRE_PYZMQ=1 but python3 with pyzmq and msgspec is missing"
        );
        eprintln!("SKIPPED: python3 with pyzmq and msgspec not found (pip install pyzmq msgspec)");
    }
    ok
}

/// `tests/robustness_publisher.py` as a child: commands on stdin, answers on stdout.
struct Publisher {
    child: Child,
    stdin: std::process::ChildStdin,
    lines: mpsc::Receiver<String>,
    streamed: Arc<Mutex<u64>>,
}

impl Publisher {
    fn start(port: u16) -> Self {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/robustness_publisher.py");
        let mut child = Command::new("python3")
            .arg(script)
            .args([port.to_string(), "16".to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start python3");
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, rx) = mpsc::channel();
        let streamed = Arc::new(Mutex::new(0));
        let s = streamed.clone();
        std::thread::spawn(move || {
            for l in out.lines() {
                let Ok(l) = l else { break };
                if let Some(n) = l.strip_prefix("STREAMED ") {
                    *s.lock().unwrap() = n.trim().parse().unwrap_or(0);
                } else if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut p = Publisher {
            child,
            stdin,
            lines: rx,
            streamed,
        };
        assert_eq!(p.line(), "READY");
        p
    }

    fn line(&mut self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(15))
            .expect("a line from the publisher")
    }

    fn cmd(&mut self, c: &str) -> String {
        writeln!(self.stdin, "{c}").unwrap();
        self.stdin.flush().unwrap();
        self.line()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn device_blocks(c: &mut Client, model: &str, toks: &[u32]) -> u64 {
    let r = c.post_json(
        "POST",
        "/overlap_scores",
        &json!({"model_name": model, "token_ids": toks}),
    );
    assert_eq!(r.status, 200, "{:?}", r.error_text());
    r.json()["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["device_blocks"].as_u64().unwrap())
        .max()
        .unwrap_or(0)
}

/// Publishes `cmd` (idempotent) until `/overlap_scores` of `toks` shows `want` device
/// blocks; republishes every second (a PUB drops what it sends before the SUBSCRIBE
/// arrived). Returns how long it took.
fn publish_until(
    c: &mut Client,
    p: &mut Publisher,
    cmd: &str,
    toks: &[u32],
    want: u64,
) -> Duration {
    let t = Instant::now();
    let mut last_pub = None::<Instant>;
    loop {
        if last_pub.map_or(true, |l| l.elapsed() > Duration::from_secs(1)) {
            let a = p.cmd(cmd);
            assert!(a.starts_with("SEQ "), "{cmd}: {a}");
            last_pub = Some(Instant::now());
        }
        let got = device_blocks(c, "pk", toks);
        if got == want {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "{cmd}: /overlap_scores shows {got} device blocks, want {want}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn all_routes_answer(c: &mut Client, ctx: &str) {
    for path in ["/health", "/ready", "/workers", "/loads", "/metrics"] {
        assert_eq!(c.get(path).status, 200, "{ctx}: GET {path}");
    }
    let p = json!({"model_name": "pk", "token_ids": tokens(5, 64)});
    for path in ["/select", "/potential_loads", "/overlap_scores"] {
        let r = quick(&format!("{ctx}: POST {path}"), || {
            c.post_json("POST", path, &p)
        });
        assert_eq!(r.status, 200, "{ctx}: POST {path}: {:?}", r.error_text());
    }
    let r = c.post_json(
        "POST",
        "/select_and_reserve",
        &json!({"model_name": "pk", "selection_id": "pk-1", "token_ids": tokens(5, 64)}),
    );
    assert_eq!(
        r.status,
        200,
        "{ctx}: select_and_reserve: {:?}",
        r.error_text()
    );
    for path in [
        "/reservations/pk-1/prefill_complete",
        "/reservations/pk-1/output_block",
    ] {
        let r = c.post_json("POST", path, &json!({}));
        assert_eq!(r.status, 200, "{ctx}: POST {path}: {:?}", r.error_text());
    }
    assert_eq!(c.delete("/reservations/pk-1").status, 200, "{ctx}: free");
    let r = c.post_json("PATCH", "/workers/1", &json!({"total_kv_blocks": 1000}));
    assert_eq!(r.status, 200, "{ctx}: PATCH: {:?}", r.error_text());
    assert_eq!(r.json()["lifecycle"], "schedulable", "{ctx}");
}

#[test]
fn killed_publisher_mid_stream_then_restarted_publisher_is_followed() {
    if !python_ready() {
        return;
    }
    let server = Server::start();
    let mut c = server.client();
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut p = Publisher::start(port);
    let rec = register(
        &mut c,
        json!({"worker_id": 1, "model_name": "pk", "endpoint": "http://w1",
               "kv_events_endpoint": format!("tcp://127.0.0.1:{port}"), "block_size": 16}),
    );
    assert_eq!(rec["lifecycle"], "schedulable");
    register(
        &mut c,
        json!({"worker_id": 2, "model_name": "pk", "endpoint": "http://w2",
               "kv_events_endpoint": "tcp://127.0.0.1:1", "block_size": 16}),
    );
    assert_eq!(p.cmd("peer 10"), "PEER 1", "the service never connected");
    let p1 = tokens(1, 64);
    let took = publish_until(&mut c, &mut p, "store 1 4", &p1, 4);
    eprintln!("first publisher's stores indexed after {took:?}");

    // A stream of batches, killed in the middle.
    writeln!(p.stdin, "stream").unwrap();
    p.stdin.flush().unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || *p.streamed.lock().unwrap()
            >= 300),
        "the publisher did not stream"
    );
    // Selections are served while the stream runs...
    for i in 0..20 {
        let r = quick(&format!("select during the stream #{i}"), || {
            c.post_json(
                "POST",
                "/select",
                &json!({"model_name": "pk", "token_ids": p1}),
            )
        });
        assert_eq!(r.status, 200, "{:?}", r.error_text());
    }
    p.child.kill().unwrap(); // SIGKILL
    let status = p.child.wait().unwrap();
    let streamed = *p.streamed.lock().unwrap();
    eprintln!("publisher killed ({status}) after streaming at least {streamed} batches");
    drop(p);

    // ... and after the kill.
    for i in 0..5 {
        all_routes_answer(&mut c, &format!("after the kill #{i}"));
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = c.post_json(
        "POST",
        "/select",
        &json!({"model_name": "pk", "token_ids": p1}),
    );
    assert_eq!(r.status, 200);
    eprintln!(
        "after the kill: P1 device blocks {} (chosen worker {})",
        device_blocks(&mut c, "pk", &p1),
        r.json()["worker_id"]
    );

    // A restart: a new publisher on the same endpoint, seq from 0.
    let mut p = Publisher::start(port);
    assert_eq!(p.cmd("peer 10"), "PEER 1", "the service never reconnected");
    let p2 = tokens(2, 64);
    let took = publish_until(&mut c, &mut p, "store 2 4", &p2, 4);
    eprintln!(
        "restarted publisher's stores indexed after {took:?}; the first one's P1 now shows {} device blocks",
        device_blocks(&mut c, "pk", &p1)
    );
    let r = c.post_json(
        "POST",
        "/select",
        &json!({"model_name": "pk", "token_ids": p2}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["worker_id"], 1, "P2 is cached on worker 1 only");
    assert_eq!(r.json()["overlap"]["gpu"], 64, "{}", r.json());
    // Its removals are followed too.
    let took = publish_until(&mut c, &mut p, "remove 2 4", &p2, 0);
    eprintln!("restarted publisher's removals indexed after {took:?}");
    let p3 = tokens(3, 32);
    publish_until(&mut c, &mut p, "store 3 2", &p3, 2);
    all_routes_answer(&mut c, "after the restart");
}
