//! The state a partition's handles keep (`crate::state`'s calls use it): the options'
//! state directory, the writer and what the restore found, and the directories this
//! process writes in.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};

use kvr::Partition;
use kvr_state::format::Identity;
use kvr_state::{partition_dir, Io, IoMode, Restored, StateConfig, StateLog, StateStats};

use crate::status::*;

/// How state files are written (`kvr_partition_options_set_state_dir`).
#[allow(non_camel_case_types)]
pub type kvr_state_io = u32;
/// io_uring when the kernel and the sandbox allow it, `pwrite`/`fdatasync` otherwise. The
/// `KVR_STATE_IO` environment variable (`auto`, `uring`, `plain`), when set, replaces it.
pub const KVR_STATE_IO_AUTO: kvr_state_io = 0;
/// io_uring, or `KVR_ERR_IO` at the partition's creation when it cannot be used.
pub const KVR_STATE_IO_URING: kvr_state_io = 1;
/// `pwrite` and `fdatasync`; io_uring is not tried.
pub const KVR_STATE_IO_PLAIN: kvr_state_io = 2;

/// What the restore at the partition's creation found and did.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct kvr_state_restored {
    /// Non-zero when a snapshot was restored (0: the partition started empty).
    pub snapshot_found: u32,
    /// Non-zero when reading stopped before the end of the journal (a torn or corrupt
    /// record, a writer's gap, a missing segment): what came before it was applied.
    pub stopped_early: u32,
    /// Blocks restored from the snapshot.
    pub snapshot_blocks: u64,
    /// Journal records replayed after it, and the events in them.
    pub records: u64,
    pub events: u64,
    /// Blocks or events the partition refused, as it would live ones.
    pub refused: u64,
    /// Files refused (corrupt, truncated, another version's or partition's).
    pub refused_files: u64,
    /// KV-event streams that resume from their last applied batch when their worker is
    /// registered with a source.
    pub streams: u64,
    /// Time the restore took.
    pub seconds: f64,
}

/// The journal writer's figures (counters only grow, except the last two).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvr_state_stats {
    /// Applied events handed to the writer, and those dropped because its queue was full
    /// (the journal then records a gap and a snapshot is taken at once).
    pub events_queued: u64,
    pub events_dropped: u64,
    /// Journal records written, their bytes, and durable syncs.
    pub records_written: u64,
    pub bytes_written: u64,
    pub syncs: u64,
    /// Appends that failed (disk full, an I/O error).
    pub write_failures: u64,
    /// Snapshots written, and those that failed (the previous one and its journal stay).
    pub snapshots: u64,
    pub snapshot_failures: u64,
    /// Blocks in the last snapshot written.
    pub snapshot_blocks: u64,
    /// Journal bytes since the last snapshot.
    pub journal_bytes: u64,
    /// Non-zero when the files are written through io_uring (0: `pwrite`/`fdatasync`).
    pub uring: u32,
    /// Non-zero once the state is closed (its final snapshot written).
    pub closed: u32,
}

impl kvr_state_stats {
    /// Every field of `StateStats`, named: a field added there fails to compile here
    /// until C carries it.
    pub(crate) fn of(s: StateStats, uring: bool, closed: bool) -> Self {
        let StateStats {
            events_queued,
            events_dropped,
            records_written,
            bytes_written,
            syncs,
            write_failures,
            snapshots,
            snapshot_failures,
            snapshot_blocks,
            journal_bytes,
        } = s;
        kvr_state_stats {
            events_queued,
            events_dropped,
            records_written,
            bytes_written,
            syncs,
            write_failures,
            snapshots,
            snapshot_failures,
            snapshot_blocks,
            journal_bytes,
            uring: uring.into(),
            closed: closed.into(),
        }
    }
}

impl kvr_state_restored {
    pub(crate) fn of(r: &Restored) -> Self {
        kvr_state_restored {
            snapshot_found: r.snapshot.is_some().into(),
            stopped_early: r.stopped.is_some().into(),
            snapshot_blocks: r.snapshot_blocks,
            records: r.records,
            events: r.events,
            refused: r.refused,
            refused_files: r.refused_files.len() as u64,
            streams: r.streams.len() as u64,
            seconds: r.seconds,
        }
    }
}

/// The state directory an options object names.
#[derive(Clone, Debug)]
pub(crate) struct StateOption {
    pub(crate) root: PathBuf,
    pub(crate) mode: IoMode,
}

