//! The msgpack request form (`Content-Type: application/msgpack`) through the router, in
//! process: the same prompt sent as JSON, as msgpack with `token_ids` an array and as
//! msgpack with `token_ids` a `bin` of little-endian u32s gets the same decision, the same
//! booking and the same load, on every prompt route; malformed msgpack gets a 4xx with a
//! JSON `{"error"}` body and counts in `kvr_http_bad_bodies_total`, and the service
//! keeps answering.

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use clap::Parser;
use rmp::encode as en;
use serde_json::{json, Value};
use tower::ServiceExt;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: kvr_service::ServeArgs,
}

/// A service with two workers of block size 16 and no KV events (bookings feed the
/// approximate index, so a booked prompt is found again on its worker).
fn service() -> (axum::Router, tokio::runtime::Runtime) {
    let argv = ["kvr-serve", "--router-use-kv-events", "false"];
    let app = kvr_service::App::new(Cli::parse_from(argv).args).expect("App::new");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let router = kvr_service::routes::router(app);
    for w in [1u64, 2] {
        let body = json!({"worker_id": w, "model_name": "m", "endpoint": format!("http://w{w}"),
                          "block_size": 16});
        let (s, b) = send(
            &rt,
            &router,
            "POST",
            "/workers",
            "application/json",
            json_bytes(&body),
        );
        assert_eq!(s, StatusCode::CREATED, "{b}");
    }
    (router, rt)
}

fn json_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

fn send(
    rt: &tokio::runtime::Runtime,
    router: &axum::Router,
    method: &str,
    path: &str,
    ct: &str,
    body: Vec<u8>,
) -> (StatusCode, Value) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header(header::CONTENT_TYPE, ct)
        .body(Body::from(body))
        .unwrap();
    let router = router.clone();
    rt.block_on(async move {
        let resp = router.oneshot(req).await.unwrap();
        let status = resp.status();
        let ct = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_string());
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        assert_eq!(ct.as_deref(), Some("application/json"), "answers stay JSON");
        (status, serde_json::from_slice(&bytes).unwrap())
    })
}

/// How a body's `token_ids` are sent.
#[derive(Clone, Copy, Debug)]
enum Form {
    Json,
    MsgpackArray,
    MsgpackBin,
}

/// `fields` (a JSON object without `token_ids`) plus `tokens`, in `form`.
fn encode(form: Form, fields: &Value, tokens: &[u32]) -> (&'static str, Vec<u8>) {
    let map = fields.as_object().unwrap();
    match form {
        Form::Json => {
            let mut v = fields.clone();
            v["token_ids"] = json!(tokens);
            ("application/json", json_bytes(&v))
        }
        Form::MsgpackArray | Form::MsgpackBin => {
            let mut b = Vec::new();
            en::write_map_len(&mut b, map.len() as u32 + 1).unwrap();
            en::write_str(&mut b, "token_ids").unwrap();
            if let Form::MsgpackBin = form {
                let le: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
                en::write_bin(&mut b, &le).unwrap();
            } else {
                en::write_array_len(&mut b, tokens.len() as u32).unwrap();
                for &t in tokens {
                    en::write_uint(&mut b, u64::from(t)).unwrap();
                }
            }
            for (k, v) in map {
                en::write_str(&mut b, k).unwrap();
                value(&mut b, v);
            }
            ("application/msgpack", b)
        }
    }
}

fn value(b: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Null => en::write_nil(b).unwrap(),
        Value::Bool(x) => en::write_bool(b, *x).unwrap(),
        Value::Number(n) if n.is_u64() => {
            en::write_uint(b, n.as_u64().unwrap()).unwrap();
        }
        Value::Number(n) if n.is_i64() => {
            en::write_sint(b, n.as_i64().unwrap()).unwrap();
        }
        Value::Number(n) => en::write_f64(b, n.as_f64().unwrap()).unwrap(),
        Value::String(s) => en::write_str(b, s).unwrap(),
        Value::Array(a) => {
            en::write_array_len(b, a.len() as u32).unwrap();
            a.iter().for_each(|x| value(b, x));
        }
        Value::Object(m) => {
            en::write_map_len(b, m.len() as u32).unwrap();
            for (k, x) in m {
                en::write_str(b, k).unwrap();
                value(b, x);
            }
        }
    }
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 200_000)
        .collect()
}

/// An answer with a minted selection id cut to its counter (each service mints under its
/// own random prefix).
fn minted_apart(mut v: Value) -> Value {
    if let Some(id) = v.get("selection_id").and_then(Value::as_str) {
        if id.len() == 36 {
            let counter = id.rsplit('-').next().unwrap().to_string();
            v["selection_id"] = json!(counter);
        }
    }
    v
}

