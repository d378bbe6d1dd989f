//! A compact `u64 → V` map (`V` a 4- or 8-byte value) for a rank's engine hashes → block
//! places, and the few other per-rank maps of the same shape: bucketized cuckoo hashing.
//!
//! Why: a rank map takes one insert per stored block and one removal per evicted block, at
//! random keys, so its cost is memory traffic, and at one entry per (rank, block) pair it
//! is most of the index's memory. A key lives in one of two buckets of eight slots; a
//! bucket's keys fill one cache line, and its values sit in a separate array of value
//! lines (8 of 8-byte values or 16 of 4-byte ones a line), so an entry costs its key and
//! value and nothing else: 12 bytes for a rank's 4-byte places (`place`). An operation
//! touches the two key lines and a value line, all prefetched ahead by the apply loops,
//! and writes in place: no probe sequences, no cluster shifting, no tombstones. When both
//! buckets are full (31 % of inserts into a full rank's map at 91 % load, per `timing`)
//! an insert first moves one resident to its other bucket, checking the sixteen candidates
//! four at a time with each four's lines prefetched together (a random walk, one miss per step, only
//! if none has room): under churn at 90 % load a four-slot random-walk table made ~0.8
//! serial moves per insert. A store's stretch of inserts defers the ones that must
//! displace to its end ([`BlockMap::insert_or_defer`]), their candidates' lines
//! prefetched meanwhile. Buckets are scanned with SSE2 compares (the x86_64 baseline).
//! The table runs at 64-96 % load, growing by 1.5× (1.25× made rehashing most of the
//! cost of filling a map). Two choices of eight-slot buckets have a load threshold near
//! 99.9 % (the bucketized cuckoo analyses of Dietzfelbinger and Weidling, and of Cain,
//! Sanders and Wormald), so 96 % is below it; an insert that finds no room within
//! [`MAX_KICKS`] moves grows the table instead.
//!
//! Keys are stored mixed (`mix`, a bijection with `mix(0) == 0`), so mixed key 0 marks an
//! empty slot and a real key 0 lives in a field of its own.
//!
//! Writer-only (the rank's mutex serializes access), so plain fields, no atomics.

use std::fmt;

use crate::prefetch::prefetch_line;

const WAYS: usize = 8;
const EMPTY: u64 = 0;
/// Grow when an insert would fill more than this fraction of the slots (96 %: at 92 %
/// an index of 1M single-holder blocks took 1.2 B more per holder-block, `index-peers
/// --child kvr --sizes 1000000 --profiles single`, one run each).
const MAX_LOAD_NUM: usize = 24;
const MAX_LOAD_DEN: usize = 25;
/// Growth ×1.5 (see the module docs); shrink by half below a quarter full.
const GROW_NUM: usize = 3;
const GROW_DEN: usize = 2;
const SHRINK_BELOW_DIV: usize = 4;
/// Residents a displacement checks together (their lines prefetched at once).
const GROUP: usize = 4;
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

/// The keys of one bucket: one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Keys([u64; WAYS]);

const EMPTY_KEYS: Keys = Keys([EMPTY; WAYS]);

/// One cache line of values (slot `k` of the table is lane `k % LANES` of line
/// `k / LANES`).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line<T, const N: usize>([T; N]);

impl<T: Copy + Default, const N: usize> Default for Line<T, N> {
    fn default() -> Self {
        Line([T::default(); N])
    }
}

/// A value the map stores: a plain 4- or 8-byte word, packed into lines.
pub(crate) trait MapValue: Copy + Default + PartialEq + fmt::Debug {
    /// A line of these values.
    type Line: Copy + Default;
    /// Values a line holds.
    const LANES: usize;
    fn lane(line: &Self::Line, j: usize) -> &Self;
    fn lane_mut(line: &mut Self::Line, j: usize) -> &mut Self;
}

