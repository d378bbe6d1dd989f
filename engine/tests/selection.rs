//! Selection and booking, one test per statement of seed 001 and DESIGN.md §7–8 (each
//! named after the statement it proves).

// A host of the engine, not engine code: the sync-facade rule (engine/clippy.toml) is
// for engine/src.
#![allow(clippy::disallowed_types)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvr::CostOverrides;
use std::time::{Duration, Instant};

use kvr::config::PartitionConfig;
use kvr::{Engine, EngineError};
use kvr::{FreeOutcome, FreedBy};
use kvr::{HostHooks, PartitionKey, WorkerInfo};
use kvr::{Outcome, SelectRequest, SessionContext};
use kvr::{RankId, StoredBlock, Tier};

const BS: u32 = 4;

fn key() -> PartitionKey {
    PartitionKey::new("llama", "default")
}

/// An engine with one partition of `workers` single-rank workers.
fn engine(workers: u64) -> Engine {
    engine_with(workers, PartitionConfig::new(BS))
}

fn engine_with(workers: u64, cfg: PartitionConfig) -> Engine {
    let e = Engine::with_seed(7);
    let p = e.create_partition(key(), cfg).unwrap();
    for w in 0..workers {
        p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
    }
    e
}

fn prompt(n_blocks: u32) -> Vec<u32> {
    (0..n_blocks * BS).collect()
}

/// Stores the first `blocks` blocks of `tokens` on `rank` (as the engine's events would).
fn cache_prefix(e: &Engine, rank: RankId, tokens: &[u32], blocks: usize) {
    let p = e.partition(&key()).unwrap();
    let mut local = Vec::new();
    p.hasher().local_hashes(tokens, &mut local);
    let stored: Vec<StoredBlock> = local[..blocks]
        .iter()
        .enumerate()
        .map(|(i, l)| StoredBlock {
            external_hash: 1000 + i as u64,
            local_hash: *l,
        })
        .collect();
    p.index().store(rank, Tier::Device, None, &stored).unwrap();
}

fn chosen(o: Outcome) -> kvr::Decision {
    match o {
        Outcome::Selected(d) => d,
        other => panic!("expected a selection, got {other:?}"),
    }
}

#[test]
fn the_rank_holding_the_longest_prefix_wins_when_loads_are_equal() {
    let e = engine(4);
    let t = prompt(8);
    cache_prefix(&e, RankId::new(2, 0), &t, 6);
    cache_prefix(&e, RankId::new(1, 0), &t, 2);
    let d = chosen(e.select(&key(), &SelectRequest::tokens(&t)).unwrap());
    assert_eq!(d.rank, RankId::new(2, 0));
    assert_eq!(d.overlap.device_blocks, 6);
    assert_eq!(d.cached_tokens, 6 * BS as u64);
    assert_eq!(d.projected_prefill_tokens, 2 * BS as u64);
}

#[test]
fn advisory_selection_books_nothing() {
    let e = engine(2);
    let t = prompt(4);
    for _ in 0..10 {
        let d = chosen(e.select(&key(), &SelectRequest::tokens(&t)).unwrap());
        assert_eq!(d.selection_id, None);
    }
    let p = e.partition(&key()).unwrap();
    assert_eq!(p.bookings().len(), 0);
    for w in 0..2 {
        assert_eq!(p.bookings().rank_load(RankId::new(w, 0)).active_requests, 0);
    }
}