/// The same requests in each form, each on a fresh service: every answer and the final
/// loads are equal.
#[test]
fn every_form_books_and_answers_alike() {
    let shared = tokens(7, 16 * 40 + 5);
    let mut other = shared[..16 * 20].to_vec();
    other.extend(tokens(9, 300));
    let run = |form: Form| {
        let (router, rt) = service();
        let mut answers = Vec::new();
        let mut call = |path: &str, fields: Value, toks: &[u32]| {
            let (ct, body) = encode(form, &fields, toks);
            let (s, v) = send(&rt, &router, "POST", path, ct, body);
            assert!(s.is_success(), "{form:?} {path}: {s} {v}");
            answers.push(minted_apart(v));
        };
        // A booking pinned to worker 2, then the same prompt and one sharing its head:
        // chosen on worker 2 by its overlap, whatever the tie-break.
        call(
            "/select_and_reserve",
            json!({"model_name": "m", "selection_id": "first",
                   "pinned_worker": {"worker_id": 2, "dp_rank": 0}}),
            &shared,
        );
        call(
            "/select_and_reserve",
            json!({"model_name": "m", "expected_output_tokens": 50}),
            &shared,
        );
        call(
            "/select",
            json!({"model_name": "m", "advisory": true}),
            &other,
        );
        call("/potential_loads", json!({"model_name": "m"}), &other);
        call("/overlap_scores", json!({"model_name": "m"}), &other);
        call(
            "/select",
            json!({"model_name": "m", "selection_id": "pending"}),
            &other,
        );
        call(
            "/reservations",
            json!({"model_name": "m", "selection_id": "explicit", "worker_id": 1}),
            &other,
        );
        let (s, loads) = send(
            &rt,
            &router,
            "GET",
            "/loads",
            "application/json",
            Vec::new(),
        );
        assert_eq!(s, StatusCode::OK);
        answers.push(loads);
        answers
    };
    let json = run(Form::Json);
    assert_eq!(json[1]["worker_id"], 2, "chosen by overlap: {}", json[1]);
    assert!(json[1]["overlap"]["gpu"].as_u64().unwrap() >= 16 * 40);
    for form in [Form::MsgpackArray, Form::MsgpackBin] {
        let got = run(form);
        for (i, (a, b)) in json.iter().zip(&got).enumerate() {
            assert_eq!(a, b, "{form:?}, answer {i}");
        }
    }
}

/// Malformed msgpack: a 4xx with `{"error"}`, counted; never a 5xx; the service still
/// books a good body afterwards.
#[test]
fn malformed_msgpack_is_refused_and_counted() {
    let (router, rt) = service();
    let good = encode(
        Form::MsgpackBin,
        &json!({"model_name": "m"}),
        &tokens(3, 64),
    )
    .1;
    let mut cases: Vec<(Vec<u8>, u16)> = Vec::new();
    for n in [0, 1, 5, good.len() / 2, good.len() - 1] {
        cases.push((good[..n].to_vec(), 400));
    }
    let mut trailing = good.clone();
    trailing.push(0xc0);
    cases.push((trailing, 400));
    // A bin whose length is not a multiple of 4.
    let mut odd = Vec::new();
    en::write_map_len(&mut odd, 1).unwrap();
    en::write_str(&mut odd, "token_ids").unwrap();
    en::write_bin(&mut odd, &[1, 2, 3, 4, 5]).unwrap();
    cases.push((odd, 400));
    // An array claiming 4 billion tokens in a few bytes.
    let mut absurd = Vec::new();
    en::write_map_len(&mut absurd, 1).unwrap();
    en::write_str(&mut absurd, "token_ids").unwrap();
    absurd.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]);
    cases.push((absurd, 400));
    // Wrong types: tokens as a string, a negative token, model_name as a number (serde's).
    let mut s = Vec::new();
    en::write_map_len(&mut s, 1).unwrap();
    en::write_str(&mut s, "token_ids").unwrap();
    en::write_str(&mut s, "1,2,3").unwrap();
    cases.push((s, 422));
    let mut neg = Vec::new();
    en::write_map_len(&mut neg, 1).unwrap();
    en::write_str(&mut neg, "token_ids").unwrap();
    en::write_array_len(&mut neg, 1).unwrap();
    en::write_sint(&mut neg, -5).unwrap();
    cases.push((neg, 422));
    cases.push((
        encode(Form::MsgpackBin, &json!({"model_name": 5}), &[1]).1,
        422,
    ));
    // A top-level array, not a map.
    cases.push((vec![0x91, 0x01], 422));
    let before = kvr_service::error::bad_bodies();
    let mut refused = 0;
    for (body, want) in &cases {
        let (status, v) = send(
            &rt,
            &router,
            "POST",
            "/select_and_reserve",
            "application/msgpack",
            body.clone(),
        );
        assert_eq!(status.as_u16(), *want, "{body:?}: {v}");
        assert!(v["error"].is_string(), "{v}");
        refused += u64::from(status.is_client_error());
    }
    // Other tests in this binary may count too: at least ours.
    assert!(kvr_service::error::bad_bodies() - before >= refused);
    let (s, v) = send(
        &rt,
        &router,
        "POST",
        "/select_and_reserve",
        "application/msgpack",
        good,
    );
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["isl_tokens"], 64);
}
