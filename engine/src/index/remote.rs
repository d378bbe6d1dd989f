//! The remote primary index, as the engine sees it (DESIGN.md §5, the "remote URL" row): the
//! [`RemoteIndex`] trait the selection calls without knowing how the index is reached, why a
//! query failed ([`RemoteError`]), where the index is and how long to wait for it
//! ([`RemoteConfig`]), and a client's counters ([`RemoteStats`]).
//!
//! A partition whose primary index is remote holds no index of its own and subscribes to no
//! KV events: for each selection it asks the remote index for the tiered overlap of the
//! prompt's local hashes, and scores with that (the selection's decision, through
//! `IndexState::query_remote`, with no engine lock held: see [`crate::indexer`]).
//!
//! The engine does no I/O: the HTTP protocol (`POST /query_tiered_by_hash`), its serde wire
//! types and its client (`kvr_remote::HttpRemoteIndex`) live in the `kvr-remote` crate
//! (transport/http), whose documentation is the protocol's. The host builds the client and
//! hands it to the partition in
//! [`IndexerConfig::remote_client`](crate::indexer::IndexerConfig::remote_client).

use std::fmt;
use std::time::Duration;

use super::TieredScores;
use crate::ids::PartitionKey;

/// Default [`RemoteConfig::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(50);

/// Default [`RemoteConfig::request_timeout`].
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_millis(200);

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
/// by `kvr_remote::HttpRemoteIndex` (HTTP) and by test fakes.
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

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
}
