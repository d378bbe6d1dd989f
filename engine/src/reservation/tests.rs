//! Unit tests of the reservation table (formerly `reservation.rs`'s test module).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::shard::shard_hash;
use super::types::Released;
use super::*;
use crate::ids::RankId;
use crate::ids::SelectionId;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::Arc;

const R0: RankId = RankId::new(1, 0);
const R1: RankId = RankId::new(1, 1);
const R2: RankId = RankId::new(2, 0);

fn manual() -> ReservationTable {
    ReservationTable::new(ReservationConfig {
        sweep_interval: None,
        ..ReservationConfig::default()
    })
}

fn req(id: SelectionId, rank: RankId, blocks: &[u64], prefill: u64) -> BookingRequest {
    BookingRequest {
        selection_id: id,
        rank,
        prompt_blocks: blocks.to_vec(),
        prefill_tokens: prefill,
        expected_output_tokens: 0,
        ttl: None,
    }
}

fn load(prefill: u64, decode: u64, requests: u64) -> ActiveLoad {
    ActiveLoad {
        active_prefill_tokens: prefill,
        active_decode_blocks: decode,
        active_requests: requests,
    }
}

/// All counters zero, refcount maps empty (and no larger than an idle rank keeps), no
/// underflow ever.
fn assert_drained(t: &ReservationTable) {
    assert_eq!(t.len(), 0);
    assert!(t.is_empty());
    t.audit().unwrap();
    for (rank, l) in t.loads().ranks() {
        assert!(l.is_zero(), "rank {rank}: {l:?}");
    }
    for s in t.inner.ranks.load().values() {
        let b = s.blocks.lock();
        assert!(b.refs.is_empty(), "rank {}: refcounts left", s.rank);
        assert!(
            b.refs.capacity() <= super::rank::IDLE_KEPT_CAPACITY,
            "rank {}: refcount map of capacity {} kept idle",
            s.rank,
            b.refs.capacity()
        );
        assert_eq!(s.counters.prompt_blocks.load(Ordering::Relaxed), 0);
    }
    assert_eq!(t.stats().counter_underflows, 0);
}

/// A deterministic xorshift generator (no external crate).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The chain of sequence hashes of the first `len` blocks of document `doc`: equal
/// documents share prefixes, as real prompts with a common prefix do.
fn chain(doc: u64, len: usize) -> Vec<u64> {
    (0..len as u64)
        .map(|i| shard_hash(doc.wrapping_mul(1_000_003) ^ (i << 48)) | 1)
        .collect()
}

#[test]
fn booking_adds_prefill_tokens_prompt_blocks_and_one_request() {
    let t = manual();
    let now = Instant::now();
    let v = t.book(req(1, R0, &[10, 11, 12], 48), now).unwrap();
    assert_eq!(v.new_prompt_blocks, 3);
    assert_eq!(v.rank_load, load(48, 3, 1));
    assert_eq!(t.rank_load(R0), load(48, 3, 1));
    assert_eq!(t.rank_load(R1), ActiveLoad::default());
    assert_eq!(v.origin, BookingOrigin::Local);
    assert_eq!(v.expires_at, Some(now + Duration::from_secs(3_600)));
    assert!(t.contains(1));
    assert_eq!(t.get(1).unwrap(), v);
    t.audit().unwrap();
}

#[test]
fn shared_prompt_blocks_count_once_per_rank() {
    let t = manual();
    let now = Instant::now();
    t.book(req(1, R0, &[10, 11, 12], 48), now).unwrap();
    let v = t.book(req(2, R0, &[10, 11, 13, 14], 64), now).unwrap();
    assert_eq!(v.new_prompt_blocks, 2, "10 and 11 are already active on R0");
    // distinct blocks: 10, 11, 12, 13, 14.
    assert_eq!(t.rank_load(R0), load(112, 5, 2));
    // The shared blocks stay while either booking holds them.
    assert!(matches!(t.free(1).unwrap(), FreeOutcome::Freed(r) if r.prompt_blocks_released == 1));
    assert_eq!(t.rank_load(R0), load(64, 4, 1));
    t.free(2).unwrap();
    assert_drained(&t);
}

#[test]
fn shared_prompt_blocks_count_separately_on_different_ranks() {
    let t = manual();
    let now = Instant::now();
    t.book(req(1, R0, &[10, 11], 32), now).unwrap();
    let v = t.book(req(2, R1, &[10, 11], 32), now).unwrap();
    assert_eq!(v.new_prompt_blocks, 2);
    assert_eq!(t.rank_load(R0), load(32, 2, 1));
    assert_eq!(t.rank_load(R1), load(32, 2, 1));
}

#[test]
fn duplicate_selection_id_is_an_error_not_an_overwrite() {
    let t = manual();
    let now = Instant::now();
    t.book(req(7, R0, &[1], 16), now).unwrap();
    assert_eq!(
        t.book(req(7, R1, &[2, 3], 99), now),
        Err(ReservationError::DuplicateSelectionId(7))
    );
    assert_eq!(
        t.install_replica_booking(req(7, R0, &[2], 1), now),
        Err(ReservationError::DuplicateSelectionId(7))
    );
    assert_eq!(t.get(7).unwrap().rank, R0);
    assert_eq!(t.rank_load(R0), load(16, 1, 1));
    assert_eq!(t.rank_load(R1), ActiveLoad::default());
    assert_eq!(t.len(), 1);
    t.audit().unwrap();
}

