//! `GET /dump`: the index as Dynamo 1.6.1 writes it (the selection service's and the
//! standalone indexer's shape), `{"<model>:<routing_group>": {"block_size", "events":
//! [{worker_id, storage_tier, residency_domain, event: {event_id, data: {stored: {
//! parent_hash, start_position, blocks: [{block_hash, tokens_hash, mm_extra_info}]}},
//! dp_rank}}]}}`. Hashes are unsigned here (unlike the request bodies), `block_hash` the
//! engine's and `tokens_hash` the local hash.

use std::collections::BTreeMap;

use kvr::{DumpedStore, IndexDump};
use kvr::{PartitionKey, RankId, StoredBlock, Tier};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct DumpBlock {
    pub block_hash: u64,
    pub tokens_hash: u64,
    #[serde(default)]
    pub mm_extra_info: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct DumpStored {
    #[serde(default)]
    pub parent_hash: Option<u64>,
    #[serde(default)]
    pub start_position: Option<u64>,
    pub blocks: Vec<DumpBlock>,
}

/// An event's data: only `stored` is written; a peer's other kinds are refused on read.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum DumpData {
    Stored(DumpStored),
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct DumpEventInner {
    pub event_id: u64,
    pub data: DumpData,
    #[serde(default)]
    pub dp_rank: u32,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct DumpEvent {
    pub worker_id: u64,
    pub storage_tier: String,
    #[serde(default = "worker_domain")]
    pub residency_domain: String,
    pub event: DumpEventInner,
}

fn worker_domain() -> String {
    "worker".to_string()
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct DumpPartition {
    pub block_size: u32,
    pub events: Vec<DumpEvent>,
}

/// The whole answer.
pub type Dump = BTreeMap<String, DumpPartition>;

pub fn tier_name(t: Tier) -> &'static str {
    match t {
        Tier::Device => "device",
        Tier::Host => "host_pinned",
        Tier::Disk => "disk",
    }
}

/// Dynamo's tier names (and the medium names engines use) to kvr's tiers.
pub fn tier_of(name: &str) -> Option<Tier> {
    match name.to_ascii_lowercase().as_str() {
        "device" | "gpu" => Some(Tier::Device),
        "host_pinned" | "host" | "cpu" | "cpu_pinned" | "cpu_tier1" => Some(Tier::Host),
        "disk" | "cpu_tier2" | "nvme" | "storage" => Some(Tier::Disk),
        _ => None,
    }
}

pub fn partition_name(key: &PartitionKey) -> String {
    format!("{}:{}", key.model, key.routing_group)
}

/// `"<model>:<routing_group>"` back into a key (the group is what follows the last `:`).
pub fn parse_partition_name(s: &str) -> Option<PartitionKey> {
    let (m, g) = s.rsplit_once(':')?;
    Some(PartitionKey::new(m, g))
}

/// One partition's dump in Dynamo's shape.
pub fn partition_dump(block_size: u32, d: &IndexDump) -> DumpPartition {
    DumpPartition {
        block_size,
        events: d
            .stores
            .iter()
            .enumerate()
            .map(|(i, s)| DumpEvent {
                worker_id: s.rank.worker_id,
                storage_tier: tier_name(s.tier).to_string(),
                residency_domain: worker_domain(),
                event: DumpEventInner {
                    event_id: i as u64,
                    data: DumpData::Stored(DumpStored {
                        parent_hash: s.parent,
                        start_position: None,
                        blocks: s
                            .blocks
                            .iter()
                            .map(|b| DumpBlock {
                                block_hash: b.external_hash,
                                tokens_hash: b.local_hash,
                                mm_extra_info: None,
                            })
                            .collect(),
                    }),
                    dp_rank: s.rank.dp_rank,
                },
            })
            .collect(),
    }
}

/// A peer's events back into stores; an unknown tier is an error (the peer speaks
/// something else: refuse the dump rather than guess).
pub fn stores_of(p: &DumpPartition) -> Result<Vec<DumpedStore>, String> {
    p.events
        .iter()
        .map(|e| {
            let tier = tier_of(&e.storage_tier)
                .ok_or_else(|| format!("unknown storage_tier {:?}", e.storage_tier))?;
            let DumpData::Stored(s) = &e.event.data;
            Ok(DumpedStore {
                rank: RankId::new(e.worker_id, e.event.dp_rank),
                tier,
                parent: s.parent_hash,
                blocks: s
                    .blocks
                    .iter()
                    .map(|b| StoredBlock {
                        external_hash: b.block_hash,
                        local_hash: b.tokens_hash,
                    })
                    .collect(),
            })
        })
        .collect()
}
