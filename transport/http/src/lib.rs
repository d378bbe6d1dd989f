//! kvr's remote primary index over HTTP: the protocol of `POST /query_tiered_by_hash`, its
//! wire types and its client [`HttpRemoteIndex`] (DESIGN.md §5, the "remote URL" row).
//!
//! A partition whose primary index is remote holds no index of its own and subscribes to no
//! KV events: for each selection it asks a remote service (a `kvr serve`, or any server
//! speaking the protocol below) for the tiered overlap of the prompt, and scores with that.
//! The service has no write API, so a remote primary with KV events off is rejected at
//! configuration (nothing would ever feed it).
//!
//! # Where this lives, and how a URL becomes a client
//!
//! The engine crate (`kvr`) does no I/O: it keeps the [`RemoteIndex`] trait the selection
//! calls without knowing HTTP, [`RemoteError`], [`RemoteConfig`], [`RemoteStats`] and the
//! indexer policy (`kvr::indexer`). This crate holds everything that speaks HTTP or JSON:
//! the wire types ([`QueryTieredByHashRequest`], [`QueryTieredByHashResponse`],
//! [`RankOverlap`], with serde so a server reuses them) and the ureq client.
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
//! - `model`, `routing_group` (strings): the partition ([`PartitionKey`](kvr::partition::PartitionKey)) whose index is asked.
//! - `block_hashes` (array of u64): the **local** block hashes of the prompt's complete blocks,
//!   first block first (DESIGN.md §3: xxh3-64 of each block's tokens, salted by LoRA name and
//!   cache namespace; the trailing partial block is never hashed, so never sent). Local, not
//!   chained sequence hashes: the server chains them itself, exactly as
//!   [`Index::find_matches_tiered`](kvr::index::Index::find_matches_tiered) does, so how an index
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
//! [`TieredOverlap`](kvr::index::TieredOverlap)). Ranks holding nothing are absent; the order is
//! free (the client sorts). The client refuses the whole answer ([`RemoteError::BadBody`])
//! when a rank is listed twice or when a rank's `device + host + disk` exceeds the number
//! of hashes sent: such a server cannot be trusted not to overcount. An entry of all zeros
//! is accepted and dropped.
//!
//! Other statuses: 400 for a malformed request or a block-size mismatch, 404 for a partition
//! the server does not serve, 5xx for a server fault. The client reports any status other
//! than 2xx as [`RemoteError::Status`] and ignores that body. It follows no redirect (a
//! 3xx is a `Status` error too).
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
//! blocks the calling thread for up to `request_timeout`. The selection makes it, with no
//! engine lock held, when the partition's primary is remote (`Partition::decide` calls it
//! before it reads the worker set, the hooks or the bookings, and holds no guard across it;
//! the engine's `tests/remote_no_lock.rs` checks this). On any error the result is left
//! empty and the error is returned and counted ([`RemoteStats`]); what to do then (say,
//! select on load alone) is the caller's decision.

mod client;
mod wire;

use std::sync::Arc;

pub use client::HttpRemoteIndex;
pub use kvr::index::remote::{
    RemoteConfig, RemoteError, RemoteIndex, RemoteStats, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_REQUEST_TIMEOUT,
};
pub use wire::{
    QueryTieredByHashRequest, QueryTieredByHashResponse, RankOverlap, QUERY_TIERED_BY_HASH_PATH,
};

use kvr::indexer::{IndexerConfig, IndexerConfigError, IndexerPolicy, RemoteClient};

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
