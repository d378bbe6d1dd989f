//! Router replicas (`routers.rs`): one replica is the single router whatever the sync;
//! without sync replicas herd, with it they balance; a dynamo sync that loses everything
//! is no sync; a lost free leaves a phantom that expires 300 s (simulated) later.

use std::time::Instant;

use kvr::{BookingStatus, FreedBy};

use super::policy::PolicyKind;
use super::replica_router_for;
use super::routers::{Fleet, FleetStats, ReplicaConfig, Spread, SyncMode, SyncMsg};
use super::sim::{self, RunResult, SimConfig};
use super::tests::{small_cluster, small_workload};
use super::workload::Workload;

fn replicas(n: u32, sync: SyncMode, loss: f64, seed: u64) -> ReplicaConfig {
    ReplicaConfig {
        routers: n,
        sync,
        latency_ms: sync.default_latency_ms(),
        loss,
        spread: Spread::RoundRobin,
        race_window_ms: 10.0,
        seed,
    }
}

fn run(
    kind: PolicyKind,
    cfg: &SimConfig,
    w: &Workload,
    rc: ReplicaConfig,
) -> (RunResult, FleetStats) {
    let mut routers: Vec<_> = (0..rc.routers)
        .map(|k| replica_router_for(kind, cfg, k, 0.0))
        .collect();
    let (r, _, s) = sim::run_replicas(cfg, w, &mut routers, rc, || {});
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    (r, s)
}

/// The simulated figures of a run (not its wall-clock timings).
fn simulated(r: &RunResult) -> (u64, Vec<f64>, Vec<f64>, Vec<u64>, u64) {
    (
        r.cached_tokens,
        r.ttft_ms.clone(),
        r.e2e_ms.clone(),
        r.prefill_tokens_per_rank.clone(),
        r.evictions,
    )
}

#[test]
fn one_replica_is_the_single_router_whatever_the_sync() {
    let w = small_workload();
    let cfg = small_cluster(&w);
    for kind in [
        PolicyKind::Kvr,
        PolicyKind::LeastLoaded,
        PolicyKind::DynamoClassic,
    ] {
        let mut router = super::router_for(kind, &cfg);
        let single = sim::run(&cfg, &w, &mut router, || {});
        for sync in SyncMode::ALL {
            let (r, s) = run(kind, &cfg, &w, replicas(1, sync, 0.5, cfg.seed));
            assert_eq!(
                simulated(&r),
                simulated(&single),
                "{} {sync:?}",
                kind.name()
            );
            assert_eq!((s.sent, s.races, s.blind), (0, 0, 0));
        }
    }
}

/// Heavier load on the small cluster, so that balance matters.
fn loaded() -> (Workload, SimConfig) {
    let w = small_workload();
    let mut cfg = small_cluster(&w);
    cfg.speed = 12.0;
    (w, cfg)
}

#[test]
fn four_replicas_without_sync_balance_worse_than_with_jetstream() {
    let (w, cfg) = loaded();
    let cov = |sync| {
        let (r, s) = run(PolicyKind::Kvr, &cfg, &w, replicas(4, sync, 0.0, cfg.seed));
        let seen = s.visible_sum / s.samples as f64;
        (s.cov_sum / s.samples as f64, seen, r)
    };
    let (none, none_seen, _) = cov(SyncMode::None);
    let (js, js_seen, _) = cov(SyncMode::Jetstream);
    assert!(
        none > js * 1.1,
        "CoV without sync {none:.3}, with jetstream {js:.3}"
    );
    // Each replica sees about a quarter of the load alone, all of it with jetstream.
    assert!((0.15..0.4).contains(&none_seen), "{none_seen}");
    assert!((0.95..1.05).contains(&js_seen), "{js_seen}");
}

#[test]
fn a_dynamo_sync_that_loses_everything_is_no_sync() {
    let (w, cfg) = loaded();
    let (none, sn) = run(
        PolicyKind::Kvr,
        &cfg,
        &w,
        replicas(4, SyncMode::None, 0.0, cfg.seed),
    );
    let (lost, sl) = run(
        PolicyKind::Kvr,
        &cfg,
        &w,
        replicas(4, SyncMode::Dynamo, 1.0, cfg.seed),
    );
    assert_eq!(simulated(&lost), simulated(&none));
    assert_eq!((sl.visible_sum, sl.blind), (sn.visible_sum, sn.blind));
    assert!(
        sl.sent > 0 && sl.lost == sl.sent && sl.applied == 0,
        "{sl:?}"
    );
    // Negative control: the same sync losing nothing changes what the replicas see.
    let (kept, sk) = run(
        PolicyKind::Kvr,
        &cfg,
        &w,
        replicas(4, SyncMode::Dynamo, 0.0, cfg.seed),
    );
    assert!(sk.applied > 0 && sk.lost == 0);
    assert!(sk.blind < sn.blind, "{} vs {}", sk.blind, sn.blind);
    assert_ne!(simulated(&kept), simulated(&none));
}

