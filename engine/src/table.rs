//! A sharded `u64 → u64` table with lock-free reads: one open-addressing table per shard.
//! The index's branch table (children of runs, see `branch`) and the engine's
//! selection-id map (`crate::idmap`) are built on it. (It was kvr's first index: one node
//! per block keyed by its sequence hash.)
//!
//! Layout: a table is one allocation of `(key, word)` slots, aligned to 256 bytes, so the
//! shard's single atomic table word carries both the slots' address and a capacity code
//! in its low 8 bits. A reader gets everything it needs to compute a slot's address from
//! one load (no header to chase), and capacities can grow in steps of 1/8 instead of 2×.
//!
//! Protocol (see `crate::docs` for the proofs):
//! - a slot's key goes from empty to one key exactly once per table; the writer stores the
//!   word first and then the key with `Release`, the reader loads the key with
//!   `Acquire` and then the word, so a found key always comes with its published word;
//! - a removed node keeps its key with an empty word ("dead"); the same key coming back
//!   revives the slot. Keys are never erased in place, so a reader never sees a key and
//!   another node's word;
//! - a table with too many dead or live slots is rebuilt: the writer copies the live nodes
//!   into a new table, publishes it with `Release` and retires the old one through the
//!   epoch collector. Readers still in the old table see it frozen at the swap.
//!
//! Writers of one shard serialize on the shard's mutex; readers take no lock.

use std::alloc::{dealloc, handle_alloc_error, Layout};
use std::marker::PhantomData;

use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
use crate::sync::UnsafeCell;
use crate::sync::{epoch, Mutex};

/// The key of an empty slot.
const EMPTY: u64 = 0;
/// Sequence hash 0 is stored under this key instead (a real hash equal to it would share
/// the node: probability 2^-64 per block, accepted and documented).
const ZERO_ALIAS: u64 = 0x9e37_79b9_7f4a_7c15;
/// Rebuild when live + dead slots exceed this percentage of the capacity.
const MAX_LOAD_PCT: usize = 85;
/// A rebuilt table starts at about this load (live / capacity), in percent.
const TARGET_LOAD_PCT: usize = 62;
/// Shrink when live slots fall under capacity / this.
const SHRINK_RATIO: usize = 8;
/// Slots past the last home slot, so probes run off the end instead of wrapping around;
/// the very last one is never filled (a sentinel that ends every probe). The tail grows
/// with the table, so even keys crafted to share one home fit once the table has grown
/// to 64 times their number: growth on overflow always terminates.
#[inline(always)]
fn tail(cap: usize) -> usize {
    (cap / 64).max(32)
}
/// Table alignment; its low bits carry the capacity code in the shard's table word.
const TABLE_ALIGN: usize = 256;
const CODE_MASK: usize = TABLE_ALIGN - 1;

#[inline(always)]
pub(crate) fn table_key(seq: u64) -> u64 {
    if seq == EMPTY {
        ZERO_ALIAS
    } else {
        seq
    }
}

/// Capacity of a code: `(8 + m) << e` with `m` the low 3 bits and `e` the next 5.
#[inline(always)]
fn capacity_of(code: usize) -> usize {
    (8 + (code & 7)) << (code >> 3)
}

/// The smallest code whose capacity is at least `n`.
fn code_for(n: usize) -> usize {
    for e in 0..32 {
        for m in 0..8 {
            if (8 + m) << e >= n {
                return m | (e << 3);
            }
        }
    }
    panic!("table capacity {n} out of range")
}

struct Slot {
    key: AtomicU64,
    word: AtomicU64,
}

/// What precedes the slots of a table: nothing outside loom; under loom, a cell that is
/// read on every lookup and written when the table dies, so loom sees a reader that
/// outlives the table.
#[repr(C, align(256))]
struct TableHeader {
    #[cfg(loom)]
    alive: UnsafeCell<()>,
}

