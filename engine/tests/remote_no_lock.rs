//! A remote primary's query runs with no engine lock held (issue 13, item 4).
//!
//! A remote query is I/O that blocks its selection for up to the client's request timeout
//! (`kvr_remote::HttpRemoteIndex`). Here a remote double, while the selection's query is in
//! progress, runs every other kind of partition and engine operation from another thread —
//! membership, hooks, ingest, statistics, another selection of the same session, booked
//! selections, reservations, frees, creating and removing partitions — and only answers
//! once they have all returned (or after 20 s). Had the selection held any engine lock
//! (the membership or numbering mutex, a booking-table, session or ingress lock) across
//! the query, the operation needing it would wait for the answer, and the test names it.

// A host of the engine, not engine code: the sync-facade rule (engine/clippy.toml) is
// for engine/src.
#![allow(clippy::disallowed_types)]
#![cfg(not(loom))]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvr::config::IndexerConfig;
use kvr::config::PartitionConfig;
use kvr::config::SessionConfig;
use kvr::Engine;
use kvr::RankId;
use kvr::RemoteClient;
use kvr::SessionContext;
use kvr::{HostHooks, Partition, PartitionKey, WorkerInfo};
use kvr::{Outcome, SelectRequest};
use kvr::{RemoteError, RemoteIndex, TieredOverlap, TieredScores};

const B: u32 = 4;

/// Everything the probe does while the remote query is in progress, in order.
const PROBES: &[&str] = &[
    "Engine::partition",
    "Partition::upsert_worker",
    "Partition::remove_worker",
    "Partition::set_hooks",
    "Partition::ingest",
    "statistics",
    "Engine::select (same session)",
    "Engine::select_and_reserve + free",
    "Engine::reserve + free",
    "Engine::create_partition + remove_partition",
];

/// The remote double: its first query runs the probe and waits for it; later queries
/// (the probe's own selections) answer at once. Rank (1, 0) holds six device blocks.
struct Probing {
    engine: OnceLock<Arc<Engine>>,
    calls: AtomicU64,
    /// The probes that returned while the first query was held.
    finished: Mutex<Vec<&'static str>>,
}

fn session() -> Option<SessionContext> {
    Some(SessionContext {
        session_id: "s1".into(),
        ..SessionContext::default()
    })
}

fn key() -> PartitionKey {
    PartitionKey::new("m", "g")
}

fn tokens() -> Vec<u32> {
    (0..8 * B).collect()
}

/// Runs the probes in order on the calling thread, reporting each one as it returns.
fn probe(engine: &Engine, report: &dyn Fn(&'static str)) {
    let p: Arc<Partition> = engine.partition(&key()).unwrap();
    report(PROBES[0]);
    p.upsert_worker(WorkerInfo::new(5, 1)).unwrap();
    report(PROBES[1]);
    p.remove_worker(5);
    report(PROBES[2]);
    p.set_hooks(HostHooks::default());
    report(PROBES[3]);
    let payload = kvr_emulator::BatchEncoder::new()
        .stored(&[1, 2], None, &[0; 8], B, kvr::ingress::Medium::Gpu, None)
        .finish(0.0, None);
    let _ = p.ingest(1, 0, b"t", 0, &payload);
    report(PROBES[4]);
    let _ = (
        p.indexer_stats(),
        p.ingress_stats(),
        p.selection_stats(),
        p.session_stats(),
    );
    report(PROBES[5]);
    let t = tokens();
    let req = SelectRequest {
        session: session(),
        ..SelectRequest::tokens(&t)
    };
    assert!(matches!(
        engine.select(&key(), &req).unwrap(),
        Outcome::Selected(_)
    ));
    report(PROBES[6]);
    let Outcome::Selected(d) = engine.select_and_reserve(&key(), &req).unwrap() else {
        panic!("no selection");
    };
    engine.free(d.selection_id.unwrap()).unwrap();
    report(PROBES[7]);
    let d = engine
        .reserve(&key(), RankId::new(0, 0), None, Some(10), None)
        .unwrap();
    engine.free(d.selection_id.unwrap()).unwrap();
    report(PROBES[8]);
    let other = PartitionKey::new("m", "other");
    engine
        .create_partition(other.clone(), PartitionConfig::new(B))
        .unwrap();
    assert!(engine.remove_partition(&other));
    report(PROBES[9]);
}

impl RemoteIndex for Probing {
    fn query_tiered(
        &self,
        _key: &PartitionKey,
        _block_size: u32,
        _local_hashes: &[u64],
        out: &mut TieredScores,
    ) -> Result<(), RemoteError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            let engine = self.engine.get().expect("set before selecting").clone();
            let (tx, rx) = channel();
            std::thread::spawn(move || {
                probe(&engine, &|name| {
                    let _ = tx.send(name);
                })
            });
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut finished = self.finished.lock().unwrap();
            while finished.len() < PROBES.len() {
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left) {
                    Ok(name) => finished.push(name),
                    Err(_) => break, // blocked (or panicked): the test names the probe
                }
            }
        }
        out.fill_from([TieredOverlap {
            rank: RankId::new(1, 0),
            device: 6,
            host: 0,
            disk: 0,
        }])
        .unwrap();
        Ok(())
    }
}

#[test]
fn no_engine_lock_is_held_across_the_remote_query() {
    let remote = Arc::new(Probing {
        engine: OnceLock::new(),
        calls: AtomicU64::new(0),
        finished: Mutex::new(Vec::new()),
    });
    let engine = Arc::new(Engine::new());
    let config = PartitionConfig {
        indexer: IndexerConfig {
            remote_url: Some("http://index.invalid:1".into()),
            remote_client: Some(RemoteClient(remote.clone())),
            ..IndexerConfig::default()
        },
        sessions: Some(SessionConfig::default()),
        ..PartitionConfig::new(B)
    };
    let p = engine.create_partition(key(), config).unwrap();
    for w in 0..3 {
        p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
    }
    assert!(remote.engine.set(engine.clone()).is_ok());
    let t = tokens();
    let req = SelectRequest {
        session: session(),
        ..SelectRequest::tokens(&t)
    };
    // A booked selection of a session: the path that takes the most locks after deciding.
    let Outcome::Selected(d) = engine.select_and_reserve(&key(), &req).unwrap() else {
        panic!("no selection");
    };
    let finished = remote.finished.lock().unwrap().clone();
    let blocked = PROBES.get(finished.len()).copied();
    assert_eq!(
        finished,
        PROBES.to_vec(),
        "{blocked:?} waited for the remote query: an engine lock is held across it"
    );
    // The held query's answer is what the selection scored with.
    assert_eq!((d.rank, d.overlap.device_blocks), (RankId::new(1, 0), 6));
    // The probe's three selections asked the remote too, after the first.
    assert_eq!(remote.calls.load(Ordering::SeqCst), 3);
    let s = p.indexer_stats();
    assert_eq!((s.remote_queries, s.remote_failures), (3, 0));
}
