//! What one rank holds of one run: per tier, which offsets (the writer's truth, a bitmap
//! per tier), and the [`Cover`] readers get: how far a lookup's walk goes in this run for
//! that rank, whatever tier phase the walk enters it in.
//!
//! The tiered score of a rank (DESIGN.md §4) is the device prefix `d`, then how many
//! further contiguous blocks the host tier holds, then the disk tier. A walk through runs
//! is a walk through that sequence, so per run and rank it suffices to know, for each phase
//! the walk can enter in (device, host, disk), how many blocks each later phase covers from
//! the run's start. A prefix of the run (a query that leaves it early) is covered greedily
//! from those counts, phase after phase, because phases only advance.

/// Counts fit in 16 bits: runs are at most [`super::run::MAX_RUN`] blocks.
type Count = u16;

/// One rank's reach in one run (16 bytes; covers are slot-sorted in a state).
///
/// Entering in the device phase: `d` device blocks from offset 0, then `h0` host blocks,
/// then `k0` disk blocks. Entering in the host phase: `h1` host blocks, then `k1` disk.
/// Entering in the disk phase: `k2` disk blocks.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Cover {
    pub(crate) slot: u32,
    pub(crate) d: Count,
    pub(crate) h0: Count,
    pub(crate) k0: Count,
    pub(crate) h1: Count,
    pub(crate) k1: Count,
    pub(crate) k2: Count,
}

/// Where a walk through one run ends for one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reach {
    /// Blocks counted per tier (device, host, disk).
    pub(crate) counts: [u32; 3],
    /// The phase the walk is in after the last block counted (`None`: it stopped, some of
    /// the `m` blocks were not covered).
    pub(crate) phase: Option<u8>,
}

impl Cover {
    pub(crate) fn is_empty(&self) -> bool {
        (self.d | self.h0 | self.k0 | self.h1 | self.k1 | self.k2) == 0
    }

    /// The walk over the first `m` blocks of the run, entering in `phase`.
    #[inline]
    pub(crate) fn walk(&self, phase: u8, m: u32) -> Reach {
        if phase == 0 && (self.h0 | self.k0) == 0 {
            // Device only from this run's start (the common case): the device walk's work.
            let d = (self.d as u32).min(m);
            return Reach {
                counts: [d, 0, 0],
                phase: (d == m).then_some(0),
            };
        }
        let runs: [u32; 3] = match phase {
            0 => [self.d as u32, self.h0 as u32, self.k0 as u32],
            1 => [0, self.h1 as u32, self.k1 as u32],
            _ => [0, 0, self.k2 as u32],
        };
        let mut counts = [0u32; 3];
        let mut left = m;
        let mut last = phase;
        for t in phase as usize..3 {
            let c = runs[t].min(left);
            counts[t] = c;
            if c > 0 {
                last = t as u8;
            }
            left -= c;
            if left == 0 {
                return Reach {
                    counts,
                    phase: Some(last),
                };
            }
        }
        Reach {
            counts,
            phase: None,
        }
    }
}

/// Bits of one tier's holdings (offset `i` is bit `i % 64` of word `i / 64`).
type Bits = smallvec::SmallVec<[u64; 2]>;

/// One rank's holdings of one run, per tier (40 bytes: one per (rank, run) pair, so it
/// counts toward the index's bytes per holder-block).
#[derive(Clone, Debug, Default)]
pub(crate) struct Hold {
    device: Bits,
    /// Host and disk, boxed: most ranks hold nothing there, and a hold with all three
    /// tiers inline took 80 bytes. Present only while one of them holds an offset.
    lower: Option<Box<[Bits; 2]>>,
    /// Whether the run counts this rank among its holders (`RunWriter::holds`); kept in
    /// step when the rank publishes its cover there.
    pub(crate) counted: bool,
    /// The run's index in the rank's run table (`place`): what the rank's places name it by.
    pub(crate) run_index: u32,
}

