//! Selection (DESIGN.md §7, seed 001): prompt → hashes → overlap (index + host shared
//! cache) → eligible candidates → cost → choice → (booked mode) booking.
//!
//! Two modes share one decision path: advisory selection ([`Partition::select`]) returns
//! the decision and the projected load and books nothing; [`Partition::select_and_reserve`]
//! books the chosen rank before returning. Hooks are called with no engine lock held.

use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::cost::{
    choose, cost, fill_costs, min_active_prefill_tokens, CandidateLoad, CostOverrides,
    RandomSource, RequestShape,
};
use crate::hash::{extend_sequence_hashes, BlockHasher, HashSalt};
use crate::index::{RankId, TieredOverlap, TieredScores, WorkerId};
use crate::load::LoadSnapshot;
use crate::partition::{BlockRange, HostHooks, Partition, PrefillQuery, WorkerInfo, WorkerSet};
use crate::reservation::{BookingRequest, ReservationError, SelectionId};
pub use crate::session::SessionContext;
use crate::session::Steer;
use crate::sync::atomic::{AtomicU64, Ordering};

/// A prompt, as tokens (kvr hashes them) or as precomputed local block hashes.
#[derive(Clone, Copy, Debug)]
pub enum Prompt<'a> {
    Tokens(&'a [u32]),
    /// Local hashes of the prompt's complete blocks, and the prompt's length in tokens.
    LocalHashes {
        hashes: &'a [u64],
        prompt_tokens: u64,
    },
}

/// One selection request.
#[derive(Clone, Debug)]
pub struct SelectRequest<'a> {
    pub prompt: Prompt<'a>,
    /// LoRA adapter: salts the hashes and narrows the candidates to workers serving it.
    pub lora_name: Option<&'a str>,
    /// The caller's allow-set of workers (`None` = every worker of the partition).
    pub allowed_workers: Option<&'a [WorkerId]>,
    /// Route to this worker (if allowed); LoRA narrowing never removes an allowed pin.
    pub pinned_worker: Option<WorkerId>,
    pub session: Option<SessionContext>,
    /// Legacy flat session id, used only when `session` is absent.
    pub legacy_session_id: Option<&'a str>,
    pub overrides: CostOverrides,
    /// Expected output tokens (booked into the decode load as output blocks grow).
    pub expected_output_tokens: u64,
    /// Booked mode: the caller's own selection id (a duplicate is an error); `None` = minted.
    pub selection_id: Option<SelectionId>,
    /// Booked mode: booking lifetime (`None` = the partition's default).
    pub ttl: Option<Duration>,
}

impl<'a> SelectRequest<'a> {
    pub fn tokens(tokens: &'a [u32]) -> Self {
        Self::with_prompt(Prompt::Tokens(tokens))
    }

    pub fn local_hashes(hashes: &'a [u64], prompt_tokens: u64) -> Self {
        Self::with_prompt(Prompt::LocalHashes {
            hashes,
            prompt_tokens,
        })
    }

    fn with_prompt(prompt: Prompt<'a>) -> Self {
        SelectRequest {
            prompt,
            lora_name: None,
            allowed_workers: None,
            pinned_worker: None,
            session: None,
            legacy_session_id: None,
            overrides: CostOverrides::NONE,
            expected_output_tokens: 0,
            selection_id: None,
            ttl: None,
        }
    }

    /// The session context the decision carries: the structured one, else one built from
    /// the legacy flat id.
    pub fn effective_session(&self) -> Option<SessionContext> {
        self.session.clone().or_else(|| {
            self.legacy_session_id.map(|id| SessionContext {
                session_id: id.to_string(),
                ..SessionContext::default()
            })
        })
    }
}

/// Cached prefix of the chosen rank, per source.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overlap {
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
    /// Blocks the host's shared cache holds beyond the device prefix.
    pub shared_blocks: u32,
}

