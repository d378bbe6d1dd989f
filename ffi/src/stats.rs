//! Statistics of a partition: its index, its selections, its bookings, a rank's load.

use kvr::RankId;

use crate::handles::kvr_partition;
use crate::status::*;

/// Index-wide figures (event and refusal counters are totals since creation).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvr_index_stats {
    pub ranks: u64,
    /// Distinct prefixes held by at least one rank.
    pub nodes: u64,
    /// (rank, block) pairs held on any tier.
    pub holder_blocks: u64,
    /// (rank, block) pairs per tier: device, host, disk.
    pub tier_blocks: [u64; 3],
    /// All index memory in bytes.
    pub bytes: u64,
    /// Stored events received, including those refused (`parent_not_found`).
    pub stored_events: u64,
    pub removed_events: u64,
    pub cleared_events: u64,
    /// Stores refused because their parent was unknown.
    pub parent_not_found: u64,
    /// Removed hashes the rank did not hold.
    pub block_not_found: u64,
    /// Events refused because the rank limit was reached.
    pub too_many_ranks: u64,
}

/// Selection counters.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvr_selection_stats {
    pub selections: u64,
    pub busy: u64,
    pub no_worker: u64,
    /// Shared-cache hook failures (the selections went on without them).
    pub shared_cache_failures: u64,
    /// Ranks whose overlap a lookup did not credit because their event stream was stale
    /// (a known loss being replayed; `kvr_partition_options_set_trust_stale_overlap`).
    pub stale_overlaps_ignored: u64,
}

/// Booking-table figures.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvr_booking_stats {
    /// Live bookings.
    pub bookings: u64,
    /// Ranks with booking counters.
    pub tracked_ranks: u64,
    /// Bookings freed by expiry sweeps so far.
    pub expired_total: u64,
    /// Counter subtractions that would have gone below zero (always 0 unless kvr has a bug).
    pub counter_underflows: u64,
    /// Non-zero once the expiry sweep thread has started (on the first booking).
    pub sweeper_started: u32,
    pub reserved: u32,
}

/// The engine's live bookings on one rank (the booking terms of the cost).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvr_active_load {
    pub active_prefill_tokens: u64,
    /// Distinct prompt blocks of the rank's bookings plus their output blocks.
    pub active_decode_blocks: u64,
    pub active_requests: u64,
}

/// Reads a partition figure into `out`.
///
/// # Safety
/// `partition` is NULL or live; `out` is NULL or writable.
unsafe fn read<T>(
    partition: *const kvr_partition,
    out: *mut T,
    f: impl FnOnce(&kvr_partition) -> T,
) -> kvr_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let p = unsafe { handle(partition) }?;
        if out.is_null() {
            return Err(KVR_ERR_NULL);
        }
        // SAFETY: forwarded caller contract.
        unsafe { write_out(out, f(p)) }
    })
}

/// The partition's index statistics. O(shards); fine for a metrics scrape.
///
/// # Safety
/// `partition` is NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_index_stats(
    partition: *const kvr_partition,
    out: *mut kvr_index_stats,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        read(partition, out, |p| {
            let s = p.partition.index().stats();
            kvr_index_stats {
                ranks: s.ranks,
                nodes: s.nodes,
                holder_blocks: s.holder_blocks,
                tier_blocks: s.tier_blocks,
                bytes: s.bytes,
                stored_events: s.stored_events,
                removed_events: s.removed_events,
                cleared_events: s.cleared_events,
                parent_not_found: s.parent_not_found,
                block_not_found: s.block_not_found,
                too_many_ranks: s.too_many_ranks,
            }
        })
    }
}

/// The partition's selection counters.
///
/// # Safety
/// `partition` is NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_selection_stats(
    partition: *const kvr_partition,
    out: *mut kvr_selection_stats,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        read(partition, out, |p| {
            let s = p.partition.selection_stats();
            kvr_selection_stats {
                selections: s.selections,
                busy: s.busy,
                no_worker: s.no_worker,
                shared_cache_failures: s.shared_cache_failures,
                stale_overlaps_ignored: s.stale_overlaps_ignored,
            }
        })
    }
}

/// The partition's booking-table figures.
///
/// # Safety
/// `partition` is NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_booking_stats(
    partition: *const kvr_partition,
    out: *mut kvr_booking_stats,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        read(partition, out, |p| {
            let s = p.partition.bookings().stats();
            kvr_booking_stats {
                bookings: s.bookings as u64,
                tracked_ranks: s.tracked_ranks as u64,
                expired_total: s.expired_total,
                counter_underflows: s.counter_underflows,
                sweeper_started: s.sweeper_started as u32,
                reserved: 0,
            }
        })
    }
}

/// The engine's live bookings on rank `(worker_id, dp_rank)` (zeros for a rank with none).
///
/// # Safety
/// `partition` is NULL or live; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvr_partition_active_load(
    partition: *const kvr_partition,
    worker_id: u64,
    dp_rank: u32,
    out: *mut kvr_active_load,
) -> kvr_status {
    // SAFETY: forwarded caller contract.
    unsafe {
        read(partition, out, |p| {
            let l = p
                .partition
                .bookings()
                .rank_load(RankId::new(worker_id, dp_rank));
            kvr_active_load {
                active_prefill_tokens: l.active_prefill_tokens,
                active_decode_blocks: l.active_decode_blocks,
                active_requests: l.active_requests,
            }
        })
    }
}
