//! Session affinity (the session table): a multi-thread stress test and a differential test
//! against a naive single-threaded model.
//!
//! - **Stress**: 4 threads bind turns of a shared pool of sessions (so turns of one
//!   session race across threads), release their own leases in random order, look up,
//!   reap, and drop ranks, on a roomy table and on one small enough to evict and refuse.
//!   Afterwards every lease is released, a final turn of every session is bound and
//!   released, and the table must be empty with no lease left and consistent counters.
//! - **Differential**: one shard, so the table's behaviour is fully determined; random
//!   operations (binds of new, held, foreign and already-released leases; releases of
//!   live, released and unknown leases; child lookups; forget_rank; reap; time jumps past
//!   the idle TTL; a capacity small enough to evict and refuse) drive the table and the
//!   model, and every answer, every counter and every entry must agree.
//!
//! Environment overrides: `KVR_SESSION_SEED`, `KVR_SESSION_OPS`.

// Threads and shared ownership of the test itself, outside the engine's sync facade.
#![allow(clippy::disallowed_types)]

#[path = "../../tests/common/rng.rs"]
#[allow(dead_code, unreachable_pub)]
mod rng;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::outcome::{BindOutcome, Binding, LeaseRelease, SessionStats};
use super::{AffinityMode, SessionConfig, SessionContext, SessionTable, EARLY_RELEASE_WINDOW};
use crate::ids::RankId;
use rng::{env_u64, Rng};

fn ctx(id: &str, parent: Option<&str>, fin: bool) -> SessionContext {
    SessionContext {
        session_id: id.to_string(),
        parent_session_id: parent.map(str::to_string),
        session_final: fin,
        input_trigger: None,
    }
}

fn ops(default: usize) -> usize {
    let n = env_u64("KVR_SESSION_OPS").map_or(default, |n| n as usize);
    if cfg!(debug_assertions) {
        n / 10
    } else {
        n
    }
}

fn seed(default: u64) -> u64 {
    env_u64("KVR_SESSION_SEED").unwrap_or(default)
}

const RANKS: [RankId; 4] = [
    RankId::new(1, 0),
    RankId::new(1, 1),
    RankId::new(2, 0),
    RankId::new(3, 0),
];

// ---------------------------------------------------------------------------------------
// Stress
// ---------------------------------------------------------------------------------------

