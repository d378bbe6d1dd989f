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
//! entry at its second step and is counted as unknown, harmlessly. The loom model
//! `session_release_races_next_turn` checks this, and its negative control, which checks
//! "last lease" and removes the entry in two separate critical sections, loses `L'`.
//!
//! **A lease released before it was bound.** The caller binds after booking, so a booking
//! can end (freed by another thread, its rank removed) before its `bind` runs. A release
//! that finds no owner therefore remembers the id for a short while (the last
//! `early_release_memory` ids per lease shard, for at most [`EARLY_RELEASE_WINDOW`]), and
//! a bind of a remembered lease records the binding without adding the lease (counted as
//! an early release; a final turn's entry is then released at once). Both steps happen
//! under the lease shard's lock, which orders them. Without this the late bind would add
//! a lease that nothing will ever release, and the entry could never expire or be
//! evicted. Loom model `session_early_release_vs_bind`, negative control: the bind
//! ignores the memory.
//!
//! **Cost.** `bind` and `release_lease` are a handful of hash-map operations under one or
//! two short critical sections; nothing allocates but a new entry (its key), and nothing
//! scans except a bind that finds its shard full or past its earliest deadline (one pass
//! over that shard, at most `max_entries / shards` entries). `lookup` takes one shard
//! lock (two for a child session without an entry).

use std::borrow::Borrow;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use smallvec::SmallVec;

use crate::index::RankId;
use crate::reservation::SelectionId;
use crate::sync::{Arc, Mutex};

/// Structured session context (seed 001); it takes precedence over a legacy flat session
/// id. Carried through to the decision; the affinity table comes with DESIGN.md §9.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionContext {
    pub session_id: String,
    pub parent_session_id: Option<String>,
    /// This is the session's last turn: release its binding once its leases end.
    pub session_final: bool,
    /// What started this turn (the typed selector's trigger), passed through.
    pub input_trigger: Option<String>,
}

/// How long a lease released before its bind is remembered (see the module docs). Far
/// longer than the gap between a booking and its bind, which is microseconds.
pub const EARLY_RELEASE_WINDOW: Duration = Duration::from_secs(60);

/// Session shards are halved until each gets at least this many entries (or one is left).
pub const MIN_ENTRIES_PER_SHARD: usize = 16;

/// How the binding steers a selection.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum AffinityMode {
    /// Pin: a turn goes to the bound rank unless that rank left or is not eligible (then
    /// it rebinds, counted as forced). Dynamo's default.
    #[default]
    Hard,
    /// Prefer: the bound rank's cost is lowered by `penalty_blocks` (cost units are
    /// blocks; lower cost wins). A negative or non-finite penalty is taken as 0.
    Soft { penalty_blocks: f64 },
}

/// Configuration of one partition's session table.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionConfig {
    pub mode: AffinityMode,
    /// Most sessions the table holds (default 65,536), enforced per shard (module docs,
    /// "Bounds"). 0 is taken as 1.
    pub max_entries: usize,
    /// An entry without leases is dropped this long after its last activity (default
    /// 600 s; the module docs say why).
    pub idle_ttl: Duration,
    /// Number of session shards and of lease shards (rounded up to a power of two, at
    /// least 1). Session shards are then halved while a shard would get fewer than
    /// [`MIN_ENTRIES_PER_SHARD`] entries, so a small table is not split into shards too
    /// small for eviction to choose well.
    pub shards: usize,
    /// Longest session id accepted, in bytes (default 256, as Dynamo).
    pub max_session_id_bytes: usize,
    /// How many leases released before their bind each lease shard remembers (module
    /// docs; 0 = none: a bind that comes after its lease's release then holds the lease
    /// for good, and its entry never expires).
    pub early_release_memory: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            mode: AffinityMode::Hard,
            max_entries: 65_536,
            idle_ttl: Duration::from_secs(600),
            shards: 64,
            max_session_id_bytes: 256,
            early_release_memory: 64,
        }
    }
}

/// A session's binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Binding {
    pub rank: RankId,
    /// The entry's revision (module docs).
    pub revision: u64,
    /// The binding is the parent session's: the session itself has no entry yet
    /// ([`SessionTable::lookup`]). Always `false` in a [`BindOutcome`].
    pub inherited: bool,
}

