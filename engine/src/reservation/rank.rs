//! Per-rank state: a rank's three live counters, read by selection without a lock, and
//! behind the rank's mutex the refcount of each of its active prompt blocks (points 4 and
//! 5 of the module docs), with the atomic add every counter increment goes through. Also
//! the deterministic hasher of the table's maps.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use crossbeam_utils::CachePadded;

use super::floor::{FloorKind, LoadFloor, GROUP_RANKS};
use super::types::ActiveLoad;
use crate::ids::RankId;
use crate::sync::atomic::{AtomicU64, Ordering};
#[cfg(loom)]
use crate::sync::faults;
use crate::sync::{Arc, Mutex};

/// Deterministic on purpose (loom replays executions and needs the same map layout); the
/// index's one cheap hasher for 64-bit keys (selection ids may be sequential; block hashes
/// are already random).
type Mix = crate::hash::mix::HashMix;
pub(super) type MixMap<K, V> = HashMap<K, V, BuildHasherDefault<Mix>>;

/// The rank registry's snapshot: rank → counter set, and the same states in rank order,
/// so a selection reads its candidates' counters in one ordered walk (no hash probe per
/// candidate, and the next states' lines prefetched; see [`LoadCursor`]). Copied and
/// rebuilt on a rank's first booking and on its removal only.
///
/// [`LoadCursor`]: super::loads::LoadCursor
#[derive(Clone, Default)]
pub(super) struct RankMap {
    map: MixMap<RankId, Arc<RankState>>,
    /// Each state beside its rank, so the ordered walk compares ranks without touching
    /// the states it passes.
    by_rank: Vec<(RankId, Arc<RankState>)>,
    /// Each rank's floor group number (its state's `group`), by position in `by_rank`:
    /// a rebuild reads these instead of every state's line.
    group_no: Vec<u32>,
    /// Every floor group ever made, by group number; one with no member left is filled
    /// again first (so their number follows the most ranks ever registered at once, not
    /// every rank ever seen).
    floors: Vec<Arc<LoadFloor>>,
    /// The groups with members: positions in `by_rank` and the membership version.
    groups: Vec<FloorGroup>,
    /// `by_rank` position → index in `groups`.
    group_at: Vec<u32>,
    /// The ranks' fingerprint ([`crate::ids::RankId::fingerprint`] summed), to tell a
    /// selection whether the worker set lists the same ranks.
    fingerprint: u64,
}

/// One group of ranks under one [`LoadFloor`], as a registry snapshot lists it.
#[derive(Clone)]
pub(crate) struct FloorGroup {
    pub(crate) floor: Arc<LoadFloor>,
    /// The group's number (`RankState::group`).
    pub(crate) number: u32,
    /// Positions of the members in the snapshot's rank order.
    pub(crate) members: Vec<u32>,
    /// The floor's membership version when this snapshot was built (`floor.rs`).
    pub(crate) version: u8,
}

impl RankMap {
    /// New counter sets for `ranks` (none of them in the map, no rank twice), each placed
    /// in a floor group with room (first fit, new groups after the last) and joined to
    /// it: to be published with [`with_all`](Self::with_all) on the returned floors.
    pub(super) fn fresh_states(
        &self,
        ranks: &[RankId],
    ) -> (Vec<Arc<RankState>>, Vec<Arc<LoadFloor>>) {
        let mut floors = self.floors.clone();
        let mut room: Vec<usize> = vec![GROUP_RANKS; floors.len()];
        for g in &self.groups {
            room[g.number as usize] -= g.members.len();
        }
        let mut g = 0;
        let states = ranks
            .iter()
            .map(|&rank| {
                while g < room.len() && room[g] == 0 {
                    g += 1;
                }
                if g == room.len() {
                    floors.push(Arc::new(LoadFloor::default()));
                    room.push(GROUP_RANKS);
                }
                room[g] -= 1;
                floors[g].join();
                Arc::new(RankState::new(rank, g as u32, floors[g].clone()))
            })
            .collect();
        (states, floors)
    }

    /// The map with every one of `states` added (made by [`fresh_states`] with `floors`):
    /// merged into the rank order, not sorted again.
    ///
    /// [`fresh_states`]: Self::fresh_states
    pub(super) fn with_all(
        &self,
        states: Vec<Arc<RankState>>,
        floors: Vec<Arc<LoadFloor>>,
    ) -> Self {
        let mut map = self.map.clone();
        let mut fresh: Vec<(RankId, u32, Arc<RankState>)> =
            states.into_iter().map(|s| (s.rank, s.group, s)).collect();
        fresh.sort_unstable_by_key(|(r, _, _)| *r);
        let n = self.by_rank.len() + fresh.len();
        let (mut by_rank, mut group_no) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let mut old = self.by_rank.iter().zip(&self.group_no).peekable();
        for (rank, g, state) in fresh {
            while let Some(((r, s), &og)) = old.next_if(|((r, _), _)| *r < rank) {
                by_rank.push((*r, s.clone()));
                group_no.push(og);
            }
            map.insert(rank, state.clone());
            by_rank.push((rank, state));
            group_no.push(g);
        }
        for ((r, s), &og) in old {
            by_rank.push((*r, s.clone()));
            group_no.push(og);
        }
        Self::of(map, by_rank, group_no, floors)
    }

