//! Concurrent readers against one or two writers: the index must never overcount while
//! events are being applied, and must equal the naive model once quiescent.
//!
//! How an overcount is detected under concurrency. The queries are prefixes of a fixed
//! pool of prompt chains, so every block a query can ask about is known up front. For
//! each (rank, block, tier) the writer keeps episode counters next to the index:
//! - `up` is incremented *before* applying an event that makes the rank start holding the
//!   block (the model, applied first, says which blocks an event makes held at any point,
//!   transiently included);
//! - `down` is incremented *after* applying an event that leaves the block no longer held.
//!
//! A reader loads `down` (R0) for the blocks of its query, runs the query, then loads `up`
//! (S1). If the query saw the rank hold a block, some holding episode k was visible during
//! the query: its `up` increment preceded the event that the reader observed, so S1 ≥ k;
//! and it had not ended before the query began (else, by the Release/Acquire chain through
//! `down`, the reader could not see it), so R0 < k. Hence every block a reported score
//! covers must satisfy S1 > R0, per tier for the tiered query: never a block no live event
//! put there.
//!
//! The other direction: `begin`/`end` count events touching the key (before/after) and
//! `held` is its state between events. A block whose key saw no event in flight from
//! before the query until after it (begin == end at the start, begin unchanged at the
//! end) was held or not held throughout, so a stably held leading run must be reported in
//! full (no lost updates, e.g. across a table rebuild or a holder-set rewrite by another
//! rank), and for a rank whose keys were all stable the tiered answer is exact.
//!
//! Also: reported ranks are real and sorted, scores lie in 1..=len. When the writers stop,
//! the index must equal the union of the writers' models exactly.
//!
//! Environment overrides: `KVR_CONC_SEED`, `KVR_CONC_OPS` (events per writer; default
//! 60,000 in `--release`, a tenth in unoptimized builds).

// A host of the engine, not engine code: the sync-facade rule (engine/clippy.toml) is
// for engine/src.
#![allow(clippy::disallowed_types)]

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Instant;

use common::model::{self, assert_stats_equal, Model, Transition, TIERS};
use common::rng::{env_u64, Rng};
use kvr::config::IndexConfig;
use kvr::{Index, OverlapScores};
use kvr::{KvEvent, RankId, StoredBlock, Tier};

const READERS: usize = 3;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    z = (z ^ (z >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    z ^ (z >> 33)
}

#[derive(Default)]
struct Key {
    up: AtomicU64,
    down: AtomicU64,
    begin: AtomicU64,
    end: AtomicU64,
    held: AtomicBool,
}

/// Everything the readers and writers share (immutable but for the atomics).
struct Shared {
    index: Index,
    ranks: Vec<RankId>,
    rank_pos: HashMap<RankId, usize>,
    /// Pool chains: local hashes, sequence hashes, and the block id of each sequence hash.
    locals: Vec<Vec<u64>>,
    seqs: Vec<Vec<u64>>,
    ids: Vec<Vec<usize>>,
    block_of: HashMap<u64, usize>,
    keys: Vec<Key>,
    writers_done: AtomicU64,
}

impl Shared {
    fn key(&self, rank: usize, block: usize, tier: Tier) -> &Key {
        &self.keys[(rank * self.block_of.len() + block) * 3 + tier as usize]
    }

    fn ext(&self, rank: RankId, c: usize, j: usize) -> u64 {
        mix(self.seqs[c][j] ^ rank.worker_id.wrapping_mul(0x9e37))
    }
}

fn build(seed: u64, dp_sizes: &[u32], config: IndexConfig) -> Shared {
    let mut rng = Rng::new(seed);
    let mut ranks = Vec::new();
    for (w, &dp) in dp_sizes.iter().enumerate() {
        for d in 0..dp {
            ranks.push(RankId::new(w as u64 + 1, d));
        }
    }
    let prefixes: Vec<Vec<u64>> = (0..4)
        .map(|_| {
            let n = rng.range(1, 5);
            (0..n).map(|_| rng.next_u64()).collect()
        })
        .collect();
    let mut locals: Vec<Vec<u64>> = Vec::new();
    for i in 0..48 {
        let mut l = if i % 3 == 1 && !locals.is_empty() {
            locals[rng.below(locals.len())].clone()
        } else if i % 3 == 0 {
            prefixes[rng.skewed(prefixes.len())].clone()
        } else {
            Vec::new()
        };
        let body = rng.range(1, 16);
        l.extend((0..body).map(|_| rng.next_u64()));
        l.truncate(40);
        locals.push(l);
    }
    let seqs: Vec<Vec<u64>> = locals.iter().map(|l| model::seqs(l)).collect();
    let mut block_of = HashMap::new();
    for s in seqs.iter().flatten() {
        let n = block_of.len();
        block_of.entry(*s).or_insert(n);
    }
    let ids = seqs
        .iter()
        .map(|s| s.iter().map(|x| block_of[x]).collect())
        .collect();
    let keys = (0..ranks.len() * block_of.len() * 3)
        .map(|_| Key::default())
        .collect();
    Shared {
        index: Index::with_config(config),
        rank_pos: ranks.iter().enumerate().map(|(i, r)| (*r, i)).collect(),
        ranks,
        locals,
        seqs,
        ids,
        block_of,
        keys,
        writers_done: AtomicU64::new(0),
    }
}

#[derive(Debug)]
enum Op {
    Store {
        rank: RankId,
        tier: Tier,
        parent: Option<u64>,
        blocks: Vec<StoredBlock>,
    },
    Remove {
        rank: RankId,
        tier: Tier,
        hashes: Vec<u64>,
    },
    Clear(RankId),
    RemoveRank(RankId),
    RemoveWorker(u64),
}

struct Writer<'a> {
    sh: &'a Shared,
    rng: Rng,
    workers: Vec<u64>,
    ranks: Vec<RankId>,
    model: Model,
}

