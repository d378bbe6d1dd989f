//! The journal's writer: what the partition's index applies is handed, event by event, to
//! a writer thread through a bounded queue; the thread groups events into records, appends
//! them (one durable sync per drain of the queue) and takes a snapshot when the journal
//! has grown, after a loss, and at shutdown.
//!
//! Ingest never waits for the disk: when the queue is full the event is dropped and
//! counted, and the writer then records a `Gap` (a restart stops reading there, with the
//! state before it, which is a true prefix) and takes a snapshot, which supersedes it.
//!
//! Files of one partition, in its own directory ([`crate::config::partition_dir`]): `journal-N.kvr`
//! segments and `snapshot-N.kvr`, the snapshot taken when segment `N` began (so it holds
//! at least everything of the segments before `N`). A snapshot is written aside and
//! renamed; only then are the older files removed. A restart reads the newest snapshot
//! and the segments from its number on ([`crate::restore`](mod@crate::restore)).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvr::{AppliedLog, KvEvent, Origin, Partition, RankId, StreamResume, WorkerId};

use crate::config::StateConfig;
use crate::format::Identity;
use crate::frame::put_frame;
use crate::io::{AppendFile, Backend, Io, IoMode};
use crate::journal::{self, BatchPayload, OwnedEvent, Record};
use crate::snapshotter::Running;

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

#[derive(Default)]
struct Counters {
    queued: AtomicU64,
    dropped: AtomicU64,
    stats: Mutex<StateStats>,
}

enum Msg {
    /// An event a host applied itself (no stream).
    Direct(RankId, OwnedEvent),
    /// A stream batch, whole: its record's payload, encoded on the ingesting thread.
    Batch(EncodedBatch),
    /// Stop after what came before.
    Stop,
    Cleared(WorkerId, Vec<u32>),
    Removed(WorkerId),
    /// Write what came before; then take a snapshot (`true`) or not; answer when done.
    Flush(SyncSender<()>, bool),
}

/// A partition's journal and snapshots: attach it with
/// [`Partition::attach_applied_log`] (after restoring, [`crate::restore()`]).
pub struct StateLog {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// What the ingesting threads share with the writer: the queue and the counters.
struct Shared {
    tx: SyncSender<Msg>,
    spare: Arc<Spare>,
    /// Set by `close`: what comes after is dropped (and counted), not queued.
    closed: AtomicBool,
    counters: Arc<Counters>,
}

/// Buffers kept for reuse, at most, and the largest kept.
const SPARE_BUFFERS: usize = 1024;
const SPARE_BYTES: usize = 64 << 10;

/// Payload buffers the writer is done with, for the next batches: no allocation per
/// batch, and no buffer freed by another thread than the one that allocated it.
#[derive(Default)]
struct Spare(Mutex<Vec<Vec<u8>>>);

impl Spare {
    fn take(&self) -> Vec<u8> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default()
    }

    fn give_back(&self, bufs: impl Iterator<Item = Vec<u8>>) {
        let mut spare = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for b in bufs {
            if spare.len() >= SPARE_BUFFERS {
                break;
            }
            if b.capacity() <= SPARE_BYTES {
                spare.push(b);
            }
        }
    }
}

impl Shared {
    /// Queues `m` (`events` events) without waiting: dropped and counted when the queue
    /// is full or the writer has stopped.
    fn send(&self, m: Msg, events: u64) {
        self.counters.queued.fetch_add(events, Ordering::Relaxed);
        let sent = !self.closed.load(Ordering::Relaxed) && self.tx.try_send(m).is_ok();
        if !sent {
            self.counters.dropped.fetch_add(events, Ordering::Relaxed);
        }
    }
}

/// A stream batch as the writer receives it.
struct EncodedBatch {
    worker_id: WorkerId,
    stream: u32,
    seq: u64,
    digest: u64,
    /// The DP ranks its events named (the first inline: one allocation-free case).
    first_rank: u32,
    more_ranks: Vec<u32>,
    payload: Vec<u8>,
}

