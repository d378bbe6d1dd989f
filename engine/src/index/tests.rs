//! Unit tests of the index's event semantics (the differential test covers random mixes).

use super::*;
use crate::ids::Tier;

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
    // R0's one block keeps the run R1 stored (3 blocks) until R0 lets it go too.
    assert_eq!((s.holder_blocks, s.nodes), (1, 3));
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

#[test]
fn many_holders_share_one_run_each_with_its_cover() {
    let idx = Index::new();
    let n: u64 = if cfg!(miri) { 12 } else { 64 };
    let ranks: Vec<RankId> = (0..n).map(|w| RankId::new(w, 0)).collect();
    for (i, &r) in ranks.iter().enumerate() {
        // Rank i holds the first i + 1 blocks of one 64-block chain.
        idx.store(r, Tier::Device, None, &blocks(0..i as u64 + 1))
            .unwrap();
    }
    assert_eq!(idx.run_counts().0, 1, "one run, a cover per rank");
    let m = idx.find_matches(&locals(0..n));
    assert_eq!(m.len(), n as usize);
    for (i, &r) in ranks.iter().enumerate() {
        assert_eq!(m.get(r), i as u32 + 1);
    }
    for &r in &ranks {
        idx.clear(r);
    }
    assert_eq!(idx.run_counts().0, 0);
}

fn rank(w: u64) -> RankId {
    RankId::new(w, 0)
}

fn salted(locals: &[u64], salt: u64) -> Vec<StoredBlock> {
    locals
        .iter()
        .map(|&l| StoredBlock {
            external_hash: l ^ salt,
            local_hash: l,
        })
        .collect()
}

#[test]
fn store_lookup_branch_and_remove() {
    let idx = Index::new();
    let a: Vec<u64> = (1..=10).collect();
    idx.store(rank(1), Tier::Device, None, &salted(&a, 0))
        .unwrap();
    assert_eq!(idx.find_matches(&a).as_slice(), &[(rank(1), 10)]);
    assert_eq!(idx.find_matches(&a[..4]).as_slice(), &[(rank(1), 4)]);
    // Rank 2 shares 5 blocks, then diverges: a child at offset 5.
    let mut b = a[..5].to_vec();
    b.extend([100, 101, 102]);
    idx.store(rank(2), Tier::Device, None, &salted(&b, 7))
        .unwrap();
    assert_eq!(
        idx.find_matches(&b).as_slice(),
        &[(rank(1), 5), (rank(2), 8)]
    );
    assert_eq!(
        idx.find_matches(&a).as_slice(),
        &[(rank(1), 10), (rank(2), 5)]
    );
    // A hole in rank 1's chain cuts its score there.
    let out = idx.remove(rank(1), Tier::Device, &[3]);
    assert_eq!(out.removed, 1);
    assert_eq!(
        idx.find_matches(&a).as_slice(),
        &[(rank(1), 2), (rank(2), 5)]
    );
    // Re-storing the hole heals it.
    idx.store(rank(1), Tier::Device, Some(2), &salted(&[3], 0))
        .unwrap();
    assert_eq!(
        idx.find_matches(&a).as_slice(),
        &[(rank(1), 10), (rank(2), 5)]
    );
    // Everything gone: every run retired.
    idx.clear(rank(1));
    idx.clear(rank(2));
    assert!(idx.find_matches(&a).is_empty());
    assert_eq!(idx.run_counts().0, 0);
    assert_eq!(idx.stats().holder_blocks, 0);
}

#[test]
fn appends_extend_a_run_and_tiers_compose() {
    let idx = Index::new();
    idx.store(rank(1), Tier::Device, None, &salted(&[1, 2], 0))
        .unwrap();
    idx.store(rank(1), Tier::Device, Some(2), &salted(&[3, 4], 0))
        .unwrap();
    assert_eq!(
        idx.run_counts().0,
        1,
        "the store at the end extends the run"
    );
    idx.store(rank(1), Tier::Host, Some(4), &salted(&[5, 6], 0))
        .unwrap();
    let t = idx.find_matches_tiered(&[1, 2, 3, 4, 5, 6, 7]);
    let e = t.get(rank(1)).unwrap();
    assert_eq!((e.device, e.host, e.disk), (4, 2, 0));
    assert_eq!(idx.find_matches(&[1, 2, 3, 4, 5, 6]).get(rank(1)), 4);
}

