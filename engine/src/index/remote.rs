//! The remote primary index: the protocol of `POST /query_tiered_by_hash` and its client
//! (DESIGN.md §5, the "remote URL" row).
//!
//! A partition whose primary index is remote holds no index of its own and subscribes to no
//! KV events: for each selection it asks a remote service (a `kvr serve`, or any server
//! speaking the protocol below) for the tiered overlap of the prompt, and scores with that.
//! The service has no write API, so a remote primary with KV events off is rejected at
//! configuration (nothing would ever feed it).
//!
//! What is always compiled (no feature): the wire types ([`QueryTieredByHashRequest`],
//! [`QueryTieredByHashResponse`], [`RankOverlap`]) and their conversions to and from
//! [`TieredScores`], the [`RemoteIndex`] trait the selection calls without knowing HTTP,
//! [`RemoteError`], [`RemoteConfig`] and [`RemoteStats`]. With the cargo feature `remote`
//! the wire types also derive serde's `Serialize`/`Deserialize` (so a server reuses them),
//! and `RemoteIndexClient` exists: the HTTP client. The client is not compiled under
//! `--cfg loom`: code using it needs `#[cfg(all(feature = "remote", not(loom)))]`.
//!
//! # Protocol
//!
//! This is the contract a `kvr serve` implements. HTTP/1.1, plain `http` (no TLS yet),
//! persistent connections: the client keeps idle connections for reuse, checks that one is
//! still open before reusing it, and does not retry a failed POST. A server should keep
//! connections open, or announce a close with `Connection: close`.
//!
//! ## Request
//!
//! ```text
//! POST {base_url}/query_tiered_by_hash HTTP/1.1
//! Content-Type: application/json
//!
//! {"model":"llama-3-8b","routing_group":"default","block_hashes":[11400714819323198485,42],"block_size":16}
//! ```
//!
//! - `model`, `routing_group` (strings): the partition ([`PartitionKey`]) whose index is asked.
//! - `block_hashes` (array of u64): the **local** block hashes of the prompt's complete blocks,
//!   first block first (DESIGN.md §3: xxh3-64 of each block's tokens, salted by LoRA name and
//!   cache namespace; the trailing partial block is never hashed, so never sent). Local, not
//!   chained sequence hashes: the server chains them itself, exactly as
//!   [`Index::find_matches_tiered`](super::Index::find_matches_tiered) does, so how an index
//!   keys its nodes stays the index's business, and a client needs no chain of its own. Not
//!   the engines' external block hashes either: those are opaque per rank.
//! - `block_size` (u32): the block size (tokens per block) the hashes were computed with. The
//!   server checks it against its partition's and refuses a mismatch (status 400): hashes of
//!   another block size never match, and answering "no overlap" would hide the
//!   misconfiguration.
//! - No LoRA name: each local hash is already salted with the request's LoRA adapter (and the
//!   partition's cache namespace), so the adapter is part of every hash the server sees.
//! - An empty `block_hashes` is valid (the answer is `{"ranks":[]}`), though the client never
//!   sends one: a prompt with no complete block makes no request.
//!
//! ## Response
//!
//! Status 200, `Content-Type: application/json`:
//!
//! ```text
//! {"ranks":[{"worker_id":7,"dp_rank":0,"device":2,"host":1,"disk":0},
//!           {"worker_id":18446744073709551614,"dp_rank":3,"device":0,"host":0,"disk":4}]}
//! ```
//!
//! One entry per rank that holds the prompt's first block on some tier: `device` leading
//! blocks on the device tier, then `host` further contiguous blocks in host memory, then
//! `disk` further contiguous blocks on disk (DESIGN.md §4, the tiered query;
//! [`TieredOverlap`]). Ranks holding nothing are absent; the order is free (the client
//! sorts). The client refuses the whole answer ([`RemoteError::BadBody`]) when a rank is
//! listed twice or when a rank's `device + host + disk` exceeds the number of hashes sent:
//! such a server cannot be trusted not to overcount. An entry of all zeros is accepted and
//! dropped.
//!
//! Other statuses: 400 for a malformed request or a block-size mismatch, 404 for a partition
//! the server does not serve, 5xx for a server fault. The client reports any status other
//! than 2xx as [`RemoteError::Status`] and ignores that body. It follows no redirect (a 3xx
//! is a `Status` error too).
//!
//! ## JSON details
//!
//! - Every u64 (`block_hashes`, `worker_id`) is a plain JSON number, not a string, written
//!   and read exactly: serde_json keeps integers as u64/i64, never through an f64. A peer
//!   whose JSON numbers are doubles (JavaScript's `JSON.parse`) would corrupt hashes and ids
//!   above 2^53 and needs a big-integer-aware parser.
//! - Unknown fields are ignored (the client ignores unknown response fields, a server should
//!   ignore unknown request fields), so either side can add optional fields later. A missing
//!   field is an error.
//! - No compression (`Content-Encoding` is not sent or accepted).
//!
//! # The client (`RemoteIndexClient`, feature `remote`)
//!
//! A blocking HTTP/1.1 client (ureq 3, no TLS) with a connection pool (up to 32 idle
//! connections) shared by every thread calling it (`Send + Sync`). `connect_timeout`
//! (default 50 ms) bounds the TCP connect; `request_timeout` (default 200 ms) bounds the
//! whole call end to end, from connecting to reading the last byte of the answer. The base
//! URL is `http://host[:port][/path]` (a path prefix is kept: `http://h/kv` posts to
//! `http://h/kv/query_tiered_by_hash`); an `https://` URL is refused at construction (TLS
//! is not supported yet), as is anything else that is not of that form (no host, another
//! scheme, a query, credentials, a bad port). The environment's proxy settings
//! (`HTTP_PROXY`, ...) are ignored: the index service is reached directly.
//!
//! Not lock-free and not part of the index's lock-free read path: a remote query is I/O that
//! blocks the calling thread for up to `request_timeout`. The selection makes it, with no
//! engine lock held, when the partition's primary is remote. On any error the result is
//! left empty and the error is returned and counted ([`RemoteStats`]); what to do then (say,
//! select on load alone) is the caller's decision.

