//! The rank map against a `HashMap` model, and its sizing rules.

use super::*;
use std::collections::HashMap;

/// A small deterministic key source (splitmix64); `timing` draws its keys from it too.
pub(super) struct SplitMix(pub(super) u64);

impl SplitMix {
    pub(super) fn next(&mut self) -> u64 {
        let z = crate::hash::mix::splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z
    }
    pub(super) fn below(&mut self, n: u64) -> u64 {
        ((self.next() as u128 * n as u128) >> 64) as u64
    }
}

fn check<V: MapValue + Into<u64>>(m: &BlockMap<V>, model: &HashMap<u64, u64>) {
    assert_eq!(m.len(), model.len());
    assert_eq!(m.occupied().count(), m.used);
    assert!(m.used <= max_used(m.keys.len()).max(m.used));
    assert_eq!(m.vals.len(), (m.keys.len() * WAYS).div_ceil(V::LANES));
    for (b, _, k) in m.occupied() {
        let (x, y) = buckets(k, m.keys.len());
        assert!(b == x || b == y, "entry outside its buckets");
    }
    let mut seen: HashMap<u64, u64> = m.iter().map(|(k, v)| (k, v.into())).collect();
    assert_eq!(seen.len(), model.len());
    for (k, v) in model {
        assert_eq!(m.get(*k).map(Into::into), Some(*v));
        seen.remove(k);
    }
    assert!(seen.is_empty());
}

/// Random inserts, removals and lookups against the model, with values of type `V`
/// (`value` makes one from an operation's number).
fn differential_of<V: MapValue + Into<u64>>(
    range: u64,
    ops: usize,
    seed: u64,
    value: fn(usize) -> V,
) {
    let mut rng = SplitMix(seed);
    let mut m = BlockMap::<V>::new();
    let mut model: HashMap<u64, u64> = HashMap::new();
    let wide = |v: Option<V>| v.map(Into::into);
    for i in 0..ops {
        let k = rng.below(range);
        let v = value(i);
        match rng.below(10) {
            0..=5 => assert_eq!(wide(m.insert(k, v)), model.insert(k, v.into())),
            6..=8 => assert_eq!(wide(m.remove(k)), model.remove(&k)),
            _ => assert_eq!(wide(m.get(k)), model.get(&k).copied()),
        }
        if i % 4_999 == 0 {
            check(&m, &model);
        }
    }
    check(&m, &model);
    for k in 0..range.min(1_000) {
        assert_eq!(wide(m.get(k)), model.get(&k).copied());
    }
}

/// Both value widths: 8-byte values fill a value line per bucket, 4-byte ones share a line
/// between two buckets.
fn differential(range: u64, ops: usize, seed: u64) {
    differential_of::<u64>(range, ops, seed, |i| i as u64 | 1 << 40);
    differential_of::<u32>(range, ops, seed ^ 0x55, |i| i as u32);
}

#[test]
fn differential_small_key_ranges() {
    for (range, seed) in [(2, 1), (17, 2), (100, 3), (1_000, 4)] {
        differential(range, 60_000, seed);
    }
}

#[test]
fn differential_large_key_ranges() {
    differential(50_000, 300_000, 5);
    differential(u64::MAX, 100_000, 6);
}

#[test]
fn structured_keys_and_zero() {
    let mut m = BlockMap::<u64>::new();
    let mut model = HashMap::new();
    for i in 0..20_000u64 {
        let k = i << 20;
        m.insert(k, i);
        model.insert(k, i);
    }
    assert_eq!(m.insert(0, 7), model.insert(0, 7));
    check(&m, &model);
    for i in (0..20_000u64).step_by(3) {
        assert_eq!(m.remove(i << 20), model.remove(&(i << 20)));
    }
    check(&m, &model);
    let drained: HashMap<u64, u64> = m.drain().collect();
    assert_eq!(drained, model);
    assert!(m.is_empty() && m.capacity() == 0);
}

