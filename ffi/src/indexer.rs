//! Indexer policy through C: which index answers a partition's overlap —
//! the engines' KV events, those plus a prediction side index, an approximate index fed
//! by bookings, or a remote index service — set on the partition options, checked with a
//! reason, and counted.
//!
//! A C host has no logger for kvr's notices (e.g. capacity-bounded retention falling back
//! to TTL), so `kvr_partition_options_check` hands them back as text.

use std::os::raw::c_char;
use std::time::Duration;

use kvr::config::{IndexerPolicy, Retention};
use kvr::config::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_REQUEST_TIMEOUT};

use crate::handles::{kvr_partition, kvr_partition_options};
use crate::status::*;

/// Approximate records expire a TTL after their last booking (the default).
pub const KVR_RETENTION_TTL: u32 = 0;
/// At most a worker's KV capacity per rank, least recently used first. Accepted; until it
/// is fully supported it falls back to `KVR_RETENTION_TTL` (`kvr_partition_options_check`
/// reports the notice).
pub const KVR_RETENTION_CAPACITY_BOUNDED: u32 = 1;

/// Policy: the engines' KV events feed the index (the default).
pub const KVR_INDEXER_EVENT_DRIVEN: u32 = 0;
/// Policy: events feed the index, and bookings a short-lived side index; a query takes the
/// per-rank maximum of both.
pub const KVR_INDEXER_EVENT_DRIVEN_WITH_PREDICTION: u32 = 1;
/// Policy: KV events are off; the index holds what bookings recorded, for a TTL.
pub const KVR_INDEXER_APPROXIMATE_PRIMARY: u32 = 2;
/// Policy: a remote index service answers overlap queries; nothing is indexed locally.
pub const KVR_INDEXER_REMOTE_PRIMARY: u32 = 3;

/// Runs `f` on the options' indexer configuration.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
unsafe fn with_indexer(
    opts: *mut kvr_partition_options,
    f: impl FnOnce(&mut kvr::config::IndexerConfig) -> Ret,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        f(&mut unsafe { handle_mut(opts) }?.config.indexer)
    })
}

/// Whether the engines' KV events feed the partition's index (Dynamo's `use_kv_events`;
/// default 1). With 0 the index is approximate: bookings record their prompts for the
/// approximate TTL, and `kvr_partition_ingest` / `kvr_partition_subscribe` apply nothing.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_use_kv_events(
    opts: *mut kvr_partition_options,
    on: u32,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_indexer(opts, |c| {
            c.use_kv_events = on != 0;
            Ok(())
        })
    }
}

/// With events on: also record every booking into a side index kept `ttl_ms` (0 = no side
/// index, the default), so a prefix just routed counts before its engine's events arrive.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_prediction_ttl_ms(
    opts: *mut kvr_partition_options,
    ttl_ms: u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_indexer(opts, |c| {
            c.prediction_ttl = (ttl_ms != 0).then(|| Duration::from_millis(ttl_ms));
            Ok(())
        })
    }
}

/// A remote index service as the primary (Dynamo's `POST {url}/query_tiered_by_hash`, or
/// a Dynamo 1.6.1 indexer's `/query_by_hash`; protocol in the kvr-remote crate), copied; `(NULL, 0)` = none (the default). Needs KV events on (the remote
/// service has no write API for routing decisions): with them off, creating the partition
/// fails with `KVR_ERR_INVALID_CONFIG`. The timeouts bound one query (0 = the defaults,
/// 50 ms to connect and 200 ms in all); a remote that is down or slow gives that selection
/// no overlap, counted in `kvr_indexer_stats.remote_failures`, never a failed selection.
///
/// # Safety
/// `opts` is NULL or live and not shared; `url` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_remote_indexer(
    opts: *mut kvr_partition_options,
    url: *const c_char,
    len: usize,
    connect_timeout_ms: u64,
    request_timeout_ms: u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_indexer(opts, |c| {
            let url = str_arg(url, len)?;
            let ms = |v: u64, default: Duration| {
                if v == 0 {
                    default
                } else {
                    Duration::from_millis(v)
                }
            };
            c.remote_url = (!url.is_empty()).then(|| url.to_owned());
            c.remote_connect_timeout = ms(connect_timeout_ms, DEFAULT_CONNECT_TIMEOUT);
            c.remote_request_timeout = ms(request_timeout_ms, DEFAULT_REQUEST_TIMEOUT);
            Ok(())
        })
    }
}

