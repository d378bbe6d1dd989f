//! Selection and booking through C: advisory and booked selection over a `kvr_request`
//! (request.rs), explicit and replica reservations, and the booking lifecycle.

use std::time::Duration;

use kvr::RankId;
use kvr::{BookingRequest, FreeOutcome, FreedBy};
use kvr::{Decision, Outcome, SelectRequest, SessionRoute};

use crate::handles::{engine_status, kvr_engine, kvr_partition};
use crate::hint::kvr_kv_hint;
use crate::request::kvr_request;
use crate::status::*;

/// A selection's answer.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct kvr_decision {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Leading prompt blocks cached on the chosen rank's device.
    pub device_blocks: u32,
    /// Further blocks in its host memory, then on its disk.
    pub host_blocks: u32,
    pub disk_blocks: u32,
    /// Blocks the host's shared cache holds beyond the device prefix.
    pub shared_blocks: u32,
    /// `KVR_DECISION_*` bits: whether a transfer hint came with the booking, and how
    /// session affinity steered the choice (at most one `KVR_DECISION_SESSION_*` bit).
    pub flags: u32,
    /// The booking's id (booked modes); 0 for advisory selection.
    pub selection_id: u64,
    /// Prompt tokens cached on the chosen rank's device.
    pub cached_tokens: u64,
    /// Prefill tokens this request adds to the rank.
    pub projected_prefill_tokens: u64,
    /// The rank's decode blocks once this request is booked on it.
    pub projected_decode_blocks: u64,
    /// The chosen rank's cost: a predicted TTFT in ms with `KVR_COST_MODEL_LATENCY` (the
    /// default), block equivalents with `KVR_COST_MODEL_DYNAMO`; NaN for explicit
    /// reservations.
    pub cost: f64,
}

/// `kvr_decision.flags`: a transfer hint was attached to the booking
/// (`kvr_partition_select_and_reserve_with_hint` wrote it).
pub const KVR_DECISION_KV_HINT: u32 = 1 << 0;
/// The request's session had no binding: chosen by cost (a booking binds it).
pub const KVR_DECISION_SESSION_UNBOUND: u32 = 1 << 1;
/// Hard affinity: sent to the session's bound rank.
pub const KVR_DECISION_SESSION_PINNED: u32 = 1 << 2;
/// Soft affinity: chosen by cost with the session's rank preferred (it may not have won).
pub const KVR_DECISION_SESSION_PREFERRED: u32 = 1 << 3;
/// The session's rank could not take the turn (left, unavailable, overloaded, not
/// allowed): chosen by cost, and a booking rebinds the session (counted as forced).
pub const KVR_DECISION_SESSION_REBOUND: u32 = 1 << 4;

#[inline(always)]
fn flags(d: &Decision) -> u32 {
    let hint = if d.kv_hint.is_some() {
        KVR_DECISION_KV_HINT
    } else {
        0
    };
    let session = match d.session_route {
        None => 0,
        Some(SessionRoute::Unbound) => KVR_DECISION_SESSION_UNBOUND,
        Some(SessionRoute::Pinned) => KVR_DECISION_SESSION_PINNED,
        Some(SessionRoute::Preferred) => KVR_DECISION_SESSION_PREFERRED,
        Some(SessionRoute::Rebound) => KVR_DECISION_SESSION_REBOUND,
        Some(_) => 0, // a route this ABI version has no flag for
    };
    hint | session
}

#[inline(always)]
fn decision(d: &Decision) -> kvr_decision {
    kvr_decision {
        worker_id: d.rank.worker_id,
        dp_rank: d.rank.dp_rank,
        device_blocks: d.overlap.device_blocks,
        host_blocks: d.overlap.host_blocks,
        disk_blocks: d.overlap.disk_blocks,
        shared_blocks: d.overlap.shared_blocks,
        flags: flags(d),
        selection_id: d.selection_id.unwrap_or(0),
        cached_tokens: d.cached_tokens,
        projected_prefill_tokens: d.projected_prefill_tokens,
        projected_decode_blocks: d.projected_decode_blocks,
        cost: d.cost,
    }
}

