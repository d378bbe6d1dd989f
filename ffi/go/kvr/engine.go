package kvr

// #include "shim.h"
import "C"

import (
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"
)

// finalized counts handles released by a finalizer (tests watch it).
var finalized atomic.Uint64

// Engine is a kvr engine: its partitions, and the selection-id index of their bookings.
// Its methods may be called from many goroutines at once.
type Engine struct {
	ptr *C.kvr_engine
}

// EngineOption configures New.
type EngineOption func(*C.kvr_engine_options) error

// WithSeed seeds the engine's random tie-breaks (default: from the clock), for
// reproducible runs.
func WithSeed(seed uint64) EngineOption {
	return func(o *C.kvr_engine_options) error {
		return check(C.kvr_engine_options_set_seed(o, C.uint64_t(seed)), "kvr_engine_options_set_seed")
	}
}

// New creates an engine. Constructing one starts no thread (the booking sweeper starts
// with the first booking).
func New(opts ...EngineOption) (*Engine, error) {
	var o *C.kvr_engine_options
	if len(opts) > 0 {
		gc()
		st := C.kvr_engine_options_new(&o)
		gc()
		if err := check(st, "kvr_engine_options_new"); err != nil {
			return nil, err
		}
		defer C.kvr_engine_options_free(o)
		for _, opt := range opts {
			gc()
			err := opt(o)
			gc()
			if err != nil {
				return nil, err
			}
		}
	}
	var ptr *C.kvr_engine
	gc()
	st := C.kvr_engine_new(o, &ptr)
	gc()
	if err := check(st, "kvr_engine_new"); err != nil {
		return nil, err
	}
	e := &Engine{ptr: ptr}
	runtime.SetFinalizer(e, (*Engine).finalize)
	return e, nil
}

func (e *Engine) finalize() {
	finalized.Add(1)
	e.Close()
}

// Close releases the engine handle. Partitions still open keep the engine alive until
// they are closed too. Idempotent; not concurrent with other calls on e.
func (e *Engine) Close() {
	if e.ptr == nil {
		return
	}
	gc()
	C.kvr_engine_free(e.ptr)
	gc()
	e.ptr = nil
	runtime.SetFinalizer(e, nil)
}

// MintSelectionID returns a fresh engine-unique selection id (never 0).
func (e *Engine) MintSelectionID() (uint64, error) {
	if e.ptr == nil {
		return 0, ErrClosed
	}
	var id C.uint64_t
	gc()
	st := C.kvr_engine_mint_selection_id(e.ptr, &id)
	gc()
	runtime.KeepAlive(e)
	return uint64(id), check(st, "kvr_engine_mint_selection_id")
}

// PartitionOption configures CreatePartition. Unset values are the defaults: the
// latency cost model (CostModelLatency, cost.go) with its default knobs, and Dynamo's
// weights.
type PartitionOption func(*C.kvr_partition_options) error

func f64Option(set func(*C.kvr_partition_options, C.double) C.kvr_status, op string, v float64) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		return check(set(o, C.double(v)), op)
	}
}

// WithCacheNamespace salts every block hash of the partition with a cache namespace.
func WithCacheNamespace(ns string) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		p, n := cstr(ns)
		st := C.kvr_partition_options_set_cache_namespace(o, p, n)
		runtime.KeepAlive(ns)
		return check(st, "kvr_partition_options_set_cache_namespace")
	}
}

// WithBookingTTL sets the lifetime of a booking nobody frees (default 1 h; at least
// 1 ms: 0 and negative durations are refused).
func WithBookingTTL(d time.Duration) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		const op = "kvr_partition_options_set_booking_ttl_ms"
		ms, err := millis(d, op) // 0 is refused by kvr itself
		if err != nil {
			return err
		}
		return check(C.kvr_partition_options_set_booking_ttl_ms(o, ms), op)
	}
}

// WithOverlapScoreCredit sets the credit per device-cached block (default 1.0).
func WithOverlapScoreCredit(v float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_overlap_score_credit(o, v)
	}, "kvr_partition_options_set_overlap_score_credit", v)
}

// WithPrefillLoadScale sets the multiplier of the prefill term (default 1.0).
func WithPrefillLoadScale(v float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_prefill_load_scale(o, v)
	}, "kvr_partition_options_set_prefill_load_scale", v)
}

// WithHostCacheHitWeight sets the credit per block cached in host memory (default 0.75).
func WithHostCacheHitWeight(v float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_host_cache_hit_weight(o, v)
	}, "kvr_partition_options_set_host_cache_hit_weight", v)
}

