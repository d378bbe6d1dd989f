//! The KV-event stream of a fleet, as the ingest bench feeds it: one vLLM batch a rank a
//! round, each with `stores` stored chains of `chain` blocks and their tokens, and from
//! the second round on the removal of what the same rank stored a round before, so the
//! index keeps its size.
//!
//! This file depends on `kvr` and `kvr_emulator` only, so the Dynamo side-by-side bench
//! (`benches/dynamo-peer`, a workspace of its own because Dynamo's crate pins another
//! tokio) builds the same messages from the same source.

use std::sync::Arc;

use kvr::config::PartitionConfig;
use kvr::ingress::Medium;
use kvr::{Engine, Partition, PartitionKey, WorkerInfo};
use kvr_emulator::BatchEncoder;

/// Tokens a block.
pub(crate) const BS: u32 = 16;

/// The fleet and the messages' shape.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EventShape {
    pub workers: u64,
    pub dp: u32,
    pub stores: usize,
    pub chain: usize,
}

impl EventShape {
    /// 1,024 workers of 8 ranks, messages of four 16-block stores.
    pub(crate) const FLEET: EventShape = EventShape {
        workers: 1_024,
        dp: 8,
        stores: 4,
        chain: 16,
    };

    pub(crate) fn ranks(&self) -> u64 {
        self.workers * u64::from(self.dp)
    }

    /// Block-ops (stored + removed) in one full round after the first.
    pub(crate) fn ops_per_round(&self) -> u64 {
        self.ranks() * (2 * self.stores * self.chain) as u64
    }
}

/// splitmix64 over a golden-ratio counter: the stream's and the queries' random numbers.
pub(crate) struct SplitMix(pub u64);

impl SplitMix {
    pub(crate) fn next_u64(&mut self) -> u64 {
        let z = kvr::hash::splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z
    }
}

/// A partition of the shape's workers, each with `capacity` KV blocks a rank registered
/// (0: none, maps grow as blocks arrive).
pub(crate) fn partition(shape: EventShape, capacity: u64) -> (Engine, Arc<Partition>) {
    let e = Engine::with_seed(11);
    let key = PartitionKey::new("fleet", "ingest");
    let p = e
        .create_partition(key, PartitionConfig::new(BS))
        .expect("a fresh engine has no partitions");
    for w in 0..shape.workers {
        let mut info = WorkerInfo::new(w, shape.dp);
        info.total_kv_blocks = capacity;
        p.upsert_worker(info).expect("valid worker metadata");
    }
    (e, p)
}

/// Hands `msgs` to `p.ingest`; panics on a message not applied whole (a refusal or a
/// decode error would make any rate meaningless).
pub(crate) fn ingest_all(p: &Partition, msgs: &[Message]) {
    for m in msgs {
        let o = p.ingest(m.worker, m.dp, b"", m.seq, &m.payload);
        assert!(
            o.batches_applied == 1 && o.decode_errors == 0 && o.refused == 0,
            "worker {} rank {} seq {}: {o:?}",
            m.worker,
            m.dp,
            m.seq
        );
    }
}

/// One message: the publishing worker, its stream (= DP rank), the batch's sequence
/// number, the msgpack payload, and the block-ops in it.
pub(crate) struct Message {
    pub worker: u64,
    pub dp: u32,
    pub seq: u64,
    pub payload: Vec<u8>,
    pub ops: u64,
}

/// The messages of every rank, a round at a time (sequence numbers count rounds).
/// Deterministic: two generators of one shape make the same bytes.
pub(crate) struct Messages {
    shape: EventShape,
    prev: Vec<Vec<u64>>,
    next_hash: u64,
    rng: SplitMix,
    round: u64,
}

impl Messages {
    pub(crate) fn new(shape: EventShape) -> Self {
        Messages {
            shape,
            prev: vec![Vec::new(); shape.ranks() as usize],
            next_hash: 1,
            rng: SplitMix(0xf1ee7),
            round: 0,
        }
    }

    /// The next round: a message from every rank, in rank order.
    pub(crate) fn round(&mut self) -> Vec<Message> {
        let p = self.shape;
        let mut out = Vec::with_capacity(p.ranks() as usize);
        for r in 0..p.ranks() {
            let (worker, dp) = (r / u64::from(p.dp), (r % u64::from(p.dp)) as u32);
            let mut batch = BatchEncoder::new();
            let mut this = Vec::with_capacity(p.stores * p.chain);
            for _ in 0..p.stores {
                let tokens: Vec<u32> = (0..p.chain * BS as usize)
                    .map(|_| (self.rng.next_u64() >> 47) as u32)
                    .collect();
                let hashes: Vec<u64> = (0..p.chain)
                    .map(|_| {
                        self.next_hash += 1;
                        self.next_hash
                    })
                    .collect();
                batch.stored(&hashes, None, &tokens, BS, Medium::Gpu, None);
                this.extend_from_slice(&hashes);
            }
            let mut ops = this.len() as u64;
            let old = std::mem::replace(&mut self.prev[r as usize], this);
            if !old.is_empty() {
                batch.removed(&old, Medium::Gpu);
                ops += old.len() as u64;
            }
            out.push(Message {
                worker,
                dp,
                seq: self.round,
                payload: batch.finish(1.0, Some(dp)),
                ops,
            });
        }
        self.round += 1;
        out
    }
}