/// The stream batch an ingesting thread is applying: its events encoded as they come, so
/// that the queue takes one message (one buffer) per batch.
struct Pending {
    shared: Arc<Shared>,
    origin: Origin,
    payload: BatchPayload,
    first_rank: Option<u32>,
    more_ranks: Vec<u32>,
}

impl Pending {
    fn new(shared: Arc<Shared>, origin: Origin) -> Option<Pending> {
        let Origin::Stream {
            worker_id,
            stream,
            seq,
            digest,
        } = origin
        else {
            return None;
        };
        let buf = shared.spare.take();
        Some(Pending {
            shared,
            origin,
            payload: BatchPayload::new(worker_id, stream, seq, digest, buf),
            first_rank: None,
            more_ranks: Vec::new(),
        })
    }

    fn push(&mut self, rank: RankId, e: &KvEvent<'_>) {
        self.payload.push(rank, e);
        match self.first_rank {
            None => self.first_rank = Some(rank.dp_rank),
            Some(r) if r == rank.dp_rank || self.more_ranks.contains(&rank.dp_rank) => {}
            Some(_) => self.more_ranks.push(rank.dp_rank),
        }
    }

    fn send(self) {
        let Origin::Stream {
            worker_id,
            stream,
            seq,
            digest,
        } = self.origin
        else {
            return;
        };
        let (payload, n) = self.payload.finish();
        let b = EncodedBatch {
            worker_id,
            stream,
            seq,
            digest,
            first_rank: self.first_rank.unwrap_or(0),
            more_ranks: self.more_ranks,
            payload,
        };
        self.shared.send(Msg::Batch(b), u64::from(n));
    }
}