// WithDiskCacheHitWeight sets the credit per block cached on disk (default 0.25).
func WithDiskCacheHitWeight(v float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_disk_cache_hit_weight(o, v)
	}, "kvr_partition_options_set_disk_cache_hit_weight", v)
}

// WithSharedCacheMultiplier sets the credit per block of the host's shared cache beyond
// the device prefix (default 0).
func WithSharedCacheMultiplier(v float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_shared_cache_multiplier(o, v)
	}, "kvr_partition_options_set_shared_cache_multiplier", v)
}

// WithTemperature sets the selection temperature: 0 = lowest cost (default), > 0 =
// softmax over normalised costs.
func WithTemperature(v float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_temperature(o, v)
	}, "kvr_partition_options_set_temperature", v)
}

// WithDecodeActiveRequestWeight sets the block equivalents charged per active request
// of a rank (default 0 = off).
func WithDecodeActiveRequestWeight(v float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_decode_active_request_weight(o, v)
	}, "kvr_partition_options_set_decode_active_request_weight", v)
}

// WithCreditDecay sets the load-dependent decay of the device credit (default off;
// ≤ 0 = off).
func WithCreditDecay(v float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_credit_decay(o, v)
	}, "kvr_partition_options_set_credit_decay", v)
}

// WithBusyDecodeBlocksFraction: a rank is busy when its decode blocks exceed this
// fraction of its total KV blocks.
func WithBusyDecodeBlocksFraction(v float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_busy_decode_blocks_fraction(o, v)
	}, "kvr_partition_options_set_busy_decode_blocks_fraction", v)
}

// WithBusyPrefillTokensFraction: a rank is busy when its active prefill tokens exceed
// this fraction of its max batched tokens.
func WithBusyPrefillTokensFraction(v float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_busy_prefill_tokens_fraction(o, v)
	}, "kvr_partition_options_set_busy_prefill_tokens_fraction", v)
}

// WithBusyPrefillTokens: a rank is busy when its active prefill tokens exceed this many.
func WithBusyPrefillTokens(tokens uint64) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		return check(C.kvr_partition_options_set_busy_prefill_tokens(o, C.uint64_t(tokens)),
			"kvr_partition_options_set_busy_prefill_tokens")
	}
}

// CreatePartition creates partition (model, group) with blocks of blockSize tokens
// (engines use 16 to 64) and returns a handle to it; ErrPartitionExists if it exists,
// ErrInvalidConfig (its Reason says why) if the options contradict each other, e.g. a
// remote indexer with KV events off. CheckPartitionOptions checks options up front and
// returns kvr's notices about them.
func (e *Engine) CreatePartition(model, group string, blockSize uint32, opts ...PartitionOption) (*Partition, error) {
	if e.ptr == nil {
		return nil, ErrClosed
	}
	o, err := newPartitionOptions(blockSize, opts)
	if err != nil {
		return nil, err
	}
	defer freePartitionOptions(o)
	mp, mn := cstr(model)
	gp, gn := cstr(group)
	var ptr *C.kvr_partition
	gc()
	st := C.kvr_engine_create_partition(e.ptr, mp, mn, gp, gn, o, &ptr)
	gc()
	runtime.KeepAlive(e)
	runtime.KeepAlive(model)
	runtime.KeepAlive(group)
	if st == C.KVR_ERR_INVALID_CONFIG {
		// kvr_partition_options_check gives the reason the engine refused them.
		err := &Error{Status: StatusInvalidConfig, Op: "kvr_engine_create_partition"}
		if cst, reason := checkPartitionOptions(o); cst == C.KVR_ERR_INVALID_CONFIG {
			err.Reason = reason
		}
		return nil, err
	}
	if err := check(st, "kvr_engine_create_partition"); err != nil {
		return nil, err
	}
	return newPartition(ptr)
}

// newPartitionOptions makes C partition options and applies opts (the caller frees them
// with freePartitionOptions).
func newPartitionOptions(blockSize uint32, opts []PartitionOption) (*C.kvr_partition_options, error) {
	var o *C.kvr_partition_options
	gc()
	st := C.kvr_partition_options_new(C.uint32_t(blockSize), &o)
	gc()
	if err := check(st, "kvr_partition_options_new"); err != nil {
		return nil, err
	}
	for _, opt := range opts {
		gc()
		err := opt(o)
		gc()
		if err != nil {
			freePartitionOptions(o)
			return nil, err
		}
	}
	return o, nil
}

func freePartitionOptions(o *C.kvr_partition_options) {
	gc()
	C.kvr_partition_options_free(o)
	gc()
}

