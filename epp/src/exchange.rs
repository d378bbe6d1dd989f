//! One request's ext_proc stream: what the picker answers to each message Envoy sends.
//!
//! Request path: the headers are held until the body is complete (full-duplex streamed
//! mode, the protocol's) or answered at once (buffered mode, where the route rides on the
//! body's answer); the body is read, tokenized and picked for; the answer sets the
//! destination (header and `envoy.lb` metadata) and hands the body back. Response path:
//! the endpoint that served is read from `envoy.lb` (a fallback that served takes the
//! booking), the first body bytes mark the prefill done, streamed chunks count output
//! blocks, the end of the stream frees the booking. A stream that ends any other way
//! (reset, cancelled, broken) frees it when the exchange is dropped, at once.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, processing_response::Response, ProcessingRequest,
    ProcessingResponse, TrailersResponse,
};

use crate::metrics::EppMetrics;
use crate::picker::{Pick, PickConfig, PickInput, Picker};
use crate::pool::{self, Membership};
use crate::prompt::{self, Tokenization};
use crate::protocol::{self as p, header, metadata_string, split_endpoints};

/// What every exchange shares.
#[derive(Debug, Clone)]
pub struct Shared {
    pub picker: Arc<Picker>,
    pub metrics: EppMetrics,
    pub tokenizer: Arc<Tokenization>,
    /// Largest request body read, bytes.
    pub max_body_bytes: usize,
    /// The request header naming a session (affinity), if any.
    pub session_header: Option<String>,
}

impl Shared {
    /// The state every exchange shares, built from the flags and a membership (no
    /// listener, no watcher: `serve_with` adds those; the fuzz target and tests build
    /// exchanges on it directly): the selection service, the pool's pods registered in
    /// it (a pod refused is logged and counted in `pool_errors`), the picker and the
    /// tokenizers.
    pub fn new(args: &crate::EppArgs, membership: &Membership) -> Result<Shared, String> {
        let tokenization = Tokenization::new(
            &args.tokenizers,
            args.tokenize_url.as_deref(),
            std::time::Duration::from_millis(args.tokenize_timeout_ms.max(1)),
            prompt::reuse_config(args.tokenize_reuse_mb),
        )?;
        let mut registered = None;
        let app = kvr_service::App::with_metrics(args.serve.clone(), |r| {
            registered = Some(EppMetrics::register(r, tokenization.local.clone()))
        })?;
        let metrics = registered.expect("the metrics hook runs in App::with_metrics");
        for e in pool::apply(&app, &Membership::default(), membership) {
            tracing::warn!(error = %e, "pool member not registered");
            metrics.pool_errors.inc();
        }
        let picker = Arc::new(Picker::new(
            app,
            membership.clone(),
            PickConfig {
                fallbacks: args.fallbacks,
                shed_when_busy: args.shed_when_busy,
            },
        ));
        Ok(Shared {
            picker,
            metrics,
            tokenizer: Arc::new(tokenization),
            max_body_bytes: args.serve.max_body_bytes,
            session_header: args.session_header.clone(),
        })
    }
}

/// One stream's state.
#[derive(Debug)]
pub struct Exchange {
    shared: Shared,
    request_mode: i32,
    response_mode: i32,
    path: String,
    subset: Option<Vec<String>>,
    session: Option<String>,
    body: Vec<u8>,
    /// The request is answered (routed or refused): later request messages pass.
    answered: bool,
    pick: Option<Pick>,
    response_started: bool,
    /// Output tokens seen in a streamed response (one per `data:` event).
    output_tokens: u64,
    /// The last bytes of the previous response chunk (a field may straddle two).
    tail: Vec<u8>,
}

impl Exchange {
    pub fn new(shared: Shared) -> Self {
        Exchange {
            shared,
            request_mode: BodySendMode::Buffered as i32,
            response_mode: BodySendMode::None as i32,
            path: String::new(),
            subset: None,
            session: None,
            body: Vec::new(),
            answered: false,
            pick: None,
            response_started: false,
            output_tokens: 0,
            tail: Vec::new(),
        }
    }

