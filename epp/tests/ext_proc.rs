//! `kvr epp` over gRPC, with this test playing Envoy's side of each ext_proc stream: the
//! route is set in the header and the `envoy.lb` metadata, fallbacks follow, a repeated
//! prompt goes where it is cached, refusals are immediate responses with their status,
//! and every booking ends: at the response's end, at once when the stream breaks, and on
//! the endpoint that served when a fallback did.

use std::collections::HashMap;
use std::time::Duration;

use clap::Parser;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request::Request, processing_response::Response, HttpBody,
    HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;

use kvr_epp::protocol::{DESTINATION, LB_NAMESPACE, SERVED, SUBSET_KEY, SUBSET_NAMESPACE};
use kvr_epp::EppArgs;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: EppArgs,
}

const POOL: &str = r#"{"model": "m", "block_size": 4, "pods": [
    {"name": "a", "address": "10.0.0.1", "ports": [8000]},
    {"name": "b", "address": "10.0.0.2", "ports": [8000]},
    {"name": "c", "address": "10.0.0.3", "ports": [8000, 8001]}]}"#;

struct Epp {
    client: ExternalProcessorClient<Channel>,
    http: String,
    stop: Option<oneshot::Sender<()>>,
    _dir: TempDir,
}

struct TempDir(std::path::PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Epp {
    async fn start(extra: &[&str]) -> Epp {
        Self::start_with(POOL, extra).await
    }

    async fn start_with(pool_json: &str, extra: &[&str]) -> Epp {
        let dir = std::env::temp_dir().join(format!(
            "kvr-epp-test-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let pool = dir.join("pool.json");
        std::fs::write(&pool, pool_json).unwrap();
        let mut argv = vec![
            "kvr-epp".to_string(),
            "--pool".into(),
            pool.display().to_string(),
            // No pod publishes KV events here: the index learns from the bookings.
            "--router-use-kv-events".into(),
            "false".into(),
        ];
        argv.extend(extra.iter().map(|s| s.to_string()));
        let args = Cli::parse_from(argv).args;
        let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc_addr = grpc.local_addr().unwrap();
        let http_addr = http.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(kvr_epp::serve_with(args, grpc, http, async {
            let _ = stopped.await;
        }));
        let channel = Channel::from_shared(format!("http://{grpc_addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
        for _ in 0..200 {
            let r = health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: "readiness".into(),
                })
                .await;
            if r.is_ok_and(|r| r.into_inner().status == 1) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Epp {
            client: ExternalProcessorClient::new(channel),
            http: format!("http://{http_addr}"),
            stop: Some(stop),
            _dir: TempDir(dir),
        }
    }

    async fn open(&mut self) -> Stream {
        let (tx, rx) = mpsc::channel(16);
        let out = self
            .client
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Stream {
            tx,
            rx: out,
            session: "s1",
            path: "/v1/completions",
        }
    }

    /// A metric's value in `/metrics` (0 if absent).
    fn metric(&self, name: &str) -> f64 {
        let body = ureq::get(&format!("{}/metrics", self.http))
            .call()
            .unwrap()
            .into_body()
            .read_to_string()
            .unwrap();
        body.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }
}

impl Drop for Epp {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
    session: &'static str,
    path: &'static str,
}

fn headers(path: &str, extra: &[(&str, &str)], end: bool) -> HttpHeaders {
    let mut h = vec![
        HeaderValue {
            key: ":path".into(),
            raw_value: path.as_bytes().to_vec(),
            ..Default::default()
        },
        HeaderValue {
            key: ":method".into(),
            raw_value: b"POST".to_vec(),
            ..Default::default()
        },
    ];
    h.extend(extra.iter().map(|(k, v)| HeaderValue {
        key: (*k).into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    }));
    HttpHeaders {
        headers: Some(HeaderMap { headers: h }),
        end_of_stream: end,
        ..Default::default()
    }
}

fn metadata(namespace: &str, key: &str, value: &str) -> Metadata {
    Metadata {
        typed_filter_metadata: Default::default(),
        filter_metadata: HashMap::from([(
            namespace.to_owned(),
            Struct {
                fields: [(
                    key.to_owned(),
                    Value {
                        kind: Some(Kind::StringValue(value.to_owned())),
                    },
                )]
                .into(),
            },
        )]),
    }
}

impl Stream {
    async fn send(&self, r: Request, md: Option<Metadata>, first: bool) {
        let protocol_config = first.then_some(ProtocolConfiguration {
            request_body_mode: BodySendMode::FullDuplexStreamed as i32,
            response_body_mode: BodySendMode::FullDuplexStreamed as i32,
            ..Default::default()
        });
        self.tx
            .send(ProcessingRequest {
                request: Some(r),
                metadata_context: md,
                protocol_config,
                ..Default::default()
            })
            .await
            .unwrap();
    }

    async fn recv(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(5), self.rx.message())
            .await
            .expect("an answer within 5 s")
            .unwrap()
            .expect("the stream is open")
    }

    /// Sends a request (headers, then the body in two chunks) and returns the first
    /// answer (the route, or an immediate response), reading the echoed body after a
    /// route.
    async fn request(&mut self, body: &str, subset: Option<&str>) -> ProcessingResponse {
        let md = subset.map(|s| metadata(SUBSET_NAMESPACE, SUBSET_KEY, s));
        self.send(
            Request::RequestHeaders(headers(self.path, &[("x-session", self.session)], false)),
            md,
            true,
        )
        .await;
        let (a, b) = body.as_bytes().split_at(body.len() / 2);
        for (chunk, end) in [(a, false), (b, true)] {
            self.send(
                Request::RequestBody(HttpBody {
                    body: chunk.to_vec(),
                    end_of_stream: end,
                    ..Default::default()
                }),
                None,
                false,
            )
            .await;
        }
        let first = self.recv().await;
        if matches!(first.response, Some(Response::RequestHeaders(_))) {
            let mut echoed = Vec::new();
            loop {
                let r = self.recv().await;
                let Some(Response::RequestBody(b)) = r.response else {
                    panic!("expected the body back, got {r:?}")
                };
                let Some(body_mutation::Mutation::StreamedResponse(s)) =
                    b.response.unwrap().body_mutation.unwrap().mutation
                else {
                    panic!("a streamed body")
                };
                echoed.extend(s.body);
                if s.end_of_stream {
                    break;
                }
            }
            assert_eq!(echoed, body.as_bytes(), "the body goes on unchanged");
        }
        first
    }

    /// The response path: headers (with the endpoint that served), one body chunk, end.
    async fn respond(&mut self, served: &str, body: &str) {
        self.send(
            Request::ResponseHeaders(headers("", &[(":status", "200")], false)),
            Some(metadata(LB_NAMESPACE, SERVED, served)),
            false,
        )
        .await;
        let r = self.recv().await;
        assert!(
            matches!(r.response, Some(Response::ResponseHeaders(_))),
            "{r:?}"
        );
        self.send(
            Request::ResponseBody(HttpBody {
                body: body.as_bytes().to_vec(),
                end_of_stream: true,
                ..Default::default()
            }),
            None,
            false,
        )
        .await;
        let r = self.recv().await;
        assert!(
            matches!(r.response, Some(Response::ResponseBody(_))),
            "{r:?}"
        );
    }
}

/// The destination list a route answer sets, checking header and metadata agree.
fn destination(r: &ProcessingResponse) -> Vec<String> {
    let Some(Response::RequestHeaders(h)) = &r.response else {
        panic!("not a route: {r:?}")
    };
    let c = h.response.as_ref().unwrap();
    assert!(c.clear_route_cache);
    let hv = c.header_mutation.as_ref().unwrap().set_headers[0]
        .header
        .as_ref()
        .unwrap();
    assert_eq!(hv.key, DESTINATION);
    let header = String::from_utf8(hv.raw_value.clone()).unwrap();
    let md = r.dynamic_metadata.as_ref().unwrap();
    let Some(Kind::StructValue(lb)) = &md.fields[LB_NAMESPACE].kind else {
        panic!("envoy.lb metadata")
    };
    let Some(Kind::StringValue(meta)) = &lb.fields[DESTINATION].kind else {
        panic!("a string")
    };
    assert_eq!(&header, meta, "header and metadata name the same endpoints");
    header.split(',').map(str::to_owned).collect()
}

fn immediate_status(r: &ProcessingResponse) -> i32 {
    match &r.response {
        Some(Response::ImmediateResponse(i)) => i.status.unwrap().code,
        other => panic!("not an immediate response: {other:?}"),
    }
}

fn prompt(seed: u32, n: u32) -> String {
    let ids: Vec<String> = (0..n).map(|i| (seed * 1000 + i).to_string()).collect();
    format!(
        r#"{{"model":"m","prompt":[{}],"max_tokens":4}}"#,
        ids.join(",")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_routed_booked_and_freed_and_its_prompt_comes_back_to_its_pod() {
    let mut epp = Epp::start(&["--fallbacks", "2"]).await;
    let mut s = epp.open().await;
    let first = destination(&s.request(&prompt(1, 64), None).await);
    assert_eq!(
        first.len(),
        3,
        "the best endpoint and two fallbacks: {first:?}"
    );
    let workers: std::collections::HashSet<&str> =
        first.iter().map(|e| e.split(':').next().unwrap()).collect();
    assert_eq!(workers.len(), 3, "fallbacks are other pods: {first:?}");
    assert_eq!(epp.metric("kvr_epp_bookings_active"), 1.0);
    s.respond(&first[0], "data: {\"x\":1}\n\ndata: [DONE]\n\n")
        .await;
    drop(s);
    // Freed at the response's end, not by the stream's drop.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(epp.metric("kvr_epp_bookings_active"), 0.0);
    assert_eq!(epp.metric("kvr_epp_broken_streams_total"), 0.0);
    // The same prompt again: where it was booked (the index learned it).
    let mut s = epp.open().await;
    let again = destination(&s.request(&prompt(1, 64), None).await);
    assert_eq!(again[0], first[0]);
    s.respond(&again[0], "{}").await;
    assert_eq!(epp.metric("kvr_epp_picks_total{outcome=\"routed\"}"), 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_stream_frees_its_booking_at_once() {
    let mut epp = Epp::start(&[]).await;
    let mut s = epp.open().await;
    destination(&s.request(&prompt(2, 16), None).await);
    assert_eq!(epp.metric("kvr_epp_bookings_active"), 1.0);
    drop(s); // Envoy resets the stream (client gone) before any response.
    let mut freed = false;
    for _ in 0..100 {
        if epp.metric("kvr_epp_bookings_active") == 0.0 {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(freed, "the booking was freed when the stream broke");
    assert_eq!(epp.metric("kvr_epp_broken_streams_total"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_that_served_takes_the_booking() {
    let mut epp = Epp::start(&[]).await;
    let mut s = epp.open().await;
    let eps = destination(&s.request(&prompt(3, 32), None).await);
    s.respond(&eps[1], "{}").await;
    assert_eq!(epp.metric("kvr_epp_fallback_served_total"), 1.0);
    assert_eq!(epp.metric("kvr_epp_bookings_active"), 0.0);
    // The prompt was learned where it was served (kvr's booking-fed index keeps the
    // first pick's prediction too, until it ages out: either may win the tie).
    let mut s = epp.open().await;
    let again = destination(&s.request(&prompt(3, 32), None).await);
    assert!(
        again[0] == eps[1] || again[0] == eps[0],
        "{again:?} {eps:?}"
    );
    assert_ne!(again[0], eps[2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_narrows_and_refusals_are_immediate() {
    let mut epp = Epp::start(&[]).await;
    // Only the second rank of pod c.
    let mut s = epp.open().await;
    let eps = destination(&s.request(&prompt(4, 8), Some("10.0.0.3:8001")).await);
    assert_eq!(eps, vec!["10.0.0.3:8001"]);
    drop(s);
    for (body, subset, status) in [
        (prompt(5, 8), Some("10.9.9.9:1"), 503),
        (r#"{"model":"m","prompt":"#.to_string(), None, 400),
        (r#"{"model":"nope","prompt":[1,2]}"#.to_string(), None, 404),
        // A model the pool does not serve is 404 before any tokenizing, text or not.
        (
            r#"{"model":"nope","prompt":"a text prompt"}"#.to_string(),
            None,
            404,
        ),
        (
            r#"{"model":"m","prompt":"text needs a tokenizer"}"#.to_string(),
            None,
            400,
        ),
    ] {
        let mut s = epp.open().await;
        let r = s.request(&body, subset).await;
        assert_eq!(immediate_status(&r), status, "{body} {subset:?}");
    }
    assert_eq!(epp.metric("kvr_epp_bookings_active"), 0.0);
    assert_eq!(
        epp.metric("kvr_epp_picks_total{outcome=\"no_endpoint\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pick_away_from_the_cache_is_counted() {
    // Session affinity pins a session to its pod: its turn for a prompt cached on another
    // pod leaves that cache (as load would), and the cache given up is counted.
    let mut epp = Epp::start(&[
        "--session-header",
        "x-session",
        "--session-affinity-ttl-secs",
        "60",
    ])
    .await;
    let mut a = epp.open().await;
    a.session = "A";
    let pa = destination(&a.request(&prompt(10, 64), None).await)[0].clone();
    let mut b = epp.open().await;
    b.session = "B";
    let pb = destination(&b.request(&prompt(11, 64), None).await)[0].clone();
    assert_ne!(pa, pb, "the second session went to a less loaded pod");
    // Its prompt is in pb's cache once it ran (the booking-fed index learns it then).
    b.respond(&pb, "{}").await;
    assert_eq!(epp.metric("kvr_epp_cache_given_up_for_load_total"), 0.0);
    // Session A asks for B's prompt: pinned to A's pod, B's cache given up.
    let mut a2 = epp.open().await;
    a2.session = "A";
    let p = destination(&a2.request(&prompt(11, 64), None).await)[0].clone();
    assert_eq!(p, pa, "the session stays on its pod");
    assert_eq!(epp.metric("kvr_epp_cache_given_up_for_load_total"), 1.0);
    assert_eq!(epp.metric("kvr_epp_cached_tokens_given_up_total"), 64.0);
    drop((a, b, a2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversations_next_turn_reuses_its_history_token_ids() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tokenize/tests/assets/tokenizer"
    );
    let mut epp = Epp::start(&["--tokenizer", &format!("m={dir}")]).await;
    let mut turn = vec![serde_json::json!({"role": "user", "content": "where is the cache?"})];
    let mut dests = Vec::new();
    for reply in ["on the pod that served you", "still there"] {
        let body = serde_json::json!({"model": "m", "messages": turn}).to_string();
        let mut s = epp.open().await;
        s.path = "/v1/chat/completions";
        let d = destination(&s.request(&body, None).await);
        s.respond(&d[0], "{}").await;
        dests.push(d[0].clone());
        turn.push(serde_json::json!({"role": "assistant", "content": reply}));
        turn.push(serde_json::json!({"role": "user", "content": "and then?"}));
    }
    assert_eq!(
        dests[0], dests[1],
        "the next turn goes where its history is"
    );
    let m = |n: &str| epp.metric(&format!("{n}{{model=\"m\"}}"));
    assert_eq!(m("kvr_epp_token_reuse_lookups_total"), 2.0);
    assert_eq!(m("kvr_epp_token_reuse_hits_total"), 1.0);
    assert!(m("kvr_epp_token_reuse_reused_tokens_total") > 10.0);
    assert_eq!(m("kvr_epp_token_reuse_mismatches_total"), 0.0);
    // The first reuses are checked against a full encoding.
    assert_eq!(m("kvr_epp_token_reuse_checks_total"), 1.0);
}
