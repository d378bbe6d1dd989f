//! Recurrent state of hybrid models (attention plus Mamba or linear-attention layers).
//!
//! Why: such an engine can reuse a cached prefix only up to a block where it also holds
//! the recurrent group's state (vLLM caches that state at some block boundaries only and
//! looks for the last one inside the attention hit). The attention blocks alone would
//! overcount. So, per rank, the index keeps where its recurrent group holds a state: a
//! place in the trie (the attention block the state was announced under, by engine hash)
//! and on which tiers. A rank that announced any state is *hybrid*: its score is cut back
//! to the last block, inside its attention prefix, that carries a state (0 if none).
//!
//! Storage: the sharded lock-free table of `crate::table`, keyed by (rank slot, place),
//! its word the tier mask (bit `t` for tier `t`); a rank's hybrid mark is the key of
//! place 0 (no block's place is 0). Readers probe it inside the query's epoch guard, only
//! for hybrid ranks with a score. Each rank's writer keeps the names and places it wrote
//! ([`StateBook`]), behind its mutex.
//!
//! Invariant (what keeps a stale entry from ever counting): a rank has a state at a place
//! only while it holds the block there on some tier. A block the rank stops holding drops
//! its state in the same event, before the rank's cover there is republished, so a run can
//! only be retired (and its address reused) after every state entry naming it is gone. A
//! state announced for a block the rank does not hold is left out (counted as unknown):
//! an undercount, never an overcount. A removed rank's entries go before its slot is freed.

use smallvec::SmallVec;

use super::branch::fold;
use super::event::ApplyOutcome;
use super::query::Walk;
use super::Index;
use crate::hash::mix::HashMixMap;
use crate::ids::{RankId, Tier};
use crate::sync::atomic::Ordering;
use crate::sync::epoch;
use crate::table::{table_key, Shards};

/// The table key of `slot`'s state at `place` (place 0: the rank's hybrid mark).
#[inline(always)]
fn state_key(slot: u32, place: u64) -> u64 {
    table_key(fold(
        place ^ 0x4528_21e6_38d0_1377,
        (slot as u64) << 20 ^ 0xbe54_66cf_34e9_0c6c | 1,
    ))
}

/// The tier mask word of a rank's hybrid mark (any non-zero word would do).
const HYBRID_MARK: u64 = 1 << 8;

/// Every rank's recurrent states, readable without a lock.
pub(crate) struct StateTable {
    shards: Shards,
}

impl StateTable {
    pub(crate) fn new() -> Self {
        StateTable {
            // Small until used: most indexes never see a recurrent state.
            shards: Shards::new(4, 8),
        }
    }

    fn set(&self, slot: u32, place: u64, word: u64, guard: &epoch::Guard) {
        let key = state_key(slot, place);
        self.shards.of(key).set_word(key, word, guard);
    }

    fn get(&self, slot: u32, place: u64, guard: &epoch::Guard) -> u64 {
        let key = state_key(slot, place);
        self.shards.of(key).table(guard).probe(key).get()
    }

    /// Whether the rank in `slot` announced recurrent state (its score needs a state).
    #[inline]
    pub(crate) fn is_hybrid(&self, slot: u32, guard: &epoch::Guard) -> bool {
        self.get(slot, 0, guard) != 0
    }

    /// The longest prefix, of at most `places.len()` blocks, whose last block carries a
    /// state of the rank in `slot` on a tier of `tiers` (a mask): the walk back vLLM does.
    pub(crate) fn reusable(
        &self,
        slot: u32,
        places: &[u64],
        tiers: u64,
        guard: &epoch::Guard,
    ) -> u32 {
        (0..places.len())
            .rev()
            .find(|&j| self.get(slot, places[j], guard) & tiers != 0)
            .map_or(0, |j| j as u32 + 1)
    }

    pub(crate) fn table_bytes(&self) -> u64 {
        self.shards.table_bytes()
    }
}

/// What one rank's writer knows of its recurrent states.
#[derive(Default)]
pub(crate) struct StateBook {
    /// The rank is marked hybrid in the table.
    marked: bool,
    /// Per place with a state: the engine hash it was announced under, per tier.
    at: HashMixMap<u64, [Option<u64>; 3]>,
    /// Per tier: engine hash → place.
    names: [HashMixMap<u64, u64>; 3],
    /// Places whose block the rank stopped holding on every tier in the event being
    /// applied: their states go before the event's covers are published.
    pub(crate) orphaned: SmallVec<[u64; 4]>,
}

