//! One simulated rank's paged KV cache: vLLM's prefix caching in miniature.
//!
//! `capacity` blocks in all. A *cached* block is a complete prompt block known by its
//! engine hash: it can be matched by later prompts, and while no running request holds
//! it, it sits in an LRU list and may be evicted (which the engine reports as a
//! `BlockRemoved`). An *anonymous* block (a prompt's partial last block, output tokens, or
//! a prompt block still being computed) only takes room. As in vLLM:
//!
//! * a prompt's cached prefix is the run of its leading block hashes present in the cache;
//! * blocks become matchable once computed — here, when the request's prefill ends (then
//!   the engine reports them in a `BlockStored`);
//! * a request that ends releases its blocks in reverse order, so a chain's tail is
//!   evicted before its head;
//! * a block found in the cache *after* the first miss (its parent was evicted and is
//!   being recomputed) is reused rather than stored twice — the event stream never names
//!   a block twice.

use std::collections::HashMap;

use kvr::ingress::Medium;
use kvr_emulator::BatchEncoder;
use xxhash_rust::xxh3::xxh3_64_with_seed;

const NIL: u32 = u32::MAX;

struct Slot {
    hash: u64,
    refs: u32,
    prev: u32,
    next: u32,
}

/// What admitting a request did.
#[derive(Debug, Default)]
pub(crate) struct Admission {
    /// Leading prompt blocks that were cached (prefill skips them).
    pub hit_blocks: u32,
    /// Per complete prompt block: `true` = computed by this request (stored at prefill
    /// end), `false` = held from the cache.
    pub computed: Vec<bool>,
    /// Anonymous blocks taken beyond the complete prompt blocks.
    pub extra_blocks: u32,
    /// Output blocks cached by [`KvCache::commit_output`] (held after the prompt's).
    pub output_blocks: u32,
}

/// A run of blocks newly stored by [`KvCache::commit`]: `hashes[start..end]` chained
/// after `hashes[start - 1]` (none when `start == 0`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct StoredRun {
    pub start: usize,
    pub end: usize,
}

pub(crate) struct KvCache {
    capacity: u32,
    /// Blocks in use: cached (held or in the LRU) plus anonymous.
    used: u32,
    map: HashMap<u64, u32>,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    /// Unreferenced cached blocks, least recently used at the head.
    lru_head: u32,
    lru_tail: u32,
    lru_len: u32,
}

impl KvCache {
    pub(crate) fn new(capacity: u32) -> Self {
        KvCache {
            capacity,
            used: 0,
            map: HashMap::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
        }
    }

    #[cfg(test)]
    pub(crate) fn used(&self) -> u32 {
        self.used
    }

    /// Cached blocks (matchable), held or not.
    pub(crate) fn cached(&self) -> usize {
        self.map.len()
    }

    /// Leading `hashes` present in the cache.
    pub(crate) fn prefix_hits(&self, hashes: &[u64]) -> u32 {
        hashes
            .iter()
            .take_while(|h| self.map.contains_key(h))
            .count() as u32
    }

    fn unlink(&mut self, s: u32) {
        let (prev, next) = (self.slots[s as usize].prev, self.slots[s as usize].next);
        match prev {
            NIL => self.lru_head = next,
            p => self.slots[p as usize].next = next,
        }
        match next {
            NIL => self.lru_tail = prev,
            n => self.slots[n as usize].prev = prev,
        }
        self.lru_len -= 1;
    }

    fn push_tail(&mut self, s: u32) {
        self.slots[s as usize].prev = self.lru_tail;
        self.slots[s as usize].next = NIL;
        match self.lru_tail {
            NIL => self.lru_head = s,
            t => self.slots[t as usize].next = s,
        }
        self.lru_tail = s;
        self.lru_len += 1;
    }

    fn hold(&mut self, s: u32) {
        if self.slots[s as usize].refs == 0 {
            self.unlink(s);
        }
        self.slots[s as usize].refs += 1;
    }

