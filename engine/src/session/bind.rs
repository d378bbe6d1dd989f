//! The write side of affinity: [`SessionTable::bind`] records a booked turn's decision
//! with its lease, and [`SessionTable::release_lease`] drops a lease when its booking
//! ends, removing a final session's entry with its last lease (the lock order and the
//! release-vs-next-turn argument of the module docs).
//!
//! [`SessionTable::bind`]: super::SessionTable::bind
//! [`SessionTable::release_lease`]: super::SessionTable::release_lease

use std::time::Instant;

use smallvec::SmallVec;

use super::config::SessionContext;
use super::entries::{Entry, SessionKey};
use super::leases::LeaseStep;
use super::outcome::{BindOutcome, Binding, LeaseRelease};
use super::table::SessionTable;
use crate::ids::RankId;
use crate::ids::SelectionId;
use crate::sync::Arc;

impl SessionTable {
    /// Records that this turn of `ctx` was booked on `rank` as `lease` (its selection id):
    /// creates or refreshes the entry, adds the lease, records a rebind if `rank` differs
    /// from the binding (revision + 1; `forced` = the bound rank was gone or unavailable,
    /// see [`Steer::Rebind`]), and takes `ctx.session_final` as the session's final
    /// request (the latest turn's word). Needs room for a new entry (module docs,
    /// "Bounds"): reaps, evicts, or refuses; never blocks on anything but the shard's
    /// critical section, never panics.
    ///
    /// `forced` only matters when the session already has an entry: a session's first
    /// bind is a creation, counted in `bindings_created`, even when a child could not
    /// follow its parent's binding.
    ///
    /// If `lease` was already released (the booking ended before this bind), the binding
    /// is recorded without it (counted in [`SessionStats::early_releases`]); a final turn
    /// then releases the entry at once, so the outcome can say `Created`/`Kept`/`Rebound`
    /// of an entry that is already gone.
    ///
    /// [`Steer::Rebind`]: super::Steer::Rebind
    /// [`SessionStats::early_releases`]: super::SessionStats::early_releases
    pub(crate) fn bind(
        &self,
        ctx: &SessionContext,
        rank: RankId,
        lease: SelectionId,
        forced: bool,
        now: Instant,
    ) -> BindOutcome {
        let id = ctx.session_id.as_str();
        if !self.valid_id(id) {
            // Counted in shard 0: an oversized id is not even hashed.
            self.sessions[0].lock().counters.invalid_ids += 1;
            return BindOutcome::InvalidSessionId;
        }
        let mut g = self.session_shard(id).lock();
        let shard = &mut *g;
        if shard.next_expiry.is_some_and(|t| t <= now) {
            shard.reap(self.idle_ttl, now);
        }
        let key = match shard.entries.get_key_value(id) {
            Some((k, _)) => k.clone(),
            None => {
                if shard.entries.len() >= self.per_shard && !shard.make_room(self.idle_ttl, now) {
                    shard.counters.refused += 1;
                    return BindOutcome::Refused;
                }
                SessionKey(Arc::new(id.to_owned()))
            }
        };

        // Lock order: session shard (held), then lease shard.
        let step = {
            let mut l = self.lease_shard(lease).lock();
            match l.owner.get(&lease) {
                Some(owner) if owner == &key => LeaseStep::AlreadyHeld,
                Some(_) => {
                    shard.counters.duplicate_leases += 1;
                    return BindOutcome::LeaseInUse;
                }
                None => {
                    #[cfg(loom)]
                    let ended = !self.faults.ignore_early_release && l.take_ended(lease, now);
                    #[cfg(not(loom))]
                    let ended = l.take_ended(lease, now);
                    if ended {
                        LeaseStep::EndedEarly
                    } else {
                        l.owner.insert(lease, key.clone());
                        LeaseStep::Added
                    }
                }
            }
        };

        let ttl = self.idle_ttl;
        let c = &mut shard.counters;
        let (outcome, idle_final, idle_deadline) = match shard.entries.get_mut(id) {
            Some(e) => {
                let outcome = if e.rank == Some(rank) {
                    BindOutcome::Kept(Binding {
                        rank,
                        revision: e.revision,
                        inherited: false,
                    })
                } else {
                    let from = e.rank;
                    let forced = forced || from.is_none();
                    e.rank = Some(rank);
                    e.revision = e.revision.wrapping_add(1);
                    c.rebinds += 1;
                    c.forced_rebinds += u64::from(forced);
                    BindOutcome::Rebound {
                        from,
                        to: Binding {
                            rank,
                            revision: e.revision,
                            inherited: false,
                        },
                        forced,
                    }
                };
                if matches!(step, LeaseStep::Added) {
                    e.leases.push(lease);
                }
                e.touch(now);
                e.final_requested = ctx.session_final;
                let lease_free = e.leases.is_empty();
                let deadline = if lease_free { e.deadline(ttl) } else { None };
                (outcome, lease_free && ctx.session_final, deadline)
            }
            None => {
                let mut e = Entry {
                    rank: Some(rank),
                    revision: 0,
                    leases: SmallVec::new(),
                    last_active: now,
                    final_requested: ctx.session_final,
                };
                if matches!(step, LeaseStep::Added) {
                    e.leases.push(lease);
                }
                let lease_free = e.leases.is_empty();
                let deadline = if lease_free { e.deadline(ttl) } else { None };
                c.created += 1;
                shard.entries.insert(key, e);
                (
                    BindOutcome::Created(Binding {
                        rank,
                        revision: 0,
                        inherited: false,
                    }),
                    lease_free && ctx.session_final,
                    deadline,
                )
            }
        };
        if matches!(step, LeaseStep::EndedEarly) {
            shard.counters.early_releases += 1;
        }
        if idle_final {
            // A final turn whose lease already ended: release at once (invariant 2).
            shard.entries.remove(id);
            shard.counters.finals_released += 1;
        } else {
            shard.note_idle(idle_deadline);
        }
        outcome
    }