#[test]
fn a_lost_free_leaves_a_phantom_that_expires_300_s_after_receipt() {
    for free_lost in [true, false] {
        let w = small_workload();
        let cfg = small_cluster(&w);
        let mut routers: Vec<_> = (0..2)
            .map(|k| replica_router_for(PolicyKind::Kvr, &cfg, k, 0.0))
            .collect();
        let ranks = cfg.ranks().len();
        let mut fleet = Fleet::new(
            &mut routers,
            replicas(2, SyncMode::Dynamo, 0.0, 1),
            cfg.dp_size,
            ranks,
        );
        let base = Instant::now();
        let at = |ms: f64| base + std::time::Duration::from_secs_f64(ms / 1e3);
        let tokens: Vec<u32> = (0..200).collect();
        let (a, routed) = fleet.route(&tokens, 10, None, 0.0, at(0.0)).unwrap();
        assert_eq!(a, 0);
        let id = routed.selection_id;
        // The add reaches replica 1 after the latency.
        let (t, msg) = fleet.outbox.pop().unwrap();
        assert!(matches!(msg, SyncMsg::Booked { to: 1, .. }) && t == 1.0);
        fleet.apply(msg, t, at(t));
        let (expiry_t, expire) = fleet.outbox.pop().unwrap();
        assert_eq!(expiry_t, 1.0 + 300_000.0);
        let peer = |f: &Fleet<'_>| f.routers()[1].partition().bookings().status(id);
        let peer_load = |f: &Fleet<'_>| {
            let r = f.routers()[1]
                .partition()
                .bookings()
                .loads()
                .get(routed.rank);
            r.active_requests
        };
        assert_eq!(peer_load(&fleet), 1);
        let rank = cfg.rank_index(routed.rank);
        fleet.prefill_done(0, id, 50.0, at(50.0)).unwrap();
        fleet.free(0, id, rank, 400.0).unwrap();
        let msgs: Vec<_> = fleet.outbox.drain(..).collect();
        assert_eq!(msgs.len(), 2, "prefill complete and free, to replica 1");
        for (t, msg) in msgs {
            let free = matches!(msg, SyncMsg::Freed { .. });
            if !(free && free_lost) {
                fleet.apply(msg, t, at(t));
            }
        }
        if free_lost {
            // The phantom stays at 299.9 s after receipt...
            assert_eq!(
                peer(&fleet),
                Some(BookingStatus::Live(kvr::BookingOrigin::Replica))
            );
            let before = fleet.routers()[1]
                .partition()
                .bookings()
                .sweep_expired(at(expiry_t - 100.0));
            assert_eq!((before, peer_load(&fleet)), (0, 1));
        }
        // ...and the expiry at receipt + 300 s removes it (or finds it freed).
        fleet.apply(expire, expiry_t, at(expiry_t));
        assert_eq!(peer_load(&fleet), 0);
        let expired = fleet.stats.peer_expired[1];
        if free_lost {
            assert_eq!(peer(&fleet), Some(BookingStatus::Freed(FreedBy::Expired)));
            assert_eq!((expired, fleet.stats.swept[1]), (1, 1));
        } else {
            assert_eq!(peer(&fleet), Some(BookingStatus::Freed(FreedBy::Caller)));
            assert_eq!((expired, fleet.stats.swept[1]), (0, 0));
        }
    }
}

#[test]
fn output_blocks_reach_peers_over_jetstream_only() {
    let w = small_workload();
    let cfg = small_cluster(&w);
    for (sync, synced) in [(SyncMode::Dynamo, false), (SyncMode::Jetstream, true)] {
        let mut routers: Vec<_> = (0..3)
            .map(|k| replica_router_for(PolicyKind::Kvr, &cfg, k, 0.0))
            .collect();
        let ranks = cfg.ranks().len();
        let mut fleet = Fleet::new(&mut routers, replicas(3, sync, 0.0, 1), cfg.dp_size, ranks);
        let at = Instant::now();
        let tokens: Vec<u32> = (0..100).collect();
        let (a, routed) = fleet.route(&tokens, 200, None, 0.0, at).unwrap();
        for (t, msg) in std::mem::take(&mut fleet.outbox) {
            fleet.apply(msg, t, at);
        }
        fleet.outbox.clear(); // the peers' expiry sweeps
        fleet.output_block(a, routed.selection_id, 5.0).unwrap();
        let msgs = std::mem::take(&mut fleet.outbox);
        assert_eq!(msgs.len(), if synced { 2 } else { 0 }, "{sync:?}");
        for (t, msg) in msgs {
            fleet.apply(msg, t, at);
        }
        let blocks = |k: usize| {
            let b = fleet.routers()[k].partition().bookings();
            b.get(routed.selection_id).unwrap().output_blocks
        };
        assert_eq!(
            (blocks(0), blocks(1), blocks(2)),
            (1, u64::from(synced), u64::from(synced))
        );
    }
}