    fn full_duplex(mode: i32) -> bool {
        mode == BodySendMode::FullDuplexStreamed as i32
    }

    /// The answers to one message (none while a full-duplex body is still coming).
    pub fn handle(&mut self, req: ProcessingRequest) -> Vec<ProcessingResponse> {
        if let Some(pc) = &req.protocol_config {
            self.request_mode = pc.request_body_mode;
            self.response_mode = pc.response_body_mode;
        }
        let Some(message) = req.request else {
            self.shared.metrics.protocol_errors.inc();
            return Vec::new();
        };
        match message {
            Request::RequestHeaders(h) => {
                let hm = h.headers.as_ref();
                self.path = header(hm, ":path")
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default();
                self.session = self
                    .shared
                    .session_header
                    .as_deref()
                    .and_then(|name| header(hm, name))
                    .map(|v| String::from_utf8_lossy(v).into_owned());
                self.subset = metadata_string(
                    req.metadata_context.as_ref(),
                    p::SUBSET_NAMESPACE,
                    p::SUBSET_KEY,
                )
                .map(|s| split_endpoints(&s));
                if h.end_of_stream || self.request_mode == BodySendMode::None as i32 {
                    // No body to read: picked on load alone.
                    return vec![self.route(false, Vec::new(), None, None)];
                }
                if Self::full_duplex(self.request_mode) {
                    return Vec::new();
                }
                vec![p::carry_on(p::request_headers)]
            }
            Request::RequestBody(b) => {
                if self.answered {
                    // Streamed mode after the route was set, or a body after a refusal.
                    return if Self::full_duplex(self.request_mode) {
                        p::streamed_body(&b.body, b.end_of_stream, p::request_body)
                    } else {
                        vec![p::carry_on(p::request_body)]
                    };
                }
                if self.body.len() + b.body.len() > self.shared.max_body_bytes {
                    let e = prompt::PromptError::Body(kvr_tokenize::BodyError::TooLarge {
                        len: self.body.len() + b.body.len(),
                        limit: self.shared.max_body_bytes,
                    });
                    return vec![self.refuse(e.status(), e.kind(), &e.message())];
                }
                self.body.extend_from_slice(&b.body);
                if !b.end_of_stream {
                    return if Self::full_duplex(self.request_mode) {
                        Vec::new()
                    } else {
                        vec![p::carry_on(p::request_body)]
                    };
                }
                self.pick_for_body()
            }
            Request::RequestTrailers(_) => vec![ProcessingResponse {
                response: Some(Response::RequestTrailers(TrailersResponse::default())),
                ..Default::default()
            }],
            Request::ResponseHeaders(h) => {
                if let Some(served) =
                    metadata_string(req.metadata_context.as_ref(), p::LB_NAMESPACE, p::SERVED)
                {
                    self.served_by(served.trim());
                }
                if h.end_of_stream {
                    self.finish();
                }
                vec![p::carry_on(p::response_headers)]
            }
            Request::ResponseBody(b) => {
                self.on_response_bytes(&b.body);
                if b.end_of_stream {
                    self.finish();
                }
                if Self::full_duplex(self.response_mode) {
                    p::streamed_body(&b.body, b.end_of_stream, p::response_body)
                } else {
                    vec![p::carry_on(p::response_body)]
                }
            }
            Request::ResponseTrailers(_) => {
                self.finish();
                vec![ProcessingResponse {
                    response: Some(Response::ResponseTrailers(TrailersResponse::default())),
                    ..Default::default()
                }]
            }
        }
    }