/// What [`SessionTable::bind`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindOutcome {
    /// The session had no entry: it now starts bound to this rank (revision 0).
    Created(Binding),
    /// The turn went to the bound rank: lease added, activity refreshed.
    Kept(Binding),
    /// The binding moved (revision bumped). `from` is `None` when the previous binding
    /// was dropped by [`SessionTable::forget_rank`]; `forced` says the bound rank was
    /// gone or unavailable (the caller's flag, or always when `from` is `None`).
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
    /// The binding after the bind, if one was recorded.
    pub fn binding(&self) -> Option<Binding> {
        match *self {
            BindOutcome::Created(b) | BindOutcome::Kept(b) => Some(b),
            BindOutcome::Rebound { to, .. } => Some(to),
            _ => None,
        }
    }
}

/// What [`SessionTable::release_lease`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseRelease {
    /// The lease is gone; the binding stays.
    Released,
    /// It was the last lease of a session whose last turn was final: the entry is gone.
    SessionEnded,
    /// No session holds this lease (never bound, bound to a refused session, released
    /// already, or released concurrently by another call). Counted; nothing changes.
    Unknown,
}

/// What the binding means for one selection ([`SessionTable::steer`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Steer {
    /// No binding: choose by cost, then bind with `forced = false`.
    Free,
    /// Hard mode, bound rank eligible: the selection must go to this rank.
    Pin(RankId),
    /// Soft mode, bound rank eligible: choose by cost with
    /// [`SessionTable::soft_cost_adjustment`] added (the bound rank's cost lowered by
    /// `penalty_blocks`); bind with `forced = false`.
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
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionView {
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

/// Negative-control faults of the loom models (each breaks one step of the protocol).
#[cfg(loom)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SessionFaults {
    /// `release_lease` decides "last lease of a final session" in one critical section
    /// and removes the entry in a second one.
    pub(crate) split_last_lease_release: bool,
    /// `bind` ignores the memory of leases released before their bind.
    pub(crate) ignore_early_release: bool,
}

// ---------------------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------------------

/// A session id shared by its entry and the lease index (one allocation per entry).
#[derive(Clone, Debug)]
struct SessionKey(Arc<String>);

impl SessionKey {
    fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl PartialEq for SessionKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for SessionKey {}

impl Hash for SessionKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Must hash as `str` does: maps are probed with `&str` (`Borrow<str>`).
        self.as_str().hash(state)
    }
}

impl Borrow<str> for SessionKey {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

/// Session ids come from clients: keyed SipHash in production. Under loom, a fixed hash
/// (loom replays executions and wants the same layout every time).
#[cfg(not(loom))]
type SidState = std::collections::hash_map::RandomState;
#[cfg(loom)]
type SidState = BuildHasherDefault<crate::index::RankHasher>;

type LeaseMap<V> = HashMap<SelectionId, V, BuildHasherDefault<crate::index::RankHasher>>;

struct Entry {
    rank: Option<RankId>,
    revision: u64,
    leases: SmallVec<[SelectionId; 2]>,
    last_active: Instant,
    final_requested: bool,
}

impl Entry {
    fn deadline(&self, ttl: Duration) -> Option<Instant> {
        self.last_active.checked_add(ttl)
    }

    /// Lease-free and past its idle deadline.
    fn expired(&self, ttl: Duration, now: Instant) -> bool {
        self.leases.is_empty() && now.saturating_duration_since(self.last_active) >= ttl
    }

    fn touch(&mut self, now: Instant) {
        // Callers' clocks may be read on different threads: never move backwards.
        self.last_active = self.last_active.max(now);
    }
}

#[derive(Default)]
struct ShardCounters {
    created: u64,
    rebinds: u64,
    forced_rebinds: u64,
    dropped: u64,
    finals_released: u64,
    evicted: u64,
    refused: u64,
    reaped: u64,
    leases_released: u64,
    lost_release_races: u64,
    early_releases: u64,
    duplicate_leases: u64,
    invalid_ids: u64,
}

struct SessionShard {
    entries: HashMap<SessionKey, Entry, SidState>,
    /// No lease-free entry of this shard expires before this (a lower bound, exact after
    /// a scan); `None` = none can. Lets `bind` skip the scan.
    next_expiry: Option<Instant>,
    counters: ShardCounters,
}

impl SessionShard {
    fn note_idle(&mut self, deadline: Option<Instant>) {
        if let Some(d) = deadline {
            self.next_expiry = Some(self.next_expiry.map_or(d, |x| x.min(d)));
        }
    }

    /// Removes the idle-expired entries; recomputes `next_expiry` exactly.
    fn reap(&mut self, ttl: Duration, now: Instant) -> usize {
        let before = self.entries.len();
        let mut next: Option<Instant> = None;
        self.entries.retain(|_, e| {
            if !e.leases.is_empty() {
                return true;
            }
            if e.expired(ttl, now) {
                return false;
            }
            if let Some(d) = e.deadline(ttl) {
                next = Some(next.map_or(d, |x| x.min(d)));
            }
            true
        });
        self.next_expiry = next;
        let n = before - self.entries.len();
        self.counters.reaped += n as u64;
        n
    }

