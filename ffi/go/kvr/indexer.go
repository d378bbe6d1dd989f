package kvr

// #include "shim.h"
import "C"

import (
	"runtime"
	"time"
	"unsafe"
)

// IndexerPolicy is the indexing a partition's options resolved to (KVR_INDEXER_*;
// DESIGN.md §5): which index answers its overlap queries.
//
//	options                                 policy
//	(default)                               IndexerEventDriven
//	WithPredictionTTL(d)                    IndexerEventDrivenWithPrediction
//	WithKVEvents(false)                     IndexerApproximatePrimary
//	WithRemoteIndexer(url, ...)             IndexerRemotePrimary
//	WithRemoteIndexer + WithKVEvents(false) refused: ErrInvalidConfig
type IndexerPolicy uint32

// The indexer policies.
const (
	// IndexerEventDriven: the engines' KV events feed the index (the default).
	IndexerEventDriven IndexerPolicy = C.KVR_INDEXER_EVENT_DRIVEN
	// IndexerEventDrivenWithPrediction: events feed the index, and bookings a short-lived
	// side index; a query takes the per-rank maximum of both.
	IndexerEventDrivenWithPrediction IndexerPolicy = C.KVR_INDEXER_EVENT_DRIVEN_WITH_PREDICTION
	// IndexerApproximatePrimary: KV events are off; the index holds what bookings
	// recorded, for a TTL.
	IndexerApproximatePrimary IndexerPolicy = C.KVR_INDEXER_APPROXIMATE_PRIMARY
	// IndexerRemotePrimary: a remote index service answers overlap queries; nothing is
	// indexed locally.
	IndexerRemotePrimary IndexerPolicy = C.KVR_INDEXER_REMOTE_PRIMARY
)

func (p IndexerPolicy) String() string {
	switch p {
	case IndexerEventDriven:
		return "event-driven"
	case IndexerEventDrivenWithPrediction:
		return "event-driven with prediction"
	case IndexerApproximatePrimary:
		return "approximate primary"
	case IndexerRemotePrimary:
		return "remote primary"
	}
	return "IndexerPolicy(" + itoa(uint64(p)) + ")"
}

// Retention is how the approximate index forgets what bookings recorded
// (KVR_RETENTION_*).
type Retention uint32

// The retentions.
const (
	// RetentionTTL: records expire a TTL after their last booking (the default).
	RetentionTTL Retention = C.KVR_RETENTION_TTL
	// RetentionCapacityBounded: at most a worker's KV capacity per rank, least recently
	// used first. Accepted; until kvr fully supports it it falls back to RetentionTTL
	// (CheckPartitionOptions returns the notice).
	RetentionCapacityBounded Retention = C.KVR_RETENTION_CAPACITY_BOUNDED
)

// millis converts a duration option to whole milliseconds: a negative duration is
// refused, and a positive one shorter than a millisecond is 1 ms (0 means "off" or
// "the default" to these options, which a positive duration never does).
func millis(d time.Duration, op string) (C.uint64_t, error) {
	if d < 0 {
		return 0, &Error{Status: StatusInvalidArgument, Op: op}
	}
	ms := d / time.Millisecond
	if ms == 0 && d > 0 {
		ms = 1
	}
	return C.uint64_t(ms), nil
}

// WithKVEvents sets whether the engines' KV events feed the partition's index (Dynamo's
// use_kv_events; default true). With false the index is approximate: each booking
// (SelectAndReserve, Reserve with a prompt, a replica booking) records its prompt on its
// rank for the approximate TTL (WithApproxIndex), advisory selections record nothing,
// and Ingest and Subscribe apply nothing (counted in IndexerStats.EventsIgnored).
func WithKVEvents(on bool) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		var v C.uint32_t
		if on {
			v = 1
		}
		return check(C.kvr_partition_options_set_use_kv_events(o, v),
			"kvr_partition_options_set_use_kv_events")
	}
}

