//! Selection and booking on a partition, each operation defined here once: the selection
//! layer decides (over the partition's parts borrowed as a [`Selector`]); a booked
//! operation then books the rank, records the booking into the approximate index when the
//! policy says so (after the booking stands: a recording failure is logged, never the
//! booking's), and binds the session.

use std::time::Instant;

use super::Partition;
use crate::cost::RandomSource;
use crate::ids::{RankId, SelectionId};
use crate::index::TieredScores;
use crate::select::{Decision, Outcome, SelectError, SelectRequest, SelectionStats, Selector};

impl Partition {
    /// The parts a selection reads and books into, borrowed for one call.
    pub(crate) fn selector(&self) -> Selector<'_> {
        Selector {
            key: &self.key,
            config: &self.config,
            hasher: &self.hasher,
            index: &self.index,
            indexing: &self.indexing,
            load: &self.load,
            bookings: &self.bookings,
            workers: &self.workers,
            hooks: &self.hooks,
            sessions: self.sessions.as_deref(),
            counters: &self.counters,
            freshness: &self.ingress.freshness,
            lookahead: &self.lookahead,
        }
    }

    /// Advisory selection: the decision and the projected load; books nothing.
    pub fn select(&self, req: &SelectRequest<'_>, rng: &mut impl RandomSource) -> Outcome {
        match self.selector().decide(req, false, None, rng) {
            Ok(p) => {
                crate::recycle::give_hashes(p.seq);
                Outcome::Selected(p.decision)
            }
            Err(o) => *o,
        }
    }

    /// Booked selection: decides, then books the chosen rank under `selection_id` before
    /// returning.
    pub fn select_and_reserve(
        &self,
        req: &SelectRequest<'_>,
        selection_id: SelectionId,
        now: Instant,
        rng: &mut impl RandomSource,
    ) -> Result<Outcome, SelectError> {
        let p = match self.selector().decide(req, true, Some(now), rng) {
            Ok(p) => p,
            Err(o) => return Ok(*o),
        };
        let mut d = p.decision;
        let to_record = self.indexing.recorder.is_some().then(|| copy_of(&p.seq));
        self.bookings.book(
            crate::reservation::BookingRequest {
                selection_id,
                rank: d.rank,
                prompt_blocks: p.seq,
                prefill_tokens: d.projected_prefill_tokens,
                expected_output_tokens: req.expected_output_tokens,
                ttl: req.ttl,
            },
            now,
        )?;
        self.record(d.rank, to_record, now);
        // The session follows its turn: bound (or rebound) to the rank, with this booking
        // as a lease that ends when the booking does. A refusal (table full of live
        // sessions) is counted by the table; the booking stands.
        if let (Some(t), Some(ctx)) = (&self.sessions, &d.session) {
            t.bind(ctx, d.rank, selection_id, p.forced_rebind, now);
        }
        d.selection_id = Some(selection_id);
        Ok(Outcome::Selected(d))
    }

    /// Books a request on a rank the caller chose (no scoring). With a prompt, its blocks
    /// join the rank's active blocks, and a policy that records bookings records it;
    /// without, only the given prefill tokens are booked.
    pub fn reserve(
        &self,
        rank: RankId,
        prompt: Option<&SelectRequest<'_>>,
        prefill_tokens: Option<u64>,
        selection_id: SelectionId,
        now: Instant,
    ) -> Result<Decision, SelectError> {
        let (decision, booking) =
            self.selector()
                .explicit(rank, prompt, prefill_tokens, selection_id)?;
        let to_record = (self.indexing.recorder.is_some() && !booking.prompt_blocks.is_empty())
            .then(|| copy_of(&booking.prompt_blocks));
        self.bookings.book(booking, now)?;
        self.record(rank, to_record, now);
        Ok(decision)
    }

    /// Records a booking's prompt (`seq`, a recycled copy) into the approximate index.
    fn record(&self, rank: RankId, seq: Option<Vec<u64>>, now: Instant) {
        if let Some(seq) = seq {
            self.indexing.record_booking(&self.index, rank, &seq, now);
            crate::recycle::give_hashes(seq);
        }
    }

    /// Overlap per rank of a prompt given as local block hashes, from the index selection
    /// reads: the indexer policy's primary (the event-fed or approximate local index, or
    /// the remote primary, asked within its timeouts) raised to the prediction side
    /// index's per-rank maximum. Ranks come sorted by (worker, DP rank); a rank holding
    /// nothing of the prompt is absent. Reuse `out` to allocate nothing once warm.
    ///
    /// [`Partition::index`] is the local index alone: under a remote primary it is empty,
    /// and it leaves out predictions.
    pub fn overlap(&self, local_hashes: &[u64], out: &mut TieredScores) {
        self.selector().overlap_of(local_hashes, out)
    }

    /// [`Partition::overlap`] of a request's prompt, as selection reads it: a tokens prompt
    /// (or a hashes prompt with its `source_tokens`) is also matched against ranks whose
    /// engines hash with lookahead (`kvr::hash::lookahead_local_hashes`), which its plain
    /// hashes never match. Only the prompt, `extras`, `source_tokens` and `lora_name` are
    /// read.
    pub fn overlap_for(&self, req: &SelectRequest<'_>, out: &mut TieredScores) {
        self.selector().overlap_for(req, out)
    }

    /// Selection counters of this partition.
    pub fn selection_stats(&self) -> SelectionStats {
        self.counters.snapshot()
    }
}

/// A copy of a booking's prompt hashes in a recycled buffer, recorded after the booking
/// stands (the booking owns the original).
fn copy_of(seq: &[u64]) -> Vec<u64> {
    let mut v = crate::recycle::take_hashes();
    v.extend_from_slice(seq);
    v
}