/// A partition's kept state, shared by its handles; dropped with the last, which closes it.
#[derive(Debug)]
pub(crate) struct KeptState {
    /// Keeps the partition's address from being reused while it is listed by it.
    pub(crate) _partition: Weak<Partition>,
    pub(crate) dir: PathBuf,
    pub(crate) log: Arc<StateLog>,
    pub(crate) restored: Restored,
    pub(crate) uring: bool,
    pub(crate) closed: Mutex<bool>,
}

impl KeptState {
    pub(crate) fn close(&self) {
        let mut closed = self.closed.lock().unwrap_or_else(|e| e.into_inner());
        if !*closed {
            self.log.close();
            *closed = true;
        }
    }
}

impl Drop for KeptState {
    fn drop(&mut self) {
        self.close();
        // Only now may another partition write in this directory.
        registry().retain(|e| e.dir != self.dir);
    }
}

/// One open state: its directory, its partition's address, the state.
struct Entry {
    pub(crate) dir: PathBuf,
    pub(crate) partition: usize,
    pub(crate) state: Weak<KeptState>,
}

/// The states open in this process: two partitions never write in the same directory
/// (another engine's partition of the same key, or one created again after a removal
/// while a handle to the old one lives). An entry whose state is gone but still listed is
/// one being closed.
static KEPT: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

fn registry() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    KEPT.lock().unwrap_or_else(|e| e.into_inner())
}

/// The state kept for `p`, if any (for a handle from `kvr_engine_get_partition`).
pub(crate) fn kept_of(p: &Arc<Partition>) -> Option<Arc<KeptState>> {
    let addr = Arc::as_ptr(p) as usize;
    let weak = registry()
        .iter()
        .find(|e| e.partition == addr)
        .map(|e| e.state.clone());
    // Upgraded outside the lock: a last reference dropped under it would deadlock in
    // `KeptState::drop`.
    weak.and_then(|w| w.upgrade())
}

/// What `kvr_engine_create_partition` checks before creating a partition with a state
/// directory: the directory can be created, and the I/O mode can be had.
pub(crate) struct Prepared {
    pub(crate) root: PathBuf,
    pub(crate) io: Io,
}

impl StateOption {
    pub(crate) fn prepare(&self) -> Result<Prepared, kvr_status> {
        self.prepare_why().map_err(|(status, _)| status)
    }

    /// [`Self::prepare`] with the reason of a failure (`kvr_partition_options_check`).
    pub(crate) fn prepare_why(&self) -> Result<Prepared, (kvr_status, String)> {
        let dir = self.root.display();
        std::fs::create_dir_all(&self.root).map_err(|e| {
            (
                KVR_ERR_IO,
                format!("state dir {dir}: cannot create it: {e}"),
            )
        })?;
        let root = self.root.canonicalize().map_err(|e| {
            (
                KVR_ERR_IO,
                format!("state dir {dir}: cannot resolve it: {e}"),
            )
        })?;
        let mode = if self.mode == IoMode::Auto {
            IoMode::from_env_or(IoMode::Auto).map_err(|e| (KVR_ERR_INVALID_CONFIG, e))?
        } else {
            self.mode
        };
        let io = Io::new(mode).map_err(|e| (KVR_ERR_IO, format!("state I/O {mode}: {e}")))?;
        Ok(Prepared { root, io })
    }
}

impl Prepared {
    /// Restores `p` (new, empty, fed by nothing yet) from its directory and attaches its
    /// journal. `KVR_ERR_IO` when another partition of this process writes there or the
    /// writer cannot start; the caller then removes `p`.
    pub(crate) fn keep(self, p: &Arc<Partition>) -> Result<Arc<KeptState>, kvr_status> {
        let dir = partition_dir(&self.root, &Identity::of(p));
        let mut reg = registry();
        if reg.iter().any(|e| e.dir == dir) {
            return Err(KVR_ERR_IO);
        }
        let restored = kvr_state::restore(&dir, p);
        let uring = self.io.backend() == kvr_state::io::Backend::Uring;
        let log = StateLog::start(
            p,
            StateConfig::new(&dir),
            self.io,
            restored.streams.clone(),
            restored.next_segment,
        )
        .map_err(|_| KVR_ERR_IO)?;
        if !p.attach_applied_log(log.clone()) {
            log.close();
            return Err(KVR_ERR_IO);
        }
        let kept = Arc::new(KeptState {
            _partition: Arc::downgrade(p),
            dir: dir.clone(),
            log,
            restored,
            uring,
            closed: Mutex::new(false),
        });
        reg.push(Entry {
            dir,
            partition: Arc::as_ptr(p) as usize,
            state: Arc::downgrade(&kept),
        });
        Ok(kept)
    }
}
