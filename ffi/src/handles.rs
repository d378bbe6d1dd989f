//! The engine and partition handles and their option structs.
//!
//! Ownership: every `*_new`/`create`/`get` that hands out a pointer transfers ownership of
//! that handle to the caller, who releases it with the matching `*_free` (NULL is a
//! no-op). A partition handle keeps its engine alive: freeing the engine handle first is
//! allowed, the engine goes away with its last handle.
//!
//! Threads: a function taking a `const` handle may be called on the same handle from
//! any number of threads at once; one taking a non-`const` handle needs it exclusively.

use std::sync::Arc;
use std::time::Duration;

use kvr::config::PartitionConfig;
use kvr::ReservationError;
use kvr::{Engine, EngineError};
use kvr::{Partition, PartitionKey};

use crate::kept::{KeptState, StateOption};
use crate::status::*;

/// The selection engine: partitions, and the selection-id index of their bookings.
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct kvr_engine {
    pub(crate) engine: Arc<Engine>,
}

/// One partition `(model, routing group)` of an engine: its index, workers, load view,
/// bookings and hooks.
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct kvr_partition {
    /// The partition's state on disk, shared by its handles (closed with the last).
    /// Declared first so that it is dropped first: its final snapshot needs the partition,
    /// which this handle may be the last to hold (the engine freed before it).
    pub(crate) state: Option<Arc<KeptState>>,
    pub(crate) engine: Arc<Engine>,
    pub(crate) partition: Arc<Partition>,
}

/// Engine options (opaque; set with `kvr_engine_options_set_*`).
#[allow(non_camel_case_types)]
#[derive(Debug, Default)]
pub struct kvr_engine_options {
    seed: Option<u64>,
}

/// Partition options (opaque; created with a block size, set with
/// `kvr_partition_options_set_*`). Unset values are the defaults: the latency cost model
/// (`KVR_COST_MODEL_LATENCY`) with its default knobs, and Dynamo's weights.
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct kvr_partition_options {
    pub(crate) config: PartitionConfig,
    /// `kvr_partition_options_set_state_dir`.
    pub(crate) state: Option<StateOption>,
}

/// The status of an engine refusal.
pub(crate) fn engine_status(e: &EngineError) -> kvr_status {
    match e {
        EngineError::UnknownPartition(_) => KVR_ERR_UNKNOWN_PARTITION,
        EngineError::PartitionExists(_) => KVR_ERR_PARTITION_EXISTS,
        EngineError::UnknownSelectionId(_) => KVR_ERR_UNKNOWN_SELECTION_ID,
        EngineError::DuplicateSelectionId(_) => KVR_ERR_DUPLICATE_SELECTION_ID,
        EngineError::UnknownRank(_) => KVR_ERR_UNKNOWN_RANK,
        EngineError::Reservation(r) => match r {
            ReservationError::DuplicateSelectionId(_) => KVR_ERR_DUPLICATE_SELECTION_ID,
            ReservationError::UnknownSelectionId(_) => KVR_ERR_UNKNOWN_SELECTION_ID,
            ReservationError::AlreadyFreed(..) => KVR_ERR_ALREADY_FREED,
            ReservationError::TooLarge(..) => KVR_ERR_TOO_LARGE,
            // A refusal this ABI version has no code for (the engine's errors are
            // `#[non_exhaustive]`): reported as bad input, never as success.
            _ => KVR_ERR_INVALID_ARGUMENT,
        },
        EngineError::InvalidConfig(_) => KVR_ERR_INVALID_CONFIG,
        _ => KVR_ERR_INVALID_ARGUMENT,
    }
}

// ---------------------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------------------

/// New engine options with every value at its default. Free with
/// `kvr_engine_options_free`.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_options_new(out: *mut *mut kvr_engine_options) -> kvr_status {
    // SAFETY: `out` is checked by `give`; the caller guarantees it is writable.
    guard(|| unsafe { give(out, kvr_engine_options::default()) })
}

/// Frees engine options; NULL is a no-op.
///
/// # Safety
/// `opts` is NULL or from `kvr_engine_options_new`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_options_free(opts: *mut kvr_engine_options) {
    // SAFETY: forwarded caller contract.
    guard_void(|| unsafe { take_back(opts) })
}

/// Seeds the engine's random tie-breaks (default: from the clock), for reproducible runs.
///
/// # Safety
/// `opts` is NULL or a live options handle not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_options_set_seed(
    opts: *mut kvr_engine_options,
    seed: u64,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        unsafe { handle_mut(opts) }?.seed = Some(seed);
        Ok(())
    })
}

