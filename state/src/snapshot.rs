//! A partition's index on disk: its ranks' blocks as the engine's dump writes them
//! (unbranched runs of `(engine hash, local hash)`, parents first, per rank and tier) and
//! the last sequence number applied from each KV-event stream.
//!
//! Layout: the header frame ([`crate::format`]), then one frame per record: `Stream`,
//! `Store` (a run, split into frames of at most [`BLOCKS_PER_FRAME`] blocks; each part's
//! parent is the last block of the part before), and a final `End` that counts them. A
//! snapshot is all or nothing: one missing or corrupt frame, or counts that disagree with
//! `End`, refuses the whole file ([`FileError`]). Written to a temporary name and renamed
//! by the I/O layer, a snapshot is never seen half written; only corruption can cut it.

use kvr::{DumpedStore, Partition, RankId, StreamResume};

use crate::format::{self, FileError, Identity, Kind, Reader, Writer};
use crate::frame::put_frame;

/// Blocks per `Store` frame (16 bytes each: 16 MiB).
pub const BLOCKS_PER_FRAME: usize = 1 << 20;

const TAG_STREAM: u8 = 1;
const TAG_STORE: u8 = 2;
const TAG_END: u8 = 3;
const TAG_HOLES: u8 = 4;

/// A partition's index and streams at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub identity: Identity,
    pub stores: Vec<DumpedStore>,
    /// Blocks written in `stores` that their rank does not hold (a removal in the middle
    /// of a chain): removed again after the stores, so the blocks under them are kept
    /// for when the engine stores the missing parent again.
    pub holes: Vec<(RankId, u64)>,
    /// Where each stream was: the last batch the journal had from it when the snapshot
    /// began (the index holds at least that much).
    pub streams: Vec<StreamResume>,
}

/// What restoring a snapshot into a partition did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Restored {
    /// Blocks the index took, and those it refused (a rank refused, an unknown parent).
    pub blocks: u64,
    pub refused: u64,
}

impl Snapshot {
    /// The snapshot of `p` now: its index dump (each rank consistent in itself) and
    /// where its streams were (`streams`, as the journal's writer knows them). Blocks the
    /// dump leaves out (a hybrid rank's, a block whose parent is gone) are not in it;
    /// they come back from the engines.
    pub fn of(p: &Partition, streams: Vec<StreamResume>) -> Snapshot {
        let dump = p.dump_index_with_holes();
        Snapshot {
            holes: dump.holes,
            identity: Identity::of(p),
            stores: dump.stores,
            streams,
        }
    }

    /// Blocks held, over every rank and tier (the holes written with them not counted).
    pub fn blocks(&self) -> u64 {
        let written: u64 = self.stores.iter().map(|s| s.blocks.len() as u64).sum();
        written.saturating_sub(self.holes.len() as u64)
    }

    /// The file's bytes, handed to `out` frame by frame (a writer need not hold the whole
    /// file).
    pub fn write(&self, mut out: impl FnMut(&[u8])) {
        let mut frame = Vec::new();
        let mut emit = |payload: &[u8]| {
            frame.clear();
            put_frame(&mut frame, payload);
            out(&frame);
        };
        emit(&format::header(Kind::Snapshot, &self.identity));
        for s in &self.streams {
            let mut w = Writer::default();
            w.u8(TAG_STREAM);
            w.u64(s.worker_id);
            w.u32(s.stream);
            let (seq, digest) = s.last.unwrap_or((0, 0));
            w.u8(u8::from(s.last.is_some()));
            w.u64(seq);
            w.u64(digest);
            w.u32(s.dp_ranks.len() as u32);
            for d in &s.dp_ranks {
                w.u32(*d);
            }
            emit(&w.0);
        }
        let mut parts = 0u64;
        for s in &self.stores {
            let mut parent = s.parent;
            for chunk in s.blocks.chunks(BLOCKS_PER_FRAME) {
                let mut w = Writer(Vec::with_capacity(32 + chunk.len() * 16));
                w.u8(TAG_STORE);
                w.u64(s.rank.worker_id);
                w.u32(s.rank.dp_rank);
                w.tier(s.tier);
                w.u8(u8::from(parent.is_some()));
                w.u64(parent.unwrap_or(0));
                w.blocks(chunk);
                emit(&w.0);
                parts += 1;
                parent = chunk.last().map(|b| b.external_hash);
            }
        }
        for chunk in self.holes.chunks(BLOCKS_PER_FRAME) {
            let mut w = Writer(Vec::with_capacity(8 + chunk.len() * 20));
            w.u8(TAG_HOLES);
            w.u32(chunk.len() as u32);
            for (rank, e) in chunk {
                w.u64(rank.worker_id);
                w.u32(rank.dp_rank);
                w.u64(*e);
            }
            emit(&w.0);
        }
        let mut w = Writer::default();
        w.u8(TAG_END);
        w.u64(self.streams.len() as u64);
        w.u64(parts);
        w.u64(self.blocks());
        w.u64(self.holes.len() as u64);
        emit(&w.0);
    }

