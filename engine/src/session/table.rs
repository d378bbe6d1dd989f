//! [`SessionTable`]: its shards and configuration, and the read side of affinity (lookup,
//! steering, the soft cost term) plus rank removal, reaping and stats. Binding and lease
//! release are in `bind.rs`, the invariant check in `audit.rs`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use super::config::{AffinityMode, SessionConfig, SessionContext, MIN_ENTRIES_PER_SHARD};
use super::entries::{SessionShard, ShardCounters, SidState};
use super::leases::{lease_hash, LeaseShard};
#[cfg(test)]
use super::outcome::SessionView;
use super::outcome::{Binding, SessionStats, Steer};
#[cfg(loom)]
use super::SessionFaults;
use crate::ids::RankId;
use crate::ids::SelectionId;
use crate::sync::Mutex;

/// The session-affinity table of one partition. All methods take `&self` and are safe to
/// call from any number of threads; none blocks on anything but a shard's short critical
/// section, none spawns a thread, none panics on any input.
pub(crate) struct SessionTable {
    pub(super) mode: AffinityMode,
    pub(super) idle_ttl: Duration,
    pub(super) per_shard: usize,
    pub(super) max_id_bytes: usize,
    pub(super) early_memory: usize,
    /// Seed of the session → shard hash (random per table in production).
    pub(super) seed: u64,
    pub(super) smask: usize,
    pub(super) lmask: usize,
    pub(super) sessions: Box<[CachePadded<Mutex<SessionShard>>]>,
    pub(super) leases: Box<[CachePadded<Mutex<LeaseShard>>]>,
    #[cfg(loom)]
    pub(super) faults: SessionFaults,
}

impl std::fmt::Debug for SessionTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionTable")
            .field("mode", &self.mode)
            .field("idle_ttl", &self.idle_ttl)
            .field("session_shards", &self.sessions.len())
            .field("per_shard", &self.per_shard)
            .finish_non_exhaustive()
    }
}

impl Default for SessionTable {
    fn default() -> Self {
        Self::new(SessionConfig::default())
    }
}

impl SessionTable {
    pub(crate) fn new(cfg: SessionConfig) -> Self {
        let mode = match cfg.mode {
            AffinityMode::Soft { penalty_blocks } => AffinityMode::Soft {
                penalty_blocks: if penalty_blocks.is_finite() && penalty_blocks > 0.0 {
                    penalty_blocks
                } else {
                    0.0
                },
            },
            AffinityMode::Hard => AffinityMode::Hard,
        };
        let max_entries = cfg.max_entries.max(1);
        let lease_shards = cfg.shards.clamp(1, 1 << 16).next_power_of_two();
        let mut session_shards = lease_shards;
        while session_shards > 1 && max_entries / session_shards < MIN_ENTRIES_PER_SHARD {
            session_shards /= 2;
        }
        #[cfg(not(loom))]
        let seed = {
            use std::hash::BuildHasher;
            SidState::new().hash_one(0x5e55_10f5_u64)
        };
        #[cfg(loom)]
        let seed = 0x5e55_10f5_u64;
        Self {
            mode,
            idle_ttl: cfg.idle_ttl,
            per_shard: max_entries / session_shards,
            max_id_bytes: cfg.max_session_id_bytes,
            early_memory: cfg.early_release_memory,
            seed,
            smask: session_shards - 1,
            lmask: lease_shards - 1,
            sessions: (0..session_shards)
                .map(|_| {
                    CachePadded::new(Mutex::new(SessionShard {
                        entries: HashMap::with_hasher(SidState::default()),
                        next_expiry: None,
                        counters: ShardCounters::default(),
                    }))
                })
                .collect(),
            leases: (0..lease_shards)
                .map(|_| CachePadded::new(Mutex::new(LeaseShard::default())))
                .collect(),
            #[cfg(loom)]
            faults: SessionFaults::default(),
        }
    }

    /// A table whose protocol is weakened by `faults` (loom negative controls only).
    #[cfg(all(test, loom))]
    pub(crate) fn with_faults(cfg: SessionConfig, faults: SessionFaults) -> Self {
        let mut t = Self::new(cfg);
        t.faults = faults;
        t
    }

    /// How long an idle session is kept (loom models reap past it).
    #[cfg(loom)]
    pub(crate) fn idle_ttl(&self) -> Duration {
        self.idle_ttl
    }

