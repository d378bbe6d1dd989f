//! One pod's KV cache, as vLLM's block manager keeps it for a full-attention model: a
//! fixed number of blocks; full blocks of computed prompts stay cached under a chained
//! engine hash (each block's hash covers its parent's) until evicted; unreferenced cached
//! blocks are evicted least recently used first, a chain's tail before its head. Pure
//! bookkeeping: it reports what changed as [`CacheEvent`]s and the pod publishes them.

use std::collections::{BTreeMap, HashMap};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// What a change did to the cache, in the order it happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// Blocks `hashes` (a chain extending `parent`) were cached with these `tokens`.
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    /// Blocks were evicted.
    Removed { hashes: Vec<u64> },
    /// Every cached block was dropped.
    Cleared,
}

/// The cache's shape.
#[derive(Clone, Copy, Debug)]
pub struct CacheConfig {
    pub block_size: u32,
    /// Blocks in all: those running requests hold plus the cached ones.
    pub capacity_blocks: usize,
    /// Folded into every engine hash (vLLM's hash seed): two pods with different seeds
    /// name the same tokens differently, as two engines do.
    pub hash_seed: u64,
}

struct Entry {
    /// Running requests holding it; at 0 it is in the LRU, evictable.
    refs: u32,
    /// Its place in the LRU while unreferenced.
    tick: u64,
    parent: Option<u64>,
    /// Cached blocks whose parent it is (only a block without any is evicted).
    children: u32,
    tokens: Vec<u32>,
}

/// Why a request was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmitError {
    /// It needs more blocks than the whole cache has: it can never run.
    TooLarge { need: usize, capacity: usize },
    /// Not now: running requests hold too much; retry when one finishes.
    NoRoom,
}

/// A request's hold on the cache, from admission to release.
#[derive(Debug)]
pub struct Admission {
    /// The engine hashes of the prompt's full blocks.
    hashes: Vec<u64>,
    /// Prompt blocks found cached at admission.
    pub matched_blocks: usize,
    /// Prompt tokens not computed (vLLM's `cached_tokens`): the matched blocks, but never
    /// the last prompt token (an engine always computes it), so at most `(len - 1) / bs`
    /// blocks.
    pub cached_tokens: usize,
    /// Cached blocks it references, in chain order.
    held: Vec<u64>,
    /// Blocks it holds outside the prefix cache (prompt blocks not yet computed, the
    /// partial block, output blocks).
    uncached: usize,
}

/// A point-in-time view of the cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheStats {
    pub capacity_blocks: usize,
    pub used_blocks: usize,
    pub cached_blocks: usize,
    pub running_requests: usize,
    /// Blocks evicted since the start.
    pub evicted_blocks: u64,
}

/// The engine hash of the root's parent (vLLM's `NONE_HASH`).
const ROOT_PARENT: u64 = 0x6b76_725f_726f_6f74;

