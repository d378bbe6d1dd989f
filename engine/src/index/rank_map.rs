//! A compact `u64 → u64` map for a rank's per-tier table of the engine's external block
//! hashes → kvr's sequence hashes.
//!
//! Why not `HashMap`: ~33 bytes an entry (16-byte slots plus a control byte, at load
//! 0.44–0.875). Here a slot is 16 bytes and the load stays in 0.72–0.9 while growing, so
//! an entry averages ~20 bytes. Layout: open addressing, linear probing, one array of
//! `(mix(key), value)`. `mix` is a bijection with `mix(0) == 0`, so mixed key 0 marks an
//! empty slot and a real key 0 lives in a field of its own.
//!
//! Each cluster is kept sorted by (home slot, mixed key) (Robin Hood order), so:
//! - a miss stops where its key would have been (~6 slots read at load 0.9, not ~50):
//!   lookups by external hash often try a tier that does not hold the block;
//! - deletion shifts the rest of the cluster back (no tombstones, so probe lengths never
//!   rot under churn);
//! - resizing is one sequential pass, as the old table already lists entries in the new
//!   table's order.
//!
//! Writer-only (the rank's mutex serializes access), so plain fields, no atomics.

use std::fmt;

/// The mixed key that marks an empty slot: `mix(0)`, so a real key 0 is kept in
/// `RankMap::zero` instead.
const EMPTY: u64 = 0;
/// Smallest allocated table, in slots.
const MIN_CAP: usize = 8;
/// Grow instead of filling more than `cap * 9 / 10` slots.
const MAX_LOAD_NUM: usize = 9;
const MAX_LOAD_DEN: usize = 10;
/// Growth factor ×1.25, not the usual ×1.5: the mean load over a growth cycle sets bytes
/// an entry (×1.5 at max load 0.9 averages ~21.6 B, ×1.25 ~19.9 B), and a rehash is one
/// sequential pass.
const GROW_NUM: usize = 5;
const GROW_DEN: usize = 4;
/// Shrink by half when `used < cap / 4`, so memory follows live entries; the gap to the
/// grow threshold keeps insert/remove at a boundary from resizing back and forth.
const SHRINK_BELOW_DIV: usize = 4;

const MIX_K1: u64 = 0x9e37_79b9_7f4a_7c15;
const MIX_K2: u64 = 0xbf58_476d_1ce4_e5b9;
const MIX_K1_INV: u64 = mul_inverse(MIX_K1);
const MIX_K2_INV: u64 = mul_inverse(MIX_K2);

/// Inverse of an odd `k` modulo 2^64 (Newton's iteration; each step doubles the correct
/// low bits, 3 → 96).
const fn mul_inverse(k: u64) -> u64 {
    let mut inv = k;
    let mut i = 0;
    while i < 5 {
        inv = inv.wrapping_mul(2u64.wrapping_sub(k.wrapping_mul(inv)));
        i += 1;
    }
    inv
}

/// Scrambles a key so structured keys (small integers, strides) spread over the table.
/// A bijection with `mix(0) == 0`: the table stores mixed keys, so a probe step finds a
/// resident's home with one multiply instead of re-mixing it, and `unmix` gives the key
/// back for iteration.
#[inline]
fn mix(key: u64) -> u64 {
    let h = (key ^ (key >> 32)).wrapping_mul(MIX_K1);
    (h ^ (h >> 32)).wrapping_mul(MIX_K2)
}

/// The inverse of `mix` (`x ^ (x >> 32)` is its own inverse).
#[inline]
fn unmix(h: u64) -> u64 {
    let h = h.wrapping_mul(MIX_K2_INV);
    let k = (h ^ (h >> 32)).wrapping_mul(MIX_K1_INV);
    k ^ (k >> 32)
}

/// The slot a mixed key would sit in with no collisions: multiply-shift range reduction,
/// so the capacity need not be a power of two.
#[inline]
fn home(h: u64, cap: usize) -> usize {
    ((h as u128 * cap as u128) >> 64) as usize
}

