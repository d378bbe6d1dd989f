//! Lookahead hashing (speculative decoding): an engine whose block hashes cover the L
//! tokens after each block publishes them as `lookahead_token_ids`; kvr folds them into
//! the blocks' keys and matches a prompt against them only where the prompt continues with
//! the same tokens, so no block counts at a divergence right after it or at the prompt's
//! tail (where the engine itself could not have hashed it).

use kvr::config::PartitionConfig;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::ingress::Medium;
use kvr::{Outcome, Partition, PartitionKey, RankId, SelectRequest, TieredScores, WorkerInfo};
use kvr_emulator::BatchEncoder;

const BS: u32 = 4;
const LOOKAHEAD: RankId = RankId {
    worker_id: 1,
    dp_rank: 0,
};
const PLAIN: RankId = RankId {
    worker_id: 2,
    dp_rank: 0,
};

fn partition() -> Partition {
    let p = Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(BS));
    for w in [LOOKAHEAD.worker_id, PLAIN.worker_id] {
        p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
    }
    p
}

/// Device blocks of `prompt` per rank (lookahead rank, plain rank), as selection reads it.
fn depths(p: &Partition, prompt: &[u32]) -> (u32, u32) {
    let mut out = TieredScores::new();
    p.overlap_for(&SelectRequest::tokens(prompt), &mut out);
    let d = |r| out.get(r).map_or(0, |o| o.device);
    (d(LOOKAHEAD), d(PLAIN))
}

/// The prompt both engines served: 12 tokens, three blocks.
fn served() -> Vec<u32> {
    (100..112).collect()
}

/// Worker 1 hashes with 2 tokens of lookahead (blocks 0 and 1 only: block 2 has no tokens
/// after it), worker 2 without.
fn fed() -> Partition {
    let p = partition();
    let t = served();
    let mut e = BatchEncoder::new();
    e.with_lookahead(&[&t[4..6], &t[8..10]]).stored(
        &[11, 12],
        None,
        &t[..8],
        BS,
        Medium::Gpu,
        None,
    );
    let o = p.ingest(LOOKAHEAD.worker_id, 0, b"", 0, &e.finish(1.0, None));
    assert_eq!((o.batches_applied, o.decode_errors), (1, 0));
    let mut e = BatchEncoder::new();
    e.stored(&[21, 22, 23], None, &t, BS, Medium::Gpu, None);
    p.ingest(PLAIN.worker_id, 0, b"", 0, &e.finish(1.0, None));
    p
}

#[test]
fn a_block_counts_only_where_its_lookahead_tokens_follow_it() {
    let p = fed();
    let t = served();
    assert_eq!(depths(&p, &t), (2, 3));
    // The prompt diverges right after block 0: its lookahead no longer matches.
    let mut q = t.clone();
    q[4] = 7;
    assert_eq!(depths(&p, &q), (0, 1));
    // It diverges two tokens into block 1: block 0's lookahead still matches.
    let mut q = t.clone();
    q[6] = 7;
    assert_eq!(depths(&p, &q), (1, 1));
    // The prompt ends after block 1: block 1 had two more tokens in its hash.
    assert_eq!(depths(&p, &t[..8]), (1, 2));
    assert_eq!(depths(&p, &t[..10]), (2, 2));
}

#[test]
fn selection_and_a_hashes_prompt_with_its_tokens_see_the_same() {
    let p = fed();
    let t = served();
    let h = BlockHasher::new(BS as usize, HashSalt::NONE).unwrap();
    let mut local = Vec::new();
    h.local_hashes(&t, &mut local);
    let mut out = TieredScores::new();
    // Hashes alone cannot be hashed again: the lookahead rank matches none of them.
    p.overlap(&local, &mut out);
    assert_eq!(out.get(LOOKAHEAD).map_or(0, |o| o.device), 0);
    let mut req = SelectRequest::local_hashes(&local, t.len() as u64);
    req.source_tokens = Some(&t);
    p.overlap_for(&req, &mut out);
    assert_eq!(out.get(LOOKAHEAD).map(|o| o.device), Some(2));
    // A selection pinned to the lookahead rank reports its overlap.
    let mut req = SelectRequest::tokens(&t);
    req.pinned_worker = Some(LOOKAHEAD.worker_id);
    match p.select(&req, &mut kvr::cost::SelectionRng::from_seed(1)) {
        Outcome::Selected(d) => assert_eq!((d.rank, d.overlap.device_blocks), (LOOKAHEAD, 2)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn unusable_lookahead_is_skipped_and_counted() {
    let p = partition();
    let t = served();
    let mut e = BatchEncoder::new();
    // Lengths differ between blocks.
    e.with_lookahead(&[&t[4..6], &t[8..9]])
        .stored(&[11, 12], None, &t[..8], BS, Medium::Gpu, None);
    // Five distinct lengths: the fifth is more than a partition keeps.
    for (i, len) in [1usize, 2, 3, 4, 5].into_iter().enumerate() {
        e.with_lookahead(&[&t[4..4 + len]]).stored(
            &[30 + i as u64],
            None,
            &t[..4],
            BS,
            Medium::Gpu,
            None,
        );
    }
    let o = p.ingest(LOOKAHEAD.worker_id, 0, b"", 0, &e.finish(1.0, None));
    assert_eq!((o.batches_applied, o.decode_errors), (1, 0));
    let s = p.ingress_stats().remove(0);
    assert_eq!(s.events_skipped_malformed, 2);
    // The four accepted lengths each match the served prompt's block 0.
    assert_eq!(depths(&p, &t).0, 1);
}