fn table_layout(cap: usize) -> (Layout, usize) {
    let (l, offset) = Layout::new::<TableHeader>()
        .extend(Layout::array::<Slot>(cap + tail(cap)).expect("table size"))
        .expect("table size");
    (l, offset)
}

/// Allocates an empty table and returns its word (address | capacity code).
fn alloc_table(code: usize) -> usize {
    let cap = capacity_of(code);
    let (layout, offset) = table_layout(cap);
    #[cfg(not(loom))]
    // SAFETY: the layout has non-zero size (at least 8 slots); all-zero bytes are valid
    // `AtomicU64`s, i.e. empty keys and empty words, and the zero-sized header.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    #[cfg(loom)]
    // SAFETY: the layout has non-zero size; every field is initialised below.
    let p = unsafe { std::alloc::alloc(layout) };
    if p.is_null() {
        handle_alloc_error(layout);
    }
    #[cfg(loom)]
    // SAFETY: `p` is a fresh allocation of `layout`: the header at 0, `cap` slots at
    // `offset`.
    unsafe {
        std::ptr::write(
            p.cast::<TableHeader>(),
            TableHeader {
                alive: UnsafeCell::new(()),
            },
        );
        let slots = p.add(offset).cast::<Slot>();
        for i in 0..cap + tail(cap) {
            std::ptr::write(
                slots.add(i),
                Slot {
                    key: AtomicU64::new(EMPTY),
                    word: AtomicU64::new(0),
                },
            );
        }
    }
    let _ = offset;
    debug_assert_eq!(p as usize & CODE_MASK, 0);
    p as usize | code
}

/// Frees a table (not the heap holder sets its words point to).
///
/// # Safety
/// `word` came from [`alloc_table`], is unreachable from any shard, and no reader can
/// still hold it.
unsafe fn free_table(word: usize) {
    let cap = capacity_of(word & CODE_MASK);
    let p = (word & !CODE_MASK) as *mut u8;
    let (layout, offset) = table_layout(cap);
    #[cfg(loom)]
    // SAFETY: per the contract the table is initialised and unreachable.
    unsafe {
        crate::sync::faults::note_free();
        let hdr = p.cast::<TableHeader>();
        if !std::thread::panicking() {
            (*hdr).alive.with_mut(|_| ());
        }
        let slots = p.add(offset).cast::<Slot>();
        for i in 0..cap + tail(cap) {
            std::ptr::drop_in_place(slots.add(i));
        }
        std::ptr::drop_in_place(hdr);
    }
    let _ = offset;
    // SAFETY: allocated in `alloc_table` with this layout.
    unsafe { dealloc(p, layout) };
}

/// A table as a reader or writer sees it, valid while the guard `'g` is pinned.
#[derive(Clone, Copy)]
pub(crate) struct TableRef<'g> {
    slots: *const Slot,
    cap: usize,
    #[cfg(loom)]
    header: *const TableHeader,
    _guard: PhantomData<&'g epoch::Guard>,
}

impl<'g> TableRef<'g> {
    /// # Safety
    /// `word` came from [`alloc_table`] and stays allocated for `'g`.
    #[inline(always)]
    unsafe fn from_word(word: usize) -> Self {
        let cap = capacity_of(word & CODE_MASK);
        let base = (word & !CODE_MASK) as *const u8;
        // The slots follow the header; the header is zero-sized outside loom.
        let offset = std::mem::size_of::<TableHeader>();
        TableRef {
            // SAFETY: `offset` is inside the allocation (per the contract).
            slots: unsafe { base.add(offset) }.cast::<Slot>(),
            cap,
            #[cfg(loom)]
            header: base.cast::<TableHeader>(),
            _guard: PhantomData,
        }
    }

