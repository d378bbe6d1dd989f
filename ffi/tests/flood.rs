//! A flood through every C entry that takes a worker id or a DP rank: made-up workers and
//! ranks by the ten thousand must leave the partition's state bounded by its caps (counted
//! from its stats), and every refusal must be a status that says so, never `KVR_OK`.
//! Counts only: the cost of a flood is measured by `tests/flood/measure.sh`, not here.

use std::ptr;

use kvr::ingress::{Medium, MAX_INGRESS_STREAMS, MAX_PENDING_RANKS};
use kvr_emulator::BatchEncoder;
use kvr_ffi::*;

const BS: u32 = 4;
const FLOOD: u64 = 10_000;

struct Fixture {
    engine: *mut kvr_engine,
    partition: *mut kvr_partition,
}

impl Fixture {
    /// A partition with worker 1 (dp_size 2) registered.
    fn new() -> Fixture {
        let mut engine = ptr::null_mut();
        let mut opts = ptr::null_mut();
        let mut partition = ptr::null_mut();
        let mut worker = ptr::null_mut();
        // SAFETY: every pointer is a live out-parameter or a handle made just before.
        unsafe {
            assert_eq!(kvr_engine_new(ptr::null(), &mut engine), KVR_OK);
            assert_eq!(kvr_partition_options_new(BS, &mut opts), KVR_OK);
            let (m, g) = ("m", "g");
            let st = kvr_engine_create_partition(
                engine,
                m.as_ptr().cast(),
                m.len(),
                g.as_ptr().cast(),
                g.len(),
                opts,
                &mut partition,
            );
            assert_eq!(st, KVR_OK);
            kvr_partition_options_free(opts);
            assert_eq!(kvr_worker_new(1, 2, &mut worker), KVR_OK);
            assert_eq!(kvr_partition_upsert_worker(partition, worker), KVR_OK);
            kvr_worker_free(worker);
        }
        Fixture { engine, partition }
    }

    fn index_stats(&self) -> kvr_index_stats {
        let mut s = std::mem::MaybeUninit::<kvr_index_stats>::zeroed();
        assert_eq!(
            // SAFETY: live handle, writable out.
            unsafe { kvr_partition_index_stats(self.partition, s.as_mut_ptr()) },
            KVR_OK
        );
        // SAFETY: written by the call.
        unsafe { s.assume_init() }
    }

    fn ranks(&self) -> u64 {
        let mut s = std::mem::MaybeUninit::<kvr_index_stats>::zeroed();
        assert_eq!(
            // SAFETY: live handle, writable out.
            unsafe { kvr_partition_index_stats(self.partition, s.as_mut_ptr()) },
            KVR_OK
        );
        // SAFETY: written by the call.
        unsafe { s.assume_init() }.ranks
    }

    fn streams(&self) -> usize {
        let mut n = 0usize;
        // SAFETY: live handle; an empty buffer only reports the count.
        let st = unsafe { kvr_partition_ingress_stats(self.partition, ptr::null_mut(), 0, &mut n) };
        assert!(st == KVR_OK || st == KVR_BUFFER_TOO_SMALL, "{st}");
        n
    }

    fn bookings(&self) -> (u64, u64) {
        let mut s = std::mem::MaybeUninit::<kvr_booking_stats>::zeroed();
        assert_eq!(
            // SAFETY: live handle, writable out.
            unsafe { kvr_partition_booking_stats(self.partition, s.as_mut_ptr()) },
            KVR_OK
        );
        // SAFETY: written by the call.
        let s = unsafe { s.assume_init() };
        (s.bookings, s.tracked_ranks)
    }

    fn ingress_refused(&self) -> u64 {
        let mut s = kvr_indexer_stats::default();
        assert_eq!(
            // SAFETY: live handle, writable out.
            unsafe { kvr_partition_indexer_stats(self.partition, &mut s) },
            KVR_OK
        );
        s.ingress_refused
    }

    fn apply(&self, worker: u64, dp: u32, hash: u64) -> (kvr_status, kvr_apply_result) {
        let block = kvr_stored_block {
            external_hash: hash,
            local_hash: hash,
        };
        let ev = kvr_event {
            kind: KVR_EVENT_STORED,
            tier: KVR_TIER_DEVICE,
            has_parent: 0,
            reserved: 0,
            parent: 0,
            blocks: &block,
            n_blocks: 1,
            removed: ptr::null(),
            n_removed: 0,
        };
        let mut out = kvr_apply_result::default();
        // SAFETY: live handle; one event whose array is one block.
        let st =
            unsafe { kvr_partition_apply_events(self.partition, worker, dp, &ev, 1, &mut out) };
        (st, out)
    }

