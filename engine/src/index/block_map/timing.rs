//! Timings and displacement counts of the rank map, run by hand (`--ignored`).

use super::tests::SplitMix;
use super::*;
use std::collections::VecDeque;

/// A map of `size` random keys from `rng` (each key's value made by `value`), and the keys
/// in the order they went in.
fn filled<V: MapValue>(
    m: &mut BlockMap<V>,
    size: usize,
    rng: &mut SplitMix,
    value: fn(u64) -> V,
) -> VecDeque<u64> {
    (0..size)
        .map(|_| {
            let k = rng.next();
            m.insert(k, value(k));
            k
        })
        .collect()
}

/// The entry counts to time: `SIZES=8000,...`, else `default`.
fn sizes(default: &[usize]) -> Vec<usize> {
    std::env::var("SIZES").map_or(default.to_vec(), |s| {
        s.split(',').filter_map(|n| n.parse().ok()).collect()
    })
}

/// `cargo test --release -p kvr --lib block_map::timing -- --ignored --nocapture`
#[test]
#[ignore = "a measurement printed for a reader, no assertion: run by hand with --nocapture"]
fn kicks_while_growing() {
    let mut m = BlockMap::<u64>::new();
    let mut x = 7u64;
    let before = KICKS.with(|k| k.get());
    for _ in 0..31_000 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        m.insert(x >> 1 | 1, 1);
    }
    let kicks = KICKS.with(|k| k.get()) - before;
    eprintln!(
        "kicks per insert while growing: {:.2}",
        kicks as f64 / 31_000.0
    );
    for load in [0.5, 0.7, 0.8, 0.84, 0.9] {
        let n = 1000;
        let (keys, vals) = BlockMap::<u64>::table(n);
        let mut m = BlockMap::<u64> {
            keys,
            vals,
            ..Default::default()
        };
        let before = KICKS.with(|k| k.get());
        let count = (n as f64 * WAYS as f64 * load) as usize;
        let mut failed = 0;
        for _ in 0..count {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if !m.place(mix(x >> 1 | 1), 1) {
                failed += 1;
            }
        }
        let kicks = KICKS.with(|k| k.get()) - before;
        let (mut same, mut adj) = (0, 0);
        for i in 0..10_000u64 {
            let (a, b) = buckets(mix(i * 7919 + 1), n);
            same += (a == b) as u32;
            adj += (a.abs_diff(b) <= 1) as u32;
        }
        eprintln!(
            "load {load}: {:.3} kicks/insert, {failed} failed; adjacent {adj} same {same}",
            kicks as f64 / count as f64
        );
    }
}

#[test]
#[ignore = "a timing printed for a reader, no assertion (timings live in benchmarks): run by hand with --nocapture"]
fn steady_churn_ns_per_op() {
    for size in [8_000usize, 1_000_000] {
        let mut m = BlockMap::<u64>::new();
        let mut rng = SplitMix(0x1234_5678);
        let mut keys = filled(&mut m, size, &mut rng, |k| k);
        let mut next = || rng.next();
        let ops = 2_000_000;
        let k0 = KICKS.with(|k| k.get());
        let t = std::time::Instant::now();
        for _ in 0..ops {
            let k = next();
            m.insert(k, k);
            keys.push_back(k);
            let old = keys.pop_front().unwrap();
            m.remove(old);
        }
        let ns = t.elapsed().as_nanos() as f64 / (2 * ops) as f64;
        let kicks = (KICKS.with(|k| k.get()) - k0) as f64 / ops as f64;
        eprintln!(
            "  load {:.2}, kicks/insert {kicks:.3}",
            m.used as f64 / m.capacity() as f64
        );
        let mut h: std::collections::HashMap<u64, u64> = Default::default();
        for &k in &keys {
            h.insert(k, k);
        }
        let t = std::time::Instant::now();
        for _ in 0..ops {
            let k = next();
            h.insert(k, k);
            keys.push_back(k);
            let old = keys.pop_front().unwrap();
            h.remove(&old);
        }
        let hs = t.elapsed().as_nanos() as f64 / (2 * ops) as f64;
        eprintln!(
            "size {size}: BlockMap {ns:.1} ns/op, std HashMap {hs:.1} ns/op, {:.1} B/entry",
            m.bytes() as f64 / m.len() as f64
        );
    }
}