impl Writer<'_> {
    fn progress(&self, rank: RankId, c: usize) -> usize {
        let Some(rm) = self.model.rank(rank) else {
            return 0;
        };
        (0..self.sh.seqs[c].len())
            .take_while(|&j| rm.resolve(self.sh.ext(rank, c, j)).is_some())
            .count()
    }

    fn next_op(&mut self) -> Op {
        let sh = self.sh;
        let rng = &mut self.rng;
        let rare = rng.below(1000);
        if rare < 2 {
            return Op::RemoveWorker(*rng.pick(&self.workers));
        }
        let rank = *rng.pick(&self.ranks);
        if rare < 4 {
            return Op::RemoveRank(rank);
        }
        if rare < 12 {
            return Op::Clear(rank);
        }
        let live = self.model.rank(rank).map_or(0, |r| r.names_len());
        let remove_pct = if live > 150 { 60 } else { 35 };
        if live > 0 && rng.below(100) < remove_pct {
            let rm = self.model.rank(rank).unwrap();
            let tiers: Vec<Tier> = TIERS
                .into_iter()
                .filter(|t| !rm.names[*t as usize].is_empty())
                .collect();
            let from = *rng.pick(&tiers);
            let mut names: Vec<u64> = rm.names[from as usize].keys().copied().collect();
            names.sort_unstable();
            let k = rng.range(1, 4);
            let mut hashes: Vec<u64> = (0..k).map(|_| *rng.pick(&names)).collect();
            if rng.chance(1, 10) {
                hashes.push(rng.next_u64());
            }
            let tier = if rng.chance(1, 8) {
                TIERS[(from as usize + rng.range(1, 2)) % 3]
            } else {
                from
            };
            return Op::Remove { rank, tier, hashes };
        }
        let c = rng.skewed(sh.seqs.len());
        let n = sh.seqs[c].len();
        let p = self.progress(rank, c);
        let rng = &mut self.rng;
        let mut tier = match rng.below(10) {
            0..=6 => Tier::Device,
            7..=8 => Tier::Host,
            _ => Tier::Disk,
        };
        let start = match rng.below(10) {
            0..=5 if p < n => p,
            0..=7 => 0,
            _ => rng.below(n),
        };
        let mut parent = (start > 0).then(|| sh.ext(rank, c, start - 1));
        if rng.chance(1, 30) {
            parent = Some(rng.next_u64());
        }
        if start > 0 && rng.chance(1, 4) {
            tier = if rng.chance(1, 2) {
                Tier::Host
            } else {
                Tier::Disk
            };
        }
        let m = rng.range(1, 8).min(n - start);
        let mut blocks: Vec<StoredBlock> = (start..start + m)
            .map(|j| StoredBlock {
                external_hash: sh.ext(rank, c, j),
                local_hash: sh.locals[c][j],
            })
            .collect();
        if rng.chance(1, 30) {
            // The name moves to other content (outside the pool).
            let j = rng.below(m);
            blocks[j].local_hash = rng.next_u64();
        }
        if rng.chance(1, 20) {
            // A second name for a block.
            let j = rng.below(m);
            blocks[j].external_hash = mix(blocks[j].external_hash ^ 0x5555);
        }
        Op::Store {
            rank,
            tier,
            parent,
            blocks,
        }
    }

    /// Applies `op` to the model, then to the index between the episode counters.
    fn step(&mut self, op: &Op) {
        let sh = self.sh;
        self.model.log = Some(Vec::new());
        let want = match op {
            Op::Store {
                rank,
                tier,
                parent,
                blocks,
            } => format!("{:?}", self.model.store(*rank, *tier, *parent, blocks)),
            Op::Remove { rank, tier, hashes } => {
                format!("{:?}", self.model.remove(*rank, *tier, hashes))
            }
            Op::Clear(rank) => format!("{:?}", self.model.clear(*rank)),
            Op::RemoveRank(rank) => format!("{:?}", self.model.remove_rank(*rank)),
            Op::RemoveWorker(w) => format!("{:?}", self.model.remove_worker(*w)),
        };
        let log = self.model.log.take().unwrap();
        // Per pool key: (first transition, last transition).
        let mut touched: HashMap<(usize, usize, Tier), (bool, bool)> = HashMap::new();
        for Transition {
            rank,
            tier,
            seq,
            held,
        } in log
        {
            let Some(&b) = sh.block_of.get(&seq) else {
                continue; // not a pool block: no query can ask for it
            };
            let r = sh.rank_pos[&rank];
            touched
                .entry((r, b, tier))
                .and_modify(|e| e.1 = held)
                .or_insert((held, held));
        }
        let mut keys: Vec<_> = touched.into_iter().collect();
        keys.sort_unstable_by_key(|e| e.0);
        for &((r, b, t), (first, _)) in &keys {
            let k = sh.key(r, b, t);
            k.begin.fetch_add(1, SeqCst);
            if first {
                k.up.fetch_add(1, SeqCst);
            }
        }
        let got = match op {
            Op::Store {
                rank,
                tier,
                parent,
                blocks,
            } => {
                if blocks.len() % 2 == 0 {
                    format!("{:?}", sh.index.store(*rank, *tier, *parent, blocks))
                } else {
                    let ev = KvEvent::Stored {
                        tier: *tier,
                        parent: *parent,
                        blocks,
                    };
                    format!("{:?}", sh.index.apply(*rank, &ev).map(|o| o.stored))
                }
            }
            Op::Remove { rank, tier, hashes } => {
                let ev = KvEvent::Removed {
                    tier: *tier,
                    external_hashes: hashes,
                };
                format!("{:?}", sh.index.apply(*rank, &ev).unwrap())
            }
            Op::Clear(rank) => format!("{:?}", sh.index.clear(*rank)),
            Op::RemoveRank(rank) => format!("{:?}", sh.index.remove_rank(*rank)),
            Op::RemoveWorker(w) => format!("{:?}", sh.index.remove_worker(*w)),
        };
        for &((r, b, t), (_, last)) in &keys {
            let k = sh.key(r, b, t);
            k.held.store(last, SeqCst);
            if !last {
                k.down.fetch_add(1, SeqCst);
            }
            k.end.fetch_add(1, SeqCst);
        }
        assert_eq!(got, want, "outcome of {op:?} (index vs model)");
    }
}