/// How far slot `i` is past mixed key `h`'s home slot, wrapping at `cap`.
#[inline]
fn displacement(h: u64, i: usize, cap: usize) -> usize {
    let h = home(h, cap);
    if i >= h {
        i - h
    } else {
        i + cap - h
    }
}

#[inline]
fn next(i: usize, cap: usize) -> usize {
    if i + 1 == cap {
        0
    } else {
        i + 1
    }
}

/// Most table entries a table of `cap` slots may hold; always leaves a slot empty (for
/// `cap >= 1`), which is what ends every probe loop.
#[inline]
fn max_used(cap: usize) -> usize {
    cap * MAX_LOAD_NUM / MAX_LOAD_DEN
}

/// Smallest capacity (at least `MIN_CAP`) that holds `n` table entries.
fn cap_for(n: usize) -> usize {
    // floor(cap * 9 / 10) >= n  <=>  cap * 9 >= n * 10.
    let cap = (n * MAX_LOAD_DEN).div_ceil(MAX_LOAD_NUM).max(MIN_CAP);
    debug_assert!(max_used(cap) >= n);
    cap
}

/// Where a probe for a mixed key ended.
enum Probe {
    /// The key is in this slot.
    Found(usize),
    /// The key is absent; it belongs in this slot (which may be occupied: the rest of the
    /// cluster then moves one slot on).
    Vacant(usize),
}

/// Open-addressing `u64 → u64` map, 16 bytes a slot, at most 90 % full. See the module
/// docs for the layout.
#[derive(Default, Clone)]
pub(crate) struct RankMap {
    /// `(mix(key), value)`; `EMPTY` (= `mix(0)`) marks a free slot. Length is the
    /// capacity: 0, or at least `MIN_CAP`.
    slots: Box<[(u64, u64)]>,
    /// Occupied slots (excludes `zero`).
    used: usize,
    /// The value of key 0, which cannot live in `slots`.
    zero: Option<u64>,
}