// Partition returns a new handle to existing partition (model, group), or
// ErrUnknownPartition.
func (e *Engine) Partition(model, group string) (*Partition, error) {
	if e.ptr == nil {
		return nil, ErrClosed
	}
	mp, mn := cstr(model)
	gp, gn := cstr(group)
	var ptr *C.kvr_partition
	gc()
	st := C.kvr_engine_get_partition(e.ptr, mp, mn, gp, gn, &ptr)
	gc()
	runtime.KeepAlive(e)
	runtime.KeepAlive(model)
	runtime.KeepAlive(group)
	if err := check(st, "kvr_engine_get_partition"); err != nil {
		return nil, err
	}
	return newPartition(ptr)
}

// RemovePartition removes partition (model, group) from the engine. Handles to it stay
// valid to close and to read, but selections and bookings through them fail with
// ErrUnknownPartition.
func (e *Engine) RemovePartition(model, group string) error {
	if e.ptr == nil {
		return ErrClosed
	}
	mp, mn := cstr(model)
	gp, gn := cstr(group)
	gc()
	st := C.kvr_engine_remove_partition(e.ptr, mp, mn, gp, gn)
	gc()
	runtime.KeepAlive(e)
	runtime.KeepAlive(model)
	runtime.KeepAlive(group)
	return check(st, "kvr_engine_remove_partition")
}

// MarkPrefillComplete records that booking selectionID finished its prefill: its
// prefill tokens leave the rank's load. Idempotent; ErrUnknownSelectionID for an id
// that is neither live nor recently freed.
func (e *Engine) MarkPrefillComplete(selectionID uint64) error {
	if e.ptr == nil {
		return ErrClosed
	}
	gc()
	st := C.kvrgo_mark_prefill_complete(uptr(unsafe.Pointer(e.ptr)), C.uint64_t(selectionID))
	gc()
	runtime.KeepAlive(e)
	return check(st, "kvr_engine_mark_prefill_complete")
}

// AddOutputBlocks records that booking selectionID produced n more output blocks
// (decode load). ErrAlreadyFreed once the booking was freed.
func (e *Engine) AddOutputBlocks(selectionID, n uint64) error {
	if e.ptr == nil {
		return ErrClosed
	}
	gc()
	st := C.kvrgo_add_output_blocks(uptr(unsafe.Pointer(e.ptr)), C.uint64_t(selectionID), C.uint64_t(n))
	gc()
	runtime.KeepAlive(e)
	return check(st, "kvr_engine_add_output_blocks")
}

// SetOutputBlocks says the request has produced total output blocks so far (its last
// block index + 1): the booking's output blocks rise to total, so a retried call adds
// nothing (idempotent, unlike AddOutputBlocks). Returns the blocks this call added.
func (e *Engine) SetOutputBlocks(selectionID, total uint64) (uint64, error) {
	if e.ptr == nil {
		return 0, ErrClosed
	}
	var added C.uint64_t
	st := C.kvr_engine_set_output_blocks(e.ptr, C.uint64_t(selectionID), C.uint64_t(total), &added)
	runtime.KeepAlive(e)
	return uint64(added), check(st, "kvr_engine_set_output_blocks")
}

// FreedBy says how FreeBooking found a booking.
type FreedBy uint32

const (
	// FreedNow: this call freed it.
	FreedNow FreedBy = C.KVR_FREED_NOW
	// FreedByCaller: an earlier FreeBooking had freed it.
	FreedByCaller FreedBy = C.KVR_FREED_BY_CALLER
	// FreedExpired: it had expired and a sweep freed it.
	FreedExpired FreedBy = C.KVR_FREED_EXPIRED
	// FreedRankRemoved: its rank had left the partition.
	FreedRankRemoved FreedBy = C.KVR_FREED_RANK_REMOVED
)

func (f FreedBy) String() string {
	switch f {
	case FreedNow:
		return "freed now"
	case FreedByCaller:
		return "freed by caller earlier"
	case FreedExpired:
		return "expired"
	case FreedRankRemoved:
		return "rank removed"
	}
	return "FreedBy(" + itoa(uint64(f)) + ")"
}

// FreeBooking releases everything booking selectionID booked (the request finished).
// Idempotent: freeing a recently freed booking succeeds again and says who freed it.
func (e *Engine) FreeBooking(selectionID uint64) (FreedBy, error) {
	if e.ptr == nil {
		return 0, ErrClosed
	}
	gc()
	st, how := unpack(C.kvrgo_free_booking(uptr(unsafe.Pointer(e.ptr)), C.uint64_t(selectionID)))
	gc()
	runtime.KeepAlive(e)
	return FreedBy(how), check(st, "kvr_engine_free_booking")
}
