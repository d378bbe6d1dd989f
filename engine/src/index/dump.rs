//! The index written out as the engine events that rebuild it ([`Index::dump`]): what
//! Dynamo's `/dump` carries, so a peer (kvr's or Dynamo's) can recover from it.
//!
//! Per rank and tier, the blocks form a forest (each block's parent is a block the rank
//! holds on some tier). The dump walks it from its roots, parents first, and writes each
//! maximal unbranched run as one `Stored` event whose parent is the run's first block's
//! parent (an engine hash of the same rank, possibly on another tier, or none). Applying
//! the events in order to an empty index gives the same holders, tiers and engine names.
//!
//! A block's lineage is its place in the trie: its local hash in its run, and its parent
//! the block before it (in the run, or in the run it branches off). A block whose parent
//! the rank no longer holds (a hole left by a mid-chain removal) cannot be re-created with
//! its prefix, so it and its descendants are left out and counted: a dump never
//! overcounts what a peer will believe. An index keyed by sequence hashes (fed by
//! bookings) has no local hashes to write and dumps nothing; a hybrid rank (one that
//! announced recurrent state, `recurrent`) is left out too, its blocks counted: its
//! score depends on states the dump's events cannot carry.

use std::collections::{HashMap as StdHashMap, HashSet as StdHashSet};
use std::hash::BuildHasherDefault;

use crate::hash::mix::HashMix;

/// Maps keyed by block ids and engine hashes (words with entropy once mixed): a dump of
/// millions of blocks spends most of its time in them, so no keyed hashing.
type HashMap<K, V> = StdHashMap<K, V, BuildHasherDefault<HashMix>>;
type HashSet<K> = StdHashSet<K, BuildHasherDefault<HashMix>>;

use super::run::{BlockRef, Run};
use super::{Index, StoredBlock};
use crate::ids::{RankId, Tier};
use crate::sync::epoch;

/// A block's parent (a block id, `BlockRef`'s word) and local hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Link {
    parent: Option<u64>,
    local: u64,
}

/// One `Stored` event of a dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DumpedStore {
    /// The rank that holds the blocks.
    pub rank: RankId,
    /// The tier it holds them on.
    pub tier: Tier,
    /// The engine hash of the first block's parent.
    pub parent: Option<u64>,
    /// One unbranched run of blocks, each the child of the one before.
    pub blocks: Vec<StoredBlock>,
}

/// An index dump.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexDump {
    /// Events in an order that applies (parents first), ranks in order.
    pub stores: Vec<DumpedStore>,
    /// Held blocks that could not be written out (no lineage, or an unheld parent).
    pub skipped_blocks: u64,
    /// Only from [`Index::dump_with_holes`]: blocks a rank does not hold on the path to
    /// blocks it does (a removal in the middle of a chain), by the made-up engine names
    /// they have in `stores` (on the device tier). Storing everything, then removing
    /// these, gives the rank's trie as it was: its blocks under a hole count again once
    /// the engine stores the missing parent again.
    pub holes: Vec<(RankId, u64)>,
}

/// The made-up engine name of a hole (`IndexDump::holes`): a mix of its block id and
/// local hash, kept clear of the names the rank uses.
fn hole_name(id: u64, local: u64, taken: &mut HashSet<u64>) -> u64 {
    let mut h =
        (id ^ local.rotate_left(29) ^ 0x6b76_725f_686f_6c65).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    while !taken.insert(h) {
        h = h.wrapping_add(1);
    }
    h
}

impl Index {
    /// The index as `Stored` events (module docs). Each rank's writer lock is held while
    /// its maps are read, so a rank's part is a consistent snapshot; ranks are read one
    /// after another. Lookups are not blocked.
    pub fn dump(&self) -> IndexDump {
        self.dump_with(false)
    }

    /// [`Index::dump`], with the blocks held under holes written too (`IndexDump::holes`):
    /// what a restart of the same index needs (its own snapshot), not a peer's dump.
    pub fn dump_with_holes(&self) -> IndexDump {
        self.dump_with(true)
    }