use std::fmt;
use std::time::Duration;

use super::{RankId, TieredOverlap, TieredScores};
use crate::ids::PartitionKey;

/// The path of the tiered query, appended to a [`RemoteConfig::base_url`].
pub const QUERY_TIERED_BY_HASH_PATH: &str = "/query_tiered_by_hash";

/// Default [`RemoteConfig::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(50);

/// Default [`RemoteConfig::request_timeout`].
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_millis(200);

/// The body of `POST /query_tiered_by_hash` (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "remote", derive(serde::Serialize, serde::Deserialize))]
pub struct QueryTieredByHashRequest {
    pub model: String,
    pub routing_group: String,
    /// Local hashes of the prompt's complete blocks, first block first.
    pub block_hashes: Vec<u64>,
    /// Tokens per block the hashes were computed with.
    pub block_size: u32,
}

impl QueryTieredByHashRequest {
    pub fn new(key: &PartitionKey, block_size: u32, local_hashes: &[u64]) -> Self {
        Self {
            model: key.model.clone(),
            routing_group: key.routing_group.clone(),
            block_hashes: local_hashes.to_vec(),
            block_size,
        }
    }

    /// The partition asked about.
    pub fn partition_key(&self) -> PartitionKey {
        PartitionKey::new(self.model.clone(), self.routing_group.clone())
    }
}

/// One rank's tiered overlap on the wire ([`TieredOverlap`] with the rank spelled out).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "remote", derive(serde::Serialize, serde::Deserialize))]
pub struct RankOverlap {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Leading blocks on the device tier.
    pub device: u32,
    /// Further contiguous blocks in host memory.
    pub host: u32,
    /// Further contiguous blocks on disk.
    pub disk: u32,
}