/// `MapValue` for a word type whose lines hold `$lanes` of it.
macro_rules! map_value {
    ($t:ty, $lanes:literal) => {
        impl MapValue for $t {
            type Line = Line<$t, $lanes>;
            const LANES: usize = $lanes;
            #[inline(always)]
            fn lane(line: &Self::Line, j: usize) -> &Self {
                &line.0[j]
            }
            #[inline(always)]
            fn lane_mut(line: &mut Self::Line, j: usize) -> &mut Self {
                &mut line.0[j]
            }
        }
    };
}

map_value!(u32, 16);
map_value!(u64, 8);

/// The first of mixed key `h`'s two buckets among `n`.
#[inline(always)]
fn primary(h: u64, n: usize) -> usize {
    ((h as u128 * n as u128) >> 64) as usize
}

/// The two buckets of mixed key `h` among `n` (distinct when `n > 1`).
#[inline(always)]
fn buckets(h: u64, n: usize) -> (usize, usize) {
    let a = primary(h, n);
    let g = h.rotate_left(29).wrapping_mul(MIX_K1) ^ (h >> 17);
    let mut b = ((g as u128 * n as u128) >> 64) as usize;
    if b == a && n > 1 {
        b = if a + 1 == n { 0 } else { a + 1 };
    }
    (a, b)
}

impl Keys {
    /// Bit `i` set where slot `i` holds `h`, and where slot `i` is empty.
    #[inline(always)]
    fn masks(&self, h: u64) -> (u32, u32) {
        #[cfg(target_arch = "x86_64")]
        {
            use core::arch::x86_64::*;
            // SAFETY: SSE2 is part of the x86_64 baseline; `Keys` is 64-byte aligned and
            // 64 bytes long, so its four 16-byte quarters are aligned loads inside it.
            unsafe {
                let p = self.0.as_ptr().cast::<__m128i>();
                let (hv, zero) = (_mm_set1_epi64x(h as i64), _mm_setzero_si128());
                let (mut hit, mut free) = (0u32, 0u32);
                for q in 0..WAYS / 2 {
                    let k = _mm_load_si128(p.add(q));
                    // A 64-bit lane is equal where both its 32-bit halves are.
                    let eh = _mm_cmpeq_epi32(k, hv);
                    let eh = _mm_and_si128(eh, _mm_shuffle_epi32::<0b10_11_00_01>(eh));
                    let ez = _mm_cmpeq_epi32(k, zero);
                    let ez = _mm_and_si128(ez, _mm_shuffle_epi32::<0b10_11_00_01>(ez));
                    hit |= (_mm_movemask_pd(_mm_castsi128_pd(eh)) as u32) << (2 * q);
                    free |= (_mm_movemask_pd(_mm_castsi128_pd(ez)) as u32) << (2 * q);
                }
                (hit, free)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let (mut hit, mut free) = (0u32, 0u32);
            for (i, &k) in self.0.iter().enumerate() {
                hit |= u32::from(k == h) << i;
                free |= u32::from(k == EMPTY) << i;
            }
            (hit, free)
        }
    }

    #[inline(always)]
    fn find(&self, h: u64) -> Option<usize> {
        let hit = self.masks(h).0;
        (hit != 0).then(|| hit.trailing_zeros() as usize)
    }

    #[inline(always)]
    fn free(&self) -> Option<usize> {
        let free = self.masks(EMPTY).1;
        (free != 0).then(|| free.trailing_zeros() as usize)
    }
}

/// Set bits of a byte (the x86_64 baseline has no `popcnt`, and a table read beats the
/// bit-twiddled count on the insert path).
const ONES: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = (i as u32).count_ones() as u8;
        i += 1;
    }
    t
};

/// Of buckets `a` and `b` with free-slot masks `free_a` and `free_b` (not both empty),
/// the one with more free slots (`a` on a tie: d-choice balancing keeps loads even, which
/// keeps full buckets and so displacements rare), and its first free slot.
#[inline(always)]
fn emptier(a: usize, free_a: u32, b: usize, free_b: u32) -> (usize, usize) {
    let (at, m) = if ONES[free_a as usize] >= ONES[free_b as usize] {
        (a, free_a)
    } else {
        (b, free_b)
    };
    (at, m.trailing_zeros() as usize)
}

