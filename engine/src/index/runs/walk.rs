//! Lookups on the run index: lock-free walks down the trie.
//!
//! A walk pins an epoch, finds the run that starts the prompt (one branch-table probe),
//! counts how many of the prompt's local hashes equal the run's, settles each rank by its
//! cover there, and probes the branch table again only where the prompt goes on past what
//! matched. A prompt nobody holds costs one probe, whatever its length.

use super::RunIndex;
use crate::index::query::{OverlapScores, TieredOverlap, TieredScores, Walk};
use crate::sync::epoch;

/// The run index reuses the flat index's result types.
pub type RunScores = OverlapScores;
pub type RunTieredScores = TieredScores;

impl RunIndex {
    /// Device overlap of a prompt given as local hashes.
    pub fn find_matches(&self, locals: &[u64]) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_into(locals, &mut out);
        out
    }

    /// As [`RunIndex::find_matches`], into a reused result (allocation-free once warm).
    pub fn find_matches_into(&self, locals: &[u64], out: &mut OverlapScores) {
        out.scores.clear();
        let Some(&first) = locals.first() else {
            return;
        };
        let guard = epoch::pin();
        let Some(mut run) = self.branches.find(0, 0, first, &guard) else {
            return;
        };
        let mut active = std::mem::take(&mut out.active);
        let mut done = std::mem::take(&mut out.done);
        active.clear();
        done.clear();
        let mut pos = 0usize;
        let mut first_run = true;
        loop {
            let v = run.view(&guard);
            let m = v.matching(&locals[pos..]);
            if m == 0 {
                break;
            }
            if first_run {
                first_run = false;
                for c in v.covers.iter().filter(|c| c.d > 0) {
                    if (c.d as usize) < m {
                        done.push((c.slot, c.d as u32));
                    } else {
                        active.push(c.slot);
                    }
                }
            } else if active.len() == 1 {
                let s = active[0];
                let d = v.cover(s).map_or(0, |c| c.d as usize);
                if d < m {
                    done.push((s, (pos + d) as u32));
                    active.clear();
                }
            } else {
                // Both slot-sorted: one merge pass.
                let covers = v.covers;
                let mut j = 0;
                active.retain(|&s| {
                    while j < covers.len() && covers[j].slot < s {
                        j += 1;
                    }
                    let d = match covers.get(j) {
                        Some(c) if c.slot == s => c.d as usize,
                        _ => 0,
                    };
                    if d < m {
                        done.push((s, (pos + d) as u32));
                    }
                    d >= m
                });
            }
            pos += m;
            if active.is_empty() || pos == locals.len() {
                break;
            }
            let here = run as *const _ as usize;
            match self.branches.find(here, m as u32, locals[pos], &guard) {
                Some(c) => run = c,
                None => break,
            }
        }
        done.extend(active.drain(..).map(|s| (s, pos as u32)));
        // Translate after the walk: every slot read above is still owned by its rank while
        // `guard` is pinned (slots are reused only past the epoch).
        let rank_of = self.ranks.translator(&guard);
        out.scores.extend(
            done.iter()
                .filter_map(|&(s, score)| rank_of(s).map(|r| (r, score))),
        );
        out.scores.sort_unstable_by_key(|e| e.0);
        out.active = active;
        out.done = done;
    }

    /// Tiered overlap of a prompt given as local hashes.
    pub fn find_matches_tiered(&self, locals: &[u64]) -> TieredScores {
        let mut out = TieredScores::new();
        self.find_matches_tiered_into(locals, &mut out);
        out
    }

    /// Per rank the device prefix, then how many further contiguous blocks the host tier
    /// holds, then the disk tier; into a reused result.
    pub fn find_matches_tiered_into(&self, locals: &[u64], out: &mut TieredScores) {
        out.entries.clear();
        let Some(&first) = locals.first() else {
            return;
        };
        let guard = epoch::pin();
        let Some(mut run) = self.branches.find(0, 0, first, &guard) else {
            return;
        };
        let mut live = std::mem::take(&mut out.live);
        let mut done = std::mem::take(&mut out.done);
        live.clear();
        done.clear();
        let mut pos = 0usize;
        let mut first_run = true;
        loop {
            let v = run.view(&guard);
            let m = v.matching(&locals[pos..]);
            if m == 0 {
                break;
            }
            if first_run {
                first_run = false;
                for c in v.covers {
                    let r = c.walk(0, m as u32);
                    let w = Walk {
                        slot: c.slot,
                        phase: r.phase.unwrap_or(0) as usize,
                        counts: r.counts,
                    };
                    match r.phase {
                        Some(_) => live.push(w),
                        None if r.counts != [0; 3] => done.push(w),
                        None => {}
                    }
                }
            } else {
                let covers = v.covers;
                let mut j = 0;
                live.retain_mut(|w| {
                    while j < covers.len() && covers[j].slot < w.slot {
                        j += 1;
                    }
                    let c = match covers.get(j) {
                        Some(c) if c.slot == w.slot => *c,
                        _ => Default::default(),
                    };
                    let r = c.walk(w.phase as u8, m as u32);
                    for t in 0..3 {
                        w.counts[t] += r.counts[t];
                    }
                    match r.phase {
                        Some(p) => {
                            w.phase = p as usize;
                            true
                        }
                        None => {
                            done.push(*w);
                            false
                        }
                    }
                });
            }
            pos += m;
            if live.is_empty() || pos == locals.len() {
                break;
            }
            let here = run as *const _ as usize;
            match self.branches.find(here, m as u32, locals[pos], &guard) {
                Some(c) => run = c,
                None => break,
            }
        }
        done.append(&mut live);
        let rank_of = self.ranks.translator(&guard);
        out.entries.extend(done.iter().filter_map(|w| {
            rank_of(w.slot).map(|rank| TieredOverlap {
                rank,
                device: w.counts[0],
                host: w.counts[1],
                disk: w.counts[2],
            })
        }));
        out.entries.sort_unstable_by_key(|e| e.rank);
        out.live = live;
        out.done = done;
    }
}
