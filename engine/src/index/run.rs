//! Runs: stretches of the prompt trie, each an array of local hashes, and what readers load
//! of them.
//!
//! A [`Run`] has a fixed address for its life. Readers see it through one word, `state`: a
//! pointer to an immutable [`State`] (the visible length, the local-hash array, and one
//! [`Cover`] per holding rank, slot-sorted). Writers, under the run's mutex, build a new
//! state and publish it with `Release`; the old one is retired through the epoch. The
//! local-hash array ([`Locals`]) is shared by successive states: it is append-only, a
//! writer fills the slots past every published length before publishing a state that
//! shows them, and an array outgrown is replaced by a copy (retired through the epoch).
//! So a reader that loads `state` with `Acquire` inside a pinned epoch reads a length,
//! locals and covers that were all published together, and nothing it reads is freed
//! under it.

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};

use super::hold::Cover;
use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use crate::sync::{epoch, Mutex, UnsafeCell};

/// Most blocks of one run: a chain goes on in a child run at this offset. Offsets fit in
/// [`OFFSET_BITS`] bits, so a block's place packs into one word ([`BlockRef`]).
pub(crate) const MAX_RUN: u32 = 1 << OFFSET_BITS;
pub(crate) const OFFSET_BITS: u32 = 11;
/// Runs are aligned so their addresses lose this many low bits when packed.
const RUN_ALIGN_BITS: u32 = 4;

/// Where a block lives: a run and an offset in it, packed into one non-zero word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BlockRef(pub(crate) u64);

impl BlockRef {
    #[inline]
    pub(crate) fn new(run: &Run, offset: u32) -> Self {
        Self::from_parts(run as *const Run as usize, offset)
    }

    /// The block at `offset` of the run at `addr` (a run's address, as `run_addr` gives).
    #[inline]
    pub(crate) fn from_parts(addr: usize, offset: u32) -> Self {
        let addr = addr as u64;
        debug_assert!(offset < MAX_RUN && addr.trailing_zeros() >= RUN_ALIGN_BITS);
        debug_assert!(addr >> (64 - OFFSET_BITS + RUN_ALIGN_BITS) == 0);
        BlockRef(((addr >> RUN_ALIGN_BITS) << OFFSET_BITS) | offset as u64)
    }

    #[inline]
    pub(crate) fn run_addr(self) -> usize {
        ((self.0 >> OFFSET_BITS) << RUN_ALIGN_BITS) as usize
    }

    #[inline]
    pub(crate) fn offset(self) -> u32 {
        (self.0 & (MAX_RUN as u64 - 1)) as u32
    }
}

/// The append-only local-hash array of a run (header, then `cap` words).
#[repr(C)]
pub(crate) struct Locals {
    /// Written when the array dies, read by every access, so loom sees a reader that
    /// outlives the array. Zero-sized outside loom.
    alive: UnsafeCell<()>,
    cap: u32,
    data: [AtomicU64; 0],
}

impl Locals {
    fn layout(cap: usize) -> Layout {
        let (l, _) = Layout::new::<Locals>()
            .extend(Layout::array::<AtomicU64>(cap).expect("locals size"))
            .expect("locals size");
        l.pad_to_align()
    }

    /// An array of `cap` slots holding `init` at its start.
    pub(crate) fn alloc(cap: usize, init: &[u64]) -> *mut Locals {
        debug_assert!(init.len() <= cap && cap <= MAX_RUN as usize);
        let layout = Self::layout(cap);
        // SAFETY: the layout has non-zero size (the header has a u32).
        let p = unsafe { alloc(layout) }.cast::<Locals>();
        if p.is_null() {
            handle_alloc_error(layout);
        }
        // SAFETY: `p` is a fresh allocation of `layout`: the header, then room for `cap`
        // words; every word is initialised (atomics must be constructed under loom).
        unsafe {
            std::ptr::write(
                p,
                Locals {
                    alive: UnsafeCell::new(()),
                    cap: cap as u32,
                    data: [],
                },
            );
            let data = std::ptr::addr_of_mut!((*p).data).cast::<AtomicU64>();
            for i in 0..cap {
                let v = init.get(i).copied().unwrap_or(0);
                std::ptr::write(data.add(i), AtomicU64::new(v));
            }
        }
        p
    }

    /// The slots of a live array.
    ///
    /// # Safety
    /// `p` came from [`Locals::alloc`] and is not freed for `'a`.
    #[inline(always)]
    pub(crate) unsafe fn slots<'a>(p: *const Locals) -> &'a [AtomicU64] {
        // SAFETY: per the contract the header is initialised and `cap` words follow it.
        unsafe {
            (*p).alive.with(|_| ());
            let n = (*p).cap as usize;
            std::slice::from_raw_parts(std::ptr::addr_of!((*p).data).cast::<AtomicU64>(), n)
        }
    }