#[test]
fn free_of_unknown_id_is_a_clear_error() {
    let t = manual();
    assert_eq!(t.free(42), Err(ReservationError::UnknownSelectionId(42)));
    assert_eq!(
        t.mark_prefill_complete(42),
        Err(ReservationError::UnknownSelectionId(42))
    );
    assert_eq!(
        t.add_output_blocks(42, 1),
        Err(ReservationError::UnknownSelectionId(42))
    );
    assert_eq!(
        ReservationError::UnknownSelectionId(42).to_string(),
        "unknown selection id 42"
    );
    assert!(!t.contains(42));
    assert_drained(&t);
}

#[test]
fn second_free_is_already_freed_and_does_not_double_decrement() {
    let t = manual();
    let now = Instant::now();
    t.book(req(1, R0, &[10, 11], 32), now).unwrap();
    t.book(req(2, R0, &[10], 16), now).unwrap();
    let first = t.free(1).unwrap();
    assert_eq!(
        first,
        FreeOutcome::Freed(Released {
            rank: R0,
            prefill_tokens: 32,
            prompt_blocks_released: 1,
            output_blocks: 0
        })
    );
    let after_first = t.rank_load(R0);
    assert_eq!(after_first, load(16, 1, 1));
    for _ in 0..3 {
        assert_eq!(t.free(1), Ok(FreeOutcome::AlreadyFreed(FreedBy::Caller)));
        assert_eq!(t.rank_load(R0), after_first);
    }
    t.free(2).unwrap();
    assert_drained(&t);
}

#[test]
fn freed_id_cannot_be_booked_again_while_remembered() {
    let t = manual();
    let now = Instant::now();
    t.book(req(1, R0, &[10], 16), now).unwrap();
    t.free(1).unwrap();
    // A late replica message for a freed booking must not resurrect it.
    assert_eq!(
        t.install_replica_booking(req(1, R0, &[10], 16), now),
        Err(ReservationError::DuplicateSelectionId(1))
    );
    assert_drained(&t);
}

#[test]
fn recently_freed_memory_is_bounded() {
    let t = ReservationTable::new(ReservationConfig {
        shards: 1,
        recently_freed_per_shard: 4,
        sweep_interval: None,
        ..ReservationConfig::default()
    });
    let now = Instant::now();
    for id in 0..10 {
        t.book(req(id, R0, &[id], 1), now).unwrap();
        t.free(id).unwrap();
    }
    let g = t.inner.shards[0].lock();
    assert_eq!(g.freed.order.len(), 4);
    assert_eq!(g.freed.by.len(), 4);
    drop(g);
    // The last four are remembered, older ones are unknown again.
    for id in 6..10 {
        assert_eq!(t.free(id), Ok(FreeOutcome::AlreadyFreed(FreedBy::Caller)));
    }
    assert_eq!(t.free(0), Err(ReservationError::UnknownSelectionId(0)));
    assert_drained(&t);
}

#[test]
fn mark_prefill_complete_is_idempotent() {
    let t = manual();
    let now = Instant::now();
    t.book(req(1, R0, &[10, 11], 32), now).unwrap();
    t.book(req(2, R0, &[12], 16), now).unwrap();
    assert_eq!(t.mark_prefill_complete(1), Ok(()));
    assert_eq!(t.rank_load(R0), load(16, 3, 2));
    assert_eq!(t.mark_prefill_complete(1), Ok(()));
    assert_eq!(t.rank_load(R0), load(16, 3, 2));
    assert!(t.get(1).unwrap().prefill_complete);
    // Freeing a prefill-complete booking does not subtract its prefill again.
    let FreeOutcome::Freed(r) = t.free(1).unwrap() else {
        panic!()
    };
    assert_eq!(r.prefill_tokens, 0);
    assert_eq!(t.rank_load(R0), load(16, 1, 1));
    // ... and marking a freed booking is a no-op, not an error.
    assert_eq!(t.mark_prefill_complete(1), Ok(()));
    t.free(2).unwrap();
    assert_drained(&t);
}

#[test]
fn mark_prefill_complete_drops_only_prefill_tokens() {
    let t = manual();
    t.book(req(1, R0, &[10, 11], 32), Instant::now()).unwrap();
    t.add_output_blocks(1, 2).unwrap();
    t.mark_prefill_complete(1).unwrap();
    assert_eq!(t.rank_load(R0), load(0, 4, 1));
}

