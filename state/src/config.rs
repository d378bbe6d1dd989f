//! Where and how a partition's state is kept.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::format::Identity;

/// How a partition's state is kept.
#[derive(Clone, Debug)]
pub struct StateConfig {
    /// The partition's directory (created if missing).
    pub dir: PathBuf,
    /// Records staged for the writer (a stream batch's events, or one event of a host's
    /// own calls, each) before ingest drops (and counts) what comes.
    pub queue_messages: usize,
    /// A snapshot is taken when the journal has grown by this many bytes since the last,
    /// and by [`StateConfig::snapshot_growth_percent`] of the last snapshot's size.
    pub snapshot_after_bytes: u64,
    /// The journal since the last snapshot must also reach this percentage of that
    /// snapshot's size before the next is taken (like an append-only file's rewrite
    /// threshold): a large index, whose snapshot takes seconds to dump and write, is
    /// snapshotted no more often than its journal doubles the state kept, and a restart
    /// replays at most about a snapshot's worth of journal.
    pub snapshot_growth_percent: u64,
    /// What arrives within this time of the last append goes in one write and one sync
    /// (a crash loses this much of the journal, and more while a sync is slow; the
    /// engines' replay brings it back, as the restart resumes each stream from what the
    /// journal kept, if their buffers still hold it).
    pub sync_every: Duration,
}

impl StateConfig {
    /// Defaults: a queue of 65,536 records, a snapshot every 256 MiB of journal and no
    /// sooner than the journal has grown by the last snapshot's size (100 %), a sync at
    /// most every 10 ms.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        StateConfig {
            dir: dir.into(),
            queue_messages: 1 << 16,
            snapshot_after_bytes: 256 << 20,
            snapshot_growth_percent: 100,
            sync_every: Duration::from_millis(10),
        }
    }
}

/// The directory of `id`'s partition under `root`: its key, made safe for a file name,
/// and a checksum of the key (two keys that read alike still differ).
pub fn partition_dir(root: &Path, id: &Identity) -> PathBuf {
    let key = format!("{}@{}", id.key.model, id.key.routing_group);
    let safe: String = key
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-@".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    root.join(format!("{safe}-{:08x}", crc32fast::hash(key.as_bytes())))
}
