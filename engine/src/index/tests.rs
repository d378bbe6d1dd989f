//! Unit tests of the index's event semantics (the differential test covers random mixes).

use super::*;

const R0: RankId = RankId::new(1, 0);
const R1: RankId = RankId::new(2, 0);
const R2: RankId = RankId::new(2, 1);

fn blocks(ext: std::ops::Range<u64>) -> Vec<StoredBlock> {
    ext.map(|e| StoredBlock {
        external_hash: e,
        local_hash: e * 1000 + 7,
    })
    .collect()
}

fn locals(ext: std::ops::Range<u64>) -> Vec<u64> {
    ext.map(|e| e * 1000 + 7).collect()
}

#[test]
fn overlap_is_the_contiguous_prefix() {
    let idx = Index::new();
    idx.store(R0, Tier::Device, None, &blocks(0..4)).unwrap();
    idx.store(R1, Tier::Device, None, &blocks(0..2)).unwrap();
    let m = idx.find_matches(&locals(0..6));
    assert_eq!(m.get(R0), 4);
    assert_eq!(m.get(R1), 2);
    assert_eq!(m.get(R2), 0);
    assert_eq!(m.len(), 2);
    // A different first block matches nothing.
    assert!(idx.find_matches(&locals(1..4)).is_empty());
}

#[test]
fn parent_chains_and_unknown_parent_rejects_whole_store() {
    let idx = Index::new();
    idx.store(R0, Tier::Device, None, &blocks(0..2)).unwrap();
    idx.store(R0, Tier::Device, Some(1), &blocks(2..5)).unwrap();
    assert_eq!(idx.find_matches(&locals(0..5)).get(R0), 5);
    let err = idx
        .store(R0, Tier::Device, Some(99), &blocks(5..7))
        .unwrap_err();
    assert_eq!(err, IndexError::ParentNotFound { parent: 99 });
    assert_eq!(idx.rank_stats(R0).unwrap().holder_blocks, 5);
    assert_eq!(idx.stats().parent_not_found, 1);
}

#[test]
fn mid_chain_removal_cuts_score_and_unknown_removals_count() {
    let idx = Index::new();
    idx.store(R0, Tier::Device, None, &blocks(0..6)).unwrap();
    let out = idx.remove(R0, Tier::Device, &[2, 77, 78]);
    assert_eq!((out.removed, out.not_found), (1, 2));
    assert_eq!(idx.find_matches(&locals(0..6)).get(R0), 2);
    assert_eq!(idx.stats().block_not_found, 2);
    assert_eq!(idx.rank_stats(R0).unwrap().holder_blocks, 5);
}

#[test]
fn many_holders_spill_to_heap_and_back() {
    let idx = Index::new();
    let ranks: Vec<RankId> = (0..10).map(|w| RankId::new(w, 0)).collect();
    for r in &ranks {
        idx.store(*r, Tier::Device, None, &blocks(0..3)).unwrap();
    }
    let m = idx.find_matches(&locals(0..3));
    assert_eq!(m.len(), 10);
    assert!(m.iter().all(|(_, s)| s == 3));
    assert!(idx.stats().holder_set_bytes > 0);
    for r in &ranks[..8] {
        idx.clear(*r);
    }
    let m = idx.find_matches(&locals(0..3));
    assert_eq!(m.as_slice(), &[(ranks[8], 3), (ranks[9], 3)]);
    assert_eq!(idx.stats().holder_set_bytes, 0);
}

#[test]
fn tiers_make_a_tiered_prefix() {
    let idx = Index::new();
    idx.store(R0, Tier::Device, None, &blocks(0..2)).unwrap();
    idx.store(R0, Tier::Host, Some(1), &blocks(2..4)).unwrap();
    idx.store(R0, Tier::Disk, Some(3), &blocks(4..5)).unwrap();
    let t = idx.find_matches_tiered(&locals(0..8)).get(R0).unwrap();
    assert_eq!((t.device, t.host, t.disk), (2, 2, 1));
    assert_eq!(idx.find_matches(&locals(0..8)).get(R0), 2);
    // Host-only rank: no device prefix, host from block 0.
    idx.store(R1, Tier::Host, None, &blocks(0..3)).unwrap();
    let t = idx.find_matches_tiered(&locals(0..8)).get(R1).unwrap();
    assert_eq!((t.device, t.host, t.disk), (0, 3, 0));
    assert_eq!(idx.find_matches(&locals(0..8)).get(R1), 0);
    // Removing the host copy of a block the device also has leaves the device copy.
    idx.store(R2, Tier::Device, None, &blocks(0..2)).unwrap();
    idx.store(R2, Tier::Host, None, &blocks(0..2)).unwrap();
    idx.remove(R2, Tier::Host, &[0, 1]);
    assert_eq!(idx.find_matches(&locals(0..2)).get(R2), 2);
}

#[test]
fn repeated_store_is_idempotent_and_aliases_refcount() {
    let idx = Index::new();
    assert_eq!(idx.store(R0, Tier::Device, None, &blocks(0..3)).unwrap(), 3);
    assert_eq!(idx.store(R0, Tier::Device, None, &blocks(0..3)).unwrap(), 0);
    // A second engine hash naming the same content and position.
    let alias = [StoredBlock {
        external_hash: 500,
        local_hash: 7,
    }];
    assert_eq!(idx.store(R0, Tier::Device, None, &alias).unwrap(), 0);
    idx.remove(R0, Tier::Device, &[0]);
    assert_eq!(
        idx.find_matches(&locals(0..3)).get(R0),
        3,
        "still held via 500"
    );
    idx.remove(R0, Tier::Device, &[500]);
    assert_eq!(idx.find_matches(&locals(0..3)).get(R0), 0);
}