fn stress(cfg: SessionConfig, sessions: usize, per_thread: usize, seed: u64) {
    const THREADS: u64 = 4;
    let t = Arc::new(SessionTable::new(cfg));
    let base = Instant::now();
    let ids: Arc<Vec<String>> = Arc::new((0..sessions).map(|i| format!("sess-{i}")).collect());
    let handles: Vec<_> = (0..THREADS)
        .map(|th| {
            let (t, ids) = (t.clone(), ids.clone());
            std::thread::spawn(move || {
                let mut rng = Rng::new(seed ^ (th + 1).wrapping_mul(0x9e37_79b9));
                let mut live: Vec<u64> = Vec::new();
                let mut next = 0u64;
                let mut bound = 0u64;
                for step in 0..per_thread {
                    let now = base + Duration::from_millis(step as u64);
                    match rng.below(100) {
                        0..=39 => {
                            let i = rng.skewed(ids.len());
                            let parent = (i > 0 && rng.chance(1, 4)).then(|| ids[i / 2].as_str());
                            let c = ctx(&ids[i], parent, rng.chance(1, 8));
                            let rank = match t.lookup(&c, now) {
                                Some(b) if !rng.chance(1, 10) => b.rank,
                                _ => *rng.pick(&RANKS),
                            };
                            let lease = (th << 40) | next;
                            next += 1;
                            let out = t.bind(&c, rank, lease, rng.chance(1, 5), now);
                            match out {
                                BindOutcome::Created(_)
                                | BindOutcome::Kept(_)
                                | BindOutcome::Rebound { .. } => {
                                    live.push(lease);
                                    bound += 1;
                                }
                                BindOutcome::Refused => {}
                                other => panic!("unexpected bind outcome {other:?}"),
                            }
                        }
                        40..=84 => {
                            if !live.is_empty() {
                                let lease = live.swap_remove(rng.below(live.len()));
                                let r = t.release_lease(lease, now);
                                assert_ne!(r, LeaseRelease::Unknown, "own live lease {lease}");
                            }
                        }
                        85..=93 => {
                            let i = rng.below(ids.len());
                            let _ = t.lookup(&ctx(&ids[i], Some(&ids[0]), false), now);
                        }
                        94..=97 => {
                            t.reap(now + Duration::from_secs(rng.below(3) as u64));
                        }
                        _ => {
                            t.forget_rank(*rng.pick(&RANKS));
                        }
                    }
                }
                let now = base + Duration::from_millis(per_thread as u64);
                for lease in live.drain(..) {
                    assert_ne!(t.release_lease(lease, now), LeaseRelease::Unknown);
                }
                bound
            })
        })
        .collect();
    let bound: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();

    let st = t.stats();
    assert_eq!(st.leases, 0, "leases leaked: {st:?}");
    assert_eq!(st.leases_released, bound, "{st:?}");
    assert_eq!(st.unknown_lease_releases, 0, "{st:?}");
    assert_eq!(st.early_releases, 0, "{st:?}");
    assert_eq!(st.duplicate_leases, 0, "{st:?}");
    t.audit().unwrap();

    // Every session ends with a final turn: nothing may stay behind.
    let now = base + Duration::from_millis(per_thread as u64 + 1);
    for (i, id) in ids.iter().enumerate() {
        let lease = (1u64 << 60) + i as u64;
        let out = t.bind(&ctx(id, None, true), RANKS[0], lease, false, now);
        assert!(out.binding().is_some(), "{id}: {out:?}");
        assert_eq!(t.release_lease(lease, now), LeaseRelease::SessionEnded);
    }
    let st = t.stats();
    assert_eq!(t.len(), 0, "entries left: {st:?}");
    assert_eq!(st.leases, 0);
    assert_eq!(st.entries, 0);
    assert!(st.finals_released >= ids.len() as u64);
    assert!(
        st.rebinds > 0 && st.forced_rebinds > 0 && st.bindings_dropped > 0,
        "{st:?}"
    );
    t.audit().unwrap();
}

#[test]
fn stress_four_threads_release_everything_roomy_table() {
    stress(
        SessionConfig {
            idle_ttl: Duration::from_secs(1),
            ..SessionConfig::default()
        },
        300,
        ops(200_000),
        seed(1),
    );
}

#[test]
fn stress_four_threads_release_everything_small_table() {
    let cfg = SessionConfig {
        max_entries: 64,
        shards: 4,
        idle_ttl: Duration::from_secs(1),
        ..SessionConfig::default()
    };
    stress(cfg, 400, ops(200_000), seed(2));
}

// ---------------------------------------------------------------------------------------
// Differential: the naive model
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct MEntry {
    rank: Option<RankId>,
    revision: u64,
    leases: Vec<u64>,
    last: Instant,
    fin: bool,
}

/// The specification, written as plainly as possible: one map, every rule applied
/// eagerly where the table is lazy (it reaps every expired entry on every bind).
struct Model {
    ttl: Duration,
    cap: usize,
    mem: usize,
    max_id: usize,
    mode: AffinityMode,
    entries: HashMap<String, MEntry>,
    owner: HashMap<u64, String>,
    ended: VecDeque<(u64, Instant)>,
    st: SessionStats,
}

impl Model {
    fn expired(&self, e: &MEntry, now: Instant) -> bool {
        e.leases.is_empty() && now.saturating_duration_since(e.last) >= self.ttl
    }

    fn valid(&self, id: &str) -> bool {
        !id.is_empty() && id.len() <= self.max_id
    }

    fn own(&self, id: &str, now: Instant) -> Option<Option<Binding>> {
        let e = self.entries.get(id)?;
        if self.expired(e, now) {
            return None;
        }
        Some(e.rank.map(|rank| Binding {
            rank,
            revision: e.revision,
            inherited: false,
        }))
    }

