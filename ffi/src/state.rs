//! A partition's index kept on disk (kvr-state), so that a host restarted on the same
//! directory comes back warm: `kvr_partition_options_set_state_dir` names the state
//! directory, and `kvr_engine_create_partition` restores the new partition from its own
//! directory under it (before anything can feed it) and journals what it applies from
//! then on. The layout is `kvr serve --state-dir`'s, without `workers.json`: a host
//! registers its workers itself.
//!
//! The state is an option, not a call on a live partition, because a restore must come
//! before any KV-event source starts and the snapshots need the index's lineage, which
//! only the partition's creation can turn on.
//!
//! The writer belongs to the partition handles: every handle to the partition
//! (`kvr_engine_get_partition` too) reads its figures; it is closed, with a final
//! snapshot, by `kvr_partition_close_state` or when the last of them is freed.

use std::path::PathBuf;

use kvr_state::IoMode;

use crate::handles::{kvr_partition, kvr_partition_options};
use crate::kept::*;
use crate::status::*;

/// Keeps every partition created with these options in `dir` (UTF-8, `dir_len` bytes, not
/// NUL-terminated; created if missing): each partition in a directory of its own under
/// it, restored when it is created and journaled after, written as `io` says. Creating a
/// partition then fails with `KVR_ERR_IO` when the directory cannot be created, `io` is
/// `KVR_STATE_IO_URING` and io_uring cannot be used, or another partition of this process
/// keeps its state there already (`kvr_partition_options_check` says why). With
/// `KVR_STATE_IO_AUTO`, an unknown `KVR_STATE_IO` value makes it fail with
/// `KVR_ERR_INVALID_CONFIG`. `(NULL, 0)` turns the option off; an unknown `io` is
/// `KVR_ERR_INVALID_ARGUMENT`.
///
/// A restored stream resumes from the last batch applied when its worker is registered
/// with a KV-event source (`kvr_partition_subscribe`); feed the partition only after
/// creating it, as usual.
///
/// # Safety
/// `opts` is NULL or live and not shared during the call; `dir` points to `dir_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_options_set_state_dir(
    opts: *mut kvr_partition_options,
    dir: *const std::os::raw::c_char,
    dir_len: usize,
    io: kvr_state_io,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let o = unsafe { handle_mut(opts) }?;
        // SAFETY: forwarded caller contract.
        let dir = unsafe { str_arg(dir, dir_len) }?;
        let mode = match io {
            KVR_STATE_IO_AUTO => IoMode::Auto,
            KVR_STATE_IO_URING => IoMode::Uring,
            KVR_STATE_IO_PLAIN => IoMode::Plain,
            _ => return Err(KVR_ERR_INVALID_ARGUMENT),
        };
        if dir.contains('\0') {
            return Err(KVR_ERR_INVALID_ARGUMENT);
        }
        o.state = (!dir.is_empty()).then(|| StateOption {
            root: PathBuf::from(dir),
            mode,
        });
        Ok(())
    })
}

/// The state kept for `partition`, or `KVR_ERR_INVALID_CONFIG` when it was created without
/// a state directory.
///
/// # Safety
/// `partition` is NULL or live.
unsafe fn kept<'a>(partition: *const kvr_partition) -> Result<&'a KeptState, kvr_status> {
    // SAFETY: forwarded caller contract.
    let p = unsafe { handle(partition) }?;
    p.state.as_deref().ok_or(KVR_ERR_INVALID_CONFIG)
}

/// What the restore at the partition's creation found (`KVR_ERR_INVALID_CONFIG` for a
/// partition without a state directory).
///
/// # Safety
/// `partition` is NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_state_restored(
    partition: *const kvr_partition,
    out: *mut kvr_state_restored,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let k = unsafe { kept(partition) }?;
        // SAFETY: forwarded caller contract.
        unsafe { write_out(out, kvr_state_restored::of(&k.restored)) }
    })
}

/// The journal writer's figures (`KVR_ERR_INVALID_CONFIG` for a partition without a state
/// directory). Readable after `kvr_partition_close_state`.
///
/// # Safety
/// `partition` is NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_state_stats(
    partition: *const kvr_partition,
    out: *mut kvr_state_stats,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let k = unsafe { kept(partition) }?;
        let closed = *k.closed.lock().unwrap_or_else(|e| e.into_inner());
        let s = kvr_state_stats::of(k.log.stats(), k.uring, closed);
        // SAFETY: forwarded caller contract.
        unsafe { write_out(out, s) }
    })
}

/// Writes what is queued and a final snapshot, then stops the journal (a graceful
/// shutdown: the next start replays nothing). The partition keeps serving; what it applies
/// afterwards is not kept. Freeing the partition's last handle does the same. Calling it
/// again does nothing. `KVR_ERR_INVALID_CONFIG` for a partition without a state directory.
///
/// # Safety
/// `partition` is NULL or live and not used by another thread during the call.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_close_state(partition: *mut kvr_partition) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        unsafe { kept(partition) }?.close();
        Ok(())
    })
}
