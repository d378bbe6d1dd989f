//! The lease side of the table: a lease shard maps each live lease (a booking's
//! selection id) to its session and remembers leases released before their bind
//! ("Concurrency" in the module docs).

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::time::Instant;

use super::config::EARLY_RELEASE_WINDOW;
use super::entries::SessionKey;
use crate::ids::SelectionId;

type LeaseMap<V> = HashMap<SelectionId, V, BuildHasherDefault<crate::hash::mix::HashMix>>;

#[derive(Default)]
pub(super) struct LeaseShard {
    pub(super) owner: LeaseMap<SessionKey>,
    /// Leases released while no session held them, oldest first (module docs).
    ended: VecDeque<(SelectionId, Instant)>,
    pub(super) unknown_releases: u64,
}

impl LeaseShard {
    pub(super) fn remember_ended(&mut self, lease: SelectionId, now: Instant, cap: usize) {
        if cap == 0 {
            return;
        }
        if self.ended.len() >= cap {
            self.ended.pop_front();
        }
        self.ended.push_back((lease, now));
    }

    /// Whether `lease` was released (recently) before this bind; forgets it either way.
    pub(super) fn take_ended(&mut self, lease: SelectionId, now: Instant) -> bool {
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
pub(super) enum LeaseStep {
    Added,
    AlreadyHeld,
    EndedEarly,
}

/// Picks the lease shard from the id's well-mixed bits.
#[inline]
pub(super) fn lease_hash(id: SelectionId) -> u64 {
    crate::hash::mix::splitmix64(id)
}
