//! Events on the run index.
//!
//! A store walks down the trie from its parent block (or the root), one run at a time,
//! under that run's mutex: a block whose local hash is the run's next one is that block;
//! else a child hanging there is followed; else the run is extended at its end, or a new
//! child starts. The stretch of blocks placed in one run is recorded in the rank's maps,
//! and once the event is applied every run it touched gets this rank's cover republished.
//! A writer pins each run it enters until that publish, so a run cannot die between a
//! writer placing blocks in it and the writer counting itself among its holders.

use smallvec::SmallVec;

use super::bookkeeping::{drop_name, settle, Touched, PREFETCH_AHEAD};
use super::event::{ApplyOutcome, IndexError, KvEvent, StoredBlock};
use super::hold::{Cover, Hold};
use super::place::{Place, RunTable};
use super::ranks::{RankEntry, Tally};
use super::run::{retire_run, BlockRef, Run, RunWriter, MAX_RUN};
use super::{Index, RankWriter};
use crate::ids::{RankId, Tier};
use crate::sync::atomic::Ordering;
use crate::sync::{epoch, MutexGuard};

/// The places of one stretch of a store (on the stack for stretches up to 128 blocks).
type Places = SmallVec<[BlockRef; 128]>;

/// A branch key already names another triple: the blocks behind it are not indexed.
struct Collision;

/// A run this rank holds or has pinned, from its address.
///
/// # Safety
/// `addr` names a run that the calling writer holds blocks of, or has pinned: such a run
/// is not retired.
unsafe fn run_at<'a>(addr: usize) -> &'a Run {
    // SAFETY: forwarded.
    unsafe { &*(addr as *const Run) }
}

fn has_children_at(w: &RunWriter, at: u32) -> bool {
    w.branch_at.iter().any(|&(o, _)| o == at)
}

impl Index {
    /// Applies one event of `rank`. Events of one rank must be applied in order.
    pub fn apply(&self, rank: RankId, event: &KvEvent<'_>) -> Result<ApplyOutcome, IndexError> {
        match *event {
            KvEvent::Stored {
                tier,
                parent,
                blocks,
            } => self
                .store(rank, tier, parent, blocks)
                .map(|stored| ApplyOutcome {
                    stored,
                    ..Default::default()
                }),
            KvEvent::StoredKnown {
                tier,
                external_hashes,
            } => Ok(self.store_known(rank, tier, external_hashes)),
            KvEvent::Removed {
                tier,
                external_hashes,
            } => Ok(self.remove(rank, tier, external_hashes)),
            KvEvent::Cleared => Ok(ApplyOutcome {
                removed: self.clear(rank),
                ..Default::default()
            }),
            KvEvent::StatesStored {
                tier,
                external_hashes,
            } => Ok(self.store_states(rank, tier, external_hashes)),
            KvEvent::StatesRemoved {
                tier,
                external_hashes,
            } => Ok(self.remove_states(rank, tier, external_hashes)),
        }
    }

    /// Runs `f` on the rank's live writer state, creating the rank if asked.
    pub(super) fn with_writer<R>(
        &self,
        rank: RankId,
        create: bool,
        f: impl FnOnce(&RankEntry<RankWriter>, &mut RankWriter) -> R,
    ) -> Result<Option<R>, IndexError> {
        loop {
            let entry = if create {
                match self.ranks.get_or_create(rank) {
                    Some(e) => e,
                    None => {
                        self.totals.too_many_ranks.fetch_add(1, Ordering::Relaxed);
                        return Err(IndexError::TooManyRanks);
                    }
                }
            } else {
                match self.ranks.get(rank) {
                    Some(e) => e,
                    None => return Ok(None),
                }
            };
            let mut w = entry.writer.lock();
            if w.removed {
                continue;
            }
            let r = f(&entry, &mut w);
            settle(&entry, &mut w.tally);
            entry
                .counters
                .map_bytes
                .store(w.map_bytes(), Ordering::Relaxed);
            return Ok(Some(r));
        }
    }