    fn ingest(
        &self,
        worker: u64,
        stream: u32,
        seq: u64,
        payload: &[u8],
    ) -> (kvr_status, kvr_ingest_result) {
        let mut out = kvr_ingest_result::default();
        // SAFETY: live handle; the slices point to their lengths.
        let st = unsafe {
            kvr_partition_ingest(
                self.partition,
                worker,
                stream,
                ptr::null(),
                0,
                seq,
                payload.as_ptr(),
                payload.len(),
                &mut out,
            )
        };
        (st, out)
    }

    fn replica(&self, id: u64, worker: u64, dp: u32, ttl_ms: u64) -> kvr_status {
        let blocks = [1u64, 2];
        let b = kvr_replica_booking {
            selection_id: id,
            worker_id: worker,
            dp_rank: dp,
            reserved: 0,
            prompt_blocks: blocks.as_ptr(),
            n_prompt_blocks: blocks.len(),
            prefill_tokens: 8,
            expected_output_tokens: 0,
            ttl_ms,
        };
        // SAFETY: live handles; the booking's array points to its length.
        unsafe { kvr_partition_install_replica_booking(self.partition, &b) }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // SAFETY: handles made by `new`, freed once.
        unsafe {
            kvr_partition_free(self.partition);
            kvr_engine_free(self.engine);
        }
    }
}

fn stored(enc: &mut BatchEncoder, dp: Option<u32>, seed: u64) -> Vec<u8> {
    let tokens: Vec<u32> = (0..BS).collect();
    enc.stored(&[seed], None, &tokens, BS, Medium::Gpu, None);
    enc.finish(1.0, dp)
}

#[test]
fn apply_events_refuses_ranks_a_worker_does_not_have() {
    let f = Fixture::new();
    assert_eq!(f.apply(1, 1, 7).0, KVR_OK, "a rank of the worker");
    for dp in 2..2 + FLOOD as u32 {
        let (st, out) = f.apply(1, dp, 7);
        assert_eq!(st, KVR_ERR_UNKNOWN_RANK, "dp {dp}");
        assert_eq!((out.events_applied, out.events_rejected), (0, 1));
    }
    assert_eq!(f.apply(u64::MAX, u32::MAX, 7).0, KVR_ERR_UNKNOWN_WORKER);
    // Made-up workers: within the pending budget, then refused.
    let mut taken = 0;
    for w in 0..FLOOD {
        match f.apply(1_000 + w, 0, 7).0 {
            KVR_OK => taken += 1,
            st => assert_eq!(st, KVR_ERR_UNKNOWN_WORKER),
        }
    }
    assert_eq!(
        taken, MAX_PENDING_RANKS as u64,
        "the (MAX, MAX) rank took no place"
    );
    assert_eq!(
        f.ranks(),
        1 + taken,
        "ranks bounded by the budget, not the flood"
    );
    assert_eq!(f.ingress_refused(), FLOOD + 1 + FLOOD - taken);
}

#[test]
fn raw_ingest_refuses_with_a_status_and_keeps_streams_bounded() {
    let f = Fixture::new();
    let mut enc = BatchEncoder::new();
    let ok = stored(&mut enc, Some(1), 1);
    let (st, out) = f.ingest(1, 0, 0, &ok);
    assert_eq!((st, out.batches_applied, out.refused), (KVR_OK, 1, 0));
    // Bogus DP ranks on the registered worker's stream: refused, and said so.
    for seq in 1..=FLOOD {
        let dp = 2 + (seq as u32).wrapping_mul(2_654_435_761) % (u32::MAX - 2);
        let msg = stored(&mut enc, Some(dp), seq);
        let (st, out) = f.ingest(1, 0, seq, &msg);
        assert_eq!(st, KVR_ERR_UNKNOWN_RANK, "dp {dp}");
        assert_eq!((out.batches_applied, out.refused), (0, 1));
    }
    // Bogus stream numbers and workers: streams bounded by the caps.
    for i in 0..FLOOD {
        let msg = stored(&mut enc, None, i);
        let st = f.ingest(1, 2 + i as u32, 0, &msg).0;
        assert!(
            st == KVR_OK || st == KVR_ERR_UNKNOWN_RANK || st == KVR_ERR_TOO_MANY_RANKS,
            "{st}"
        );
        let st = f.ingest(1_000 + i, 0, 0, &msg).0;
        assert!(st == KVR_OK || st == KVR_ERR_UNKNOWN_WORKER, "{st}");
        let garbage = f
            .ingest(500_000 + i, (i % 4096) as u32, 0, b"\xc1garbage")
            .0;
        assert!(
            garbage == KVR_ERR_DECODE || garbage == KVR_ERR_UNKNOWN_WORKER,
            "{garbage}"
        );
    }
    // The stream bound is the allowance past the registered ranks (worker 1's two).
    assert_eq!(f.streams(), MAX_INGRESS_STREAMS + 2, "{}", f.streams());
    assert!(f.ranks() <= 2 + MAX_PENDING_RANKS as u64, "{}", f.ranks());
    assert!(f.ingress_refused() >= 2 * FLOOD - MAX_INGRESS_STREAMS as u64);
}

