//! Step 2's lookahead part: ranks whose engines hash with lookahead (`crate::hash::lookahead`)
//! hold blocks keyed by their lookahead tokens too, which the prompt's plain hashes never
//! match. A tokens prompt is hashed once more per lookahead length the partition has seen,
//! and each rank keeps the larger of its overlaps: a rank holds keys of one length only,
//! so the others find nothing of it. A hashes prompt is hashed again from its
//! `source_tokens` when the caller gives them; without them lookahead ranks match none of
//! it (an undercount).

use super::{Prompt, SelectRequest, Selector};
use crate::hash::{extend_sequence_hashes, lookahead_local_hashes, HashSalt};
use crate::index::{TieredOverlap, TieredScores};
use crate::sync::atomic::Ordering;

impl Selector<'_> {
    /// Raises `tiered` (the prompt's overlap, stale ranks already forgotten) to what each
    /// rank holds of the prompt under the lookahead lengths seen; `merged` is a reused
    /// buffer. Nothing to do (no hashing, no allocation) while no length has been seen.
    pub(super) fn lookahead_overlap_into(
        &self,
        req: &SelectRequest<'_>,
        tiered: &mut TieredScores,
        merged: &mut Vec<TieredOverlap>,
    ) {
        let tokens = match req.prompt {
            Prompt::Tokens(tokens) => tokens,
            Prompt::LocalHashes { .. } => match req.source_tokens {
                Some(tokens) => tokens,
                None => return,
            },
        };
        let lengths = self.lookahead.now();
        if lengths.is_empty() || self.indexing.remote.is_some() {
            return;
        }
        // Loaded before the index is read (`crate::freshness`), as for the plain hashes.
        let stale = (!self.config.trust_stale_overlap).then(|| self.freshness.now());
        let salt = HashSalt::new(req.lora_name, self.config().cache_namespace.as_deref());
        let extras = req.extras.filter(|e| !e.is_empty());
        let (mut local, mut seq) = (crate::recycle::take_hashes(), crate::recycle::take_hashes());
        let mut found = TieredScores::new();
        for &len in lengths.iter() {
            let bs = self.block_size() as usize;
            lookahead_local_hashes(tokens, bs, len as usize, extras, salt, &mut local);
            if local.is_empty() {
                continue;
            }
            seq.clear();
            extend_sequence_hashes(None, &local, &mut seq);
            self.index
                .find_matches_tiered_into(self.indexing.primary_keys(&local, &seq), &mut found);
            if let Some(stale) = stale.as_ref().filter(|s| !s.is_empty()) {
                let n = found.forget_ranks(|r| stale.contains(r));
                self.counters
                    .stale_overlaps_ignored
                    .fetch_add(n as u64, Ordering::Relaxed);
            }
            if found.is_empty() {
                continue;
            }
            merge_larger(tiered.as_slice(), found.as_slice(), merged);
            tiered
                .fill_from(merged.drain(..))
                .expect("a merge lists each rank once");
        }
        crate::recycle::give_hashes(local);
        crate::recycle::give_hashes(seq);
    }
}

/// Per rank, the overlap that covers more blocks (on any tier; ties: the longer device
/// prefix). Both inputs sorted by rank; so is the result.
fn merge_larger(a: &[TieredOverlap], b: &[TieredOverlap], out: &mut Vec<TieredOverlap>) {
    let key = |o: &TieredOverlap| (o.device + o.host + o.disk, o.device);
    out.clear();
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        match (a.get(i), b.get(j)) {
            (Some(x), Some(y)) if x.rank == y.rank => {
                out.push(if key(y) > key(x) { *y } else { *x });
                i += 1;
                j += 1;
            }
            (Some(x), Some(y)) if x.rank < y.rank => {
                out.push(*x);
                i += 1;
            }
            (Some(x), None) => {
                out.push(*x);
                i += 1;
            }
            (_, Some(y)) => {
                out.push(*y);
                j += 1;
            }
            (None, None) => unreachable!("the loop ends first"),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::ids::RankId;

    fn o(w: u64, device: u32, host: u32) -> TieredOverlap {
        TieredOverlap {
            rank: RankId::new(w, 0),
            device,
            host,
            disk: 0,
        }
    }

    #[test]
    fn each_rank_keeps_its_larger_overlap() {
        let mut out = vec![o(9, 9, 9)];
        merge_larger(
            &[o(1, 2, 0), o(3, 1, 0)],
            &[o(0, 1, 0), o(1, 1, 3), o(4, 2, 0)],
            &mut out,
        );
        assert_eq!(out, vec![o(0, 1, 0), o(1, 1, 3), o(3, 1, 0), o(4, 2, 0)]);
    }
}