#[test]
fn select_and_reserve_books_before_returning() {
    let e = engine(2);
    let t = prompt(4);
    let d = chosen(
        e.select_and_reserve(&key(), &SelectRequest::tokens(&t))
            .unwrap(),
    );
    let id = d.selection_id.expect("a booked decision carries its id");
    let p = e.partition(&key()).unwrap();
    assert!(p.bookings().contains(id));
    let load = p.bookings().rank_load(d.rank);
    assert_eq!(load.active_requests, 1);
    assert_eq!(load.active_prefill_tokens, d.projected_prefill_tokens);
    assert_eq!(load.active_decode_blocks, d.projected_decode_blocks);
    // The booking now steers the next request to the other rank (load balance).
    let d2 = chosen(e.select(&key(), &SelectRequest::tokens(&t)).unwrap());
    assert_ne!(d2.rank, d.rank);
    e.free(id).unwrap();
    assert_eq!(p.bookings().rank_load(d.rank).active_requests, 0);
}

#[test]
fn temperature_zero_breaks_ties_uniformly_at_random() {
    let e = engine(4);
    let t = prompt(4);
    let mut hits = [0usize; 4];
    for _ in 0..4000 {
        let d = chosen(e.select(&key(), &SelectRequest::tokens(&t)).unwrap());
        hits[d.rank.worker_id as usize] += 1;
    }
    for h in hits {
        assert!((800..1200).contains(&h), "uneven tie-break: {hits:?}");
    }
}

#[test]
fn per_request_overrides_change_the_cost() {
    let e = engine(2);
    let t = prompt(8);
    cache_prefix(&e, RankId::new(1, 0), &t, 8);
    let base = chosen(e.select(&key(), &SelectRequest::tokens(&t)).unwrap());
    let mut req = SelectRequest::tokens(&t);
    req.overrides = CostOverrides {
        overlap_score_credit: Some(0.0),
        ..CostOverrides::NONE
    };
    let no_credit = chosen(e.select(&key(), &req).unwrap());
    assert_eq!(base.rank, RankId::new(1, 0));
    assert!(
        no_credit.cost > base.cost,
        "{} vs {}",
        no_credit.cost,
        base.cost
    );
}

#[test]
fn shared_cache_lookup_runs_alongside_the_index_and_its_hits_are_reported() {
    let e = engine(1);
    let p = e.partition(&key()).unwrap();
    p.set_hooks(HostHooks {
        shared_cache: Some(Arc::new(|seq: &[u64]| Ok(vec![(0, seq.len() as u32)]))),
        ..HostHooks::default()
    });
    let d = chosen(
        e.select(&key(), &SelectRequest::tokens(&prompt(5)))
            .unwrap(),
    );
    assert_eq!(d.overlap.shared_blocks, 5);
}

#[test]
fn a_failed_shared_cache_lookup_is_counted_and_selection_proceeds_without_it() {
    let e = engine(2);
    let p = e.partition(&key()).unwrap();
    p.set_hooks(HostHooks {
        shared_cache: Some(Arc::new(|_: &[u64]| Err("cache service down".to_string()))),
        ..HostHooks::default()
    });
    let d = chosen(
        e.select(&key(), &SelectRequest::tokens(&prompt(5)))
            .unwrap(),
    );
    assert_eq!(d.overlap.shared_blocks, 0);
    assert_eq!(p.selection_stats().shared_cache_failures, 1);
}

fn lora_engine() -> Engine {
    let e = engine(0);
    let p = e.partition(&key()).unwrap();
    for w in 0..4u64 {
        let mut info = WorkerInfo::new(w, 1);
        if w >= 2 {
            info.lora_adapters = vec!["sql".into()];
        }
        p.upsert_worker(info).unwrap();
    }
    e
}

#[test]
fn lora_narrowing_never_widens_the_callers_allow_set() {
    let e = lora_engine();
    let t = prompt(4);
    let allowed = [0, 1, 2];
    let mut req = SelectRequest::tokens(&t);
    req.lora_name = Some("sql");
    req.allowed_workers = Some(&allowed);
    for _ in 0..50 {
        let d = chosen(e.select(&key(), &req).unwrap());
        assert_eq!(
            d.rank.worker_id, 2,
            "only worker 2 is both allowed and serves sql"
        );
    }
}

