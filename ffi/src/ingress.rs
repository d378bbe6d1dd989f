//! Raw engine messages through C: hand kvr one ZMQ message's frames and it decodes,
//! sequence-checks and applies them; per-stream counters.

use std::os::raw::c_char;

use kvr::ingress::DecodeErrorKind;
use kvr::stats::{HealthReason, SourceHealth, StreamStats};

use crate::handles::kvr_partition;
use crate::status::*;

/// The most ingress streams one partition keeps (subscriptions' and raw ones together)
/// beyond one per registered DP rank (an engine with data parallelism publishes from each
/// rank).
pub const KVR_MAX_INGRESS_STREAMS: u32 = 1024;
/// The most DP ranks of workers not registered yet that a partition takes events for; a
/// worker's ranks leave this budget when it is registered or removed.
pub const KVR_MAX_PENDING_RANKS: u32 = 256;

const _: () = assert!(KVR_MAX_INGRESS_STREAMS as usize == kvr::ingress::MAX_INGRESS_STREAMS);
const _: () = assert!(KVR_MAX_PENDING_RANKS as usize == kvr::ingress::MAX_PENDING_RANKS);

/// Slots of `kvr_stream_stats.decode_errors` (one per decode-error kind; more than kvr
/// has today, so kinds can be added without changing the struct).
pub const KVR_DECODE_ERROR_KINDS: usize = 16;

const _: () = assert!(DecodeErrorKind::ALL.len() <= KVR_DECODE_ERROR_KINDS);

/// `kvr_stream_stats.health`: in sequence, the index follows the publisher.
pub const KVR_SOURCE_EXACT: u32 = 0;
/// `kvr_stream_stats.health`: a replay is in flight, nothing known lost.
pub const KVR_SOURCE_RECOVERING: u32 = 1;
/// `kvr_stream_stats.health`: the stream's ranks may miss state or hold stale state (a
/// loss not repaired, state cleared, decode errors, a reconnection).
pub const KVR_SOURCE_DEGRADED: u32 = 2;
/// `kvr_stream_stats.health`: the publisher cannot be reached, or is silent beyond the
/// subscription's bound.
pub const KVR_SOURCE_DEAD: u32 = 3;

const _: () = assert!(
    KVR_SOURCE_EXACT == SourceHealth::Exact as u32
        && KVR_SOURCE_RECOVERING == SourceHealth::Recovering as u32
        && KVR_SOURCE_DEGRADED == SourceHealth::Degraded as u32
        && KVR_SOURCE_DEAD == SourceHealth::Dead as u32
);

/// What one `kvr_partition_ingest` call did.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvr_ingest_result {
    /// Batches applied (0 for a duplicate; a gap may first clear the stream's ranks).
    pub batches_applied: u32,
    /// Times the stream's ranks were cleared (a gap or a restart).
    pub clears: u32,
    /// Batches that failed to decode (nothing of them applied).
    pub decode_errors: u32,
    /// Batches refused (not applied, not in `batches_applied`): their DP rank is not
    /// the worker's, or the message would open a stream past a bound.
    pub refused: u32,
}

/// One stream's counters.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct kvr_stream_stats {
    pub worker_id: u64,
    pub stream: u32,
    pub reserved: u32,
    pub messages: u64,
    pub bytes: u64,
    pub batches: u64,
    pub events: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub events_rejected: u64,
    pub block_size_mismatches: u64,
    /// Decode failures by kind (`kvr_decode_error_name(i)` names slot i).
    pub decode_errors: [u64; KVR_DECODE_ERROR_KINDS],
    pub bad_frames: u64,
    pub gaps: u64,
    pub restarts: u64,
    pub duplicates: u64,
    pub replays_requested: u64,
    pub replays_filled: u64,
    /// Replays that ended partial or failed (the Rust stats split the two).
    pub replays_incomplete: u64,
    pub clears: u64,
    pub batches_lost: u64,
    /// The last sequence number applied (`UINT64_MAX` = none yet).
    pub last_seq: u64,
    /// Wall-clock time of the last applied batch, ms since the Unix epoch (0 = never).
    pub last_batch_unix_ms: u64,
    /// Replays that completed without covering the loss (part of `replays_incomplete`).
    pub replays_partial: u64,
    /// Replays that failed or timed out (the rest of `replays_incomplete`).
    pub replays_failed: u64,
    /// Idle probes started (subscriptions only).
    pub idle_probes: u64,
    /// Events skipped: their KV-cache group is not the one routing follows.
    pub events_skipped_group: u64,
    /// Times the followed KV-cache group changed (the stream's ranks were cleared).
    pub group_switches: u64,
    /// Events skipped: a `medium` kvr does not know.
    pub events_skipped_medium: u64,
    /// Freshness: since when the stream's ranks are stale (a known loss being replayed;
    /// their overlap is not credited by default), ms since the Unix epoch; 0 = not stale.
    pub stale_since_unix_ms: u64,
    /// 1 while a replay is in flight (recovering, or stale if `stale_since_unix_ms`).
    pub recovering: u32,
    pub reserved2: u32,
    /// Batches refused because they name a DP rank the worker does not have (at or above
    /// its `dp_size`, or at least `KVR_MAX_DP_SIZE` for a worker not yet registered): the
    /// wire never picks which ranks exist. Their events count in `events_rejected` too.
    pub dp_rank_refused: u64,
    /// Stores skipped because they cannot be used (token ids that do not fill their
    /// blocks, a per-block list of the wrong length); the batch's other events applied.
    pub events_skipped_malformed: u64,
    /// Blocks of tokenless stores (an offloading connector's host or disk copies, named
    /// by engine hash only) that the rank held on no tier: left out of the index.
    pub tokenless_blocks_unknown: u64,
    /// The stream's health: `KVR_SOURCE_EXACT`, `_RECOVERING`, `_DEGRADED` or `_DEAD`. A
    /// degraded or dead stream's ranks are stale (`stale_since_unix_ms`).
    pub health: u32,
    /// Why it is in that state (`kvr_health_reason_name` says it in words).
    pub health_reason: u32,
    /// Since when it is in that state, ms since the Unix epoch (0 = since registered).
    pub health_since_unix_ms: u64,
    /// Failed connects or binds and lost connections (subscriptions only).
    pub link_failures: u64,
}