/// The decision for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub rank: RankId,
    /// The booking's id (booked mode); `None` for advisory selection.
    pub selection_id: Option<SelectionId>,
    pub overlap: Overlap,
    /// Prompt tokens the chosen rank has cached on its device.
    pub cached_tokens: u64,
    /// Prefill tokens this request adds to the rank (host estimator, else prompt − cached).
    pub projected_prefill_tokens: u64,
    /// The rank's decode blocks once this request is booked on it.
    pub projected_decode_blocks: u64,
    pub cost: f64,
    pub session: Option<SessionContext>,
    /// How session affinity steered this decision: `None` without a session table or a
    /// session context (and for explicit reservations, which are not steered).
    pub session_route: Option<SessionRoute>,
    /// Booked responses only: a peer rank that holds more of the prompt and can send it.
    pub kv_hint: Option<KvHint>,
}

/// How session affinity took part in a selection (DESIGN.md §9), reported so a gateway
/// can log or count it per request as Dynamo's router does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionRoute {
    /// The session had no binding: chosen by cost (booking binds it).
    Unbound,
    /// Hard mode: sent to the session's bound rank.
    Pinned,
    /// Soft mode: chosen by cost with the bound rank preferred (it may or may not win).
    Preferred,
    /// The bound rank could not take the turn (left, unavailable, overloaded, not
    /// allowed): chosen by cost; booking rebinds the session (a forced rebind).
    Rebound,
}

impl SessionRoute {
    fn of(steer: &Steer) -> Self {
        match steer {
            Steer::Free => SessionRoute::Unbound,
            Steer::Pin(_) => SessionRoute::Pinned,
            Steer::Prefer { .. } => SessionRoute::Preferred,
            Steer::Rebind { .. } => SessionRoute::Rebound,
        }
    }
}

/// A transfer hint (DESIGN.md §7): the chosen rank may pull blocks `block_range` of the
/// prompt from `source` through its control endpoint instead of computing them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvHint {
    pub source: RankId,
    pub control_endpoint: String,
    /// `[start, end)` in prompt blocks: from the chosen rank's device prefix to the
    /// source's, at most `max_transfer_blocks` long.
    pub block_range: (u32, u32),
}

/// What a selection answers.
// `Selected` is the common case and is returned by value: boxing the decision would put
// an allocation on every selection (the routing path allocates nothing once warm).
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Selected(Decision),
    /// Candidates exist, but every one is busy or overloaded: try again later.
    Busy,
    /// No rank can serve the request at all (no workers, nothing allowed or available).
    NoWorker,
}

/// Why a booked selection or an explicit reservation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SelectError {
    Reservation(ReservationError),
    /// An explicit reservation named a rank that is not a member of the partition.
    UnknownRank(RankId),
}

impl std::fmt::Display for SelectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SelectError::Reservation(e) => write!(f, "{e}"),
            SelectError::UnknownRank(r) => write!(f, "rank {r} is not in this partition"),
        }
    }
}

impl std::error::Error for SelectError {}

impl From<ReservationError> for SelectError {
    fn from(e: ReservationError) -> Self {
        SelectError::Reservation(e)
    }
}

/// Selection counters of one partition.
#[derive(Default)]
pub(crate) struct SelectionCounters {
    /// Bumped by every selection: striped, so threads do not share its cache line.
    pub(crate) selections: crate::counter::StripedCounter,
    pub(crate) busy: AtomicU64,
    pub(crate) no_worker: AtomicU64,
    pub(crate) shared_cache_failures: AtomicU64,
}

/// Selection counters of one partition, as read at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SelectionStats {
    pub selections: u64,
    pub busy: u64,
    pub no_worker: u64,
    /// Shared-cache lookups that failed (selection went on without their hits).
    pub shared_cache_failures: u64,
}

impl SelectionCounters {
    pub(crate) fn snapshot(&self) -> SelectionStats {
        SelectionStats {
            selections: self.selections.get(),
            busy: self.busy.load(Ordering::Relaxed),
            no_worker: self.no_worker.load(Ordering::Relaxed),
            shared_cache_failures: self.shared_cache_failures.load(Ordering::Relaxed),
        }
    }
}

