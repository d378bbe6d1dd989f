//! Dynamo's pending-selection cache: `POST /select` with a `selection_id` remembers the
//! decision, and `POST /reservations {selection_id, model_name, routing_group}` books it
//! once (single use). Entries live `--selection-cache-ttl-secs` (120 s), at most
//! `--selection-cache-max-entries` (4,096) and about `--selection-cache-max-bytes`
//! (256 MiB) of prompts; the oldest go first when a bound is reached.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvr::{PartitionKey, RankId};

use crate::wire::prompt::ResolvedPrompt;

/// Bounds of the cache.
#[derive(Clone, Copy, Debug)]
pub struct PendingLimits {
    pub ttl: Duration,
    pub max_entries: usize,
    pub max_bytes: usize,
}

impl Default for PendingLimits {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(120),
            max_entries: 4096,
            max_bytes: 256 << 20,
        }
    }
}

/// A selection waiting for its claim.
#[derive(Clone, Debug)]
pub struct Pending {
    pub key: PartitionKey,
    pub rank: RankId,
    pub prompt: ResolvedPrompt,
    pub lora_name: Option<String>,
    pub expected_output_tokens: u64,
}

impl Pending {
    fn bytes(&self) -> usize {
        self.prompt.heap_bytes() + 128
    }
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<String, (Pending, Instant, u64)>,
    /// Insertion order (= expiry order, the TTL being one value): (id, generation).
    order: VecDeque<(String, u64)>,
    bytes: usize,
    generation: u64,
    evicted: u64,
}

#[derive(Debug)]
pub struct PendingCache {
    limits: PendingLimits,
    inner: Mutex<Inner>,
}

/// What `insert` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InsertOutcome {
    Inserted,
    /// The id already names a pending selection: it was replaced.
    Replaced,
    /// One prompt alone exceeds the byte budget: not cached.
    TooLarge,
}

impl PendingCache {
    pub fn new(limits: PendingLimits) -> Self {
        Self {
            limits,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn insert(&self, id: &str, p: Pending, now: Instant) -> InsertOutcome {
        let bytes = p.bytes();
        if bytes > self.limits.max_bytes {
            return InsertOutcome::TooLarge;
        }
        let mut g = self.lock();
        Self::expire(&mut g, &self.limits, now);
        let replaced = match g.entries.remove(id) {
            Some((old, _, _)) => {
                g.bytes -= old.bytes();
                true
            }
            None => false,
        };
        while !g.entries.is_empty()
            && (g.entries.len() >= self.limits.max_entries
                || g.bytes + bytes > self.limits.max_bytes)
        {
            Self::pop_oldest(&mut g);
        }
        g.generation += 1;
        let generation = g.generation;
        g.bytes += bytes;
        g.entries.insert(id.to_string(), (p, now, generation));
        g.order.push_back((id.to_string(), generation));
        if replaced {
            InsertOutcome::Replaced
        } else {
            InsertOutcome::Inserted
        }
    }

    /// Takes the pending selection of `id` in partition `key` (single use).
    pub fn take(&self, id: &str, key: &PartitionKey, now: Instant) -> Option<Pending> {
        let mut g = self.lock();
        Self::expire(&mut g, &self.limits, now);
        match g.entries.get(id) {
            Some((p, _, _)) if &p.key == key => {}
            _ => return None,
        }
        let (p, _, _) = g.entries.remove(id)?;
        g.bytes -= p.bytes();
        Some(p)
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    pub fn evicted(&self) -> u64 {
        self.lock().evicted
    }

    fn expire(g: &mut Inner, limits: &PendingLimits, now: Instant) {
        while let Some((id, generation)) = g.order.front().cloned() {
            match g.entries.get(&id) {
                Some((_, at, gen)) if *gen == generation => {
                    if now.duration_since(*at) < limits.ttl {
                        break;
                    }
                    Self::pop_oldest(g);
                }
                // Taken or replaced since: a stale order entry.
                _ => {
                    g.order.pop_front();
                }
            }
        }
    }

    fn pop_oldest(g: &mut Inner) {
        while let Some((id, generation)) = g.order.pop_front() {
            let live = matches!(g.entries.get(&id), Some((_, _, gen)) if *gen == generation);
            if live {
                let (p, _, _) = g.entries.remove(&id).expect("live entry");
                g.bytes -= p.bytes();
                g.evicted += 1;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(tokens: usize) -> Pending {
        Pending {
            key: PartitionKey::new("m", "default"),
            rank: RankId::new(1, 0),
            // `tokens` × 4 bytes of prompt, as the cache counts it (8 bytes a hash).
            prompt: ResolvedPrompt {
                hashes: vec![0; tokens.div_ceil(2)],
                prompt_tokens: tokens as u64,
                ..ResolvedPrompt::default()
            },
            lora_name: None,
            expected_output_tokens: 0,
        }
    }

    #[test]
    fn single_use_and_partition_checked() {
        let c = PendingCache::new(PendingLimits::default());
        let now = Instant::now();
        assert_eq!(c.insert("a", pending(4), now), InsertOutcome::Inserted);
        assert!(c
            .take("a", &PartitionKey::new("other", "default"), now)
            .is_none());
        assert!(c
            .take("a", &PartitionKey::new("m", "default"), now)
            .is_some());
        assert!(c
            .take("a", &PartitionKey::new("m", "default"), now)
            .is_none());
        assert_eq!(c.bytes(), 0);
    }

    #[test]
    fn bounds_evict_the_oldest() {
        let limits = PendingLimits {
            ttl: Duration::from_secs(10),
            max_entries: 2,
            max_bytes: 1 << 20,
        };
        let c = PendingCache::new(limits);
        let t0 = Instant::now();
        let key = PartitionKey::new("m", "default");
        c.insert("a", pending(1), t0);
        c.insert("b", pending(1), t0);
        c.insert("c", pending(1), t0);
        assert_eq!(c.len(), 2);
        assert!(c.take("a", &key, t0).is_none());
        assert_eq!(c.evicted(), 1);
        // TTL.
        assert!(c.take("b", &key, t0 + Duration::from_secs(11)).is_none());
        assert!(c.is_empty());
        // Bytes: a prompt over the budget is refused; big ones push out old ones.
        let small = PendingCache::new(PendingLimits {
            max_bytes: 4096,
            ..limits
        });
        assert_eq!(
            small.insert("x", pending(2000), t0),
            InsertOutcome::TooLarge
        );
        small.insert("y", pending(500), t0);
        small.insert("z", pending(500), t0);
        assert_eq!(small.len(), 1);
        assert!(small.bytes() <= 4096);
    }
}
