//! The simulator's invariants on small generated workloads, for every policy, and
//! negative controls showing the invariant checks catch what they claim to.

use kvr_emulator::BatchEncoder;

use super::policy::PolicyKind;
use super::sim::{self, router_problems, SimConfig};
use super::workload::{generate, GeneratorConfig, Request, Workload, UNIQUE_CONTENT};
use super::{oracle_hit_rate, router_for};

/// A small cluster that must evict: 3 workers × 2 DP ranks, 32-token blocks, room for
/// a few conversations per rank.
pub(super) fn small_cluster(w: &Workload) -> SimConfig {
    let mut cfg = SimConfig {
        workers: 3,
        dp_size: 2,
        kv_blocks: 0,
        block_size: 32,
        prefill_rate: 8_000.0,
        prefill_overhead_ms: 2.0,
        tpot_ms: 10.0,
        batch_slowdown: 0.02,
        max_running: 8,
        max_batched_tokens: 2_048,
        event_delay_ms: 15.0,
        speed: 4.0,
        seed: 9,
        cost: kvr::config::CostConfig::default(),
        prediction_ttl_ms: 500.0,
        affinity: None,
        slow: None,
    };
    let biggest = w
        .requests
        .iter()
        .map(|r| cfg.blocks_needed(r.input_tokens, r.output_tokens))
        .max()
        .unwrap();
    cfg.kv_blocks = biggest + biggest / 2;
    cfg
}

pub(super) fn small_workload() -> Workload {
    generate(&GeneratorConfig {
        seed: 3,
        sessions: 80,
        session_rate: 4.0,
        ..GeneratorConfig::default()
    })
}

#[test]
fn every_policy_books_and_frees_every_request_and_keeps_the_index_exact() {
    let w = small_workload();
    let cfg = small_cluster(&w);
    let n = w.requests.len() as u64;
    for kind in PolicyKind::ALL {
        let mut router = router_for(kind, &cfg);
        let mut arrivals = 0;
        let (r, caches) = sim::run_keeping_caches(&cfg, &w, &mut router, || arrivals += 1);
        let name = kind.name();
        assert!(r.problems.is_empty(), "{name}: {:#?}", r.problems);
        assert_eq!(arrivals, n, "{name}");
        assert_eq!(
            (router.booked, router.prefilled, router.freed),
            (n, n, n),
            "{name}"
        );
        assert_eq!(r.ttft_ms.len() as u64, n, "{name}");
        assert_eq!(r.select_ns.len() as u64, n, "{name}");
        assert!(
            r.ttft_ms.iter().all(|t| *t >= cfg.prefill_overhead_ms),
            "{name}"
        );
        assert!(
            r.cached_tokens > 0 && r.cached_tokens < r.prompt_tokens,
            "{name}"
        );
        assert!(r.evictions > 0, "{name}: the cluster is meant to evict");
        assert_eq!(r.prefill_tokens_per_rank.len(), 6);
        assert_eq!(r.requests_per_rank.iter().sum::<u64>(), n, "{name}");
        assert_eq!(
            r.prefill_tokens_per_rank.iter().sum::<u64>(),
            r.prompt_tokens - r.cached_tokens,
            "{name}: every uncached prompt token is prefilled once"
        );
        if kind.uses_events() {
            assert!(r.events_applied > 0 && r.blocks_applied > 0, "{name}");
            // Stored and removed blocks all reached the index; what is left is exact.
            let held: u64 = caches.iter().map(|(_, c)| c.cached() as u64).sum();
            assert_eq!(r.index.holder_blocks, held, "{name}");
        } else {
            assert_eq!(r.events_applied, 0, "{name}: events are off");
        }
        // The checker run again from outside agrees.
        let refs: Vec<_> = caches.iter().map(|(id, c)| (*id, c)).collect();
        assert!(router_problems(&router, &refs, 0).is_empty(), "{name}");
    }
}

