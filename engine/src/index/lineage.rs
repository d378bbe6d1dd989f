//! Each block's parent and local hash, kept only when a dump of the index is wanted.
//!
//! The node table knows a block by its chained sequence hash alone, which cannot be
//! unchained: writing the index out as engine events (Dynamo's `/dump`, for a peer to
//! recover from) needs each block's local hash and its parent. An index built
//! [`with_lineage`](super::Index::with_lineage) records them here as blocks are stored:
//! one 32-byte slot per distinct block (not per holder), taken only on the write path
//! (lookups never read it).
//!
//! A link is recorded only when a store gives a block its first holder of any rank (the
//! node table reports that transition to exactly one writer), after the node is updated,
//! so the blocks stored again by other ranks cost nothing here. A block held has its link:
//! it was recorded when the block was last born, and pruning keeps the links of held
//! blocks (a prune racing a birth either sees the block held or has no entry to drop yet).
//! Blocks stored through `store_sequences` (bookings, in an approximate index never fed
//! events) have no local hash and get no link.
//!
//! Entries are not removed when their block's last holder goes (that would put a second
//! map update on every removal); instead a shard that has doubled since it was last pruned
//! drops the entries of blocks no rank holds, so the map stays within about twice the live
//! blocks and the work is amortized O(1) per store.

use crate::sync::Mutex;

/// Shards of the map: a store takes each shard it touches once (its blocks are grouped by
/// shard), and writers of different ranks rarely meet. A balance: more shards make a
/// prune (one pass over a shard, a node-table probe per entry) shorter — at 64 workers of
/// 8,192 blocks up to ~16k entries here, where 16 shards would make it ~60k — and fewer
/// make each store's births share more locks (256 shards meant about one lock per birth:
/// lineage took 10 % of the server's core under the load benchmark, against 6.5 % with 64,
/// by the `perf record` command README.md gives for its profile).
const SHARDS: usize = 64;
/// A shard is never pruned below this many entries.
const MIN_PRUNE: usize = 1024;
/// A shard's table starts with this many slots (a power of two).
const MIN_SLOTS: usize = 64;

/// A block's place in its chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Link {
    /// The parent block's sequence hash (`None` for a first block).
    pub parent: Option<u64>,
    /// The block's local hash (its tokens only).
    pub local: u64,
}

/// One slot of a shard's open-addressing table (32 bytes: two per cache line, so an
/// insert is one miss, not hashbrown's control byte and bucket).
#[derive(Clone, Copy, Default)]
struct Slot {
    seq: u64,
    parent: u64,
    local: u64,
    /// `USED`, and `HAS_PARENT` when `parent` is meaningful.
    flags: u64,
}

const USED: u64 = 1;
const HAS_PARENT: u64 = 2;

impl Slot {
    fn link(&self) -> Link {
        Link {
            parent: (self.flags & HAS_PARENT != 0).then_some(self.parent),
            local: self.local,
        }
    }
}

/// A linear-probing table, at most 3/4 full.
#[derive(Default)]
struct LineageShard {
    slots: Vec<Slot>,
    len: usize,
    /// Size after the last prune.
    kept: usize,
}

/// The home slot of `seq` in a table of `mask + 1` slots (the shard took the top bits).
#[inline]
fn home(seq: u64, mask: usize) -> usize {
    (seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20) as usize & mask
}

impl LineageShard {
    fn find(&self, seq: u64) -> Option<&Slot> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = home(seq, mask);
        loop {
            let s = &self.slots[i];
            if s.flags & USED == 0 {
                return None;
            }
            if s.seq == seq {
                return Some(s);
            }
            i = (i + 1) & mask;
        }
    }

    /// Inserts unless `seq` is there (first writer wins: a sequence hash has one link).
    fn insert(&mut self, seq: u64, link: Link) {
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.resize((self.slots.len() * 2).max(MIN_SLOTS), |_| true);
        }
        let mask = self.slots.len() - 1;
        let mut i = home(seq, mask);
        loop {
            let s = &mut self.slots[i];
            if s.flags & USED == 0 {
                *s = Slot {
                    seq,
                    parent: link.parent.unwrap_or(0),
                    local: link.local,
                    flags: USED | if link.parent.is_some() { HAS_PARENT } else { 0 },
                };
                self.len += 1;
                return;
            }
            if s.seq == seq {
                return;
            }
            i = (i + 1) & mask;
        }
    }

    /// Rebuilds into `slots` slots, keeping the entries `keep` accepts.
    fn resize(&mut self, slots: usize, keep: impl Fn(u64) -> bool) {
        let old = std::mem::replace(&mut self.slots, vec![Slot::default(); slots]);
        let mask = slots - 1;
        self.len = 0;
        for s in old
            .into_iter()
            .filter(|s| s.flags & USED != 0 && keep(s.seq))
        {
            let mut i = home(s.seq, mask);
            while self.slots[i].flags & USED != 0 {
                i = (i + 1) & mask;
            }
            self.slots[i] = s;
            self.len += 1;
        }
    }

    /// Drops the entries of blocks `live` says no rank holds, once the shard has doubled
    /// since it was last pruned.
    fn maybe_prune(&mut self, live: &impl Fn(u64) -> bool) {
        if self.len >= (2 * self.kept).max(MIN_PRUNE) {
            let slots = self.slots.len();
            self.resize(slots, live);
            // Shrink once the kept entries would fit a quarter of the table.
            if self.len * 8 < slots && slots > MIN_SLOTS {
                let to = (self.len * 2).next_power_of_two().max(MIN_SLOTS);
                self.resize(to, |_| true);
            }
            self.kept = self.len;
        }
    }
}

