//! The flat node table: sequence hash → holder word, one open-addressing table per shard.
//!
//! A node is identified by its chained sequence hash, so a walk of depth D is D
//! independent probes that can all be in flight at once, not D dependent pointer chases.
//!
//! Protocol (see `crate::docs` for the proofs):
//! - a slot's key goes from empty to one key exactly once per table; the writer stores the
//!   holder word first and then the key with `Release`, the reader loads the key with
//!   `Acquire` and then the word, so a found key always comes with its published word;
//! - a removed node keeps its key with an empty word ("dead"); the same key coming back
//!   revives the slot. Keys are never erased in place, so a reader never sees a key and
//!   another node's word;
//! - a table with too many dead or live slots is rebuilt: the writer copies the live nodes
//!   into a new table, publishes it with `Release` and retires the old one through the
//!   epoch collector. Readers still in the old table see it frozen at the swap.
//!
//! Writers of one shard serialize on the shard's mutex; readers take no lock.

use super::holders::{self, Holders};
use crate::sync::atomic::{AtomicU64, Ordering};
#[cfg(loom)]
use crate::sync::UnsafeCell;
use crate::sync::{epoch, Mutex};

/// The key of an empty slot.
const EMPTY: u64 = 0;
/// Sequence hash 0 is stored under this key instead (a real hash equal to it would share
/// the node: probability 2^-64 per block, accepted and documented).
const ZERO_ALIAS: u64 = 0x9e37_79b9_7f4a_7c15;
/// Rebuild when live + dead slots exceed this fraction of the capacity.
const MAX_LOAD_NUM: usize = 4;
const MAX_LOAD_DEN: usize = 5;
/// A rebuilt table starts at this load (live / capacity).
const TARGET_LOAD_NUM: usize = 1;
const TARGET_LOAD_DEN: usize = 2;
/// Shrink when live slots fall under capacity / this.
const SHRINK_RATIO: usize = 8;

#[inline(always)]
pub(crate) fn table_key(seq: u64) -> u64 {
    if seq == EMPTY {
        ZERO_ALIAS
    } else {
        seq
    }
}

/// A prepared lookup of one key in one table (see [`Table::probe`]).
#[derive(Clone, Copy)]
pub(crate) struct Probe<'t> {
    table: &'t Table,
    home: usize,
    key: u64,
}

impl Probe<'_> {
    /// Hints the CPU to start loading the key's home slot.
    #[inline(always)]
    pub(crate) fn prefetch(&self) {
        let p = &self.table.slots[self.home] as *const Slot;
        #[cfg(all(target_arch = "x86_64", not(loom)))]
        // SAFETY: prefetch is a hint that never faults or dereferences; SSE is part of the
        // x86_64 baseline, so the intrinsic is available on every x86_64 CPU.
        unsafe {
            core::arch::x86_64::_mm_prefetch(p.cast::<i8>(), core::arch::x86_64::_MM_HINT_T0)
        };
        #[cfg(not(all(target_arch = "x86_64", not(loom))))]
        let _ = p;
    }

    /// The key's holder word (empty if absent). Lock-free; never waits for a writer.
    #[inline(always)]
    pub(crate) fn get(&self) -> Holders {
        let t = self.table;
        #[cfg(loom)]
        t.alive.with(|_| ());
        let slots = &t.slots[..];
        let mut i = self.home;
        loop {
            let slot = &slots[i];
            let k = slot.key.load(Ordering::Acquire);
            if k == self.key {
                return Holders(slot.word.load(Ordering::Acquire));
            }
            if k == EMPTY {
                return Holders::EMPTY;
            }
            i += 1;
            if i == slots.len() {
                i = 0;
            }
        }
    }
}

struct Slot {
    key: AtomicU64,
    word: AtomicU64,
}

pub(crate) struct Table {
    slots: Box<[Slot]>,
    /// Read on every lookup and written when the table dies, so that loom sees a reader
    /// that outlives the table (loom models only).
    #[cfg(loom)]
    alive: UnsafeCell<()>,
}

impl Table {
    fn with_capacity(cap: usize) -> Self {
        let slots = (0..cap)
            .map(|_| Slot {
                key: AtomicU64::new(EMPTY),
                word: AtomicU64::new(0),
            })
            .collect();
        Table {
            slots,
            #[cfg(loom)]
            alive: UnsafeCell::new(()),
        }
    }

    /// Marks the table dead through a loom-tracked write (the negative controls use this
    /// instead of freeing, so a caught bug is reported rather than being real UB).
    #[cfg(loom)]
    fn poison(&self) {
        self.alive.with_mut(|_| ());
    }

