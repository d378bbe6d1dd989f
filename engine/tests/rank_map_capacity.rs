//! A registered worker's KV capacity sizes its ranks' index maps at their first accepted
//! store (`kvr::index` module `capacity`): no growth while the cache fills, nothing for a
//! refused event, bounded for an absurd capacity, forgotten with the worker.

use kvr::config::PartitionConfig;
use kvr::{KvEvent, StoredBlock, MAX_RESERVED_BLOCKS};
use kvr::{Partition, PartitionKey, WorkerInfo};
use kvr::{RankId, Tier};

/// Bytes of a rank-map slot: an engine hash (8) and a place (4).
const SLOT: u64 = 12;

fn partition() -> Partition {
    Partition::try_new(PartitionKey::new("m", "g"), PartitionConfig::new(16)).unwrap()
}

fn worker(id: u64, capacity: u64) -> WorkerInfo {
    WorkerInfo {
        total_kv_blocks: capacity,
        ..WorkerInfo::new(id, 1)
    }
}

fn store(p: &Partition, rank: RankId, parent: Option<u64>, ext: std::ops::Range<u64>) -> u64 {
    let blocks: Vec<StoredBlock> = ext
        .map(|e| StoredBlock {
            external_hash: e,
            local_hash: e ^ 0x5bd1_e995,
        })
        .collect();
    let ev = KvEvent::Stored {
        tier: Tier::Device,
        parent,
        blocks: &blocks,
    };
    let out = p.apply_events(rank, [ev]);
    out.rejected
}

fn map_bytes(p: &Partition, rank: RankId) -> u64 {
    p.index().rank_stats(rank).map_or(0, |s| s.rank_map_bytes)
}

#[test]
fn a_registered_capacity_sizes_the_map_once() {
    let p = partition();
    let (sized, grown) = (RankId::new(1, 0), RankId::new(2, 0));
    p.upsert_worker(worker(1, 20_000)).unwrap();
    p.upsert_worker(worker(2, 0)).unwrap();
    // A refused store (unknown parent) creates and sizes nothing.
    assert_eq!(store(&p, sized, Some(999), 0..10), 1);
    assert!(p.index().rank_stats(sized).is_none());

    assert_eq!(store(&p, sized, None, 0..100), 0);
    assert_eq!(store(&p, grown, None, 0..100), 0);
    let first = map_bytes(&p, sized);
    assert!(first >= 20_000 * SLOT, "sized for the capacity: {first}");
    assert!(map_bytes(&p, grown) < 4_000, "{}", map_bytes(&p, grown));
    // Filling toward the capacity: the map part does not grow (holds add a little).
    for i in 1..150u64 {
        assert_eq!(
            store(&p, sized, Some(i * 100 - 1), i * 100..i * 100 + 100),
            0
        );
    }
    let full = map_bytes(&p, sized);
    assert!(full < first + 64 * 1024, "{first} -> {full}");
    assert_eq!(p.index().rank_stats(sized).unwrap().holder_blocks, 15_000);

    // Removed and added again without a capacity: the new rank grows as it goes.
    assert!(p.remove_worker(1));
    p.upsert_worker(worker(1, 0)).unwrap();
    assert_eq!(store(&p, sized, None, 0..100), 0);
    assert!(map_bytes(&p, sized) < 4_000, "{}", map_bytes(&p, sized));
}

#[test]
fn an_absurd_capacity_is_bounded() {
    let p = partition();
    let r = RankId::new(7, 0);
    p.upsert_worker(worker(7, u64::MAX)).unwrap();
    assert_eq!(store(&p, r, None, 0..4), 0);
    let bytes = map_bytes(&p, r);
    assert!(bytes >= MAX_RESERVED_BLOCKS * SLOT, "{bytes}");
    assert!(bytes <= MAX_RESERVED_BLOCKS * SLOT * 3 / 2, "{bytes}");
}