    /// Admits a request whose complete prompt blocks have engine hashes `hashes` and which
    /// needs `total_blocks` blocks in all (prompt and output). Holds its cached blocks,
    /// takes room for the rest, evicting least-recently-used unheld blocks (their hashes
    /// are appended to `evicted`). `None` (and nothing changed) if it does not fit now.
    pub(crate) fn admit(
        &mut self,
        hashes: &[u64],
        total_blocks: u32,
        evicted: &mut Vec<u64>,
    ) -> Option<Admission> {
        let hit = self.prefix_hits(hashes);
        let found: Vec<Option<u32>> = hashes.iter().map(|h| self.map.get(h).copied()).collect();
        let held_from_lru = found
            .iter()
            .flatten()
            .filter(|&&s| self.slots[s as usize].refs == 0)
            .count() as u32;
        let from_cache = found.iter().filter(|f| f.is_some()).count() as u32;
        let needed = total_blocks.saturating_sub(from_cache);
        let evictable = self.lru_len - held_from_lru;
        if u64::from(self.used) + u64::from(needed)
            > u64::from(self.capacity) + u64::from(evictable)
        {
            return None;
        }
        let mut computed = Vec::with_capacity(hashes.len());
        for (i, f) in found.iter().enumerate() {
            match f {
                // Before the first miss the block is a hit; after it, the prompt is
                // recomputed from there, but a block still cached is not stored again.
                Some(s) => {
                    self.hold(*s);
                    computed.push(false);
                }
                None => {
                    debug_assert!(i as u32 >= hit);
                    computed.push(true);
                }
            }
        }
        while self.used + needed > self.capacity {
            let s = self.lru_head;
            debug_assert_ne!(s, NIL, "feasibility was checked");
            self.unlink(s);
            let h = self.slots[s as usize].hash;
            self.map.remove(&h);
            self.free_slots.push(s);
            self.used -= 1;
            evicted.push(h);
        }
        self.used += needed;
        let prompt_new = computed.iter().filter(|c| **c).count() as u32;
        Some(Admission {
            hit_blocks: hit,
            computed,
            extra_blocks: needed - prompt_new,
            output_blocks: 0,
        })
    }

    /// Prefill ended: the request's computed blocks become cached. A block another request
    /// stored meanwhile is shared instead (the anonymous copy is given back). Returns the
    /// runs of blocks newly stored, for the `BlockStored` events.
    pub(crate) fn commit(&mut self, hashes: &[u64], adm: &Admission) -> Vec<StoredRun> {
        let mut runs: Vec<StoredRun> = Vec::new();
        for (i, &h) in hashes.iter().enumerate() {
            if adm.computed[i] {
                self.store_computed(i, h, &mut runs);
            }
        }
        runs
    }

    /// A block the request computed (an anonymous block of its own, at position `i`)
    /// becomes cached, or, if another request stored it meanwhile, is shared and the
    /// anonymous copy given back. A newly stored block extends `runs`.
    fn store_computed(&mut self, i: usize, h: u64, runs: &mut Vec<StoredRun>) {
        if let Some(&s) = self.map.get(&h) {
            self.hold(s);
            self.used -= 1;
            return;
        }
        let s = self.new_slot(h);
        self.map.insert(h, s);
        match runs.last_mut() {
            Some(r) if r.end == i => r.end = i + 1,
            _ => runs.push(StoredRun {
                start: i,
                end: i + 1,
            }),
        }
    }

    /// Decode filled the blocks `hashes[from..]` (output tokens, chained on the prompt's
    /// `hashes[..from]`): they become cached out of the request's anonymous blocks, so a
    /// later turn that carries the answer reuses them (vLLM caches decode blocks too). A
    /// block already cached is shared instead. Returns the runs newly stored.
    pub(crate) fn commit_output(
        &mut self,
        hashes: &[u64],
        from: usize,
        adm: &mut Admission,
    ) -> Vec<StoredRun> {
        let mut runs: Vec<StoredRun> = Vec::new();
        let n = (hashes.len() - from).min(adm.extra_blocks as usize);
        for (i, &h) in hashes.iter().enumerate().skip(from).take(n) {
            self.store_computed(i, h, &mut runs);
        }
        adm.extra_blocks -= n as u32;
        adm.output_blocks = n as u32;
        runs
    }

