//! Churn: millions of store/remove events over a bounded live set. Memory must track the
//! live blocks (DESIGN.md §4: "memory tracks live blocks under endless churn. Dynamo
//! leaked here; we must not").
//!
//! Workload: 16 ranks (4 workers × 4 dp ranks; worker 4 stores on the host tier). In
//! each round every rank stores one new chain and, once it holds `WINDOW` chains, evicts
//! its oldest (LRU). A chain is a 4-block system prefix shared by all ranks for
//! `GROUP_ROUNDS` rounds (so its nodes have 16 holders: heap holder sets) and 4 blocks of
//! its own, stored as two events (the second continuing from the first's last block);
//! an eviction removes the chain's own blocks (leaves first) and, when the rank's last
//! chain of a prefix goes, the prefix too. Every block's content is new, so the node
//! tables see an endless stream of fresh keys. After each later sample one rank is
//! cleared or one worker removed (its ranks return with their next stores), and refills
//! its window well before the next sample.
//!
//! Measurement: `stats().bytes` and the process RSS (Linux, `/proc/self/statm`) at the end
//! of rounds where every rank holds exactly `WINDOW` chains spanning whole prefix groups,
//! so every sample has the very same live set (asserted: same holder blocks, tier blocks
//! and nodes). The reference is the largest of the samples taken after warm-up (10 % to
//! 20 % of the events); every later sample must stay within 10 % of it.
//!
//! `KVR_CHURN_EVENTS` overrides the event count (default 5,000,000).

mod common;

use std::collections::VecDeque;
use std::time::Instant;

use common::rng::env_u64;
use kvr::Index;
use kvr::{RankId, StoredBlock, Tier};

const WORKERS: u64 = 4;
const DP: u32 = 4;
/// Live chains per rank.
const WINDOW: usize = 2048;
/// Rounds during which all ranks share one system prefix.
const GROUP_ROUNDS: u64 = 16;
const PREFIX: usize = 4;
const TAIL: usize = 4;
const TOLERANCE: f64 = 0.10;
/// Absolute RSS slack (4 KiB pages): 2 MiB.
const RSS_SLACK_PAGES: u64 = 512;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    z = (z ^ (z >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    z ^ (z >> 33)
}

fn prefix_ext(g: u64, j: usize) -> u64 {
    mix((g << 8) ^ j as u64 ^ 0x7072_6566_0000_0000)
}

fn prefix_local(g: u64, j: usize) -> u64 {
    mix(prefix_ext(g, j) ^ 0x99)
}

fn tail_ext(r: usize, n: u64, j: usize) -> u64 {
    mix(((r as u64) << 56) ^ (n << 8) ^ j as u64 ^ 0x7461_696c)
}

fn tail_local(r: usize, n: u64, j: usize) -> u64 {
    mix(tail_ext(r, n, j) ^ 0x77)
}

/// The local hashes of chain `n` of rank `r`.
fn chain_locals(r: usize, n: u64) -> Vec<u64> {
    let g = n / GROUP_ROUNDS;
    (0..PREFIX)
        .map(|j| prefix_local(g, j))
        .chain((0..TAIL).map(|j| tail_local(r, n, j)))
        .collect()
}

struct RankState {
    rank: RankId,
    tier: Tier,
    /// Rounds of the live chains, oldest first.
    live: VecDeque<u64>,
    /// Live chains per prefix group, oldest group first.
    groups: VecDeque<(u64, u32)>,
}

/// Resident set size in pages (Linux), `None` elsewhere.
fn rss_pages() -> Option<u64> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    statm.split_whitespace().nth(1)?.parse().ok()
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    events: u64,
    round: u64,
    bytes: u64,
    table_bytes: u64,
    holder_set_bytes: u64,
    rank_map_bytes: u64,
    rss_pages: Option<u64>,
}

struct Churn {
    index: Index,
    ranks: Vec<RankState>,
    events: u64,
    blocks: u64,
}

