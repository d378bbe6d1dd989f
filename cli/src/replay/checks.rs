//! The end-of-run invariants of a replay: what every policy's run must leave behind.

use kvr::RankId;

use super::kv_cache::KvCache;
use super::policy::Router;
use super::routers::Fleet;

/// The end-of-run invariants of a router whose requests have all ended: kvr holds no
/// booking and every rank's booking counters are back to zero; no event was refused,
/// failed to decode or went missing; and (with events) the index holds exactly what each
/// rank's cache holds. `peer_expired`: how many of its bookings were peers' that expired
/// (router replicas, `routers.rs`); no other booking may expire.
pub(crate) fn router_problems(
    router: &Router,
    caches: &[(RankId, &KvCache)],
    peer_expired: u64,
) -> Vec<String> {
    let mut problems = Vec::new();
    let p = router.partition();
    if router.booked != router.freed || router.prefilled != router.booked {
        problems.push(format!(
            "{} booked, {} marked prefill-complete, {} freed",
            router.booked, router.prefilled, router.freed
        ));
    }
    if let Some(s) = p.session_stats() {
        if s.leases > 0 || s.unknown_lease_releases > 0 {
            problems.push(format!("session leases outlived their bookings: {s:?}"));
        }
    }
    let indexer = p.indexer_stats();
    if indexer.record_failures > 0 {
        problems.push(format!("recording bookings failed: {indexer:?}"));
    }
    let bookings = p.bookings();
    let stats = bookings.stats();
    if stats.expired_total != peer_expired || stats.counter_underflows > 0 {
        problems.push(format!(
            "bookings expired or counters underflowed: {stats:?}"
        ));
    }
    if !bookings.is_empty() {
        problems.push(format!("{} bookings left", bookings.len()));
    }
    let loads = bookings.loads();
    for (id, cache) in caches {
        let l = loads.get(*id);
        if !l.is_zero() {
            problems.push(format!("rank {id:?} still has load {l:?}"));
        }
        if let Err(e) = cache.check() {
            problems.push(format!("rank {id:?} cache: {e}"));
        }
    }
    if let Err(e) = bookings.audit() {
        problems.push(format!("booking audit: {e}"));
    }
    for s in p.ingress_stats() {
        let decode_errors: u64 = s.decode_errors.iter().map(|e| e.1).sum();
        if s.events_rejected + s.block_size_mismatches + decode_errors + s.sequence.gaps > 0 {
            problems.push(format!("stream {}/{}: {s:?}", s.worker_id, s.stream));
        }
    }
    if router.kind().uses_events() {
        let index = p.index().stats();
        if index.parent_not_found + index.block_not_found > 0 {
            problems.push(format!("index refused events: {index:?}"));
        }
        for (id, cache) in caches {
            let held = p.index().rank_stats(*id).map_or(0, |s| s.holder_blocks);
            if held != cache.cached() as u64 {
                problems.push(format!(
                    "rank {id:?}: index holds {held} blocks, its cache {}",
                    cache.cached()
                ));
            }
        }
    }
    problems
}

/// [`router_problems`] of every replica (named from the second on), and whether the
/// simulation's expiry sweeps freed only peers' bookings.
pub(crate) fn fleet_problems(fleet: &Fleet<'_>, caches: &[(RankId, &KvCache)]) -> Vec<String> {
    let mut problems = Vec::new();
    let stats = &fleet.stats;
    for (k, router) in fleet.routers().iter().enumerate() {
        // The simulation sweeps only at peer bookings' expiry: whatever it freed must
        // be those (a local booking expiring is a broken run).
        let expired = stats.peer_expired[k];
        if stats.swept[k] != expired {
            problems.push(format!(
                "replica {k}: the expiry sweeps freed {} bookings, {expired} of them peers'",
                stats.swept[k]
            ));
        }
        let found = router_problems(router, caches, expired);
        let named = found.into_iter().map(|p| match k {
            0 => p,
            _ => format!("replica {k}: {p}"),
        });
        problems.extend(named);
    }
    problems
}
