//! The two booked paths and the advisory one: decide, then (booked) book the rank, record
//! the booking into the approximate index when the policy says so, and bind the session.

use std::time::Instant;

use super::scratch::Scratch;
use super::{Decision, Outcome, Overlap, Prompt, SelectError, SelectRequest, Selector};
use crate::cost::RandomSource;
use crate::hash::{extend_sequence_hashes, BlockHasher, HashSalt};
use crate::ids::RankId;
use crate::ids::SelectionId;
use crate::index::TieredScores;
use crate::reservation::BookingRequest;

impl Selector<'_> {
    /// [`Partition::select`](crate::partition::Partition::select)'s work.
    pub(crate) fn select(&self, req: &SelectRequest<'_>, rng: &mut impl RandomSource) -> Outcome {
        match self.decide(req, false, None, rng) {
            Ok(p) => {
                crate::recycle::give_hashes(p.seq);
                Outcome::Selected(p.decision)
            }
            Err(o) => *o,
        }
    }

    /// [`Partition::select_and_reserve`](crate::partition::Partition::select_and_reserve)'s
    /// work: decide, book, then record and bind the session after the booking stands.
    pub(crate) fn select_and_reserve(
        &self,
        req: &SelectRequest<'_>,
        selection_id: SelectionId,
        now: Instant,
        rng: &mut impl RandomSource,
    ) -> Result<Outcome, SelectError> {
        let p = match self.decide(req, true, Some(now), rng) {
            Ok(p) => p,
            Err(o) => return Ok(*o),
        };
        let mut d = p.decision;
        let to_record = self.indexing.recorder.is_some().then(|| copy_of(&p.seq));
        self.bookings.book(
            BookingRequest {
                selection_id,
                rank: d.rank,
                prompt_blocks: p.seq,
                prefill_tokens: d.projected_prefill_tokens,
                expected_output_tokens: req.expected_output_tokens,
                ttl: req.ttl,
            },
            now,
        )?;
        // After the booking stands: a recording failure is logged, never the booking's.
        if let Some(seq) = to_record {
            self.indexing.record_booking(self.index, d.rank, &seq, now);
            crate::recycle::give_hashes(seq);
        }
        // The session follows its turn: bound (or rebound) to the rank, with this booking
        // as a lease that ends when the booking does. A refusal (table full of live
        // sessions) is counted by the table; the booking stands.
        if let (Some(t), Some(ctx)) = (&self.sessions, &d.session) {
            t.bind(ctx, d.rank, selection_id, p.forced_rebind, now);
        }
        d.selection_id = Some(selection_id);
        Ok(Outcome::Selected(d))
    }

    /// [`Partition::reserve`](crate::partition::Partition::reserve)'s work.
    pub(crate) fn reserve(
        &self,
        rank: RankId,
        prompt: Option<&SelectRequest<'_>>,
        prefill_tokens: Option<u64>,
        selection_id: SelectionId,
        now: Instant,
    ) -> Result<Decision, SelectError> {
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
        let to_record =
            (self.indexing.recorder.is_some() && !seq.is_empty()).then(|| copy_of(&seq));
        self.bookings.book(
            BookingRequest {
                selection_id,
                rank,
                prompt_blocks: seq,
                prefill_tokens: prefill,
                expected_output_tokens: expected,
                ttl,
            },
            now,
        )?;
        // A reservation that carries the prompt records it (DESIGN.md §5).
        if let Some(seq) = to_record {
            self.indexing.record_booking(self.index, rank, &seq, now);
            crate::recycle::give_hashes(seq);
        }
        Ok(Decision {
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
        })
    }

    /// Sequence hashes of a request's prompt and its length in tokens; a tokens prompt's
    /// local hashes land in `local` (a hashes prompt carries its own).
    pub(super) fn sequence_into(
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

/// A copy of a booking's prompt hashes in a recycled buffer, recorded after the booking
/// stands (the booking owns the original).
fn copy_of(seq: &[u64]) -> Vec<u64> {
    let mut v = crate::recycle::take_hashes();
    v.extend_from_slice(seq);
    v
}
