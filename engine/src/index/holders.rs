//! Holder sets: which ranks hold one block, and on which tiers, packed into one word.
//!
//! A node's holder set is a single `u64` that readers load atomically:
//! - `0`: nobody holds the block (a dead node, dropped at the next rehash);
//! - low bit `1`: up to three holders *inline*, each 21 bits = rank slot (18 bits) and
//!   tier mask (3 bits); an entry with an empty tier mask is absent. Most blocks have one
//!   holder, so most nodes cost no allocation at all;
//! - low bit `0`: a pointer to an immutable [`HeapHolders`] of slot-sorted entries.
//!
//! Heap sets are copy-on-write: a writer builds the new set, publishes its pointer with
//! `Release`, and retires the old one through the epoch collector, so a reader that
//! loaded the old pointer (with `Acquire`, inside a pinned epoch) can keep reading it.

use crate::sync::UnsafeCell;

/// Bits of a rank slot: at most 2^18 ranks per index.
pub(crate) const SLOT_BITS: u32 = 18;
pub(crate) const MAX_SLOTS: u32 = 1 << SLOT_BITS;
const ENTRY_BITS: u32 = SLOT_BITS + 3;
const ENTRY_MASK: u64 = (1 << ENTRY_BITS) - 1;
const INLINE_CAP: usize = 3;
const INLINE_TAG: u64 = 1;

/// An entry of a heap set: `slot << 3 | tiers`.
type Entry = u32;

#[inline(always)]
fn entry(slot: u32, tiers: u8) -> Entry {
    (slot << 3) | tiers as u32
}

#[inline(always)]
fn entry_slot(e: Entry) -> u32 {
    e >> 3
}

#[inline(always)]
fn entry_tiers(e: Entry) -> u8 {
    (e & 7) as u8
}

/// An immutable, slot-sorted holder set of more than three ranks.
pub(crate) struct HeapHolders {
    entries: UnsafeCell<Box<[Entry]>>,
}

impl HeapHolders {
    fn new(entries: Box<[Entry]>) -> Box<Self> {
        Box::new(Self {
            entries: UnsafeCell::new(entries),
        })
    }

    #[inline(always)]
    fn with_entries<R>(&self, f: impl FnOnce(&[Entry]) -> R) -> R {
        // SAFETY: entries are written only by `new` before the set is published and by
        // `Drop` after the epoch collector proved no reader can still hold it; in between
        // the set is immutable, so shared reads never race a write.
        self.entries.with(|p| f(unsafe { &*p }))
    }

    /// Heap bytes of a set with `n` entries (for the index's byte count).
    pub(crate) fn bytes_for(n: usize) -> usize {
        std::mem::size_of::<Self>() + n * std::mem::size_of::<Entry>()
    }
}

impl HeapHolders {
    /// A loom-tracked write, as `Drop` does, without freeing (negative controls).
    #[cfg(loom)]
    pub(crate) fn poison(&self) {
        self.entries.with_mut(|_| ());
    }
}

impl Drop for HeapHolders {
    fn drop(&mut self) {
        // A loom model that already failed must unwind without a second panic.
        #[cfg(loom)]
        if std::thread::panicking() {
            return;
        }
        #[cfg(loom)]
        crate::sync::faults::note_free();
        // A write access, so that loom reports any reader the collector failed to wait for.
        self.entries.with_mut(|p| {
            // SAFETY: `&mut self` in Drop is the only reference; nothing else can access it.
            let entries = unsafe { &mut *p };
            if let Some(first) = entries.first_mut() {
                *first = 0;
            }
        });
    }
}

/// A holder word, as loaded from a node.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Holders(pub(crate) u64);

impl Holders {
    pub(crate) const EMPTY: Holders = Holders(0);

