// Package kvr is the Go binding of kvr, an in-process selection engine for
// KV-cache-aware LLM inference routing (include/kvr.h, DESIGN.md §11), for Go gateways
// such as an llm-d endpoint picker (Gateway API inference extension EPP) scorer.
//
// # Locking
//
// Index lookups are lock-free: they take no lock and never wait for a writer. Applying
// events takes the rank's mutex and per block its index shard's; booking and free take
// the booking's shard mutex and the rank's booking mutex, prefill completion and output
// blocks the shard mutex only (with events off or a prediction index, booking also
// records under one mutex per partition); advisory selection reads booked ranks'
// prompt blocks and a session's binding under their mutexes (only when there are any);
// worker and load updates take one mutex per partition. No kvr lock is held while a
// host hook runs. The per-path table is in the engine's design notes
// (engine/src/docs/locking.rs).
//
// # Shape
//
// An [Engine] holds partitions; a [Partition] (model, routing group) holds an index of
// the KV blocks each worker's ranks hold (fed with [Partition.ApplyEvents]), the workers
// ([Partition.UpsertWorker]), their reported load ([Partition.PublishLoad]) and the
// engine's own bookings. [Partition.Select] answers which rank should serve a prompt;
// [Partition.SelectAndReserve] also books it, and the booking is then driven by its
// selection id through [Engine.MarkPrefillComplete], [Engine.AddOutputBlocks] and
// [Engine.FreeBooking]. Engines' own KV-event messages (vLLM/SGLang ZMQ) reach the index
// through [Partition.Subscribe] (kvr's own subscriber thread) or [Partition.Ingest] (the
// host reads the sockets); [Partition.IngressStats] counts them per stream.
//
// # Indexer policy, transfer hints, session affinity
//
// Partition options choose the index that answers overlap queries ([IndexerPolicy]):
// the engines' KV events (the default), those plus a prediction side index fed by
// bookings ([WithPredictionTTL]), an approximate index fed by bookings alone
// ([WithKVEvents](false), [WithApproxIndex]), or a remote index service
// ([WithRemoteIndexer]); [Partition.IndexerStats] reports the policy and its counters.
// Contradictory options fail CreatePartition with [ErrInvalidConfig], whose Reason says
// why; [CheckPartitionOptions] checks options up front and returns kvr's notices.
// [WithKVHints] attaches a transfer hint ([Decision.Hint]) to a booking when a peer rank
// with a control endpoint holds a longer prefix. [WithSessionAffinity] keeps a session's
// turns on its rank ([Decision.SessionRoute], [Partition.SessionStats]).
//
// # Handles
//
// Engine, Partition, Request, Worker and Subscription wrap C handles. Close releases one
// (Close is idempotent); a finalizer releases a handle that is dropped without Close, as
// a safety net only. A method on a closed handle returns [ErrClosed]. Close must not run
// concurrently with another method on the same handle (a [Subscription] excepted: all
// its methods may run concurrently, and its finalizer stops it, so keep it reachable).
//
// Engine and Partition methods may be called from many goroutines at once. A Request
// and a Worker are builders: use each from one goroutine at a time (keep one Request per
// goroutine and Reset it between requests; that path allocates nothing).
//
// # Outcomes and errors
//
// A selection that finds every candidate busy, or no candidate at all, is an outcome of
// normal operation, not an error: it is reported in [Decision.Outcome] ([Busy],
// [NoWorker]) with a nil error. Errors are *[Error] values carrying the C status; compare
// them with errors.Is against the sentinels ([ErrUnknownSelectionID], ...) or extract the
// status with errors.As. [Decision.Err] turns the outcome into an error for callers that
// prefer one.
//
// # Memory
//
// Slices are passed to C without copying, for the duration of one cgo call only: kvr
// never keeps a Go pointer (the C API's borrowed request prompt is set, used and cleared
// inside one call). The one copy: an event batch of several events is flattened into
// reused buffers (C's event structs hold pointers, which Go memory passed to C may not).
// Outputs go into caller-supplied slices, grown when too small. Selections, lookups,
// hashing and the booking lifecycle allocate nothing in Go (a booking that carries a
// transfer hint allocates its [KVHint]).
//
// # Hooks
//
// Host hooks ([Hooks]) are Go functions called by kvr during a selection, through C
// trampolines whose user_data is an integer handle into a table of the package, never a
// Go pointer. A hook that panics is recovered and treated as "no input" (see [Hooks]).
//
// Build with -tags kvrdebug to force a garbage collection before and after every cgo
// call (to shake out lifetime bugs: a missing KeepAlive or an early finalizer).
package kvr

