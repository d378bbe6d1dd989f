//! Snapshots taken beside the journal's writer: dumping tens of millions of blocks takes
//! seconds, and a writer that waited for it would let its queue fill and drop events.
//! The writer starts a new journal segment, hands the snapshot of that moment to a thread
//! of its own and goes on appending; older files are removed once the snapshot is on
//! disk. One runs at a time; a request meanwhile is served by the next one.

use std::path::{Path, PathBuf};
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::thread::JoinHandle;

use kvr::{Partition, StreamResume};

use crate::io::{Io, IoMode};
use crate::snapshot::Snapshot;

/// Added to the snapshot thread's nice value (it also runs as `SCHED_BATCH`).
const SNAPSHOT_NICE: i32 = 10;

/// A snapshot being taken, and who waits for it.
pub(crate) struct Running {
    handle: JoinHandle<Option<(u64, u64)>>,
    acks: Vec<SyncSender<()>>,
}

impl Running {
    /// Starts snapshot `n` of `p` into `dir` (the streams' places `marks`), written
    /// through a new `mode` writer; `acks` are answered when it ends.
    pub(crate) fn start(
        p: Arc<Partition>,
        marks: Vec<StreamResume>,
        dir: PathBuf,
        mode: IoMode,
        n: u64,
        acks: Vec<SyncSender<()>>,
    ) -> Running {
        let work = move || -> Option<(u64, u64)> {
            // Seconds of dumping give way to ingest and lookups (the journal covers
            // what the snapshot has not caught yet).
            crate::priority::background(SNAPSHOT_NICE);
            let snap = Snapshot::of(&p, marks);
            drop(p);
            let mut io = Io::new(mode).ok()?;
            let name = format!("snapshot-{n}.kvr");
            let bytes = io.write_atomic(&dir, &name, |out| snap.write(out)).ok()?;
            remove_older(&dir, n);
            Some((snap.blocks(), bytes))
        };
        let handle = match std::thread::Builder::new()
            .name("kvr-snapshot".into())
            .spawn(work)
        {
            Ok(h) => h,
            // No thread: an immediate failure, reported as one.
            Err(_) => std::thread::spawn(|| None),
        };
        Running { handle, acks }
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for it: the blocks it holds and its bytes (`None`: it failed), and who
    /// waits to hear (answered by the caller once it has counted it).
    pub(crate) fn finish(self) -> (Option<(u64, u64)>, Vec<SyncSender<()>>) {
        (self.handle.join().ok().flatten(), self.acks)
    }
}

/// Removes the journal segments and snapshots numbered below `n`.
fn remove_older(dir: &Path, n: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        if let Some((_, k)) = crate::restore::numbered(&name.to_string_lossy()) {
            if k < n {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}