    /// # Safety
    /// As for [`Locals::slots`].
    pub(crate) unsafe fn cap(p: *const Locals) -> usize {
        // SAFETY: forwarded.
        unsafe { (*p).cap as usize }
    }

    pub(crate) fn bytes_for(cap: usize) -> usize {
        Self::layout(cap).size()
    }

    /// # Safety
    /// `p` came from [`Locals::alloc`] and nothing can reach it any more.
    unsafe fn free(p: *mut Locals) {
        // SAFETY: per the contract the array is initialised and unreachable.
        unsafe {
            let cap = (*p).cap as usize;
            #[cfg(loom)]
            {
                crate::sync::faults::note_free();
                if !std::thread::panicking() {
                    (*p).alive.with_mut(|_| ());
                }
            }
            let data = std::ptr::addr_of_mut!((*p).data).cast::<AtomicU64>();
            for i in 0..cap {
                std::ptr::drop_in_place(data.add(i));
            }
            std::ptr::drop_in_place(p);
            dealloc(p.cast::<u8>(), Self::layout(cap));
        }
    }
}

/// What a reader loads of a run: immutable once published.
#[repr(C)]
pub(crate) struct State {
    alive: UnsafeCell<()>,
    /// Blocks visible: `locals[..len]`.
    len: u32,
    /// Covers that follow the header.
    n: u32,
    locals: *const Locals,
    covers: [Cover; 0],
}

impl State {
    fn layout(n: usize) -> Layout {
        let (l, _) = Layout::new::<State>()
            .extend(Layout::array::<Cover>(n).expect("state size"))
            .expect("state size");
        l.pad_to_align()
    }

    pub(crate) fn alloc(len: u32, locals: *const Locals, covers: &[Cover]) -> *mut State {
        let layout = Self::layout(covers.len());
        // SAFETY: the layout has non-zero size.
        let p = unsafe { alloc(layout) }.cast::<State>();
        if p.is_null() {
            handle_alloc_error(layout);
        }
        // SAFETY: fresh allocation of `layout`: the header then room for the covers.
        unsafe {
            std::ptr::write(
                p,
                State {
                    alive: UnsafeCell::new(()),
                    len,
                    n: covers.len() as u32,
                    locals,
                    covers: [],
                },
            );
            let dst = std::ptr::addr_of_mut!((*p).covers).cast::<Cover>();
            std::ptr::copy_nonoverlapping(covers.as_ptr(), dst, covers.len());
        }
        p
    }

    pub(crate) fn bytes_for(n: usize) -> usize {
        Self::layout(n).size()
    }