/// Per-thread buffers a selection reuses, so an advisory selection allocates nothing once
/// a thread has warmed up (the C ABI's "no allocation on the routing path"). Taken out of
/// the thread-local slot and put back, never borrowed across a call: a host hook that
/// selects again from inside a selection just gets fresh (empty) buffers.
#[derive(Default)]
struct Scratch {
    local: Vec<u64>,
    /// A spare sequence vector: an advisory selection gives its prompt's back; a booked
    /// one moves it into the booking.
    seq: Vec<u64>,
    tiered: TieredScores,
    /// The prediction side index's overlaps and the merge of both (prediction mode).
    predicted: TieredScores,
    merged: Vec<TieredOverlap>,
}

std::thread_local! {
    static SCRATCH: std::cell::Cell<Option<Box<Scratch>>> = const { std::cell::Cell::new(None) };
}

impl Scratch {
    fn take() -> Box<Scratch> {
        SCRATCH.with(|c| c.take()).unwrap_or_default()
    }

    fn put(s: Box<Scratch>) {
        SCRATCH.with(|c| c.set(Some(s)));
    }

    fn give_back_seq(seq: Vec<u64>) {
        SCRATCH.with(|c| {
            if let Some(mut s) = c.take() {
                if s.seq.capacity() < seq.capacity() {
                    s.seq = seq;
                }
                c.set(Some(s));
            }
        });
    }
}

/// Puts the scratch back when a decision ends, on every return path.
struct PutBack(Option<Box<Scratch>>);

impl Drop for PutBack {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            Scratch::put(s);
        }
    }
}

/// Everything a decision needed, kept for booking it.
pub(crate) struct Prepared {
    pub(crate) decision: Decision,
    pub(crate) seq: Vec<u64>,
    /// The session's bound rank could not take the turn: the booking rebinds it (counted).
    pub(crate) forced_rebind: bool,
}

/// Blocks of `[from, n)` covered contiguously from `from` by the shared-cache ranges.
fn shared_beyond(ranges: &[BlockRange], from: u32, n: u32) -> u32 {
    let mut at = from;
    loop {
        let next = ranges
            .iter()
            .filter(|(s, e)| *s <= at && *e > at)
            .map(|(_, e)| (*e).min(n))
            .max();
        match next {
            Some(e) if e > at => at = e,
            _ => return at - from,
        }
    }
}

impl Partition {
    /// Advisory selection: the decision and the projected load; books nothing.
    pub fn select(&self, req: &SelectRequest<'_>, rng: &mut impl RandomSource) -> Outcome {
        match self.decide(req, false, None, rng) {
            Ok(p) => {
                Scratch::give_back_seq(p.seq);
                Outcome::Selected(p.decision)
            }
            Err(o) => *o,
        }
    }

    /// Booked selection: decides, then books the chosen rank before returning.
    pub fn select_and_reserve(
        &self,
        req: &SelectRequest<'_>,
        selection_id: SelectionId,
        now: Instant,
        rng: &mut impl RandomSource,
    ) -> Result<Outcome, SelectError> {
        let p = match self.decide(req, true, Some(now), rng) {
            Ok(p) => p,
            Err(o) => return Ok(*o),
        };
        let mut d = p.decision;
        let to_record = self.indexing.recorder.is_some().then(|| p.seq.clone());
        self.bookings.book(
            BookingRequest {
                selection_id,
                rank: d.rank,
                prompt_blocks: p.seq,
                prefill_tokens: d.projected_prefill_tokens,
                expected_output_tokens: req.expected_output_tokens,
                ttl: req.ttl,
            },
            now,
        )?;
        // After the booking stands: a recording failure is logged, never the booking's.
        if let Some(seq) = to_record {
            self.indexing.record_booking(&self.index, d.rank, &seq, now);
        }
        // The session follows its turn: bound (or rebound) to the rank, with this booking
        // as a lease that ends when the booking does. A refusal (table full of live
        // sessions) is counted by the table; the booking stands.
        if let (Some(t), Some(ctx)) = (&self.sessions, &d.session) {
            t.bind(ctx, d.rank, selection_id, p.forced_rebind, now);
        }
        d.selection_id = Some(selection_id);
        Ok(Outcome::Selected(d))
    }

