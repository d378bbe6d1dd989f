//! A lookup's answer put in rank order in linear expected time.
//!
//! Why: a lookup collects its ranks in the order the walk settles them, and callers want
//! them by rank. At fleet scale (a thousand ranks holding a prompt's first blocks) a
//! comparison sort of those entries took about a fifth of a selection at 8,192 ranks
//! (`perf` of `fleet-bench select`). Ranks are spread over their id range — sequential
//! ids, or the random ones a deployment hands out — so one counting pass over the top bits
//! of each rank's key (its worker's distance from the least worker, then its DP rank)
//! spreads them over about two buckets an entry, in order, and one insertion pass sorts
//! inside the buckets. A spread that crowds more than a few entries into one bucket goes
//! to the library sort, so a skewed one costs little more than before.

use crate::ids::RankId;

/// Below this many entries the library sort is used: a small answer does not pay for
/// the bucket array.
const SMALL: usize = 64;
/// Buckets up to this long are sorted by insertion; a crowded one sends the whole
/// input to the library sort.
const INSERTION: usize = 16;
/// At most this many buckets (their counters stay in the cache).
const MAX_BUCKETS: usize = 8192;

/// A sorter's reused buffers (kept by the scores it sorts, so a warm lookup allocates
/// nothing).
#[derive(Clone, Debug)]
pub(crate) struct RankOrder<T> {
    /// Where the entries go bucket by bucket; swapped with the sorted vector.
    spare: Vec<T>,
    /// Each entry's bucket.
    bucket_of: Vec<u32>,
    /// Per bucket its start, then (after the scatter) its end.
    ends: Vec<u32>,
}

impl<T> Default for RankOrder<T> {
    fn default() -> Self {
        Self {
            spare: Vec::new(),
            bucket_of: Vec::new(),
            ends: Vec::new(),
        }
    }
}

impl<T: Copy> RankOrder<T> {
    /// Sorts `v` by `rank` (not stable: entries of one rank come in any order).
    pub(crate) fn sort(&mut self, v: &mut Vec<T>, rank: impl Fn(&T) -> RankId) {
        let n = v.len();
        if n < SMALL {
            v.sort_unstable_by_key(|e| rank(e));
            return;
        }
        // Each rank's key is its worker's distance from the least worker, then its DP
        // rank in as few bits as the largest needs: ordered as the ranks are.
        let (mut lo, mut hi, mut dp_max) = (u64::MAX, 0u64, 0u32);
        for e in v.iter() {
            let r = rank(e);
            lo = lo.min(r.worker_id);
            hi = hi.max(r.worker_id);
            dp_max = dp_max.max(r.dp_rank);
        }
        let dp_bits = 32 - dp_max.leading_zeros();
        let key_bits = (64 - (hi - lo).leading_zeros()) + dp_bits;
        // About two buckets an entry, so most hold one entry or none.
        let buckets = (2 * n).next_power_of_two().min(MAX_BUCKETS);
        // Every key's top bits, `key >> shift`, are below 2^(key_bits - shift) ≤ buckets.
        let shift = key_bits.saturating_sub(buckets.trailing_zeros());
        // The same in 64-bit halves (a 128-bit shift by a variable amount costs branches):
        // the key's bits at and above `shift` are the worker part's above `shift - dp_bits`
        // when the shift reaches past the DP bits, else the whole worker part and the DP
        // rank's bits above `shift`. Either result is below `buckets`, so nothing overflows.
        let bucket = |r: RankId| {
            let w = r.worker_id - lo;
            let b = if shift >= dp_bits {
                w.checked_shr(shift - dp_bits).unwrap_or(0)
            } else {
                (w << (dp_bits - shift)) | u64::from(r.dp_rank >> shift)
            };
            b as u32
        };
        let (ends, bucket_of) = (&mut self.ends, &mut self.bucket_of);
        ends.clear();
        ends.resize(buckets + 1, 0);
        bucket_of.clear();
        let mut crowd = 0;
        for e in v.iter() {
            let b = bucket(rank(e));
            bucket_of.push(b);
            let c = &mut ends[b as usize + 1];
            *c += 1;
            crowd = crowd.max(*c);
        }
        if crowd as usize > INSERTION {
            // Ranks crowded into few buckets: the scatter would not sort them.
            v.sort_unstable_by_key(|e| rank(e));
            return;
        }
        // The running sum in a register: summing in place waits on each store.
        let mut sum = 0;
        for e in ends.iter_mut() {
            sum += *e;
            *e = sum;
        }
        let spare = &mut self.spare;
        spare.clear();
        spare.resize(n, v[0]);
        for (e, &b) in v.iter().zip(bucket_of.iter()) {
            let at = &mut ends[b as usize];
            spare[*at as usize] = *e;
            *at += 1;
        }
        // Buckets are in order and each holds at most `INSERTION` entries, so one
        // insertion pass moves each entry at most that far.
        insertion_sort(spare, &rank);
        std::mem::swap(v, spare);
    }
}