    /// The booking `lease` ended (freed, expired, or its rank removed): the lease is
    /// dropped, the session's idle clock restarts, and if it was the session's last lease
    /// and the session's latest turn was final, the entry is removed (binding released).
    /// Suits [`crate::reservation::ForgetListener`]. Unknown leases are counted and
    /// otherwise ignored (and remembered briefly, in case their bind is still to come).
    pub(crate) fn release_lease(&self, lease: SelectionId, now: Instant) -> LeaseRelease {
        // Step 1, the lease shard alone: who owns the lease?
        let key = {
            let mut l = self.lease_shard(lease).lock();
            match l.owner.get(&lease) {
                Some(k) => k.clone(),
                None => {
                    l.unknown_releases += 1;
                    l.remember_ended(lease, now, self.early_memory);
                    return LeaseRelease::Unknown;
                }
            }
        };
        // Step 2, one critical section of the owner's shard (lease shard nested): drop the
        // lease from the entry and the index, and release a final session on its last
        // lease, before anyone else can see the entry without leases.
        let mut g = self.session_shard(key.as_str()).lock();
        let shard = &mut *g;
        let Some(e) = shard.entries.get_mut(key.as_str()) else {
            // Cannot happen while invariant 3 holds; harmless anyway.
            shard.counters.lost_release_races += 1;
            return LeaseRelease::Unknown;
        };
        let Some(pos) = e.leases.iter().position(|&l| l == lease) else {
            // Another release of the same lease got here first.
            shard.counters.lost_release_races += 1;
            return LeaseRelease::Unknown;
        };
        e.leases.swap_remove(pos);
        self.lease_shard(lease).lock().owner.remove(&lease);
        e.touch(now);
        shard.counters.leases_released += 1;
        if !e.leases.is_empty() {
            return LeaseRelease::Released;
        }
        if !e.final_requested {
            let d = e.deadline(self.idle_ttl);
            shard.note_idle(d);
            return LeaseRelease::Released;
        }
        #[cfg(loom)]
        if self.faults.split_last_lease_release {
            // Negative control: "last lease of a final session" decided above, the entry
            // removed in a second critical section — a bind in between is lost.
            drop(g);
            let mut g = self.session_shard(key.as_str()).lock();
            g.entries.remove(key.as_str());
            g.counters.finals_released += 1;
            return LeaseRelease::SessionEnded;
        }
        shard.entries.remove(key.as_str());
        shard.counters.finals_released += 1;
        LeaseRelease::SessionEnded
    }
}