impl RankMap {
    /// An empty map; allocates nothing until the first insert.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// An empty map that holds `n` entries without resizing.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn with_capacity(n: usize) -> Self {
        if n == 0 {
            return Self::default();
        }
        RankMap {
            slots: empty_slots(cap_for(n)),
            used: 0,
            zero: None,
        }
    }

    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn len(&self) -> usize {
        self.used + usize::from(self.zero.is_some())
    }

    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Slots allocated (0, or at least 8).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Heap bytes allocated by the table.
    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of_val::<[(u64, u64)]>(&self.slots)
    }

    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        if key == 0 {
            return self.zero;
        }
        if self.slots.is_empty() {
            return None;
        }
        match probe(&self.slots, mix(key)) {
            Probe::Found(i) => Some(self.slots[i].1),
            Probe::Vacant(_) => None,
        }
    }

    /// Hints the CPU to load `key`'s home slot (the apply path calls it a few blocks
    /// ahead, so the probe does not wait on memory).
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        if self.slots.is_empty() {
            return;
        }
        let p = &self.slots[home(mix(key), self.slots.len())] as *const (u64, u64);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: prefetch is a hint that never faults or dereferences; SSE is part of the
        // x86_64 baseline, so the intrinsic is available on every x86_64 CPU.
        unsafe {
            core::arch::x86_64::_mm_prefetch(p.cast::<i8>(), core::arch::x86_64::_MM_HINT_T0)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }

    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn contains_key(&self, key: u64) -> bool {
        self.get(key).is_some()
    }

    /// Inserts or overwrites; returns the previous value.
    pub(crate) fn insert(&mut self, key: u64, value: u64) -> Option<u64> {
        if key == 0 {
            return self.zero.replace(value);
        }
        let h = mix(key);
        let cap = self.slots.len();
        let mut at = None;
        if cap > 0 {
            match probe(&self.slots, h) {
                Probe::Found(i) => return Some(std::mem::replace(&mut self.slots[i].1, value)),
                Probe::Vacant(i) => at = Some(i),
            }
        }
        match at {
            Some(i) if self.used < max_used(cap) => place_at(&mut self.slots, i, (h, value)),
            _ => {
                let grown = (cap * GROW_NUM / GROW_DEN).max(cap_for(self.used + 1));
                self.resize(grown);
                place(&mut self.slots, (h, value));
            }
        }
        self.used += 1;
        None
    }

    /// Removes `key`; returns its value. Shrinks the table when it falls below 1/4 full.
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        if key == 0 {
            return self.zero.take();
        }
        if self.slots.is_empty() {
            return None;
        }
        let Probe::Found(mut i) = probe(&self.slots, mix(key)) else {
            return None;
        };
        let value = self.slots[i].1;
        let cap = self.slots.len();
        // Backward shift: pull the rest of the cluster back one slot, up to an empty slot
        // or an entry at its home (which must not move before its home).
        loop {
            let j = next(i, cap);
            let k = self.slots[j].0;
            if k == EMPTY || home(k, cap) == j {
                self.slots[i] = (EMPTY, 0);
                break;
            }
            self.slots[i] = self.slots[j];
            i = j;
        }
        self.used -= 1;
        if cap > MIN_CAP && self.used < cap / SHRINK_BELOW_DIV {
            self.resize((cap / 2).max(cap_for(self.used)));
        }
        Some(value)
    }

    /// Removes everything and frees the table.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn clear(&mut self) {
        *self = Self::default();
    }

    /// Every entry once, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let zero = self.zero.map(|v| (0, v));
        zero.into_iter().chain(
            self.slots
                .iter()
                .filter(|e| e.0 != EMPTY)
                .map(|&(h, v)| (unmix(h), v)),
        )
    }

    /// Takes every entry out, leaving the map empty with its table freed (even if the
    /// iterator is dropped early).
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = (u64, u64)> {
        let RankMap { slots, zero, .. } = std::mem::take(self);
        let zero = zero.map(|v| (0, v));
        zero.into_iter().chain(
            Vec::from(slots)
                .into_iter()
                .filter(|e| e.0 != EMPTY)
                .map(|(h, v)| (unmix(h), v)),
        )
    }

    /// Rehashes every entry into a fresh table of `cap` slots.
    ///
    /// Read from just after an empty slot (no cluster crosses it), the old table lists its
    /// entries in cluster order, i.e. by mixed key, wrapping once. Homes in the new table
    /// are monotone in the mixed key too, so each entry goes at its home or right after
    /// the previous one: one sequential pass, no probing. Only where the last entries run
    /// into the first ones does it fall back to a general insertion.
    fn resize(&mut self, cap: usize) {
        debug_assert!(cap >= MIN_CAP && max_used(cap) >= self.used);
        let old = std::mem::replace(&mut self.slots, empty_slots(cap));
        let slots = &mut self.slots[..];
        let start = old.iter().position(|e| e.0 == EMPTY).map_or(0, |s| s + 1);
        // Unwrapped slot (in `0..2 * cap`) after the last entry placed in order.
        let mut after_last = 0;
        let mut prev = None;
        let mut wrapped = false;
        let mut in_order = true;
        for i in (start..old.len()).chain(0..start) {
            let entry = old[i];
            if entry.0 == EMPTY {
                continue;
            }
            if in_order {
                if prev.is_some_and(|p| entry.0 < p) {
                    // The mixed keys wrap past 2^64 once; a second drop cannot happen.
                    in_order = !wrapped;
                    wrapped = true;
                }
                prev = Some(entry.0);
                let at = (home(entry.0, cap) + if wrapped { cap } else { 0 }).max(after_last);
                let slot = if at >= cap { at - cap } else { at };
                if in_order && at < 2 * cap && slots[slot].0 == EMPTY {
                    slots[slot] = entry;
                    after_last = at + 1;
                    continue;
                }
                in_order = false;
            }
            place(slots, entry);
        }
    }
}