/// A reader thread walks chains while a writer grows them (array growth), branches off
/// them and removes them (runs retired): under Miri, for data races and use-after-free.
#[test]
fn a_reader_races_a_writer_that_grows_branches_and_retires_runs() {
    let idx = crate::sync::StdArc::new(Index::new());
    let rounds = if cfg!(miri) { 6 } else { 300 };
    let chain: Vec<u64> = (1..=24).collect();
    let reader = {
        let idx = idx.clone();
        let chain = chain.clone();
        std::thread::spawn(move || {
            let mut out = crate::index::OverlapScores::new();
            for _ in 0..rounds * 4 {
                idx.find_matches_into(&chain, &mut out);
                for (_, n) in out.iter() {
                    assert!(n as usize <= chain.len());
                }
                let _ = idx.find_matches_tiered(&chain[..7]);
            }
        })
    };
    for r in 0..rounds {
        let salt = r as u64 * 1_000;
        // Grow one block at a time (appends past the array's capacity).
        idx.store(rank(1), Tier::Device, None, &salted(&chain[..1], salt))
            .unwrap();
        for i in 1..chain.len() {
            idx.store(
                rank(1),
                Tier::Device,
                Some(chain[i - 1] ^ salt),
                &salted(&chain[i..=i], salt),
            )
            .unwrap();
        }
        // Another rank branches off half-way, then everything goes.
        let mut b = chain[..12].to_vec();
        b.push(999);
        idx.store(rank(2), Tier::Host, None, &salted(&b, salt + 1))
            .unwrap();
        idx.clear(rank(2));
        let all: Vec<u64> = chain.iter().map(|l| l ^ salt).collect();
        assert_eq!(idx.remove(rank(1), Tier::Device, &all).removed, chain.len());
    }
    reader.join().unwrap();
    assert_eq!(idx.run_counts().0, 0);
}

/// A reserved rank map is sized once: storing up to the reservation, evicting, and a
/// clear leave its bytes as they were; the reservation is bounded; answers are unchanged.
#[test]
fn reserved_rank_map_keeps_its_size() {
    let idx = Index::new();
    let plain = Index::new();
    let slots = |idx: &Index, r: RankId, t: Tier| {
        idx.ranks.get(r).unwrap().writer.lock().blocks[t as usize].capacity()
    };
    idx.reserve_blocks(R0, Tier::Device, 5_000).unwrap();
    let reserved = slots(&idx, R0, Tier::Device);
    assert!(reserved >= 5_000, "{reserved}");
    for i in 0..50u64 {
        let (b, parent) = (blocks(i * 100..i * 100 + 100), None);
        idx.store(R0, Tier::Device, parent, &b).unwrap();
        plain.store(R0, Tier::Device, parent, &b).unwrap();
        assert_eq!(slots(&idx, R0, Tier::Device), reserved, "grew at {i}");
    }
    let q = locals(700..800);
    assert_eq!(idx.find_matches(&q).get(R0), 100);
    assert_eq!(plain.find_matches(&q).get(R0), 100);
    let gone: Vec<u64> = (0..4_900).collect();
    assert_eq!(idx.remove(R0, Tier::Device, &gone).removed, 4_900);
    assert_eq!(slots(&idx, R0, Tier::Device), reserved);
    assert_eq!(idx.find_matches(&locals(4_900..5_000)).get(R0), 100);
    idx.clear(R0);
    assert_eq!(slots(&idx, R0, Tier::Device), reserved);
    assert_eq!(idx.rank_stats(R0).unwrap().holder_blocks, 0);
    // An absurd capacity is cut to MAX_RESERVED_BLOCKS.
    idx.reserve_blocks(R1, Tier::Host, u64::MAX).unwrap();
    let big = slots(&idx, R1, Tier::Host) as u64;
    assert!(big <= MAX_RESERVED_BLOCKS * 13 / 10, "{big}");
}

