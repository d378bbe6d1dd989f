//! The shards: `selection_id → Booking` maps, one mutex each, an id's shard picked by a
//! hash of the id; and each shard's bounded memory of recently freed ids, which makes a
//! second `free` idempotent and a late duplicate booking harmless.

use std::collections::VecDeque;
use std::time::Instant;

use super::rank::{MixMap, RankState};
use super::types::{BookingOrigin, FreedBy};
use crate::ids::SelectionId;
use crate::sync::Arc;

/// Picks the shard from the id's well-mixed bits.
#[inline]
pub(super) fn shard_hash(id: SelectionId) -> u64 {
    crate::hash::mix::splitmix64(id)
}

/// One live booking.
#[derive(Clone)]
pub(super) struct Booking {
    /// The counter set the booking was added to (kept, not looked up again, so a release
    /// always subtracts from the very counters it added to, even if the rank was removed
    /// and re-created meanwhile).
    pub(super) rank: Arc<RankState>,
    pub(super) origin: BookingOrigin,
    pub(super) prompt_blocks: Vec<u64>,
    pub(super) new_prompt_blocks: u64,
    pub(super) prefill_tokens: u64,
    pub(super) prefill_done: bool,
    pub(super) expected_output_tokens: u64,
    pub(super) output_blocks: u64,
    pub(super) created: Instant,
    pub(super) expires_at: Option<Instant>,
    /// The rank's booked prefill tokens and decode blocks just before this booking was
    /// added: what a selection saw, for the decode drag's observation (`drag.rs`).
    pub(super) load_before: (u64, u64),
}

/// The bounded memory of recently freed ids of one shard (FIFO eviction).
#[derive(Default)]
pub(super) struct RecentlyFreed {
    pub(super) order: VecDeque<SelectionId>,
    pub(super) by: MixMap<SelectionId, FreedBy>,
}

impl RecentlyFreed {
    pub(super) fn record(&mut self, id: SelectionId, by: FreedBy, cap: usize) {
        if cap == 0 {
            return;
        }
        if self.order.capacity() == 0 {
            // Once, at the shard's first free: the whole bounded memory, so freeing
            // allocates nothing after it.
            self.order.reserve_exact(cap + 1);
            self.by.reserve(cap + 1);
        }
        if self.by.insert(id, by).is_none() {
            self.order.push_back(id);
            if self.order.len() > cap {
                if let Some(old) = self.order.pop_front() {
                    self.by.remove(&old);
                }
            }
        }
    }

    pub(super) fn get(&self, id: SelectionId) -> Option<FreedBy> {
        self.by.get(&id).copied()
    }
}

#[derive(Default)]
pub(super) struct Shard {
    pub(super) live: MixMap<SelectionId, Booking>,
    pub(super) freed: RecentlyFreed,
    /// No live booking of this shard expires before this (a lower bound, exact after a
    /// sweep); `None` = none expires. Lets a sweep skip a shard without scanning it.
    pub(super) earliest_expiry: Option<Instant>,
}