    fn lookup(&self, c: &SessionContext, now: Instant) -> Option<Binding> {
        if self.valid(&c.session_id) {
            if let Some(b) = self.own(&c.session_id, now) {
                return b;
            }
        }
        let p = c.parent_session_id.as_deref()?;
        if !self.valid(p) || p == c.session_id {
            return None;
        }
        self.own(p, now)?.map(|b| Binding {
            inherited: true,
            ..b
        })
    }

    fn reap(&mut self, now: Instant) -> usize {
        let dead: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| self.expired(e, now))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &dead {
            self.entries.remove(k);
        }
        self.st.reaped += dead.len() as u64;
        dead.len()
    }

    fn bind(
        &mut self,
        c: &SessionContext,
        rank: RankId,
        lease: u64,
        forced: bool,
        now: Instant,
    ) -> BindOutcome {
        let id = c.session_id.clone();
        if !self.valid(&id) {
            self.st.invalid_session_ids += 1;
            return BindOutcome::InvalidSessionId;
        }
        self.reap(now);
        if !self.entries.contains_key(&id) && self.entries.len() >= self.cap {
            let victim = self
                .entries
                .iter()
                .filter(|(_, e)| e.leases.is_empty())
                .min_by_key(|(_, e)| e.last)
                .map(|(k, _)| k.clone());
            match victim {
                Some(v) => {
                    self.entries.remove(&v);
                    self.st.evicted += 1;
                }
                None => {
                    self.st.refused += 1;
                    return BindOutcome::Refused;
                }
            }
        }
        let (add, early) = match self.owner.get(&lease) {
            Some(o) if *o == id => (false, false),
            Some(_) => {
                self.st.duplicate_leases += 1;
                return BindOutcome::LeaseInUse;
            }
            None => match self.ended.iter().position(|&(l, _)| l == lease) {
                Some(i) => {
                    let (_, at) = self.ended.remove(i).unwrap();
                    let early = now.saturating_duration_since(at) <= EARLY_RELEASE_WINDOW;
                    (!early, early)
                }
                None => (true, false),
            },
        };
        if add {
            self.owner.insert(lease, id.clone());
        }
        if early {
            self.st.early_releases += 1;
        }
        let out = match self.entries.get_mut(&id) {
            Some(e) => {
                let out = if e.rank == Some(rank) {
                    BindOutcome::Kept(Binding {
                        rank,
                        revision: e.revision,
                        inherited: false,
                    })
                } else {
                    let from = e.rank;
                    let forced = forced || from.is_none();
                    e.rank = Some(rank);
                    e.revision += 1;
                    self.st.rebinds += 1;
                    self.st.forced_rebinds += u64::from(forced);
                    BindOutcome::Rebound {
                        from,
                        to: Binding {
                            rank,
                            revision: e.revision,
                            inherited: false,
                        },
                        forced,
                    }
                };
                if add {
                    e.leases.push(lease);
                }
                e.last = e.last.max(now);
                e.fin = c.session_final;
                out
            }
            None => {
                self.st.bindings_created += 1;
                self.entries.insert(
                    id.clone(),
                    MEntry {
                        rank: Some(rank),
                        revision: 0,
                        leases: if add { vec![lease] } else { vec![] },
                        last: now,
                        fin: c.session_final,
                    },
                );
                BindOutcome::Created(Binding {
                    rank,
                    revision: 0,
                    inherited: false,
                })
            }
        };
        let e = &self.entries[&id];
        if e.fin && e.leases.is_empty() {
            self.entries.remove(&id);
            self.st.finals_released += 1;
        }
        out
    }

    fn release(&mut self, lease: u64, now: Instant) -> LeaseRelease {
        let Some(id) = self.owner.remove(&lease) else {
            self.st.unknown_lease_releases += 1;
            if self.mem > 0 {
                if self.ended.len() >= self.mem {
                    self.ended.pop_front();
                }
                self.ended.push_back((lease, now));
            }
            return LeaseRelease::Unknown;
        };
        let e = self
            .entries
            .get_mut(&id)
            .expect("an owned lease has its entry");
        e.leases.retain(|&l| l != lease);
        e.last = e.last.max(now);
        self.st.leases_released += 1;
        if e.leases.is_empty() && e.fin {
            self.entries.remove(&id);
            self.st.finals_released += 1;
            LeaseRelease::SessionEnded
        } else {
            LeaseRelease::Released
        }
    }

    fn forget_rank(&mut self, rank: RankId) -> usize {
        let mut n = 0;
        for e in self.entries.values_mut() {
            if e.rank == Some(rank) {
                e.rank = None;
                n += 1;
            }
        }
        self.st.bindings_dropped += n as u64;
        n
    }

    fn soft_cost_adjustment(&self, binding: Option<RankId>, candidate: RankId) -> f64 {
        match self.mode {
            AffinityMode::Soft { penalty_blocks } if binding == Some(candidate) => -penalty_blocks,
            _ => 0.0,
        }
    }

    fn stats(&self) -> SessionStats {
        SessionStats {
            entries: self.entries.len(),
            leases: self.owner.len(),
            ..self.st
        }
    }
}

