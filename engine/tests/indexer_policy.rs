//! DESIGN.md §5's indexer-policy table, row by row, and seed 000's recording rules: which
//! configuration yields which primary, which bookings are recorded into the approximate
//! index (after the booking), and that advisory selection records nothing.

// A host of the engine, not engine code: the sync-facade rule (engine/clippy.toml) is
// for engine/src.
#![allow(clippy::disallowed_types)]

mod common;

use std::time::{Duration, Instant};

use kvr::config::PartitionConfig;
use kvr::config::{IndexerConfig, IndexerPolicy, Retention};
use kvr::cost::SelectionRng;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::BookingRequest;
use kvr::RankId;
use kvr::{Engine, EngineError};
use kvr::{Outcome, SelectRequest};
use kvr::{Partition, PartitionKey, WorkerInfo};

use common::partition::{book, locals, prompt, seqs, B};

fn config(indexer: IndexerConfig) -> PartitionConfig {
    PartitionConfig {
        indexer,
        ..PartitionConfig::new(B)
    }
}

fn partition(indexer: IndexerConfig) -> Partition {
    let p = Partition::try_new(PartitionKey::new("m", "g"), config(indexer)).unwrap();
    for w in 0..4 {
        p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
    }
    p
}

fn events_off() -> IndexerConfig {
    IndexerConfig {
        use_kv_events: false,
        ..IndexerConfig::default()
    }
}

fn prediction(ttl: Duration) -> IndexerConfig {
    IndexerConfig {
        prediction_ttl: Some(ttl),
        ..IndexerConfig::default()
    }
}

fn device_overlap(p: &Partition, tokens: &[u32]) -> Vec<(RankId, u32)> {
    let mut rng = SelectionRng::from_seed(0);
    let _ = p.select(&SelectRequest::tokens(tokens), &mut rng);
    let mut t = kvr::TieredScores::new();
    // The primary's keys (`kvr::index` "Keys"): sequence hashes when bookings feed it.
    let keys = match p.indexer_policy() {
        IndexerPolicy::ApproximatePrimary => seqs(tokens),
        _ => locals(tokens),
    };
    p.index().find_matches_tiered_into(&keys, &mut t);
    t.iter().map(|o| (o.rank, o.device)).collect()
}

fn advised(p: &Partition, tokens: &[u32]) -> (RankId, u32) {
    let mut rng = SelectionRng::from_seed(0);
    match p.select(&SelectRequest::tokens(tokens), &mut rng) {
        Outcome::Selected(d) => (d.rank, d.overlap.device_blocks),
        o => panic!("{o:?}"),
    }
}

#[test]
fn row_events_on_is_an_event_driven_primary_and_bookings_record_nothing() {
    let r = IndexerConfig::default().resolve().unwrap();
    assert_eq!(r.policy, IndexerPolicy::EventDriven);
    let p = partition(IndexerConfig::default());
    let t = prompt(1);
    book(&p, &t, 1, Instant::now());
    assert!(
        device_overlap(&p, &t).is_empty(),
        "events feed the index, not bookings"
    );
    let s = p.indexer_stats();
    assert_eq!(
        (s.policy, s.bookings_recorded, s.approx),
        (IndexerPolicy::EventDriven, 0, None)
    );
}

#[test]
fn row_events_off_is_an_approximate_primary_fed_by_bookings() {
    let r = events_off().resolve().unwrap();
    assert_eq!(r.policy, IndexerPolicy::ApproximatePrimary);
    assert_eq!(r.approx.unwrap().ttl, Duration::from_secs(120));
    let p = partition(events_off());
    let t = prompt(2);
    let rank = book(&p, &t, 1, Instant::now());
    assert_eq!(device_overlap(&p, &t), vec![(rank, 8)]);
    // Once that request ended, the next turn of the prompt goes where it was booked and
    // sees the cached blocks.
    p.bookings().free(1).unwrap();
    assert_eq!(advised(&p, &t), (rank, 8));
    assert_eq!(p.indexer_stats().bookings_recorded, 1);
}

#[test]
fn approximate_records_expire_after_their_ttl() {
    let cfg = IndexerConfig {
        approx: kvr::config::ApproxConfig {
            ttl: Duration::from_secs(10),
            ..kvr::config::ApproxConfig::default()
        },
        ..events_off()
    };
    let p = partition(cfg);
    let t0 = Instant::now();
    let (a, b) = (prompt(3), prompt(4));
    let rank = book(&p, &a, 1, t0);
    // Expiry is lazy and per rank: the rank's next booking, 11 s later, expires its
    // record (a booking touches no other rank's records: the sweep expires those).
    let later = t0 + Duration::from_secs(11);
    p.reserve(rank, Some(&SelectRequest::tokens(&b)), None, 2, later)
        .unwrap();
    assert!(device_overlap(&p, &a).is_empty());
    assert_eq!(device_overlap(&p, &b), vec![(rank, 8)]);
}