fn mask(tiers: &[Option<u64>; 3]) -> u64 {
    (0..3)
        .filter(|&t| tiers[t].is_some())
        .fold(0, |m, t| m | 1 << t)
}

impl StateBook {
    /// Whether any state is recorded (checked before the per-block bookkeeping).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// Whether the rank announced recurrent state (and was not removed since).
    pub(crate) fn is_hybrid(&self) -> bool {
        self.marked
    }

    /// Marks the rank hybrid (once).
    pub(crate) fn mark(&mut self, table: &StateTable, slot: u32, guard: &epoch::Guard) {
        if !self.marked {
            self.marked = true;
            table.set(slot, 0, HYBRID_MARK, guard);
        }
    }

    /// The state named `name` is held on `tier` at `place` (a block the rank holds).
    /// Returns whether it is new there.
    pub(crate) fn store(
        &mut self,
        table: &StateTable,
        slot: u32,
        tier: Tier,
        name: u64,
        place: u64,
        guard: &epoch::Guard,
    ) -> bool {
        let t = tier as usize;
        if let Some(old) = self.names[t].insert(name, place) {
            if old != place {
                // The name moved (a store after the engine reused it): drop the old one.
                self.unname(table, slot, t, name, old, guard);
            }
        }
        let tiers = self.at.entry(place).or_default();
        let fresh = tiers[t].is_none();
        if let Some(prev) = tiers[t].replace(name) {
            if prev != name {
                // Another name of this tier pointed here: the newer one now does.
                self.names[t].remove(&prev);
            }
        }
        let word = mask(tiers);
        table.set(slot, place, word, guard);
        fresh
    }

    /// The state named `name` left `tier`. Returns whether it was held.
    pub(crate) fn remove(
        &mut self,
        table: &StateTable,
        slot: u32,
        tier: Tier,
        name: u64,
        guard: &epoch::Guard,
    ) -> bool {
        let t = tier as usize;
        match self.names[t].remove(&name) {
            Some(place) => {
                self.unname(table, slot, t, name, place, guard);
                true
            }
            None => false,
        }
    }

    fn unname(
        &mut self,
        table: &StateTable,
        slot: u32,
        t: usize,
        name: u64,
        place: u64,
        guard: &epoch::Guard,
    ) {
        let Some(tiers) = self.at.get_mut(&place) else {
            return;
        };
        if tiers[t] == Some(name) {
            tiers[t] = None;
        }
        let word = mask(tiers);
        if word == 0 {
            self.at.remove(&place);
        }
        table.set(slot, place, word, guard);
    }

    /// Drops the states of the places in `orphaned` (see the field).
    pub(crate) fn drop_orphans(&mut self, table: &StateTable, slot: u32, guard: &epoch::Guard) {
        let orphaned = std::mem::take(&mut self.orphaned);
        for place in orphaned {
            if let Some(tiers) = self.at.remove(&place) {
                for (t, name) in tiers.iter().enumerate() {
                    if let Some(n) = name {
                        self.names[t].remove(n);
                    }
                }
                table.set(slot, place, 0, guard);
            }
        }
    }

    /// Drops every state (a cleared rank); keeps the hybrid mark unless `unmark` (a
    /// removed rank, whose slot will be reused).
    pub(crate) fn clear(
        &mut self,
        table: &StateTable,
        slot: u32,
        unmark: bool,
        guard: &epoch::Guard,
    ) {
        for (&place, _) in self.at.iter() {
            table.set(slot, place, 0, guard);
        }
        self.at = Default::default();
        self.names = Default::default();
        self.orphaned.clear();
        if unmark && self.marked {
            self.marked = false;
            table.set(slot, 0, 0, guard);
        }
    }

    pub(crate) fn bytes(&self) -> u64 {
        let entry = |cap: usize, size: usize| (cap * 8 / 7 * (size + 1)) as u64;
        entry(self.at.capacity(), 8 + 48)
            + self
                .names
                .iter()
                .map(|m| entry(m.capacity(), 16))
                .sum::<u64>()
    }
}

