//! The C selection request: a reusable object naming the prompt and the caller's
//! constraints.
//!
//! A `kvr_request` borrows the token or hash array it is given (no copy of the prompt):
//! the array must stay valid and unchanged until the request is reset, given another
//! prompt, or freed, and during every selection call that uses it. Everything else
//! (LoRA name, allow-set, session context) is copied into buffers the request reuses, so
//! a host that keeps one request per thread allocates nothing per selection (a session
//! context is the exception: it is carried into the decision as owned strings).

use std::os::raw::c_char;
use std::time::Duration;

use kvr::hash::BlockExtras;
use kvr::CostOverrides;
use kvr::WorkerId;
use kvr::{Prompt, SelectRequest, SessionContext};

use crate::status::*;

/// A selection request (opaque; reuse it: `kvr_request_reset` between requests).
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct kvr_request {
    tokens: (*const u32, usize),
    hashes: Option<((*const u64, usize), u64)>,
    lora: String,
    /// A tokens prompt's extra keys (cache salt, multimodal inputs, raw block keys).
    extras: BlockExtras,
    /// The caller's buffer for a transfer hint's source block hashes (borrowed).
    hint_names: (*mut u64, usize),
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

// SAFETY: the raw prompt pointers are only read, and the hint-names buffer only written,
// during calls whose contract requires the caller to keep them valid (and the buffer used
// by one selection at a time); the request holds no thread-affine state.
unsafe impl Send for kvr_request {}
// SAFETY: as above; `const kvr_request *` calls only read the request.
unsafe impl Sync for kvr_request {}

impl kvr_request {
    fn new() -> Self {
        kvr_request {
            tokens: (std::ptr::null(), 0),
            hashes: None,
            lora: String::new(),
            extras: BlockExtras::new(),
            hint_names: (std::ptr::null_mut(), 0),
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
        self.extras.clear();
        self.hint_names = (std::ptr::null_mut(), 0);
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

    /// Writes a hint's source block hashes into the caller's buffer (as many as fit);
    /// returns how many.
    ///
    /// # Safety
    /// The buffer set on the request is valid and writable (the caller's contract).
    pub(crate) unsafe fn write_hint_names(&self, names: &[u64]) -> usize {
        // SAFETY: forwarded caller contract; checked (aligned, size) when set.
        match unsafe { slice_mut(self.hint_names.0, self.hint_names.1) } {
            Ok(buf) => {
                let n = names.len().min(buf.len());
                buf[..n].copy_from_slice(&names[..n]);
                n
            }
            Err(_) => 0,
        }
    }

    /// The engine's view of this request, borrowing the prompt array.
    ///
    /// # Safety
    /// The prompt array set on the request is valid for `'a` (the caller's contract).
    #[inline(always)]
    pub(crate) unsafe fn view(&self) -> Result<SelectRequest<'_>, kvr_status> {
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
        r.extras = (!self.extras.is_empty()).then_some(&self.extras);
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

/// Most multimodal inputs one request may carry (`kvr_request_add_mm_input`).
pub const KVR_MAX_MM_INPUTS: usize = 4096;
const _: () = assert!(KVR_MAX_MM_INPUTS == kvr::hash::MAX_MM_SPANS);
/// Most raw block keys one request may carry (`kvr_request_add_block_key`).
pub const KVR_MAX_BLOCK_KEYS: usize = 65536;
const _: () = assert!(KVR_MAX_BLOCK_KEYS == kvr::hash::MAX_BLOCK_KEYS);

/// The request's cache salt (vLLM's `cache_salt`; copied; `(NULL, 0)` or empty = none):
/// folded into block 0's hash as engines fold it (`kvr::hash`), so a tokens prompt
/// matches only blocks published under the same salt. Ignored for a hashes prompt.
///
/// # Safety
/// `req` is NULL or live and not shared; `salt` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_cache_salt(
    req: *mut kvr_request,
    salt: *const c_char,
    len: usize,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            let salt = str_arg(salt, len)?;
            r.extras.set_cache_salt(Some(salt));
            Ok(())
        })
    }
}

/// Adds a multimodal input to a tokens prompt: `identifier` (`id_len` bytes: vLLM's
/// `mm_feature.identifier`, copied as its hash) occupying prompt tokens
/// `offset..offset + length`; each block it touches hashes with it as vLLM's events do.
/// At most `KVR_MAX_MM_INPUTS` per request (`KVR_ERR_TOO_LARGE` beyond, nothing added).
///
/// # Safety
/// `req` is NULL or live and not shared; `identifier` points to `id_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_add_mm_input(
    req: *mut kvr_request,
    identifier: *const u8,
    id_len: usize,
    offset: u64,
    length: u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            let id = slice(identifier, id_len)?;
            r.extras
                .multimodal(id, offset, length)
                .map_err(|_| KVR_ERR_TOO_LARGE)?;
            Ok(())
        })
    }
}

/// Adds a raw extra-key value to block `block` of a tokens prompt (Dynamo's per-block
/// `mm_hash`, or a prompt-embeddings key). At most `KVR_MAX_BLOCK_KEYS` per request
/// (`KVR_ERR_TOO_LARGE` beyond).
///
/// # Safety
/// `req` is NULL or live and not shared.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_add_block_key(
    req: *mut kvr_request,
    block: usize,
    key: u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            r.extras
                .block_key(block, key)
                .map_err(|_| KVR_ERR_TOO_LARGE)?;
            Ok(())
        })
    }
}

/// A buffer of `cap` hashes for the transfer hint of a booked selection with this request
/// (`kvr_partition_select_and_reserve_with_hint`): the source engine's own hashes of the
/// hinted blocks are written there, as many as fit (`kvr_kv_hint.n_block_hashes` says how
/// many; `block_end - block_start` is the full count). Borrowed, not copied: it must stay
/// valid and writable, and unused by anything else, during every such selection, until the
/// request is reset or freed or given another buffer. `(NULL, 0)` = none (the default).
///
/// # Safety
/// `req` is NULL or live and not shared; `buf` points to `cap` writable `uint64_t`s.
#[no_mangle]
pub unsafe extern "C" fn kvr_request_set_hint_names_buffer(
    req: *mut kvr_request,
    buf: *mut u64,
    cap: usize,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_request(req, |r| {
            slice_mut(buf, cap)?;
            r.hint_names = (buf, cap);
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

/// Longest session id (structured, parent or legacy) a request takes, in bytes: longer
/// ones are refused when set (`KVR_ERR_INVALID_ARGUMENT`), not dropped at selection.
pub const KVR_MAX_SESSION_ID_BYTES: usize = 256;

const _: () = assert!(KVR_MAX_SESSION_ID_BYTES == kvr::config::DEFAULT_MAX_SESSION_ID_BYTES);

/// The structured session context (all copied; `session_id` must not be empty; a
/// `(NULL, 0)` parent or trigger = none; ids of at most `KVR_MAX_SESSION_ID_BYTES`). It
/// takes precedence over a legacy session id.
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
            if id.is_empty()
                || id.len() > KVR_MAX_SESSION_ID_BYTES
                || parent.len() > KVR_MAX_SESSION_ID_BYTES
            {
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

/// A legacy flat session id (copied; `(NULL, 0)` = none; at most
/// `KVR_MAX_SESSION_ID_BYTES`), used only without a structured session context.
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
            if id.len() > KVR_MAX_SESSION_ID_BYTES {
                return Err(KVR_ERR_INVALID_ARGUMENT);
            }
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
