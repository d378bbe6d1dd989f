//! A pod's HTTP side: vLLM's OpenAI-compatible routes, plus `/emulate/*` to inspect and
//! steer the emulation. Every response names the pod (`x-kvr-emulated-pod`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use crate::cache::AdmitError;
use crate::openai::{
    error_body, output_piece, output_text, usage, ChatRequest, CompletionRequest, Envelope, Kind,
    Prompt, TokenizeRequest,
};
use crate::pod::{Mode, Pod, Running};

/// The header naming the pod that answered.
pub const POD_HEADER: &str = "x-kvr-emulated-pod";

/// The pod's routes.
pub fn router(pod: Arc<Pod>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/tokenize", post(tokenize))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v1/models", get(models))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/emulate/state", get(state))
        .route("/emulate/mode", post(set_mode))
        .route("/emulate/drop_events", post(drop_events))
        .layer(axum::middleware::from_fn_with_state(pod.clone(), gate))
        .with_state(pod)
}

/// Refuses or hangs as the pod's mode says (never `/emulate/*`, so a test can switch it
/// back), and names the pod on every response.
async fn gate(State(pod): State<Arc<Pod>>, req: Request, next: Next) -> Response {
    let steering = req.uri().path().starts_with("/emulate/");
    let mode = if steering { Mode::Serve } else { pod.mode() };
    let mut resp = match mode {
        Mode::Serve => next.run(req).await,
        Mode::Refuse => {
            pod.log(format_args!(
                "path={} refused (mode refuse)",
                req.uri().path()
            ));
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailableError",
                "the pod refuses requests (emulated)",
            )
        }
        Mode::Hang => {
            pod.log(format_args!(
                "path={} hanging (mode hang)",
                req.uri().path()
            ));
            std::future::pending::<()>().await;
            unreachable!("a pending future never completes")
        }
    };
    if let Ok(v) = HeaderValue::from_str(pod.name()) {
        resp.headers_mut()
            .insert(HeaderName::from_static(POD_HEADER), v);
    }
    resp
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    (status, Json(error_body(message, kind, status.as_u16()))).into_response()
}

fn bad_request(message: &str) -> Response {
    error(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

/// An error answer not yet rendered (small, unlike a `Response`).
struct Refusal {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        error(self.status, self.kind, &self.message)
    }
}

fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, Refusal> {
    serde_json::from_slice(body).map_err(|e| Refusal {
        status: StatusCode::BAD_REQUEST,
        kind: "BadRequestError",
        message: format!("invalid request body: {e}"),
    })
}

fn check_model(pod: &Pod, model: Option<&str>) -> Result<(), Refusal> {
    match model {
        Some(m) if m != pod.cfg.model => Err(Refusal {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!("The model `{m}` does not exist."),
        }),
        _ => Ok(()),
    }
}

async fn completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: CompletionRequest = match parse(&body) {
        Ok(r) => r,
        Err(resp) => return resp.into_response(),
    };
    if let Err(resp) = check_model(&pod, req.model.as_deref()) {
        return resp.into_response();
    }
    let tokens = match req.prompt {
        Prompt::Text(t) => pod.tokenize(&t),
        Prompt::Tokens(t) => t,
        Prompt::Texts(t) if t.len() == 1 => pod.tokenize(&t[0]),
        Prompt::TokenLists(mut t) if t.len() == 1 => t.remove(0),
        _ => return bad_request("the emulator serves one prompt per request"),
    };
    let include_usage = req.stream_options.unwrap_or_default().include_usage;
    let job = Job {
        kind: Kind::Text,
        path: "/v1/completions",
        max_tokens: req.max_tokens.unwrap_or(pod.cfg.default_max_tokens),
        stream: req.stream,
        include_usage,
    };
    complete(pod, job, tokens).await
}

async fn chat_completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: ChatRequest = match parse(&body) {
        Ok(r) => r,
        Err(resp) => return resp.into_response(),
    };
    if let Err(resp) = check_model(&pod, req.model.as_deref()) {
        return resp.into_response();
    }
    let tokens = pod
        .tokenizer
        .encode_chat(&req.messages, req.add_generation_prompt);
    let job = Job {
        kind: Kind::Chat,
        path: "/v1/chat/completions",
        max_tokens: req
            .max_completion_tokens
            .or(req.max_tokens)
            .unwrap_or(pod.cfg.default_max_tokens),
        stream: req.stream,
        include_usage: req.stream_options.unwrap_or_default().include_usage,
    };
    complete(pod, job, tokens).await
}

/// One completion to run.
struct Job {
    kind: Kind,
    path: &'static str,
    max_tokens: usize,
    stream: bool,
    include_usage: bool,
}