/// Retention of the approximate index (the primary with events off; the side index takes
/// the size bound and the prediction TTL): records live `ttl_ms` after their last booking
/// (default 120,000) and at most `max_blocks` (rank, block) records are kept (default
/// 2^20; above it the deepest are pruned to 80 %). Both must be ≥ 1.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_approx_index(
    opts: *mut kvr_partition_options,
    ttl_ms: u64,
    max_blocks: u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_indexer(opts, |c| {
            if ttl_ms == 0 || max_blocks == 0 {
                return Err(KVR_ERR_INVALID_ARGUMENT);
            }
            c.approx.ttl = Duration::from_millis(ttl_ms);
            c.approx.max_blocks = usize::try_from(max_blocks).unwrap_or(usize::MAX);
            Ok(())
        })
    }
}

/// The approximate index's retention: `KVR_RETENTION_TTL` (default) or
/// `KVR_RETENTION_CAPACITY_BOUNDED`.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_approx_retention(
    opts: *mut kvr_partition_options,
    retention: u32,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_indexer(opts, |c| {
            c.retention = match retention {
                KVR_RETENTION_TTL => Retention::Ttl,
                KVR_RETENTION_CAPACITY_BOUNDED => Retention::CapacityBounded,
                _ => return Err(KVR_ERR_INVALID_ARGUMENT),
            };
            Ok(())
        })
    }
}

/// Checks the options as `kvr_engine_create_partition` would (`PartitionConfig::validate`
/// and the indexer policy), without creating a partition. `KVR_OK` if a partition can be
/// made from them: `why` then gets kvr's notices about them, joined by "; " (empty if none
/// — e.g. capacity-bounded retention falling back to TTL). `KVR_ERR_INVALID_CONFIG` if not:
/// `why` gets the reason. With a state directory (`kvr_partition_options_set_state_dir`)
/// the directory is created if missing and the I/O mode tried, as creating the partition
/// does; a failure is `KVR_ERR_IO` (or `KVR_ERR_INVALID_CONFIG` for a bad `KVR_STATE_IO`)
/// with its reason in `why`. `why` receives the first
/// `min(*why_len, why_cap)` bytes of the text (UTF-8, not NUL-terminated; `(NULL, 0)` to
/// only learn the length); `*why_len` is the text's full length.
///
/// # Safety
/// `opts` is NULL or live; `why` is NULL or has `why_cap` writable bytes; `why_len` is NULL
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_check(
    opts: *const kvr_partition_options,
    why: *mut c_char,
    why_cap: usize,
    why_len: *mut usize,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let o = unsafe { handle(opts) }?;
        if why_len.is_null() {
            return Err(KVR_ERR_NULL);
        }
        // SAFETY: forwarded caller contract.
        let buf = unsafe { slice_mut(why.cast::<u8>(), why_cap) }?;
        // The remote URL gets its HTTP client first, as `kvr_engine_create_partition` gives
        // it (the engine builds none), so a URL the client cannot use is reported here.
        // Then the whole configuration is validated as the engine will (every
        // `ConfigError`, e.g. a latency knob `OutOfRange`, with its message), and only a
        // valid one reports the indexer's notices.
        let checked = kvr_remote::with_http_client(&o.config.indexer)
            .map_err(|e| e.0)
            .and_then(|indexer| {
                let mut config = o.config.clone();
                config.indexer = indexer;
                config.validate().map_err(|e| e.to_string())?;
                config.indexer.check().map_err(|e| e.0)
            });
        let (text, status) = match checked {
            // A state directory is tried as creating the partition will (created if
            // missing, the I/O mode set up): the reason of a failure is reported here.
            Ok(r) => match o.state.as_ref().map(|s| s.prepare_why()).transpose() {
                Ok(_) => (r.notices.join("; "), Ok(())),
                Err((status, reason)) => (reason, Err(status)),
            },
            Err(reason) => (reason, Err(KVR_ERR_INVALID_CONFIG)),
        };
        let n = text.len().min(buf.len());
        buf[..n].copy_from_slice(&text.as_bytes()[..n]);
        // SAFETY: checked non-NULL above; writable by the caller's contract.
        unsafe { why_len.write(text.len()) };
        status
    })
}

