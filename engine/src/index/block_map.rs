//! A compact `u64 → u64` map for a rank's engine hashes → block places (and the few other
//! per-rank maps of the same shape): bucketized cuckoo hashing.
//!
//! Why: a rank map takes one insert per stored block and one removal per evicted block, at
//! random keys, so its cost is memory traffic. Here a key lives in one of two buckets of
//! eight `(key, value)` slots (two cache lines), so an operation touches those four lines,
//! all prefetched ahead by the apply loops, and writes in place: no probe sequences, no
//! cluster shifting, no tombstones. When both buckets are full an insert first moves one
//! resident to its other bucket, checking all sixteen candidates with their lines
//! prefetched together (a random walk, one miss per step, only if none has room): under
//! churn at 90 % load a four-slot random-walk table made ~0.8 serial moves per insert.
//! The table runs at 61-92 % load, growing by 1.5× (1.25× made rehashing most of the cost
//! of filling a map), 17-26 bytes an entry.
//!
//! Keys are stored mixed (`mix`, a bijection with `mix(0) == 0`), so mixed key 0 marks an
//! empty slot and a real key 0 lives in a field of its own.
//!
//! Writer-only (the rank's mutex serializes access), so plain fields, no atomics.

use std::fmt;

const WAYS: usize = 8;
const EMPTY: u64 = 0;
/// Grow when an insert would fill more than this fraction of the slots.
const MAX_LOAD_NUM: usize = 23;
const MAX_LOAD_DEN: usize = 25;
/// Growth ×1.25 (see the module docs); shrink by half below a quarter full.
const GROW_NUM: usize = 3;
const GROW_DEN: usize = 2;
const SHRINK_BELOW_DIV: usize = 4;
/// Displacements an insert may make before the table grows instead.
const MAX_KICKS: usize = 256;

const MIX_K1: u64 = 0x9e37_79b9_7f4a_7c15;
const MIX_K2: u64 = 0xbf58_476d_1ce4_e5b9;
const MIX_K1_INV: u64 = mul_inverse(MIX_K1);
const MIX_K2_INV: u64 = mul_inverse(MIX_K2);

/// Inverse of an odd `k` modulo 2^64 (Newton's iteration).
const fn mul_inverse(k: u64) -> u64 {
    let mut inv = k;
    let mut i = 0;
    while i < 5 {
        inv = inv.wrapping_mul(2u64.wrapping_sub(k.wrapping_mul(inv)));
        i += 1;
    }
    inv
}

/// Scrambles a key (a bijection with `mix(0) == 0`), so structured keys spread.
#[inline]
fn mix(key: u64) -> u64 {
    let h = (key ^ (key >> 32)).wrapping_mul(MIX_K1);
    (h ^ (h >> 32)).wrapping_mul(MIX_K2)
}

#[inline]
fn unmix(h: u64) -> u64 {
    let h = h.wrapping_mul(MIX_K2_INV);
    let k = (h ^ (h >> 32)).wrapping_mul(MIX_K1_INV);
    k ^ (k >> 32)
}

/// Eight `(key, value)` slots: two cache lines.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Bucket {
    slots: [(u64, u64); WAYS],
}

const EMPTY_BUCKET: Bucket = Bucket {
    slots: [(EMPTY, 0); WAYS],
};

/// The two buckets of mixed key `h` among `n` (distinct when `n > 1`).
#[inline(always)]
fn buckets(h: u64, n: usize) -> (usize, usize) {
    let a = ((h as u128 * n as u128) >> 64) as usize;
    let g = h.rotate_left(29).wrapping_mul(MIX_K1) ^ (h >> 17);
    let mut b = ((g as u128 * n as u128) >> 64) as usize;
    if b == a && n > 1 {
        b = if a + 1 == n { 0 } else { a + 1 };
    }
    (a, b)
}