#[test]
fn add_output_blocks_adds_to_decode_load_and_free_drops_it() {
    let t = manual();
    t.book(req(1, R0, &[10], 16), Instant::now()).unwrap();
    assert_eq!(t.add_output_blocks(1, 3), Ok(()));
    assert_eq!(t.add_output_blocks(1, 2), Ok(()));
    assert_eq!(t.add_output_blocks(1, 0), Ok(()));
    assert_eq!(t.rank_load(R0), load(16, 6, 1));
    assert_eq!(t.get(1).unwrap().output_blocks, 5);
    let FreeOutcome::Freed(r) = t.free(1).unwrap() else {
        panic!()
    };
    assert_eq!(r.output_blocks, 5);
    assert_drained(&t);
}

#[test]
fn set_output_blocks_is_idempotent_and_never_lowers() {
    let t = manual();
    t.book(req(1, R0, &[10], 16), Instant::now()).unwrap();
    assert_eq!(t.set_output_blocks(1, 3), Ok(3));
    assert_eq!(t.set_output_blocks(1, 3), Ok(0), "a retry adds nothing");
    assert_eq!(
        t.set_output_blocks(1, 2),
        Ok(0),
        "a late, lower total changes nothing"
    );
    t.add_output_blocks(1, 1).unwrap();
    assert_eq!(t.set_output_blocks(1, 6), Ok(2));
    assert_eq!(t.rank_load(R0), load(16, 7, 1));
    assert!(matches!(
        t.set_output_blocks(1, u64::MAX),
        Err(ReservationError::TooLarge(1, _))
    ));
    t.free(1).unwrap();
    assert_eq!(
        t.set_output_blocks(1, 9),
        Err(ReservationError::AlreadyFreed(1, FreedBy::Caller))
    );
    assert_eq!(
        t.set_output_blocks(2, 1),
        Err(ReservationError::UnknownSelectionId(2))
    );
    assert_drained(&t);
}

#[test]
fn add_output_blocks_to_a_freed_booking_is_an_error() {
    let t = manual();
    t.book(req(1, R0, &[10], 16), Instant::now()).unwrap();
    t.free(1).unwrap();
    assert_eq!(
        t.add_output_blocks(1, 1),
        Err(ReservationError::AlreadyFreed(1, FreedBy::Caller))
    );
    assert_drained(&t);
}

#[test]
fn counts_above_the_per_booking_maximum_are_refused() {
    let t = manual();
    let now = Instant::now();
    assert_eq!(
        t.book(req(1, R0, &[], MAX_PER_BOOKING + 1), now),
        Err(ReservationError::TooLarge(1, "prefill_tokens"))
    );
    t.book(req(2, R0, &[], MAX_PER_BOOKING), now).unwrap();
    assert_eq!(
        t.add_output_blocks(2, u64::MAX),
        Err(ReservationError::TooLarge(2, "output_blocks"))
    );
    assert_eq!(t.rank_load(R0), load(MAX_PER_BOOKING, 0, 1));
    t.free(2).unwrap();
    assert_drained(&t);
}

#[test]
fn expected_output_is_recorded_in_blocks_and_adds_no_load() {
    let t = manual();
    let mut r = req(1, R0, &[10], 16);
    r.expected_output_tokens = 33;
    let v = t.book(r, Instant::now()).unwrap();
    assert_eq!(v.expected_output_blocks, 3);
    assert_eq!(t.rank_load(R0), load(16, 1, 1));
}

#[test]
fn new_blocks_not_active_counts_the_blocks_the_rank_does_not_hold() {
    let t = manual();
    let now = Instant::now();
    assert_eq!(
        t.new_blocks_not_active(R0, &[10, 11, 12]),
        3,
        "unknown rank"
    );
    t.book(req(1, R0, &[10, 11], 32), now).unwrap();
    assert_eq!(t.new_blocks_not_active(R0, &[10, 11, 12]), 1);
    assert_eq!(t.new_blocks_not_active(R0, &[]), 0);
    assert_eq!(t.new_blocks_not_active(R1, &[10, 11, 12]), 3);
    // It is exactly what booking there adds.
    let v = t.book(req(2, R0, &[10, 11, 12], 48), now).unwrap();
    assert_eq!(v.new_prompt_blocks, 1);
    t.free(1).unwrap();
    t.free(2).unwrap();
    // An idle rank answers without its lock, and says "all new".
    assert_eq!(t.new_blocks_not_active(R0, &[10, 11, 12]), 3);
}

#[test]
fn chain_count_agrees_with_the_linear_count_on_hash_chains() {
    let t = manual();
    let now = Instant::now();
    let mut rng = Rng(0x5eed);
    let mut id = 0;
    for _ in 0..200 {
        let doc = rng.below(6);
        let len = 1 + rng.below(12) as usize;
        t.book(req(id, R0, &chain(doc, len), 1), now).unwrap();
        id += 1;
        if rng.below(3) == 0 {
            let _ = t.free(rng.below(id));
        }
        let loads = t.loads();
        for doc in 0..8 {
            for len in 0..14 {
                let c = chain(doc, len);
                assert_eq!(
                    loads.new_blocks_not_active_chain(R0, &c),
                    loads.new_blocks_not_active(R0, &c),
                    "doc {doc} len {len}"
                );
            }
        }
    }
}