    /// A slot for a newly cached block, held once.
    fn new_slot(&mut self, hash: u64) -> u32 {
        let slot = Slot {
            hash,
            refs: 1,
            prev: NIL,
            next: NIL,
        };
        match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = slot;
                s
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// The request ended: its prompt blocks and cached output blocks (`hashes`, the whole
    /// chain) are released (tail first into the LRU) and its anonymous blocks freed.
    pub(crate) fn release(&mut self, hashes: &[u64], adm: &Admission) {
        debug_assert_eq!(
            hashes.len(),
            adm.computed.len() + adm.output_blocks as usize
        );
        for h in hashes.iter().rev() {
            let s = self.map[h];
            let slot = &mut self.slots[s as usize];
            slot.refs -= 1;
            if slot.refs == 0 {
                self.push_tail(s);
            }
        }
        self.used -= adm.extra_blocks;
    }

    /// Internal consistency, for tests.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut n = 0;
        let mut s = self.lru_head;
        while s != NIL {
            if self.slots[s as usize].refs != 0 {
                return Err(format!("held block {s} in the LRU"));
            }
            n += 1;
            s = self.slots[s as usize].next;
        }
        if n != self.lru_len {
            return Err(format!("LRU length {} but {n} linked", self.lru_len));
        }
        if self.used > self.capacity {
            return Err(format!("{} blocks used of {}", self.used, self.capacity));
        }
        Ok(())
    }
}

/// The engine's block hashes, as a vLLM-like engine computes them: its own function of
/// the parent's hash and the block's tokens (not kvr's; kvr learns the mapping from
/// events). Appends the hashes of `tokens`' complete blocks after `out`'s last.
pub(crate) fn engine_hashes(
    tokens: &[u32],
    block_size: usize,
    bytes: &mut Vec<u8>,
    out: &mut Vec<u64>,
) {
    let mut parent = out.last().copied().unwrap_or(0x766c_6c6d_5f72_6f6f_u64);
    for block in tokens[out.len() * block_size..].chunks_exact(block_size) {
        bytes.clear();
        bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
        parent = xxh3_64_with_seed(bytes, parent);
        out.push(parent);
    }
}

