//! The routers under test. Every policy books through kvr's host API on its partition, so
//! the simulated cluster drives the same lifecycle a host does (`select_and_reserve` or
//! `reserve` at arrival, `mark_prefill_complete`, `add_output_blocks`, `free`): the
//! policies differ only in how they pick the rank. Calls take the simulated time, so
//! booking expiry and the approximate index's TTL run on the trace's clock.
//!
//! * `kvr` — [`Partition::select_and_reserve`] with kvr's default cost (the latency
//!   model: predicted TTFT, `kvr::cost::latency_cost`), on the index fed by the simulated
//!   engines' KV events.
//! * `kvr-dynamo` — the same with Dynamo's cost (`CostModel::Dynamo`): what a Dynamo
//!   router configured alike picks.
//! * `kvr-approx` — the same selection with events off: the partition's indexer policy is
//!   the approximate primary, which holds what kvr itself booked for 120 s (DESIGN.md §5).
//! * `kvr-predict` — events on plus the prediction side index: what kvr booked counts
//!   for `--prediction-ttl-ms` until the engine's events say what was cached.
//! * `round-robin`, `random`.
//! * `least-loaded` — fewest active tokens by kvr's bookings: prefill tokens not yet
//!   computed plus `block_size` × active decode blocks (prompt blocks counted once per
//!   rank, output blocks as they grow).
//! * `sglang` — SGLang router's cache-aware rule on its own kind of state: a prefix tree
//!   of the requests it routed, bounded by size only ([`SglangTree`]; SGLang's router
//!   has no KV events), and running requests per worker. When `max - min > 64` and
//!   `max > 1.5 × min` it balances (fewest running requests); otherwise it takes the
//!   worker with the longest prefix match if the match covers more than 30 % of the
//!   prompt, else the least-loaded one. (SGLang sends that last case to the worker with
//!   the smallest tree; the issue asks for least-loaded, which is the stronger baseline.)
//! * `dynamo-classic` — Dynamo's 2025 logit (REFERENCE.md §3, `overlap_score_weight` 1)
//!   on the event-fed index and kvr's bookings, argmin with a random tie-break.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvr::config::IndexerConfig;
use kvr::cost::{choose, classic_logit, CandidateLoad, RequestShape, SelectionRng};
use kvr::hash::{BlockHasher, HashSalt};
use kvr::Engine;
use kvr::FreeOutcome;
use kvr::OverlapScores;
use kvr::Partition;
use kvr::RankId;
use kvr::{Outcome, SelectRequest, SessionContext};

use super::sglang_tree::{SglangTree, DEFAULT_MAX_ENTRIES};

/// A routing policy of `kvr replay`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PolicyKind {
    Kvr,
    KvrDynamo,
    KvrApprox,
    KvrPredict,
    RoundRobin,
    Random,
    LeastLoaded,
    Sglang,
    DynamoClassic,
}

impl PolicyKind {
    pub(crate) const ALL: [PolicyKind; 9] = [
        PolicyKind::Kvr,
        PolicyKind::KvrDynamo,
        PolicyKind::KvrApprox,
        PolicyKind::KvrPredict,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastLoaded,
        PolicyKind::Sglang,
        PolicyKind::DynamoClassic,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            PolicyKind::Kvr => "kvr",
            PolicyKind::KvrDynamo => "kvr-dynamo",
            PolicyKind::KvrApprox => "kvr-approx",
            PolicyKind::KvrPredict => "kvr-predict",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::Sglang => "sglang",
            PolicyKind::DynamoClassic => "dynamo-classic",
        }
    }

    pub(crate) fn parse(s: &str) -> Result<PolicyKind, String> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = PolicyKind::ALL.iter().map(|p| p.name()).collect();
                format!("unknown policy {s:?} (known: {})", names.join(", "))
            })
    }

    /// Whether the router reads the engines' KV events.
    pub(crate) fn uses_events(self) -> bool {
        matches!(
            self,
            PolicyKind::Kvr
                | PolicyKind::KvrDynamo
                | PolicyKind::KvrPredict
                | PolicyKind::DynamoClassic
        )
    }

    /// Whether kvr's own selection picks the rank (so session affinity can steer it).
    pub(crate) fn selects_in_engine(self) -> bool {
        matches!(
            self,
            PolicyKind::Kvr
                | PolicyKind::KvrDynamo
                | PolicyKind::KvrApprox
                | PolicyKind::KvrPredict
        )
    }

    /// The cost the partition selects with: Dynamo's for `kvr-dynamo`, else `cost`.
    pub(crate) fn cost(self, cost: kvr::config::CostConfig) -> kvr::config::CostConfig {
        match self {
            PolicyKind::KvrDynamo => kvr::config::CostConfig {
                model: kvr::config::CostModel::Dynamo,
                ..cost
            },
            _ => cost,
        }
    }

    /// The partition's indexer policy: events off (the approximate primary, fed by the
    /// bookings) for the policies without events, the prediction side index for
    /// `kvr-predict`.
    pub(crate) fn indexer(self, prediction_ttl: Duration) -> IndexerConfig {
        match self {
            PolicyKind::KvrApprox => IndexerConfig {
                use_kv_events: false,
                ..IndexerConfig::default()
            },
            PolicyKind::KvrPredict => IndexerConfig {
                prediction_ttl: Some(prediction_ttl),
                ..IndexerConfig::default()
            },
            _ => IndexerConfig::default(),
        }
    }
}

