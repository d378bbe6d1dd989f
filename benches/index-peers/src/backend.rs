//! The indexes under test, behind one interface: kvr's, a naive exact map (the in-bench
//! reference), and SMG's two (`smg`).
//!
//! Every backend gets the same events (engine hash + local hash per block, a parent engine
//! hash) and the same queries (local hashes). Writer state a backend keeps per worker (SMG's block maps)
//! lives in `Writers`, owned by the one thread applying events, as each design intends.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::RwLock;

use kvr::{Index, OverlapScores};
use kvr::{RankId, StoredBlock, Tier};

use crate::workload::{Block, Query};

/// One index design as the harness drives it.
pub(crate) trait Backend: Sync + Send + Sized {
    /// Writer-side state (per-worker maps), owned by the thread applying events.
    type Writers: Send;
    /// A reader's reusable buffers.
    type Scratch: Default + Send;

    fn new(workers: usize) -> (Self, Self::Writers);

    /// Stores `blocks` on `worker` after `parent` (an engine hash; `None`: position 0).
    fn store(&self, w: &mut Self::Writers, worker: u32, parent: Option<u64>, blocks: &[Block]);

    /// Told before the build that `worker` will hold about `blocks` blocks (its cache's
    /// capacity, as an engine registers it); most designs ignore it.
    fn expect(&self, _w: &mut Self::Writers, _worker: u32, _blocks: u64) {}

    /// Removes blocks of `worker` by engine hash.
    fn remove(&self, w: &mut Self::Writers, worker: u32, exts: &[u64]);

    /// Looks a query up; returns the number of workers with a non-empty prefix.
    fn lookup(&self, s: &mut Self::Scratch, q: &Query) -> usize;

    /// The last lookup's answer, `(worker, blocks)` sorted by worker.
    fn answer(&self, s: &Self::Scratch, out: &mut Vec<(u32, u32)>);

    /// The index's own account of its bytes, if it keeps one: (read structure, writer
    /// maps), in bytes.
    fn own_bytes(&self) -> Option<(u64, u64)> {
        None
    }
}

/// The backends by name, for dispatch.
pub(crate) const NAMES: [&str; 5] = [
    "kvr",
    "kvr-reserved",
    "smg-chain",
    "smg-positional",
    "naive",
];

// ---------------------------------------------------------------------------------------
// kvr
// ---------------------------------------------------------------------------------------

/// kvr's index (the run index), queried with local hashes. `RESERVE`: each worker's KV
/// capacity is registered before the build (`Index::set_worker_capacity`, what a
/// partition does with `WorkerInfo::total_kv_blocks`), so its map is sized once.
pub(crate) struct KvrIndex<const RESERVE: bool> {
    pub index: Index,
}

/// kvr's index, maps grown as blocks come.
pub(crate) type Kvr = KvrIndex<false>;
/// kvr's index, each worker's map reserved for its share of the build.
pub(crate) type KvrReserved = KvrIndex<true>;

fn rank(worker: u32) -> RankId {
    RankId::new(worker as u64, 0)
}

/// The store's blocks in kvr's type, in a reused buffer.
pub(crate) struct KvrWriters {
    buf: Vec<StoredBlock>,
}

impl<const RESERVE: bool> Backend for KvrIndex<RESERVE> {
    type Writers = KvrWriters;
    type Scratch = OverlapScores;

    fn new(_workers: usize) -> (Self, KvrWriters) {
        (
            KvrIndex {
                index: Index::new(),
            },
            KvrWriters { buf: Vec::new() },
        )
    }

    fn store(&self, w: &mut KvrWriters, worker: u32, parent: Option<u64>, blocks: &[Block]) {
        w.buf.clear();
        w.buf.extend(blocks.iter().map(|b| StoredBlock {
            external_hash: b.ext,
            local_hash: b.local,
        }));
        let _ = self.index.store(rank(worker), Tier::Device, parent, &w.buf);
    }

    fn expect(&self, _w: &mut KvrWriters, worker: u32, blocks: u64) {
        if RESERVE {
            let _ = self
                .index
                .reserve_blocks(rank(worker), Tier::Device, blocks);
        }
    }

