//! Status codes, the panic boundary, version symbols and the argument checks every export
//! shares.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};

/// The result of every fallible call. 0 is success; every other number names one cause,
/// is never reused for another, and has a message in `kvr_status_str`. 1–9 are outcomes
/// a correct caller meets in normal operation; 100 and up are errors.
#[allow(non_camel_case_types)]
pub type kvr_status = u32;

/// Success.
pub const KVR_OK: kvr_status = 0;
/// Selection: every candidate rank is busy or overloaded (nothing written, nothing
/// booked); try again later.
pub const KVR_BUSY: kvr_status = 1;
/// Selection: no rank can serve the request (no workers, none allowed or available).
pub const KVR_NO_WORKER: kvr_status = 2;
/// An output buffer is too small: nothing was written and `*out_len` holds the entries
/// needed.
pub const KVR_BUFFER_TOO_SMALL: kvr_status = 3;
/// A required pointer is NULL (a handle, an out-parameter, or a slice `(NULL, n > 0)`).
pub const KVR_ERR_NULL: kvr_status = 100;
/// An argument is out of range or malformed (block size 0, an unknown tier or event
/// kind, a string that is not UTF-8, a misaligned slice, a DP rank ≥ the worker's size).
pub const KVR_ERR_INVALID_ARGUMENT: kvr_status = 101;
/// No partition with this (model, routing group), or the partition was removed.
pub const KVR_ERR_UNKNOWN_PARTITION: kvr_status = 102;
/// A partition with this (model, routing group) exists already.
pub const KVR_ERR_PARTITION_EXISTS: kvr_status = 103;
/// No live or recently freed booking has this selection id.
pub const KVR_ERR_UNKNOWN_SELECTION_ID: kvr_status = 104;
/// The selection id is booked already (or was freed recently); nothing was booked.
pub const KVR_ERR_DUPLICATE_SELECTION_ID: kvr_status = 105;
/// The (worker, DP rank) is not a member of the partition.
pub const KVR_ERR_UNKNOWN_RANK: kvr_status = 106;
/// The worker is not a member of the partition.
pub const KVR_ERR_UNKNOWN_WORKER: kvr_status = 107;
/// The booking was freed already, so it cannot grow (`kvr_engine_add_output_blocks`).
pub const KVR_ERR_ALREADY_FREED: kvr_status = 108;
/// A count is larger than one booking may carry.
pub const KVR_ERR_TOO_LARGE: kvr_status = 109;
/// A stored event named a parent block this rank does not hold; that event was not
/// applied (the others of the batch were).
pub const KVR_ERR_PARENT_NOT_FOUND: kvr_status = 110;
/// The index holds the maximum number of ranks; the event was not applied.
pub const KVR_ERR_TOO_MANY_RANKS: kvr_status = 111;
/// A raw engine message did not decode (`kvr_partition_ingest`): nothing of it was
/// applied; counted by cause in the stream's stats.
pub const KVR_ERR_DECODE: kvr_status = 112;
/// An operating-system resource could not be had (`kvr_partition_subscribe`: the
/// subscription's thread or its I/O runtime could not be created); nothing was started.
pub const KVR_ERR_IO: kvr_status = 113;
/// The partition options contradict each other (e.g. a remote indexer with KV events
/// off) or name something kvr cannot use (a remote URL that is not `http://host[:port]`);
/// nothing was created. `kvr_partition_options_check` writes the reason. Also: the
/// partition's configuration does not allow the call (`kvr_partition_subscribe` on a
/// partition that applies no engine events).
pub const KVR_ERR_INVALID_CONFIG: kvr_status = 114;
/// A Rust panic was caught at the boundary (a bug in kvr); the call had no effect it
/// reports, and the engine keeps serving.
pub const KVR_ERR_PANIC: kvr_status = 199;

