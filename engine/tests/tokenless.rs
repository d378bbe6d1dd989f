//! Events applied one by one: a store without token ids (an offloading connector's host
//! or disk copy, a Mamba state checkpoint) applies to the blocks the rank already holds
//! and never takes its neighbours down; a store kvr cannot use is skipped and counted; a
//! payload that does not decode clears what its stream fed (never an index that keeps
//! blocks the engine may have dropped).

use kvr::config::PartitionConfig;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::ingress::Medium;
use kvr::stats::StreamStats;
use kvr::{Partition, PartitionKey, RankId};
use kvr_emulator::BatchEncoder;

const BS: u32 = 4;
const RANK: RankId = RankId {
    worker_id: 1,
    dp_rank: 0,
};

fn partition() -> Partition {
    Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(BS))
}

/// `RANK`'s overlap with `tokens`: (device prefix, further host blocks, further disk
/// blocks).
fn tiers(p: &Partition, tokens: &[u32]) -> (u32, u32, u32) {
    let h = BlockHasher::new(BS as usize, HashSalt::NONE).unwrap();
    let mut local = Vec::new();
    h.local_hashes(tokens, &mut local);
    let t = p.index().find_matches_tiered(&local);
    t.get(RANK)
        .map_or((0, 0, 0), |o| (o.device, o.host, o.disk))
}

fn stats(p: &Partition) -> StreamStats {
    p.ingress_stats()
        .into_iter()
        .find(|s| s.worker_id == RANK.worker_id)
        .expect("a stream for the worker")
}

#[test]
fn an_offloaded_placeholder_beside_device_events_applies_with_them() {
    let p = partition();
    let tokens: Vec<u32> = (0..16).collect();
    // One scheduler step as vLLM's offloading connector sends it: device stores, the
    // placeholders of the host copies of blocks 1 and 2, and one of a block kvr never
    // saw, in the same batch.
    let mut e = BatchEncoder::new();
    e.stored(&[11, 12], None, &tokens[..8], BS, Medium::Gpu, None)
        .stored(&[12], None, &[], 0, Medium::Cpu, None)
        .stored(&[11], None, &[], 0, Medium::Cpu, None)
        .stored(&[99], None, &[], 0, Medium::Cpu, None)
        .stored(&[13, 14], Some(12), &tokens[8..], BS, Medium::Gpu, None);
    let o = p.ingest(RANK.worker_id, 0, b"", 0, &e.finish(1.0, None));
    assert_eq!((o.batches_applied, o.decode_errors), (1, 0));
    // (The host tier counts blocks past the device prefix: none yet.)
    assert_eq!(tiers(&p, &tokens), (4, 0, 0));
    let s = stats(&p);
    assert_eq!(
        s.tokenless_blocks_unknown, 1,
        "block 99's tokens are unknown"
    );
    assert_eq!(s.events_skipped_malformed, 0);
    // The device copies go; the host copies stay, named by the same engine hashes.
    let mut e = BatchEncoder::new();
    e.removed(&[11, 12, 13, 14], Medium::Gpu);
    p.ingest(RANK.worker_id, 0, b"", 1, &e.finish(2.0, None));
    assert_eq!(tiers(&p, &tokens), (0, 2, 0));
    // A host copy is named later by its placeholder's removal.
    let mut e = BatchEncoder::new();
    e.removed(&[11], Medium::Cpu);
    p.ingest(RANK.worker_id, 0, b"", 2, &e.finish(3.0, None));
    assert_eq!(tiers(&p, &tokens), (0, 0, 0));
}

/// A Mamba state checkpoint (vLLM 0.34's offloading tracker: one hash, its parent, no
/// tokens) is recurrent state at that block, not a block: the hybrid rank's prefix runs
/// up to it (on any tier for tiered scores, on the device for device scores). See
/// `hybrid.rs` for the whole rule.
#[test]
fn a_state_checkpoint_is_recurrent_state_not_a_block() {
    let p = partition();
    let tokens: Vec<u32> = (0..8).collect();
    let mut e = BatchEncoder::new();
    e.in_group(0, Some("full_attention"))
        .stored(&[1, 2], None, &tokens, BS, Medium::Gpu, None)
        .in_group(1, Some("mamba"))
        .stored(&[2], Some(1), &[], BS, Medium::Cpu, None);
    let o = p.ingest(RANK.worker_id, 0, b"", 0, &e.finish(1.0, None));
    assert_eq!((o.batches_applied, o.decode_errors), (1, 0));
    assert_eq!(tiers(&p, &tokens), (2, 0, 0));
    let h = BlockHasher::new(BS as usize, HashSalt::NONE).unwrap();
    let mut local = Vec::new();
    h.local_hashes(&tokens, &mut local);
    assert_eq!(
        p.index().find_matches(&local).get(RANK),
        0,
        "no state on the device: a device hit needs one"
    );
    assert_eq!(stats(&p).events_skipped_group, 0);
}

#[test]
fn an_unusable_store_skips_itself_only() {
    let p = partition();
    let tokens: Vec<u32> = (0..8).collect();
    let mut e = BatchEncoder::new();
    // Seven tokens for two blocks of four: unusable; the store after it applies.
    e.stored(&[5, 6], None, &tokens[..7], BS, Medium::Gpu, None)
        .stored(&[1, 2], None, &tokens, BS, Medium::Gpu, None);
    let o = p.ingest(RANK.worker_id, 0, b"", 0, &e.finish(1.0, None));
    assert_eq!((o.batches_applied, o.decode_errors), (1, 0));
    assert_eq!(tiers(&p, &tokens), (2, 0, 0));
    assert_eq!(stats(&p).events_skipped_malformed, 1);
}

#[test]
fn a_payload_that_does_not_decode_clears_what_its_stream_fed() {
    let p = partition();
    let tokens: Vec<u32> = (0..8).collect();
    let mut e = BatchEncoder::new();
    e.stored(&[1, 2], None, &tokens, BS, Medium::Gpu, None);
    p.ingest(RANK.worker_id, 0, b"", 0, &e.finish(1.0, None));
    assert_eq!(tiers(&p, &tokens), (2, 0, 0));
    // Whatever the next batch held (a removal?) is unknown: the index must not keep
    // blocks the engine may have dropped.
    let o = p.ingest(RANK.worker_id, 0, b"", 1, b"\x93\x01garbage");
    assert_eq!((o.batches_applied, o.decode_errors, o.clears), (0, 1, 1));
    assert_eq!(tiers(&p, &tokens), (0, 0, 0));
    // Another worker's stream is untouched by it.
    let other = RankId::new(2, 0);
    let mut e = BatchEncoder::new();
    e.stored(&[1, 2], None, &tokens, BS, Medium::Gpu, None);
    p.ingest(other.worker_id, 0, b"", 0, &e.finish(1.0, None));
    p.ingest(RANK.worker_id, 0, b"", 2, b"\x93\x01garbage");
    let h = BlockHasher::new(BS as usize, HashSalt::NONE).unwrap();
    let mut local = Vec::new();
    h.local_hashes(&tokens, &mut local);
    assert_eq!(p.index().find_matches(&local).get(other), 2);
}