/// Sizing ahead is bounded per index as well as per rank: a worker of many ranks at the
/// per-rank bound takes the index's budget and no more, and its removal gives it back.
#[test]
fn reservations_are_bounded_per_index() {
    let idx = Index::new();
    let dp = (MAX_RESERVED_BLOCKS_PER_INDEX / MAX_RESERVED_BLOCKS) as u32 + 4;
    for d in 0..dp {
        idx.reserve_blocks(RankId::new(9, d), Tier::Device, u64::MAX)
            .unwrap();
    }
    assert_eq!(idx.reserved_blocks(), MAX_RESERVED_BLOCKS_PER_INDEX);
    let last = idx.ranks.get(RankId::new(9, dp - 1)).unwrap();
    assert_eq!(
        last.writer.lock().reserved,
        0,
        "past the budget: nothing ahead"
    );
    drop(last);
    // A rank with a registered capacity past the budget grows as it fills, but its last
    // growth step stops at the size a reservation of that capacity has, not past it.
    let reserved = Index::new();
    reserved
        .reserve_blocks(RankId::new(10, 0), Tier::Device, 20_000)
        .unwrap();
    idx.set_worker_capacity(10, 20_000);
    let late = RankId::new(10, 0);
    for i in 0..200u64 {
        let b = blocks(i * 100..i * 100 + 100);
        idx.store(late, Tier::Device, None, &b).unwrap();
        reserved.store(late, Tier::Device, None, &b).unwrap();
    }
    let slots = |idx: &Index| {
        let e = idx.ranks.get(late).unwrap();
        let w = e.writer.lock();
        (w.reserved, w.blocks[Tier::Device as usize].capacity())
    };
    let ((late_reserved, grown), (_, sized)) = (slots(&idx), slots(&reserved));
    assert_eq!(late_reserved, 0, "past the budget: nothing ahead");
    assert_eq!(grown, sized, "grown to the capacity's size, no further");
    let q = locals(19_900..20_000);
    assert_eq!(idx.find_matches(&q).get(late), 100);
    idx.remove_worker(9);
    idx.remove_worker(10);
    assert_eq!(idx.reserved_blocks(), 0, "given back");
}

/// A rank holds blocks of at most so many runs at once (`place`): a store that would need
/// one more leaves those blocks unindexed and counted, nothing else changes; once the rank
/// holds one run fewer its index is reused, and every place still names its own block.
#[test]
fn held_run_limit_refuses_and_reuses() {
    let idx = Index::new();
    idx.store(R0, Tier::Device, None, &blocks(0..3)).unwrap();
    idx.ranks.get(R0).unwrap().writer.lock().runs.test_limit = Some(2);
    let held = |idx: &Index| idx.ranks.get(R0).unwrap().writer.lock().runs.held();
    idx.store(R0, Tier::Device, None, &blocks(10..13)).unwrap();
    assert_eq!(held(&idx), 2);
    // A third chain (its own run): refused, counted.
    assert_eq!(idx.store(R0, Tier::Device, None, &blocks(20..24)), Ok(0));
    assert_eq!(idx.held_run_limit_hits(), 4);
    assert_eq!(idx.find_matches(&locals(20..24)).get(R0), 0);
    assert_eq!(idx.remove(R0, Tier::Device, &[20]).not_found, 1);
    // Extending a held run needs no new index.
    idx.store(R0, Tier::Device, Some(2), &blocks(3..5)).unwrap();
    assert_eq!(idx.find_matches(&locals(0..5)).get(R0), 5);
    assert_eq!(idx.find_matches(&locals(10..13)).get(R0), 3);
    assert_eq!(idx.rank_stats(R0).unwrap().holder_blocks, 8);
    // The second chain goes: its index is given back and taken by the third.
    assert_eq!(idx.remove(R0, Tier::Device, &[10, 11, 12]).removed, 3);
    assert_eq!(held(&idx), 1);
    assert_eq!(idx.store(R0, Tier::Device, None, &blocks(20..24)), Ok(4));
    assert_eq!(held(&idx), 2);
    assert_eq!(idx.find_matches(&locals(20..24)).get(R0), 4);
    assert_eq!(idx.find_matches(&locals(10..13)).get(R0), 0);
    // Names resolve to their own blocks after the reuse: a parent in the third chain, and
    // removals in both.
    idx.store(R0, Tier::Device, Some(23), &blocks(24..26))
        .unwrap();
    assert_eq!(idx.find_matches(&locals(20..26)).get(R0), 6);
    assert_eq!(idx.remove(R0, Tier::Device, &[22, 1]).removed, 2);
    assert_eq!(idx.find_matches(&locals(20..26)).get(R0), 2);
    assert_eq!(idx.find_matches(&locals(0..5)).get(R0), 1);
    assert_eq!(idx.held_run_limit_hits(), 4);
    idx.clear(R0);
    assert_eq!(held(&idx), 0);
}

