//! `POST /query_tiered_by_hash` in Dynamo's shape (REFERENCE §7): the request, the answer,
//! and their conversions to and from the engine's [`TieredScores`].

use std::collections::{BTreeMap, BTreeSet};

use kvr::PartitionKey;
use kvr::RankId;
use kvr::{RemoteError, TieredOverlap, TieredScores};

use super::{check_lengths, default_routing_group, hash_from_wire, hash_to_wire, WireRank};

/// The body of `POST /query_tiered_by_hash` (and of Dynamo's `/query_by_hash`, which
/// takes the same fields). Unknown fields are ignored; a field of the wrong type (a hash
/// above `i64::MAX`, a string, a float) refuses the whole body, as Dynamo does.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueryTieredByHashRequest {
    /// Local hashes of the prompt's complete blocks, first block first, as signed i64
    /// ([`hash_to_wire`](super::hash_to_wire)).
    pub block_hashes: Vec<i64>,
    pub model_name: String,
    /// `"default"` when absent.
    #[serde(default = "default_routing_group")]
    pub routing_group: String,
    /// Refused by Dynamo (400): the hashes must already carry the salt. Kept so that a
    /// server can refuse it too ([`QueryTieredByHashRequest::check`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
}

/// Why a server refuses a request body, with the status Dynamo's indexer answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestError {
    /// 400 (not JSON, or `cache_salt` set) or 422 (JSON of the wrong shape or types).
    pub status: u16,
    pub message: String,
}

impl RequestError {
    /// The error body Dynamo sends: `{"error": "..."}`.
    pub fn body(&self) -> String {
        serde_json::json!({ "error": self.message }).to_string()
    }
}

impl QueryTieredByHashRequest {
    pub fn new(key: &PartitionKey, local_hashes: &[u64]) -> Self {
        Self {
            block_hashes: local_hashes.iter().map(|&h| hash_to_wire(h)).collect(),
            model_name: key.model.clone(),
            routing_group: key.routing_group.clone(),
            cache_salt: None,
        }
    }

    /// Parses and checks a body as Dynamo's indexer does: 400 if it is not JSON, 422 if
    /// a field is missing or of the wrong type, 400 if it names a `cache_salt`.
    pub fn from_json(body: &[u8]) -> Result<Self, RequestError> {
        let req: Self = serde_json::from_slice(body).map_err(|e| RequestError {
            status: if e.is_data() { 422 } else { 400 },
            message: format!("invalid request body: {e}"),
        })?;
        req.check()?;
        Ok(req)
    }

    /// Refuses a `cache_salt` (status 400): the local hashes must already include it.
    pub fn check(&self) -> Result<(), RequestError> {
        match self.cache_salt {
            Some(_) => Err(RequestError {
                status: 400,
                message: "cache_salt is not accepted by /query_tiered_by_hash; block_hashes \
                          must already include the intended cache salt"
                    .into(),
            }),
            None => Ok(()),
        }
    }

    /// The partition asked about.
    pub fn partition_key(&self) -> PartitionKey {
        PartitionKey::new(self.model_name.clone(), self.routing_group.clone())
    }

    /// The local hashes as the engine keys them (u64).
    pub fn local_hashes(&self) -> Vec<u64> {
        self.block_hashes
            .iter()
            .map(|&h| hash_from_wire(h))
            .collect()
    }
}

/// A storage tier below the device, as Dynamo names it. `External` (a cache outside the
/// worker) has no kvr tier: the client ignores its hits (it comes last, so ignoring it
/// never shifts another tier's blocks).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum LowerTier {
    HostPinned,
    Disk,
    External,
}

/// The device tier's scores: leading blocks per rank (Dynamo's `OverlapScores`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceScores {
    /// `[[rank, blocks], ...]`: ranks with at least one device block.
    pub scores: Vec<(WireRank, u32)>,
    /// Dynamo's per-depth worker counts; always empty in its answers, and in ours.
    #[serde(default)]
    pub frequencies: Vec<u32>,
}

/// One lower tier's hits: blocks per rank that extend the previous tier's match.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LowerTierHits {
    pub hits: Vec<(WireRank, u32)>,
}