#[test]
fn expired_bookings_are_swept() {
    let t = manual();
    let now = Instant::now();
    let mut short = req(1, R0, &[10, 11], 32);
    short.ttl = Some(Duration::from_secs(5));
    t.book(short, now).unwrap();
    t.book(req(2, R0, &[10], 16), now).unwrap(); // default ttl: 3,600 s
    assert_eq!(t.sweep_expired(now + Duration::from_secs(4)), 0);
    assert!(t.contains(1));
    assert_eq!(t.sweep_expired(now + Duration::from_secs(5)), 1);
    assert!(!t.contains(1));
    assert_eq!(t.rank_load(R0), load(16, 1, 1));
    assert_eq!(t.free(1), Ok(FreeOutcome::AlreadyFreed(FreedBy::Expired)));
    assert_eq!(t.sweep_expired(now + Duration::from_secs(3_599)), 0);
    assert_eq!(t.sweep_expired(now + Duration::from_secs(3_600)), 1);
    assert_eq!(t.stats().expired_total, 2);
    assert_drained(&t);
}

#[test]
fn the_default_ttl_is_dynamos_current_hour() {
    assert_eq!(
        ReservationConfig::default().default_ttl,
        Duration::from_secs(3_600)
    );
}

#[test]
fn a_ttl_beyond_the_clock_never_expires() {
    let t = manual();
    let now = Instant::now();
    let mut r = req(1, R0, &[10], 16);
    r.ttl = Some(Duration::MAX);
    assert_eq!(t.book(r, now).unwrap().expires_at, None);
    assert_eq!(t.sweep_expired(now + Duration::from_secs(1 << 40)), 0);
    t.free(1).unwrap();
    assert_drained(&t);
}

#[test]
fn sweep_skips_shards_with_nothing_expired() {
    let t = ReservationTable::new(ReservationConfig {
        shards: 4,
        sweep_interval: None,
        ..ReservationConfig::default()
    });
    let now = Instant::now();
    for id in 0..64 {
        t.book(req(id, R0, &[id], 1), now).unwrap();
    }
    for s in t.inner.shards.iter() {
        assert_eq!(
            s.lock().earliest_expiry,
            Some(now + Duration::from_secs(3_600))
        );
    }
    assert_eq!(t.sweep_expired(now), 0);
}

#[test]
fn remove_rank_frees_its_bookings_only() {
    let t = manual();
    let now = Instant::now();
    t.book(req(1, R0, &[10, 11], 32), now).unwrap();
    t.book(req(2, R0, &[10], 16), now).unwrap();
    t.book(req(3, R2, &[10], 16), now).unwrap();
    assert_eq!(t.remove_rank(R0), 2);
    assert_eq!(t.remove_rank(R0), 0);
    assert_eq!(t.rank_load(R0), ActiveLoad::default());
    assert_eq!(t.rank_load(R2), load(16, 1, 1));
    assert_eq!(
        t.free(1),
        Ok(FreeOutcome::AlreadyFreed(FreedBy::RankRemoved))
    );
    assert_eq!(t.stats().tracked_ranks, 1);
    // The rank can come back and starts from zero.
    t.book(req(4, R0, &[10], 8), now).unwrap();
    assert_eq!(t.rank_load(R0), load(8, 1, 1));
    t.free(3).unwrap();
    t.free(4).unwrap();
    assert_drained(&t);
}

#[test]
fn bookings_racing_remove_rank_are_freed_by_it_or_start_the_rank_afresh() {
    for round in 0..50 {
        let t = Arc::new(manual());
        let now = Instant::now();
        let booker = {
            let t = t.clone();
            std::thread::spawn(move || {
                for id in 0..200 {
                    t.book(req(id, R0, &chain(id % 3, 4), 16), now).unwrap();
                }
            })
        };
        let mut removed = 0;
        for _ in 0..20 {
            removed += t.remove_rank(R0);
        }
        booker.join().unwrap();
        t.audit().unwrap();
        assert_eq!(removed + t.len(), 200, "round {round}");
        assert_eq!(t.rank_load(R0).active_requests as usize, t.len());
        t.remove_rank(R0);
        assert_drained(&t);
    }
}

#[test]
fn replica_bookings_count_like_local_ones_and_are_flagged() {
    let t = manual();
    let now = Instant::now();
    t.book(req(1, R0, &[10, 11], 32), now).unwrap();
    let mut r = req(2, R0, &[10, 12], 32);
    r.ttl = Some(Duration::from_secs(10));
    let v = t.install_replica_booking(r, now).unwrap();
    assert_eq!(v.origin, BookingOrigin::Replica);
    assert_eq!(v.new_prompt_blocks, 1);
    assert_eq!(t.rank_load(R0), load(64, 3, 2));
    assert_eq!(t.get(2).unwrap().origin, BookingOrigin::Replica);
    assert_eq!(t.sweep_expired(now + Duration::from_secs(10)), 1);
    t.free(1).unwrap();
    assert_drained(&t);
}

