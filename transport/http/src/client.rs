//! [`HttpRemoteIndex`]: the blocking ureq client of the protocol (see the crate
//! documentation).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kvr::{RemoteError, RemoteIndex};

use kvr::config::RemoteConfig;

use kvr::stats::RemoteStats;
use kvr::PartitionKey;
use kvr::TieredScores;
use ureq::http::Uri;

use crate::wire::by_hash::QueryByHashResponse;
use crate::wire::tiered::QueryTieredByHashResponse;
use crate::wire::{hash_to_wire, QUERY_BY_HASH_PATH, QUERY_TIERED_BY_HASH_PATH};

/// The largest answer read (a full index of `MAX_RANKS` ranks is about 24 MiB).
const MAX_RESPONSE_BYTES: u64 = 32 << 20;

/// Idle connections kept for reuse (ureq's default is 3 per host, which would make a
/// router with more selecting threads than that open a connection per query).
const MAX_IDLE_CONNECTIONS: usize = 32;

/// The most of an error answer read (to tell a missing route from a refusal).
const MAX_ERROR_BYTES: u64 = 64 << 10;

/// The smallest timeout used (a zero timeout would fail every call).
const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// The request as it is serialized: the same fields as
/// [`crate::QueryTieredByHashRequest`], borrowed, so a query copies no hashes.
#[derive(serde::Serialize)]
pub(crate) struct RequestRef<'a> {
    #[serde(serialize_with = "signed_hashes")]
    pub(crate) block_hashes: &'a [u64],
    pub(crate) model_name: &'a str,
    pub(crate) routing_group: &'a str,
}

/// Writes u64 hashes as Dynamo reads them: their bits as signed i64.
fn signed_hashes<S: serde::Serializer>(hashes: &&[u64], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(hashes.iter().map(|&h| hash_to_wire(h)))
}

/// Whether a 404 answer to the tiered query means the route is missing (an indexer, such as
/// Dynamo 1.6.1's, without `/query_tiered_by_hash`) rather than an unknown partition, which
/// Dynamo and `kvr serve` answer with `{"error": "..."}`.
fn route_missing(body: &[u8]) -> bool {
    !matches!(
        serde_json::from_slice::<serde_json::Value>(body),
        Ok(serde_json::Value::Object(m)) if m.contains_key("error")
    )
}

#[derive(Default)]
struct Counters {
    queries: AtomicU64,
    ok: AtomicU64,
    connect: AtomicU64,
    timeout: AtomicU64,
    status: AtomicU64,
    bad_body: AtomicU64,
    other: AtomicU64,
}

/// The HTTP client of a remote primary index (see the crate documentation).
/// `Send + Sync`: one client serves every selecting thread and pools their connections.
pub struct HttpRemoteIndex {
    agent: ureq::Agent,
    endpoint: Uri,
    /// Dynamo 1.6.1's route, used once the tiered one turned out missing.
    by_hash_endpoint: Uri,
    by_hash: AtomicBool,
    counters: Counters,
}

impl std::fmt::Debug for HttpRemoteIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpRemoteIndex")
            .field("endpoint", &self.endpoint())
            .field("stats", &self.stats())
            .finish()
    }
}

/// Checks `base_url` (`http://host[:port][/path]`) and returns the tiered query's endpoint.
pub(crate) fn endpoint_of(base_url: &str) -> Result<Uri, RemoteError> {
    route_of(base_url, QUERY_TIERED_BY_HASH_PATH)
}

