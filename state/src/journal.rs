//! The journal: what the index applied since the last snapshot, batch by batch, so that a
//! restart replays it on top of the snapshot.
//!
//! After the header frame ([`crate::format`], kind `Journal`), one frame per record: a
//! batch a stream applied (its worker, stream, sequence number, and each event with its
//! rank, in the index's own terms: local and engine hashes, not tokens), or ranks cleared.
//! Unlike a snapshot, a journal is read up to its first bad frame: a torn tail (the
//! process killed mid-write) is cut there and what came before is kept.

use kvr::{KvEvent, RankId, StoredBlock, Tier};

use crate::format::{self, FileError, Identity, Kind, Reader, Writer};
use crate::frame::{put_frame, FrameStop, FRAME_HEAD, MAX_FRAME};

const TAG_BATCH: u8 = 1;
const TAG_CLEAR: u8 = 2;
const TAG_DIRECT: u8 = 3;
const TAG_REMOVED: u8 = 4;
const TAG_GAP: u8 = 5;

/// An event with its lists owned (a journal record outlives the batch it came from).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OwnedEvent {
    Stored {
        tier: Tier,
        parent: Option<u64>,
        blocks: Vec<StoredBlock>,
    },
    StoredKnown {
        tier: Tier,
        external_hashes: Vec<u64>,
    },
    Removed {
        tier: Tier,
        external_hashes: Vec<u64>,
    },
    Cleared,
    StatesStored {
        tier: Tier,
        external_hashes: Vec<u64>,
    },
    StatesRemoved {
        tier: Tier,
        external_hashes: Vec<u64>,
    },
}

impl OwnedEvent {
    pub fn of(e: &KvEvent<'_>) -> Self {
        match *e {
            KvEvent::Stored {
                tier,
                parent,
                blocks,
            } => OwnedEvent::Stored {
                tier,
                parent,
                blocks: blocks.to_vec(),
            },
            KvEvent::StoredKnown {
                tier,
                external_hashes,
            } => OwnedEvent::StoredKnown {
                tier,
                external_hashes: external_hashes.to_vec(),
            },
            KvEvent::Removed {
                tier,
                external_hashes,
            } => OwnedEvent::Removed {
                tier,
                external_hashes: external_hashes.to_vec(),
            },
            KvEvent::Cleared => OwnedEvent::Cleared,
            KvEvent::StatesStored {
                tier,
                external_hashes,
            } => OwnedEvent::StatesStored {
                tier,
                external_hashes: external_hashes.to_vec(),
            },
            KvEvent::StatesRemoved {
                tier,
                external_hashes,
            } => OwnedEvent::StatesRemoved {
                tier,
                external_hashes: external_hashes.to_vec(),
            },
        }
    }

    /// The event, borrowing this one's lists.
    pub fn as_event(&self) -> KvEvent<'_> {
        match self {
            OwnedEvent::Stored {
                tier,
                parent,
                blocks,
            } => KvEvent::Stored {
                tier: *tier,
                parent: *parent,
                blocks,
            },
            OwnedEvent::StoredKnown {
                tier,
                external_hashes,
            } => KvEvent::StoredKnown {
                tier: *tier,
                external_hashes,
            },
            OwnedEvent::Removed {
                tier,
                external_hashes,
            } => KvEvent::Removed {
                tier: *tier,
                external_hashes,
            },
            OwnedEvent::Cleared => KvEvent::Cleared,
            OwnedEvent::StatesStored {
                tier,
                external_hashes,
            } => KvEvent::StatesStored {
                tier: *tier,
                external_hashes,
            },
            OwnedEvent::StatesRemoved {
                tier,
                external_hashes,
            } => KvEvent::StatesRemoved {
                tier: *tier,
                external_hashes,
            },
        }
    }
}