    #[inline(always)]
    fn home(&self, key: u64) -> usize {
        // Multiply-shift range reduction on the key's high bits (shards use the low bits).
        ((key as u128 * self.slots.len() as u128) >> 64) as usize
    }

    /// A lookup of `key` whose home slot is computed once, so it can be prefetched
    /// early and probed later without redoing the address arithmetic.
    #[inline(always)]
    pub(crate) fn probe(&self, key: u64) -> Probe<'_> {
        Probe {
            table: self,
            home: self.home(key),
            key,
        }
    }

    /// The holder word of `key` (empty if absent). Lock-free; never waits for a writer.
    #[inline(always)]
    #[allow(dead_code)]
    pub(crate) fn get(&self, key: u64) -> Holders {
        self.probe(key).get()
    }

    fn bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.slots.len() * std::mem::size_of::<Slot>()
    }

    /// The slot of `key`, or the empty slot where it would go. Writer only.
    fn find_for_write(&self, key: u64) -> (usize, bool) {
        let cap = self.slots.len();
        let mut i = self.home(key);
        loop {
            let k = self.slots[i].key.load(Ordering::Relaxed);
            if k == key {
                return (i, true);
            }
            if k == EMPTY {
                return (i, false);
            }
            i += 1;
            if i == cap {
                i = 0;
            }
        }
    }
}

/// Writer-side bookkeeping of one shard, guarded by its mutex.
struct ShardWriter {
    /// Slots with a key (live or dead).
    used: usize,
    /// Slots with a non-empty word.
    live: usize,
}

pub(crate) struct Shard {
    table: epoch::Atomic<Table>,
    writer: Mutex<ShardWriter>,
    min_capacity: usize,
    /// Bytes of the current table (read by stats).
    table_bytes: AtomicU64,
    /// Live nodes (read by stats).
    live: AtomicU64,
}

/// The change one holder update made.
pub(crate) struct TierChange {
    pub(crate) before: u8,
    pub(crate) after: u8,
    pub(crate) heap_delta: isize,
}

impl Shard {
    pub(crate) fn new(min_capacity: usize) -> Self {
        let min_capacity = min_capacity.max(4);
        let t = Table::with_capacity(min_capacity);
        let bytes = t.bytes() as u64;
        Shard {
            table: epoch::Atomic::new(t),
            writer: Mutex::new(ShardWriter { used: 0, live: 0 }),
            min_capacity,
            table_bytes: AtomicU64::new(bytes),
            live: AtomicU64::new(0),
        }
    }

