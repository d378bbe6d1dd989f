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

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};

use crate::hash::mix::HashMixMap;
use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::{Mutex, UnsafeCell};

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

/// An immutable, slot-sorted holder set of more than three ranks: one allocation, a
/// header followed by the entries, so a reader pays one cache miss, not two.
#[repr(C)]
pub(crate) struct HeapHolders {
    /// Created with the set and written when it dies, so that loom sees a reader that
    /// reads an unpublished or freed set. Zero-sized outside loom.
    alive: UnsafeCell<()>,
    /// Nodes whose word points here. Changed only under the interner shard's lock.
    refs: AtomicUsize,
    len: u32,
    entries: [Entry; 0],
}

impl HeapHolders {
    fn layout(n: usize) -> Layout {
        let (l, _) = Layout::new::<HeapHolders>()
            .extend(Layout::array::<Entry>(n).expect("holder set size"))
            .expect("holder set size");
        l.pad_to_align()
    }

    /// Allocates a set holding `entries` (slot-sorted).
    fn alloc(entries: &[Entry]) -> *mut HeapHolders {
        let layout = Self::layout(entries.len());
        // SAFETY: the layout has non-zero size (the header has a u32).
        let p = unsafe { alloc(layout) }.cast::<HeapHolders>();
        if p.is_null() {
            handle_alloc_error(layout);
        }
        // SAFETY: `p` is a fresh allocation of `layout`, which holds the header followed by
        // room for `entries.len()` entries; writes go through raw pointers derived from `p`.
        unsafe {
            std::ptr::write(
                p,
                HeapHolders {
                    alive: UnsafeCell::new(()),
                    refs: AtomicUsize::new(1),
                    len: entries.len() as u32,
                    entries: [],
                },
            );
            let data = std::ptr::addr_of_mut!((*p).entries).cast::<Entry>();
            std::ptr::copy_nonoverlapping(entries.as_ptr(), data, entries.len());
        }
        p
    }

    /// The entries of a live, published set.
    ///
    /// # Safety
    /// `p` came from [`HeapHolders::alloc`] and is not freed for the returned lifetime.
    #[inline(always)]
    unsafe fn entries<'a>(p: *const HeapHolders) -> &'a [Entry] {
        // SAFETY: per the contract the header is initialised and `len` entries follow it
        // in the same allocation; the pointer keeps the allocation's provenance.
        unsafe {
            (*p).alive.with(|_| ());
            let n = (*p).len as usize;
            std::slice::from_raw_parts(std::ptr::addr_of!((*p).entries).cast::<Entry>(), n)
        }
    }

    /// Heap bytes of a set with `n` entries (for the index's byte count).
    pub(crate) fn bytes_for(n: usize) -> usize {
        Self::layout(n).size()
    }

    /// A loom-tracked write, as a free does, without freeing (negative controls).
    ///
    /// # Safety
    /// `p` came from [`HeapHolders::alloc`] and is not freed.
    #[cfg(loom)]
    pub(crate) unsafe fn poison(p: *const HeapHolders) {
        // SAFETY: per the contract the header is initialised.
        unsafe { (*p).alive.with_mut(|_| ()) };
    }

    /// Frees a set.
    ///
    /// # Safety
    /// `p` came from [`HeapHolders::alloc`], and nothing can read it any more.
    unsafe fn free(p: *mut HeapHolders) {
        // SAFETY: per the contract the header is initialised and the set unreachable.
        unsafe {
            let n = (*p).len as usize;
            #[cfg(loom)]
            {
                crate::sync::faults::note_free();
                if !std::thread::panicking() {
                    (*p).alive.with_mut(|_| ());
                }
            }
            std::ptr::drop_in_place(p);
            dealloc(p.cast::<u8>(), Self::layout(n));
        }
    }
}

/// A holder word, as loaded from a node.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Holders(pub(crate) u64);

/// A holder word taken apart.
pub(crate) enum HolderView<'a> {
    Empty,
    /// Up to three `(slot, tiers)` entries, packed; see [`inline_entries`].
    Inline(u64),
    /// Slot-sorted entries; decode with [`entry_slot`] and [`entry_tiers`].
    Heap(&'a [Entry]),
}

/// The present entries of an inline word, in slot order.
#[inline(always)]
pub(crate) fn inline_entries(w: u64) -> impl Iterator<Item = (u32, u8)> {
    (0..INLINE_CAP as u32).filter_map(move |i| {
        let e = ((w >> (1 + i * ENTRY_BITS)) & ENTRY_MASK) as Entry;
        (entry_tiers(e) != 0).then(|| (entry_slot(e), entry_tiers(e)))
    })
}

/// The word of a node held by `slot` alone, on exactly `tiers`: the common case, which a
/// walk tests with one comparison.
#[inline(always)]
pub(crate) fn sole_holder_word(slot: u32, tiers: u8) -> u64 {
    ((entry(slot, tiers) as u64) << 1) | INLINE_TAG
}

