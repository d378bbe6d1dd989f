//! The journal's writer: what the partition's index applies is encoded on the ingesting
//! thread, a record per stream batch, and staged in a byte buffer the writer thread swaps
//! out at each group commit ([`crate::staged`]); the writer appends it (one write and one
//! durable sync) and takes a snapshot when the journal has grown, after a loss, and at
//! shutdown.
//!
//! Ingest never waits for the disk: when too many records are staged the event is
//! dropped and counted, and the writer then records a `Gap` (a restart stops reading
//! there, with the state before it, which is a true prefix) and takes a snapshot, which
//! supersedes it.
//!
//! Files of one partition, in its own directory ([`crate::config::partition_dir`]): `journal-N.kvr`
//! segments and `snapshot-N.kvr`, the snapshot taken when segment `N` began (so it holds
//! at least everything of the segments before `N`). A snapshot is written aside and
//! renamed; only then are the older files removed. A restart reads the newest snapshot
//! and the segments from its number on ([`crate::restore`](mod@crate::restore)).

use std::collections::HashMap;
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvr::{AppliedLog, KvEvent, Origin, Partition, RankId, StreamResume, WorkerId};

use crate::config::StateConfig;
use crate::format::Identity;
use crate::io::{AppendFile, Backend, Io, IoMode};
use crate::journal::{self, BatchPayload, Record};
use crate::snapshotter::Running;
use crate::staged::{fill_checksums, Note, Stage, Staged};

/// What the writer did, for metrics (every field only grows, except the last ones).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateStats {
    /// Events handed to the writer, and those dropped because its queue was full.
    pub events_queued: u64,
    pub events_dropped: u64,
    /// Journal records written, their bytes, and durable syncs.
    pub records_written: u64,
    pub bytes_written: u64,
    pub syncs: u64,
    /// Appends that failed (the disk full, an I/O error): the journal has a gap there.
    pub write_failures: u64,
    /// Snapshots written, and those that failed (the previous one and its journal stay).
    pub snapshots: u64,
    pub snapshot_failures: u64,
    /// Blocks in the last snapshot written.
    pub snapshot_blocks: u64,
    /// Bytes of journal since the last snapshot.
    pub journal_bytes: u64,
}

impl StateStats {
    /// Every field by name, in declaration order: the one list the hosts (Python's dict,
    /// the service's `kvr_state_*` families) are checked against. A field added to the
    /// struct fails to compile here until it is named.
    pub fn named(&self) -> [(&'static str, u64); 10] {
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
        } = *self;
        [
            ("events_queued", events_queued),
            ("events_dropped", events_dropped),
            ("records_written", records_written),
            ("bytes_written", bytes_written),
            ("syncs", syncs),
            ("write_failures", write_failures),
            ("snapshots", snapshots),
            ("snapshot_failures", snapshot_failures),
            ("snapshot_blocks", snapshot_blocks),
            ("journal_bytes", journal_bytes),
        ]
    }
}

/// A partition's journal and snapshots: attach it with
/// [`Partition::attach_applied_log`] (after restoring, [`crate::restore()`]).
pub struct StateLog {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// What the ingesting threads share with the writer: the staged records, and the
/// writer's counters.
struct Shared {
    stage: Arc<Stage>,
    stats: Arc<Mutex<StateStats>>,
}

/// Buffers of a batch being gathered, kept per thread for the next one (no allocation
/// per batch once they have grown), unless they grew past this.
const KEEP_BYTES: usize = 1 << 20;

/// The stream batch an ingesting thread is applying: its events encoded as they come,
/// after room for the frame head, so that staging it is one copy.
struct Pending {
    shared: Arc<Shared>,
    origin: Origin,
    payload: BatchPayload,
    /// The DP ranks its events named, each once.
    ranks: Vec<u32>,
}

/// This thread's batch being gathered, and the buffers of the last one sent.
#[derive(Default)]
struct Local {
    pending: Option<Pending>,
    spare: (Vec<u8>, Vec<u32>),
}

impl Pending {
    fn new(
        shared: Arc<Shared>,
        origin: Origin,
        spare: &mut (Vec<u8>, Vec<u32>),
    ) -> Option<Pending> {
        let Origin::Stream {
            worker_id,
            stream,
            seq,
            digest,
        } = origin
        else {
            return None;
        };
        let buf = std::mem::take(&mut spare.0);
        let mut ranks = std::mem::take(&mut spare.1);
        ranks.clear();
        Some(Pending {
            shared,
            origin,
            payload: BatchPayload::framed(worker_id, stream, seq, digest, buf),
            ranks,
        })
    }