#[test]
fn a_lora_filter_hook_can_only_narrow() {
    let e = lora_engine();
    let p = e.partition(&key()).unwrap();
    // A filter that claims every worker, including ones the caller did not allow.
    p.set_hooks(HostHooks {
        lora_filter: Some(Arc::new(|_: &str, _: &[u64]| vec![0, 1, 2, 3, 99])),
        ..HostHooks::default()
    });
    let t = prompt(4);
    let allowed = [1];
    let mut req = SelectRequest::tokens(&t);
    req.lora_name = Some("sql");
    req.allowed_workers = Some(&allowed);
    let d = chosen(e.select(&key(), &req).unwrap());
    assert_eq!(d.rank.worker_id, 1);
}

#[test]
fn an_allowed_pin_survives_lora_narrowing() {
    let e = lora_engine();
    let t = prompt(4);
    let mut req = SelectRequest::tokens(&t);
    req.lora_name = Some("sql");
    req.pinned_worker = Some(0); // does not serve sql, but is allowed (no allow-set)
    let d = chosen(e.select(&key(), &req).unwrap());
    assert_eq!(d.rank.worker_id, 0);
}

#[test]
fn a_pinned_dp_rank_is_the_only_candidate_of_its_worker() {
    let e = Engine::with_seed(7);
    let p = e.create_partition(key(), PartitionConfig::new(BS)).unwrap();
    p.upsert_worker(WorkerInfo::new(0, 1)).unwrap();
    p.upsert_worker(WorkerInfo::new(1, 4)).unwrap();
    let t = prompt(4);
    cache_prefix(&e, RankId::new(1, 0), &t, 4); // rank 0 of worker 1 would win on cost
    let mut req = SelectRequest::tokens(&t);
    req.pinned_worker = Some(1);
    req.pinned_dp_rank = Some(2);
    for _ in 0..20 {
        assert_eq!(
            chosen(e.select(&key(), &req).unwrap()).rank,
            RankId::new(1, 2)
        );
    }
    // A rank the worker does not have leaves the pin at the worker (its best rank).
    req.pinned_dp_rank = Some(9);
    assert_eq!(
        chosen(e.select(&key(), &req).unwrap()).rank,
        RankId::new(1, 0)
    );
}

#[test]
fn an_empty_lora_narrowing_falls_back_to_the_callers_set() {
    let e = lora_engine();
    let t = prompt(4);
    let allowed = [0, 1];
    let mut req = SelectRequest::tokens(&t);
    req.lora_name = Some("sql");
    req.allowed_workers = Some(&allowed);
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..100 {
        seen.insert(chosen(e.select(&key(), &req).unwrap()).rank.worker_id);
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![0, 1]);
}

#[test]
fn the_lora_name_salts_the_prompt_hashes() {
    let e = engine(2);
    let t = prompt(4);
    cache_prefix(&e, RankId::new(1, 0), &t, 4); // cached without a LoRA salt
    let mut req = SelectRequest::tokens(&t);
    req.lora_name = Some("sql");
    let d = chosen(e.select(&key(), &req).unwrap());
    assert_eq!(
        d.overlap.device_blocks, 0,
        "an adapter's KV blocks differ from the base model's"
    );
}

#[test]
fn structured_session_context_takes_precedence_over_the_legacy_session_id() {
    let e = engine(1);
    let t = prompt(2);
    let mut req = SelectRequest::tokens(&t);
    req.legacy_session_id = Some("legacy");
    let d = chosen(e.select(&key(), &req).unwrap());
    assert_eq!(d.session.unwrap().session_id, "legacy");
    let ctx = SessionContext {
        session_id: "s-1".into(),
        parent_session_id: Some("s-0".into()),
        session_final: true,
        input_trigger: Some("tool_result".into()),
    };
    req.session = Some(ctx.clone());
    let d = chosen(e.select(&key(), &req).unwrap());
    assert_eq!(d.session, Some(ctx));
}

