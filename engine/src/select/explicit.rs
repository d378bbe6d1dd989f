//! Explicit reservations: the decision for a rank the caller chose, and a request's
//! sequence hashes (which a booking holds).

use super::scratch::Scratch;
use super::{Decision, Overlap, Prompt, SelectError, SelectRequest, Selector};
use crate::hash::{extend_sequence_hashes, BlockHasher, HashSalt};
use crate::ids::RankId;
use crate::ids::SelectionId;
use crate::index::TieredScores;
use crate::reservation::BookingRequest;

impl Selector<'_> {
    /// The decision of an explicit reservation, on a rank the caller chose (no scoring),
    /// and the booking it asks for, not yet booked: with a prompt, its blocks; without,
    /// only the given prefill tokens.
    pub(crate) fn explicit(
        &self,
        rank: RankId,
        prompt: Option<&SelectRequest<'_>>,
        prefill_tokens: Option<u64>,
        selection_id: SelectionId,
    ) -> Result<(Decision, BookingRequest), SelectError> {
        let workers = self.workers_now();
        let member = workers
            .get(rank.worker_id)
            .is_some_and(|w| w.has_rank(rank.dp_rank));
        if !member {
            return Err(SelectError::UnknownRank(rank));
        }
        let mut scratch = Scratch::take();
        let (seq, prompt_tokens, expected, ttl) = match prompt {
            Some(r) => {
                let (seq, n) =
                    self.sequence_into(r, &mut scratch.local, crate::recycle::take_hashes());
                (seq, n, r.expected_output_tokens, r.ttl)
            }
            None => (Vec::new(), prefill_tokens.unwrap_or(0), 0, None),
        };
        let device = if seq.is_empty() {
            0
        } else {
            let local: &[u64] = match prompt.map(|r| &r.prompt) {
                Some(Prompt::LocalHashes { hashes, .. }) => hashes,
                _ => &scratch.local,
            };
            let mut t = TieredScores::new();
            self.index
                .find_matches_tiered_into(self.indexing.primary_keys(local, &seq), &mut t);
            t.get(rank).map_or(0, |o| o.device)
        };
        Scratch::put(scratch);
        let cached = (device as u64 * self.block_size() as u64).min(prompt_tokens);
        let prefill = prefill_tokens.unwrap_or(prompt_tokens - cached);
        let active = self.bookings.rank_load(rank);
        let new_blocks = self.bookings.new_blocks_not_active(rank, &seq);
        let decision = Decision {
            rank,
            selection_id: Some(selection_id),
            overlap: Overlap {
                device_blocks: device,
                ..Overlap::default()
            },
            cached_tokens: cached,
            projected_prefill_tokens: prefill,
            projected_decode_blocks: active.active_decode_blocks + new_blocks,
            cost: f64::NAN,
            session: prompt.and_then(|r| r.effective_session()),
            session_route: None,
            kv_hint: None,
        };
        let booking = BookingRequest {
            selection_id,
            rank,
            prompt_blocks: seq,
            prefill_tokens: prefill,
            expected_output_tokens: expected,
            ttl,
        };
        Ok((decision, booking))
    }

    /// Sequence hashes of a request's prompt and its length in tokens; a tokens prompt's
    /// local hashes land in `local` (a hashes prompt carries its own).
    pub(crate) fn sequence_into(
        &self,
        req: &SelectRequest<'_>,
        local: &mut Vec<u64>,
        mut seq: Vec<u64>,
    ) -> (Vec<u64>, u64) {
        match req.prompt {
            Prompt::Tokens(tokens) => {
                let salt = HashSalt::new(req.lora_name, self.config().cache_namespace.as_deref());
                let hasher = if salt == self.hasher().salt() {
                    *self.hasher()
                } else {
                    BlockHasher::new(self.block_size() as usize, salt).expect("block size >= 1")
                };
                match req.extras.filter(|e| !e.is_empty()) {
                    Some(extras) => {
                        extras.local_hashes(tokens, hasher.block_size(), salt, local);
                        seq.clear();
                        extend_sequence_hashes(None, local, &mut seq);
                    }
                    None => hasher.hash_tokens(tokens, local, &mut seq),
                }
                (seq, tokens.len() as u64)
            }
            Prompt::LocalHashes {
                hashes,
                prompt_tokens,
            } => {
                extend_sequence_hashes(None, hashes, &mut seq);
                (seq, prompt_tokens)
            }
        }
    }
}