    /// The most entries the table can hold: `max_entries` (at least 1) rounded down to a
    /// multiple of the session shard count.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.per_shard * self.sessions.len()
    }

    pub(super) fn valid_id(&self, id: &str) -> bool {
        !id.is_empty() && id.len() <= self.max_id_bytes
    }

    pub(super) fn session_shard(&self, id: &str) -> &Mutex<SessionShard> {
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(id.as_bytes(), self.seed);
        &self.sessions[h as usize & self.smask]
    }

    pub(super) fn lease_shard(&self, lease: SelectionId) -> &Mutex<LeaseShard> {
        &self.leases[lease_hash(lease) as usize & self.lmask]
    }

    /// The binding of the entry `id`, if it has a live entry: `Some(None)` = an entry
    /// without binding (dropped by `forget_rank`); `None` = no entry, or an expired one.
    fn own_binding(&self, id: &str, now: Instant) -> Option<Option<Binding>> {
        let g = self.session_shard(id).lock();
        let e = g.entries.get(id)?;
        if e.expired(self.idle_ttl, now) {
            return None;
        }
        Some(e.rank.map(|rank| Binding {
            rank,
            revision: e.revision,
            inherited: false,
        }))
    }

    #[cfg(test)]
    /// The binding a turn of `ctx` should follow: the session's own; if the session has
    /// no (live) entry yet, its parent's (`parent_session_id`), marked `inherited` — a
    /// child session starts from its parent's binding, and its own entry, created by its
    /// first `bind`, then evolves on its own. One level only: a grandparent is not
    /// consulted. An entry whose binding `forget_rank` dropped answers `None` (no parent
    /// fallback: the session rebinds). Read-only: it neither refreshes nor reaps.
    pub(crate) fn lookup(&self, ctx: &SessionContext, now: Instant) -> Option<Binding> {
        self.lookup_or_dropped(ctx, now).0
    }

    /// As [`SessionTable::lookup`], and whether the session's own binding was dropped by
    /// `forget_rank` (its rank left): such a turn is chosen by cost like an unbound one,
    /// but it is a forced rebind, and the decision reports it so.
    pub(crate) fn lookup_or_dropped(
        &self,
        ctx: &SessionContext,
        now: Instant,
    ) -> (Option<Binding>, bool) {
        if self.valid_id(&ctx.session_id) {
            if let Some(own) = self.own_binding(&ctx.session_id, now) {
                let dropped = own.is_none();
                return (own, dropped);
            }
        }
        let Some(parent) = ctx.parent_session_id.as_deref() else {
            return (None, false);
        };
        if !self.valid_id(parent) || parent == ctx.session_id {
            return (None, false);
        }
        let inherited = self.own_binding(parent, now).flatten().map(|b| Binding {
            inherited: true,
            ..b
        });
        (inherited, false)
    }

    /// What `binding` means for a selection whose eligible candidates are those for
    /// which `eligible` is true (see [`Steer`]).
    ///
    /// [`Steer`]: super::Steer
    pub(crate) fn steer(
        &self,
        binding: Option<Binding>,
        eligible: impl Fn(RankId) -> bool,
    ) -> Steer {
        let Some(b) = binding else {
            return Steer::Free;
        };
        if !eligible(b.rank) {
            return Steer::Rebind { from: b.rank };
        }
        match self.mode {
            AffinityMode::Hard => Steer::Pin(b.rank),
            AffinityMode::Soft { penalty_blocks } => Steer::Prefer {
                rank: b.rank,
                penalty_blocks,
            },
        }
    }

    #[cfg(test)]
    /// The term to **add** to `candidate`'s cost (in blocks; lower cost wins): in soft
    /// mode `-penalty_blocks` for the bound rank, which lowers its cost, and 0 for every
    /// other candidate; always 0 in hard mode (the pin is [`Steer::Pin`]) or without a
    /// binding.
    ///
    /// [`Steer::Pin`]: super::Steer::Pin
    pub(crate) fn soft_cost_adjustment(&self, binding: Option<RankId>, candidate: RankId) -> f64 {
        match (self.mode, binding) {
            (AffinityMode::Soft { penalty_blocks }, Some(bound)) if bound == candidate => {
                -penalty_blocks
            }
            _ => 0.0,
        }
    }

    /// A rank left: every binding to it is dropped (counted) so the session's next turn
    /// rebinds (counted as forced). Entries stay, with their leases (the rank's bookings
    /// end through the reservation table, which releases them); lease-free ones age out.
    /// Returns how many bindings were dropped.
    pub(crate) fn forget_rank(&self, rank: RankId) -> usize {
        let mut total = 0;
        for s in self.sessions.iter() {
            let mut g = s.lock();
            let mut n = 0u64;
            for e in g.entries.values_mut() {
                if e.rank == Some(rank) {
                    e.rank = None;
                    n += 1;
                }
            }
            g.counters.dropped += n;
            total += n as usize;
        }
        total
    }

    #[cfg(test)]
    /// Removes every idle-expired entry (no leases, idle TTL past); returns how many.
    pub(crate) fn reap(&self, now: Instant) -> usize {
        self.sessions
            .iter()
            .map(|s| s.lock().reap(self.idle_ttl, now))
            .sum()
    }

    #[cfg(test)]
    /// Entries now, including expired ones not yet reaped (shards summed one by one).
    pub(crate) fn len(&self) -> usize {
        self.sessions.iter().map(|s| s.lock().entries.len()).sum()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[cfg(test)]
    /// The entry of `session_id`, as it is now (expired or not).
    pub(crate) fn entry(&self, session_id: &str) -> Option<SessionView> {
        let g = self.session_shard(session_id).lock();
        let e = g.entries.get(session_id)?;
        Some(SessionView {
            rank: e.rank,
            revision: e.revision,
            leases: e.leases.to_vec(),
            final_requested: e.final_requested,
            last_active: e.last_active,
            idle_deadline: e.deadline(self.idle_ttl),
        })
    }

    pub(crate) fn stats(&self) -> SessionStats {
        let mut st = SessionStats::default();
        for s in self.sessions.iter() {
            let g = s.lock();
            let c = &g.counters;
            st.entries += g.entries.len();
            st.bindings_created += c.created;
            st.rebinds += c.rebinds;
            st.forced_rebinds += c.forced_rebinds;
            st.bindings_dropped += c.dropped;
            st.finals_released += c.finals_released;
            st.evicted += c.evicted;
            st.refused += c.refused;
            st.reaped += c.reaped;
            st.leases_released += c.leases_released;
            st.unknown_lease_releases += c.lost_release_races;
            st.early_releases += c.early_releases;
            st.duplicate_leases += c.duplicate_leases;
            st.invalid_session_ids += c.invalid_ids;
        }
        for s in self.leases.iter() {
            let g = s.lock();
            st.leases += g.owner.len();
            st.unknown_lease_releases += g.unknown_releases;
        }
        st
    }
}