#[test]
fn the_availability_provider_removes_ranks_from_the_candidates() {
    let e = engine(3);
    let p = e.partition(&key()).unwrap();
    p.set_hooks(HostHooks {
        availability: Some(Arc::new(|r: RankId| r.worker_id == 2)),
        ..HostHooks::default()
    });
    for _ in 0..20 {
        let d = chosen(
            e.select(&key(), &SelectRequest::tokens(&prompt(3)))
                .unwrap(),
        );
        assert_eq!(d.rank.worker_id, 2);
    }
    p.set_hooks(HostHooks {
        availability: Some(Arc::new(|_: RankId| false)),
        ..HostHooks::default()
    });
    assert_eq!(
        e.select(&key(), &SelectRequest::tokens(&prompt(3)))
            .unwrap(),
        Outcome::NoWorker
    );
}

#[test]
fn all_ranks_overloaded_is_a_distinct_busy_outcome() {
    let e = engine(2);
    let p = e.partition(&key()).unwrap();
    p.set_hooks(HostHooks {
        overload: Some(Arc::new(|_: RankId| true)),
        ..HostHooks::default()
    });
    assert_eq!(
        e.select(&key(), &SelectRequest::tokens(&prompt(3)))
            .unwrap(),
        Outcome::Busy
    );
    assert_eq!(p.selection_stats().busy, 1);
}

#[test]
fn busy_thresholds_on_prefill_tokens_make_a_rank_busy() {
    let e = Engine::with_seed(1);
    let mut cfg = PartitionConfig::new(BS);
    cfg.busy.prefill_tokens = Some(10);
    let p = e.create_partition(key(), cfg).unwrap();
    p.upsert_worker(WorkerInfo::new(0, 1)).unwrap();
    let t = prompt(4); // 16 prefill tokens
    chosen(
        e.select_and_reserve(&key(), &SelectRequest::tokens(&t))
            .unwrap(),
    );
    assert_eq!(
        e.select(&key(), &SelectRequest::tokens(&t)).unwrap(),
        Outcome::Busy
    );
}

#[test]
fn no_candidate_is_a_distinct_no_worker_outcome() {
    let e = engine(0);
    assert_eq!(
        e.select(&key(), &SelectRequest::tokens(&prompt(3)))
            .unwrap(),
        Outcome::NoWorker
    );
    let e = engine(2);
    let allowed = [42];
    let t = prompt(3);
    let mut req = SelectRequest::tokens(&t);
    req.allowed_workers = Some(&allowed);
    assert_eq!(e.select(&key(), &req).unwrap(), Outcome::NoWorker);
}

#[test]
fn the_prefill_estimator_sets_the_projected_prefill() {
    let e = engine(1);
    let p = e.partition(&key()).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    p.set_hooks(HostHooks {
        prefill_estimator: Some(Arc::new(move |q: &kvr::PrefillQuery| {
            c.fetch_add(1, Ordering::Relaxed);
            Some(q.prompt_tokens * 2)
        })),
        ..HostHooks::default()
    });
    let d = chosen(
        e.select(&key(), &SelectRequest::tokens(&prompt(3)))
            .unwrap(),
    );
    assert_eq!(d.projected_prefill_tokens, 24);
    assert_eq!(calls.load(Ordering::Relaxed), 1);
}

#[test]
fn hooks_default_to_absent_and_selection_uses_the_prior_inputs() {
    let e = engine(2);
    let p = e.partition(&key()).unwrap();
    assert!(format!("{:?}", p.hooks()).contains("overload: false"));
    let d = chosen(
        e.select(&key(), &SelectRequest::tokens(&prompt(3)))
            .unwrap(),
    );
    assert_eq!(d.projected_prefill_tokens, 12);
}