    fn remove(&self, _w: &mut KvrWriters, worker: u32, exts: &[u64]) {
        self.index.remove(rank(worker), Tier::Device, exts);
    }

    #[inline]
    fn lookup(&self, s: &mut OverlapScores, q: &Query) -> usize {
        self.index.find_matches_into(&q.local, s);
        s.len()
    }

    fn answer(&self, s: &OverlapScores, out: &mut Vec<(u32, u32)>) {
        out.clear();
        out.extend(s.iter().map(|(r, n)| (r.worker_id as u32, n)));
        out.sort_unstable();
    }

    fn own_bytes(&self) -> Option<(u64, u64)> {
        let s = self.index.stats();
        Some((s.table_bytes + s.holder_set_bytes, s.rank_map_bytes))
    }
}

// ---------------------------------------------------------------------------------------
// The naive exact map: the reference
// ---------------------------------------------------------------------------------------

/// Folded-multiply hasher for already-random u64 keys (what a careful naive map would use;
/// SipHash would make the reference look slower than it needs to be).
#[derive(Default, Clone, Copy)]
pub(crate) struct Fold(u64);

impl Hasher for Fold {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(*b as u64);
        }
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        let m = u128::from(x ^ self.0 ^ 0x243f_6a88_85a3_08d3) * 0x9e37_79b9_7f4a_7c15u128;
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
}

type FoldMap<K, V> = HashMap<K, V, BuildHasherDefault<Fold>>;

/// Sequence hash → holders, under one reader-writer lock; per worker, engine hash →
/// sequence hash. Exact by construction: a lookup walks the chain of sequence hashes.
#[derive(Default)]
pub(crate) struct Naive {
    nodes: RwLock<FoldMap<u64, Vec<u32>>>,
}

pub(crate) struct NaiveWriters {
    blocks: Vec<FoldMap<u64, u64>>,
    seq: Vec<u64>,
}

#[derive(Default)]
pub(crate) struct NaiveScratch {
    seq: Vec<u64>,
    active: Vec<u32>,
    done: Vec<(u32, u32)>,
}

impl Backend for Naive {
    type Writers = NaiveWriters;
    type Scratch = NaiveScratch;

    fn new(workers: usize) -> (Self, NaiveWriters) {
        (
            Naive::default(),
            NaiveWriters {
                blocks: (0..workers).map(|_| FoldMap::default()).collect(),
                seq: Vec::new(),
            },
        )
    }

    fn store(&self, w: &mut NaiveWriters, worker: u32, parent: Option<u64>, blocks: &[Block]) {
        let map = &mut w.blocks[worker as usize];
        let mut prev = match parent {
            None => None,
            Some(p) => match map.get(&p) {
                Some(&s) => Some(s),
                None => return,
            },
        };
        w.seq.clear();
        for b in blocks {
            let s = kvr::hash::next_sequence_hash(prev, b.local);
            w.seq.push(s);
            prev = Some(s);
        }
        let mut nodes = self.nodes.write().unwrap();
        for (b, &s) in blocks.iter().zip(&w.seq) {
            if map.insert(b.ext, s).is_none() {
                let h = nodes.entry(s).or_default();
                if !h.contains(&worker) {
                    h.push(worker);
                }
            }
        }
    }

    fn remove(&self, w: &mut NaiveWriters, worker: u32, exts: &[u64]) {
        let map = &mut w.blocks[worker as usize];
        let mut nodes = self.nodes.write().unwrap();
        for e in exts {
            if let Some(s) = map.remove(e) {
                if let Some(h) = nodes.get_mut(&s) {
                    h.retain(|&x| x != worker);
                    if h.is_empty() {
                        nodes.remove(&s);
                    }
                }
            }
        }
    }

