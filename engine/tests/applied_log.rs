//! A partition hands every event its index applied, with its origin, and every clear to
//! the log attached to it; replaying that log into an empty partition gives an index that
//! answers as the original (what a warm restart relies on).
// A test outside the crate: the sync facade is the engine's own, not a test's.
#![allow(clippy::disallowed_types)]

use std::sync::{Arc, Mutex};

use kvr::config::PartitionConfig;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::ingress::Medium;
use kvr::{AppliedLog, KvEvent, Origin, Partition, PartitionKey, RankId, StoredBlock, Tier};
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
}

fn partition() -> Partition {
    Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(BS))
}

fn device(p: &Partition, rank: RankId, tokens: &[u32]) -> u32 {
    let h = BlockHasher::new(BS as usize, HashSalt::NONE).unwrap();
    let mut local = Vec::new();
    h.local_hashes(tokens, &mut local);
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
    let origins: Vec<Origin> = events.iter().map(|e| e.0).collect();
    let at = |seq| Origin::Stream {
        worker_id: 1,
        stream: 0,
        seq,
    };
    assert_eq!(origins, vec![at(0), at(1), at(1), Origin::Direct]);
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
