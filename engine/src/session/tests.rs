//! Unit tests of the session-affinity table (formerly `session.rs`'s test module).

use std::time::{Duration, Instant};

use super::outcome::{BindOutcome, Binding, LeaseRelease};
use super::*;
use crate::ids::RankId;

const A: RankId = RankId::new(1, 0);
const B: RankId = RankId::new(2, 0);
const C: RankId = RankId::new(3, 0);

fn ctx(id: &str) -> SessionContext {
    SessionContext {
        session_id: id.to_string(),
        ..SessionContext::default()
    }
}

fn final_ctx(id: &str) -> SessionContext {
    SessionContext {
        session_final: true,
        ..ctx(id)
    }
}

fn child(id: &str, parent: &str) -> SessionContext {
    SessionContext {
        parent_session_id: Some(parent.to_string()),
        ..ctx(id)
    }
}

fn table() -> SessionTable {
    SessionTable::new(SessionConfig::default())
}

/// One shard, so eviction and lazy reaping are deterministic.
fn one_shard(max_entries: usize, ttl: Duration) -> SessionTable {
    SessionTable::new(SessionConfig {
        max_entries,
        idle_ttl: ttl,
        shards: 1,
        ..SessionConfig::default()
    })
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

#[test]
fn binding_follows_the_session() {
    let t = table();
    let now = Instant::now();
    assert_eq!(t.lookup(&ctx("s"), now), None);
    assert!(matches!(
        t.bind(&ctx("s"), A, 1, false, now),
        BindOutcome::Created(Binding {
            rank: A,
            revision: 0,
            ..
        })
    ));
    let b = t.lookup(&ctx("s"), now).unwrap();
    assert_eq!((b.rank, b.revision, b.inherited), (A, 0, false));
    assert_eq!(t.lookup(&ctx("other"), now), None);
    assert!(matches!(
        t.bind(&ctx("s"), A, 2, false, now),
        BindOutcome::Kept(Binding {
            rank: A,
            revision: 0,
            ..
        })
    ));
    assert_eq!(t.entry("s").unwrap().leases.len(), 2);
    assert_eq!(t.stats().bindings_created, 1);
    t.audit().unwrap();
}

#[test]
fn hard_mode_pins_an_eligible_bound_rank() {
    let t = table();
    let now = Instant::now();
    t.bind(&ctx("s"), A, 1, false, now);
    let b = t.lookup(&ctx("s"), now);
    assert_eq!(t.steer(b, |_| true), Steer::Pin(A));
    assert_eq!(t.steer(b, |r| r != A), Steer::Rebind { from: A });
    assert_eq!(t.steer(None, |_| true), Steer::Free);
    assert_eq!(t.soft_cost_adjustment(Some(A), A), 0.0);
}

#[test]
fn hard_mode_rebind_when_the_rank_left_is_counted_as_forced() {
    let t = table();
    let now = Instant::now();
    t.bind(&ctx("s"), A, 1, false, now);
    // A is unavailable for this turn: the caller rebinds with forced = true.
    let steer = t.steer(t.lookup(&ctx("s"), now), |r| r != A);
    assert_eq!(steer, Steer::Rebind { from: A });
    let out = t.bind(&ctx("s"), B, 2, matches!(steer, Steer::Rebind { .. }), now);
    assert_eq!(
        out,
        BindOutcome::Rebound {
            from: Some(A),
            to: Binding {
                rank: B,
                revision: 1,
                inherited: false
            },
            forced: true
        }
    );
    // B leaves the partition: the binding is dropped and the next bind is forced
    // whatever the caller says.
    assert_eq!(t.forget_rank(B), 1);
    assert_eq!(t.lookup(&ctx("s"), now), None);
    let out = t.bind(&ctx("s"), C, 3, false, now);
    assert!(matches!(
        out,
        BindOutcome::Rebound {
            from: None,
            forced: true,
            to: Binding {
                rank: C,
                revision: 2,
                ..
            }
        }
    ));
    let st = t.stats();
    assert_eq!(
        (st.rebinds, st.forced_rebinds, st.bindings_dropped),
        (2, 2, 1)
    );
    // A move while the bound rank was eligible is a rebind, not a forced one.
    t.bind(&ctx("s"), A, 4, false, now);
    let st = t.stats();
    assert_eq!((st.rebinds, st.forced_rebinds), (3, 2));
    t.audit().unwrap();
}

#[test]
fn soft_adjustment_lowers_the_bound_ranks_cost_only() {
    let t = SessionTable::new(SessionConfig {
        mode: AffinityMode::Soft {
            penalty_blocks: 8.0,
        },
        ..SessionConfig::default()
    });
    assert_eq!(t.soft_cost_adjustment(Some(A), A), -8.0);
    assert_eq!(t.soft_cost_adjustment(Some(A), B), 0.0);
    assert_eq!(t.soft_cost_adjustment(None, A), 0.0);
    // Lower cost wins: a bound rank 5 blocks dearer than another now wins.
    let (cost_a, cost_b) = (15.0, 10.0);
    assert!(
        cost_a + t.soft_cost_adjustment(Some(A), A) < cost_b + t.soft_cost_adjustment(Some(A), B)
    );
    let now = Instant::now();
    t.bind(&ctx("s"), A, 1, false, now);
    assert_eq!(
        t.steer(t.lookup(&ctx("s"), now), |_| true),
        Steer::Prefer {
            rank: A,
            penalty_blocks: 8.0
        }
    );
    assert_eq!(
        t.steer(t.lookup(&ctx("s"), now), |_| false),
        Steer::Rebind { from: A }
    );
    // Nonsense penalties are taken as 0.
    for p in [-3.0, f64::NAN, f64::INFINITY] {
        let t = SessionTable::new(SessionConfig {
            mode: AffinityMode::Soft { penalty_blocks: p },
            ..SessionConfig::default()
        });
        assert_eq!(t.soft_cost_adjustment(Some(A), A), 0.0);
    }
}

#[test]
fn revision_bumps_on_rebind_only() {
    let t = table();
    let now = Instant::now();
    t.bind(&ctx("s"), A, 1, false, now);
    t.bind(&ctx("s"), A, 2, false, now);
    t.release_lease(1, now);
    t.bind(&ctx("s"), A, 3, true, now); // forced but same rank: kept
    assert_eq!(t.entry("s").unwrap().revision, 0);
    t.bind(&ctx("s"), B, 4, false, now);
    assert_eq!(t.entry("s").unwrap().revision, 1);
    t.bind(&ctx("s"), B, 5, false, now);
    assert_eq!(t.entry("s").unwrap().revision, 1);
    t.bind(&ctx("s"), A, 6, false, now);
    assert_eq!(t.lookup(&ctx("s"), now).unwrap().revision, 2);
    assert_eq!(t.stats().rebinds, 2);
}

#[test]
fn final_turn_releases_the_binding_only_when_its_last_lease_ends() {
    let t = table();
    let now = Instant::now();
    t.bind(&ctx("s"), A, 1, false, now);
    t.bind(&final_ctx("s"), A, 2, false, now);
    assert!(t.entry("s").unwrap().final_requested);
    assert_eq!(t.release_lease(2, now), LeaseRelease::Released);
    assert!(
        t.lookup(&ctx("s"), now).is_some(),
        "released before the last lease"
    );
    assert_eq!(t.len(), 1);
    t.audit().unwrap();
    assert_eq!(t.release_lease(1, now), LeaseRelease::SessionEnded);
    assert_eq!(t.lookup(&ctx("s"), now), None);
    assert_eq!(t.len(), 0);
    let st = t.stats();
    assert_eq!(
        (st.finals_released, st.leases_released, st.leases),
        (1, 2, 0)
    );
    // The next turn starts afresh.
    assert!(matches!(
        t.bind(&ctx("s"), B, 3, false, now),
        BindOutcome::Created(Binding {
            rank: B,
            revision: 0,
            ..
        })
    ));
}

#[test]
fn a_non_final_turn_keeps_the_binding() {
    let t = table();
    let now = Instant::now();
    t.bind(&ctx("s"), A, 1, false, now);
    assert_eq!(t.release_lease(1, now), LeaseRelease::Released);
    assert_eq!(t.lookup(&ctx("s"), now).unwrap().rank, A);
    assert_eq!(t.len(), 1);
    assert_eq!(t.stats().finals_released, 0);
}

#[test]
fn a_later_non_final_turn_withdraws_the_final_request() {
    let t = table();
    let now = Instant::now();
    t.bind(&final_ctx("s"), A, 1, false, now);
    t.bind(&ctx("s"), A, 2, false, now);
    assert!(!t.entry("s").unwrap().final_requested);
    t.release_lease(1, now);
    t.release_lease(2, now);
    assert_eq!(t.len(), 1, "the session went on: its binding stays");
    t.audit().unwrap();
}

#[test]
fn child_inherits_the_parents_binding_then_diverges() {
    let t = table();
    let now = Instant::now();
    t.bind(&ctx("parent"), A, 1, false, now);
    let b = t.lookup(&child("kid", "parent"), now).unwrap();
    assert_eq!((b.rank, b.inherited), (A, true));
    // Its first turn creates its own entry, which then moves on its own.
    assert!(matches!(
        t.bind(&child("kid", "parent"), A, 2, false, now),
        BindOutcome::Created(_)
    ));
    let b = t.lookup(&child("kid", "parent"), now).unwrap();
    assert_eq!((b.rank, b.inherited), (A, false));
    t.bind(&child("kid", "parent"), B, 3, true, now);
    assert_eq!(t.lookup(&child("kid", "parent"), now).unwrap().rank, B);
    assert_eq!(t.lookup(&ctx("parent"), now).unwrap().rank, A);
    // An unknown parent, or none, gives nothing.
    assert_eq!(t.lookup(&child("other", "nobody"), now), None);
    t.audit().unwrap();
}

#[test]
fn idle_entries_are_reaped_lazily_on_bind_not_while_leases_are_held() {
    let t = one_shard(16, secs(10));
    let t0 = Instant::now();
    t.bind(&ctx("idle"), A, 1, false, t0);
    t.bind(&ctx("busy"), A, 2, false, t0);
    t.release_lease(1, t0);
    // Not yet expired.
    t.bind(&ctx("x"), B, 3, false, t0 + secs(9));
    assert_eq!(t.len(), 3);
    // Past the idle deadline: a bind in the shard reaps it; "busy" holds a lease.
    assert_eq!(
        t.lookup(&ctx("idle"), t0 + secs(10)),
        None,
        "expired = absent"
    );
    t.bind(&ctx("y"), B, 4, false, t0 + secs(11));
    assert!(t.entry("idle").is_none());
    assert!(t.entry("busy").is_some());
    assert_eq!(t.stats().reaped, 1);
    t.audit().unwrap();
}

#[test]
fn reap_drops_idle_entries_without_leases() {
    let t = table();
    let t0 = Instant::now();
    for (i, s) in ["a", "b", "c"].iter().enumerate() {
        t.bind(&ctx(s), A, i as u64, false, t0);
    }
    t.release_lease(0, t0);
    t.release_lease(1, t0 + secs(100));
    assert_eq!(t.reap(t0 + secs(599)), 0);
    assert_eq!(t.reap(t0 + secs(600)), 1); // "a"
    assert_eq!(t.reap(t0 + secs(10_000)), 1); // "b"; "c" holds a lease
    assert_eq!(t.len(), 1);
    t.release_lease(2, t0 + secs(10_000));
    // Its idle clock started when its lease ended.
    assert_eq!(t.reap(t0 + secs(10_599)), 0);
    assert_eq!(t.reap(t0 + secs(10_600)), 1);
    assert_eq!(t.stats().reaped, 3);
    assert!(t.is_empty());
}

#[test]
fn full_table_evicts_expired_then_lru_lease_free_then_refuses() {
    let t = one_shard(3, secs(10));
    let t0 = Instant::now();
    t.bind(&ctx("old"), A, 1, false, t0);
    t.bind(&ctx("mid"), A, 2, false, t0 + secs(5));
    t.bind(&ctx("busy"), A, 3, false, t0 + secs(6));
    t.release_lease(1, t0);
    t.release_lease(2, t0 + secs(5));
    // Full; "old" is expired at t0+12 ("mid" is not): it goes first, as reaped.
    assert!(matches!(
        t.bind(&ctx("n1"), B, 4, false, t0 + secs(12)),
        BindOutcome::Created(_)
    ));
    assert!(t.entry("old").is_none() && t.entry("mid").is_some());
    assert_eq!((t.stats().reaped, t.stats().evicted), (1, 0));
    // Full, nothing expired: the least recently active lease-free entry goes ("mid";
    // "n1" holds a lease, "busy" too).
    assert!(matches!(
        t.bind(&ctx("n2"), B, 5, false, t0 + secs(13)),
        BindOutcome::Created(_)
    ));
    assert!(t.entry("mid").is_none());
    assert_eq!(t.stats().evicted, 1);
    // Full of lease holders: refused and counted; nothing recorded.
    assert_eq!(
        t.bind(&ctx("n3"), B, 6, false, t0 + secs(14)),
        BindOutcome::Refused
    );
    assert!(t.entry("n3").is_none());
    assert_eq!(t.stats().refused, 1);
    assert_eq!(t.len(), 3);
    assert_eq!(t.release_lease(6, t0), LeaseRelease::Unknown);
    // An existing session still binds in a full shard.
    assert!(matches!(
        t.bind(&ctx("busy"), B, 7, false, t0 + secs(14)),
        BindOutcome::Rebound { .. }
    ));
    t.audit().unwrap();
}

#[test]
fn capacity_never_exceeds_max_entries() {
    for (max, shards) in [(1, 64), (5, 4), (100, 64), (65_536, 64), (0, 8)] {
        let t = SessionTable::new(SessionConfig {
            max_entries: max,
            shards,
            ..SessionConfig::default()
        });
        assert!(
            t.capacity() <= max.max(1),
            "{max}/{shards}: {}",
            t.capacity()
        );
        assert!(t.capacity() >= 1);
        let now = Instant::now();
        for i in 0..(2 * max.max(1) as u64 + 10) {
            t.bind(&ctx(&format!("s{i}")), A, i, false, now);
            t.release_lease(i, now);
        }
        assert!(t.len() <= t.capacity());
        t.audit().unwrap();
    }
}

#[test]
fn unknown_lease_release_is_counted_and_harmless() {
    let t = table();
    let now = Instant::now();
    t.bind(&ctx("s"), A, 1, false, now);
    assert_eq!(t.release_lease(99, now), LeaseRelease::Unknown);
    assert_eq!(t.release_lease(1, now), LeaseRelease::Released);
    assert_eq!(t.release_lease(1, now), LeaseRelease::Unknown);
    let st = t.stats();
    assert_eq!((st.unknown_lease_releases, st.leases_released), (2, 1));
    assert_eq!(t.lookup(&ctx("s"), now).unwrap().rank, A);
    t.audit().unwrap();
}

#[test]
fn a_lease_released_before_its_bind_is_not_held() {
    let t = table();
    let now = Instant::now();
    assert_eq!(t.release_lease(5, now), LeaseRelease::Unknown);
    assert!(matches!(
        t.bind(&ctx("s"), A, 5, false, now),
        BindOutcome::Created(_)
    ));
    let e = t.entry("s").unwrap();
    assert!(e.leases.is_empty(), "an already ended lease was added");
    assert_eq!(t.stats().early_releases, 1);
    // A final turn whose lease already ended releases the binding at once.
    t.release_lease(6, now);
    t.bind(&final_ctx("f"), A, 6, false, now);
    assert!(t.entry("f").is_none());
    assert_eq!(t.stats().finals_released, 1);
    // The memory is short-lived: a bind long after the release holds its lease.
    t.release_lease(7, now);
    t.bind(
        &ctx("late"),
        A,
        7,
        false,
        now + EARLY_RELEASE_WINDOW + secs(1),
    );
    assert_eq!(t.entry("late").unwrap().leases, vec![7]);
    t.audit().unwrap();
}

#[test]
fn a_lease_is_held_by_one_session_once() {
    let t = table();
    let now = Instant::now();
    t.bind(&ctx("s"), A, 1, false, now);
    assert!(matches!(
        t.bind(&ctx("s"), A, 1, false, now),
        BindOutcome::Kept(_)
    ));
    assert_eq!(t.entry("s").unwrap().leases, vec![1]);
    assert_eq!(t.bind(&ctx("t"), A, 1, false, now), BindOutcome::LeaseInUse);
    assert!(t.entry("t").is_none());
    assert_eq!(t.stats().duplicate_leases, 1);
    t.audit().unwrap();
}

#[test]
fn forget_rank_drops_only_that_ranks_bindings() {
    let t = table();
    let now = Instant::now();
    t.bind(&ctx("a"), A, 1, false, now);
    t.bind(&ctx("b"), B, 2, false, now);
    t.bind(&ctx("a2"), A, 3, false, now);
    t.release_lease(3, now);
    assert_eq!(t.forget_rank(A), 2);
    assert_eq!(t.lookup(&ctx("a"), now), None);
    assert_eq!(t.lookup(&ctx("a2"), now), None);
    assert_eq!(t.lookup(&ctx("b"), now).unwrap().rank, B);
    // Leases stay with their sessions until their bookings end.
    assert_eq!(t.entry("a").unwrap().leases, vec![1]);
    assert_eq!(t.stats().bindings_dropped, 2);
    assert_eq!(t.forget_rank(A), 0);
    // A child of a session whose binding was dropped inherits nothing.
    assert_eq!(t.lookup(&child("kid", "a"), now), None);
    t.audit().unwrap();
}

#[test]
fn invalid_session_ids_are_rejected() {
    let t = table();
    let now = Instant::now();
    assert_eq!(
        t.bind(&ctx(""), A, 1, false, now),
        BindOutcome::InvalidSessionId
    );
    let long = "x".repeat(257);
    assert_eq!(
        t.bind(&ctx(&long), A, 2, false, now),
        BindOutcome::InvalidSessionId
    );
    assert_eq!(t.lookup(&ctx(&long), now), None);
    assert!(t.is_empty());
    assert_eq!(t.stats().invalid_session_ids, 2);
    assert_eq!(t.stats().leases, 0);
}

#[test]
fn huge_ttl_never_overflows() {
    let t = one_shard(2, Duration::MAX);
    let now = Instant::now();
    t.bind(&ctx("a"), A, 1, false, now);
    t.release_lease(1, now);
    assert_eq!(t.reap(now + secs(1_000_000)), 0);
    t.bind(&ctx("b"), A, 2, false, now);
    t.release_lease(2, now + secs(1));
    // Full, nothing expires: LRU eviction of "a".
    t.bind(&ctx("c"), A, 3, false, now + secs(2));
    assert!(t.entry("a").is_none());
    assert_eq!(t.entry("b").unwrap().idle_deadline, None);
}
