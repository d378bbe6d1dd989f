//! This thread's spare hash buffers. A booked selection moves its prompt's sequence
//! hashes into the booking; freeing the booking gives the buffer back here, and the next
//! selection on the thread takes it, so a thread that books and frees allocates no hash
//! buffer once warm (a booking freed on another thread feeds that thread's spares).
//! Bounded: a few buffers, none kept past a large prompt's size.

use std::cell::RefCell;

/// Spare buffers kept per thread.
const KEEP: usize = 4;
/// A buffer larger than this (in hashes: 2^16 blocks, 512 KiB) is not kept.
const MAX_KEPT_CAPACITY: usize = 1 << 16;

std::thread_local! {
    static SPARE: RefCell<Vec<Vec<u64>>> = const { RefCell::new(Vec::new()) };
}

/// An empty buffer: the thread's largest spare, or a new one.
pub(crate) fn take_hashes() -> Vec<u64> {
    SPARE
        .try_with(|s| s.try_borrow_mut().ok().and_then(|mut s| s.pop()))
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Gives `v` back for the thread's next selection (dropped if the spares are full).
pub(crate) fn give_hashes(mut v: Vec<u64>) {
    if v.capacity() == 0 || v.capacity() > MAX_KEPT_CAPACITY {
        return;
    }
    v.clear();
    let _ = SPARE.try_with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            if s.len() < KEEP {
                s.push(v);
                // The largest last, so `take_hashes` hands it out first.
                s.sort_unstable_by_key(Vec::capacity);
            }
        }
    });
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_given_buffer_comes_back_empty_and_the_largest_first() {
        while !take_hashes().is_empty() || take_hashes().capacity() != 0 {}
        give_hashes(Vec::with_capacity(8));
        let mut big = Vec::with_capacity(64);
        big.push(7);
        give_hashes(big);
        let v = take_hashes();
        assert!(v.is_empty() && v.capacity() >= 64);
        assert!(take_hashes().capacity() >= 8);
        assert_eq!(take_hashes().capacity(), 0, "none left");
        give_hashes(Vec::with_capacity(MAX_KEPT_CAPACITY + 1));
        assert_eq!(take_hashes().capacity(), 0, "too large to keep");
    }
}