    fn push(&mut self, rank: RankId, e: &KvEvent<'_>) {
        self.payload.push(rank, e);
        if !self.ranks.contains(&rank.dp_rank) {
            self.ranks.push(rank.dp_rank);
        }
    }

    /// Stages the batch; returns its buffers for the next one.
    fn send(self) -> (Vec<u8>, Vec<u32>) {
        let (frame, n, fits) = self.payload.finish_frame();
        let ranks = self.ranks;
        if let Origin::Stream {
            worker_id,
            stream,
            seq,
            digest,
        } = self.origin
        {
            self.shared.stage.push(u64::from(n), |bytes, staged_ranks| {
                if !fits {
                    return Err(());
                }
                bytes.extend_from_slice(&frame);
                let from = staged_ranks.len() as u32;
                staged_ranks.extend_from_slice(&ranks);
                Ok(Some(Note::Batch {
                    worker_id,
                    stream,
                    seq,
                    digest,
                    from,
                    to: staged_ranks.len() as u32,
                }))
            });
        }
        (frame, ranks)
    }
}

thread_local! {
    static LOCAL: std::cell::RefCell<Local> = std::cell::RefCell::new(Local::default());
}

/// Sends `p` and keeps its buffers for this thread's next batch.
fn send_and_keep(p: Pending) {
    let (buf, ranks) = p.send();
    if buf.capacity() <= KEEP_BYTES {
        LOCAL.with(|l| l.borrow_mut().spare = (buf, ranks));
    }
}

impl std::fmt::Debug for StateLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateLog").finish_non_exhaustive()
    }
}

