//! Session affinity (DESIGN.md §9): which rank a session's turns should go to.
//!
//! A multi-turn session (a chat, an agent loop) resends its whole conversation every
//! turn, so the rank that served the previous turn holds the longest cached prefix of
//! the next one. The [`SessionTable`] remembers, per session id, the rank the session is
//! *bound* to, and the selection path consults it:
//!
//! 1. [`SessionTable::lookup`]: the binding this turn should follow — the session's own,
//!    or, for a session seen for the first time, its parent's (a sub-agent starts where
//!    its parent's cache is);
//! 2. [`SessionTable::steer`] turns that binding into what the selection must do under
//!    the configured [`AffinityMode`]: `Hard` pins the turn to the bound rank while that
//!    rank is eligible; `Soft` only lowers the bound rank's cost by
//!    [`SessionTable::soft_cost_adjustment`]; a bound rank that left or is unavailable
//!    makes the turn rebind (*forced*);
//! 3. once the turn is booked, [`SessionTable::bind`] records the decision with the
//!    booking's selection id as a *lease*;
//! 4. when the booking ends (freed, expired or its rank removed),
//!    [`SessionTable::release_lease`] drops the lease.
//!
//! This module is standalone: it knows sessions, ranks and selection ids, and nothing of
//! the index, the load view or the reservation table. Time is always a parameter.
//!
//! # An entry
//!
//! Keyed by session id: the bound rank (`None` after [`SessionTable::forget_rank`]), a
//! `revision` bumped on every rebind, the *leases* (selection ids of the session's live
//! bookings; a lease is owned by its reservation and ends with it), the time of the last
//! activity, and `final_requested`.
//!
//! - **Revision.** Starts at 0 when the entry is created and grows by one each time the
//!   binding changes rank (including a rebind after `forget_rank`); a turn that stays on
//!   the bound rank leaves it unchanged. An entry that is removed (final release, idle
//!   expiry, eviction) and later re-created starts at 0 again, so `(rank, revision)`
//!   identifies a binding within one entry's life.
//! - **Final turns.** A turn with `session_final` asks for the binding to be released
//!   once the session has no live booking left: the release of the *last* lease removes
//!   the entry. `final_requested` is the word of the most recent turn: a later non-final
//!   turn means the session went on after all (a retried final turn, a reused id), so it
//!   clears the request and the binding then ends by a later final turn or idle expiry.
//! - **Idle expiry.** An entry without leases expires `idle_ttl` after its last activity
//!   (the last bind, or the end of its last lease: the clock starts when a turn *ends*,
//!   so a long generation does not eat into the idle time). An entry holding leases never
//!   expires: its bookings are live, and a booking's own expiry (reservation TTL) ends
//!   the lease. Expired entries are removed lazily: by `bind` in the shard it touches
//!   (when the shard's earliest possible deadline has passed), by `bind` when the shard
//!   is full, and by [`SessionTable::reap`]. No background thread. Until then
//!   [`SessionTable::lookup`] already treats an expired entry as absent.
//!
//! The default idle TTL is 600 s. Affinity only pays while the bound rank still holds
//! the session's prefix; under load a GPU prefix cache turns over within minutes, so a
//! binding idle for much longer mostly pins a session to a rank with nothing of it left
//! (and, in hard mode, away from a less loaded rank). Ten minutes covers human think time
//! between chat turns and the tool calls of agent loops, and keeps at most ~10 minutes of
//! finished sessions in the table; deployments with host/disk KV tiers that keep
//! prefixes longer can raise it.
//!
//! # Modes
//!
//! - [`AffinityMode::Hard`]: the turn must go to the bound rank, unless that rank left or
//!   is not eligible for this request (not in the candidate set: unavailable,
//!   overloaded, not allowed) — then the caller selects freely and binds with
//!   `forced = true`. A caller that moves a session although its bound rank was eligible
//!   (e.g. an explicit worker pin) binds with `forced = false`: counted as a plain
//!   rebind.
//! - [`AffinityMode::Soft`]: a preference: the bound rank's cost (in blocks, lower wins,
//!   REFERENCE.md §3) is *lowered* by `penalty_blocks`, i.e. the other candidates pay a
//!   relative penalty of that many blocks. [`SessionTable::soft_cost_adjustment`] returns
//!   the term to *add* to a candidate's cost: `-penalty_blocks` for the bound rank, 0 for
//!   the others.
//!
//! # Bounds
//!
//! The table holds at most `max_entries` sessions (default 65,536, Dynamo's bound). It is
//! sharded, and the bound is enforced per shard: each of the `S` session shards holds at
//! most `max_entries / S` entries (`S` is halved until that is at least
//! [`MIN_ENTRIES_PER_SHARD`], or down to 1 shard), so the total never exceeds
//! `max_entries`, but a new session can be refused while other shards still have room. A bind that needs a new entry in a full shard first removes that
//! shard's idle-expired entries, else evicts the least recently active entry *without
//! leases*; if every entry of the shard holds leases (live bookings) the new session is
//! refused ([`BindOutcome::Refused`], counted): its turn is served, it just gets no
//! binding. Session ids longer than `max_session_id_bytes` (default 256) or empty are
//! rejected, so the table's memory stays bounded. Leases per entry are not bounded here:
//! they are bounded by the bookings.
//!
//! # Concurrency
//!
//! - **Session shards** (64 by default): `session id → entry`, each behind a
//!   `sync::Mutex`; the shard is chosen by a seeded hash of the id. Everything
//!   about one entry changes under its shard's lock.
//! - **Lease shards** (as many): `selection id → session id` (the owner of each live
//!   lease, so [`SessionTable::release_lease`], which only knows the selection id, finds
//!   the session), plus a short memory of leases released before they were bound (below).
//!
//! **Lock order: session shard, then lease shard.** A lease shard is locked either alone
//! or nested inside one session shard; no path locks a session shard while holding a
//! lease shard, and no path holds two session shards or two lease shards at once
//! (`lookup`'s parent fallback, `reap`, `forget_rank`, `len` and `stats` take shards one
//! after the other). So there is no deadlock.
//!
//! **Invariants** (checked by [`SessionTable::audit`]), true whenever no lock is held:
//!
//! 1. *The lease index and the entries agree*: the index maps `L → s` exactly when entry
//!    `s` holds lease `L`. Both sides change together, in one critical section of `s`'s
//!    shard (with the lease shard nested).
//! 2. *A final request never outlives its last lease*: an entry with `final_requested`
//!    holds at least one lease. The critical section that drops an entry's last lease
//!    (or binds a final turn whose lease already ended) removes the entry if
//!    `final_requested` is set, before unlocking.
//! 3. Only entries without leases are removed by expiry or eviction, and `forget_rank`
//!    unbinds but never removes, so an indexed lease always finds its entry.
//!
//! **A lease release racing the next turn of the same session.** `release_lease(L)`
//! first reads `L`'s owner `s` under the lease shard's lock (alone), then, under `s`'s
//! session shard lock, removes `L` from the entry and from the index, and — if that was
//! the last lease and a final turn asked for it — removes the entry, all in that one
//! critical section. A concurrent `bind(s, L')` runs wholly under the same session shard
//! lock, so it is ordered entirely before or entirely after the release's second step:
//! before, the entry holds `{L, L'}` when `L` goes, so it survives with `L'`; after, the
//! release has either removed the entry (final, last lease) and the bind creates a fresh
//! one, or left it without leases and the bind adds `L'` to it. Either way the session
//! ends bound with `L'` held, and no entry is ever left final and lease-less (which
//! nothing would release). Between the two steps of the release the index still maps `L`
//! (invariant 1 holds): a second release of `L` in that window finds `L` no longer in the
//! entry at its second step and is counted as unknown, harmlessly. The loom models
//! `session_release_races_next_turn` and `session_turns_race` (three threads: `L`'s
//! release, the next turn's bind, and `L'`'s release) check this, and their negative
//! control, which checks "last lease" and removes the entry in two separate critical
//! sections, loses `L'`.
//!
//! **A lease released before it was bound.** The caller binds after booking, so a booking
//! can end (freed by another thread, its rank removed) before its `bind` runs. A release
//! that finds no owner therefore remembers the id for a short while (the last
//! `early_release_memory` ids per lease shard, for at most [`EARLY_RELEASE_WINDOW`]), and
//! a bind of a remembered lease records the binding without adding the lease (counted as
//! an early release; a final turn's entry is then released at once). Both steps happen
//! under the lease shard's lock, which orders them. Without this the late bind would add
//! a lease that nothing will ever release, and the entry could never expire or be
//! evicted. Loom models `session_early_release_vs_bind` and `session_turns_race`,
//! negative control: the bind ignores the memory.
//!
//! **Cost.** `bind` and `release_lease` are a handful of hash-map operations under one or
//! two short critical sections; nothing allocates but a new entry (its key), and nothing
//! scans except a bind that finds its shard full or past its earliest deadline (one pass
//! over that shard, at most `max_entries / shards` entries). `lookup` takes one shard
//! lock (two for a child session without an entry).

#[cfg(test)]
mod audit;
mod bind;
mod config;
mod entries;
mod leases;
pub(crate) mod outcome;
mod table;

#[cfg(loom)]
pub(crate) use config::SessionFaults;
pub use config::{
    AffinityMode, SessionConfig, SessionContext, DEFAULT_MAX_SESSION_ID_BYTES,
    EARLY_RELEASE_WINDOW, MIN_ENTRIES_PER_SHARD,
};
pub use outcome::SessionStats;
pub(crate) use outcome::Steer;
pub(crate) use table::SessionTable;

#[cfg(all(test, not(loom)))]
mod stress;
#[cfg(all(test, not(loom)))]
mod tests;
