//! The simulated fleet: one vLLM-style ZMQ PUB per worker, and each worker's prefix
//! cache, so that the service's index learns from the traffic it routes.
//!
//! When a request is served on a worker, the blocks of its prompt that the worker did
//! not hold are stored (`BlockStored`, chained to the deepest block it held), and the
//! least recently used blocks beyond the worker's capacity are evicted
//! (`BlockRemoved`). Within a prompt the deeper blocks get the older use stamps, so a
//! parent is always more recent than its children: eviction only ever removes leaves,
//! every cached set stays prefix-closed, and every `parent_block_hash` sent is a block
//! the worker holds, as in a real engine.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

/// A hasher for keys that are already hashes (the engine's block hashes): one
/// multiply, where the default SipHash was a tenth of the generator's CPU.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct HashKey(u64);

impl std::hash::Hasher for HashKey {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type HashKeyMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<HashKey>>;

/// One worker's prefix cache (engine block hashes), LRU with leaf-first eviction.
///
/// Stamps only grow, so the use order is a queue: a touch pushes `(stamp, hash)` at the
/// back and leaves the older entry of that hash in place, stale (its stamp no longer
/// the hash's); eviction pops from the front and skips stale entries. (A BTreeMap keyed
/// by stamp did the same at a third of the generator's CPU at 32k-token prompts.)
#[derive(Debug)]
pub(crate) struct Cache {
    capacity: usize,
    stamp_of: HashKeyMap<u64>,
    by_stamp: VecDeque<(u64, u64)>,
    clock: u64,
}

/// What serving a prompt did to a cache.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Served {
    /// Leading blocks the worker held before (the overlap a perfect index reports).
    pub cached: usize,
    pub evicted: Vec<u64>,
}

impl Cache {
    pub(crate) fn new(capacity: usize) -> Self {
        Cache {
            capacity,
            stamp_of: HashKeyMap::default(),
            by_stamp: VecDeque::new(),
            clock: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.stamp_of.len()
    }

    /// Serves a prompt of `hashes` (one per complete block, root first).
    pub(crate) fn serve(&mut self, hashes: &[u64]) -> Served {
        let cached = hashes
            .iter()
            .take_while(|h| self.stamp_of.contains_key(h))
            .count();
        // Deepest block first, so that it gets the oldest stamp of this prompt.
        for h in hashes.iter().rev() {
            self.clock += 1;
            self.stamp_of.insert(*h, self.clock);
            self.by_stamp.push_back((self.clock, *h));
        }
        let mut evicted = Vec::new();
        while self.stamp_of.len() > self.capacity {
            let (stamp, h) = self.by_stamp.pop_front().expect("every cached hash queued");
            if self.stamp_of.get(&h) == Some(&stamp) {
                self.stamp_of.remove(&h);
                evicted.push(h);
            }
        }
        // Bound the stale entries: rebuild the queue when it is mostly stale.
        if self.by_stamp.len() > 2 * self.stamp_of.len() + 1024 {
            let live = &self.stamp_of;
            self.by_stamp.retain(|(s, h)| live.get(h) == Some(s));
        }
        Served { cached, evicted }
    }
}

/// A vLLM KV-event batch (REFERENCE §2) in the positional-array encoding:
/// `[ts, [events], dp_rank]`, BlockStored as `["BlockStored", block_hashes,
/// parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]` and
/// BlockRemoved as `["BlockRemoved", block_hashes, medium]`.
#[derive(Debug, Default)]
pub(crate) struct Batch {
    buf: Vec<u8>,
    events: u32,
}

impl Batch {
    pub(crate) fn stored(
        &mut self,
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        bs: usize,
    ) {
        let b = &mut self.buf;
        rmp::encode::write_array_len(b, 8).unwrap();
        rmp::encode::write_str(b, "BlockStored").unwrap();
        rmp::encode::write_array_len(b, hashes.len() as u32).unwrap();
        for h in hashes {
            rmp::encode::write_uint(b, *h).unwrap();
        }
        match parent {
            Some(p) => rmp::encode::write_uint(b, p).map(|_| ()).unwrap(),
            None => rmp::encode::write_nil(b).unwrap(),
        }
        rmp::encode::write_array_len(b, tokens.len() as u32).unwrap();
        b.reserve(tokens.len() * 5);
        for &t in tokens {
            // rmp's write_uint per token was a sixth of the generator at 32k tokens; the
            // same smallest encodings, written as fixed-size pushes.
            match t {
                0..=0x7f => b.push(t as u8),
                0x80..=0xff => b.extend_from_slice(&[0xcc, t as u8]),
                0x100..=0xffff => {
                    let [hi, lo] = (t as u16).to_be_bytes();
                    b.extend_from_slice(&[0xcd, hi, lo]);
                }
                _ => {
                    let [a, c, d, e] = t.to_be_bytes();
                    b.extend_from_slice(&[0xce, a, c, d, e]);
                }
            }
        }
        rmp::encode::write_uint(b, bs as u64).unwrap();
        rmp::encode::write_nil(b).unwrap();
        rmp::encode::write_str(b, "GPU").unwrap();
        rmp::encode::write_nil(b).unwrap();
        self.events += 1;
    }