impl Bucket {
    /// The slot holding `h`, the first free slot, and the number of free slots.
    #[inline(always)]
    fn scan(&self, h: u64) -> (Option<usize>, usize, u32) {
        let (mut hit, mut free) = (0u32, 0u32);
        for (i, &(k, _)) in self.slots.iter().enumerate() {
            hit |= u32::from(k == h) << i;
            free |= u32::from(k == EMPTY) << i;
        }
        (
            (hit != 0).then(|| hit.trailing_zeros() as usize),
            free.trailing_zeros() as usize,
            free.count_ones(),
        )
    }

    #[inline(always)]
    fn find(&self, h: u64) -> Option<usize> {
        let mut hit = 0u32;
        for (i, &(k, _)) in self.slots.iter().enumerate() {
            hit |= u32::from(k == h) << i;
        }
        (hit != 0).then(|| hit.trailing_zeros() as usize)
    }

    #[inline(always)]
    fn free(&self) -> Option<usize> {
        self.find(EMPTY)
    }
}

#[cfg(test)]
std::thread_local! {
    static KICKS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Bucketized cuckoo `u64 → u64` map (module docs).
#[derive(Default, Clone)]
pub(crate) struct BlockMap {
    buckets: Box<[Bucket]>,
    /// Occupied slots (excludes `zero`).
    used: usize,
    /// The value of key 0, which cannot live in a bucket.
    zero: Option<u64>,
    /// Where the next displacement starts (varies the victims; deterministic).
    kick: u32,
    /// Buckets the table keeps however empty it gets (`reserve`): a rank whose capacity
    /// is known fills its map without rehashing, and keeps it through evictions.
    floor: usize,
}

fn max_used(buckets: usize) -> usize {
    buckets * WAYS * MAX_LOAD_NUM / MAX_LOAD_DEN
}

/// Fewest buckets that hold `n` entries within the load bound.
fn buckets_for(n: usize) -> usize {
    let mut b = (n * MAX_LOAD_DEN).div_ceil(WAYS * MAX_LOAD_NUM).max(1);
    while max_used(b) < n {
        b += 1;
    }
    b
}

impl BlockMap {
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn len(&self) -> usize {
        self.used + usize::from(self.zero.is_some())
    }

    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Slots allocated.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn capacity(&self) -> usize {
        self.buckets.len() * WAYS
    }

    /// Sizes the table for `n` entries and a tenth more now, and keeps at least that size
    /// from then on (a rank's known capacity: filling it takes no growth, whose rehashes
    /// were about a third of building an index from empty; the tenth keeps a full cache's
    /// churn off the load bound, where inserts displace: without it, churn on a full
    /// 8-way-shared index ran 25 % slower).
    pub(crate) fn reserve(&mut self, n: usize) {
        let want = buckets_for(n + n / 10);
        self.floor = self.floor.max(want);
        if self.buckets.len() < want {
            self.resize(want);
        }
    }

    /// Empties the map, keeping a reserved table (freed otherwise).
    pub(crate) fn clear(&mut self) {
        if self.floor == 0 {
            *self = Self::default();
            return;
        }
        self.buckets.fill(EMPTY_BUCKET);
        self.used = 0;
        self.zero = None;
    }

    /// Heap bytes allocated by the table.
    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of_val::<[Bucket]>(&self.buckets)
    }

    #[inline]
    fn locate(&self, h: u64) -> Option<(usize, usize)> {
        let (a, b) = buckets(h, self.buckets.len());
        if let Some(i) = self.buckets[a].find(h) {
            return Some((a, i));
        }
        self.buckets[b].find(h).map(|i| (b, i))
    }

    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        if key == 0 {
            return self.zero;
        }
        if self.buckets.is_empty() {
            return None;
        }
        self.locate(mix(key))
            .map(|(b, i)| self.buckets[b].slots[i].1)
    }

    /// Hints the CPU to load `key`'s two key lines (the apply loops call it a few blocks
    /// ahead, so the operation does not wait on memory).
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        if self.buckets.is_empty() {
            return;
        }
        self.prefetch_mixed(mix(key));
    }

    #[inline]
    fn prefetch_mixed(&self, h: u64) {
        let (a, b) = buckets(h, self.buckets.len());
        self.prefetch_bucket(a);
        self.prefetch_bucket(b);
    }

    #[inline]
    fn prefetch_bucket(&self, i: usize) {
        {
            let p = &self.buckets[i] as *const Bucket;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: prefetch is a hint that never faults or dereferences; SSE is part of
            // the x86_64 baseline, so the intrinsic is available on every x86_64 CPU. Both
            // lines of the bucket.
            unsafe {
                let p = p.cast::<i8>();
                core::arch::x86_64::_mm_prefetch(p, core::arch::x86_64::_MM_HINT_T0);
                core::arch::x86_64::_mm_prefetch(p.add(64), core::arch::x86_64::_MM_HINT_T0);
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = p;
        }
    }

    /// Inserts or overwrites; returns the previous value.
    pub(crate) fn insert(&mut self, key: u64, value: u64) -> Option<u64> {
        if key == 0 {
            return self.zero.replace(value);
        }
        let h = mix(key);
        let n = self.buckets.len();
        if n > 0 {
            // One pass over both buckets: the key, or the emptier bucket's first free slot.
            let (a, b) = buckets(h, n);
            let (ka, fa, free_a) = self.buckets[a].scan(h);
            if let Some(i) = ka {
                return Some(std::mem::replace(&mut self.buckets[a].slots[i].1, value));
            }
            let (kb, fb, free_b) = self.buckets[b].scan(h);
            if let Some(i) = kb {
                return Some(std::mem::replace(&mut self.buckets[b].slots[i].1, value));
            }
            if self.used < max_used(n) && (free_a > 0 || free_b > 0) {
                let (at, i) = if free_a >= free_b { (a, fa) } else { (b, fb) };
                self.buckets[at].slots[i] = (h, value);
                self.used += 1;
                return None;
            }
        }
        if self.used + 1 > max_used(self.buckets.len()) {
            self.grow();
        }
        while !self.place(h, value, true) {
            self.grow();
        }
        self.used += 1;
        None
    }

    fn grow(&mut self) {
        let n = self.buckets.len();
        let to = (n * GROW_NUM / GROW_DEN)
            .max(n + 1)
            .max(buckets_for(self.used + 1));
        self.resize(to);
    }

    /// Puts an absent mixed key in: a free slot of either bucket (the emptier one), else
    /// displacing entries to their other bucket. `false` (the entry and the table as they
    /// were) if no room was found within [`MAX_KICKS`] moves.
    ///
    /// `balance`: put it in the emptier bucket (an insert, whose check for the key loaded
    /// both); else the first with room (a rehash, which then mostly walks the new table in
    /// order, as homes are monotone in the mixed key).
    fn place(&mut self, h: u64, value: u64, balance: bool) -> bool {
        let n = self.buckets.len();
        let (a, b) = buckets(h, n);
        let free = |bk: &Bucket| bk.slots.iter().filter(|e| e.0 == EMPTY).count();
        let at = if balance {
            let (fa, fb) = (free(&self.buckets[a]), free(&self.buckets[b]));
            (fa > 0 || fb > 0).then_some(if fa >= fb { a } else { b })
        } else if self.buckets[a].free().is_some() {
            Some(a)
        } else if self.buckets[b].free().is_some() {
            Some(b)
        } else {
            None
        };
        if let Some(at) = at {
            let i = self.buckets[at].free().expect("a bucket with room");
            self.buckets[at].slots[i] = (h, value);
            return true;
        }
        // One move, breadth first: a resident of either bucket whose other bucket has
        // room goes there (their lines are prefetched together, so the misses overlap).
        for &at in &[a, b] {
            for i in 0..WAYS {
                let (k, _) = self.buckets[at].slots[i];
                let (x, y) = buckets(k, n);
                let alt = if x == at { y } else { x };
                self.prefetch_bucket(alt);
            }
        }
        for &at in &[a, b] {
            for i in 0..WAYS {
                let (k, v) = self.buckets[at].slots[i];
                let (x, y) = buckets(k, n);
                let alt = if x == at { y } else { x };
                if let Some(j) = self.buckets[alt].free() {
                    self.buckets[alt].slots[j] = (k, v);
                    self.buckets[at].slots[i] = (h, value);
                    return true;
                }
            }
        }
        // Random-walk cuckoo: evict a victim, move it to its other bucket; record the
        // path so a failed walk can be undone.
        let mut path: smallvec::SmallVec<[(usize, usize); 32]> = smallvec::SmallVec::new();
        let (mut cur_h, mut cur_v, mut at) = (h, value, a);
        for _ in 0..MAX_KICKS {
            #[cfg(test)]
            KICKS.with(|k| k.set(k.get() + 1));
            self.kick = self.kick.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let i = (self.kick >> 16) as usize % WAYS;
            let victim = std::mem::replace(&mut self.buckets[at].slots[i], (cur_h, cur_v));
            path.push((at, i));
            (cur_h, cur_v) = victim;
            let (x, y) = buckets(cur_h, n);
            at = if x == at { y } else { x };
            if let Some(j) = self.buckets[at].free() {
                self.buckets[at].slots[j] = (cur_h, cur_v);
                return true;
            }
        }
        // Undo: walk the path back, restoring each victim.
        while let Some((b, i)) = path.pop() {
            (cur_h, cur_v) = std::mem::replace(&mut self.buckets[b].slots[i], (cur_h, cur_v));
        }
        debug_assert_eq!(cur_h, h);
        false
    }

    /// Removes `key`; returns its value. Shrinks the table below a quarter full.
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        if key == 0 {
            return self.zero.take();
        }
        if self.buckets.is_empty() {
            return None;
        }
        let (b, i) = self.locate(mix(key))?;
        let v = std::mem::replace(&mut self.buckets[b].slots[i], (EMPTY, 0)).1;
        self.used -= 1;
        let n = self.buckets.len();
        if n > 1 && n > self.floor && self.used * SHRINK_BELOW_DIV < n * WAYS {
            self.resize((n / 2).max(buckets_for(self.used)).max(self.floor));
        }
        Some(v)
    }

    /// Every entry once, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let zero = self.zero.map(|v| (0, v));
        zero.into_iter().chain(self.buckets.iter().flat_map(|b| {
            b.slots
                .iter()
                .filter(|e| e.0 != EMPTY)
                .map(|&(k, v)| (unmix(k), v))
        }))
    }

    /// Takes every entry out, leaving the map empty with its table freed.
    #[cfg(test)]
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = (u64, u64)> {
        let all: Vec<(u64, u64)> = self.iter().collect();
        *self = Self::default();
        all.into_iter()
    }

    /// Rehashes every entry into `n` buckets (more if some do not fit). Entries go in
    /// batches whose buckets are prefetched first, so the misses of a batch overlap.
    fn resize(&mut self, mut n: usize) {
        const BATCH: usize = 16;
        loop {
            let old = std::mem::replace(&mut self.buckets, vec![EMPTY_BUCKET; n].into());
            let mut batch = [(EMPTY, 0u64); BATCH];
            let mut len = 0;
            let mut ok = true;
            'all: for b in old.iter() {
                for &e in &b.slots {
                    if e.0 == EMPTY {
                        continue;
                    }
                    batch[len] = e;
                    len += 1;
                    if len == BATCH {
                        ok = self.place_batch(&batch);
                        len = 0;
                        if !ok {
                            break 'all;
                        }
                    }
                }
            }
            if ok && self.place_batch(&batch[..len]) {
                return;
            }
            // Rare: retry from the old table with more room.
            self.buckets = old;
            n += n / 8 + 1;
        }
    }

    /// Prefetches the buckets of a batch of absent mixed keys, then places them.
    fn place_batch(&mut self, batch: &[(u64, u64)]) -> bool {
        for &(k, _) in batch {
            self.prefetch_mixed(k);
        }
        batch.iter().all(|&(k, v)| self.place(k, v, true))
    }
}

impl fmt::Debug for BlockMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests;

#[cfg(all(test, not(loom)))]
mod timing;