/// SGLang's defaults: `balance_abs_threshold`, `balance_rel_threshold`, `cache_threshold`.
const SGLANG_BALANCE_ABS: f64 = 64.0;
const SGLANG_BALANCE_REL: f64 = 1.5;
const SGLANG_CACHE_THRESHOLD: f64 = 0.3;

/// A router: one policy over one partition of its own engine.
pub(crate) struct Router {
    kind: PolicyKind,
    /// Owns the partition (kept alive; the router calls the partition directly).
    _engine: Engine,
    partition: Arc<Partition>,
    ranks: Vec<RankId>,
    rng: SelectionRng,
    next_id: u64,
    next_rr: usize,
    hasher: BlockHasher,
    local: Vec<u64>,
    seq: Vec<u64>,
    overlaps: OverlapScores,
    costs: Vec<f64>,
    ties: Vec<usize>,
    /// The `sglang` policy's tree of routed prompts, and its match buffer.
    tree: SglangTree,
    matched: Vec<u32>,
    /// Replica-specific near-tie break (`least-loaded`, `dynamo-classic`): this replica's
    /// index and the band (0 = off). See [`Router::set_replica`].
    replica: u32,
    tie_band: f64,
    /// Lifecycle calls that succeeded: bookings, prefill completions, frees.
    pub booked: u64,
    pub prefilled: u64,
    pub freed: u64,
}

/// Where a request went.
pub(crate) struct Routed {
    pub rank: RankId,
    pub selection_id: u64,
}

impl Router {
    pub(crate) fn new(
        kind: PolicyKind,
        engine: Engine,
        partition: Arc<Partition>,
        ranks: Vec<RankId>,
        seed: u64,
    ) -> Self {
        let hasher = *partition.hasher();
        Router {
            kind,
            _engine: engine,
            partition,
            ranks,
            rng: SelectionRng::from_seed(seed ^ 0x726f_7574_6572),
            next_id: 1,
            next_rr: 0,
            hasher,
            local: Vec::new(),
            seq: Vec::new(),
            overlaps: OverlapScores::new(),
            costs: Vec::new(),
            ties: Vec::new(),
            tree: SglangTree::new(DEFAULT_MAX_ENTRIES),
            matched: Vec::new(),
            replica: 0,
            tie_band: 0.0,
            booked: 0,
            prefilled: 0,
            freed: 0,
        }
    }

    pub(crate) fn kind(&self) -> PolicyKind {
        self.kind
    }

    pub(crate) fn ranks(&self) -> &[RankId] {
        &self.ranks
    }

