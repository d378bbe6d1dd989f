//! Selection and booking through C: a reusable request object, advisory and booked
//! selection, explicit and replica reservations, and the booking lifecycle.
//!
//! A `kvr_request` borrows the token or hash array it is given (no copy of the prompt):
//! the array must stay valid and unchanged until the request is reset, given another
//! prompt, or freed, and during every selection call that uses it. Everything else
//! (LoRA name, allow-set, session context) is copied into buffers the request reuses, so
//! a host that keeps one request per thread allocates nothing per selection (a session
//! context is the exception: it is carried into the decision as owned strings).

use std::os::raw::c_char;
use std::time::Duration;

use kvr::cost::CostOverrides;
use kvr::reservation::{BookingRequest, FreeOutcome, FreedBy};
use kvr::select::{Decision, Outcome, Prompt, SelectRequest, SessionContext, SessionRoute};
use kvr::{RankId, WorkerId};

use crate::handles::{engine_status, kvr_engine, kvr_partition};
use crate::hint::kvr_kv_hint;
use crate::status::*;

/// A selection request (opaque; reuse it: `kvr_request_reset` between requests).
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct kvr_request {
    tokens: (*const u32, usize),
    hashes: Option<((*const u64, usize), u64)>,
    lora: String,
    /// The allow-set's buffer, and whether an allow-set is set.
    allowed: Vec<WorkerId>,
    allowed_set: bool,
    pinned: Option<WorkerId>,
    session: Option<SessionContext>,
    legacy_session: Option<String>,
    overrides: CostOverrides,
    expected_output_tokens: u64,
    selection_id: Option<u64>,
    ttl: Option<Duration>,
}

// SAFETY: the raw prompt pointers are only read, during calls whose contract requires
// the caller to keep them valid; the request holds no thread-affine state.
unsafe impl Send for kvr_request {}
// SAFETY: as above; `const kvr_request *` calls only read the request.
unsafe impl Sync for kvr_request {}

impl kvr_request {
    fn new() -> Self {
        kvr_request {
            tokens: (std::ptr::null(), 0),
            hashes: None,
            lora: String::new(),
            allowed: Vec::new(),
            allowed_set: false,
            pinned: None,
            session: None,
            legacy_session: None,
            overrides: CostOverrides::NONE,
            expected_output_tokens: 0,
            selection_id: None,
            ttl: None,
        }
    }

    fn reset(&mut self) {
        self.tokens = (std::ptr::null(), 0);
        self.hashes = None;
        self.lora.clear();
        self.allowed.clear();
        self.allowed_set = false;
        self.pinned = None;
        self.session = None;
        self.legacy_session = None;
        self.overrides = CostOverrides::NONE;
        self.expected_output_tokens = 0;
        self.selection_id = None;
        self.ttl = None;
    }

    /// The engine's view of this request, borrowing the prompt array.
    ///
    /// # Safety
    /// The prompt array set on the request is valid for `'a` (the caller's contract).
    #[inline(always)]
    unsafe fn view(&self) -> Result<SelectRequest<'_>, kvr_status> {
        let prompt = match self.hashes {
            Some(((p, n), prompt_tokens)) => Prompt::LocalHashes {
                // SAFETY: forwarded caller contract; checked when set.
                hashes: unsafe { slice(p, n) }?,
                prompt_tokens,
            },
            // SAFETY: forwarded caller contract; checked when set.
            None => Prompt::Tokens(unsafe { slice(self.tokens.0, self.tokens.1) }?),
        };
        let mut r = match prompt {
            Prompt::Tokens(t) => SelectRequest::tokens(t),
            Prompt::LocalHashes {
                hashes,
                prompt_tokens,
            } => SelectRequest::local_hashes(hashes, prompt_tokens),
        };
        r.lora_name = (!self.lora.is_empty()).then_some(self.lora.as_str());
        r.allowed_workers = self.allowed_set.then_some(self.allowed.as_slice());
        r.pinned_worker = self.pinned;
        r.session = self.session.clone();
        r.legacy_session_id = self.legacy_session.as_deref();
        r.overrides = self.overrides;
        r.expected_output_tokens = self.expected_output_tokens;
        r.selection_id = self.selection_id;
        r.ttl = self.ttl;
        Ok(r)
    }
}