/// The KV cache of one pod.
pub struct KvCache {
    cfg: CacheConfig,
    map: HashMap<u64, Entry>,
    lru: BTreeMap<u64, u64>,
    next_tick: u64,
    uncached: usize,
    running: usize,
    evicted: u64,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl KvCache {
    /// An empty cache. `block_size` and `capacity_blocks` must be at least 1.
    pub fn new(cfg: CacheConfig) -> Self {
        assert!(cfg.block_size > 0 && cfg.capacity_blocks > 0, "{cfg:?}");
        KvCache {
            cfg,
            map: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 0,
            uncached: 0,
            running: 0,
            evicted: 0,
        }
    }

    pub fn config(&self) -> CacheConfig {
        self.cfg
    }

    /// The engine hashes of `tokens`' full blocks, each chained to its parent's.
    pub fn block_hashes(&self, tokens: &[u32]) -> Vec<u64> {
        let bs = self.cfg.block_size as usize;
        let mut parent = ROOT_PARENT;
        let mut bytes = Vec::with_capacity(8 + 4 * bs);
        tokens
            .chunks_exact(bs)
            .map(|block| {
                bytes.clear();
                bytes.extend_from_slice(&parent.to_le_bytes());
                for t in block {
                    bytes.extend_from_slice(&t.to_le_bytes());
                }
                parent = xxh3_64_with_seed(&bytes, self.cfg.hash_seed);
                parent
            })
            .collect()
    }

    /// How many leading full blocks of `tokens` are cached now (no last-token cap).
    pub fn cached_prefix_blocks(&self, tokens: &[u32]) -> usize {
        self.matched(&self.block_hashes(tokens))
    }

    fn matched(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.map.contains_key(h))
            .count()
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            capacity_blocks: self.cfg.capacity_blocks,
            used_blocks: self.map.len() + self.uncached,
            cached_blocks: self.map.len(),
            running_requests: self.running,
            evicted_blocks: self.evicted,
        }
    }

    /// Every cached block as the tokens from its chain's root through it.
    pub fn cached_prefixes(&self) -> Vec<Vec<u32>> {
        self.map
            .keys()
            .map(|h| {
                let mut chain = Vec::new();
                let mut at = Some(*h);
                while let Some(e) = at.and_then(|h| self.map.get(&h)) {
                    chain.push(&e.tokens);
                    at = e.parent;
                }
                chain.iter().rev().flat_map(|t| t.iter().copied()).collect()
            })
            .collect()
    }

    fn reference(&mut self, h: u64) {
        let e = self.map.get_mut(&h).expect("a held block is cached");
        if e.refs == 0 {
            self.lru.remove(&e.tick);
        }
        e.refs += 1;
    }

    fn unreference(&mut self, h: u64) {
        let e = self.map.get_mut(&h).expect("a held block is cached");
        e.refs -= 1;
        if e.refs == 0 {
            self.next_tick += 1;
            e.tick = self.next_tick;
            self.lru.insert(e.tick, h);
        }
    }

    /// Evicts the least recently used unreferenced block that no cached block extends.
    fn evict_one(&mut self) -> Option<u64> {
        let (tick, h) = self
            .lru
            .iter()
            .map(|(t, h)| (*t, *h))
            .find(|(_, h)| self.map[h].children == 0)?;
        self.lru.remove(&tick);
        let e = self.map.remove(&h).expect("an LRU block is cached");
        if let Some(p) = e.parent.and_then(|p| self.map.get_mut(&p)) {
            p.children -= 1;
        }
        self.evicted += 1;
        Some(h)
    }

    /// Admits a request of `tokens` that will write `output_len` tokens: references its
    /// cached prefix and reserves the rest, evicting as needed (the evictions are pushed
    /// to `events`).
    pub fn admit(
        &mut self,
        tokens: &[u32],
        output_len: usize,
        events: &mut Vec<CacheEvent>,
    ) -> Result<Admission, AdmitError> {
        let bs = self.cfg.block_size as usize;
        let total = (tokens.len() + output_len).div_ceil(bs);
        if total > self.cfg.capacity_blocks {
            return Err(AdmitError::TooLarge {
                need: total,
                capacity: self.cfg.capacity_blocks,
            });
        }
        let hashes = self.block_hashes(tokens);
        let matched = self.matched(&hashes);
        let need = total - matched;
        let free = self.cfg.capacity_blocks - self.map.len() - self.uncached;
        // Unreferenced blocks outside the matched prefix (which is about to be held).
        let matched_idle = hashes[..matched]
            .iter()
            .filter(|h| self.map[*h].refs == 0)
            .count();
        if free + self.lru.len() - matched_idle < need {
            return Err(AdmitError::NoRoom);
        }
        for h in &hashes[..matched] {
            self.reference(*h);
        }
        let mut removed = Vec::new();
        while self.cfg.capacity_blocks - self.map.len() - self.uncached < need {
            removed.push(self.evict_one().expect("counted evictable blocks above"));
        }
        if !removed.is_empty() {
            events.push(CacheEvent::Removed { hashes: removed });
        }
        self.uncached += need;
        self.running += 1;
        let cap_blocks = tokens.len().saturating_sub(1) / bs;
        Ok(Admission {
            cached_tokens: matched.min(cap_blocks) * bs,
            matched_blocks: matched,
            held: hashes[..matched].to_vec(),
            hashes,
            uncached: need,
        })
    }

    /// The prompt of `adm` (`tokens`) is computed: its full blocks join the prefix cache
    /// (a block another request cached meanwhile is shared instead).
    pub fn finish_prefill(
        &mut self,
        adm: &mut Admission,
        tokens: &[u32],
        events: &mut Vec<CacheEvent>,
    ) {
        let bs = self.cfg.block_size as usize;
        let mut run: Option<(usize, Vec<u64>)> = None;
        let flush = |run: &mut Option<(usize, Vec<u64>)>, events: &mut Vec<CacheEvent>| {
            if let Some((start, hashes)) = run.take() {
                events.push(CacheEvent::Stored {
                    parent: start.checked_sub(1).map(|i| adm.hashes[i]),
                    tokens: tokens[start * bs..(start + hashes.len()) * bs].to_vec(),
                    hashes,
                });
            }
        };
        for j in adm.held.len()..adm.hashes.len() {
            let h = adm.hashes[j];
            adm.uncached -= 1;
            self.uncached -= 1;
            adm.held.push(h);
            if self.map.contains_key(&h) {
                flush(&mut run, events);
                self.reference(h);
                continue;
            }
            let parent = j.checked_sub(1).map(|i| adm.hashes[i]);
            if let Some(p) = parent {
                self.map.get_mut(&p).expect("the parent is held").children += 1;
            }
            let block = tokens[j * bs..(j + 1) * bs].to_vec();
            self.map.insert(
                h,
                Entry {
                    refs: 1,
                    tick: 0,
                    parent,
                    children: 0,
                    tokens: block,
                },
            );
            run.get_or_insert_with(|| (j, Vec::new())).1.push(h);
        }
        flush(&mut run, events);
    }

    /// The request of `adm` finished (or was dropped): its blocks are released, a chain's
    /// tail first so that it is evicted first.
    pub fn release(&mut self, adm: Admission) {
        for h in adm.held.iter().rev() {
            self.unreference(*h);
        }
        self.uncached -= adm.uncached;
        self.running -= 1;
    }

    /// Drops every cached block (vLLM's prefix-cache reset); refused while requests run.
    pub fn reset(&mut self, events: &mut Vec<CacheEvent>) -> Result<usize, usize> {
        if self.running > 0 {
            return Err(self.running);
        }
        let n = self.map.len();
        self.map.clear();
        self.lru.clear();
        events.push(CacheEvent::Cleared);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(capacity: usize) -> KvCache {
        KvCache::new(CacheConfig {
            block_size: 4,
            capacity_blocks: capacity,
            hash_seed: 0,
        })
    }

    fn run(c: &mut KvCache, tokens: &[u32], out: usize, ev: &mut Vec<CacheEvent>) -> Admission {
        let mut a = c.admit(tokens, out, ev).expect("admit");
        c.finish_prefill(&mut a, tokens, ev);
        a
    }

    #[test]
    fn a_repeated_prompt_hits_its_blocks_but_not_its_last_token() {
        let mut c = cache(100);
        let mut ev = Vec::new();
        let p: Vec<u32> = (0..10).collect();
        let a = run(&mut c, &p, 2, &mut ev);
        assert_eq!((a.matched_blocks, a.cached_tokens), (0, 0));
        c.release(a);
        assert_eq!(ev.len(), 1);
        match &ev[0] {
            CacheEvent::Stored {
                hashes,
                parent,
                tokens,
            } => {
                assert_eq!((hashes.len(), *parent), (2, None));
                assert_eq!(tokens, &p[..8]);
            }
            e => panic!("{e:?}"),
        }
        let a = c.admit(&p, 2, &mut ev).unwrap();
        assert_eq!((a.matched_blocks, a.cached_tokens), (2, 8));
        c.release(a);
        // Exactly two blocks long: the last token is computed, so one block is reported.
        let a = c.admit(&p[..8], 2, &mut ev).unwrap();
        assert_eq!((a.matched_blocks, a.cached_tokens), (2, 4));
        c.release(a);
        assert_eq!(c.stats().used_blocks, 2);
        assert_eq!(c.stats().running_requests, 0);
    }

    #[test]
    fn eviction_takes_the_least_recently_used_tail_first() {
        let mut c = cache(6);
        let mut ev = Vec::new();
        let a: Vec<u32> = (0..12).collect();
        let b: Vec<u32> = (100..112).collect();
        let x = run(&mut c, &a, 0, &mut ev);
        c.release(x);
        let x = run(&mut c, &b, 0, &mut ev);
        c.release(x);
        assert_eq!(c.stats().cached_blocks, 6);
        ev.clear();
        // Two new blocks: a's last two go (a is older), tail first.
        let d: Vec<u32> = (200..208).collect();
        let x = run(&mut c, &d, 0, &mut ev);
        let ha = c.block_hashes(&a);
        assert_eq!(
            ev[0],
            CacheEvent::Removed {
                hashes: vec![ha[2], ha[1]]
            }
        );
        assert_eq!(c.cached_prefix_blocks(&a), 1);
        assert_eq!(c.cached_prefix_blocks(&b), 3);
        // Everything else is held or too big.
        assert_eq!(
            c.admit(&(300..328).collect::<Vec<_>>(), 0, &mut ev)
                .unwrap_err(),
            AdmitError::TooLarge {
                need: 7,
                capacity: 6
            }
        );
        c.release(x);
        let held: Vec<Admission> = [&a[..], &b[..]]
            .iter()
            .map(|p| c.admit(p, 0, &mut ev).unwrap())
            .collect();
        assert_eq!(
            c.admit(&(400..420).collect::<Vec<_>>(), 0, &mut ev)
                .unwrap_err(),
            AdmitError::NoRoom
        );
        for h in held {
            c.release(h);
        }
        assert_eq!(c.cached_prefixes().len(), c.stats().cached_blocks);
    }

    #[test]
    fn seeds_name_the_same_tokens_differently_and_reset_clears() {
        let p: Vec<u32> = (0..8).collect();
        let mut other = cache(10);
        other.cfg.hash_seed = 7;
        let mut c = cache(10);
        assert_ne!(c.block_hashes(&p), other.block_hashes(&p));
        assert_eq!(c.block_hashes(&p), cache(1).block_hashes(&p));
        let mut ev = Vec::new();
        let a = run(&mut c, &p, 0, &mut ev);
        assert_eq!(c.reset(&mut ev), Err(1));
        c.release(a);
        assert_eq!(c.reset(&mut ev), Ok(2));
        assert_eq!(ev.last(), Some(&CacheEvent::Cleared));
        assert_eq!(c.stats().used_blocks, 0);
    }
}