/// A rank's map as the index uses it: `u32` places, reserved for its capacity, churned
/// full (91 % load), inserts and removals timed apart.
/// `cargo test --release -p kvr --lib block_map::timing::reserved -- --ignored --nocapture`
/// (`SIZES=8000,...` sets the entry counts; `OVER=150` reserves for 150 % of them, a lower
/// load).
/// Measured (2026-12-04, 8,000 entries, in cache, `SIZES=8000`, `OVER=100/120/150`): insert
/// 26.6-27.4 / 15.6 / 15.4 ns at 91 / 76 / 61 % load, remove 13-14 ns; both buckets full on
/// 31.5 / 1.7 / 0.0 % of inserts; before the grouped displacement and SSE2 scans, insert
/// 40 ns at 91 %.
#[test]
#[ignore = "a timing printed for a reader, no assertion (timings live in benchmarks): run by hand with --nocapture"]
fn reserved_churn_ns_per_op() {
    for size in sizes(&[8_000, 1_000_000]) {
        let mut m = BlockMap::<u32>::new();
        m.reserve(size * std::env::var("OVER").map_or(100, |v| v.parse().unwrap()) / 100);
        let mut rng = SplitMix(0x1234_5678);
        let mut keys = filled(&mut m, size, &mut rng, |k| k as u32);
        let mut next = || rng.next();
        let rounds = 2_000_000 / 64;
        let (mut ti, mut tr) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
        let (k0, d0) = (KICKS.with(|k| k.get()), DISPLACES.with(|d| d.get()));
        let mut batch = [0u64; 64];
        for _ in 0..rounds {
            for b in batch.iter_mut() {
                *b = next();
            }
            let t = std::time::Instant::now();
            for &k in &batch {
                m.insert(k, k as u32);
            }
            ti += t.elapsed();
            keys.extend(batch);
            let old: Vec<u64> = keys.drain(..64).collect();
            let t = std::time::Instant::now();
            for &k in &old {
                m.remove(k);
            }
            tr += t.elapsed();
        }
        let ops = (rounds * 64) as f64;
        eprintln!(
            "size {size}: load {:.3}, insert {:.1} ns, remove {:.1} ns, both buckets full on \
             {:.1} % of inserts, kicks/insert {:.3}",
            m.used as f64 / m.capacity() as f64,
            ti.as_nanos() as f64 / ops,
            tr.as_nanos() as f64 / ops,
            (DISPLACES.with(|d| d.get()) - d0) as f64 / ops * 100.0,
            (KICKS.with(|k| k.get()) - k0) as f64 / ops,
        );
    }
}

/// Filling a map from empty, growing as it goes, against filling one reserved for the
/// same count (what growth costs), medians of five fills.
/// `cargo test --release -p kvr --lib block_map::timing::fill -- --ignored --nocapture`
#[test]
#[ignore = "a timing printed for a reader, no assertion (timings live in benchmarks): run by hand with --nocapture"]
fn fill_ns_per_insert() {
    for size in sizes(&[100_000, 1_000_000]) {
        let mut rng = SplitMix(0x5eed);
        let keys: Vec<u64> = (0..size).map(|_| rng.next()).collect();
        let fill = |reserve: bool| {
            let mut times: Vec<f64> = (0..5)
                .map(|_| {
                    let t = std::time::Instant::now();
                    let mut m = BlockMap::<u32>::new();
                    if reserve {
                        m.reserve(size);
                    }
                    for &k in &keys {
                        m.insert(k, k as u32);
                    }
                    assert_eq!(m.len(), size);
                    t.elapsed().as_nanos() as f64 / size as f64
                })
                .collect();
            times.sort_by(f64::total_cmp);
            times[2]
        };
        let (grown, reserved) = (fill(false), fill(true));
        eprintln!("size {size}: growing {grown:.1} ns/insert, reserved {reserved:.1} ns/insert");
    }
}

