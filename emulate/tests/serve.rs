//! A pod's HTTP side: completions (streamed and not), usage with cached tokens, the
//! vLLM-shaped auxiliary routes, capacity pressure, and the refuse/hang modes.

mod common;

use std::time::{Duration, Instant};

use common::{config, sse_data, Emu};
use kvr_emulate::openai::output_text;
use kvr_emulate::Mode;
use serde_json::{json, Value};

const PROMPT: &str = "You are a helpful assistant. Answer every question about the routing \
    of requests to model servers in a short, friendly and exact way, please.";

#[test]
fn completions_report_cached_tokens_on_a_repeated_prompt() {
    let e = Emu::start(config("alpha"));
    let n = e.h.pod.tokenize(PROMPT).len();
    assert!(n > 20, "{n}");
    let r = e.post(
        "/v1/completions",
        &json!({"model": "emu-model", "prompt": PROMPT, "max_tokens": 3}),
    );
    assert_eq!(
        (r.status, r.pod.as_deref()),
        (200, Some("alpha")),
        "{}",
        r.body
    );
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], output_text(3));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], n);
    assert_eq!(u["completion_tokens"], 3);
    assert_eq!(u["total_tokens"], n + 3);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    // The same prompt again: every full block but the one holding the last token.
    let u = e.complete(json!(PROMPT), 3);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], (n - 1) / 4 * 4);
    // Token ids work as a prompt and share the cache with the same text.
    let ids = e.h.pod.tokenize(PROMPT);
    let u = e.complete(json!(ids[..12]), 1);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 8);
    assert_eq!(e.state()["requests"], 3);
}

#[test]
fn streaming_sends_chunks_then_usage_then_done() {
    let e = Emu::start(config("beta"));
    e.complete(json!(PROMPT), 1);
    let r = e.post(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 5, "stream": true,
                "stream_options": {"include_usage": true}}),
    );
    assert_eq!((r.status, r.pod.as_deref()), (200, Some("beta")));
    let data = sse_data(&r.body);
    assert_eq!(data.len(), 5 + 2, "{}", r.body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..6]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = chunks[..5]
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, output_text(5));
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], Value::Null);
    let n = e.h.pod.tokenize(PROMPT).len();
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(
        chunks[5]["usage"]["prompt_tokens_details"]["cached_tokens"],
        (n - 1) / 4 * 4
    );
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 5);

    // Without include_usage: tokens then [DONE].
    let r = e.post(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 2, "stream": true}),
    );
    assert_eq!(sse_data(&r.body).len(), 3, "{}", r.body);
}

#[test]
fn chat_renders_like_tokenize_and_streams_a_role_first() {
    let e = Emu::start(config("gamma"));
    let messages = json!([{"role": "system", "content": "be brief"},
                          {"role": "user", "content": PROMPT}]);
    let t = e.post(
        "/tokenize",
        &json!({"model": "emu-model", "messages": messages,
                                        "add_generation_prompt": true}),
    );
    assert_eq!((t.status, t.pod.as_deref()), (200, Some("gamma")));
    let t = t.json();
    assert_eq!(t["count"], t["tokens"].as_array().unwrap().len());
    assert_eq!(t["max_model_len"], 4096);
    let r = e.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2}),
    );
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], output_text(2));
    assert_eq!(v["usage"]["prompt_tokens"], t["count"]);
    let r = e.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_completion_tokens": 2,
                                                    "stream": true}),
    );
    let data = sse_data(&r.body);
    assert_eq!(data.len(), 1 + 2 + 1, "{}", r.body);
    let first: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let p = e.post("/tokenize", &json!({"prompt": "a b, c"})).json();
    assert_eq!(p["count"], 4);
    assert_eq!(p["tokens"], json!(e.h.pod.tokenize("a b, c")));
}

#[test]
fn auxiliary_routes_and_errors_are_vllm_shaped_and_name_the_pod() {
    let e = Emu::start(config("delta"));
    let h = e.get("/health");
    assert_eq!((h.status, h.pod.as_deref()), (200, Some("delta")));
    let m = e.get("/v1/models").json();
    assert_eq!(m["data"][0]["id"], "emu-model");
    let r = e.post(
        "/v1/completions",
        &json!({"model": "other", "prompt": "hi"}),
    );
    assert_eq!((r.status, r.pod.as_deref()), (404, Some("delta")));
    assert_eq!(r.json()["type"], "NotFoundError");
    let r = e.post(
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 5000}),
    );
    assert_eq!(r.status, 400);
    assert!(r.json()["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length"));
    let r = e.post("/v1/completions", &json!({"prompt": ["a", "b"]}));
    assert_eq!(r.status, 400);
    let r = e.post("/v1/completions", &json!({"nothing": 1}));
    assert_eq!((r.status, r.pod.as_deref()), (400, Some("delta")));
}

