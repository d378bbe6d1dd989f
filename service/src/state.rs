//! `--state-dir`: the service keeps each partition's index on disk (kvr-state: a snapshot
//! and a journal of what the index applied) and the workers' registrations beside it, so
//! that a restart comes back warm: the registrations are replayed, each partition is
//! restored before its workers' KV-event streams start, and every stream resumes from the
//! last batch the previous run applied (its publisher is asked, through replay, for that
//! batch unchanged and what followed; a publisher that restarted meanwhile is found and
//! its ranks cleared).
//!
//! Layout: `DIR/workers.json` (the registrations, as `POST /workers` took them) and one
//! directory per partition (`kvr_state::partition_dir`). A state directory that cannot be
//! created or written is an error at start; files that cannot be read or are refused
//! are logged and counted, and the service starts from what is valid (or empty).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kvr::{Partition, PartitionKey};
use kvr_state::format::Identity;
use kvr_state::{partition_dir, Io, IoMode, Restored, StateConfig, StateLog, StateStats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use crate::figures::{self, Labels, Rows};
use crate::wire::worker::WorkerRequest;

/// The registrations' file name.
const WORKERS_FILE: &str = "workers.json";
/// The largest registrations file read (a bound on a hostile or damaged file).
const MAX_WORKERS_FILE: u64 = 64 << 20;

/// One partition's state on disk: its writer and what its restore found.
struct Kept {
    key: PartitionKey,
    log: Arc<StateLog>,
    restored: Restored,
    backend: &'static str,
}

/// The service's state directory.
pub struct ServiceState {
    root: PathBuf,
    mode: IoMode,
    kept: Mutex<Vec<Kept>>,
    /// The registrations read at start.
    saved: Vec<WorkerRequest>,
    /// Registrations are not written while the kept ones are registered again.
    suspended: std::sync::atomic::AtomicBool,
    /// The registrations file was unreadable or malformed at start (counted).
    workers_file_refused: std::sync::atomic::AtomicU64,
    /// Writes of the registrations file that failed.
    workers_file_failures: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for ServiceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceState")
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl ServiceState {
    /// Opens (creating) `root` and checks that it can be written; `mode` says how
    /// (`auto`: io_uring when the kernel allows it, else plain writes).
    pub fn open(root: &Path, mode: IoMode) -> Result<Arc<ServiceState>, String> {
        std::fs::create_dir_all(root)
            .map_err(|e| format!("--state-dir {}: cannot create it: {e}", root.display()))?;
        let probe = root.join(".kvr-write-check");
        std::fs::write(&probe, b"ok")
            .and_then(|()| std::fs::remove_file(&probe))
            .map_err(|e| format!("--state-dir {}: cannot write in it: {e}", root.display()))?;
        let io = Io::new(mode).map_err(|e| format!("--state-io {mode}: {e}"))?;
        match io.fallback_reason() {
            Some(why) => tracing::warn!(
                reason = why,
                "state: io_uring is not available here; writing with pwrite/fdatasync"
            ),
            None => {
                tracing::info!(backend = io.backend().name(), dir = %root.display(), "state: keeping the index on disk")
            }
        }
        let mut s = ServiceState {
            root: root.to_path_buf(),
            mode,
            kept: Mutex::new(Vec::new()),
            saved: Vec::new(),
            suspended: Default::default(),
            workers_file_refused: Default::default(),
            workers_file_failures: Default::default(),
        };
        s.saved = s.read_workers();
        Ok(Arc::new(s))
    }

    /// The registrations the previous run kept.
    pub fn saved_workers(&self) -> Vec<WorkerRequest> {
        self.saved.clone()
    }

    /// The kept registrations of the partition `key`.
    pub fn saved_workers_of(&self, key: &PartitionKey) -> Vec<WorkerRequest> {
        self.saved
            .iter()
            .filter(|r| r.model_name == key.model && r.routing_group == key.routing_group)
            .cloned()
            .collect()
    }

    /// Stops (`true`) or resumes writing the registrations file.
    pub fn suspend_saves(&self, on: bool) {
        self.suspended
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Reads the registrations file (none when there is no file; a file that cannot be
    /// read is logged, counted and ignored).
    fn read_workers(&self) -> Vec<WorkerRequest> {
        let path = self.root.join(WORKERS_FILE);
        let bytes = match std::fs::metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
            Ok(m) if m.len() > MAX_WORKERS_FILE => Err(format!("{} bytes is too large", m.len())),
            _ => std::fs::read(&path).map_err(|e| e.to_string()),
        };
        match bytes.and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string())) {
            Ok(v) => v,
            Err(why) => {
                self.workers_file_refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::error!(file = %path.display(), error = %why, "state: the registrations file is refused; starting without it");
                Vec::new()
            }
        }
    }

    /// Keeps the registrations (written aside and renamed: never half written).
    pub fn save_workers(&self, workers: &[&WorkerRequest]) {
        if self.suspended.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let r = serde_json::to_vec(workers)
            .map_err(std::io::Error::other)
            .and_then(|body| {
                let tmp = self.root.join(format!("{WORKERS_FILE}.tmp"));
                std::fs::write(&tmp, body)?;
                std::fs::File::open(&tmp)?.sync_all()?;
                std::fs::rename(&tmp, self.root.join(WORKERS_FILE))?;
                std::fs::File::open(&self.root)?.sync_all()
            });
        if let Err(e) = r {
            self.workers_file_failures
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::error!(error = %e, "state: the registrations could not be written");
        }
    }

    /// A new partition: restores it from its directory (before any of its streams
    /// starts), then journals what it applies from now on.
    pub fn attach(&self, p: &Arc<Partition>) {
        let dir = partition_dir(&self.root, &Identity::of(p));
        let restored = kvr_state::restore(&dir, p);
        for (file, why) in &restored.refused_files {
            tracing::error!(%file, reason = %why, model = %p.key().model, "state: a state file is refused");
        }
        tracing::info!(
            model = %p.key().model,
            routing_group = %p.key().routing_group,
            snapshot = ?restored.snapshot,
            blocks = restored.snapshot_blocks,
            records = restored.records,
            streams = restored.streams.len(),
            stopped = ?restored.stopped,
            seconds = restored.seconds,
            "state: partition restored"
        );
        let io = match Io::new(self.mode) {
            Ok(io) => io,
            Err(e) => {
                tracing::error!(error = %e, "state: no journal for this partition");
                return;
            }
        };
        let backend = io.backend().name();
        let streams = restored.streams.clone();
        match StateLog::start(
            p,
            StateConfig::new(&dir),
            io,
            streams,
            restored.next_segment,
        ) {
            Ok(log) => {
                p.attach_applied_log(log.clone());
                self.kept_lock().push(Kept {
                    key: p.key().clone(),
                    log,
                    restored,
                    backend,
                });
            }
            Err(e) => {
                tracing::error!(error = %e, dir = %dir.display(), "state: no journal for this partition")
            }
        }
    }

    fn kept_lock(&self) -> std::sync::MutexGuard<'_, Vec<Kept>> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether some partition came back from a snapshot (peer recovery is then skipped).
    pub fn restored_any(&self) -> bool {
        self.kept_lock()
            .iter()
            .any(|k| k.restored.snapshot.is_some())
    }

    /// Writes what is queued and a final snapshot of every partition (graceful shutdown).
    pub fn close(&self) {
        for k in self.kept_lock().iter() {
            k.log.close();
        }
    }
}

/// One partition's row of the `kvr_state_*` families.
struct Row {
    stats: StateStats,
    restored_blocks: u64,
    restored_records: u64,
    restored_events: u64,
    refused_files: u64,
    restore_ms: u64,
}

const STATE: &[figures::Figure<Row>] = &[
    figures::counter(
        "kvr_state_events_queued",
        "Applied events handed to the journal's writer",
        |r| r.stats.events_queued,
    ),
    figures::counter(
        "kvr_state_events_dropped",
        "Applied events dropped because the writer's queue was full (a gap, then a snapshot)",
        |r| r.stats.events_dropped,
    ),
    figures::counter(
        "kvr_state_records_written",
        "Journal records written",
        |r| r.stats.records_written,
    ),
    figures::counter("kvr_state_bytes_written", "Journal bytes written", |r| {
        r.stats.bytes_written
    }),
    figures::counter("kvr_state_syncs", "Durable syncs of the journal", |r| {
        r.stats.syncs
    }),
    figures::counter(
        "kvr_state_write_failures",
        "Journal appends that failed (disk full, I/O error)",
        |r| r.stats.write_failures,
    ),
    figures::counter("kvr_state_snapshots", "Snapshots written", |r| {
        r.stats.snapshots
    }),
    figures::counter(
        "kvr_state_snapshot_failures",
        "Snapshots that could not be written (the previous one stays)",
        |r| r.stats.snapshot_failures,
    ),
    figures::gauge(
        "kvr_state_snapshot_blocks",
        "Blocks in the last snapshot written",
        |r| r.stats.snapshot_blocks as i64,
    ),
    figures::gauge(
        "kvr_state_journal_bytes",
        "Journal bytes since the last snapshot",
        |r| r.stats.journal_bytes as i64,
    ),
    figures::gauge(
        "kvr_state_restored_blocks",
        "Blocks restored from the snapshot at start",
        |r| r.restored_blocks as i64,
    ),
    figures::gauge(
        "kvr_state_restored_records",
        "Journal records replayed at start",
        |r| r.restored_records as i64,
    ),
    figures::gauge(
        "kvr_state_restored_events",
        "Events in the journal records replayed at start",
        |r| r.restored_events as i64,
    ),
    figures::gauge(
        "kvr_state_refused_files",
        "State files refused at start (corrupt, truncated, foreign)",
        |r| r.refused_files as i64,
    ),
    figures::gauge(
        "kvr_state_restore_milliseconds",
        "Time the restore took",
        |r| r.restore_ms as i64,
    ),
];

/// The `kvr_state_*` families, read at scrape time.
#[derive(Debug)]
pub struct StateMetrics(pub Arc<ServiceState>);

impl Collector for StateMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut rows = Rows::new(STATE);
        for k in self.0.kept_lock().iter() {
            let labels: Labels = vec![
                ("model", format!("{}:{}", k.key.model, k.key.routing_group)),
                ("backend", k.backend.to_string()),
            ];
            rows.push(
                &labels,
                &Row {
                    stats: k.log.stats(),
                    restored_blocks: k.restored.snapshot_blocks,
                    restored_records: k.restored.records,
                    restored_events: k.restored.events,
                    refused_files: k.restored.refused_files.len() as u64,
                    restore_ms: (k.restored.seconds * 1e3) as u64,
                },
            );
        }
        rows.encode(&mut enc)?;
        let s = &self.0;
        figures::family(
            &mut enc,
            "kvr_state_workers_file_failures",
            "The registrations file: reads refused at start, writes that failed",
            prometheus_client::metrics::MetricType::Counter,
            &[
                (
                    vec![("op", "read".to_string())],
                    prometheus_client::metrics::counter::ConstCounter::new(
                        s.workers_file_refused
                            .load(std::sync::atomic::Ordering::Relaxed),
                    ),
                ),
                (
                    vec![("op", "write".to_string())],
                    prometheus_client::metrics::counter::ConstCounter::new(
                        s.workers_file_failures
                            .load(std::sync::atomic::Ordering::Relaxed),
                    ),
                ),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_stats_field_has_its_metric_family() {
        // `StateStats::named` is kvr-state's one field list: a field added there must
        // reach /metrics as `kvr_state_<field>`.
        for (name, _) in StateStats::default().named() {
            let family = format!("kvr_state_{name}");
            assert!(
                STATE.iter().any(|f| f.name == family),
                "{family} is missing from the service's kvr_state_* families"
            );
        }
    }
}
