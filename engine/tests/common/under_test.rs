//! The index as the model-based tests drive it, behind an interface (kvr has had more than
//! one index implementation; the tests stay generic).

use kvr::index::{
    ApplyOutcome, Index, IndexError, IndexStats, OverlapScores, RankStats, TieredScores,
};
use kvr::{KvEvent, RankId, StoredBlock, Tier};

pub trait UnderTest {
    /// Whether `stats().nodes` counts distinct held prefixes exactly (the run index counts
    /// the blocks of its live runs, which may include blocks nobody holds any more).
    const EXACT_NODES: bool;
    fn store(
        &self,
        rank: RankId,
        tier: Tier,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<usize, IndexError>;
    fn apply(&self, rank: RankId, event: &KvEvent<'_>) -> Result<ApplyOutcome, IndexError>;
    fn remove(&self, rank: RankId, tier: Tier, hashes: &[u64]) -> ApplyOutcome;
    fn clear(&self, rank: RankId) -> usize;
    fn remove_rank(&self, rank: RankId) -> bool;
    fn remove_worker(&self, worker: u64) -> usize;
    fn ranks(&self) -> Vec<RankId>;
    fn stats(&self) -> IndexStats;
    fn rank_stats(&self, rank: RankId) -> Option<RankStats>;
    fn find_matches(&self, q: &[u64]) -> OverlapScores;
    fn find_matches_into(&self, q: &[u64], out: &mut OverlapScores);
    fn find_matches_tiered(&self, q: &[u64]) -> TieredScores;
    /// By sequence hashes, if the implementation can (`false`: it cannot).
    fn find_matches_by_sequence(&self, _seq: &[u64], _out: &mut OverlapScores) -> bool {
        false
    }
}

macro_rules! forward {
    () => {
        fn store(
            &self,
            rank: RankId,
            tier: Tier,
            parent: Option<u64>,
            blocks: &[StoredBlock],
        ) -> Result<usize, IndexError> {
            Self::store(self, rank, tier, parent, blocks)
        }
        fn apply(&self, rank: RankId, event: &KvEvent<'_>) -> Result<ApplyOutcome, IndexError> {
            Self::apply(self, rank, event)
        }
        fn remove(&self, rank: RankId, tier: Tier, hashes: &[u64]) -> ApplyOutcome {
            Self::remove(self, rank, tier, hashes)
        }
        fn clear(&self, rank: RankId) -> usize {
            Self::clear(self, rank)
        }
        fn remove_rank(&self, rank: RankId) -> bool {
            Self::remove_rank(self, rank)
        }
        fn remove_worker(&self, worker: u64) -> usize {
            Self::remove_worker(self, worker)
        }
        fn ranks(&self) -> Vec<RankId> {
            Self::ranks(self)
        }
        fn stats(&self) -> IndexStats {
            Self::stats(self)
        }
        fn rank_stats(&self, rank: RankId) -> Option<RankStats> {
            Self::rank_stats(self, rank)
        }
        fn find_matches(&self, q: &[u64]) -> OverlapScores {
            Self::find_matches(self, q)
        }
        fn find_matches_into(&self, q: &[u64], out: &mut OverlapScores) {
            Self::find_matches_into(self, q, out)
        }
        fn find_matches_tiered(&self, q: &[u64]) -> TieredScores {
            Self::find_matches_tiered(self, q)
        }
    };
}

impl UnderTest for Index {
    const EXACT_NODES: bool = false;
    forward!();
}