/// Random operations against a reference model: after every step each rank's counters
/// equal the model's, and none ever underflowed.
#[test]
fn counters_never_go_negative() {
    let t = ReservationTable::new(ReservationConfig {
        shards: 4,
        sweep_interval: None,
        recently_freed_per_shard: 1 << 20,
        ..ReservationConfig::default()
    });
    let ranks = [R0, R1, R2];
    let start = Instant::now();
    let mut rng = Rng(0xdead_beef);
    // Reference: id → (rank index, blocks, prefill, prefill_done, output, expiry secs).
    type Model = HashMap<u64, (usize, Vec<u64>, u64, bool, u64, u64)>;
    let mut model = Model::new();
    let mut clock = 0u64;
    let mut next_id = 0u64;
    for step in 0..20_000 {
        match rng.below(10) {
            0..=3 => {
                let ri = rng.below(3) as usize;
                let blocks = chain(rng.below(5), rng.below(6) as usize);
                let prefill = rng.below(100);
                let ttl = 1 + rng.below(50);
                let mut r = req(next_id, ranks[ri], &blocks, prefill);
                r.ttl = Some(Duration::from_secs(ttl));
                t.book(r, start + Duration::from_secs(clock)).unwrap();
                model.insert(next_id, (ri, blocks, prefill, false, 0, clock + ttl));
                next_id += 1;
            }
            4 => {
                let id = rng.below(next_id + 1);
                let r = t.mark_prefill_complete(id);
                if let Some(m) = model.get_mut(&id) {
                    m.3 = true;
                    assert_eq!(r, Ok(()));
                }
            }
            5 => {
                let id = rng.below(next_id + 1);
                let n = rng.below(4);
                let r = t.add_output_blocks(id, n);
                if let Some(m) = model.get_mut(&id) {
                    m.4 += n;
                    assert_eq!(r, Ok(()));
                    assert_eq!(t.get(id).unwrap().output_blocks, m.4);
                } else {
                    assert!(r.is_err());
                }
            }
            6..=8 => {
                let id = rng.below(next_id + 1);
                let r = t.free(id);
                match model.remove(&id) {
                    Some(_) => assert!(matches!(r, Ok(FreeOutcome::Freed(_)))),
                    None if id < next_id => {
                        assert!(matches!(r, Ok(FreeOutcome::AlreadyFreed(_))))
                    }
                    None => assert_eq!(r, Err(ReservationError::UnknownSelectionId(id))),
                }
            }
            _ => {
                clock += rng.below(5);
                let swept = t.sweep_expired(start + Duration::from_secs(clock));
                let before = model.len();
                model.retain(|_, m| m.5 > clock);
                assert_eq!(swept, before - model.len());
            }
        }
        for (ri, &rank) in ranks.iter().enumerate() {
            let mut want = ActiveLoad::default();
            let mut distinct = std::collections::HashSet::new();
            for m in model.values().filter(|m| m.0 == ri) {
                want.active_requests += 1;
                if !m.3 {
                    want.active_prefill_tokens += m.2;
                }
                want.active_decode_blocks += m.4;
                distinct.extend(m.1.iter().copied());
            }
            want.active_decode_blocks += distinct.len() as u64;
            assert_eq!(t.rank_load(rank), want, "step {step} rank {rank}");
        }
        assert_eq!(t.stats().counter_underflows, 0);
    }
    t.audit().unwrap();
    t.sweep_expired(start + Duration::from_secs(clock + 1_000));
    assert_drained(&t);
}

#[test]
fn the_underflow_guard_saturates_and_counts() {
    let t = manual();
    let c = AtomicU64::new(3);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.inner.sub(&c, 5, "test")));
    // Debug builds stop at the broken invariant; release builds never go below zero.
    assert_eq!(r.is_err(), cfg!(debug_assertions));
    if !cfg!(debug_assertions) {
        assert_eq!(c.load(Ordering::Relaxed), 0);
    }
    assert_eq!(t.stats().counter_underflows, 1);
}

#[test]
fn counters_do_not_leak_and_refcount_maps_are_freed() {
    let t = manual();
    let now = Instant::now();
    for id in 0..5_000u64 {
        t.book(
            req(id, RankId::new(id % 4, 0), &chain(id % 7, 40), 100),
            now,
        )
        .unwrap();
    }
    assert!(t
        .inner
        .ranks
        .load()
        .values()
        .all(|s| s.blocks.lock().refs.len() > 40));
    for id in 0..5_000u64 {
        if id % 3 == 0 {
            t.mark_prefill_complete(id).unwrap();
        }
        if id % 5 == 0 {
            t.add_output_blocks(id, 7).unwrap();
        }
    }
    t.audit().unwrap();
    for id in 0..5_000u64 {
        t.free(id).unwrap();
    }
    assert_drained(&t);
}