    /// Books a request on a rank the caller chose (no scoring). With a prompt, its blocks
    /// join the rank's active blocks; without, only the given prefill tokens are booked.
    pub fn reserve(
        &self,
        rank: RankId,
        prompt: Option<&SelectRequest<'_>>,
        prefill_tokens: Option<u64>,
        selection_id: SelectionId,
        now: Instant,
    ) -> Result<Decision, SelectError> {
        let workers = self.workers();
        let member = workers
            .get(rank.worker_id)
            .is_some_and(|w| rank.dp_rank < w.dp_size.max(1));
        if !member {
            return Err(SelectError::UnknownRank(rank));
        }
        let (seq, prompt_tokens, expected, ttl) = match prompt {
            Some(r) => {
                let (seq, n) = self.sequence_of(r);
                (seq, n, r.expected_output_tokens, r.ttl)
            }
            None => (Vec::new(), prefill_tokens.unwrap_or(0), 0, None),
        };
        let device = if seq.is_empty() {
            0
        } else {
            let mut t = TieredScores::new();
            self.index.find_matches_tiered_by_sequence(&seq, &mut t);
            t.get(rank).map_or(0, |o| o.device)
        };
        let cached = (device as u64 * self.block_size() as u64).min(prompt_tokens);
        let prefill = prefill_tokens.unwrap_or(prompt_tokens - cached);
        let active = self.bookings.rank_load(rank);
        let new_blocks = self.bookings.new_blocks_not_active(rank, &seq);
        let to_record = (self.indexing.recorder.is_some() && !seq.is_empty()).then(|| seq.clone());
        self.bookings.book(
            BookingRequest {
                selection_id,
                rank,
                prompt_blocks: seq,
                prefill_tokens: prefill,
                expected_output_tokens: expected,
                ttl,
            },
            now,
        )?;
        // A reservation that carries the prompt records it (DESIGN.md §5).
        if let Some(seq) = to_record {
            self.indexing.record_booking(&self.index, rank, &seq, now);
        }
        Ok(Decision {
            rank,
            selection_id: Some(selection_id),
            overlap: Overlap {
                device_blocks: device,
                ..Overlap::default()
            },
            cached_tokens: cached,
            projected_prefill_tokens: prefill,
            projected_decode_blocks: active.active_decode_blocks + new_blocks,
            cost: f64::NAN,
            session: prompt.and_then(|r| r.effective_session()),
            session_route: None,
            kv_hint: None,
        })
    }

    /// Sequence hashes of a request's prompt and its length in tokens.
    fn sequence_of(&self, req: &SelectRequest<'_>) -> (Vec<u64>, u64) {
        let mut scratch = Scratch::take();
        let mut seq = std::mem::take(&mut scratch.seq);
        seq.clear();
        let r = self.sequence_into(req, &mut scratch.local, seq);
        Scratch::put(scratch);
        r
    }

    fn sequence_into(
        &self,
        req: &SelectRequest<'_>,
        local: &mut Vec<u64>,
        mut seq: Vec<u64>,
    ) -> (Vec<u64>, u64) {
        match req.prompt {
            Prompt::Tokens(tokens) => {
                let salt = HashSalt::new(req.lora_name, self.config().cache_namespace.as_deref());
                let hasher = if salt == self.hasher().salt() {
                    *self.hasher()
                } else {
                    BlockHasher::new(self.block_size() as usize, salt).expect("block size >= 1")
                };
                hasher.hash_tokens(tokens, local, &mut seq);
                (seq, tokens.len() as u64)
            }
            Prompt::LocalHashes {
                hashes,
                prompt_tokens,
            } => {
                extend_sequence_hashes(None, hashes, &mut seq);
                (seq, prompt_tokens)
            }
        }
    }