    #[inline(always)]
    fn slot(&self, i: usize) -> &'g Slot {
        assert!(i < self.cap + tail(self.cap));
        // SAFETY: `i < cap + tail(cap)`, the number of slots; the table outlives `'g` (see
        // `from_word`).
        unsafe { &*self.slots.add(i) }
    }

    /// Index of the sentinel slot, which stays empty.
    fn sentinel(&self) -> usize {
        self.cap + tail(self.cap) - 1
    }

    #[inline(always)]
    fn home(&self, key: u64) -> usize {
        // Multiply-shift range reduction on the key's high bits (shards use the low bits).
        ((key as u128 * self.cap as u128) >> 64) as usize
    }

    /// A lookup of `key` whose home slot is computed once, so it can be prefetched
    /// early and probed later without redoing the address arithmetic.
    #[inline(always)]
    pub(crate) fn probe(self, key: u64) -> Probe<'g> {
        Probe {
            slot: self.slot(self.home(key)),
            key,
            #[cfg(loom)]
            header: self.header,
        }
    }

    /// The slot of `key`, or the empty slot where it would go (the sentinel when the tail
    /// is full: the caller must grow the table before inserting). Writer only.
    fn find_for_write(&self, key: u64) -> (usize, bool) {
        let mut i = self.home(key);
        loop {
            let k = self.slot(i).key.load(Ordering::Relaxed);
            if k == key {
                return (i, true);
            }
            if k == EMPTY {
                return (i, false);
            }
            i += 1;
        }
    }

    fn bytes(&self) -> usize {
        table_layout(self.cap).0.size()
    }
}

/// A prepared lookup of one key in one table (see [`TableRef::probe`]): its home slot
/// and the key, valid while the guard `'g` is pinned.
#[derive(Clone, Copy)]
pub(crate) struct Probe<'g> {
    slot: &'g Slot,
    key: u64,
    #[cfg(loom)]
    header: *const TableHeader,
}

