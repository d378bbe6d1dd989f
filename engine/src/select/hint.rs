//! The transfer hint of a booked selection (DESIGN.md §7 step 6).

use super::{KvHint, Selector};
use crate::hooks::HostHooks;
use crate::ids::RankId;
use crate::index::TieredScores;
use crate::load::LoadSnapshot;
use crate::workers::WorkerSet;

impl Selector<'_> {
    /// The transfer hint for a booking on `chosen` (holding `chosen_device` blocks): the
    /// eligible rank with the longest device prefix, if it beats the chosen one by the
    /// configured minimum. Eligible: a role allowed to serve transfers, a control endpoint
    /// for that rank, not overloaded (host hook) and not over a busy threshold.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kv_hint(
        &self,
        keys: &[u64],
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
            // Not a candidate of the host's, so not a source either (and a stale rank is
            // not in `tiered` at all: `crate::freshness`).
            if hooks.availability.as_ref().is_some_and(|f| !f(o.rank)) {
                continue;
            }
            let Some(endpoint) = info
                .control_endpoints
                .get(info.rank_index(o.rank.dp_rank).unwrap_or(usize::MAX))
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
        let end = device
            .min(chosen_device.saturating_add(cfg.max_transfer_blocks))
            .min(keys.len() as u32);
        if end <= chosen_device {
            return None;
        }
        let mut block_hashes = Vec::new();
        self.index.engine_names(
            source,
            keys,
            chosen_device as usize..end as usize,
            &mut block_hashes,
        );
        // Only what the source can be asked for by name.
        let end = chosen_device + block_hashes.len() as u32;
        (end > chosen_device).then(|| KvHint {
            source,
            control_endpoint: endpoint.to_string(),
            block_range: (chosen_device, end),
            block_hashes,
        })
    }
}