    pub(crate) fn removed(&mut self, hashes: &[u64]) {
        let b = &mut self.buf;
        rmp::encode::write_array_len(b, 3).unwrap();
        rmp::encode::write_str(b, "BlockRemoved").unwrap();
        rmp::encode::write_array_len(b, hashes.len() as u32).unwrap();
        for h in hashes {
            rmp::encode::write_uint(b, *h).unwrap();
        }
        rmp::encode::write_str(b, "GPU").unwrap();
        self.events += 1;
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.events == 0
    }

    pub(crate) fn finish(self) -> Bytes {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let mut out = Vec::with_capacity(self.buf.len() + 16);
        rmp::encode::write_array_len(&mut out, 3).unwrap();
        rmp::encode::write_f64(&mut out, ts).unwrap();
        rmp::encode::write_array_len(&mut out, self.events).unwrap();
        out.extend_from_slice(&self.buf);
        rmp::encode::write_uint(&mut out, 0).unwrap();
        Bytes::from(out)
    }
}

/// Counters of what the fleet published.
#[derive(Debug, Default)]
pub(crate) struct FleetStats {
    pub batches: AtomicU64,
    pub stored_blocks: AtomicU64,
    pub removed_blocks: AtomicU64,
}

struct Worker {
    cache: Cache,
    tx: mpsc::UnboundedSender<Bytes>,
}

/// The workers' caches and their publishers (worker ids are 0..n).
pub(crate) struct Fleet {
    workers: Vec<Mutex<Worker>>,
    pub block_size: usize,
    pub stats: FleetStats,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("workers", &self.workers.len())
            .finish()
    }
}

impl Fleet {
    /// Binds one PUB per worker on `127.0.0.1:{base_port + i}` (vLLM's publishers bind;
    /// the service connects to each `kv_events_endpoint`) and spawns its sender.
    pub(crate) async fn bind(
        n: usize,
        base_port: u16,
        capacity: usize,
        block_size: usize,
    ) -> Result<Arc<Fleet>, String> {
        let mut workers = Vec::with_capacity(n);
        for i in 0..n {
            let ep = format!("tcp://127.0.0.1:{}", base_port as usize + i);
            let mut socket = PubSocket::new();
            socket
                .bind(&ep)
                .await
                .map_err(|e| format!("bind {ep}: {e}"))?;
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(publish(socket, rx));
            workers.push(Mutex::new(Worker {
                cache: Cache::new(capacity),
                tx,
            }));
        }
        Ok(Arc::new(Fleet {
            workers,
            block_size,
            stats: FleetStats::default(),
        }))
    }

    pub(crate) fn len(&self) -> usize {
        self.workers.len()
    }

    /// Publishes a prebuilt batch on worker `w` (the readiness probes).
    pub(crate) fn send(&self, w: usize, batch: Batch) {
        let worker = self.workers[w].lock().unwrap();
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        let _ = worker.tx.send(batch.finish());
    }

    /// The request of `tokens` / `hashes` ran its prefill on worker `w`: update its
    /// cache and publish what changed. Returns the blocks it already held.
    pub(crate) fn serve(&self, w: usize, tokens: &[u32], hashes: &[u64]) -> usize {
        let bs = self.block_size;
        // Encode and enqueue under the worker's lock, so batches leave in cache order.
        let mut worker = self.workers[w].lock().unwrap();
        let served = worker.cache.serve(hashes);
        let mut batch = Batch::default();
        let k = served.cached;
        if k < hashes.len() {
            let parent = k.checked_sub(1).map(|p| hashes[p]);
            batch.stored(&hashes[k..], parent, &tokens[k * bs..hashes.len() * bs], bs);
            self.stats
                .stored_blocks
                .fetch_add((hashes.len() - k) as u64, Ordering::Relaxed);
        }
        if !served.evicted.is_empty() {
            batch.removed(&served.evicted);
            self.stats
                .removed_blocks
                .fetch_add(served.evicted.len() as u64, Ordering::Relaxed);
        }
        if !batch.is_empty() {
            self.stats.batches.fetch_add(1, Ordering::Relaxed);
            let _ = worker.tx.send(batch.finish());
        }
        k
    }