#[test]
fn explicit_reservations_book_a_given_rank_with_or_without_tokens() {
    let e = engine(2);
    let t = prompt(4);
    let p = e.partition(&key()).unwrap();
    let req = SelectRequest::tokens(&t);
    let d = e
        .reserve(&key(), RankId::new(1, 0), Some(&req), None, None)
        .unwrap();
    assert_eq!(d.rank, RankId::new(1, 0));
    assert_eq!(p.bookings().rank_load(d.rank).active_prefill_tokens, 16);
    let d2 = e
        .reserve(&key(), RankId::new(0, 0), None, Some(100), Some(555))
        .unwrap();
    assert_eq!(d2.selection_id, Some(555));
    assert_eq!(p.bookings().rank_load(d2.rank).active_prefill_tokens, 100);
    assert_eq!(
        e.reserve(&key(), RankId::new(9, 0), None, Some(1), None)
            .unwrap_err(),
        EngineError::UnknownRank(RankId::new(9, 0))
    );
    e.free(d.selection_id.unwrap()).unwrap();
    e.free(555).unwrap();
}

#[test]
fn a_duplicate_selection_id_is_an_error_not_an_overwrite() {
    let e = engine(2);
    let t = prompt(2);
    let mut req = SelectRequest::tokens(&t);
    req.selection_id = Some(77);
    chosen(e.select_and_reserve(&key(), &req).unwrap());
    assert_eq!(
        e.select_and_reserve(&key(), &req).unwrap_err(),
        EngineError::DuplicateSelectionId(77)
    );
    let p = e.partition(&key()).unwrap();
    assert_eq!(p.bookings().len(), 1);
}

#[test]
fn lifecycle_calls_on_an_unknown_id_are_a_clear_error() {
    let e = engine(1);
    assert_eq!(
        e.free(12345).unwrap_err(),
        EngineError::UnknownSelectionId(12345)
    );
    assert_eq!(
        e.mark_prefill_complete(12345).unwrap_err(),
        EngineError::UnknownSelectionId(12345)
    );
    assert_eq!(
        e.add_output_blocks(12345, 1).unwrap_err(),
        EngineError::UnknownSelectionId(12345)
    );
    assert!(EngineError::UnknownSelectionId(12345)
        .to_string()
        .contains("12345"));
}

#[test]
fn lifecycle_calls_reach_the_booking_and_are_idempotent() {
    let e = engine(1);
    let t = prompt(4);
    let d = chosen(
        e.select_and_reserve(&key(), &SelectRequest::tokens(&t))
            .unwrap(),
    );
    let id = d.selection_id.unwrap();
    let p = e.partition(&key()).unwrap();
    e.mark_prefill_complete(id).unwrap();
    e.mark_prefill_complete(id).unwrap();
    assert_eq!(p.bookings().rank_load(d.rank).active_prefill_tokens, 0);
    e.add_output_blocks(id, 3).unwrap();
    assert_eq!(p.bookings().rank_load(d.rank).active_decode_blocks, 4 + 3);
    e.free(id).unwrap();
    let l = p.bookings().rank_load(d.rank);
    assert_eq!(
        (
            l.active_requests,
            l.active_decode_blocks,
            l.active_prefill_tokens
        ),
        (0, 0, 0)
    );
}

#[test]
fn the_id_index_answers_first_and_a_partition_scan_finds_replica_bookings() {
    let e = engine(1);
    let other = PartitionKey::new("mistral", "default");
    let p2 = e
        .create_partition(other.clone(), PartitionConfig::new(BS))
        .unwrap();
    p2.upsert_worker(WorkerInfo::new(5, 1)).unwrap();
    e.install_replica_booking(
        &other,
        kvr::BookingRequest {
            selection_id: 9_000,
            rank: RankId::new(5, 0),
            prompt_blocks: vec![1, 2, 3],
            prefill_tokens: 12,
            expected_output_tokens: 0,
            ttl: None,
        },
    )
    .unwrap();
    // Not in the id index (a peer booked it), found by the scan.
    e.mark_prefill_complete(9_000).unwrap();
    assert_eq!(
        p2.bookings()
            .rank_load(RankId::new(5, 0))
            .active_prefill_tokens,
        0
    );
    e.free(9_000).unwrap();
    assert!(!p2.bookings().contains(9_000));
}