impl From<TieredOverlap> for RankOverlap {
    fn from(o: TieredOverlap) -> Self {
        Self {
            worker_id: o.rank.worker_id,
            dp_rank: o.rank.dp_rank,
            device: o.device,
            host: o.host,
            disk: o.disk,
        }
    }
}

impl From<RankOverlap> for TieredOverlap {
    fn from(o: RankOverlap) -> Self {
        Self {
            rank: RankId::new(o.worker_id, o.dp_rank),
            device: o.device,
            host: o.host,
            disk: o.disk,
        }
    }
}

/// The body of a 200 answer to `POST /query_tiered_by_hash`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "remote", derive(serde::Serialize, serde::Deserialize))]
pub struct QueryTieredByHashResponse {
    pub ranks: Vec<RankOverlap>,
}

impl QueryTieredByHashResponse {
    /// The answer a server gives from its index's tiered lookup
    /// ([`Index::find_matches_tiered`](super::Index::find_matches_tiered) of the request's
    /// `block_hashes`).
    pub fn from_scores(scores: &TieredScores) -> Self {
        Self {
            ranks: scores.iter().map(RankOverlap::from).collect(),
        }
    }

    /// Checks the answer to a query of `blocks_queried` hashes and writes it into `out`
    /// (sorted by rank; all-zero entries dropped). A rank listed twice, or a rank whose
    /// `device + host + disk` exceeds `blocks_queried`, is [`RemoteError::BadBody`], and
    /// `out` is left empty.
    pub fn to_scores(
        &self,
        blocks_queried: usize,
        out: &mut TieredScores,
    ) -> Result<(), RemoteError> {
        let too_long = self
            .ranks
            .iter()
            .find(|r| r.device as u64 + r.host as u64 + r.disk as u64 > blocks_queried as u64);
        if let Some(r) = too_long {
            let _ = out.fill_from(std::iter::empty());
            return Err(RemoteError::BadBody(format!(
                "rank {}/{} holds {} + {} + {} blocks of a {blocks_queried}-block query",
                r.worker_id, r.dp_rank, r.device, r.host, r.disk
            )));
        }
        out.fill_from(self.ranks.iter().map(|&r| TieredOverlap::from(r)))
            .map_err(|rank| RemoteError::BadBody(format!("rank {rank} listed twice")))
    }
}

impl From<&TieredScores> for QueryTieredByHashResponse {
    fn from(scores: &TieredScores) -> Self {
        Self::from_scores(scores)
    }
}

/// Why a remote query failed. Each kind has its counter in [`RemoteStats`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RemoteError {
    /// The base URL is not `http://host[:port][/path]` (construction only).
    InvalidUrl(String),
    /// No connection: refused, unreachable, or the host name did not resolve.
    Connect(String),
    /// The connect or the whole call took longer than its timeout.
    Timeout,
    /// The server answered with this status (anything but 2xx).
    Status(u16),
    /// A 2xx answer whose body is not a valid response: not JSON, the wrong shape, too
    /// large, a rank listed twice, or a count larger than the query.
    BadBody(String),
    /// Anything else (a connection broken mid-call, a response that is not HTTP, ...).
    Other(String),
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteError::InvalidUrl(m) => write!(f, "invalid remote index URL: {m}"),
            RemoteError::Connect(m) => write!(f, "cannot connect to the remote index: {m}"),
            RemoteError::Timeout => write!(f, "remote index query timed out"),
            RemoteError::Status(s) => write!(f, "remote index answered HTTP status {s}"),
            RemoteError::BadBody(m) => write!(f, "remote index sent a bad answer: {m}"),
            RemoteError::Other(m) => write!(f, "remote index query failed: {m}"),
        }
    }
}

impl std::error::Error for RemoteError {}