#[test]
fn session_affinity_keeps_every_invariant_and_steers_conversations_home() {
    let w = small_workload();
    let mut cfg = small_cluster(&w);
    let sessions = w.requests.iter().filter(|r| r.follows.is_none()).count() as u64;
    let later_turns = w.requests.len() as u64 - sessions;
    for mode in [
        kvr::config::AffinityMode::Hard,
        kvr::config::AffinityMode::Soft {
            penalty_blocks: 1e6,
        },
    ] {
        cfg.affinity = Some(mode);
        let mut router = router_for(PolicyKind::Kvr, &cfg);
        let (r, caches) = sim::run_keeping_caches(&cfg, &w, &mut router, || {});
        assert!(r.problems.is_empty(), "{mode:?}: {:?}", r.problems);
        let s = router.partition().session_stats().expect("a session table");
        assert_eq!(s.leases, 0, "{mode:?}");
        assert!(s.bindings_created > 0, "{mode:?}");
        // Conversations stay home: far fewer rebinds than later turns (each turn after the
        // first would rebind if affinity did not steer it).
        assert!(
            s.rebinds + s.forced_rebinds < later_turns / 4,
            "{mode:?}: {s:?}, {later_turns} later turns"
        );
        let refs: Vec<_> = caches.iter().map(|(id, c)| (*id, c)).collect();
        assert!(router_problems(&router, &refs, 0).is_empty());
    }
}

#[test]
fn cache_aware_policies_hit_more_than_cache_blind_ones() {
    let w = small_workload();
    let cfg = small_cluster(&w);
    let hit = |kind| {
        let mut router = router_for(kind, &cfg);
        let r = sim::run(&cfg, &w, &mut router, || {});
        r.cached_tokens as f64 / r.prompt_tokens as f64
    };
    let (kvr, rr, oracle) = (
        hit(PolicyKind::Kvr),
        hit(PolicyKind::RoundRobin),
        oracle_hit_rate(&w, cfg.block_size),
    );
    assert!(kvr > rr, "kvr {kvr} vs round-robin {rr}");
    assert!(oracle >= kvr, "oracle {oracle} vs kvr {kvr}");
}

#[test]
fn runs_are_deterministic_in_the_seed() {
    let w = small_workload();
    let cfg = small_cluster(&w);
    for kind in [PolicyKind::Kvr, PolicyKind::Random, PolicyKind::Sglang] {
        let a = sim::run(&cfg, &w, &mut router_for(kind, &cfg), || {});
        let b = sim::run(&cfg, &w, &mut router_for(kind, &cfg), || {});
        assert_eq!(a.ttft_ms, b.ttft_ms, "{}", kind.name());
        assert_eq!(a.cached_tokens, b.cached_tokens);
        assert_eq!(a.prefill_tokens_per_rank, b.prefill_tokens_per_rank);
    }
}

#[test]
fn the_checks_catch_a_booking_never_freed() {
    let w = small_workload();
    let cfg = small_cluster(&w);
    let mut router = router_for(PolicyKind::Kvr, &cfg);
    let (r, caches) = sim::run_keeping_caches(&cfg, &w, &mut router, || {});
    assert!(r.problems.is_empty());
    let mut tokens = Vec::new();
    w.requests[0].tokens_into(&mut tokens);
    router
        .route(
            &tokens,
            10,
            None,
            std::time::Instant::now() + std::time::Duration::from_secs(3_600),
        )
        .unwrap();
    let refs: Vec<_> = caches.iter().map(|(id, c)| (*id, c)).collect();
    let p = router_problems(&router, &refs, 0);
    assert!(
        p.iter().any(|m| m.contains("bookings left")) && p.iter().any(|m| m.contains("booked")),
        "{p:?}"
    );
}

/// Runs kvr on the small workload, then hands its partition one `Cleared` batch of
/// (`worker`, `stream`) numbered `skip` past the stream's last, and returns what the
/// end-of-run checks say.
fn problems_after_a_stray_batch(worker: u64, stream: u32, skip: u64) -> Vec<String> {
    let w = small_workload();
    let cfg = small_cluster(&w);
    let mut router = router_for(PolicyKind::Kvr, &cfg);
    let (r, caches) = sim::run_keeping_caches(&cfg, &w, &mut router, || {});
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    let payload = BatchEncoder::new().cleared().finish(0.0, Some(stream));
    let p = router.partition();
    let last = p
        .ingress_stats()
        .iter()
        .find(|s| s.worker_id == worker && s.stream == stream)
        .and_then(|s| s.sequence.last_seq)
        .unwrap();
    p.ingest(worker, stream, b"kv-events", last + skip, &payload);
    let refs: Vec<_> = caches.iter().map(|(id, c)| (*id, c)).collect();
    router_problems(&router, &refs, 0)
}

