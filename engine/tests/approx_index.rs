//! The approximate (booking-fed) index: `ApproxRecorder` writing into an `Index`.
//!
//! Scenario tests pin each retention rule (overlap after a record, shared prefixes counted
//! once, TTL expiry exactly at the deadline, refresh, the size bound and the maintenance
//! pass's prune, deepest first with its tie-break, eviction of a rank's least recent bookings at the
//! bound, rank independence, `forget_rank`, a `now` that goes backwards), and a
//! differential test drives the recorder and a naive model — a map (rank, sequence hash)
//! → (deadline, depth) — with the same random operations, comparing every outcome,
//! `len()`, the index's per-rank block counts and `find_matches` of random prompts.
//!
//! A differential failure prints the seed; `KVR_DIFF_SEED` and `KVR_DIFF_OPS` override
//! them (the run is cheap enough that unoptimized builds do the same counts).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use common::rng::{env_u64, Rng};
use kvr::config::ApproxConfig;
use kvr::hash::sequence_hashes;
use kvr::stats::ApproxStats;
use kvr::testing::{ApproxRecorder, RecordOutcome};
use kvr::MAX_RANKS;
use kvr::{Index, IndexError};
use kvr::{RankId, Tier};

const TTL: Duration = Duration::from_secs(120);

fn rank(w: u64) -> RankId {
    RankId::new(w, 0)
}

/// A lookup of a prompt given as local hashes: the approximate index is fed by bookings,
/// so it is keyed by sequence hashes (`kvr::index` "Keys").
fn lookup(index: &Index, locals: &[u64]) -> kvr::OverlapScores {
    index.find_matches(&sequence_hashes(locals))
}

fn recorder() -> ApproxRecorder {
    ApproxRecorder::new(ApproxConfig::default())
}

