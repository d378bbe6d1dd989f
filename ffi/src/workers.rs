//! Workers (their metadata, built with an opaque builder) and the load hosts report.

use std::os::raw::c_char;

use kvr::RankId;
use kvr::RankLoad;
use kvr::{BackendRole, WorkerInfo};

use crate::handles::kvr_partition;
use crate::status::*;

/// Prefill and decode on the same worker (the default).
pub const KVR_ROLE_AGGREGATED: u32 = 0;
/// A prefill worker of a disaggregated deployment.
pub const KVR_ROLE_PREFILL: u32 = 1;
/// A decode worker of a disaggregated deployment.
pub const KVR_ROLE_DECODE: u32 = 2;

/// A worker's metadata under construction (opaque; `kvr_worker_new`, setters, then
/// `kvr_partition_upsert_worker`, which copies it).
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct kvr_worker {
    info: WorkerInfo,
}

/// Load figures a host reports for one rank (0 = unknown for every figure).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvr_rank_load {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Requests queued, not yet scheduled.
    pub waiting_requests: u32,
    /// Requests being prefilled or decoded.
    pub running_requests: u32,
    /// Must be 0.
    pub reserved: u32,
    /// Device KV blocks in use.
    pub kv_blocks_used: u64,
    /// Device KV blocks in total.
    pub kv_blocks_total: u64,
    /// Prefill tokens scheduled but not yet computed.
    pub pending_prefill_tokens: u64,
}

/// Most data-parallel ranks of one worker (`kvr_worker_new` refuses more).
pub const KVR_MAX_DP_SIZE: u32 = 4096;

/// The most blocks one rank's index map is sized for ahead (`kvr_worker_set_total_kv_blocks`).
pub const KVR_MAX_RESERVED_BLOCKS: u64 = 1 << 20;
/// The most blocks all of one partition's ranks are sized for ahead together.
pub const KVR_MAX_RESERVED_BLOCKS_PER_PARTITION: u64 = 8 << 20;

const _: () = assert!(KVR_MAX_RESERVED_BLOCKS == kvr::MAX_RESERVED_BLOCKS);
const _: () = assert!(KVR_MAX_RESERVED_BLOCKS_PER_PARTITION == kvr::MAX_RESERVED_BLOCKS_PER_INDEX);

const _: () = assert!(KVR_MAX_DP_SIZE == kvr::MAX_DP_SIZE);

/// Longest control endpoint a worker may register, in bytes (a DNS name is at most 253,
/// plus scheme, port and path).
pub const KVR_CONTROL_ENDPOINT_MAX_LEN: usize = 511;
const _: () = assert!(KVR_CONTROL_ENDPOINT_MAX_LEN == kvr::MAX_CONTROL_ENDPOINT_LEN);

/// A new worker `worker_id` with `dp_size` data-parallel ranks (1 to `KVR_MAX_DP_SIZE`,
/// else `KVR_ERR_INVALID_ARGUMENT`, before anything is allocated), role aggregated,
/// nothing else set. Free with `kvr_worker_free`.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_worker_new(
    worker_id: u64,
    dp_size: u32,
    out: *mut *mut kvr_worker,
) -> kvr_status {
    guard(|| {
        // Bounded before the per-rank allocation below.
        if dp_size == 0 || dp_size > KVR_MAX_DP_SIZE {
            return Err(KVR_ERR_INVALID_ARGUMENT);
        }
        let mut info = WorkerInfo::new(worker_id, dp_size);
        info.control_endpoints = vec![None; dp_size as usize];
        // SAFETY: forwarded caller contract.
        unsafe { give(out, kvr_worker { info }) }
    })
}

/// Frees a worker builder; NULL is a no-op.
///
/// # Safety
/// `worker` is NULL or from `kvr_worker_new`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn kvr_worker_free(worker: *mut kvr_worker) {
    // SAFETY: forwarded caller contract.
    guard_void(|| unsafe { take_back(worker) })
}

/// Runs `f` on a worker builder the caller holds exclusively.
///
/// # Safety
/// `worker` is NULL or live and not shared during the call.
unsafe fn with_worker(
    worker: *mut kvr_worker,
    f: impl FnOnce(&mut WorkerInfo) -> Ret,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let w = unsafe { handle_mut(worker) }?;
        f(&mut w.info)
    })
}

/// The worker's role: `KVR_ROLE_AGGREGATED`, `KVR_ROLE_PREFILL` or `KVR_ROLE_DECODE`.
///
/// # Safety
/// `worker` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_worker_set_role(worker: *mut kvr_worker, role: u32) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_worker(worker, |w| {
            w.role = match role {
                KVR_ROLE_AGGREGATED => BackendRole::Aggregated,
                KVR_ROLE_PREFILL => BackendRole::Prefill,
                KVR_ROLE_DECODE => BackendRole::Decode,
                _ => return Err(KVR_ERR_INVALID_ARGUMENT),
            };
            Ok(())
        })
    }
}

/// The endpoint a peer uses to pull KV blocks from rank `dp_rank` (< dp size), copied;
/// `(NULL, 0)` clears it. At most `KVR_CONTROL_ENDPOINT_MAX_LEN` bytes (it travels inline
/// in `kvr_kv_hint`).
///
/// # Safety
/// `worker` is NULL or live and not shared; `endpoint` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_worker_set_control_endpoint(
    worker: *mut kvr_worker,
    dp_rank: u32,
    endpoint: *const c_char,
    len: usize,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_worker(worker, |w| {
            let ep = str_arg(endpoint, len)?;
            if ep.len() > KVR_CONTROL_ENDPOINT_MAX_LEN {
                return Err(KVR_ERR_INVALID_ARGUMENT);
            }
            let slot = w
                .control_endpoints
                .get_mut(dp_rank as usize)
                .ok_or(KVR_ERR_INVALID_ARGUMENT)?;
            *slot = (!ep.is_empty()).then(|| ep.to_owned());
            Ok(())
        })
    }
}

