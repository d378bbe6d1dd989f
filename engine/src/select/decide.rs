//! The decision path both modes share (DESIGN.md §7 steps 1–5).

use std::time::Instant;

use smallvec::SmallVec;

use super::overlap::Local;
use super::scratch::{PutBack, Scratch};
use super::{Decision, Outcome, Overlap, Prompt, SelectRequest, Selector, SessionRoute};
use crate::cost::{
    choose, cost, fill_costs, min_active_prefill_tokens, CandidateLoad, RandomSource, RequestShape,
};
use crate::hooks::{BlockRange, PrefillQuery};
use crate::ids::RankId;
use crate::session::Steer;
use crate::sync::atomic::Ordering;

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
        // 1. hashes.
        let (seq, prompt_tokens) = self.sequence_of(req);
        // 2. overlap: the index the policy names, and the host's shared cache alongside it.
        let mut scratch = Scratch::take();
        let local = match req.prompt {
            Prompt::LocalHashes { hashes, .. } => Local::Given(hashes),
            Prompt::Tokens(tokens) => Local::Tokens(tokens, req.lora_name),
        };
        self.overlap_into(local, &seq, &mut scratch);
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