#[test]
fn grows_and_shrinks_back() {
    let mut m = BlockMap::<u64>::new();
    for k in 1..=100_000u64 {
        m.insert(k, k);
    }
    let big = m.capacity();
    for k in 1..=100_000u64 {
        assert_eq!(m.remove(k), Some(k));
    }
    assert!(m.capacity() < big / 100, "{} of {big}", m.capacity());
}

/// A reserved map fills to its reservation without resizing, and neither removals nor
/// `clear` shrink it below; an unreserved one is freed by `clear`.
#[test]
fn reserved_size_holds() {
    let mut m = BlockMap::<u64>::new();
    m.reserve(50_000);
    let cap = m.capacity();
    assert!((52_500..58_000).contains(&cap), "{cap}");
    let mut model = HashMap::new();
    for k in 1..=50_000u64 {
        m.insert(k * 31, k);
        model.insert(k * 31, k);
        assert_eq!(m.capacity(), cap, "grew at {k}");
    }
    check(&m, &model);
    for k in 1..=49_990u64 {
        assert_eq!(m.remove(k * 31), Some(k));
        model.remove(&(k * 31));
    }
    assert_eq!(m.capacity(), cap);
    check(&m, &model);
    m.clear();
    assert_eq!((m.len(), m.capacity()), (0, cap));
    assert_eq!(m.get(50_000 * 31), None);
    m.insert(0, 5);
    m.insert(7, 7);
    assert_eq!((m.get(0), m.get(7)), (Some(5), Some(7)));
    let mut u = BlockMap::<u64>::new();
    u.insert(3, 3);
    u.clear();
    assert_eq!((u.len(), u.capacity()), (0, 0));
}

/// A map whose growth is capped ends, filled to that count, at the size a reservation
/// gives; past it, it grows as any map; `clear` keeps the cap.
#[test]
fn growth_stops_at_its_ceiling() {
    let mut sized = BlockMap::<u64>::new();
    sized.reserve(50_000);
    let mut m = BlockMap::<u64>::new();
    m.cap_growth(50_000);
    let mut model = HashMap::new();
    for k in 1..=50_000u64 {
        m.insert(k * 31, k);
        model.insert(k * 31, k);
    }
    check(&m, &model);
    assert_eq!(m.capacity(), sized.capacity());
    for k in 50_001..=60_000u64 {
        m.insert(k * 31, k);
        model.insert(k * 31, k);
    }
    check(&m, &model);
    assert!(m.capacity() > sized.capacity());
    m.clear();
    for k in 1..=50_000u64 {
        m.insert(k * 31, k);
    }
    assert_eq!(m.capacity(), sized.capacity(), "the cap outlives a clear");
}

/// A map of `V` filled from empty with 200,000 random keys (`value` makes each value), and
/// its mean bytes per entry, sampled along the way.
fn mean_bytes_over_growth<V: MapValue>(value: fn(u32) -> V) -> (BlockMap<V>, f64) {
    let mut m = BlockMap::<V>::new();
    let mut rng = SplitMix(9);
    let mut samples = Vec::new();
    for i in 1..=200_000u32 {
        m.insert(rng.next() | 1, value(i));
        if i >= 1_000 && i % 97 == 0 {
            samples.push(m.bytes() as f64 / m.len() as f64);
        }
    }
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    (m, mean)
}

/// Bytes per entry over a growth from empty: the load stays high.
#[test]
fn bytes_per_entry_over_growth() {
    let (_, mean) = mean_bytes_over_growth::<u64>(u64::from);
    assert!(mean < 24.0, "mean {mean:.1} bytes an entry");
}