    /// The map without any of `ranks`.
    pub(super) fn without_all(&self, ranks: &[RankId]) -> Self {
        let mut map = self.map.clone();
        for r in ranks {
            map.remove(r);
        }
        let mut gone = ranks.to_vec();
        gone.sort_unstable();
        let (by_rank, group_no) = self
            .by_rank
            .iter()
            .zip(&self.group_no)
            .filter(|((r, _), _)| gone.binary_search(r).is_err())
            .map(|((r, s), &g)| ((*r, s.clone()), g))
            .unzip();
        Self::of(map, by_rank, group_no, self.floors.clone())
    }

    fn of(
        map: MixMap<RankId, Arc<RankState>>,
        by_rank: Vec<(RankId, Arc<RankState>)>,
        group_no: Vec<u32>,
        floors: Vec<Arc<LoadFloor>>,
    ) -> Self {
        let mut index_of: Vec<u32> = vec![u32::MAX; floors.len()];
        let mut groups: Vec<FloorGroup> = Vec::new();
        let mut group_at = Vec::with_capacity(by_rank.len());
        let mut fingerprint = 0u64;
        for (pos, ((rank, _), &g)) in by_rank.iter().zip(&group_no).enumerate() {
            fingerprint = fingerprint.wrapping_add(rank.fingerprint());
            let g = g as usize;
            if index_of[g] == u32::MAX {
                index_of[g] = groups.len() as u32;
                groups.push(FloorGroup {
                    floor: floors[g].clone(),
                    number: g as u32,
                    members: Vec::with_capacity(GROUP_RANKS),
                    version: floors[g].version_now(),
                });
            }
            groups[index_of[g] as usize].members.push(pos as u32);
            group_at.push(index_of[g]);
        }
        Self {
            map,
            by_rank,
            group_no,
            floors,
            groups,
            group_at,
            fingerprint,
        }
    }

    /// The states in rank order.
    pub(super) fn in_rank_order(&self) -> &[(RankId, Arc<RankState>)] {
        &self.by_rank
    }

    /// The floor groups with members.
    pub(super) fn groups(&self) -> &[FloorGroup] {
        &self.groups
    }

    /// `in_rank_order` position → index in [`groups`](Self::groups).
    pub(super) fn group_at(&self) -> &[u32] {
        &self.group_at
    }

    pub(super) fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

impl std::ops::Deref for RankMap {
    type Target = MixMap<RankId, Arc<RankState>>;

    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

/// A rank's counters (lock-free reads) and prompt-block refcounts (behind its mutex).
pub(super) struct RankState {
    pub(super) rank: RankId,
    /// The rank's floor group (its number in the registry) and that group's floor, which
    /// every decrement of a counter lowers.
    pub(super) group: u32,
    pub(super) floor: Arc<LoadFloor>,
    pub(super) counters: CachePadded<Counters>,
    pub(super) blocks: Mutex<RankBlocks>,
}

impl Counters {
    /// The counter a floor kind bounds.
    #[inline]
    pub(super) fn of(&self, kind: FloorKind) -> &AtomicU64 {
        match kind {
            FloorKind::PrefillTokens => &self.prefill_tokens,
            FloorKind::DecodeBlocks => &self.decode_blocks,
            FloorKind::Requests => &self.requests,
        }
    }

