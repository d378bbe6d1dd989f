//! Candidate ranks (DESIGN.md §7 step 3): the allow-set, the pin, LoRA narrowing, host
//! availability, and the busy thresholds.

use super::scratch::Candidates;
use super::{SelectRequest, Selector};
use crate::hooks::HostHooks;
use crate::ids::RankId;
use crate::load::LoadSnapshot;
use crate::workers::{RankSlot, WorkerInfo, WorkerSet};

impl Selector<'_> {
    /// Candidate ranks after the allow-set, the pin, LoRA narrowing and host
    /// availability. `true`: every rank of `workers`, as [`WorkerSet::slots`] (the common
    /// case, nothing copied); `false`: the candidates are `c.slots`.
    pub(super) fn candidates(
        &self,
        req: &SelectRequest<'_>,
        workers: &WorkerSet,
        hooks: &HostHooks,
        c: &mut Candidates,
    ) -> bool {
        c.slots.clear();
        let lora = req.lora_name.filter(|l| !l.is_empty());
        if req.allowed_workers.is_none() && req.pinned_worker.is_none() && lora.is_none() {
            match &hooks.availability {
                None => return true,
                Some(_) => c.slots.extend_from_slice(workers.slots()),
            }
        } else {
            narrowed_candidates(req, workers, hooks, c);
        }
        if let Some(avail) = &hooks.availability {
            c.slots.retain(|s| avail(s.rank));
        }
        false
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

impl Candidates {
    /// Every rank of `info`'s worker, with its KV capacity.
    fn push_worker(&mut self, info: &WorkerInfo) {
        for rank in info.ranks() {
            self.slots.push(RankSlot {
                rank,
                kv_blocks: info.total_kv_blocks,
            });
        }
    }
}

/// The allow-set, the pin (a worker, or one rank of it) and LoRA narrowing, in that order,
/// into `c.slots`.
fn narrowed_candidates(
    req: &SelectRequest<'_>,
    workers: &WorkerSet,
    hooks: &HostHooks,
    c: &mut Candidates,
) {
    let allowed = |w: &WorkerInfo| req.allowed_workers.is_none_or(|a| a.contains(&w.worker_id));
    let mut pool = std::mem::take(&mut c.pool);
    pool.clear();
    pool.extend(workers.iter().filter(|w| allowed(w)).map(|w| w.worker_id));
    // An allowed pin is the whole pool; a pin outside the allow-set does not survive.
    let pinned = req.pinned_worker.filter(|p| pool.contains(p));
    if let Some(p) = pinned {
        pool.retain(|w| *w == p);
    } else if let Some(lora) = req.lora_name.filter(|l| !l.is_empty()) {
        let narrowed = &mut c.narrowed;
        narrowed.clear();
        match &hooks.lora_filter {
            Some(f) => {
                let offered = f(lora, &pool);
                // Never widen: keep only workers the caller allowed.
                narrowed.extend(pool.iter().copied().filter(|w| offered.contains(w)));
            }
            None => narrowed.extend(pool.iter().copied().filter(|w| {
                workers
                    .get(*w)
                    .is_some_and(|i| i.lora_adapters.iter().any(|a| a == lora))
            })),
        }
        // When no worker survives the LoRA narrowing, the caller's own set stands.
        if !narrowed.is_empty() {
            std::mem::swap(&mut pool, narrowed);
        }
    }
    for &w in pool.iter() {
        if let Some(info) = workers.get(w) {
            match (pinned, req.pinned_dp_rank) {
                (Some(_), Some(dp)) if info.has_rank(dp) => c.slots.push(RankSlot {
                    rank: RankId::new(w, dp),
                    kv_blocks: info.total_kv_blocks,
                }),
                _ => c.push_worker(info),
            }
        }
    }
    c.pool = pool;
}
