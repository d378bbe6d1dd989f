//! The decision path both modes share (DESIGN.md §7 steps 1–5), as one short function a
//! stage: hashes → overlap → shared cache → eligible candidates → costs → session steer
//! → choice → decision. Every buffer a stage fills is the thread's [`Scratch`], so a
//! warmed-up thread allocates nothing however many ranks or blocks a selection has.

use std::time::Instant;

use super::idle;
use super::overlap::shared_beyond;
use super::prune::PruneInput;
use super::scratch::{Candidates, PutBack, Scratch};
use super::{Decision, Outcome, Overlap, Prompt, SelectRequest, Selector, SessionRoute};
use crate::config::CostConfig;
use crate::cost::{
    blocks_in_cost_units, choose, takes_argmin, ties_at_min, CostEval, CostModel, LoadRow,
    RandomSource, RequestShape,
};
use crate::hooks::{BlockRange, HostHooks, PrefillQuery};
use crate::index::TieredScores;
use crate::load::LoadSnapshot;
use crate::reservation::ActiveLoads;
use crate::session::{SessionContext, Steer};
use crate::sync::atomic::Ordering;
use crate::workers::{RankSlot, WorkerSet};

/// Everything a decision needed, kept for booking it.
pub(crate) struct Prepared {
    pub(crate) decision: Decision,
    pub(crate) seq: Vec<u64>,
    /// The session's bound rank could not take the turn: the booking rebinds it (counted).
    pub(crate) forced_rebind: bool,
}

/// What one selection reads once and every stage shares: the worker set, the hooks, the
/// booking registry and the reported load, each loaded once (one consistent view).
struct View<'s> {
    workers: &'s WorkerSet,
    hooks: &'s HostHooks,
    loads: &'s ActiveLoads,
    reported: &'s LoadSnapshot,
}

/// How session affinity steers this choice (step 4).
struct Steering {
    session: Option<SessionContext>,
    steer: Steer,
    route: Option<SessionRoute>,
}