#[derive(Default, Debug, Clone, Copy)]
struct ReaderCounts {
    queries: u64,
    scored_ranks: u64,
    checked_blocks: u64,
    stable_prefix_blocks: u64,
    exact_tiered: u64,
}

/// Per query block and tier, what the reader loaded before the query.
#[derive(Clone, Copy, Default)]
struct Before {
    down: u64,
    begin: u64,
    /// `Some(held)` if no event was in flight on the key when loaded.
    stable: Option<bool>,
}

fn load_before(k: &Key) -> Before {
    let end = k.end.load(SeqCst);
    let held = k.held.load(SeqCst);
    let down = k.down.load(SeqCst);
    let begin = k.begin.load(SeqCst);
    Before {
        down,
        begin,
        stable: (begin == end).then_some(held),
    }
}

fn reader(sh: &Shared, seed: u64) -> ReaderCounts {
    let mut rng = Rng::new(seed);
    let mut c = ReaderCounts::default();
    let nr = sh.ranks.len();
    let mut before: Vec<Before> = Vec::new();
    let mut reuse = OverlapScores::new();
    let known: HashSet<RankId> = sh.ranks.iter().copied().collect();
    while sh.writers_done.load(SeqCst) == 0 || c.queries < 1000 {
        let ch = rng.skewed(sh.seqs.len());
        let n = sh.seqs[ch].len();
        let len = if rng.chance(1, 2) { n } else { rng.range(1, n) };
        let ids = &sh.ids[ch][..len];
        let tiered = rng.chance(1, 3);
        let tiers: &[Tier] = if tiered { &TIERS } else { &[Tier::Device] };
        // Load (rank, block, tier) keys before the query.
        before.clear();
        for r in 0..nr {
            for &b in ids {
                for &t in tiers {
                    before.push(load_before(sh.key(r, b, t)));
                }
            }
        }
        let at = |r: usize, j: usize, ti: usize| (r * len + j) * tiers.len() + ti;
        // Query. Then per reported rank: the blocks it claims must have been held.
        let mut reported: Vec<(RankId, [u32; 3])> = Vec::new();
        if tiered {
            let t = sh.index.find_matches_tiered(&sh.locals[ch][..len]);
            for e in t.iter() {
                reported.push((e.rank, [e.device, e.host, e.disk]));
            }
        } else if rng.chance(1, 2) {
            sh.index
                .find_matches_into(&sh.locals[ch][..len], &mut reuse);
            reported.extend(reuse.iter().map(|(r, s)| (r, [s, 0, 0])));
        } else {
            let m = sh.index.find_matches(&sh.locals[ch][..len]);
            reported.extend(m.iter().map(|(r, s)| (r, [s, 0, 0])));
        }
        c.queries += 1;
        for w in reported.windows(2) {
            assert!(w[0].0 < w[1].0, "results not sorted by rank: {reported:?}");
        }
        let mut scored = vec![[0u32; 3]; nr];
        for &(rank, sc) in &reported {
            assert!(known.contains(&rank), "a rank that never existed: {rank}");
            let total: u32 = sc.iter().sum();
            assert!(
                (1..=len as u32).contains(&total),
                "score {sc:?} of {rank} outside 1..={len}"
            );
            scored[sh.rank_pos[&rank]] = sc;
            c.scored_ranks += 1;
        }
        for (r, sc) in scored.iter().enumerate() {
            // Overcount check: block j reported on tier `tiers[ti]`.
            let mut j = 0;
            for (ti, &cnt) in sc.iter().enumerate().take(tiers.len()) {
                for _ in 0..cnt {
                    let k = sh.key(r, ids[j], tiers[ti]);
                    let up = k.up.load(SeqCst);
                    let b = before[at(r, j, ti)];
                    assert!(
                        up > b.down,
                        "OVERCOUNT: {} reported holding block {j} of chain {ch} on {:?} \
                         (score {sc:?}, query len {len}), but no event stored it during \
                         the query (up {up}, down before {})",
                        sh.ranks[r],
                        tiers[ti],
                        b.down
                    );
                    c.checked_blocks += 1;
                    j += 1;
                }
            }
            // Completeness for keys no event touched during the query.
            let unchanged = |j: usize, ti: usize| -> Option<bool> {
                let b = before[at(r, j, ti)];
                let k = sh.key(r, ids[j], tiers[ti]);
                if k.begin.load(SeqCst) == b.begin {
                    b.stable
                } else {
                    None
                }
            };
            let stable_prefix = (0..len)
                .take_while(|&j| unchanged(j, 0) == Some(true))
                .count() as u32;
            assert!(
                sc[0] >= stable_prefix,
                "LOST: {} holds the first {stable_prefix} blocks of chain {ch} on the device \
                 throughout the query, reported {sc:?}",
                sh.ranks[r]
            );
            c.stable_prefix_blocks += stable_prefix as u64;
            if tiered {
                let states: Option<Vec<[bool; 3]>> = (0..len)
                    .map(|j| Some([unchanged(j, 0)?, unchanged(j, 1)?, unchanged(j, 2)?]))
                    .collect();
                if let Some(states) = states {
                    let run = |from: usize, t: usize| {
                        states[from..].iter().take_while(|s| s[t]).count() as u32
                    };
                    let d = run(0, 0);
                    let h = run(d as usize, 1);
                    let k = run((d + h) as usize, 2);
                    assert_eq!(
                        *sc,
                        [d, h, k],
                        "tiered answer of {} for chain {ch} (len {len}) while all its keys \
                         were stable",
                        sh.ranks[r]
                    );
                    c.exact_tiered += 1;
                }
            }
        }
    }
    c
}