thread_local! {
    static PENDING: std::cell::RefCell<Option<Pending>> = const { std::cell::RefCell::new(None) };
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
        let (tx, rx) = mpsc::sync_channel(cfg.queue_messages.max(1));
        let counters = Arc::new(Counters::default());
        let spare = Arc::new(Spare::default());
        let w = Writer {
            partition: Arc::downgrade(partition),
            identity: Identity::of(partition),
            cfg,
            io,
            counters: counters.clone(),
            spare: spare.clone(),
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
            buf: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("kvr-state".into())
            .spawn(move || w.run(rx))?;
        Ok(Arc::new(StateLog {
            shared: Arc::new(Shared {
                tx,
                spare: spare.clone(),
                closed: AtomicBool::new(false),
                counters,
            }),
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// Sends this thread's gathered batch first, if it is this log's (what follows must
    /// come after it).
    fn flush_pending(&self) {
        let p = PENDING.with(|p| {
            let mut p = p.borrow_mut();
            match &*p {
                Some(x) if Arc::ptr_eq(&x.shared, &self.shared) => p.take(),
                _ => None,
            }
        });
        if let Some(p) = p {
            p.send();
        }
    }

    fn send(&self, m: Msg) {
        self.flush_pending();
        self.shared.send(m, 1);
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
        if self.shared.closed.load(Ordering::Relaxed) {
            return false;
        }
        let (ack, done) = mpsc::sync_channel(1);
        self.shared.tx.send(Msg::Flush(ack, snapshot)).is_ok() && done.recv().is_ok()
    }

    /// Writes what is queued, takes a final snapshot and stops the writer (a graceful
    /// shutdown: the next start needs no journal). Events after this are dropped.
    pub fn close(&self) {
        self.snapshot_now();
        if !self.shared.closed.swap(true, Ordering::Relaxed) {
            let _ = self.shared.tx.send(Msg::Stop);
        }
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }

    /// The writer's counters now.
    pub fn stats(&self) -> StateStats {
        let mut s = *self
            .shared
            .counters
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        s.events_queued = self.shared.counters.queued.load(Ordering::Relaxed);
        s.events_dropped = self.shared.counters.dropped.load(Ordering::Relaxed);
        s
    }
}

impl AppliedLog for StateLog {
    fn applied(&self, origin: Origin, rank: RankId, event: &KvEvent<'_>) {
        if matches!(origin, Origin::Direct) {
            return self.send(Msg::Direct(rank, OwnedEvent::of(event)));
        }
        // A stream batch's events are encoded on this thread until its end.
        let pushed = PENDING.with(|p| match &mut *p.borrow_mut() {
            Some(x) if x.origin == origin && Arc::ptr_eq(&x.shared, &self.shared) => {
                x.push(rank, event);
                true
            }
            _ => false,
        });
        if pushed {
            return;
        }
        let Some(mut fresh) = Pending::new(self.shared.clone(), origin) else {
            return;
        };
        fresh.push(rank, event);
        let other = PENDING.with(|p| p.borrow_mut().replace(fresh));
        // Another batch was still gathered (its end never came): it goes as it is.
        if let Some(o) = other {
            o.send();
        }
    }
    fn batch_end(&self, origin: Origin) {
        let p = PENDING.with(|p| {
            let mut p = p.borrow_mut();
            match &*p {
                Some(x) if x.origin == origin && Arc::ptr_eq(&x.shared, &self.shared) => p.take(),
                _ => None,
            }
        });
        // Nothing of it applied: nothing to journal.
        if let Some(p) = p {
            p.send();
        }
    }
    fn cleared(&self, worker: WorkerId, dp_ranks: &[u32]) {
        self.send(Msg::Cleared(worker, dp_ranks.to_vec()));
    }
    fn worker_removed(&self, worker: WorkerId) {
        self.send(Msg::Removed(worker));
    }
}

/// What one append writes, in order: records, or batch payloads encoded already.
enum Piece {
    Record(Record),
    Payload(Vec<u8>),
}

/// The writer thread's state.
struct Writer {
    partition: Weak<Partition>,
    identity: Identity,
    cfg: StateConfig,
    io: Io,
    counters: Arc<Counters>,
    spare: Arc<Spare>,
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
    /// `counters.dropped` when a gap was last recorded.
    seen_dropped: u64,
    buf: Vec<u8>,
}

/// Messages taken from the queue per append (one durable sync each), at most.
const DRAIN: usize = 16_384;

impl Writer {
    fn run(mut self, rx: Receiver<Msg>) {
        // The journal starts from what the index holds now (restored or empty).
        self.snapshot(Vec::new());
        let mut msgs = Vec::with_capacity(DRAIN);
        let mut last_write = Instant::now();
        loop {
            self.poll_snapshot(false);
            let idle = if self.running.is_some() { 5 } else { 200 };
            match rx.recv_timeout(Duration::from_millis(idle)) {
                Ok(m) => msgs.push(m),
                Err(RecvTimeoutError::Timeout) => {
                    // A loss with nothing queued since still needs its gap and snapshot.
                    if self.counters.dropped.load(Ordering::Relaxed) != self.seen_dropped
                        && self.write(&mut msgs)
                    {
                        return;
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
            // Group commit: what arrives within `sync_every` of the last write goes in
            // the next one (one write, one sync), unless someone waits for it. The
            // writer sleeps meanwhile rather than waiting on the queue, so that senders
            // never have to wake it.
            let waited_for = |m: &Msg| matches!(m, Msg::Flush(..) | Msg::Stop);
            if !msgs.iter().any(waited_for) {
                let deadline = last_write + self.cfg.sync_every;
                let now = Instant::now();
                if deadline > now {
                    std::thread::sleep(deadline - now);
                }
            }
            while msgs.len() < DRAIN {
                match rx.try_recv() {
                    Ok(m) => msgs.push(m),
                    Err(_) => break,
                }
            }
            if self.write(&mut msgs) {
                return;
            }
            last_write = Instant::now();
        }
    }

    /// Appends `msgs` as records, then snapshots when one is due or asked for; true
    /// when asked to stop.
    fn write(&mut self, msgs: &mut Vec<Msg>) -> bool {
        let mut records: Vec<Piece> = Vec::new();
        let mut asked = Vec::new();
        let mut asked_snapshot = Vec::new();
        let mut stop = false;
        let dropped = self.counters.dropped.load(Ordering::Relaxed);
        let lost = dropped.wrapping_sub(self.seen_dropped);
        for m in msgs.drain(..) {
            match m {
                Msg::Direct(rank, e) => {
                    if let Some(Piece::Record(Record::Direct { events })) = records.last_mut() {
                        events.push((rank, e));
                    } else {
                        records.push(Piece::Record(Record::Direct {
                            events: vec![(rank, e)],
                        }));
                    }
                }
                Msg::Batch(b) => {
                    self.note_batch(&b);
                    records.push(Piece::Payload(b.payload));
                }
                Msg::Stop => stop = true,
                Msg::Cleared(worker_id, dp_ranks) => records.push(Piece::Record(Record::Clear {
                    worker_id,
                    dp_ranks,
                })),
                Msg::Removed(worker_id) => {
                    self.marks.retain(|k, _| k.0 != worker_id);
                    records.push(Piece::Record(Record::Removed { worker_id }));
                }
                Msg::Flush(ack, true) => asked_snapshot.push(ack),
                Msg::Flush(ack, false) => asked.push(ack),
            }
        }
        // Dropped events were applied before the ones queued after them: the gap goes
        // first, and what follows it is not read at a restart (the snapshot below is).
        if lost > 0 {
            records.insert(0, Piece::Record(Record::Gap { records: lost }));
            self.seen_dropped = dropped;
        }
        let mut ok = true;
        if !records.is_empty() {
            ok = self.append(&records);
        }
        self.spare
            .give_back(records.into_iter().filter_map(|p| match p {
                Piece::Payload(b) => Some(b),
                Piece::Record(_) => None,
            }));
        let due = self.stats(|s| s.journal_bytes) >= self.cfg.snapshot_after_bytes;
        if lost > 0 || !ok || due || !asked_snapshot.is_empty() {
            self.snapshot(asked_snapshot);
        }
        for a in asked {
            let _ = a.send(());
        }
        if stop {
            while self.running.is_some() {
                self.poll_snapshot(true);
            }
        }
        stop
    }

    /// Notes a stream batch as the stream's place (what a snapshot stores).
    fn note_batch(&mut self, b: &EncodedBatch) {
        crate::restore::note_place(
            &mut self.marks,
            (b.worker_id, b.stream),
            (b.seq, b.digest),
            std::iter::once(b.first_rank).chain(b.more_ranks.iter().copied()),
        );
    }

    fn stats<T>(&self, f: impl FnOnce(&mut StateStats) -> T) -> T {
        f(&mut self
            .counters
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner()))
    }

    fn journal_name(n: u64) -> String {
        format!("journal-{n}.kvr")
    }

    /// Appends records to the current segment and syncs; false (counted, logged by the
    /// host through the stats) when the write failed: the segment is left as it is (a
    /// restart stops at its torn end) and the next write goes to a new one after a
    /// snapshot.
    fn append(&mut self, records: &[Piece]) -> bool {
        self.buf.clear();
        for r in records {
            match r {
                Piece::Record(r) => journal::put_record(&mut self.buf, r),
                Piece::Payload(p) => put_frame(&mut self.buf, p),
            }
        }
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
        match self.io.append(j, &[&header, &self.buf]) {
            Ok(()) => {
                let n = self.buf.len() as u64;
                self.stats(|s| {
                    s.records_written += records.len() as u64;
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
            Some(blocks) => self.stats(|s| {
                s.snapshots += 1;
                s.snapshot_blocks = blocks;
            }),
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