    /// Makes this router replica `index` of several: its own random stream (replica 0
    /// keeps the single router's), selection ids of its own (`index` in the top 16 bits,
    /// so peers' ids never collide), and the replica-specific near-tie break with `band`:
    /// the policies picked here (`least-loaded`, `dynamo-classic`) take, among the ranks
    /// within `band` × |best| (at least `band`) of the best key, the one ranked first by a
    /// hash of (replica, rank), instead of a random one among exact ties. Replicas with
    /// the same view then spread over near-equal ranks without talking to each other.
    /// kvr's own policies select inside the engine, which has no such knob.
    pub(crate) fn set_replica(&mut self, index: u32, seed: u64, tie_band: f64) {
        if index > 0 {
            self.rng = SelectionRng::from_seed(
                seed ^ 0x726f_7574_6572 ^ u64::from(index).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
        }
        self.next_id = (u64::from(index) << 48) | 1;
        self.replica = index;
        self.tie_band = tie_band;
    }

    /// The replica's preference among near-tied ranks.
    fn replica_hash(&self, rank: usize) -> u64 {
        let x = (u64::from(self.replica) << 32 | rank as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
        let x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }

    /// The least of `keys` (a random one among exact ties), or with a tie band the
    /// replica's favourite among the near-least.
    fn pick_min(&mut self, keys: &[f64]) -> RankId {
        if self.tie_band > 0.0 {
            let best = keys.iter().copied().fold(f64::INFINITY, f64::min);
            let limit = best + self.tie_band * best.abs().max(1.0);
            let i = (0..keys.len())
                .filter(|&i| keys[i] <= limit)
                .min_by_key(|&i| self.replica_hash(i))
                .expect("the best key is within its own band");
            return self.ranks[i];
        }
        self.argmin_into(|i| keys[i]);
        self.pick_tie()
    }

    pub(crate) fn partition(&self) -> &Partition {
        &self.partition
    }

    /// Routes and books one request at simulated time `now`.
    pub(crate) fn route(
        &mut self,
        tokens: &[u32],
        output_tokens: u32,
        session: Option<u64>,
        now: Instant,
    ) -> Result<Routed, String> {
        let mut req = SelectRequest::tokens(tokens);
        req.expected_output_tokens = u64::from(output_tokens);
        // The conversation a turn belongs to (built-in workload); it steers only where the
        // partition keeps a session table (`--affinity`).
        req.session = session.map(|s| SessionContext {
            session_id: s.to_string(),
            ..SessionContext::default()
        });
        let partition = Arc::clone(&self.partition);
        let p = &*partition;
        let id = self.next_id;
        self.next_id += 1;
        let decision = match self.kind {
            PolicyKind::Kvr
            | PolicyKind::KvrDynamo
            | PolicyKind::KvrApprox
            | PolicyKind::KvrPredict => match p.select_and_reserve(&req, id, now, &mut self.rng) {
                Ok(Outcome::Selected(d)) => d,
                Ok(other) => return Err(format!("selection answered {other:?}")),
                Err(e) => return Err(e.to_string()),
            },
            _ => {
                let rank = self.pick(tokens);
                p.reserve(rank, Some(&req), None, id, now)
                    .map_err(|e| e.to_string())?
            }
        };
        self.booked += 1;
        Ok(Routed {
            rank: decision.rank,
            selection_id: decision
                .selection_id
                .ok_or("a booking without a selection id")?,
        })
    }

    /// A uniformly random index among `self.ties`.
    fn pick_tie(&mut self) -> RankId {
        let i = (self.rng.next_u64() % self.ties.len() as u64) as usize;
        self.ranks[self.ties[i]]
    }

    /// The ranks minimising `key`, into `self.ties`.
    fn argmin_into(&mut self, key: impl Fn(usize) -> f64) {
        self.ties.clear();
        let mut best = f64::INFINITY;
        for i in 0..self.ranks.len() {
            let k = key(i);
            if k < best {
                best = k;
                self.ties.clear();
            }
            if k == best {
                self.ties.push(i);
            }
        }
    }

    fn pick(&mut self, tokens: &[u32]) -> RankId {
        let partition = Arc::clone(&self.partition);
        let p = &*partition;
        let b = p.block_size();
        match self.kind {
            PolicyKind::RoundRobin => {
                let r = self.ranks[self.next_rr % self.ranks.len()];
                self.next_rr += 1;
                r
            }
            PolicyKind::Random => {
                let i = (self.rng.next_u64() % self.ranks.len() as u64) as usize;
                self.ranks[i]
            }
            PolicyKind::LeastLoaded => {
                let loads = p.bookings().loads();
                let ranks = &self.ranks;
                self.ties.clear();
                let key = |i: usize| {
                    let l = loads.get(ranks[i]);
                    (l.active_prefill_tokens + u64::from(b) * l.active_decode_blocks) as f64
                };
                let keys: Vec<f64> = (0..ranks.len()).map(key).collect();
                self.pick_min(&keys)
            }
            PolicyKind::Sglang => {
                let loads = p.bookings().loads();
                let running: Vec<f64> = self
                    .ranks
                    .iter()
                    .map(|&r| loads.get(r).active_requests as f64)
                    .collect();
                let max = running.iter().copied().fold(0.0, f64::max);
                let min = running.iter().copied().fold(f64::INFINITY, f64::min);
                let imbalanced = max - min > SGLANG_BALANCE_ABS && max > SGLANG_BALANCE_REL * min;
                self.hasher
                    .hash_tokens(tokens, &mut self.local, &mut self.seq);
                let mut chosen = None;
                if !imbalanced {
                    self.tree
                        .match_prefix(&self.seq, self.ranks.len(), &mut self.matched);
                    let best = self.matched.iter().copied().max().unwrap_or(0);
                    let rate = f64::from(best) * f64::from(b) / tokens.len().max(1) as f64;
                    if rate > SGLANG_CACHE_THRESHOLD {
                        let keys: Vec<f64> = self.matched.iter().map(|&m| -f64::from(m)).collect();
                        self.argmin_into(|i| keys[i]);
                        chosen = Some(self.pick_tie());
                    }
                }
                let rank = chosen.unwrap_or_else(|| {
                    self.argmin_into(|i| running[i]);
                    self.pick_tie()
                });
                let w = self.ranks.iter().position(|&r| r == rank).expect("a rank") as u32;
                self.tree.insert(&self.seq, w);
                rank
            }
            PolicyKind::DynamoClassic => {
                self.hasher
                    .hash_tokens(tokens, &mut self.local, &mut self.seq);
                p.index().find_matches_into(&self.local, &mut self.overlaps);
                let loads = p.bookings().loads();
                let shape = RequestShape::new(tokens.len() as u64, b);
                self.costs.clear();
                for &r in &self.ranks {
                    let l = loads.get(r);
                    let c = CandidateLoad {
                        device_blocks: u64::from(self.overlaps.get(r)),
                        active_prefill_tokens: l.active_prefill_tokens,
                        active_decode_blocks: l.active_decode_blocks,
                        new_blocks_not_active: loads.new_blocks_not_active(r, &self.seq),
                        active_requests: l.active_requests,
                        ..CandidateLoad::default()
                    };
                    self.costs.push(classic_logit(1.0, &shape, &c));
                }
                if self.tie_band > 0.0 {
                    let costs = std::mem::take(&mut self.costs);
                    let rank = self.pick_min(&costs);
                    self.costs = costs;
                    return rank;
                }
                let i = choose(&self.costs, 0.0, &mut self.rng).unwrap_or(0);
                self.ranks[i]
            }
            PolicyKind::Kvr
            | PolicyKind::KvrDynamo
            | PolicyKind::KvrApprox
            | PolicyKind::KvrPredict => {
                unreachable!("selected by the engine")
            }
        }
    }

    pub(crate) fn prefill_done(&mut self, id: u64, now: Instant) -> Result<(), String> {
        self.partition
            .bookings()
            .mark_prefill_complete_at(id, now)
            .map_err(|e| e.to_string())?;
        self.prefilled += 1;
        Ok(())
    }

    pub(crate) fn output_block(&self, id: u64) -> Result<(), String> {
        self.partition
            .bookings()
            .add_output_blocks(id, 1)
            .map_err(|e| e.to_string())
    }

    pub(crate) fn free(&mut self, id: u64) -> Result<(), String> {
        match self
            .partition
            .bookings()
            .free(id)
            .map_err(|e| e.to_string())?
        {
            FreeOutcome::Freed(_) => {
                self.freed += 1;
                Ok(())
            }
            FreeOutcome::AlreadyFreed(by) => Err(format!("already freed ({by:?})")),
            other => Err(format!("not freed ({other:?})")),
        }
    }
}

/// A salt-free hasher of `block_size` (the partitions of a replay use no namespace).
pub(crate) fn hasher(block_size: u32) -> BlockHasher {
    BlockHasher::new(block_size as usize, HashSalt::default()).expect("block size checked >= 1")
}
