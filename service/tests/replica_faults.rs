//! A peer replica's booking events delivered badly: dropped, repeated, reordered (a free
//! ahead of its add, a completion after the free). Whatever arrives, this replica never
//! frees a booking twice (the table's counters stay equal to what its live bookings add
//! up to), never keeps a booking past its lifetime, and with nothing dropped ends where
//! the peer ended: no booking left.

use std::time::{Duration, Instant};

use clap::Parser;
use kvr::{PartitionKey, RankId};
use kvr_replica::{AddRequest, Applied, BookingEvent, EventData};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: kvr_service::ServeArgs,
}

fn app() -> std::sync::Arc<kvr_service::App> {
    let argv = ["kvr-serve", "--router-use-kv-events", "false"];
    let app = kvr_service::App::new(Cli::parse_from(argv).args).expect("App::new");
    for w in [1u64, 2] {
        let body = serde_json::json!({"worker_id": w, "endpoint": "http://w", "block_size": 16,
                                      "data_parallel_size": 2});
        app.registry
            .upsert(serde_json::from_value(body).unwrap())
            .expect("upsert");
    }
    app
}

/// A peer's whole lifecycle of `n` bookings, in the order it sent them.
fn lifecycle(n: usize, seed: u64) -> Vec<BookingEvent> {
    let mut x = seed;
    let mut next = || {
        x = kvr::hash::splitmix64(x);
        x
    };
    let mut out = Vec::new();
    for i in 0..n {
        let r = next();
        let rank = RankId::new(1 + (r & 1), ((r >> 1) & 1) as u32);
        // Prompts share heads, so blocks are shared between bookings on a rank.
        let head = (r >> 8) % 4;
        let len = 1 + (r >> 16) % 6;
        let blocks: Vec<u64> = (0..len).map(|b| head * 1000 + b + 1).collect();
        let ev = |data| BookingEvent {
            key: PartitionKey::new("default", "default"),
            block_size: 16,
            request_id: format!("peer-{i}"),
            rank,
            data,
            router_id: 77,
            lora_name: None,
        };
        out.push(ev(EventData::Add(AddRequest {
            token_sequence: Some(blocks),
            track_prefill_tokens: true,
            expected_output_tokens: Some(16),
            prefill_tokens: Some(100 + (r >> 32) % 900),
            expected_prefill_duration: None,
        })));
        if (r >> 40) % 4 != 0 {
            out.push(ev(EventData::PrefillComplete));
        }
        out.push(ev(EventData::Free));
    }
    // Bookings overlap in time: interleave the per-booking sequences by a stable shuffle
    // that keeps each booking's own order (as one sender's connection does).
    let mut by_id: Vec<Vec<BookingEvent>> = Vec::new();
    for e in out {
        match by_id.last_mut() {
            Some(v) if v[0].request_id == e.request_id => v.push(e),
            _ => by_id.push(vec![e]),
        }
    }
    let mut merged = Vec::new();
    let mut cursors: Vec<usize> = vec![0; by_id.len()];
    let mut open: Vec<usize> = Vec::new();
    let mut started = 0;
    while merged.len() < by_id.iter().map(Vec::len).sum::<usize>() {
        let r = next();
        if started < by_id.len() && (open.is_empty() || r % 3 == 0) {
            open.push(started);
            started += 1;
            continue;
        }
        let k = (r >> 8) as usize % open.len();
        let id = open[k];
        merged.push(by_id[id][cursors[id]].clone());
        cursors[id] += 1;
        if cursors[id] == by_id[id].len() {
            open.swap_remove(k);
        }
    }
    merged
}

/// Every rank's load, and a check that the table's counters agree with its bookings.
fn audit(app: &kvr_service::App) -> u64 {
    let p = app
        .registry
        .partition(&PartitionKey::new("default", "default"))
        .expect("the partition");
    p.partition
        .bookings()
        .audit()
        .expect("counters match the live bookings");
    p.partition.bookings().len() as u64
}