impl Selector<'_> {
    /// The decision path both modes share (steps 1–5 of DESIGN.md §7).
    pub(crate) fn decide(
        &self,
        req: &SelectRequest<'_>,
        booked: bool,
        now: Option<Instant>,
        rng: &mut impl RandomSource,
    ) -> Result<Prepared, Box<Outcome>> {
        self.counters.selections.add(1);
        let mut held = PutBack(Some(Scratch::take()));
        let Scratch {
            local,
            tiered,
            predicted,
            merged,
            candidates,
        } = &mut **held.0.as_mut().expect("held until drop");
        // 1. hashes (a tokens prompt's local hashes land in `local`).
        let (seq, prompt_tokens) = self.sequence_into(req, local, crate::recycle::take_hashes());
        let local: &[u64] = match req.prompt {
            Prompt::LocalHashes { hashes, .. } => hashes,
            Prompt::Tokens(_) => local,
        };
        // 2. overlap: the index the policy names.
        self.overlap_into(local, &seq, tiered, predicted, merged);
        self.lookahead_overlap_into(req, tiered, merged);
        // ... and the host's shared cache alongside it.
        let hooks = self.hooks_now();
        let shared = self.shared_cache(&hooks, &seq);
        // 3. candidates, read against one view of the partition.
        let workers = self.workers_now();
        let loads = self.bookings.loads();
        let reported = self.load.snapshot_now();
        let view = View {
            workers: &workers,
            hooks: &hooks,
            loads: &loads,
            reported: &reported,
        };
        let cfg = self.config().cost.resolve(&req.overrides);
        let mut shape = RequestShape::new(prompt_tokens, self.block_size())
            .with_expected_output_tokens(req.expected_output_tokens);
        if cfg.model == CostModel::Latency {
            shape = shape
                .with_prefill_rate(self.prefill_rate(&cfg))
                .with_decode_drag(self.decode_drag(&cfg));
        }
        let every_rank = self.candidates(req, view.workers, view.hooks, candidates);
        let input = PruneInput {
            workers: view.workers,
            hooks: view.hooks,
            loads: view.loads,
            overlaps: tiered.as_slice(),
            shared: &shared,
            n_blocks: seq.len(),
        };
        let stats = self.pruned_candidates(req, every_rank, &input, &cfg, shape, candidates);
        if stats.is_none() {
            self.eligible(every_rank, &view, tiered, &shared, seq.len(), candidates)?;
        }
        // 5. cost (4, the session, decides how far costs must be resolved).
        let steering = self.steering(req, now, &candidates.eligible);
        self.resolve_costs(&cfg, shape, stats, &steering.steer, &view, &seq, candidates);
        // Idle groups priced as one (`idle.rs`) weigh as many ranks as they stand for;
        // the pruned pass runs with no session steering, so nothing else decides.
        let collapsed = match steering.steer {
            Steer::Free => idle::choose(candidates, view.loads, view.workers.slots(), rng),
            _ => None,
        };
        let i = match collapsed {
            Some(i) => i,
            None => pick(candidates, &steering.steer, &cfg, &shape, &hooks, rng),
        };
        let (decision, forced_rebind) = self.decision(
            i,
            prompt_tokens,
            self.indexing.primary_keys(local, &seq),
            booked,
            &view,
            tiered,
            candidates,
            steering,
        );
        Ok(Prepared {
            decision,
            seq,
            forced_rebind,
        })
    }

    /// The block ranges of the prompt in the host's shared cache; a failed lookup is
    /// counted and the selection goes on without them.
    fn shared_cache(&self, hooks: &HostHooks, seq: &[u64]) -> Vec<BlockRange> {
        match &hooks.shared_cache {
            Some(f) if !seq.is_empty() => f(seq).unwrap_or_else(|_| {
                self.counters
                    .shared_cache_failures
                    .fetch_add(1, Ordering::Relaxed);
                Vec::new()
            }),
            _ => Vec::new(),
        }
    }

    /// Step 3: the eligible candidates and their inputs, as parallel arrays in
    /// `c.eligible` / `c.cols` (the cost pass reads the columns in place); thresholds
    /// are checked only if the partition sets any. `NoWorker` / `Busy` when none is left.
    fn eligible(
        &self,
        every_rank: bool,
        view: &View<'_>,
        tiered: &TieredScores,
        shared: &[BlockRange],
        n_blocks: usize,
        c: &mut Candidates,
    ) -> Result<(), Box<Outcome>> {
        let Candidates {
            slots,
            eligible,
            cols,
            ..
        } = c;
        let slots: &[RankSlot] = if every_rank {
            view.workers.slots()
        } else {
            slots
        };
        if slots.is_empty() {
            self.counters.no_worker.fetch_add(1, Ordering::Relaxed);
            return Err(Box::new(Outcome::NoWorker));
        }
        let busy = self.config().busy;
        let any_threshold = busy.decode_blocks_fraction.is_some()
            || busy.prefill_tokens.is_some()
            || busy.prefill_tokens_fraction.is_some();
        // Sized for every candidate and filled by index (no capacity check a column),
        // then cut to the eligible ones.
        let all = slots.len();
        eligible.clear();
        eligible.resize(all, slots[0].rank);
        let ranks_out = &mut eligible[..all];
        let mut rows = cols.rows(all);
        let mut m = 0;
        // Candidates come in rank order (the worker set is ordered by id) and so do the
        // overlaps: one merge walk instead of a search per candidate.
        let overlaps = tiered.as_slice();
        let mut loads = view.loads.cursor();
        let overload = view.hooks.overload.as_ref();
        let (mut at, mut prev) = (0, None);
        for &RankSlot {
            rank,
            kv_blocks: total_kv_blocks,
        } in slots
        {
            if prev.is_some_and(|p| rank < p) {
                at = 0; // out of order (never with today's worker set): restart the walk
            }
            prev = Some(rank);
            while at < overlaps.len() && overlaps[at].rank < rank {
                at += 1;
            }
            let t = overlaps.get(at).filter(|o| o.rank == rank);
            if overload.is_some_and(|f| f(rank)) {
                continue;
            }
            let active = loads.get(rank);
            // Negative control of the load-snapshot model: one snapshot per candidate.
            #[cfg(loom)]
            let reloaded = crate::sync::faults::get()
                .reload_load_per_rank
                .then(|| self.load.snapshot_now());
            #[cfg(loom)]
            let reported: &LoadSnapshot = reloaded.as_deref().unwrap_or(view.reported);
            #[cfg(not(loom))]
            let reported = view.reported;
            if any_threshold
                && self.is_busy(
                    rank,
                    view.workers.get(rank.worker_id),
                    reported,
                    active.active_decode_blocks,
                    active.active_prefill_tokens,
                )
            {
                continue;
            }
            let device = t.map_or(0, |o| o.device);
            ranks_out[m] = rank;
            rows.set(
                m,
                LoadRow {
                    device,
                    host: t.map_or(0, |o| o.host),
                    disk: t.map_or(0, |o| o.disk),
                    shared: shared_beyond(shared, device, n_blocks as u32),
                    prefill_tokens: active.active_prefill_tokens,
                    decode_blocks: active.active_decode_blocks,
                    requests: active.active_requests,
                    kv_blocks: total_kv_blocks,
                },
            );
            m += 1;
        }
        eligible.truncate(m);
        cols.truncate(m);
        if eligible.is_empty() {
            self.counters.busy.fetch_add(1, Ordering::Relaxed);
            return Err(Box::new(Outcome::Busy));
        }
        Ok(())
    }

    /// Step 4, session context (DESIGN.md §9): a bound session pins (hard) or prefers
    /// (soft) its rank while that rank is eligible; otherwise this choice rebinds it.
    fn steering(
        &self,
        req: &SelectRequest<'_>,
        now: Option<Instant>,
        eligible: &[crate::ids::RankId],
    ) -> Steering {
        let session = req.effective_session();
        let mut steer = Steer::Free;
        let mut route = None;
        if let (Some(t), Some(ctx)) = (&self.sessions, &session) {
            let (binding, dropped) = t.lookup_or_dropped(ctx, now.unwrap_or_else(Instant::now));
            steer = t.steer(binding, |r| eligible.contains(&r));
            route = Some(if dropped {
                SessionRoute::Rebound
            } else {
                SessionRoute::of(&steer)
            });
        }
        Steering {
            session,
            steer,
            route,
        }
    }

    /// The prefill rate this selection prices with: the partition's learned estimate
    /// (clamped to a tenth to ten times the prior, so a host that marks prefills complete
    /// at odd times cannot make the estimate absurd), or the prior.
    fn prefill_rate(&self, cfg: &CostConfig) -> f64 {
        let prior = cfg.latency.prefill_rate_prior;
        match self.bookings.prefill_rate() {
            Some(r) if cfg.latency.learn_prefill_rate => r.clamp(prior / 10.0, prior * 10.0),
            _ => prior,
        }
    }

    /// The decode drag this selection prices with, ms per held decode block: the
    /// partition's learned estimate when the prefill timings are learned, capped at 1 ms
    /// a block (a host with odd timings cannot make the charge absurd); else 0.
    fn decode_drag(&self, cfg: &CostConfig) -> f64 {
        match self.bookings.decode_drag() {
            Some(s) if cfg.latency.learn_prefill_rate => (s * 1e3).clamp(0.0, 1.0),
            _ => 0.0,
        }
    }

    /// Step 5: every candidate's cost into `c.costs`.
    ///
    /// The decode term needs, per busy rank, how many prompt blocks are not active on it
    /// yet (a lock and a few lookups a rank). Both models' costs only rise with that
    /// count, so with it at its upper bound (the whole prompt) every cost is an upper
    /// bound, and that minus the count's share ([`CostEval::new_blocks_share`]) a lower
    /// bound; at temperature 0 a rank whose lower bound exceeds the smallest upper bound
    /// can never win or tie, and keeps its bound. (At T > 0, or when a session steers,
    /// every cost matters, so all are resolved.)
    /// Resolving changes no candidate's prefill tokens, so the credit decay's reference
    /// point stays and only the resolved ranks' costs are recomputed.
    #[allow(clippy::too_many_arguments)]
    fn resolve_costs(
        &self,
        cfg: &CostConfig,
        shape: RequestShape,
        stats: Option<RequestShape>,
        steer: &Steer,
        view: &View<'_>,
        seq: &[u64],
        c: &mut Candidates,
    ) {
        // As `fill_costs`, keeping the evaluator for the resolved ranks. Every rank is
        // priced with the whole prompt new; only an idle rank's count is exact already.
        let shape = stats.unwrap_or_else(|| c.cols.selection_stats(shape));
        let eval = CostEval::new(cfg, &shape);
        let whole = seq.len() as u64;
        let min_upper = eval.bounds_all(&c.cols, whole, &mut c.costs, &mut c.lower);
        c.cols.new_blocks.clear();
        c.cols.new_blocks.resize(c.cols.len(), whole);
        let steered = matches!(steer, Steer::Pin(_) | Steer::Prefer { .. });
        let prune = !steered && cfg.temperature <= 0.0;
        let Candidates {
            eligible,
            cols,
            costs,
            lower,
            ..
        } = c;
        for (k, (&requests, &lower)) in cols.requests.iter().zip(lower.iter()).enumerate() {
            if requests != 0 && (!prune || lower <= min_upper) {
                // Bookings carry whole chains from block 0, so the rank's active blocks
                // are prefix-closed and the chain form (log n lookups) is exact.
                cols.new_blocks[k] = view.loads.new_blocks_not_active_chain(eligible[k], seq);
                costs[k] = eval.cost(&cols.load(k));
            }
        }
    }

    /// The decision for candidate `i`, and whether booking it rebinds the session.
    #[allow(clippy::too_many_arguments)]
    fn decision(
        &self,
        i: usize,
        prompt_tokens: u64,
        keys: &[u64],
        booked: bool,
        view: &View<'_>,
        tiered: &TieredScores,
        c: &Candidates,
        steering: Steering,
    ) -> (Decision, bool) {
        let (rank, load) = (c.eligible[i], c.cols.load(i));
        let device = load.device_blocks as u32;
        let cached_tokens = (device as u64 * self.block_size() as u64).min(prompt_tokens);
        let projected_prefill_tokens = view
            .hooks
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
        // 6. (booked mode) the transfer hint.
        let kv_hint = if booked {
            self.kv_hint(
                keys,
                rank,
                device,
                tiered,
                view.workers,
                view.hooks,
                view.loads,
                view.reported,
            )
        } else {
            None
        };
        let decision = Decision {
            rank,
            selection_id: None,
            overlap: Overlap {
                device_blocks: device,
                host_blocks: t.map_or(0, |o| o.host),
                disk_blocks: t.map_or(0, |o| o.disk),
                shared_blocks: load.shared_blocks_beyond_device as u32,
            },
            cached_tokens,
            projected_prefill_tokens,
            projected_decode_blocks: load.active_decode_blocks + load.new_blocks_not_active,
            cost: c.costs[i],
            session: steering.session,
            session_route: steering.route,
            kv_hint,
        };
        (decision, matches!(steering.steer, Steer::Rebind { .. }))
    }
}

