//! Target (e): sequences of Envoy ext_proc streams → `kvr epp`'s [`Exchange`]s, in-process.
//!
//! One picker ([`Shared`], built once per process with `Shared::new`) serves every input:
//! a selection service with `--router-use-kv-events false`, `--max-body-bytes`
//! [`MAX_BODY`], a session header, the test asset tokenizer for model `m` and an engine
//! `/tokenize` at a closed local port for every other model (the dead-tokenizer path);
//! a pool of four pods without KV events: `a` (m), `b` (m, two DP ranks, LoRA adapter
//! `m-lora`), `c` (m), `d` (model `m2`).
//!
//! An [`Input`] is a few streams; each has a request body from a grammar (completions or
//! chat bodies naming no, known, adapter or unknown models, with token-id or text prompts;
//! truncated JSON; wrong types; garbage; bodies past the size limit), a response body (SSE
//! with a usage object, or garbage) and a sequence of ext_proc messages: request headers
//! (path, session, subset hint naming pool, other-model or unknown endpoints, as a string
//! or a list or of a wrong type, end of stream), body chunks cut from the body, trailers,
//! response headers with the endpoint that served (the pick, a fallback, another model's
//! pod, unknown, garbage), response chunks, messages with no request, protocol
//! configurations (none, buffered, streamed, full duplex, invalid). A stream may stop at
//! any message: the exchange is dropped.
//!
//! A model of the exchange (independent of its code: the documented statuses of
//! docs/epp.md) predicts each message's answers, and the target asserts, per message: the
//! number and kinds of answers; a refusal's status and kind are the predicted ones (413
//! for a body past the limit, 400 for a malformed body or path, 503 for a text prompt
//! only the dead `/tokenize` could read, 404 for an unknown model, 503 for a subset hint
//! naming no endpoint of the model; a route may also be a 429 `busy`); a route's
//! destination header equals its `envoy.lb` metadata, names distinct pool endpoints of
//! distinct workers serving the model, only subset endpoints under a hint. Per stream: the
//! pick counters moved by exactly the outcomes seen, `protocol_errors` by the messages
//! without a request, `fallback_served` by the fallbacks reported, the observed cached
//! tokens by the usage the response carried while booked. After each stream is dropped:
//! `kvr_epp_bookings_active` is 0, every partition's bookings table is empty and no
//! selection is pending — whatever order the messages came in.

use std::collections::HashSet;
use std::sync::OnceLock;

use arbitrary::{Arbitrary, Unstructured};
use clap::{Args, FromArgMatches};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, processing_response::Response, CommonResponse, HttpBody,
    HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use kvr_epp::exchange::{Exchange, Shared};
use kvr_epp::metrics::Outcome;
use kvr_epp::pool::PoolFile;
use kvr_epp::protocol::{DESTINATION, LB_NAMESPACE, SERVED, SUBSET_KEY, SUBSET_NAMESPACE};
use kvr_epp::EppArgs;

/// `--max-body-bytes`: small, so oversized bodies are cheap.
pub const MAX_BODY: usize = 4096;
/// Streams per input and messages per stream, at most.
const MAX_STREAMS: usize = 4;
const MAX_MSGS: usize = 16;
const SESSION_HEADER: &str = "x-session-id";

const POOL: &str = r#"{"model":"m","block_size":16,"pods":[
  {"name":"a","address":"10.0.0.1","ports":[8000],"worker_id":1},
  {"name":"b","address":"10.0.0.2","ports":[8000,8001],"worker_id":2,"lora_adapters":["m-lora"]},
  {"name":"c","address":"10.0.0.3","ports":[8000],"worker_id":3},
  {"name":"d","address":"10.0.0.4","ports":[8000],"worker_id":4,"model":"m2"}]}"#;

/// Pool endpoints: (endpoint, worker, model).
const ENDPOINTS: [(&str, u64, &str); 5] = [
    ("10.0.0.1:8000", 1, "m"),
    ("10.0.0.2:8000", 2, "m"),
    ("10.0.0.2:8001", 2, "m"),
    ("10.0.0.3:8000", 3, "m"),
    ("10.0.0.4:8000", 4, "m2"),
];
/// Names of no pool endpoint.
const UNKNOWN_ENDPOINTS: [&str; 3] = ["10.9.9.9:1", "10.0.0.1:9000", "not an endpoint"];