/// Encodes a `BlockStored` per run of newly cached blocks (`hashes[run]`, chained on the
/// block before it, with their `tokens`), as vLLM publishes them. Whether any was.
pub(crate) fn encode_stored(
    enc: &mut BatchEncoder,
    runs: &[StoredRun],
    hashes: &[u64],
    tokens: &[u32],
    b: usize,
) -> bool {
    for run in runs {
        let parent = run.start.checked_sub(1).map(|p| hashes[p]);
        enc.stored(
            &hashes[run.start..run.end],
            parent,
            &tokens[run.start * b..run.end * b],
            b as u32,
            Medium::Gpu,
            None,
        );
    }
    !runs.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_hits_store_release_evict() {
        let mut c = KvCache::new(6);
        let mut ev = Vec::new();
        let a = c.admit(&[1, 2, 3], 4, &mut ev).unwrap();
        assert_eq!((a.hit_blocks, a.extra_blocks), (0, 1));
        assert_eq!(c.used(), 4);
        // Not matchable before prefill ends.
        assert_eq!(c.prefix_hits(&[1, 2]), 0);
        assert_eq!(
            c.commit(&[1, 2, 3], &a),
            vec![StoredRun { start: 0, end: 3 }]
        );
        assert_eq!(c.prefix_hits(&[1, 2, 9]), 2);
        // Shares 1, 2 while the first still runs.
        let b = c.admit(&[1, 2, 4], 3, &mut ev).unwrap();
        assert_eq!((b.hit_blocks, b.extra_blocks), (2, 0));
        assert_eq!(c.used(), 5);
        // Does not fit: 3 new blocks, 1 free, nothing evictable.
        assert!(c.admit(&[7, 8, 9], 3, &mut ev).is_none());
        assert_eq!(c.used(), 5);
        assert_eq!(
            c.commit(&[1, 2, 4], &b),
            vec![StoredRun { start: 2, end: 3 }]
        );
        c.release(&[1, 2, 3], &a);
        c.release(&[1, 2, 4], &b);
        c.check().unwrap();
        assert_eq!(c.used(), 4);
        // Needs 4: evicts the tails first (3 released before 1, 2; 4 next).
        let d = c.admit(&[7, 8, 9], 4, &mut ev).unwrap();
        assert_eq!(d.hit_blocks, 0);
        assert_eq!(ev, vec![3, 4]);
        assert_eq!(c.prefix_hits(&[1, 2]), 2);
        c.check().unwrap();
    }

    #[test]
    fn orphans_are_reused_not_stored_twice() {
        let mut c = KvCache::new(8);
        let mut ev = Vec::new();
        let a = c.admit(&[1, 2, 3], 3, &mut ev).unwrap();
        c.commit(&[1, 2, 3], &a);
        c.release(&[1, 2, 3], &a);
        // Evict exactly block 3 then 2? LRU order after release: 3, 2, 1. Fill so 3 goes.
        let f = c.admit(&[10, 11, 12, 13, 14, 15], 6, &mut ev).unwrap();
        assert_eq!(ev, vec![3]);
        c.commit(&[10, 11, 12, 13, 14, 15], &f);
        c.release(&[10, 11, 12, 13, 14, 15], &f);
        ev.clear();
        // Now a prompt 1, 2, 3: hits 1, 2; 3 recomputed and stored.
        let g = c.admit(&[1, 2, 3], 3, &mut ev).unwrap();
        assert_eq!(g.hit_blocks, 2);
        assert_eq!(
            c.commit(&[1, 2, 3], &g),
            vec![StoredRun { start: 2, end: 3 }]
        );
        c.release(&[1, 2, 3], &g);
        c.check().unwrap();
    }

    #[test]
    fn decode_blocks_become_cached_for_the_next_turn() {
        let mut c = KvCache::new(8);
        let mut ev = Vec::new();
        // Two prompt blocks, room for three more (output).
        let mut a = c.admit(&[1, 2], 5, &mut ev).unwrap();
        c.commit(&[1, 2], &a);
        assert_eq!(c.used(), 5);
        // Decode filled two blocks (the third is the answer's partial tail).
        let runs = c.commit_output(&[1, 2, 3, 4], 2, &mut a);
        assert_eq!(runs, vec![StoredRun { start: 2, end: 4 }]);
        assert_eq!((a.extra_blocks, a.output_blocks, c.used()), (1, 2, 5));
        c.release(&[1, 2, 3, 4], &a);
        c.check().unwrap();
        assert_eq!((c.used(), c.prefix_hits(&[1, 2, 3, 4, 5])), (4, 4));
    }

    #[test]
    fn concurrent_computation_of_one_block_is_shared_at_commit() {
        let mut c = KvCache::new(8);
        let mut ev = Vec::new();
        let a = c.admit(&[1, 2], 2, &mut ev).unwrap();
        let b = c.admit(&[1, 2], 2, &mut ev).unwrap();
        assert_eq!(c.used(), 4);
        assert_eq!(c.commit(&[1, 2], &a).len(), 1);
        assert!(c.commit(&[1, 2], &b).is_empty());
        assert_eq!(c.used(), 2);
        c.release(&[1, 2], &a);
        assert_eq!(c.prefix_hits(&[1, 2]), 2);
        c.release(&[1, 2], &b);
        c.check().unwrap();
        assert_eq!(c.cached(), 2);
    }
}