/// The map of sequence hash → [`Link`].
pub(crate) struct Lineage {
    shards: Box<[Mutex<LineageShard>]>,
}

impl Lineage {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(LineageShard::default()))
                .collect(),
        }
    }

    fn shard_of(seq: u64) -> usize {
        // The top bits: the node table's shards use the low ones.
        (seq >> 58) as usize % SHARDS
    }

    /// Records each `(seq, link)` (first writer wins; within one call, one of two links of
    /// the same `seq` — a chain never has two), taking each shard's lock once: the
    /// inserts of one shard run back to back, so their cache misses overlap. A shard that
    /// has doubled since its last prune first drops the entries of blocks `live` says no
    /// rank holds.
    pub(crate) fn record_all(&self, links: &mut [(u64, Link)], live: impl Fn(u64) -> bool) {
        links.sort_unstable_by_key(|&(seq, _)| Self::shard_of(seq));
        for group in links.chunk_by(|a, b| Self::shard_of(a.0) == Self::shard_of(b.0)) {
            let mut s = self.shards[Self::shard_of(group[0].0)].lock();
            s.maybe_prune(&live);
            for &(seq, link) in group {
                s.insert(seq, link);
            }
        }
    }

    pub(crate) fn get(&self, seq: u64) -> Option<Link> {
        self.shards[Self::shard_of(seq)]
            .lock()
            .find(seq)
            .map(Slot::link)
    }

    /// Entries kept (live or not yet pruned).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len).sum()
    }

    /// Heap bytes of the tables.
    pub(crate) fn bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| (s.lock().slots.len() * std::mem::size_of::<Slot>()) as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_link_wins_and_pruning_keeps_live_blocks() {
        let l = Lineage::new();
        let link = |local| Link {
            parent: None,
            local,
        };
        l.record_all(&mut [(7, link(1))], |_| true);
        l.record_all(&mut [(7, link(2))], |_| true);
        assert_eq!(l.get(7), Some(link(1)));
        // Fill one shard past its prune threshold with dead entries; only live ones stay.
        let shard_key = |i: u64| i; // seq >> 58 == 0: all in shard 0
        for i in 0..(MIN_PRUNE as u64 + 10) {
            l.record_all(&mut [(shard_key(i + 100), link(i))], |k| k % 2 == 0);
        }
        let kept = l.len();
        assert!(kept < MIN_PRUNE, "dead entries were pruned: {kept}");
        assert_eq!(l.get(7), None, "7 is odd: not live, pruned");
        assert!(l.get(100).is_some());
    }

    #[test]
    fn agrees_with_a_map_through_growth_pruning_and_shrinking() {
        let l = Lineage::new();
        let mut model = std::collections::HashMap::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        // Keys from a small space (repeats), parents present or not; a key's link is a
        // function of the key, as a sequence hash's link is.
        let link_of = |seq: u64| Link {
            parent: (seq % 3 != 0).then_some(seq ^ 0x55),
            local: seq.rotate_left(7),
        };
        for round in 0..40u64 {
            let mut batch = Vec::new();
            for _ in 0..500 {
                let seq = (next() % 20_000) | ((next() % 4) << 58);
                batch.push((seq, link_of(seq)));
            }
            // In odd rounds only even keys are live (a prune may drop the odd ones).
            let live = |k: u64| round % 2 == 0 || k % 2 == 0;
            l.record_all(&mut batch, live);
            for (seq, _) in batch {
                model.insert(seq, ());
            }
            // A live key is never lost; what is found is its own link.
            for k in model.keys() {
                if k % 2 == 0 {
                    assert_eq!(l.get(*k), Some(link_of(*k)), "live {k}");
                } else if let Some(got) = l.get(*k) {
                    assert_eq!(got, link_of(*k));
                }
            }
            assert!(l.len() <= model.len());
        }
        assert!(l.len() >= 1 && l.bytes() > 0);
        // Live entries survive every prune: record everything as live and check all.
        let l = Lineage::new();
        let mut all = Vec::new();
        for i in 0..5_000u64 {
            all.push((
                (i << 4) | ((i % 16) << 58),
                Link {
                    parent: Some(i),
                    local: i,
                },
            ));
        }
        for chunk in all.chunks(100) {
            l.record_all(&mut chunk.to_vec(), |_| true);
        }
        for (seq, link) in &all {
            assert_eq!(l.get(*seq), Some(*link));
        }
        assert_eq!(l.len(), all.len());
    }
}
