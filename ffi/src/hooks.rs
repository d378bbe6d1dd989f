//! Host hooks as C function pointers with a `void *user_data`: the inputs a host may
//! supply to selection.
//!
//! The engine calls hooks from whichever thread is selecting, possibly from several at
//! once, with no engine lock held (a hook may call kvr again). A hook must not unwind
//! (no C++ exception may leave it). `release(user_data)`, if given, is called exactly
//! once, when the engine drops these hooks: after `kvr_partition_set_hooks` replaced them
//! and every selection still using them has finished, or when the partition goes away.

use std::os::raw::{c_char, c_void};
use std::sync::Arc;

use kvr::{BlockRange, HostHooks, PrefillQuery};
use kvr::{RankId, WorkerId};

use crate::handles::kvr_partition;
use crate::status::*;

/// A range `[start, end)` of prompt blocks.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvr_block_range {
    pub start: u32,
    pub end: u32,
}

/// Projected prefill tokens of a request on a rank: write them to `*out_tokens` and
/// return 0, or return non-zero for "no estimate" (kvr uses prompt − cached).
#[allow(non_camel_case_types)]
pub type kvr_prefill_estimate_fn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        worker_id: u64,
        dp_rank: u32,
        prompt_tokens: u64,
        cached_tokens: u64,
        out_tokens: *mut u64,
    ) -> i32,
>;

/// Non-zero = the rank is overloaded now (not chosen; all overloaded = `KVR_BUSY`).
#[allow(non_camel_case_types)]
pub type kvr_overloaded_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, worker_id: u64, dp_rank: u32) -> i32>;

/// Zero = the rank cannot take requests (not a candidate at all).
#[allow(non_camel_case_types)]
pub type kvr_available_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, worker_id: u64, dp_rank: u32) -> i32>;

/// Block ranges of the prompt (given by sequence hashes) present in the host's shared KV
/// cache: write up to `cap` ranges to `out`, their number to `*out_len`, return 0. If more
/// than `cap` exist, write the number needed to `*out_len` and return 0: kvr calls again
/// with room for them (up to 65,536 ranges; more counts as a failed lookup). Non-zero =
/// the lookup failed: counted, and the selection goes on without shared-cache hits.
#[allow(non_camel_case_types)]
pub type kvr_shared_cache_fn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        seq_hashes: *const u64,
        n: usize,
        out: *mut kvr_block_range,
        cap: usize,
        out_len: *mut usize,
    ) -> i32,
>;

/// Which of `workers` serve LoRA adapter `lora` (UTF-8, not NUL-terminated): set
/// `out_serves[i]` non-zero for each that does, return 0. Non-zero = failure: no narrowing.
#[allow(non_camel_case_types)]
pub type kvr_lora_filter_fn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        lora: *const c_char,
        lora_len: usize,
        workers: *const u64,
        n: usize,
        out_serves: *mut u8,
    ) -> i32,
>;

/// Called once with `user_data` when the engine drops the hooks.
#[allow(non_camel_case_types)]
pub type kvr_release_fn = Option<unsafe extern "C" fn(user_data: *mut c_void)>;

/// A partition's host hooks; every function pointer may be NULL (= that input as if no
/// host supplied it).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_hooks {
    pub user_data: *mut c_void,
    pub release: kvr_release_fn,
    pub prefill_estimate: kvr_prefill_estimate_fn,
    pub overloaded: kvr_overloaded_fn,
    pub available: kvr_available_fn,
    pub shared_cache: kvr_shared_cache_fn,
    pub lora_filter: kvr_lora_filter_fn,
}

/// The hooks as the engine holds them: shared by every closure, released once.
struct Held(kvr_hooks);

// SAFETY: the header's contract: hooks and user_data may be used from any thread, at once.
unsafe impl Send for Held {}
// SAFETY: as above.
unsafe impl Sync for Held {}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(release) = self.0.release {
            // SAFETY: the host gave this function for this user_data; called once, here.
            unsafe { release(self.0.user_data) };
        }
    }
}

/// Ranges a shared-cache hook is first offered room for.
const SHARED_RANGES: usize = 64;
/// At most this many ranges are accepted from one lookup (more = a failed lookup).
const MAX_SHARED_RANGES: usize = 1 << 16;