fn stream_stats(s: &StreamStats) -> kvr_stream_stats {
    let mut decode_errors = [0u64; KVR_DECODE_ERROR_KINDS];
    for (slot, kind) in decode_errors.iter_mut().zip(DecodeErrorKind::ALL) {
        *slot = s
            .decode_errors
            .iter()
            .find(|c| c.0 == kind.name())
            .map_or(0, |c| c.1);
    }
    let q = &s.sequence;
    kvr_stream_stats {
        worker_id: s.worker_id,
        stream: s.stream,
        reserved: 0,
        messages: s.messages,
        bytes: s.bytes,
        batches: s.batches,
        events: s.events,
        blocks_stored: s.blocks_stored,
        blocks_removed: s.blocks_removed,
        events_rejected: s.events_rejected,
        block_size_mismatches: s.block_size_mismatches,
        decode_errors,
        bad_frames: s.bad_frames,
        gaps: q.gaps,
        restarts: q.restarts,
        duplicates: q.duplicates,
        replays_requested: q.replays_requested,
        replays_filled: q.replays_filled,
        replays_incomplete: q.replays_incomplete(),
        clears: q.clears,
        batches_lost: q.batches_lost,
        last_seq: q.last_seq.unwrap_or(u64::MAX),
        last_batch_unix_ms: s.last_batch_unix_ms,
        replays_partial: q.replays_partial,
        replays_failed: q.replays_failed,
        idle_probes: q.idle_probes,
        events_skipped_group: s.events_skipped_group,
        group_switches: s.group_switches,
        events_skipped_medium: s.events_skipped_medium,
        stale_since_unix_ms: s.stale_since_unix_ms,
        recovering: u32::from(q.recovering),
        reserved2: 0,
        dp_rank_refused: s.dp_rank_refused,
        events_skipped_malformed: s.events_skipped_malformed,
        tokenless_blocks_unknown: s.tokenless_blocks_unknown,
        health: s.health as u32,
        health_reason: s.health_reason as u32,
        health_since_unix_ms: s.health_since_unix_ms,
        link_failures: s.link_failures,
    }
}