fn device_blocks(index: &Index, r: RankId) -> u64 {
    index.rank_stats(r).map_or(0, |s| s.tier_blocks[0])
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn defaults_are_dynamos() {
    let c = ApproxConfig::default();
    assert_eq!(c.ttl, secs(120));
    assert_eq!(c.max_blocks, 1 << 20);
    assert_eq!(c.prune_to, 0.8);
    assert_eq!(recorder().config(), &c);
}

#[test]
fn record_shows_overlap_for_that_rank() {
    let index = Index::new();
    let rec = recorder();
    let t0 = Instant::now();
    let prompt = [11u64, 12, 13];
    let out = rec.record(&index, rank(1), &prompt, t0).unwrap();
    assert_eq!(
        out,
        RecordOutcome {
            stored: 3,
            ..Default::default()
        }
    );
    assert_eq!(rec.len(), 3);
    assert!(!rec.is_empty());
    let m = lookup(&index, &prompt);
    assert_eq!(m.as_slice(), &[(rank(1), 3)]);
    assert_eq!(lookup(&index, &[11, 12]).get(rank(1)), 2);
    assert_eq!(lookup(&index, &[11, 99, 13]).get(rank(1)), 1);
    assert!(lookup(&index, &[12, 13]).is_empty());
    assert_eq!(lookup(&index, &prompt).get(rank(2)), 0);

    // The blocks are named by their sequence hashes: removing the last by that name works.
    let seqs = sequence_hashes(&prompt);
    let removed = index.remove(rank(1), Tier::Device, &seqs[2..]);
    assert_eq!((removed.removed, removed.not_found), (1, 0));
    assert_eq!(lookup(&index, &prompt).get(rank(1)), 2);

    let s = rec.stats();
    assert_eq!(
        (s.records, s.blocks_recorded, s.blocks_refreshed),
        (1, 3, 0)
    );
}

#[test]
fn shared_prefix_on_one_rank_is_counted_once() {
    let index = Index::new();
    let rec = recorder();
    let t0 = Instant::now();
    let a = [1u64, 2, 3, 4];
    let b = [1u64, 2, 7];
    rec.record(&index, rank(1), &a, t0).unwrap();
    let out = rec.record(&index, rank(1), &b, t0 + secs(1)).unwrap();
    assert_eq!((out.stored, out.refreshed), (1, 2));
    assert_eq!(rec.len(), 5);
    assert_eq!(device_blocks(&index, rank(1)), 5);
    assert_eq!(lookup(&index, &a).get(rank(1)), 4);
    assert_eq!(lookup(&index, &b).get(rank(1)), 3);
    // Same content at another position is another block.
    rec.record(&index, rank(1), &[5, 5, 5], t0).unwrap();
    assert_eq!(rec.len(), 8);
    // Recording an already-held prompt again adds nothing.
    let out = rec.record(&index, rank(1), &a, t0 + secs(2)).unwrap();
    assert_eq!((out.stored, out.refreshed), (0, 4));
    assert_eq!(rec.len(), 8);
    assert_eq!(device_blocks(&index, rank(1)), 8);
}

#[test]
fn ttl_expires_exactly_at_the_deadline() {
    let index = Index::new();
    let rec = recorder();
    let t0 = Instant::now();
    let p = [1u64, 2, 3];
    rec.record(&index, rank(1), &p, t0).unwrap();
    let just_before = t0 + TTL - Duration::from_nanos(1);
    assert_eq!(rec.expire(&index, just_before), 0);
    assert_eq!(rec.len(), 3);
    assert_eq!(lookup(&index, &p).get(rank(1)), 3);
    // Another rank's booking leaves rank 1's records alone (recording is per rank).
    let out = rec.record(&index, rank(2), &[50], t0 + TTL).unwrap();
    assert_eq!(out.expired, 0);
    assert_eq!(rec.len(), 4);
    // Rank 1's own booking at the deadline expires what of it is due as a side effect.
    let out = rec.record(&index, rank(1), &[60], t0 + TTL).unwrap();
    assert_eq!((out.stored, out.expired), (1, 3));
    assert_eq!(rec.len(), 2);
    assert!(lookup(&index, &p).is_empty());
    assert_eq!(device_blocks(&index, rank(1)), 1);
    assert_eq!(rec.stats().blocks_expired, 3);
    assert_eq!(index.stats().block_not_found, 0);
    // And the explicit call (the maintenance pass) expires every rank's.
    assert_eq!(rec.expire(&index, t0 + TTL + TTL), 2);
    assert!(rec.is_empty());
}

#[test]
fn rerecording_refreshes_the_deadline() {
    let index = Index::new();
    let rec = recorder();
    let t0 = Instant::now();
    let p = [1u64, 2, 3, 4];
    rec.record(&index, rank(1), &p, t0).unwrap();
    let out = rec.record(&index, rank(1), &p[..2], t0 + secs(60)).unwrap();
    assert_eq!((out.stored, out.refreshed), (0, 2));
    // The unrefreshed tail goes at the original deadline, the refreshed prefix stays.
    assert_eq!(rec.expire(&index, t0 + TTL), 2);
    assert_eq!(lookup(&index, &p).get(rank(1)), 2);
    assert_eq!(rec.len(), 2);
    assert_eq!(
        rec.expire(&index, t0 + secs(60) + TTL - Duration::from_nanos(1)),
        0
    );
    assert_eq!(lookup(&index, &p).get(rank(1)), 2);
    assert_eq!(rec.expire(&index, t0 + secs(60) + TTL), 2);
    assert!(lookup(&index, &p).is_empty());
    assert!(rec.is_empty());
    assert_eq!(rec.stats().blocks_refreshed, 2);
}

/// Ten shared prefix blocks, then 20 blocks of prompt `i`'s own.
fn prefixed_prompt(i: u64) -> Vec<u64> {
    (1..=10)
        .chain((0..20).map(|j| 1000 * (i + 1) + j))
        .collect()
}

/// Rank 1 holds exactly 100 records: prompts 0..4 (30 + 3 × 20) and ten blocks of
/// their own, booked at t0 + 0..=4 s.
fn fill_rank_one_to_100(index: &Index, rec: &ApproxRecorder, t0: Instant) {
    for i in 0..4 {
        let out = rec
            .record(index, rank(1), &prefixed_prompt(i), t0 + secs(i))
            .unwrap();
        assert_eq!((out.over_bound, out.evicted), (0, 0));
    }
    let own: Vec<u64> = (50_000..50_010).collect();
    rec.record(index, rank(1), &own, t0 + secs(4)).unwrap();
    assert_eq!(rec.len(), 100);
}

#[test]
fn at_the_bound_a_booking_evicts_its_ranks_least_recent_bookings() {
    let index = Index::new();
    let rec = ApproxRecorder::new(ApproxConfig {
        max_blocks: 100,
        ..Default::default()
    });
    let t0 = Instant::now();
    for i in 0..4 {
        rec.record(&index, rank(1), &prefixed_prompt(i), t0 + secs(i))
            .unwrap();
    }
    assert_eq!(rec.len(), 90);
    // 110 > 100: the booking evicts the least recently booked records of its rank, prompt
    // 0's own 20 (the shared 10 were booked again since), and records its whole prompt.
    let out = rec
        .record(&index, rank(1), &prefixed_prompt(4), t0 + secs(4))
        .unwrap();
    assert_eq!(
        (out.stored, out.refreshed, out.over_bound, out.evicted),
        (20, 10, 0, 20)
    );
    assert_eq!(rec.len(), 90);
    assert_eq!(lookup(&index, &prefixed_prompt(4)).get(rank(1)), 30);
    assert_eq!(lookup(&index, &prefixed_prompt(0)).get(rank(1)), 10);
    for i in 1..4 {
        assert_eq!(lookup(&index, &prefixed_prompt(i)).get(rank(1)), 30);
    }
    let s = rec.stats();
    assert_eq!((s.blocks_pruned, s.blocks_over_bound), (20, 0));
    assert_eq!(device_blocks(&index, rank(1)), 90);
    // A booking naming old blocks again makes them the most recent: prompt 1 is now the
    // least recent, and a new prompt needing 20 evicts it, not prompt 2.
    rec.record(&index, rank(1), &prefixed_prompt(2), t0 + secs(5))
        .unwrap();
    let out = rec
        .record(&index, rank(1), &prefixed_prompt(5), t0 + secs(6))
        .unwrap();
    assert_eq!((out.stored, out.evicted), (20, 20));
    assert_eq!(lookup(&index, &prefixed_prompt(1)).get(rank(1)), 10);
    assert_eq!(lookup(&index, &prefixed_prompt(2)).get(rank(1)), 30);
    assert_eq!(index.stats().block_not_found, 0);
}

/// The reported failure: under load the bound filled and every later booking went
/// unrecorded until the next maintenance pass. Now the newest prompt is always found.
#[test]
fn booking_far_past_the_bound_still_finds_the_newest_prompt() {
    let index = Index::new();
    let rec = ApproxRecorder::new(ApproxConfig {
        max_blocks: 1000,
        ..Default::default()
    });
    let t0 = Instant::now();
    // 300 prompts of 256 blocks (4,096 tokens at block size 16) on two ranks: 77 times
    // the bound, no maintenance pass in between.
    for i in 0..300u64 {
        let p: Vec<u64> = (0..256).map(|j| (i << 20) | j).collect();
        let r = rank(1 + i % 2);
        let now = t0 + Duration::from_millis(i);
        let out = rec.record(&index, r, &p, now).unwrap();
        assert_eq!(out.over_bound, 0, "prompt {i}");
        assert_eq!(lookup(&index, &p).get(r), 256, "prompt {i}");
        assert!(rec.len() <= 1000);
    }
    assert_eq!(rec.stats().blocks_over_bound, 0);
}

#[test]
fn a_rank_holding_too_little_prunes_across_ranks_deepest_first() {
    let index = Index::new();
    let rec = ApproxRecorder::new(ApproxConfig {
        max_blocks: 100,
        ..Default::default()
    });
    let t0 = Instant::now();
    fill_rank_one_to_100(&index, &rec, t0);
    // Rank 2 holds nothing to evict: the booking prunes to 80 %, deepest first (depths
    // 29..=25 hold four records each), then records its block.
    let out = rec.record(&index, rank(2), &[7], t0 + secs(4)).unwrap();
    assert_eq!((out.stored, out.over_bound, out.evicted), (1, 0, 0));
    assert_eq!(rec.len(), 81);
    assert_eq!(device_blocks(&index, rank(1)), 80);
    assert_eq!(rec.stats().blocks_pruned, 20);
    for i in 0..4 {
        // Oldest prompts included: their shallow blocks survive, only the tails go.
        assert_eq!(
            lookup(&index, &prefixed_prompt(i)).get(rank(1)),
            25,
            "prompt {i}"
        );
    }
    let prefix: Vec<u64> = (1..=10).collect();
    assert_eq!(lookup(&index, &prefix).get(rank(1)), 10);
    assert_eq!(lookup(&index, &[7]).get(rank(2)), 1);
    // A prompt longer than the bound is recorded up to what fits, the rest counted; the
    // maintenance pass then prunes again.
    let long: Vec<u64> = (90_000..90_150).collect();
    let out = rec.record(&index, rank(3), &long, t0 + secs(5)).unwrap();
    assert!(out.over_bound > 0);
    assert_eq!(out.stored + out.over_bound, 150);
    assert_eq!(rec.len(), 100);
    assert_eq!(lookup(&index, &long).get(rank(3)), out.stored as u32);
    rec.expire(&index, t0 + secs(5));
    assert_eq!(rec.len(), 80);
    assert_eq!(index.stats().block_not_found, 0);
}

#[test]
fn prune_ties_at_the_cut_depth_go_oldest_first() {
    let index = Index::new();
    let rec = ApproxRecorder::new(ApproxConfig {
        max_blocks: 100,
        prune_to: 0.83,
        ..Default::default()
    });
    let t0 = Instant::now();
    fill_rank_one_to_100(&index, &rec, t0);
    // Prune 17: depths 29..=26 (16 records) and the oldest record at depth 25.
    rec.record(&index, rank(2), &[7], t0 + secs(5)).unwrap();
    assert_eq!(rec.len(), 84);
    let got: Vec<u32> = (0..4)
        .map(|i| lookup(&index, &prefixed_prompt(i)).get(rank(1)))
        .collect();
    assert_eq!(got, vec![25, 26, 26, 26]);
}

#[test]
fn ranks_are_independent() {
    let index = Index::new();
    let rec = recorder();
    let t0 = Instant::now();
    let p = [1u64, 2, 3, 4];
    rec.record(&index, rank(1), &p[..3], t0).unwrap();
    let out = rec.record(&index, rank(2), &p, t0 + secs(30)).unwrap();
    // Rank 1's records do not make rank 2's "refreshed".
    assert_eq!((out.stored, out.refreshed), (4, 0));
    assert_eq!(rec.len(), 7);
    let m = lookup(&index, &p);
    assert_eq!(m.as_slice(), &[(rank(1), 3), (rank(2), 4)]);
    // Rank 2's booking refreshed nothing of rank 1.
    assert_eq!(rec.expire(&index, t0 + TTL), 3);
    assert_eq!(lookup(&index, &p).as_slice(), &[(rank(2), 4)]);
    assert_eq!(rec.expire(&index, t0 + secs(30) + TTL), 4);
    assert!(lookup(&index, &p).is_empty());
}

#[test]
fn forget_rank_drops_its_records_only() {
    let index = Index::new();
    let rec = recorder();
    let t0 = Instant::now();
    let p = [1u64, 2, 3];
    rec.record(&index, rank(1), &p, t0).unwrap();
    rec.record(&index, rank(2), &p[..2], t0).unwrap();
    assert!(index.remove_rank(rank(1)));
    rec.forget_rank(rank(1));
    rec.forget_rank(rank(9)); // unknown: nothing happens
    assert_eq!(rec.len(), 2);
    assert_eq!(lookup(&index, &p).as_slice(), &[(rank(2), 2)]);
    // Rank 1 comes back: its blocks are new again and stored from scratch.
    let out = rec.record(&index, rank(1), &p, t0 + secs(10)).unwrap();
    assert_eq!((out.stored, out.refreshed), (3, 0));
    assert_eq!(lookup(&index, &p).get(rank(1)), 3);
    // The forgotten records' old deadline passes without touching the index.
    assert_eq!(rec.expire(&index, t0 + TTL), 2);
    assert_eq!(lookup(&index, &p).as_slice(), &[(rank(1), 3)]);
    assert_eq!(index.stats().block_not_found, 0);
    assert_eq!(rec.expire(&index, t0 + secs(10) + TTL), 3);
    assert!(rec.is_empty());
}

#[test]
fn now_going_backwards_loses_nothing_not_due() {
    let index = Index::new();
    let rec = recorder();
    let t0 = Instant::now();
    let t1 = t0 + secs(100);
    let a = [1u64, 2, 3];
    let b = [1u64, 2, 7, 8];
    rec.record(&index, rank(1), &a, t1).unwrap();
    // Earlier than the last call: 1 and 2 keep their later deadline, 7 and 8 get t0 + TTL.
    let out = rec.record(&index, rank(1), &b, t0).unwrap();
    assert_eq!((out.stored, out.refreshed, out.expired), (2, 2, 0));
    rec.record(&index, rank(1), &a, t0 + secs(50)).unwrap();
    assert_eq!(rec.expire(&index, t0), 0);
    assert_eq!(rec.expire(&index, t0 + TTL - Duration::from_nanos(1)), 0);
    assert_eq!(rec.len(), 5);
    assert_eq!(rec.expire(&index, t0 + TTL), 2);
    assert_eq!(lookup(&index, &b).get(rank(1)), 2);
    assert_eq!(lookup(&index, &a).get(rank(1)), 3);
    // Backwards again: nothing is due.
    assert_eq!(rec.expire(&index, t0 + secs(1)), 0);
    assert_eq!(rec.len(), 3);
    assert_eq!(rec.expire(&index, t1 + TTL - Duration::from_nanos(1)), 0);
    assert_eq!(rec.expire(&index, t1 + TTL), 3);
    assert!(rec.is_empty());
    assert!(lookup(&index, &a).is_empty());
    assert_eq!(index.stats().block_not_found, 0);
}

#[test]
fn empty_prompt_is_a_no_op() {
    let index = Index::new();
    let rec = recorder();
    let t0 = Instant::now();
    rec.record(&index, rank(1), &[1], t0).unwrap();
    // Even at a time when the record above is due: a no-op does not expire.
    let out = rec.record(&index, rank(2), &[], t0 + TTL).unwrap();
    assert_eq!(out, RecordOutcome::default());
    assert_eq!(rec.len(), 1);
    assert_eq!(index.ranks(), vec![rank(1)]);
    assert_eq!(rec.stats().records, 1);
}

/// End to end through a real index filled to `MAX_RANKS` (the module's unit test covers
/// the same path with a refusing index). Each rank stores one block of its own (a store
/// of nothing creates no rank). The slot directory grows by doubling, so creating 2^18
/// ranks is linear (it used to copy the directory per new rank: about 9 minutes).
#[test]
fn index_refusal_is_returned_and_counted() {
    let index = Index::new();
    let rec = recorder();
    let t0 = Instant::now();
    for w in 0..u64::from(MAX_RANKS) {
        let block = kvr::StoredBlock {
            external_hash: w,
            local_hash: w | 1 << 63,
        };
        index
            .store(RankId::new(w, 0), Tier::Device, None, &[block])
            .unwrap();
    }
    let before = rec.len();
    let r = rec.record(&index, RankId::new(u64::MAX, 0), &[1, 2], t0);
    assert_eq!(r, Err(IndexError::TooManyRanks));
    assert_eq!(rec.len(), before);
    assert_eq!(rec.stats().record_errors, 1);
    assert_eq!(rec.stats().records, 0);
    // A rank the index already tracks still records.
    rec.record(&index, RankId::new(7, 0), &[1, 2], t0).unwrap();
    assert_eq!(lookup(&index, &[1, 2]).get(RankId::new(7, 0)), 2);
}

// ---------------------------------------------------------------------------------------
// Differential test against a naive model.

/// The specification, written plainly: records (rank, seq) → (deadline, depth).
struct Model {
    ttl: Duration,
    max: usize,
    target: usize,
    recs: HashMap<(RankId, u64), (Instant, u32)>,
    stats: ApproxStats,
    /// A recording was cut short by the bound: the next `expire` prunes.
    prune_wanted: bool,
}

impl Model {
    fn record(&mut self, r: RankId, locals: &[u64], now: Instant) -> RecordOutcome {
        let mut out = RecordOutcome::default();
        if locals.is_empty() {
            return out;
        }
        let deadline = now + self.ttl;
        let seqs = sequence_hashes(locals);
        let mut pruned = false;
        let keep = loop {
            let new: Vec<usize> = (0..seqs.len())
                .filter(|&i| !self.recs.contains_key(&(r, seqs[i])))
                .collect();
            let room = self.max - self.recs.len();
            if new.len() <= room {
                break seqs.len();
            }
            // At the bound: evict the rank's least recent bookings (whole groups of the
            // earliest deadline), never the prompt's own blocks.
            let need = new.len() - room;
            let mut gone = 0;
            while gone < need {
                let evictable = |k: &(RankId, u64)| k.0 == r && !seqs.contains(&k.1);
                let Some(oldest) = self
                    .recs
                    .iter()
                    .filter(|(k, _)| evictable(k))
                    .map(|(_, v)| v.0)
                    .min()
                else {
                    break;
                };
                let before = self.recs.len();
                self.recs.retain(|k, v| !(evictable(k) && v.0 == oldest));
                gone += before - self.recs.len();
            }
            out.evicted += gone;
            self.stats.blocks_pruned += gone as u64;
            if new.len() <= self.max - self.recs.len() {
                continue;
            }
            // The rank holds too few: prune across ranks once, then what fits.
            if !pruned {
                self.prune();
                pruned = true;
                continue;
            }
            self.prune_wanted = true;
            break new[self.max - self.recs.len()];
        };
        out.over_bound = seqs.len() - keep;
        for (depth, &seq) in seqs[..keep].iter().enumerate() {
            match self.recs.get_mut(&(r, seq)) {
                Some(e) => {
                    e.0 = e.0.max(deadline);
                    out.refreshed += 1;
                }
                None => {
                    self.recs.insert((r, seq), (deadline, depth as u32));
                    out.stored += 1;
                }
            }
        }
        self.stats.records += 1;
        self.stats.blocks_recorded += out.stored as u64;
        self.stats.blocks_refreshed += out.refreshed as u64;
        self.stats.blocks_over_bound += out.over_bound as u64;
        // Only this rank's records expire.
        let before = self.recs.len();
        self.recs.retain(|k, v| k.0 != r || v.0 > now);
        out.expired = before - self.recs.len();
        self.stats.blocks_expired += out.expired as u64;
        out
    }

    /// The maintenance pass: every rank's expiry, then the prune a cut-short recording
    /// asked for.
    fn expire(&mut self, now: Instant) -> usize {
        let before = self.recs.len();
        self.recs.retain(|_, v| v.0 > now);
        let n = before - self.recs.len();
        self.stats.blocks_expired += n as u64;
        if std::mem::take(&mut self.prune_wanted) {
            self.prune();
        }
        n
    }

    /// The prune across ranks, down to `target`.
    fn prune(&mut self) {
        if self.recs.len() <= self.target {
            return;
        }
        let mut all: Vec<_> = self.recs.iter().map(|(&k, &v)| (k, v)).collect();
        // Deepest first, then the soonest deadline, then rank, then hash.
        all.sort_by(|a, b| (b.1 .1, a.1 .0, a.0 .0, a.0 .1).cmp(&(a.1 .1, b.1 .0, b.0 .0, b.0 .1)));
        let excess = self.recs.len() - self.target;
        for (k, _) in &all[..excess] {
            self.recs.remove(k);
        }
        self.stats.blocks_pruned += excess as u64;
    }

    fn forget(&mut self, r: RankId) {
        self.recs.retain(|k, _| k.0 != r);
    }

    /// Expected `find_matches`: per rank, the leading blocks it has records of.
    fn matches(&self, locals: &[u64], ranks: &[RankId]) -> Vec<(RankId, u32)> {
        let seqs = sequence_hashes(locals);
        let mut out = Vec::new();
        for &r in ranks {
            let n = seqs
                .iter()
                .take_while(|s| self.recs.contains_key(&(r, **s)))
                .count();
            if n > 0 {
                out.push((r, n as u32));
            }
        }
        out
    }

    fn per_rank(&self) -> BTreeMap<RankId, u64> {
        let mut m = BTreeMap::new();
        for &(r, _) in self.recs.keys() {
            *m.entry(r).or_insert(0) += 1;
        }
        m
    }
}

/// Prompts sharing system prefixes and extending each other (multi-turn).
fn prompt_pool(rng: &mut Rng) -> Vec<Vec<u64>> {
    let prefixes: Vec<Vec<u64>> = (0..5)
        .map(|_| (0..rng.range(1, 8)).map(|_| rng.next_u64()).collect())
        .collect();
    let mut pool: Vec<Vec<u64>> = Vec::new();
    for _ in 0..40 {
        let mut p = if !pool.is_empty() && rng.chance(1, 3) {
            rng.pick(&pool).clone()
        } else {
            rng.pick(&prefixes).clone()
        };
        p.extend((0..rng.range(0, 20)).map(|_| rng.next_u64()));
        pool.push(p);
    }
    pool
}

fn query_prompt(rng: &mut Rng, pool: &[Vec<u64>]) -> Vec<u64> {
    let mut p = pool[rng.skewed(pool.len())].clone();
    match rng.below(4) {
        0 => p.truncate(rng.below(p.len() + 1)),
        1 if !p.is_empty() => {
            let i = rng.below(p.len());
            p[i] = rng.next_u64();
        }
        2 => p.push(rng.next_u64()),
        _ => {}
    }
    p
}

fn differential(seed: u64, ops: usize, backwards: bool) {
    let mut rng = Rng::new(seed);
    let config = ApproxConfig {
        ttl: secs(60),
        max_blocks: 150 + rng.below(100),
        prune_to: 0.8,
    };
    let index = Index::new();
    let rec = ApproxRecorder::new(config);
    let mut model = Model {
        ttl: config.ttl,
        max: config.max_blocks,
        target: (config.max_blocks as f64 * 0.8).floor() as usize,
        recs: HashMap::new(),
        stats: ApproxStats::default(),
        prune_wanted: false,
    };
    let ranks: Vec<RankId> = (1..=3)
        .flat_map(|w| (0..2).map(move |d| RankId::new(w, d)))
        .collect();
    let pool = prompt_pool(&mut rng);
    let base = Instant::now();
    let mut t_ms: u64 = 1_000_000;
    let mut log: Vec<String> = Vec::new();
    let mut scores = kvr::OverlapScores::new();

    for op in 0..ops {
        // Time: mostly small steps, sometimes a jump past the TTL, sometimes backwards.
        t_ms = match rng.below(20) {
            0 => t_ms + rng.range(30_000, 90_000) as u64,
            1 if backwards => t_ms.saturating_sub(rng.range(0, 40_000) as u64),
            2 | 3 => t_ms,
            _ => t_ms + rng.below(3_000) as u64,
        };
        let now = base + Duration::from_millis(t_ms);
        let r = ranks[rng.skewed(ranks.len())];
        let ctx = |log: &[String]| {
            format!(
                "seed {seed:#x} op {op} (backwards: {backwards}); last ops:\n{}",
                log.join("\n")
            )
        };
        match rng.below(20) {
            0..=13 => {
                let mut p = pool[rng.skewed(pool.len())].clone();
                if rng.chance(1, 4) {
                    p.truncate(rng.below(p.len() + 1));
                }
                log.push(format!("t={t_ms} record {r} len {}", p.len()));
                let got = rec.record(&index, r, &p, now).unwrap();
                let want = model.record(r, &p, now);
                assert_eq!(got, want, "record outcome; {}", ctx(&log));
            }
            14..=16 => {
                log.push(format!("t={t_ms} expire"));
                let got = rec.expire(&index, now);
                let want = model.expire(now);
                assert_eq!(got, want, "expired; {}", ctx(&log));
            }
            17 => {
                log.push(format!("t={t_ms} forget {r}"));
                rec.forget_rank(r);
                index.remove_rank(r);
                model.forget(r);
            }
            _ => {
                log.push(format!("t={t_ms} record {r} empty"));
                let got = rec.record(&index, r, &[], now).unwrap();
                assert_eq!(got, RecordOutcome::default(), "{}", ctx(&log));
            }
        }
        if log.len() > 12 {
            log.remove(0);
        }

        assert_eq!(rec.len(), model.recs.len(), "len; {}", ctx(&log));
        assert!(rec.len() <= config.max_blocks, "over bound; {}", ctx(&log));
        for _ in 0..4 {
            let q = query_prompt(&mut rng, &pool);
            index.find_matches_into(&sequence_hashes(&q), &mut scores);
            assert_eq!(
                scores.as_slice(),
                model.matches(&q, &ranks).as_slice(),
                "find_matches; {}",
                ctx(&log)
            );
        }
        if op % 25 == 0 {
            let want = model.per_rank();
            for &r in &ranks {
                assert_eq!(
                    device_blocks(&index, r),
                    want.get(&r).copied().unwrap_or(0),
                    "index blocks of {r}; {}",
                    ctx(&log)
                );
            }
        }
    }
    assert_eq!(rec.stats(), model.stats, "stats; seed {seed:#x}");
    assert_eq!(index.stats().block_not_found, 0, "seed {seed:#x}");
    assert_eq!(index.stats().parent_not_found, 0, "seed {seed:#x}");
    let s = rec.stats();
    // The workload must exercise every path, or the comparison proves little.
    assert!(
        s.blocks_expired > 0 && s.blocks_pruned > 0 && s.blocks_refreshed > 0,
        "seed {seed:#x}: a path went unexercised: {s:?}"
    );
}

fn ops() -> usize {
    env_u64("KVR_DIFF_OPS").map_or(4000, |n| n as usize)
}

fn seeds(defaults: &[u64]) -> Vec<u64> {
    match env_u64("KVR_DIFF_SEED") {
        Some(s) => vec![s],
        None => defaults.to_vec(),
    }
}

#[test]
fn differential_against_naive_model() {
    for seed in seeds(&[1, 0xa77, 0xbeef, 42]) {
        differential(seed, ops(), false);
    }
}

#[test]
fn differential_against_naive_model_with_time_going_backwards() {
    for seed in seeds(&[7, 0xdead, 99]) {
        differential(seed, ops(), true);
    }
}