    /// Candidate ranks after the allow-set, the pin, LoRA narrowing and host availability.
    fn candidates(
        &self,
        req: &SelectRequest<'_>,
        workers: &WorkerSet,
        hooks: &HostHooks,
    ) -> SmallVec<[RankId; 64]> {
        let mut ranks: SmallVec<[RankId; 64]> = SmallVec::new();
        let lora = req.lora_name.filter(|l| !l.is_empty());
        if req.allowed_workers.is_none() && req.pinned_worker.is_none() && lora.is_none() {
            // The common case: every worker of the partition, one pass.
            for info in workers.iter() {
                ranks.extend(info.ranks());
            }
        } else {
            self.narrowed_candidates(req, workers, hooks, &mut ranks);
        }
        if let Some(avail) = &hooks.availability {
            ranks.retain(|r| avail(*r));
        }
        ranks
    }

    /// The allow-set, the pin and LoRA narrowing, in that order.
    fn narrowed_candidates(
        &self,
        req: &SelectRequest<'_>,
        workers: &WorkerSet,
        hooks: &HostHooks,
        ranks: &mut SmallVec<[RankId; 64]>,
    ) {
        let allowed = |w: &WorkerInfo| {
            req.allowed_workers
                .map_or(true, |a| a.contains(&w.worker_id))
        };
        let mut pool: SmallVec<[WorkerId; 64]> = workers
            .iter()
            .filter(|w| allowed(w))
            .map(|w| w.worker_id)
            .collect();
        // An allowed pin is the whole pool; a pin outside the allow-set does not survive.
        let pinned = req.pinned_worker.filter(|p| pool.contains(p));
        if let Some(p) = pinned {
            pool.retain(|w| *w == p);
        } else if let Some(lora) = req.lora_name.filter(|l| !l.is_empty()) {
            let narrowed: SmallVec<[WorkerId; 64]> = match &hooks.lora_filter {
                Some(f) => {
                    let offered = f(lora, &pool);
                    // Never widen: keep only workers the caller allowed.
                    pool.iter()
                        .copied()
                        .filter(|w| offered.contains(w))
                        .collect()
                }
                None => pool
                    .iter()
                    .copied()
                    .filter(|w| {
                        workers
                            .get(*w)
                            .is_some_and(|i| i.lora_adapters.iter().any(|a| a == lora))
                    })
                    .collect(),
            };
            // An empty narrowing falls back to the caller's set.
            if !narrowed.is_empty() {
                pool = narrowed;
            }
        }
        for w in pool {
            if let Some(info) = workers.get(w) {
                ranks.extend(info.ranks());
            }
        }
    }

    /// Over a busy threshold (DESIGN.md §6, REFERENCE.md §3). Takes the selection's one
    /// worker set and load snapshot.
    fn is_busy(
        &self,
        rank: RankId,
        info: Option<&WorkerInfo>,
        reported: &LoadSnapshot,
        decode_blocks: u64,
        prefill_tokens: u64,
    ) -> bool {
        let b = &self.config().busy;
        if let (Some(f), Some(i)) = (b.decode_blocks_fraction, info) {
            let used = reported
                .get(rank)
                .map_or(0, |l| l.kv_blocks_used)
                .max(decode_blocks);
            if i.total_kv_blocks > 0 && used as f64 > f * i.total_kv_blocks as f64 {
                return true;
            }
        }
        if b.prefill_tokens.is_some_and(|t| prefill_tokens > t) {
            return true;
        }
        if let (Some(f), Some(i)) = (b.prefill_tokens_fraction, info) {
            if i.max_batched_tokens > 0 && prefill_tokens as f64 > f * i.max_batched_tokens as f64 {
                return true;
            }
        }
        false
    }

