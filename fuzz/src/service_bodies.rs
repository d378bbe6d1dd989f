//! Target (d): arbitrary request bodies → `kvr serve`'s HTTP routes, in-process.
//!
//! One [`App`](kvr_service::App) is built once (lazily) with two schedulable workers of
//! model `m` (ids 1 and 2, block size 16, KV-event endpoints nobody listens on) and one
//! booking (`base`), all registered through the router. Each input is
//! `[selector, body...]`: `selector % ROUTES.len()` picks a POST/PATCH route,
//! `selector / ROUTES.len() % 10` the content type (JSON or msgpack); the rest is sent as the body through
//! `routes::router(app)` (built once, cloned per request) with `tower::ServiceExt::oneshot` on a current-thread tokio
//! runtime.
//!
//! Asserted: no panic; every status below 500, except the documented 503s of a valid JSON
//! body naming a partition or an allowed set without a schedulable worker; every 4xx is
//! `application/json` with an `{"error": "<string>"}` body; every 2xx is JSON; and the
//! hand-read `token_ids` of the body agree with serde's reading of it
//! (`kvr_service::fuzzing`).
//!
//! To keep inputs independent, what a 2xx changed is undone after it: a worker registered
//! by the input is deleted, a booking it made is freed, and the base workers are
//! registered again after any 2xx on a `/workers` route.

use std::sync::OnceLock;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use clap::{Args, FromArgMatches};
use kvr_service::App;
use serde_json::Value;
use tower::ServiceExt;

/// (method, path) by selector.
pub const ROUTES: &[(&str, &str)] = &[
    ("POST", "/workers"),
    ("PATCH", "/workers/1"),
    ("POST", "/select"),
    ("POST", "/select_and_reserve"),
    ("POST", "/potential_loads"),
    ("POST", "/overlap_scores"),
    ("POST", "/reservations"),
    ("POST", "/reservations/base/prefill_complete"),
    ("POST", "/reservations/base/output_block"),
    ("PATCH", "/workers/777"),
    ("POST", "/reservations/nope/output_block"),
];

/// Content types by `selector / ROUTES.len() % 10`: JSON mostly, msgpack (kvr's binary
/// form: the body is then read as msgpack, malformed or not), and refused ones.
const CONTENT_TYPES: [Option<&str>; 10] = [
    Some("application/json"),
    Some("application/json"),
    Some("application/json"),
    Some("application/json"),
    Some("application/json; charset=utf-8"),
    None,
    Some("text/plain"),
    Some("application/problem+json"),
    Some("application/msgpack"),
    Some("application/x-msgpack"),
];

fn base_worker(id: u64) -> Value {
    serde_json::json!({
        "worker_id": id, "model_name": "m", "endpoint": format!("http://w{id}"),
        "kv_events_endpoint": "tcp://127.0.0.1:1", "block_size": 16
    })
}

struct Harness {
    rt: tokio::runtime::Runtime,
    /// `routes::router(app)`, built once (building it per request was most of an input's
    /// cost); each request runs on a clone (shared routes and state).
    router: axum::Router,
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let cmd = kvr_service::ServeArgs::augment_args(clap::Command::new("kvr-serve"));
        let m = cmd.get_matches_from(["kvr-serve"]);
        let args = kvr_service::ServeArgs::from_arg_matches(&m).expect("default ServeArgs");
        let app = App::new(args).expect("App::new");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let router = kvr_service::routes::router(app);
        let h = Harness { rt, router };
        for id in [1, 2] {
            let (s, _) = h.send(
                "POST",
                "/workers",
                Some("application/json"),
                &json_bytes(&base_worker(id)),
            );
            assert_eq!(s, StatusCode::CREATED);
        }
        let booking = serde_json::json!({
            "model_name": "m", "selection_id": "base",
            "token_ids": (0..64).collect::<Vec<u32>>()
        });
        let (s, b) = h.send(
            "POST",
            "/select_and_reserve",
            Some("application/json"),
            &json_bytes(&booking),
        );
        assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
        h
    })
}

fn json_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

impl Harness {
    fn send(
        &self,
        method: &str,
        path: &str,
        ct: Option<&str>,
        body: &[u8],
    ) -> (StatusCode, Vec<u8>) {
        let (s, _, b) = self.send_full(method, path, ct, body);
        (s, b)
    }