/// Shared by both selection modes: checks, runs `f`, maps the outcome.
///
/// # Safety
/// As the exported selections.
#[inline(always)]
unsafe fn selection(
    partition: *const kvr_partition,
    req: *const kvr_request,
    out: *mut kvr_decision,
    hint: *mut kvr_kv_hint,
    f: impl FnOnce(&kvr_partition, &SelectRequest<'_>) -> Result<Outcome, kvr::EngineError>,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (p, r) = unsafe { (handle(partition)?, handle(req)?) };
        if out.is_null() {
            return Err(KVR_ERR_NULL);
        }
        // SAFETY: forwarded caller contract (the prompt array is valid during the call).
        let view = unsafe { r.view() }?;
        // One match on the result, no intermediate moves of the decision.
        match &f(p, &view) {
            Ok(Outcome::Selected(d)) => {
                // SAFETY: checked non-NULL above; writable by the caller's contract.
                unsafe { out.write(decision(d)) };
                if let (Some(h), false) = (&d.kv_hint, hint.is_null()) {
                    let mut c = kvr_kv_hint::of(h);
                    // SAFETY: the request's names buffer is the caller's, valid by contract.
                    c.n_block_hashes = unsafe { r.write_hint_names(&h.block_hashes) } as u32;
                    // SAFETY: non-NULL; writable by the caller's contract.
                    unsafe { hint.write(c) };
                }
                Ok(())
            }
            Ok(Outcome::Busy) => Err(KVR_BUSY),
            Ok(Outcome::NoWorker) => Err(KVR_NO_WORKER),
            Ok(_) => Err(KVR_ERR_INVALID_ARGUMENT), // an outcome this ABI has no code for
            Err(e) => Err(engine_status(e)),
        }
    })
}

/// Advisory selection: the rank kvr would choose and the load it would
/// add; books nothing and cannot reserve. `KVR_OK` with `*out` written, or `KVR_BUSY` /
/// `KVR_NO_WORKER` with `*out` untouched. Takes no engine-wide lock; after warm-up, a
/// request without a session context allocates nothing.
///
/// # Safety
/// `partition` and `req` are NULL or live (`req` with a valid prompt array); `out` is NULL
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_select(
    partition: *const kvr_partition,
    req: *const kvr_request,
    out: *mut kvr_decision,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        selection(partition, req, out, std::ptr::null_mut(), |p, r| {
            p.engine.select(&p.partition, r)
        })
    }
}

/// Booked selection: as `kvr_partition_select`, and the chosen rank is booked before it
/// returns (`out->selection_id` names the booking; free it with `kvr_engine_free_booking`).
///
/// # Safety
/// As `kvr_partition_select`.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_select_and_reserve(
    partition: *const kvr_partition,
    req: *const kvr_request,
    out: *mut kvr_decision,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { kvr_partition_select_and_reserve_with_hint(partition, req, out, std::ptr::null_mut()) }
}

/// As `kvr_partition_select_and_reserve`, and when the booking comes with a transfer hint
/// (partition options `kvr_partition_options_set_kv_hints`; `out->flags` has
/// `KVR_DECISION_KV_HINT`) it is written to `*hint`; otherwise `*hint` is untouched.
/// `hint` may be NULL (the hint is dropped).
///
/// # Safety
/// As `kvr_partition_select`; `hint` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_select_and_reserve_with_hint(
    partition: *const kvr_partition,
    req: *const kvr_request,
    out: *mut kvr_decision,
    hint: *mut kvr_kv_hint,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        selection(partition, req, out, hint, |p, r| {
            p.engine.select_and_reserve(&p.partition, r)
        })
    }
}