/// What a full map's load costs the index's stores: 128 maps of 8,000 entries (a 1M-block
/// index's ranks), churned a stretch of 112 inserts and its oldest stretch's removals at a
/// time, with the store loop's lookahead and deferred displacements (`record_stretch`),
/// reserved as a registered capacity does (91 % full) against reserved for 130 % of it
/// (70 %). The two sets alternate in one process, 20 blocks of 2,000 stretches each, so
/// the machine's drift falls on both; the ratio is per pair of blocks.
/// `cargo test --release -p kvr --lib block_map::timing::load_cost -- --ignored --nocapture`
/// Measured (2026-12-08, five runs): 88-148 ns an insert at 91 %, 46-77 ns at 70 %;
/// 70 % ÷ 91 % per pair, median 0.50-0.54 (pairs 0.40-0.91): about half of a full map's
/// insert time is its displacements.
#[test]
#[ignore = "a timing printed for a reader, no assertion (timings live in benchmarks): run by hand with --nocapture"]
fn load_cost() {
    const MAPS: usize = 128;
    const PER: usize = 8_000;
    const STRETCH: usize = 112;
    use crate::index::bookkeeping::PREFETCH_AHEAD as AHEAD;
    let mut rng = SplitMix(0xfeed);
    let mk = |scale: usize, rng: &mut SplitMix| {
        let mut maps: Vec<BlockMap<u32>> = Vec::new();
        let mut held: Vec<VecDeque<Vec<u64>>> = Vec::new();
        for _ in 0..MAPS {
            let mut m = BlockMap::new();
            m.reserve(PER * scale / 100);
            let mut q = VecDeque::new();
            for _ in 0..PER / STRETCH {
                let keys: Vec<u64> = (0..STRETCH).map(|_| rng.next()).collect();
                for &k in &keys {
                    m.insert(k, k as u32);
                }
                q.push_back(keys);
            }
            maps.push(m);
            held.push(q);
        }
        (maps, held)
    };
    let mut sets = [mk(100, &mut rng), mk(130, &mut rng)];
    let mut per = [Vec::new(), Vec::new()];
    // Reused, as the store loop's stack buffer is: no allocation in the timed part.
    let mut deferred: Vec<u64> = Vec::with_capacity(STRETCH);
    for block in 0..40 {
        let which = block % 2;
        let (maps, held) = &mut sets[which];
        let mut t = std::time::Duration::ZERO;
        let mut n = 0;
        for _ in 0..2_000 {
            let i = (rng.next() % MAPS as u64) as usize;
            let keys: Vec<u64> = (0..STRETCH).map(|_| rng.next()).collect();
            let m = &mut maps[i];
            let t0 = std::time::Instant::now();
            for k in keys.iter().take(AHEAD) {
                m.prefetch(*k);
            }
            for (j, &k) in keys.iter().enumerate() {
                if let Some(&n) = keys.get(j + AHEAD) {
                    m.prefetch(n);
                }
                if m.insert_or_defer(k, k as u32).is_err() {
                    deferred.push(k);
                }
            }
            for k in deferred.drain(..) {
                m.insert(k, k as u32);
            }
            t += t0.elapsed();
            n += keys.len();
            held[i].push_back(keys);
            let old = held[i].pop_front().unwrap();
            for (j, &k) in old.iter().enumerate() {
                if let Some(&n) = old.get(j + AHEAD) {
                    m.prefetch(n);
                }
                m.remove(k);
            }
        }
        per[which].push(t.as_nanos() as f64 / n as f64);
    }
    let ratios: Vec<f64> = per[1].iter().zip(&per[0]).map(|(b, a)| b / a).collect();
    let med = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    eprintln!(
        "insert ns/key at 91 %: {:.1}, at 70 %: {:.1}; 70/91 per pair median {:.3} (min {:.3}, max {:.3})",
        med(&per[0]),
        med(&per[1]),
        med(&ratios),
        ratios.iter().cloned().fold(f64::MAX, f64::min),
        ratios.iter().cloned().fold(0.0, f64::max)
    );
}