    #[inline(always)]
    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }

    #[inline(always)]
    fn heap(self) -> Option<*const HeapHolders> {
        if self.0 != 0 && self.0 & INLINE_TAG == 0 {
            Some(self.0 as usize as *const HeapHolders)
        } else {
            None
        }
    }

    /// Tiers on which `slot` holds the block (0 = not held).
    ///
    /// # Safety
    /// A heap word must have been loaded with `Acquire` inside an epoch guard that is
    /// still pinned (or under the shard's writer lock), so the set is alive and published.
    #[inline(always)]
    pub(crate) unsafe fn tiers_of(self, slot: u32) -> u8 {
        match self.heap() {
            None => {
                let mut w = self.0 >> 1;
                for _ in 0..INLINE_CAP {
                    let e = (w & ENTRY_MASK) as Entry;
                    if entry_slot(e) == slot && entry_tiers(e) != 0 {
                        return entry_tiers(e);
                    }
                    w >>= ENTRY_BITS;
                }
                0
            }
            Some(p) => {
                // SAFETY: by this function's contract the set is alive and published.
                let set = unsafe { &*p };
                set.with_entries(
                    |es| match es.binary_search_by_key(&slot, |e| entry_slot(*e)) {
                        Ok(i) => entry_tiers(es[i]),
                        Err(_) => 0,
                    },
                )
            }
        }
    }

    /// Calls `f(slot, tiers)` for every holder, in slot order for heap sets.
    ///
    /// # Safety
    /// As for [`Holders::tiers_of`].
    #[inline(always)]
    pub(crate) unsafe fn for_each(self, mut f: impl FnMut(u32, u8)) {
        match self.heap() {
            None => {
                let mut w = self.0 >> 1;
                for _ in 0..INLINE_CAP {
                    let e = (w & ENTRY_MASK) as Entry;
                    if entry_tiers(e) != 0 {
                        f(entry_slot(e), entry_tiers(e));
                    }
                    w >>= ENTRY_BITS;
                }
            }
            Some(p) => {
                // SAFETY: by this function's contract the set is alive and published.
                let set = unsafe { &*p };
                set.with_entries(|es| {
                    for &e in es {
                        f(entry_slot(e), entry_tiers(e));
                    }
                })
            }
        }
    }

    /// Heap bytes this word owns.
    ///
    /// # Safety
    /// As for [`Holders::tiers_of`].
    pub(crate) unsafe fn heap_bytes(self) -> usize {
        match self.heap() {
            None => 0,
            Some(p) => {
                // SAFETY: by this function's contract the set is alive and published.
                let set = unsafe { &*p };
                set.with_entries(|es| HeapHolders::bytes_for(es.len()))
            }
        }
    }
}

/// The result of changing one rank's tiers in a holder word.
pub(crate) struct Rewrite {
    pub(crate) word: Holders,
    /// The heap set the old word owned, if the new word no longer uses it: retire it.
    pub(crate) retired: Option<*mut HeapHolders>,
    /// Heap bytes allocated minus freed by this rewrite.
    pub(crate) heap_delta: isize,
}