/// Creates an engine. `opts` may be NULL (defaults); it is only read, and may be freed
/// after the call. Constructing an engine starts no thread.
///
/// # Safety
/// `opts` is NULL or a live options handle; `out` is a writable pointer.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_new(
    opts: *const kvr_engine_options,
    out: *mut *mut kvr_engine,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract (NULL allowed).
        let seed = unsafe { opts.as_ref() }.and_then(|o| o.seed);
        let engine = match seed {
            Some(s) => Engine::with_seed(s),
            None => Engine::new(),
        };
        // SAFETY: forwarded caller contract.
        unsafe {
            give(
                out,
                kvr_engine {
                    engine: Arc::new(engine),
                },
            )
        }
    })
}

/// Releases the engine handle; NULL is a no-op. Partition handles still held keep the
/// engine alive until they are freed too.
///
/// # Safety
/// `engine` is NULL or from `kvr_engine_new`, not freed before, and no other thread is
/// using this handle.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_free(engine: *mut kvr_engine) {
    // SAFETY: forwarded caller contract.
    guard_void(|| unsafe { take_back(engine) })
}

/// A fresh engine-unique selection id (never 0).
///
/// # Safety
/// `engine` is NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_mint_selection_id(
    engine: *const kvr_engine,
    out: *mut u64,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let e = unsafe { handle(engine) }?;
        // SAFETY: forwarded caller contract.
        unsafe { write_out(out, e.engine.mint_selection_id()) }
    })
}

// ---------------------------------------------------------------------------------------
// Partition options
// ---------------------------------------------------------------------------------------

/// New partition options for blocks of `block_size` tokens (must be ≥ 1; engines use
/// 16 to 64). Free with `kvr_partition_options_free`.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_new(
    block_size: u32,
    out: *mut *mut kvr_partition_options,
) -> kvr_status {
    guard(|| {
        if block_size == 0 {
            return Err(KVR_ERR_INVALID_ARGUMENT);
        }
        let opts = kvr_partition_options {
            config: PartitionConfig::new(block_size),
            state: None,
        };
        // SAFETY: forwarded caller contract.
        unsafe { give(out, opts) }
    })
}

/// Frees partition options; NULL is a no-op.
///
/// # Safety
/// `opts` is NULL or from `kvr_partition_options_new`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_free(opts: *mut kvr_partition_options) {
    // SAFETY: forwarded caller contract.
    guard_void(|| unsafe { take_back(opts) })
}

/// Salts every block hash of the partition with a cache namespace (`(NULL, 0)` = none).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call; `ns` points to `ns_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_cache_namespace(
    opts: *mut kvr_partition_options,
    ns: *const std::os::raw::c_char,
    ns_len: usize,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let o = unsafe { handle_mut(opts) }?;
        // SAFETY: forwarded caller contract.
        let ns = unsafe { str_arg(ns, ns_len) }?;
        o.config.cache_namespace = (!ns.is_empty()).then(|| ns.to_owned());
        Ok(())
    })
}

/// Lifetime of a booking nobody frees, in milliseconds (default 3,600,000; must be ≥ 1).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_booking_ttl_ms(
    opts: *mut kvr_partition_options,
    ttl_ms: u64,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let o = unsafe { handle_mut(opts) }?;
        if ttl_ms == 0 {
            return Err(KVR_ERR_INVALID_ARGUMENT);
        }
        o.config.booking_ttl = Duration::from_millis(ttl_ms);
        Ok(())
    })
}

/// Whether selection credits a stale rank's overlap (a stream with a known loss being
/// replayed, or degraded or dead: `kvr_stream_stats.stale_since_unix_ms`, `health`);
/// default 0: a stale rank's overlap counts as none until the stream's repair is in the
/// index.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_trust_stale_overlap(
    opts: *mut kvr_partition_options,
    on: u32,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let o = unsafe { handle_mut(opts) }?;
        o.config.trust_stale_overlap = on != 0;
        Ok(())
    })
}

/// Sets one cost knob or busy threshold if `valid(value)` (else
/// `KVR_ERR_INVALID_ARGUMENT`, nothing changed; a NULL handle is `KVR_ERR_NULL` first).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
unsafe fn set_checked(
    opts: *mut kvr_partition_options,
    value: f64,
    valid: impl FnOnce(f64) -> bool,
    set: impl FnOnce(&mut PartitionConfig, f64),
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let o = unsafe { handle_mut(opts) }?;
        if !valid(value) {
            return Err(KVR_ERR_INVALID_ARGUMENT);
        }
        set(&mut o.config, value);
        Ok(())
    })
}

/// Sets one cost knob; NaN or infinity is refused.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
unsafe fn set_f64(
    opts: *mut kvr_partition_options,
    value: f64,
    set: impl FnOnce(&mut PartitionConfig, f64),
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_checked(opts, value, f64::is_finite, set) }
}

