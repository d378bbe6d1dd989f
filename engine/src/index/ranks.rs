//! Ranks: their slots (what runs' covers name), the slot → rank directory readers
//! translate with (`directory`), and the registry of each rank's writer-side state.
//!
//! Writers of one rank serialize on that rank's mutex (one writer per rank is the proven
//! design); different ranks never share a writer lock here.
//!
//! Slot reuse is the one hazard: a reader that loaded a cover naming slot `s` must never
//! translate `s` into a rank that got the slot later. So a removed rank's covers are taken
//! out of the runs first, and its slot goes back to the free list only
//! through the epoch collector, after every reader pinned at that time has finished.

use super::directory::Directory;
use crate::ids::RankId;
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::{epoch, Arc, Mutex, ShardedMap};

/// Bits of a rank slot: at most 2^18 ranks per index (a bound on the slot directory,
/// which readers index by slot).
pub(crate) const SLOT_BITS: u32 = 18;
pub(crate) const MAX_SLOTS: u32 = 1 << SLOT_BITS;

/// Per-rank counters, readable without the rank's lock.
#[derive(Default)]
pub(crate) struct RankCounters {
    pub(crate) holder_blocks: AtomicU64,
    pub(crate) tier_blocks: [AtomicU64; 3],
    pub(crate) stored_events: AtomicU64,
    pub(crate) removed_events: AtomicU64,
    pub(crate) cleared_events: AtomicU64,
    pub(crate) parent_not_found: AtomicU64,
    pub(crate) block_not_found: AtomicU64,
    pub(crate) map_bytes: AtomicU64,
}

/// Counter changes of the event being applied, settled into the atomics once per event.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) tier_blocks: [i64; 3],
    pub(crate) holder_blocks: i64,
}

/// A rank's writer-side state, as the registry needs to know it.
pub(crate) trait WriterState: Default + Send {
    /// A state whose rank is already removed (what a writer that loses a race finds).
    fn removed() -> Self;
}

/// One rank known to the index.
pub(crate) struct RankEntry<W> {
    pub(crate) id: RankId,
    pub(crate) slot: u32,
    pub(crate) writer: Mutex<W>,
    pub(crate) counters: RankCounters,
}

/// Free and never-used slots.
struct SlotAllocator {
    free: Vec<u32>,
    next: u32,
    /// Slots of removed ranks, each with a flag the epoch collector raises once no reader
    /// can still hold a word naming the slot. Raising a flag is one atomic store, so a
    /// reader that happens to run the deferred work never waits on this allocator's lock.
    pending: Vec<(u32, Arc<AtomicBool>)>,
}

impl SlotAllocator {
    fn take(&mut self) -> Option<u32> {
        let mut k = 0;
        while k < self.pending.len() {
            if self.pending[k].1.load(Ordering::Acquire) {
                let (slot, _) = self.pending.swap_remove(k);
                self.free.push(slot);
            } else {
                k += 1;
            }
        }
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        if self.next < MAX_SLOTS {
            self.next += 1;
            return Some(self.next - 1);
        }
        None
    }
}

/// Slot → rank, one cell per slot, grown by doubling (module `directory` docs).
pub(crate) struct RankRegistry<W> {
    by_id: ShardedMap<RankId, Arc<RankEntry<W>>>,
    directory: Directory,
    slots: Mutex<SlotAllocator>,
}

impl<W: WriterState> RankRegistry<W> {
    pub(crate) fn new() -> Self {
        RankRegistry {
            by_id: ShardedMap::new(),
            directory: Directory::new(),
            slots: Mutex::new(SlotAllocator {
                free: Vec::new(),
                next: 0,
                pending: Vec::new(),
            }),
        }
    }

    pub(crate) fn get(&self, id: RankId) -> Option<Arc<RankEntry<W>>> {
        self.by_id.get(&id)
    }

    /// The rank's entry, created with a fresh slot on first sight. `None` when out of slots.
    pub(crate) fn get_or_create(&self, id: RankId) -> Option<Arc<RankEntry<W>>> {
        if let Some(e) = self.by_id.get(&id) {
            return Some(e);
        }
        let mut failed = false;
        let entry = self
            .by_id
            .get_or_insert_with(id, || match self.allocate(id) {
                Some(slot) => Arc::new(RankEntry {
                    id,
                    slot,
                    writer: Mutex::new(W::default()),
                    counters: RankCounters::default(),
                }),
                None => {
                    failed = true;
                    Arc::new(RankEntry {
                        id,
                        slot: u32::MAX,
                        writer: Mutex::new(W::removed()),
                        counters: RankCounters::default(),
                    })
                }
            });
        if failed || entry.slot == u32::MAX {
            self.by_id.remove(&id);
            return None;
        }
        Some(entry)
    }

    /// Takes a slot and publishes slot → rank before any holder word can name the slot.
    fn allocate(&self, id: RankId) -> Option<u32> {
        let slot = self.slots.lock().take()?;
        self.set_directory(slot, Some(id));
        Some(slot)
    }

    fn set_directory(&self, slot: u32, id: Option<RankId>) {
        self.directory.set(slot, id);
    }

    /// Translates slots to ranks for one reader, inside its epoch.
    pub(crate) fn translator<'g>(
        &self,
        guard: &'g epoch::Guard,
    ) -> impl Fn(u32) -> Option<RankId> + 'g {
        self.directory.translator(guard)
    }

    /// Cells of the slot directory (its capacity).
    #[cfg(loom)]
    pub(crate) fn directory_capacity(&self) -> usize {
        self.directory.capacity()
    }

    /// Forgets `id`: the caller has already emptied its holders. `unlisted` runs once no
    /// reader can translate the slot to the rank any more and before the slot can be
    /// reused (a removed hybrid rank's mark is cleared there). The slot is reusable once
    /// every reader pinned now has finished.
    pub(crate) fn forget(&self, entry: &RankEntry<W>, unlisted: impl FnOnce()) {
        self.by_id.remove(&entry.id);
        self.set_directory(entry.slot, None);
        unlisted();
        let reusable = Arc::new(AtomicBool::new(false));
        self.slots
            .lock()
            .pending
            .push((entry.slot, reusable.clone()));
        #[cfg(loom)]
        if crate::sync::faults::get().reuse_slot_now {
            reusable.store(true, Ordering::Release);
            return;
        }
        let guard = epoch::pin();
        guard.defer(move || reusable.store(true, Ordering::Release));
        guard.flush();
    }

    pub(crate) fn entries(&self) -> Vec<Arc<RankEntry<W>>> {
        self.by_id.entries().into_iter().map(|(_, v)| v).collect()
    }
}
