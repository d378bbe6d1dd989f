//! The slot → rank directory readers translate covers' slots with.
//!
//! One cell per slot, in an array that grows by doubling: setting or clearing a slot's
//! cell is one in-place write, and a slot past the array's end makes the writer copy the
//! array into one twice as large (at least), publish it with `Release` and retire the old
//! one through the epoch. A new rank therefore costs amortised O(1) (kvr's first
//! directory copied the whole array per new rank: 2^18 ranks took minutes).
//!
//! Writers serialize on the directory's mutex (rank creation and removal only). Readers
//! take no lock: inside their epoch they load the array once (`Acquire`) and read cells.
//!
//! A cell holds a rank id (96 bits) in two words: the worker id, and the DP rank with a
//! `LIVE` bit. Set: worker, then the DP word with `Release`; clear: the DP word alone.
//! A reader loads the DP word (`Acquire`), then the worker. This is never torn, because
//! a reader translates only a slot it read in a cover inside its pinned epoch, and:
//! - the slot's cell was set before any cover could name it (the registry allocates the
//!   slot and sets the cell before the rank's first store publishes a cover), so the
//!   reader sees the whole setting (the run state it loaded with `Acquire` was published
//!   after it);
//! - a removed rank's cell is cleared (DP word only: the worker word stays as it was), and
//!   its slot is set again for another rank only once every reader pinned at the removal
//!   has unpinned (`ranks`: slots are reused through the epoch). So the reader sees the
//!   old rank whole, or nothing.
//!
//! Loom model `loom_models::rank_directory_growth` (an outgrown array freed only after
//! its readers; negative control `free_directory_now`) and `rank_slot_reuse` (the
//! clear-then-reuse order; negative control `reuse_slot_now`).

use crate::ids::RankId;
use crate::sync::atomic::{AtomicU64, Ordering};
#[cfg(loom)]
use crate::sync::UnsafeCell;
use crate::sync::{epoch, Mutex};

/// Set in a cell's DP word while the cell names a rank.
const LIVE: u64 = 1 << 32;
/// Cells of a new directory (loom models start at one so their second rank grows it).
const MIN_CELLS: usize = if cfg!(loom) { 1 } else { 8 };

#[derive(Default)]
struct Cell {
    worker: AtomicU64,
    /// `dp_rank | LIVE`, or 0 when the slot names no rank.
    dp: AtomicU64,
}

impl Cell {
    #[inline(always)]
    fn get(&self) -> Option<RankId> {
        let dp = self.dp.load(Ordering::Acquire);
        if dp & LIVE == 0 {
            return None;
        }
        Some(RankId::new(self.worker.load(Ordering::Relaxed), dp as u32))
    }

    /// Under the directory's mutex.
    fn set(&self, id: Option<RankId>) {
        match id {
            Some(id) => {
                self.worker.store(id.worker_id, Ordering::Relaxed);
                self.dp
                    .store(u64::from(id.dp_rank) | LIVE, Ordering::Release);
            }
            None => self.dp.store(0, Ordering::Release),
        }
    }
}

/// One array of cells, immutable in size.
struct Cells {
    /// Read by every translation and written when the array dies, so loom sees a reader
    /// that outlives the array. Zero-sized outside loom.
    #[cfg(loom)]
    alive: UnsafeCell<()>,
    cells: Box<[Cell]>,
}

impl Cells {
    fn new(n: usize) -> Self {
        Cells {
            #[cfg(loom)]
            alive: UnsafeCell::new(()),
            cells: (0..n).map(|_| Cell::default()).collect(),
        }
    }

    #[inline(always)]
    fn get(&self, slot: u32) -> Option<RankId> {
        #[cfg(loom)]
        self.alive.with(|_| ());
        self.cells.get(slot as usize).and_then(Cell::get)
    }
}

// SAFETY: under loom only: `alive` is a zero-sized marker whose every access goes through
// loom (`with` / `with_mut`), which checks them; the cells are atomics.
#[cfg(loom)]
unsafe impl Sync for Cells {}
// SAFETY: as above.
#[cfg(loom)]
unsafe impl Send for Cells {}