/// Version of this library (semantic versioning of the C ABI's source). 0.2 added raw
/// ingest, ingress stats and subscriptions; 0.3 added indexer policies, transfer hints
/// and session affinity and renamed `kvr_decision.reserved` (always 0 until then) to
/// `flags`. Nothing of 0.1 or 0.2 changed its layout or meaning. 0.4 (ABI 2) appended
/// recovery, group, medium and freshness counters to `kvr_stream_stats`, the lease
/// counters to `kvr_session_stats`, `stale_overlaps_ignored` to `kvr_selection_stats` and
/// the approximate index's records, record errors and blocks over its bound to
/// `kvr_indexer_stats` (larger structs: hosts must be rebuilt), and added extra keys to
/// `kvr_request`.
pub const KVR_VERSION_MAJOR: u32 = 0;
pub const KVR_VERSION_MINOR: u32 = 4;
pub const KVR_VERSION_PATCH: u32 = 0;
/// The ABI generation: bumped on every incompatible change of a type or signature.
/// `kvr_abi_version()` returns the library's; a host compares it with this macro.
pub const KVR_ABI_VERSION: u32 = 2;

/// Link-time ABI check: a host built against this header references this symbol (see
/// `KVR_ABI_CHECK()`), so linking it against a library of another ABI generation fails.
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static kvr_abi_2: u32 = KVR_ABI_VERSION;

/// The ABI generation of the linked library (compare with `KVR_ABI_VERSION`).
///
/// Thread-safe; never fails.
#[no_mangle]
pub extern "C" fn kvr_abi_version() -> u32 {
    KVR_ABI_VERSION
}

/// A static, NUL-terminated English message for `status` (an unknown number gets
/// "unknown status"). The pointer stays valid for the life of the process; do not free.
///
/// Thread-safe; never fails.
#[no_mangle]
pub extern "C" fn kvr_status_str(status: kvr_status) -> *const std::os::raw::c_char {
    let s: &'static [u8] = match status {
        KVR_OK => b"ok\0",
        KVR_BUSY => b"every candidate rank is busy\0",
        KVR_NO_WORKER => b"no worker can serve the request\0",
        KVR_BUFFER_TOO_SMALL => b"output buffer too small\0",
        KVR_ERR_NULL => b"NULL pointer argument\0",
        KVR_ERR_INVALID_ARGUMENT => b"invalid argument\0",
        KVR_ERR_UNKNOWN_PARTITION => b"unknown partition\0",
        KVR_ERR_PARTITION_EXISTS => b"partition exists\0",
        KVR_ERR_UNKNOWN_SELECTION_ID => b"unknown selection id\0",
        KVR_ERR_DUPLICATE_SELECTION_ID => b"duplicate selection id\0",
        KVR_ERR_UNKNOWN_RANK => b"rank is not in the partition\0",
        KVR_ERR_UNKNOWN_WORKER => b"worker is not in the partition\0",
        KVR_ERR_ALREADY_FREED => b"booking was already freed\0",
        KVR_ERR_TOO_LARGE => b"count too large for one booking\0",
        KVR_ERR_PARENT_NOT_FOUND => b"stored event's parent block is unknown\0",
        KVR_ERR_TOO_MANY_RANKS => b"too many ranks in the index\0",
        KVR_ERR_DECODE => b"engine message did not decode\0",
        KVR_ERR_IO => b"I/O error\0",
        KVR_ERR_INVALID_CONFIG => b"invalid partition configuration\0",
        KVR_ERR_PANIC => b"internal error (panic caught)\0",
        _ => b"unknown status\0",
    };
    s.as_ptr().cast()
}

/// Statuses with a counter; anything above counts under the last slot.
const COUNTED: usize = 200;

static RETURNED: [AtomicU64; COUNTED + 1] = [const { AtomicU64::new(0) }; COUNTED + 1];

/// How many calls in this process returned `status` (any value other than `KVR_OK`;
/// `KVR_OK` is not counted and reads 0). Bad input is counted here whatever handle it
/// came with, including none.
///
/// Thread-safe; never fails.
#[no_mangle]
pub extern "C" fn kvr_status_count(status: kvr_status) -> u64 {
    RETURNED[(status as usize).min(COUNTED)].load(Ordering::Relaxed)
}

fn counted(status: kvr_status) -> kvr_status {
    if status != KVR_OK {
        RETURNED[(status as usize).min(COUNTED)].fetch_add(1, Ordering::Relaxed);
    }
    status
}