    fn dump_with(&self, holes: bool) -> IndexDump {
        let mut out = IndexDump::default();
        if !self.keeps_lineage() {
            out.skipped_blocks = self.stats().holder_blocks;
            return out;
        }
        let guard = epoch::pin();
        // The link of a block the rank holds: under its writer lock its runs are live.
        let link_of = |id: u64| -> Link {
            let r = BlockRef(id);
            // SAFETY: the rank (whose writer lock the caller holds) holds this block, or
            // one of its descendants, so its run, and the parent run a run with a holder
            // or a child keeps, are not retired.
            let run = unsafe { &*(r.run_addr() as *const Run) };
            let local = run.view(&guard).locals[r.offset() as usize]
                .load(crate::sync::atomic::Ordering::Relaxed);
            let parent = if r.offset() > 0 {
                Some(BlockRef::new(run, r.offset() - 1).0)
            } else if run.parent != 0 {
                // SAFETY: as above (a run with a child is kept).
                let p = unsafe { &*(run.parent as *const Run) };
                Some(BlockRef::new(p, run.at - 1).0)
            } else {
                None
            };
            Link { parent, local }
        };
        let mut entries = self.ranks.entries();
        entries.sort_by_key(|e| e.id);
        for entry in entries {
            let w = entry.writer.lock();
            if w.removed {
                continue;
            }
            if w.states.is_hybrid() {
                // A hybrid rank's blocks count only up to its recurrent states, which
                // engine events of the attention group cannot carry: a peer would
                // overcount them. Left out, counted.
                out.skipped_blocks += (0..3).map(|t| w.blocks[t].len() as u64).sum::<u64>();
                continue;
            }
            // The rank's engine name of every block it holds (any tier).
            let mut name: HashMap<u64, u64> = HashMap::default();
            for t in 0..3 {
                for (external, r) in w.held(t) {
                    name.entry(r.0).or_insert(external);
                }
            }
            // Holes: the unheld ancestors of held blocks, named and written on the device
            // tier with the rest, listed to be removed after.
            let mut hole_blocks: Vec<(u64, u64)> = Vec::new();
            if holes {
                let held: Vec<u64> = name.keys().copied().collect();
                let mut taken: HashSet<u64> = name.values().copied().collect();
                for id in held {
                    let mut cur = link_of(id).parent;
                    while let Some(p) = cur.filter(|p| !name.contains_key(p)) {
                        // An ancestor of a held block: its run is kept (a run with a
                        // child is), so `link_of` may read it as it reads held ones.
                        let link = link_of(p);
                        let e = hole_name(p, link.local, &mut taken);
                        name.insert(p, e);
                        hole_blocks.push((e, p));
                        cur = link.parent;
                    }
                }
                hole_blocks.sort_unstable();
                out.holes
                    .extend(hole_blocks.iter().map(|&(e, _)| (entry.id, e)));
            }
            // A block can be re-created iff every ancestor can (held on some tier of
            // this rank, lineage known); its depth orders the events parents first, as
            // a parent may sit on another tier than its child.
            let mut ok: HashMap<u64, Option<(u32, Link)>> = HashMap::default();
            let mut depth_of = |seq: u64| -> Option<(u32, Link)> {
                // The walk from `seq` up to a block already known (or the root), memoized.
                let mut path = Vec::new();
                let mut cur = Some(seq);
                let mut base: Option<u32> = Some(0);
                while let Some(s) = cur {
                    if let Some(known) = ok.get(&s) {
                        base = known.map(|(d, _)| d + 1);
                        break;
                    }
                    match name.contains_key(&s).then(|| link_of(s)) {
                        Some(link) => {
                            path.push((s, link));
                            cur = link.parent;
                        }
                        None => {
                            ok.insert(s, None);
                            base = None;
                            break;
                        }
                    }
                }
                // `base` is the depth of the block at `path`'s far end (or None).
                while let Some((s, link)) = path.pop() {
                    ok.insert(s, base.map(|d| (d, link)));
                    base = base.map(|d| d + 1);
                }
                ok.get(&seq).copied().flatten()
            };
            let mut rank_stores: Vec<(u32, DumpedStore)> = Vec::new();
            for tier in Tier::ALL {
                let mut held: Vec<(u64, u64)> =
                    w.held(tier as usize).map(|(e, r)| (e, r.0)).collect();
                if tier == Tier::Device {
                    held.extend(hole_blocks.iter().copied());
                }
                let mut links = HashMap::with_capacity_and_hasher(held.len(), Default::default());
                for &(_, seq) in &held {
                    match depth_of(seq) {
                        Some((d, link)) => {
                            links.insert(seq, (link, d));
                        }
                        None => out.skipped_blocks += 1,
                    }
                }
                // Children by parent, for parents on this tier; roots otherwise.
                let mut children: HashMap<u64, Vec<(u64, u64)>> = HashMap::default();
                let mut stack: Vec<(Option<u64>, u64, u64)> = Vec::new();
                for &(external, seq) in &held {
                    let Some((link, _)) = links.get(&seq) else {
                        continue;
                    };
                    match link.parent {
                        Some(p) if links.contains_key(&p) => {
                            children.entry(p).or_default().push((seq, external));
                        }
                        None => stack.push((None, seq, external)),
                        // Held on another tier (re-creatable, or `depth_of` said no).
                        Some(p) => stack.push((name.get(&p).copied(), seq, external)),
                    }
                }
                // Deterministic order (engine hashes), so dumps of equal indexes are equal.
                stack.sort_unstable_by_key(|&(_, _, e)| std::cmp::Reverse(e));
                for kids in children.values_mut() {
                    kids.sort_unstable_by_key(|&(_, e)| std::cmp::Reverse(e));
                }
                while let Some((parent, seq, external)) = stack.pop() {
                    let (first, depth) = links[&seq];
                    let mut blocks = vec![StoredBlock {
                        external_hash: external,
                        local_hash: first.local,
                    }];
                    let mut cur = seq;
                    loop {
                        let kids = children.get(&cur).map_or(&[][..], Vec::as_slice);
                        if let [(s, e)] = kids {
                            blocks.push(StoredBlock {
                                external_hash: *e,
                                local_hash: links[s].0.local,
                            });
                            cur = *s;
                            continue;
                        }
                        let at = blocks.last().map(|b| b.external_hash);
                        stack.extend(kids.iter().map(|&(s, e)| (at, s, e)));
                        break;
                    }
                    rank_stores.push((
                        depth,
                        DumpedStore {
                            rank: entry.id,
                            tier,
                            parent,
                            blocks,
                        },
                    ));
                }
            }
            // Parents first: a run starts one deeper than the block it extends.
            rank_stores.sort_by_key(|(d, _)| *d);
            out.stores.extend(rank_stores.into_iter().map(|(_, s)| s));
        }
        out
    }
}
