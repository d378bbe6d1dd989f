//! A rank's compact block places: 4 bytes where a [`BlockRef`] takes 8.
//!
//! Why: the rank maps (engine hash → place, `block_map`) are most of the index's memory,
//! one entry per (rank, block) pair. A `BlockRef` packs a run's address and an offset into
//! 8 bytes, so a map slot (key and value) took 16. A rank names a run it holds by its index
//! in the rank's own run table instead, [`RUN_INDEX_BITS`] bits beside the offset's, so a
//! slot takes 12 bytes.
//!
//! An index lives exactly as long as the rank's hold of the run (`hold::Hold`): taken when
//! the rank first holds a block of the run (`with_hold` in `write`), given back when the
//! rank holds none of it any more (`finish`). Every map entry names a block the rank holds,
//! so no entry names an index after it is given back, and an index is never ambiguous.
//!
//! A rank holds blocks of at most [`MAX_HELD_RUNS`] runs at once (a run holds at least one
//! of its blocks, so that is at least 2^21 blocks, twice the most a rank's map is sized
//! for, `MAX_RESERVED_BLOCKS`): blocks a store would place in one more are left
//! unindexed and counted (`Index::held_run_limit_hits`), never overcounted.

use super::run::{BlockRef, MAX_RUN, OFFSET_BITS};

/// Bits of a run's index in a rank's table.
pub(crate) const RUN_INDEX_BITS: u32 = 32 - OFFSET_BITS;
/// Runs a rank holds blocks of at once.
pub(crate) const MAX_HELD_RUNS: u32 = 1 << RUN_INDEX_BITS;

/// A block of a run the rank holds: the run's index in the rank's table, and the offset.
pub(crate) type Place = u32;

/// A rank's table of the runs it holds blocks of: index → run address.
#[derive(Default)]
pub(crate) struct RunTable {
    addrs: Vec<usize>,
    free: Vec<u32>,
    /// A lower limit than [`MAX_HELD_RUNS`], for the tests of reaching it.
    #[cfg(test)]
    pub(crate) test_limit: Option<u32>,
}

impl RunTable {
    fn limit(&self) -> u32 {
        #[cfg(test)]
        if let Some(l) = self.test_limit {
            return l.min(MAX_HELD_RUNS);
        }
        MAX_HELD_RUNS
    }

    /// An index for the run at `addr`, or `None` if the rank holds blocks of as many runs
    /// as it may.
    pub(crate) fn take(&mut self, addr: usize) -> Option<u32> {
        if let Some(i) = self.free.pop() {
            self.addrs[i as usize] = addr;
            return Some(i);
        }
        let i = u32::try_from(self.addrs.len()).ok()?;
        if i >= self.limit() {
            return None;
        }
        self.addrs.push(addr);
        Some(i)
    }

    /// Gives back the index of a run the rank no longer holds.
    pub(crate) fn release(&mut self, index: u32) {
        debug_assert!((index as usize) < self.addrs.len());
        self.addrs[index as usize] = 0;
        self.free.push(index);
    }

    /// The place of block `offset` of the run at `index`.
    #[inline]
    pub(crate) fn place(index: u32, offset: u32) -> Place {
        debug_assert!(index < MAX_HELD_RUNS && offset < MAX_RUN);
        index << OFFSET_BITS | offset
    }

    /// The block a place of this rank names.
    #[inline]
    pub(crate) fn block_ref(&self, place: Place) -> BlockRef {
        let addr = self.addrs[(place >> OFFSET_BITS) as usize];
        debug_assert!(addr != 0, "a place names a released run index");
        BlockRef::from_parts(addr, place & (MAX_RUN - 1))
    }

    /// Runs the rank holds blocks of.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn held(&self) -> usize {
        self.addrs.len() - self.free.len()
    }

    /// Heap bytes of the table.
    pub(crate) fn bytes(&self) -> usize {
        self.addrs.capacity() * std::mem::size_of::<usize>()
            + self.free.capacity() * std::mem::size_of::<u32>()
    }
}
