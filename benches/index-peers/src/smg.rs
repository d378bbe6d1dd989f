//! SMG's indexes, from crates.io: the chain index of `kv-index` 2.0.0 (SMG's newest radix
//! index: chain-native runs, coverage bitsets, seqlock readers) and the positional indexer
//! of `kv-index` 1.7.0 (a DashMap keyed by (position, content hash), the design the issue's
//! first measurements were taken against; removed in 2.0).
//!
//! Both are driven through their public APIs as SMG's gateway drives them: a worker id
//! interned from a name, a block map per worker owned by the thread that applies its events,
//! lookups by content (local) hash.

use smg1::{PositionalIndexer, WorkerBlockMap};
use smg2::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};

use crate::backend::Backend;
use crate::workload::{Block, Query};

/// `kv-index` 2.0.0's `ChainIndex`.
pub(crate) struct SmgChain {
    index: ChainIndex,
    /// Our worker → the index's interned id, and back.
    ids: Vec<u32>,
    back: Vec<u32>,
}

pub(crate) struct ChainWriters {
    maps: Vec<ChainBlockMap>,
    buf: Vec<StoredBlock>,
}

impl Backend for SmgChain {
    type Writers = ChainWriters;
    type Scratch = Vec<(u32, u32)>;

    fn new(workers: usize) -> (Self, ChainWriters) {
        let index = ChainIndex::with_max_workers(workers);
        let ids: Vec<u32> = (0..workers)
            .map(|w| index.intern_worker(&format!("worker-{w}")).expect("room"))
            .collect();
        let mut back = vec![u32::MAX; ids.iter().max().map_or(0, |m| *m as usize + 1)];
        for (w, &id) in ids.iter().enumerate() {
            back[id as usize] = w as u32;
        }
        (
            SmgChain { index, ids, back },
            ChainWriters {
                maps: (0..workers).map(|_| ChainBlockMap::new()).collect(),
                buf: Vec::new(),
            },
        )
    }

    fn store(&self, w: &mut ChainWriters, worker: u32, parent: Option<u64>, blocks: &[Block]) {
        w.buf.clear();
        w.buf.extend(blocks.iter().map(|b| StoredBlock {
            seq_hash: SequenceHash(b.ext),
            content_hash: ContentHash(b.local),
        }));
        let _ = self.index.apply_stored(
            self.ids[worker as usize],
            &w.buf,
            parent.map(SequenceHash),
            &mut w.maps[worker as usize],
        );
    }

    fn remove(&self, w: &mut ChainWriters, worker: u32, exts: &[u64]) {
        // `SequenceHash` is a plain newtype: the engine hashes, as the API takes them.
        let hashes: Vec<SequenceHash> = exts.iter().map(|&e| SequenceHash(e)).collect();
        self.index.apply_removed(
            self.ids[worker as usize],
            &hashes,
            &mut w.maps[worker as usize],
        );
    }

    #[inline]
    fn lookup(&self, s: &mut Vec<(u32, u32)>, q: &Query) -> usize {
        s.clear();
        self.index
            .score_into(&q.local, |h| *h, false, |w, n| s.push((w, n)));
        s.len()
    }

    fn answer(&self, s: &Vec<(u32, u32)>, out: &mut Vec<(u32, u32)>) {
        out.clear();
        out.extend(s.iter().map(|&(w, n)| (self.back[w as usize], n)));
        out.sort_unstable();
    }
}

/// `kv-index` 1.7.0's `PositionalIndexer`.
pub(crate) struct SmgPositional {
    index: PositionalIndexer,
    ids: Vec<u32>,
    back: Vec<u32>,
}

pub(crate) struct PositionalWriters {
    maps: Vec<WorkerBlockMap>,
    buf: Vec<smg1::StoredBlock>,
}

impl Backend for SmgPositional {
    type Writers = PositionalWriters;
    type Scratch = Option<smg1::OverlapScores>;

    fn new(workers: usize) -> (Self, PositionalWriters) {
        // SMG's gateway default jump size (ignored since 1.6: every position is verified).
        let index = PositionalIndexer::new(64);
        let ids: Vec<u32> = (0..workers)
            .map(|w| index.intern_worker(&format!("worker-{w}")).expect("room"))
            .collect();
        let mut back = vec![u32::MAX; ids.iter().max().map_or(0, |m| *m as usize + 1)];
        for (w, &id) in ids.iter().enumerate() {
            back[id as usize] = w as u32;
        }
        (
            SmgPositional { index, ids, back },
            PositionalWriters {
                maps: (0..workers).map(|_| WorkerBlockMap::default()).collect(),
                buf: Vec::new(),
            },
        )
    }

    fn store(&self, w: &mut PositionalWriters, worker: u32, parent: Option<u64>, blocks: &[Block]) {
        w.buf.clear();
        w.buf.extend(blocks.iter().map(|b| smg1::StoredBlock {
            seq_hash: smg1::SequenceHash(b.ext),
            content_hash: smg1::ContentHash(b.local),
        }));
        let _ = self.index.apply_stored(
            self.ids[worker as usize],
            &w.buf,
            parent.map(smg1::SequenceHash),
            &mut w.maps[worker as usize],
        );
    }

    fn remove(&self, w: &mut PositionalWriters, worker: u32, exts: &[u64]) {
        self.index.apply_removed_iter(
            self.ids[worker as usize],
            exts.iter().map(|&e| smg1::SequenceHash(e)),
            &mut w.maps[worker as usize],
        );
    }

    #[inline]
    fn lookup(&self, s: &mut Option<smg1::OverlapScores>, q: &Query) -> usize {
        let r = self.index.find_matches_in(&q.local[..], false);
        let n = r.scores.len();
        *s = Some(r);
        n
    }

    fn answer(&self, s: &Option<smg1::OverlapScores>, out: &mut Vec<(u32, u32)>) {
        out.clear();
        if let Some(r) = s {
            out.extend(r.scores.iter().map(|(&w, &n)| (self.back[w as usize], n)));
        }
        out.sort_unstable();
    }
}
