//! Raw engine messages through `Partition::ingest`: decoded, hashed from their tokens,
//! applied to the rank they name, sequence-checked, counted.

use kvr::config::PartitionConfig;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::ingress::Medium;
use kvr::stats::StreamStats;
use kvr::RankId;
use kvr::{Partition, PartitionKey};
use kvr_emulator::BatchEncoder;

const BS: u32 = 4;

fn partition() -> Partition {
    Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(BS))
}

/// A vLLM 0.33-style batch (tagged-map events), through kvr's own encoder.
struct Batch(BatchEncoder);

impl Batch {
    fn new() -> Self {
        Batch(BatchEncoder::new())
    }

    fn stored(mut self, hashes: &[u64], parent: Option<u64>, tokens: &[u32], medium: &str) -> Self {
        let m = if medium == "CPU" {
            Medium::Cpu
        } else {
            Medium::Gpu
        };
        self.0.stored(hashes, parent, tokens, BS, m, None);
        self
    }

    fn removed(mut self, hashes: &[u64]) -> Self {
        self.0.removed(hashes, Medium::Gpu);
        self
    }

    fn finish(mut self, dp_rank: Option<u32>) -> Vec<u8> {
        self.0.finish(1.0, dp_rank)
    }
}

fn device_overlap(p: &Partition, tokens: &[u32], rank: RankId) -> u32 {
    let h = BlockHasher::new(BS as usize, HashSalt::new(None, None)).unwrap();
    let mut local = Vec::new();
    h.local_hashes(tokens, &mut local);
    p.index().find_matches(&local).get(rank)
}

fn stats_of(p: &Partition, worker: u64) -> StreamStats {
    p.ingress_stats()
        .into_iter()
        .find(|s| s.worker_id == worker)
        .expect("a stream for the worker")
}

#[test]
fn a_stored_batch_lands_on_the_rank_it_names_hashed_from_its_tokens() {
    let p = partition();
    let tokens: Vec<u32> = (0..12).collect();
    let msg = Batch::new()
        .stored(&[11, 12, 13], None, &tokens, "GPU")
        .finish(Some(1));
    let o = p.ingest(7, 0, b"", 0, &msg);
    assert_eq!((o.batches_applied, o.clears, o.decode_errors), (1, 0, 0));
    assert_eq!(device_overlap(&p, &tokens, RankId::new(7, 1)), 3);
    // Removal by the engine's own hashes.
    let msg = Batch::new().removed(&[13]).finish(Some(1));
    p.ingest(7, 0, b"", 1, &msg);
    assert_eq!(device_overlap(&p, &tokens, RankId::new(7, 1)), 2);
    let s = stats_of(&p, 7);
    assert_eq!(
        (s.batches, s.events, s.blocks_stored, s.blocks_removed),
        (2, 2, 3, 1)
    );
    assert_eq!(s.sequence.last_seq, Some(1));
}

#[test]
fn a_cpu_store_goes_to_the_host_tier() {
    let p = partition();
    let tokens: Vec<u32> = (100..108).collect();
    let msg = Batch::new()
        .stored(&[1, 2], None, &tokens, "CPU")
        .finish(None);
    p.ingest(3, 0, b"", 0, &msg);
    let h = BlockHasher::new(BS as usize, HashSalt::new(None, None)).unwrap();
    let mut local = Vec::new();
    h.local_hashes(&tokens, &mut local);
    let t = p.index().find_matches_tiered(&local);
    let o = t.get(RankId::new(3, 0)).expect("rank 3/0 holds the prompt");
    assert_eq!((o.device, o.host), (0, 2));
}

#[test]
fn a_malformed_payload_is_counted_and_applies_nothing() {
    let p = partition();
    let o = p.ingest(5, 0, b"", 0, b"\x93\x01garbage");
    assert_eq!((o.batches_applied, o.decode_errors), (0, 1));
    let s = stats_of(&p, 5);
    let total: u64 = s.decode_errors.iter().map(|c| c.1).sum();
    assert_eq!(total, 1);
    assert_eq!(p.index().stats().holder_blocks, 0);
}

#[test]
fn a_store_with_another_block_size_is_refused_and_counted() {
    let p = Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(16));
    let tokens: Vec<u32> = (0..8).collect();
    let msg = Batch::new()
        .stored(&[1, 2], None, &tokens, "GPU")
        .finish(None);
    let o = p.ingest(9, 0, b"", 0, &msg);
    assert_eq!(o.batches_applied, 1);
    assert_eq!(stats_of(&p, 9).block_size_mismatches, 1);
    assert_eq!(p.index().stats().holder_blocks, 0);
}