// WithTrustStaleOverlap sets whether selection credits a stale rank's overlap (a stream
// with a known loss being replayed, or degraded or dead: StreamStats.StaleSince and
// Health); default false, so a stale rank's overlap counts as none until the stream's
// repair is in the index.
func WithTrustStaleOverlap(on bool) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		var v C.uint32_t
		if on {
			v = 1
		}
		return check(C.kvr_partition_options_set_trust_stale_overlap(o, v),
			"kvr_partition_options_set_trust_stale_overlap")
	}
}

// WithPredictionTTL: with KV events on, also record every booking into a side index kept
// for ttl (0 = no side index, the default), so a prefix just routed counts before its
// engine's events arrive. Ignored, with a notice, with events off or a remote primary.
func WithPredictionTTL(ttl time.Duration) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		const op = "kvr_partition_options_set_prediction_ttl_ms"
		ms, err := millis(ttl, op)
		if err != nil {
			return err
		}
		return check(C.kvr_partition_options_set_prediction_ttl_ms(o, ms), op)
	}
}

// WithRemoteIndexer makes a remote index service the partition's primary index: each
// selection POSTs the prompt's local block hashes to {url}/query_tiered_by_hash, Dynamo's
// standalone-indexer query (JSON; falls back to a Dynamo 1.6.1 indexer's /query_by_hash;
// the protocol is in transport/http/src/lib.rs) and scores with the answer. url is
// http://host[:port][/path] ("" = none, the default); connectTimeout bounds the TCP
// connect and requestTimeout one whole query (0 = the defaults, 50 ms and 200 ms). A
// remote that is down, slow or answers garbage gives that selection no overlap, counted
// in IndexerStats.RemoteFailures, never a failed selection. Needs KV events on: with
// WithKVEvents(false) CreatePartition fails with ErrInvalidConfig, as it does for a URL
// kvr cannot use (https, no host, ...).
func WithRemoteIndexer(url string, connectTimeout, requestTimeout time.Duration) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		const op = "kvr_partition_options_set_remote_indexer"
		cms, err := millis(connectTimeout, op)
		if err != nil {
			return err
		}
		rms, err := millis(requestTimeout, op)
		if err != nil {
			return err
		}
		up, un := cstr(url)
		st := C.kvr_partition_options_set_remote_indexer(o, up, un, cms, rms)
		runtime.KeepAlive(url)
		return check(st, op)
	}
}

// WithApproxIndex sets the approximate index's retention (the primary with events off;
// the prediction side index takes maxBlocks, with the prediction TTL): records live ttl
// after their last booking (default 2 min) and at most maxBlocks (rank, block) records
// are kept (default 2^20; above it the deepest are pruned to 80 %). Both must be ≥ 1
// (ms, block), else ErrInvalidArgument.
func WithApproxIndex(ttl time.Duration, maxBlocks uint64) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		const op = "kvr_partition_options_set_approx_index"
		ms, err := millis(ttl, op)
		if err != nil {
			return err
		}
		return check(C.kvr_partition_options_set_approx_index(o, ms, C.uint64_t(maxBlocks)), op)
	}
}

// WithApproxRetention sets the approximate index's retention (default RetentionTTL);
// ErrInvalidArgument for an unknown value.
func WithApproxRetention(r Retention) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		return check(C.kvr_partition_options_set_approx_retention(o, C.uint32_t(r)),
			"kvr_partition_options_set_approx_retention")
	}
}

// CheckPartitionOptions checks partition options as CreatePartition would, without
// creating anything (a host validates its configuration up front). On success it
// returns kvr's notices about them ("" if none), e.g. that capacity-bounded retention
// falls back to TTL. The notices are kvr's text, several joined by "; " (one notice may
// itself contain "; ", so the text is not split). Options kvr refuses are
// ErrInvalidConfig, with the reason in the error's Reason; an option setter's own
// refusal is returned as is (e.g. ErrInvalidArgument).
func CheckPartitionOptions(blockSize uint32, opts ...PartitionOption) (notices string, err error) {
	o, err := newPartitionOptions(blockSize, opts)
	if err != nil {
		return "", err
	}
	defer freePartitionOptions(o)
	st, text := checkPartitionOptions(o)
	switch st {
	case C.KVR_OK:
		return text, nil
	case C.KVR_ERR_INVALID_CONFIG:
		return "", &Error{Status: StatusInvalidConfig, Op: "kvr_partition_options_check", Reason: text}
	}
	return "", check(st, "kvr_partition_options_check")
}

