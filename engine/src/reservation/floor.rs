//! [`LoadFloor`]: a lower bound of each booking counter over a group of ranks, so that a
//! selection over thousands of ranks prices only the groups that could still win.
//!
//! Why a bound and not the exact minimum: the exact minimum would need every counter
//! change to rescan its group. A bound only has to go down when a counter does; it may lag
//! behind a counter that goes up (it is then loose, and a selection prices the group and
//! tightens it on the way). So the writers' side is a few read-modify-writes on the
//! group's floor a decrement (one a word it bounds) and nothing an increment.
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
//! Four more words bound each member's **combined** figures `p·1024 + L_k·d` (its booked
//! prefill tokens `p` and decode blocks `d`; `L_k` = [`FloorMix`]'s weights of a decode
//! block, in 1/1024 tokens, fixed per table): the three bounds may each come from a
//! different member, so a group whose least-loaded member in prefill is the busiest in
//! decode looked cheaper than any of its members; the combined bounds do not, and
//! between two weights they interpolate ([`MixAt::bound`]). They follow the same
//! protocol, with one more step on the writers' side: after decrementing `p` (or `d`), the
//! writer reads the other counter with a read-modify-write (`fetch_add(0)`), and both
//! counters' decrements are `AcqRel` read-modify-writes ([`COUNTER_RMW`]). Of two writers
//! that decrement `p` and `d` at once, the one whose read comes later in that counter's
//! modification order reads the other's decrement (a read-modify-write reads the latest
//! value, and the earlier one's release synchronizes with it), so at least one lowers the
//! combined bounds to the rank's figures after both. A plain load could read the old value
//! in both (the loom model `floor_combined_decrements_race` and its negative control).
//! Loom runs the read-modify-writes of one location in one order that follows its
//! interleaving, so it passes with `Relaxed` ones too (tried): the need for `AcqRel` rests
//! on the argument above, not on the model.
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

use super::types::ActiveLoad;
use crate::sync::atomic::{AtomicU64, Ordering};

/// The ordering of the booking counters' decrements and of the combined bounds' read of
/// the other counter: `AcqRel` (module docs). On x86 a locked instruction either way;
/// increments never lower a bound (they are `Release` for the idle groups, `idle.rs`).
pub(crate) const COUNTER_RMW: Ordering = Ordering::AcqRel;

/// How many combined bounds a floor keeps, each under its own weight ([`FloorMix`]). The
/// loom models keep one: each word follows the same protocol on its own, and four made
/// every decrement in the booking models four steps longer (the suite's loom step took
/// 1,003 s instead of 371 s).
pub(crate) const MIXES: usize = if cfg!(loom) { 1 } else { 4 };

/// The weights' multiples of the partition's own ratio ([`FloorMix::around`]).
const MIX_FACTORS: [f64; 4] = [1.0, 0.25, 4.0, 16.0];

/// The first combined word's index in [`LoadFloor`] (after the three [`FloorKind`]s).
const COMBINED: usize = 3;

/// A floor's words: the three [`FloorKind`]s, then the combined bounds.
pub(crate) const FLOOR_WORDS: usize = COMBINED + MIXES;

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

/// A group's lower bounds of its members' counters and combined figures (module docs),
/// and how many live bookings its members hold (`idle.rs`).
#[derive(Default)]
pub(crate) struct LoadFloor {
    words: [AtomicU64; FLOOR_WORDS],
    pub(super) bookings: AtomicU64,
}

/// What a selection read of a floor: its words as loaded, to raise from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FloorRead {
    words: [u64; FLOOR_WORDS],
}

/// The weights of one decode block against one prefill token in a floor's combined
/// bounds, in 1/1024ths of a token, ascending: fixed when the table is made (around the
/// ratio of the partition's cost knobs), since the bounds stored under one weight mean
/// nothing under another. Any weights give valid bounds; the nearer one is to the ratio a
/// selection prices with (a learned prefill rate moves it), the tighter its bound.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FloorMix {
    per_block: [u64; MIXES],
}

impl FloorMix {
    const SCALE: f64 = 1024.0;

