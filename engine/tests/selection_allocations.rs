//! "Nothing allocated on the routing path" (DESIGN.md §11): once a thread has warmed up,
//! an advisory selection (tokens or local hashes in, decision out), a booked selection
//! and its free, and an index lookup allocate nothing — at real sizes: 16, 65, 256 and
//! 1,024 ranks, prompts of 1, 257 and 4,096 blocks (past every inline buffer), and a
//! fleet of 1,024 workers of 8 data-parallel ranks (8,192 candidates), with and without
//! an allow-set or a LoRA adapter narrowing them. Counted by a global allocator that
//! counts this thread's allocations.
//!
//! The tests run one at a time: epoch reclamation is global, so a thread that pins may
//! retire (and allocate for) garbage another test's thread just made.

// A host of the engine, not engine code: the sync-facade rule (engine/clippy.toml) is
// for engine/src.
#![allow(clippy::disallowed_types)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvr::config::PartitionConfig;
use kvr::Engine;
use kvr::{Outcome, SelectRequest};
use kvr::{OverlapScores, TieredScores};
use kvr::{PartitionKey, WorkerInfo};
use kvr::{RankId, StoredBlock, Tier};

struct Counting;

std::thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; the counter is a
// thread-local `Cell` of a `Copy` integer, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract for `alloc` is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout (every path above).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract for `realloc` is passed on unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Held by every test of this file, so no other test makes epoch garbage meanwhile.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn allocations_in(f: impl FnOnce()) -> u64 {
    let before = ALLOCS.with(|c| c.get());
    f();
    ALLOCS.with(|c| c.get()) - before
}

const BS: u32 = 16;

/// 64 single-rank workers; rank `w` holds the first `w % 16 + 1` blocks of a 256-token
/// prompt.
fn engine_with_cached_prefixes() -> (Engine, PartitionKey, Vec<u32>) {
    engine_of(64, 16, |w| w as usize % 16 + 1)
}

/// An engine of `ranks` single-rank workers and a prompt of `blocks` blocks, of which
/// rank `w` holds the first `held(w)` on its device.
fn engine_of(
    ranks: u64,
    blocks: usize,
    held: impl Fn(u64) -> usize,
) -> (Engine, PartitionKey, Vec<u32>) {
    let e = Engine::with_seed(3);
    let key = PartitionKey::new("m", "g");
    let p = e
        .create_partition(key.clone(), PartitionConfig::new(BS))
        .unwrap();
    for w in 0..ranks {
        p.upsert_worker(WorkerInfo::new(w, 1)).unwrap();
    }
    let tokens: Vec<u32> = (0..(blocks as u32) * BS).collect();
    let mut local = Vec::new();
    p.hasher().local_hashes(&tokens, &mut local);
    for w in 0..ranks {
        let stored: Vec<StoredBlock> = local[..held(w)]
            .iter()
            .enumerate()
            .map(|(i, &h)| StoredBlock {
                external_hash: 100_000 * w + i as u64,
                local_hash: h,
            })
            .collect();
        p.index()
            .store(RankId::new(w, 0), Tier::Device, None, &stored)
            .unwrap();
    }
    (e, key, tokens)
}

#[test]
fn advisory_selection_allocates_nothing_after_warm_up() {
    let _serial = one_at_a_time();
    let (e, key, tokens) = engine_with_cached_prefixes();
    let p = e.partition(&key).unwrap();
    let req = SelectRequest::tokens(&tokens);
    for _ in 0..3 {
        assert!(matches!(e.select(&p, &req), Ok(Outcome::Selected(_))));
    }
    let n = allocations_in(|| {
        for _ in 0..100 {
            let out = e.select(&p, &req).unwrap();
            assert!(matches!(out, Outcome::Selected(_)));
        }
    });
    assert_eq!(n, 0, "100 advisory selections allocated {n} times");
}

#[test]
fn advisory_selection_by_local_hashes_allocates_nothing_after_warm_up() {
    let _serial = one_at_a_time();
    let (e, key, tokens) = engine_with_cached_prefixes();
    let p = e.partition(&key).unwrap();
    let mut local = Vec::new();
    p.hasher().local_hashes(&tokens, &mut local);
    let req = SelectRequest::local_hashes(&local, tokens.len() as u64);
    for _ in 0..3 {
        e.select(&p, &req).unwrap();
    }
    let n = allocations_in(|| {
        for _ in 0..100 {
            e.select(&p, &req).unwrap();
        }
    });
    assert_eq!(n, 0, "100 advisory selections allocated {n} times");
}

#[test]
fn tiered_lookup_into_a_reused_buffer_allocates_nothing() {
    let _serial = one_at_a_time();
    let (e, key, tokens) = engine_with_cached_prefixes();
    let p = e.partition(&key).unwrap();
    let mut local = Vec::new();
    p.hasher().local_hashes(&tokens, &mut local);
    let mut out = TieredScores::new();
    p.index().find_matches_tiered_into(&local, &mut out);
    let n = allocations_in(|| {
        for _ in 0..100 {
            p.index().find_matches_tiered_into(&local, &mut out);
        }
    });
    assert_eq!(out.len(), 64);
    assert_eq!(n, 0, "100 lookups allocated {n} times");
}

