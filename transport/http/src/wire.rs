//! The wire types of `POST /query_tiered_by_hash` (see the crate documentation) and their
//! conversions to and from the engine's [`TieredScores`].

use kvr::index::{RankId, RemoteError, TieredOverlap, TieredScores};
use kvr::partition::PartitionKey;

/// The path of the tiered query, appended to a
/// [`RemoteConfig::base_url`](kvr::index::RemoteConfig::base_url).
pub const QUERY_TIERED_BY_HASH_PATH: &str = "/query_tiered_by_hash";

/// The body of `POST /query_tiered_by_hash` (see the crate documentation).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueryTieredByHashRequest {
    pub model: String,
    pub routing_group: String,
    /// Local hashes of the prompt's complete blocks, first block first.
    pub block_hashes: Vec<u64>,
    /// Tokens per block the hashes were computed with.
    pub block_size: u32,
}

impl QueryTieredByHashRequest {
    pub fn new(key: &PartitionKey, block_size: u32, local_hashes: &[u64]) -> Self {
        Self {
            model: key.model.clone(),
            routing_group: key.routing_group.clone(),
            block_hashes: local_hashes.to_vec(),
            block_size,
        }
    }

    /// The partition asked about.
    pub fn partition_key(&self) -> PartitionKey {
        PartitionKey::new(self.model.clone(), self.routing_group.clone())
    }
}

/// One rank's tiered overlap on the wire ([`TieredOverlap`] with the rank spelled out).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RankOverlap {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Leading blocks on the device tier.
    pub device: u32,
    /// Further contiguous blocks in host memory.
    pub host: u32,
    /// Further contiguous blocks on disk.
    pub disk: u32,
}

impl From<TieredOverlap> for RankOverlap {
    fn from(o: TieredOverlap) -> Self {
        Self {
            worker_id: o.rank.worker_id,
            dp_rank: o.rank.dp_rank,
            device: o.device,
            host: o.host,
            disk: o.disk,
        }
    }
}

impl From<RankOverlap> for TieredOverlap {
    fn from(o: RankOverlap) -> Self {
        Self {
            rank: RankId::new(o.worker_id, o.dp_rank),
            device: o.device,
            host: o.host,
            disk: o.disk,
        }
    }
}

/// The body of a 200 answer to `POST /query_tiered_by_hash`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueryTieredByHashResponse {
    pub ranks: Vec<RankOverlap>,
}

impl QueryTieredByHashResponse {
    /// The answer a server gives from its index's tiered lookup
    /// ([`Index::find_matches_tiered`](kvr::index::Index::find_matches_tiered) of the request's
    /// `block_hashes`).
    pub fn from_scores(scores: &TieredScores) -> Self {
        Self {
            ranks: scores.iter().map(RankOverlap::from).collect(),
        }
    }

    /// Checks the answer to a query of `blocks_queried` hashes and writes it into `out`
    /// (sorted by rank; all-zero entries dropped). A rank listed twice, or a rank whose
    /// `device + host + disk` exceeds `blocks_queried`, is [`RemoteError::BadBody`], and
    /// `out` is left empty.
    pub fn to_scores(
        &self,
        blocks_queried: usize,
        out: &mut TieredScores,
    ) -> Result<(), RemoteError> {
        let too_long = self
            .ranks
            .iter()
            .find(|r| r.device as u64 + r.host as u64 + r.disk as u64 > blocks_queried as u64);
        if let Some(r) = too_long {
            let _ = out.fill_from(std::iter::empty());
            return Err(RemoteError::BadBody(format!(
                "rank {}/{} holds {} + {} + {} blocks of a {blocks_queried}-block query",
                r.worker_id, r.dp_rank, r.device, r.host, r.disk
            )));
        }
        out.fill_from(self.ranks.iter().map(|&r| TieredOverlap::from(r)))
            .map_err(|rank| RemoteError::BadBody(format!("rank {rank} listed twice")))
    }
}

