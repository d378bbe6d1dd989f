//! The size bound's prune: deepest records first, across ranks, run by the maintenance
//! pass ([`ApproxRecorder::expire`]), never by a booking.

use super::records::Deadline;
use super::{ApproxRecorder, RankMap, Sink};
use crate::ids::RankId;
use crate::sync::atomic::Ordering;

impl ApproxRecorder {
    /// Removes the deepest records (then the soonest to expire, then by rank and hash, a
    /// total order) until `target` are left; returns how many went. The maintenance
    /// mutex is held; each rank's mutex is taken on its own, three times (depth
    /// histogram, candidates, removal), so bookings of other ranks go on meanwhile.
    pub(super) fn prune(&self, index: &impl Sink, ranks: &RankMap) -> usize {
        let len = self.len.load(Ordering::Relaxed);
        if len <= self.target {
            return 0;
        }
        let excess = len - self.target;
        // Depth histogram: only records at or below the cut depth need sorting.
        let mut hist: Vec<usize> = Vec::new();
        for rr in ranks.values() {
            rr.state.lock().depth_histogram(&mut hist);
        }
        let mut cut = hist.len();
        let mut deeper = 0;
        while cut > 0 && deeper < excess {
            cut -= 1;
            deeper += hist[cut];
        }
        let cut = cut as u32;
        let mut cands: Vec<(u32, Deadline, RankId, u64)> = Vec::with_capacity(deeper);
        for rr in ranks.values() {
            rr.state.lock().candidates(rr.rank, cut, &mut cands);
        }
        cands.sort_unstable_by(|a, b| {
            b.0.cmp(&a.0)
                .then(a.1.cmp(&b.1))
                .then(a.2.cmp(&b.2))
                .then(a.3.cmp(&b.3))
        });
        cands.truncate(excess);
        cands.sort_unstable_by_key(|c| c.2);
        let mut seqs: Vec<u64> = Vec::new();
        let mut pruned = 0;
        for group in cands.chunk_by(|a, b| a.2 == b.2) {
            let Some(rr) = ranks.get(&group[0].2) else {
                continue;
            };
            seqs.clear();
            seqs.extend(group.iter().map(|c| c.3));
            let mut st = rr.state.lock();
            let n = st.prune(index, rr.rank, cut, &seqs);
            // Under the rank's mutex, as every change of its share of `len`.
            self.len.fetch_sub(n, Ordering::Relaxed);
            drop(st);
            pruned += n;
        }
        self.counters
            .blocks_pruned
            .fetch_add(pruned as u64, Ordering::Relaxed);
        pruned
    }
}