#[test]
fn workers_come_and_go_while_selections_run() {
    let e = Arc::new(engine(4));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let e = e.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let p = e.partition(&key()).unwrap();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                p.upsert_worker(WorkerInfo::new(100 + n % 8, 2)).unwrap();
                p.remove_worker(100 + (n + 4) % 8);
                n += 1;
            }
        })
    };
    let t = prompt(6);
    for _ in 0..5_000 {
        let d = chosen(
            e.select_and_reserve(&key(), &SelectRequest::tokens(&t))
                .unwrap(),
        );
        let _ = e.free(d.selection_id.unwrap());
    }
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
}

#[test]
fn prompt_blocks_already_active_on_a_rank_add_no_decode_load_there() {
    // Rank 0 runs this very prompt (prefill done): its 16 blocks are active there, so
    // another copy adds no decode blocks. Rank 1 runs a different 8-block prompt. Dynamo's
    // costs: rank 0 = 16 prefill + 16 active + 0 new = 32; rank 1 = 16 + 8 + 16 new = 40.
    let e = engine_with(
        2,
        PartitionConfig {
            cost: kvr::config::CostConfig::dynamo(),
            ..PartitionConfig::new(BS)
        },
    );
    let t = prompt(16);
    let other: Vec<u32> = (10_000..10_000 + 8 * BS).collect();
    let a = e
        .reserve(
            &key(),
            RankId::new(0, 0),
            Some(&SelectRequest::tokens(&t)),
            None,
            None,
        )
        .unwrap();
    let b = e
        .reserve(
            &key(),
            RankId::new(1, 0),
            Some(&SelectRequest::tokens(&other)),
            None,
            None,
        )
        .unwrap();
    e.mark_prefill_complete(a.selection_id.unwrap()).unwrap();
    e.mark_prefill_complete(b.selection_id.unwrap()).unwrap();
    for _ in 0..20 {
        let d = chosen(e.select(&key(), &SelectRequest::tokens(&t)).unwrap());
        assert_eq!(d.rank, RankId::new(0, 0));
        assert_eq!(d.projected_decode_blocks, 16);
        assert!((d.cost - 32.0).abs() < 1e-9, "cost {}", d.cost);
    }
}

#[test]
fn a_minted_selection_id_skips_ids_callers_have_taken() {
    let e = engine(2);
    let t = prompt(4);
    let next = e.mint_selection_id() + 1;
    let mut mine = SelectRequest::tokens(&t);
    mine.selection_id = Some(next);
    chosen(e.select_and_reserve(&key(), &mine).unwrap());
    // The next minted id would be `next`: the engine skips it instead of failing.
    let d = chosen(
        e.select_and_reserve(&key(), &SelectRequest::tokens(&t))
            .unwrap(),
    );
    assert_ne!(d.selection_id, Some(next));
    let r = e
        .reserve(&key(), RankId::new(0, 0), None, Some(1), None)
        .unwrap();
    assert_ne!(r.selection_id, Some(next));
    // A caller's own id stays a duplicate.
    assert_eq!(
        e.select_and_reserve(&key(), &mine),
        Err(EngineError::DuplicateSelectionId(next))
    );
}