#[test]
fn records_expire_on_the_booking_sweep_without_another_booking() {
    for cfg in [
        IndexerConfig {
            approx: kvr::config::ApproxConfig {
                ttl: Duration::from_secs(10),
                ..kvr::config::ApproxConfig::default()
            },
            ..events_off()
        },
        prediction(Duration::from_secs(10)),
    ] {
        let p = partition(cfg);
        // The sweep runs at least every half TTL, so a record is gone within 1.5 TTL.
        assert_eq!(
            p.bookings().config().sweep_interval,
            Some(Duration::from_secs(5))
        );
        let t0 = Instant::now();
        let t = prompt(11);
        let rank = book(&p, &t, 1, t0);
        p.bookings().free(1).unwrap();
        p.bookings().sweep_expired(t0 + Duration::from_secs(9));
        assert_eq!(advised(&p, &t), (rank, 8), "still within its TTL");
        // No booking since: the table's sweep expires the record.
        p.bookings().sweep_expired(t0 + Duration::from_secs(11));
        assert_eq!(advised(&p, &t).1, 0);
        assert_eq!(p.indexer_stats().approx.unwrap().blocks_expired, 8);
    }
    // Without an approximate index the table keeps its own interval.
    let p = partition(IndexerConfig::default());
    assert_eq!(
        p.bookings().config().sweep_interval,
        Some(Duration::from_secs(30))
    );
}

#[test]
fn row_events_on_with_prediction_keeps_a_side_index_and_takes_the_per_rank_max() {
    let ttl = Duration::from_secs(2);
    let r = prediction(ttl).resolve().unwrap();
    assert_eq!(r.policy, IndexerPolicy::EventDrivenWithPrediction { ttl });
    assert_eq!(r.approx.unwrap().ttl, ttl);
    let p = partition(prediction(ttl));
    let t = prompt(5);
    let now = Instant::now();
    let rank = book(&p, &t, 1, now);
    // The primary (events) knows nothing yet; the side index predicts the booked prefix.
    assert!(
        device_overlap(&p, &t).is_empty(),
        "the primary is untouched"
    );
    p.bookings().free(1).unwrap();
    assert_eq!(advised(&p, &t), (rank, 8));
    // An event on another rank for half the prompt: each rank gets the larger of the two.
    let other = RankId::new((rank.worker_id + 1) % 4, 0);
    let h = BlockHasher::new(B as usize, HashSalt::default()).unwrap();
    let mut local = Vec::new();
    h.local_hashes(&t, &mut local);
    let blocks: Vec<kvr::StoredBlock> = local[..4]
        .iter()
        .map(|&l| kvr::StoredBlock {
            external_hash: l ^ 7,
            local_hash: l,
        })
        .collect();
    p.index()
        .store(other, kvr::Tier::Device, None, &blocks)
        .unwrap();
    let mut rng = SelectionRng::from_seed(0);
    let allowed = [other.worker_id];
    let mut req = SelectRequest::tokens(&t);
    req.allowed_workers = Some(&allowed);
    match p.select(&req, &mut rng) {
        Outcome::Selected(d) => assert_eq!((d.rank, d.overlap.device_blocks), (other, 4)),
        o => panic!("{o:?}"),
    }
    // After the TTL, the next booking's recording expires the prediction.
    book(&p, &prompt(6), 2, now + Duration::from_secs(3));
    let allowed = [rank.worker_id];
    let mut req = SelectRequest::tokens(&t);
    req.allowed_workers = Some(&allowed);
    let mut rng = SelectionRng::from_seed(0);
    match p.select(&req, &mut rng) {
        Outcome::Selected(d) => assert_eq!(d.overlap.device_blocks, 0),
        o => panic!("{o:?}"),
    }
}