/// Sorts `part` by `rank`, each entry compared only with those before it that are larger.
fn insertion_sort<T: Copy>(part: &mut [T], rank: impl Fn(&T) -> RankId) {
    for i in 1..part.len() {
        let e = part[i];
        let k = rank(&e);
        let mut j = i;
        while j > 0 && rank(&part[j - 1]) > k {
            part[j] = part[j - 1];
            j -= 1;
        }
        part[j] = e;
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::hash::mix::splitmix64;

    /// Sorts `v` and checks that it comes out in rank order with the same entries as the
    /// library sort gives (entries of one rank may come in any order, so the contents are
    /// compared after a full sort of both).
    fn check(mut v: Vec<(RankId, u32)>) {
        let mut want = v.clone();
        want.sort_unstable();
        let mut order = RankOrder::default();
        order.sort(&mut v, |e| e.0);
        assert!(v.windows(2).all(|w| w[0].0 <= w[1].0), "not in rank order");
        v.sort_unstable(); // ties by payload, to compare contents
        assert_eq!(v, want);
    }

    #[test]
    fn sorts_like_the_library_sort() {
        let mut s = 7u64;
        let mut next = || {
            s = splitmix64(s);
            s
        };
        for n in [0, 1, 63, 64, 65, 200, 1000, 5000] {
            // Sequential workers of 8 ranks, shuffled.
            let mut seq: Vec<(RankId, u32)> = (0..n as u64)
                .map(|i| (RankId::new(i / 8, (i % 8) as u32), i as u32))
                .collect();
            for i in (1..seq.len()).rev() {
                seq.swap(i, next() as usize % (i + 1));
            }
            check(seq);
            // Random worker ids, with repeats of one rank.
            let random: Vec<(RankId, u32)> = (0..n)
                .map(|i| (RankId::new(next() % 50_000, (next() % 3) as u32), i as u32))
                .collect();
            check(random);
            // Skewed: full 64-bit ids, most clustered near zero, one far away.
            let mut skew: Vec<(RankId, u32)> = (0..n)
                .map(|i| (RankId::new(next() % 16, (next() >> 40) as u32), i as u32))
                .collect();
            if let Some(e) = skew.first_mut() {
                e.0 = RankId::new(u64::MAX, u32::MAX);
            }
            check(skew);
            // All one rank.
            check(vec![(RankId::new(5, 5), 1); n]);
        }
    }
}

/// By hand: `cargo test --release -p kvr --lib rank_order::timing -- --ignored --nocapture`.
#[cfg(all(test, not(loom)))]
mod timing {
    use super::*;
    use crate::index::TieredOverlap;
    use std::time::Instant;

    /// Mean ns of `f` over `reps` calls, each on a fresh copy of `base`.
    fn mean_ns(
        base: &[TieredOverlap],
        reps: u32,
        mut f: impl FnMut(&mut Vec<TieredOverlap>),
    ) -> u128 {
        let mut v = Vec::with_capacity(base.len());
        let t = Instant::now();
        for _ in 0..reps {
            v.clear();
            v.extend_from_slice(base);
            f(&mut v);
            std::hint::black_box(&mut v);
        }
        t.elapsed().as_nanos() / u128::from(reps)
    }

    #[test]
    #[ignore = "a timing printed for a reader, no assertion (timings live in benchmarks): run by hand with --nocapture"]
    fn sort_ns() {
        // 1,000 ranks of 1,024 workers × 8, in the walk's (unordered) order.
        let mut s = 7u64;
        let base: Vec<TieredOverlap> = (0..1000u32)
            .map(|i| {
                s = crate::hash::mix::splitmix64(s);
                TieredOverlap {
                    rank: RankId::new(s % 1024, (s >> 20) as u32 % 8),
                    device: i,
                    host: 0,
                    disk: 0,
                }
            })
            .collect();
        let mut order = RankOrder::default();
        for _ in 0..3 {
            let counting = mean_ns(&base, 1000, |v| order.sort(v, |e| e.rank));
            let library = mean_ns(&base, 1000, |v| v.sort_unstable_by_key(|e| e.rank));
            let copy = mean_ns(&base, 1000, |_| {});
            eprintln!("counting {counting} ns, library {library} ns, the copy alone {copy} ns");
        }
    }
}