/// Checks `base_url` and returns the endpoint of `route` under it.
fn route_of(base_url: &str, route: &str) -> Result<Uri, RemoteError> {
    let invalid = |why: &str| RemoteError::InvalidUrl(format!("{base_url:?}: {why}"));
    let url = base_url.trim();
    if url.is_empty() {
        return Err(invalid("empty"));
    }
    let uri: Uri = url.parse().map_err(|e| invalid(&format!("{e}")))?;
    match uri.scheme_str() {
        Some(s) if s.eq_ignore_ascii_case("http") => {}
        Some(s) if s.eq_ignore_ascii_case("https") => {
            return Err(invalid("https is not supported yet (plain http:// only)"))
        }
        Some(s) => return Err(invalid(&format!("unsupported scheme {s:?} (http:// only)"))),
        None => return Err(invalid("no scheme (expected http://host[:port][/path])")),
    }
    let Some(authority) = uri.authority() else {
        return Err(invalid("no host"));
    };
    if authority.as_str().contains('@') {
        return Err(invalid("credentials in the URL are not supported"));
    }
    if authority.host().is_empty() {
        return Err(invalid("no host"));
    }
    // The authority is `host[:port]` (no userinfo, see above); the port, when written,
    // must be 1..=65535 (http's `port()` would silently skip one that is out of range).
    let a = authority.as_str();
    let port = a.strip_prefix(authority.host()).unwrap_or(a);
    if !port.is_empty() {
        match port.strip_prefix(':').map(str::parse::<u16>) {
            Some(Ok(p)) if p != 0 => {}
            _ => return Err(invalid("bad port (expected 1-65535)")),
        }
    }
    if uri.query().is_some() {
        return Err(invalid("a base URL takes no query"));
    }
    let path = uri.path().trim_end_matches('/');
    format!("http://{}{path}{route}", authority.as_str())
        .parse()
        .map_err(|e| invalid(&format!("{e}")))
}

/// Sorts a ureq error into the client's kinds.
fn classify(e: ureq::Error) -> RemoteError {
    match e {
        ureq::Error::Timeout(_) => RemoteError::Timeout,
        ureq::Error::StatusCode(s) => RemoteError::Status(s),
        ureq::Error::HostNotFound => RemoteError::Connect("host not found".into()),
        ureq::Error::ConnectionFailed => RemoteError::Connect("connection failed".into()),
        ureq::Error::BodyExceedsLimit(n) => {
            RemoteError::BadBody(format!("answer larger than {n} bytes"))
        }
        ureq::Error::Io(io) => match io.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => RemoteError::Timeout,
            io::ErrorKind::ConnectionRefused
            | io::ErrorKind::AddrNotAvailable
            | io::ErrorKind::NetworkUnreachable
            | io::ErrorKind::HostUnreachable => RemoteError::Connect(io.to_string()),
            _ => RemoteError::Other(format!("io: {io}")),
        },
        other => RemoteError::Other(other.to_string()),
    }
}

impl HttpRemoteIndex {
    /// A client of the index at `cfg.base_url`. Connects to nothing yet. Refuses a URL
    /// that is not `http://host[:port][/path]` ([`RemoteError::InvalidUrl`]), `https`
    /// included. Timeouts below 1 ms are raised to 1 ms.
    pub fn new(cfg: RemoteConfig) -> Result<Self, RemoteError> {
        let endpoint = endpoint_of(&cfg.base_url)?;
        let config = ureq::Agent::config_builder()
            .timeout_connect(Some(cfg.connect_timeout.max(MIN_TIMEOUT)))
            .timeout_global(Some(cfg.request_timeout.max(MIN_TIMEOUT)))
            .http_status_as_error(false)
            .max_redirects(0)
            .proxy(None)
            .max_idle_connections(MAX_IDLE_CONNECTIONS)
            .max_idle_connections_per_host(MAX_IDLE_CONNECTIONS)
            .build();
        Ok(Self {
            agent: ureq::Agent::new_with_config(config),
            endpoint,
            by_hash_endpoint: route_of(&cfg.base_url, QUERY_BY_HASH_PATH)?,
            by_hash: AtomicBool::new(false),
            counters: Counters::default(),
        })
    }

    /// The URL queries are posted to: `{base_url}/query_tiered_by_hash`, or
    /// `{base_url}/query_by_hash` once the server showed it lacks the former.
    pub fn endpoint(&self) -> String {
        if self.by_hash.load(Ordering::Relaxed) {
            self.by_hash_endpoint.to_string()
        } else {
            self.endpoint.to_string()
        }
    }