/// The model's live leases, in a reproducible order.
fn sorted_live(m: &Model) -> Vec<u64> {
    let mut v: Vec<u64> = m.owner.keys().copied().collect();
    v.sort_unstable();
    v
}

fn compare_all(t: &SessionTable, m: &Model, ids: &[String], ctx_msg: &dyn Fn() -> String) {
    assert_eq!(t.stats(), m.stats(), "stats differ {}", ctx_msg());
    assert_eq!(t.len(), m.entries.len(), "{}", ctx_msg());
    for id in ids {
        let got = t.entry(id).map(|v| {
            let mut leases = v.leases;
            leases.sort_unstable();
            (v.rank, v.revision, leases, v.final_requested, v.last_active)
        });
        let want = m.entries.get(id).map(|e| {
            let mut leases = e.leases.clone();
            leases.sort_unstable();
            (e.rank, e.revision, leases, e.fin, e.last)
        });
        assert_eq!(got, want, "entry {id:?} differs {}", ctx_msg());
    }
    t.audit().unwrap_or_else(|e| panic!("{e} {}", ctx_msg()));
}

fn differential(seed: u64, n_ops: usize, cap: usize, mode: AffinityMode) {
    let ttl = Duration::from_secs(30);
    let mem = 8;
    let cfg = SessionConfig {
        mode,
        max_entries: cap,
        idle_ttl: ttl,
        shards: 1,
        max_session_id_bytes: 12,
        early_release_memory: mem,
    };
    let t = SessionTable::new(cfg.clone());
    assert_eq!(t.capacity(), cap);
    let mut m = Model {
        ttl,
        cap,
        mem,
        max_id: 12,
        mode,
        entries: HashMap::new(),
        owner: HashMap::new(),
        ended: VecDeque::new(),
        st: SessionStats::default(),
    };
    let mut ids: Vec<String> = (0..14).map(|i| format!("s{i}")).collect();
    ids.push(String::new()); // invalid: empty
    ids.push("x".repeat(13)); // invalid: too long
    let mut rng = Rng::new(seed);
    let mut now = Instant::now();
    let mut next_lease = 1u64;
    let mut used: Vec<u64> = Vec::new();
    let mut early: Vec<u64> = Vec::new();
    let mut history: VecDeque<String> = VecDeque::new();
    for step in 0..n_ops {
        // Strictly increasing time (so "least recently active" has no ties), with jumps
        // past the idle TTL and the early-release window.
        now += match rng.below(100) {
            0..=89 => Duration::from_millis(1 + rng.below(500) as u64),
            90..=97 => Duration::from_secs(rng.range(10, 40) as u64),
            _ => Duration::from_secs(rng.range(50, 90) as u64),
        };
        let pick_id = |rng: &mut Rng| -> String {
            if rng.chance(1, 40) {
                ids[14 + rng.below(2)].clone()
            } else {
                ids[rng.skewed(14)].clone()
            }
        };
        let op: String;
        match rng.below(100) {
            0..=34 => {
                let id = pick_id(&mut rng);
                let parent = rng.chance(1, 3).then(|| pick_id(&mut rng));
                let c = ctx(&id, parent.as_deref(), rng.chance(1, 6));
                let rank = *rng.pick(&RANKS);
                // Mostly a fresh lease; sometimes a live one (held by this or another
                // session), one released before its bind, or any used before.
                let live = sorted_live(&m);
                let lease = match rng.below(10) {
                    0 if !live.is_empty() => *rng.pick(&live),
                    1 if !early.is_empty() => {
                        early[early.len() - 1 - rng.below(early.len().min(4))]
                    }
                    2 if !used.is_empty() => *rng.pick(&used),
                    _ => {
                        next_lease += 1;
                        next_lease
                    }
                };
                used.push(lease);
                let forced = rng.chance(1, 4);
                op = format!("bind({c:?}, {rank}, {lease}, forced={forced})");
                let got = t.bind(&c, rank, lease, forced, now);
                let want = m.bind(&c, rank, lease, forced, now);
                assert_eq!(got, want, "step {step} {op}\nseed {seed:#x}\n{history:#?}");
            }
            35..=74 => {
                let live = sorted_live(&m);
                let lease = match rng.below(10) {
                    0 => {
                        // Released before its bind (the bind may follow).
                        next_lease += 1;
                        used.push(next_lease);
                        early.push(next_lease);
                        next_lease
                    }
                    1 if !used.is_empty() => *rng.pick(&used),
                    _ if !live.is_empty() => *rng.pick(&live),
                    _ => continue,
                };
                op = format!("release({lease})");
                let got = t.release_lease(lease, now);
                let want = m.release(lease, now);
                assert_eq!(got, want, "step {step} {op}\nseed {seed:#x}\n{history:#?}");
            }
            75..=86 => {
                let id = pick_id(&mut rng);
                let parent = rng.chance(1, 2).then(|| pick_id(&mut rng));
                let c = ctx(&id, parent.as_deref(), false);
                op = format!("lookup({c:?})");
                let got = t.lookup(&c, now);
                assert_eq!(got, m.lookup(&c, now), "step {step} {op}\nseed {seed:#x}");
                let cand = *rng.pick(&RANKS);
                let b = got.map(|b| b.rank);
                assert_eq!(
                    t.soft_cost_adjustment(b, cand),
                    m.soft_cost_adjustment(b, cand)
                );
            }
            87..=93 => {
                op = "reap".to_string();
                assert_eq!(t.reap(now), m.reap(now), "step {step}\nseed {seed:#x}");
            }
            _ => {
                let r = *rng.pick(&RANKS);
                op = format!("forget_rank({r})");
                assert_eq!(t.forget_rank(r), m.forget_rank(r), "step {step}");
            }
        }
        if history.len() == 12 {
            history.pop_front();
        }
        history.push_back(op);
        if step % 16 == 0 {
            compare_all(&t, &m, &ids, &|| {
                format!("after step {step}, seed {seed:#x}")
            });
        }
    }
    compare_all(&t, &m, &ids, &|| format!("at the end, seed {seed:#x}"));
    let st = t.stats();
    // The workload must have reached every path: checked at the full length (release
    // builds; a debug build runs a tenth of the steps, too few to reach eviction).
    if cfg!(debug_assertions) {
        return;
    }
    for (what, n) in [
        ("created", st.bindings_created),
        ("rebinds", st.rebinds),
        ("forced", st.forced_rebinds),
        ("dropped", st.bindings_dropped),
        ("finals", st.finals_released),
        ("evicted", st.evicted),
        ("refused", st.refused),
        ("reaped", st.reaped),
        ("released", st.leases_released),
        ("unknown", st.unknown_lease_releases),
        ("early", st.early_releases),
        ("duplicate", st.duplicate_leases),
        ("invalid", st.invalid_session_ids),
    ] {
        assert!(
            n > 0,
            "the workload never reached {what}: {st:?} (seed {seed:#x})"
        );
    }
}

#[test]
fn differential_against_a_naive_model_hard() {
    let s = seed(0x5e55);
    for i in 0..4 {
        differential(s.wrapping_add(i), ops(50_000), 8, AffinityMode::Hard);
    }
}

#[test]
fn differential_against_a_naive_model_soft() {
    let s = seed(0x50f7);
    differential(
        s,
        ops(50_000),
        5,
        AffinityMode::Soft {
            penalty_blocks: 4.0,
        },
    );
}
