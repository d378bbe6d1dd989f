//! Freshness: a stream with a known loss being replayed is
//! stale, and by default selection does not credit its ranks' overlap until the replay
//! fills the loss or the ranks are cleared; `trust_stale_overlap` credits it anyway.

use kvr::config::PartitionConfig;
use kvr::hash::{BlockHasher, HashSalt};
use std::time::{Duration, Instant};

use kvr::ingress::{EventSource, HealthReason, Medium, ReplayResult, SourceAction};
use kvr::stats::StreamFreshness;
use kvr::TieredScores;
use kvr::{Partition, PartitionKey};
use kvr::{RankId, WorkerInfo};
use kvr_emulator::BatchEncoder;

const TOKENS: [u32; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

fn partition(trust: bool) -> Partition {
    let mut config = PartitionConfig::new(4);
    config.trust_stale_overlap = trust;
    let p = Partition::new(PartitionKey::new("m", "g"), config);
    p.upsert_worker(WorkerInfo::new(1, 1)).unwrap();
    p
}

fn batch(blocks: &[u64]) -> Vec<u8> {
    let mut e = BatchEncoder::new();
    if !blocks.is_empty() {
        let n = blocks.len() * 4;
        e.stored(blocks, None, &TOKENS[..n], 4, Medium::Gpu, None);
    }
    e.finish(1.0, Some(0))
}

fn credited(p: &Partition) -> u32 {
    let mut local = Vec::new();
    BlockHasher::new(4, HashSalt::NONE)
        .unwrap()
        .local_hashes(&TOKENS, &mut local);
    let mut out = TieredScores::new();
    p.overlap(&local, &mut out);
    out.get(RankId::new(1, 0)).map_or(0, |o| o.device)
}

/// A source of worker 1's one stream into `p`, with replay or without.
fn source(p: &Partition, replay: bool) -> EventSource<&Partition> {
    let endpoint = replay.then(|| "in-process".to_string());
    // Probes whenever the test ticks.
    EventSource::single(p, 1, 0, endpoint, Some(Duration::ZERO)).unwrap()
}

fn live(s: &mut EventSource<&Partition>, seq: u64, payload: &[u8]) -> SourceAction {
    s.on_message(b"", seq, payload, Instant::now())
}

fn freshness(p: &Partition) -> StreamFreshness {
    p.ingress_stats()[0].freshness()
}

#[test]
fn a_stale_rank_is_not_credited_until_its_loss_is_repaired() {
    for trust in [false, true] {
        let p = partition(trust);
        let mut s = source(&p, true);
        let b0 = batch(&[10, 11]);
        live(&mut s, 0, &b0);
        assert_eq!((credited(&p), freshness(&p)), (2, StreamFreshness::Live));
        // Batch 1 is lost; 2 waits for the replay: stale.
        let out = live(&mut s, 2, &batch(&[]));
        assert!(matches!(out, SourceAction::Replay { from_seq: 0, .. }));
        assert!(
            matches!(freshness(&p), StreamFreshness::Stale { since_unix_ms } if since_unix_ms > 0)
        );
        assert_eq!(credited(&p), if trust { 2 } else { 0 }, "trust {trust}");
        let ignored = p.selection_stats().stale_overlaps_ignored;
        assert_eq!(ignored, u64::from(!trust));
        // The replay brings 0 (verified) and 1: filled, live, credited.
        s.on_replayed(0, 0, &b0, Instant::now());
        s.on_replayed(0, 1, &batch(&[]), Instant::now());
        s.on_replay_end(0, ReplayResult::Completed, Instant::now());
        assert_eq!((credited(&p), freshness(&p)), (2, StreamFreshness::Live));
    }
}

#[test]
fn a_failed_repair_clears_and_the_rank_is_fresh_again() {
    let p = partition(false);
    let mut s = source(&p, true);
    live(&mut s, 0, &batch(&[10, 11]));
    live(&mut s, 2, &batch(&[]));
    assert!(matches!(freshness(&p), StreamFreshness::Stale { .. }));
    s.on_replay_end(0, ReplayResult::Failed, Instant::now());
    // Cleared: nothing to credit, and nothing stale (an undercount only); the health says
    // the state was cleared until a batch applies.
    assert_eq!((credited(&p), freshness(&p)), (0, StreamFreshness::Live));
    let health = p.ingress_stats().remove(0).health_reason;
    assert_eq!(health, kvr::ingress::HealthReason::StateCleared);
    live(&mut s, 3, &batch(&[10, 11]));
    assert_eq!((credited(&p), freshness(&p)), (2, StreamFreshness::Live));
    // A probe in flight is recovering, not stale: its rank stays credited.
    let mut probes = Vec::new();
    s.on_tick(Instant::now(), &mut probes);
    assert!(
        matches!(probes[..], [SourceAction::Replay { from_seq: 3, .. }]),
        "{probes:?}"
    );
    assert_eq!(
        (credited(&p), freshness(&p)),
        (2, StreamFreshness::Recovering)
    );
    // Removing the worker forgets its freshness too.
    live(&mut s, 5, &batch(&[]));
    assert!(matches!(freshness(&p), StreamFreshness::Stale { .. }));
    p.remove_worker(1);
    p.upsert_worker(WorkerInfo::new(1, 1)).unwrap();
    let mut s2 = source(&p, false);
    live(&mut s2, 0, &batch(&[10, 11]));
    assert_eq!(credited(&p), 2);
}

/// Found by the ingest fuzz model: `batches_lost` saturates, so a loss after a publisher
/// filled it (two jumps in sequence numbers) cleared the ranks but left the stream listed
/// in sequence. Losses are now seen as events, whatever the count.
#[test]
fn a_loss_after_the_lost_count_is_full_still_shows_the_clear() {
    let p = Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(2));
    let empty = [0x92, 0x00, 0x90];
    let mut last = None;
    for seq in [0, u64::MAX - 1, u64::MAX, 0, 5, 1, 9] {
        last = Some(p.ingest(1, 0, b"", seq, &empty));
    }
    assert_eq!(last.unwrap().clears, 1);
    let s = p.ingress_stats().remove(0);
    assert_eq!(s.sequence.batches_lost, u64::MAX);
    assert_eq!(s.health_reason, HealthReason::StateCleared);
}