impl StateLog {
    /// Starts the writer of `partition`'s state in `cfg.dir`: its thread first takes a
    /// snapshot (so the journal starts from what is in the index now), with the
    /// streams' resume points `marks` (what a restore found). `next_segment` is the first
    /// journal number not used yet ([`crate::restore::Restored::next_segment`]).
    pub fn start(
        partition: &Arc<Partition>,
        cfg: StateConfig,
        io: Io,
        marks: Vec<StreamResume>,
        next_segment: u64,
    ) -> std::io::Result<Arc<StateLog>> {
        std::fs::create_dir_all(&cfg.dir)?;
        let stage = Arc::new(Stage::new(cfg.queue_messages));
        let stats = Arc::new(Mutex::new(StateStats::default()));
        let w = Writer {
            partition: Arc::downgrade(partition),
            identity: Identity::of(partition),
            cfg,
            io,
            stage: stage.clone(),
            stats: stats.clone(),
            marks: marks
                .into_iter()
                .map(|m| ((m.worker_id, m.stream), m))
                .collect(),
            segment: next_segment,
            journal: None,
            seen_dropped: 0,
            running: None,
            again: false,
            waiting: Vec::new(),
            last_snapshot_bytes: 0,
        };
        let thread = std::thread::Builder::new()
            .name("kvr-state".into())
            .spawn(move || w.run())?;
        Ok(Arc::new(StateLog {
            shared: Arc::new(Shared { stage, stats }),
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// Sends this thread's gathered batch first, if it is this log's (what follows must
    /// come after it).
    fn flush_pending(&self) {
        let p = LOCAL.with(|l| {
            let mut l = l.borrow_mut();
            match &l.pending {
                Some(x) if Arc::ptr_eq(&x.shared, &self.shared) => l.pending.take(),
                _ => None,
            }
        });
        if let Some(p) = p {
            send_and_keep(p);
        }
    }

    /// Takes a snapshot now and waits for it (e.g. before a planned restart); false when
    /// the writer has stopped.
    pub fn snapshot_now(&self) -> bool {
        self.flush_with(true)
    }

    /// Waits until everything handed over so far is in the journal, durably; false when
    /// the writer has stopped.
    pub fn flush(&self) -> bool {
        self.flush_with(false)
    }

    fn flush_with(&self, snapshot: bool) -> bool {
        self.flush_pending();
        let (ack, done) = mpsc::sync_channel(1);
        self.shared.stage.ask(ack, snapshot) && done.recv().is_ok()
    }

    /// Writes what is queued, takes a final snapshot and stops the writer (a graceful
    /// shutdown: the next start needs no journal). Events after this are dropped.
    pub fn close(&self) {
        self.snapshot_now();
        self.stop();
    }

    /// Writes what is queued and stops the writer without a final snapshot (a restart
    /// replays the journal since the last one), after a snapshot running has ended.
    /// Events after this are dropped.
    pub fn stop(&self) {
        self.flush_pending();
        self.shared.stage.close();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }

    /// The writer's counters now.
    pub fn stats(&self) -> StateStats {
        let mut s = *self.shared.stats.lock().unwrap_or_else(|e| e.into_inner());
        (s.events_queued, s.events_dropped) = self.shared.stage.counts();
        s
    }
}

impl Drop for StateLog {
    /// The writer ends after what was handed over (no final snapshot), without being
    /// waited for.
    fn drop(&mut self) {
        self.shared.stage.close();
    }
}

impl AppliedLog for StateLog {
    fn applied(&self, origin: Origin, rank: RankId, event: &KvEvent<'_>) {
        if matches!(origin, Origin::Direct) {
            self.flush_pending();
            return self.shared.stage.push(1, |bytes, _| {
                if journal::put_direct_unsummed(bytes, rank, event) {
                    Ok(None)
                } else {
                    Err(())
                }
            });
        }
        // A stream batch's events are encoded on this thread until its end.
        let other = LOCAL.with(|l| {
            let mut l = l.borrow_mut();
            let l = &mut *l;
            match &mut l.pending {
                Some(x) if x.origin == origin && Arc::ptr_eq(&x.shared, &self.shared) => {
                    x.push(rank, event);
                    return None;
                }
                _ => {}
            }
            let mut fresh = Pending::new(self.shared.clone(), origin, &mut l.spare)?;
            fresh.push(rank, event);
            // Another batch was still gathered (its end never came): it goes as it is.
            l.pending.replace(fresh)
        });
        if let Some(o) = other {
            send_and_keep(o);
        }
    }
    fn batch_end(&self, origin: Origin) {
        let p = LOCAL.with(|l| {
            let mut l = l.borrow_mut();
            match &l.pending {
                Some(x) if x.origin == origin && Arc::ptr_eq(&x.shared, &self.shared) => {
                    l.pending.take()
                }
                _ => None,
            }
        });
        // Nothing of it applied: nothing to journal.
        if let Some(p) = p {
            send_and_keep(p);
        }
    }
    fn cleared(&self, worker_id: WorkerId, dp_ranks: &[u32]) {
        self.flush_pending();
        let rec = Record::Clear {
            worker_id,
            dp_ranks: dp_ranks.to_vec(),
        };
        self.shared.stage.push(1, |bytes, _| {
            journal::put_record(bytes, &rec);
            Ok(None)
        });
    }
    fn worker_removed(&self, worker_id: WorkerId) {
        self.flush_pending();
        self.shared.stage.push(1, |bytes, _| {
            journal::put_record(bytes, &Record::Removed { worker_id });
            Ok(Some(Note::Removed(worker_id)))
        });
    }
}

/// The writer thread's state.
struct Writer {
    partition: Weak<Partition>,
    identity: Identity,
    cfg: StateConfig,
    io: Io,
    stage: Arc<Stage>,
    stats: Arc<Mutex<StateStats>>,
    /// Each stream's last batch journaled whole (what a snapshot stores).
    marks: HashMap<(WorkerId, u32), StreamResume>,
    /// The current journal segment's number, and its file once opened.
    segment: u64,
    journal: Option<AppendFile>,
    /// The snapshot being taken, whether another is wanted after it, and who waits for
    /// that one.
    running: Option<Running>,
    again: bool,
    waiting: Vec<SyncSender<()>>,
    /// The stage's dropped count when a gap was last recorded.
    seen_dropped: u64,
    /// The size of the last snapshot written (bytes), for when the next is due.
    last_snapshot_bytes: u64,
}

/// The staged bytes kept for reuse after a write, at most (a burst's larger buffer goes).
const KEEP_STAGED: usize = 64 << 20;

/// Tells the stage when the writer ends, even by a panic: whoever waits for it hears.
struct Gone(Arc<Stage>);

impl Drop for Gone {
    fn drop(&mut self) {
        self.0.writer_gone();
    }
}

impl Writer {
    fn run(mut self) {
        let _gone = Gone(self.stage.clone());
        // The journal starts from what the index holds now (restored or empty).
        self.snapshot(Vec::new());
        let mut taken = Staged::default();
        let mut last_write = Instant::now();
        loop {
            self.poll_snapshot(false);
            let idle = if self.running.is_some() { 5 } else { 200 };
            if !self
                .stage
                .wait_work(Duration::from_millis(idle), self.seen_dropped)
            {
                continue;
            }
            // Group commit: what is staged within `sync_every` of the last write goes in
            // the next one (one write, one sync), unless someone waits for it. Staging a
            // record never wakes the writer meanwhile.
            self.stage.wait_until(last_write + self.cfg.sync_every);
            self.stage.take(&mut taken);
            if self.write(&mut taken) {
                return;
            }
            if taken.bytes.capacity() > KEEP_STAGED {
                taken.bytes = Vec::new();
            }
            last_write = Instant::now();
        }
    }

    /// Appends what was staged, then snapshots when one is due or asked for; true
    /// when asked to stop.
    fn write(&mut self, t: &mut Staged) -> bool {
        for n in t.notes.drain(..) {
            match n {
                Note::Batch {
                    worker_id,
                    stream,
                    seq,
                    digest,
                    from,
                    to,
                } => crate::restore::note_place(
                    &mut self.marks,
                    (worker_id, stream),
                    (seq, digest),
                    t.ranks[from as usize..to as usize].iter().copied(),
                ),
                Note::Removed(worker_id) => self.marks.retain(|k, _| k.0 != worker_id),
            }
        }
        // Dropped events were applied before the ones staged after them: the gap goes
        // first, and what follows it is not read at a restart (the snapshot below is).
        let lost = t.dropped.wrapping_sub(self.seen_dropped);
        let mut gap = Vec::new();
        if lost > 0 {
            journal::put_record(&mut gap, &Record::Gap { records: lost });
            self.seen_dropped = t.dropped;
        }
        fill_checksums(&mut t.bytes);
        let mut ok = true;
        if !gap.is_empty() || !t.bytes.is_empty() {
            ok = self.append(&gap, &t.bytes, t.records + u64::from(lost > 0));
        }
        let mut asked = Vec::new();
        let mut asked_snapshot = Vec::new();
        for (ack, snapshot) in t.acks.drain(..) {
            if snapshot {
                asked_snapshot.push(ack);
            } else {
                asked.push(ack);
            }
        }
        let journal_bytes = self.stats(|s| s.journal_bytes);
        if lost > 0 || !ok || self.snapshot_due(journal_bytes) || !asked_snapshot.is_empty() {
            self.snapshot(asked_snapshot);
        }
        for a in asked {
            let _ = a.send(());
        }
        if t.stop {
            while self.running.is_some() {
                self.poll_snapshot(true);
            }
        }
        t.stop
    }

    /// Whether the journal has grown enough since the last snapshot for the next: by
    /// `snapshot_after_bytes`, and by `snapshot_growth_percent` of that snapshot's size.
    fn snapshot_due(&self, journal_bytes: u64) -> bool {
        let relative = (u128::from(self.last_snapshot_bytes)
            * u128::from(self.cfg.snapshot_growth_percent)
            / 100)
            .min(u128::from(u64::MAX)) as u64;
        journal_bytes >= self.cfg.snapshot_after_bytes.max(relative)
    }

    fn stats<T>(&self, f: impl FnOnce(&mut StateStats) -> T) -> T {
        f(&mut self.stats.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn journal_name(n: u64) -> String {
        format!("journal-{n}.kvr")
    }

    /// Appends `records` records (`gap`, then the staged frames `bytes`) to the current
    /// segment and syncs; false (counted, logged by the host through the stats) when the
    /// write failed: the segment is left as it is (a restart stops at its torn end) and
    /// the next write goes to a new one after a snapshot.
    fn append(&mut self, gap: &[u8], bytes: &[u8], records: u64) -> bool {
        let mut header = Vec::new();
        if self.journal.is_none() {
            let path = self.cfg.dir.join(Self::journal_name(self.segment));
            match self.io.open_append(&path) {
                Ok(j) => {
                    if j.is_empty() {
                        header = journal::header_frame(&self.identity);
                    }
                    self.journal = Some(j);
                }
                Err(_) => {
                    self.stats(|s| s.write_failures += 1);
                    return false;
                }
            }
        }
        let j = self.journal.as_mut().expect("opened above");
        let bufs: Vec<&[u8]> = [&header[..], gap, bytes]
            .into_iter()
            .filter(|b| !b.is_empty())
            .collect();
        match self.io.append(j, &bufs) {
            Ok(()) => {
                let n = (gap.len() + bytes.len()) as u64;
                self.stats(|s| {
                    s.records_written += records;
                    s.bytes_written += n;
                    s.journal_bytes += n;
                    s.syncs += 1;
                });
                true
            }
            Err(_) => {
                self.journal = None;
                self.segment += 1;
                self.stats(|s| s.write_failures += 1);
                false
            }
        }
    }

    /// Starts a new segment and a snapshot of the index into `snapshot-<segment>`, taken
    /// beside the writer (`crate::snapshotter`); `acks` are answered when it is on disk.
    /// While one runs, the request is served by the next (started when it ends). On
    /// failure the older files stay (they still restore) and the failure is counted.
    fn snapshot(&mut self, acks: Vec<SyncSender<()>>) {
        if self.running.is_some() {
            self.again = true;
            self.waiting.extend(acks);
            return;
        }
        let Some(p) = self.partition.upgrade() else {
            for a in acks {
                let _ = a.send(());
            }
            return;
        };
        // Everything journaled so far was applied before now: the snapshot holds it.
        self.journal = None;
        self.segment += 1;
        self.stats(|s| s.journal_bytes = 0);
        let marks: Vec<StreamResume> = self.marks.values().cloned().collect();
        let mode = match self.io.backend() {
            Backend::Uring => IoMode::Uring,
            Backend::Plain => IoMode::Plain,
        };
        self.running = Some(Running::start(
            p,
            marks,
            self.cfg.dir.clone(),
            mode,
            self.segment,
            acks,
        ));
    }

    /// Collects a finished snapshot (and starts the one asked for meanwhile); `wait`:
    /// waits for the one running.
    fn poll_snapshot(&mut self, wait: bool) {
        let done = match &self.running {
            Some(r) => wait || r.is_finished(),
            None => false,
        };
        if !done {
            return;
        }
        let (blocks, acks) = self.running.take().expect("checked").finish();
        match blocks {
            Some((blocks, bytes)) => {
                self.last_snapshot_bytes = bytes;
                self.stats(|s| {
                    s.snapshots += 1;
                    s.snapshot_blocks = blocks;
                });
            }
            None => self.stats(|s| s.snapshot_failures += 1),
        }
        for a in acks {
            let _ = a.send(());
        }
        if std::mem::take(&mut self.again) {
            let acks = std::mem::take(&mut self.waiting);
            self.snapshot(acks);
        }
    }
}