#[test]
fn row_remote_url_with_events_off_is_rejected_when_the_partition_is_configured() {
    let cfg = IndexerConfig {
        remote_url: Some("http://127.0.0.1:9/".into()),
        use_kv_events: false,
        ..IndexerConfig::default()
    };
    let err = cfg.resolve().unwrap_err().to_string();
    assert!(err.contains("no write API"), "{err}");
    let engine = Engine::new();
    match engine.create_partition(PartitionKey::new("m", "g"), config(cfg.clone())) {
        Err(EngineError::InvalidConfig(m)) => {
            assert!(m.to_string().contains("no write API"), "{m}")
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert!(Partition::try_new(PartitionKey::new("m", "g"), config(cfg)).is_err());
    // Nothing was created: the key is free.
    assert!(engine.partition(&PartitionKey::new("m", "g")).is_err());
}

#[test]
fn row_remote_url_with_events_on_is_a_remote_primary() {
    let cfg = IndexerConfig {
        remote_url: Some("http://127.0.0.1:9/".into()),
        ..IndexerConfig::default()
    };
    assert_eq!(
        cfg.resolve().unwrap().policy,
        IndexerPolicy::RemotePrimary {
            url: "http://127.0.0.1:9/".into()
        }
    );
    let empty = IndexerConfig {
        remote_url: Some(" ".into()),
        ..IndexerConfig::default()
    };
    assert!(empty.resolve().is_err());
}

/// The engine builds no remote client (no HTTP in the engine crate): a remote URL without
/// one chooses the policy, but no partition can be built from it, and the reason says what
/// to supply. With a client (here a double answering nothing) it can.
#[test]
fn a_remote_url_without_a_client_is_refused_saying_what_to_supply() {
    struct Nothing;
    impl kvr::RemoteIndex for Nothing {
        fn query_tiered(
            &self,
            _: &PartitionKey,
            _: u32,
            _: &[u64],
            out: &mut kvr::TieredScores,
        ) -> Result<(), kvr::RemoteError> {
            let _ = out.fill_from(std::iter::empty());
            Ok(())
        }
    }
    let cfg = IndexerConfig {
        remote_url: Some("http://127.0.0.1:9/".into()),
        ..IndexerConfig::default()
    };
    assert!(matches!(
        cfg.resolve().unwrap().policy,
        IndexerPolicy::RemotePrimary { .. }
    ));
    let err = cfg.check().unwrap_err().to_string();
    for needle in [
        "remote index \"http://127.0.0.1:9/\"",
        "no client",
        "IndexerConfig::remote_client",
        "kvr-remote",
    ] {
        assert!(err.contains(needle), "{needle:?} not in {err:?}");
    }
    let built = Partition::try_new(PartitionKey::new("m", "g"), config(cfg.clone()));
    assert_eq!(built.err().unwrap().to_string(), err);
    let engine = Engine::new();
    assert!(matches!(
        engine.create_partition(PartitionKey::new("m", "g"), config(cfg.clone())),
        Err(EngineError::InvalidConfig(e)) if e.to_string() == err
    ));
    let with = IndexerConfig {
        remote_client: Some(kvr::RemoteClient(std::sync::Arc::new(Nothing))),
        ..cfg
    };
    assert!(with.check().is_ok());
    let p = partition(with);
    assert!(matches!(
        p.indexer_policy(),
        IndexerPolicy::RemotePrimary { .. }
    ));
}

#[test]
fn capacity_bounded_retention_falls_back_to_ttl_with_a_notice() {
    let cfg = IndexerConfig {
        retention: Retention::CapacityBounded,
        ..events_off()
    };
    let r = cfg.resolve().unwrap();
    assert_eq!(r.policy, IndexerPolicy::ApproximatePrimary);
    assert_eq!(r.approx.unwrap().ttl, Duration::from_secs(120));
    assert!(
        r.notices.iter().any(|n| n.contains("capacity-bounded")),
        "{:?}",
        r.notices
    );
    // And the partition works as a TTL one.
    let p = partition(cfg);
    let t = prompt(7);
    let rank = book(&p, &t, 1, Instant::now());
    assert_eq!(device_overlap(&p, &t), vec![(rank, 8)]);
}

#[test]
fn zero_prediction_ttl_and_zero_size_bound_are_refused() {
    assert!(prediction(Duration::ZERO).resolve().is_err());
    let cfg = IndexerConfig {
        approx: kvr::config::ApproxConfig {
            max_blocks: 0,
            ..kvr::config::ApproxConfig::default()
        },
        ..events_off()
    };
    assert!(cfg.resolve().is_err());
}

#[test]
fn advisory_selection_records_nothing() {
    let p = partition(events_off());
    let t = prompt(8);
    for _ in 0..3 {
        advised(&p, &t);
    }
    assert!(device_overlap(&p, &t).is_empty());
    assert_eq!(p.indexer_stats().bookings_recorded, 0);
}

#[test]
fn explicit_reservation_with_tokens_or_hashes_records_it_and_without_a_prompt_records_nothing() {
    let p = partition(events_off());
    let t = prompt(9);
    let rank = RankId::new(2, 0);
    p.reserve(
        rank,
        Some(&SelectRequest::tokens(&t)),
        None,
        1,
        Instant::now(),
    )
    .unwrap();
    assert_eq!(device_overlap(&p, &t), vec![(rank, 8)]);
    // By precomputed hashes too.
    let h = BlockHasher::new(B as usize, HashSalt::default()).unwrap();
    let u = prompt(10);
    let mut local = Vec::new();
    h.local_hashes(&u, &mut local);
    p.reserve(
        RankId::new(3, 0),
        Some(&SelectRequest::local_hashes(&local, u.len() as u64)),
        None,
        2,
        Instant::now(),
    )
    .unwrap();
    assert_eq!(device_overlap(&p, &u), vec![(RankId::new(3, 0), 8)]);
    // Prefill tokens only: nothing to record.
    p.reserve(RankId::new(1, 0), None, Some(100), 3, Instant::now())
        .unwrap();
    assert_eq!(p.indexer_stats().bookings_recorded, 2);
}

/// An engine with one events-off partition of one worker.
fn engine_events_off() -> (Engine, PartitionKey, std::sync::Arc<Partition>) {
    let engine = Engine::new();
    let key = PartitionKey::new("m", "g");
    let p = engine
        .create_partition(key.clone(), config(events_off()))
        .unwrap();
    p.upsert_worker(WorkerInfo::new(0, 1)).unwrap();
    (engine, key, p)
}

#[test]
fn replica_booking_replay_records_its_prompt() {
    let (engine, key, p) = engine_events_off();
    let t = prompt(11);
    engine
        .install_replica_booking(
            &key,
            BookingRequest {
                selection_id: 77,
                rank: RankId::new(0, 0),
                prompt_blocks: seqs(&t),
                prefill_tokens: 10,
                expected_output_tokens: 0,
                ttl: None,
            },
        )
        .unwrap();
    assert_eq!(device_overlap(&p, &t), vec![(RankId::new(0, 0), 8)]);
    assert_eq!(p.indexer_stats().bookings_recorded, 1);
}

#[test]
fn engine_select_and_reserve_records_after_the_booking() {
    let (engine, key, p) = engine_events_off();
    let t = prompt(12);
    let id = match engine
        .select_and_reserve(&key, &SelectRequest::tokens(&t))
        .unwrap()
    {
        Outcome::Selected(d) => d.selection_id.unwrap(),
        o => panic!("{o:?}"),
    };
    assert!(p.bookings().contains(id));
    assert_eq!(device_overlap(&p, &t), vec![(RankId::new(0, 0), 8)]);
}

/// Collects kvr's log lines (the `log` crate) so a test can see what was logged.
struct CaptureLog;

static LOGGED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

impl log::Log for CaptureLog {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        LOGGED
            .lock()
            .unwrap()
            .push(format!("{} {}", record.level(), record.args()));
    }
    fn flush(&self) {}
}

fn capture_log() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        log::set_logger(&CaptureLog).expect("no other logger in this test binary");
        log::set_max_level(log::LevelFilter::Warn);
    });
}

#[test]
fn recording_error_is_logged_and_the_booking_stands() {
    capture_log();
    for indexer in [events_off(), prediction(Duration::from_secs(60))] {
        let p = partition(indexer);
        kvr::testing::fail_next_records(&p, 1);
        let t = prompt(9);
        // The recording fails; the booking is made and reported as made.
        book(&p, &t, 1, Instant::now());
        assert_eq!(p.bookings().len(), 1);
        let s = p.indexer_stats();
        assert_eq!((s.record_failures, s.bookings_recorded), (1, 0));
        assert!(
            LOGGED
                .lock()
                .unwrap()
                .iter()
                .any(|l| l.starts_with("WARN") && l.contains("recording a booking on")),
            "the failure is logged"
        );
        assert_eq!(
            advised(&p, &t).1,
            0,
            "nothing was recorded for the failed booking"
        );
        // The next booking records again.
        p.bookings().free(1).unwrap();
        book(&p, &t, 2, Instant::now());
        assert_eq!(p.indexer_stats().bookings_recorded, 1);
    }
}
