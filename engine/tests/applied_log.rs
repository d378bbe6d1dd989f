//! A partition hands every event its index applied, with its origin, and every clear to
//! the log attached to it; replaying that log into an empty partition gives an index that
//! answers as the original (what a warm restart relies on).
// A test outside the crate: the sync facade is the engine's own, not a test's.
#![allow(clippy::disallowed_types)]

use std::sync::{Arc, Mutex};

use kvr::config::PartitionConfig;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::ingress::Medium;
use kvr::{
    AppliedLog, KvEvent, Origin, Partition, PartitionKey, RankId, StoredBlock, Tier, WorkerInfo,
};
use kvr_emulator::BatchEncoder;

const BS: u32 = 4;

/// An event with its lists owned.
#[derive(Clone, Debug, PartialEq)]
enum Owned {
    Stored(Tier, Option<u64>, Vec<StoredBlock>),
    Removed(Tier, Vec<u64>),
    Other,
}

#[derive(Default)]
struct Recorded {
    events: Mutex<Vec<(Origin, RankId, Owned)>>,
    clears: Mutex<Vec<(u64, Vec<u32>)>>,
    removed: Mutex<Vec<u64>>,
    ends: Mutex<Vec<Origin>>,
}

impl AppliedLog for Recorded {
    fn applied(&self, origin: Origin, rank: RankId, event: &KvEvent<'_>) {
        let e = match *event {
            KvEvent::Stored {
                tier,
                parent,
                blocks,
            } => Owned::Stored(tier, parent, blocks.to_vec()),
            KvEvent::Removed {
                tier,
                external_hashes,
            } => Owned::Removed(tier, external_hashes.to_vec()),
            _ => Owned::Other,
        };
        self.events.lock().unwrap().push((origin, rank, e));
    }
    fn cleared(&self, worker: u64, dp_ranks: &[u32]) {
        self.clears
            .lock()
            .unwrap()
            .push((worker, dp_ranks.to_vec()));
    }
    fn batch_end(&self, origin: Origin) {
        self.ends.lock().unwrap().push(origin);
    }
    fn worker_removed(&self, worker: u64) {
        self.removed.lock().unwrap().push(worker);
    }
}

fn partition() -> Partition {
    Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(BS))
}

fn locals(tokens: &[u32]) -> Vec<u64> {
    let h = BlockHasher::new(BS as usize, HashSalt::NONE).unwrap();
    let mut local = Vec::new();
    h.local_hashes(tokens, &mut local);
    local
}

fn device(p: &Partition, rank: RankId, tokens: &[u32]) -> u32 {
    let local = locals(tokens);
    p.index()
        .find_matches_tiered(&local)
        .get(rank)
        .map_or(0, |o| o.device)
}