/// What an export body returns: `Err` carries a non-OK status.
pub(crate) type Ret = Result<(), kvr_status>;

/// The panic boundary every fallible export runs its body in: a panic becomes
/// `KVR_ERR_PANIC` instead of unwinding into C, and every non-OK status is counted.
pub(crate) fn guard(body: impl FnOnce() -> Ret) -> kvr_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => KVR_OK,
        Ok(Err(status)) => counted(status),
        Err(_) => counted(KVR_ERR_PANIC),
    }
}

/// As [`guard`], for exports that return nothing (the `*_free` functions).
pub(crate) fn guard_void(body: impl FnOnce()) {
    let _ = catch_unwind(AssertUnwindSafe(body)).map_err(|_| counted(KVR_ERR_PANIC));
}

/// Borrows a C slice: `(NULL, 0)` (or any pointer with 0) is empty, `(NULL, n > 0)` is
/// `KVR_ERR_NULL`, a misaligned or oversized one `KVR_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// If `ptr` is not NULL and `len > 0`, it must point to `len` initialised `T`s that stay
/// valid and unmodified for `'a`.
pub(crate) unsafe fn slice<'a, T>(ptr: *const T, len: usize) -> Result<&'a [T], kvr_status> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(KVR_ERR_NULL);
    }
    if !ptr.is_aligned()
        || len
            .checked_mul(std::mem::size_of::<T>())
            .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(KVR_ERR_INVALID_ARGUMENT);
    }
    // SAFETY: non-NULL, aligned, size within isize::MAX, and the caller guarantees `len`
    // valid elements for `'a`.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// Borrows a writable C buffer of `cap` elements, with [`slice`]'s rules.
///
/// # Safety
/// If `ptr` is not NULL and `cap > 0`, it must point to `cap` writable `T`s, not aliased
/// for `'a`.
pub(crate) unsafe fn slice_mut<'a, T>(ptr: *mut T, cap: usize) -> Result<&'a mut [T], kvr_status> {
    if cap == 0 {
        return Ok(&mut []);
    }
    if ptr.is_null() {
        return Err(KVR_ERR_NULL);
    }
    if !ptr.is_aligned()
        || cap
            .checked_mul(std::mem::size_of::<T>())
            .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(KVR_ERR_INVALID_ARGUMENT);
    }
    // SAFETY: as in `slice`, and the caller guarantees exclusive writable access.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, cap) })
}

/// Borrows a UTF-8 string given as `(ptr, len)` (not NUL-terminated); `(NULL, 0)` is "".
///
/// # Safety
/// As [`slice`] for `len` bytes.
pub(crate) unsafe fn str_arg<'a>(
    ptr: *const std::os::raw::c_char,
    len: usize,
) -> Result<&'a str, kvr_status> {
    // SAFETY: forwarded caller contract.
    let bytes = unsafe { slice(ptr.cast::<u8>(), len) }?;
    std::str::from_utf8(bytes).map_err(|_| KVR_ERR_INVALID_ARGUMENT)
}

/// A shared reference to a handle, or `KVR_ERR_NULL`.
///
/// # Safety
/// A non-NULL `ptr` must point to a live `T` created by this library.
pub(crate) unsafe fn handle<'a, T>(ptr: *const T) -> Result<&'a T, kvr_status> {
    // SAFETY: NULL is handled by `as_ref`; otherwise the caller guarantees liveness.
    unsafe { ptr.as_ref() }.ok_or(KVR_ERR_NULL)
}

/// An exclusive reference to a handle, or `KVR_ERR_NULL`.
///
/// # Safety
/// A non-NULL `ptr` must point to a live `T` created by this library, used by no other
/// thread during the call.
pub(crate) unsafe fn handle_mut<'a, T>(ptr: *mut T) -> Result<&'a mut T, kvr_status> {
    // SAFETY: NULL is handled by `as_mut`; otherwise the caller guarantees liveness and
    // exclusivity.
    unsafe { ptr.as_mut() }.ok_or(KVR_ERR_NULL)
}