/// Hands kvr one message of an engine's KV-event stream (vLLM/SGLang ZMQ frames: topic,
/// sequence number, msgpack payload) from `worker_id`'s stream `stream`
/// (one per publisher socket, e.g. its DP rank). The batch is sequence-checked (a gap
/// or a restart clears the stream's ranks: the host owns the socket, so kvr cannot ask
/// for a replay), decoded, and applied to rank `(worker_id, data_parallel_rank)` (or
/// `(worker_id, stream)` if the batch names none), with local hashes computed from the
/// token ids. A payload that does not decode applies nothing, is counted by cause, and
/// returns `KVR_ERR_DECODE`. `out` (may be NULL) gets what happened either way.
///
/// Nothing handed in creates state without bound, and a refusal is never `KVR_OK`:
/// - a batch naming a DP rank a registered worker does not have is refused
///   (`KVR_ERR_UNKNOWN_RANK`, `out->refused`, the stream's `dp_rank_refused`);
/// - a worker not registered yet (engines may publish before the host registers them)
///   may open streams and ranks only within the partition's budget of such ranks
///   (`KVR_MAX_PENDING_RANKS`, `stream` counting as a DP rank; ranks at least
///   `KVR_MAX_DP_SIZE` never): past it, `KVR_ERR_UNKNOWN_WORKER`;
/// - a message that would open a stream past `KVR_MAX_INGRESS_STREAMS` streams beyond the
///   partition's registered DP ranks: `KVR_ERR_TOO_MANY_RANKS`.
///
/// Refusals also count in `kvr_indexer_stats.ingress_refused` (those of an existing
/// stream's batches in its `dp_rank_refused`).
///
/// Messages of one stream must be handed in order, one at a time; different streams may
/// be ingested from different threads at once.
///
/// # Safety
/// `partition` is NULL or live; `topic` and `payload` point to their lengths in bytes;
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_ingest(
    partition: *const kvr_partition,
    worker_id: u64,
    stream: u32,
    topic: *const u8,
    topic_len: usize,
    seq: u64,
    payload: *const u8,
    payload_len: usize,
    out: *mut kvr_ingest_result,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (p, topic, payload) = unsafe {
            (
                handle(partition)?,
                slice(topic, topic_len)?,
                slice(payload, payload_len)?,
            )
        };
        let o = p.partition.ingest(worker_id, stream, topic, seq, payload);
        let r = kvr_ingest_result {
            batches_applied: o.batches_applied,
            clears: o.clears,
            decode_errors: o.decode_errors,
            refused: o.refused,
        };
        // SAFETY: forwarded caller contract.
        unsafe { write_opt(out, r) };
        let member = || p.partition.workers().get(worker_id).is_some();
        if o.decode_errors > 0 {
            Err(KVR_ERR_DECODE)
        } else if o.stream_refused && member() {
            Err(KVR_ERR_TOO_MANY_RANKS)
        } else if o.refused > 0 && member() {
            Err(KVR_ERR_UNKNOWN_RANK)
        } else if o.refused > 0 {
            Err(KVR_ERR_UNKNOWN_WORKER)
        } else {
            Ok(())
        }
    })
}

/// Counters of every event stream of the partition (ingested or subscribed), into `out`
/// (`cap` entries; `*out_len` = the number of streams; `KVR_BUFFER_TOO_SMALL` and nothing
/// written if they do not fit).
///
/// # Safety
/// `partition` is NULL or live; `out` points to `cap` writable entries; `out_len` is NULL
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_ingress_stats(
    partition: *const kvr_partition,
    out: *mut kvr_stream_stats,
    cap: usize,
    out_len: *mut usize,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (p, out) = unsafe { (handle(partition)?, slice_mut(out, cap)?) };
        if out_len.is_null() {
            return Err(KVR_ERR_NULL);
        }
        let all = p.partition.ingress_stats();
        // SAFETY: checked non-NULL; writable by the caller's contract.
        unsafe { out_len.write(all.len()) };
        if all.len() > out.len() {
            return Err(KVR_BUFFER_TOO_SMALL);
        }
        for (slot, s) in out.iter_mut().zip(&all) {
            *slot = stream_stats(s);
        }
        Ok(())
    })
}

/// The name of decode-error slot `kind` of `kvr_stream_stats.decode_errors` (e.g.
/// "truncated"), as a static string of `*len` bytes (not NUL-terminated);
/// `KVR_ERR_INVALID_ARGUMENT` for a slot kvr does not use.
///
/// # Safety
/// `name` and `len` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_decode_error_name(
    kind: u32,
    name: *mut *const c_char,
    len: *mut usize,
) -> kvr_status {
    // SAFETY: forwarded from this function's contract.
    guard(|| unsafe {
        static_name(
            DecodeErrorKind::ALL.get(kind as usize).map(|k| k.name()),
            name,
            len,
        )
    })
}

/// The words for `kvr_stream_stats.health_reason` `reason` (e.g. "decode errors"), as a
/// static string of `*len` bytes (not NUL-terminated); `KVR_ERR_INVALID_ARGUMENT` for a
/// number kvr does not use.
///
/// # Safety
/// `name` and `len` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_health_reason_name(
    reason: u32,
    name: *mut *const c_char,
    len: *mut usize,
) -> kvr_status {
    // SAFETY: forwarded from this function's contract.
    guard(|| unsafe {
        static_name(
            HealthReason::ALL.get(reason as usize).map(|r| r.text()),
            name,
            len,
        )
    })
}

/// Writes a static string's address and length to `name` and `len` (not NUL-terminated):
/// `KVR_ERR_INVALID_ARGUMENT` when there is none (an unused number).
///
/// # Safety
/// `name` and `len` are NULL or writable.
unsafe fn static_name(
    s: Option<&'static str>,
    name: *mut *const c_char,
    len: *mut usize,
) -> Result<(), kvr_status> {
    if name.is_null() || len.is_null() {
        return Err(KVR_ERR_NULL);
    }
    let s = s.ok_or(KVR_ERR_INVALID_ARGUMENT)?;
    // SAFETY: both checked non-NULL; writable by the caller's contract.
    unsafe {
        name.write(s.as_ptr().cast());
        len.write(s.len());
    }
    Ok(())
}