impl Churn {
    fn new() -> Self {
        let mut ranks = Vec::new();
        for w in 1..=WORKERS {
            for d in 0..DP {
                ranks.push(RankState {
                    rank: RankId::new(w, d),
                    tier: if w == WORKERS {
                        Tier::Host
                    } else {
                        Tier::Device
                    },
                    live: VecDeque::with_capacity(WINDOW + 1),
                    groups: VecDeque::new(),
                });
            }
        }
        Churn {
            index: Index::new(),
            ranks,
            events: 0,
            blocks: 0,
        }
    }

    fn store(&mut self, r: usize, parent: Option<u64>, blocks: &[StoredBlock]) {
        let st = &self.ranks[r];
        let stored = self
            .index
            .store(st.rank, st.tier, parent, blocks)
            .expect("the parent is always held");
        assert_eq!(
            stored,
            blocks.len(),
            "every stored block is new to the rank"
        );
        self.events += 1;
        self.blocks += blocks.len() as u64;
    }

    fn remove(&mut self, r: usize, hashes: &[u64]) {
        let st = &self.ranks[r];
        let out = self.index.remove(st.rank, st.tier, hashes);
        assert_eq!(
            (out.removed, out.not_found),
            (hashes.len(), 0),
            "every removed block is held"
        );
        self.events += 1;
        self.blocks += hashes.len() as u64;
    }

    /// One rank's turn in round `n`: store its chain `n`, evict the oldest if over the window.
    fn turn(&mut self, r: usize, n: u64) {
        let g = n / GROUP_ROUNDS;
        let tail = |j: usize| StoredBlock {
            external_hash: tail_ext(r, n, j),
            local_hash: tail_local(r, n, j),
        };
        let mut first: Vec<StoredBlock> = Vec::with_capacity(PREFIX + 2);
        let st = &mut self.ranks[r];
        let parent = match st.groups.back_mut() {
            Some((bg, count)) if *bg == g => {
                *count += 1;
                Some(prefix_ext(g, PREFIX - 1))
            }
            _ => {
                st.groups.push_back((g, 1));
                first.extend((0..PREFIX).map(|j| StoredBlock {
                    external_hash: prefix_ext(g, j),
                    local_hash: prefix_local(g, j),
                }));
                None
            }
        };
        st.live.push_back(n);
        first.extend([tail(0), tail(1)]);
        self.store(r, parent, &first);
        self.store(r, Some(tail_ext(r, n, 1)), &[tail(2), tail(3)]);

        let st = &mut self.ranks[r];
        if st.live.len() > WINDOW {
            let old = st.live.pop_front().unwrap();
            let og = old / GROUP_ROUNDS;
            let front = st.groups.front_mut().expect("a live group");
            assert_eq!(front.0, og);
            front.1 -= 1;
            let drop_prefix = front.1 == 0;
            if drop_prefix {
                st.groups.pop_front();
            }
            let hashes: [u64; TAIL] = std::array::from_fn(|i| tail_ext(r, old, TAIL - 1 - i));
            self.remove(r, &hashes);
            if drop_prefix {
                let hashes: [u64; PREFIX] = std::array::from_fn(|i| prefix_ext(og, PREFIX - 1 - i));
                self.remove(r, &hashes);
            }
        }
    }

    /// Drops a whole rank (a `Cleared` event) or a whole worker (`remove_worker`, whose
    /// ranks come back with the next stores, possibly in other slots). The victims refill
    /// their windows long before the next sample.
    fn reset(&mut self, k: usize) {
        let victims: Vec<usize> = if k.is_multiple_of(2) {
            let r = (k / 2 * 7) % self.ranks.len();
            let out = self.index.apply(self.ranks[r].rank, &kvr::KvEvent::Cleared);
            assert_eq!(
                out.unwrap().removed,
                WINDOW * TAIL + WINDOW / GROUP_ROUNDS as usize * PREFIX
            );
            vec![r]
        } else {
            let w = (k as u64 / 2) % WORKERS + 1;
            assert_eq!(self.index.remove_worker(w), DP as usize);
            (0..self.ranks.len())
                .filter(|&r| self.ranks[r].rank.worker_id == w)
                .collect()
        };
        self.events += 1;
        for r in victims {
            self.ranks[r].live.clear();
            self.ranks[r].groups.clear();
        }
    }

