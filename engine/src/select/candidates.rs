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

/// The allow-set, the pin (a worker, or one rank of it) and LoRA narrowing, in that order,
/// into `c.slots`. Workers are kept as positions in the set's id order, so each step is a
/// walk or a binary search, not a search of the allow-set per worker (at a thousand
/// workers that was most of a narrowed selection).
fn narrowed_candidates(
    req: &SelectRequest<'_>,
    workers: &WorkerSet,
    hooks: &HostHooks,
    c: &mut Candidates,
) {
    let order = workers.in_order();
    let mut pool = std::mem::take(&mut c.pool);
    pool.clear();
    match req.allowed_workers {
        None => pool.extend(0..order.len() as u32),
        Some(allowed) => {
            // A sorted copy without repeats, looked up one by one: the pool stays in id
            // order, as the candidate walk needs.
            let sorted = &mut c.allowed;
            sorted.clear();
            sorted.extend_from_slice(allowed);
            sorted.sort_unstable();
            sorted.dedup();
            pool.extend(
                sorted
                    .iter()
                    .filter_map(|&id| workers.position_of(id).map(|i| i as u32)),
            );
        }
    }
    let id_at = |i: &u32| order[*i as usize].worker_id;
    // An allowed pin is the whole pool; a pin outside the allow-set does not survive.
    let pinned = req
        .pinned_worker
        .filter(|&p| pool.binary_search_by_key(&p, id_at).is_ok());
    if let Some(p) = pinned {
        pool.retain(|i| id_at(i) == p);
    } else if let Some(lora) = req.lora_name.filter(|l| !l.is_empty()) {
        let narrowed = &mut c.narrowed;
        narrowed.clear();
        match &hooks.lora_filter {
            Some(f) => {
                let ids = &mut c.pool_ids;
                ids.clear();
                ids.extend(pool.iter().map(id_at));
                let mut offered = f(lora, ids);
                offered.sort_unstable();
                // Never widen: keep only workers the caller allowed.
                narrowed.extend(
                    pool.iter()
                        .copied()
                        .filter(|i| offered.binary_search(&id_at(i)).is_ok()),
                );
            }
            None => narrowed.extend(
                pool.iter()
                    .copied()
                    .filter(|&i| order[i as usize].lora_adapters.iter().any(|a| a == lora)),
            ),
        }
        // When no worker survives the LoRA narrowing, the caller's own set stands.
        if !narrowed.is_empty() {
            std::mem::swap(&mut pool, narrowed);
        }
    }
    for &i in pool.iter() {
        let info = &order[i as usize];
        match (pinned, req.pinned_dp_rank) {
            (Some(_), Some(dp)) if info.has_rank(dp) => c.slots.push(RankSlot {
                rank: RankId::new(info.worker_id, dp),
                kv_blocks: info.total_kv_blocks,
            }),
            _ => c.slots.extend_from_slice(workers.slots_of(i as usize)),
        }
    }
    c.pool = pool;
}