fn empty_slots(cap: usize) -> Box<[(u64, u64)]> {
    vec![(EMPTY, 0); cap].into_boxed_slice()
}

/// Inserts an entry whose mixed key is not in the table (and not `EMPTY`); the table has
/// a free slot.
fn place(slots: &mut [(u64, u64)], entry: (u64, u64)) {
    match probe(slots, entry.0) {
        Probe::Vacant(at) => place_at(slots, at, entry),
        Probe::Found(at) => {
            debug_assert!(false, "placing a key that is already in the table");
            slots[at] = entry;
        }
    }
}

/// Finds mixed key `h` (never `EMPTY`) in a non-empty table.
///
/// Clusters are sorted by (home, mixed key), so the probe stops at the first slot that
/// would come after `h`: an empty one, an entry closer to its home than the probe is to
/// `h`'s (a later home), or one with the same home and a larger mixed key. If `h` is
/// absent, that slot is where it belongs.
#[inline]
fn probe(slots: &[(u64, u64)], h: u64) -> Probe {
    debug_assert!(h != EMPTY && !slots.is_empty());
    let cap = slots.len();
    let mut i = home(h, cap);
    let mut dist = 0;
    if let Some(w) = slots.get(i..i + 4) {
        // Most probes end within 4 slots of home: test 4 slots without a branch each, so
        // a probe costs one or two well-predicted branches instead of a mispredicted loop
        // exit. A hit always comes before the first stop.
        let mut hit = 0;
        for (j, e) in w.iter().enumerate() {
            hit |= usize::from(e.0 == h) << j;
        }
        if hit != 0 {
            return Probe::Found(i + hit.trailing_zeros() as usize);
        }
        let mut stop = 0;
        for (j, e) in w.iter().enumerate() {
            let k = e.0;
            let d = displacement(k, i + j, cap);
            stop |= usize::from((k == EMPTY) | (d < j) | ((d == j) & (k > h))) << j;
        }
        if stop != 0 {
            return Probe::Vacant(i + stop.trailing_zeros() as usize);
        }
        i = next(i + 3, cap);
        dist = 4;
    }
    loop {
        let k = slots[i].0;
        if k == h {
            return Probe::Found(i);
        }
        if k == EMPTY {
            return Probe::Vacant(i);
        }
        let d = displacement(k, i, cap);
        if d < dist || (d == dist && k > h) {
            return Probe::Vacant(i);
        }
        i = next(i, cap);
        dist += 1;
    }
}

/// Writes `entry` at slot `i`, moving the entries from `i` up to the next empty slot one
/// slot on (wrapping), which keeps the cluster in order.
#[inline]
fn place_at(slots: &mut [(u64, u64)], i: usize, entry: (u64, u64)) {
    let cap = slots.len();
    // The run to move is `i..end`, possibly wrapping past the last slot; `end` is empty.
    let end = match slots[i..].iter().position(|e| e.0 == EMPTY) {
        Some(n) => i + n,
        None => slots[..i]
            .iter()
            .position(|e| e.0 == EMPTY)
            .expect("a table always has an empty slot"),
    };
    if end < i {
        // Wrapped run: `0..end` moves to `1..=end`, the last slot to 0, `i..cap - 1` on.
        slots.copy_within(0..end, 1);
        slots[0] = slots[cap - 1];
        slots.copy_within(i..cap - 1, i + 1);
    } else {
        slots.copy_within(i..end, i + 1);
    }
    slots[i] = entry;
}