#[inline(always)]
pub(crate) fn entry_slot_of(e: u32) -> u32 {
    entry_slot(e)
}

#[inline(always)]
pub(crate) fn entry_tiers_of(e: u32) -> u8 {
    entry_tiers(e)
}

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

    /// The word taken apart.
    ///
    /// # Safety
    /// A heap word must have been loaded with `Acquire` inside an epoch guard that is
    /// still pinned for `'a` (or under the shard's writer lock), so the set is alive and
    /// published.
    #[inline(always)]
    pub(crate) unsafe fn view<'a>(self) -> HolderView<'a> {
        if self.0 == 0 {
            HolderView::Empty
        } else if self.0 & INLINE_TAG != 0 {
            HolderView::Inline(self.0)
        } else {
            // SAFETY: forwarded from this function's contract.
            HolderView::Heap(unsafe { HeapHolders::entries(self.0 as usize as *const HeapHolders) })
        }
    }

    /// Tiers on which `slot` holds the block (0 = not held).
    ///
    /// # Safety
    /// As for [`Holders::view`].
    #[inline(always)]
    pub(crate) unsafe fn tiers_of(self, slot: u32) -> u8 {
        // SAFETY: forwarded from this function's contract.
        match unsafe { self.view() } {
            HolderView::Empty => 0,
            HolderView::Inline(w) => {
                let mut w = w >> 1;
                for _ in 0..INLINE_CAP {
                    let e = (w & ENTRY_MASK) as Entry;
                    if entry_slot(e) == slot && entry_tiers(e) != 0 {
                        return entry_tiers(e);
                    }
                    w >>= ENTRY_BITS;
                }
                0
            }
            HolderView::Heap(es) => match es.binary_search_by_key(&slot, |e| entry_slot(*e)) {
                Ok(i) => entry_tiers(es[i]),
                Err(_) => 0,
            },
        }
    }

    /// Calls `f(slot, tiers)` for every holder, in slot order.
    ///
    /// # Safety
    /// As for [`Holders::view`].
    #[inline(always)]
    pub(crate) unsafe fn for_each(self, mut f: impl FnMut(u32, u8)) {
        // SAFETY: forwarded from this function's contract.
        match unsafe { self.view() } {
            HolderView::Empty => {}
            HolderView::Inline(w) => inline_entries(w).for_each(|(s, t)| f(s, t)),
            HolderView::Heap(es) => es.iter().for_each(|&e| f(entry_slot(e), entry_tiers(e))),
        }
    }
}

/// The result of changing one rank's tiers in a holder word.
pub(crate) struct Rewrite {
    pub(crate) word: Holders,
    /// A heap set no node uses any more: retire it through the epoch.
    pub(crate) retired: Option<*mut HeapHolders>,
    /// Heap bytes allocated minus released by this rewrite.
    pub(crate) heap_delta: isize,
}

/// Hash-consing of heap holder sets: every distinct set exists once, shared by all the
/// nodes it describes (a prompt prefix cached by the same eight ranks is one set, not one
/// per block). That saves memory and lets a walk recognise "same holders as the previous
/// block" by comparing words. Reference counts change only under the lock of the shard
/// of the interner that owns the set's content hash; writers of the node tables take it
/// after their own shard lock (a leaf lock). Readers never touch the interner.
pub(crate) struct Interner {
    shards: Box<[Mutex<InternShard>]>,
}

/// Content hash → the sets with that hash (addresses; nearly always one).
type InternShard = HashMixMap<u64, smallvec::SmallVec<[usize; 1]>>;

const INTERN_SHARDS: usize = 64;

fn content_hash(entries: &[Entry]) -> u64 {
    entries.iter().fold(0x243f_6a88_85a3_08d3u64, |h, &e| {
        let m = ((h ^ e as u64) as u128) * 0x9e37_79b9_7f4a_7c15u128;
        (m as u64) ^ ((m >> 64) as u64)
    })
}

impl Interner {
    pub(crate) fn new() -> Self {
        Interner {
            shards: (0..INTERN_SHARDS)
                .map(|_| Mutex::new(HashMixMap::default()))
                .collect(),
        }
    }

    fn shard(&self, h: u64) -> &Mutex<InternShard> {
        &self.shards[(h >> 58) as usize % INTERN_SHARDS]
    }

    /// The set with exactly `entries` (slot-sorted), one more reference to it; and the
    /// bytes allocated (0 when it already existed).
    fn acquire(&self, entries: &[Entry]) -> (*mut HeapHolders, usize) {
        let h = content_hash(entries);
        let mut map = self.shard(h).lock();
        let ptrs = map.entry(h).or_default();
        for &p in ptrs.iter() {
            let p = p as *mut HeapHolders;
            // SAFETY: sets in the interner are alive (removed from it before retiring).
            if unsafe { HeapHolders::entries(p) } == entries {
                // SAFETY: as above.
                unsafe { (*p).refs.fetch_add(1, Ordering::Relaxed) };
                return (p, 0);
            }
        }
        let p = HeapHolders::alloc(entries);
        ptrs.push(p as usize);
        (p, HeapHolders::bytes_for(entries.len()))
    }