#[test]
fn replica_bookings_need_a_registered_rank() {
    let f = Fixture::new();
    assert_eq!(f.replica(1, 1, 1, 0), KVR_OK);
    for i in 0..FLOOD {
        assert_eq!(
            f.replica(10 + i, 1_000 + i, 0, u64::MAX),
            KVR_ERR_UNKNOWN_RANK
        );
        assert_eq!(
            f.replica(20_000 + i, 1, 2 + i as u32, 1),
            KVR_ERR_UNKNOWN_RANK
        );
    }
    // The registered worker's two ranks have counters from its registration on; the
    // flood adds no rank.
    assert_eq!(
        f.bookings(),
        (1, 2),
        "one booking, the registered ranks only, not a flood's"
    );
}

#[test]
fn capacity_sizing_is_bounded_per_partition() {
    let f = Fixture::new();
    let mut worker = ptr::null_mut();
    // SAFETY: live handles and out-parameters.
    unsafe {
        assert_eq!(kvr_worker_new(2, KVR_MAX_DP_SIZE, &mut worker), KVR_OK);
        assert_eq!(kvr_worker_set_total_kv_blocks(worker, 1 << 30), KVR_OK);
        assert_eq!(kvr_partition_upsert_worker(f.partition, worker), KVR_OK);
        kvr_worker_free(worker);
    }
    for dp in 0..KVR_MAX_DP_SIZE {
        assert_eq!(f.apply(2, dp, 7).0, KVR_OK);
    }
    let s = f.index_stats();
    assert_eq!(s.ranks, u64::from(KVR_MAX_DP_SIZE));
    // 12-byte entries at most 7/8 full, with room for the rest of the index (the ranks past
    // the budget hold one block each).
    let budget_bytes = KVR_MAX_RESERVED_BLOCKS_PER_PARTITION * 13 * 8 / 7 * 2;
    // The figure does see the sizing: the budget's ranks were sized ahead.
    assert!(
        s.bytes > KVR_MAX_RESERVED_BLOCKS_PER_PARTITION * 12,
        "{}",
        s.bytes
    );
    assert!(
        s.bytes < budget_bytes,
        "{} bytes of index (the per-rank bound alone would be {})",
        s.bytes,
        KVR_MAX_RESERVED_BLOCKS * 12 * u64::from(KVR_MAX_DP_SIZE)
    );
}

#[test]
fn load_reports_keep_to_registered_ranks() {
    let f = Fixture::new();
    let load = |worker: u64, dp: u32| kvr_rank_load {
        worker_id: worker,
        dp_rank: dp,
        kv_blocks_used: 1,
        ..kvr_rank_load::default()
    };
    let mut batch = vec![load(1, 0), load(1, 1)];
    let mut v = 0;
    // SAFETY: live handle; the batch points to its length.
    let st =
        unsafe { kvr_partition_publish_load(f.partition, batch.as_ptr(), batch.len(), &mut v) };
    assert_eq!(st, KVR_OK);
    for i in 0..FLOOD {
        batch.push(load(1_000 + i, 0));
        batch.push(load(1, 2 + i as u32));
    }
    // SAFETY: as above.
    let st =
        unsafe { kvr_partition_publish_load(f.partition, batch.as_ptr(), batch.len(), &mut v) };
    assert_eq!(st, KVR_ERR_UNKNOWN_RANK, "the made-up ranks were skipped");
    // (How many entries the view keeps: engine/tests/garbage_events.rs.)
}
