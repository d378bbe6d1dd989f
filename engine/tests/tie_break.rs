//! The host's tie-break hook: asked only when ranks tie at the lowest cost at temperature
//! 0, its answer taken when it names one of the tied ranks, a uniform random choice
//! otherwise.

// A host of the engine, not engine code: the sync-facade rule (engine/clippy.toml) is
// for engine/src.
#![allow(clippy::disallowed_types)]

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvr::config::PartitionConfig;
use kvr::{CostOverrides, Engine, HostHooks, Outcome, PartitionKey, RankId, SelectRequest};
use kvr::{StoredBlock, Tier, WorkerInfo};

const BS: u32 = 4;

fn key() -> PartitionKey {
    PartitionKey::new("llama", "default")
}

fn engine(workers: u64) -> Engine {
    let e = Engine::with_seed(11);
    let p = e.create_partition(key(), PartitionConfig::new(BS)).unwrap();
    for w in 0..workers {
        p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
    }
    e
}

fn worker(o: Outcome) -> u64 {
    match o {
        Outcome::Selected(d) => d.rank.worker_id,
        other => panic!("expected a selection, got {other:?}"),
    }
}

/// Installs a tie-break that answers `answer(ranks, tied)` and counts its calls.
fn hook(
    e: &Engine,
    answer: impl Fn(&[RankId], &[usize]) -> Option<usize> + Send + Sync + 'static,
) -> Arc<AtomicUsize> {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    e.partition(&key()).unwrap().set_hooks(HostHooks {
        tie_break: Some(Arc::new(move |ranks: &[RankId], tied: &[usize]| {
            c.fetch_add(1, Ordering::Relaxed);
            assert!(tied.len() > 1, "asked without a tie");
            assert!(
                tied.windows(2).all(|w| w[0] < w[1]),
                "tied positions ascending"
            );
            answer(ranks, tied)
        })),
        ..HostHooks::default()
    });
    calls
}

#[test]
fn the_hook_takes_one_of_the_ranks_tied_at_the_lowest_cost() {
    let e = engine(4);
    let calls = hook(&e, |ranks, tied| {
        tied.iter().copied().max_by_key(|&k| ranks[k].worker_id)
    });
    let t: Vec<u32> = (0..4 * BS).collect();
    // Idle: all four tie, and the hook's choice (the highest worker) is taken every time.
    for _ in 0..20 {
        assert_eq!(
            worker(e.select(&key(), &SelectRequest::tokens(&t)).unwrap()),
            3
        );
    }
    assert_eq!(calls.load(Ordering::Relaxed), 20);
    // A rank holding the prompt is cheaper than the rest: no tie, the hook is not asked.
    let p = e.partition(&key()).unwrap();
    let mut local = Vec::new();
    p.hasher().local_hashes(&t, &mut local);
    let stored: Vec<StoredBlock> = (local.iter().enumerate())
        .map(|(i, &l)| StoredBlock {
            external_hash: 500 + i as u64,
            local_hash: l,
        })
        .collect();
    p.index()
        .store(RankId::new(1, 0), Tier::Device, None, &stored)
        .unwrap();
    assert_eq!(
        worker(e.select(&key(), &SelectRequest::tokens(&t)).unwrap()),
        1
    );
    assert_eq!(calls.load(Ordering::Relaxed), 20);
}

#[test]
fn an_answer_outside_the_tie_falls_back_to_a_uniform_choice() {
    for answer in [None, Some(99)] {
        let e = engine(4);
        let calls = hook(&e, move |_, _| answer);
        let t: Vec<u32> = (0..4 * BS).collect();
        let seen: BTreeSet<u64> = (0..200)
            .map(|_| worker(e.select(&key(), &SelectRequest::tokens(&t)).unwrap()))
            .collect();
        assert_eq!(
            seen.len(),
            4,
            "answer {answer:?}: every tied rank is chosen sometimes"
        );
        assert_eq!(calls.load(Ordering::Relaxed), 200);
    }
}

#[test]
fn the_hook_is_not_asked_above_temperature_zero() {
    let e = engine(4);
    let calls = hook(&e, |_, tied| Some(tied[0]));
    let t: Vec<u32> = (0..4 * BS).collect();
    let mut req = SelectRequest::tokens(&t);
    req.overrides = CostOverrides {
        temperature: Some(0.5),
        ..CostOverrides::default()
    };
    for _ in 0..20 {
        worker(e.select(&key(), &req).unwrap());
    }
    assert_eq!(calls.load(Ordering::Relaxed), 0);
}