// Linking: the compiler and linker flags come from pkg-config's kvr module (kvr.pc, which
// `make install` installs under PREFIX/lib/pkgconfig): set PKG_CONFIG_PATH to that
// directory. Inside the repository, ffi/go/run.sh generates a kvr.pc for the build tree.

/*
#cgo pkg-config: kvr
#include <stdlib.h>
#include "shim.h"

// Link-time ABI check: references kvr_abi_<KVR_ABI_VERSION>, so a libkvr.a of another ABI
// generation fails to link.
static uint32_t kvrgo_abi_check(void) { KVR_ABI_CHECK(); return kvr_abi_2; }
*/
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"
)

// Version of the C ABI's source this binding was built against.
const (
	VersionMajor = C.KVR_VERSION_MAJOR
	VersionMinor = C.KVR_VERSION_MINOR
	VersionPatch = C.KVR_VERSION_PATCH
	// ABIVersionHeader is the ABI generation of include/kvr.h.
	ABIVersionHeader = C.KVR_ABI_VERSION
)

func init() {
	// The link itself checked the generation (kvrgo_abi_check references kvr_abi_N);
	// this catches a mismatched shared library or a stale header.
	if v := uint32(C.kvr_abi_version()); v != ABIVersionHeader || uint32(C.kvrgo_abi_check()) != ABIVersionHeader {
		panic(fmt.Sprintf("kvr: libkvr ABI version %d, binding built for %d", v, ABIVersionHeader))
	}
}

// ABIVersion is the ABI generation of the linked library (kvr_abi_version).
func ABIVersion() uint32 {
	gc()
	v := uint32(C.kvr_abi_version())
	gc()
	return v
}

// gc forces a collection in kvrdebug builds (compiled away otherwise).
func gc() {
	if debugMode {
		runtime.GC()
	}
}

// Strings and slices as C (pointer, length) pairs, without copying. The pointers are
// only valid for the cgo call they are passed to; callers KeepAlive the source after it.

func cstr(s string) (*C.char, C.size_t) {
	if len(s) == 0 {
		return nil, 0
	}
	// The data pointer of the string header (unsafe.StringData is Go 1.20).
	return (*C.char)(*(*unsafe.Pointer)(unsafe.Pointer(&s))), C.size_t(len(s))
}

func cu32(s []uint32) (*C.uint32_t, C.size_t) {
	if len(s) == 0 {
		return nil, 0
	}
	return (*C.uint32_t)(unsafe.Pointer(&s[0])), C.size_t(len(s))
}

func cu64(s []uint64) (*C.uint64_t, C.size_t) {
	if len(s) == 0 {
		return nil, 0
	}
	return (*C.uint64_t)(unsafe.Pointer(&s[0])), C.size_t(len(s))
}

// uptr passes a C handle as an integer (see shim.h: no per-call allocation for cgo's
// pointer check).
func uptr(p unsafe.Pointer) C.uintptr_t { return C.uintptr_t(uintptr(p)) }

// unpack splits a helper's packed result: the status (low 32 bits) and a count.
func unpack(v C.uint64_t) (C.kvr_status, uint64) {
	return C.kvr_status(uint32(v)), uint64(v) >> 32
}

// grow returns s resliced to n elements, reallocated if its capacity is smaller.
func grow(s []uint64, n int) []uint64 {
	if cap(s) >= n {
		return s[:n]
	}
	return make([]uint64, n)
}