/// Writes `value` through an out-parameter, or `KVR_ERR_NULL`.
///
/// # Safety
/// A non-NULL `ptr` must be valid for a write of `T` and aligned.
pub(crate) unsafe fn write_out<T>(ptr: *mut T, value: T) -> Ret {
    if ptr.is_null() {
        return Err(KVR_ERR_NULL);
    }
    // SAFETY: non-NULL and, by the caller's contract, valid and aligned. `write` does not
    // drop the (possibly uninitialised) old value.
    unsafe { ptr.write(value) };
    Ok(())
}

/// Writes through an optional out-parameter (NULL = the caller does not want it).
///
/// # Safety
/// As [`write_out`].
pub(crate) unsafe fn write_opt<T>(ptr: *mut T, value: T) {
    if !ptr.is_null() {
        // SAFETY: non-NULL, and valid by the caller's contract.
        unsafe { ptr.write(value) };
    }
}

/// Moves `value` to the heap and hands its ownership to C through `out`.
///
/// # Safety
/// As [`write_out`].
pub(crate) unsafe fn give<T>(out: *mut *mut T, value: T) -> Ret {
    if out.is_null() {
        return Err(KVR_ERR_NULL);
    }
    // SAFETY: checked non-NULL above; valid by the caller's contract.
    unsafe { out.write(Box::into_raw(Box::new(value))) };
    Ok(())
}

/// Takes back and drops a handle handed out by [`give`]; NULL is a no-op.
///
/// # Safety
/// A non-NULL `ptr` must come from [`give`] for the same `T` and not have been freed.
pub(crate) unsafe fn take_back<T>(ptr: *mut T) {
    if !ptr.is_null() {
        // SAFETY: the caller guarantees `ptr` is a live `Box<T>` from `give`.
        drop(unsafe { Box::from_raw(ptr) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_a_status_and_is_counted() {
        let before = kvr_status_count(KVR_ERR_PANIC);
        let s = guard(|| panic!("boom"));
        assert_eq!(s, KVR_ERR_PANIC);
        assert!(kvr_status_count(KVR_ERR_PANIC) > before);
        guard_void(|| panic!("boom in a free"));
    }

    #[test]
    fn every_status_has_its_own_message() {
        let all = [
            KVR_OK,
            KVR_BUSY,
            KVR_NO_WORKER,
            KVR_BUFFER_TOO_SMALL,
            KVR_ERR_NULL,
            KVR_ERR_INVALID_ARGUMENT,
            KVR_ERR_UNKNOWN_PARTITION,
            KVR_ERR_PARTITION_EXISTS,
            KVR_ERR_UNKNOWN_SELECTION_ID,
            KVR_ERR_DUPLICATE_SELECTION_ID,
            KVR_ERR_UNKNOWN_RANK,
            KVR_ERR_UNKNOWN_WORKER,
            KVR_ERR_ALREADY_FREED,
            KVR_ERR_TOO_LARGE,
            KVR_ERR_PARENT_NOT_FOUND,
            KVR_ERR_TOO_MANY_RANKS,
            KVR_ERR_DECODE,
            KVR_ERR_IO,
            KVR_ERR_PANIC,
        ];
        let mut seen = std::collections::HashSet::new();
        for s in all {
            // SAFETY: kvr_status_str returns a static NUL-terminated string.
            let m = unsafe { std::ffi::CStr::from_ptr(kvr_status_str(s)) };
            assert_ne!(m.to_str().unwrap(), "unknown status", "status {s}");
            assert!(seen.insert(m.to_owned()), "status {s} repeats a message");
        }
    }

    #[test]
    fn null_with_a_length_is_an_error_and_null_without_one_is_empty() {
        // SAFETY: NULL pointers only; the functions must not dereference them.
        unsafe {
            assert_eq!(slice::<u64>(std::ptr::null(), 0), Ok(&[][..]));
            assert_eq!(slice::<u64>(std::ptr::null(), 3), Err(KVR_ERR_NULL));
            assert_eq!(str_arg(std::ptr::null(), 0), Ok(""));
        }
        let bad = [0xffu8, 0xfe];
        // SAFETY: `bad` is a live 2-byte buffer.
        let r = unsafe { str_arg(bad.as_ptr().cast(), 2) };
        assert_eq!(r, Err(KVR_ERR_INVALID_ARGUMENT));
    }
}