    /// Weights of a quarter of, once, 4 and 16 times `tokens_per_block` (each NaN or below
    /// 1/1024: 0; clamped to 2^20): the learned prefill rate moves the latency model's
    /// ratio up to tenfold either way, and a rate above the prior, the likelier, raises it.
    pub(crate) fn around(tokens_per_block: f64) -> Self {
        let at = |x: f64| {
            let w = (x * Self::SCALE).round();
            if w >= 1.0 {
                w.min(1_073_741_824.0) as u64
            } else {
                0
            }
        };
        let mut per_block: [u64; MIXES] =
            std::array::from_fn(|k| at(MIX_FACTORS[k] * tokens_per_block));
        per_block.sort_unstable();
        Self { per_block }
    }

    /// A rank's combined figures, in 1/1024 tokens (saturating).
    #[inline]
    pub(crate) fn of(self, prefill_tokens: u64, decode_blocks: u64) -> [u64; MIXES] {
        let p = prefill_tokens.saturating_mul(Self::SCALE as u64);
        self.per_block
            .map(|l| p.saturating_add(decode_blocks.saturating_mul(l)))
    }

    /// A rank's figure for each of a floor's words: its three counters in [`FloorKind`]
    /// order, then its combined figures (what [`LoadFloor::raise`] takes the minimums of).
    #[inline]
    pub(crate) fn figures(self, load: ActiveLoad) -> [u64; FLOOR_WORDS] {
        let (p, d) = (load.active_prefill_tokens, load.active_decode_blocks);
        let mut all = [0; FLOOR_WORDS];
        all[..COMBINED].copy_from_slice(&[p, d, load.active_requests]);
        all[COMBINED..].copy_from_slice(&self.of(p, d));
        all
    }

    /// The weights as used: tokens per decode block.
    #[inline]
    pub(crate) fn weights(self) -> [f64; MIXES] {
        self.per_block.map(|l| l as f64 / Self::SCALE)
    }

    /// [`MixAt::bound`] at `lambda` (selection finds the weights once with
    /// [`at`](Self::at) and bounds each group with them).
    #[cfg(test)]
    pub(crate) fn bound_at(self, f: &FloorRead, lambda: f64) -> f64 {
        self.at(lambda).bound(f)
    }

    /// Which weights bound `p + lambda·d` over a group (see [`MixAt::bound`]), found once
    /// for the many groups of one selection.
    pub(crate) fn at(self, lambda: f64) -> MixAt {
        let mut at = MixAt {
            lambda: if lambda > 0.0 { lambda } else { 0.0 }, // NaN too
            lo: 0.0,
            lo_k: None,
            hi: None,
        };
        for (k, w) in self.weights().into_iter().enumerate() {
            // Zero weights (too small to store) and repeats give nothing new.
            if w <= at.lo {
                continue;
            }
            if at.lambda <= w {
                at.hi = Some((k, w));
                break;
            }
            (at.lo, at.lo_k) = (w, Some(k));
        }
        at
    }
}

/// The weights around one λ ([`FloorMix::at`]): the one at or below it (none: λ = 0, the
/// prefill floor alone) and the one above it, if any.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MixAt {
    lambda: f64,
    lo: f64,
    lo_k: Option<usize>,
    hi: Option<(usize, f64)>,
}

impl MixAt {
    /// A lower bound of `p + λ·d` over the members of the group whose floor is `f`: at a
    /// weight, its combined bound; between two, the chord of the neighbours (the least of
    /// `p + λ·d` over a set is concave in λ), or the lower one's bound plus the rest of the
    /// weight times the decode floor, whichever is higher; beyond the last weight, that.
    #[inline]
    pub(crate) fn bound(&self, f: &FloorRead) -> f64 {
        let fp = f.bound(FloorKind::PrefillTokens) as f64;
        let fd = f.bound(FloorKind::DecodeBlocks) as f64;
        let g = |k: usize, w: f64| (f.combined(k) as f64 / FloorMix::SCALE).max(fp + w * fd);
        let g_lo = self.lo_k.map_or(fp, |k| g(k, self.lo));
        let along = g_lo + (self.lambda - self.lo) * fd;
        match self.hi {
            None => along,
            Some((k, w)) => {
                let chord = g_lo + (g(k, w) - g_lo) * (self.lambda - self.lo) / (w - self.lo);
                chord.max(along)
            }
        }
    }
}

