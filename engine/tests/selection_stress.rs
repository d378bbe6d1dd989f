//! Stress: 4 threads select-and-reserve and free 1,000,000 requests over 64 ranks while
//! KV events and load reports flow; afterwards every booking counter is exactly zero.

// A host of the engine, not engine code: the sync-facade rule (engine/clippy.toml) is
// for engine/src.
#![allow(clippy::disallowed_types)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvr::config::PartitionConfig;
use kvr::Engine;
use kvr::RankLoad;
use kvr::{Outcome, SelectRequest};
use kvr::{PartitionKey, WorkerInfo};
use kvr::{RankId, StoredBlock, Tier};

const RANKS: u64 = 64;
const BS: u32 = 16;

fn requests() -> u64 {
    if cfg!(debug_assertions) {
        20_000
    } else {
        1_000_000
    }
}

#[test]
fn four_threads_book_and_free_a_million_requests_and_every_counter_ends_at_zero() {
    let key = PartitionKey::new("m", "g");
    let engine = Arc::new(Engine::with_seed(3));
    let p = engine
        .create_partition(key.clone(), PartitionConfig::new(BS))
        .unwrap();
    for w in 0..RANKS / 2 {
        p.upsert_worker(WorkerInfo::new(w, 2)).unwrap();
    }
    // A pool of prompts sharing system-prompt prefixes.
    let prompts: Arc<Vec<Vec<u32>>> = Arc::new(
        (0..64u32)
            .map(|i| {
                let mut t: Vec<u32> = (0..128).map(|x| x + (i % 4) * 1_000).collect();
                t.extend((0..128).map(|x| x + i * 10_000 + 100_000));
                t
            })
            .collect(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    // Events: ranks store and evict prompt prefixes.
    let events = {
        let (p, prompts, stop) = (p.clone(), prompts.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            let mut local = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let rank = RankId::new(n % (RANKS / 2), (n % 2) as u32);
                let t = &prompts[(n % 64) as usize];
                p.hasher().local_hashes(t, &mut local);
                let blocks: Vec<StoredBlock> = local
                    .iter()
                    .enumerate()
                    .map(|(i, l)| StoredBlock {
                        external_hash: (n % 64) << 32 | i as u64,
                        local_hash: *l,
                    })
                    .collect();
                let _ = p.index().store(rank, Tier::Device, None, &blocks);
                if n.is_multiple_of(3) {
                    p.index().clear(rank);
                }
                n += 1;
            }
            n
        })
    };
    // Load reports.
    let loads = {
        let (p, stop) = (p.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut v = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let batch: Vec<_> = (0..RANKS)
                    .map(|r| {
                        let load = RankLoad {
                            kv_blocks_used: (v + r) % 100,
                            kv_blocks_total: 1_000,
                            ..RankLoad::default()
                        };
                        (RankId::new(r / 2, (r % 2) as u32), load)
                    })
                    .collect();
                p.load_view().publish(&batch);
                v += 1;
                std::thread::yield_now();
            }
        })
    };
    let selected = Arc::new(AtomicU64::new(0));
    let per_thread = requests() / 4;
    let workers: Vec<_> = (0..4u64)
        .map(|t| {
            let (engine, key, prompts, selected) = (
                engine.clone(),
                key.clone(),
                prompts.clone(),
                selected.clone(),
            );
            std::thread::spawn(move || {
                let mut held = std::collections::VecDeque::new();
                for i in 0..per_thread {
                    let prompt = &prompts[((i * 7 + t) % 64) as usize];
                    let req = SelectRequest::tokens(prompt);
                    match engine.select_and_reserve(&key, &req).unwrap() {
                        Outcome::Selected(d) => {
                            let id = d.selection_id.unwrap();
                            if i % 2 == 0 {
                                engine.mark_prefill_complete(id).unwrap();
                            }
                            if i % 3 == 0 {
                                engine.add_output_blocks(id, 2).unwrap();
                            }
                            held.push_back(id);
                            selected.fetch_add(1, Ordering::Relaxed);
                        }
                        other => panic!("unexpected {other:?}"),
                    }
                    // Keep up to 32 requests in flight per thread.
                    if held.len() > 32 {
                        engine.free(held.pop_front().unwrap()).unwrap();
                    }
                }
                for id in held {
                    engine.free(id).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let applied = events.join().unwrap();
    loads.join().unwrap();
    assert_eq!(selected.load(Ordering::Relaxed), per_thread * 4);
    assert!(applied > 0);
    let b = p.bookings();
    assert_eq!(b.len(), 0);
    for w in 0..RANKS / 2 {
        for d in 0..2 {
            let l = b.rank_load(RankId::new(w, d));
            assert!(l.is_zero(), "rank {w}/{d} left with {l:?}");
        }
    }
    b.audit()
        .expect("refcounts and counters recomputed from scratch agree");
    assert_eq!(b.stats().counter_underflows, 0);
}
