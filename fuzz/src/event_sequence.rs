//! Target (c): a structured (`arbitrary`-derived) sequence of typed index operations →
//! [`Index`], differential against the naive model (`engine/tests/common/model.rs`).
//!
//! [`Input`] picks a table shape (one shard of 4 slots, which rebuilds and shrinks all the
//! time, up to the default 256 shards) and up to [`MAX_OPS`] [`Op`]s over 8 ranks of 7
//! workers (including worker 0, `u64::MAX` and dp `u32::MAX`): stores from scratch or
//! continuing a chain the rank stored (on any tier: offloads), with parents held, known
//! elsewhere or unknown; blocks with content-addressed, colliding (a name moves to other
//! content), known or arbitrary engine hashes and local hashes from a small vocabulary
//! (including 0 and `u64::MAX`); repeated stores (same or another rank); removes of held
//! names (right or wrong tier), of chain tails, of unknown hashes; clears; `remove_rank`;
//! `remove_worker`; a hybrid model's recurrent states (`StatesStored` at names the rank
//! holds, chain tails, known or unknown hashes; `StatesRemoved` of its states' names, on
//! the right tier or another, of other hashes) — each through `Index::apply` or the direct
//! method.
//!
//! After every operation: its outcome equals the model's (`Result<stored>`,
//! `ApplyOutcome`, cleared count, `remove_rank` / `remove_worker` results); the rank list
//! and the touched rank's stats are equal (all stats, in total and per rank, after every
//! 4th operation and after `remove_rank` / `remove_worker`); prefix queries (device and tiered, by sequence and by
//! local hashes) agree for the chains the operation stored and for earlier ones. Every 32
//! operations the model re-derives itself. At the end every rank is cleared (the index
//! must hold no node and no holder-set bytes) and every worker removed. The index of each
//! shape is reused by the next input of that shape, which checks it starts empty; the
//! model starts from the index's event totals.

use std::cell::RefCell;

use arbitrary::{Arbitrary, Unstructured};
use kvr::config::IndexConfig;
use kvr::Index;
use kvr::{KvEvent, RankId, StoredBlock, Tier};

use crate::check::{check_all, Links, Scratch};
use crate::model::{assert_stats_equal, Model, TIERS};

/// Operations per input at most.
pub const MAX_OPS: usize = 256;
/// Blocks per store / hashes per remove at most.
const MAX_LIST: usize = 32;

const RANKS: [RankId; 8] = [
    RankId::new(1, 0),
    RankId::new(1, 1),
    RankId::new(2, 0),
    RankId::new(2, 3),
    RankId::new(3, 0),
    RankId::new(0, 0),
    RankId::new(u64::MAX, u32::MAX),
    RankId::new(7, 0),
];
const WORKERS: [u64; 7] = [1, 2, 3, 0, u64::MAX, 7, 99];

/// One fuzz input.
#[derive(Arbitrary, Debug)]
pub struct Input {
    pub shape: u8,
    pub ops: Vec<Op>,
}

#[derive(Arbitrary, Debug, Clone)]
pub enum Op {
    /// A store with a chosen parent.
    Store {
        rank: u8,
        tier: u8,
        parent: ParentSel,
        blocks: Vec<BlockSel>,
        via_apply: bool,
    },
    /// A store continuing one of the chains the rank stored last (`tail` back from the
    /// latest), the common case.
    Extend {
        rank: u8,
        tier: u8,
        tail: u8,
        blocks: Vec<BlockSel>,
        via_apply: bool,
    },
    /// One of the recent stores again, on its rank or on `other`.
    Repeat {
        k: u8,
        other: Option<u8>,
        via_apply: bool,
    },
    Remove {
        rank: u8,
        tier: u8,
        hashes: Vec<HashSel>,
        via_apply: bool,
    },
    /// Removes the last `n` blocks of a recent store, leaves first (an LRU eviction).
    EvictTail {
        k: u8,
        n: u8,
        via_apply: bool,
    },
    Clear {
        rank: u8,
        via_apply: bool,
    },
    RemoveRank {
        rank: u8,
    },
    RemoveWorker {
        worker: u8,
    },
    /// A recurrent group's states at some blocks (the rank becomes hybrid).
    StoreStates {
        rank: u8,
        tier: u8,
        hashes: Vec<StateSel>,
        via_apply: bool,
    },
    RemoveStates {
        rank: u8,
        tier: u8,
        hashes: Vec<StateSel>,
        via_apply: bool,
    },
}