#[test]
fn an_idle_rank_keeps_a_bounded_refcount_map_and_gives_back_a_burst() {
    let t = manual();
    let now = Instant::now();
    let r = RankId::new(1, 0);
    let capacity = || {
        t.inner
            .ranks
            .load()
            .values()
            .map(|s| s.blocks.lock().refs.capacity())
            .sum::<usize>()
    };
    // An ordinary prompt: its map stays once the rank is idle, for the next booking.
    t.book(req(1, r, &chain(1, 1_000), 10), now).unwrap();
    t.free(1).unwrap();
    let kept = capacity();
    assert!(
        (1_000..=super::rank::IDLE_KEPT_CAPACITY).contains(&kept),
        "{kept}"
    );
    // A burst past the bound: given back when the rank goes idle.
    t.book(req(2, r, &chain(2, 20_000), 10), now).unwrap();
    assert!(capacity() > super::rank::IDLE_KEPT_CAPACITY);
    t.free(2).unwrap();
    assert_eq!(capacity(), 0, "the burst's map was given back");
    assert_drained(&t);
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn constructing_spawns_nothing_and_first_booking_starts_the_sweep() {
    let t = ReservationTable::new(ReservationConfig {
        sweep_interval: Some(Duration::from_secs(3_600)),
        ..ReservationConfig::default()
    });
    assert!(!t.stats().sweeper_started);
    assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 0);
    assert!(t.sweeper.handle.lock().is_none());
    // Non-booking calls start nothing either.
    let _ = t.free(1);
    let _ = t.rank_load(R0);
    t.sweep_expired(Instant::now());
    assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 0);

    t.book(req(1, R0, &[1], 1), Instant::now()).unwrap();
    assert!(t.stats().sweeper_started);
    assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 1);
    for id in 2..100 {
        t.book(req(id, R0, &[id], 1), Instant::now()).unwrap();
    }
    assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 1);
    let h = t.sweeper.handle.lock();
    let h = h.as_ref().unwrap();
    assert_eq!(h.thread().name(), Some("kvr-reservation-sweep"));
    assert!(!h.is_finished());
}

