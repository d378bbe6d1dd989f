package kvr

// #include "shim.h"
import "C"

import (
	"runtime"
	"time"
	"unsafe"
)

// DecodeErrorKinds is the number of slots of StreamStats.DecodeErrors (more than kvr uses
// today, so kinds can be added; DecodeErrorName names the used ones).
const DecodeErrorKinds = C.KVR_DECODE_ERROR_KINDS

// IngestResult is what one Ingest call did (kvr_ingest_result).
type IngestResult struct {
	// BatchesApplied: 0 for a duplicate.
	BatchesApplied uint32
	// Clears: times the stream's ranks were cleared (a gap or a restart).
	Clears uint32
	// DecodeErrors: batches that failed to decode (nothing of them was applied).
	DecodeErrors uint32
	// Refused: batches refused (their DP rank is not the worker's, or the message would
	// open a stream past a bound); the error says which (KVR_ERR_UNKNOWN_RANK,
	// KVR_ERR_UNKNOWN_WORKER, KVR_ERR_TOO_MANY_RANKS).
	Refused uint32
}

// StreamStats are the counters of one event stream of a partition: one publisher
// socket of an engine, fed through Ingest or a Subscription (kvr_stream_stats).
type StreamStats struct {
	WorkerID uint64
	Stream   uint32
	// Messages received (live and replayed) and their payload bytes.
	Messages uint64
	Bytes    uint64
	// Batches decoded and applied, their events, the blocks they stored and removed.
	Batches       uint64
	Events        uint64
	BlocksStored  uint64
	BlocksRemoved uint64
	// EventsRejected: events the index refused (unknown parent, rank limit), and the
	// events of batches refused for their DP rank.
	EventsRejected uint64
	// DPRankRefused: batches refused because they name a DP rank the worker does not
	// have (at or above its dpSize, or at least KVR_MAX_DP_SIZE = 4096 for a worker not
	// yet registered): the wire never picks which ranks exist.
	DPRankRefused uint64
	// BlockSizeMismatches: stores refused because their block size is not the
	// partition's.
	BlockSizeMismatches uint64
	// DecodeErrors: batches that failed to decode, by kind (DecodeErrorName(i) names
	// slot i).
	DecodeErrors [DecodeErrorKinds]uint64
	// BadFrames: messages whose frames were malformed (subscriptions only).
	BadFrames uint64
	// Sequence tracking: gaps, restarts (seq going back), duplicates, replays requested,
	// filled and incomplete, clears of the stream's ranks, and batches lost for good.
	Gaps              uint64
	Restarts          uint64
	Duplicates        uint64
	ReplaysRequested  uint64
	ReplaysFilled     uint64
	ReplaysIncomplete uint64
	Clears            uint64
	BatchesLost       uint64
	// LastSeq is the last sequence number seen, if HasLastSeq.
	LastSeq    uint64
	HasLastSeq bool
	// LastBatch: wall-clock time of the last applied batch (zero: never).
	LastBatch time.Time
	// ReplaysPartial and ReplaysFailed split ReplaysIncomplete; IdleProbes counts the
	// subscription's idle probes.
	ReplaysPartial uint64
	ReplaysFailed  uint64
	IdleProbes     uint64
	// KV-cache groups and mediums: events skipped (not the followed group, an unknown
	// medium) and changes of the followed group.
	EventsSkippedGroup  uint64
	GroupSwitches       uint64
	EventsSkippedMedium uint64
	// Stores skipped as unusable (token ids that do not fill their blocks), and blocks
	// of tokenless stores (host or disk copies named by engine hash only) that the rank
	// held on no tier, left out of the index.
	EventsSkippedMalformed uint64
	TokenlessBlocksUnknown uint64
	// Freshness: Recovering while a replay is in flight; StaleSince (non-zero) while a
	// known loss is being replayed, when selection does not credit the stream's ranks
	// (unless WithTrustStaleOverlap).
	Recovering bool
	StaleSince time.Time
	// Health: Exact, Recovering, Degraded (state may be missing or stale) or Dead
	// (unreachable, or silent beyond the bound), with HealthReason in words, since
	// HealthSince (zero: since registered). A degraded or dead stream's ranks are stale.
	Health       SourceHealth
	HealthReason string
	HealthSince  time.Time
	// LinkFailures: failed connects or binds and lost connections (subscriptions only).
	LinkFailures uint64
}