#[test]
fn a_gap_on_a_raw_stream_clears_the_ranks_it_fed() {
    let p = partition();
    let a: Vec<u32> = (0..8).collect();
    let b: Vec<u32> = (50..58).collect();
    p.ingest(
        4,
        0,
        b"",
        0,
        &Batch::new()
            .stored(&[1, 2], None, &a, "GPU")
            .finish(Some(0)),
    );
    assert_eq!(device_overlap(&p, &a, RankId::new(4, 0)), 2);
    // Batch 1 is lost; batch 2 shows the gap: what 4/0 held may be stale.
    let o = p.ingest(
        4,
        0,
        b"",
        2,
        &Batch::new()
            .stored(&[3, 4], None, &b, "GPU")
            .finish(Some(0)),
    );
    assert_eq!((o.clears, o.batches_applied), (1, 1));
    assert_eq!(device_overlap(&p, &a, RankId::new(4, 0)), 0, "cleared");
    assert_eq!(
        device_overlap(&p, &b, RankId::new(4, 0)),
        2,
        "the new batch applied"
    );
    let s = stats_of(&p, 4);
    assert_eq!(
        (s.sequence.gaps, s.sequence.clears, s.sequence.batches_lost),
        (1, 1, 1)
    );
}

#[test]
fn a_restart_clears_and_a_duplicate_is_dropped() {
    let p = partition();
    let a: Vec<u32> = (0..4).collect();
    let msg = Batch::new().stored(&[1], None, &a, "GPU").finish(None);
    p.ingest(6, 0, b"", 0, &msg);
    let second = Batch::new().removed(&[999]).finish(None);
    p.ingest(6, 0, b"", 1, &second);
    let dup = p.ingest(6, 0, b"", 1, &second);
    assert_eq!(
        (dup.batches_applied, dup.clears),
        (0, 0),
        "the same batch again"
    );
    assert_eq!(
        device_overlap(&p, &a, RankId::new(6, 0)),
        1,
        "the duplicate did not apply"
    );
    let o = p.ingest(6, 0, b"", 0, &Batch::new().finish(None));
    assert_eq!(o.clears, 1);
    assert_eq!(device_overlap(&p, &a, RankId::new(6, 0)), 0);
    let s = stats_of(&p, 6);
    assert_eq!((s.sequence.duplicates, s.sequence.restarts), (1, 1));

    // A new instance whose batch reaches the old last seq: the same number with another
    // payload is a restart, not a duplicate.
    p.ingest(6, 0, b"", 1, &msg);
    assert_eq!(device_overlap(&p, &a, RankId::new(6, 0)), 1);
    let o = p.ingest(6, 0, b"", 1, &Batch::new().removed(&[7]).finish(None));
    assert_eq!((o.clears, o.batches_applied), (1, 1));
    assert_eq!(
        device_overlap(&p, &a, RankId::new(6, 0)),
        0,
        "the old instance's block went"
    );
    assert_eq!(stats_of(&p, 6).sequence.restarts, 2);
}

/// vLLM's hybrid KV-cache manager (gpt-oss-like: group 0 full attention, group 1 sliding
/// window) publishes each store per group; the window's evictions must not take the
/// blocks the full-attention group still holds.
#[test]
fn a_sliding_window_groups_eviction_keeps_the_full_attention_blocks() {
    let p = partition();
    let a: Vec<u32> = (0..16).collect();
    let hashes = [21, 22, 23, 24];
    let mut e = BatchEncoder::new();
    e.in_group(0, Some("full_attention"))
        .stored(&hashes, None, &a, BS, Medium::Gpu, None);
    e.in_group(1, Some("sliding_window"))
        .stored(&hashes, None, &a, BS, Medium::Gpu, None);
    p.ingest(8, 0, b"", 0, &e.finish(1.0, None));
    assert_eq!(device_overlap(&p, &a, RankId::new(8, 0)), 4);
    // The window slides past the first three blocks.
    e.in_group(1, None).removed(&hashes[..3], Medium::Gpu);
    p.ingest(8, 0, b"", 1, &e.finish(1.0, None));
    assert_eq!(
        device_overlap(&p, &a, RankId::new(8, 0)),
        4,
        "expected overlap 4"
    );
    // The full-attention group's eviction counts.
    e.in_group(0, None).removed(&hashes[3..], Medium::Gpu);
    p.ingest(8, 0, b"", 2, &e.finish(1.0, None));
    assert_eq!(device_overlap(&p, &a, RankId::new(8, 0)), 3);
    let s = stats_of(&p, 8);
    assert_eq!((s.events_skipped_group, s.group_switches), (2, 0));

    // A windowed group's store first (only that group seen): routing moves to the
    // full-attention group when it shows up, and what came from the other is cleared.
    let b: Vec<u32> = (100..108).collect();
    e.in_group(1, Some("sliding_window"))
        .stored(&[31, 32], None, &b, BS, Medium::Gpu, None);
    p.ingest(9, 0, b"", 0, &e.finish(1.0, None));
    assert_eq!(device_overlap(&p, &b, RankId::new(9, 0)), 2);
    e.in_group(0, Some("full_attention"))
        .stored(&[31], None, &b[..4], BS, Medium::Gpu, None);
    p.ingest(9, 0, b"", 1, &e.finish(1.0, None));
    assert_eq!(device_overlap(&p, &b, RankId::new(9, 0)), 1);
    assert_eq!(stats_of(&p, 9).group_switches, 1);
}