    /// Makes room for one entry: expired entries first, else the least recently active
    /// entry without leases. False if every entry holds leases.
    fn make_room(&mut self, ttl: Duration, now: Instant) -> bool {
        if self.reap(ttl, now) > 0 {
            return true;
        }
        let victim = self
            .entries
            .iter()
            .filter(|(_, e)| e.leases.is_empty())
            .min_by_key(|(_, e)| e.last_active)
            .map(|(k, _)| k.clone());
        match victim {
            Some(k) => {
                self.entries.remove(&k);
                self.counters.evicted += 1;
                true
            }
            None => false,
        }
    }
}

#[derive(Default)]
struct LeaseShard {
    owner: LeaseMap<SessionKey>,
    /// Leases released while no session held them, oldest first (module docs).
    ended: VecDeque<(SelectionId, Instant)>,
    unknown_releases: u64,
}

impl LeaseShard {
    fn remember_ended(&mut self, lease: SelectionId, now: Instant, cap: usize) {
        if cap == 0 {
            return;
        }
        if self.ended.len() >= cap {
            self.ended.pop_front();
        }
        self.ended.push_back((lease, now));
    }

    /// Whether `lease` was released (recently) before this bind; forgets it either way.
    fn take_ended(&mut self, lease: SelectionId, now: Instant) -> bool {
        match self.ended.iter().position(|&(id, _)| id == lease) {
            None => false,
            Some(i) => {
                let (_, at) = self.ended.remove(i).expect("position is in range");
                now.saturating_duration_since(at) <= EARLY_RELEASE_WINDOW
            }
        }
    }
}

/// How a bind treats its lease (decided under the lease shard's lock).
enum LeaseStep {
    Added,
    AlreadyHeld,
    EndedEarly,
}

/// SplitMix64's finalizer: picks the lease shard from the id's well-mixed bits.
#[inline]
fn lease_hash(id: SelectionId) -> u64 {
    let mut z = id.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The session-affinity table of one partition. All methods take `&self` and are safe to
/// call from any number of threads; none blocks on anything but a shard's short critical
/// section, none spawns a thread, none panics on any input.
pub struct SessionTable {
    mode: AffinityMode,
    idle_ttl: Duration,
    per_shard: usize,
    max_id_bytes: usize,
    early_memory: usize,
    /// Seed of the session → shard hash (random per table in production).
    seed: u64,
    smask: usize,
    lmask: usize,
    sessions: Box<[CachePadded<Mutex<SessionShard>>]>,
    leases: Box<[CachePadded<Mutex<LeaseShard>>]>,
    #[cfg(loom)]
    faults: SessionFaults,
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
    pub fn new(cfg: SessionConfig) -> Self {
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

    /// The mode (with a soft penalty already sanitized).
    pub fn mode(&self) -> AffinityMode {
        self.mode
    }

    pub fn idle_ttl(&self) -> Duration {
        self.idle_ttl
    }

    /// The most entries the table can hold: `max_entries` (at least 1) rounded down to a
    /// multiple of the session shard count.
    pub fn capacity(&self) -> usize {
        self.per_shard * self.sessions.len()
    }

    fn valid_id(&self, id: &str) -> bool {
        !id.is_empty() && id.len() <= self.max_id_bytes
    }

    fn session_shard(&self, id: &str) -> &Mutex<SessionShard> {
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(id.as_bytes(), self.seed);
        &self.sessions[h as usize & self.smask]
    }

    fn lease_shard(&self, lease: SelectionId) -> &Mutex<LeaseShard> {
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

    /// The binding a turn of `ctx` should follow: the session's own; if the session has
    /// no (live) entry yet, its parent's (`parent_session_id`), marked `inherited` — a
    /// child session starts from its parent's binding, and its own entry, created by its
    /// first `bind`, then evolves on its own. One level only: a grandparent is not
    /// consulted. An entry whose binding `forget_rank` dropped answers `None` (no parent
    /// fallback: the session rebinds). Read-only: it neither refreshes nor reaps.
    pub fn lookup(&self, ctx: &SessionContext, now: Instant) -> Option<Binding> {
        self.lookup_or_dropped(ctx, now).0
    }

    /// As [`SessionTable::lookup`], and whether the session's own binding was dropped by
    /// `forget_rank` (its rank left): such a turn is chosen by cost like an unbound one,
    /// but it is a forced rebind, and the decision reports it so.
    pub fn lookup_or_dropped(&self, ctx: &SessionContext, now: Instant) -> (Option<Binding>, bool) {
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
    pub fn steer(&self, binding: Option<Binding>, eligible: impl Fn(RankId) -> bool) -> Steer {
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

    /// The term to **add** to `candidate`'s cost (in blocks; lower cost wins): in soft
    /// mode `-penalty_blocks` for the bound rank, which lowers its cost, and 0 for every
    /// other candidate; always 0 in hard mode (the pin is [`Steer::Pin`]) or without a
    /// binding.
    pub fn soft_cost_adjustment(&self, binding: Option<RankId>, candidate: RankId) -> f64 {
        match (self.mode, binding) {
            (AffinityMode::Soft { penalty_blocks }, Some(bound)) if bound == candidate => {
                -penalty_blocks
            }
            _ => 0.0,
        }
    }

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
    pub fn bind(
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
    pub fn release_lease(&self, lease: SelectionId, now: Instant) -> LeaseRelease {
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

    /// A rank left: every binding to it is dropped (counted) so the session's next turn
    /// rebinds (counted as forced). Entries stay, with their leases (the rank's bookings
    /// end through the reservation table, which releases them); lease-free ones age out.
    /// Returns how many bindings were dropped.
    pub fn forget_rank(&self, rank: RankId) -> usize {
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

    /// Removes every idle-expired entry (no leases, idle TTL past); returns how many.
    pub fn reap(&self, now: Instant) -> usize {
        self.sessions
            .iter()
            .map(|s| s.lock().reap(self.idle_ttl, now))
            .sum()
    }

    /// Entries now, including expired ones not yet reaped (shards summed one by one).
    pub fn len(&self) -> usize {
        self.sessions.iter().map(|s| s.lock().entries.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entry of `session_id`, as it is now (expired or not).
    pub fn entry(&self, session_id: &str) -> Option<SessionView> {
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

    pub fn stats(&self) -> SessionStats {
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

    /// Checks the invariants of the module docs: the lease index and the entries' leases
    /// agree exactly, no final entry is lease-less, no lease is held twice, no shard is
    /// over its bound. Locks every shard in turn: exact only on a table no other thread
    /// is using (tests, diagnostics).
    pub fn audit(&self) -> Result<(), String> {
        let mut held: HashMap<SelectionId, String> = HashMap::new();
        for (i, s) in self.sessions.iter().enumerate() {
            let g = s.lock();
            if g.entries.len() > self.per_shard {
                return Err(format!(
                    "session shard {i} holds {} entries, bound {}",
                    g.entries.len(),
                    self.per_shard
                ));
            }
            for (k, e) in &g.entries {
                if e.final_requested && e.leases.is_empty() {
                    return Err(format!(
                        "session {:?} is final without leases: nothing will release it",
                        k.as_str()
                    ));
                }
                for &l in &e.leases {
                    if let Some(other) = held.insert(l, k.as_str().to_owned()) {
                        return Err(format!(
                            "lease {l} held by sessions {other:?} and {:?}",
                            k.as_str()
                        ));
                    }
                }
            }
        }
        let mut indexed = 0;
        for s in self.leases.iter() {
            let g = s.lock();
            for (l, k) in &g.owner {
                indexed += 1;
                match held.get(l) {
                    Some(owner) if owner == k.as_str() => {}
                    Some(owner) => {
                        return Err(format!(
                            "lease index: {l} → {:?}, but session {owner:?} holds it",
                            k.as_str()
                        ))
                    }
                    None => {
                        return Err(format!(
                            "lease index: {l} → {:?}, which does not hold it (leaked lease)",
                            k.as_str()
                        ))
                    }
                }
            }
        }
        if indexed != held.len() {
            return Err(format!(
                "sessions hold {} leases, the lease index knows {indexed}",
                held.len()
            ));
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const A: RankId = RankId::new(1, 0);
    const B: RankId = RankId::new(2, 0);
    const C: RankId = RankId::new(3, 0);

    fn ctx(id: &str) -> SessionContext {
        SessionContext {
            session_id: id.to_string(),
            ..SessionContext::default()
        }
    }

    fn final_ctx(id: &str) -> SessionContext {
        SessionContext {
            session_final: true,
            ..ctx(id)
        }
    }

    fn child(id: &str, parent: &str) -> SessionContext {
        SessionContext {
            parent_session_id: Some(parent.to_string()),
            ..ctx(id)
        }
    }

    fn table() -> SessionTable {
        SessionTable::new(SessionConfig::default())
    }

    /// One shard, so eviction and lazy reaping are deterministic.
    fn one_shard(max_entries: usize, ttl: Duration) -> SessionTable {
        SessionTable::new(SessionConfig {
            max_entries,
            idle_ttl: ttl,
            shards: 1,
            ..SessionConfig::default()
        })
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn binding_follows_the_session() {
        let t = table();
        let now = Instant::now();
        assert_eq!(t.lookup(&ctx("s"), now), None);
        assert!(matches!(
            t.bind(&ctx("s"), A, 1, false, now),
            BindOutcome::Created(Binding {
                rank: A,
                revision: 0,
                ..
            })
        ));
        let b = t.lookup(&ctx("s"), now).unwrap();
        assert_eq!((b.rank, b.revision, b.inherited), (A, 0, false));
        assert_eq!(t.lookup(&ctx("other"), now), None);
        assert!(matches!(
            t.bind(&ctx("s"), A, 2, false, now),
            BindOutcome::Kept(Binding {
                rank: A,
                revision: 0,
                ..
            })
        ));
        assert_eq!(t.entry("s").unwrap().leases.len(), 2);
        assert_eq!(t.stats().bindings_created, 1);
        t.audit().unwrap();
    }

    #[test]
    fn hard_mode_pins_an_eligible_bound_rank() {
        let t = table();
        let now = Instant::now();
        t.bind(&ctx("s"), A, 1, false, now);
        let b = t.lookup(&ctx("s"), now);
        assert_eq!(t.steer(b, |_| true), Steer::Pin(A));
        assert_eq!(t.steer(b, |r| r != A), Steer::Rebind { from: A });
        assert_eq!(t.steer(None, |_| true), Steer::Free);
        assert_eq!(t.soft_cost_adjustment(Some(A), A), 0.0);
    }

    #[test]
    fn hard_mode_rebind_when_the_rank_left_is_counted_as_forced() {
        let t = table();
        let now = Instant::now();
        t.bind(&ctx("s"), A, 1, false, now);
        // A is unavailable for this turn: the caller rebinds with forced = true.
        let steer = t.steer(t.lookup(&ctx("s"), now), |r| r != A);
        assert_eq!(steer, Steer::Rebind { from: A });
        let out = t.bind(&ctx("s"), B, 2, matches!(steer, Steer::Rebind { .. }), now);
        assert_eq!(
            out,
            BindOutcome::Rebound {
                from: Some(A),
                to: Binding {
                    rank: B,
                    revision: 1,
                    inherited: false
                },
                forced: true
            }
        );
        // B leaves the partition: the binding is dropped and the next bind is forced
        // whatever the caller says.
        assert_eq!(t.forget_rank(B), 1);
        assert_eq!(t.lookup(&ctx("s"), now), None);
        let out = t.bind(&ctx("s"), C, 3, false, now);
        assert!(matches!(
            out,
            BindOutcome::Rebound {
                from: None,
                forced: true,
                to: Binding {
                    rank: C,
                    revision: 2,
                    ..
                }
            }
        ));
        let st = t.stats();
        assert_eq!(
            (st.rebinds, st.forced_rebinds, st.bindings_dropped),
            (2, 2, 1)
        );
        // A move while the bound rank was eligible is a rebind, not a forced one.
        t.bind(&ctx("s"), A, 4, false, now);
        let st = t.stats();
        assert_eq!((st.rebinds, st.forced_rebinds), (3, 2));
        t.audit().unwrap();
    }

    #[test]
    fn soft_adjustment_lowers_the_bound_ranks_cost_only() {
        let t = SessionTable::new(SessionConfig {
            mode: AffinityMode::Soft {
                penalty_blocks: 8.0,
            },
            ..SessionConfig::default()
        });
        assert_eq!(t.soft_cost_adjustment(Some(A), A), -8.0);
        assert_eq!(t.soft_cost_adjustment(Some(A), B), 0.0);
        assert_eq!(t.soft_cost_adjustment(None, A), 0.0);
        // Lower cost wins: a bound rank 5 blocks dearer than another now wins.
        let (cost_a, cost_b) = (15.0, 10.0);
        assert!(
            cost_a + t.soft_cost_adjustment(Some(A), A)
                < cost_b + t.soft_cost_adjustment(Some(A), B)
        );
        let now = Instant::now();
        t.bind(&ctx("s"), A, 1, false, now);
        assert_eq!(
            t.steer(t.lookup(&ctx("s"), now), |_| true),
            Steer::Prefer {
                rank: A,
                penalty_blocks: 8.0
            }
        );
        assert_eq!(
            t.steer(t.lookup(&ctx("s"), now), |_| false),
            Steer::Rebind { from: A }
        );
        // Nonsense penalties are taken as 0.
        for p in [-3.0, f64::NAN, f64::INFINITY] {
            let t = SessionTable::new(SessionConfig {
                mode: AffinityMode::Soft { penalty_blocks: p },
                ..SessionConfig::default()
            });
            assert_eq!(t.soft_cost_adjustment(Some(A), A), 0.0);
        }
    }

    #[test]
    fn revision_bumps_on_rebind_only() {
        let t = table();
        let now = Instant::now();
        t.bind(&ctx("s"), A, 1, false, now);
        t.bind(&ctx("s"), A, 2, false, now);
        t.release_lease(1, now);
        t.bind(&ctx("s"), A, 3, true, now); // forced but same rank: kept
        assert_eq!(t.entry("s").unwrap().revision, 0);
        t.bind(&ctx("s"), B, 4, false, now);
        assert_eq!(t.entry("s").unwrap().revision, 1);
        t.bind(&ctx("s"), B, 5, false, now);
        assert_eq!(t.entry("s").unwrap().revision, 1);
        t.bind(&ctx("s"), A, 6, false, now);
        assert_eq!(t.lookup(&ctx("s"), now).unwrap().revision, 2);
        assert_eq!(t.stats().rebinds, 2);
    }

    #[test]
    fn final_turn_releases_the_binding_only_when_its_last_lease_ends() {
        let t = table();
        let now = Instant::now();
        t.bind(&ctx("s"), A, 1, false, now);
        t.bind(&final_ctx("s"), A, 2, false, now);
        assert!(t.entry("s").unwrap().final_requested);
        assert_eq!(t.release_lease(2, now), LeaseRelease::Released);
        assert!(
            t.lookup(&ctx("s"), now).is_some(),
            "released before the last lease"
        );
        assert_eq!(t.len(), 1);
        t.audit().unwrap();
        assert_eq!(t.release_lease(1, now), LeaseRelease::SessionEnded);
        assert_eq!(t.lookup(&ctx("s"), now), None);
        assert_eq!(t.len(), 0);
        let st = t.stats();
        assert_eq!(
            (st.finals_released, st.leases_released, st.leases),
            (1, 2, 0)
        );
        // The next turn starts afresh.
        assert!(matches!(
            t.bind(&ctx("s"), B, 3, false, now),
            BindOutcome::Created(Binding {
                rank: B,
                revision: 0,
                ..
            })
        ));
    }

    #[test]
    fn a_non_final_turn_keeps_the_binding() {
        let t = table();
        let now = Instant::now();
        t.bind(&ctx("s"), A, 1, false, now);
        assert_eq!(t.release_lease(1, now), LeaseRelease::Released);
        assert_eq!(t.lookup(&ctx("s"), now).unwrap().rank, A);
        assert_eq!(t.len(), 1);
        assert_eq!(t.stats().finals_released, 0);
    }

    #[test]
    fn a_later_non_final_turn_withdraws_the_final_request() {
        let t = table();
        let now = Instant::now();
        t.bind(&final_ctx("s"), A, 1, false, now);
        t.bind(&ctx("s"), A, 2, false, now);
        assert!(!t.entry("s").unwrap().final_requested);
        t.release_lease(1, now);
        t.release_lease(2, now);
        assert_eq!(t.len(), 1, "the session went on: its binding stays");
        t.audit().unwrap();
    }

    #[test]
    fn child_inherits_the_parents_binding_then_diverges() {
        let t = table();
        let now = Instant::now();
        t.bind(&ctx("parent"), A, 1, false, now);
        let b = t.lookup(&child("kid", "parent"), now).unwrap();
        assert_eq!((b.rank, b.inherited), (A, true));
        // Its first turn creates its own entry, which then moves on its own.
        assert!(matches!(
            t.bind(&child("kid", "parent"), A, 2, false, now),
            BindOutcome::Created(_)
        ));
        let b = t.lookup(&child("kid", "parent"), now).unwrap();
        assert_eq!((b.rank, b.inherited), (A, false));
        t.bind(&child("kid", "parent"), B, 3, true, now);
        assert_eq!(t.lookup(&child("kid", "parent"), now).unwrap().rank, B);
        assert_eq!(t.lookup(&ctx("parent"), now).unwrap().rank, A);
        // An unknown parent, or none, gives nothing.
        assert_eq!(t.lookup(&child("other", "nobody"), now), None);
        t.audit().unwrap();
    }

    #[test]
    fn idle_entries_are_reaped_lazily_on_bind_not_while_leases_are_held() {
        let t = one_shard(16, secs(10));
        let t0 = Instant::now();
        t.bind(&ctx("idle"), A, 1, false, t0);
        t.bind(&ctx("busy"), A, 2, false, t0);
        t.release_lease(1, t0);
        // Not yet expired.
        t.bind(&ctx("x"), B, 3, false, t0 + secs(9));
        assert_eq!(t.len(), 3);
        // Past the idle deadline: a bind in the shard reaps it; "busy" holds a lease.
        assert_eq!(
            t.lookup(&ctx("idle"), t0 + secs(10)),
            None,
            "expired = absent"
        );
        t.bind(&ctx("y"), B, 4, false, t0 + secs(11));
        assert!(t.entry("idle").is_none());
        assert!(t.entry("busy").is_some());
        assert_eq!(t.stats().reaped, 1);
        t.audit().unwrap();
    }

    #[test]
    fn reap_drops_idle_entries_without_leases() {
        let t = table();
        let t0 = Instant::now();
        for (i, s) in ["a", "b", "c"].iter().enumerate() {
            t.bind(&ctx(s), A, i as u64, false, t0);
        }
        t.release_lease(0, t0);
        t.release_lease(1, t0 + secs(100));
        assert_eq!(t.reap(t0 + secs(599)), 0);
        assert_eq!(t.reap(t0 + secs(600)), 1); // "a"
        assert_eq!(t.reap(t0 + secs(10_000)), 1); // "b"; "c" holds a lease
        assert_eq!(t.len(), 1);
        t.release_lease(2, t0 + secs(10_000));
        // Its idle clock started when its lease ended.
        assert_eq!(t.reap(t0 + secs(10_599)), 0);
        assert_eq!(t.reap(t0 + secs(10_600)), 1);
        assert_eq!(t.stats().reaped, 3);
        assert!(t.is_empty());
    }

    #[test]
    fn full_table_evicts_expired_then_lru_lease_free_then_refuses() {
        let t = one_shard(3, secs(10));
        let t0 = Instant::now();
        t.bind(&ctx("old"), A, 1, false, t0);
        t.bind(&ctx("mid"), A, 2, false, t0 + secs(5));
        t.bind(&ctx("busy"), A, 3, false, t0 + secs(6));
        t.release_lease(1, t0);
        t.release_lease(2, t0 + secs(5));
        // Full; "old" is expired at t0+12 ("mid" is not): it goes first, as reaped.
        assert!(matches!(
            t.bind(&ctx("n1"), B, 4, false, t0 + secs(12)),
            BindOutcome::Created(_)
        ));
        assert!(t.entry("old").is_none() && t.entry("mid").is_some());
        assert_eq!((t.stats().reaped, t.stats().evicted), (1, 0));
        // Full, nothing expired: the least recently active lease-free entry goes ("mid";
        // "n1" holds a lease, "busy" too).
        assert!(matches!(
            t.bind(&ctx("n2"), B, 5, false, t0 + secs(13)),
            BindOutcome::Created(_)
        ));
        assert!(t.entry("mid").is_none());
        assert_eq!(t.stats().evicted, 1);
        // Full of lease holders: refused and counted; nothing recorded.
        assert_eq!(
            t.bind(&ctx("n3"), B, 6, false, t0 + secs(14)),
            BindOutcome::Refused
        );
        assert!(t.entry("n3").is_none());
        assert_eq!(t.stats().refused, 1);
        assert_eq!(t.len(), 3);
        assert_eq!(t.release_lease(6, t0), LeaseRelease::Unknown);
        // An existing session still binds in a full shard.
        assert!(matches!(
            t.bind(&ctx("busy"), B, 7, false, t0 + secs(14)),
            BindOutcome::Rebound { .. }
        ));
        t.audit().unwrap();
    }

    #[test]
    fn capacity_never_exceeds_max_entries() {
        for (max, shards) in [(1, 64), (5, 4), (100, 64), (65_536, 64), (0, 8)] {
            let t = SessionTable::new(SessionConfig {
                max_entries: max,
                shards,
                ..SessionConfig::default()
            });
            assert!(
                t.capacity() <= max.max(1),
                "{max}/{shards}: {}",
                t.capacity()
            );
            assert!(t.capacity() >= 1);
            let now = Instant::now();
            for i in 0..(2 * max.max(1) as u64 + 10) {
                t.bind(&ctx(&format!("s{i}")), A, i, false, now);
                t.release_lease(i, now);
            }
            assert!(t.len() <= t.capacity());
            t.audit().unwrap();
        }
    }

    #[test]
    fn unknown_lease_release_is_counted_and_harmless() {
        let t = table();
        let now = Instant::now();
        t.bind(&ctx("s"), A, 1, false, now);
        assert_eq!(t.release_lease(99, now), LeaseRelease::Unknown);
        assert_eq!(t.release_lease(1, now), LeaseRelease::Released);
        assert_eq!(t.release_lease(1, now), LeaseRelease::Unknown);
        let st = t.stats();
        assert_eq!((st.unknown_lease_releases, st.leases_released), (2, 1));
        assert_eq!(t.lookup(&ctx("s"), now).unwrap().rank, A);
        t.audit().unwrap();
    }

    #[test]
    fn a_lease_released_before_its_bind_is_not_held() {
        let t = table();
        let now = Instant::now();
        assert_eq!(t.release_lease(5, now), LeaseRelease::Unknown);
        assert!(matches!(
            t.bind(&ctx("s"), A, 5, false, now),
            BindOutcome::Created(_)
        ));
        let e = t.entry("s").unwrap();
        assert!(e.leases.is_empty(), "an already ended lease was added");
        assert_eq!(t.stats().early_releases, 1);
        // A final turn whose lease already ended releases the binding at once.
        t.release_lease(6, now);
        t.bind(&final_ctx("f"), A, 6, false, now);
        assert!(t.entry("f").is_none());
        assert_eq!(t.stats().finals_released, 1);
        // The memory is short-lived: a bind long after the release holds its lease.
        t.release_lease(7, now);
        t.bind(
            &ctx("late"),
            A,
            7,
            false,
            now + EARLY_RELEASE_WINDOW + secs(1),
        );
        assert_eq!(t.entry("late").unwrap().leases, vec![7]);
        t.audit().unwrap();
    }

    #[test]
    fn a_lease_is_held_by_one_session_once() {
        let t = table();
        let now = Instant::now();
        t.bind(&ctx("s"), A, 1, false, now);
        assert!(matches!(
            t.bind(&ctx("s"), A, 1, false, now),
            BindOutcome::Kept(_)
        ));
        assert_eq!(t.entry("s").unwrap().leases, vec![1]);
        assert_eq!(t.bind(&ctx("t"), A, 1, false, now), BindOutcome::LeaseInUse);
        assert!(t.entry("t").is_none());
        assert_eq!(t.stats().duplicate_leases, 1);
        t.audit().unwrap();
    }

    #[test]
    fn forget_rank_drops_only_that_ranks_bindings() {
        let t = table();
        let now = Instant::now();
        t.bind(&ctx("a"), A, 1, false, now);
        t.bind(&ctx("b"), B, 2, false, now);
        t.bind(&ctx("a2"), A, 3, false, now);
        t.release_lease(3, now);
        assert_eq!(t.forget_rank(A), 2);
        assert_eq!(t.lookup(&ctx("a"), now), None);
        assert_eq!(t.lookup(&ctx("a2"), now), None);
        assert_eq!(t.lookup(&ctx("b"), now).unwrap().rank, B);
        // Leases stay with their sessions until their bookings end.
        assert_eq!(t.entry("a").unwrap().leases, vec![1]);
        assert_eq!(t.stats().bindings_dropped, 2);
        assert_eq!(t.forget_rank(A), 0);
        // A child of a session whose binding was dropped inherits nothing.
        assert_eq!(t.lookup(&child("kid", "a"), now), None);
        t.audit().unwrap();
    }

    #[test]
    fn invalid_session_ids_are_rejected() {
        let t = table();
        let now = Instant::now();
        assert_eq!(
            t.bind(&ctx(""), A, 1, false, now),
            BindOutcome::InvalidSessionId
        );
        let long = "x".repeat(257);
        assert_eq!(
            t.bind(&ctx(&long), A, 2, false, now),
            BindOutcome::InvalidSessionId
        );
        assert_eq!(t.lookup(&ctx(&long), now), None);
        assert!(t.is_empty());
        assert_eq!(t.stats().invalid_session_ids, 2);
        assert_eq!(t.stats().leases, 0);
    }

    #[test]
    fn huge_ttl_never_overflows() {
        let t = one_shard(2, Duration::MAX);
        let now = Instant::now();
        t.bind(&ctx("a"), A, 1, false, now);
        t.release_lease(1, now);
        assert_eq!(t.reap(now + secs(1_000_000)), 0);
        t.bind(&ctx("b"), A, 2, false, now);
        t.release_lease(2, now + secs(1));
        // Full, nothing expires: LRU eviction of "a".
        t.bind(&ctx("c"), A, 3, false, now + secs(2));
        assert!(t.entry("a").is_none());
        assert_eq!(t.entry("b").unwrap().idle_deadline, None);
    }
}