    /// Drops one reference to `p`; returns it with its size if that was the last one (the
    /// caller retires it through the epoch).
    ///
    /// # Safety
    /// `p` is a set of this interner, alive, and the caller owns the reference it drops.
    unsafe fn release(&self, p: *mut HeapHolders) -> Option<(*mut HeapHolders, usize)> {
        // SAFETY: per the contract `p` is alive.
        let entries = unsafe { HeapHolders::entries(p) };
        let h = content_hash(entries);
        let mut map = self.shard(h).lock();
        // SAFETY: as above.
        if unsafe { (*p).refs.fetch_sub(1, Ordering::Relaxed) } != 1 {
            return None;
        }
        if let Some(ptrs) = map.get_mut(&h) {
            ptrs.retain(|q| *q != p as usize);
            if ptrs.is_empty() {
                map.remove(&h);
            }
        }
        Some((p, HeapHolders::bytes_for(entries.len())))
    }
}

impl Drop for Interner {
    fn drop(&mut self) {
        for shard in self.shards.iter() {
            for (_, ptrs) in shard.lock().drain() {
                for p in ptrs {
                    // SAFETY: `&mut self` at drop: the index and its tables are gone, so no
                    // node or reader can reach these sets; retired ones are not in the map.
                    unsafe { HeapHolders::free(p as *mut HeapHolders) };
                }
            }
        }
    }
}

/// Returns `old` with `slot`'s tier mask set to `tiers` (0 removes the holder).
///
/// # Safety
/// Called by the shard's writer, which alone replaces words, with `old` loaded under its
/// lock: a heap set it points to is alive and holds a reference owned by this node.
pub(crate) unsafe fn rewrite(interner: &Interner, old: Holders, slot: u32, tiers: u8) -> Rewrite {
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

    let mut heap_delta = 0isize;
    let word = if list.is_empty() {
        Holders::EMPTY
    } else if list.len() <= INLINE_CAP {
        let mut w = 0u64;
        for (i, e) in list.iter().enumerate() {
            w |= (*e as u64) << (i as u32 * ENTRY_BITS);
        }
        Holders((w << 1) | INLINE_TAG)
    } else {
        let (p, bytes) = interner.acquire(&list);
        debug_assert!(p as usize & 1 == 0);
        heap_delta += bytes as isize;
        Holders(p as usize as u64)
    };
    let mut retired = None;
    if let Some(p) = old.heap() {
        // SAFETY: forwarded from this function's contract: this node owned a reference.
        if let Some((p, bytes)) = unsafe { interner.release(p as *mut HeapHolders) } {
            heap_delta -= bytes as isize;
            retired = Some(p);
        }
    }
    Rewrite {
        word,
        retired,
        heap_delta,
    }
}

/// Frees a heap set.
///
/// # Safety
/// `p` came from [`rewrite`], is no longer reachable from any table or the interner, and
/// no reader can still hold it (its epoch has passed).
pub(crate) unsafe fn free_heap(p: *mut HeapHolders) {
    // SAFETY: forwarded from this function's contract.
    unsafe { HeapHolders::free(p) };
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
        let interner = Interner::new();
        let mut w = Holders::EMPTY;
        let mut retired = Vec::new();
        for slot in [7u32, 3, MAX_SLOTS - 1, 0, 12] {
            // SAFETY: single-threaded; the old word is live.
            let r = unsafe { rewrite(&interner, w, slot, 1) };
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
            let r = unsafe { rewrite(&interner, w, slot, 0) };
            retired.extend(r.retired);
            w = r.word;
        }
        assert_eq!(w.0 & 1, 1, "three holders fit inline again");
        assert_eq!(holders(w), vec![(0, 1), (12, 1), (MAX_SLOTS - 1, 1)]);
        // SAFETY: as above; tier bits of an inline entry.
        let r = unsafe { rewrite(&interner, w, 12, 0b110) };
        assert_eq!(holders(r.word), vec![(0, 1), (12, 6), (MAX_SLOTS - 1, 1)]);
        for p in retired {
            // SAFETY: single-threaded; nothing references the retired sets.
            unsafe { free_heap(p) };
        }
    }

    #[test]
    fn removing_last_holder_empties_word() {
        let interner = Interner::new();
        // SAFETY: single-threaded test.
        let r = unsafe { rewrite(&interner, Holders::EMPTY, 5, 1) };
        // SAFETY: as above.
        let r2 = unsafe { rewrite(&interner, r.word, 5, 0) };
        assert!(r2.word.is_empty());
    }
}