#[test]
fn the_checks_catch_an_index_that_drifted_from_the_caches() {
    // An engine restart the simulator did not model: rank (0, 1) is cleared.
    let p = problems_after_a_stray_batch(0, 1, 1);
    assert!(
        p.iter().any(|m| m.contains("index holds 0 blocks")),
        "{p:?}"
    );
}

#[test]
fn the_checks_catch_a_lost_event_batch() {
    // Seq last + 3: two batches went missing.
    let p = problems_after_a_stray_batch(1, 0, 3);
    assert!(p.iter().any(|m| m.contains("stream 1/0")), "{p:?}");
}

#[test]
fn oracle_counts_leading_blocks_seen_before() {
    let req = |segments: Vec<(u64, u32)>| Request {
        arrival_ms: 0.0,
        input_tokens: segments.iter().map(|s| s.1).sum(),
        segments,
        output_tokens: 1,
        session: None,
        output_content: UNIQUE_CONTENT,
        follows: None,
    };
    let w = Workload {
        name: "t".into(),
        // 64 + 100, then the same 64 + 100 extended: with 32-token blocks the second
        // request's first 5 blocks (160 tokens) were computed by the first.
        requests: vec![req(vec![(1, 64), (2, 100)]), req(vec![(1, 64), (2, 200)])],
        params: Vec::new(),
    };
    let got = oracle_hit_rate(&w, 32);
    assert!((got - 160.0 / 428.0).abs() < 1e-12, "{got}");
    // A prompt seen before in full still recomputes the block of its last token.
    let again = Workload {
        requests: vec![req(vec![(5, 64)]), req(vec![(5, 64)])],
        ..w
    };
    assert_eq!(oracle_hit_rate(&again, 32), 32.0 / 128.0);
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_block() {
    let one = Request {
        arrival_ms: 0.0,
        segments: vec![(9, 256)],
        input_tokens: 256,
        output_tokens: 4,
        session: None,
        output_content: UNIQUE_CONTENT,
        follows: None,
    };
    let second = Request {
        arrival_ms: 5_000.0,
        ..one.clone()
    };
    let w = Workload {
        name: "t".into(),
        requests: vec![one, second],
        params: Vec::new(),
    };
    let mut cfg = small_cluster(&w);
    cfg.workers = 1;
    cfg.dp_size = 1;
    let r = sim::run(&cfg, &w, &mut router_for(PolicyKind::Kvr, &cfg), || {});
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(r.cached_tokens, 256 - 32, "all but the last block");
    assert_eq!(r.prefill_tokens_per_rank, vec![256 + 32]);
}

#[test]
fn slow_workers_take_longer_from_their_start_time_on() {
    use super::slow::SlowWorkers;
    let w = small_workload();
    let base = small_cluster(&w);
    let run = |slow: Option<SlowWorkers>| {
        let cfg = SimConfig {
            slow,
            ..base.clone()
        };
        let r = sim::run(
            &cfg,
            &w,
            &mut router_for(PolicyKind::RoundRobin, &cfg),
            || {},
        );
        assert!(r.problems.is_empty(), "{:#?}", r.problems);
        r
    };
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let alike = run(None);
    let all_slow = run(Some(SlowWorkers {
        workers: 3,
        factor: 3.0,
        from_ms: 0.0,
    }));
    assert!(
        median(&all_slow.tpot_ms) > 2.5 * median(&alike.tpot_ms),
        "tokens of 3x slower workers: {} against {} ms",
        median(&all_slow.tpot_ms),
        median(&alike.tpot_ms)
    );
    // Slow only after the run has ended: the same run, figure for figure.
    let later = run(Some(SlowWorkers {
        workers: 3,
        factor: 3.0,
        from_ms: 1e12,
    }));
    assert_eq!(later.ttft_ms, alike.ttft_ms);
    assert_eq!(later.tpot_ms, alike.tpot_ms);
}
