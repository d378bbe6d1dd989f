//! Each block's parent and local hash, kept only when a dump of the index is wanted.
//!
//! The node table knows a block by its chained sequence hash alone, which cannot be
//! unchained: writing the index out as engine events (Dynamo's `/dump`, for a peer to
//! recover from) needs each block's local hash and its parent. An index built
//! [`with_lineage`](super::Index::with_lineage) records them here as blocks are stored:
//! one entry per distinct block (not per holder), ~30 bytes, taken only on the write path
//! (lookups never read it).
//!
//! Entries are not removed when their block's last holder goes (that would put a second
//! map update on every removal); instead a shard that has doubled since it was last pruned
//! drops the entries of blocks no rank holds, so the map stays within about twice the live
//! blocks and the work is amortized O(1) per store.

use crate::hash::mix::HashMixMap;
use crate::sync::Mutex;

/// Shards of the map (writers of different ranks rarely meet).
const SHARDS: usize = 64;
/// A shard is never pruned below this many entries.
const MIN_PRUNE: usize = 1024;

/// A block's place in its chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Link {
    /// The parent block's sequence hash (`None` for a first block).
    pub parent: Option<u64>,
    /// The block's local hash (its tokens only).
    pub local: u64,
}

#[derive(Default)]
struct LineageShard {
    map: HashMixMap<u64, Link>,
    /// Size after the last prune.
    kept: usize,
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

    fn shard(&self, seq: u64) -> &Mutex<LineageShard> {
        // The top bits: the node table's shards use the low ones.
        &self.shards[(seq >> 58) as usize % SHARDS]
    }

    /// Records `seq`'s link (first writer wins: a sequence hash has one link). When the
    /// shard has doubled since its last prune, the entries of blocks `live` says no rank
    /// holds are dropped first.
    pub(crate) fn record(&self, seq: u64, link: Link, live: impl Fn(u64) -> bool) {
        let mut s = self.shard(seq).lock();
        if s.map.len() >= (2 * s.kept).max(MIN_PRUNE) {
            s.map.retain(|&k, _| live(k));
            s.kept = s.map.len();
        }
        s.map.entry(seq).or_insert(link);
    }

    pub(crate) fn get(&self, seq: u64) -> Option<Link> {
        self.shard(seq).lock().map.get(&seq).copied()
    }

    /// Entries kept (live or not yet pruned).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    /// Approximate heap bytes (hashbrown: buckets of key + value and a control byte).
    pub(crate) fn bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| {
                let cap = s.lock().map.capacity();
                (cap * 8 / 7 * (8 + std::mem::size_of::<Link>() + 1)) as u64
            })
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
        l.record(7, link(1), |_| true);
        l.record(7, link(2), |_| true);
        assert_eq!(l.get(7), Some(link(1)));
        // Fill one shard past its prune threshold with dead entries; only live ones stay.
        let shard_key = |i: u64| i; // seq >> 58 == 0: all in shard 0
        for i in 0..(MIN_PRUNE as u64 + 10) {
            l.record(shard_key(i + 100), link(i), |k| k % 2 == 0);
        }
        let kept = l.len();
        assert!(kept < MIN_PRUNE, "dead entries were pruned: {kept}");
        assert_eq!(l.get(7), None, "7 is odd: not live, pruned");
        assert!(l.get(100).is_some());
    }
}