#[test]
fn capacity_pressure_evicts_the_least_recently_used_prompt() {
    let mut cfg = config("epsilon");
    cfg.cache.capacity_blocks = 8;
    let e = Emu::start(cfg);
    // 12 tokens (3 blocks) + 1 output token: 4 blocks a request; 3 cached after.
    let a: Vec<u32> = (1..=12).collect();
    let b: Vec<u32> = (101..=112).collect();
    let c: Vec<u32> = (201..=212).collect();
    e.complete(json!(a), 1);
    e.complete(json!(b), 1);
    assert_eq!(e.state()["cache"]["cached_blocks"], 6);
    assert_eq!(e.h.pod.cached_prefix_blocks(&a), 3);
    // c needs 4 blocks with 2 free: a's tail two go.
    e.complete(json!(c), 1);
    assert_eq!(e.h.pod.cached_prefix_blocks(&a), 1);
    assert_eq!(e.h.pod.cached_prefix_blocks(&b), 3);
    let s = e.state();
    assert_eq!(s["cache"]["cached_blocks"], 7);
    assert!(s["cache"]["used_blocks"].as_u64().unwrap() <= 8);
    let u = e.complete(json!(a), 1);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 4);
    // a needed 3 new blocks with 1 free: b's tail two went (b is older than c).
    assert_eq!(e.h.pod.cached_prefix_blocks(&b), 1);
    assert_eq!(e.h.pod.cached_prefix_blocks(&c), 3);
    let u = e.complete(json!(c), 1);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 8);
    // Too big for the whole cache: refused, not queued forever.
    let r = e.post(
        "/v1/completions",
        &json!({"prompt": (1..=40).collect::<Vec<u32>>()}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
}

#[test]
fn running_requests_hold_their_blocks_and_wait_for_room() {
    let mut cfg = config("zeta");
    cfg.cache.capacity_blocks = 5;
    cfg.timing.decode_ns_per_token = 100_000_000; // 100 ms a token
    let e = Emu::start(cfg);
    let url = e.url("/v1/completions");
    let slow = std::thread::spawn(move || {
        ureq::post(&url)
            .content_type("application/json")
            .send(json!({"prompt": (1..=12).collect::<Vec<u32>>(), "max_tokens": 4}).to_string())
            .unwrap()
            .status()
    });
    let t0 = Instant::now();
    while e.state()["cache"]["running_requests"] != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the slow request never ran"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let s = e.state();
    assert_eq!(s["cache"]["used_blocks"], 4, "{s}");
    // A reset is refused while a request holds blocks.
    assert_eq!(e.post("/reset_prefix_cache", &json!({})).status, 409);
    // A second request needs 4 blocks with 1 free: it waits for the first to finish.
    let t1 = Instant::now();
    let u = e.complete(json!((101..=112).collect::<Vec<u32>>()), 1);
    assert_eq!(u["completion_tokens"], 1);
    assert!(
        t1.elapsed() >= Duration::from_millis(200),
        "{:?}",
        t1.elapsed()
    );
    assert_eq!(slow.join().unwrap(), 200);
    let r = e.post("/reset_prefix_cache", &json!({}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(e.state()["cache"]["cached_blocks"], 0);
}

#[test]
fn a_refusing_pod_answers_503_and_a_hanging_one_never() {
    let mut cfg = config("eta");
    cfg.mode = Mode::Refuse;
    let e = Emu::start(cfg);
    let r = e.post("/v1/completions", &json!({"prompt": "hi"}));
    assert_eq!((r.status, r.pod.as_deref()), (503, Some("eta")));
    assert_eq!(e.get("/health").status, 503);
    let m = e.post("/emulate/mode", &json!({"mode": "hang"}));
    assert_eq!(m.status, 200, "{}", m.body);
    let t0 = Instant::now();
    let hung = e.post_within(
        "/v1/completions",
        &json!({"prompt": "hi"}),
        Duration::from_millis(300),
    );
    assert!(hung.is_err(), "a hanging pod answered: {hung:?}");
    assert!(t0.elapsed() >= Duration::from_millis(300));
    e.post("/emulate/mode", &json!({"mode": "serve"}));
    assert_eq!(
        e.post("/v1/completions", &json!({"prompt": "hi"})).status,
        200
    );
    assert_eq!(
        e.state()["requests"],
        1,
        "refused and hung requests are not admitted"
    );
}