/// After a decrement of a rank's prefill (or decode) counter left `left`, its combined
/// figures: the other counter `other` is read with a read-modify-write (module docs).
#[inline]
pub(crate) fn combined_after(
    mix: FloorMix,
    kind: FloorKind,
    left: u64,
    other: &AtomicU64,
) -> [u64; MIXES] {
    #[cfg(loom)]
    let now = if crate::sync::faults::get().floor_combined_reads_with_load {
        other.load(Ordering::Acquire)
    } else {
        other.fetch_add(0, COUNTER_RMW)
    };
    #[cfg(not(loom))]
    let now = other.fetch_add(0, COUNTER_RMW);
    match kind {
        FloorKind::DecodeBlocks => mix.of(now, left),
        _ => mix.of(left, now),
    }
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

    /// The bound of the members' `k`th combined figures ([`FloorMix::of`]).
    #[inline]
    pub(crate) fn combined(&self, k: usize) -> u64 {
        value(self.words[COMBINED + k])
    }

    /// Every word's bound, in [`FloorMix::figures`]' order.
    #[inline]
    pub(crate) fn bounds(&self) -> [u64; FLOOR_WORDS] {
        self.words.map(value)
    }

    /// The membership version the words carry (all move together).
    #[cfg(any(test, loom))]
    pub(crate) fn version_of_words(&self) -> u8 {
        version(self.words[0])
    }
}

impl LoadFloor {
    /// After a member's `kind` counter went down to `now`.
    #[inline]
    pub(crate) fn lower(&self, kind: FloorKind, now: u64) {
        self.lower_word(kind as usize, now);
    }

    /// After a member's combined figures went down to `now` ([`combined_after`]).
    #[inline]
    pub(crate) fn lower_combined(&self, now: [u64; MIXES]) {
        for (k, v) in now.into_iter().enumerate() {
            self.lower_word(COMBINED + k, v);
        }
    }