fn get(b: &[u64], i: u32) -> bool {
    b.get((i / 64) as usize)
        .is_some_and(|w| w >> (i % 64) & 1 == 1)
}

/// Consecutive set bits of `b` from offset `from`.
fn run_from(b: &[u64], from: u32) -> u32 {
    let mut i = from;
    loop {
        let Some(&w) = b.get((i / 64) as usize) else {
            return i - from;
        };
        let ones = (!(w >> (i % 64))).trailing_zeros().min(64 - i % 64);
        i += ones;
        if !i.is_multiple_of(64) || ones == 0 {
            return i - from;
        }
    }
}

impl Hold {
    /// An empty hold of the run at `run_index` in the rank's run table.
    pub(crate) fn new(run_index: u32) -> Self {
        Hold {
            run_index,
            ..Default::default()
        }
    }

    /// The words of `tier`'s bitmap (none for a lower tier without a box).
    fn bits(&self, tier: usize) -> &[u64] {
        match (tier, &self.lower) {
            (0, _) => &self.device,
            (t, Some(l)) => &l[t - 1],
            (_, None) => &[],
        }
    }

    /// The bitmap of `tier`, boxing the lower tiers' if they have none yet.
    fn bits_mut(&mut self, tier: usize) -> &mut Bits {
        match tier {
            0 => &mut self.device,
            t => &mut self.lower.get_or_insert_with(Default::default)[t - 1],
        }
    }

    /// Whether the rank holds `offset` on `tier`.
    pub(crate) fn has(&self, tier: usize, offset: u32) -> bool {
        get(self.bits(tier), offset)
    }

    /// Whether the rank holds `offset` on any tier.
    pub(crate) fn has_any(&self, offset: u32) -> bool {
        (0..3).any(|t| self.has(t, offset))
    }

    /// Sets `offset` on `tier`; returns whether it was unset.
    pub(crate) fn set(&mut self, tier: usize, offset: u32) -> bool {
        let b = self.bits_mut(tier);
        let w = (offset / 64) as usize;
        if b.len() <= w {
            b.resize(w + 1, 0);
        }
        let bit = 1u64 << (offset % 64);
        let was = b[w] & bit != 0;
        b[w] |= bit;
        !was
    }

    /// Clears `offset` on `tier`; returns whether it was set.
    pub(crate) fn clear(&mut self, tier: usize, offset: u32) -> bool {
        if tier > 0 && self.lower.is_none() {
            return false;
        }
        let b = self.bits_mut(tier);
        let w = (offset / 64) as usize;
        let Some(word) = b.get_mut(w) else {
            return false;
        };
        let bit = 1u64 << (offset % 64);
        let was = *word & bit != 0;
        *word &= !bit;
        while b.last() == Some(&0) {
            b.pop();
        }
        if self
            .lower
            .as_ref()
            .is_some_and(|l| l.iter().all(|b| b.is_empty()))
        {
            self.lower = None;
        }
        was
    }

    pub(crate) fn is_empty(&self) -> bool {
        (0..3).all(|t| self.bits(t).is_empty())
    }

    /// Offsets held per tier, and offsets held on any tier.
    pub(crate) fn counts(&self) -> ([i64; 3], i64) {
        let pop = |b: &[u64]| b.iter().map(|w| w.count_ones() as i64).sum::<i64>();
        let (a, b, c) = (self.bits(0), self.bits(1), self.bits(2));
        let n = a.len().max(b.len()).max(c.len());
        let word = |x: &[u64], i: usize| x.get(i).copied().unwrap_or(0);
        let any = (0..n)
            .map(|i| (word(a, i) | word(b, i) | word(c, i)).count_ones() as i64)
            .sum();
        ([pop(a), pop(b), pop(c)], any)
    }

    /// Forgets every offset (the `counted` flag stays for the publish that follows).
    pub(crate) fn clear_all(&mut self) {
        self.device.clear();
        self.lower = None;
    }