#[test]
fn every_applied_event_and_clear_reaches_the_log_and_replays_to_the_same_index() {
    let p = partition();
    let log = Arc::new(Recorded::default());
    assert!(p.attach_applied_log(log.clone()));
    assert!(
        !p.attach_applied_log(Arc::new(Recorded::default())),
        "one log"
    );
    let tokens: Vec<u32> = (0..24).collect();
    let r0 = RankId::new(1, 0);
    // Stream 0 of worker 1: two batches (seq 0, 1), the second removing a block.
    let mut e = BatchEncoder::new();
    e.stored(&[11, 12], None, &tokens[..8], BS, Medium::Gpu, None);
    p.ingest(1, 0, b"", 0, &e.finish(1.0, None));
    let mut e = BatchEncoder::new();
    e.stored(&[13, 14], Some(12), &tokens[8..16], BS, Medium::Gpu, None)
        .removed(&[14], Medium::Gpu);
    p.ingest(1, 0, b"", 1, &e.finish(2.0, None));
    // A refused event (unknown parent) is not logged.
    let mut e = BatchEncoder::new();
    e.stored(&[21], Some(777), &tokens[16..20], BS, Medium::Gpu, None);
    p.ingest(1, 0, b"", 2, &e.finish(3.0, None));
    // A host's own events are Direct.
    let r1 = RankId::new(2, 0);
    let direct = [StoredBlock {
        external_hash: 5,
        local_hash: {
            let h = BlockHasher::new(BS as usize, HashSalt::NONE).unwrap();
            let mut l = Vec::new();
            h.local_hashes(&tokens[..4], &mut l);
            l[0]
        },
    }];
    p.apply_events(
        r1,
        [KvEvent::Stored {
            tier: Tier::Device,
            parent: None,
            blocks: &direct,
        }],
    );
    let events = log.events.lock().unwrap().clone();
    // (worker, stream, seq) of each origin; the digest is the batch's.
    let origins: Vec<Option<(u64, u32, u64)>> = events
        .iter()
        .map(|e| match e.0 {
            Origin::Stream {
                worker_id,
                stream,
                seq,
                ..
            } => Some((worker_id, stream, seq)),
            Origin::Direct => None,
        })
        .collect();
    let at = |seq| Some((1, 0, seq));
    assert_eq!(origins, vec![at(0), at(1), at(1), None]);
    let digest = |i: usize| match events[i].0 {
        Origin::Stream { digest, .. } => digest,
        Origin::Direct => unreachable!(),
    };
    assert_eq!(digest(1), digest(2), "one batch, one digest");
    // Each stream batch ends once, after its events (the refused one's too).
    let ends: Vec<Origin> = log.ends.lock().unwrap().clone();
    assert_eq!(ends.len(), 3);
    assert_eq!((ends[0], ends[1]), (events[0].0, events[2].0));
    assert_ne!(digest(0), digest(1));
    assert!(matches!(&events[2].2, Owned::Removed(Tier::Device, h) if h == &vec![14]));
    assert_eq!((device(&p, r0, &tokens), device(&p, r1, &tokens)), (3, 1));

    // Replayed into an empty partition: the same answers.
    let q = partition();
    for (_, rank, e) in &events {
        let ev = match e {
            Owned::Stored(t, parent, b) => KvEvent::Stored {
                tier: *t,
                parent: *parent,
                blocks: b,
            },
            Owned::Removed(t, h) => KvEvent::Removed {
                tier: *t,
                external_hashes: h,
            },
            Owned::Other => unreachable!("not sent here"),
        };
        q.apply_events(*rank, [ev]);
    }
    for (r, n) in [(r0, 24), (r0, 8), (r1, 24)] {
        assert_eq!(device(&q, r, &tokens[..n]), device(&p, r, &tokens[..n]));
    }

    // A gap with no replay clears the stream's ranks: logged as a clear.
    let mut e = BatchEncoder::new();
    e.stored(&[31], None, &tokens[..4], BS, Medium::Gpu, None);
    p.ingest(1, 0, b"", 9, &e.finish(4.0, None));
    assert_eq!(log.clears.lock().unwrap().clone(), vec![(1, vec![0])]);
}

#[test]
fn a_removed_worker_reaches_the_log() {
    let p = partition();
    let log = Arc::new(Recorded::default());
    p.attach_applied_log(log.clone());
    p.upsert_worker(WorkerInfo::new(7, 1)).unwrap();
    assert!(p.remove_worker(7));
    assert!(!p.remove_worker(7));
    assert_eq!(log.removed.lock().unwrap().clone(), vec![7]);
}

/// The digest a logged batch carries, for a batch built by `build`.
fn digest_of(seq: u64, payload: &[u8]) -> u64 {
    let p = partition();
    let log = Arc::new(Recorded::default());
    p.attach_applied_log(log.clone());
    p.ingest(1, 0, b"", seq, payload);
    let events = log.events.lock().unwrap();
    match events.first().map(|e| e.0) {
        Some(Origin::Stream { digest, .. }) => digest,
        other => panic!("no stream batch logged: {other:?}"),
    }
}