    /// The body is complete: read it, pick, answer.
    fn pick_for_body(&mut self) -> Vec<ProcessingResponse> {
        let body = std::mem::take(&mut self.body);
        // Tokenizing is CPU (a 32k-token prompt takes milliseconds) or a blocking call
        // to the engine's /tokenize: off the async workers' hands.
        let parsed = match blocking(|| prompt::parse(&self.path, &body, self.shared.max_body_bytes))
        {
            Ok(p) => p,
            Err(e) => return vec![self.refuse(e.status(), e.kind(), &e.message())],
        };
        // A model the pool does not serve is 404, whatever its prompt: no tokenizer (and no
        // engine's /tokenize) is asked about it.
        let base = match self.shared.picker.check_model(parsed.model()) {
            Ok(base) => base,
            Err(e) => return vec![self.refuse(e.status(), e.kind(), e.message())],
        };
        let read = blocking(|| parsed.tokenize(&self.shared.tokenizer, &base));
        let r = match read {
            Ok(r) => r,
            Err(e) => return vec![self.refuse(e.status(), e.kind(), &e.message())],
        };
        self.shared.metrics.phase("parse", r.parse_secs);
        self.shared.metrics.phase("tokenize", r.tokenize_secs);
        let on_body = !Self::full_duplex(self.request_mode);
        let routed = self.route(on_body, r.tokens, r.model, r.max_tokens);
        if !on_body && self.pick.is_some() {
            let mut out = vec![routed];
            out.extend(p::streamed_body(&body, true, p::request_body));
            return out;
        }
        vec![routed]
    }

    /// Picks with `tokens` and answers with the route (or the refusal).
    fn route(
        &mut self,
        on_body: bool,
        tokens: Vec<u32>,
        model: Option<String>,
        max_tokens: Option<u64>,
    ) -> ProcessingResponse {
        // Request headers twice on one stream (out of protocol) pick twice: the first
        // booking ends here, counted, instead of being dropped with the gauge still up.
        self.finish();
        let t0 = Instant::now();
        let result = self.shared.picker.pick(PickInput {
            model: model.as_deref(),
            tokens,
            subset: self.subset.clone(),
            session: self.session.clone(),
            expected_output_tokens: max_tokens,
        });
        let secs = t0.elapsed().as_secs_f64();
        self.shared.metrics.phase("select", secs);
        match result {
            Ok(pick) => {
                self.answered = true;
                self.shared.metrics.outcome("routed");
                self.shared.metrics.bookings_active.inc();
                self.shared
                    .metrics
                    .predicted_cached_tokens
                    .inc_by(pick.predicted_cached_tokens);
                if pick.cache_given_up_tokens > 0 {
                    self.shared.metrics.cache_given_up_for_load.inc();
                    self.shared
                        .metrics
                        .cached_tokens_given_up
                        .inc_by(pick.cache_given_up_tokens);
                }
                let list = pick.endpoints.join(",");
                self.pick = Some(pick);
                p::route_to(&list, &[], on_body)
            }
            Err(e) => self.refuse(e.status(), e.kind(), e.message()),
        }
    }

    fn refuse(&mut self, status: u16, kind: &'static str, message: &str) -> ProcessingResponse {
        self.answered = true;
        self.shared.metrics.outcome(kind);
        tracing::debug!(status, kind, message, path = %self.path, "request refused");
        p::immediate(status, kind, message)
    }

    /// The load balancer reports the endpoint that served: a fallback takes the booking.
    fn served_by(&mut self, served: &str) {
        let Some(pick) = self.pick.as_mut() else {
            return;
        };
        if pick.endpoints.first().map(String::as_str) == Some(served) || served.is_empty() {
            return;
        }
        self.shared.metrics.fallback_served.inc();
        let picker = self.shared.picker.clone();
        let was_live = pick.booking.is_live();
        let moved = picker.rebook(pick, served);
        // The gauge follows the booking: a rebooking the serving rank refused (another
        // model's pod, busy) leaves none; a later report of a rank that takes it books again.
        match (was_live, pick.booking.is_live()) {
            (true, false) => self.shared.metrics.bookings_active.dec(),
            (false, true) => self.shared.metrics.bookings_active.inc(),
            _ => 0,
        };
        if !moved {
            tracing::warn!(
                served,
                "the serving endpoint is not in the pool or refused the booking"
            );
        }
    }