    fn sample(&self, round: u64) -> Sample {
        let s = self.index.stats();
        // Like with like: the live set is the same at every sample point.
        let per_rank = (WINDOW * TAIL + WINDOW / GROUP_ROUNDS as usize * PREFIX) as u64;
        let device_ranks = (WORKERS - 1) * DP as u64;
        let host_ranks = DP as u64;
        assert_eq!(
            (s.ranks, s.holder_blocks, s.tier_blocks),
            (
                WORKERS * DP as u64,
                per_rank * (device_ranks + host_ranks),
                [per_rank * device_ranks, per_rank * host_ranks, 0]
            ),
            "live set at round {round}"
        );
        let nodes =
            (self.ranks.len() * WINDOW * TAIL + WINDOW / GROUP_ROUNDS as usize * PREFIX) as u64;
        assert_eq!(s.nodes, nodes, "live nodes at round {round}");
        // A few lookups: the newest chain of a device rank and of a host rank.
        for (r, st) in self.ranks.iter().enumerate().step_by(5) {
            let q = chain_locals(r, round);
            let t = self.index.find_matches_tiered(&q);
            let want = match st.tier {
                Tier::Device => (8, 0),
                _ => (0, 8),
            };
            let got = t.get(st.rank).map(|o| (o.device, o.host));
            assert_eq!(
                got,
                Some(want),
                "newest chain of {} at round {round}",
                st.rank
            );
            // The prefix alone is held by every rank.
            assert_eq!(self.index.find_matches_tiered(&q[..PREFIX]).len(), 16);
        }
        Sample {
            events: self.events,
            round,
            bytes: s.bytes,
            table_bytes: s.table_bytes,
            holder_set_bytes: s.holder_set_bytes,
            rank_map_bytes: s.rank_map_bytes,
            rss_pages: rss_pages(),
        }
    }
}