impl From<&TieredScores> for QueryTieredByHashResponse {
    fn from(scores: &TieredScores) -> Self {
        Self::from_scores(scores)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvr::index::Index;
    use kvr::{KvEvent, StoredBlock, Tier};

    fn store(index: &Index, rank: RankId, tier: Tier, parent: Option<u64>, blocks: &[(u64, u64)]) {
        let blocks: Vec<StoredBlock> = blocks
            .iter()
            .map(|&(external_hash, local_hash)| StoredBlock {
                external_hash,
                local_hash,
            })
            .collect();
        index
            .apply(
                rank,
                &KvEvent::Stored {
                    tier,
                    parent,
                    blocks: &blocks,
                },
            )
            .unwrap();
    }

    /// Ranks with device, host and disk blocks of the prompt [1, 2, 3, 4, 5].
    fn populated() -> Index {
        let index = Index::new();
        let a = RankId::new(7, 0);
        let b = RankId::new(u64::MAX - 1, 3);
        let c = RankId::new(9, 1);
        store(&index, a, Tier::Device, None, &[(100, 1), (101, 2)]);
        store(&index, a, Tier::Host, Some(101), &[(102, 3)]);
        store(&index, a, Tier::Disk, Some(102), &[(103, 4), (104, 5)]);
        store(&index, b, Tier::Disk, None, &[(200, 1), (201, 2), (202, 3)]);
        store(&index, c, Tier::Device, None, &[(300, 1)]);
        index
    }

    #[test]
    fn overlap_converts_both_ways() {
        let o = TieredOverlap {
            rank: RankId::new(u64::MAX, u32::MAX),
            device: 1,
            host: 2,
            disk: 3,
        };
        let w = RankOverlap::from(o);
        assert_eq!(
            w,
            RankOverlap {
                worker_id: u64::MAX,
                dp_rank: u32::MAX,
                device: 1,
                host: 2,
                disk: 3
            }
        );
        assert_eq!(TieredOverlap::from(w), o);
    }

    #[test]
    fn scores_round_trip_through_a_response() {
        let index = populated();
        let prompt = [1, 2, 3, 4, 5, 6];
        let local = index.find_matches_tiered(&prompt);
        assert_eq!(local.len(), 3);
        let a = local.get(RankId::new(7, 0)).unwrap();
        assert_eq!((a.device, a.host, a.disk), (2, 1, 2));
        let mut resp = QueryTieredByHashResponse::from(&local);
        assert_eq!(resp.ranks.len(), 3);
        // The order on the wire is free: the client sorts.
        resp.ranks.reverse();
        let mut back = TieredScores::new();
        resp.to_scores(prompt.len(), &mut back).unwrap();
        assert_eq!(back, local);
        assert_eq!(back.as_slice(), local.as_slice());
        // Exactly as many blocks as the counts is fine.
        resp.to_scores(5, &mut back).unwrap();
        assert_eq!(back, local);
    }

    #[test]
    fn empty_scores_make_an_empty_response() {
        let resp = QueryTieredByHashResponse::from_scores(&TieredScores::new());
        assert!(resp.ranks.is_empty());
        let mut out = populated().find_matches_tiered(&[1]);
        assert!(!out.is_empty());
        resp.to_scores(3, &mut out).unwrap();
        assert!(out.is_empty());
    }

    #[test]
    fn duplicate_ranks_are_refused() {
        let r = RankOverlap {
            worker_id: 1,
            dp_rank: 0,
            device: 1,
            host: 0,
            disk: 0,
        };
        let other = RankOverlap { dp_rank: 1, ..r };
        let mut out = TieredScores::new();
        let resp = QueryTieredByHashResponse {
            ranks: vec![r, other, r],
        };
        assert!(matches!(
            resp.to_scores(4, &mut out),
            Err(RemoteError::BadBody(m)) if m.contains("1/0 listed twice")
        ));
        assert!(out.is_empty());
        // Also when one of the two is all zeros.
        let resp = QueryTieredByHashResponse {
            ranks: vec![r, RankOverlap { device: 0, ..r }],
        };
        assert!(resp.to_scores(4, &mut out).is_err());
        assert!(out.is_empty());
    }

    #[test]
    fn counts_beyond_the_query_are_refused() {
        let mut out = populated().find_matches_tiered(&[1, 2]);
        assert!(!out.is_empty());
        for (device, host, disk) in [(3, 0, 0), (1, 1, 1), (0, 0, 3), (u32::MAX, u32::MAX, 2)] {
            let resp = QueryTieredByHashResponse {
                ranks: vec![RankOverlap {
                    worker_id: 4,
                    dp_rank: 0,
                    device,
                    host,
                    disk,
                }],
            };
            assert!(matches!(
                resp.to_scores(2, &mut out),
                Err(RemoteError::BadBody(_))
            ));
            assert!(out.is_empty());
        }
    }

    #[test]
    fn all_zero_entries_are_dropped() {
        let resp = QueryTieredByHashResponse {
            ranks: vec![
                RankOverlap {
                    worker_id: 2,
                    ..Default::default()
                },
                RankOverlap {
                    worker_id: 1,
                    host: 1,
                    ..Default::default()
                },
            ],
        };
        let mut out = TieredScores::new();
        resp.to_scores(1, &mut out).unwrap();
        assert_eq!(
            out.as_slice(),
            &[TieredOverlap {
                rank: RankId::new(1, 0),
                device: 0,
                host: 1,
                disk: 0
            }]
        );
    }

    #[test]
    fn request_carries_the_partition() {
        let key = PartitionKey::new("m", "g");
        let req = QueryTieredByHashRequest::new(&key, 16, &[3, 1, 2]);
        assert_eq!(req.block_hashes, vec![3, 1, 2]);
        assert_eq!(req.block_size, 16);
        assert_eq!(req.partition_key(), key);
    }

    mod json {
        use crate::client::{endpoint_of, RequestRef};
        use crate::wire::*;

        #[test]
        fn request_json_is_the_documented_shape() {
            let req = QueryTieredByHashRequest {
                model: "llama".into(),
                routing_group: "default".into(),
                block_hashes: vec![11400714819323198485, 42],
                block_size: 16,
            };
            let json = serde_json::to_string(&req).unwrap();
            assert_eq!(
                json,
                r#"{"model":"llama","routing_group":"default","block_hashes":[11400714819323198485,42],"block_size":16}"#
            );
            // The client's borrowed form writes the same bytes.
            let borrowed = serde_json::to_string(&RequestRef {
                model: &req.model,
                routing_group: &req.routing_group,
                block_hashes: &req.block_hashes,
                block_size: req.block_size,
            })
            .unwrap();
            assert_eq!(borrowed, json);
            let back: QueryTieredByHashRequest = serde_json::from_str(&json).unwrap();
            assert_eq!(back, req);
        }

        #[test]
        fn response_json_keeps_u64_exact_and_ignores_unknown_fields() {
            let json = r#"{"ranks":[{"worker_id":18446744073709551615,"dp_rank":3,"device":1,"host":2,"disk":3,"later":true}],"version":2}"#;
            let resp: QueryTieredByHashResponse = serde_json::from_str(json).unwrap();
            assert_eq!(resp.ranks[0].worker_id, u64::MAX);
            assert_eq!(
                serde_json::to_string(&resp).unwrap(),
                r#"{"ranks":[{"worker_id":18446744073709551615,"dp_rank":3,"device":1,"host":2,"disk":3}]}"#
            );
            // A missing field is an error; so is a worker id written as a string or a float.
            for bad in [
                r#"{"ranks":[{"worker_id":1,"dp_rank":0,"device":1,"host":0}]}"#,
                r#"{"ranks":[{"worker_id":"1","dp_rank":0,"device":1,"host":0,"disk":0}]}"#,
                r#"{"ranks":[{"worker_id":1.5,"dp_rank":0,"device":1,"host":0,"disk":0}]}"#,
                r#"{"ranks":[{"worker_id":-1,"dp_rank":0,"device":1,"host":0,"disk":0}]}"#,
                r#"{}"#,
            ] {
                assert!(serde_json::from_str::<QueryTieredByHashResponse>(bad).is_err());
            }
        }

        #[test]
        fn endpoints() {
            for (base, want) in [
                (
                    "http://127.0.0.1:8080",
                    "http://127.0.0.1:8080/query_tiered_by_hash",
                ),
                (
                    "http://127.0.0.1:8080/",
                    "http://127.0.0.1:8080/query_tiered_by_hash",
                ),
                (
                    "HTTP://index.svc:80/kv/",
                    "http://index.svc:80/kv/query_tiered_by_hash",
                ),
                ("http://index", "http://index/query_tiered_by_hash"),
                (
                    "http://[::1]:9000",
                    "http://[::1]:9000/query_tiered_by_hash",
                ),
                (" http://h:1 ", "http://h:1/query_tiered_by_hash"),
            ] {
                assert_eq!(endpoint_of(base).unwrap().to_string(), want, "{base}");
            }
        }

        #[test]
        fn invalid_urls() {
            for base in [
                "",
                "   ",
                "https://index:443",
                "HTTPS://index",
                "ftp://index",
                "http://",
                "http:///path",
                "http://:8080",
                "index:8080",
                "/query",
                "garbage",
                "http://user:pw@index",
                "http://index:0",
                "http://index:99999",
                "http://index:port",
                "http://index:",
                "http://index:-1",
                "http://[::1]:65536",
                "http://index/?a=1",
                "http://in dex",
            ] {
                assert!(
                    matches!(endpoint_of(base), Err(RemoteError::InvalidUrl(_))),
                    "{base:?} -> {:?}",
                    endpoint_of(base)
                );
            }
            let https = endpoint_of("https://index").unwrap_err().to_string();
            assert!(https.contains("https is not supported"), "{https}");
        }
    }
}