#[cfg(loom)]
impl Drop for Cells {
    fn drop(&mut self) {
        crate::sync::faults::note_directory_free();
        if !std::thread::panicking() {
            self.alive.with_mut(|_| ());
        }
    }
}

pub(crate) struct Directory {
    current: epoch::Atomic<Cells>,
    /// Serializes writers (cell writes and growth); never taken by readers.
    writer: Mutex<()>,
}

impl Directory {
    pub(crate) fn new() -> Self {
        Directory {
            current: epoch::Atomic::new(Cells::new(MIN_CELLS)),
            writer: Mutex::new(()),
        }
    }

    /// Names `slot` as `id` (or as no rank): in place, or in a grown copy of the array.
    pub(crate) fn set(&self, slot: u32, id: Option<RankId>) {
        let _w = self.writer.lock();
        let guard = epoch::pin();
        let cur_ptr = self.current.load(Ordering::Acquire, &guard);
        // SAFETY: never null; replaced only under `writer`, which we hold, so it is the
        // current array and alive.
        let cur = unsafe { cur_ptr.deref() };
        let i = slot as usize;
        if let Some(cell) = cur.cells.get(i) {
            cell.set(id);
            return;
        }
        // Doubling: each cell is copied O(1) times on average over the growths.
        let n = (2 * cur.cells.len()).max(i + 1);
        let next = Cells::new(n);
        for (to, from) in next.cells.iter().zip(cur.cells.iter()) {
            to.worker
                .store(from.worker.load(Ordering::Relaxed), Ordering::Relaxed);
            to.dp
                .store(from.dp.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        next.cells[i].set(id);
        let prev = self
            .current
            .swap(epoch::Owned::new(next), Ordering::Release, &guard);
        retire(prev, &guard);
    }

    /// Translates slots to ranks for one reader, inside its epoch.
    #[inline]
    pub(crate) fn translator<'g>(
        &self,
        guard: &'g epoch::Guard,
    ) -> impl Fn(u32) -> Option<RankId> + 'g {
        let d = self.current.load(Ordering::Acquire, guard);
        // SAFETY: never null; an outgrown array is retired through the epoch, so it is
        // alive while `guard` is pinned.
        let d: &'g Cells = unsafe { d.deref() };
        move |slot| d.get(slot)
    }

    #[cfg(any(test, loom))]
    pub(crate) fn capacity(&self) -> usize {
        let guard = epoch::pin();
        // SAFETY: never null; alive while `guard` is pinned.
        unsafe { self.current.load(Ordering::Acquire, &guard).deref() }
            .cells
            .len()
    }
}

fn retire(prev: epoch::Shared<'_, Cells>, guard: &epoch::Guard) {
    #[cfg(loom)]
    if crate::sync::faults::get().free_directory_now {
        // Negative control: poison the array now (a loom-tracked write) and leak it.
        // SAFETY: still allocated (leaked, never freed).
        unsafe { prev.deref() }.alive.with_mut(|_| ());
        return;
    }
    // SAFETY: swapped out under the writer mutex, so no new reader can load it; it is
    // destroyed after every guard pinned now is dropped.
    unsafe { guard.defer_destroy(prev) };
}

impl Drop for Directory {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no reader can reach the array any more.
        unsafe {
            let guard = epoch::unprotected();
            drop(self.current.load(Ordering::Relaxed, guard).into_owned());
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn cells_grow_by_doubling_and_keep_their_ranks() {
        let d = Directory::new();
        let guard = epoch::pin();
        let mut growths = 0;
        let mut cap = d.capacity();
        for s in 0..10_000u32 {
            d.set(
                s,
                Some(RankId::new(u64::from(s) << 40 | 7, s ^ 0xffff_0000)),
            );
            if d.capacity() != cap {
                growths += 1;
                cap = d.capacity();
            }
        }
        // 8 → 16384 by doubling: 11 copies for 10,000 ranks, not one per rank.
        assert_eq!(growths, 11);
        d.set(17, None);
        let t = d.translator(&guard);
        for s in 0..10_000u32 {
            let want = (s != 17).then(|| RankId::new(u64::from(s) << 40 | 7, s ^ 0xffff_0000));
            assert_eq!(t(s), want, "slot {s}");
        }
        assert_eq!(t(20_000), None);
    }
}