#[test]
fn remove_worker_drops_all_its_ranks_and_slots_are_reused() {
    let idx = Index::new();
    idx.store(R1, Tier::Device, None, &blocks(0..3)).unwrap();
    idx.store(R2, Tier::Device, None, &blocks(0..3)).unwrap();
    idx.store(R0, Tier::Device, None, &blocks(0..1)).unwrap();
    assert_eq!(idx.remove_worker(2), 2);
    let m = idx.find_matches(&locals(0..3));
    assert_eq!(m.as_slice(), &[(R0, 1)]);
    assert_eq!(idx.ranks(), vec![R0]);
    let s = idx.stats();
    assert_eq!((s.holder_blocks, s.nodes), (1, 1));
    // Events for a removed worker bring it back as a new rank with only new blocks.
    idx.store(R1, Tier::Device, None, &blocks(0..1)).unwrap();
    assert_eq!(idx.find_matches(&locals(0..3)).get(R1), 1);
}

#[test]
fn clear_and_apply_dispatch() {
    let idx = Index::new();
    let b = blocks(0..4);
    let out = idx
        .apply(
            R0,
            &KvEvent::Stored {
                tier: Tier::Device,
                parent: None,
                blocks: &b,
            },
        )
        .unwrap();
    assert_eq!(out.stored, 4);
    let out = idx.apply(R0, &KvEvent::Cleared).unwrap();
    assert_eq!(out.removed, 4);
    assert!(idx.find_matches(&locals(0..4)).is_empty());
    assert_eq!(idx.stats().nodes, 0);
}

#[test]
fn memory_follows_live_blocks() {
    let idx = Index::with_config(IndexConfig {
        shards: 4,
        min_shard_capacity: 16,
    });
    for round in 0..50u64 {
        let base = round * 1000;
        let b = blocks(base..base + 500);
        idx.store(R0, Tier::Device, None, &b).unwrap();
        let ext: Vec<u64> = (base..base + 500).collect();
        idx.remove(R0, Tier::Device, &ext);
    }
    let s = idx.stats();
    assert_eq!(s.nodes, 0);
    assert!(
        s.table_bytes < 4 * 64 * 16 + 4096,
        "tables shrank back: {}",
        s.table_bytes
    );
}

#[test]
fn index_is_send_and_sync() {
    fn shared<T: Send + Sync>() {}
    shared::<Index>();
}

#[test]
fn equal_holder_sets_are_shared_and_outlive_one_nodes_change() {
    let idx = Index::new();
    let ranks: Vec<RankId> = (0..5).map(|w| RankId::new(w, 0)).collect();
    for r in &ranks {
        idx.store(*r, Tier::Device, None, &blocks(0..64)).unwrap();
    }
    // 64 nodes, one interned set of five holders.
    let one_set = idx.stats().holder_set_bytes;
    assert!(
        one_set > 0 && one_set < 64,
        "one set, not 64: {one_set} bytes"
    );
    // One node changes (rank 0 evicts block 10): the other 63 keep the shared set.
    idx.remove(ranks[0], Tier::Device, &[10]);
    let m = idx.find_matches(&locals(0..64));
    assert_eq!(m.get(ranks[0]), 10);
    for r in &ranks[1..] {
        assert_eq!(m.get(*r), 64);
    }
    // Two distinct sets now: {0..4} and {1..4}.
    assert!(idx.stats().holder_set_bytes > one_set);
    for r in &ranks {
        idx.clear(*r);
    }
    assert_eq!(idx.stats().holder_set_bytes, 0);
}

/// Small enough for Miri (tests/miri.sh), which checks it for data races and
/// use-after-free: a reader walks a chain while a writer adds and drops four more holders
/// under it (the word goes inline → heap → inline; heap sets and rebuilt tables are
/// retired through the epoch; removed ranks' slots come back through it).
#[test]
fn a_reader_races_a_churning_writer() {
    let idx = crate::sync::StdArc::new(Index::with_config(IndexConfig {
        shards: 2,
        min_shard_capacity: 8,
    }));
    idx.store(R1, Tier::Device, None, &blocks(0..8)).unwrap();
    let churn = (10..14u64).map(|w| RankId::new(w, 0)).collect::<Vec<_>>();
    let writer = {
        let (idx, churn) = (idx.clone(), churn.clone());
        std::thread::spawn(move || {
            for round in 0..12u64 {
                for &r in &churn {
                    idx.store(r, Tier::Device, None, &blocks(0..8)).unwrap();
                }
                for &r in &churn {
                    if round % 2 == 0 {
                        idx.clear(r);
                    } else {
                        idx.remove_rank(r);
                    }
                }
            }
        })
    };
    for _ in 0..12 {
        let m = idx.find_matches(&locals(0..8));
        assert_eq!(m.get(R1), 8, "the steady holder is always seen whole");
        assert!(m
            .iter()
            .all(|(r, s)| (r == R1 || churn.contains(&r)) && s <= 8));
    }
    writer.join().unwrap();
    assert_eq!(idx.find_matches(&locals(0..8)).as_slice(), &[(R1, 8)]);
}
