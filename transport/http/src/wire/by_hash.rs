//! Dynamo 1.6.1's `POST /query_by_hash` answer, the client's fallback for an indexer with
//! no `/query_tiered_by_hash` route (every 1.6.1 indexer). Probed against the real server:
//!
//! ```text
//! {"scores":{"1":{"0":48}},"frequencies":[],
//!  "instances":{"1":{"longest_matched":96,"gpu":48,"dp":{"0":48},"cpu":80,"disk":96}}}
//! ```
//!
//! Counts are **tokens** (blocks × the indexer's block size). `scores` is the device match
//! per worker and DP rank. `instances` summarises each worker: `gpu` its device match,
//! `cpu` the match with host blocks continuing it, `disk` with disk blocks continuing that
//! (cumulative: gpu ≤ cpu ≤ disk); `dp` lists the worker's ranks (device tokens). The
//! summary is per worker, not per rank, so the host and disk blocks of a worker with more
//! than one DP rank listed cannot be attributed to a rank: the client keeps that worker's
//! device counts only (an undercount, never an overcount).

use std::collections::{BTreeMap, BTreeSet};

use kvr::RankId;
use kvr::{RemoteError, TieredOverlap, TieredScores};

use super::check_lengths;

/// One worker's summary in `instances` (Dynamo's `MooncakeOverlapSummary`), in tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InstanceOverlap {
    #[serde(default)]
    pub longest_matched: u64,
    pub gpu: u64,
    /// Device tokens per DP rank.
    #[serde(default)]
    pub dp: BTreeMap<u32, u64>,
    pub cpu: u64,
    pub disk: u64,
}

/// The body of a 200 answer to Dynamo 1.6.1's `POST /query_by_hash`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueryByHashResponse {
    /// Device tokens per worker id, then per DP rank (JSON object keys are decimal strings).
    pub scores: BTreeMap<u64, BTreeMap<u32, u64>>,
    #[serde(default)]
    pub frequencies: Vec<u64>,
    #[serde(default)]
    pub instances: BTreeMap<u64, InstanceOverlap>,
}

impl QueryByHashResponse {
    /// Checks the answer to a query of `blocks_queried` hashes in a partition of
    /// `block_size` and writes it into `out`. Refused ([`RemoteError::BadBody`], `out`
    /// left empty): a count that is not whole blocks (an indexer of another block size), a
    /// summary that is not cumulative, or a rank with more blocks than were asked.
    pub fn to_scores(
        &self,
        block_size: u32,
        blocks_queried: usize,
        out: &mut TieredScores,
    ) -> Result<(), RemoteError> {
        super::fill_checked(self.collect(block_size, blocks_queried), out)
    }

    fn collect(
        &self,
        block_size: u32,
        blocks_queried: usize,
    ) -> Result<Vec<TieredOverlap>, RemoteError> {
        let bs = u64::from(block_size.max(1));
        let blocks = |tokens: u64, what: &dyn Fn() -> String| -> Result<u32, RemoteError> {
            if !tokens.is_multiple_of(bs) {
                return Err(RemoteError::BadBody(format!(
                    "{}: {tokens} tokens is not a whole number of {bs}-token blocks \
                     (does the index use another block size?)",
                    what()
                )));
            }
            u32::try_from(tokens / bs)
                .map_err(|_| RemoteError::BadBody(format!("{}: {tokens} tokens", what())))
        };
        let mut ranks: BTreeMap<RankId, TieredOverlap> = BTreeMap::new();
        let zero = |rank| TieredOverlap {
            rank,
            device: 0,
            host: 0,
            disk: 0,
        };
        for (&worker, per_rank) in &self.scores {
            for (&dp, &tokens) in per_rank {
                let rank = RankId::new(worker, dp);
                ranks.entry(rank).or_insert(zero(rank)).device =
                    blocks(tokens, &|| format!("scores of rank {rank}"))?;
            }
        }
        for (&worker, s) in &self.instances {
            let what = || format!("instance {worker}");
            if s.gpu > s.cpu || s.cpu > s.disk {
                return Err(RemoteError::BadBody(format!(
                    "{}: gpu {} / cpu {} / disk {} tokens is not cumulative",
                    what(),
                    s.gpu,
                    s.cpu,
                    s.disk
                )));
            }
            let host = blocks(s.cpu - s.gpu, &what)?;
            let disk = blocks(s.disk - s.cpu, &what)?;
            let listed: BTreeSet<u32> =
                s.dp.keys()
                    .chain(self.scores.get(&worker).into_iter().flat_map(|m| m.keys()))
                    .copied()
                    .collect();
            // One rank: the summary is that rank's. More: not attributable (see above).
            if let [dp] = listed.into_iter().collect::<Vec<_>>()[..] {
                let rank = RankId::new(worker, dp);
                let o = ranks.entry(rank).or_insert(zero(rank));
                (o.host, o.disk) = (host, disk);
            }
        }
        let entries: Vec<TieredOverlap> = ranks.into_values().collect();
        check_lengths(&entries, blocks_queried)?;
        Ok(entries)
    }
}