    /// The current table, valid while `guard` is pinned.
    #[inline(always)]
    pub(crate) fn table<'g>(&self, guard: &'g epoch::Guard) -> &'g Table {
        let t = self.table.load(Ordering::Acquire, guard);
        // SAFETY: the pointer is never null (set in `new`, replaced only by a non-null
        // table), and a replaced table is retired through the epoch, so it outlives `guard`.
        unsafe { t.deref() }
    }

    pub(crate) fn table_bytes(&self) -> u64 {
        self.table_bytes.load(Ordering::Relaxed)
    }

    pub(crate) fn live_nodes(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    /// Adds (`set = true`) or removes `tier_bits` for `slot` on the node `key`.
    pub(crate) fn update(
        &self,
        key: u64,
        slot: u32,
        tier_bits: u8,
        set: bool,
        guard: &epoch::Guard,
    ) -> TierChange {
        let mut w = self.writer.lock();
        let table = self.table(guard);
        let (i, found) = table.find_for_write(key);
        let old = if found {
            Holders(table.slots[i].word.load(Ordering::Relaxed))
        } else {
            Holders::EMPTY
        };
        // SAFETY: we hold the shard's writer lock; `old` was loaded under it, so a heap
        // set it points to is alive.
        let before = unsafe { old.tiers_of(slot) };
        let after = if set {
            before | tier_bits
        } else {
            before & !tier_bits
        };
        if after == before {
            return TierChange {
                before,
                after,
                heap_delta: 0,
            };
        }
        // SAFETY: as above.
        let rw = unsafe { holders::rewrite(old, slot, after) };
        if found {
            table.slots[i].word.store(rw.word.0, publish_ordering());
            if old.is_empty() && !rw.word.is_empty() {
                w.live += 1;
            } else if !old.is_empty() && rw.word.is_empty() {
                w.live -= 1;
            }
        } else {
            // Only additions reach here (a removal of an absent node changes nothing).
            let slot_ref = &table.slots[i];
            slot_ref.word.store(rw.word.0, Ordering::Relaxed);
            slot_ref.key.store(key, publish_ordering());
            w.used += 1;
            w.live += 1;
        }
        if let Some(p) = rw.retired {
            retire_holders(p, guard);
        }
        let cap = table.slots.len();
        if w.used * MAX_LOAD_DEN > cap * MAX_LOAD_NUM
            || (w.live * SHRINK_RATIO < cap && cap > self.min_capacity)
        {
            self.rebuild(&mut w, table, guard);
        }
        self.live.store(w.live as u64, Ordering::Relaxed);
        TierChange {
            before,
            after,
            heap_delta: rw.heap_delta,
        }
    }

    /// Copies the live nodes into a table sized for them and swaps it in.
    fn rebuild(&self, w: &mut ShardWriter, old: &Table, guard: &epoch::Guard) {
        let cap = (w.live * TARGET_LOAD_DEN / TARGET_LOAD_NUM).max(self.min_capacity);
        let new = Table::with_capacity(cap);
        let mut live = 0;
        for s in old.slots.iter() {
            let word = s.word.load(Ordering::Relaxed);
            if word == 0 {
                continue;
            }
            let key = s.key.load(Ordering::Relaxed);
            let (i, _) = new.find_for_write(key);
            new.slots[i].word.store(word, Ordering::Relaxed);
            new.slots[i].key.store(key, Ordering::Relaxed);
            live += 1;
        }
        debug_assert_eq!(live, w.live);
        w.used = live;
        self.table_bytes
            .store(new.bytes() as u64, Ordering::Relaxed);
        let prev = self
            .table
            .swap(epoch::Owned::new(new), publish_ordering(), guard);
        // The heap sets the old table points to now belong to the new one: only the
        // table itself is retired.
        retire_table(prev, guard);
    }

    /// Calls `f(key, word)` for every live node. Writer-lock held; for teardown and tests.
    #[allow(dead_code)]
    pub(crate) fn for_each_live(&self, guard: &epoch::Guard, mut f: impl FnMut(u64, Holders)) {
        let _w = self.writer.lock();
        let table = self.table(guard);
        for s in table.slots.iter() {
            let word = s.word.load(Ordering::Relaxed);
            if word != 0 {
                f(s.key.load(Ordering::Relaxed), Holders(word));
            }
        }
    }
}

#[cfg(loom)]
impl Drop for Table {
    fn drop(&mut self) {
        // A loom model that already failed must unwind without a second panic.
        if std::thread::panicking() {
            return;
        }
        crate::sync::faults::note_free();
        self.alive.with_mut(|_| ());
    }
}

impl Drop for Shard {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no reader or writer can reach this shard any more, so the
        // current table and its heap sets can be freed now (retired ones are the
        // collector's).
        unsafe {
            let guard = epoch::unprotected();
            let t = self.table.load(Ordering::Relaxed, guard);
            for s in t.deref().slots.iter() {
                holders::free_word(Holders(s.word.load(Ordering::Relaxed)));
            }
            drop(t.into_owned());
        }
    }
}

#[inline(always)]
fn publish_ordering() -> Ordering {
    #[cfg(loom)]
    if crate::sync::faults::get().relaxed_publish {
        return Ordering::Relaxed;
    }
    Ordering::Release
}

fn retire_holders(p: *mut holders::HeapHolders, guard: &epoch::Guard) {
    #[cfg(loom)]
    if crate::sync::faults::get().free_holders_now {
        // Negative control (loom models only): "free" at once while readers may hold the
        // set. It is poisoned through a loom-tracked write and leaked rather than freed, so
        // the model reports the race instead of touching freed memory.
        // SAFETY: the set is still allocated (leaked, never freed).
        unsafe { holders::HeapHolders::poison(p) };
        return;
    }
    let addr = p as usize;
    // SAFETY: the set is unreachable from the table (its word was replaced under the
    // writer lock), and the closure runs only after every guard pinned now is dropped.
    unsafe {
        guard.defer_unchecked(move || holders::free_heap(addr as *mut holders::HeapHolders));
    }
}

fn retire_table(t: epoch::Shared<'_, Table>, guard: &epoch::Guard) {
    #[cfg(loom)]
    if crate::sync::faults::get().free_table_now {
        // Negative control (loom models only): poison now, leak instead of freeing.
        // SAFETY: the table is still allocated (leaked, never freed).
        unsafe { t.deref().poison() };
        return;
    }
    // SAFETY: the table was swapped out under the writer lock, so no new reader can
    // reach it; the destructor runs after every guard pinned now is dropped.
    unsafe { guard.defer_destroy(t) };
}