    /// The cover readers get (with `slot`).
    pub(crate) fn cover(&self, slot: u32) -> Cover {
        let (dev, host, disk) = (self.bits(0), self.bits(1), self.bits(2));
        let d = run_from(dev, 0);
        let h0 = run_from(host, d);
        let k0 = run_from(disk, d + h0);
        let h1 = run_from(host, 0);
        let k1 = run_from(disk, h1);
        let k2 = run_from(disk, 0);
        let c = |x: u32| x.min(Count::MAX as u32) as Count;
        Cover {
            slot,
            d: c(d),
            h0: c(h0),
            k0: c(k0),
            h1: c(h1),
            k1: c(k1),
            k2: c(k2),
        }
    }

    /// Heap bytes of the lower tiers' box and of the bitmaps beyond the inline words.
    pub(crate) fn heap_bytes(&self) -> usize {
        let spilled = |b: &Bits| if b.spilled() { b.capacity() * 8 } else { 0 };
        spilled(&self.device)
            + self.lower.as_ref().map_or(0, |l| {
                std::mem::size_of::<[Bits; 2]>() + l.iter().map(spilled).sum::<usize>()
            })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// The lower tiers take a box only while they hold something, and the hold counts it.
    #[test]
    fn lower_tiers_are_boxed_while_used() {
        assert!(std::mem::size_of::<Hold>() <= 40);
        let mut h = Hold::new(3);
        assert!(h.set(0, 5));
        assert_eq!(h.heap_bytes(), 0);
        assert!(!h.clear(2, 5), "nothing on disk");
        assert!(h.lower.is_none());
        assert!(h.set(1, 7) && h.set(2, 9));
        assert!(h.heap_bytes() >= std::mem::size_of::<[Bits; 2]>());
        assert!(h.has(1, 7) && h.has(2, 9) && !h.has(1, 9));
        assert_eq!(h.counts(), ([1, 1, 1], 3));
        assert!(h.clear(1, 7));
        assert!(h.lower.is_some(), "disk still holds 9");
        assert!(h.clear(2, 9));
        assert!(h.lower.is_none() && h.heap_bytes() == 0);
        assert!(!h.is_empty() && h.has(0, 5));
        h.set(2, 1);
        h.clear_all();
        assert!(h.is_empty() && h.lower.is_none() && h.run_index == 3);
    }

    #[test]
    fn runs_cross_words() {
        let mut h = Hold::default();
        for i in 0..130 {
            assert!(h.set(0, i));
        }
        assert!(!h.set(0, 5));
        assert_eq!(h.cover(1).d, 130);
        assert!(h.clear(0, 64));
        assert_eq!(h.cover(1).d, 64);
        assert!(h.set(1, 64));
        let c = h.cover(1);
        assert_eq!((c.d, c.h0, c.k0, c.h1), (64, 1, 0, 0));
        assert_eq!(h.counts(), ([129, 1, 0], 130));
    }

    #[test]
    fn walk_truncates_phase_by_phase() {
        let c = Cover {
            slot: 0,
            d: 4,
            h0: 3,
            k0: 2,
            h1: 5,
            k1: 0,
            k2: 1,
        };
        assert_eq!(
            c.walk(0, 3),
            Reach {
                counts: [3, 0, 0],
                phase: Some(0)
            }
        );
        assert_eq!(
            c.walk(0, 6),
            Reach {
                counts: [4, 2, 0],
                phase: Some(1)
            }
        );
        assert_eq!(
            c.walk(0, 9),
            Reach {
                counts: [4, 3, 2],
                phase: Some(2)
            }
        );
        assert_eq!(c.walk(0, 10).phase, None);
        assert_eq!(c.walk(1, 5).counts, [0, 5, 0]);
        assert_eq!(c.walk(2, 2).phase, None);
        // A rank entering with nothing held stops at once.
        assert_eq!(Cover::default().walk(0, 1).phase, None);
        assert_eq!(Cover::default().walk(0, 0).phase, Some(0));
    }
}