/// Sets a busy fraction; NaN, infinity and negative values (which would make every rank
/// busy, every selection `KVR_BUSY`) are refused.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
unsafe fn set_fraction(
    opts: *mut kvr_partition_options,
    value: f64,
    set: impl FnOnce(&mut PartitionConfig, f64),
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_checked(opts, value, |v| v.is_finite() && v >= 0.0, set) }
}

/// Credit per device-cached block (Dynamo `overlap_score_credit`, default 1.0).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_overlap_score_credit(
    opts: *mut kvr_partition_options,
    value: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_f64(opts, value, |c, v| c.cost.overlap_score_credit = v) }
}

/// Multiplier of the prefill term (Dynamo `prefill_load_scale`, default 1.0).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_prefill_load_scale(
    opts: *mut kvr_partition_options,
    value: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_f64(opts, value, |c, v| c.cost.prefill_load_scale = v) }
}

/// Credit per block cached in host memory (default 0.75).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_host_cache_hit_weight(
    opts: *mut kvr_partition_options,
    value: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_f64(opts, value, |c, v| c.cost.host_cache_hit_weight = v) }
}

/// Credit per block cached on disk (default 0.25).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_disk_cache_hit_weight(
    opts: *mut kvr_partition_options,
    value: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_f64(opts, value, |c, v| c.cost.disk_cache_hit_weight = v) }
}

/// Credit per block of the host's shared cache beyond the device prefix (default 0).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_shared_cache_multiplier(
    opts: *mut kvr_partition_options,
    value: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_f64(opts, value, |c, v| c.cost.shared_cache_multiplier = v) }
}

/// Selection temperature: 0 = lowest cost (default), > 0 = softmax over normalised
/// costs.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_temperature(
    opts: *mut kvr_partition_options,
    value: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_f64(opts, value, |c, v| c.cost.temperature = v) }
}

/// Block equivalents charged per active request of a rank (default 0 = off).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_decode_active_request_weight(
    opts: *mut kvr_partition_options,
    value: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_f64(opts, value, |c, v| c.cost.decode_active_request_weight = v) }
}

/// Load-dependent decay of the device credit (default off; ≤ 0 = off).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_credit_decay(
    opts: *mut kvr_partition_options,
    value: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_f64(opts, value, |c, v| c.cost.credit_decay = Some(v)) }
}

/// Busy when a rank's decode blocks exceed this fraction of its total KV blocks (≥ 0;
/// negative, NaN or infinite: `KVR_ERR_INVALID_ARGUMENT`).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_busy_decode_blocks_fraction(
    opts: *mut kvr_partition_options,
    value: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_fraction(opts, value, |c, v| c.busy.decode_blocks_fraction = Some(v)) }
}

/// Busy when a rank's active prefill tokens exceed this fraction of its max batched
/// tokens (≥ 0; negative, NaN or infinite: `KVR_ERR_INVALID_ARGUMENT`).
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_busy_prefill_tokens_fraction(
    opts: *mut kvr_partition_options,
    value: f64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe { set_fraction(opts, value, |c, v| c.busy.prefill_tokens_fraction = Some(v)) }
}

/// Busy when a rank's active prefill tokens exceed this many.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_busy_prefill_tokens(
    opts: *mut kvr_partition_options,
    tokens: u64,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        unsafe { handle_mut(opts) }?.config.busy.prefill_tokens = Some(tokens);
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------
// Partitions
// ---------------------------------------------------------------------------------------

/// A partition key from C strings.
///
/// # Safety
/// As [`str_arg`] for both strings.
unsafe fn key(
    model: *const std::os::raw::c_char,
    model_len: usize,
    group: *const std::os::raw::c_char,
    group_len: usize,
) -> Result<PartitionKey, kvr_status> {
    // SAFETY: forwarded caller contract.
    let (m, g) = unsafe { (str_arg(model, model_len)?, str_arg(group, group_len)?) };
    Ok(PartitionKey::new(m, g))
}

