//! Selection and booking on a partition: each call borrows the partition's parts as a
//! [`Selector`] and runs the selection layer over them.

use std::time::Instant;

use super::Partition;
use crate::cost::RandomSource;
use crate::ids::RankId;
use crate::ids::SelectionId;
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
        }
    }

    /// Advisory selection: the decision and the projected load; books nothing.
    pub fn select(&self, req: &SelectRequest<'_>, rng: &mut impl RandomSource) -> Outcome {
        self.selector().select(req, rng)
    }

    /// Booked selection: decides, then books the chosen rank before returning.
    pub fn select_and_reserve(
        &self,
        req: &SelectRequest<'_>,
        selection_id: SelectionId,
        now: Instant,
        rng: &mut impl RandomSource,
    ) -> Result<Outcome, SelectError> {
        self.selector()
            .select_and_reserve(req, selection_id, now, rng)
    }

    /// Books a request on a rank the caller chose (no scoring). With a prompt, its blocks
    /// join the rank's active blocks; without, only the given prefill tokens are booked.
    pub fn reserve(
        &self,
        rank: RankId,
        prompt: Option<&SelectRequest<'_>>,
        prefill_tokens: Option<u64>,
        selection_id: SelectionId,
        now: Instant,
    ) -> Result<Decision, SelectError> {
        self.selector()
            .reserve(rank, prompt, prefill_tokens, selection_id, now)
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

    /// Selection counters of this partition.
    pub fn selection_stats(&self) -> SelectionStats {
        self.counters.snapshot()
    }
}