/// A name a state event gives.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum StateSel {
    /// A name the rank holds on any tier (a block it may have a state at).
    Held(u16),
    /// The last name of one of the rank's recent stores (a state at a chain's end).
    Tail(u8),
    /// The name of a state the rank has on the event's tier, or on any tier.
    State(u16),
    StateAny(u16),
    Known(u16),
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum ParentSel {
    None,
    /// A name the rank holds (sorted, modulo their number).
    Held(u16),
    /// Any engine hash the run has used.
    Known(u16),
    Unknown(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct BlockSel {
    pub ext: ExtSel,
    /// Local hash from a small vocabulary (0, `u64::MAX`, small numbers, mixed values).
    pub local: u8,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum ExtSel {
    /// Content-addressed: a function of the previous block's name and this local hash.
    Content,
    Content2,
    Content3,
    /// 0..8: names that collide across contents.
    Small(u8),
    Known(u16),
    /// The previous block's name again (one name twice in one event).
    Same,
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum HashSel {
    /// A name the rank holds on the event's tier.
    Held(u16),
    /// A name the rank holds on any tier.
    HeldAny(u16),
    Known(u16),
    Small(u8),
    Raw(u64),
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    z = (z ^ (z >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    z ^ (z >> 33)
}

fn local_of(v: u8) -> u64 {
    match v % 32 {
        0 => 0,
        1 => u64::MAX,
        x @ 2..=7 => u64::from(x),
        x => mix(u64::from(x)),
    }
}

fn tier_of(t: u8) -> Tier {
    match t % 8 {
        0..=4 => Tier::Device,
        5 | 6 => Tier::Host,
        _ => Tier::Disk,
    }
}

/// A store, as recorded for repeats and evictions.
#[derive(Clone, Debug)]
struct StoreRec {
    rank: RankId,
    tier: Tier,
    parent: Option<u64>,
    blocks: Vec<StoredBlock>,
}

/// What one operation does, resolved against the run's state.
#[derive(Clone, Debug)]
enum Resolved {
    Store {
        rank: RankId,
        tier: Tier,
        parent: Option<u64>,
        blocks: Vec<StoredBlock>,
        via_apply: bool,
    },
    Remove {
        rank: RankId,
        tier: Tier,
        hashes: Vec<u64>,
        via_apply: bool,
    },
    Clear {
        rank: RankId,
        via_apply: bool,
    },
    RemoveRank(RankId),
    RemoveWorker(u64),
    States {
        rank: RankId,
        tier: Tier,
        hashes: Vec<u64>,
        stored: bool,
        via_apply: bool,
    },
}

struct Run {
    index: &'static Index,
    model: Model,
    links: Links,
    scratch: Scratch,
    known: Vec<u64>,
    recent: Vec<StoreRec>,
    sum: Summary,
}

/// What a run exercised (the replay test checks the committed seeds cover every path).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub ops: u64,
    pub blocks_stored: u64,
    pub parent_not_found: u64,
    pub blocks_removed: u64,
    pub not_found: u64,
    /// Clears that emptied something.
    pub effective_clears: u64,
    pub ranks_removed: u64,
    pub workers_removed: u64,
    /// Queries four or more ranks scored on the device (runs with many covers).
    pub shared_hits: u64,
    pub queries: u64,
    pub device_hits: u64,
    pub lower_tier_hits: u64,
    pub states_stored: u64,
    pub states_removed: u64,
    /// Queries a hybrid rank scored on the device, and ones where its states cut a score.
    pub state_hits: u64,
    pub state_cuts: u64,
}

impl Summary {
    /// Every counter, by name.
    pub fn fields(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("ops", self.ops),
            ("blocks_stored", self.blocks_stored),
            ("parent_not_found", self.parent_not_found),
            ("blocks_removed", self.blocks_removed),
            ("not_found", self.not_found),
            ("effective_clears", self.effective_clears),
            ("ranks_removed", self.ranks_removed),
            ("workers_removed", self.workers_removed),
            ("shared_hits", self.shared_hits),
            ("queries", self.queries),
            ("device_hits", self.device_hits),
            ("lower_tier_hits", self.lower_tier_hits),
            ("states_stored", self.states_stored),
            ("states_removed", self.states_removed),
            ("state_hits", self.state_hits),
            ("state_cuts", self.state_cuts),
        ]
    }

    /// Field-wise sum.
    pub fn add(&mut self, o: &Summary) {
        let Summary {
            ops,
            blocks_stored,
            parent_not_found,
            blocks_removed,
            not_found,
            effective_clears,
            ranks_removed,
            workers_removed,
            shared_hits,
            queries,
            device_hits,
            lower_tier_hits,
            states_stored,
            states_removed,
            state_hits,
            state_cuts,
        } = o;
        self.ops += ops;
        self.blocks_stored += blocks_stored;
        self.parent_not_found += parent_not_found;
        self.blocks_removed += blocks_removed;
        self.not_found += not_found;
        self.effective_clears += effective_clears;
        self.ranks_removed += ranks_removed;
        self.workers_removed += workers_removed;
        self.shared_hits += shared_hits;
        self.queries += queries;
        self.device_hits += device_hits;
        self.lower_tier_hits += lower_tier_hits;
        self.states_stored += states_stored;
        self.states_removed += states_removed;
        self.state_hits += state_hits;
        self.state_cuts += state_cuts;
    }
}

/// Runs one input; panics on a finding.
pub fn run(data: &[u8]) {
    run_summary(data);
}

/// [`run`], returning what the input exercised.
pub fn run_summary(data: &[u8]) -> Summary {
    let u = Unstructured::new(data);
    match Input::arbitrary_take_rest(u) {
        Ok(input) => run_input(&input),
        Err(_) => Summary::default(),
    }
}

thread_local! {
    /// One index per table shape, reused by every input of that shape: building one
    /// (up to 256 shard tables) per input cost more than running most inputs. An input
    /// leaves its index empty (the final drain below clears every rank and removes every
    /// worker, checked), and the next input checks it starts empty.
    static INDEXES: RefCell<[Option<&'static Index>; 4]> = const { RefCell::new([None; 4]) };
}

fn config_of(shape: u8) -> IndexConfig {
    match shape % 4 {
        0 => IndexConfig {
            shards: 1,
            min_shard_capacity: 4,
        },
        1 => IndexConfig {
            shards: 2,
            min_shard_capacity: 4,
        },
        2 => IndexConfig {
            shards: 4,
            min_shard_capacity: 8,
        },
        _ => IndexConfig::default(),
    }
}

/// The reused index of `shape`, checked empty; its event and refusal totals (kept across
/// inputs, as across removed ranks) seed the model's.
fn index_for(shape: u8, model: &mut Model) -> &'static Index {
    let index = INDEXES.with(|c| {
        *c.borrow_mut()[shape as usize % 4]
            .get_or_insert_with(|| Box::leak(Box::new(Index::with_config(config_of(shape)))))
    });
    crate::check::start_on_reused(index, "index", model);
    assert!(index.ranks().is_empty(), "a reused index must have no rank");
    index
}

/// Runs a decoded input.
pub fn run_input(input: &Input) -> Summary {
    let config = config_of(input.shape);
    let mut model = Model::new();
    let index = index_for(input.shape, &mut model);
    let mut r = Run {
        index,
        model,
        links: Links::default(),
        scratch: Scratch::default(),
        known: Vec::new(),
        recent: Vec::new(),
        sum: Summary::default(),
    };
    let mut touched = Vec::new();
    for (i, op) in input.ops.iter().take(MAX_OPS).enumerate() {
        let res = r.resolve(op);
        touched.clear();
        let ctx = || format!("op {i}: {op:?} resolved to {res:?}; config {config:?}");
        r.apply(&res, &mut touched, &ctx);
        // Every stat after every 4th operation and after those that touch several ranks;
        // the touched rank's after the others.
        let (full, rank) = match res {
            Resolved::Store { rank, .. }
            | Resolved::Remove { rank, .. }
            | Resolved::States { rank, .. }
            | Resolved::Clear { rank, .. } => (i % 4 == 0, rank),
            Resolved::RemoveRank(rank) => (true, rank),
            Resolved::RemoveWorker(_) => (true, RANKS[0]),
        };
        check_all(
            r.index,
            &r.model,
            &r.links,
            &touched,
            i.wrapping_mul(2_654_435_761),
            full,
            &[rank],
            &mut r.scratch,
            &ctx,
        );
        if i % 32 == 31 {
            r.model.self_check();
        }
        r.sum.ops += 1;
    }
    r.model.self_check();
    // Drain: clear every rank; nothing may stay behind.
    for rank in r.model.ranks() {
        let want = r.model.clear(rank);
        assert_eq!(r.index.clear(rank), want, "final clear of {rank}");
    }
    assert_stats_equal(r.index, &r.model, &|| "after clearing every rank".into());
    let s = r.index.stats();
    assert_eq!(
        (s.nodes, s.holder_blocks, s.holder_set_bytes, s.tier_blocks),
        (0, 0, 0, [0; 3]),
        "cleared index still holds something"
    );
    for w in WORKERS {
        assert_eq!(
            r.index.remove_worker(w),
            r.model.remove_worker(w),
            "final remove_worker({w})"
        );
    }
    assert!(
        r.index.ranks().is_empty(),
        "ranks left after removing every worker"
    );
    r.sum.queries = r.scratch.queries;
    r.sum.device_hits = r.scratch.device_hits;
    r.sum.shared_hits = r.scratch.shared_hits;
    r.sum.lower_tier_hits = r.scratch.lower_tier_hits;
    r.sum.state_hits = r.scratch.state_hits;
    r.sum.state_cuts = r.scratch.state_cuts;
    crate::check::collect_garbage();
    r.sum
}

impl Run {
    fn rank(v: u8) -> RankId {
        RANKS[v as usize % RANKS.len()]
    }

    /// The names `rank` holds on `tier` (or on every tier), sorted.
    fn held(&self, rank: RankId, tier: Option<Tier>) -> Vec<u64> {
        let Some(rm) = self.model.rank(rank) else {
            return Vec::new();
        };
        let mut v: Vec<u64> = match tier {
            Some(t) => rm.names[t as usize].keys().copied().collect(),
            None => TIERS
                .iter()
                .flat_map(|t| rm.names[*t as usize].keys().copied())
                .collect(),
        };
        v.sort_unstable();
        v.dedup();
        v
    }

    fn nth<T>(v: &[T], k: u16) -> Option<&T> {
        (!v.is_empty()).then(|| &v[k as usize % v.len()])
    }

    fn blocks(&self, parent: Option<u64>, sel: &[BlockSel]) -> Vec<StoredBlock> {
        let mut prev = parent.unwrap_or(0x1337);
        let mut out: Vec<StoredBlock> = Vec::with_capacity(sel.len().min(MAX_LIST));
        for b in sel.iter().take(MAX_LIST) {
            let local = local_of(b.local);
            let content = mix(prev ^ mix(local));
            let ext = match b.ext {
                ExtSel::Content | ExtSel::Content2 | ExtSel::Content3 => content,
                ExtSel::Small(x) => u64::from(x % 8),
                ExtSel::Known(k) => Self::nth(&self.known, k).copied().unwrap_or(content),
                ExtSel::Same => out.last().map_or(content, |b| b.external_hash),
                ExtSel::Raw(x) => x,
            };
            out.push(StoredBlock {
                external_hash: ext,
                local_hash: local,
            });
            prev = ext;
        }
        out
    }

    fn resolve(&self, op: &Op) -> Resolved {
        match op {
            Op::Store {
                rank,
                tier,
                parent,
                blocks,
                via_apply,
            } => {
                let rank = Self::rank(*rank);
                let parent = match *parent {
                    ParentSel::None => None,
                    ParentSel::Held(k) => Self::nth(&self.held(rank, None), k).copied(),
                    ParentSel::Known(k) => Self::nth(&self.known, k).copied(),
                    ParentSel::Unknown(x) => Some(x),
                };
                Resolved::Store {
                    rank,
                    tier: tier_of(*tier),
                    parent,
                    blocks: self.blocks(parent, blocks),
                    via_apply: *via_apply,
                }
            }
            Op::Extend {
                rank,
                tier,
                tail,
                blocks,
                via_apply,
            } => {
                let rank = Self::rank(*rank);
                let tails: Vec<u64> = self
                    .recent
                    .iter()
                    .rev()
                    .filter(|s| s.rank == rank)
                    .filter_map(|s| s.blocks.last().map(|b| b.external_hash))
                    .collect();
                let parent = Self::nth(&tails, u16::from(*tail % 4)).copied();
                Resolved::Store {
                    rank,
                    tier: tier_of(*tier),
                    parent,
                    blocks: self.blocks(parent, blocks),
                    via_apply: *via_apply,
                }
            }
            Op::Repeat {
                k,
                other,
                via_apply,
            } => match Self::nth(&self.recent, u16::from(*k)).cloned() {
                Some(s) => Resolved::Store {
                    rank: other.map_or(s.rank, Self::rank),
                    tier: s.tier,
                    parent: s.parent,
                    blocks: s.blocks,
                    via_apply: *via_apply,
                },
                None => Resolved::Clear {
                    rank: Self::rank(*k),
                    via_apply: *via_apply,
                },
            },
            Op::Remove {
                rank,
                tier,
                hashes,
                via_apply,
            } => {
                let rank = Self::rank(*rank);
                let tier = tier_of(*tier);
                let on_tier = self.held(rank, Some(tier));
                let any = self.held(rank, None);
                let hashes = hashes
                    .iter()
                    .take(MAX_LIST)
                    .map(|h| match *h {
                        HashSel::Held(k) => Self::nth(&on_tier, k).copied().unwrap_or(u64::from(k)),
                        HashSel::HeldAny(k) => Self::nth(&any, k).copied().unwrap_or(u64::from(k)),
                        HashSel::Known(k) => {
                            Self::nth(&self.known, k).copied().unwrap_or(u64::from(k))
                        }
                        HashSel::Small(x) => u64::from(x % 8),
                        HashSel::Raw(x) => x,
                    })
                    .collect();
                Resolved::Remove {
                    rank,
                    tier,
                    hashes,
                    via_apply: *via_apply,
                }
            }
            Op::EvictTail { k, n, via_apply } => match Self::nth(&self.recent, u16::from(*k)) {
                Some(s) => {
                    let n = (*n as usize % 4 + 1).min(s.blocks.len());
                    Resolved::Remove {
                        rank: s.rank,
                        tier: s.tier,
                        hashes: s.blocks[s.blocks.len() - n..]
                            .iter()
                            .rev()
                            .map(|b| b.external_hash)
                            .collect(),
                        via_apply: *via_apply,
                    }
                }
                None => Resolved::RemoveRank(Self::rank(*k)),
            },
            Op::Clear { rank, via_apply } => Resolved::Clear {
                rank: Self::rank(*rank),
                via_apply: *via_apply,
            },
            Op::RemoveRank { rank } => Resolved::RemoveRank(Self::rank(*rank)),
            Op::StoreStates {
                rank,
                tier,
                hashes,
                via_apply,
            }
            | Op::RemoveStates {
                rank,
                tier,
                hashes,
                via_apply,
            } => {
                let rank = Self::rank(*rank);
                let tier = tier_of(*tier);
                Resolved::States {
                    rank,
                    tier,
                    hashes: self.state_names(rank, tier, hashes),
                    stored: matches!(op, Op::StoreStates { .. }),
                    via_apply: *via_apply,
                }
            }
            Op::RemoveWorker { worker } => {
                Resolved::RemoveWorker(WORKERS[*worker as usize % WORKERS.len()])
            }
        }
    }

    /// The names `sel` gives for a state event of `rank` on `tier`.
    fn state_names(&self, rank: RankId, tier: Tier, sel: &[StateSel]) -> Vec<u64> {
        let held = self.held(rank, None);
        let states = |tiers: &[Tier]| {
            let mut v: Vec<u64> = self.model.rank(rank).map_or_else(Vec::new, |rm| {
                tiers
                    .iter()
                    .flat_map(|t| rm.states[*t as usize].keys().copied())
                    .collect()
            });
            v.sort_unstable();
            v.dedup();
            v
        };
        let (on_tier, any) = (states(&[tier]), states(&TIERS));
        let tails: Vec<u64> = self
            .recent
            .iter()
            .rev()
            .filter(|s| s.rank == rank)
            .filter_map(|s| s.blocks.last().map(|b| b.external_hash))
            .collect();
        sel.iter()
            .take(MAX_LIST)
            .map(|h| {
                let k = match *h {
                    StateSel::Held(k)
                    | StateSel::State(k)
                    | StateSel::StateAny(k)
                    | StateSel::Known(k) => k,
                    StateSel::Tail(k) => u16::from(k),
                    StateSel::Raw(x) => return x,
                };
                let from = match *h {
                    StateSel::Held(_) => &held,
                    StateSel::Tail(_) => &tails,
                    StateSel::State(_) => &on_tier,
                    StateSel::StateAny(_) => &any,
                    _ => &self.known,
                };
                Self::nth(from, k).copied().unwrap_or(u64::from(k))
            })
            .collect()
    }

    fn apply(&mut self, op: &Resolved, touched: &mut Vec<u64>, ctx: &dyn Fn() -> String) {
        let index = self.index;
        let model = &mut self.model;
        match op {
            Resolved::Store {
                rank,
                tier,
                parent,
                blocks,
                via_apply,
            } => {
                self.links.record(model, *rank, *parent, blocks, touched);
                let want = model.store(*rank, *tier, *parent, blocks);
                let got = if *via_apply {
                    index
                        .apply(
                            *rank,
                            &KvEvent::Stored {
                                tier: *tier,
                                parent: *parent,
                                blocks,
                            },
                        )
                        .map(|o| o.stored)
                } else {
                    index.store(*rank, *tier, *parent, blocks)
                };
                assert_eq!(got, want, "store outcome (index vs model); {}", ctx());
                match want {
                    Ok(n) => self.sum.blocks_stored += n as u64,
                    Err(_) => self.sum.parent_not_found += 1,
                }
                for b in blocks {
                    if !self.known.contains(&b.external_hash) {
                        if self.known.len() == 64 {
                            self.known.remove(0);
                        }
                        self.known.push(b.external_hash);
                    }
                }
                if self.recent.len() == 16 {
                    self.recent.remove(0);
                }
                self.recent.push(StoreRec {
                    rank: *rank,
                    tier: *tier,
                    parent: *parent,
                    blocks: blocks.clone(),
                });
            }
            Resolved::Remove {
                rank,
                tier,
                hashes,
                via_apply,
            } => {
                let want = model.remove(*rank, *tier, hashes);
                let got = if *via_apply {
                    index
                        .apply(
                            *rank,
                            &KvEvent::Removed {
                                tier: *tier,
                                external_hashes: hashes,
                            },
                        )
                        .expect("Removed is never refused")
                } else {
                    index.remove(*rank, *tier, hashes)
                };
                assert_eq!(got, want, "remove outcome (index vs model); {}", ctx());
                self.sum.blocks_removed += want.removed as u64;
                self.sum.not_found += want.not_found as u64;
            }
            Resolved::Clear { rank, via_apply } => {
                let want = model.clear(*rank);
                let got = if *via_apply {
                    index
                        .apply(*rank, &KvEvent::Cleared)
                        .expect("Cleared is never refused")
                        .removed
                } else {
                    index.clear(*rank)
                };
                assert_eq!(got, want, "clear outcome (index vs model); {}", ctx());
                self.sum.effective_clears += u64::from(want > 0);
            }
            Resolved::RemoveRank(rank) => {
                let want = model.remove_rank(*rank);
                assert_eq!(index.remove_rank(*rank), want, "remove_rank; {}", ctx());
                self.sum.ranks_removed += u64::from(want);
            }
            Resolved::RemoveWorker(w) => {
                let want = model.remove_worker(*w);
                assert_eq!(index.remove_worker(*w), want, "remove_worker; {}", ctx());
                self.sum.workers_removed += u64::from(want > 0);
            }
            Resolved::States {
                rank,
                tier,
                hashes,
                stored,
                via_apply,
            } => {
                let (tier, hashes) = (*tier, hashes.as_slice());
                let (want, got) = match (*stored, *via_apply) {
                    (true, false) => (
                        model.store_states(*rank, tier, hashes),
                        index.store_states(*rank, tier, hashes),
                    ),
                    (false, false) => (
                        model.remove_states(*rank, tier, hashes),
                        index.remove_states(*rank, tier, hashes),
                    ),
                    (true, true) => {
                        let ev = KvEvent::StatesStored {
                            tier,
                            external_hashes: hashes,
                        };
                        let want = model.apply(*rank, &ev).expect("never refused");
                        (want, index.apply(*rank, &ev).expect("never refused"))
                    }
                    (false, true) => {
                        let ev = KvEvent::StatesRemoved {
                            tier,
                            external_hashes: hashes,
                        };
                        let want = model.apply(*rank, &ev).expect("never refused");
                        (want, index.apply(*rank, &ev).expect("never refused"))
                    }
                };
                assert_eq!(got, want, "state event outcome (index vs model); {}", ctx());
                self.sum.states_stored += want.stored as u64;
                self.sum.states_removed += want.removed as u64;
            }
        }
    }
}