#[test]
fn device_lookup_into_a_reused_buffer_allocates_nothing() {
    let _serial = one_at_a_time();
    let (e, key, tokens) = engine_with_cached_prefixes();
    let p = e.partition(&key).unwrap();
    let mut local = Vec::new();
    p.hasher().local_hashes(&tokens, &mut local);
    let mut out = kvr::OverlapScores::new();
    p.index().find_matches_into(&local, &mut out);
    let n = allocations_in(|| {
        for _ in 0..100 {
            p.index().find_matches_into(&local, &mut out);
        }
    });
    assert_eq!(out.len(), 64);
    assert_eq!(n, 0, "100 lookups allocated {n} times");
}

/// The real sizes: ranks × prompt blocks, past every inline buffer.
const SIZES: [(u64, usize); 12] = [
    (16, 1),
    (16, 257),
    (16, 4_096),
    (65, 1),
    (65, 257),
    (65, 4_096),
    (256, 1),
    (256, 257),
    (256, 4_096),
    (1_024, 1),
    (1_024, 257),
    (1_024, 4_096),
];

/// `engine_of` at a real size: rank 0 holds the whole prompt (so lookups walk all of
/// it), every other rank a short prefix.
fn engine_at(ranks: u64, blocks: usize) -> (Engine, PartitionKey, Vec<u32>) {
    engine_of(ranks, blocks, |w| {
        if w == 0 {
            blocks
        } else {
            1 + (w as usize % 8).min(blocks - 1)
        }
    })
}

/// Allocations per step over 20 rounds after `warm` rounds: `round` runs one round,
/// calling `step(k, f)` to run (and count) its step `k`.
fn allocations_per_step<const N: usize>(
    warm: usize,
    mut round: impl FnMut(&mut dyn FnMut(usize, &mut dyn FnMut())),
) -> [u64; N] {
    let mut counts = [0; N];
    for r in 0..warm + 20 {
        round(&mut |k, f| {
            let n = allocations_in(f);
            if r >= warm {
                counts[k] += n;
            }
        });
    }
    counts
}