/// One journal record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A batch a stream applied, each event with its rank.
    Batch {
        worker_id: u64,
        stream: u32,
        seq: u64,
        /// The digest of the batch's payload (what a resumed stream verifies).
        digest: u64,
        events: Vec<(RankId, OwnedEvent)>,
    },
    /// Events a host applied itself (no stream: its own calls, a peer's dump).
    Direct { events: Vec<(RankId, OwnedEvent)> },
    /// `worker`'s DP ranks `dp_ranks` were cleared (all of its ranks when empty).
    Clear { worker_id: u64, dp_ranks: Vec<u32> },
    /// `worker` was removed: its blocks and its streams' places are gone.
    Removed { worker_id: u64 },
    /// The writer dropped `records` records here (its queue was full): what follows does
    /// not continue the state before it; only a snapshot taken after it does.
    Gap { records: u64 },
}

/// The journal's header frame, to start a file with.
pub fn header_frame(id: &Identity) -> Vec<u8> {
    let mut out = Vec::new();
    put_frame(&mut out, &format::header(Kind::Journal, id));
    out
}

fn put_hashes(w: &mut Writer, tier: Tier, hashes: &[u64]) {
    w.tier(tier);
    w.u32(hashes.len() as u32);
    for h in hashes {
        w.u64(*h);
    }
}

/// Writes each event with its rank.
fn put_events(w: &mut Writer, events: &[(RankId, OwnedEvent)]) {
    w.u32(events.len() as u32);
    for (rank, e) in events {
        put_event(w, *rank, &e.as_event());
    }
}

/// Writes one event with its rank.
fn put_event(w: &mut Writer, rank: RankId, e: &KvEvent<'_>) {
    w.u64(rank.worker_id);
    w.u32(rank.dp_rank);
    match *e {
        KvEvent::Stored {
            tier,
            parent,
            blocks,
        } => {
            w.u8(1);
            w.tier(tier);
            w.u8(u8::from(parent.is_some()));
            w.u64(parent.unwrap_or(0));
            w.blocks(blocks);
        }
        KvEvent::StoredKnown {
            tier,
            external_hashes,
        } => {
            w.u8(2);
            put_hashes(w, tier, external_hashes);
        }
        KvEvent::Removed {
            tier,
            external_hashes,
        } => {
            w.u8(3);
            put_hashes(w, tier, external_hashes);
        }
        KvEvent::Cleared => w.u8(4),
        KvEvent::StatesStored {
            tier,
            external_hashes,
        } => {
            w.u8(5);
            put_hashes(w, tier, external_hashes);
        }
        KvEvent::StatesRemoved {
            tier,
            external_hashes,
        } => {
            w.u8(6);
            put_hashes(w, tier, external_hashes);
        }
    }
}

/// A stream batch's record payload, built event by event as the events are applied (on
/// the ingesting thread: one buffer per batch, no copy of each event's lists). The same
/// bytes as [`put_record`] of the equivalent [`Record::Batch`] puts in its frame.
#[derive(Debug)]
pub struct BatchPayload {
    w: Writer,
    events: u32,
    /// Where the payload starts in the buffer (after a frame head left for the writer).
    start: usize,
}

/// Where the event count sits in a batch payload (after tag, worker, stream, seq, digest).
const COUNT_AT: usize = 1 + 8 + 4 + 8 + 8;

impl BatchPayload {
    /// A payload for batch `seq` of `worker_id`'s stream `stream`, written into `buf`
    /// (cleared; a buffer used before keeps its allocation).
    pub fn new(worker_id: u64, stream: u32, seq: u64, digest: u64, buf: Vec<u8>) -> Self {
        Self::at(worker_id, stream, seq, digest, buf, 0)
    }

    /// The same, after room for its frame head ([`BatchPayload::finish_frame`]).
    pub(crate) fn framed(worker_id: u64, stream: u32, seq: u64, digest: u64, buf: Vec<u8>) -> Self {
        Self::at(worker_id, stream, seq, digest, buf, FRAME_HEAD)
    }

    fn at(
        worker_id: u64,
        stream: u32,
        seq: u64,
        digest: u64,
        mut buf: Vec<u8>,
        start: usize,
    ) -> Self {
        buf.clear();
        if buf.capacity() == 0 {
            buf.reserve(1024);
        }
        buf.resize(start, 0);
        let mut w = Writer(buf);
        w.u8(TAG_BATCH);
        w.u64(worker_id);
        w.u32(stream);
        w.u64(seq);
        w.u64(digest);
        w.u32(0);
        BatchPayload {
            w,
            events: 0,
            start,
        }
    }

