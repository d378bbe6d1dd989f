//! [`LoadFloor`]: a lower bound of each booking counter over a group of ranks, so that a
//! selection over thousands of ranks prices only the groups that could still win.
//!
//! Why a bound and not the exact minimum: the exact minimum would need every counter
//! change to rescan its group. A bound only has to go down when a counter does; it may lag
//! behind a counter that goes up (it is then loose, and a selection prices the group and
//! tightens it on the way). So the writers' side is one read-modify-write a decrement and
//! nothing an increment.
//!
//! The protocol, per counter kind, on one word `[version:8 | gen:16 | value:40]`:
//! - **lower** (after a member's counter went down to `v`): `value = min(value, v)` and
//!   `gen += 1`, in one RMW;
//! - **join** (a rank enters the group, its counters at 0, before the registry snapshot
//!   with it is published): `value = 0`, `gen += 1`, `version += 1`;
//! - **raise** (a selection that read the word `w`, then every member's counter, found the
//!   minimum `m`): a compare-and-swap from `w` to `(version, gen, m)`, only when `w`'s
//!   version is the one the selection's registry snapshot recorded for the group.
//!
//! A raise cannot publish a bound above a member's counter: a lower that came before the
//! raiser's read of `w` synchronizes with it (Release RMW, Acquire load), so the raiser's
//! counter reads see the decrement; one that comes after the read changes `gen`, so the
//! CAS fails, or lands after the CAS and takes the minimum again. A join changes the
//! version, so a raiser still walking an older member list (without the new rank) fails
//! its check. `gen` wraps after 65,536 lowers and `version` after 256 joins of one group
//! within one raiser's read-to-CAS window (about a microsecond): not a case a live
//! partition reaches. Values above 2^40 − 1 are stored as 2^40 − 1, still a lower bound.
//! The loom models are `loom_models::floors`, each with a negative control.

use crate::sync::atomic::{AtomicU64, Ordering};

/// Ranks a group holds at most.
pub(crate) const GROUP_RANKS: usize = 64;

const VALUE_BITS: u32 = 40;
const GEN_BITS: u32 = 16;
const VALUE_MAX: u64 = (1 << VALUE_BITS) - 1;
const GEN_MASK: u64 = (1 << GEN_BITS) - 1;

/// The counters a floor bounds, in [`LoadFloor`]'s word order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FloorKind {
    PrefillTokens = 0,
    DecodeBlocks = 1,
    Requests = 2,
}

/// A group's lower bounds of its members' counters (see the module docs).
#[derive(Default)]
pub(crate) struct LoadFloor {
    words: [AtomicU64; 3],
}

/// What a selection read of a floor: the three words as loaded, to raise from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FloorRead {
    words: [u64; 3],
}

#[inline]
fn value(w: u64) -> u64 {
    w & VALUE_MAX
}

#[inline]
fn gen(w: u64) -> u64 {
    (w >> VALUE_BITS) & GEN_MASK
}

#[inline]
pub(crate) fn version(w: u64) -> u8 {
    (w >> (VALUE_BITS + GEN_BITS)) as u8
}

#[inline]
fn pack(version: u8, gen: u64, value: u64) -> u64 {
    (u64::from(version) << (VALUE_BITS + GEN_BITS))
        | ((gen & GEN_MASK) << VALUE_BITS)
        | value.min(VALUE_MAX)
}

impl FloorRead {
    /// The bound of `kind`'s counter over the group.
    #[inline]
    pub(crate) fn bound(&self, kind: FloorKind) -> u64 {
        value(self.words[kind as usize])
    }

    /// The membership version the words carry (all three move together).
    #[cfg(any(test, loom))]
    pub(crate) fn version_of_words(&self) -> u8 {
        version(self.words[0])
    }
}

impl LoadFloor {
    /// After a member's `kind` counter went down to `now`.
    #[inline]
    pub(crate) fn lower(&self, kind: FloorKind, now: u64) {
        let word = &self.words[kind as usize];
        #[cfg(loom)]
        if crate::sync::faults::get().floor_lower_keeps_gen {
            let w = word.load(Ordering::Acquire);
            if now < value(w) {
                let _ = word.compare_exchange(
                    w,
                    pack(version(w), gen(w), now),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                );
            }
            return;
        }
        let _ = word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            Some(pack(version(w), gen(w) + 1, value(w).min(now)))
        });
    }

    /// A rank joins the group with its counters at 0: every bound to 0, a new version.
    pub(crate) fn join(&self) {
        for word in &self.words {
            let _ = word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                Some(pack(version(w).wrapping_add(1), gen(w) + 1, 0))
            });
        }
    }

    /// The words, each with `Acquire` (a raise must read the members' counters after).
    #[inline]
    pub(crate) fn read(&self) -> FloorRead {
        FloorRead {
            words: [
                self.words[0].load(Ordering::Acquire),
                self.words[1].load(Ordering::Acquire),
                self.words[2].load(Ordering::Acquire),
            ],
        }
    }

    /// Raises each bound to the minimum `mins` the caller found over the members listed
    /// in a registry snapshot of membership `version`, having read `seen` before reading
    /// any member's counter. A word whose version is another, or that changed since
    /// `seen`, is left as it is.
    pub(crate) fn raise(&self, seen: FloorRead, version_of_members: u8, mins: [u64; 3]) {
        for (k, word) in self.words.iter().enumerate() {
            let w = seen.words[k];
            #[cfg(loom)]
            let skip_check = crate::sync::faults::get().floor_raise_ignores_version;
            #[cfg(not(loom))]
            let skip_check = false;
            let stale = !skip_check && version(w) != version_of_members;
            if stale || mins[k].min(VALUE_MAX) <= value(w) {
                continue;
            }
            let _ = word.compare_exchange(
                w,
                pack(version(w), gen(w), mins[k]),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }

    /// The membership version now (recorded by a registry snapshot built after a join).
    pub(crate) fn version_now(&self) -> u8 {
        version(self.words[0].load(Ordering::Acquire))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn lower_join_and_raise_keep_a_lower_bound() {
        let f = LoadFloor::default();
        let seen = f.read();
        assert_eq!(seen.bound(FloorKind::PrefillTokens), 0);
        f.raise(seen, seen.version_of_words(), [100, 7, 2]);
        let r = f.read();
        assert_eq!(
            [
                FloorKind::PrefillTokens,
                FloorKind::DecodeBlocks,
                FloorKind::Requests
            ]
            .map(|k| r.bound(k)),
            [100, 7, 2]
        );
        // A lower after the read: the stale raise does nothing.
        f.lower(FloorKind::PrefillTokens, 40);
        f.raise(r, r.version_of_words(), [500, 7, 2]);
        assert_eq!(f.read().bound(FloorKind::PrefillTokens), 40);
        // A join: bounds to 0, and a raise for the old membership is refused.
        let before = f.read();
        f.join();
        let after = f.read();
        assert_ne!(after.version_of_words(), before.version_of_words());
        assert_eq!(after.bound(FloorKind::Requests), 0);
        f.raise(after, before.version_of_words(), [9, 9, 9]);
        assert_eq!(f.read().bound(FloorKind::Requests), 0);
        f.raise(after, after.version_of_words(), [9, 9, 9]);
        assert_eq!(f.read().bound(FloorKind::Requests), 9);
        // Absurd values are clamped, still below the counter.
        let r = f.read();
        f.raise(r, r.version_of_words(), [u64::MAX, 9, 9]);
        assert_eq!(f.read().bound(FloorKind::PrefillTokens), VALUE_MAX);
    }
}
