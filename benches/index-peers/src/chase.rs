//! The machine's latency of one dependent load over a footprint: the physical unit a cold
//! lookup is paid in. A lookup that follows pointers (branch slot → run → its state → its
//! hashes) waits about this long at each step whose line is not cached, so a cold lookup's
//! p50 divided by it says how many misses in series the lookup waits on.

use std::time::Instant;

use crate::workload::Rng;

/// `u64`s per 64-byte line: the first of a line holds the index of the next line's.
const WORDS_PER_LINE: usize = 8;
/// Loads timed (after a warming pass of at most this many).
const LOADS: usize = 2_000_000;

/// Nanoseconds per load of a random cyclic walk over `bytes` (at least 64 KiB), one
/// 64-byte line per step, each load's address the previous load's value.
pub(crate) fn dependent_load_ns(bytes: usize, seed: u64) -> f64 {
    let buf = walk(bytes / 64, seed);
    let lines = buf.len() / WORDS_PER_LINE;
    let mut p = 0usize;
    for _ in 0..lines.min(LOADS) {
        p = buf[p] as usize;
    }
    let t = Instant::now();
    for _ in 0..LOADS {
        p = buf[p] as usize;
    }
    let ns = t.elapsed().as_nanos() as f64 / LOADS as f64;
    std::hint::black_box(p);
    ns
}

/// `lines` (at least 1,024) 64-byte lines linked into one random cycle: the lines are
/// shuffled and each is linked to the next in that order, the last to the first, so the
/// walk is one cycle whatever the shuffle; word `8 i` holds the word index of the line
/// after line `i`.
fn walk(lines: usize, seed: u64) -> Vec<u64> {
    let lines = lines.max(1024);
    let mut order: Vec<u32> = (0..lines as u32).collect();
    let mut rng = Rng::new(seed);
    for i in (1..lines).rev() {
        order.swap(i, rng.below(i));
    }
    let mut buf = vec![0u64; lines * WORDS_PER_LINE];
    for i in 0..lines {
        let (from, to) = (order[i] as usize, order[(i + 1) % lines] as usize);
        buf[from * WORDS_PER_LINE] = (to * WORDS_PER_LINE) as u64;
    }
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The walk visits every line once before it comes back (else it would time a loop
    /// small enough to stay cached).
    #[test]
    fn the_walk_is_one_cycle_through_every_line() {
        let buf = walk(5000, 7);
        let lines = buf.len() / WORDS_PER_LINE;
        let mut seen = vec![false; lines];
        let mut p = 0usize;
        for _ in 0..lines {
            assert!(
                !seen[p / WORDS_PER_LINE],
                "line {} twice",
                p / WORDS_PER_LINE
            );
            seen[p / WORDS_PER_LINE] = true;
            p = buf[p] as usize;
        }
        assert_eq!(p, 0);
        assert!(seen.iter().all(|&s| s));
    }
}