#[test]
fn selection_ids_are_unique_across_the_engine_for_replica_bookings_too() {
    let e = engine(2);
    let other = PartitionKey::new("other", "default");
    let q = e
        .create_partition(other.clone(), PartitionConfig::new(BS))
        .unwrap();
    q.upsert_worker(WorkerInfo::new(9, 1)).unwrap();
    let t = prompt(4);
    let local = chosen(
        e.select_and_reserve(&key(), &SelectRequest::tokens(&t))
            .unwrap(),
    )
    .selection_id
    .unwrap();
    let replica = |id| kvr::BookingRequest {
        selection_id: id,
        rank: RankId::new(9, 0),
        prompt_blocks: vec![1, 2],
        prefill_tokens: 8,
        expected_output_tokens: 0,
        ttl: None,
    };
    assert_eq!(
        e.install_replica_booking(&other, replica(local)),
        Err(EngineError::DuplicateSelectionId(local)),
        "an id live as a local booking elsewhere"
    );
    e.install_replica_booking(&other, replica(5_000)).unwrap();
    // A replica booking names a registered rank of the partition it is installed in.
    e.partition(&key())
        .unwrap()
        .upsert_worker(WorkerInfo::new(9, 1))
        .unwrap();
    assert_eq!(
        e.install_replica_booking(&key(), replica(5_000)),
        Err(EngineError::DuplicateSelectionId(5_000)),
        "an id live as a replica booking in another partition"
    );
    assert!(matches!(e.free(5_000), Ok(FreeOutcome::Freed(_))));
    assert!(matches!(e.free(local), Ok(FreeOutcome::Freed(_))));
}

#[test]
fn a_hook_may_select_again_from_inside_a_selection() {
    let e = Arc::new(engine(2));
    let inner = Arc::downgrade(&e);
    let nested = Arc::new(AtomicUsize::new(0));
    let seen = nested.clone();
    let p = e.partition(&key()).unwrap();
    p.set_hooks(HostHooks {
        availability: Some(Arc::new(move |_: RankId| {
            if let Some(e) = inner.upgrade() {
                if seen.fetch_add(1, Ordering::Relaxed) == 0 {
                    let t = prompt(2);
                    chosen(e.select(&key(), &SelectRequest::tokens(&t)).unwrap());
                }
            }
            true
        })),
        ..HostHooks::default()
    });
    let t = prompt(4);
    chosen(e.select(&key(), &SelectRequest::tokens(&t)).unwrap());
    assert!(
        nested.load(Ordering::Relaxed) >= 2,
        "the hook ran, and again inside"
    );
    p.set_hooks(HostHooks::default());
}

#[test]
fn each_engine_keeps_its_own_seeded_tie_breaks_on_a_shared_thread() {
    let picks = |e: &Engine| -> Vec<u64> {
        let t = prompt(4);
        (0..64)
            .map(|_| {
                chosen(e.select(&key(), &SelectRequest::tokens(&t)).unwrap())
                    .rank
                    .worker_id
            })
            .collect()
    };
    let alone = std::thread::spawn(move || {
        let b = Engine::with_seed(99);
        let p = b.create_partition(key(), PartitionConfig::new(BS)).unwrap();
        for w in 0..8 {
            p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
        }
        picks(&b)
    })
    .join()
    .unwrap();
    let shared = std::thread::spawn(move || {
        let a = engine(8); // seed 7, selects first on this thread
        picks(&a);
        let b = Engine::with_seed(99);
        let p = b.create_partition(key(), PartitionConfig::new(BS)).unwrap();
        for w in 0..8 {
            p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
        }
        picks(&b)
    })
    .join()
    .unwrap();
    assert_eq!(
        alone, shared,
        "engine 99's choices depend on another engine"
    );
}

/// Books and frees enough other (minted) ids that every shard of the partition's table
/// forgets what it freed before (its recently-freed memory is bounded).
fn churn_recently_freed(e: &Engine) {
    for _ in 0..40_000 {
        let d = e
            .reserve(&key(), RankId::new(0, 0), None, Some(1), None)
            .unwrap();
        e.free(d.selection_id.unwrap()).unwrap();
    }
}

