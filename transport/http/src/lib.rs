//! kvr's remote primary index over HTTP: Dynamo's standalone-indexer query
//! `POST /query_tiered_by_hash`, its wire types and its client [`HttpRemoteIndex`]
//! (DESIGN.md §5, the "remote URL" row; REFERENCE.md §7).
//!
//! A partition whose primary index is remote holds no index of its own and subscribes to no
//! KV events: for each selection it asks a remote service (Dynamo's standalone indexer, a
//! `kvr serve`, or any server speaking the protocol below) for the tiered overlap of the
//! prompt, and scores with that. The service is fed by the engines' KV events, not by kvr,
//! so a remote primary with KV events off is rejected at configuration.
//!
//! # Where this lives, and how a URL becomes a client
//!
//! The engine crate (`kvr`) does no I/O: it keeps the [`RemoteIndex`] trait the selection
//! calls without knowing HTTP, [`RemoteError`], [`RemoteConfig`], [`RemoteStats`] and the
//! indexer policy (`kvr::config::IndexerPolicy`). This crate holds everything that speaks HTTP or JSON:
//! the wire types ([`QueryTieredByHashRequest`], [`QueryTieredByHashResponse`], Dynamo
//! 1.6.1's [`QueryByHashResponse`], with serde so a server reuses them) and the ureq client.
//!
//! The engine cannot turn `IndexerConfig::remote_url` into a client itself. The host does:
//! it builds an [`HttpRemoteIndex`] (or any [`RemoteIndex`]) and passes it in
//! `IndexerConfig::remote_client`; [`with_http_client`] does exactly that from the URL and
//! the configured timeouts. A remote URL without a client is refused when the partition is
//! built, and by `IndexerConfig::check`, with a reason naming this crate. libkvr (the
//! `kvr-ffi` crate) calls [`with_http_client`] for its C, C++ and Go hosts, so
//! `kvr_partition_options_set_remote_indexer` behaves as it always did.
//!
//! # Protocol
//!
//! HTTP/1.1, plain `http` (no TLS yet), JSON, persistent connections: the client keeps
//! idle connections for reuse, checks that one is still open before reusing it, and does
//! not retry a failed POST. A server should keep connections open, or announce a close
//! with `Connection: close`.
//!
//! ## Request
//!
//! ```text
//! POST {base_url}/query_tiered_by_hash HTTP/1.1
//! Content-Type: application/json
//!
//! {"block_hashes":[-7046029254386353131,42],"model_name":"llama-3-8b","routing_group":"default"}
//! ```
//!
//! - `block_hashes`: the **local** block hashes of the prompt's complete blocks, first
//!   block first (REFERENCE.md §1: xxh3-64 of each block's tokens, salted by LoRA name and
//!   cache namespace; the trailing partial block is never hashed, so never sent), each
//!   u64 written as the **signed i64** with the same bits ([`hash_to_wire`]; Dynamo's
//!   server refuses a number above `i64::MAX` with 422). Local, not chained sequence
//!   hashes: the server chains them itself, as it does the `tokens_hash` of the engines'
//!   events. Not the engines' external block hashes either: those are opaque per rank.
//! - `model_name`, `routing_group`: the partition
//!   ([`PartitionKey`](kvr::PartitionKey)); `routing_group` defaults to
//!   `"default"`.
//! - No LoRA name, no block size: each local hash is already salted with the request's
//!   LoRA adapter and the partition's cache namespace, and the answer names its block size.
//!   A `cache_salt` field is refused (400).
//! - Unknown fields are ignored; a field of the wrong type refuses the request (422).
//!
//! ## Response
//!
//! Status 200:
//!
//! ```text
//! {"block_size":16,
//!  "tiered":{"device":{"scores":[[{"worker_id":1,"dp_rank":0},3]],"frequencies":[]},
//!            "lower_tier":[["host_pinned",{"hits":[[{"worker_id":1,"dp_rank":0},2]]}],
//!                          ["disk",{"hits":[[{"worker_id":2,"dp_rank":0},4]]}]]}}
//! ```
//!
//! Counts are **blocks**. `device.scores`: leading blocks per rank on the device tier.
//! `lower_tier`: tiers in the order `host_pinned`, `disk`, `external`, each at most once;
//! a tier's hits are the further contiguous blocks that extend the match of the tiers
//! before it (a rank with no device block starts at the first block). They map one to one
//! onto [`TieredOverlap`](kvr::TieredOverlap)'s `device`, `host`, `disk`; kvr has no
//! external tier, so `external` hits (a cache outside the worker) are ignored. The client
//! refuses the whole answer ([`RemoteError::BadBody`]) when `block_size` is not the
//! partition's (hashes of another block size never match, and "no overlap" would hide the
//! misconfiguration), a rank is listed twice in a tier, a tier twice or out of order, or a
//! rank's blocks add up to more than were asked. A `kvr serve` writes this answer with
//! [`QueryTieredByHashResponse::from_scores`] and parses the request with
//! [`QueryTieredByHashRequest::from_json`].
//!
//! Other statuses: 400 for a body that is not JSON or names a `cache_salt`, 422 for one of
//! the wrong shape, 404 for a partition the server does not serve (with a body
//! `{"error":"..."}`), 5xx for a server fault: [`RemoteError::Status`]. No redirect is
//! followed (a 3xx is a `Status` error too).
//!
//! ## Dynamo 1.6.1: `/query_by_hash`
//!
//! Dynamo 1.6.1's indexer has no `/query_tiered_by_hash` route (its router answers 404
//! with an empty body). When the tiered query gets a 404 whose body is not an
//! `{"error": ...}` object, the client posts the same body to `{base_url}/query_by_hash`
//! and keeps using that route ([`HttpRemoteIndex::endpoint`] tells which). Its answer
//! ([`QueryByHashResponse`]) counts tokens, cumulatively per worker; it converts exactly
//! for workers with one DP rank and gives the device counts only for a worker with more
//! (see `wire/by_hash.rs`). It does not name its block size: a count that is not whole
//! blocks of the partition's is refused, an indexer whose block size is a multiple of the
//! partition's cannot be told apart (its hashes simply never match).
//!
//! ## JSON details
//!
//! Numbers are read and written exactly (serde_json keeps integers as u64/i64, never
//! through an f64): a peer whose JSON numbers are doubles would corrupt hashes and ids
//! above 2^53. No compression.
//!
//! # The client ([`HttpRemoteIndex`])
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
//! blocks the calling thread for up to `request_timeout` (twice, once per client: the
//! query that finds `/query_tiered_by_hash` missing and its `/query_by_hash`). The selection makes it, with no
//! engine lock held, when the partition's primary is remote (the selection's decision calls it
//! before it reads the worker set, the hooks or the bookings, and holds no guard across it;
//! the engine's `tests/remote_no_lock.rs` checks this). On any error the result is left
//! empty and the error is returned and counted ([`RemoteStats`]); what to do then (say,
//! select on load alone) is the caller's decision.

