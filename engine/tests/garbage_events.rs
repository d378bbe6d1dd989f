//! The wire cannot create state (issue 20): 1,000,000 events that must be refused leave
//! only their counters — no rank entry, no memory — and a legitimate rank is still
//! admitted afterwards.
//!
//! Two kinds, half each: stores chained to a parent nobody stored, each on a rank never
//! seen (`Partition::apply_events`, as a host with its own transport feeds kvr); and
//! engine batches of a registered dp-size-1 worker naming DP ranks it does not have
//! (`Partition::ingest`, the payload's `data_parallel_rank`). Before the fix, 30,000 of
//! the first kind made 30,000 ranks (+159 MB) and 40,000 of the second 40,000 ranks.

use kvr::config::PartitionConfig;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::ingress::Medium;
use kvr::{KvEvent, RankId, StoredBlock, Tier, WorkerInfo};
use kvr::{Partition, PartitionKey};
use kvr_emulator::BatchEncoder;

const BS: u32 = 4;
const EVENTS: u64 = 1_000_000;
const PER_BATCH: u64 = 10;

/// Resident set size in bytes (Linux), or `None` elsewhere.
fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn stored_payload(enc: &mut BatchEncoder, dp: Option<u32>, n: u64, seed: u64) -> Vec<u8> {
    let tokens: Vec<u32> = (0..BS).collect();
    for i in 0..n {
        enc.stored(&[seed * 100 + i], None, &tokens, BS, Medium::Gpu, None);
    }
    enc.finish(1.0, dp)
}

#[test]
fn a_million_refused_events_leave_no_rank_and_no_memory() {
    let p = Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(BS));
    p.upsert_worker(WorkerInfo::new(1, 1)).unwrap();
    let tokens: Vec<u32> = (0..BS).collect();
    let hasher = BlockHasher::new(BS as usize, HashSalt::new(None, None)).unwrap();
    let mut local = Vec::new();
    hasher.local_hashes(&tokens, &mut local);
    let block = [StoredBlock {
        external_hash: 7,
        local_hash: local[0],
    }];

    // Warm up the paths (first-use allocations are not growth), then measure.
    let mut enc = BatchEncoder::new();
    let warm = stored_payload(&mut enc, Some(5), PER_BATCH, 0);
    p.ingest(1, 0, b"", 0, &warm);
    let _ = p.apply_events(
        RankId::new(1_000_000, 0),
        [KvEvent::Stored {
            tier: Tier::Device,
            parent: Some(1),
            blocks: &block,
        }],
    );
    let ranks_before = p.index().ranks().len();
    let rss_before = rss_bytes();

    let half = EVENTS / 2;
    let mut refused_by_index = 0;
    for i in 0..half {
        // A new rank each time (a hostile or confused publisher inventing ids).
        let rank = RankId::new(2 + (i % 50_000), (i / 50_000) as u32);
        let o = p.apply_events(
            rank,
            [KvEvent::Stored {
                tier: Tier::Device,
                parent: Some(0xdead_0000 + i),
                blocks: &block,
            }],
        );
        refused_by_index += o.rejected;
    }
    let mut seq = 1;
    for b in 0..half / PER_BATCH {
        // DP ranks 1.. of a dp-size-1 worker, up to u32::MAX.
        let dp = 1 + (b as u32).wrapping_mul(2_654_435_761) % (u32::MAX - 1);
        let msg = stored_payload(&mut enc, Some(dp), PER_BATCH, b);
        let o = p.ingest(1, 0, b"", seq, &msg);
        assert_eq!(o.decode_errors, 0);
        seq += 1;
    }

    assert_eq!(
        refused_by_index, half,
        "every unknown-parent store is refused"
    );
    assert_eq!(
        p.index().ranks().len(),
        ranks_before,
        "refused events created ranks"
    );
    let s = p
        .ingress_stats()
        .into_iter()
        .find(|s| s.worker_id == 1)
        .unwrap();
    assert_eq!(s.dp_rank_refused, half / PER_BATCH + 1, "{s:?}");
    assert_eq!(s.events_rejected, half + PER_BATCH, "{s:?}");
    assert_eq!(s.blocks_stored, 0, "{s:?}");
    let ix = p.index().stats();
    // Past the pending-rank budget the partition refuses a made-up worker's rank before
    // the index sees it; within it the index refuses the unknown parents.
    let refused_first = p.indexer_stats().ingress_refused;
    // (The warm-up's made-up rank took one place of the budget.)
    let budget = kvr::ingress::MAX_PENDING_RANKS as u64 - 1;
    assert_eq!(refused_first, half - budget);
    assert!(ix.parent_not_found + refused_first > half, "{ix:?}");
    assert_eq!(ix.holder_blocks, 0, "{ix:?}");
    if let (Some(a), Some(b)) = (rss_before, rss_bytes()) {
        let grown = b.saturating_sub(a);
        assert!(
            grown < 16 << 20,
            "RSS grew {grown} bytes over {EVENTS} refused events"
        );
    }

    // The worker's own rank is still admitted, through both paths.
    let msg = stored_payload(&mut enc, Some(0), 1, 9);
    let o = p.ingest(1, 0, b"", seq, &msg);
    assert_eq!(o.batches_applied, 1);
    assert_eq!(p.index().find_matches(&local).get(RankId::new(1, 0)), 1);
    let o = p.apply_events(
        RankId::new(3, 0),
        [KvEvent::Stored {
            tier: Tier::Device,
            parent: None,
            blocks: &block,
        }],
    );
    assert_eq!((o.applied, o.blocks_stored), (1, 1));
    assert_eq!(p.index().ranks().len(), ranks_before + 2);
}

