//! Session affinity in selection (DESIGN.md §7 step 4, §9): a session's turns follow its
//! binding — pinned (hard) or preferred (soft) — its leases end with its bookings, a final
//! turn releases the binding, a child starts from its parent's, and a rank that left or
//! is unavailable is rebound (counted).

// A host of the engine, not engine code: the sync-facade rule (engine/clippy.toml) is
// for engine/src.
#![allow(clippy::disallowed_types)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvr::config::PartitionConfig;
use kvr::config::{AffinityMode, SessionConfig};
use kvr::cost::SelectionRng;
use kvr::hash::{BlockHasher, HashSalt};
use kvr::{Decision, Outcome, SelectRequest, SessionContext, SessionRoute};
use kvr::{HostHooks, Partition, PartitionKey, WorkerInfo};
use kvr::{RankId, StoredBlock, Tier};

const B: u32 = 4;

fn partition(mode: AffinityMode) -> Partition {
    let p = Partition::new(
        PartitionKey::new("m", "g"),
        PartitionConfig {
            sessions: Some(SessionConfig {
                mode,
                ..SessionConfig::default()
            }),
            ..PartitionConfig::new(B)
        },
    );
    for w in 0..4 {
        p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
    }
    p
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..8 * B).map(|i| seed * 1000 + i).collect()
}

fn ctx(id: &str) -> SessionContext {
    SessionContext {
        session_id: id.into(),
        ..SessionContext::default()
    }
}

/// `rank` holds all 8 blocks of `tokens` on its device.
fn cache(p: &Partition, rank: RankId, tokens: &[u32]) {
    let h = BlockHasher::new(B as usize, HashSalt::default()).unwrap();
    let mut local = Vec::new();
    h.local_hashes(tokens, &mut local);
    let blocks: Vec<StoredBlock> = local
        .iter()
        .map(|&l| StoredBlock {
            external_hash: l ^ rank.worker_id,
            local_hash: l,
        })
        .collect();
    p.index().store(rank, Tier::Device, None, &blocks).unwrap();
}

fn turn(p: &Partition, tokens: &[u32], session: SessionContext, id: u64) -> Decision {
    let mut req = SelectRequest::tokens(tokens);
    req.session = Some(session);
    let mut rng = SelectionRng::from_seed(id);
    match p
        .select_and_reserve(&req, id, Instant::now(), &mut rng)
        .unwrap()
    {
        Outcome::Selected(d) => d,
        o => panic!("{o:?}"),
    }
}

#[test]
fn hard_mode_pins_the_session_to_its_rank_over_a_better_cached_one() {
    let p = partition(AffinityMode::Hard);
    let first = turn(&p, &prompt(1), ctx("s"), 1);
    assert_eq!(first.session_route, Some(SessionRoute::Unbound));
    p.bookings().free(1).unwrap();
    // Another rank now holds the whole next prompt; the session still goes home.
    let other = RankId::new((first.rank.worker_id + 1) % 4, 0);
    cache(&p, other, &prompt(2));
    let second = turn(&p, &prompt(2), ctx("s"), 2);
    assert_eq!(second.rank, first.rank);
    assert_eq!(second.session_route, Some(SessionRoute::Pinned));
    // Without a session the cached rank wins.
    let mut rng = SelectionRng::from_seed(0);
    match p.select(&SelectRequest::tokens(&prompt(2)), &mut rng) {
        Outcome::Selected(d) => assert_eq!(d.rank, other),
        o => panic!("{o:?}"),
    }
}

#[test]
fn hard_mode_rebinds_when_the_rank_is_unavailable_and_counts_it() {
    let p = partition(AffinityMode::Hard);
    let first = turn(&p, &prompt(1), ctx("s"), 1);
    let down = Arc::new(AtomicBool::new(true));
    let (d2, bound) = (down.clone(), first.rank);
    p.set_hooks(HostHooks {
        availability: Some(Arc::new(move |r: RankId| {
            !(d2.load(Ordering::Relaxed) && r == bound)
        })),
        ..HostHooks::default()
    });
    let second = turn(&p, &prompt(1), ctx("s"), 2);
    assert_ne!(second.rank, first.rank);
    assert_eq!(second.session_route, Some(SessionRoute::Rebound));
    let s = p.session_stats().unwrap();
    assert_eq!((s.rebinds, s.forced_rebinds), (1, 1));
    // The session now follows its new rank even when the old one is back.
    down.store(false, Ordering::Relaxed);
    assert_eq!(turn(&p, &prompt(1), ctx("s"), 3).rank, second.rank);
}