    /// The other counter of the combined figure (`floor.rs`): decode blocks for prefill
    /// tokens and back; none for requests.
    #[inline]
    pub(super) fn partner(&self, kind: FloorKind) -> Option<&AtomicU64> {
        match kind {
            FloorKind::PrefillTokens => Some(&self.decode_blocks),
            FloorKind::DecodeBlocks => Some(&self.prefill_tokens),
            FloorKind::Requests => None,
        }
    }
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) prefill_tokens: AtomicU64,
    pub(super) decode_blocks: AtomicU64,
    pub(super) requests: AtomicU64,
    /// Distinct active prompt blocks (= the refcount map's length), so a rank with none
    /// answers `new_blocks_not_active` without its lock.
    pub(super) prompt_blocks: AtomicU64,
    /// When the rank's latest prefill completed, ns from the table's epoch (advanced by
    /// `fetch_max`: the prefill-rate estimator's service windows, `rate.rs`).
    pub(super) last_prefill_done_ns: AtomicU64,
}

/// The prompt-block map capacity an idle rank keeps (see [`RankBlocks::maybe_shrink`]).
pub(super) const IDLE_KEPT_CAPACITY: usize = 8_192;

#[derive(Default)]
pub(super) struct RankBlocks {
    /// Active prompt block → number of live bookings on this rank that hold it (≥ 1;
    /// an entry is removed when it reaches 0).
    pub(super) refs: MixMap<u64, u64>,
    /// Set (under this mutex) when the rank is removed: a booking that finds it set
    /// retries with the rank's new state, so none is added to a dead counter set.
    pub(super) retired: bool,
}

impl RankBlocks {
    /// Gives memory back once the rank has gone (mostly) idle, so a burst does not pin
    /// its high-water mark forever. An idle rank keeps a map of up to
    /// [`IDLE_KEPT_CAPACITY`] entries (~140 KiB), so that booking and freeing one prompt
    /// of up to 4,096 blocks at a time reuses it instead of regrowing it every booking.
    pub(super) fn maybe_shrink(&mut self) {
        let cap = self.refs.capacity();
        if self.refs.is_empty() {
            if cap > IDLE_KEPT_CAPACITY {
                self.refs = MixMap::default();
            }
        } else if cap > 256 && self.refs.len() * 8 < cap {
            self.refs.shrink_to(self.refs.len() * 2);
        }
    }
}

impl RankState {
    pub(super) fn new(rank: RankId, group: u32, floor: Arc<LoadFloor>) -> Self {
        Self {
            rank,
            group,
            floor,
            counters: CachePadded::new(Counters::default()),
            blocks: Mutex::new(RankBlocks::default()),
        }
    }

    /// Where the counters' line is (for a prefetch hint; never dereferenced through it).
    #[inline]
    pub(super) fn counters_addr(&self) -> *const u8 {
        (&*self.counters as *const Counters).cast()
    }

    pub(super) fn load(&self) -> ActiveLoad {
        self.load_ordered(Ordering::Relaxed)
    }

    /// The counters, each read with `order`.
    #[inline]
    fn load_ordered(&self, order: Ordering) -> ActiveLoad {
        ActiveLoad {
            active_prefill_tokens: self.counters.prefill_tokens.load(order),
            active_decode_blocks: self.counters.decode_blocks.load(order),
            active_requests: self.counters.requests.load(order),
        }
    }

    /// The counters read with `Acquire`: the idle-group model (`loom_models::idle`)
    /// observes through them the order in which a booking moved them and its group's count.
    #[cfg(loom)]
    pub(super) fn load_acquire(&self) -> ActiveLoad {
        self.load_ordered(Ordering::Acquire)
    }

    pub(super) fn new_blocks_not_active(&self, blocks: &[u64]) -> u64 {
        if blocks.is_empty() || self.counters.prompt_blocks.load(Ordering::Relaxed) == 0 {
            return blocks.len() as u64;
        }
        let b = self.blocks.lock();
        blocks.iter().filter(|h| !b.refs.contains_key(h)).count() as u64
    }

    pub(super) fn new_blocks_not_active_chain(&self, chain: &[u64]) -> u64 {
        if chain.is_empty() || self.counters.prompt_blocks.load(Ordering::Relaxed) == 0 {
            return chain.len() as u64;
        }
        let b = self.blocks.lock();
        let active = |h: &u64| b.refs.contains_key(h);
        // The common answers take one lookup each: the first block is not active (nothing
        // of the chain is), or the last one is (all of it is).
        let n = chain.len();
        if !active(&chain[0]) {
            return n as u64;
        }
        if active(&chain[n - 1]) {
            return 0;
        }
        (n - 1 - chain[1..n - 1].partition_point(active)) as u64
    }
}

/// Adds to a counter (an atomic read-modify-write; see the module docs, point 4).
#[inline]
pub(super) fn add(counter: &AtomicU64, n: u64) {
    if n != 0 {
        add_reading(counter, n);
    }
}

/// Adds to a counter and returns what it held before, always as one read-modify-write,
/// even of zero. A booking learns its rank's load this way rather than by a separate
/// load: the read-modify-write sees the latest value, so under loom it adds far fewer
/// interleavings than a relaxed load, which may read any of several stores.
#[inline]
pub(super) fn add_reading(counter: &AtomicU64, n: u64) -> u64 {
    #[cfg(loom)]
    if faults::get().split_counter_rmw {
        let v = counter.load(Ordering::Relaxed);
        counter.store(v + n, Ordering::Relaxed);
        return v;
    }
    // Release: a reader that sees this also sees the booking's step on its group's
    // count, made before it (`idle.rs`).
    counter.fetch_add(n, Ordering::Release)
}