/// Returns `old` with `slot`'s tier mask set to `tiers` (0 removes the holder).
///
/// # Safety
/// Called by the shard's writer, which alone replaces words, with `old` loaded under its
/// lock: a heap set it points to is alive.
pub(crate) unsafe fn rewrite(old: Holders, slot: u32, tiers: u8) -> Rewrite {
    debug_assert!(slot < MAX_SLOTS && tiers < 8);
    let mut list: smallvec::SmallVec<[Entry; 16]> = smallvec::SmallVec::new();
    let mut found = false;
    // SAFETY: forwarded from this function's contract.
    unsafe {
        old.for_each(|s, t| {
            if s == slot {
                found = true;
                if tiers != 0 {
                    list.push(entry(s, tiers));
                }
            } else {
                list.push(entry(s, t));
            }
        })
    };
    if !found && tiers != 0 {
        list.push(entry(slot, tiers));
    }
    list.sort_unstable_by_key(|e| entry_slot(*e));

    let (word, new_bytes) = if list.is_empty() {
        (Holders::EMPTY, 0)
    } else if list.len() <= INLINE_CAP {
        let mut w = 0u64;
        for (i, e) in list.iter().enumerate() {
            w |= (*e as u64) << (i as u32 * ENTRY_BITS);
        }
        (Holders((w << 1) | INLINE_TAG), 0)
    } else {
        let n = list.len();
        let set = HeapHolders::new(list.into_vec().into_boxed_slice());
        let p = Box::into_raw(set);
        debug_assert!(p as usize & 1 == 0);
        (Holders(p as usize as u64), HeapHolders::bytes_for(n))
    };
    // SAFETY: forwarded from this function's contract.
    let old_bytes = unsafe { old.heap_bytes() };
    Rewrite {
        word,
        retired: old.heap().map(|p| p as *mut HeapHolders),
        heap_delta: new_bytes as isize - old_bytes as isize,
    }
}

/// Frees a heap set.
///
/// # Safety
/// `p` came from [`rewrite`], is no longer reachable from any table, and no reader can
/// still hold it (its epoch has passed, or the index is being dropped).
pub(crate) unsafe fn free_heap(p: *mut HeapHolders) {
    // SAFETY: forwarded from this function's contract; `p` came from `Box::into_raw`.
    drop(unsafe { Box::from_raw(p) });
}

/// Frees the heap set a word owns, if any.
///
/// # Safety
/// As for [`free_heap`].
pub(crate) unsafe fn free_word(w: Holders) {
    if let Some(p) = w.heap() {
        // SAFETY: forwarded from this function's contract.
        unsafe { free_heap(p as *mut HeapHolders) }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn holders(w: Holders) -> Vec<(u32, u8)> {
        let mut v = Vec::new();
        // SAFETY: single-threaded test; every word here is live.
        unsafe { w.for_each(|s, t| v.push((s, t))) };
        v.sort();
        v
    }

    #[test]
    fn inline_then_heap_then_back() {
        let mut w = Holders::EMPTY;
        let mut retired = Vec::new();
        for slot in [7u32, 3, MAX_SLOTS - 1, 0, 12] {
            // SAFETY: single-threaded; the old word is live.
            let r = unsafe { rewrite(w, slot, 1) };
            retired.extend(r.retired);
            w = r.word;
        }
        assert_eq!(w.0 & 1, 0, "five holders live on the heap");
        assert_eq!(
            holders(w),
            vec![(0, 1), (3, 1), (7, 1), (12, 1), (MAX_SLOTS - 1, 1)]
        );
        // SAFETY: as above.
        unsafe {
            assert_eq!(w.tiers_of(12), 1);
            assert_eq!(w.tiers_of(13), 0);
        }
        for slot in [7u32, 3] {
            // SAFETY: as above.
            let r = unsafe { rewrite(w, slot, 0) };
            retired.extend(r.retired);
            w = r.word;
        }
        assert_eq!(w.0 & 1, 1, "three holders fit inline again");
        assert_eq!(holders(w), vec![(0, 1), (12, 1), (MAX_SLOTS - 1, 1)]);
        // SAFETY: as above; tier bits of an inline entry.
        let r = unsafe { rewrite(w, 12, 0b110) };
        assert_eq!(holders(r.word), vec![(0, 1), (12, 6), (MAX_SLOTS - 1, 1)]);
        for p in retired {
            // SAFETY: single-threaded; nothing references the retired sets.
            unsafe { free_heap(p) };
        }
    }

    #[test]
    fn removing_last_holder_empties_word() {
        // SAFETY: single-threaded test.
        let r = unsafe { rewrite(Holders::EMPTY, 5, 1) };
        // SAFETY: as above.
        let r2 = unsafe { rewrite(r.word, 5, 0) };
        assert!(r2.word.is_empty());
    }
}