impl fmt::Debug for RankMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct SplitMix(u64);

    impl SplitMix {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u64) -> u64 {
            ((self.next() as u128 * n as u128) >> 64) as u64
        }
    }

    /// Checks the table's structure: counts, the free slot, each entry reachable from its
    /// home through occupied slots, and clusters sorted by (home, mixed key): displacement
    /// grows by at most one a slot, only between equal homes in key order, and an entry
    /// right after an empty slot is at home.
    fn check_invariants(m: &RankMap) {
        let cap = m.slots.len();
        if cap == 0 {
            assert_eq!(m.used, 0);
            return;
        }
        assert!(cap >= MIN_CAP);
        let occupied = m.slots.iter().filter(|e| e.0 != EMPTY).count();
        assert_eq!(occupied, m.used);
        assert!(m.used <= max_used(cap) && m.used < cap);
        for i in 0..cap {
            let (k, v) = m.slots[i];
            if k == EMPTY {
                assert_eq!(v, 0, "empty slot {i} keeps a value");
            }
            let j = next(i, cap);
            let kj = m.slots[j].0;
            if kj == EMPTY {
                continue;
            }
            let dj = displacement(kj, j, cap);
            if k == EMPTY {
                assert_eq!(dj, 0, "slot {j} follows an empty slot but is off home");
            } else {
                // Sorted by (home, mixed key): a later home, or the same home (one more
                // slot of displacement) and a larger mixed key.
                let di = displacement(k, i, cap);
                assert!(
                    dj < di + 1 || (dj == di + 1 && kj > k),
                    "cluster order broken at {j}"
                );
            }
        }
    }

    fn assert_same(m: &RankMap, model: &HashMap<u64, u64>) {
        check_invariants(m);
        assert_eq!(m.len(), model.len());
        let mut seen = HashMap::new();
        for (k, v) in m.iter() {
            assert!(seen.insert(k, v).is_none(), "key {k} iterated twice");
        }
        assert_eq!(&seen, model);
        for (&k, &v) in model {
            assert_eq!(m.get(k), Some(v));
        }
    }

    /// Random ops against `HashMap`; `key` draws keys, `p_insert` (per mille) biases the
    /// population up or down. Returns the ops run.
    fn differential(
        rng: &mut SplitMix,
        m: &mut RankMap,
        model: &mut HashMap<u64, u64>,
        ops: usize,
        p_insert: u64,
        key: &mut dyn FnMut(&mut SplitMix) -> u64,
    ) -> usize {
        for op in 0..ops {
            let k = key(rng);
            let r = rng.below(1000);
            if r < p_insert {
                let v = rng.next();
                assert_eq!(m.insert(k, v), model.insert(k, v), "insert {k}");
            } else if r < p_insert + (1000 - p_insert) * 3 / 4 {
                assert_eq!(m.remove(k), model.remove(&k), "remove {k}");
            } else {
                assert_eq!(m.get(k), model.get(&k).copied(), "get {k}");
                assert_eq!(m.contains_key(k), model.contains_key(&k));
            }
            assert_eq!(m.len(), model.len());
            let cap = m.capacity();
            assert!(cap == 0 || m.used <= max_used(cap));
            // Full check after every op while the table is small, then periodically.
            if model.len() <= 128 || op % 4096 == 0 {
                assert_same(m, model);
            }
        }
        assert_same(m, model);
        ops
    }

    #[test]
    fn differential_small_key_ranges() {
        let mut rng = SplitMix(0x5eed_0001);
        let mut total = 0;
        // Small ranges keep the table tiny and crowded: every op collides, wraps and
        // shifts. Key 0 and u64::MAX are in every range.
        for &range in &[2u64, 5, 8, 13, 30, 100, 1_000, 20_000] {
            let mut key = move |r: &mut SplitMix| match r.below(range + 2) {
                0 => 0,
                1 => u64::MAX,
                x => x - 1,
            };
            let mut m = RankMap::new();
            let mut model = HashMap::new();
            for &p in &[900u64, 500, 300, 700, 100, 500] {
                total += differential(&mut rng, &mut m, &mut model, 30_000, p, &mut key);
            }
        }
        assert!(total >= 1_000_000, "{total}");
    }

    #[test]
    fn differential_full_range_keys() {
        let mut rng = SplitMix(0x5eed_0002);
        let mut total = 0;
        for &pool_size in &[16usize, 200, 5_000, 100_000] {
            // A pool of full-range keys (so removes and overwrites hit) plus the extremes.
            let mut pool: Vec<u64> = (0..pool_size).map(|_| rng.next()).collect();
            pool.extend([0, 1, u64::MAX, u64::MAX - 1, 1 << 63]);
            let mut key = move |r: &mut SplitMix| pool[r.below(pool.len() as u64) as usize];
            let mut m = RankMap::new();
            let mut model = HashMap::new();
            for &p in &[950u64, 500, 200, 600, 50] {
                total += differential(&mut rng, &mut m, &mut model, 50_000, p, &mut key);
            }
        }
        assert!(total >= 1_000_000, "{total}");
    }

    #[test]
    fn differential_structured_keys() {
        let mut rng = SplitMix(0x5eed_0003);
        for shift in [0u32, 8, 32, 48, 60] {
            let mut key = move |r: &mut SplitMix| r.below(3_000) << shift;
            let mut m = RankMap::new();
            let mut model = HashMap::new();
            for &p in &[800u64, 500, 200] {
                differential(&mut rng, &mut m, &mut model, 40_000, p, &mut key);
            }
        }
    }

    /// Keys whose home in a table of `cap` slots is `h`.
    fn keys_with_home(cap: usize, h: usize, n: usize, from: &mut u64) -> Vec<u64> {
        let mut out = Vec::new();
        while out.len() < n {
            *from += 1;
            if home(mix(*from), cap) == h {
                out.push(*from);
            }
        }
        out
    }

    #[test]
    fn wrap_around_in_tiny_table() {
        // Cap 8 holds 7 and never shrinks, so every shape below stays in one 8-slot table.
        // Clusters start at the last slots and wrap past slot 0; every removal order of
        // every cluster shape is checked against the model.
        let mut from = 0;
        let mut shapes: Vec<Vec<u64>> = Vec::new();
        for homes in [
            vec![7, 7, 7, 7],
            vec![6, 7, 7, 0, 0],
            vec![7, 7, 0, 1, 1, 1],
            vec![5, 6, 6, 7, 7, 7, 0],
            vec![7, 0, 7, 0, 7, 1, 2],
            vec![0, 0, 7, 7, 1, 6, 6],
        ] {
            shapes.push(
                homes
                    .iter()
                    .map(|&h| keys_with_home(8, h, 1, &mut from)[0])
                    .collect(),
            );
        }
        for keys in &shapes {
            let n = keys.len();
            let mut perm: Vec<usize> = (0..n).collect();
            // All removal orders (n ≤ 7: at most 5040), each after inserting in key order.
            permutations(&mut perm, 0, &mut |order| {
                let mut m = RankMap::new();
                let mut model = HashMap::new();
                for (i, &k) in keys.iter().enumerate() {
                    assert_eq!(m.insert(k, i as u64), None);
                    model.insert(k, i as u64);
                }
                assert_eq!(m.capacity(), 8);
                assert_same(&m, &model);
                for &o in order {
                    let k = keys[o];
                    assert_eq!(m.remove(k), model.remove(&k));
                    assert_eq!(m.remove(k), None);
                    assert_same(&m, &model);
                }
                assert!(m.is_empty() && m.capacity() == 8);
            });
        }
    }

    fn permutations(v: &mut Vec<usize>, at: usize, f: &mut dyn FnMut(&[usize])) {
        if at == v.len() {
            return f(v);
        }
        for i in at..v.len() {
            v.swap(at, i);
            permutations(v, at + 1, f);
            v.swap(at, i);
        }
    }

    #[test]
    fn wrap_around_random_tiny() {
        // Every key homes to the last two slots of an 8-slot table: clusters always wrap.
        let mut from = 0;
        let mut keys = keys_with_home(8, 7, 4, &mut from);
        keys.extend(keys_with_home(8, 6, 3, &mut from));
        let mut rng = SplitMix(0x5eed_0004);
        let mut m = RankMap::new();
        let mut model = HashMap::new();
        let mut key = |r: &mut SplitMix| keys[r.below(keys.len() as u64) as usize];
        // Seven keys: the table fills up completely but never grows past 8 slots.
        differential(&mut rng, &mut m, &mut model, 100_000, 500, &mut key);
        differential(&mut rng, &mut m, &mut model, 100_000, 800, &mut key);
        assert_eq!(m.capacity(), 8);
    }

    #[test]
    fn grow_and_shrink_cycles() {
        let mut rng = SplitMix(0x5eed_0005);
        let mut m = RankMap::new();
        let mut model = HashMap::new();
        for round in 0..4 {
            let n = 10_000 * (round + 1);
            let keys: Vec<u64> = (0..n).map(|_| rng.next() | 1).collect();
            for (i, &k) in keys.iter().enumerate() {
                m.insert(k, i as u64);
                model.insert(k, i as u64);
                assert!(m.used <= max_used(m.capacity()));
            }
            assert_same(&m, &model);
            let peak = m.capacity();
            assert!(
                m.len() as f64 / peak as f64 > 0.9 / (GROW_NUM as f64 / GROW_DEN as f64) - 0.01
            );
            for &k in &keys {
                assert!(m.remove(k).is_some());
                model.remove(&k);
                let cap = m.capacity();
                // Load stays in [1/4, 0.9] except in the smallest table.
                assert!(
                    cap == MIN_CAP || m.used >= cap / SHRINK_BELOW_DIV,
                    "{} in {cap}",
                    m.used
                );
            }
            assert_same(&m, &model);
            assert!(m.is_empty());
            assert_eq!(m.capacity(), MIN_CAP);
        }
        m.insert(0, 1);
        m.clear();
        assert_eq!((m.len(), m.capacity(), m.bytes()), (0, 0, 0));
        assert_eq!(m.get(0), None);

        let w = RankMap::with_capacity(1000);
        let cap = w.capacity();
        let mut w = w;
        for k in 1..=1000 {
            w.insert(k, k);
        }
        assert_eq!(
            w.capacity(),
            cap,
            "with_capacity(1000) resized before 1000 entries"
        );
        assert_eq!(RankMap::with_capacity(0).capacity(), 0);
    }

    #[test]
    fn resize_to_any_capacity() {
        // Rehash crowded tables into tight and loose capacities, growing and shrinking:
        // at load ~0.9 the last cluster often runs into the first one, so both the
        // in-order pass and its fallback run.
        let mut rng = SplitMix(0x5eed_0009);
        for round in 0..20_000 {
            let n = 1 + rng.below(if round % 2 == 0 { 12 } else { 300 }) as usize;
            let mut m = RankMap::new();
            let mut model = HashMap::new();
            while m.used < n {
                let k = if rng.below(4) == 0 {
                    rng.below(64)
                } else {
                    rng.next()
                };
                m.insert(k, round);
                model.insert(k, round);
            }
            for _ in 0..4 {
                let cap = cap_for(m.used) + rng.below(m.used as u64 / 2 + 2) as usize;
                m.resize(cap);
                assert_eq!(m.capacity(), cap);
                assert_same(&m, &model);
            }
        }
    }

    #[test]
    fn mix_is_a_bijection() {
        assert_eq!(mix(0), 0);
        let mut rng = SplitMix(0x5eed_000a);
        let edges = [1, 2, u64::MAX, u64::MAX - 1, 1 << 32, 1 << 63, 0xffff_ffff];
        for k in edges.into_iter().chain((0..100_000).map(|_| rng.next())) {
            assert_eq!(unmix(mix(k)), k);
            assert_ne!(mix(k), 0);
        }
        assert_eq!(MIX_K1.wrapping_mul(MIX_K1_INV), 1);
        assert_eq!(MIX_K2.wrapping_mul(MIX_K2_INV), 1);
    }

    #[test]
    fn cap_for_is_minimal() {
        for n in 0..10_000 {
            let c = cap_for(n);
            assert!(max_used(c) >= n);
            assert!(c == MIN_CAP || max_used(c - 1) < n, "cap_for({n}) = {c}");
        }
    }

    #[test]
    fn bytes_per_entry_over_growth() {
        let mut rng = SplitMix(0x5eed_0006);
        let mut m = RankMap::new();
        let n_max = 1_000_000usize;
        // Uniform samples every 1000 entries, and log-spaced samples from 100 (each
        // growth cycle weighted the same).
        let mut log_points: Vec<usize> = (0..=400)
            .map(|i| (100.0 * (n_max as f64 / 100.0).powf(i as f64 / 400.0)).round() as usize)
            .collect();
        log_points.dedup();
        let (mut uni, mut log) = (Vec::new(), Vec::new());
        let mut li = 0;
        for n in 1..=n_max {
            m.insert(rng.next(), n as u64);
            let b = m.bytes() as f64 / m.len() as f64;
            if n % 1000 == 0 {
                uni.push(b);
            }
            while li < log_points.len() && log_points[li] == n {
                log.push(b);
                li += 1;
            }
        }
        assert_eq!(m.len(), n_max);
        let stats = |v: &[f64]| {
            let avg = v.iter().sum::<f64>() / v.len() as f64;
            let lo = v.iter().cloned().fold(f64::MAX, f64::min);
            let hi = v.iter().cloned().fold(0.0, f64::max);
            (avg, lo, hi)
        };
        let (ua, ul, uh) = stats(&uni);
        let (la, ll, lh) = stats(&log);
        println!(
            "bytes/entry uniform: avg {ua:.2} min {ul:.2} max {uh:.2} ({} samples)",
            uni.len()
        );
        println!(
            "bytes/entry log:     avg {la:.2} min {ll:.2} max {lh:.2} ({} samples)",
            log.len()
        );
        assert!(ua <= 21.0 && la <= 21.0, "uniform {ua:.2}, log {la:.2}");
        assert!(ul >= 16.0 / 0.9 - 0.01);
    }

    #[test]
    fn iteration_and_drain() {
        let mut rng = SplitMix(0x5eed_0007);
        let mut m = RankMap::new();
        let mut model = HashMap::new();
        for i in 0..5_000u64 {
            let k = if i == 0 {
                0
            } else if i == 1 {
                u64::MAX
            } else {
                rng.next()
            };
            m.insert(k, i);
            model.insert(k, i);
        }
        assert_same(&m, &model);
        assert_eq!(m.iter().count(), model.len());
        let s = format!("{m:?}");
        assert!(s.starts_with('{') && s.ends_with('}'));

        let mut drained: Vec<(u64, u64)> = m.drain().collect();
        assert!(m.is_empty());
        assert_eq!(m.bytes(), 0);
        drained.sort_unstable();
        let mut want: Vec<(u64, u64)> = model.into_iter().collect();
        want.sort_unstable();
        assert_eq!(drained, want);
        // Still usable afterwards; dropping a drain early still empties the map.
        m.insert(5, 6);
        m.insert(0, 7);
        drop(m.drain());
        assert!(m.is_empty() && m.get(5).is_none() && m.get(0).is_none());
    }

    #[test]
    fn probe_lengths_stay_short() {
        // Mean displacement at the grow threshold for random and structured keys: a bad
        // mix would show up here as long clusters.
        for shift in [None, Some(0u32), Some(16), Some(32), Some(46), Some(52)] {
            let mut m = RankMap::with_capacity(100_000);
            let mut rng = SplitMix(0x5eed_0008);
            for i in 1..=100_000u64 {
                let k = match shift {
                    None => rng.next(),
                    Some(s) => i << s,
                };
                m.insert(k, i);
            }
            let cap = m.capacity();
            let total: usize = (0..cap)
                .filter(|&i| m.slots[i].0 != EMPTY)
                .map(|i| displacement(m.slots[i].0, i, cap))
                .sum();
            let mean = total as f64 / m.used as f64;
            // Uniform hashing at load 0.9 gives ~4.5; strided keys may do somewhat worse
            // with a one-multiply mix, but must not degrade into long runs.
            assert!(mean < 10.0, "shift {shift:?}: mean displacement {mean:.2}");
        }
    }
}