/// A new, empty request (an empty prompt). Free with `kvr_request_free`.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_new(out: *mut *mut kvr_request) -> kvr_status {
    // SAFETY: forwarded caller contract.
    guard(|| unsafe { give(out, kvr_request::new()) })
}

/// Frees a request; NULL is a no-op.
///
/// # Safety
/// `req` is NULL or from `kvr_request_new`, not freed before, not in use by a call.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_free(req: *mut kvr_request) {
    // SAFETY: forwarded caller contract.
    guard_void(|| unsafe { take_back(req) })
}

/// Runs a setter on a request the caller holds exclusively.
///
/// # Safety
/// `req` is NULL or live and not shared during the call.
unsafe fn with_request(
    req: *mut kvr_request,
    f: impl FnOnce(&mut kvr_request) -> Ret,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        f(unsafe { handle_mut(req) }?)
    })
}

/// Clears every field (keeping the request's buffers for reuse).
///
/// # Safety
/// `req` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_reset(req: *mut kvr_request) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            r.reset();
            Ok(())
        })
    }
}

/// The prompt as `n` token ids (kvr hashes them with the partition's salt and the
/// request's LoRA). Borrowed, not copied: see the module rules.
///
/// # Safety
/// `req` is NULL or live and not shared; `tokens` points to `n` values that stay valid as
/// the module documentation says.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_tokens(
    req: *mut kvr_request,
    tokens: *const u32,
    n: usize,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            slice(tokens, n)?;
            r.tokens = (tokens, n);
            r.hashes = None;
            Ok(())
        })
    }
}

/// The prompt as `n` local block hashes (from `kvr_partition_hash_tokens` or the host's
/// own Dynamo-compatible hashing) and its length in tokens. Borrowed, not copied.
///
/// # Safety
/// As `kvr_request_set_tokens`.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_local_hashes(
    req: *mut kvr_request,
    hashes: *const u64,
    n: usize,
    prompt_tokens: u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            slice(hashes, n)?;
            r.hashes = Some(((hashes, n), prompt_tokens));
            r.tokens = (std::ptr::null(), 0);
            Ok(())
        })
    }
}

/// The LoRA adapter (copied; `(NULL, 0)` = none): salts the hashes and narrows the
/// candidates to workers serving it (never to nothing: an empty narrowing is ignored).
///
/// # Safety
/// `req` is NULL or live and not shared; `name` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_lora(
    req: *mut kvr_request,
    name: *const c_char,
    len: usize,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            let name = str_arg(name, len)?;
            r.lora.clear();
            r.lora.push_str(name);
            Ok(())
        })
    }
}

/// The caller's allow-set of workers (copied). `(NULL, 0)` means "no worker allowed" (the
/// selection answers `KVR_NO_WORKER`); to allow every worker, do not set it (or reset).
///
/// # Safety
/// `req` is NULL or live and not shared; `workers` points to `n` values.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_allowed_workers(
    req: *mut kvr_request,
    workers: *const u64,
    n: usize,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            let w = slice(workers, n)?;
            r.allowed.clear();
            r.allowed.extend_from_slice(w);
            r.allowed_set = true;
            Ok(())
        })
    }
}

/// Routes to `worker_id` if it is allowed (LoRA narrowing never removes an allowed pin).
///
/// # Safety
/// `req` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_pinned_worker(
    req: *mut kvr_request,
    worker_id: u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            r.pinned = Some(worker_id);
            Ok(())
        })
    }
}