async fn complete(pod: Arc<Pod>, job: Job, tokens: Vec<u32>) -> Response {
    if tokens.is_empty() {
        return bad_request("the prompt is empty");
    }
    let max_len = pod.cfg.max_model_len;
    if tokens.len() + job.max_tokens > max_len {
        return bad_request(&format!(
            "This model's maximum context length is {max_len} tokens. However, you requested \
             {} tokens ({} in the messages, {} in the completion).",
            tokens.len() + job.max_tokens,
            tokens.len(),
            job.max_tokens
        ));
    }
    let mut running = match pod.admit(&tokens, job.max_tokens).await {
        Ok(r) => r,
        Err(AdmitError::TooLarge { need, capacity }) => {
            return bad_request(&format!(
                "the request needs {need} KV blocks; the pod's cache has {capacity}"
            ))
        }
        Err(AdmitError::NoRoom) => unreachable!("admit waits for room"),
    };
    pod.log(format_args!(
        "path={} request={} prompt_tokens={} cached_tokens={} max_tokens={} stream={}",
        job.path,
        running.id,
        running.prompt_tokens,
        running.cached_tokens,
        job.max_tokens,
        job.stream
    ));
    running.prefill(&tokens).await;
    let prefix = match job.kind {
        Kind::Text => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let envelope = Envelope {
        kind: job.kind,
        id: format!("{prefix}-{}-{}", pod.name(), running.id),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: pod.cfg.model.clone(),
    };
    if !job.stream {
        let step = pod.cfg.timing.decode_step();
        crate::pod::wait(step * job.max_tokens as u32).await;
        let u = usage(running.prompt_tokens, job.max_tokens, running.cached_tokens);
        drop(running);
        return Json(envelope.full(&output_text(job.max_tokens), u)).into_response();
    }
    Sse::new(token_stream(pod, envelope, running, job)).into_response()
}

/// What a streaming completion still has to send.
struct StreamState {
    pod: Arc<Pod>,
    envelope: Envelope,
    /// Held until the last token is out (its blocks stay referenced meanwhile).
    running: Option<Running>,
    job: Job,
    /// The next step: a chat's role chunk (chat only), tokens, usage, `[DONE]`.
    step: usize,
}

fn token_stream(
    pod: Arc<Pod>,
    envelope: Envelope,
    running: Running,
    job: Job,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let first = usize::from(job.kind == Kind::Text);
    let state = StreamState {
        pod,
        envelope,
        running: Some(running),
        job,
        step: first,
    };
    stream::unfold(state, |mut s| async move {
        let n = s.job.max_tokens;
        let step = s.step;
        s.step += 1;
        let data = if step == 0 {
            s.envelope.chunk(None, false)
        } else if step <= n {
            crate::pod::wait(s.pod.cfg.timing.decode_step()).await;
            s.envelope.chunk(Some(&output_piece(step - 1)), step == n)
        } else if step == n + 1 {
            let r = s.running.take()?;
            let u = usage(r.prompt_tokens, n, r.cached_tokens);
            drop(r);
            if !s.job.include_usage {
                return Some((Ok(Event::default().data("[DONE]")), s));
            }
            s.envelope.usage_chunk(u)
        } else if step == n + 2 && s.job.include_usage {
            return Some((Ok(Event::default().data("[DONE]")), s));
        } else {
            return None;
        };
        Some((Ok(Event::default().data(data.to_string())), s))
    })
}

async fn tokenize(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let req: TokenizeRequest = match parse(&body) {
        Ok(r) => r,
        Err(resp) => return resp.into_response(),
    };
    if let Err(resp) = check_model(&pod, req.model.as_deref()) {
        return resp.into_response();
    }
    let tokens = match (req.prompt, req.messages) {
        (Some(p), None) => pod.tokenize(&p),
        (None, Some(m)) => pod.tokenizer.encode_chat(&m, req.add_generation_prompt),
        _ => return bad_request("give either `prompt` or `messages`"),
    };
    Json(json!({
        "count": tokens.len(),
        "max_model_len": pod.cfg.max_model_len,
        "tokens": tokens,
        "token_strs": null,
    }))
    .into_response()
}

async fn models(State(pod): State<Arc<Pod>>) -> Json<Value> {
    let m = &pod.cfg.model;
    Json(json!({"object": "list", "data": [{
        "id": m, "object": "model", "created": 0, "owned_by": "kvr-emulate",
        "root": m, "parent": null, "max_model_len": pod.cfg.max_model_len,
    }]}))
}

async fn reset_prefix_cache(State(pod): State<Arc<Pod>>) -> Response {
    match pod.reset_prefix_cache() {
        Ok(n) => {
            pod.log(format_args!("prefix cache reset: {n} blocks dropped"));
            Json(json!({"cleared_blocks": n})).into_response()
        }
        Err(running) => error(
            StatusCode::CONFLICT,
            "ConflictError",
            &format!("{running} requests are running; the prefix cache is kept"),
        ),
    }
}

async fn state(State(pod): State<Arc<Pod>>) -> Json<Value> {
    Json(serde_json::to_value(pod.state()).unwrap_or(Value::Null))
}

async fn set_mode(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    #[derive(serde::Deserialize)]
    struct Body {
        mode: Mode,
    }
    match parse::<Body>(&body) {
        Ok(b) => {
            pod.set_mode(b.mode);
            pod.log(format_args!("mode set to {}", b.mode.name()));
            Json(json!({"mode": b.mode})).into_response()
        }
        Err(resp) => resp.into_response(),
    }
}

async fn drop_events(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    #[derive(serde::Deserialize)]
    struct Body {
        batches: u64,
    }
    match parse::<Body>(&body) {
        Ok(b) if pod.drop_next_event_batches(b.batches) => {
            Json(json!({"dropping": b.batches})).into_response()
        }
        Ok(_) => bad_request("the pod publishes no KV events"),
        Err(resp) => resp.into_response(),
    }
}
