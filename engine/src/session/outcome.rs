//! What the table answers: a session's [`Binding`], what a bind did ([`BindOutcome`]),
//! what a lease release did ([`LeaseRelease`]), what the selection must do
//! ([`Steer`]), and the table's [`SessionStats`] and per-entry [`SessionView`].

#[cfg(test)]
use std::time::Instant;

use crate::ids::RankId;
#[cfg(test)]
use crate::ids::SelectionId;

/// A session's binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Binding {
    pub rank: RankId,
    /// The entry's revision (module docs).
    pub revision: u64,
    /// The binding is the parent session's: the session itself has no entry yet
    /// ([`SessionTable::lookup`]). Always `false` in a [`BindOutcome`].
    ///
    /// [`SessionTable::lookup`]: super::SessionTable::lookup
    pub inherited: bool,
}

/// What [`SessionTable::bind`] did.
///
/// [`SessionTable::bind`]: super::SessionTable::bind
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BindOutcome {
    /// The session had no entry: it now starts bound to this rank (revision 0).
    Created(Binding),
    /// The turn went to the bound rank: lease added, activity refreshed.
    Kept(Binding),
    /// The binding moved (revision bumped). `from` is `None` when the previous binding
    /// was dropped by [`SessionTable::forget_rank`]; `forced` says the bound rank was
    /// gone or unavailable (the caller's flag, or always when `from` is `None`).
    ///
    /// [`SessionTable::forget_rank`]: super::SessionTable::forget_rank
    Rebound {
        from: Option<RankId>,
        to: Binding,
        forced: bool,
    },
    /// No entry could be made: the session's shard is full and every entry in it holds
    /// leases. Nothing was recorded (a later release of this lease is counted unknown).
    Refused,
    /// The lease is already held by another session: this session's entry is not
    /// touched (a caller bug: selection ids are unique; the bind may still have reaped or
    /// evicted other entries while making room). Binding a lease again to its own
    /// session is not this: it refreshes the entry and keeps the lease once.
    LeaseInUse,
    /// The session id is empty or longer than `max_session_id_bytes`: nothing recorded.
    InvalidSessionId,
}

impl BindOutcome {
    #[cfg(test)]
    /// The binding after the bind, if one was recorded.
    pub(crate) fn binding(&self) -> Option<Binding> {
        match *self {
            BindOutcome::Created(b) | BindOutcome::Kept(b) => Some(b),
            BindOutcome::Rebound { to, .. } => Some(to),
            _ => None,
        }
    }
}

/// What [`SessionTable::release_lease`] did.
///
/// [`SessionTable::release_lease`]: super::SessionTable::release_lease
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LeaseRelease {
    /// The lease is gone; the binding stays.
    Released,
    /// It was the last lease of a session whose last turn was final: the entry is gone.
    SessionEnded,
    /// No session holds this lease (never bound, bound to a refused session, released
    /// already, or released concurrently by another call). Counted; nothing changes.
    Unknown,
}

/// What the binding means for one selection ([`SessionTable::steer`]).
///
/// [`SessionTable::steer`]: super::SessionTable::steer
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Steer {
    /// No binding: choose by cost, then bind with `forced = false`.
    Free,
    /// Hard mode, bound rank eligible: the selection must go to this rank.
    Pin(RankId),
    /// Soft mode, bound rank eligible: choose by cost with
    /// [`SessionTable::soft_cost_adjustment`] added (the bound rank's cost lowered by
    /// `penalty_blocks`); bind with `forced = false`.
    ///
    /// [`SessionTable::soft_cost_adjustment`]: super::SessionTable::soft_cost_adjustment
    Prefer { rank: RankId, penalty_blocks: f64 },
    /// The bound rank is not eligible (left, unavailable, overloaded, not allowed):
    /// choose by cost and bind with `forced = true`.
    Rebind { from: RankId },
}

/// Counters of the table (summed over shards: each figure is exact, the set is not one
/// snapshot while other threads use the table).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Entries now (including expired ones not yet reaped).
    pub entries: usize,
    /// Live leases now.
    pub leases: usize,
    /// Entries created by `bind`.
    pub bindings_created: u64,
    /// Binds that moved a binding to another rank.
    pub rebinds: u64,
    /// Of those, the ones because the bound rank was gone or unavailable.
    pub forced_rebinds: u64,
    /// Bindings dropped by `forget_rank`.
    pub bindings_dropped: u64,
    /// Entries released because a final turn's last lease ended.
    pub finals_released: u64,
    /// Lease-free entries evicted (least recently active) to make room.
    pub evicted: u64,
    /// New sessions refused because their shard was full of lease-holding entries.
    pub refused: u64,
    /// Idle-expired entries removed (lazily by `bind`, or by `reap`).
    pub reaped: u64,
    /// Leases released.
    pub leases_released: u64,
    /// Releases of leases no session held.
    pub unknown_lease_releases: u64,
    /// Binds whose lease had already been released (recorded without the lease).
    pub early_releases: u64,
    /// Binds refused because the lease belonged to another session.
    pub duplicate_leases: u64,
    /// Binds with an empty or too long session id.
    pub invalid_session_ids: u64,
}

/// An entry as [`SessionTable::entry`] reports it.
///
/// [`SessionTable::entry`]: super::SessionTable::entry
#[cfg(test)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SessionView {
    /// `None` after `forget_rank` dropped the binding.
    pub rank: Option<RankId>,
    pub revision: u64,
    /// Live leases, in no particular order.
    pub leases: Vec<SelectionId>,
    pub final_requested: bool,
    pub last_active: Instant,
    /// When the entry expires if it holds no lease then (`None`: beyond `Instant`'s
    /// range, never).
    pub idle_deadline: Option<Instant>,
}