#[test]
fn ids_of_bookings_that_vanish_without_a_free_can_be_used_again() {
    let e = engine(2);
    let t = prompt(4);
    let p = e.partition(&key()).unwrap();
    // 1. The booking's rank leaves the partition.
    let mut r77 = SelectRequest::tokens(&t);
    r77.selection_id = Some(77);
    r77.pinned_worker = Some(1);
    chosen(e.select_and_reserve(&key(), &r77).unwrap());
    assert!(p.remove_worker(1));
    p.upsert_worker(WorkerInfo::new(1, 1)).unwrap();
    assert!(matches!(
        e.free(77),
        Ok(FreeOutcome::AlreadyFreed(FreedBy::RankRemoved))
    ));
    // 2. It expires and the sweep frees it.
    let mut r78 = SelectRequest::tokens(&t);
    r78.selection_id = Some(78);
    r78.ttl = Some(Duration::from_millis(1));
    chosen(e.select_and_reserve(&key(), &r78).unwrap());
    assert_eq!(
        p.bookings()
            .sweep_expired(Instant::now() + Duration::from_secs(1)),
        1
    );
    assert_eq!(
        e.select_and_reserve(&key(), &r78),
        Err(EngineError::DuplicateSelectionId(78)),
        "while the table remembers 78 as freed, it stays taken (idempotent frees)"
    );
    // Once the table has forgotten them, the ids are unknown and free to book again.
    churn_recently_freed(&e);
    for (id, r) in [(77, &r77), (78, &r78)] {
        assert_eq!(e.free(id), Err(EngineError::UnknownSelectionId(id)));
        let d = chosen(e.select_and_reserve(&key(), r).unwrap());
        assert_eq!(d.selection_id, Some(id));
        assert!(matches!(e.free(id), Ok(FreeOutcome::Freed(_))));
    }
    // 3. Its partition is removed: the id is unknown at once and free in a new partition.
    let mut r79 = SelectRequest::tokens(&t);
    r79.selection_id = Some(79);
    chosen(e.select_and_reserve(&key(), &r79).unwrap());
    assert!(e.remove_partition(&key()));
    assert_eq!(e.free(79), Err(EngineError::UnknownSelectionId(79)));
    let p2 = e.create_partition(key(), PartitionConfig::new(BS)).unwrap();
    p2.upsert_worker(WorkerInfo::new(0, 1)).unwrap();
    chosen(e.select_and_reserve(&key(), &r79).unwrap());
    assert!(matches!(e.free(79), Ok(FreeOutcome::Freed(_))));
}

#[test]
fn an_unsorted_allow_set_with_repeats_and_strangers_narrows_to_its_workers() {
    let e = engine(6);
    let t = prompt(3);
    let allowed = [5, 2, 5, 77, 2, 0];
    let mut req = SelectRequest::tokens(&t);
    req.allowed_workers = Some(&allowed);
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..200 {
        seen.insert(chosen(e.select(&key(), &req).unwrap()).rank.worker_id);
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![0, 2, 5]);
    // A pin inside that set wins; one outside it does not survive.
    req.pinned_worker = Some(5);
    assert_eq!(chosen(e.select(&key(), &req).unwrap()).rank.worker_id, 5);
    req.pinned_worker = Some(3);
    for _ in 0..50 {
        let w = chosen(e.select(&key(), &req).unwrap()).rank.worker_id;
        assert!([0, 2, 5].contains(&w), "chose {w}, outside the allow-set");
    }
}

#[test]
fn a_lora_filter_answer_in_any_order_narrows_to_what_it_names() {
    let e = lora_engine();
    let p = e.partition(&key()).unwrap();
    p.set_hooks(HostHooks {
        lora_filter: Some(Arc::new(|_: &str, _: &[u64]| vec![3, 99, 1, 3])),
        ..HostHooks::default()
    });
    let t = prompt(4);
    let mut req = SelectRequest::tokens(&t);
    req.lora_name = Some("sql");
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..200 {
        seen.insert(chosen(e.select(&key(), &req).unwrap()).rank.worker_id);
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![1, 3]);
}
