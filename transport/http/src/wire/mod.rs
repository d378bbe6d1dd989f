//! The wire types of Dynamo's standalone indexer queries (see the crate documentation):
//! `POST /query_tiered_by_hash` ([`tiered`]), which kvr speaks first and a `kvr serve`
//! answers, and Dynamo 1.6.1's `POST /query_by_hash` ([`by_hash`]), the only tiered
//! answer a 1.6.1 indexer gives (it has no `/query_tiered_by_hash` route).

pub(crate) mod by_hash;
#[cfg(test)]
mod tests;
pub(crate) mod tiered;

/// The path of the tiered query, appended to a
/// [`RemoteConfig::base_url`](kvr::config::RemoteConfig::base_url).
pub const QUERY_TIERED_BY_HASH_PATH: &str = "/query_tiered_by_hash";

/// The path of Dynamo 1.6.1's query, the client's fallback when the tiered route is missing.
pub const QUERY_BY_HASH_PATH: &str = "/query_by_hash";

/// A block hash as Dynamo writes it: the u64's bits as a signed i64 (two's complement).
/// Dynamo's server refuses an unsigned number above `i64::MAX` (HTTP 422).
pub fn hash_to_wire(hash: u64) -> i64 {
    hash as i64
}

/// The u64 block hash whose bits a wire (signed) hash carries.
pub fn hash_from_wire(hash: i64) -> u64 {
    hash as u64
}

/// Dynamo's `WorkerWithDpRank`: one rank, as the key of every score.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct WireRank {
    pub worker_id: u64,
    pub dp_rank: u32,
}

impl From<kvr::RankId> for WireRank {
    fn from(r: kvr::RankId) -> Self {
        Self {
            worker_id: r.worker_id,
            dp_rank: r.dp_rank,
        }
    }
}

impl From<WireRank> for kvr::RankId {
    fn from(r: WireRank) -> Self {
        kvr::RankId::new(r.worker_id, r.dp_rank)
    }
}

/// Dynamo's default routing group (a request without `routing_group` asks this one).
pub(crate) fn default_routing_group() -> String {
    "default".to_string()
}

/// An answer whose counts add up to more blocks than were asked is refused: such a server
/// cannot be trusted not to overcount.
pub(crate) fn check_lengths(
    entries: &[kvr::TieredOverlap],
    blocks_queried: usize,
) -> Result<(), kvr::RemoteError> {
    let too_long = entries
        .iter()
        .find(|o| o.device as u64 + o.host as u64 + o.disk as u64 > blocks_queried as u64);
    match too_long {
        Some(o) => Err(kvr::RemoteError::BadBody(format!(
            "rank {}/{} holds {} + {} + {} blocks of a {blocks_queried}-block query",
            o.rank.worker_id, o.rank.dp_rank, o.device, o.host, o.disk
        ))),
        None => Ok(()),
    }
}

/// Writes a checked answer into `out`; a refused one leaves `out` empty (both answers'
/// `to_scores`).
pub(crate) fn fill_checked(
    collected: Result<Vec<kvr::TieredOverlap>, kvr::RemoteError>,
    out: &mut kvr::TieredScores,
) -> Result<(), kvr::RemoteError> {
    match collected {
        Ok(entries) => out
            .fill_from(entries)
            .map_err(|rank| kvr::RemoteError::BadBody(format!("rank {rank} listed twice"))),
        Err(e) => {
            let _ = out.fill_from(std::iter::empty());
            Err(e)
        }
    }
}