mod client;
mod wire;

use std::sync::Arc;

pub use client::HttpRemoteIndex;
pub use kvr::config::{RemoteConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_REQUEST_TIMEOUT};
pub use kvr::stats::RemoteStats;
pub use kvr::{RemoteError, RemoteIndex};
pub use wire::by_hash::{InstanceOverlap, QueryByHashResponse};
pub use wire::tiered::{
    DeviceScores, LowerTier, LowerTierHits, QueryTieredByHashRequest, QueryTieredByHashResponse,
    RequestError, TieredMatches,
};
pub use wire::{
    hash_from_wire, hash_to_wire, WireRank, QUERY_BY_HASH_PATH, QUERY_TIERED_BY_HASH_PATH,
};

use kvr::RemoteClient;

use kvr::config::{IndexerConfig, IndexerConfigError, IndexerPolicy};

/// `cfg` with its remote primary's client: when `cfg` names a remote URL and brings no
/// client of its own, an [`HttpRemoteIndex`] of that URL with `cfg`'s
/// `remote_connect_timeout` and `remote_request_timeout`, in `remote_client`. Any other
/// configuration comes back unchanged (a client already set is kept).
///
/// Refused as the engine would refuse it, in the same order: first what the policy forbids
/// (`IndexerConfig::resolve`: a remote URL with KV events off, an empty URL, ...), then a
/// URL the client cannot use (`https`, no host, ...) as `remote index "URL": ...`. Builds
/// the client only; connects to nothing.
pub fn with_http_client(cfg: &IndexerConfig) -> Result<IndexerConfig, IndexerConfigError> {
    if cfg.remote_url.is_none() || cfg.remote_client.is_some() {
        return Ok(cfg.clone());
    }
    let IndexerPolicy::RemotePrimary { url } = cfg.resolve()?.policy else {
        return Ok(cfg.clone());
    };
    let client = HttpRemoteIndex::new(RemoteConfig {
        base_url: url.clone(),
        connect_timeout: cfg.remote_connect_timeout,
        request_timeout: cfg.remote_request_timeout,
    })
    .map_err(|e| IndexerConfigError(format!("remote index {url:?}: {e}")))?;
    Ok(IndexerConfig {
        remote_client: Some(RemoteClient(Arc::new(client))),
        ..cfg.clone()
    })
}