impl Index {
    /// The recurrent group of `rank` holds its state, on `tier`, at the end of the blocks
    /// `external_hashes` name ([`KvEvent::StatesStored`](super::KvEvent::StatesStored)).
    /// Marks the rank hybrid. A hash naming no block the rank holds is left out and
    /// counted in `not_found`; an unknown rank holds nothing.
    pub fn store_states(&self, rank: RankId, tier: Tier, external_hashes: &[u64]) -> ApplyOutcome {
        self.totals.stored_events.fetch_add(1, Ordering::Relaxed);
        let out = self.with_writer(rank, false, |entry, w| {
            entry.counters.stored_events.fetch_add(1, Ordering::Relaxed);
            let guard = epoch::pin();
            w.states.mark(&self.states, entry.slot, &guard);
            self.has_states.store(true, Ordering::Release);
            let mut out = ApplyOutcome::default();
            for &name in external_hashes {
                match w.resolve(name) {
                    Some(place) => {
                        let fresh =
                            w.states
                                .store(&self.states, entry.slot, tier, name, place.0, &guard);
                        out.stored += usize::from(fresh);
                    }
                    None => out.not_found += 1,
                }
            }
            out
        });
        match out {
            Ok(Some(out)) => out,
            _ => ApplyOutcome {
                not_found: external_hashes.len(),
                ..Default::default()
            },
        }
    }

    /// The recurrent group of `rank` dropped its states named `external_hashes` from
    /// `tier`. Names it does not hold there count in `not_found`.
    pub fn remove_states(&self, rank: RankId, tier: Tier, external_hashes: &[u64]) -> ApplyOutcome {
        self.totals.removed_events.fetch_add(1, Ordering::Relaxed);
        let out = self.with_writer(rank, false, |entry, w| {
            entry
                .counters
                .removed_events
                .fetch_add(1, Ordering::Relaxed);
            let guard = epoch::pin();
            let mut out = ApplyOutcome::default();
            for &name in external_hashes {
                if w.states
                    .remove(&self.states, entry.slot, tier, name, &guard)
                {
                    out.removed += 1;
                } else {
                    out.not_found += 1;
                }
            }
            out
        });
        match out {
            Ok(Some(out)) => out,
            _ => ApplyOutcome {
                not_found: external_hashes.len(),
                ..Default::default()
            },
        }
    }

    /// Cuts each hybrid rank's device score (`done`: slot, score) back to the last block
    /// inside it with a state on the device; drops ranks left with nothing.
    pub(super) fn cut_to_states(
        &self,
        locals: &[u64],
        guard: &epoch::Guard,
        done: &mut Vec<(u32, u32)>,
        places: &mut Vec<u64>,
    ) {
        if !self.has_states.load(Ordering::Acquire) {
            return;
        }
        let hybrid = |slot| self.states.is_hybrid(slot, guard);
        let need = done.iter().filter(|e| hybrid(e.0)).map(|e| e.1).max();
        if !self.walk_places(locals, need, guard, places) {
            return;
        }
        for e in done.iter_mut().filter(|e| e.1 > 0) {
            if hybrid(e.0) {
                let n = places.len().min(e.1 as usize);
                let device = 1 << Tier::Device as u64;
                e.1 = self.states.reusable(e.0, &places[..n], device, guard);
            }
        }
        done.retain(|e| e.1 > 0);
    }

    /// As [`Index::cut_to_states`] for tiered scores: the whole prefix (device, then host,
    /// then disk) is cut back to the last block with a state on any tier, keeping the
    /// device part first.
    pub(super) fn cut_tiered_to_states(
        &self,
        locals: &[u64],
        guard: &epoch::Guard,
        done: &mut Vec<Walk>,
        places: &mut Vec<u64>,
    ) {
        if !self.has_states.load(Ordering::Acquire) {
            return;
        }
        let hybrid = |slot| self.states.is_hybrid(slot, guard);
        let total = |w: &Walk| w.counts.iter().sum::<u32>();
        let need = done.iter().filter(|w| hybrid(w.slot)).map(total).max();
        if !self.walk_places(locals, need, guard, places) {
            return;
        }
        for w in done.iter_mut() {
            let t = total(w);
            if t > 0 && hybrid(w.slot) {
                let n = places.len().min(t as usize);
                let mut left = self.states.reusable(w.slot, &places[..n], 0b111, guard);
                for c in w.counts.iter_mut() {
                    *c = (*c).min(left);
                    left -= *c;
                }
            }
        }
        done.retain(|w| total(w) > 0);
    }

    /// The places of the prompt's first `need` blocks (as far as the trie has them) into
    /// `places`; `false` when no hybrid rank scored (`need` absent or 0).
    fn walk_places(
        &self,
        locals: &[u64],
        need: Option<u32>,
        guard: &epoch::Guard,
        places: &mut Vec<u64>,
    ) -> bool {
        let need = need.unwrap_or(0) as usize;
        places.clear();
        if need == 0 {
            return false;
        }
        self.places(locals, 0..need.min(locals.len()), guard, places);
        true
    }
}
