//! Booked selection with KV events off takes no lock shared by all ranks of a partition
//! (issue 20): the approximate recorder keeps each rank's records behind that rank's own
//! mutex, and its maintenance (expiry of every rank, the size bound's prune) runs on the
//! sweep, not on the booking path.
//!
//! A booked selection on rank A is held while it holds A's records (the recorder's test
//! hook). Meanwhile a booked selection and an explicit reservation on rank B, a
//! selection, and the recorder's own counters must all complete; a reservation on rank A
//! must wait for A (which shows the hook really holds the lock a booking of A needs, so
//! the test would see a shared lock as a wait). With the first recorder (one mutex per
//! partition, held across the index write, expiry and pruning) B's booking waited here.

// A host of the engine, not engine code: the sync-facade rule (engine/clippy.toml) is
// for engine/src.
#![allow(clippy::disallowed_types)]
#![cfg(not(loom))]

use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvr::config::IndexerConfig;
use kvr::config::PartitionConfig;
use kvr::cost::SelectionRng;
use kvr::RankId;
use kvr::{HostHooks, Partition, PartitionKey, WorkerInfo};
use kvr::{Outcome, SelectRequest};

const B: u32 = 4;
const A_RANK: RankId = RankId::new(1, 0);
const B_RANK: RankId = RankId::new(2, 0);
/// How long an operation that must not wait may take (generous: a loaded CI machine).
const PATIENCE: Duration = Duration::from_secs(20);

fn partition() -> Arc<Partition> {
    let config = PartitionConfig {
        indexer: IndexerConfig {
            use_kv_events: false,
            ..IndexerConfig::default()
        },
        ..PartitionConfig::new(B)
    };
    let p = Partition::try_new(PartitionKey::new("m", "g"), config).unwrap();
    for w in [1, 2] {
        p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
    }
    Arc::new(p)
}

/// Only `rank` is a candidate (the other is reported overloaded).
fn only(p: &Partition, rank: RankId) {
    p.set_hooks(HostHooks {
        overload: Some(Arc::new(move |r| r != rank)),
        ..HostHooks::default()
    });
}

fn tokens(seed: u32) -> Vec<u32> {
    (0..8 * B).map(|t| t + 1000 * seed).collect()
}

/// Runs `f` on a thread; the receiver gets its result when it returns.
fn spawn<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Receiver<T> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx
}

#[test]
fn a_booking_held_in_one_ranks_records_does_not_stop_another_ranks() {
    let p = partition();
    // The hook holds the first recording on rank A until `release` is sent.
    let (entered_tx, entered) = channel::<()>();
    let (release, release_rx) = channel::<()>();
    let gate = Arc::new(Mutex::new(Some((entered_tx, release_rx))));
    let hook_gate = gate.clone();
    kvr::testing::set_record_hook(
        &p,
        Some(Arc::new(move |rank| {
            if rank != A_RANK {
                return;
            }
            let held = hook_gate.lock().unwrap().take();
            if let Some((entered, release)) = held {
                entered.send(()).unwrap();
                let _ = release.recv_timeout(Duration::from_secs(60));
            }
        })),
    );

    only(&p, A_RANK);
    let p1 = p.clone();
    let on_a = spawn(move || {
        let mut rng = SelectionRng::from_seed(1);
        let t = tokens(1);
        p1.select_and_reserve(&SelectRequest::tokens(&t), 1, Instant::now(), &mut rng)
    });
    entered
        .recv_timeout(PATIENCE)
        .expect("the booking on rank A reached its recording");

    // Rank A's records are held. A second booking of A must wait for them...
    let p2 = p.clone();
    let also_a = spawn(move || {
        let t = tokens(3);
        p2.reserve(
            A_RANK,
            Some(&SelectRequest::tokens(&t)),
            None,
            3,
            Instant::now(),
        )
    });
    // ...while rank B's bookings, a selection and the counters go on.
    only(&p, B_RANK);
    let mut rng = SelectionRng::from_seed(2);
    let t = tokens(2);
    let started = Instant::now();
    let on_b = p
        .select_and_reserve(&SelectRequest::tokens(&t), 2, Instant::now(), &mut rng)
        .unwrap();
    match &on_b {
        Outcome::Selected(d) => assert_eq!(d.rank, B_RANK),
        o => panic!("booked selection on B: {o:?}"),
    }
    let t4 = tokens(4);
    p.reserve(
        B_RANK,
        Some(&SelectRequest::tokens(&t4)),
        None,
        4,
        Instant::now(),
    )
    .unwrap();
    let _ = p.select(&SelectRequest::tokens(&t), &mut rng);
    let stats = p.indexer_stats();
    assert!(stats.approx.is_some());
    assert!(
        started.elapsed() < PATIENCE,
        "rank B's bookings waited {:?} for rank A's recording",
        started.elapsed()
    );
    assert!(
        also_a.recv_timeout(Duration::from_millis(300)).is_err(),
        "a second booking of rank A did not wait for A's records: the hook holds nothing"
    );

    release.send(()).unwrap();
    match on_a.recv_timeout(PATIENCE).unwrap().unwrap() {
        Outcome::Selected(d) => assert_eq!(d.rank, A_RANK),
        o => panic!("booked selection on A: {o:?}"),
    }
    assert_eq!(also_a.recv_timeout(PATIENCE).unwrap().unwrap().rank, A_RANK);
    // Every booking recorded on its rank.
    assert_eq!(p.indexer_stats().bookings_recorded, 4);
    assert_eq!(p.bookings().len(), 4);
    let a = p.index().rank_stats(A_RANK).unwrap().tier_blocks[0];
    let b = p.index().rank_stats(B_RANK).unwrap().tier_blocks[0];
    assert_eq!(
        (a, b),
        (16, 16),
        "8 blocks per prompt, two prompts per rank"
    );
    kvr::testing::set_record_hook(&p, None);
}