#[test]
fn concurrent_first_bookings_start_exactly_one_sweeper() {
    for _ in 0..20 {
        let t = Arc::new(ReservationTable::new(ReservationConfig::default()));
        let threads: Vec<_> = (0..4u64)
            .map(|k| {
                let t = t.clone();
                std::thread::spawn(move || {
                    t.book(req(k, R0, &[k], 1), Instant::now()).unwrap();
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 1);
    }
}

#[test]
fn dropping_the_table_ends_the_sweep_thread() {
    // An hour-long interval: only the drop can end the thread in time.
    let t = ReservationTable::new(ReservationConfig {
        sweep_interval: Some(Duration::from_secs(3_600)),
        ..ReservationConfig::default()
    });
    t.book(req(1, R0, &[1], 1), Instant::now()).unwrap();
    let exited = t.sweeper.exited.clone();
    let weak = Arc::downgrade(&t.inner);
    assert!(!exited.load(Ordering::Acquire));
    let started = Instant::now();
    drop(t);
    assert!(
        exited.load(Ordering::Acquire),
        "the sweep thread outlived the table"
    );
    assert!(
        weak.upgrade().is_none(),
        "the table's state outlived the table"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn the_sweep_thread_holds_only_a_weak_reference() {
    let t = ReservationTable::new(ReservationConfig {
        sweep_interval: Some(Duration::from_millis(1)),
        ..ReservationConfig::default()
    });
    t.book(req(1, R0, &[1], 1), Instant::now()).unwrap();
    // Between sweeps the thread holds no strong reference.
    wait_for("an idle sweeper", || Arc::strong_count(&t.inner) == 1);
    assert_eq!(Arc::weak_count(&t.inner), 1);
}

#[test]
fn the_background_sweep_frees_expired_bookings() {
    let t = ReservationTable::new(ReservationConfig {
        sweep_interval: Some(Duration::from_millis(2)),
        ..ReservationConfig::default()
    });
    let mut r = req(1, R0, &[10, 11], 32);
    r.ttl = Some(Duration::ZERO);
    t.book(r, Instant::now()).unwrap();
    t.book(req(2, R0, &[10], 16), Instant::now()).unwrap();
    wait_for("the sweep", || !t.contains(1));
    assert!(t.contains(2));
    // The sweep takes the booking out of its shard, then releases it (point 2): wait for
    // the release too.
    wait_for("the release", || t.rank_load(R0) == load(16, 1, 1));
    assert_eq!(t.free(1), Ok(FreeOutcome::AlreadyFreed(FreedBy::Expired)));
}

#[test]
fn ensure_sweeper_starts_one_thread_when_none_is_configured() {
    let t = manual();
    t.book(req(1, R0, &[1], 1), Instant::now()).unwrap();
    assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 0);
    t.ensure_sweeper(Duration::from_millis(1));
    t.ensure_sweeper(Duration::from_millis(1));
    assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 1);
    let mut r = req(2, R0, &[2], 1);
    r.ttl = Some(Duration::ZERO);
    t.book(r, Instant::now()).unwrap();
    wait_for("the sweep", || !t.contains(2));
    assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 1);
}

#[test]
fn status_tells_live_from_recently_freed_from_unknown() {
    let t = manual();
    let now = Instant::now();
    t.book(req(1, R0, &[1], 1), now).unwrap();
    t.install_replica_booking(req(2, R0, &[1], 1), now).unwrap();
    assert_eq!(t.status(1), Some(BookingStatus::Live(BookingOrigin::Local)));
    assert_eq!(
        t.status(2),
        Some(BookingStatus::Live(BookingOrigin::Replica))
    );
    t.free(1).unwrap();
    assert_eq!(t.status(1), Some(BookingStatus::Freed(FreedBy::Caller)));
    assert_eq!(t.status(3), None);
}

#[test]
fn no_sweep_interval_means_no_thread() {
    let t = manual();
    t.book(req(1, R0, &[1], 1), Instant::now()).unwrap();
    assert_eq!(t.sweeper.spawned.load(Ordering::Relaxed), 0);
    assert!(t.sweeper.handle.lock().is_none());
}

/// 4 threads book and free 1,000,000 requests (release; 40,000 in debug) over 64 ranks
/// with overlapping prompt blocks, marking prefill and adding output on the way, while
/// a sweeper thread and the background sweep expire the short-lived ones; every
/// thread also reads loads. Afterwards every counter is exactly 0 and every refcount
/// map empty and freed.
#[test]
fn stress_four_threads_book_and_free_a_million_requests_over_64_ranks() {
    const THREADS: u64 = 4;
    const TOTAL: u64 = if cfg!(debug_assertions) {
        40_000
    } else {
        1_000_000
    };
    const WINDOW: usize = 24;
    let t = Arc::new(ReservationTable::new(ReservationConfig {
        sweep_interval: Some(Duration::from_millis(1)),
        recently_freed_per_shard: 4_096,
        ..ReservationConfig::default()
    }));
    let done = Arc::new(AtomicBool::new(false));
    let sweeper = {
        let (t, done) = (t.clone(), done.clone());
        std::thread::spawn(move || {
            let mut swept = 0;
            while !done.load(Ordering::Acquire) {
                swept += t.sweep_expired(Instant::now());
                std::thread::yield_now();
            }
            swept
        })
    };
    let started = Instant::now();
    let workers: Vec<_> = (0..THREADS)
        .map(|k| {
            let t = t.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9 ^ ((k + 1) * 0x1234_5678_9abc));
                let mut window: VecDeque<u64> = VecDeque::new();
                let (mut freed, mut expired) = (0u64, 0u64);
                let mut check = 0u64;
                for i in 0..TOTAL / THREADS {
                    let id = (k << 48) | i;
                    let rank = RankId::new(rng.below(64), 0);
                    let blocks = chain(rng.below(32), 1 + rng.below(16) as usize);
                    let ttl = if rng.below(8) == 0 {
                        Duration::ZERO
                    } else {
                        Duration::from_secs(600)
                    };
                    let loads = t.loads();
                    check = check.wrapping_add(
                        loads.new_blocks_not_active_chain(rank, &blocks)
                            + loads.get(rank).active_decode_blocks,
                    );
                    let mut r = req(id, rank, &blocks, 16 * blocks.len() as u64);
                    r.ttl = Some(ttl);
                    t.book(r, Instant::now()).unwrap();
                    window.push_back(id);
                    match rng.below(4) {
                        0 => {
                            let _ = t.mark_prefill_complete(id);
                        }
                        1 => {
                            let _ = t.add_output_blocks(id, 1 + rng.below(3));
                        }
                        _ => {}
                    }
                    if window.len() > WINDOW {
                        let at = rng.below(WINDOW as u64) as usize;
                        let victim = window.swap_remove_front(at).unwrap();
                        match t.free(victim) {
                            Ok(FreeOutcome::Freed(_)) => freed += 1,
                            Ok(FreeOutcome::AlreadyFreed(FreedBy::Expired)) => expired += 1,
                            other => panic!("free {victim:?}: {other:?}"),
                        }
                    }
                }
                for id in window {
                    match t.free(id) {
                        Ok(FreeOutcome::Freed(_)) => freed += 1,
                        Ok(FreeOutcome::AlreadyFreed(FreedBy::Expired)) => expired += 1,
                        other => panic!("free {id}: {other:?}"),
                    }
                }
                std::hint::black_box(check);
                (freed, expired)
            })
        })
        .collect();
    let (mut freed, mut expired) = (0, 0);
    for w in workers {
        let (f, e) = w.join().unwrap();
        freed += f;
        expired += e;
    }
    done.store(true, Ordering::Release);
    sweeper.join().unwrap();
    let elapsed = started.elapsed();
    assert_eq!(freed + expired, TOTAL);
    assert_eq!(t.stats().expired_total, expired);
    assert!(expired > 0, "the sweep never raced the frees");
    assert_eq!(t.stats().tracked_ranks, 64);
    assert_drained(&t);
    eprintln!(
        "reservation stress: {TOTAL} bookings+frees by {THREADS} threads in {elapsed:?} \
         ({:.2} M/s), {expired} expired before their free",
        TOTAL as f64 / elapsed.as_secs_f64() / 1e6
    );
}