#[test]
fn advisory_selection_and_lookups_allocate_nothing_at_real_sizes() {
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for (ranks, blocks) in SIZES {
        let (e, key, tokens) = engine_at(ranks, blocks);
        let p = e.partition(&key).unwrap();
        let mut local = Vec::new();
        p.hasher().local_hashes(&tokens, &mut local);
        let req = SelectRequest::tokens(&tokens);
        let by_hash = SelectRequest::local_hashes(&local, tokens.len() as u64);
        let (mut device, mut tiered, mut overlap) = (
            OverlapScores::new(),
            TieredScores::new(),
            TieredScores::new(),
        );
        // Warm includes the setup's epoch garbage being reclaimed: readers take part
        // in reclamation (crossbeam-epoch), and retiring a queue node of that garbage
        // can allocate the next one, so the first rounds after a big load may
        // allocate a few times.
        let counts: [u64; 5] = allocations_per_step(200, |step| {
            step(0, &mut || {
                assert!(matches!(e.select(&p, &req), Ok(Outcome::Selected(_))));
            });
            step(1, &mut || {
                assert!(matches!(e.select(&p, &by_hash), Ok(Outcome::Selected(_))));
            });
            step(2, &mut || p.index().find_matches_into(&local, &mut device));
            step(3, &mut || {
                p.index().find_matches_tiered_into(&local, &mut tiered)
            });
            step(4, &mut || p.overlap(&local, &mut overlap));
        });
        let n: u64 = counts.iter().sum();
        assert_eq!(device.len() as u64, ranks);
        assert_eq!(device.get(RankId::new(0, 0)), blocks as u32);
        assert_eq!(overlap.len() as u64, ranks);
        if n != 0 {
            failures.push(format!(
                "{ranks} ranks × {blocks} blocks: select {}, select by hashes {}, \
                     find_matches {}, tiered {}, overlap {}",
                counts[0], counts[1], counts[2], counts[3], counts[4]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "allocations in 20 rounds, per step: {failures:#?}"
    );
}

/// A booked selection and its lifecycle (prefill complete, output blocks, free), at the
/// same sizes. Warm is longer here: each of the booking table's 64 shards allocates its
/// booking map and its bounded memory of freed ids at its first booking and first free,
/// and minted ids reach every shard only after a few hundred bookings; and a rank's
/// booking state is created at its first booking (so every rank is booked once first).
#[test]
fn booked_selection_and_its_lifecycle_allocate_nothing_at_real_sizes() {
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for (ranks, blocks) in SIZES {
        let (e, key, tokens) = engine_at(ranks, blocks);
        let p = e.partition(&key).unwrap();
        let mut local = Vec::new();
        p.hasher().local_hashes(&tokens, &mut local);
        let req = SelectRequest::tokens(&tokens);
        let mut overlap = TieredScores::new();
        for w in 0..ranks {
            let d = e
                .reserve(&p, RankId::new(w, 0), Some(&req), None, None)
                .unwrap();
            e.free(d.selection_id.unwrap()).unwrap();
        }
        let counts: [u64; 3] = allocations_per_step(1_000, |step| {
            let mut id = 0;
            step(0, &mut || {
                id = match e.select_and_reserve(&p, &req) {
                    Ok(Outcome::Selected(d)) => d.selection_id.unwrap(),
                    o => panic!("{o:?}"),
                };
            });
            step(1, &mut || {
                e.mark_prefill_complete(id).unwrap();
                e.add_output_blocks(id, 2).unwrap();
                e.free(id).unwrap();
            });
            // A host's lookup between bookings (it shares the thread's buffers).
            step(2, &mut || p.overlap(&local, &mut overlap));
        });
        assert_eq!(p.bookings().len(), 0);
        if counts.iter().sum::<u64>() != 0 {
            failures.push(format!(
                "{ranks} ranks × {blocks} blocks: select_and_reserve {}, \
                     prefill/output/free {}, overlap {}",
                counts[0], counts[1], counts[2]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "allocations in 20 booked rounds, per step: {failures:#?}"
    );
}

/// 1,024 workers of 8 DP ranks; every 16th serves the adapter "fleet"; rank (0, 0) holds
/// the whole prompt of `blocks` blocks, the others a short prefix of it.
fn fleet_engine(blocks: usize) -> (Engine, PartitionKey, Vec<u32>) {
    const WORKERS: u64 = 1_024;
    const DP: u32 = 8;
    let e = Engine::with_seed(5);
    let key = PartitionKey::new("m", "fleet");
    let p = e
        .create_partition(key.clone(), PartitionConfig::new(BS))
        .unwrap();
    for w in 0..WORKERS {
        let mut info = WorkerInfo::new(w, DP);
        if w % 16 == 0 {
            info.lora_adapters = vec!["fleet".into()];
        }
        p.upsert_worker(info).unwrap();
    }
    let tokens: Vec<u32> = (0..(blocks as u32) * BS).collect();
    let mut local = Vec::new();
    p.hasher().local_hashes(&tokens, &mut local);
    for w in 0..WORKERS {
        for dp in 0..DP {
            let held = if (w, dp) == (0, 0) {
                blocks
            } else {
                1 + ((w as usize + dp as usize) % 8).min(blocks - 1)
            };
            let stored: Vec<StoredBlock> = local[..held]
                .iter()
                .enumerate()
                .map(|(i, &h)| StoredBlock {
                    external_hash: (w << 20) + (u64::from(dp) << 16) + i as u64,
                    local_hash: h,
                })
                .collect();
            p.index()
                .store(RankId::new(w, dp), Tier::Device, None, &stored)
                .unwrap();
        }
    }
    (e, key, tokens)
}

#[test]
fn selection_over_a_fleet_of_8192_ranks_allocates_nothing() {
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    let allowed: Vec<u64> = (0..1_024).rev().step_by(16).collect();
    for blocks in [1, 257] {
        let (e, key, tokens) = fleet_engine(blocks);
        let p = e.partition(&key).unwrap();
        let all = SelectRequest::tokens(&tokens);
        let mut subset = SelectRequest::tokens(&tokens);
        subset.allowed_workers = Some(&allowed);
        let mut lora = SelectRequest::tokens(&tokens);
        lora.lora_name = Some("fleet");
        // Every rank booked once first: a rank's booking state is made at its first.
        for w in 0..1_024 {
            for dp in 0..8 {
                let d = e
                    .reserve(&p, RankId::new(w, dp), Some(&all), None, None)
                    .unwrap();
                e.free(d.selection_id.unwrap()).unwrap();
            }
        }
        let counts: [u64; 5] = allocations_per_step(300, |step| {
            for (k, req) in [&all, &subset, &lora].into_iter().enumerate() {
                step(k, &mut || {
                    assert!(matches!(e.select(&p, req), Ok(Outcome::Selected(_))));
                });
            }
            let mut id = 0;
            step(3, &mut || {
                id = match e.select_and_reserve(&p, &subset) {
                    Ok(Outcome::Selected(d)) => d.selection_id.unwrap(),
                    o => panic!("{o:?}"),
                };
            });
            step(4, &mut || {
                e.free(id).unwrap();
            });
        });
        assert_eq!(p.bookings().len(), 0);
        if counts.iter().sum::<u64>() != 0 {
            failures.push(format!(
                "8,192 ranks × {blocks} blocks: select {}, with an allow-set {}, \
                 with a LoRA adapter {}, select_and_reserve {}, free {}",
                counts[0], counts[1], counts[2], counts[3], counts[4]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "allocations in 20 rounds, per step: {failures:#?}"
    );
}