const OUTCOMES: [&str; 9] = [
    "routed",
    "malformed_body",
    "no_tokenizer",
    "body_too_large",
    "tokenizer_error",
    "unknown_model",
    "no_endpoint",
    "busy",
    "refused",
];

fn shared() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        // A local port nobody listens on: the engine's /tokenize is dead.
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a local port")
            .port();
        let tok = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tokenize/tests/assets/tokenizer"
        );
        let argv = [
            "kvr-epp".to_owned(),
            "--pool".into(),
            "unused".into(),
            "--router-use-kv-events".into(),
            "false".into(),
            "--max-body-bytes".into(),
            MAX_BODY.to_string(),
            "--session-header".into(),
            SESSION_HEADER.into(),
            "--tokenizer".into(),
            format!("m={tok}"),
            "--tokenize-url".into(),
            format!("http://127.0.0.1:{closed}"),
            "--tokenize-timeout-ms".into(),
            "200".into(),
        ];
        let m = EppArgs::augment_args(clap::Command::new("kvr-epp")).get_matches_from(argv);
        let args = EppArgs::from_arg_matches(&m).expect("EppArgs");
        let membership = PoolFile::parse(POOL).expect("pool").membership();
        let s = Shared::new(&args, &membership).expect("Shared::new");
        assert_eq!(s.metrics.pool_errors.get(), 0, "every pod registered");
        s
    })
}

mod input;
pub use input::*;

fn header_value(k: &str, v: &str) -> HeaderValue {
    HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    }
}

