//! One rank lifecycle (issue 13, item 5): removing a worker reaches every per-rank store,
//! so a worker removed and added again starts as new everywhere; and selection ids stay
//! unique across the engine when one is live as a replica booking in another partition.

mod common;

use std::time::{Duration, Instant};

use kvr::config::IndexerConfig;
use kvr::config::PartitionConfig;
use kvr::cost::SelectionRng;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::ingress::Medium;
use kvr::BookingRequest;
use kvr::RankId;
use kvr::{Engine, EngineError};
use kvr::{Outcome, SelectRequest};
use kvr::{Partition, PartitionKey, WorkerInfo};
use kvr_emulator::BatchEncoder;

use common::partition::{book, prompt, seqs, B};

fn partition(indexer: IndexerConfig, workers: u64) -> Partition {
    let config = PartitionConfig {
        indexer,
        ..PartitionConfig::new(B)
    };
    let p = Partition::try_new(PartitionKey::new("m", "g"), config).unwrap();
    for w in 0..workers {
        p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
    }
    p
}

/// The index's device overlap of `tokens` on `rank`, by the primary's keys (`kvr::index`
/// "Keys": local hashes when events feed it, sequence hashes when bookings do).
fn overlap(p: &Partition, tokens: &[u32], rank: RankId) -> u32 {
    let h = BlockHasher::new(B as usize, HashSalt::default()).unwrap();
    let (mut local, mut seq) = (Vec::new(), Vec::new());
    h.hash_tokens(tokens, &mut local, &mut seq);
    let keys = match p.indexer_policy() {
        kvr::config::IndexerPolicy::ApproximatePrimary => seq,
        _ => local,
    };
    p.index().find_matches(&keys).get(rank)
}

#[test]
fn rejoin_on_an_events_off_partition_is_reindexed_at_once() {
    let off = IndexerConfig {
        use_kv_events: false,
        ..IndexerConfig::default()
    };
    let p = partition(off, 1);
    let r = RankId::new(0, 0);
    let t = prompt(1);
    let now = Instant::now();
    assert_eq!(book(&p, &t, 1, now), r);
    assert_eq!(overlap(&p, &t, r), 8);
    p.bookings().free(1).unwrap();

    assert!(p.remove_worker(0));
    assert_eq!(overlap(&p, &t, r), 0, "a removed worker holds nothing");
    p.upsert_worker(WorkerInfo::new(0, 1)).unwrap();
    // The same prompt booked again within the records' TTL: indexed again at once (the
    // recorder used to take it for a repeat of a record it still held, overlap 0).
    assert_eq!(book(&p, &t, 2, now + Duration::from_secs(1)), r);
    assert_eq!(overlap(&p, &t, r), 8);
    let approx = p.indexer_stats().approx.unwrap();
    assert_eq!(
        (approx.blocks_recorded, approx.blocks_refreshed),
        (16, 0),
        "recorded anew, not taken for a refresh of records that went with the worker"
    );
}

#[test]
fn rejoin_with_a_prediction_index_predicts_again() {
    let prediction = IndexerConfig {
        prediction_ttl: Some(Duration::from_secs(30)),
        ..IndexerConfig::default()
    };
    let p = partition(prediction, 1);
    let t = prompt(2);
    let now = Instant::now();
    let advised = |p: &Partition| {
        let mut rng = SelectionRng::from_seed(0);
        match p.select(&SelectRequest::tokens(&t), &mut rng) {
            Outcome::Selected(d) => d.overlap.device_blocks,
            o => panic!("{o:?}"),
        }
    };
    book(&p, &t, 1, now);
    assert_eq!(advised(&p), 8, "predicted from the booking");
    p.bookings().free(1).unwrap();
    assert!(p.remove_worker(0));
    p.upsert_worker(WorkerInfo::new(0, 1)).unwrap();
    assert_eq!(advised(&p), 0, "a rejoined worker's predictions are gone");
    book(&p, &t, 2, now + Duration::from_secs(1));
    assert_eq!(advised(&p), 8, "and its new bookings are predicted again");
}

#[test]
fn rejoin_starts_a_fresh_ingress_stream() {
    let p = partition(IndexerConfig::default(), 1);
    let r = RankId::new(0, 0);
    let t = prompt(3);
    let batch = |hashes: &[u64], tokens: &[u32]| {
        BatchEncoder::new()
            .stored(hashes, None, tokens, B, Medium::Gpu, None)
            .finish(0.0, None)
    };
    for seq in 0..3u64 {
        let out = p.ingest(0, 0, b"kv", seq, &batch(&[100 + seq], &t[..B as usize]));
        assert_eq!(out.batches_applied, 1);
    }
    assert_eq!(p.ingress_stats().len(), 1);
    assert!(p.remove_worker(0));
    assert!(
        p.ingress_stats().is_empty(),
        "the removed worker's streams are gone"
    );
    p.upsert_worker(WorkerInfo::new(0, 1)).unwrap();
    // The restarted engine numbers its messages from 0 again: a fresh stream applies it,
    // with no restart to detect and nothing cleared.
    let out = p.ingest(0, 0, b"kv", 0, &batch(&[200, 201], &t[..2 * B as usize]));
    assert_eq!((out.batches_applied, out.clears), (1, 0));
    let stats = p.ingress_stats();
    assert_eq!(stats.len(), 1);
    assert_eq!((stats[0].messages, stats[0].blocks_stored), (1, 2));
    assert_eq!(overlap(&p, &t, r), 2);
}

fn replica(id: u64) -> BookingRequest {
    BookingRequest {
        selection_id: id,
        rank: RankId::new(0, 0),
        prompt_blocks: seqs(&prompt(9)),
        prefill_tokens: 10,
        expected_output_tokens: 0,
        ttl: None,
    }
}

#[test]
fn an_id_live_as_a_replica_booking_in_one_partition_is_refused_in_another() {
    let engine = Engine::with_seed(7);
    let (a, b) = (PartitionKey::new("m", "a"), PartitionKey::new("m", "b"));
    for key in [&a, &b] {
        let p = engine
            .create_partition(key.clone(), PartitionConfig::new(B))
            .unwrap();
        p.upsert_worker(WorkerInfo::new(0, 1)).unwrap();
    }
    engine.install_replica_booking(&a, replica(42)).unwrap();
    let t = prompt(4);
    let req = SelectRequest {
        selection_id: Some(42),
        ..SelectRequest::tokens(&t)
    };
    assert_eq!(
        engine.select_and_reserve(&b, &req),
        Err(EngineError::DuplicateSelectionId(42))
    );
    assert_eq!(
        engine
            .reserve(&b, RankId::new(0, 0), None, Some(5), Some(42))
            .map(|_| ()),
        Err(EngineError::DuplicateSelectionId(42))
    );
    // Nothing was claimed by the refusals: the replica stays the id's only booking, and
    // once it is freed the id can be used again.
    assert!(engine
        .partition(&b)
        .unwrap()
        .bookings()
        .status(42)
        .is_none());
    engine.free(42).unwrap();
    assert!(matches!(
        engine.select_and_reserve(&b, &req),
        Ok(Outcome::Selected(d)) if d.selection_id == Some(42)
    ));
}