// SourceHealth is a stream's state (kvr_stream_stats.health).
type SourceHealth uint32

// The states of SourceHealth.
const (
	SourceExact      SourceHealth = C.KVR_SOURCE_EXACT
	SourceRecovering SourceHealth = C.KVR_SOURCE_RECOVERING
	SourceDegraded   SourceHealth = C.KVR_SOURCE_DEGRADED
	SourceDead       SourceHealth = C.KVR_SOURCE_DEAD
)

// String is the state's name: exact, recovering, degraded, dead.
func (h SourceHealth) String() string {
	switch h {
	case SourceExact:
		return "exact"
	case SourceRecovering:
		return "recovering"
	case SourceDegraded:
		return "degraded"
	case SourceDead:
		return "dead"
	}
	return "unknown"
}

// healthReasonName is kvr_health_reason_name's text ("" for a number kvr does not use).
func healthReasonName(reason uint32) string {
	var name *C.char
	var n C.size_t
	if C.kvr_health_reason_name(C.uint32_t(reason), &name, &n) != C.KVR_OK {
		return ""
	}
	return C.GoStringN(name, C.int(n))
}

// DecodeErrorTotal is the sum of DecodeErrors.
func (s *StreamStats) DecodeErrorTotal() uint64 {
	var n uint64
	for _, v := range s.DecodeErrors {
		n += v
	}
	return n
}

func streamStatsOf(c *C.kvr_stream_stats) StreamStats {
	s := StreamStats{
		WorkerID:            uint64(c.worker_id),
		Stream:              uint32(c.stream),
		Messages:            uint64(c.messages),
		Bytes:               uint64(c.bytes),
		Batches:             uint64(c.batches),
		Events:              uint64(c.events),
		BlocksStored:        uint64(c.blocks_stored),
		BlocksRemoved:       uint64(c.blocks_removed),
		EventsRejected:      uint64(c.events_rejected),
		DPRankRefused:       uint64(c.dp_rank_refused),
		BlockSizeMismatches: uint64(c.block_size_mismatches),
		BadFrames:           uint64(c.bad_frames),
		Gaps:                uint64(c.gaps),
		Restarts:            uint64(c.restarts),
		Duplicates:          uint64(c.duplicates),
		ReplaysRequested:    uint64(c.replays_requested),
		ReplaysFilled:       uint64(c.replays_filled),
		ReplaysIncomplete:   uint64(c.replays_incomplete),
		Clears:              uint64(c.clears),
		BatchesLost:         uint64(c.batches_lost),
	}
	for i := range s.DecodeErrors {
		s.DecodeErrors[i] = uint64(c.decode_errors[i])
	}
	if last := uint64(c.last_seq); last != ^uint64(0) {
		s.LastSeq, s.HasLastSeq = last, true
	}
	if ms := int64(c.last_batch_unix_ms); ms != 0 {
		s.LastBatch = time.UnixMilli(ms)
	}
	s.ReplaysPartial, s.ReplaysFailed = uint64(c.replays_partial), uint64(c.replays_failed)
	s.IdleProbes = uint64(c.idle_probes)
	s.EventsSkippedGroup, s.GroupSwitches = uint64(c.events_skipped_group), uint64(c.group_switches)
	s.EventsSkippedMedium = uint64(c.events_skipped_medium)
	s.EventsSkippedMalformed = uint64(c.events_skipped_malformed)
	s.TokenlessBlocksUnknown = uint64(c.tokenless_blocks_unknown)
	s.Recovering = c.recovering != 0
	if ms := int64(c.stale_since_unix_ms); ms != 0 {
		s.StaleSince = time.UnixMilli(ms)
	}
	s.Health, s.HealthReason = SourceHealth(c.health), healthReasonName(uint32(c.health_reason))
	if ms := int64(c.health_since_unix_ms); ms != 0 {
		s.HealthSince = time.UnixMilli(ms)
	}
	s.LinkFailures = uint64(c.link_failures)
	return s
}