#[test]
#[cfg_attr(debug_assertions, ignore = "5M events: run with --release")]
fn churn_memory_tracks_live_blocks() {
    let target = env_u64("KVR_CHURN_EVENTS").unwrap_or(5_000_000);
    let started = Instant::now();
    let mut churn = Churn::new();
    let n_ranks = churn.ranks.len() as u64;
    // Steady state: 2 stores and 1 eviction per rank and round, plus one prefix eviction
    // per rank every GROUP_ROUNDS rounds.
    let per_round = 3 * n_ranks + n_ranks / GROUP_ROUNDS;
    let est_rounds = target / per_round;
    assert!(
        est_rounds / 10 > WINDOW as u64 + GROUP_ROUNDS,
        "too few events ({target}) to reach the steady state before the warm-up samples"
    );
    // Sample at the end of a round that closes a prefix group (whole groups live).
    let warmup_at: Vec<u64> = [10, 12, 14, 16, 18, 20]
        .iter()
        .map(|p| est_rounds * p / 100)
        .collect();
    let later_at: Vec<u64> = (5..=19).map(|k| est_rounds * k * 5 / 100).collect();
    let mut warm: Vec<Sample> = Vec::new();
    let mut later: Vec<Sample> = Vec::new();
    let mut next_warm = 0;
    let mut next_later = 0;
    let mut n = 0u64;
    loop {
        for r in 0..churn.ranks.len() {
            churn.turn(r, n);
        }
        let group_end = (n + 1).is_multiple_of(GROUP_ROUNDS);
        if group_end {
            if next_warm < warmup_at.len() && n >= warmup_at[next_warm] {
                warm.push(churn.sample(n));
                next_warm += 1;
            } else if next_later < later_at.len() && n >= later_at[next_later] {
                later.push(churn.sample(n));
                churn.reset(next_later);
                next_later += 1;
            } else if churn.events >= target && next_warm == warmup_at.len() {
                later.push(churn.sample(n));
                break;
            }
        }
        n += 1;
    }
    let elapsed = started.elapsed();

    let ref_bytes = warm.iter().map(|s| s.bytes).max().unwrap();
    let min_ref_bytes = warm.iter().map(|s| s.bytes).min().unwrap();
    let max_later_bytes = later.iter().map(|s| s.bytes).max().unwrap();
    let min_later_bytes = later.iter().map(|s| s.bytes).min().unwrap();
    let last = *later.last().unwrap();
    eprintln!(
        "churn: {} events ({} blocks), {} rounds, in {elapsed:.2?} ({:.0} ns/event)",
        churn.events,
        churn.blocks,
        n + 1,
        elapsed.as_nanos() as f64 / churn.events as f64
    );
    eprintln!("  samples (events, round, bytes [table + holder sets + rank maps], rss pages):");
    for (tag, s) in warm
        .iter()
        .map(|s| ("warm-up", s))
        .chain(later.iter().map(|s| ("later", s)))
    {
        eprintln!(
            "    {tag:8} {:>9} {:>7} {:>10} [{} + {} + {}] {:?}",
            s.events,
            s.round,
            s.bytes,
            s.table_bytes,
            s.holder_set_bytes,
            s.rank_map_bytes,
            s.rss_pages
        );
    }
    assert!(
        churn.events >= target,
        "ran {} events, wanted {target}",
        churn.events
    );
    assert!(
        (max_later_bytes as f64) <= ref_bytes as f64 * (1.0 + TOLERANCE),
        "index bytes grew under churn: warm-up max {ref_bytes}, later max {max_later_bytes} \
         (last {})",
        last.bytes
    );
    assert!(
        (min_later_bytes as f64) >= min_ref_bytes as f64 * (1.0 - TOLERANCE),
        "index bytes fell with the same live set: warm-up min {min_ref_bytes}, later min \
         {min_later_bytes}"
    );
    if let Some(ref_rss) = warm.iter().filter_map(|s| s.rss_pages).max() {
        let max_later = later.iter().filter_map(|s| s.rss_pages).max().unwrap();
        eprintln!(
            "  rss: warm-up max {ref_rss} pages, later max {max_later} pages ({:+.1} %)",
            (max_later as f64 / ref_rss as f64 - 1.0) * 100.0
        );
        // Only growth is a leak; the allocator may keep freed pages, and RSS never falls
        // below what the live set needs, so no lower bound is asserted. The process is
        // small (~10 MB), and allocator fragmentation after warm-up measured +5 to +8 %
        // whether the run was 5 M or 20 M events long (so not a leak, which would grow
        // with the events), and +4 to +9 % over 10 runs on 2026-12-01 (`cargo test
        // --release -p kvr --test index_churn -- --nocapture`; one CI run, with
        // a heap buffer per removal since removed, +11.5 %). The bound is 10 % or 2 MiB,
        // whichever is larger: a leak of half a byte per event over the 5 M events is
        // 2.5 MB and still fails it.
        let allowed = (ref_rss as f64 * TOLERANCE).max(RSS_SLACK_PAGES as f64);
        assert!(
            (max_later as f64) <= ref_rss as f64 + allowed,
            "process RSS grew under churn: warm-up max {ref_rss} pages, later max {max_later} \
             pages (last {:?})",
            last.rss_pages
        );
    }
    eprintln!(
        "  bytes: warm-up max {ref_bytes}, later max {max_later_bytes} ({:+.1} %), {:.1} \
         bytes per holder block",
        (max_later_bytes as f64 / ref_bytes as f64 - 1.0) * 100.0,
        churn.index.stats().bytes_per_holder_block()
    );
}
