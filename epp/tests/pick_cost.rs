//! Where a pick's time goes, in process (no gRPC, no Envoy): one request's headers and
//! body through an [`Exchange`], split into parse, tokenize and select, for prompts of 1k,
//! 8k and 32k tokens sent as token ids and as text. A measurement, not a test: run with
//! `cargo test --release -p kvr-epp --test pick_cost -- --ignored --nocapture`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, processing_response::Response, HttpBody, HttpHeaders,
    ProcessingRequest, ProtocolConfiguration,
};

use kvr_epp::exchange::{Exchange, Shared};
use kvr_epp::metrics::EppMetrics;
use kvr_epp::picker::{PickConfig, Picker};
use kvr_epp::pool::{self, Membership, PoolFile};
use kvr_epp::prompt::Tokenization;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: kvr_service::ServeArgs,
}

fn shared() -> Shared {
    let args = Cli::parse_from(["t", "--router-use-kv-events", "false"]).args;
    let mut m = None;
    let app =
        kvr_service::App::with_metrics(args, |r| m = Some(EppMetrics::register(r, None))).unwrap();
    let pool = PoolFile::parse(
        r#"{"model": "m", "block_size": 16, "pods": [
        {"name": "a", "address": "10.0.0.1", "ports": [8000]},
        {"name": "b", "address": "10.0.0.2", "ports": [8000]},
        {"name": "c", "address": "10.0.0.3", "ports": [8000]},
        {"name": "d", "address": "10.0.0.4", "ports": [8000]}]}"#,
    )
    .unwrap()
    .membership();
    assert!(pool::apply(&app, &Membership::default(), &pool).is_empty());
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tokenize/tests/assets/tokenizer");
    Shared {
        picker: Arc::new(Picker::new(
            app,
            pool,
            PickConfig {
                fallbacks: 2,
                shed_when_busy: true,
            },
        )),
        metrics: m.unwrap(),
        tokenizer: Arc::new(
            Tokenization::new(
                &[("m".into(), dir)],
                None,
                Duration::from_secs(1),
                kvr_epp::prompt::reuse_config(64),
            )
            .unwrap(),
        ),
        max_body_bytes: 64 << 20,
        session_header: None,
    }
}

fn one(shared: &Shared, body: &[u8]) -> Duration {
    let mut x = Exchange::new(shared.clone());
    let headers = ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![HeaderValue {
                    key: ":path".into(),
                    raw_value: b"/v1/completions".to_vec(),
                    ..Default::default()
                }],
            }),
            ..Default::default()
        })),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::FullDuplexStreamed as i32,
            ..Default::default()
        }),
        ..Default::default()
    };
    let t0 = Instant::now();
    assert!(x.handle(headers).is_empty());
    let out = x.handle(ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    });
    let took = t0.elapsed();
    assert!(
        matches!(out[0].response, Some(Response::RequestHeaders(_))),
        "{:?}",
        out[0]
    );
    took
}

#[test]
#[ignore = "a measurement, not a test: run with --ignored --nocapture"]
fn pick_cost_by_prompt_size() {
    let shared = shared();
    let words = [
        "cache", "block", "prefix", "route", "engine", "model", "gateway", "picker",
    ];
    println!(
        "tokens  form   p50 us   (parse/tokenize/select are in kvr_epp_pick_duration_seconds)"
    );
    for n in [1024usize, 8192, 32768] {
        let ids: Vec<String> = (0..n).map(|i| (i % 2000 + 1).to_string()).collect();
        let as_ids = format!(
            r#"{{"model":"m","prompt":[{}],"max_tokens":8}}"#,
            ids.join(",")
        );
        // About n tokens of text with the asset tokenizer (measured below).
        let text: Vec<&str> = (0..n)
            .map(|i| words[(i * 7 + i / 3) % words.len()])
            .collect();
        let as_text = format!(
            r#"{{"model":"m","prompt":"{}","max_tokens":8}}"#,
            text.join(" ")
        );
        for (form, body) in [("ids", &as_ids), ("text", &as_text)] {
            let mut times: Vec<Duration> = (0..21).map(|_| one(&shared, body.as_bytes())).collect();
            times.sort();
            println!("{n:>6}  {form:<5} {:>8.0}", times[10].as_secs_f64() * 1e6);
        }
    }
}
