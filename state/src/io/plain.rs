//! The fallback backend: positioned writes (`pwrite`) and `fdatasync`, through std.
//!
//! std's `write_all_at` already retries a write interrupted by a signal (`EINTR`) and
//! continues after a short write; a write that makes no progress is an error
//! (`WriteZero`), never a loop.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use super::Failed;

/// Writes each of `bufs` in turn at `off` onwards, then syncs the file's data if `sync`.
pub(super) fn write_at(
    file: &File,
    mut off: u64,
    bufs: &[&[u8]],
    sync: bool,
) -> Result<(), Failed> {
    for buf in bufs {
        file.write_all_at(buf, off).map_err(|e| ("write", e))?;
        off += buf.len() as u64;
    }
    if sync {
        sync_data(file)?;
    }
    Ok(())
}

/// `fdatasync`, retried when a signal interrupts it.
pub(super) fn sync_data(file: &File) -> Result<(), Failed> {
    loop {
        match file.sync_data() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r.map_err(|e| ("fdatasync", e)),
        }
    }
}