impl Probe<'_> {
    /// The key's word (0 if absent). Lock-free; never waits for a writer.
    #[inline(always)]
    pub(crate) fn get(&self) -> u64 {
        #[cfg(loom)]
        // SAFETY: the header lives as long as the table (`'g`).
        unsafe {
            (*self.header).alive.with(|_| ())
        };
        let mut p = self.slot as *const Slot;
        loop {
            // SAFETY: `p` starts at a home slot (< cap) and moves up one slot at a time
            // until it meets the key or an empty slot; the last of the `cap + tail(cap)` slots
            // is never filled, so `p` stays inside the table, which outlives `'g`.
            let slot = unsafe { &*p };
            let k = slot.key.load(read_ordering(Fault::KeyLoad));
            if k == self.key {
                return slot.word.load(read_ordering(Fault::WordLoad));
            }
            if k == EMPTY {
                return 0;
            }
            // SAFETY: see above; the next slot exists because this one was not the sentinel.
            p = unsafe { p.add(1) };
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

/// Shards picked by a key's low bits (homes use its high bits): what the branch table,
/// the selection-id map and the recurrent-state table share.
pub(crate) struct Shards {
    shards: Box<[Shard]>,
    mask: u64,
}

impl Shards {
    /// `shards` (rounded up to a power of two) of at least `min_capacity` slots each.
    pub(crate) fn new(shards: usize, min_capacity: usize) -> Self {
        let n = shards.max(1).next_power_of_two();
        Shards {
            shards: (0..n).map(|_| Shard::new(min_capacity)).collect(),
            mask: n as u64 - 1,
        }
    }

    /// The shard that holds `key`.
    #[inline(always)]
    pub(crate) fn of(&self, key: u64) -> &Shard {
        &self.shards[(key & self.mask) as usize]
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Shard> {
        self.shards.iter()
    }

    pub(crate) fn table_bytes(&self) -> u64 {
        self.shards.iter().map(Shard::table_bytes).sum()
    }
}

pub(crate) struct Shard {
    /// The current table's address | capacity code.
    table: AtomicUsize,
    writer: Mutex<ShardWriter>,
    min_code: usize,
    /// Bytes of the current table (read by stats).
    table_bytes: AtomicU64,
    /// Live nodes (read by stats).
    live: AtomicU64,
}

impl Shard {
    pub(crate) fn new(min_capacity: usize) -> Self {
        let min_code = code_for(min_capacity.max(8));
        let word = alloc_table(min_code);
        Shard {
            table: AtomicUsize::new(word),
            writer: Mutex::new(ShardWriter { used: 0, live: 0 }),
            min_code,
            table_bytes: AtomicU64::new(table_layout(capacity_of(min_code)).0.size() as u64),
            live: AtomicU64::new(0),
        }
    }

    /// The current table, valid while `guard` is pinned.
    #[inline(always)]
    pub(crate) fn table<'g>(&self, _guard: &'g epoch::Guard) -> TableRef<'g> {
        let word = self.table.load(read_ordering(Fault::TableLoad));
        // SAFETY: the word always names a live table (set in `new`, replaced only by
        // another live table), and a replaced table is retired through the epoch, so it
        // outlives `_guard`.
        unsafe { TableRef::from_word(word) }
    }

    pub(crate) fn table_bytes(&self) -> u64 {
        self.table_bytes.load(Ordering::Relaxed)
    }

    #[cfg(test)]
    pub(crate) fn live_nodes(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    /// Sets `key`'s word to `value` (0 removes it) and returns the old word.
    pub(crate) fn set_word(&self, key: u64, value: u64, guard: &epoch::Guard) -> u64 {
        self.modify(key, guard, |old| {
            if old == value {
                (None, old)
            } else {
                (Some(value), old)
            }
        })
    }

    /// Sets `key`'s word to `value` only if it has none; returns the word it already had.
    pub(crate) fn set_word_if_absent(&self, key: u64, value: u64, guard: &epoch::Guard) -> u64 {
        self.modify(key, guard, |old| {
            if old != 0 {
                (None, old)
            } else {
                (Some(value), 0)
            }
        })
    }

    /// Every non-zero word (for an owner tearing the table down, or a snapshot taken
    /// under the writer lock).
    pub(crate) fn live_words(&self, guard: &epoch::Guard) -> Vec<u64> {
        let _w = self.writer.lock();
        let t = self.table(guard);
        (0..t.cap + tail(t.cap))
            .map(|i| t.slot(i).word.load(Ordering::Relaxed))
            .filter(|&w| w != 0)
            .collect()
    }

    /// Clears `key`'s word if it is `expected`; returns whether it was.
    pub(crate) fn clear_word_if(&self, key: u64, expected: u64, guard: &epoch::Guard) -> bool {
        self.modify(key, guard, |old| {
            if old == expected && old != 0 {
                (Some(0), true)
            } else {
                (None, false)
            }
        })
    }

    /// Under the writer lock: computes `key`'s new word from its old one (`None` = leave
    /// it), publishes it (inserting the key, growing the table if its probe tail is full),
    /// and rebuilds the table when it is too full or too empty.
    fn modify<R>(
        &self,
        key: u64,
        guard: &epoch::Guard,
        f: impl FnOnce(u64) -> (Option<u64>, R),
    ) -> R {
        let mut w = self.writer.lock();
        let mut table = self.table(guard);
        let (mut i, found) = table.find_for_write(key);
        let old = if found {
            table.slot(i).word.load(Ordering::Relaxed)
        } else {
            0
        };
        let (new, r) = f(old);
        let Some(new) = new else {
            return r;
        };
        if found {
            table
                .slot(i)
                .word
                .store(new, publish_ordering(Fault::SlotWord));
            if old == 0 && new != 0 {
                w.live += 1;
            } else if old != 0 && new == 0 {
                w.live -= 1;
            }
        } else if new != 0 {
            let mut grow = 1;
            while i == table.sentinel() {
                // The probe ran through the whole tail: grow, then find the slot again.
                self.rebuild(&mut w, table, guard, grow);
                table = self.table(guard);
                i = table.find_for_write(key).0;
                grow += 1;
            }
            let s = table.slot(i);
            s.word.store(new, Ordering::Relaxed);
            s.key.store(key, publish_ordering(Fault::SlotKey));
            w.used += 1;
            w.live += 1;
        }
        let cap = table.cap;
        if w.used * 100 > cap * MAX_LOAD_PCT
            || (w.live * SHRINK_RATIO < cap && cap > capacity_of(self.min_code))
        {
            self.rebuild(&mut w, table, guard, 0);
        }
        self.live.store(w.live as u64, Ordering::Relaxed);
        r
    }

    /// Copies the live nodes into a table sized for them and swaps it in.
    /// `grow` steps the capacity code up beyond what the live count asks for (used when a
    /// probe tail overflowed).
    fn rebuild(&self, w: &mut ShardWriter, old: TableRef<'_>, guard: &epoch::Guard, grow: usize) {
        let mut code = code_for(w.live * 100 / TARGET_LOAD_PCT + 1).max(self.min_code) + grow;
        let (word, new, live) = loop {
            let word = alloc_table(code);
            // SAFETY: just allocated; not yet visible to anyone else.
            let new = unsafe { TableRef::from_word(word) };
            match copy_live(old, new) {
                Some(live) => break (word, new, live),
                None => {
                    // A tail overflowed in the new table: try the next size up.
                    // SAFETY: never published.
                    unsafe { free_table(word) };
                    code += 1;
                }
            }
        };
        debug_assert_eq!(live, w.live);
        w.used = live;
        self.table_bytes
            .store(new.bytes() as u64, Ordering::Relaxed);
        let prev = self.table.swap(word, publish_ordering(Fault::TableSwap));
        // The heap sets the old table points to now belong to the new one: only the
        // table itself is retired.
        retire_table(prev, guard);
    }
}

/// Copies the live nodes of `old` into the empty table `new`; `None` if a probe tail of
/// `new` overflowed.
fn copy_live(old: TableRef<'_>, new: TableRef<'_>) -> Option<usize> {
    let mut live = 0;
    for i in 0..old.cap + tail(old.cap) {
        let s = old.slot(i);
        let h = s.word.load(Ordering::Relaxed);
        if h == 0 {
            continue;
        }
        let key = s.key.load(Ordering::Relaxed);
        let (j, _) = new.find_for_write(key);
        if j == new.sentinel() {
            return None;
        }
        new.slot(j).word.store(h, Ordering::Relaxed);
        new.slot(j).key.store(key, Ordering::Relaxed);
        live += 1;
    }
    Some(live)
}

impl Drop for Shard {
    fn drop(&mut self) {
        let word = self.table.load(Ordering::Relaxed);
        // SAFETY: `&mut self`: no reader or writer can reach this shard any more, so the
        // current table can be freed now (retired ones are the collector's; heap holder
        // sets belong to the interner).
        unsafe { free_table(word) };
    }
}

/// The publication and read steps of the protocol (module docs), each of which a loom
/// negative control can weaken to `Relaxed` on its own (`crate::sync::faults`).
#[derive(Clone, Copy)]
enum Fault {
    /// A new slot's key (`Release`): `relaxed_slot_key`.
    SlotKey,
    /// A word stored over a slot that already has its key, e.g. a dead slot revived
    /// (`Release`): `relaxed_slot_word`.
    SlotWord,
    /// A rebuilt table swapped in (`Release`): `relaxed_table_swap`.
    TableSwap,
    /// A reader's load of a slot's key (`Acquire`): `relaxed_key_load`.
    KeyLoad,
    /// A reader's load of a found slot's word (`Acquire`): `relaxed_word_load`.
    WordLoad,
    /// A reader's load of the shard's table word (`Acquire`): `relaxed_table_load`.
    TableLoad,
}

/// Whether a loom negative control weakens `step` (never outside loom).
#[inline(always)]
fn weakened(step: Fault) -> bool {
    #[cfg(loom)]
    {
        let f = crate::sync::faults::get();
        match step {
            Fault::SlotKey => f.relaxed_slot_key,
            Fault::SlotWord => f.relaxed_slot_word,
            Fault::TableSwap => f.relaxed_table_swap,
            Fault::KeyLoad => f.relaxed_key_load,
            Fault::WordLoad => f.relaxed_word_load,
            Fault::TableLoad => f.relaxed_table_load,
        }
    }
    #[cfg(not(loom))]
    {
        let _ = step;
        false
    }
}

#[inline(always)]
fn publish_ordering(step: Fault) -> Ordering {
    if weakened(step) {
        return Ordering::Relaxed;
    }
    Ordering::Release
}

#[inline(always)]
fn read_ordering(step: Fault) -> Ordering {
    if weakened(step) {
        return Ordering::Relaxed;
    }
    Ordering::Acquire
}

fn retire_table(word: usize, guard: &epoch::Guard) {
    #[cfg(loom)]
    if crate::sync::faults::get().free_table_now {
        // Negative control (loom models only): poison now, leak instead of freeing.
        let hdr = (word & !CODE_MASK) as *const TableHeader;
        // SAFETY: the table is still allocated (leaked, never freed).
        unsafe { (*hdr).alive.with_mut(|_| ()) };
        return;
    }
    // SAFETY: the table was swapped out under the writer lock, so no new reader can
    // reach it; the closure runs after every guard pinned now is dropped.
    unsafe { guard.defer_unchecked(move || free_table(word)) };
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn capacity_codes_are_monotone_and_fine_grained() {
        let mut prev = 0;
        for code in 0..(8 * 26) {
            let c = capacity_of(code);
            assert!(c > prev);
            assert!(
                prev == 0 || c * 8 <= prev * 9 + 8,
                "step too coarse at {code}"
            );
            assert_eq!(code_for(c), code);
            assert_eq!(code_for(prev + 1), code);
            prev = c;
        }
        assert_eq!(capacity_of(code_for(1_000_000)), 1_048_576);
    }
}

#[cfg(all(test, not(loom)))]
mod rebuild_tests {
    use super::*;

    #[test]
    fn smallest_table_is_rebuilt_at_the_seventh_key() {
        let shard = Shard::new(8);
        let before = shard.table_bytes();
        let guard = epoch::pin();
        for k in 1..=6u64 {
            shard.set_word(k << 60 | 1, 1, &guard);
        }
        assert_eq!(shard.table_bytes(), before);
        shard.set_word(7 << 60 | 1, 1, &guard);
        assert!(
            shard.table_bytes() > before,
            "{} vs {before}",
            shard.table_bytes()
        );
        for k in 1..=7u64 {
            assert_ne!(shard.table(&guard).probe(k << 60 | 1).get(), 0);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tail_tests {
    use super::*;

    #[test]
    fn keys_sharing_one_home_at_the_end_grow_the_table_until_they_fit() {
        // 200 keys whose high 32 bits are all ones: every capacity homes them at the very
        // end of the table, where only the tail can absorb them.
        let shard = Shard::new(8);
        let guard = epoch::pin();
        let keys: Vec<u64> = (1..=200u64).map(|k| (u32::MAX as u64) << 32 | k).collect();
        for &k in &keys {
            shard.set_word(k, k, &guard);
        }
        for &k in &keys {
            assert_eq!(shard.table(&guard).probe(k).get(), k);
        }
        assert_eq!(shard.table(&guard).probe(12345).get(), 0);
        for &k in &keys {
            shard.set_word(k, 0, &guard);
        }
        assert_eq!(shard.live_nodes(), 0);
    }
}
