//! Errors as Dynamo's service answers them: `{"error": "..."}` with 400 bad request, 404
//! not found, 409 conflict, 422 wrong JSON types, 503 not ready or no schedulable worker,
//! 500 internal (REFERENCE.md §7).

use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

static BAD_BODIES: AtomicU64 = AtomicU64::new(0);

/// Counts a body refused as malformed (`kvr_http_bad_bodies_total`).
pub fn count_bad_body() {
    BAD_BODIES.fetch_add(1, Ordering::Relaxed);
}

/// Bodies refused as malformed since start.
pub fn bad_bodies() -> u64 {
    BAD_BODIES.load(Ordering::Relaxed)
}

/// An error answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            axum::Json(serde_json::json!({ "error": self.message })),
        )
            .into_response()
    }
}

/// A JSON body whose rejections answer in Dynamo's error shape, with axum's own texts and
/// statuses (400 syntax, 415 content type, 413 too large, 422 wrong types or missing
/// fields, the field named), since Dynamo's service is axum too. Unknown fields are
/// tolerated, as Dynamo tolerates them.
///
/// The body is parsed into [`WireBody::Fast`] without path tracking (the hot path); only a
/// body that fails is parsed again by axum's `Json` into `T` itself, for the exact
/// rejection text Dynamo's clients see.
#[derive(Debug)]
pub struct Body<T>(pub T);

/// A request body type and the type it is read through on the hot path.
pub trait WireBody: DeserializeOwned + Sized {
    type Fast: DeserializeOwned + Into<Self>;
    /// Where a prompt body's top-level `token_ids` goes when it is read by hand
    /// ([`crate::wire::tokens`]); `None` for the bodies without one (never split).
    const TOKEN_SLOT: Option<TokenSlot<Self::Fast>> = None;
}

/// The field of a fast body that takes its hand-read `token_ids`.
pub type TokenSlot<F> = fn(&mut F) -> &mut Option<Vec<u32>>;

/// The forms a body may take, by its `Content-Type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    Json,
    Msgpack,
}

/// The hot path: `token_ids` by hand where the body has them and the split accepts, the
/// rest by serde without path tracking. `None` sends the body to the slow, exact path.
fn parse_fast<T: WireBody>(bytes: &[u8]) -> Option<T::Fast> {
    if let Some(slot) = T::TOKEN_SLOT {
        if let Some(split) = crate::wire::tokens::split_token_ids(bytes) {
            let mut fast = serde_json::from_slice::<T::Fast>(&split.rest).ok()?;
            *slot(&mut fast) = Some(split.tokens);
            return Some(fast);
        }
    }
    serde_json::from_slice::<T::Fast>(bytes).ok()
}

impl<S, T> FromRequest<S> for Body<T>
where
    T: WireBody,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let Some(form) = body_form(req.headers()) else {
            count_bad_body();
            // Dynamo's text (msgpack is kvr's addition, in docs/service.md).
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "Expected request with `Content-Type: application/json`",
            ));
        };
        let bytes = match axum::body::Bytes::from_request(req, state).await {
            Ok(b) => b,
            Err(r) => {
                count_bad_body();
                return Err(ApiError::new(r.status(), r.body_text()));
            }
        };
        match form {
            Form::Json => json_body::<T>(&bytes),
            Form::Msgpack => msgpack_body::<T>(&bytes),
        }
    }
}

/// A JSON body: the hot path, else axum's exact rejection.
fn json_body<T: WireBody>(bytes: &[u8]) -> Result<Body<T>, ApiError> {
    if let Some(v) = parse_fast::<T>(bytes) {
        return Ok(Body(v.into()));
    }
    count_bad_body();
    match axum::Json::<T>::from_bytes(bytes) {
        Ok(axum::Json(v)) => Ok(Body(v)),
        Err(rejection) => Err(rejection_error(&rejection)),
    }
}

/// A msgpack body ([`crate::wire::msgpack`]): transcoded, its `token_ids` read natively
/// and put in place after serde has read the rest. A body serde refuses is answered as
/// the same body in JSON would be (the tokens written back in), so every field's error
/// text is the JSON form's.
fn msgpack_body<T: WireBody>(bytes: &[u8]) -> Result<Body<T>, ApiError> {
    use crate::wire::msgpack::{transcode, Refused};
    let t = transcode(bytes, T::TOKEN_SLOT.is_some()).map_err(|r| {
        count_bad_body();
        match r {
            Refused::Malformed(m) => ApiError::bad_request(m),
            Refused::Type(m) => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, m),
        }
    })?;
    let tokens = t.tokens;
    if let Ok(mut fast) = serde_json::from_slice::<T::Fast>(&t.json) {
        if let (Some(slot), Some(tokens)) = (T::TOKEN_SLOT, tokens) {
            *slot(&mut fast) = Some(tokens);
        }
        return Ok(Body(fast.into()));
    }
    let json = match tokens {
        None => t.json,
        Some(tokens) => {
            let (head, tail) = t.json.split_at(t.tokens_at);
            let mut full = head.to_vec();
            // Writing to a Vec cannot fail.
            let _ = serde_json::to_writer(&mut full, &tokens);
            full.extend_from_slice(&tail[b"null".len()..]);
            full
        }
    };
    json_body::<T>(&json)
}

/// The body's form: axum's JSON rule (`application/json` or any `+json` type), or
/// msgpack (`application/msgpack`, or the older `x-msgpack` and `vnd.msgpack`).
fn body_form(headers: &axum::http::HeaderMap) -> Option<Form> {
    let ct = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())?;
    let mime = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let (ty, sub) = mime.split_once('/')?;
    if ty != "application" {
        return None;
    }
    if sub == "json" || sub.ends_with("+json") {
        Some(Form::Json)
    } else if matches!(sub, "msgpack" | "x-msgpack" | "vnd.msgpack") {
        Some(Form::Msgpack)
    } else {
        None
    }
}

fn rejection_error(r: &JsonRejection) -> ApiError {
    ApiError::new(r.status(), r.body_text())
}
