//! Requests and connections the service refused, by reason: `kvr_http_refused_total` on
//! `GET /metrics`, a debug log line each, and at most one warning every
//! [`WARN_EVERY`] while refusals keep coming. Connection-level refusals (malformed HTTP,
//! timeouts) never reach a route, so nothing else would show them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry as PromRegistry;

/// Least time between two refusal warnings.
pub const WARN_EVERY: Duration = Duration::from_secs(10);

/// Why a request or connection got no regular answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// 400: an unreadable JSON body, or a value the service refuses.
    BadRequest,
    /// 404 on a route that does not exist.
    UnknownRoute,
    /// 404 on a route that exists (an unknown worker, reservation or selection).
    NotFound,
    /// 405.
    MethodNotAllowed,
    /// 409.
    Conflict,
    /// 413: a body over `--max-body-bytes`.
    BodyTooLarge,
    /// 415: a body without `Content-Type: application/json`.
    UnsupportedMediaType,
    /// 422: JSON of the wrong shape or types.
    InvalidBody,
    /// Any other 4xx.
    OtherClientError,
    /// Bytes that are not HTTP/1 (closed by the server before any route).
    MalformedHttp,
    /// A request's headers not complete within `--http-header-read-timeout-secs`
    /// (a half-sent request).
    HeaderTimeout,
    /// A connection closed for sending nothing: no request within
    /// `--http-header-read-timeout-secs` (a connection opened and left silent, or a
    /// keep-alive connection idle that long), or no byte either way for
    /// `--http-idle-timeout-secs` while the service waited on it.
    IdleTimeout,
}

impl Refusal {
    /// The reason label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::BadRequest => "bad_request",
            Refusal::UnknownRoute => "unknown_route",
            Refusal::NotFound => "not_found",
            Refusal::MethodNotAllowed => "method_not_allowed",
            Refusal::Conflict => "conflict",
            Refusal::BodyTooLarge => "body_too_large",
            Refusal::UnsupportedMediaType => "unsupported_media_type",
            Refusal::InvalidBody => "invalid_body",
            Refusal::OtherClientError => "other_client_error",
            Refusal::MalformedHttp => "malformed_http",
            Refusal::HeaderTimeout => "header_timeout",
            Refusal::IdleTimeout => "idle_timeout",
        }
    }

    /// The refusal an answered status stands for (`None`: not a 4xx). `matched`: the
    /// request named an existing route.
    pub fn of_status(status: u16, matched: bool) -> Option<Refusal> {
        Some(match status {
            400 => Refusal::BadRequest,
            404 if matched => Refusal::NotFound,
            404 => Refusal::UnknownRoute,
            405 => Refusal::MethodNotAllowed,
            409 => Refusal::Conflict,
            413 => Refusal::BodyTooLarge,
            415 => Refusal::UnsupportedMediaType,
            422 => Refusal::InvalidBody,
            401..=499 => Refusal::OtherClientError,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// The refusal counters (one per service, in [`crate::metrics::Metrics`]).
#[derive(Debug, Default)]
pub struct Refusals {
    counts: Family<ReasonLabel, Counter>,
    /// Unix seconds of the last warning.
    last_warn: AtomicU64,
    /// Refusals since the last warning.
    since_warn: AtomicU64,
}

impl Refusals {
    /// New counters, registered in `registry` as `kvr_http_refused`.
    pub fn register(registry: &mut PromRegistry) -> Self {
        let r = Refusals::default();
        registry.register(
            "kvr_http_refused",
            "Requests and connections refused, by reason (4xx answers, malformed HTTP, \
             header-read and idle timeouts)",
            r.counts.clone(),
        );
        r
    }

    /// Counts one refusal, logs it at debug, and warns at most every [`WARN_EVERY`].
    pub fn count(&self, why: Refusal, detail: &str) {
        self.counts
            .get_or_create(&ReasonLabel {
                reason: why.label(),
            })
            .inc();
        tracing::debug!(reason = why.label(), detail, "refused");
        let n = self.since_warn.fetch_add(1, Ordering::Relaxed) + 1;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let last = self.last_warn.load(Ordering::Relaxed);
        if now >= last + WARN_EVERY.as_secs()
            && self
                .last_warn
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.since_warn.fetch_sub(n, Ordering::Relaxed);
            tracing::warn!(
                refused = n,
                last_reason = why.label(),
                "refused requests or connections since the last warning (kvr_http_refused_total \
                 by reason; KVR_LOG=debug logs each)"
            );
        }
    }

    /// How many refusals of this reason so far.
    pub fn get(&self, why: Refusal) -> u64 {
        self.counts
            .get_or_create(&ReasonLabel {
                reason: why.label(),
            })
            .get()
    }
}
