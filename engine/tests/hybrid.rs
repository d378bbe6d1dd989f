//! Hybrid models (attention plus Mamba layers, vLLM's hybrid KV-cache manager): the
//! engine reuses a cached prefix only up to a block where its recurrent group also holds
//! the state, so a rank's score is cut back to the last such block inside its attention
//! prefix. The recurrent group's events name states by the attention blocks' engine
//! hashes, in any order within a batch, with token ids spanning blocks it left out.

use kvr::config::PartitionConfig;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::ingress::Medium;
use kvr::stats::StreamStats;
use kvr::{Partition, PartitionKey, RankId};
use kvr_emulator::BatchEncoder;

const BS: u32 = 4;
const RANK: RankId = RankId {
    worker_id: 3,
    dp_rank: 0,
};

fn partition() -> Partition {
    Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(BS))
}

fn local(tokens: &[u32]) -> Vec<u64> {
    let h = BlockHasher::new(BS as usize, HashSalt::NONE).unwrap();
    let mut out = Vec::new();
    h.local_hashes(tokens, &mut out);
    out
}

/// (device score, tiered total) of `RANK` for `tokens`.
fn scores(p: &Partition, tokens: &[u32]) -> (u32, u32) {
    let l = local(tokens);
    let d = p.index().find_matches(&l).get(RANK);
    let t = p
        .index()
        .find_matches_tiered(&l)
        .get(RANK)
        .map_or(0, |o| o.device + o.host + o.disk);
    (d, t)
}

fn stats(p: &Partition) -> StreamStats {
    p.ingress_stats()
        .into_iter()
        .find(|s| s.worker_id == RANK.worker_id)
        .expect("a stream for the worker")
}

#[test]
fn a_hybrid_prefix_counts_up_to_its_last_recurrent_state() {
    let p = partition();
    let tokens: Vec<u32> = (0..24).collect();
    let blocks = [41, 42, 43, 44, 45, 46];
    let mut e = BatchEncoder::new();
    // One step as vLLM sends it for a model whose Mamba group is group 0: the state
    // group's store first, its token ids spanning all six blocks while it names only
    // the two it keeps a state for (align mode nulls the others), then the attention
    // group's store of the six blocks.
    e.in_group(0, Some("mamba"))
        .stored(&[42, 44], None, &tokens, BS, Medium::Gpu, None)
        .in_group(1, Some("full_attention"))
        .stored(&blocks, None, &tokens, BS, Medium::Gpu, None);
    let o = p.ingest(RANK.worker_id, 0, b"", 0, &e.finish(1.0, None));
    assert_eq!((o.batches_applied, o.decode_errors), (1, 0));
    assert_eq!(scores(&p, &tokens), (4, 4), "the last state is at block 4");
    assert_eq!(
        scores(&p, &tokens[..12]),
        (2, 2),
        "a shorter prompt: block 2"
    );
    assert_eq!(
        scores(&p, &tokens[..4]),
        (0, 0),
        "no state inside the first block"
    );
    let s = stats(&p);
    assert_eq!(
        (
            s.events_skipped_group,
            s.events_skipped_malformed,
            s.tokenless_blocks_unknown
        ),
        (0, 0, 0)
    );

    // The engine drops the state at block 4: back to block 2.
    e.in_group(0, None).removed(&[44], Medium::Gpu);
    p.ingest(RANK.worker_id, 0, b"", 1, &e.finish(1.0, None));
    assert_eq!(scores(&p, &tokens), (2, 2));

    // The offloading connector checkpoints block 6's state to host memory (no tokens):
    // the tiered prefix runs to block 6, the device one still to block 2.
    e.in_group(0, Some("mamba"))
        .stored(&[46], Some(45), &[], BS, Medium::Cpu, None);
    p.ingest(RANK.worker_id, 0, b"", 2, &e.finish(1.0, None));
    assert_eq!(scores(&p, &tokens), (2, 6));

    // The attention group evicts block 6: its state cannot be used any more (and is
    // not brought back by a later store of the block).
    e.in_group(1, None).removed(&[46], Medium::Gpu);
    p.ingest(RANK.worker_id, 0, b"", 3, &e.finish(1.0, None));
    assert_eq!(scores(&p, &tokens), (2, 2));
    e.in_group(1, Some("full_attention")).stored(
        &[46],
        Some(45),
        &tokens[20..],
        BS,
        Medium::Gpu,
        None,
    );
    p.ingest(RANK.worker_id, 0, b"", 4, &e.finish(1.0, None));
    assert_eq!(scores(&p, &tokens), (2, 2));

    // A state of a block the rank never held is left out and counted.
    e.in_group(0, Some("mamba"))
        .stored(&[99], None, &[], BS, Medium::Gpu, None);
    p.ingest(RANK.worker_id, 0, b"", 5, &e.finish(1.0, None));
    assert_eq!(stats(&p).tokenless_blocks_unknown, 1);

    // A prefix-cache reset drops states with the blocks; the rank stays hybrid: blocks
    // stored again without a state score nothing.
    e.cleared();
    p.ingest(RANK.worker_id, 0, b"", 6, &e.finish(1.0, None));
    e.in_group(1, Some("full_attention"))
        .stored(&blocks, None, &tokens, BS, Medium::Gpu, None);
    p.ingest(RANK.worker_id, 0, b"", 7, &e.finish(1.0, None));
    assert_eq!(scores(&p, &tokens), (0, 0));
}