// checkPartitionOptions runs kvr_partition_options_check: its status and its text (the
// notices on KVR_OK, the reason on KVR_ERR_INVALID_CONFIG).
func checkPartitionOptions(o *C.kvr_partition_options) (C.kvr_status, string) {
	buf := make([]byte, 256)
	for {
		var n C.size_t
		gc()
		st := C.kvr_partition_options_check(o, (*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)), &n)
		gc()
		runtime.KeepAlive(buf)
		if st != C.KVR_OK && st != C.KVR_ERR_INVALID_CONFIG {
			return st, ""
		}
		if int(n) <= len(buf) {
			return st, string(buf[:int(n)])
		}
		buf = make([]byte, int(n))
	}
}

// IndexerStats are a partition's indexer figures: its policy and what it recorded or
// asked (totals since the partition was created).
type IndexerStats struct {
	Policy IndexerPolicy
	// BookingsRecorded: bookings recorded into the approximate index (the primary with
	// events off, or the prediction side index); RecordFailures: recordings that failed
	// (the bookings stood).
	BookingsRecorded uint64
	RecordFailures   uint64
	// RemoteQueries: overlap queries sent to the remote primary; RemoteFailures: those
	// that failed (refused, timed out, bad answer: the selection went on without
	// overlap).
	RemoteQueries  uint64
	RemoteFailures uint64
	// EventsIgnored: engine event messages handed to a partition whose policy applies
	// none (events off, or a remote primary).
	EventsIgnored uint64
	// The approximate index's (rank, block) records: created, refreshed by a later
	// booking, expired, pruned by the size bound (0 without an approximate index).
	ApproxBlocksRecorded  uint64
	ApproxBlocksRefreshed uint64
	ApproxBlocksExpired   uint64
	ApproxBlocksPruned    uint64
	// ApproxRecords: bookings the approximate index recorded (with at least one block);
	// ApproxRecordErrors: those it refused (e.g. too many ranks); ApproxBlocksOverBound:
	// blocks of booked prompts not recorded because the records were at the size bound.
	ApproxRecords         uint64
	ApproxRecordErrors    uint64
	ApproxBlocksOverBound uint64
	// IngressRefused: engine messages, batches and topics refused because they would
	// create ingress state past a bound (a bind subscription's route-less topic past its
	// cap, a stream past KVR_MAX_INGRESS_STREAMS beyond the registered ranks, a rank of a
	// worker not registered past KVR_MAX_PENDING_RANKS, a typed batch for a DP rank its
	// worker does not have).
	IngressRefused uint64
}

// IndexerStats returns the partition's indexer statistics.
func (p *Partition) IndexerStats() (IndexerStats, error) {
	return readStats(p, "kvr_partition_indexer_stats",
		func(p *C.kvr_partition, c *C.kvr_indexer_stats) C.kvr_status {
			return C.kvr_partition_indexer_stats(p, c)
		},
		func(c *C.kvr_indexer_stats) IndexerStats {
			return IndexerStats{
				Policy:                IndexerPolicy(c.policy),
				BookingsRecorded:      uint64(c.bookings_recorded),
				RecordFailures:        uint64(c.record_failures),
				RemoteQueries:         uint64(c.remote_queries),
				RemoteFailures:        uint64(c.remote_failures),
				EventsIgnored:         uint64(c.events_ignored),
				ApproxBlocksRecorded:  uint64(c.approx_blocks_recorded),
				ApproxBlocksRefreshed: uint64(c.approx_blocks_refreshed),
				ApproxBlocksExpired:   uint64(c.approx_blocks_expired),
				ApproxBlocksPruned:    uint64(c.approx_blocks_pruned),
				ApproxRecords:         uint64(c.approx_records),
				ApproxRecordErrors:    uint64(c.approx_record_errors),
				ApproxBlocksOverBound: uint64(c.approx_blocks_over_bound),
				IngressRefused:        uint64(c.ingress_refused),
			}
		})
}