    #[inline]
    fn lower_word(&self, at: usize, now: u64) {
        let word = &self.words[at];
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
            words: std::array::from_fn(|k| self.words[k].load(Ordering::Acquire)),
        }
    }

    /// Raises each bound to the minimum `mins` the caller found over the members listed
    /// in a registry snapshot of membership `version` (the three counters in
    /// [`FloorKind`] order, then the combined figures), having read `seen` before reading
    /// any member's counter. A word whose version is another, or that changed since
    /// `seen`, is left as it is.
    pub(crate) fn raise(&self, seen: FloorRead, version_of_members: u8, mins: [u64; FLOOR_WORDS]) {
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

    /// The three counters' minimums, then `c` for every combined figure.
    fn mins(p: u64, d: u64, r: u64, c: u64) -> [u64; FLOOR_WORDS] {
        let mut m = [c; FLOOR_WORDS];
        m[..3].copy_from_slice(&[p, d, r]);
        m
    }

    #[test]
    fn lower_join_and_raise_keep_a_lower_bound() {
        let f = LoadFloor::default();
        let seen = f.read();
        assert_eq!(seen.bound(FloorKind::PrefillTokens), 0);
        f.raise(seen, seen.version_of_words(), mins(100, 7, 2, 5_000));
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
        assert_eq!(r.combined(0), 5_000);
        // A lower after the read: the stale raise does nothing.
        f.lower(FloorKind::PrefillTokens, 40);
        f.raise(r, r.version_of_words(), mins(500, 7, 2, 9_000));
        assert_eq!(f.read().bound(FloorKind::PrefillTokens), 40);
        // The combined word moves on its own gen: its raise from `r` still lands; a
        // combined lower after it wins.
        assert_eq!(f.read().combined(0), 9_000);
        f.lower_combined([1_000; MIXES]);
        f.raise(r, r.version_of_words(), mins(500, 7, 2, 9_000));
        assert_eq!(f.read().combined(0), 1_000);
        // A join: bounds to 0, and a raise for the old membership is refused.
        let before = f.read();
        f.join();
        let after = f.read();
        assert_ne!(after.version_of_words(), before.version_of_words());
        assert_eq!(after.bound(FloorKind::Requests), 0);
        f.raise(after, before.version_of_words(), mins(9, 9, 9, 9));
        assert_eq!(f.read().bound(FloorKind::Requests), 0);
        assert_eq!(f.read().combined(0), 0);
        f.raise(after, after.version_of_words(), mins(9, 9, 9, 9));
        assert_eq!(f.read().bound(FloorKind::Requests), 9);
        assert_eq!(f.read().combined(0), 9);
        // Absurd values are clamped, still below the counter.
        let r = f.read();
        f.raise(r, r.version_of_words(), mins(u64::MAX, 9, 9, 9));
        assert_eq!(f.read().bound(FloorKind::PrefillTokens), VALUE_MAX);
    }

    #[test]
    fn the_combined_figures_weigh_a_block_as_the_mix_says() {
        let mix = FloorMix::around(0.5);
        assert_eq!(mix.weights(), [0.125, 0.5, 2.0, 8.0]);
        assert_eq!(mix.of(3, 4)[1], 3 * 1024 + 4 * 512);
        assert_eq!(mix.of(u64::MAX, 1), [u64::MAX; MIXES], "saturates");
        for bad in [f64::NAN, -1.0, 0.0] {
            assert_eq!(
                FloorMix::around(bad).of(3, 1_000),
                [3 * 1024; MIXES],
                "{bad}"
            );
        }
        assert_eq!(
            FloorMix::around(f64::INFINITY).weights(),
            [1_048_576.0; MIXES]
        );
        // After a decrement, the other counter is read (and left as it was).
        let other = AtomicU64::new(6);
        let after = combined_after(mix, FloorKind::PrefillTokens, 2, &other);
        assert_eq!(after, mix.of(2, 6));
        let after = combined_after(mix, FloorKind::DecodeBlocks, 2, &other);
        assert_eq!(after, mix.of(6, 2));
        assert_eq!(other.load(Ordering::Relaxed), 6);
    }

    /// `bound_at` against the exact least `p + λ·d` of random member sets: never above
    /// it, equal to it at the weights, and no lower than the separate floors' bound.
    #[test]
    fn the_bound_at_any_weight_is_below_the_least_member() {
        let mut x = 0u64;
        let mut next = |n: u64| {
            x = crate::hash::mix::splitmix64(x);
            x % n
        };
        for case in 0..2_000 {
            let mix = FloorMix::around([0.01, 1.0, 16.0][case % 3]);
            let members: Vec<(u64, u64)> = (0..1 + next(64))
                .map(|_| (next(5_000), next(3_000)))
                .collect();
            let f = LoadFloor::default();
            let seen = f.read();
            let mut m = [u64::MAX; FLOOR_WORDS];
            for &(p, d) in &members {
                let load = ActiveLoad {
                    active_prefill_tokens: p,
                    active_decode_blocks: d,
                    active_requests: 0,
                };
                for (m, v) in m.iter_mut().zip(mix.figures(load)) {
                    *m = (*m).min(v);
                }
            }
            f.raise(seen, seen.version_of_words(), m);
            let r = f.read();
            let (fp, fd) = (m[0] as f64, m[1] as f64);
            let weights = mix.weights();
            let lambdas = [
                0.0,
                next(1_000) as f64 / 100.0,
                weights[1],
                weights[3] * 3.0,
            ];
            for lambda in lambdas.into_iter().chain(weights) {
                let exact = members
                    .iter()
                    .map(|&(p, d)| p as f64 + lambda * d as f64)
                    .fold(f64::INFINITY, f64::min);
                let b = mix.bound_at(&r, lambda);
                assert!(
                    b <= exact + 1e-6 * exact,
                    "case {case} λ {lambda}: {b} > {exact}"
                );
                assert!(
                    b + 1e-9 >= fp + lambda * fd,
                    "case {case} λ {lambda}: below the floors"
                );
                if weights.contains(&lambda) {
                    assert!(
                        (b - exact).abs() <= 1e-6 * exact.max(1.0),
                        "case {case} λ {lambda}"
                    );
                }
            }
        }
    }
}