    fn lookup(&self, s: &mut NaiveScratch, q: &Query) -> usize {
        s.seq.clear();
        s.done.clear();
        s.active.clear();
        kvr::hash::extend_sequence_hashes(None, &q.local, &mut s.seq);
        let nodes = self.nodes.read().unwrap();
        for (i, seq) in s.seq.iter().enumerate() {
            let holders = nodes.get(seq).map(Vec::as_slice).unwrap_or(&[]);
            if i == 0 {
                s.active.extend_from_slice(holders);
            } else {
                let done = &mut s.done;
                s.active.retain(|w| {
                    let keep = holders.contains(w);
                    if !keep {
                        done.push((*w, i as u32));
                    }
                    keep
                });
            }
            if s.active.is_empty() {
                break;
            }
        }
        let n = s.seq.len() as u32;
        s.done.extend(s.active.drain(..).map(|w| (w, n)));
        s.done.len()
    }

    fn answer(&self, s: &NaiveScratch, out: &mut Vec<(u32, u32)>) {
        out.clear();
        out.extend_from_slice(&s.done);
        out.sort_unstable();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{build, Generator, Profile, Queries};

    /// kvr and the naive map agree with the workload's exact answers (and each other).
    fn agree<B: Backend>() {
        for p in Profile::ALL {
            let mut g = Generator::new(p, 11);
            let built = build(&mut g, 40_000);
            let (b, mut w) = B::new(crate::workload::WORKERS);
            for worker in 0..crate::workload::WORKERS as u32 {
                // Less than most workers hold: reserved maps still grow past it.
                b.expect(&mut w, worker, 64);
            }
            for s in &built.stores {
                b.store(&mut w, s.worker, s.parent, &s.blocks);
            }
            let mut qs = Queries::cold(&mut g, &built.requests, 128, 50);
            qs.extend(Queries::splice(&mut g, &built.requests, 20));
            qs.extend(Queries::miss(&mut g, 32, 5));
            let mut s = B::Scratch::default();
            let mut out = Vec::new();
            for q in &qs {
                b.lookup(&mut s, q);
                b.answer(&s, &mut out);
                assert_eq!(out, q.expect);
            }
        }
    }

    #[test]
    fn kvr_is_exact() {
        agree::<Kvr>();
    }

    #[test]
    fn kvr_reserved_is_exact() {
        agree::<KvrReserved>();
    }

    #[test]
    fn naive_is_exact() {
        agree::<Naive>();
    }

    #[test]
    fn smg_chain_is_exact() {
        agree::<crate::smg::SmgChain>();
    }

    /// The negative control of the exactness check: an index keyed by (position, local
    /// hash), as positional indexers were before they verified prefixes, credits the spliced
    /// tail of the template variants, and the check sees it.
    #[test]
    fn splices_catch_a_positional_index() {
        struct Positional(std::collections::HashMap<(usize, u64), Vec<u32>>);
        let mut g = Generator::new(Profile::Single, 5);
        let built = build(&mut g, 400_000);
        let mut idx = Positional(Default::default());
        let mut pos: Vec<FoldMap<u64, usize>> = vec![FoldMap::default(); crate::workload::WORKERS];
        for s in &built.stores {
            let start = s.parent.map_or(0, |p| pos[s.worker as usize][&p] + 1);
            for (i, b) in s.blocks.iter().enumerate() {
                pos[s.worker as usize].insert(b.ext, start + i);
                idx.0
                    .entry((start + i, b.local))
                    .or_default()
                    .push(s.worker);
            }
        }
        let qs = Queries::splice(&mut g, &built.requests, 200);
        assert_eq!(qs.len(), 200);
        let mut over = 0;
        for q in &qs {
            let mut active: Vec<u32> = idx.0.get(&(0, q.local[0])).cloned().unwrap_or_default();
            let mut out = Vec::new();
            for (i, l) in q.local.iter().enumerate().skip(1) {
                let h = idx.0.get(&(i, *l)).cloned().unwrap_or_default();
                active.retain(|w| {
                    let keep = h.contains(w);
                    if !keep {
                        out.push((*w, i as u32));
                    }
                    keep
                });
            }
            out.extend(active.iter().map(|&w| (w, q.local.len() as u32)));
            out.sort_unstable();
            out.dedup_by_key(|e| e.0);
            over += (crate::measure::overcounts(&out, &q.expect) > 0) as usize;
        }
        assert!(over > 0, "no splice overcounted: the workload cannot tell");
    }
}