    pub fn push(&mut self, rank: RankId, e: &KvEvent<'_>) {
        put_event(&mut self.w, rank, e);
        self.events += 1;
    }

    fn put_count(&mut self) {
        let at = self.start + COUNT_AT;
        self.w.0[at..at + 4].copy_from_slice(&self.events.to_le_bytes());
    }

    /// The payload (to frame with [`put_frame`]) and its event count.
    pub fn finish(mut self) -> (Vec<u8>, u32) {
        self.put_count();
        (self.w.0, self.events)
    }

    /// A payload made by [`BatchPayload::framed`]: its frame, the checksum left zero (to
    /// fill in before it is written), its event count, and whether it fits in a frame
    /// (over [`MAX_FRAME`] it cannot be journaled: the caller counts it as lost).
    pub(crate) fn finish_frame(mut self) -> (Vec<u8>, u32, bool) {
        self.put_count();
        let len = self.w.0.len() - FRAME_HEAD;
        self.w.0[..4].copy_from_slice(&(len as u32).to_le_bytes());
        self.w.0[4..8].fill(0);
        (self.w.0, self.events, len <= MAX_FRAME)
    }
}

/// Appends a `Direct` record of one event, as one frame whose checksum is left zero (to
/// fill in before it is written); false (nothing appended) when it is over [`MAX_FRAME`].
pub(crate) fn put_direct_unsummed(out: &mut Vec<u8>, rank: RankId, e: &KvEvent<'_>) -> bool {
    let head = out.len();
    out.resize(head + FRAME_HEAD, 0);
    let mut w = Writer(std::mem::take(out));
    w.u8(TAG_DIRECT);
    w.u32(1);
    put_event(&mut w, rank, e);
    *out = w.0;
    let len = out.len() - head - FRAME_HEAD;
    if len > MAX_FRAME {
        out.truncate(head);
        return false;
    }
    out[head..head + 4].copy_from_slice(&(len as u32).to_le_bytes());
    true
}

/// About the bytes `rec`'s events take (to size its buffer once).
fn events_bytes(rec: &Record) -> usize {
    let events = match rec {
        Record::Batch { events, .. } | Record::Direct { events } => events,
        _ => return 16,
    };
    events
        .iter()
        .map(|(_, e)| {
            24 + match e {
                OwnedEvent::Stored { blocks, .. } => blocks.len() * 16,
                OwnedEvent::StoredKnown {
                    external_hashes, ..
                }
                | OwnedEvent::Removed {
                    external_hashes, ..
                }
                | OwnedEvent::StatesStored {
                    external_hashes, ..
                }
                | OwnedEvent::StatesRemoved {
                    external_hashes, ..
                } => external_hashes.len() * 8,
                OwnedEvent::Cleared => 0,
            }
        })
        .sum()
}

/// Appends `rec` to `out` as one frame.
pub fn put_record(out: &mut Vec<u8>, rec: &Record) {
    let mut w = Writer(Vec::with_capacity(32 + events_bytes(rec)));
    match rec {
        Record::Batch {
            worker_id,
            stream,
            seq,
            digest,
            events,
        } => {
            w.u8(TAG_BATCH);
            w.u64(*worker_id);
            w.u32(*stream);
            w.u64(*seq);
            w.u64(*digest);
            put_events(&mut w, events);
        }
        Record::Direct { events } => {
            w.u8(TAG_DIRECT);
            put_events(&mut w, events);
        }
        Record::Removed { worker_id } => {
            w.u8(TAG_REMOVED);
            w.u64(*worker_id);
        }
        Record::Gap { records } => {
            w.u8(TAG_GAP);
            w.u64(*records);
        }
        Record::Clear {
            worker_id,
            dp_ranks,
        } => {
            w.u8(TAG_CLEAR);
            w.u64(*worker_id);
            w.u32(dp_ranks.len() as u32);
            for d in dp_ranks {
                w.u32(*d);
            }
        }
    }
    put_frame(out, &w.0);
}