/// A primary index the selection queries without knowing how it is reached: implemented
/// by `RemoteIndexClient` (feature `remote`) and by test fakes.
pub trait RemoteIndex: Send + Sync {
    /// Writes into `out` the tiered overlap of the prompt whose complete blocks have these
    /// local hashes (first block first), in partition `key` of block size `block_size`.
    /// On error `out` is empty. An empty prompt yields empty scores.
    fn query_tiered(
        &self,
        key: &PartitionKey,
        block_size: u32,
        local_hashes: &[u64],
        out: &mut TieredScores,
    ) -> Result<(), RemoteError>;
}

/// Where the remote index is and how long to wait for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteConfig {
    /// `http://host[:port][/path]`; requests go to `{base_url}/query_tiered_by_hash`.
    pub base_url: String,
    /// Bound on the TCP connect (default 50 ms).
    pub connect_timeout: Duration,
    /// Bound on the whole call, connect to last byte of the answer (default 200 ms).
    pub request_timeout: Duration,
}

impl RemoteConfig {
    /// `base_url` with the default timeouts.
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }
}

/// A remote client's counters since it was built. Every request sent ends in exactly one of
/// the outcomes, so `queries = ok + connect_errors + timeouts + status_errors + bad_bodies
/// + other_errors` once no call is in flight. Empty prompts send nothing and count nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteStats {
    /// Requests sent (or attempted).
    pub queries: u64,
    /// Valid answers.
    pub ok: u64,
    /// [`RemoteError::Connect`]: refused or unreachable.
    pub connect_errors: u64,
    /// [`RemoteError::Timeout`].
    pub timeouts: u64,
    /// [`RemoteError::Status`].
    pub status_errors: u64,
    /// [`RemoteError::BadBody`]: the answer did not decode or did not validate.
    pub bad_bodies: u64,
    /// [`RemoteError::Other`].
    pub other_errors: u64,
}

#[cfg(all(feature = "remote", not(loom)))]
pub use client::RemoteIndexClient;

#[cfg(all(feature = "remote", not(loom)))]
mod client {
    use std::io;
    use std::time::Duration;

    use ureq::http::Uri;

    use super::{
        QueryTieredByHashResponse, RemoteConfig, RemoteError, RemoteIndex, RemoteStats,
        QUERY_TIERED_BY_HASH_PATH,
    };
    use crate::ids::PartitionKey;
    use crate::index::TieredScores;
    use crate::sync::atomic::{AtomicU64, Ordering};

    /// The largest answer read (a full index of `MAX_RANKS` ranks is about 24 MiB).
    const MAX_RESPONSE_BYTES: u64 = 32 << 20;

    /// Idle connections kept for reuse (ureq's default is 3 per host, which would make a
    /// router with more selecting threads than that open a connection per query).
    const MAX_IDLE_CONNECTIONS: usize = 32;

    /// The smallest timeout used (a zero timeout would fail every call).
    const MIN_TIMEOUT: Duration = Duration::from_millis(1);

    /// The request as it is serialized: the same fields as
    /// [`super::QueryTieredByHashRequest`], borrowed, so a query copies no hashes.
    #[derive(serde::Serialize)]
    pub(super) struct RequestRef<'a> {
        pub(super) model: &'a str,
        pub(super) routing_group: &'a str,
        pub(super) block_hashes: &'a [u64],
        pub(super) block_size: u32,
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

    /// The HTTP client of a remote primary index (see the module documentation).
    /// `Send + Sync`: one client serves every selecting thread and pools their connections.
    pub struct RemoteIndexClient {
        agent: ureq::Agent,
        endpoint: Uri,
        counters: Counters,
    }