/// Creates partition `(model, group)` and hands out a handle to it. `opts` is only read
/// (NULL is not allowed: the block size has no default). Fails with
/// `KVR_ERR_PARTITION_EXISTS` if it exists, and with `KVR_ERR_INVALID_CONFIG` if the
/// options contradict each other (`kvr_partition_options_check` says why). With a state
/// directory (`kvr_partition_options_set_state_dir`) the new partition is restored from it
/// before this returns, or fails with `KVR_ERR_IO` and is not created.
///
/// # Safety
/// `engine` and `opts` are NULL or live; the strings point to their lengths in bytes;
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_create_partition(
    engine: *const kvr_engine,
    model: *const std::os::raw::c_char,
    model_len: usize,
    group: *const std::os::raw::c_char,
    group_len: usize,
    opts: *const kvr_partition_options,
    out: *mut *mut kvr_partition,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract (all arguments).
        let (e, o) = unsafe { (handle(engine)?, handle(opts)?) };
        if out.is_null() {
            return Err(KVR_ERR_NULL);
        }
        // SAFETY: forwarded caller contract.
        let k = unsafe { key(model, model_len, group, group_len) }?;
        // A remote URL gets its HTTP client here: the engine builds none. If it cannot
        // (the policy or the URL is refused), the options go as they are and the engine
        // refuses them itself, after its own checks (`KVR_ERR_PARTITION_EXISTS` first).
        let mut config = o.config.clone();
        if let Ok(indexer) = kvr_remote::with_http_client(&config.indexer) {
            config.indexer = indexer;
        }
        // The state's directory and I/O are checked first: nothing is created without them.
        let prepared = o.state.as_ref().map(StateOption::prepare).transpose()?;
        if prepared.is_some() {
            // Snapshots are the index's dump, which needs each block's lineage.
            config.index_dump = true;
        }
        let p = e
            .engine
            .create_partition(k.clone(), config)
            .map_err(|err| engine_status(&err))?;
        let state = match prepared.map(|pr| pr.keep(&p)).transpose() {
            Ok(s) => s,
            Err(status) => {
                e.engine.remove_partition(&k);
                return Err(status);
            }
        };
        let h = kvr_partition {
            engine: e.engine.clone(),
            partition: p,
            state,
        };
        // SAFETY: forwarded caller contract.
        unsafe { give(out, h) }
    })
}

/// A new handle to existing partition `(model, group)`, or `KVR_ERR_UNKNOWN_PARTITION`.
///
/// # Safety
/// As `kvr_engine_create_partition`.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_get_partition(
    engine: *const kvr_engine,
    model: *const std::os::raw::c_char,
    model_len: usize,
    group: *const std::os::raw::c_char,
    group_len: usize,
    out: *mut *mut kvr_partition,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let e = unsafe { handle(engine) }?;
        if out.is_null() {
            return Err(KVR_ERR_NULL);
        }
        // SAFETY: forwarded caller contract.
        let k = unsafe { key(model, model_len, group, group_len) }?;
        let p = e.engine.partition(&k).map_err(|err| engine_status(&err))?;
        let h = kvr_partition {
            engine: e.engine.clone(),
            state: crate::kept::kept_of(&p),
            partition: p,
        };
        // SAFETY: forwarded caller contract.
        unsafe { give(out, h) }
    })
}

/// Removes partition `(model, group)` from the engine. Handles to it stay valid to free
/// and to read, but selections and bookings through them fail with
/// `KVR_ERR_UNKNOWN_PARTITION`.
///
/// # Safety
/// As `kvr_engine_get_partition`.
#[no_mangle]
pub unsafe extern "C" fn kvr_engine_remove_partition(
    engine: *const kvr_engine,
    model: *const std::os::raw::c_char,
    model_len: usize,
    group: *const std::os::raw::c_char,
    group_len: usize,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let e = unsafe { handle(engine) }?;
        // SAFETY: forwarded caller contract.
        let k = unsafe { key(model, model_len, group, group_len) }?;
        if e.engine.remove_partition(&k) {
            Ok(())
        } else {
            Err(KVR_ERR_UNKNOWN_PARTITION)
        }
    })
}

/// Releases a partition handle (not the partition); NULL is a no-op. Freeing the last
/// handle of a partition with a state directory closes its state (a final snapshot).
///
/// # Safety
/// `partition` is NULL or a handle from this library, not freed before, and no other
/// thread is using it.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_free(partition: *mut kvr_partition) {
    // SAFETY: forwarded caller contract.
    guard_void(|| unsafe { take_back(partition) })
}

/// The partition's block size in tokens.
///
/// # Safety
/// `partition` is NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_block_size(
    partition: *const kvr_partition,
    out: *mut u32,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let p = unsafe { handle(partition) }?;
        // SAFETY: forwarded caller contract.
        unsafe { write_out(out, p.partition.block_size()) }
    })
}

/// Rust-side constructors, for Rust code that drives the C ABI over an engine it built
/// itself (the ABI-overhead benchmark); not part of the C header.
impl kvr_engine {
    pub fn from_engine(engine: Arc<Engine>) -> Self {
        kvr_engine { engine }
    }
}

impl kvr_partition {
    /// A handle to `partition` of `engine`.
    pub fn from_parts(engine: Arc<Engine>, partition: Arc<Partition>) -> Self {
        kvr_partition {
            engine,
            state: crate::kept::kept_of(&partition),
            partition,
        }
    }
}