fn hashes(r: &mut Reader<'_>) -> Option<(Tier, Vec<u64>)> {
    let tier = r.tier()?;
    let n = r.u32()? as usize;
    if n.checked_mul(8)? > r.left() {
        return None;
    }
    Some((
        tier,
        (0..n).map(|_| r.u64().expect("length checked")).collect(),
    ))
}

/// Reads events with their ranks (a corrupt count cannot allocate much).
fn events(r: &mut Reader<'_>) -> Option<Vec<(RankId, OwnedEvent)>> {
    let n = r.u32()? as usize;
    // Each event takes at least 13 bytes: a corrupt count cannot allocate much.
    if n.checked_mul(13)? > r.left() {
        return None;
    }
    let mut events = Vec::with_capacity(n);
    for _ in 0..n {
        let rank = RankId::new(r.u64()?, r.u32()?);
        let e = match r.u8()? {
            1 => {
                let tier = r.tier()?;
                let has = r.u8()?;
                let parent = r.u64()?;
                let blocks = r.blocks(usize::MAX)?;
                OwnedEvent::Stored {
                    tier,
                    parent: (has == 1).then_some(parent),
                    blocks,
                }
            }
            2 => {
                let (tier, external_hashes) = hashes(r)?;
                OwnedEvent::StoredKnown {
                    tier,
                    external_hashes,
                }
            }
            3 => {
                let (tier, external_hashes) = hashes(r)?;
                OwnedEvent::Removed {
                    tier,
                    external_hashes,
                }
            }
            4 => OwnedEvent::Cleared,
            5 => {
                let (tier, external_hashes) = hashes(r)?;
                OwnedEvent::StatesStored {
                    tier,
                    external_hashes,
                }
            }
            6 => {
                let (tier, external_hashes) = hashes(r)?;
                OwnedEvent::StatesRemoved {
                    tier,
                    external_hashes,
                }
            }
            _ => return None,
        };
        events.push((rank, e));
    }
    Some(events)
}

fn record(payload: &[u8]) -> Option<Record> {
    let mut r = Reader::new(payload);
    let rec = match r.u8()? {
        TAG_BATCH => {
            let worker_id = r.u64()?;
            let stream = r.u32()?;
            let seq = r.u64()?;
            let digest = r.u64()?;
            let events = events(&mut r)?;
            Record::Batch {
                worker_id,
                stream,
                seq,
                digest,
                events,
            }
        }
        TAG_DIRECT => Record::Direct {
            events: events(&mut r)?,
        },
        TAG_REMOVED => Record::Removed {
            worker_id: r.u64()?,
        },
        TAG_GAP => Record::Gap { records: r.u64()? },
        TAG_CLEAR => {
            let worker_id = r.u64()?;
            let n = r.u32()? as usize;
            if n.checked_mul(4)? > r.left() {
                return None;
            }
            let dp_ranks = (0..n).map(|_| r.u32().expect("length checked")).collect();
            Record::Clear {
                worker_id,
                dp_ranks,
            }
        }
        _ => return None,
    };
    r.done().then_some(rec)
}

/// A journal, read: its valid records and where (and why) reading stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JournalRead {
    pub records: Vec<Record>,
    /// Bytes of the file that are valid: a writer appending again truncates to this.
    pub valid_len: usize,
    /// Why reading stopped before the end: a torn or corrupt frame, or a frame whose
    /// checksum holds but whose record does not read (`None`: read to the end).
    pub stop: Option<&'static str>,
}

/// Reads a journal for the partition `want` names. The header must be whole and this
/// partition's ([`FileError`] otherwise: nothing is applied); records are read up to
/// the first that does not.
pub fn read(bytes: &[u8], want: &Identity) -> Result<JournalRead, FileError> {
    let mut frames = format::open(bytes, Kind::Journal, want)?;
    let mut out = JournalRead {
        records: Vec::new(),
        valid_len: frames.valid_len(),
        stop: None,
    };
    while let Some(payload) = frames.next() {
        match record(payload) {
            Some(r) => out.records.push(r),
            None => {
                out.stop = Some("malformed_record");
                return Ok(out);
            }
        }
        out.valid_len = frames.valid_len();
    }
    out.stop = frames.stop().map(FrameStop::name);
    Ok(out)
}
