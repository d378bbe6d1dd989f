//! A partition's index kept on disk for a warm restart (kvr-state), for
//! `Engine.create_partition(..., state_dir=...)`: the new partition is restored from its
//! own directory under `state_dir` (kvr serve's `--state-dir` layout, without
//! `workers.json`) before `create_partition` returns, and what it applies afterwards is
//! journaled. `Partition.close_state()`, or the partition object going away, writes the
//! final snapshot.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use kvr::Partition;
use kvr_state::format::Identity;
use kvr_state::{partition_dir, Io, IoMode, Restored, StateConfig, StateLog};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Directories a partition of this process writes in: two never share one.
static OPEN: Mutex<Option<HashSet<PathBuf>>> = Mutex::new(None);

fn open_dirs() -> std::sync::MutexGuard<'static, Option<HashSet<PathBuf>>> {
    OPEN.lock().unwrap_or_else(|e| e.into_inner())
}

/// The I/O mode `io` names (`auto` also reads `KVR_STATE_IO`, as `kvr serve` does).
pub(crate) fn io_mode(io: &str) -> PyResult<IoMode> {
    let mode: IoMode = io.parse().map_err(PyValueError::new_err)?;
    if mode == IoMode::Auto {
        return IoMode::from_env_or(IoMode::Auto).map_err(PyValueError::new_err);
    }
    Ok(mode)
}

/// What `create_partition` checks before creating the partition: the directory can be
/// created and the I/O mode had (`OSError` otherwise).
pub(crate) struct Prepared {
    root: PathBuf,
    io: Io,
}

pub(crate) fn prepare(root: &str, mode: IoMode) -> PyResult<Prepared> {
    if root.is_empty() {
        return Err(PyValueError::new_err("state_dir must not be empty"));
    }
    let os = |what: &str, e: &dyn std::fmt::Display| {
        PyOSError::new_err(format!("state_dir {root}: {what}: {e}"))
    };
    std::fs::create_dir_all(root).map_err(|e| os("cannot create it", &e))?;
    let root = std::fs::canonicalize(root).map_err(|e| os("cannot resolve it", &e))?;
    let io = Io::new(mode).map_err(|e| PyOSError::new_err(format!("state_io {mode}: {e}")))?;
    Ok(Prepared { root, io })
}

/// A partition's state on disk: its writer and what its restore found.
pub(crate) struct Kept {
    dir: PathBuf,
    log: Arc<StateLog>,
    restored: Restored,
    uring: bool,
    closed: Mutex<bool>,
}

impl Prepared {
    /// Restores `p` (new, fed by nothing yet) and attaches its journal.
    pub(crate) fn keep(self, p: &Arc<Partition>) -> PyResult<Kept> {
        let dir = partition_dir(&self.root, &Identity::of(p));
        let mut open = open_dirs();
        let set = open.get_or_insert_with(HashSet::new);
        if set.contains(&dir) {
            return Err(PyOSError::new_err(format!(
                "state_dir: another partition of this process keeps its state in {}",
                dir.display()
            )));
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
        .map_err(|e| PyOSError::new_err(format!("state_dir {}: {e}", dir.display())))?;
        if !p.attach_applied_log(log.clone()) {
            log.close();
            return Err(PyOSError::new_err("the partition already keeps a journal"));
        }
        set.insert(dir.clone());
        Ok(Kept {
            dir,
            log,
            restored,
            uring,
            closed: Mutex::new(false),
        })
    }
}

impl Kept {
    /// Writes what is queued and a final snapshot, then stops the journal (idempotent).
    pub(crate) fn close(&self) {
        let mut closed = self.closed.lock().unwrap_or_else(|e| e.into_inner());
        if !*closed {
            self.log.close();
            *closed = true;
        }
    }

    /// What the restore found, as a dict.
    pub(crate) fn restored<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = &self.restored;
        let d = PyDict::new(py);
        d.set_item("snapshot_found", r.snapshot.is_some())?;
        d.set_item("stopped_early", r.stopped.is_some())?;
        d.set_item("stopped", r.stopped.clone())?;
        d.set_item("snapshot_blocks", r.snapshot_blocks)?;
        d.set_item("records", r.records)?;
        d.set_item("events", r.events)?;
        d.set_item("refused", r.refused)?;
        d.set_item("refused_files", r.refused_files.clone())?;
        d.set_item("streams", r.streams.len())?;
        d.set_item("seconds", r.seconds)?;
        Ok(d)
    }

    /// The writer's figures, as a dict: every `StateStats` field (`StateStats::named`,
    /// the list kvr-state declares once), `uring` and `closed`.
    pub(crate) fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, value) in self.log.stats().named() {
            d.set_item(name, value)?;
        }
        d.set_item("uring", self.uring)?;
        d.set_item(
            "closed",
            *self.closed.lock().unwrap_or_else(|e| e.into_inner()),
        )?;
        Ok(d)
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.close();
        if let Some(set) = open_dirs().as_mut() {
            set.remove(&self.dir);
        }
    }
}