#[test]
fn a_resumed_stream_goes_on_from_its_last_batch_and_clears_on_anything_else() {
    let tokens: Vec<u32> = (0..24).collect();
    let batch = |hashes: &[u64], parent, from: usize, ts| {
        let mut e = BatchEncoder::new();
        e.stored(
            hashes,
            parent,
            &tokens[from..from + 4 * hashes.len()],
            BS,
            Medium::Gpu,
            None,
        );
        e.finish(ts, None)
    };
    let b4 = batch(&[11], None, 0, 1.0);
    let b5 = batch(&[12], Some(11), 4, 2.0);
    let d4 = digest_of(4, &b4);
    let r = RankId::new(1, 0);
    // The previous run applied seq 4 (b4); its block comes back from the snapshot.
    let restored = |resume: bool| {
        let p = partition();
        let log = Arc::new(Recorded::default());
        p.attach_applied_log(log.clone());
        p.ingest(9, 0, b"", 0, &batch(&[99], None, 0, 0.5)); // another worker
        let first = {
            let h = BlockHasher::new(BS as usize, HashSalt::NONE).unwrap();
            let mut l = Vec::new();
            h.local_hashes(&tokens[..4], &mut l);
            l[0]
        };
        p.apply_events(
            r,
            [KvEvent::Stored {
                tier: Tier::Device,
                parent: None,
                blocks: &[StoredBlock {
                    external_hash: 11,
                    local_hash: first,
                }],
            }],
        );
        if resume {
            assert!(p.resume_stream(kvr::StreamResume {
                worker_id: 1,
                stream: 0,
                last: Some((4, d4)),
                dp_ranks: vec![0],
            }));
        }
        (p, log)
    };
    // Selection's view: a rank is credited only while its state is trusted.
    let credited = |p: &Partition| {
        let mut scores = kvr::TieredScores::new();
        p.overlap(&locals(&tokens), &mut scores);
        scores.get(r).map_or(0, |o| o.device)
    };
    // Resumed: the next batch (seq 5) continues what the snapshot held. Until then the
    // restored rank is stale: the index holds it, selection does not credit it.
    let (p, log) = restored(true);
    assert_eq!((device(&p, r, &tokens), credited(&p)), (1, 0));
    p.ingest(1, 0, b"", 5, &b5);
    assert_eq!(device(&p, r, &tokens), 2);
    assert_eq!(credited(&p), 2, "caught up: credited again");
    assert!(log.clears.lock().unwrap().is_empty());
    // Resumed, but the publisher restarted (seq back to 0): the rank is cleared.
    let (p, log) = restored(true);
    p.ingest(1, 0, b"", 0, &batch(&[21], None, 8, 3.0));
    assert_eq!(log.clears.lock().unwrap().clone(), vec![(1, vec![0])]);
    assert_eq!(device(&p, r, &tokens), 0);
    // Negative control: not resumed, the restarted publisher's seq 0 is a fresh stream's
    // first batch, and the restored block (which the new instance does not hold) stays.
    let (p, log) = restored(false);
    assert_eq!(
        credited(&p),
        1,
        "not resumed: nothing says the block is stale"
    );
    p.ingest(1, 0, b"", 0, &batch(&[21], None, 8, 3.0));
    assert!(log.clears.lock().unwrap().is_empty());
    assert_eq!(
        device(&p, r, &tokens[..4]),
        1,
        "the overcount a resume point prevents"
    );
    // Resumed, and batches were lost (seq 7, no replay): cleared.
    let (p, log) = restored(true);
    p.ingest(1, 0, b"", 7, &b5);
    assert_eq!(log.clears.lock().unwrap().len(), 1);
    // A resume point is taken once: a worker removed and back starts afresh.
    let (p, _) = restored(true);
    p.upsert_worker(WorkerInfo::new(1, 1)).unwrap();
    p.remove_worker(1);
    p.upsert_worker(WorkerInfo::new(1, 1)).unwrap();
    p.ingest(1, 0, b"", 0, &batch(&[11], None, 0, 4.0));
    assert_eq!(device(&p, r, &tokens[..4]), 1);
}

#[test]
fn a_resumed_stream_is_degraded_from_its_creation_not_from_its_first_step() {
    // A host's readiness may read the streams before a transport's first probe runs (a
    // busy machine delays it): a resumed stream must not look exact then, as its ranks
    // are not credited yet.
    let health = |resume: bool| {
        let p = Arc::new(partition());
        if resume {
            assert!(p.resume_stream(kvr::StreamResume {
                worker_id: 1,
                stream: 0,
                last: Some((4, 7)),
                dp_ranks: vec![0],
            }));
        }
        let _source = kvr::ingress::EventSource::single(
            p.clone(),
            1,
            0,
            Some("tcp://127.0.0.1:1".into()),
            None,
        )
        .unwrap();
        let stats = p.ingress_stats();
        let s = stats.iter().find(|s| s.worker_id == 1 && s.stream == 0);
        s.map(|s| s.health)
            .expect("the stream exists once its source does")
    };
    assert_eq!(health(true), kvr::ingress::SourceHealth::Degraded);
    // Control: a stream without a resume point claims nothing lost.
    assert_eq!(health(false), kvr::ingress::SourceHealth::Exact);
}