/// 4-byte values: an entry is 12 bytes at full load, so over a growth from empty the
/// mean stays under three quarters of the 8-byte map's bound.
#[test]
fn bytes_per_entry_with_narrow_values() {
    let (mut m, mean) = mean_bytes_over_growth::<u32>(|i| i);
    assert!(mean < 18.0, "mean {mean:.1} bytes an entry");
    // Reserved for a million (a full cache): 12 bytes / 96 % load, plus the twentieth.
    m.reserve(1_000_000);
    let full = m.bytes() as f64 / 1_000_000.0;
    assert!(
        full < 13.2,
        "{full:.2} bytes an entry of a full reserved map"
    );
}

/// The index's store protocol at a full map's load (`record_stretch`): a stretch of inserts
/// through `insert_or_defer` while `headroom` covers it, the deferred ones after it in
/// order. A deferred key is absent, a repeat of it within the stretch is deferred too, and
/// the map ends as inserting the stretch in order leaves it.
#[test]
fn deferred_inserts_keep_the_order_of_a_stretch() {
    let mut rng = SplitMix(11);
    let mut m = BlockMap::<u32>::new();
    m.reserve(4_000);
    let (range, stretch) = (6_000u64, 32);
    let mut model: HashMap<u64, u64> = HashMap::new();
    while model.len() < 4_000 {
        let k = 1 + rng.below(range);
        m.insert(k, k as u32);
        model.insert(k, k);
    }
    let (mut deferred_total, mut repeats) = (0, 0);
    for round in 0..3_000u32 {
        let keys: Vec<u64> = (0..stretch).map(|_| 1 + rng.below(range)).collect();
        let mut in_order = model.clone();
        for (i, &k) in keys.iter().enumerate() {
            in_order.insert(k, u64::from(round) * 64 + i as u64);
        }
        assert!(m.headroom() >= stretch, "round {round}: the map would grow");
        let mut deferred: Vec<(u64, u32)> = Vec::new();
        for (i, &k) in keys.iter().enumerate() {
            let v = round * 64 + i as u32;
            let waiting = deferred.iter().any(|&(d, _)| d == k);
            match m.insert_or_defer(k, v) {
                Ok(prev) => {
                    assert!(!waiting, "a repeat of a deferred key went in");
                    assert_eq!(prev.map(u64::from), model.insert(k, v.into()));
                }
                Err(()) => {
                    assert!(!model.contains_key(&k), "deferred a present key");
                    repeats += usize::from(waiting);
                    deferred.push((k, v));
                }
            }
        }
        deferred_total += deferred.len();
        for (k, v) in deferred {
            assert_eq!(m.insert(k, v).map(u64::from), model.insert(k, v.into()));
        }
        assert_eq!(model, in_order);
        // Evict as many as were added, back to a full cache's load.
        while model.len() > 4_000 {
            let k = 1 + rng.below(range);
            assert_eq!(m.remove(k).map(u64::from), model.remove(&k));
        }
        if round % 500 == 0 {
            check(&m, &model);
        }
    }
    check(&m, &model);
    assert!(
        deferred_total > 1_000,
        "{deferred_total} deferred: the test missed the path"
    );
    assert!(repeats > 0, "no repeat of a deferred key within a stretch");
}

/// A rehash keeps each entry's choice of hash, so almost every entry lands next to where
/// the streaming pass writes; were the new buckets not in step with the old (a change to
/// `buckets`, or an entry given its other choice), growth would wait on memory again.
#[test]
fn rehash_streams() {
    let (moved0, off0) = REHASHED.with(|r| r.get());
    let mut m = BlockMap::<u32>::new();
    let mut rng = SplitMix(0x5eed_f1a7e);
    let mut model = HashMap::new();
    for _ in 0..200_000 {
        let k = rng.next();
        m.insert(k, k as u32);
        model.insert(k, u64::from(k as u32));
    }
    check(&m, &model);
    let (moved, off) = REHASHED.with(|r| r.get());
    let (moved, off) = (moved - moved0, off - off0);
    assert!(moved > 200_000, "growing from empty rehashes: {moved}");
    assert!(
        off * 100 < moved,
        "{off} of {moved} rehashed entries were not written in stream"
    );
}