    /// The file's bytes in one buffer.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.write(|f| v.extend_from_slice(f));
        v
    }

    /// Reads a snapshot file for the partition `want` names: the whole snapshot, or why
    /// not.
    pub fn read(bytes: &[u8], want: &Identity) -> Result<Snapshot, FileError> {
        let mut frames = format::open(bytes, Kind::Snapshot, want)?;
        let bad = |what| FileError::Malformed(what);
        let mut snap = Snapshot {
            identity: want.clone(),
            stores: Vec::new(),
            holes: Vec::new(),
            streams: Vec::new(),
        };
        let mut parts = 0u64;
        let mut end = None;
        for payload in frames.by_ref() {
            if end.is_some() {
                return Err(bad("a record after the end"));
            }
            let mut r = Reader::new(payload);
            match r.u8() {
                Some(TAG_STREAM) => {
                    let worker_id = r.u64().ok_or(bad("stream"))?;
                    let stream = r.u32().ok_or(bad("stream"))?;
                    let has = r.u8().ok_or(bad("stream"))?;
                    let seq = r.u64().ok_or(bad("stream"))?;
                    let digest = r.u64().ok_or(bad("stream"))?;
                    let n = r.u32().ok_or(bad("stream"))? as usize;
                    if n > kvr::MAX_DP_SIZE as usize || n * 4 > r.left() {
                        return Err(bad("stream ranks"));
                    }
                    let dp_ranks = (0..n).map(|_| r.u32().unwrap_or(0)).collect();
                    snap.streams.push(StreamResume {
                        worker_id,
                        stream,
                        last: (has == 1).then_some((seq, digest)),
                        dp_ranks,
                    });
                }
                Some(TAG_STORE) => {
                    let worker = r.u64().ok_or(bad("store"))?;
                    let dp = r.u32().ok_or(bad("store"))?;
                    let tier = r.tier().ok_or(bad("store tier"))?;
                    let has = r.u8().ok_or(bad("store"))?;
                    let parent = r.u64().ok_or(bad("store"))?;
                    let blocks = r.blocks(BLOCKS_PER_FRAME).ok_or(bad("store length"))?;
                    if blocks.is_empty() || !r.done() {
                        return Err(bad("store length"));
                    }
                    snap.stores.push(DumpedStore {
                        rank: RankId::new(worker, dp),
                        tier,
                        parent: (has == 1).then_some(parent),
                        blocks,
                    });
                    parts += 1;
                }
                Some(TAG_HOLES) => {
                    let n = r.u32().ok_or(bad("holes"))? as usize;
                    if n > BLOCKS_PER_FRAME || n * 20 != r.left() {
                        return Err(bad("holes length"));
                    }
                    for _ in 0..n {
                        let (w, d, e) = (r.u64(), r.u32(), r.u64());
                        let (Some(w), Some(d), Some(e)) = (w, d, e) else {
                            return Err(bad("holes"));
                        };
                        snap.holes.push((RankId::new(w, d), e));
                    }
                }
                Some(TAG_END) => {
                    let streams = r.u64().ok_or(bad("end"))?;
                    let p = r.u64().ok_or(bad("end"))?;
                    let blocks = r.u64().ok_or(bad("end"))?;
                    let holes = r.u64().ok_or(bad("end"))?;
                    end = Some((streams, p, blocks, holes));
                }
                _ => return Err(bad("unknown record")),
            }
            if !r.done() {
                return Err(bad("trailing bytes in a record"));
            }
        }
        if let Some(stop) = frames.stop() {
            return Err(FileError::Frame(stop));
        }
        match end {
            None => Err(bad("no end record")),
            Some(e)
                if e != (
                    snap.streams.len() as u64,
                    parts,
                    snap.blocks(),
                    snap.holes.len() as u64,
                ) =>
            {
                Err(bad("counts differ from the end record"))
            }
            Some(_) => Ok(snap),
        }
    }

    /// Applies the snapshot's blocks to `p` (an empty partition, or one whose ranks the
    /// snapshot does not name). Ranks are checked as engine events are: a worker not
    /// registered is taken within the pending-rank budget, the rest refused and counted.
    pub fn restore(&self, p: &Partition) -> Restored {
        let mut out = Restored::default();
        for s in &self.stores {
            let ev = kvr::KvEvent::Stored {
                tier: s.tier,
                parent: s.parent,
                blocks: &s.blocks,
            };
            let r = p.apply_events(s.rank, [ev]);
            let n = s.blocks.len() as u64;
            if r.ignored || r.rank_refused || r.rejected > 0 {
                out.refused += n;
            } else {
                out.blocks += n;
            }
        }
        for (rank, e) in &self.holes {
            p.apply_events(
                *rank,
                [kvr::KvEvent::Removed {
                    tier: kvr::Tier::Device,
                    external_hashes: std::slice::from_ref(e),
                }],
            );
            out.blocks = out.blocks.saturating_sub(1);
        }
        out
    }
}
