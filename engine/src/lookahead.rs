//! The lookahead lengths a partition's engines hash with (`crate::hash::lookahead`): ingress
//! notes each length a store shows, selection hashes a tokens prompt once more per length
//! noted. Few engines of one model differ here (the length is a serving option), so the set
//! is bounded: a store with a length beyond [`MAX_LOOKAHEAD_LENGTHS`] distinct ones is
//! skipped and counted, never indexed under keys no request would be hashed with.
//!
//! Selection loads the set without a lock (a `Snapshot`, as the stale-rank list); a writer
//! swaps a new set in, rarely (the first store of a new length). A selection that loads
//! the set just before a new length is noted misses that length's blocks once: an
//! undercount, never an overcount.

use crate::sync::{Mutex, Snapshot, SnapshotGuard};

/// Distinct lookahead lengths a partition keeps (the zero length, no lookahead, is not one).
pub(crate) const MAX_LOOKAHEAD_LENGTHS: usize = 4;

/// A partition's lookahead lengths, sorted.
pub(crate) struct LookaheadLengths {
    current: Snapshot<Vec<u32>>,
    /// Serializes writers (read, modify, store).
    writer: Mutex<()>,
}

impl Default for LookaheadLengths {
    fn default() -> Self {
        LookaheadLengths {
            current: Snapshot::new(Vec::new()),
            writer: Mutex::new(()),
        }
    }
}

impl std::fmt::Debug for LookaheadLengths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LookaheadLengths")
            .field(&*self.current.guard())
            .finish()
    }
}

impl LookaheadLengths {
    /// The lengths for one selection.
    pub(crate) fn now(&self) -> SnapshotGuard<Vec<u32>> {
        self.current.guard()
    }

    /// Notes a store's lookahead length: `true` if the partition hashes prompts with it
    /// (now or already), `false` if the set is full (the store must be skipped). Zero (no
    /// lookahead) is always accepted.
    pub(crate) fn note(&self, len: u32) -> bool {
        if len == 0 || self.current.guard().contains(&len) {
            return true;
        }
        let _w = self.writer.lock();
        let cur = self.current.guard();
        if cur.contains(&len) {
            return true;
        }
        if cur.len() >= MAX_LOOKAHEAD_LENGTHS {
            return false;
        }
        let mut next = Vec::clone(&cur);
        next.push(len);
        next.sort_unstable();
        drop(cur);
        self.current.store(next);
        true
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn lengths_are_kept_sorted_once_each_and_bounded() {
        let l = LookaheadLengths::default();
        assert!(
            l.note(0) && l.now().is_empty(),
            "no lookahead is not a length"
        );
        for len in [3, 1, 3, 2, 9] {
            assert!(l.note(len));
        }
        assert_eq!(l.now().as_slice(), &[1, 2, 3, 9]);
        assert!(!l.note(5), "a fifth length is refused");
        assert!(l.note(2), "a known one still is accepted");
    }
}
