use super::*;
use crate::index::event::{StoredBlock, Tier};

fn rank(w: u64) -> RankId {
    RankId::new(w, 0)
}

fn blocks(locals: &[u64], salt: u64) -> Vec<StoredBlock> {
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
    let idx = RunIndex::new();
    let a: Vec<u64> = (1..=10).collect();
    idx.store(rank(1), Tier::Device, None, &blocks(&a, 0))
        .unwrap();
    assert_eq!(idx.find_matches(&a).as_slice(), &[(rank(1), 10)]);
    assert_eq!(idx.find_matches(&a[..4]).as_slice(), &[(rank(1), 4)]);
    // Rank 2 shares 5 blocks, then diverges: a child at offset 5.
    let mut b = a[..5].to_vec();
    b.extend([100, 101, 102]);
    idx.store(rank(2), Tier::Device, None, &blocks(&b, 7))
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
    idx.store(rank(1), Tier::Device, Some(2), &blocks(&[3], 0))
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
    let idx = RunIndex::new();
    idx.store(rank(1), Tier::Device, None, &blocks(&[1, 2], 0))
        .unwrap();
    idx.store(rank(1), Tier::Device, Some(2), &blocks(&[3, 4], 0))
        .unwrap();
    assert_eq!(
        idx.run_counts().0,
        1,
        "the store at the end extends the run"
    );
    idx.store(rank(1), Tier::Host, Some(4), &blocks(&[5, 6], 0))
        .unwrap();
    let t = idx.find_matches_tiered(&[1, 2, 3, 4, 5, 6, 7]);
    let e = t.get(rank(1)).unwrap();
    assert_eq!((e.device, e.host, e.disk), (4, 2, 0));
    assert_eq!(idx.find_matches(&[1, 2, 3, 4, 5, 6]).get(rank(1)), 4);
}

/// A reader thread walks chains while a writer grows them (array growth), branches off
/// them and removes them (runs retired): under Miri, for data races and use-after-free.
#[test]
fn a_reader_races_a_churning_writer() {
    let idx = crate::sync::StdArc::new(RunIndex::new());
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
        idx.store(rank(1), Tier::Device, None, &blocks(&chain[..1], salt))
            .unwrap();
        for i in 1..chain.len() {
            idx.store(
                rank(1),
                Tier::Device,
                Some(chain[i - 1] ^ salt),
                &blocks(&chain[i..=i], salt),
            )
            .unwrap();
        }
        // Another rank branches off half-way, then everything goes.
        let mut b = chain[..12].to_vec();
        b.push(999);
        idx.store(rank(2), Tier::Host, None, &blocks(&b, salt + 1))
            .unwrap();
        idx.clear(rank(2));
        let all: Vec<u64> = chain.iter().map(|l| l ^ salt).collect();
        assert_eq!(idx.remove(rank(1), Tier::Device, &all).removed, chain.len());
    }
    reader.join().unwrap();
    assert_eq!(idx.run_counts().0, 0);
}