    /// Asks the remote index for the tiered overlap of a prompt (see [`RemoteIndex`]).
    /// An empty prompt sends nothing.
    pub fn query_tiered(
        &self,
        key: &PartitionKey,
        block_size: u32,
        local_hashes: &[u64],
        out: &mut TieredScores,
    ) -> Result<(), RemoteError> {
        let _ = out.fill_from(std::iter::empty());
        if local_hashes.is_empty() {
            return Ok(());
        }
        self.counters.queries.fetch_add(1, Ordering::Relaxed);
        let r = self.call(key, block_size, local_hashes, out);
        let c = &self.counters;
        let counter = match &r {
            Ok(()) => &c.ok,
            Err(RemoteError::Connect(_)) => &c.connect,
            Err(RemoteError::Timeout) => &c.timeout,
            Err(RemoteError::Status(_)) => &c.status,
            Err(RemoteError::BadBody(_)) => &c.bad_body,
            Err(RemoteError::Other(_) | RemoteError::InvalidUrl(_)) => &c.other,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if r.is_err() {
            let _ = out.fill_from(std::iter::empty());
        }
        r
    }

    fn call(
        &self,
        key: &PartitionKey,
        block_size: u32,
        local_hashes: &[u64],
        out: &mut TieredScores,
    ) -> Result<(), RemoteError> {
        let body = serde_json::to_vec(&RequestRef {
            block_hashes: local_hashes,
            model_name: &key.model,
            routing_group: &key.routing_group,
        })
        .map_err(|e| RemoteError::Other(format!("encoding the request: {e}")))?;
        if !self.by_hash.load(Ordering::Relaxed) {
            match self.post(&self.endpoint, &body)? {
                (200..=299, bytes) => {
                    let answer: QueryTieredByHashResponse = serde_json::from_slice(&bytes)
                        .map_err(|e| RemoteError::BadBody(format!("not a tiered answer: {e}")))?;
                    return answer.to_scores(block_size, local_hashes.len(), out);
                }
                (404, bytes) if route_missing(&bytes) => {
                    self.by_hash.store(true, Ordering::Relaxed);
                }
                (status, _) => return Err(RemoteError::Status(status)),
            }
        }
        match self.post(&self.by_hash_endpoint, &body)? {
            (200..=299, bytes) => {
                let answer: QueryByHashResponse = serde_json::from_slice(&bytes).map_err(|e| {
                    RemoteError::BadBody(format!("not a query_by_hash answer: {e}"))
                })?;
                answer.to_scores(block_size, local_hashes.len(), out)
            }
            (status, _) => Err(RemoteError::Status(status)),
        }
    }

    /// POSTs `body` to `endpoint`: the status and the answer's body (an error answer's
    /// body only as far as it reads within [`MAX_ERROR_BYTES`], else empty).
    fn post(&self, endpoint: &Uri, body: &[u8]) -> Result<(u16, Vec<u8>), RemoteError> {
        let mut resp = self
            .agent
            .post(endpoint.clone())
            .header("content-type", "application/json")
            .header("accept", "application/json")
            .send(body)
            .map_err(classify)?;
        let status = resp.status().as_u16();
        let reader = resp.body_mut().with_config();
        if !(200..300).contains(&status) {
            let bytes = reader
                .limit(MAX_ERROR_BYTES)
                .read_to_vec()
                .unwrap_or_default();
            return Ok((status, bytes));
        }
        let bytes = reader
            .limit(MAX_RESPONSE_BYTES)
            .read_to_vec()
            .map_err(classify)?;
        Ok((status, bytes))
    }

    /// The counters so far (each read once; calls in flight may or may not be in them).
    pub fn stats(&self) -> RemoteStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RemoteStats {
            queries: get(&c.queries),
            ok: get(&c.ok),
            connect_errors: get(&c.connect),
            timeouts: get(&c.timeout),
            status_errors: get(&c.status),
            bad_bodies: get(&c.bad_body),
            other_errors: get(&c.other),
        }
    }
}

impl RemoteIndex for HttpRemoteIndex {
    fn query_tiered(
        &self,
        key: &PartitionKey,
        block_size: u32,
        local_hashes: &[u64],
        out: &mut TieredScores,
    ) -> Result<(), RemoteError> {
        HttpRemoteIndex::query_tiered(self, key, block_size, local_hashes, out)
    }
}
