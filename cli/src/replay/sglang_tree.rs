//! The `sglang` baseline's own state: an approximate prefix tree of the prompts it
//! routed, per worker, as SGLang's cache-aware router keeps one.
//!
//! SGLang's router inserts each routed prompt into its worker's tree and matches new
//! prompts against every worker's; it never hears what the engines evicted, and its tree
//! forgets only by size (`max_tree_size`, least recently used first), not by age. Here
//! the tree is kept at block granularity (kvr's chained block hashes name a prefix, so a
//! set of hashes per worker is a prefix tree), bounded in (block, worker) entries.

use std::collections::HashMap;

/// Entries (block, worker) the tree holds at most by default: SGLang's default
/// `max_tree_size` of 2^26 tokens in 64-token blocks.
pub(crate) const DEFAULT_MAX_ENTRIES: usize = (1 << 26) / 64;

/// An approximate, size-bounded prefix tree over block hashes, per worker index.
pub(crate) struct SglangTree {
    /// Block hash → (worker, last use) for every worker that was sent it.
    blocks: HashMap<u64, Vec<(u32, u64)>>,
    entries: usize,
    max_entries: usize,
    tick: u64,
}

impl SglangTree {
    pub(crate) fn new(max_entries: usize) -> Self {
        SglangTree {
            blocks: HashMap::new(),
            entries: 0,
            max_entries: max_entries.max(1),
            tick: 0,
        }
    }

    /// Entries held now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries
    }

    /// Per worker (`out[w]`, `out` resized to `workers`), how many leading blocks of
    /// `chain` the tree holds for it.
    pub(crate) fn match_prefix(&self, chain: &[u64], workers: usize, out: &mut Vec<u32>) {
        out.clear();
        out.resize(workers, 0);
        for (depth, h) in chain.iter().enumerate() {
            let Some(holders) = self.blocks.get(h) else {
                break;
            };
            // A worker still matches while it held every block so far (its count is the
            // depth); extend those that hold this one too.
            let mut any = false;
            for &(w, _) in holders {
                let m = &mut out[w as usize];
                if *m == depth as u32 {
                    *m += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
    }

    /// Records that `chain` was sent to `worker` (refreshing what it already held), then
    /// evicts the least recently used entries if the tree outgrew its bound.
    pub(crate) fn insert(&mut self, chain: &[u64], worker: u32) {
        self.tick += 1;
        let tick = self.tick;
        for h in chain {
            let holders = self.blocks.entry(*h).or_default();
            match holders.iter_mut().find(|(x, _)| *x == worker) {
                Some(e) => e.1 = tick,
                None => {
                    holders.push((worker, tick));
                    self.entries += 1;
                }
            }
        }
        if self.entries > self.max_entries {
            self.evict();
        }
    }

    /// Drops the oldest entries down to 90 % of the bound (in one pass, so eviction is
    /// amortised over many inserts).
    fn evict(&mut self) {
        let keep = self.max_entries * 9 / 10;
        let mut ticks: Vec<u64> = self.blocks.values().flatten().map(|e| e.1).collect();
        let drop = ticks.len() - keep;
        let (_, cut, _) = ticks.select_nth_unstable(drop - 1);
        let cut = *cut;
        let mut left = drop;
        self.blocks.retain(|_, holders| {
            holders.retain(|e| {
                let old = e.1 <= cut && left > 0;
                if old {
                    left -= 1;
                }
                !old
            });
            !holders.is_empty()
        });
        self.entries = self.blocks.values().map(Vec::len).sum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_per_worker_and_forgets_by_size_only() {
        let mut t = SglangTree::new(10);
        let mut m = Vec::new();
        t.insert(&[1, 2, 3], 0);
        t.insert(&[1, 2, 7], 1);
        t.match_prefix(&[1, 2, 3, 4], 3, &mut m);
        assert_eq!(m, vec![3, 2, 0]);
        // 6 entries; 6 more pass the bound of 10: the oldest go first.
        t.insert(&[10, 11, 12, 13, 14, 15], 2);
        assert!(t.len() <= 10, "{}", t.len());
        t.match_prefix(&[10, 11, 12], 3, &mut m);
        assert_eq!(m, vec![0, 0, 3], "the newest survive");
        t.match_prefix(&[1, 2, 3], 3, &mut m);
        assert_eq!(m[0], 0, "worker 0's old chain was evicted first");
    }
}