/// The quiescent end: the index equals the merged model exactly.
fn assert_equals_model(sh: &Shared, model: &Model) {
    let ctx = || "after the writers stopped".to_string();
    assert_stats_equal(&sh.index, model, &ctx);
    for (c, l) in sh.locals.iter().enumerate() {
        for len in [1, l.len() / 2, l.len()] {
            let q = &l[..len.max(1)];
            assert_eq!(
                sh.index.find_matches(q).as_slice(),
                model.find_matches(q).as_slice(),
                "find_matches of chain {c}[..{len}] after the writers stopped"
            );
            assert_eq!(
                sh.index.find_matches_tiered(q).as_slice(),
                model.find_matches_tiered(q).as_slice(),
                "find_matches_tiered of chain {c}[..{len}] after the writers stopped"
            );
        }
    }
}

fn run(name: &str, seed: u64, dp_sizes: &[u32], writer_workers: &[&[u64]], config: IndexConfig) {
    // Sized for `--release`; unoptimized builds run a tenth.
    let default_ops = if cfg!(debug_assertions) {
        6_000
    } else {
        60_000
    };
    let ops = env_u64("KVR_CONC_OPS").unwrap_or(default_ops) as usize;
    let started = Instant::now();
    let sh = Arc::new(build(seed, dp_sizes, config));
    let report = Report { name, seed };
    let (models, counts) = std::thread::scope(|s| {
        let readers: Vec<_> = (0..READERS)
            .map(|i| {
                let sh = &*sh;
                s.spawn(move || reader(sh, seed ^ (0x1000 + i as u64)))
            })
            .collect();
        let writers: Vec<_> = writer_workers
            .iter()
            .enumerate()
            .map(|(i, workers)| {
                let sh = &*sh;
                s.spawn(move || {
                    let mut w = Writer {
                        sh,
                        rng: Rng::new(seed ^ (0x2000 + i as u64)),
                        workers: workers.to_vec(),
                        ranks: sh
                            .ranks
                            .iter()
                            .filter(|r| workers.contains(&r.worker_id))
                            .copied()
                            .collect(),
                        model: Model::new(),
                    };
                    for i in 0..ops {
                        let op = w.next_op();
                        w.step(&op);
                        if i % 64 == 0 {
                            std::thread::yield_now();
                        }
                    }
                    w.model
                })
            })
            .collect();
        // Join the writers without unwrapping first, so the readers always get to stop.
        let models: Vec<_> = writers.into_iter().map(|h| h.join()).collect();
        sh.writers_done.store(1, SeqCst);
        let counts: Vec<ReaderCounts> = readers
            .into_iter()
            .map(|h| h.join().expect("reader panicked"))
            .collect();
        let models: Vec<Model> = models
            .into_iter()
            .map(|m| m.expect("writer panicked"))
            .collect();
        (models, counts)
    });
    let mut model = Model::new();
    for m in models {
        model.merge(m);
    }
    assert_equals_model(&sh, &model);
    let total = counts
        .iter()
        .fold(ReaderCounts::default(), |a, c| ReaderCounts {
            queries: a.queries + c.queries,
            scored_ranks: a.scored_ranks + c.scored_ranks,
            checked_blocks: a.checked_blocks + c.checked_blocks,
            stable_prefix_blocks: a.stable_prefix_blocks + c.stable_prefix_blocks,
            exact_tiered: a.exact_tiered + c.exact_tiered,
        });
    eprintln!(
        "{name}: seed {seed}, {} writer(s) x {ops} events, {READERS} readers: ok in {:.2?}; {total:?}; \
         final stats {:?}",
        writer_workers.len(),
        started.elapsed(),
        sh.index.stats()
    );
    assert!(
        total.checked_blocks > 10_000 && total.stable_prefix_blocks > 10_000,
        "the readers checked too little: {total:?}"
    );
    drop(report);
}

/// Prints the seed if the test panics.
struct Report<'a> {
    name: &'a str,
    seed: u64,
}

impl Drop for Report<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "\n=== {} FAILED with seed {} (rerun: KVR_CONC_SEED={} cargo test -p kvr \
                 --release --test index_concurrent {})",
                self.name, self.seed, self.seed, self.name
            );
        }
    }
}

#[test]
fn concurrent_one_writer() {
    let seed = env_u64("KVR_CONC_SEED").unwrap_or(11);
    run(
        "concurrent_one_writer",
        seed,
        &[4, 2, 3, 3],
        &[&[1, 2, 3, 4]],
        IndexConfig {
            shards: 8,
            min_shard_capacity: 16,
        },
    );
}

/// Two writers on disjoint workers, sharing two tiny shards (rebuilds all the time).
#[test]
fn concurrent_two_writers() {
    let seed = env_u64("KVR_CONC_SEED").unwrap_or(12);
    run(
        "concurrent_two_writers",
        seed,
        &[4, 2, 3, 3],
        &[&[1, 3], &[2, 4]],
        IndexConfig {
            shards: 2,
            min_shard_capacity: 4,
        },
    );
}
