//! Step 2 of a selection (DESIGN.md §5, §7): the overlap per rank, from the index the
//! indexer policy names — the local primary (event-fed or approximate), or the remote
//! primary — raised to the prediction side index's per-rank maximum. Selection and
//! [`Partition::overlap`](crate::partition::Partition::overlap) share it, so what a host
//! reads is what selection scores. A stale rank's overlap (a known loss being replayed,
//! `crate::freshness`) counts as none unless `PartitionConfig::trust_stale_overlap`.

use super::scratch::Scratch;
use super::{Prompt, SelectRequest, Selector};
use crate::hooks::BlockRange;
use crate::index::{TieredOverlap, TieredScores};
use crate::sync::atomic::Ordering;

impl Selector<'_> {
    /// The overlap of a prompt (`local`: its local hashes, which a remote primary takes
    /// and chains itself; `seq`: its sequence hashes) into `tiered`. `predicted` and
    /// `merged` are the prediction merge's reused buffers.
    pub(super) fn overlap_into(
        &self,
        local: &[u64],
        seq: &[u64],
        tiered: &mut TieredScores,
        predicted: &mut TieredScores,
        merged: &mut Vec<TieredOverlap>,
    ) {
        match &self.indexing.remote {
            // Bounded by the remote's timeouts; no engine lock is held here.
            Some(remote) => {
                self.indexing
                    .query_remote(&**remote, self.key(), self.block_size(), local, tiered)
            }
            None => {
                // Loaded before the index is read (`crate::freshness`).
                let stale = (!self.config.trust_stale_overlap).then(|| self.freshness.now());
                let keys = self.indexing.primary_keys(local, seq);
                self.index.find_matches_tiered_into(keys, tiered);
                if let Some(stale) = stale.filter(|s| !s.is_empty()) {
                    let n = tiered.forget_ranks(|r| stale.contains(r));
                    self.counters
                        .stale_overlaps_ignored
                        .fetch_add(n as u64, Ordering::Relaxed);
                }
            }
        }
        // Prediction: what was booked but not yet announced counts too.
        self.indexing
            .merge_prediction(seq, tiered, predicted, merged);
    }

    /// The overlap of a request's prompt, into `out`: the plain hashes' and, for ranks
    /// hashing with lookahead, the lookahead hashes' (a host's lookup of a whole request).
    pub(crate) fn overlap_for(&self, req: &SelectRequest<'_>, out: &mut TieredScores) {
        let mut scratch = Scratch::take();
        let Scratch {
            local,
            tiered,
            predicted,
            merged,
            ..
        } = &mut *scratch;
        let (seq, _) = self.sequence_into(req, local, crate::recycle::take_hashes());
        let local: &[u64] = match req.prompt {
            Prompt::LocalHashes { hashes, .. } => hashes,
            Prompt::Tokens(_) => local,
        };
        self.overlap_into(local, &seq, tiered, predicted, merged);
        self.lookahead_overlap_into(req, tiered, merged);
        out.fill_from(tiered.iter())
            .expect("an overlap lists each rank once");
        Scratch::put(scratch);
        crate::recycle::give_hashes(seq);
    }

    /// The overlap of a prompt given as local hashes, into `out` (a host's lookup).
    pub(crate) fn overlap_of(&self, local_hashes: &[u64], out: &mut TieredScores) {
        self.overlap_for(&SelectRequest::local_hashes(local_hashes, 0), out)
    }
}

/// Blocks of `[from, n)` covered contiguously from `from` by the shared-cache ranges.
pub(super) fn shared_beyond(ranges: &[BlockRange], from: u32, n: u32) -> u32 {
    if ranges.is_empty() {
        return 0; // the common case, without the walk
    }
    let mut at = from;
    loop {
        let next = ranges
            .iter()
            .filter(|(s, e)| *s <= at && *e > at)
            .map(|(_, e)| (*e).min(n))
            .max();
        match next {
            Some(e) if e > at => at = e,
            _ => return at - from,
        }
    }
}

#[cfg(test)]
mod shared_range_tests {
    use super::shared_beyond;

    #[test]
    fn shared_blocks_count_contiguously_from_the_device_prefix() {
        assert_eq!(shared_beyond(&[(0, 10)], 4, 20), 6);
        assert_eq!(shared_beyond(&[(0, 3), (3, 8)], 2, 20), 6);
        assert_eq!(
            shared_beyond(&[(5, 9)], 4, 20),
            0,
            "a gap at the device prefix end"
        );
        assert_eq!(shared_beyond(&[(0, 50)], 4, 20), 16, "capped at the prompt");
        assert_eq!(shared_beyond(&[], 0, 20), 0);
    }
}