/// Device KV blocks per rank (0 = unknown). It also sizes each rank's index map ahead, at
/// the rank's first stored block: for at most `KVR_MAX_RESERVED_BLOCKS` blocks per rank
/// (about 13 MiB) and `KVR_MAX_RESERVED_BLOCKS_PER_PARTITION` for all of the partition's
/// ranks together (about 105 MiB); ranks past that budget grow their maps as they fill.
///
/// # Safety
/// `worker` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_worker_set_total_kv_blocks(
    worker: *mut kvr_worker,
    blocks: u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_worker(worker, |w| {
            w.total_kv_blocks = blocks;
            Ok(())
        })
    }
}

/// Largest prefill batch per rank in tokens (0 = unknown).
///
/// # Safety
/// `worker` is NULL or live and not shared during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_worker_set_max_batched_tokens(
    worker: *mut kvr_worker,
    tokens: u64,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_worker(worker, |w| {
            w.max_batched_tokens = tokens;
            Ok(())
        })
    }
}

/// Adds a LoRA adapter the worker serves (copied; empty names are refused).
///
/// # Safety
/// `worker` is NULL or live and not shared; `name` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_worker_add_lora_adapter(
    worker: *mut kvr_worker,
    name: *const c_char,
    len: usize,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_worker(worker, |w| {
            let name = str_arg(name, len)?;
            if name.is_empty() {
                return Err(KVR_ERR_INVALID_ARGUMENT);
            }
            if !w.lora_adapters.iter().any(|a| a == name) {
                w.lora_adapters.push(name.to_owned());
            }
            Ok(())
        })
    }
}

/// Sets label `key` = `value` (both copied; a later value for the same key wins).
///
/// # Safety
/// `worker` is NULL or live and not shared; the strings point to their lengths in bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_worker_set_label(
    worker: *mut kvr_worker,
    key: *const c_char,
    key_len: usize,
    value: *const c_char,
    value_len: usize,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        with_worker(worker, |w| {
            let (k, v) = (str_arg(key, key_len)?, str_arg(value, value_len)?);
            w.labels.insert(k.to_owned(), v.to_owned());
            Ok(())
        })
    }
}

/// Adds the worker to the partition or replaces its metadata (a copy is taken; the
/// builder stays the caller's). Selections running meanwhile see the old or the new set.
///
/// # Safety
/// `partition` and `worker` are NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_upsert_worker(
    partition: *const kvr_partition,
    worker: *const kvr_worker,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (p, w) = unsafe { (handle(partition)?, handle(worker)?) };
        // Checked as each field was set; a refusal here is a bug, reported as bad input.
        p.partition
            .upsert_worker(w.info.clone())
            .map_err(|_| KVR_ERR_INVALID_ARGUMENT)?;
        Ok(())
    })
}

/// Removes a worker: from the candidates first, then its index entries, reported load
/// and bookings. `KVR_ERR_UNKNOWN_WORKER` if it was not a member.
///
/// # Safety
/// `partition` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_remove_worker(
    partition: *const kvr_partition,
    worker_id: u64,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let p = unsafe { handle(partition) }?;
        if p.partition.remove_worker(worker_id) {
            Ok(())
        } else {
            Err(KVR_ERR_UNKNOWN_WORKER)
        }
    })
}

/// Publishes one batch of load reports: selections see all of it or none of it. Later
/// entries for the same rank win. `out_version` (may be NULL) receives the load view's
/// new version. A non-zero `reserved` field is `KVR_ERR_INVALID_ARGUMENT` (nothing
/// published). Only registered workers' own ranks are kept: entries for any other rank
/// are skipped (never stored, so made-up ranks take no memory), the rest are published,
/// and the call returns `KVR_ERR_UNKNOWN_RANK` (with `*out_version` written).
///
/// # Safety
/// `partition` is NULL or live; `loads` points to `n` entries; `out_version` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_publish_load(
    partition: *const kvr_partition,
    loads: *const kvr_rank_load,
    n: usize,
    out_version: *mut u64,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (p, loads) = unsafe { (handle(partition)?, slice(loads, n)?) };
        if loads.iter().any(|l| l.reserved != 0) {
            return Err(KVR_ERR_INVALID_ARGUMENT);
        }
        let batch: Vec<(RankId, RankLoad)> = loads
            .iter()
            .map(|l| {
                (
                    RankId::new(l.worker_id, l.dp_rank),
                    RankLoad {
                        kv_blocks_used: l.kv_blocks_used,
                        kv_blocks_total: l.kv_blocks_total,
                        waiting_requests: l.waiting_requests,
                        running_requests: l.running_requests,
                        pending_prefill_tokens: l.pending_prefill_tokens,
                    },
                )
            })
            .collect();
        let (v, skipped) = p.partition.publish_load(&batch);
        // SAFETY: forwarded caller contract.
        unsafe { write_opt(out_version, v) };
        if skipped > 0 {
            return Err(KVR_ERR_UNKNOWN_RANK);
        }
        Ok(())
    })
}