/// The structured session context (all copied; `session_id` must not be empty; a
/// `(NULL, 0)` parent or trigger = none). It takes precedence over a legacy session id.
///
/// # Safety
/// `req` is NULL or live and not shared; the strings point to their lengths in bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_session(
    req: *mut kvr_request,
    session_id: *const c_char,
    session_id_len: usize,
    parent_session_id: *const c_char,
    parent_session_id_len: usize,
    session_final: u32,
    input_trigger: *const c_char,
    input_trigger_len: usize,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            let id = str_arg(session_id, session_id_len)?;
            let parent = str_arg(parent_session_id, parent_session_id_len)?;
            let trigger = str_arg(input_trigger, input_trigger_len)?;
            if id.is_empty() {
                return Err(KVR_ERR_INVALID_ARGUMENT);
            }
            r.session = Some(SessionContext {
                session_id: id.to_owned(),
                parent_session_id: (!parent.is_empty()).then(|| parent.to_owned()),
                session_final: session_final != 0,
                input_trigger: (!trigger.is_empty()).then(|| trigger.to_owned()),
            });
            Ok(())
        })
    }
}

/// A legacy flat session id (copied; `(NULL, 0)` = none), used only without a structured
/// session context.
///
/// # Safety
/// `req` is NULL or live and not shared; `id` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_legacy_session_id(
    req: *mut kvr_request,
    id: *const c_char,
    len: usize,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            let id = str_arg(id, len)?;
            r.legacy_session = (!id.is_empty()).then(|| id.to_owned());
            Ok(())
        })
    }
}

/// Per-request cost overrides (Dynamo's four): pass NaN to keep the partition's value.
/// Infinite values are refused.
///
/// # Safety
/// `req` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_overrides(
    req: *mut kvr_request,
    overlap_score_credit: f64,
    prefill_load_scale: f64,
    temperature: f64,
    shared_cache_multiplier: f64,
) -> kvr_status {
    let opt = |v: f64| -> Result<Option<f64>, kvr_status> {
        if v.is_nan() {
            Ok(None)
        } else if v.is_infinite() {
            Err(KVR_ERR_INVALID_ARGUMENT)
        } else {
            Ok(Some(v))
        }
    };
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            r.overrides = CostOverrides {
                overlap_score_credit: opt(overlap_score_credit)?,
                prefill_load_scale: opt(prefill_load_scale)?,
                temperature: opt(temperature)?,
                shared_cache_multiplier: opt(shared_cache_multiplier)?,
            };
            Ok(())
        })
    }
}

/// Output tokens the request is expected to produce, recorded on the booking (as
/// Dynamo, decode load grows as output is reported: `kvr_engine_add_output_blocks`).
///
/// # Safety
/// `req` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_expected_output_tokens(
    req: *mut kvr_request,
    tokens: u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            r.expected_output_tokens = tokens;
            Ok(())
        })
    }
}

/// Booked modes: the caller's own selection id (0 = let the engine mint one). A live or
/// recently freed id is refused with `KVR_ERR_DUPLICATE_SELECTION_ID` at booking time.
///
/// # Safety
/// `req` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_selection_id(
    req: *mut kvr_request,
    id: u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            r.selection_id = (id != 0).then_some(id);
            Ok(())
        })
    }
}

/// Booked modes: the booking's lifetime in milliseconds (0 = the partition's default).
///
/// # Safety
/// `req` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_ttl_ms(req: *mut kvr_request, ttl_ms: u64) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            r.ttl = (ttl_ms != 0).then(|| Duration::from_millis(ttl_ms));
            Ok(())
        })
    }
}

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
    /// The chosen rank's cost (block equivalents; NaN for explicit reservations).
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
    f: impl FnOnce(&kvr_partition, &SelectRequest<'_>) -> Result<Outcome, kvr::engine::EngineError>,
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
                    // SAFETY: non-NULL; writable by the caller's contract.
                    unsafe { hint.write(kvr_kv_hint::of(h)) };
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

/// Advisory selection (DESIGN.md §7): the rank kvr would choose and the load it would
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
            p.engine.select_in(&p.partition, r)
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
            p.engine.select_and_reserve_in(&p.partition, r)
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
            .reserve_in(
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
    /// Lifetime in milliseconds (0 = the partition's default).
    pub ttl_ms: u64,
}

/// Installs a replica peer's booking. It is not in the selection-id index: lifecycle
/// calls find it by scanning the partitions (DESIGN.md §8).
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
            .install_replica_booking_in(&p.partition, req)
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

/// The request produced `n` more output blocks (decode load).
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