    fn on_response_bytes(&mut self, chunk: &[u8]) {
        let Some(pick) = self.pick.as_ref() else {
            return;
        };
        if !self.response_started {
            self.response_started = true;
            pick.booking.prefill_complete();
        }
        // A field may straddle two chunks: scan this one with the last one's tail.
        let mut scan = std::mem::take(&mut self.tail);
        let fresh = scan.len();
        scan.extend_from_slice(chunk);
        let events = count_events(&scan[fresh.saturating_sub(5)..]);
        let bs = u64::from(pick.booking.block_size.max(1));
        for _ in 0..events {
            self.output_tokens += 1;
            if self.output_tokens.is_multiple_of(bs) {
                pick.booking.output_block();
            }
        }
        // Counted once: in the chunk holding the byte after the number (the one that
        // shows it complete; a number ending the previous chunk was not counted there).
        if let Some((cached, end)) = find_number(&scan, b"\"cached_tokens\":") {
            if end >= fresh {
                self.shared.metrics.observed_cached_tokens.inc_by(cached);
                if let Some((prompt, _)) = find_number(&scan, b"\"prompt_tokens\":") {
                    self.shared.metrics.observed_prompt_tokens.inc_by(prompt);
                }
            }
        }
        let keep = scan.len().min(64);
        self.tail = scan[scan.len() - keep..].to_vec();
    }

    /// The response ended: the booking ends.
    fn finish(&mut self) {
        if let Some(mut pick) = self.pick.take() {
            if pick.booking.free() {
                self.shared.metrics.bookings_active.dec();
            }
        }
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        if let Some(mut pick) = self.pick.take() {
            if pick.booking.free() {
                self.shared.metrics.bookings_active.dec();
                self.shared.metrics.broken_streams.inc();
            }
        }
    }
}

/// Runs `f` where blocking is allowed: in place on a multi-threaded runtime's worker
/// (`block_in_place`), else directly.
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Server-sent events (`data: ` at a line start) other than `[DONE]`.
fn count_events(bytes: &[u8]) -> u64 {
    let mut n = 0;
    let mut i = 0;
    while let Some(at) = find(&bytes[i..], b"data: ") {
        let start = i + at;
        let line_start = start == 0 || bytes[start - 1] == b'\n';
        let rest = &bytes[start + 6..];
        if line_start && !rest.starts_with(b"[DONE]") {
            n += 1;
        }
        i = start + 6;
    }
    n
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The number after the last `key` in `hay` (whitespace allowed), if complete, and the
/// index just past it.
fn find_number(hay: &[u8], key: &[u8]) -> Option<(u64, usize)> {
    let at = hay.windows(key.len()).rposition(|w| w == key)? + key.len();
    let skip = hay[at..].iter().position(|c| !c.is_ascii_whitespace())?;
    let start = at + skip;
    let len = hay[start..].iter().position(|c| !c.is_ascii_digit())?;
    let n = std::str::from_utf8(&hay[start..start + len])
        .ok()?
        .parse()
        .ok()?;
    Some((n, start + len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_and_usage_fields_are_read() {
        assert_eq!(
            count_events(b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n"),
            2
        );
        assert_eq!(count_events(b"xdata: 1"), 0);
        assert_eq!(
            find_number(b"{\"usage\":{\"prompt_tokens\": 40,\"prompt_tokens_details\":{\"cached_tokens\":32}}}", b"\"cached_tokens\":").map(|f| f.0),
            Some(32)
        );
        assert_eq!(
            find_number(b"\"cached_tokens\":3", b"\"cached_tokens\":"),
            None,
            "incomplete"
        );
    }
}