    impl std::fmt::Debug for RemoteIndexClient {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("RemoteIndexClient")
                .field("endpoint", &self.endpoint)
                .field("stats", &self.stats())
                .finish()
        }
    }

    /// Checks `base_url` (`http://host[:port][/path]`) and returns the query's endpoint.
    pub(super) fn endpoint_of(base_url: &str) -> Result<Uri, RemoteError> {
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
        format!(
            "http://{}{path}{QUERY_TIERED_BY_HASH_PATH}",
            authority.as_str()
        )
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

    impl RemoteIndexClient {
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
                counters: Counters::default(),
            })
        }

        /// The URL queries are posted to.
        pub fn endpoint(&self) -> String {
            self.endpoint.to_string()
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
                model: &key.model,
                routing_group: &key.routing_group,
                block_hashes: local_hashes,
                block_size,
            })
            .map_err(|e| RemoteError::Other(format!("encoding the request: {e}")))?;
            let mut resp = self
                .agent
                .post(self.endpoint.clone())
                .header("content-type", "application/json")
                .header("accept", "application/json")
                .send(body.as_slice())
                .map_err(classify)?;
            let status = resp.status().as_u16();
            if !(200..300).contains(&status) {
                return Err(RemoteError::Status(status));
            }
            let bytes = resp
                .body_mut()
                .with_config()
                .limit(MAX_RESPONSE_BYTES)
                .read_to_vec()
                .map_err(classify)?;
            let answer: QueryTieredByHashResponse = serde_json::from_slice(&bytes)
                .map_err(|e| RemoteError::BadBody(format!("not a tiered answer: {e}")))?;
            answer.to_scores(local_hashes.len(), out)
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

    impl RemoteIndex for RemoteIndexClient {
        fn query_tiered(
            &self,
            key: &PartitionKey,
            block_size: u32,
            local_hashes: &[u64],
            out: &mut TieredScores,
        ) -> Result<(), RemoteError> {
            RemoteIndexClient::query_tiered(self, key, block_size, local_hashes, out)
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::index::{Index, KvEvent, StoredBlock, Tier};

    fn store(index: &Index, rank: RankId, tier: Tier, parent: Option<u64>, blocks: &[(u64, u64)]) {
        let blocks: Vec<StoredBlock> = blocks
            .iter()
            .map(|&(external_hash, local_hash)| StoredBlock {
                external_hash,
                local_hash,
            })
            .collect();
        index
            .apply(
                rank,
                &KvEvent::Stored {
                    tier,
                    parent,
                    blocks: &blocks,
                },
            )
            .unwrap();
    }

    /// Ranks with device, host and disk blocks of the prompt [1, 2, 3, 4, 5].
    fn populated() -> Index {
        let index = Index::new();
        let a = RankId::new(7, 0);
        let b = RankId::new(u64::MAX - 1, 3);
        let c = RankId::new(9, 1);
        store(&index, a, Tier::Device, None, &[(100, 1), (101, 2)]);
        store(&index, a, Tier::Host, Some(101), &[(102, 3)]);
        store(&index, a, Tier::Disk, Some(102), &[(103, 4), (104, 5)]);
        store(&index, b, Tier::Disk, None, &[(200, 1), (201, 2), (202, 3)]);
        store(&index, c, Tier::Device, None, &[(300, 1)]);
        index
    }

    #[test]
    fn overlap_converts_both_ways() {
        let o = TieredOverlap {
            rank: RankId::new(u64::MAX, u32::MAX),
            device: 1,
            host: 2,
            disk: 3,
        };
        let w = RankOverlap::from(o);
        assert_eq!(
            w,
            RankOverlap {
                worker_id: u64::MAX,
                dp_rank: u32::MAX,
                device: 1,
                host: 2,
                disk: 3
            }
        );
        assert_eq!(TieredOverlap::from(w), o);
    }

    #[test]
    fn scores_round_trip_through_a_response() {
        let index = populated();
        let prompt = [1, 2, 3, 4, 5, 6];
        let local = index.find_matches_tiered(&prompt);
        assert_eq!(local.len(), 3);
        let a = local.get(RankId::new(7, 0)).unwrap();
        assert_eq!((a.device, a.host, a.disk), (2, 1, 2));
        let mut resp = QueryTieredByHashResponse::from(&local);
        assert_eq!(resp.ranks.len(), 3);
        // The order on the wire is free: the client sorts.
        resp.ranks.reverse();
        let mut back = TieredScores::new();
        resp.to_scores(prompt.len(), &mut back).unwrap();
        assert_eq!(back, local);
        assert_eq!(back.as_slice(), local.as_slice());
        // Exactly as many blocks as the counts is fine.
        resp.to_scores(5, &mut back).unwrap();
        assert_eq!(back, local);
    }

    #[test]
    fn empty_scores_make_an_empty_response() {
        let resp = QueryTieredByHashResponse::from_scores(&TieredScores::new());
        assert!(resp.ranks.is_empty());
        let mut out = populated().find_matches_tiered(&[1]);
        assert!(!out.is_empty());
        resp.to_scores(3, &mut out).unwrap();
        assert!(out.is_empty());
    }

    #[test]
    fn duplicate_ranks_are_refused() {
        let r = RankOverlap {
            worker_id: 1,
            dp_rank: 0,
            device: 1,
            host: 0,
            disk: 0,
        };
        let other = RankOverlap { dp_rank: 1, ..r };
        let mut out = TieredScores::new();
        let resp = QueryTieredByHashResponse {
            ranks: vec![r, other, r],
        };
        assert!(matches!(
            resp.to_scores(4, &mut out),
            Err(RemoteError::BadBody(m)) if m.contains("1/0 listed twice")
        ));
        assert!(out.is_empty());
        // Also when one of the two is all zeros.
        let resp = QueryTieredByHashResponse {
            ranks: vec![r, RankOverlap { device: 0, ..r }],
        };
        assert!(resp.to_scores(4, &mut out).is_err());
        assert!(out.is_empty());
    }

    #[test]
    fn counts_beyond_the_query_are_refused() {
        let mut out = populated().find_matches_tiered(&[1, 2]);
        assert!(!out.is_empty());
        for (device, host, disk) in [(3, 0, 0), (1, 1, 1), (0, 0, 3), (u32::MAX, u32::MAX, 2)] {
            let resp = QueryTieredByHashResponse {
                ranks: vec![RankOverlap {
                    worker_id: 4,
                    dp_rank: 0,
                    device,
                    host,
                    disk,
                }],
            };
            assert!(matches!(
                resp.to_scores(2, &mut out),
                Err(RemoteError::BadBody(_))
            ));
            assert!(out.is_empty());
        }
    }

    #[test]
    fn all_zero_entries_are_dropped() {
        let resp = QueryTieredByHashResponse {
            ranks: vec![
                RankOverlap {
                    worker_id: 2,
                    ..Default::default()
                },
                RankOverlap {
                    worker_id: 1,
                    host: 1,
                    ..Default::default()
                },
            ],
        };
        let mut out = TieredScores::new();
        resp.to_scores(1, &mut out).unwrap();
        assert_eq!(
            out.as_slice(),
            &[TieredOverlap {
                rank: RankId::new(1, 0),
                device: 0,
                host: 1,
                disk: 0
            }]
        );
    }

    #[test]
    fn request_carries_the_partition() {
        let key = PartitionKey::new("m", "g");
        let req = QueryTieredByHashRequest::new(&key, 16, &[3, 1, 2]);
        assert_eq!(req.block_hashes, vec![3, 1, 2]);
        assert_eq!(req.block_size, 16);
        assert_eq!(req.partition_key(), key);
    }

    #[test]
    fn errors_display() {
        for (e, s) in [
            (
                RemoteError::InvalidUrl("x".into()),
                "invalid remote index URL: x",
            ),
            (RemoteError::Timeout, "remote index query timed out"),
            (
                RemoteError::Status(503),
                "remote index answered HTTP status 503",
            ),
        ] {
            assert_eq!(e.to_string(), s);
        }
    }

    #[cfg(feature = "remote")]
    mod wire {
        use super::super::client::{endpoint_of, RequestRef};
        use super::super::*;

        #[test]
        fn request_json_is_the_documented_shape() {
            let req = QueryTieredByHashRequest {
                model: "llama".into(),
                routing_group: "default".into(),
                block_hashes: vec![11400714819323198485, 42],
                block_size: 16,
            };
            let json = serde_json::to_string(&req).unwrap();
            assert_eq!(
                json,
                r#"{"model":"llama","routing_group":"default","block_hashes":[11400714819323198485,42],"block_size":16}"#
            );
            // The client's borrowed form writes the same bytes.
            let borrowed = serde_json::to_string(&RequestRef {
                model: &req.model,
                routing_group: &req.routing_group,
                block_hashes: &req.block_hashes,
                block_size: req.block_size,
            })
            .unwrap();
            assert_eq!(borrowed, json);
            let back: QueryTieredByHashRequest = serde_json::from_str(&json).unwrap();
            assert_eq!(back, req);
        }

        #[test]
        fn response_json_keeps_u64_exact_and_ignores_unknown_fields() {
            let json = r#"{"ranks":[{"worker_id":18446744073709551615,"dp_rank":3,"device":1,"host":2,"disk":3,"later":true}],"version":2}"#;
            let resp: QueryTieredByHashResponse = serde_json::from_str(json).unwrap();
            assert_eq!(resp.ranks[0].worker_id, u64::MAX);
            assert_eq!(
                serde_json::to_string(&resp).unwrap(),
                r#"{"ranks":[{"worker_id":18446744073709551615,"dp_rank":3,"device":1,"host":2,"disk":3}]}"#
            );
            // A missing field is an error; so is a worker id written as a string or a float.
            for bad in [
                r#"{"ranks":[{"worker_id":1,"dp_rank":0,"device":1,"host":0}]}"#,
                r#"{"ranks":[{"worker_id":"1","dp_rank":0,"device":1,"host":0,"disk":0}]}"#,
                r#"{"ranks":[{"worker_id":1.5,"dp_rank":0,"device":1,"host":0,"disk":0}]}"#,
                r#"{"ranks":[{"worker_id":-1,"dp_rank":0,"device":1,"host":0,"disk":0}]}"#,
                r#"{}"#,
            ] {
                assert!(serde_json::from_str::<QueryTieredByHashResponse>(bad).is_err());
            }
        }

        #[test]
        fn endpoints() {
            for (base, want) in [
                (
                    "http://127.0.0.1:8080",
                    "http://127.0.0.1:8080/query_tiered_by_hash",
                ),
                (
                    "http://127.0.0.1:8080/",
                    "http://127.0.0.1:8080/query_tiered_by_hash",
                ),
                (
                    "HTTP://index.svc:80/kv/",
                    "http://index.svc:80/kv/query_tiered_by_hash",
                ),
                ("http://index", "http://index/query_tiered_by_hash"),
                (
                    "http://[::1]:9000",
                    "http://[::1]:9000/query_tiered_by_hash",
                ),
                (" http://h:1 ", "http://h:1/query_tiered_by_hash"),
            ] {
                assert_eq!(endpoint_of(base).unwrap().to_string(), want, "{base}");
            }
        }

        #[test]
        fn invalid_urls() {
            for base in [
                "",
                "   ",
                "https://index:443",
                "HTTPS://index",
                "ftp://index",
                "http://",
                "http:///path",
                "http://:8080",
                "index:8080",
                "/query",
                "garbage",
                "http://user:pw@index",
                "http://index:0",
                "http://index:99999",
                "http://index:port",
                "http://index:",
                "http://index:-1",
                "http://[::1]:65536",
                "http://index/?a=1",
                "http://in dex",
            ] {
                assert!(
                    matches!(endpoint_of(base), Err(RemoteError::InvalidUrl(_))),
                    "{base:?} -> {:?}",
                    endpoint_of(base)
                );
            }
            let https = endpoint_of("https://index").unwrap_err().to_string();
            assert!(https.contains("https is not supported"), "{https}");
        }
    }
}