/// A partition's indexer: its policy and what it recorded or asked (totals since the
/// partition was created).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvr_indexer_stats {
    /// `KVR_INDEXER_*`.
    pub policy: u32,
    /// Always 0.
    pub reserved: u32,
    /// Bookings recorded into the approximate index (primary or side).
    pub bookings_recorded: u64,
    /// Recordings that failed (the bookings stood).
    pub record_failures: u64,
    /// Overlap queries sent to the remote primary, and those that failed (the selection
    /// went on without overlap).
    pub remote_queries: u64,
    pub remote_failures: u64,
    /// Engine event messages handed to a partition whose policy applies none.
    pub events_ignored: u64,
    /// The approximate index's (rank, block) records: created, refreshed by a later
    /// booking, expired, pruned by the size bound. 0 without an approximate index.
    pub approx_blocks_recorded: u64,
    pub approx_blocks_refreshed: u64,
    pub approx_blocks_expired: u64,
    pub approx_blocks_pruned: u64,
    /// Bookings the approximate index recorded (with at least one block), and those it
    /// refused (e.g. too many ranks). 0 without an approximate index.
    pub approx_records: u64,
    pub approx_record_errors: u64,
    /// Blocks of booked prompts not recorded because the records were at the size bound.
    pub approx_blocks_over_bound: u64,
    /// Engine messages, batches and topics refused because they would create ingress
    /// state past a bound: a bind subscription's route-less topic past its cap, a stream
    /// past `KVR_MAX_INGRESS_STREAMS` beyond the registered ranks, a rank of a worker not registered past
    /// `KVR_MAX_PENDING_RANKS`, or a typed batch for a DP rank its worker does not have.
    pub ingress_refused: u64,
}

/// The partition's indexer statistics.
///
/// # Safety
/// `partition` is NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_indexer_stats(
    partition: *const kvr_partition,
    out: *mut kvr_indexer_stats,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let p = unsafe { handle(partition) }?;
        let s = p.partition.indexer_stats();
        let a = s.approx.unwrap_or_default();
        let stats = kvr_indexer_stats {
            policy: match s.policy {
                IndexerPolicy::EventDriven => KVR_INDEXER_EVENT_DRIVEN,
                IndexerPolicy::EventDrivenWithPrediction { .. } => {
                    KVR_INDEXER_EVENT_DRIVEN_WITH_PREDICTION
                }
                IndexerPolicy::ApproximatePrimary => KVR_INDEXER_APPROXIMATE_PRIMARY,
                IndexerPolicy::RemotePrimary { .. } => KVR_INDEXER_REMOTE_PRIMARY,
                // A policy this ABI version has no code for.
                _ => u32::MAX,
            },
            reserved: 0,
            bookings_recorded: s.bookings_recorded,
            record_failures: s.record_failures,
            remote_queries: s.remote_queries,
            remote_failures: s.remote_failures,
            events_ignored: s.events_ignored,
            approx_blocks_recorded: a.blocks_recorded,
            approx_blocks_refreshed: a.blocks_refreshed,
            approx_blocks_expired: a.blocks_expired,
            approx_blocks_pruned: a.blocks_pruned,
            approx_records: a.records,
            approx_record_errors: a.record_errors,
            approx_blocks_over_bound: a.blocks_over_bound,
            ingress_refused: s.ingress_refused,
        };
        // SAFETY: forwarded caller contract.
        unsafe { write_out(out, stats) }
    })
}