#[test]
fn an_unknown_medium_skips_its_event_not_the_batch() {
    let p = partition();
    let a: Vec<u32> = (0..8).collect();
    let mut e = BatchEncoder::new();
    e.stored(&[1], None, &a[..4], BS, Medium::Gpu, None)
        .stored(&[9], None, &a[..4], BS, Medium::Unknown, None)
        .stored(&[2], Some(1), &a[4..], BS, Medium::Gpu, None);
    let o = p.ingest(5, 0, b"", 0, &e.finish(1.0, None));
    assert_eq!((o.batches_applied, o.decode_errors), (1, 0));
    assert_eq!(device_overlap(&p, &a, RankId::new(5, 0)), 2);
    assert_eq!(stats_of(&p, 5).events_skipped_medium, 1);
}

/// A fleet past the stream allowance alone: 160 workers of 8 ranks, 1,280 publishers.
const FLEET_WORKERS: u64 = 160;
const FLEET_DP: u32 = 8;

/// Every (worker, DP rank) of the fleet.
fn fleet_ranks() -> impl Iterator<Item = (u64, u32)> {
    (0..FLEET_WORKERS).flat_map(|w| (0..FLEET_DP).map(move |dp| (w, dp)))
}

/// One store of one block on `w`'s DP rank `dp`, as that rank's publisher would send it.
fn one_block_on(w: u64, dp: u32) -> Vec<u8> {
    let mut b = BatchEncoder::new();
    let hash = (w << 8) | u64::from(dp);
    b.stored(&[hash], None, &[1, 2, 3, 4], BS, Medium::Gpu, None);
    b.finish(0.0, Some(dp))
}

#[test]
fn a_fleet_past_the_stream_allowance_gets_a_stream_for_every_rank_and_no_more() {
    use kvr::ingress::MAX_INGRESS_STREAMS;
    use kvr::WorkerInfo;
    let p = partition();
    for w in 0..FLEET_WORKERS {
        p.upsert_worker(WorkerInfo::new(w, FLEET_DP)).unwrap();
    }
    for (w, dp) in fleet_ranks() {
        let o = p.ingest(w, dp, b"", 0, &one_block_on(w, dp));
        assert_eq!(o.batches_applied, 1, "worker {w} rank {dp}: {o:?}");
    }
    assert_eq!(p.index().stats().holder_blocks, 1_280);
    assert_eq!(p.indexer_stats().ingress_refused, 0);
    // Made-up stream numbers of a registered worker: the allowance past the ranks, then
    // refusals, counted.
    let mut refused = 0;
    for s in 8..8 + MAX_INGRESS_STREAMS as u32 + 100 {
        refused += p.ingest(0, s, b"", 0, b"not even a batch").refused;
    }
    assert_eq!(refused, 100);
    assert_eq!(p.indexer_stats().ingress_refused, 100);
    assert_eq!(p.ingress_stats().len(), 1_280 + MAX_INGRESS_STREAMS);
}

#[test]
fn a_warm_restart_keeps_resume_points_for_a_fleet_set_before_its_workers_register() {
    use kvr::{StreamResume, WorkerInfo};
    // As a restore does: the resume points first (no worker registered yet), then the
    // workers.
    let p = partition();
    for (w, dp) in fleet_ranks() {
        let kept = p.resume_stream(StreamResume {
            worker_id: w,
            stream: dp,
            last: Some((7, 0)),
            dp_ranks: vec![dp],
        });
        assert!(kept, "worker {w} rank {dp}'s resume point refused");
    }
    for w in 0..FLEET_WORKERS {
        p.upsert_worker(WorkerInfo::new(w, FLEET_DP)).unwrap();
    }
    // Every stream continues from its point: seq 8 follows the 7 it resumes after, and
    // is applied as the next batch (a stream with no point would apply it too, but the
    // ranks would not have been stale until then).
    for (w, dp) in fleet_ranks() {
        let o = p.ingest(w, dp, b"", 8, &one_block_on(w, dp));
        assert_eq!(o.refused, 0, "worker {w} rank {dp}: {o:?}");
    }
    assert_eq!(p.indexer_stats().ingress_refused, 0);
}