    fn send_full(
        &self,
        method: &str,
        path: &str,
        ct: Option<&str>,
        body: &[u8],
    ) -> (StatusCode, Option<String>, Vec<u8>) {
        let mut req = Request::builder()
            .method(Method::from_bytes(method.as_bytes()).unwrap())
            .uri(path);
        if let Some(ct) = ct {
            req = req.header(header::CONTENT_TYPE, ct);
        }
        let req = req.body(Body::from(body.to_vec())).unwrap();
        let router = self.router.clone();
        self.rt.block_on(async move {
            let resp = router.oneshot(req).await.expect("infallible router");
            let status = resp.status();
            let ct = resp
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
                .await
                .expect("response body");
            (status, ct, bytes.to_vec())
        })
    }
}

/// The target: panics on a finding.
pub fn run(data: &[u8]) {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    // The hand-read token_ids never disagree with serde's reading of the same body.
    assert!(
        kvr_service::fuzzing::token_split_agrees_with_serde(body),
        "token_ids split disagrees with serde: {:?}",
        String::from_utf8_lossy(body)
    );
    let h = harness();
    let (method, path) = ROUTES[sel as usize % ROUTES.len()];
    let ct = CONTENT_TYPES[sel as usize / ROUTES.len() % CONTENT_TYPES.len()];
    let (status, rct, resp) = h.send_full(method, path, ct, body);
    let show = || {
        format!(
            "{method} {path} (content type {ct:?}) → {status} {:?}; body {:?}",
            String::from_utf8_lossy(&resp),
            String::from_utf8_lossy(body)
        )
    };
    let json: Option<Value> = serde_json::from_slice(&resp).ok();
    if status.is_server_error() {
        let err = json
            .as_ref()
            .and_then(|v| v.get("error"))
            .and_then(Value::as_str)
            .unwrap_or("");
        // A body the service accepted (serde skips unknown fields without checking their
        // strings' UTF-8, so it need not be strict JSON) naming no schedulable worker.
        let documented = status == StatusCode::SERVICE_UNAVAILABLE
            && (err.starts_with("no schedulable workers")
                || err == "no endpoints available to route work");
        assert!(documented, "5xx: {}", show());
        return;
    }
    if status.is_client_error() {
        assert!(
            rct.as_deref()
                .is_some_and(|c| c.starts_with("application/json")),
            "4xx not JSON: {}",
            show()
        );
        let err = json
            .as_ref()
            .and_then(|v| v.get("error"))
            .and_then(Value::as_str);
        assert!(
            err.is_some(),
            "4xx without {{\"error\": string}}: {}",
            show()
        );
        return;
    }
    assert!(status.is_success(), "status: {}", show());
    let v = json.unwrap_or_else(|| panic!("2xx not JSON: {}", show()));
    undo(h, path, &v);
}

/// Undoes what a successful input changed (see the module docs).
fn undo(h: &Harness, path: &str, v: &Value) {
    match path {
        "/workers" | "/workers/1" | "/workers/777" => {
            if let Some(id) = v.get("worker_id").and_then(Value::as_u64) {
                if id != 1 && id != 2 {
                    let (s, b) = h.send("DELETE", &format!("/workers/{id}"), None, b"");
                    assert_eq!(
                        s,
                        StatusCode::OK,
                        "DELETE /workers/{id}: {}",
                        String::from_utf8_lossy(&b)
                    );
                }
            }
            for id in [1, 2] {
                let (s, _) = h.send(
                    "POST",
                    "/workers",
                    Some("application/json"),
                    &json_bytes(&base_worker(id)),
                );
                assert_eq!(s, StatusCode::CREATED);
            }
        }
        "/select_and_reserve" | "/reservations" => {
            let id = v
                .get("selection_id")
                .and_then(Value::as_str)
                .unwrap_or_else(|| panic!("{path} 2xx without selection_id: {v}"));
            // "" cannot be named in a path (the booking stays; a second one is a 409).
            if id != "base" && !id.is_empty() {
                let uri = format!("/reservations/{}", percent_encode(id));
                let (s, b) = h.send("DELETE", &uri, None, b"");
                assert_eq!(
                    s,
                    StatusCode::OK,
                    "DELETE {uri}: {}",
                    String::from_utf8_lossy(&b)
                );
            }
        }
        _ => {}
    }
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
