package kvr

// #include "shim.h"
import "C"

import "runtime"

// readStats is the one body of the partition's figure getters: the closed-handle check,
// the C call into a C value (between the kvrdebug GC hooks), its status, and the
// conversion of the C value into the Go one.
func readStats[CT, GT any](p *Partition, op string, read func(*C.kvr_partition, *CT) C.kvr_status,
	convert func(*CT) GT) (GT, error) {
	var zero GT
	if p.ptr == nil {
		return zero, ErrClosed
	}
	var c CT
	gc()
	st := read(p.ptr, &c)
	gc()
	runtime.KeepAlive(p)
	if err := check(st, op); err != nil {
		return zero, err
	}
	return convert(&c), nil
}

// IndexStats returns the partition's index statistics (O(shards); fine for a metrics
// scrape).
func (p *Partition) IndexStats() (IndexStats, error) {
	return readStats(p, "kvr_partition_index_stats",
		func(p *C.kvr_partition, c *C.kvr_index_stats) C.kvr_status {
			return C.kvr_partition_index_stats(p, c)
		},
		func(c *C.kvr_index_stats) IndexStats {
			return IndexStats{
				Ranks:          uint64(c.ranks),
				Nodes:          uint64(c.nodes),
				HolderBlocks:   uint64(c.holder_blocks),
				TierBlocks:     [3]uint64{uint64(c.tier_blocks[0]), uint64(c.tier_blocks[1]), uint64(c.tier_blocks[2])},
				Bytes:          uint64(c.bytes),
				StoredEvents:   uint64(c.stored_events),
				RemovedEvents:  uint64(c.removed_events),
				ClearedEvents:  uint64(c.cleared_events),
				ParentNotFound: uint64(c.parent_not_found),
				BlockNotFound:  uint64(c.block_not_found),
				TooManyRanks:   uint64(c.too_many_ranks),
			}
		})
}

// SelectionStats returns the partition's selection counters.
func (p *Partition) SelectionStats() (SelectionStats, error) {
	return readStats(p, "kvr_partition_selection_stats",
		func(p *C.kvr_partition, c *C.kvr_selection_stats) C.kvr_status {
			return C.kvr_partition_selection_stats(p, c)
		},
		func(c *C.kvr_selection_stats) SelectionStats {
			return SelectionStats{
				Selections:           uint64(c.selections),
				Busy:                 uint64(c.busy),
				NoWorker:             uint64(c.no_worker),
				SharedCacheFailures:  uint64(c.shared_cache_failures),
				StaleOverlapsIgnored: uint64(c.stale_overlaps_ignored),
			}
		})
}

// BookingStats returns the partition's booking-table figures.
func (p *Partition) BookingStats() (BookingStats, error) {
	return readStats(p, "kvr_partition_booking_stats",
		func(p *C.kvr_partition, c *C.kvr_booking_stats) C.kvr_status {
			return C.kvr_partition_booking_stats(p, c)
		},
		func(c *C.kvr_booking_stats) BookingStats {
			return BookingStats{
				Bookings:          uint64(c.bookings),
				TrackedRanks:      uint64(c.tracked_ranks),
				ExpiredTotal:      uint64(c.expired_total),
				CounterUnderflows: uint64(c.counter_underflows),
				SweeperStarted:    c.sweeper_started != 0,
			}
		})
}

// ActiveLoad returns the engine's live bookings on rank (zeros for a rank with none).
func (p *Partition) ActiveLoad(rank Rank) (ActiveLoad, error) {
	return readStats(p, "kvr_partition_active_load",
		func(p *C.kvr_partition, c *C.kvr_active_load) C.kvr_status {
			return C.kvr_partition_active_load(p, C.uint64_t(rank.WorkerID), C.uint32_t(rank.DPRank), c)
		},
		func(c *C.kvr_active_load) ActiveLoad {
			return ActiveLoad{
				ActivePrefillTokens: uint64(c.active_prefill_tokens),
				ActiveDecodeBlocks:  uint64(c.active_decode_blocks),
				ActiveRequests:      uint64(c.active_requests),
			}
		})
}