#[test]
fn a_registered_workers_dp_ranks_are_admitted_and_others_refused() {
    let p = Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(BS));
    let mut w = WorkerInfo::new(4, 2);
    w.dp_start = 2;
    p.upsert_worker(w).unwrap();
    let mut enc = BatchEncoder::new();
    for (seq, dp) in [2u32, 3, 1, 4, 0].into_iter().enumerate() {
        let msg = stored_payload(&mut enc, Some(dp), 1, u64::from(dp));
        p.ingest(4, 0, b"", seq as u64, &msg);
    }
    let mut ranks = p.index().ranks();
    ranks.sort();
    assert_eq!(ranks, vec![RankId::new(4, 2), RankId::new(4, 3)]);
    let s = p.ingress_stats().into_iter().next().unwrap();
    assert_eq!((s.dp_rank_refused, s.blocks_stored), (3, 2));
    // A worker not registered yet may use ranks below MAX_DP_SIZE, not beyond.
    let max = kvr::MAX_DP_SIZE;
    for (seq, dp) in [max - 1, max].into_iter().enumerate() {
        let msg = stored_payload(&mut enc, Some(dp), 1, 50 + u64::from(dp));
        p.ingest(5, 0, b"", seq as u64, &msg);
    }
    assert!(p.index().ranks().contains(&RankId::new(5, max - 1)));
    assert!(!p.index().ranks().contains(&RankId::new(5, max)));
}

#[test]
fn load_reports_of_made_up_ranks_are_not_kept() {
    let p = Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(BS));
    p.upsert_worker(WorkerInfo::new(1, 2)).unwrap();
    let load = kvr::RankLoad {
        kv_blocks_used: 1,
        ..Default::default()
    };
    let mut batch = vec![(RankId::new(1, 0), load), (RankId::new(1, 1), load)];
    assert_eq!(p.publish_load(&batch).1, 0);
    for i in 0..10_000u64 {
        batch.push((RankId::new(1_000 + i, 0), load));
        batch.push((RankId::new(1, 2 + i as u32), load));
    }
    assert_eq!(p.publish_load(&batch).1, 20_000);
    assert_eq!(
        p.load_view().snapshot().len(),
        2,
        "only the worker's own ranks"
    );
}