    /// # Safety
    /// `p` came from [`State::alloc`] and nothing can reach it any more.
    unsafe fn free(p: *mut State) {
        // SAFETY: per the contract the state is initialised and unreachable.
        unsafe {
            let n = (*p).n as usize;
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

/// A published state as a reader (or the run's writer) sees it, valid while `'g` lasts.
#[derive(Clone, Copy)]
pub(crate) struct View<'g> {
    pub(crate) len: usize,
    pub(crate) locals: &'g [AtomicU64],
    pub(crate) covers: &'g [Cover],
}

impl View<'_> {
    /// How many of `query`'s hashes equal this run's locals from offset 0.
    #[inline(always)]
    pub(crate) fn matching(&self, query: &[u64]) -> usize {
        let n = self.len.min(query.len());
        let (locals, query) = (&self.locals[..n], &query[..n]);
        // A group at a time with one branch (most walks match whole runs), then one by one
        // from the first group that differs.
        const GROUP: usize = 4;
        let mut i = 0;
        while i + GROUP <= n {
            let d =
                (i..i + GROUP).fold(0, |d, j| d | (locals[j].load(Ordering::Relaxed) ^ query[j]));
            if d != 0 {
                break;
            }
            i += GROUP;
        }
        while i < n && locals[i].load(Ordering::Relaxed) == query[i] {
            i += 1;
        }
        i
    }

    /// The cover of `slot` (binary search; covers are slot-sorted).
    #[inline]
    pub(crate) fn cover(&self, slot: u32) -> Option<&Cover> {
        self.covers
            .binary_search_by_key(&slot, |c| c.slot)
            .ok()
            .map(|i| &self.covers[i])
    }
}

/// Writer-side state of a run, behind its mutex.
pub(crate) struct RunWriter {
    /// Blocks written (≥ the published length: a writer may append before publishing).
    pub(crate) len: u32,
    /// The array new blocks go into (the latest state's, or a larger copy of it).
    pub(crate) locals: *mut Locals,
    /// The array the latest published state names (retired when a state names another).
    published_locals: *mut Locals,
    /// Ranks holding some block of this run on some tier.
    pub(crate) holds: u32,
    /// Writers between entering this run and publishing their change: a run they may
    /// still write into cannot die under them.
    pub(crate) pins: u32,
    /// Live child runs, and the offsets they hang off (offset, count), sorted.
    pub(crate) children: u32,
    pub(crate) branch_at: smallvec::SmallVec<[(u32, u32); 2]>,
    /// Unlinked: no new holder may enter; it is retired.
    pub(crate) dead: bool,
    /// Bytes of the run as last counted in the index's totals.
    pub(crate) accounted: u32,
}

// SAFETY: `locals` is only dereferenced under the run's mutex (or, as a published
// array, through a state inside an epoch guard); the pointer itself carries no thread
// affinity.
unsafe impl Send for RunWriter {}

/// One run of the trie. Aligned so its address packs into a [`BlockRef`].
#[repr(C, align(16))]
pub(crate) struct Run {
    /// `*const State`, never null; replaced only under `writer`.
    state: AtomicUsize,
    /// The run this one branches off (0 for a child of the root) and where.
    pub(crate) parent: usize,
    pub(crate) at: u32,
    /// `locals[0]`, so a branch lookup verifies a child without loading its state.
    pub(crate) first: u64,
    pub(crate) writer: Mutex<RunWriter>,
}

// SAFETY: the raw pointers inside are owned by the run and reclaimed through the epoch;
// shared access goes through atomics and the mutex.
unsafe impl Send for Run {}
// SAFETY: as above.
unsafe impl Sync for Run {}

impl Run {
    /// A run of `locals` (at least one), branching off `parent` at `at`, with no covers
    /// yet. Returns it boxed; its address is its identity until it is retired.
    pub(crate) fn new(parent: usize, at: u32, locals: &[u64], spare: usize) -> Box<Run> {
        debug_assert!(!locals.is_empty() || parent == 0);
        let cap = (locals.len() + spare).clamp(1, MAX_RUN as usize);
        let arr = Locals::alloc(cap, locals);
        let st = State::alloc(locals.len() as u32, arr, &[]);
        Box::new(Run {
            state: AtomicUsize::new(st as usize),
            parent,
            at,
            first: locals.first().copied().unwrap_or(0),
            writer: Mutex::new(RunWriter {
                len: locals.len() as u32,
                locals: arr,
                published_locals: arr,
                holds: 0,
                pins: 0,
                children: 0,
                branch_at: smallvec::SmallVec::new(),
                dead: false,
                accounted: 0,
            }),
        })
    }