/// Books a request on a rank the caller chose (no scoring). With `req` (may be NULL),
/// its prompt's blocks join the rank's active blocks and its selection id, TTL and
/// expected output are used; `prefill_tokens` (may be NULL) overrides the prefill booked
/// (default: prompt tokens not cached on the rank; 0 without a prompt). `selection_id`
/// (0 = the request's, else minted) names the booking. `KVR_ERR_UNKNOWN_RANK` if the rank
/// is not in the partition.
///
/// # Safety
/// `partition` is NULL or live; `req` is NULL or live with a valid prompt array;
/// `prefill_tokens` is NULL or readable; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_reserve(
    partition: *const kvr_partition,
    worker_id: u64,
    dp_rank: u32,
    req: *const kvr_request,
    prefill_tokens: *const u64,
    selection_id: u64,
    out: *mut kvr_decision,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let p = unsafe { handle(partition) }?;
        if out.is_null() {
            return Err(KVR_ERR_NULL);
        }
        // SAFETY: forwarded caller contract (NULL allowed for both).
        let (r, prefill) = unsafe { (req.as_ref(), prefill_tokens.as_ref().copied()) };
        let view = match r {
            // SAFETY: forwarded caller contract (the prompt array is valid during the call).
            Some(r) => Some(unsafe { r.view() }?),
            None => None,
        };
        let id = (selection_id != 0)
            .then_some(selection_id)
            .or_else(|| view.as_ref().and_then(|v| v.selection_id));
        let d = p
            .engine
            .reserve(
                &p.partition,
                RankId::new(worker_id, dp_rank),
                view.as_ref(),
                prefill,
                id,
            )
            .map_err(|e| engine_status(&e))?;
        // SAFETY: forwarded caller contract.
        unsafe { write_out(out, decision(&d)) }
    })
}

/// A booking received from a replica peer (another router instance over the same
/// workers).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_replica_booking {
    /// Must not be 0.
    pub selection_id: u64,
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Must be 0.
    pub reserved: u32,
    /// The prompt's sequence hashes (`seq_out` of `kvr_partition_hash_tokens`).
    pub prompt_blocks: *const u64,
    pub n_prompt_blocks: usize,
    pub prefill_tokens: u64,
    pub expected_output_tokens: u64,
    /// Lifetime in milliseconds (0 = the partition's default), at most
    /// `KVR_MAX_REPLICA_BOOKING_TTL_MS` (a longer one is cut to it).
    pub ttl_ms: u64,
}

/// The longest a replica peer's booking lives (Dynamo's replica-booking expiry, 300 s):
/// `kvr_replica_booking.ttl_ms`, or the partition's default, is cut to it.
pub const KVR_MAX_REPLICA_BOOKING_TTL_MS: u64 = 300_000;

const _: () =
    assert!(KVR_MAX_REPLICA_BOOKING_TTL_MS == kvr::MAX_REPLICA_BOOKING_TTL.as_millis() as u64);

/// Installs a replica peer's booking. It is not in the selection-id index: lifecycle
/// calls find it by scanning the partitions. Its rank must be a registered worker's own
/// (else `KVR_ERR_UNKNOWN_RANK`, nothing installed: a peer never creates ranks here), and
/// it lives at most `KVR_MAX_REPLICA_BOOKING_TTL_MS`.
///
/// # Safety
/// `partition` and `booking` are NULL or live; `booking->prompt_blocks` points to
/// `n_prompt_blocks` values.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_install_replica_booking(
    partition: *const kvr_partition,
    booking: *const kvr_replica_booking,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (p, b) = unsafe { (handle(partition)?, handle(booking)?) };
        if b.selection_id == 0 || b.reserved != 0 {
            return Err(KVR_ERR_INVALID_ARGUMENT);
        }
        // SAFETY: forwarded caller contract.
        let blocks = unsafe { slice(b.prompt_blocks, b.n_prompt_blocks) }?;
        let req = BookingRequest {
            selection_id: b.selection_id,
            rank: RankId::new(b.worker_id, b.dp_rank),
            prompt_blocks: blocks.to_vec(),
            prefill_tokens: b.prefill_tokens,
            expected_output_tokens: b.expected_output_tokens,
            ttl: (b.ttl_ms != 0).then(|| Duration::from_millis(b.ttl_ms)),
        };
        p.engine
            .install_replica_booking(&p.partition, req)
            .map_err(|e| engine_status(&e))
    })
}