fn metadata(namespace: &str, key: &str, v: Value) -> Metadata {
    Metadata {
        typed_filter_metadata: Default::default(),
        filter_metadata: [(
            namespace.to_owned(),
            Struct {
                fields: [(key.to_owned(), v)].into(),
            },
        )]
        .into(),
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

fn endpoint_name(i: u8) -> &'static str {
    let i = usize::from(i) % (ENDPOINTS.len() + UNKNOWN_ENDPOINTS.len());
    ENDPOINTS
        .get(i)
        .map_or_else(|| UNKNOWN_ENDPOINTS[i - ENDPOINTS.len()], |e| e.0)
}

/// What the model expects of a pick.
#[derive(Debug, Clone, PartialEq)]
enum Expect {
    /// A route to endpoints of `workers` (within `subset` if some), or a 429.
    Route {
        workers: Vec<u64>,
        subset: Option<HashSet<String>>,
        on_body: bool,
    },
    /// A route, or a 400 `refused` (a pick with no prompt tokens).
    RouteOrRefused {
        workers: Vec<u64>,
        subset: Option<HashSet<String>>,
    },
    Refuse(u16, &'static str),
    /// One of two refusals.
    Either((u16, &'static str), (u16, &'static str)),
    /// Any documented answer: a route to the pool, or a documented status and kind.
    Documented,
}

/// The statuses docs/epp.md documents, with their kinds.
const DOCUMENTED: [(u16, &str); 8] = [
    (400, "malformed_body"),
    (400, "no_tokenizer"),
    (400, "refused"),
    (404, "unknown_model"),
    (413, "body_too_large"),
    (429, "busy"),
    (503, "no_endpoint"),
    (503, "tokenizer_error"),
];

/// The exchange as docs/epp.md describes it.
struct Model {
    req_mode: i32,
    resp_mode: i32,
    path: String,
    subset: Option<Vec<String>>,
    answered: bool,
    sent: Vec<u8>,
    /// The exchange holds a pick (routed, not finished).
    picked: Option<Vec<String>>,
    live_response: Vec<u8>,
    expected_fallbacks: u64,
    no_request: u64,
    outcomes: Vec<&'static str>,
}

fn full_duplex(mode: i32) -> bool {
    mode == BodySendMode::FullDuplexStreamed as i32
}

/// The workers serving a request's `model` (None: the pool's default, `m`), or 404.
fn serving(model: Option<&str>) -> Result<Vec<u64>, Expect> {
    let m = model.unwrap_or("m");
    let w: Vec<u64> = match m {
        "m-lora" => vec![2],
        _ => ENDPOINTS.iter().filter(|e| e.2 == m).map(|e| e.1).collect(),
    };
    let mut w = w;
    w.dedup();
    if w.is_empty() {
        Err(Expect::Refuse(404, "unknown_model"))
    } else {
        Ok(w)
    }
}

impl Model {
    /// A pick for `model` under the current subset hint.
    fn pick(&self, model: Option<&str>, empty_prompt: bool, on_body: bool) -> Expect {
        let workers = match serving(model) {
            Ok(w) => w,
            Err(e) => return e,
        };
        let subset = self.subset.as_ref().map(|s| {
            s.iter()
                .filter(|e| {
                    ENDPOINTS
                        .iter()
                        .any(|p| p.0 == e.as_str() && workers.contains(&p.1))
                })
                .cloned()
                .collect::<HashSet<String>>()
        });
        if subset.as_ref().is_some_and(HashSet::is_empty) {
            return Expect::Refuse(503, "no_endpoint");
        }
        if empty_prompt {
            Expect::RouteOrRefused { workers, subset }
        } else {
            Expect::Route {
                workers,
                subset,
                on_body,
            }
        }
    }

    /// The answer to a complete body of class `class` (the full body iff `whole`).
    fn body(&self, full: &[u8], class: &BodyClass) -> Expect {
        let api = match self
            .path
            .split_once('?')
            .map_or(self.path.as_str(), |(p, _)| p)
        {
            "/v1/completions" => false,
            "/v1/chat/completions" => true,
            _ => return Expect::Refuse(400, "malformed_body"),
        };
        if *class == BodyClass::Unknown {
            return Expect::Documented;
        }
        if self.sent.len() != full.len() {
            return Expect::Refuse(400, "malformed_body");
        }
        match class {
            BodyClass::Unknown => unreachable!(),
            BodyClass::Malformed => Expect::Refuse(400, "malformed_body"),
            BodyClass::Valid { chat, model, text } => {
                if *chat != api {
                    return Expect::Refuse(400, "malformed_body");
                }
                if *text {
                    // The model is resolved first (404 for one the pool does not serve);
                    // a text prompt is then tokenized with its base model's tokenizer (no
                    // model: the pool's default "m"; the adapter "m-lora": "m"), else
                    // only the dead /tokenize could read it: 503.
                    if let Err(e) = serving(model.as_deref()) {
                        return e;
                    }
                    let base = match model.as_deref() {
                        None | Some("m") | Some("m-lora") => "m",
                        Some(other) => other,
                    };
                    if base != "m" {
                        return Expect::Refuse(503, "tokenizer_error");
                    }
                }
                self.pick(model.as_deref(), false, !full_duplex(self.req_mode))
            }
        }
    }
}

fn metric_snapshot(s: &Shared) -> (Vec<u64>, u64, u64, u64, u64) {
    let m = &s.metrics;
    (
        OUTCOMES
            .iter()
            .map(|o| m.picks.get_or_create(&Outcome { outcome: o }).get())
            .collect(),
        m.protocol_errors.get(),
        m.fallback_served.get(),
        m.observed_cached_tokens.get(),
        m.broken_streams.get(),
    )
}

/// The destination a route answer sets, checked: header = `envoy.lb` metadata; and
/// whether it rode on the body.
fn route_of(r: &ProcessingResponse) -> Option<(Vec<String>, bool)> {
    let (common, on_body) = match r.response.as_ref()? {
        Response::RequestHeaders(h) => (h.response.as_ref()?, false),
        Response::RequestBody(b) => (b.response.as_ref()?, true),
        _ => return None,
    };
    let set = &common.header_mutation.as_ref()?.set_headers;
    let h = set
        .iter()
        .find_map(|o| o.header.as_ref().filter(|h| h.key == DESTINATION))?;
    let header = String::from_utf8(h.raw_value.clone()).expect("destination is UTF-8");
    let md = r
        .dynamic_metadata
        .as_ref()
        .expect("a route carries envoy.lb metadata");
    let Some(Kind::StructValue(lb)) = md.fields.get(LB_NAMESPACE).and_then(|v| v.kind.as_ref())
    else {
        panic!("no envoy.lb struct: {r:?}")
    };
    let Some(Kind::StringValue(listed)) = lb.fields.get(DESTINATION).and_then(|v| v.kind.as_ref())
    else {
        panic!("no destination in envoy.lb: {r:?}")
    };
    assert_eq!(
        &header, listed,
        "the header and the envoy.lb metadata differ"
    );
    assert!(common.clear_route_cache, "a route clears the route cache");
    Some((header.split(',').map(str::to_owned).collect(), on_body))
}

fn check_route(eps: &[String], workers: &[u64], subset: &Option<HashSet<String>>) {
    assert!(!eps.is_empty(), "a route names an endpoint");
    let mut seen = HashSet::new();
    for e in eps {
        let p = ENDPOINTS
            .iter()
            .find(|p| p.0 == e)
            .unwrap_or_else(|| panic!("{e}: not a pool endpoint"));
        assert!(
            workers.contains(&p.1),
            "{e}: its worker {} does not serve the model ({workers:?})",
            p.1
        );
        assert!(
            seen.insert(p.1),
            "two endpoints of worker {} in {eps:?}",
            p.1
        );
        if let Some(s) = subset {
            assert!(s.contains(e), "{e} is not in the subset hint {s:?}");
        }
    }
}

fn immediate(r: &ProcessingResponse) -> Option<(u16, String)> {
    let Some(Response::ImmediateResponse(i)) = &r.response else {
        return None;
    };
    let code = i.status.as_ref().expect("a status").code;
    let kind = i
        .details
        .strip_prefix("kvr_epp_")
        .expect("details name the kind")
        .to_owned();
    let body: serde_json::Value = serde_json::from_slice(&i.body).expect("a JSON error body");
    assert_eq!(body["error"]["type"], kind.as_str());
    assert_eq!(body["error"]["code"], code);
    Some((u16::try_from(code).expect("an HTTP status"), kind))
}

fn is_phase(r: &ProcessingResponse, phase: fn(CommonResponse) -> Response) -> bool {
    std::mem::discriminant(r.response.as_ref().unwrap())
        == std::mem::discriminant(&phase(CommonResponse::default()))
}

/// The pool endpoints the current hint names (any model's), if a hint was given.
fn m_subset(model: &Model) -> Option<HashSet<String>> {
    model.subset.as_ref().map(|s| s.iter().cloned().collect())
}

/// Checks a pick's answers against the expectation; records the outcome.
fn check_pick(
    model: &mut Model,
    out: &[ProcessingResponse],
    expect: Expect,
    ctx: &dyn Fn() -> String,
) {
    assert!(!out.is_empty(), "no answer to a pick: {}", ctx());
    model.answered = true;
    // A pick ends the stream's earlier booking (request headers twice), whatever it answers.
    model.picked = None;
    if let Some((status, kind)) = immediate(&out[0]) {
        assert_eq!(out.len(), 1, "a refusal is one answer: {}", ctx());
        let ok = match &expect {
            Expect::Refuse(s, k) => (status, kind.as_str()) == (*s, *k),
            Expect::Either(a, b) => [*a, *b].contains(&(status, kind.as_str())),
            Expect::Route { .. } => (status, kind.as_str()) == (429, "busy"),
            Expect::RouteOrRefused { .. } => {
                matches!((status, kind.as_str()), (429, "busy") | (400, "refused"))
            }
            Expect::Documented => DOCUMENTED.contains(&(status, kind.as_str())),
        };
        assert!(
            ok,
            "refused {status} {kind}, expected {expect:?}: {}",
            ctx()
        );
        model.outcomes.push(
            OUTCOMES
                .iter()
                .find(|o| **o == kind)
                .expect("a known outcome"),
        );
        return;
    }
    let (eps, on_body) = route_of(&out[0])
        .unwrap_or_else(|| panic!("neither a route nor a refusal: {out:?}: {}", ctx()));
    match &expect {
        Expect::Route {
            workers,
            subset,
            on_body: ob,
        } => {
            check_route(&eps, workers, subset);
            assert_eq!(
                on_body,
                *ob,
                "the route rides on the wrong message: {}",
                ctx()
            );
        }
        Expect::RouteOrRefused { workers, subset } => {
            check_route(&eps, workers, subset);
            assert!(!on_body);
            assert_eq!(out.len(), 1);
        }
        Expect::Documented => {
            let all: Vec<u64> = ENDPOINTS.iter().map(|e| e.1).collect();
            check_route(&eps, &all, &m_subset(model));
        }
        Expect::Refuse(..) | Expect::Either(..) => {
            panic!("routed to {eps:?}, expected {expect:?}: {}", ctx())
        }
    }
    model.outcomes.push("routed");
    model.picked = Some(eps);
}

/// A chunk's length from its selector: every fourth takes the rest (so whole bodies are
/// common), the others a part of it.
fn chunk_len(take: u16, left: usize) -> usize {
    if take % 4 == 0 {
        left
    } else {
        usize::from(take / 4) % (left + 1)
    }
}

/// `KVR_FUZZ_DEBUG=1`: print each message and its answers.
fn debug() -> bool {
    static D: OnceLock<bool> = OnceLock::new();
    *D.get_or_init(|| std::env::var_os("KVR_FUZZ_DEBUG").is_some())
}

/// Bookings left anywhere: the EPP's gauge, the engine's tables, pending selections.
fn live_bookings(s: &Shared) -> (i64, usize, usize) {
    let app = &s.picker.app;
    let engine: usize = app
        .registry
        .partitions()
        .iter()
        .map(|p| p.partition.bookings().len())
        .sum();
    (s.metrics.bookings_active.get(), engine, app.pending.len())
}

/// What inputs exercised (the seeds must cover every field).
#[derive(Debug, Default, Clone)]
pub struct Summary {
    /// Answers by outcome, as [`SUMMARY_OUTCOMES`].
    pub outcomes: [u64; 6],
    /// Picks at the request headers (no body).
    pub header_picks: u64,
    /// Bodies handed back after a full-duplex route.
    pub echoed_bodies: u64,
    pub fallbacks: u64,
    pub no_request: u64,
    /// Streams dropped with their booking live.
    pub broken: u64,
    /// Responses whose cached tokens were counted.
    pub usage_counted: u64,
}

/// The outcomes the pool and flags make reachable (no `no_tokenizer`: a `/tokenize` is
/// configured; `busy` and `refused` are possible, not required).
const SUMMARY_OUTCOMES: [&str; 6] = [
    "routed",
    "malformed_body",
    "body_too_large",
    "tokenizer_error",
    "unknown_model",
    "no_endpoint",
];

impl Summary {
    /// Every counter, by name.
    pub fn fields(&self) -> Vec<(&'static str, u64)> {
        let mut v: Vec<(&'static str, u64)> = SUMMARY_OUTCOMES
            .iter()
            .copied()
            .zip(self.outcomes)
            .collect();
        v.extend([
            ("header_picks", self.header_picks),
            ("echoed_bodies", self.echoed_bodies),
            ("fallbacks", self.fallbacks),
            ("no_request", self.no_request),
            ("broken", self.broken),
            ("usage_counted", self.usage_counted),
        ]);
        v
    }

    pub fn add(&mut self, o: &Summary) {
        for (a, b) in self.outcomes.iter_mut().zip(o.outcomes) {
            *a += b;
        }
        self.header_picks += o.header_picks;
        self.echoed_bodies += o.echoed_bodies;
        self.fallbacks += o.fallbacks;
        self.no_request += o.no_request;
        self.broken += o.broken;
        self.usage_counted += o.usage_counted;
    }
}

/// The target: panics on a finding.
pub fn run(data: &[u8]) {
    run_summary(data);
}

/// [`run`], returning what the input exercised.
pub fn run_summary(data: &[u8]) -> Summary {
    let mut sum = Summary::default();
    let mut u = Unstructured::new(data);
    let Ok(input) = Input::arbitrary(&mut u) else {
        return sum;
    };
    let s = shared();
    assert_eq!(
        live_bookings(s),
        (0, 0, 0),
        "bookings left before the input"
    );
    for stream in input.streams.iter().take(MAX_STREAMS) {
        run_stream(s, stream, &mut sum);
        assert_eq!(
            live_bookings(s),
            (0, 0, 0),
            "bookings left after a stream: {stream:?}"
        );
    }
    sum
}

fn run_stream(s: &Shared, stream: &StreamIn, sum: &mut Summary) {
    let (body, class) = stream.body.build();
    let (resp, reported) = stream.response.build();
    let before = metric_snapshot(s);
    let mut ex = Exchange::new(s.clone());
    let mut m = Model {
        req_mode: BodySendMode::Buffered as i32,
        resp_mode: BodySendMode::None as i32,
        path: String::new(),
        subset: None,
        answered: false,
        sent: Vec::new(),
        picked: None,
        live_response: Vec::new(),
        expected_fallbacks: 0,
        no_request: 0,
        outcomes: Vec::new(),
    };
    let (mut body_at, mut resp_at) = (0usize, 0usize);
    for (i, msg) in stream.msgs.iter().take(MAX_MSGS).enumerate() {
        let protocol_config = msg.config.map(|(rq, rs)| {
            let rq = MODES[usize::from(rq) % MODES.len()] as i32;
            // An index past the table: a mode Envoy does not define.
            let rs = if rs == 255 {
                99
            } else {
                MODES[usize::from(rs) % MODES.len()] as i32
            };
            m.req_mode = rq;
            m.resp_mode = rs;
            ProtocolConfiguration {
                request_body_mode: rq,
                response_body_mode: rs,
                ..Default::default()
            }
        });
        let mut metadata_context = None;
        let request = match &msg.kind {
            MsgKind::NoRequest => None,
            MsgKind::RequestHeaders {
                path,
                session,
                subset,
                end,
            } => {
                let p = PATHS[usize::from(*path) % PATHS.len()];
                let mut h = vec![header_value(":method", "POST")];
                if !p.is_empty() {
                    h.push(header_value(":path", p));
                }
                if let Some(sid) = session {
                    h.push(header_value(SESSION_HEADER, &format!("s{}", sid % 4)));
                }
                m.path = p.to_owned();
                m.subset = None;
                if let Some(sel) = subset {
                    let v = match sel {
                        SubsetSel::Joined(ix) => {
                            let names: Vec<&str> =
                                ix.iter().take(6).map(|i| endpoint_name(*i)).collect();
                            m.subset = Some(names.iter().map(|n| (*n).to_owned()).collect());
                            string_value(&names.join(" ,"))
                        }
                        SubsetSel::List(ix) => {
                            let names: Vec<&str> =
                                ix.iter().take(6).map(|i| endpoint_name(*i)).collect();
                            m.subset = Some(names.iter().map(|n| (*n).to_owned()).collect());
                            Value {
                                kind: Some(Kind::ListValue(ListValue {
                                    values: names.iter().map(|n| string_value(n)).collect(),
                                })),
                            }
                        }
                        SubsetSel::WrongType => Value {
                            kind: Some(Kind::NumberValue(3.0)),
                        },
                    };
                    metadata_context = Some(metadata(SUBSET_NAMESPACE, SUBSET_KEY, v));
                }
                Some(Request::RequestHeaders(HttpHeaders {
                    headers: Some(HeaderMap { headers: h }),
                    end_of_stream: *end,
                    ..Default::default()
                }))
            }
            MsgKind::RequestBody { take, end } => {
                let n = chunk_len(*take, body.len() - body_at);
                let chunk = body[body_at..body_at + n].to_vec();
                body_at += n;
                Some(Request::RequestBody(HttpBody {
                    body: chunk,
                    end_of_stream: *end,
                    ..Default::default()
                }))
            }
            MsgKind::RequestTrailers => Some(Request::RequestTrailers(HttpTrailers::default())),
            MsgKind::ResponseHeaders { served, end } => {
                if let Some(sel) = served {
                    let picked = m.picked.clone().unwrap_or_default();
                    let name = match sel {
                        ServedSel::Picked => picked.first().cloned().unwrap_or_default(),
                        ServedSel::Fallback(i) => picked
                            .get(1 + usize::from(*i) % picked.len().max(1))
                            .cloned()
                            .unwrap_or_else(|| ENDPOINTS[usize::from(*i) % 4].0.to_owned()),
                        ServedSel::Pool(i) => {
                            ENDPOINTS[usize::from(*i) % ENDPOINTS.len()].0.to_owned()
                        }
                        ServedSel::Unknown(i) => {
                            UNKNOWN_ENDPOINTS[usize::from(*i) % UNKNOWN_ENDPOINTS.len()].to_owned()
                        }
                        ServedSel::Garbage(g) => g.chars().take(40).collect(),
                        ServedSel::Empty => String::new(),
                    };
                    let trimmed = name.trim();
                    if let Some(p) = &m.picked {
                        if !trimmed.is_empty() && p.first().map(String::as_str) != Some(trimmed) {
                            m.expected_fallbacks += 1;
                        }
                    }
                    metadata_context = Some(metadata(LB_NAMESPACE, SERVED, string_value(&name)));
                }
                let mut h = vec![header_value(":status", "200")];
                h.push(header_value("content-type", "text/event-stream"));
                Some(Request::ResponseHeaders(HttpHeaders {
                    headers: Some(HeaderMap { headers: h }),
                    end_of_stream: *end,
                    ..Default::default()
                }))
            }
            MsgKind::ResponseBody { take, end } => {
                let n = chunk_len(*take, resp.len() - resp_at);
                let chunk = resp[resp_at..resp_at + n].to_vec();
                resp_at += n;
                Some(Request::ResponseBody(HttpBody {
                    body: chunk,
                    end_of_stream: *end,
                    ..Default::default()
                }))
            }
            MsgKind::ResponseTrailers => Some(Request::ResponseTrailers(HttpTrailers::default())),
        };
        let req = ProcessingRequest {
            request: request.clone(),
            metadata_context,
            protocol_config,
            ..Default::default()
        };
        let out = ex.handle(req);
        let ctx = || format!("message {i} of {stream:?}");
        if debug() {
            eprintln!("message {i}: {msg:?} → {out:?}");
        }
        let Some(request) = request else {
            m.no_request += 1;
            assert!(out.is_empty(), "an answer to no request: {}", ctx());
            continue;
        };
        use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as R;
        match request {
            Request::RequestHeaders(h) => {
                if h.end_of_stream || m.req_mode == BodySendMode::None as i32 {
                    let e = m.pick(None, true, false);
                    check_pick(&mut m, &out, e, &ctx);
                    sum.header_picks += 1;
                } else if full_duplex(m.req_mode) {
                    assert!(out.is_empty(), "full duplex holds the headers: {}", ctx());
                } else {
                    assert!(
                        out.len() == 1 && is_phase(&out[0], kvr_epp::protocol::request_headers),
                        "{out:?} {}",
                        ctx()
                    );
                }
            }
            Request::RequestBody(b) => {
                if m.answered {
                    assert!(
                        !out.is_empty()
                            && out
                                .iter()
                                .all(|r| matches!(r.response, Some(R::RequestBody(_)))),
                        "{out:?} {}",
                        ctx()
                    );
                    if !full_duplex(m.req_mode) {
                        assert_eq!(out.len(), 1);
                    }
                } else if m.sent.len() + b.body.len() > MAX_BODY {
                    check_pick(&mut m, &out, Expect::Refuse(413, "body_too_large"), &ctx);
                } else {
                    m.sent.extend_from_slice(&b.body);
                    if !b.end_of_stream {
                        if full_duplex(m.req_mode) {
                            assert!(out.is_empty(), "{out:?} {}", ctx());
                        } else {
                            assert!(
                                out.len() == 1
                                    && is_phase(&out[0], kvr_epp::protocol::request_body),
                                "{out:?} {}",
                                ctx()
                            );
                        }
                    } else {
                        let e = m.body(&body, &class);
                        let routes = matches!(e, Expect::Route { .. });
                        check_pick(&mut m, &out, e, &ctx);
                        if routes && route_of(&out[0]).is_some() && full_duplex(m.req_mode) {
                            // The body goes back after the route, unchanged.
                            let mut echoed = Vec::new();
                            for (k, r) in out[1..].iter().enumerate() {
                                let Some(R::RequestBody(br)) = &r.response else {
                                    panic!("{r:?}")
                                };
                                let Some(envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation::StreamedResponse(sr)) =
                                    br.response.as_ref().and_then(|c| c.body_mutation.as_ref()).and_then(|b| b.mutation.as_ref())
                                else {
                                    panic!("{r:?}")
                                };
                                assert_eq!(sr.end_of_stream, k + 2 == out.len());
                                echoed.extend_from_slice(&sr.body);
                            }
                            assert_eq!(echoed, m.sent, "the body goes on unchanged: {}", ctx());
                            sum.echoed_bodies += 1;
                        }
                    }
                }
            }
            Request::RequestTrailers(_) => {
                assert!(
                    out.len() == 1 && matches!(out[0].response, Some(R::RequestTrailers(_))),
                    "{}",
                    ctx()
                );
            }
            Request::ResponseHeaders(h) => {
                assert!(
                    out.len() == 1 && is_phase(&out[0], kvr_epp::protocol::response_headers),
                    "{}",
                    ctx()
                );
                if h.end_of_stream {
                    m.picked = None;
                }
            }
            Request::ResponseBody(b) => {
                if m.picked.is_some() {
                    m.live_response.extend_from_slice(&b.body);
                }
                if full_duplex(m.resp_mode) {
                    assert!(
                        !out.is_empty()
                            && out
                                .iter()
                                .all(|r| matches!(r.response, Some(R::ResponseBody(_)))),
                        "{}",
                        ctx()
                    );
                } else {
                    assert!(
                        out.len() == 1 && is_phase(&out[0], kvr_epp::protocol::response_body),
                        "{}",
                        ctx()
                    );
                }
                if b.end_of_stream {
                    m.picked = None;
                }
            }
            Request::ResponseTrailers(_) => {
                assert!(
                    out.len() == 1 && matches!(out[0].response, Some(R::ResponseTrailers(_))),
                    "{}",
                    ctx()
                );
                m.picked = None;
            }
        }
    }
    drop(ex);
    let after = metric_snapshot(s);
    for (k, o) in OUTCOMES.iter().enumerate() {
        let seen = m.outcomes.iter().filter(|x| *x == o).count() as u64;
        assert_eq!(
            after.0[k] - before.0[k],
            seen,
            "kvr_epp_picks{{outcome={o}}} moved by other than the answers: {stream:?}"
        );
    }
    assert_eq!(
        after.1 - before.1,
        m.no_request,
        "protocol_errors: {stream:?}"
    );
    assert_eq!(
        after.2 - before.2,
        m.expected_fallbacks,
        "fallback_served: {stream:?}"
    );
    if reported.is_some() {
        // The usage the response carried while booked is counted once.
        let key = b"\"cached_tokens\":";
        let mut want = 0;
        let live = &m.live_response;
        if let Some(at) = live.windows(key.len()).position(|w| w == key) {
            let rest = &live[at + key.len()..];
            let digits = rest.iter().take_while(|c| c.is_ascii_digit()).count();
            if digits > 0 && digits < rest.len() {
                want = std::str::from_utf8(&rest[..digits])
                    .unwrap()
                    .parse::<u64>()
                    .unwrap();
            }
        }
        assert_eq!(
            after.3 - before.3,
            want,
            "observed cached tokens: {stream:?}"
        );
        sum.usage_counted += u64::from(want > 0);
    }
    assert!(after.4 - before.4 <= 1, "broken_streams: {stream:?}");
    sum.broken += after.4 - before.4;
    sum.fallbacks += m.expected_fallbacks;
    sum.no_request += m.no_request;
    for (k, o) in SUMMARY_OUTCOMES.iter().enumerate() {
        sum.outcomes[k] += m.outcomes.iter().filter(|x| *x == o).count() as u64;
    }
}
