//! Step 2 of a selection (DESIGN.md §5, §7): the overlap per rank, from the index the
//! indexer policy names — the local primary (event-fed or approximate), or the remote
//! primary — raised to the prediction side index's per-rank maximum. Selection and
//! [`Partition::overlap`](crate::partition::Partition::overlap) share it, so what a host
//! reads is what selection scores.

use super::scratch::Scratch;
use super::Selector;
use crate::hash::{extend_sequence_hashes, BlockHasher, HashSalt};
use crate::index::TieredScores;

/// The prompt's local hashes, as a remote primary takes them (it chains them itself).
#[derive(Clone, Copy)]
pub(crate) enum Local<'a> {
    /// Given by the caller.
    Given(&'a [u64]),
    /// To be hashed from the tokens (salted by the LoRA adapter), only if a remote asks.
    Tokens(&'a [u32], Option<&'a str>),
}

impl Selector<'_> {
    /// The overlap of a prompt (`seq`: its sequence hashes) into `scratch.tiered`.
    pub(super) fn overlap_into(&self, local: Local<'_>, seq: &[u64], scratch: &mut Scratch) {
        let Scratch {
            local: local_buf,
            tiered,
            predicted,
            merged,
            ..
        } = scratch;
        match &self.indexing.remote {
            Some(remote) => {
                let hashes: &[u64] = match local {
                    Local::Given(hashes) => hashes,
                    Local::Tokens(tokens, lora) => {
                        let salt = HashSalt::new(lora, self.config().cache_namespace.as_deref());
                        BlockHasher::new(self.block_size() as usize, salt)
                            .expect("block size >= 1")
                            .local_hashes(tokens, local_buf);
                        local_buf
                    }
                };
                // Bounded by the remote's timeouts; no engine lock is held here.
                self.indexing.query_remote(
                    &**remote,
                    self.key(),
                    self.block_size(),
                    hashes,
                    tiered,
                );
            }
            None => self.index.find_matches_tiered_by_sequence(seq, tiered),
        }
        // Prediction: what was booked but not yet announced counts too.
        self.indexing
            .merge_prediction(seq, tiered, predicted, merged);
    }

    /// The overlap of a prompt given as local hashes, into `out` (a host's lookup).
    pub(crate) fn overlap_of(&self, local_hashes: &[u64], out: &mut TieredScores) {
        let mut scratch = Scratch::take();
        let mut seq = crate::recycle::take_hashes();
        extend_sequence_hashes(None, local_hashes, &mut seq);
        self.overlap_into(Local::Given(local_hashes), &seq, &mut scratch);
        out.fill_from(scratch.tiered.iter())
            .expect("an overlap lists each rank once");
        Scratch::put(scratch);
        crate::recycle::give_hashes(seq);
    }
}