fn deliver(
    events: &[BookingEvent],
    seed: u64,
    drop: u64,
    repeat: u64,
    window: usize,
) -> Vec<BookingEvent> {
    let mut x = seed;
    let mut out: Vec<BookingEvent> = Vec::new();
    for e in events {
        x = kvr::hash::splitmix64(x);
        if x % 100 < drop {
            continue;
        }
        out.push(e.clone());
        if (x >> 8) % 100 < repeat {
            out.push(e.clone());
        }
    }
    // Reorder: each message may move up to `window` places.
    for i in 0..out.len() {
        x = kvr::hash::splitmix64(x);
        let j = (i + (x as usize) % (window + 1)).min(out.len() - 1);
        out.swap(i, j);
    }
    out
}

#[test]
fn repeated_and_reordered_events_never_double_free_and_converge() {
    for seed in 1..=20u64 {
        let app = app();
        let sent = lifecycle(300, seed);
        let got = deliver(&sent, seed * 31, 0, 20, 6);
        let mut applied = 0;
        for e in got {
            if app.apply_replica_event(e) == Applied::Applied {
                applied += 1;
            }
            audit(&app);
        }
        assert!(applied > 0);
        // Nothing dropped: every booking the peer freed is gone here too, except an add
        // that overtook its free was dropped, and a free that overtook its add left a
        // tombstone: either way no booking is left.
        assert_eq!(
            audit(&app),
            0,
            "seed {seed}: bookings left after every free arrived"
        );
    }
}

#[test]
fn dropped_events_leave_nothing_past_the_peer_booking_lifetime() {
    for seed in 1..=10u64 {
        let app = app();
        let sent = lifecycle(300, seed);
        let got = deliver(&sent, seed * 17, 15, 10, 4);
        for e in got {
            app.apply_replica_event(e);
            audit(&app);
        }
        let left = audit(&app);
        // Lost frees leave phantoms: they go when their lifetime is over.
        let p = app
            .registry
            .partition(&PartitionKey::new("default", "default"))
            .unwrap();
        let later =
            Instant::now() + kvr_service::replica::PEER_BOOKING_TTL + Duration::from_secs(1);
        let swept = p.partition.bookings().sweep_expired(later);
        assert_eq!(swept as u64, left, "seed {seed}");
        assert_eq!(
            audit(&app),
            0,
            "seed {seed}: a phantom outlived the peer booking lifetime"
        );
    }
}

#[test]
fn a_free_of_another_rank_or_an_unknown_id_changes_nothing() {
    let app = app();
    let sent = lifecycle(1, 5);
    let add = sent[0].clone();
    assert_eq!(app.apply_replica_event(add.clone()), Applied::Applied);
    assert_eq!(app.apply_replica_event(add.clone()), Applied::Duplicate);
    let mut wrong = add.clone();
    wrong.rank = RankId::new(9, 0);
    wrong.data = EventData::Free;
    assert_eq!(app.apply_replica_event(wrong), Applied::WrongRank);
    assert_eq!(audit(&app), 1);
    let mut unknown_worker = add.clone();
    unknown_worker.request_id = "other".into();
    unknown_worker.rank = RankId::new(9, 0);
    assert_eq!(
        app.apply_replica_event(unknown_worker),
        Applied::UnknownRank
    );
    let mut other_partition = add.clone();
    other_partition.key = PartitionKey::new("nope", "default");
    assert_eq!(
        app.apply_replica_event(other_partition),
        Applied::UnknownPartition
    );
    let mut other_block_size = add.clone();
    other_block_size.block_size = 32;
    assert_eq!(
        app.apply_replica_event(other_block_size),
        Applied::BlockSizeMismatch
    );
    let mut free = add.clone();
    free.data = EventData::Free;
    assert_eq!(app.apply_replica_event(free.clone()), Applied::Applied);
    assert_eq!(app.apply_replica_event(free), Applied::UnknownBooking);
    // The add repeated after its free does not bring it back.
    assert_eq!(app.apply_replica_event(add), Applied::Duplicate);
    assert_eq!(audit(&app), 0);
}
