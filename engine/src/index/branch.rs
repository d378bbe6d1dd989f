//! The branch table: a run's children by (parent run, offset, first local hash), in the
//! sharded lock-free `u64 → u64` tables of [`crate::table`] (readers take no lock;
//! writers take one shard's mutex, a leaf lock).
//!
//! A child of run `P` at offset `k` starting with local hash `l` continues `P`'s first `k`
//! blocks with `l`; the root's children (`P` = 0, `k` = 0) start prompts. The key is a
//! 64-bit mix of the triple; a lookup checks the child it finds against the triple (the
//! child records its parent, offset and first local), so two triples sharing a key can
//! never send a walk down the wrong branch. A writer that meets such a collision does not
//! index the blocks behind it (counted), which undercounts, never overcounts.

use super::run::Run;
use crate::sync::epoch;
use crate::table::{table_key, Shard, Shards};

/// Folded 128-bit multiply: a strong, cheap mixer of two words.
#[inline(always)]
pub(super) fn fold(a: u64, b: u64) -> u64 {
    let m = (a as u128) * (b as u128);
    (m as u64) ^ ((m >> 64) as u64)
}

/// The table key of child `(parent, at, local)`.
#[inline(always)]
pub(crate) fn branch_key(parent: usize, at: u32, local: u64) -> u64 {
    let a = fold(
        local ^ 0x243f_6a88_85a3_08d3,
        (parent as u64) ^ ((at as u64) << 52) ^ 0x1319_8a2e_0370_7344,
    );
    table_key(fold(a ^ 0xa409_3822_299f_31d0, 0x9e37_79b9_7f4a_7c15 | 1))
}

pub(crate) struct Branches {
    shards: Shards,
}

impl Branches {
    pub(crate) fn new(shards: usize, min_capacity: usize) -> Self {
        Branches {
            shards: Shards::new(shards, min_capacity),
        }
    }

    #[inline(always)]
    fn shard(&self, key: u64) -> &Shard {
        self.shards.of(key)
    }

    /// The child `(parent, at, local)`, if linked. Lock-free; the run is valid while
    /// `guard` is pinned (runs are retired through the epoch after being unlinked).
    #[inline]
    pub(crate) fn find<'g>(
        &self,
        parent: usize,
        at: u32,
        local: u64,
        guard: &'g epoch::Guard,
    ) -> Option<&'g Run> {
        let key = branch_key(parent, at, local);
        let w = self.shard(key).table(guard).probe(key).get();
        if w == 0 {
            return None;
        }
        // SAFETY: a non-zero word is the address of a linked run, published with Release
        // after the run was fully built and read with Acquire; it is retired through the
        // epoch only after its entry is removed, so it outlives `guard`.
        let run = unsafe { &*(w as usize as *const Run) };
        (run.parent == parent && run.at == at && run.first == local).then_some(run)
    }

    /// Links `run` as child `(run.parent, run.at, run.first)`. `Err(existing)`: the key
    /// is taken (by that very triple if the caller raced another creator, else by a
    /// colliding one).
    pub(crate) fn link(&self, run: &Run, guard: &epoch::Guard) -> Result<(), u64> {
        let key = branch_key(run.parent, run.at, run.first);
        match self
            .shard(key)
            .set_word_if_absent(key, run as *const Run as usize as u64, guard)
        {
            0 => Ok(()),
            existing => Err(existing),
        }
    }

    /// Unlinks `run` (if its key still names it).
    pub(crate) fn unlink(&self, run: &Run, guard: &epoch::Guard) {
        let key = branch_key(run.parent, run.at, run.first);
        let me = run as *const Run as usize as u64;
        self.shard(key).clear_word_if(key, me, guard);
    }

    /// Frees every linked run (the index is being dropped: nothing else can reach them).
    pub(crate) fn drain_runs(&mut self) {
        let guard = epoch::pin();
        for shard in self.shards.iter() {
            for w in shard.live_words(&guard) {
                // SAFETY: `&mut self` at the index's drop: no reader or writer is left, and
                // every linked run was boxed by `Run::new` and is linked once.
                drop(unsafe { Box::from_raw((w as usize) as *mut Run) });
            }
        }
    }

    pub(crate) fn table_bytes(&self) -> u64 {
        self.shards.table_bytes()
    }
}