// Ingest hands kvr one message of an engine's KV-event stream (the frames of a vLLM or
// SGLang ZMQ message: topic, sequence number, msgpack payload) from workerID's stream
// (one per publisher socket, e.g. its DP rank), for hosts that read the sockets
// themselves (else see Subscribe). The batch is sequence-checked (a gap or a restart
// clears the stream's ranks: kvr does not own the socket, so it cannot ask for a
// replay), decoded and applied to rank (workerID, the batch's data_parallel_rank), or
// (workerID, stream) if the batch names none. A payload that does not decode applies
// nothing, is counted by cause, and returns ErrDecode with the result. A refused batch
// (a DP rank the worker does not have, a worker not registered past the pending-rank
// budget, a stream past the partition's cap) applies nothing and returns ErrUnknownRank,
// ErrUnknownWorker or ErrTooManyRanks with the result (Refused counts it).
//
// Messages of one stream must be handed in order, one at a time; different streams may
// be ingested from different goroutines at once. topic and payload are passed to C in
// place.
func (p *Partition) Ingest(workerID uint64, stream uint32, topic []byte, seq uint64, payload []byte) (IngestResult, error) {
	if p.ptr == nil {
		return IngestResult{}, ErrClosed
	}
	var tp, pp *C.uint8_t
	if len(topic) > 0 {
		tp = (*C.uint8_t)(unsafe.Pointer(&topic[0]))
	}
	if len(payload) > 0 {
		pp = (*C.uint8_t)(unsafe.Pointer(&payload[0]))
	}
	var c C.kvr_ingest_result
	gc()
	st := C.kvr_partition_ingest(p.ptr, C.uint64_t(workerID), C.uint32_t(stream), tp, C.size_t(len(topic)),
		C.uint64_t(seq), pp, C.size_t(len(payload)), &c)
	gc()
	runtime.KeepAlive(p)
	runtime.KeepAlive(topic)
	runtime.KeepAlive(payload)
	res := IngestResult{
		BatchesApplied: uint32(c.batches_applied),
		Clears:         uint32(c.clears),
		DecodeErrors:   uint32(c.decode_errors),
		Refused:        uint32(c.refused),
	}
	return res, check(st, "kvr_partition_ingest")
}

// IngressStats returns the counters of every event stream of the partition (ingested or
// subscribed; a stream's counters stay after its subscription stops).
func (p *Partition) IngressStats() ([]StreamStats, error) {
	if p.ptr == nil {
		return nil, ErrClosed
	}
	buf := make([]C.kvr_stream_stats, 4)
	for {
		var n C.size_t
		gc()
		st := C.kvr_partition_ingress_stats(p.ptr, &buf[0], C.size_t(len(buf)), &n)
		gc()
		runtime.KeepAlive(p)
		switch st {
		case C.KVR_OK:
			out := make([]StreamStats, int(n))
			for i := range out {
				out[i] = streamStatsOf(&buf[i])
			}
			return out, nil
		case C.KVR_BUFFER_TOO_SMALL:
			// Room for what was needed plus slack: streams may be added meanwhile.
			buf = make([]C.kvr_stream_stats, int(n)+int(n)/4+4)
		default:
			return nil, check(st, "kvr_partition_ingress_stats")
		}
	}
}

// DecodeErrorName names slot kind of StreamStats.DecodeErrors (e.g. "truncated");
// ErrInvalidArgument for a slot kvr does not use.
func DecodeErrorName(kind int) (string, error) {
	if kind < 0 || kind >= DecodeErrorKinds {
		return "", &Error{Status: StatusInvalidArgument, Op: "kvr_decode_error_name"}
	}
	var name *C.char
	var n C.size_t
	gc()
	st := C.kvr_decode_error_name(C.uint32_t(kind), &name, &n)
	gc()
	if err := check(st, "kvr_decode_error_name"); err != nil {
		return "", err
	}
	return C.GoStringN(name, C.int(n)), nil
}
