//! Candidate ranks (DESIGN.md §7 step 3): the allow-set, the pin, LoRA narrowing, host
//! availability, and the busy thresholds.

use smallvec::SmallVec;

use super::{SelectRequest, Selector};
use crate::hooks::HostHooks;
use crate::ids::{RankId, WorkerId};
use crate::load::LoadSnapshot;
use crate::workers::{WorkerInfo, WorkerSet};

impl Selector<'_> {
    /// Candidate ranks after the allow-set, the pin, LoRA narrowing and host availability.
    pub(super) fn candidates(
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
    pub(super) fn is_busy(
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
}
