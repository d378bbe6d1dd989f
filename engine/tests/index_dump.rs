//! `Index::dump` against a naive model: an index rebuilt from another's dump answers every
//! lookup exactly as the original does (differential over random workloads with stores on
//! three tiers, branches, removals that leave holes, clears), never more; an index without
//! lineage dumps nothing and says how many blocks it left out.

use kvr::{Index, KvEvent, RankId, StoredBlock, Tier};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A prompt family: prompt `p` is blocks [p*1000 .. p*1000+len); prompts share a prefix of
/// `shared` blocks with prompt 0 so chains branch.
fn locals(prompt: u64, len: usize, shared: usize) -> Vec<u64> {
    (0..len as u64)
        .map(|i| {
            if (i as usize) < shared {
                1 + i
            } else {
                1 + prompt * 1000 + i
            }
        })
        .collect()
}

fn external(rank: RankId, local: &[u64], i: usize) -> u64 {
    // An engine hash per (rank, prefix): any injective-enough function works.
    let mut h =
        0xcbf2_9ce4_8422_2325u64 ^ rank.worker_id.wrapping_mul(31) ^ u64::from(rank.dp_rank);
    for &l in &local[..=i] {
        h = (h ^ l).wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn apply_dump(src: &Index) -> (Index, u64) {
    let dump = src.dump();
    let dst = Index::new().with_lineage(true);
    for s in &dump.stores {
        dst.apply(
            s.rank,
            &KvEvent::Stored {
                tier: s.tier,
                parent: s.parent,
                blocks: &s.blocks,
            },
        )
        .expect("a dump's events apply in order");
    }
    (dst, dump.skipped_blocks)
}

#[test]
fn a_rebuilt_index_answers_as_the_original() {
    for seed in 1..=40u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let index = Index::new().with_lineage(true);
        let ranks = [
            RankId::new(1, 0),
            RankId::new(2, 0),
            RankId::new(2, 1),
            RankId::new(9, 3),
        ];
        let mut prompts = Vec::new();
        for step in 0..60 {
            let rank = ranks[rng.below(ranks.len() as u64) as usize];
            let prompt = rng.below(6);
            let len = 1 + rng.below(8) as usize;
            let l = locals(prompt, len, rng.below(4) as usize);
            let tier = Tier::ALL[rng.below(3) as usize];
            match rng.below(10) {
                0 if step > 5 => {
                    index.apply(rank, &KvEvent::Cleared).unwrap();
                }
                1..=2 => {
                    // Remove one block somewhere in the chain (may leave a hole).
                    let i = rng.below(len as u64) as usize;
                    let e = external(rank, &l, i);
                    let _ = index.apply(
                        rank,
                        &KvEvent::Removed {
                            tier,
                            external_hashes: &[e],
                        },
                    );
                }
                _ => {
                    // Store the chain from a random split: the head (if any) first.
                    let split = rng.below(len as u64) as usize;
                    let blocks: Vec<StoredBlock> = (0..len)
                        .map(|i| StoredBlock {
                            external_hash: external(rank, &l, i),
                            local_hash: l[i],
                        })
                        .collect();
                    if split > 0 {
                        let _ = index.apply(
                            rank,
                            &KvEvent::Stored {
                                tier,
                                parent: None,
                                blocks: &blocks[..split],
                            },
                        );
                        let parent = Some(blocks[split - 1].external_hash);
                        let _ = index.apply(
                            rank,
                            &KvEvent::Stored {
                                tier,
                                parent,
                                blocks: &blocks[split..],
                            },
                        );
                    } else {
                        let _ = index.apply(
                            rank,
                            &KvEvent::Stored {
                                tier,
                                parent: None,
                                blocks: &blocks,
                            },
                        );
                    }
                }
            }
            prompts.push(l);
        }
        let (rebuilt, skipped) = apply_dump(&index);
        for p in &prompts {
            let a = index.find_matches_tiered(p);
            let b = rebuilt.find_matches_tiered(p);
            for o in b.iter() {
                let (dev, all) = a
                    .get(o.rank)
                    .map_or((0, 0), |x| (x.device, x.device + x.host + x.disk));
                assert!(
                    o.device <= dev && o.device + o.host + o.disk <= all,
                    "seed {seed}: the rebuilt index overcounts {o:?} (original {dev}/{all})"
                );
            }
            if skipped == 0 {
                assert_eq!(a, b, "seed {seed}: prompt {p:?}");
            }
        }
        // Everything held is either rebuilt or counted as left out.
        assert_eq!(
            rebuilt.stats().holder_blocks + skipped,
            index.stats().holder_blocks,
            "seed {seed}"
        );
        // Dumping the rebuilt index gives the same events (a fixed point).
        assert_eq!(
            rebuilt.dump(),
            {
                let mut d = index.dump();
                d.skipped_blocks = 0;
                d
            },
            "seed {seed}"
        );
    }
}

#[test]
fn chains_become_one_event_and_other_tiers_name_their_parent() {
    let index = Index::new().with_lineage(true);
    let r = RankId::new(1, 0);
    let b = |e, l| StoredBlock {
        external_hash: e,
        local_hash: l,
    };
    index
        .apply(
            r,
            &KvEvent::Stored {
                tier: Tier::Device,
                parent: None,
                blocks: &[b(10, 1), b(11, 2)],
            },
        )
        .unwrap();
    index
        .apply(
            r,
            &KvEvent::Stored {
                tier: Tier::Device,
                parent: Some(11),
                blocks: &[b(12, 3)],
            },
        )
        .unwrap();
    index
        .apply(
            r,
            &KvEvent::Stored {
                tier: Tier::Host,
                parent: Some(12),
                blocks: &[b(13, 4)],
            },
        )
        .unwrap();
    let d = index.dump();
    assert_eq!(d.skipped_blocks, 0);
    assert_eq!(d.stores.len(), 2, "{d:?}");
    assert_eq!(d.stores[0].tier, Tier::Device);
    assert_eq!(d.stores[0].parent, None);
    assert_eq!(d.stores[0].blocks, vec![b(10, 1), b(11, 2), b(12, 3)]);
    assert_eq!(d.stores[1].tier, Tier::Host);
    assert_eq!(d.stores[1].parent, Some(12));
    // A hole: removing block 11 cuts 12 off from the root on the device tier.
    index
        .apply(
            r,
            &KvEvent::Removed {
                tier: Tier::Device,
                external_hashes: &[11],
            },
        )
        .unwrap();
    let d = index.dump();
    let blocks: usize = d.stores.iter().map(|s| s.blocks.len()).sum();
    assert_eq!(blocks, 1, "only block 10 can be written out: {d:?}");
    assert_eq!(
        d.skipped_blocks, 2,
        "12 (device) and 13 (host, parent 12 still named but 11 gone)"
    );
}

#[test]
fn every_event_fed_index_dumps_without_asking_for_lineage() {
    let index = Index::new();
    let r = RankId::new(1, 0);
    let blocks = [StoredBlock {
        external_hash: 5,
        local_hash: 6,
    }];
    index
        .apply(
            r,
            &KvEvent::Stored {
                tier: Tier::Device,
                parent: None,
                blocks: &blocks,
            },
        )
        .unwrap();
    let d = index.dump();
    assert_eq!(d.stores.len(), 1);
    assert_eq!(d.stores[0].blocks, blocks.to_vec());
    assert_eq!(d.skipped_blocks, 0);
}

#[test]
fn an_index_fed_by_bookings_dumps_nothing_and_counts_all() {
    // Keyed by sequence hashes: there are no local hashes to write out.
    let index = Index::new();
    let r = RankId::new(1, 0);
    index.store_sequences(r, Tier::Device, &[7, 8]).unwrap();
    assert!(!index.keeps_lineage());
    let d = index.dump();
    assert!(d.stores.is_empty());
    assert_eq!(d.skipped_blocks, 2);
}