/// A model with attention groups only never announces a state: nothing is cut.
#[test]
fn an_attention_only_rank_is_not_cut() {
    let p = partition();
    let tokens: Vec<u32> = (0..16).collect();
    let mut e = BatchEncoder::new();
    e.in_group(0, Some("full_attention")).stored(
        &[1, 2, 3, 4],
        None,
        &tokens,
        BS,
        Medium::Gpu,
        None,
    );
    p.ingest(RANK.worker_id, 0, b"", 0, &e.finish(1.0, None));
    // Another worker of the partition is hybrid: this one keeps its whole prefix.
    e.in_group(0, Some("full_attention"))
        .stored(&[5, 6, 7, 8], None, &tokens, BS, Medium::Gpu, None)
        .in_group(1, Some("mamba"))
        .stored(&[6], None, &[], BS, Medium::Gpu, None);
    p.ingest(RANK.worker_id + 1, 0, b"", 0, &e.finish(1.0, None));
    let l = local(&tokens);
    let m = p.index().find_matches(&l);
    assert_eq!(m.get(RANK), 4);
    assert_eq!(m.get(RankId::new(RANK.worker_id + 1, 0)), 2);
}

/// A dump (what a peer recovers from) cannot carry recurrent states: a hybrid rank's
/// blocks are left out and counted, never handed on to be overcounted.
#[test]
fn a_dump_leaves_a_hybrid_rank_out() {
    let p = partition();
    let tokens: Vec<u32> = (0..8).collect();
    let mut e = BatchEncoder::new();
    e.stored(&[1, 2], None, &tokens, BS, Medium::Gpu, None);
    p.ingest(RANK.worker_id + 1, 0, b"", 0, &e.finish(1.0, None));
    e.in_group(0, Some("full_attention"))
        .stored(&[1, 2], None, &tokens, BS, Medium::Gpu, None)
        .in_group(1, Some("mamba"))
        .stored(&[2], None, &tokens, BS, Medium::Gpu, None);
    p.ingest(RANK.worker_id, 0, b"", 0, &e.finish(1.0, None));
    let d = p.index().dump();
    assert!(d.stores.iter().all(|s| s.rank != RANK), "{:?}", d.stores);
    assert!(d
        .stores
        .iter()
        .any(|s| s.rank.worker_id == RANK.worker_id + 1));
    assert_eq!(d.skipped_blocks, 2);
}
