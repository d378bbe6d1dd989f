//! What the ingesting threads hand the journal's writer: records framed already, appended
//! to one byte buffer under a short lock, which the writer swaps for an empty one at each
//! group commit. An ingesting thread never waits for the writer or the disk (the lock is
//! held only for a copy or a swap), and the writer does no work per record beyond the
//! frames' checksums, which it fills in (the ingesting threads leave them zero).
//!
//! Bounded: past `cap` records staged, what comes is dropped and counted, and the writer
//! then records a gap and takes a snapshot.

use std::sync::mpsc::SyncSender;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvr::WorkerId;

use crate::frame::FRAME_HEAD;

/// What the writer needs to know of a record besides its bytes: a stream's place (what a
/// snapshot stores), or a worker gone.
pub(crate) enum Note {
    /// A stream batch: its stream, sequence number, digest, and the DP ranks its events
    /// named (`ranks[from..to]` of the staged ranks).
    Batch {
        worker_id: WorkerId,
        stream: u32,
        seq: u64,
        digest: u64,
        from: u32,
        to: u32,
    },
    Removed(WorkerId),
}

/// The records staged since the last swap, and what the writer is asked to do.
#[derive(Default)]
pub(crate) struct Staged {
    /// Frames, their checksums not filled in yet.
    pub bytes: Vec<u8>,
    pub records: u64,
    pub notes: Vec<Note>,
    pub ranks: Vec<u32>,
    /// Flushes waiting: answered once what came before is durable (`true`: after a
    /// snapshot taken then).
    pub acks: Vec<(SyncSender<()>, bool)>,
    /// Stop after what came before (`true`: waiting for a running snapshot first).
    pub stop: bool,
    /// Events handed over and dropped so far (they only grow).
    pub queued: u64,
    pub dropped: u64,
}

struct Inner {
    staged: Staged,
    /// The writer waits for work: the next record has to wake it.
    idle: bool,
    /// Nothing is staged any more (closed, or the log dropped): what comes is dropped.
    closed: bool,
}

/// The buffer the ingesting threads and the writer share.
pub(crate) struct Stage {
    inner: Mutex<Inner>,
    wake: Condvar,
    cap: u64,
}

impl Stage {
    pub(crate) fn new(cap: usize) -> Stage {
        Stage {
            inner: Mutex::new(Inner {
                staged: Staged::default(),
                idle: false,
                closed: false,
            }),
            wake: Condvar::new(),
            cap: cap.max(1) as u64,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stages one record of `events` events: `put` appends its frame (and may push its
    /// ranks) and says what the writer must know of it (`Err`: it appended nothing, the
    /// record cannot be journaled). Dropped and counted when `cap` records wait already
    /// or the writer has stopped.
    pub(crate) fn push(
        &self,
        events: u64,
        put: impl FnOnce(&mut Vec<u8>, &mut Vec<u32>) -> Result<Option<Note>, ()>,
    ) {
        let mut g = self.lock();
        g.staged.queued += events;
        if g.closed || g.staged.records >= self.cap {
            g.staged.dropped += events;
            return;
        }
        let s = &mut g.staged;
        match put(&mut s.bytes, &mut s.ranks) {
            Ok(note) => {
                s.records += 1;
                s.notes.extend(note);
            }
            Err(()) => {
                s.dropped += events;
                return;
            }
        }
        if g.idle {
            g.idle = false;
            self.wake.notify_one();
        }
    }

    /// Asks the writer to flush (and snapshot when `snapshot`); false when it has stopped.
    pub(crate) fn ask(&self, ack: SyncSender<()>, snapshot: bool) -> bool {
        let mut g = self.lock();
        if g.closed {
            return false;
        }
        g.staged.acks.push((ack, snapshot));
        self.wake.notify_one();
        true
    }

    /// Stops taking records, and asks the writer to stop after what came before.
    pub(crate) fn close(&self) {
        let mut g = self.lock();
        g.closed = true;
        g.staged.stop = true;
        self.wake.notify_one();
    }

    /// The writer has ended: nothing is staged any more, and whoever waits for it hears
    /// so (their acks are dropped).
    pub(crate) fn writer_gone(&self) {
        let mut g = self.lock();
        g.closed = true;
        g.staged.acks.clear();
    }

    /// Events handed over and dropped so far.
    pub(crate) fn counts(&self) -> (u64, u64) {
        let g = self.lock();
        (g.staged.queued, g.staged.dropped)
    }

    /// Waits up to `timeout` for work: records, a request, or a loss since `seen_dropped`.
    pub(crate) fn wait_work(&self, timeout: Duration, seen_dropped: u64) -> bool {
        let has =
            |s: &Staged| s.records > 0 || !s.acks.is_empty() || s.stop || s.dropped != seen_dropped;
        let mut g = self.lock();
        if !has(&g.staged) {
            g.idle = true;
            g = self
                .wake
                .wait_timeout(g, timeout)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            g.idle = false;
        }
        has(&g.staged)
    }

    /// Waits until `deadline` (the group commit), or less when someone waits for the
    /// writer. Records do not wake it (their senders never pay for a wake-up).
    pub(crate) fn wait_until(&self, deadline: Instant) {
        let mut g = self.lock();
        loop {
            if !g.staged.acks.is_empty() || g.staged.stop {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            g = self
                .wake
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Takes what is staged into `out` (emptied first; its buffers become the next
    /// ones to stage into, so no allocation once they have grown).
    pub(crate) fn take(&self, out: &mut Staged) {
        out.bytes.clear();
        out.notes.clear();
        out.ranks.clear();
        out.acks.clear();
        let mut g = self.lock();
        let s = &mut g.staged;
        std::mem::swap(&mut s.bytes, &mut out.bytes);
        std::mem::swap(&mut s.notes, &mut out.notes);
        std::mem::swap(&mut s.ranks, &mut out.ranks);
        std::mem::swap(&mut s.acks, &mut out.acks);
        out.records = std::mem::take(&mut s.records);
        out.stop = std::mem::take(&mut s.stop);
        out.queued = s.queued;
        out.dropped = s.dropped;
    }
}

/// Fills in the checksum of each frame in `bytes` (whole frames, as staged).
pub(crate) fn fill_checksums(bytes: &mut [u8]) {
    let mut at = 0;
    while at + FRAME_HEAD <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
        let end = at + FRAME_HEAD + len;
        let crc = crc32fast::hash(&bytes[at + FRAME_HEAD..end]);
        bytes[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
        at = end;
    }
}