/// The choice: the session's pinned rank if it is eligible; else the lowest cost (a
/// preferred rank's cost lowered by its penalty first, converted from blocks to the
/// model's unit), softmax-sampled at T > 0; at T = 0 the host's tie-break, if any, takes
/// one of the ranks tied at the lowest cost.
fn pick(
    c: &mut Candidates,
    steer: &Steer,
    cfg: &CostConfig,
    shape: &RequestShape,
    hooks: &HostHooks,
    rng: &mut impl RandomSource,
) -> usize {
    let pinned = match *steer {
        Steer::Pin(r) => c.eligible.iter().position(|&e| e == r),
        Steer::Prefer {
            rank,
            penalty_blocks,
        } => {
            if let Some(k) = c.eligible.iter().position(|&e| e == rank) {
                c.costs[k] -= blocks_in_cost_units(cfg, shape, penalty_blocks);
            }
            None
        }
        _ => None,
    };
    if let Some(k) = pinned {
        return k;
    }
    let tie_break = hooks
        .tie_break
        .as_ref()
        .filter(|_| takes_argmin(cfg.temperature));
    if let Some(f) = tie_break {
        ties_at_min(&c.costs, &mut c.tied);
        if c.tied.len() > 1 {
            if let Some(k) = f(&c.eligible, &c.tied).filter(|k| c.tied.contains(k)) {
                return k;
            }
        }
    }
    choose(&c.costs, cfg.temperature, rng).expect("at least one eligible rank")
}