/// Dynamo's `TieredMatchDetails`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TieredMatches {
    pub device: DeviceScores,
    /// `[["host_pinned", {...}], ["disk", {...}]]`, each tier at most once, in this order.
    #[serde(default)]
    pub lower_tier: Vec<(LowerTier, LowerTierHits)>,
}

/// The body of a 200 answer to `POST /query_tiered_by_hash`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueryTieredByHashResponse {
    /// The indexer's block size: the client refuses an answer for another one.
    pub block_size: u32,
    pub tiered: TieredMatches,
}

impl QueryTieredByHashResponse {
    /// The answer a server gives from its index's tiered lookup
    /// ([`Index::find_matches_tiered`](kvr::Index::find_matches_tiered) of the
    /// request's local hashes): device scores, then `host_pinned` and `disk` (both always
    /// listed, as by an indexer holding every tier), ranks sorted, zero counts left out.
    pub fn from_scores(scores: &TieredScores, block_size: u32) -> Self {
        let list = |f: fn(&TieredOverlap) -> u32| -> Vec<(WireRank, u32)> {
            scores
                .as_slice()
                .iter()
                .filter(|o| f(o) > 0)
                .map(|o| (WireRank::from(o.rank), f(o)))
                .collect()
        };
        Self {
            block_size,
            tiered: TieredMatches {
                device: DeviceScores {
                    scores: list(|o| o.device),
                    frequencies: Vec::new(),
                },
                lower_tier: vec![
                    (
                        LowerTier::HostPinned,
                        LowerTierHits {
                            hits: list(|o| o.host),
                        },
                    ),
                    (
                        LowerTier::Disk,
                        LowerTierHits {
                            hits: list(|o| o.disk),
                        },
                    ),
                ],
            },
        }
    }

    /// Checks the answer to a query of `blocks_queried` hashes in a partition of
    /// `block_size` and writes it into `out` (sorted by rank; all-zero entries dropped).
    /// Refused ([`RemoteError::BadBody`], `out` left empty): another block size, a rank
    /// listed twice in one tier, a tier listed twice or out of order, or a rank whose
    /// blocks add up to more than `blocks_queried`.
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
        if self.block_size != block_size {
            return Err(RemoteError::BadBody(format!(
                "the index answered for block size {}, the partition's is {block_size}",
                self.block_size
            )));
        }
        let mut ranks: BTreeMap<RankId, TieredOverlap> = BTreeMap::new();
        merge(&mut ranks, "device", &self.tiered.device.scores, |o| {
            &mut o.device
        })?;
        let mut last: Option<LowerTier> = None;
        for (tier, hits) in &self.tiered.lower_tier {
            if last.is_some_and(|l| l >= *tier) {
                return Err(RemoteError::BadBody(format!(
                    "lower tier {tier:?} listed twice or out of order"
                )));
            }
            last = Some(*tier);
            match tier {
                LowerTier::HostPinned => {
                    merge(&mut ranks, "host_pinned", &hits.hits, |o| &mut o.host)?
                }
                LowerTier::Disk => merge(&mut ranks, "disk", &hits.hits, |o| &mut o.disk)?,
                LowerTier::External => {}
            }
        }
        let entries: Vec<TieredOverlap> = ranks.into_values().collect();
        check_lengths(&entries, blocks_queried)?;
        Ok(entries)
    }
}

/// Adds one tier's counts to `ranks`; a rank listed twice in the tier is refused.
fn merge(
    ranks: &mut BTreeMap<RankId, TieredOverlap>,
    tier: &str,
    list: &[(WireRank, u32)],
    field: fn(&mut TieredOverlap) -> &mut u32,
) -> Result<(), RemoteError> {
    let mut seen = BTreeSet::new();
    for &(rank, n) in list {
        let rank = RankId::from(rank);
        if !seen.insert(rank) {
            return Err(RemoteError::BadBody(format!(
                "rank {rank} listed twice in {tier}"
            )));
        }
        let o = ranks.entry(rank).or_insert(TieredOverlap {
            rank,
            device: 0,
            host: 0,
            disk: 0,
        });
        *field(o) = n;
    }
    Ok(())
}