    /// The decision path both modes share (steps 1–5 of DESIGN.md §7).
    pub(crate) fn decide(
        &self,
        req: &SelectRequest<'_>,
        booked: bool,
        now: Option<Instant>,
        rng: &mut impl RandomSource,
    ) -> Result<Prepared, Box<Outcome>> {
        self.counters.selections.add(1);
        // 1. hashes.
        let (seq, prompt_tokens) = self.sequence_of(req);
        // 2. overlap: the index, and the host's shared cache alongside it.
        let mut scratch = Scratch::take();
        let tiered = &mut scratch.tiered;
        match &self.indexing.remote {
            // A remote primary takes the prompt's local hashes (it chains them itself).
            Some(remote) => {
                let local = &mut scratch.local;
                let hashes: &[u64] = match req.prompt {
                    Prompt::LocalHashes { hashes, .. } => hashes,
                    Prompt::Tokens(tokens) => {
                        let salt =
                            HashSalt::new(req.lora_name, self.config().cache_namespace.as_deref());
                        BlockHasher::new(self.block_size() as usize, salt)
                            .expect("block size >= 1")
                            .local_hashes(tokens, local);
                        local
                    }
                };
                self.indexing.query_remote(
                    &**remote,
                    self.key(),
                    self.block_size(),
                    hashes,
                    &mut scratch.tiered,
                );
            }
            None => self.index.find_matches_tiered_by_sequence(&seq, tiered),
        }
        // Prediction (DESIGN.md §5): what was booked but not yet announced counts too.
        let Scratch {
            tiered,
            predicted,
            merged,
            ..
        } = &mut *scratch;
        self.indexing
            .merge_prediction(&seq, tiered, predicted, merged);
        let scratch = PutBack(Some(scratch));
        let tiered = &scratch.0.as_ref().expect("held until drop").tiered;
        let hooks = self.hooks_now();
        let shared: Vec<BlockRange> = match &hooks.shared_cache {
            Some(f) if !seq.is_empty() => match f(&seq) {
                Ok(r) => r,
                Err(_) => {
                    self.counters
                        .shared_cache_failures
                        .fetch_add(1, Ordering::Relaxed);
                    Vec::new()
                }
            },
            _ => Vec::new(),
        };
        // 3. candidates. One read of the booking registry, the worker set and the reported
        // load for the whole selection; thresholds are checked only if the partition sets
        // any.
        let workers = self.workers_now();
        let ranks = self.candidates(req, &workers, &hooks);
        if ranks.is_empty() {
            self.counters.no_worker.fetch_add(1, Ordering::Relaxed);
            return Err(Box::new(Outcome::NoWorker));
        }
        let n_blocks = seq.len() as u32;
        let loads = self.bookings.loads();
        let reported = self.load.snapshot_now();
        let busy = self.config().busy;
        let any_threshold = busy.decode_blocks_fraction.is_some()
            || busy.prefill_tokens.is_some()
            || busy.prefill_tokens_fraction.is_some();
        // The eligible candidates, as parallel arrays (the cost function reads `inputs`
        // in place).
        let mut eligible: SmallVec<[RankId; 64]> = SmallVec::new();
        let mut inputs: SmallVec<[CandidateLoad; 64]> = SmallVec::new();
        // Candidates come in rank order (the worker set is ordered by id) and so do the
        // overlaps: one merge walk instead of a search per candidate.
        let overlaps = tiered.as_slice();
        let (mut at, mut prev) = (0, None);
        for &rank in &ranks {
            if prev.is_some_and(|p| rank < p) {
                at = 0; // out of order (never with today's worker set): restart the walk
            }
            prev = Some(rank);
            while at < overlaps.len() && overlaps[at].rank < rank {
                at += 1;
            }
            let t = overlaps.get(at).filter(|o| o.rank == rank);
            if hooks.overload.as_ref().is_some_and(|f| f(rank)) {
                continue;
            }
            let active = loads.get(rank);
            // Negative control of the load-snapshot model: one snapshot per candidate.
            #[cfg(loom)]
            let reported = if crate::sync::faults::get().reload_load_per_rank {
                self.load.snapshot_now()
            } else {
                reported.clone()
            };
            if any_threshold
                && self.is_busy(
                    rank,
                    workers.get(rank.worker_id),
                    &reported,
                    active.active_decode_blocks,
                    active.active_prefill_tokens,
                )
            {
                continue;
            }
            let device = t.map_or(0, |o| o.device);
            eligible.push(rank);
            inputs.push(CandidateLoad {
                device_blocks: device as u64,
                host_blocks: t.map_or(0, |o| o.host) as u64,
                disk_blocks: t.map_or(0, |o| o.disk) as u64,
                shared_blocks_beyond_device: shared_beyond(&shared, device, n_blocks) as u64,
                active_prefill_tokens: active.active_prefill_tokens,
                active_decode_blocks: active.active_decode_blocks,
                // Known exactly only for an idle rank; the others are resolved below,
                // and only where they can change the choice.
                new_blocks_not_active: seq.len() as u64,
                active_requests: active.active_requests,
            });
        }
        if eligible.is_empty() {
            self.counters.busy.fetch_add(1, Ordering::Relaxed);
            return Err(Box::new(Outcome::Busy));
        }
        // 5. cost and choice.
        let cfg = self.config().cost.resolve(&req.overrides);
        let shape = RequestShape::new(prompt_tokens, self.block_size());
        // The decode term needs, per busy rank, how many prompt blocks are not active on
        // it yet (a lock and a few lookups a rank). Cost rises by exactly one per such
        // block, so with the term at its upper bound (the whole prompt) every cost is an
        // upper bound; at temperature 0 a rank whose cost with the term at 0 exceeds the
        // smallest upper bound can never win or tie, and keeps its bound. (At T > 0 every
        // cost matters, so all are resolved.) Resolving changes no candidate's prefill
        // tokens, so the credit decay's reference point stays and only the resolved
        // ranks' costs are recomputed.
        let mut costs: SmallVec<[f64; 64]> = SmallVec::from_elem(0.0, inputs.len());
        fill_costs(&cfg, &shape, &inputs, &mut costs);
        // 4. session context (DESIGN.md §9): a bound session pins (hard) or prefers (soft)
        // its rank while that rank is eligible; otherwise it is rebound by this choice.
        let session = req.effective_session();
        let mut steer = Steer::Free;
        let mut session_route = None;
        if let (Some(t), Some(ctx)) = (&self.sessions, &session) {
            let (binding, dropped) = t.lookup_or_dropped(ctx, now.unwrap_or_else(Instant::now));
            steer = t.steer(binding, |r| eligible.contains(&r));
            session_route = Some(if dropped {
                SessionRoute::Rebound
            } else {
                SessionRoute::of(&steer)
            });
        }
        let steered = matches!(steer, Steer::Pin(_) | Steer::Prefer { .. });
        let bound = if steered {
            f64::INFINITY // resolve every cost: the steering below compares them exactly
        } else if cfg.temperature <= 0.0 {
            let min_upper = costs.iter().copied().fold(f64::INFINITY, f64::min);
            min_upper + seq.len() as f64
        } else {
            f64::INFINITY
        };
        let shape = shape.with_min_active_prefill_tokens(min_active_prefill_tokens(&inputs));
        for k in 0..inputs.len() {
            if inputs[k].active_requests != 0 && costs[k] <= bound {
                // Bookings carry whole chains from block 0, so the rank's active blocks
                // are prefix-closed and the chain form (log n lookups) is exact.
                inputs[k].new_blocks_not_active =
                    loads.new_blocks_not_active_chain(eligible[k], &seq);
                costs[k] = cost(&cfg, &shape, &inputs[k]);
            }
        }
        let pinned = match steer {
            Steer::Pin(r) => eligible.iter().position(|&e| e == r),
            Steer::Prefer {
                rank,
                penalty_blocks,
            } => {
                if let Some(k) = eligible.iter().position(|&e| e == rank) {
                    costs[k] -= penalty_blocks;
                }
                None
            }
            _ => None,
        };
        let i = match pinned {
            Some(k) => k,
            None => choose(&costs, cfg.temperature, rng).expect("at least one eligible rank"),
        };
        let (rank, c) = (eligible[i], inputs[i]);
        let device = c.device_blocks as u32;
        let cached_tokens = (device as u64 * self.block_size() as u64).min(prompt_tokens);
        let projected_prefill_tokens = hooks
            .prefill_estimator
            .as_ref()
            .and_then(|f| {
                f(&PrefillQuery {
                    rank,
                    prompt_tokens,
                    cached_tokens,
                })
            })
            .unwrap_or(prompt_tokens - cached_tokens);
        let t = tiered.get(rank);
        let kv_hint = if booked {
            self.kv_hint(rank, device, tiered, &workers, &hooks, &loads, &reported)
        } else {
            None
        };
        Ok(Prepared {
            decision: Decision {
                rank,
                selection_id: None,
                overlap: Overlap {
                    device_blocks: device,
                    host_blocks: t.map_or(0, |o| o.host),
                    disk_blocks: t.map_or(0, |o| o.disk),
                    shared_blocks: c.shared_blocks_beyond_device as u32,
                },
                cached_tokens,
                projected_prefill_tokens,
                projected_decode_blocks: c.active_decode_blocks + c.new_blocks_not_active,
                cost: costs[i],
                session,
                session_route,
                kv_hint,
            },
            seq,
            forced_rebind: matches!(steer, Steer::Rebind { .. }),
        })
    }

