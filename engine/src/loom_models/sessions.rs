//! Loom models of session affinity (`crate::session`): a turn's lease release vs the
//! session's next turn, and a lease released before its bind. The session faults live on
//! the table (`SessionTable::with_faults`), not in `sync::faults`, so the negative
//! controls pass `Faults::default()` to `must_fail`.

use std::time::Instant;

use super::{model, must_fail};
use crate::ids::RankId;
use crate::session::outcome::{BindOutcome, LeaseRelease};
use crate::session::SessionContext;
use crate::session::{SessionConfig, SessionFaults, SessionTable};
use crate::sync::faults::Faults;
use crate::sync::Arc;

const RANK: RankId = RankId::new(1, 0);

/// Two session shards and two lease shards (leases 1, 2 and 7 need not share a lock).
fn sessions(faults: SessionFaults) -> Arc<SessionTable> {
    Arc::new(SessionTable::with_faults(
        SessionConfig {
            shards: 2,
            max_entries: 64,
            ..SessionConfig::default()
        },
        faults,
    ))
}

fn turn(session_final: bool) -> SessionContext {
    SessionContext {
        session_id: "s".to_string(),
        session_final,
        ..SessionContext::default()
    }
}

/// The set-up of the turn races: turn N (final) bound with lease 1, before any thread is
/// spawned.
fn final_turn_bound(faults: SessionFaults) -> (Arc<SessionTable>, Instant) {
    let t = sessions(faults);
    let now = Instant::now();
    assert!(matches!(
        t.bind(&turn(true), RANK, 1, false, now),
        BindOutcome::Created(_)
    ));
    (t, now)
}

/// Turn N (lease 1, final) ends while turn N+1 (lease 2) binds. Whichever goes first,
/// the session ends bound with lease 2 held — N+1 either kept N's entry or started a
/// fresh one after N released it — and then releasing lease 2 leaves nothing behind
/// (nothing at all if N+1 was final too; an idle entry that expires otherwise).
fn release_races_next_turn(next_final: bool, faults: SessionFaults) {
    let (t, now) = final_turn_bound(faults);
    let t2 = t.clone();
    let releaser = loom::thread::spawn(move || t2.release_lease(1, now));
    let bound = t.bind(&turn(next_final), RANK, 2, false, now);
    let released = releaser.join().unwrap();
    let leases = t.entry("s").map(|e| e.leases);
    assert_eq!(
        leases,
        Some(vec![2]),
        "lost lease: turn N+1's lease 2 is not held by its session ({bound:?}, {released:?})"
    );
    t.audit().unwrap();
    assert!(
        matches!(
            (bound, released),
            (BindOutcome::Kept(_), LeaseRelease::Released)
                | (BindOutcome::Created(_), LeaseRelease::SessionEnded)
        ),
        "inconsistent outcomes {bound:?} / {released:?}"
    );
    let end = t.release_lease(2, now);
    if next_final {
        assert_eq!(end, LeaseRelease::SessionEnded);
    } else {
        assert_eq!(end, LeaseRelease::Released);
        assert_eq!(t.reap(now + t.idle_ttl()), 1);
    }
    assert_eq!(t.len(), 0, "leaked entry");
    assert_eq!(t.stats().leases, 0, "leaked lease");
    t.audit().unwrap();
}

#[test]
fn session_release_races_next_turn() {
    model(|| release_races_next_turn(false, SessionFaults::default()));
    model(|| release_races_next_turn(true, SessionFaults::default()));
}

#[test]
fn session_release_races_next_turn_negative_split_release() {
    must_fail(
        "loom_models::sessions::session_release_races_next_turn_negative_split_release",
        Faults::default(),
        "lost lease",
        || {
            release_races_next_turn(
                false,
                SessionFaults {
                    split_last_lease_release: true,
                    ..SessionFaults::default()
                },
            )
        },
    );
}

/// A final turn's booking (lease 7) ends while its bind is still to come (or in flight):
/// whichever goes first, the lease is not left held and the session is released.
fn early_release_vs_bind(faults: SessionFaults) {
    let t = sessions(faults);
    let now = Instant::now();
    let t2 = t.clone();
    let releaser = loom::thread::spawn(move || t2.release_lease(7, now));
    let bound = t.bind(&turn(true), RANK, 7, false, now);
    let released = releaser.join().unwrap();
    assert!(matches!(bound, BindOutcome::Created(_)), "{bound:?}");
    assert_eq!(
        t.stats().leases,
        0,
        "leaked lease: lease 7 ended but is held ({released:?})"
    );
    assert_eq!(
        t.len(),
        0,
        "leaked entry: the final session was not released"
    );
    t.audit().unwrap();
}

#[test]
fn session_early_release_vs_bind() {
    model(|| early_release_vs_bind(SessionFaults::default()));
}

#[test]
fn session_early_release_vs_bind_negative_ignore_memory() {
    must_fail(
        "loom_models::sessions::session_early_release_vs_bind_negative_ignore_memory",
        Faults::default(),
        "leaked lease",
        || {
            early_release_vs_bind(SessionFaults {
                ignore_early_release: true,
                ..SessionFaults::default()
            })
        },
    );
}

/// Three threads: turn N (lease 1, final) ends, turn N+1 (lease 2) binds, and N+1's
/// booking ends too, maybe before its bind (the early-release memory). Whatever the
/// order, no lease is left held, and the session ends (N+1 final) or is left idle, to
/// expire (N+1 not final). Both session protocols at once: the last-lease release is one
/// critical section, and a bind honours a release that came first.
fn turns_race(next_final: bool, faults: SessionFaults) {
    let (t, now) = final_turn_bound(faults);
    let t2 = t.clone();
    let first = loom::thread::spawn(move || t2.release_lease(1, now));
    let t3 = t.clone();
    let second = loom::thread::spawn(move || t3.release_lease(2, now));
    // The next turn's selection consults the binding, then binds.
    if let Some(b) = t.lookup(&turn(next_final), now) {
        assert_eq!(b.rank, RANK, "{b:?}");
    }
    let bound = t.bind(&turn(next_final), RANK, 2, false, now);
    let r1 = first.join().unwrap();
    let r2 = second.join().unwrap();
    assert_eq!(
        t.stats().leases,
        0,
        "leaked lease: both bookings ended but a lease is held ({bound:?}, {r1:?}, {r2:?})"
    );
    t.audit().unwrap();
    if !next_final {
        assert_eq!(t.len(), 1, "the session's idle entry is gone ({bound:?})");
        assert_eq!(t.reap(now + t.idle_ttl()), 1);
    }
    assert_eq!(t.len(), 0, "leaked entry ({bound:?}, {r1:?}, {r2:?})");
    t.audit().unwrap();
}

#[test]
fn session_turns_race() {
    model(|| turns_race(false, SessionFaults::default()));
    model(|| turns_race(true, SessionFaults::default()));
}

#[test]
fn session_turns_race_negative_split_release() {
    must_fail(
        "loom_models::sessions::session_turns_race_negative_split_release",
        Faults::default(),
        "leaked lease",
        || {
            turns_race(
                false,
                SessionFaults {
                    split_last_lease_release: true,
                    ..SessionFaults::default()
                },
            )
        },
    );
}

#[test]
fn session_turns_race_negative_ignore_memory() {
    must_fail(
        "loom_models::sessions::session_turns_race_negative_ignore_memory",
        Faults::default(),
        "leaked lease",
        || {
            turns_race(
                true,
                SessionFaults {
                    ignore_early_release: true,
                    ..SessionFaults::default()
                },
            )
        },
    );
}