    /// Blocks held across the fleet (the index size a perfect index would have).
    pub(crate) fn cached_blocks(&self) -> usize {
        self.workers
            .iter()
            .map(|w| w.lock().unwrap().cache.len())
            .sum()
    }
}

/// A worker's sender: 3 frames `[topic "", seq (u64 BE, from 0), payload]`.
async fn publish(mut socket: PubSocket, mut rx: mpsc::UnboundedReceiver<Bytes>) {
    let mut seq: u64 = 0;
    while let Some(payload) = rx.recv().await {
        let mut m = ZmqMessage::from(Bytes::new());
        m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        m.push_back(payload);
        if socket.send(m).await.is_err() {
            break;
        }
        seq += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_stays_prefix_closed_and_evicts_leaves() {
        let mut c = Cache::new(6);
        assert_eq!(c.serve(&[1, 2, 3, 4]).cached, 0);
        assert_eq!(c.serve(&[1, 2, 5]).cached, 2);
        // 1,2,5 are fresher than 3,4; the leaf 4 goes before its parent 3.
        let s = c.serve(&[1, 6, 7]);
        assert_eq!(s.cached, 1);
        assert_eq!(s.evicted, vec![4]);
        assert_eq!(c.serve(&[1, 2, 3, 4]).cached, 3);
        assert_eq!(c.len(), 6);
    }

    /// The queue with stale entries evicts exactly what a by-stamp ordered map does.
    #[test]
    fn lazy_queue_evicts_as_an_ordered_map() {
        use std::collections::BTreeMap;
        let (mut c, mut want_of, mut want) = (Cache::new(50), HashMap::new(), BTreeMap::new());
        let mut clock = 0u64;
        let mut x = 7u64;
        for _ in 0..2_000 {
            x = kvr::hash::splitmix64(x);
            let root = x % 8;
            let len = 1 + (x >> 8) as usize % 20;
            let hashes: Vec<u64> = (0..len as u64).map(|d| root * 1000 + d).collect();
            let got = c.serve(&hashes);
            let cached = hashes
                .iter()
                .take_while(|h| want_of.contains_key(*h))
                .count();
            for h in hashes.iter().rev() {
                clock += 1;
                if let Some(old) = want_of.insert(*h, clock) {
                    want.remove(&old);
                }
                want.insert(clock, *h);
            }
            let mut evicted = Vec::new();
            while want_of.len() > 50 {
                let (_, h) = want.pop_first().unwrap();
                want_of.remove(&h);
                evicted.push(h);
            }
            assert_eq!(got, Served { cached, evicted });
        }
        assert!(c.by_stamp.len() <= 2 * c.len() + 1024 + 20);
    }

    /// The hand-written token encoding is rmp's smallest form of each value.
    #[test]
    fn token_encoding_matches_rmp() {
        let tokens = [0, 1, 127, 128, 255, 256, 31_999, 65_535, 65_536, u32::MAX];
        let mut b = Batch::default();
        b.stored(&[1], None, &tokens, 10);
        let mut want = Vec::new();
        for t in tokens {
            rmp::encode::write_uint(&mut want, u64::from(t)).unwrap();
        }
        assert!(b.buf.windows(want.len()).any(|w| w == want.as_slice()));
    }

    #[test]
    fn batch_layout() {
        let mut b = Batch::default();
        b.stored(&[7, 8], Some(6), &[1, 2, 3, 4], 2);
        b.removed(&[5]);
        let bytes = b.finish();
        let mut rd = &bytes[..];
        let v = rmpv::decode::read_value(&mut rd).unwrap();
        let top = v.as_array().unwrap();
        assert_eq!(top.len(), 3);
        let events = top[1].as_array().unwrap();
        let stored = events[0].as_array().unwrap();
        assert_eq!(stored.len(), 8);
        assert_eq!(stored[0].as_str(), Some("BlockStored"));
        assert_eq!(stored[2].as_u64(), Some(6));
        assert_eq!(stored[3].as_array().unwrap().len(), 4);
        assert_eq!(stored[6].as_str(), Some("GPU"));
        let removed = events[1].as_array().unwrap();
        assert_eq!(removed[0].as_str(), Some("BlockRemoved"));
        assert_eq!(removed[1].as_array().unwrap()[0].as_u64(), Some(5));
        assert_eq!(top[2].as_u64(), Some(0));
    }
}
