//! The session side of the table: the shared session key, one session's entry (binding,
//! revision, leases, last activity, final request), and a session shard with its idle
//! expiry, eviction and counters ("An entry" and "Bounds" in the module docs).

use std::borrow::Borrow;
use std::collections::HashMap;
#[cfg(loom)]
use std::hash::BuildHasherDefault;
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::ids::RankId;
use crate::ids::SelectionId;
use crate::sync::Arc;

/// A session id shared by its entry and the lease index (one allocation per entry).
#[derive(Clone, Debug)]
pub(super) struct SessionKey(pub(super) Arc<String>);

impl SessionKey {
    pub(super) fn as_str(&self) -> &str {
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
pub(super) type SidState = std::collections::hash_map::RandomState;
#[cfg(loom)]
pub(super) type SidState = BuildHasherDefault<crate::hash::mix::HashMix>;

pub(super) struct Entry {
    pub(super) rank: Option<RankId>,
    pub(super) revision: u64,
    pub(super) leases: SmallVec<[SelectionId; 2]>,
    pub(super) last_active: Instant,
    pub(super) final_requested: bool,
}

impl Entry {
    pub(super) fn deadline(&self, ttl: Duration) -> Option<Instant> {
        self.last_active.checked_add(ttl)
    }

    /// Lease-free and past its idle deadline.
    pub(super) fn expired(&self, ttl: Duration, now: Instant) -> bool {
        self.leases.is_empty() && now.saturating_duration_since(self.last_active) >= ttl
    }

    pub(super) fn touch(&mut self, now: Instant) {
        // Callers' clocks may be read on different threads: never move backwards.
        self.last_active = self.last_active.max(now);
    }
}

#[derive(Default)]
pub(super) struct ShardCounters {
    pub(super) created: u64,
    pub(super) rebinds: u64,
    pub(super) forced_rebinds: u64,
    pub(super) dropped: u64,
    pub(super) finals_released: u64,
    pub(super) evicted: u64,
    pub(super) refused: u64,
    pub(super) reaped: u64,
    pub(super) leases_released: u64,
    pub(super) lost_release_races: u64,
    pub(super) early_releases: u64,
    pub(super) duplicate_leases: u64,
    pub(super) invalid_ids: u64,
}

pub(super) struct SessionShard {
    pub(super) entries: HashMap<SessionKey, Entry, SidState>,
    /// No lease-free entry of this shard expires before this (a lower bound, exact after
    /// a scan); `None` = none can. Lets `bind` skip the scan.
    pub(super) next_expiry: Option<Instant>,
    pub(super) counters: ShardCounters,
}

impl SessionShard {
    pub(super) fn note_idle(&mut self, deadline: Option<Instant>) {
        if let Some(d) = deadline {
            self.next_expiry = Some(self.next_expiry.map_or(d, |x| x.min(d)));
        }
    }

    /// Removes the idle-expired entries; recomputes `next_expiry` exactly.
    pub(super) fn reap(&mut self, ttl: Duration, now: Instant) -> usize {
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
    pub(super) fn make_room(&mut self, ttl: Duration, now: Instant) -> bool {
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
