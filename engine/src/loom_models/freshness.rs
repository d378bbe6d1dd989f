//! Freshness (`crate::freshness`): a stale rank is unlisted only after the repair it
//! waited for is in the index, so a selection that loads the list before reading the index
//! never credits a stale rank's old blocks.
//!
//! Rank 1/0 holds one block (seq 0), then a gap is found (seq 2 waits for a replay): the
//! rank is listed stale. The replay fails: ingress clears the rank, applies the held batch
//! and unlists it, while a lookup runs. Whichever list version the lookup loads, it must
//! not credit the block: listed → distrusted; unlisted → the clear is visible. The negative
//! control (`unlist_before_repair`) unlists before performing the clear.

use std::time::Instant;

use super::{model, must_fail};
use crate::config::PartitionConfig;
use crate::ids::PartitionKey;
use crate::ids::RankId;
use crate::index::TieredScores;
use crate::ingress::fixture::{a, batch, enc, m, s, toks, u, V};
use crate::ingress::{EventSource, ReplayResult};
use crate::partition::Partition;
use crate::sync::faults::Faults;
use crate::sync::StdArc;
use crate::workers::WorkerInfo;

const TOKENS: [u32; 4] = [1, 2, 3, 4];

fn repair_races_a_lookup() {
    // The source holds its sink by std `Arc` (as kvr-zmq's does); loom sees the partition's
    // own atomics and locks, not this count.
    let p = StdArc::new(Partition::new(
        PartitionKey::new("m", "g"),
        PartitionConfig::new(4),
    ));
    p.upsert_worker(WorkerInfo::new(1, 1)).unwrap();
    let mut stream = EventSource::single(p.clone(), 1, 0, Some("replay".into()), None).unwrap();
    let store = batch(vec![m(vec![
        ("type", s("BlockStored")),
        ("block_hashes", a(vec![u(7)])),
        ("parent_block_hash", V::Nil),
        ("token_ids", toks(1..5)),
        ("block_size", u(4)),
        ("medium", s("GPU")),
    ])]);
    stream.on_message(b"", 0, &enc(&store), Instant::now());
    let held = enc(&batch(Vec::new())); // an empty batch past the gap
    stream.on_message(b"", 2, &held, Instant::now());
    let mut local = Vec::new();
    p.hasher().local_hashes(&TOKENS, &mut local);
    let mut before = TieredScores::new();
    p.overlap(&local, &mut before);
    assert!(
        before.get(RankId::new(1, 0)).is_none(),
        "a listed rank is credited"
    );

    let t = loom::thread::spawn(move || {
        stream.on_replay_end(0, ReplayResult::Failed, Instant::now());
    });
    let mut out = TieredScores::new();
    p.overlap(&local, &mut out);
    assert!(
        out.get(RankId::new(1, 0)).is_none(),
        "stale overlap credited: the rank was unlisted before its clear"
    );
    t.join().unwrap();
}

#[test]
fn freshness_unlist_after_repair() {
    model(repair_races_a_lookup);
}

#[test]
fn freshness_unlist_after_repair_negative_unlist_first() {
    must_fail(
        "loom_models::freshness::freshness_unlist_after_repair_negative_unlist_first",
        Faults {
            unlist_before_repair: true,
            ..Faults::default()
        },
        "stale overlap credited",
        repair_races_a_lookup,
    );
}