/// The request's prefill is done: its prefill tokens leave the rank's load. Idempotent.
///
/// # Safety
/// `engine` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_mark_prefill_complete(
    engine: *const kvr_engine,
    selection_id: u64,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let e = unsafe { handle(engine) }?;
        e.engine
            .mark_prefill_complete(selection_id)
            .map_err(|e| engine_status(&e))
    })
}

/// The request produced `n` more output blocks (decode load). Additive, as Dynamo's
/// `add_output_block`: each call adds, so a call that may be retried should use
/// `kvr_engine_set_output_blocks` (idempotent) instead.
///
/// # Safety
/// `engine` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_add_output_blocks(
    engine: *const kvr_engine,
    selection_id: u64,
    n: u64,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let e = unsafe { handle(engine) }?;
        e.engine
            .add_output_blocks(selection_id, n)
            .map_err(|e| engine_status(&e))
    })
}

/// The request has produced `total` output blocks so far (its last block index + 1): the
/// booking's output blocks rise to `total`, so a retried call adds nothing and a late,
/// lower total changes nothing (idempotent, unlike `kvr_engine_add_output_blocks`).
/// `*out_added` (may be NULL) gets the blocks this call added. `KVR_ERR_TOO_LARGE` over
/// the per-booking bound; unknown and freed ids as `kvr_engine_add_output_blocks`.
///
/// # Safety
/// `engine` is NULL or live; `out_added` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_set_output_blocks(
    engine: *const kvr_engine,
    selection_id: u64,
    total: u64,
    out_added: *mut u64,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let e = unsafe { handle(engine) }?;
        let added = e
            .engine
            .set_output_blocks(selection_id, total)
            .map_err(|e| engine_status(&e))?;
        // SAFETY: forwarded caller contract.
        unsafe { write_opt(out_added, added) };
        Ok(())
    })
}

/// This call freed the booking.
pub const KVR_FREED_NOW: u32 = 0;
/// It had been freed by an earlier `kvr_engine_free_booking`.
pub const KVR_FREED_BY_CALLER: u32 = 1;
/// It had expired and a sweep freed it.
pub const KVR_FREED_EXPIRED: u32 = 2;
/// Its rank had left the partition.
pub const KVR_FREED_RANK_REMOVED: u32 = 3;

/// The request finished: everything it booked is released. Idempotent: freeing a
/// booking freed recently is `KVR_OK` again; `*out_freed` (may be NULL) says which case
/// (`KVR_FREED_*`).
///
/// # Safety
/// `engine` is NULL or live; `out_freed` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_free_booking(
    engine: *const kvr_engine,
    selection_id: u64,
    out_freed: *mut u32,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let e = unsafe { handle(engine) }?;
        let how = match e.engine.free(selection_id).map_err(|e| engine_status(&e))? {
            FreeOutcome::Freed(_) => KVR_FREED_NOW,
            FreeOutcome::AlreadyFreed(FreedBy::Caller) => KVR_FREED_BY_CALLER,
            FreeOutcome::AlreadyFreed(FreedBy::Expired) => KVR_FREED_EXPIRED,
            FreeOutcome::AlreadyFreed(FreedBy::RankRemoved) => KVR_FREED_RANK_REMOVED,
            // A freeing this ABI version has no code for: it was freed before.
            _ => KVR_FREED_BY_CALLER,
        };
        // SAFETY: forwarded caller contract.
        unsafe { write_opt(out_freed, how) };
        Ok(())
    })
}