/// The ordered cursor selection reads counters through answers as `get` does, for ranks
/// with and without counters, asked in order, out of order and twice, before and after
/// a rank's removal.
#[test]
fn the_load_cursor_answers_as_the_map_does_in_any_order() {
    let t = manual();
    let now = Instant::now();
    // 40 ranks with bookings (more than the prefetch window), every other rank id.
    let booked: Vec<RankId> = (0..40u64)
        .map(|w| RankId::new(2 * w + 1, (w % 3) as u32))
        .collect();
    for (i, &r) in booked.iter().enumerate() {
        for k in 0..=(i as u64 % 4) {
            let id = 1_000 * (i as u64 + 1) + k;
            t.book(req(id, r, &[id], 16 * (i as u64 + 1)), now).unwrap();
        }
    }
    let mut asked: Vec<RankId> = (0..90u64).map(|w| RankId::new(w, (w % 3) as u32)).collect();
    asked.extend(booked.iter().copied());
    asked.sort();
    let check = |t: &ReservationTable, order: &[RankId]| {
        let loads = t.loads();
        let mut cursor = loads.cursor();
        for &r in order {
            assert_eq!(cursor.get(r), loads.get(r), "rank {r}");
        }
    };
    check(&t, &asked);
    let mut shuffled = asked.clone();
    let mut rng = Rng(0x9e37_79b9);
    for i in (1..shuffled.len()).rev() {
        shuffled.swap(i, rng.below(i as u64 + 1) as usize);
    }
    check(&t, &shuffled);
    let twice: Vec<RankId> = asked.iter().flat_map(|&r| [r, r]).collect();
    check(&t, &twice);
    assert!(booked.iter().any(|&r| !t.loads().cursor().get(r).is_zero()));
    t.remove_rank(booked[7]);
    t.remove_rank(booked[0]);
    check(&t, &asked);
    assert!(t.loads().cursor().get(booked[7]).is_zero());
}

#[test]
fn the_decode_drag_is_learned_from_prefill_timings_on_ranks_of_different_loads() {
    let t = manual();
    let t0 = Instant::now();
    // R1 holds 2,000 decode blocks all along; R0 none.
    let held: Vec<u64> = (1_000_000..1_002_000).collect();
    t.book(req(1, R1, &held, 0), t0).unwrap();
    assert_eq!(t.decode_drag(), None);
    // Each prefill: 1,000 tokens in 100 ms, plus 20 µs per decode block its rank holds.
    let mut now = t0;
    for i in 0..400u64 {
        let (rank, extra_blocks) = if i % 2 == 0 { (R0, 0) } else { (R1, 2_000) };
        let id = 10 + i;
        t.book(req(id, rank, &[i], 1_000), now).unwrap();
        let secs = 0.1 + 20e-6 * (extra_blocks + 1) as f64;
        now += Duration::from_secs_f64(secs);
        t.mark_prefill_complete_at(id, now).unwrap();
        t.free(id).unwrap();
        now += Duration::from_millis(5);
    }
    let drag = t.decode_drag().expect("learned");
    assert!((drag - 20e-6).abs() < 2e-6, "{drag}");
    // The same timings on ranks of equal load teach no drag.
    let t = manual();
    let mut now = t0;
    for i in 0..400u64 {
        let rank = if i % 2 == 0 { R0 } else { R1 };
        t.book(req(10 + i, rank, &[i], 1_000), now).unwrap();
        now += Duration::from_millis(if i % 4 < 2 { 100 } else { 140 });
        t.mark_prefill_complete_at(10 + i, now).unwrap();
        t.free(10 + i).unwrap();
    }
    assert_eq!(t.decode_drag(), None);
}

#[test]
fn stats_report_the_learned_decode_drag_and_its_observations() {
    let t = manual();
    let t0 = Instant::now();
    let s = t.stats();
    assert_eq!((s.decode_drag, s.decode_drag_observations), (None, 0));
    // R1 holds 2,000 decode blocks all along; R0 none. 20 µs of TTFT a held block.
    let held: Vec<u64> = (1_000_000..1_002_000).collect();
    t.book(req(1, R1, &held, 0), t0).unwrap();
    let mut now = t0;
    for i in 0..400u64 {
        let (rank, extra_blocks) = if i % 2 == 0 { (R0, 0) } else { (R1, 2_000) };
        t.book(req(10 + i, rank, &[i], 1_000), now).unwrap();
        now += Duration::from_secs_f64(0.1 + 20e-6 * (extra_blocks + 1) as f64);
        t.mark_prefill_complete_at(10 + i, now).unwrap();
        t.free(10 + i).unwrap();
        now += Duration::from_millis(5);
    }
    let s = t.stats();
    assert_eq!(s.decode_drag_observations, 400);
    assert_eq!(t.decode_drag_observations(), 400);
    assert_eq!(s.decode_drag, t.decode_drag());
    let drag = s.decode_drag.expect("learned");
    assert!((drag - 20e-6).abs() < 2e-6, "{drag}");
}