    /// The transfer hint for a booking on `chosen` (holding `chosen_device` blocks): the
    /// eligible rank with the longest device prefix, if it beats the chosen one by the
    /// configured minimum. Eligible: a role allowed to serve transfers, a control endpoint
    /// for that rank, not overloaded (host hook) and not over a busy threshold.
    #[allow(clippy::too_many_arguments)]
    fn kv_hint(
        &self,
        chosen: RankId,
        chosen_device: u32,
        tiered: &TieredScores,
        workers: &WorkerSet,
        hooks: &HostHooks,
        loads: &crate::reservation::ActiveLoads,
        reported: &LoadSnapshot,
    ) -> Option<KvHint> {
        let cfg = self.config().hints.as_ref()?;
        let mut best: Option<(u32, RankId, &str)> = None;
        for o in tiered.iter() {
            if o.rank == chosen
                || o.device < chosen_device.saturating_add(cfg.min_advantage_blocks.max(1))
                || best.is_some_and(|(d, _, _)| o.device <= d)
            {
                continue;
            }
            let Some(info) = workers.get(o.rank.worker_id) else {
                continue;
            };
            if !cfg.source_roles.contains(&info.role) {
                continue;
            }
            let Some(endpoint) = info
                .control_endpoints
                .get(o.rank.dp_rank as usize)
                .and_then(|e| e.as_deref())
                .filter(|e| !e.is_empty())
            else {
                continue;
            };
            if hooks.overload.as_ref().is_some_and(|f| f(o.rank)) {
                continue;
            }
            let active = loads.get(o.rank);
            if self.is_busy(
                o.rank,
                Some(info),
                reported,
                active.active_decode_blocks,
                active.active_prefill_tokens,
            ) {
                continue;
            }
            best = Some((o.device, o.rank, endpoint));
        }
        let (device, source, endpoint) = best?;
        let end = device.min(chosen_device.saturating_add(cfg.max_transfer_blocks));
        (end > chosen_device).then(|| KvHint {
            source,
            control_endpoint: endpoint.to_string(),
            block_range: (chosen_device, end),
        })
    }

    /// Selection counters of this partition.
    pub fn selection_stats(&self) -> SelectionStats {
        self.counters.snapshot()
    }
}

#[cfg(test)]
mod shared_range_tests {
    use super::shared_beyond;

    #[test]
    fn shared_blocks_count_contiguously_from_the_device_prefix() {
        assert_eq!(shared_beyond(&[(0, 10)], 4, 20), 6);
        assert_eq!(shared_beyond(&[(0, 3), (3, 8)], 2, 20), 6);
        assert_eq!(
            shared_beyond(&[(5, 9)], 4, 20),
            0,
            "a gap at the device prefix end"
        );
        assert_eq!(shared_beyond(&[(0, 50)], 4, 20), 16, "capped at the prompt");
        assert_eq!(shared_beyond(&[], 0, 20), 0);
    }
}