    /// Stores `blocks` on `rank`'s `tier` after `parent`. Returns the blocks newly held on
    /// that tier. An unknown parent rejects the whole store.
    pub fn store(
        &self,
        rank: RankId,
        tier: Tier,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<usize, IndexError> {
        let create = parent.is_none() && !blocks.is_empty();
        let stored = self.with_writer(rank, create, |entry, w| {
            entry.counters.stored_events.fetch_add(1, Ordering::Relaxed);
            self.totals.stored_events.fetch_add(1, Ordering::Relaxed);
            let start = match parent {
                None => None,
                Some(p) => match w.resolve(p) {
                    Some(r) => Some(r),
                    None => {
                        entry
                            .counters
                            .parent_not_found
                            .fetch_add(1, Ordering::Relaxed);
                        self.totals.parent_not_found.fetch_add(1, Ordering::Relaxed);
                        return Err(IndexError::ParentNotFound { parent: p });
                    }
                },
            };
            self.size_once(rank, w);
            let guard = epoch::pin();
            let mut touched = Touched::default();
            let mut placed: Places = SmallVec::new();
            let mut cursor = start;
            let mut stored = 0;
            let mut i = 0;
            while i < blocks.len() {
                placed.clear();
                match self.place(cursor, &blocks[i..], &mut touched, &mut placed, &guard) {
                    Ok(n) => {
                        stored +=
                            self.record_stretch(w, tier, &blocks[i..i + n], &placed, &mut touched);
                        cursor = placed.last().copied();
                        i += n;
                    }
                    Err(Collision) => {
                        self.totals
                            .branch_collisions
                            .fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
            }
            self.finish(entry.slot, w, &touched, &guard);
            Ok(stored)
        })?;
        stored.unwrap_or_else(|| {
            self.totals.stored_events.fetch_add(1, Ordering::Relaxed);
            match parent {
                Some(p) => {
                    self.totals.parent_not_found.fetch_add(1, Ordering::Relaxed);
                    Err(IndexError::ParentNotFound { parent: p })
                }
                None => Ok(0),
            }
        })
    }

    /// Records the blocks `external_hashes` name, which `rank` already holds on some
    /// tier, as held on `tier` too (`KvEvent::StoredKnown`). Hashes the rank holds on no
    /// tier are left out and counted in `not_found`; an unknown rank holds nothing.
    pub fn store_known(&self, rank: RankId, tier: Tier, external_hashes: &[u64]) -> ApplyOutcome {
        self.totals.stored_events.fetch_add(1, Ordering::Relaxed);
        let out = self.with_writer(rank, false, |entry, w| {
            entry.counters.stored_events.fetch_add(1, Ordering::Relaxed);
            let guard = epoch::pin();
            let mut touched = Touched::default();
            let mut out = ApplyOutcome::default();
            for &external in external_hashes {
                let Some(at) = w.resolve(external) else {
                    out.not_found += 1;
                    continue;
                };
                // The rank holds a block of this run, so the run is live without a pin;
                // `finish` republishes the rank's cover there.
                touched.add(at.run_addr(), 0);
                // `record_stretch` reads only the blocks' engine names and places.
                let block = StoredBlock {
                    external_hash: external,
                    local_hash: 0,
                };
                out.stored += self.record_stretch(w, tier, &[block], &[at], &mut touched);
            }
            self.finish(entry.slot, w, &touched, &guard);
            out
        });
        match out {
            Ok(Some(out)) => out,
            // No such rank (or it went while we looked): it holds none of them.
            _ => ApplyOutcome {
                not_found: external_hashes.len(),
                ..Default::default()
            },
        }
    }

    /// Stores a chain given by its sequence hashes (first block first), each block named
    /// by its sequence hash and keyed by it too: how kvr records what it booked (the
    /// approximate index, the prediction side index), where no engine names the blocks and
    /// no local hash is known. Such an index is looked up by sequence hashes (module docs).
    /// Returns the blocks newly stored.
    pub fn store_sequences(
        &self,
        rank: RankId,
        tier: Tier,
        seqs: &[u64],
    ) -> Result<usize, IndexError> {
        self.keyed_by_sequence.store(true, Ordering::Relaxed);
        let blocks: SmallVec<[StoredBlock; 128]> = seqs
            .iter()
            .map(|&s| StoredBlock {
                external_hash: s,
                local_hash: s,
            })
            .collect();
        self.store(rank, tier, None, &blocks)
    }

    /// Places the first blocks of `rest` after `cursor` (the rank's last block, or the
    /// root): finds or makes the run the first one goes in, then takes every following
    /// block that is that run's next. Pushes their places to `out`; returns how many.
    fn place(
        &self,
        cursor: Option<BlockRef>,
        rest: &[StoredBlock],
        touched: &mut Touched,
        out: &mut Places,
        guard: &epoch::Guard,
    ) -> Result<usize, Collision> {
        let l = rest[0].local_hash;
        let room = rest.len().min(MAX_RUN as usize);
        let locals =
            || -> SmallVec<[u64; 128]> { rest[..room].iter().map(|b| b.local_hash).collect() };
        let (run, mut w, k): (&Run, MutexGuard<'_, RunWriter>, u32) = loop {
            match cursor {
                None => {
                    if let Some(r) = self.branches.find(0, 0, l, guard) {
                        let w = r.writer.lock();
                        if w.dead {
                            continue;
                        }
                        break (r, w, 0);
                    }
                    let r = self.new_run(0, 0, &locals());
                    match self.branches.link(r, guard) {
                        Ok(()) => {
                            let w = r.writer.lock();
                            break (r, w, 0);
                        }
                        Err(existing) => {
                            self.discard(r);
                            // SAFETY: a linked run, alive while `guard` is pinned.
                            let e = unsafe { &*(existing as usize as *const Run) };
                            if e.parent == 0 && e.at == 0 && e.first == l {
                                continue; // another writer made it first: use theirs
                            }
                            return Err(Collision);
                        }
                    }
                }
                Some(cur) => {
                    // SAFETY: the rank holds its cursor block, so its run is live.
                    let p = unsafe { run_at(cur.run_addr()) };
                    let k = cur.offset() + 1;
                    let mut pw = p.writer.lock();
                    debug_assert!(!pw.dead, "a run the writer holds died");
                    if k < pw.len && p.local_at(&pw, k) == l {
                        break (p, pw, k);
                    }
                    if has_children_at(&pw, k) {
                        if let Some(c) = self.branches.find(cur.run_addr(), k, l, guard) {
                            drop(pw);
                            let cw = c.writer.lock();
                            if cw.dead {
                                continue;
                            }
                            break (c, cw, 0);
                        }
                    }
                    if k == pw.len && k < MAX_RUN {
                        let before = pw.len;
                        p.append(&mut pw, &locals()[..room.min((MAX_RUN - k) as usize)]);
                        self.totals
                            .run_blocks
                            .fetch_add((pw.len - before) as i64, Ordering::Relaxed);
                        break (p, pw, k);
                    }
                    let c = self.new_run(cur.run_addr(), k, &locals());
                    match self.branches.link(c, guard) {
                        Ok(()) => {
                            pw.children += 1;
                            match pw.branch_at.iter_mut().find(|(o, _)| *o == k) {
                                Some(e) => e.1 += 1,
                                None => {
                                    let at = pw.branch_at.partition_point(|(o, _)| *o < k);
                                    pw.branch_at.insert(at, (k, 1));
                                }
                            }
                            drop(pw);
                            let cw = c.writer.lock();
                            break (c, cw, 0);
                        }
                        Err(_) => {
                            // Children of `p` are made under its lock, which we hold, and
                            // none is at (k, l): the key belongs to another triple.
                            self.discard(c);
                            return Err(Collision);
                        }
                    }
                }
            }
        };
        w.pins += 1;
        touched.add(run as *const Run as usize, 1);
        let mut j = 0u32;
        while (j as usize) < rest.len()
            && k + j < w.len
            && run.local_at(&w, k + j) == rest[j as usize].local_hash
        {
            out.push(BlockRef::new(run, k + j));
            j += 1;
        }
        debug_assert!(j >= 1);
        Ok(j as usize)
    }

    /// A new run (not linked yet), counted in the totals.
    fn new_run(&self, parent: usize, at: u32, locals: &[u64]) -> &Run {
        let p = Box::into_raw(Run::new(parent, at, locals, 0));
        // Exposed with the box's full permission: the run is freed later from its address
        // (`retire_run`, `discard`, the index's drop), not from a shared reference.
        let _ = p as usize; // an `as` cast exposes the provenance
                            // SAFETY: just allocated and initialised; freed only once unlinked and retired.
        let r: &Run = unsafe { &*p };
        self.totals.runs.fetch_add(1, Ordering::Relaxed);
        self.totals
            .run_blocks
            .fetch_add(locals.len() as i64, Ordering::Relaxed);
        r
    }

    /// Frees a run that was never linked.
    fn discard(&self, r: &Run) {
        let w = r.writer.lock();
        self.totals.runs.fetch_sub(1, Ordering::Relaxed);
        self.totals
            .run_blocks
            .fetch_sub(w.len as i64, Ordering::Relaxed);
        drop(w);
        // SAFETY: boxed by `Run::new` and leaked in `new_run`; never linked, so no one
        // else can reach it.
        drop(unsafe { Box::from_raw((r as *const Run as usize) as *mut Run) });
    }

    /// Records a stretch of a store: block `j` of `stretch` is named by its engine hash
    /// and lives at `places[j]`, all in one run. Returns the blocks the rank holds on
    /// `tier` anew. The common case (new names) takes the run's hold once for the stretch;
    /// a name that moves from another block drops that block first, as one block at a time
    /// would.
    fn record_stretch(
        &self,
        w: &mut RankWriter,
        tier: Tier,
        stretch: &[StoredBlock],
        places: &[BlockRef],
        touched: &mut Touched,
    ) -> usize {
        let t = tier as usize;
        let run = places[0].run_addr();
        let names_kept = self.engine_names && tier == Tier::Device;
        let mut stored = 0;
        let mut j = 0;
        for b in stretch.iter().take(PREFETCH_AHEAD) {
            w.blocks[t].prefetch(b.external_hash);
        }
        // Names whose insert must displace an entry wait here, their lines prefetched,
        // and go in at the end of the stretch, in order (`BlockMap::insert_or_defer`).
        // Only while the map cannot grow within the stretch: then a waiting name's buckets
        // stay full, so a repeat of it in the stretch waits too, and order is kept.
        let defer = w.blocks[t].headroom() >= stretch.len();
        let mut deferred: SmallVec<[(u64, Place); 32]> = SmallVec::new();
        while j < stretch.len() {
            // The block whose name moved from another block, if the loop stopped at one.
            let mut moved = None;
            let held = {
                let RankWriter {
                    blocks,
                    holds,
                    runs,
                    names,
                    tally,
                    hold_heap,
                    aliases,
                    ..
                } = &mut *w;
                with_hold(holds, runs, hold_heap, run, |hold| {
                    while j < stretch.len() {
                        if let Some(next) = stretch.get(j + PREFETCH_AHEAD) {
                            blocks[t].prefetch(next.external_hash);
                        }
                        let (external, r) = (stretch[j].external_hash, places[j]);
                        if names_kept {
                            names.insert(r.0, external);
                        }
                        let p = RunTable::place(hold.run_index, r.offset());
                        let done = if defer {
                            blocks[t].insert_or_defer(external, p)
                        } else {
                            Ok(blocks[t].insert(external, p))
                        };
                        match done {
                            Ok(Some(old)) if old == p => {
                                j += 1;
                                continue;
                            }
                            Ok(Some(old)) => {
                                moved = Some(old);
                                break;
                            }
                            Ok(None) => {}
                            // Absent, so held anew as an insert would find it.
                            Err(()) => deferred.push((external, p)),
                        }
                        stored += hold_block(hold, tally, &mut aliases[t], t, r) as usize;
                        j += 1;
                    }
                })
            };
            if held.is_none() {
                self.refuse_unheld(stretch.len() - j);
                break;
            }
            if let Some(old) = moved {
                // The map entry now names block `j`, so the block the name left goes now.
                let old = w.runs.block_ref(old);
                drop_name(w, t, old, touched);
                let r = places[j];
                let RankWriter {
                    holds,
                    runs,
                    tally,
                    hold_heap,
                    aliases,
                    ..
                } = &mut *w;
                // The loop above made the rank's hold of `run`, and holds go only in
                // `finish`, so this finds it (no run-table index is taken).
                let new = with_hold(holds, runs, hold_heap, run, |hold| {
                    hold_block(hold, tally, &mut aliases[t], t, r)
                });
                debug_assert!(new.is_some(), "the hold of the stretch's run went");
                stored += new.unwrap_or(false) as usize;
                j += 1;
            }
        }
        for (external, p) in deferred {
            // Found absent and held; a repeat of the name later in the stretch (which
            // waited too) moves it here, as it would have in order.
            if let Some(old) = w.blocks[t].insert(external, p).filter(|&old| old != p) {
                let old = w.runs.block_ref(old);
                drop_name(w, t, old, touched);
            }
        }
        // The run is already among those touched: `place` pinned it.
        stored
    }

    /// Counts blocks a store leaves unindexed because the rank's run table is full.
    fn refuse_unheld(&self, blocks: usize) {
        self.totals
            .held_run_limit
            .fetch_add(blocks as u64, Ordering::Relaxed);
    }

    /// Publishes this rank's new cover in every run the event touched, releases its pins,
    /// and retires runs left with no holder, child or writer.
    pub(super) fn finish(
        &self,
        slot: u32,
        w: &mut RankWriter,
        touched: &Touched,
        guard: &epoch::Guard,
    ) {
        #[cfg(loom)]
        if crate::sync::faults::get().keep_orphaned_states {
            w.states.orphaned.clear();
        }
        #[cfg(loom)]
        let late = crate::sync::faults::get().drop_orphans_late;
        #[cfg(not(loom))]
        let late = false;
        if !late && !w.states.orphaned.is_empty() {
            // Before any cover goes: a run may be retired below (`recurrent`'s invariant).
            w.states.drop_orphans(&self.states, slot, guard);
        }
        for &(addr, pins) in &touched.runs {
            // SAFETY: the rank held blocks of it before this event or pinned it.
            let run = unsafe { run_at(addr) };
            let (cover, counted, empty) = match w.holds.get(&addr) {
                Some(h) => (h.cover(slot), h.counted, h.is_empty()),
                None => (Cover::default(), false, true),
            };
            let mut rw = run.writer.lock();
            if !empty && !counted {
                rw.holds += 1;
                if let Some(h) = w.holds.get_mut(&addr) {
                    h.counted = true;
                }
            }
            if empty {
                if counted {
                    rw.holds -= 1;
                }
                if let Some(h) = w.holds.remove(&addr) {
                    w.hold_heap -= h.heap_bytes();
                    w.runs.release(h.run_index);
                }
            }
            rw.pins -= pins;
            let v = run.view(guard);
            let old = v.cover(slot).copied();
            let new = (!cover.is_empty()).then_some(cover);
            if old != new || v.len != rw.len as usize {
                let mut covers: SmallVec<[Cover; 8]> = v
                    .covers
                    .iter()
                    .filter(|c| c.slot != slot)
                    .copied()
                    .collect();
                if let Some(c) = new {
                    let at = covers.partition_point(|x| x.slot < slot);
                    covers.insert(at, c);
                }
                run.publish(&mut rw, &covers, guard);
                let bytes = run.bytes(&rw, covers.len()) as u32;
                self.totals
                    .run_bytes
                    .fetch_add(bytes as i64 - rw.accounted as i64, Ordering::Relaxed);
                rw.accounted = bytes;
            }
            self.reap(run, rw, guard);
        }
        if late {
            w.states.drop_orphans(&self.states, slot, guard);
        }
    }

    /// Retires `run` if nothing keeps it (no holder, child or writer), then its parent if
    /// that leaves the parent with nothing either.
    fn reap<'a>(&self, mut run: &'a Run, mut rw: MutexGuard<'a, RunWriter>, guard: &epoch::Guard) {
        loop {
            if rw.holds != 0 || rw.pins != 0 || rw.children != 0 || rw.dead {
                return;
            }
            rw.dead = true;
            self.branches.unlink(run, guard);
            self.totals.runs.fetch_sub(1, Ordering::Relaxed);
            self.totals
                .run_bytes
                .fetch_sub(rw.accounted as i64, Ordering::Relaxed);
            self.totals
                .run_blocks
                .fetch_sub(rw.len as i64, Ordering::Relaxed);
            let (parent, at) = (run.parent, run.at);
            drop(rw);
            // SAFETY: unlinked just now under its lock (no new writer can enter: `dead`),
            // held by no rank and pinned by no writer, so no rank map names it; boxed by
            // `Run::new`; retired once (`dead` was unset).
            unsafe { retire_run(run, guard) };
            if parent == 0 {
                return;
            }
            // SAFETY: the parent counted this run among its children until the lines
            // below, so it has not been retired.
            run = unsafe { run_at(parent) };
            rw = run.writer.lock();
            rw.children -= 1;
            if let Some(i) = rw.branch_at.iter().position(|(o, _)| *o == at) {
                rw.branch_at[i].1 -= 1;
                if rw.branch_at[i].1 == 0 {
                    rw.branch_at.remove(i);
                }
            }
        }
    }
}

/// `f` on the rank's hold of `run` (a new, empty one if it has none, with an index in the
/// rank's run table), keeping the writer's count of hold heap bytes in step with what `f`
/// did to it. `None` (and `f` not run) if the rank has no hold of `run` and its table is
/// full.
fn with_hold<R>(
    holds: &mut crate::hash::mix::HashMixMap<usize, Hold>,
    runs: &mut RunTable,
    hold_heap: &mut usize,
    run: usize,
    f: impl FnOnce(&mut Hold) -> R,
) -> Option<R> {
    use std::collections::hash_map::Entry;
    let hold = match holds.entry(run) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => e.insert(Hold::new(runs.take(run)?)),
    };
    let heap = hold.heap_bytes();
    let out = f(hold);
    *hold_heap = *hold_heap + hold.heap_bytes() - heap;
    Some(out)
}

/// The rank now names the block at `r` on tier `t` (`hold` is its hold of `r`'s run):
/// holds it anew (returns true) or counts one more name of a block it held already.
fn hold_block(
    hold: &mut Hold,
    tally: &mut Tally,
    aliases: &mut crate::hash::mix::HashMixMap<u64, u32>,
    t: usize,
    r: BlockRef,
) -> bool {
    let any = hold.has_any(r.offset());
    if !hold.set(t, r.offset()) {
        // Another engine hash of this rank already names this block.
        *aliases.entry(r.0).or_insert(0) += 1;
        return false;
    }
    tally.tier_blocks[t] += 1;
    if !any {
        tally.holder_blocks += 1;
    }
    true
}