#[cfg(test)]
std::thread_local! {
    /// Random-walk moves, and placements that found both buckets full (`timing` prints
    /// both per insert).
    static KICKS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static DISPLACES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Entries rehashed, and of those the ones not written where the streaming pass was
    /// (their bucket of the same choice full, or not next to the old bucket's image).
    static REHASHED: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

/// Bucketized cuckoo `u64 → V` map (module docs).
#[derive(Clone)]
pub(crate) struct BlockMap<V: MapValue> {
    /// Per bucket, its keys (mixed; `EMPTY` marks a free slot).
    keys: Box<[Keys]>,
    /// The slots' values, `WAYS` a bucket, in lines.
    vals: Box<[V::Line]>,
    /// Occupied slots (excludes `zero`).
    used: usize,
    /// The value of key 0, which cannot live in a bucket.
    zero: Option<V>,
    /// Where the next displacement starts (varies the victims; deterministic).
    kick: u32,
    /// Buckets the table keeps however empty it gets (`reserve`): a rank whose capacity
    /// is known fills its map without rehashing, and keeps it through evictions.
    floor: usize,
    /// Buckets a growth step stops at, if the table is smaller (`cap_growth`): the size a
    /// known capacity fills, so a map grown to it ends as dense as a reserved one.
    ceiling: usize,
}

impl<V: MapValue> Default for BlockMap<V> {
    fn default() -> Self {
        BlockMap {
            keys: Box::default(),
            vals: Box::default(),
            used: 0,
            zero: None,
            kick: 0,
            floor: 0,
            ceiling: 0,
        }
    }
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

impl<V: MapValue> BlockMap<V> {
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// An empty table of `n` buckets.
    fn table(n: usize) -> (Box<[Keys]>, Box<[V::Line]>) {
        (
            vec![EMPTY_KEYS; n].into(),
            vec![V::Line::default(); (n * WAYS).div_ceil(V::LANES)].into(),
        )
    }

    #[inline(always)]
    fn val(&self, b: usize, i: usize) -> V {
        let k = b * WAYS + i;
        *V::lane(&self.vals[k / V::LANES], k % V::LANES)
    }

    #[inline(always)]
    fn val_mut(&mut self, b: usize, i: usize) -> &mut V {
        let k = b * WAYS + i;
        V::lane_mut(&mut self.vals[k / V::LANES], k % V::LANES)
    }

    /// Writes slot `i` of bucket `b`; returns what it held.
    #[inline(always)]
    fn swap(&mut self, b: usize, i: usize, h: u64, v: V) -> (u64, V) {
        let k = std::mem::replace(&mut self.keys[b].0[i], h);
        (k, std::mem::replace(self.val_mut(b, i), v))
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
        self.keys.len() * WAYS
    }

    /// Sizes the table for `n` entries and a twentieth more now, and keeps at least that
    /// size from then on (a rank's known capacity: filling it takes no growth, whose
    /// rehashes were about a third of building an index from empty; the twentieth keeps a
    /// full cache's churn off the load bound, where inserts displace: with no headroom,
    /// churn on a full 8-way-shared index ran 25 % slower). A full cache's map is then
    /// 91 % loaded: 13.1 bytes an entry.
    pub(crate) fn reserve(&mut self, n: usize) {
        let want = buckets_for(n + n / 20);
        self.floor = self.floor.max(want);
        if self.keys.len() < want {
            self.resize(want);
        }
    }

    /// Lets growth stop at the size [`Self::reserve`] would give `n` entries instead of
    /// stepping past it: for a rank whose capacity is known but was not reserved ahead
    /// (the index's budget spent), so its map, full, is as dense as a reserved one rather
    /// than anywhere from 64 to 96 % loaded. Allocates nothing now.
    pub(crate) fn cap_growth(&mut self, n: usize) {
        self.ceiling = buckets_for(n + n / 20);
    }

    /// Empties the map, keeping a reserved table (freed otherwise).
    pub(crate) fn clear(&mut self) {
        if self.floor == 0 {
            *self = Self {
                ceiling: self.ceiling,
                ..Self::default()
            };
            return;
        }
        self.keys.fill(EMPTY_KEYS);
        self.used = 0;
        self.zero = None;
    }

    /// Heap bytes allocated by the table.
    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of_val::<[Keys]>(&self.keys) + std::mem::size_of_val::<[V::Line]>(&self.vals)
    }

    #[inline]
    fn locate(&self, h: u64) -> Option<(usize, usize)> {
        let (a, b) = buckets(h, self.keys.len());
        if let Some(i) = self.keys[a].find(h) {
            return Some((a, i));
        }
        self.keys[b].find(h).map(|i| (b, i))
    }

    pub(crate) fn get(&self, key: u64) -> Option<V> {
        if key == 0 {
            return self.zero;
        }
        if self.keys.is_empty() {
            return None;
        }
        self.locate(mix(key)).map(|(b, i)| self.val(b, i))
    }

    /// Hints the CPU to load `key`'s two key lines and their value lines (the apply loops
    /// call it a few blocks ahead, so the operation does not wait on memory).
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        if self.keys.is_empty() {
            return;
        }
        self.prefetch_mixed(mix(key));
    }

    #[inline]
    fn prefetch_mixed(&self, h: u64) {
        let (a, b) = buckets(h, self.keys.len());
        self.prefetch_bucket(a);
        self.prefetch_bucket(b);
    }

    #[inline]
    fn prefetch_bucket(&self, i: usize) {
        prefetch_line(&self.keys[i]);
        prefetch_line(&self.vals[i * WAYS / V::LANES]);
    }

    /// Entries the map takes before it grows.
    #[inline]
    pub(crate) fn headroom(&self) -> usize {
        max_used(self.keys.len()).saturating_sub(self.used)
    }

    /// [`Self::insert`], unless `key` is absent and both its buckets are full: then
    /// `Err(())`, the map unchanged, and the lines a displacement will read prefetched, so
    /// that the caller can go on and [`Self::insert`] it a little later, when they have
    /// arrived: about a third of inserts into a full rank's map displace, and where the
    /// maps outgrow the caches (4M-16M holder-blocks) each waited a memory latency on the
    /// moved entry's other bucket. The caller keeps order (see `record_stretch`).
    #[inline]
    pub(crate) fn insert_or_defer(&mut self, key: u64, value: V) -> Result<Option<V>, ()> {
        let n = self.keys.len();
        if key == 0 || n == 0 || self.used >= max_used(n) {
            return Ok(self.insert(key, value));
        }
        let h = mix(key);
        let (a, b) = buckets(h, n);
        match self.insert_in(a, b, h, value, true) {
            Some(done) => Ok(done),
            None => {
                self.group_alts(a, b, 0);
                Err(())
            }
        }
    }

    /// Puts mixed key `h` (buckets `a`, `b`) in without displacing: overwrites it, or,
    /// if `room` (the load bound allows one more), takes a free slot of the emptier
    /// bucket. `None` if it is absent and not put in.
    #[inline(always)]
    fn insert_in(&mut self, a: usize, b: usize, h: u64, value: V, room: bool) -> Option<Option<V>> {
        let ((hit_a, free_a), (hit_b, free_b)) = (self.keys[a].masks(h), self.keys[b].masks(h));
        if hit_a | hit_b != 0 {
            let (at, m) = if hit_a != 0 { (a, hit_a) } else { (b, hit_b) };
            let i = m.trailing_zeros() as usize;
            return Some(Some(std::mem::replace(self.val_mut(at, i), value)));
        }
        if !room || free_a | free_b == 0 {
            return None;
        }
        let (at, i) = emptier(a, free_a, b, free_b);
        self.swap(at, i, h, value);
        self.used += 1;
        Some(None)
    }

    /// Inserts or overwrites; returns the previous value.
    pub(crate) fn insert(&mut self, key: u64, value: V) -> Option<V> {
        if key == 0 {
            return self.zero.replace(value);
        }
        let h = mix(key);
        let n = self.keys.len();
        if n > 0 {
            let (a, b) = buckets(h, n);
            let room = self.used < max_used(n);
            if let Some(done) = self.insert_in(a, b, h, value, room) {
                return done;
            }
            if room && self.displace_one(a, b, h, value) {
                self.used += 1;
                return None;
            }
        }
        if self.used + 1 > max_used(self.keys.len()) {
            self.grow();
        }
        while !self.place(h, value) {
            self.grow();
        }
        self.used += 1;
        None
    }

    /// Both buckets of the absent mixed key `h` are full: moves a resident of either to its
    /// other bucket, if one has room, and puts `h` in the slot it left. Residents are tried
    /// a group at a time, the group's other buckets prefetched together (most inserts find
    /// room in the first group, so this waits on memory about once).
    #[inline]
    fn displace_one(&mut self, a: usize, b: usize, h: u64, value: V) -> bool {
        #[cfg(test)]
        DISPLACES.with(|d| d.set(d.get() + 1));
        for g in 0..2 * WAYS / GROUP {
            for (at, i, alt) in self.group_alts(a, b, g) {
                if let Some(j) = self.keys[alt].free() {
                    let k = self.keys[at].0[i];
                    let v = self.val(at, i);
                    self.swap(alt, j, k, v);
                    self.swap(at, i, h, value);
                    return true;
                }
            }
        }
        false
    }

    /// The `g`-th group of residents a displacement from full buckets `a` and `b` tries
    /// (the two alternate), each as its bucket, way and other bucket, the other buckets'
    /// key lines prefetched together.
    #[inline(always)]
    fn group_alts(&self, a: usize, b: usize, g: usize) -> [(usize, usize, usize); GROUP] {
        let mut alts = [(0, 0, 0); GROUP];
        for (j, e) in alts.iter_mut().enumerate() {
            let s = g * GROUP + j;
            let (at, i) = (if s.is_multiple_of(2) { a } else { b }, s / 2);
            let (x, y) = buckets(self.keys[at].0[i], self.keys.len());
            *e = (at, i, if x == at { y } else { x });
            prefetch_line(&self.keys[e.2]);
        }
        alts
    }

    fn grow(&mut self) {
        let n = self.keys.len();
        let need = buckets_for(self.used + 1);
        let mut to = (n * GROW_NUM / GROW_DEN).max(n + 1).max(need);
        if n < self.ceiling && to > self.ceiling {
            to = self.ceiling.max(need);
        }
        self.resize(to);
    }

    /// Puts an absent mixed key in: a free slot of the emptier bucket, else displacing
    /// entries to their other bucket. `false` (the entry and the table as they were) if no
    /// room was found within [`MAX_KICKS`] moves.
    fn place(&mut self, h: u64, value: V) -> bool {
        let n = self.keys.len();
        let (a, b) = buckets(h, n);
        let (free_a, free_b) = (self.keys[a].masks(EMPTY).1, self.keys[b].masks(EMPTY).1);
        if free_a | free_b != 0 {
            let (at, i) = emptier(a, free_a, b, free_b);
            self.swap(at, i, h, value);
            return true;
        }
        // One move, breadth first: a resident of either bucket whose other bucket has room.
        if self.displace_one(a, b, h, value) {
            return true;
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
            let victim = self.swap(at, i, cur_h, cur_v);
            path.push((at, i));
            (cur_h, cur_v) = victim;
            let (x, y) = buckets(cur_h, n);
            at = if x == at { y } else { x };
            if let Some(j) = self.keys[at].free() {
                self.swap(at, j, cur_h, cur_v);
                return true;
            }
        }
        // Undo: walk the path back, restoring each victim.
        while let Some((b, i)) = path.pop() {
            (cur_h, cur_v) = self.swap(b, i, cur_h, cur_v);
        }
        debug_assert_eq!(cur_h, h);
        false
    }

    /// Removes `key`; returns its value. Shrinks the table below a quarter full.
    pub(crate) fn remove(&mut self, key: u64) -> Option<V> {
        if key == 0 {
            return self.zero.take();
        }
        if self.keys.is_empty() {
            return None;
        }
        let (b, i) = self.locate(mix(key))?;
        let v = self.swap(b, i, EMPTY, V::default()).1;
        self.used -= 1;
        let n = self.keys.len();
        if n > 1 && n > self.floor && self.used * SHRINK_BELOW_DIV < n * WAYS {
            self.resize((n / 2).max(buckets_for(self.used)).max(self.floor));
        }
        Some(v)
    }

    /// Every occupied slot once, as (bucket, way, mixed key).
    fn occupied(&self) -> impl Iterator<Item = (usize, usize, u64)> + '_ {
        self.keys.iter().enumerate().flat_map(|(b, ks)| {
            ks.0.iter()
                .enumerate()
                .filter(|e| *e.1 != EMPTY)
                .map(move |(i, &k)| (b, i, k))
        })
    }

    /// Every entry once, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        let zero = self.zero.map(|v| (0, v));
        zero.into_iter()
            .chain(self.occupied().map(|(b, i, k)| (unmix(k), self.val(b, i))))
    }

    /// Takes every entry out, leaving the map empty with its table freed.
    #[cfg(test)]
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = (u64, V)> {
        let all: Vec<(u64, V)> = self.iter().collect();
        *self = Self::default();
        all.into_iter()
    }

    /// Rehashes every entry into `n` buckets (more if some do not fit).
    ///
    /// Why it streams: a bucket is the high bits of a hash times the table size, so an
    /// entry in old bucket `x` has, for the same choice of hash, new bucket `x·n/old`
    /// (within a bucket or two). Walking the old buckets in order and keeping each entry's
    /// choice therefore writes the new table front to back, with no cache miss per entry;
    /// a rehash placing each entry anew waited on two random lines per entry (maps grown
    /// from empty then stored at about half the rate of reserved ones, in the side-by-side
    /// index bench at 1M holder-blocks). An entry whose bucket
    /// of that choice is already full (about one in 250 while a map grows by 1.5× steps,
    /// per `tests::rehash_streams`) is placed afterwards, in batches whose buckets are
    /// prefetched first.
    fn resize(&mut self, mut n: usize) {
        const BATCH: usize = 16;
        let mut spill: Vec<(u64, V)> = Vec::new();
        loop {
            let (keys, vals) = Self::table(n);
            let old_keys = std::mem::replace(&mut self.keys, keys);
            let old_vals = std::mem::replace(&mut self.vals, vals);
            let old = BlockMap::<V> {
                keys: old_keys,
                vals: old_vals,
                ..Default::default()
            };
            let old_n = old.keys.len();
            spill.clear();
            #[cfg(test)]
            let mut far = 0u64;
            for (b, i, k) in old.occupied() {
                let to = if b == primary(k, old_n) {
                    primary(k, n)
                } else {
                    buckets(k, n).1
                };
                #[cfg(test)]
                if to.abs_diff(b * n / old_n) > 2 {
                    far += 1;
                }
                let v = old.val(b, i);
                match self.keys[to].free() {
                    Some(j) => {
                        self.swap(to, j, k, v);
                    }
                    None => spill.push((k, v)),
                }
            }
            if spill.chunks(BATCH).all(|batch| self.place_batch(batch)) {
                #[cfg(test)]
                REHASHED.with(|r| {
                    let (moved, off) = r.get();
                    r.set((moved + self.used as u64, off + spill.len() as u64 + far));
                });
                return;
            }
            // Rare: retry from the old table with more room.
            self.keys = old.keys;
            self.vals = old.vals;
            n += n / 8 + 1;
        }
    }

    /// Prefetches the buckets of a batch of absent mixed keys, then places them.
    fn place_batch(&mut self, batch: &[(u64, V)]) -> bool {
        for &(k, _) in batch {
            self.prefetch_mixed(k);
        }
        batch.iter().all(|&(k, v)| self.place(k, v))
    }
}

impl<V: MapValue> fmt::Debug for BlockMap<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests;

#[cfg(all(test, not(loom)))]
mod timing;