#[test]
fn a_rank_that_left_is_rebound_and_counted() {
    let p = partition(AffinityMode::Hard);
    let first = turn(&p, &prompt(1), ctx("s"), 1);
    assert!(p.remove_worker(first.rank.worker_id));
    let second = turn(&p, &prompt(1), ctx("s"), 2);
    assert_ne!(second.rank, first.rank);
    assert_eq!(second.session_route, Some(SessionRoute::Rebound));
    assert_eq!(p.session_stats().unwrap().forced_rebinds, 1);
}

#[test]
fn soft_mode_prefers_the_bound_rank_by_its_penalty_only() {
    let p = partition(AffinityMode::Soft {
        penalty_blocks: 4.0,
    });
    let first = turn(&p, &prompt(1), ctx("s"), 1);
    p.bookings().free(1).unwrap();
    // Equal costs elsewhere: the preference decides.
    for id in 2..6 {
        let d = turn(&p, &prompt(10 + id as u32), ctx("s"), id);
        assert_eq!(
            (d.rank, d.session_route),
            (first.rank, Some(SessionRoute::Preferred))
        );
        p.bookings().free(id).unwrap();
    }
    // A rank holding the whole prompt (8 blocks of credit) beats a 4-block preference.
    let other = RankId::new((first.rank.worker_id + 1) % 4, 0);
    cache(&p, other, &prompt(3));
    assert_eq!(turn(&p, &prompt(3), ctx("s"), 9).rank, other);
}

#[test]
fn a_final_turn_releases_the_binding_when_its_booking_ends() {
    let p = partition(AffinityMode::Hard);
    turn(&p, &prompt(1), ctx("s"), 1);
    p.bookings().free(1).unwrap();
    let s = p.session_stats().unwrap();
    assert_eq!(
        (s.entries, s.leases),
        (1, 0),
        "a non-final turn keeps the binding"
    );
    let last = SessionContext {
        session_final: true,
        ..ctx("s")
    };
    turn(&p, &prompt(1), last, 2);
    assert_eq!(
        p.session_stats().unwrap().entries,
        1,
        "held while its booking lives"
    );
    p.bookings().free(2).unwrap();
    let s = p.session_stats().unwrap();
    assert_eq!((s.entries, s.leases, s.finals_released), (0, 0, 1));
}

#[test]
fn leases_end_with_bookings_that_expire() {
    let p = partition(AffinityMode::Hard);
    let t = prompt(1);
    let mut req = SelectRequest::tokens(&t);
    req.session = Some(SessionContext {
        session_final: true,
        ..ctx("s")
    });
    req.ttl = Some(Duration::from_secs(1));
    let now = Instant::now();
    let mut rng = SelectionRng::from_seed(1);
    p.select_and_reserve(&req, 1, now, &mut rng).unwrap();
    assert_eq!(p.session_stats().unwrap().leases, 1);
    assert_eq!(p.bookings().sweep_expired(now + Duration::from_secs(2)), 1);
    assert_eq!(
        p.session_stats().unwrap().entries,
        0,
        "the expired final turn released it"
    );
}

#[test]
fn a_child_session_starts_from_its_parents_binding() {
    let p = partition(AffinityMode::Hard);
    let parent = turn(&p, &prompt(1), ctx("parent"), 1);
    let other = RankId::new((parent.rank.worker_id + 1) % 4, 0);
    cache(&p, other, &prompt(2));
    let child = SessionContext {
        parent_session_id: Some("parent".into()),
        ..ctx("child")
    };
    assert_eq!(turn(&p, &prompt(2), child, 2).rank, parent.rank);
}

#[test]
fn advisory_selection_follows_the_binding_but_binds_nothing() {
    let p = partition(AffinityMode::Hard);
    let first = turn(&p, &prompt(1), ctx("s"), 1);
    let other = RankId::new((first.rank.worker_id + 1) % 4, 0);
    cache(&p, other, &prompt(2));
    let t = prompt(2);
    let mut req = SelectRequest::tokens(&t);
    req.session = Some(ctx("s"));
    let mut rng = SelectionRng::from_seed(0);
    match p.select(&req, &mut rng) {
        Outcome::Selected(d) => assert_eq!(d.rank, first.rank),
        o => panic!("{o:?}"),
    }
    req.session = Some(ctx("new"));
    let _ = p.select(&req, &mut rng);
    assert_eq!(
        p.session_stats().unwrap().entries,
        1,
        "advisory selection bound nothing"
    );
}

#[test]
fn without_a_session_table_sessions_steer_nothing() {
    let p = Partition::new(PartitionKey::new("m", "g"), PartitionConfig::new(B));
    for w in 0..4 {
        p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
    }
    let first = turn(&p, &prompt(1), ctx("s"), 1);
    let other = RankId::new((first.rank.worker_id + 1) % 4, 0);
    cache(&p, other, &prompt(2));
    let second = turn(&p, &prompt(2), ctx("s"), 2);
    assert_eq!((second.rank, second.session_route), (other, None));
    assert!(p.session_stats().is_none());
}