    /// The published state, valid while `_guard` is pinned.
    #[inline(always)]
    pub(crate) fn view<'g>(&self, _guard: &'g epoch::Guard) -> View<'g> {
        let p = self.state.load(Ordering::Acquire) as *const State;
        // SAFETY: `state` always names a live state (set in `new`, replaced only by a
        // newer live state under the writer lock, the old one retired through the epoch),
        // and so the array it names: both outlive `_guard`. Loaded with Acquire, so the
        // header, covers and the first `len` locals written before the Release publish
        // are visible.
        unsafe {
            (*p).alive.with(|_| ());
            let len = (*p).len as usize;
            let n = (*p).n as usize;
            let covers =
                std::slice::from_raw_parts(std::ptr::addr_of!((*p).covers).cast::<Cover>(), n);
            View {
                len,
                locals: Locals::slots((*p).locals),
                covers,
            }
        }
    }

    /// Under the writer lock: appends `locals` at `w.len`, growing the array if needed
    /// (the published one stays until the next publish). Not visible to readers until [`Run::publish`].
    /// Returns how many fitted (at most up to [`MAX_RUN`]).
    pub(crate) fn append(&self, w: &mut RunWriter, locals: &[u64]) -> usize {
        let room = (MAX_RUN - w.len) as usize;
        let n = locals.len().min(room);
        if n == 0 {
            return 0;
        }
        let need = w.len as usize + n;
        // SAFETY: `w.locals` is the run's current array, alive under the writer lock.
        let cap = unsafe { Locals::cap(w.locals) };
        if need > cap {
            let new_cap = (cap + cap / 2).max(need).max(8).min(MAX_RUN as usize);
            // SAFETY: as above; its first `w.len` slots are written.
            let old = unsafe { Locals::slots(w.locals) };
            let init: Vec<u64> = old[..w.len as usize]
                .iter()
                .map(|x| x.load(Ordering::Relaxed))
                .collect();
            let arr = Locals::alloc(new_cap, &init);
            let prev = std::mem::replace(&mut w.locals, arr);
            if prev != w.published_locals {
                // Never published: no reader has seen it.
                // SAFETY: allocated by this writer and named by no state.
                unsafe { Locals::free(prev) };
            }
            // The published one stays until a state names another (`publish`).
        }
        // SAFETY: as above; slots `w.len..need` are past every published length, so no
        // reader reads them until a later Release publish.
        let slots = unsafe { Locals::slots(w.locals) };
        for (i, &l) in locals[..n].iter().enumerate() {
            slots[w.len as usize + i].store(l, Ordering::Relaxed);
        }
        w.len = need as u32;
        n
    }

    /// Under the writer lock: the local at `offset` (< `w.len`), published or not.
    #[inline]
    pub(crate) fn local_at(&self, w: &RunWriter, offset: u32) -> u64 {
        debug_assert!(offset < w.len);
        // SAFETY: the current array, alive under the writer lock; `offset < w.len` slots
        // are written.
        unsafe { Locals::slots(w.locals)[offset as usize].load(Ordering::Relaxed) }
    }

    /// Under the writer lock: publishes a state showing `w.len` blocks and `covers`.
    pub(crate) fn publish(&self, w: &mut RunWriter, covers: &[Cover], guard: &epoch::Guard) {
        let st = State::alloc(w.len, w.locals, covers);
        // Writers of a run serialize on its mutex, so a load and a store replace the word
        // (no read-modify-write needed).
        let prev = self.state.load(Ordering::Relaxed);
        self.state.store(st as usize, publish_ordering());
        retire_state(prev as *mut State, guard);
        if w.published_locals != w.locals {
            // No state names the old array now; readers pinned before may still read it.
            retire_locals(std::mem::replace(&mut w.published_locals, w.locals), guard);
        }
    }

    /// Heap bytes of the run as published (the run itself, its state and its array).
    pub(crate) fn bytes(&self, w: &RunWriter, covers: usize) -> usize {
        // SAFETY: the current array, alive under the writer lock.
        let cap = unsafe { Locals::cap(w.locals) };
        std::mem::size_of::<Run>() + State::bytes_for(covers) + Locals::bytes_for(cap)
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        // Dropped only once unreachable (retired through the epoch, or with the index):
        // its state and arrays go with it.
        let st = self.state.load(Ordering::Relaxed) as *mut State;
        let w = self.writer.lock();
        // SAFETY: nothing can reach the run any more, so neither its state nor its arrays.
        unsafe {
            State::free(st);
            if w.published_locals != w.locals {
                Locals::free(w.published_locals);
            }
            Locals::free(w.locals);
        }
    }
}

#[inline(always)]
fn publish_ordering() -> Ordering {
    #[cfg(loom)]
    if crate::sync::faults::get().relaxed_run_state {
        return Ordering::Relaxed;
    }
    Ordering::Release
}

fn retire_state(p: *mut State, guard: &epoch::Guard) {
    let addr = p as usize;
    // SAFETY: the state was swapped out under the writer lock, so no new reader can reach
    // it; the closure runs after every guard pinned now is dropped.
    unsafe { guard.defer_unchecked(move || State::free(addr as *mut State)) };
}

fn retire_locals(p: *mut Locals, guard: &epoch::Guard) {
    #[cfg(loom)]
    if crate::sync::faults::get().free_locals_now {
        // Negative control: poison (a loom-tracked write) and leak instead of freeing.
        // SAFETY: still allocated (leaked).
        unsafe { (*p).alive.with_mut(|_| ()) };
        return;
    }
    let addr = p as usize;
    // SAFETY: the writer no longer appends to it; states that name it are retired or will
    // be before a reader pinned later can load them, and the free runs after every guard
    // pinned now is dropped.
    unsafe { guard.defer_unchecked(move || Locals::free(addr as *mut Locals)) };
}

/// Retires an unlinked run (with its state and array) past every current reader.
///
/// # Safety
/// `run` was allocated by [`Run::new`] (boxed), is unreachable from the branch table and
/// from every rank's maps, and is retired once.
pub(crate) unsafe fn retire_run(run: *const Run, guard: &epoch::Guard) {
    #[cfg(loom)]
    if crate::sync::faults::get().free_run_now {
        // Negative control: poison its state (a loom-tracked write) and leak the run.
        // SAFETY: the run and its state are still allocated (leaked).
        unsafe {
            let st = (*run).state.load(Ordering::Relaxed) as *const State;
            (*st).alive.with_mut(|_| ());
        }
        return;
    }
    let addr = run as usize;
    // SAFETY: per the contract; the closure runs after every guard pinned now is dropped.
    unsafe { guard.defer_unchecked(move || drop(Box::from_raw(addr as *mut Run))) };
}