fn host_hooks(h: kvr_hooks) -> HostHooks {
    let held = Arc::new(Held(h));
    let mut hooks = HostHooks::default();
    if let Some(f) = h.prefill_estimate {
        let held = held.clone();
        hooks.prefill_estimator = Some(Arc::new(move |q: &PrefillQuery| {
            let mut out = 0u64;
            // SAFETY: the host's function with its own user_data and a valid out pointer.
            let rc = unsafe {
                f(
                    held.0.user_data,
                    q.rank.worker_id,
                    q.rank.dp_rank,
                    q.prompt_tokens,
                    q.cached_tokens,
                    &mut out,
                )
            };
            (rc == 0).then_some(out)
        }));
    }
    if let Some(f) = h.overloaded {
        let held = held.clone();
        // SAFETY: the host's function with its own user_data.
        hooks.overload = Some(Arc::new(
            move |r: RankId| unsafe { f(held.0.user_data, r.worker_id, r.dp_rank) } != 0,
        ));
    }
    if let Some(f) = h.available {
        let held = held.clone();
        // SAFETY: the host's function with its own user_data.
        hooks.availability = Some(Arc::new(
            move |r: RankId| unsafe { f(held.0.user_data, r.worker_id, r.dp_rank) } != 0,
        ));
    }
    if let Some(f) = h.shared_cache {
        let held = held.clone();
        hooks.shared_cache = Some(Arc::new(move |seq: &[u64]| {
            let mut buf = vec![kvr_block_range::default(); SHARED_RANGES];
            loop {
                let mut n = 0usize;
                // SAFETY: `seq` and `buf` are live for the call with the lengths passed.
                let rc = unsafe {
                    f(
                        held.0.user_data,
                        seq.as_ptr(),
                        seq.len(),
                        buf.as_mut_ptr(),
                        buf.len(),
                        &mut n,
                    )
                };
                if rc != 0 {
                    return Err(format!("shared-cache hook returned {rc}"));
                }
                if n <= buf.len() {
                    buf.truncate(n);
                    return Ok(buf.iter().map(|r| (r.start, r.end) as BlockRange).collect());
                }
                if n > MAX_SHARED_RANGES {
                    return Err(format!("shared-cache hook wants {n} ranges"));
                }
                buf.resize(n, kvr_block_range::default());
            }
        }));
    }
    if let Some(f) = h.lora_filter {
        let held = held.clone();
        hooks.lora_filter = Some(Arc::new(move |lora: &str, workers: &[WorkerId]| {
            let mut serves = vec![0u8; workers.len()];
            // SAFETY: every pointer is live for the call with the length passed.
            let rc = unsafe {
                f(
                    held.0.user_data,
                    lora.as_ptr().cast(),
                    lora.len(),
                    workers.as_ptr(),
                    workers.len(),
                    serves.as_mut_ptr(),
                )
            };
            if rc != 0 {
                // No narrowing: an empty answer falls back to the caller's set.
                return Vec::new();
            }
            workers
                .iter()
                .zip(&serves)
                .filter(|(_, s)| **s != 0)
                .map(|(w, _)| *w)
                .collect()
        }));
    }
    drop(held);
    hooks
}

/// Replaces the partition's host hooks (`hooks` NULL = remove them all). The struct is
/// copied; `user_data` must stay valid until `release` is called (or, without `release`,
/// until the hooks are replaced and the partition is gone). Selections already running
/// finish with the hooks they started with.
///
/// `release` is called exactly once per accepted `kvr_hooks`: when no selection can use
/// them any more. With no hook function set that is at once, before this returns. If the
/// call fails with `KVR_ERR_NULL` it was not accepted (no release); after `KVR_ERR_PANIC`
/// it has been released.
///
/// # Safety
/// `partition` is NULL or live; `hooks` is NULL or readable, its functions callable from
/// any thread with its `user_data`.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_set_hooks(
    partition: *const kvr_partition,
    hooks: *const kvr_hooks,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let p = unsafe { handle(partition) }?;
        // SAFETY: forwarded caller contract (NULL allowed).
        let h = unsafe { hooks.as_ref() }.copied();
        p.partition
            .set_hooks(h.map_or_else(HostHooks::default, host_hooks));
        Ok(())
    })
}