/// Stores `d`'s runs, then removes its holes: what a restart does with a snapshot.
fn replay_dump(d: &IndexDump) -> Index {
    let idx = Index::new();
    for s in &d.stores {
        idx.store(s.rank, s.tier, s.parent, &s.blocks).unwrap();
    }
    for (rank, e) in &d.holes {
        idx.remove(*rank, Tier::Device, &[*e]);
    }
    idx
}

#[test]
fn a_dump_with_holes_keeps_the_blocks_under_a_removed_parent() {
    let idx = Index::new();
    // R0: a chain 0..6 and a branch off block 2; block 1 is removed (a hole under which
    // 2..6 and the branch stay held), R1 holds 0..3 whole.
    idx.store(R0, Tier::Device, None, &blocks(0..6)).unwrap();
    idx.store(R0, Tier::Device, Some(2), &blocks(10..12))
        .unwrap();
    idx.store(R1, Tier::Device, None, &blocks(0..3)).unwrap();
    idx.remove(R0, Tier::Device, &[1]);
    let plain = idx.dump();
    let d = idx.dump_with_holes();
    assert!(plain.holes.is_empty());
    assert_eq!(
        plain.skipped_blocks, 6,
        "2..6 and the branch have no parent"
    );
    assert_eq!((d.skipped_blocks, d.holes.len()), (0, 1));
    assert_eq!(d.holes[0].0, R0);
    let back = replay_dump(&d);
    // Nothing more is held: the hole is gone again, the prefix stops at block 0.
    for q in [locals(0..6), locals(0..3)] {
        assert_eq!(back.find_matches(&q).get(R0), idx.find_matches(&q).get(R0));
        assert_eq!(back.find_matches(&q).get(R1), idx.find_matches(&q).get(R1));
    }
    assert_eq!(back.stats().holder_blocks, idx.stats().holder_blocks);
    // The engine stores block 1 again: the blocks under it count again, in both.
    for i in [&idx, &back] {
        i.store(R0, Tier::Device, Some(0), &blocks(1..2)).unwrap();
    }
    let mut branch = locals(0..3);
    branch.extend(locals(10..12));
    for q in [locals(0..6), branch] {
        assert_eq!(idx.find_matches(&q).get(R0), q.len() as u32);
        assert_eq!(back.find_matches(&q).get(R0), q.len() as u32);
    }
    // Without the holes (a peer's dump), the blocks under it are gone for good.
    let peer = replay_dump(&plain);
    peer.store(R0, Tier::Device, Some(0), &blocks(1..2))
        .unwrap();
    assert_eq!(peer.find_matches(&locals(0..6)).get(R0), 2);
}
