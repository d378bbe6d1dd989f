package kvr

// #include <stdlib.h>
// #include "shim.h"
import "C"

import (
	"math"
	"runtime"
	"sync"
	"time"
	"unsafe"
)

// The most multimodal inputs (AddMMInput) and raw block keys (AddBlockKey) one request
// may carry; beyond them the call fails with StatusTooLarge and adds nothing.
const (
	MaxMMInputs  = C.KVR_MAX_MM_INPUTS
	MaxBlockKeys = C.KVR_MAX_BLOCK_KEYS
)

// Request is a reusable selection request: everything but the prompt, which each
// selection call takes (Prompt) and borrows for that call only. Every setter copies its
// input. Use a Request from one goroutine at a time (including while a selection uses
// it); Reset it between requests. A Request that is reused allocates nothing per
// selection.
type Request struct {
	ptr *C.kvr_request
	// out receives the decision of the selections that use this request, and hint a
	// booked selection's transfer hint (Go memory without pointers, reused: no
	// allocation per call).
	out  C.kvr_decision
	hint C.kvr_kv_hint
	// names is C memory for a transfer hint's source block hashes (KeepHintNames).
	names    *C.uint64_t
	namesCap int
}

// NewRequest returns an empty request.
func NewRequest() (*Request, error) {
	var ptr *C.kvr_request
	gc()
	st := C.kvr_request_new(&ptr)
	gc()
	if err := check(st, "kvr_request_new"); err != nil {
		return nil, err
	}
	r := &Request{ptr: ptr}
	runtime.SetFinalizer(r, (*Request).finalize)
	return r, nil
}

func (r *Request) finalize() {
	finalized.Add(1)
	r.Close()
}

// Close frees the request. Idempotent.
func (r *Request) Close() {
	if r.ptr == nil {
		return
	}
	gc()
	C.kvr_request_free(r.ptr)
	gc()
	r.ptr = nil
	r.freeNames()
	runtime.SetFinalizer(r, nil)
}

func (r *Request) freeNames() {
	if r.names != nil {
		C.free(unsafe.Pointer(r.names))
		r.names, r.namesCap = nil, 0
	}
}

// MaxHintNames bounds KeepHintNames.
const MaxHintNames = 1 << 20

// KeepHintNames makes booked selections with this request fill KVHint.BlockHashes with
// up to n of the source engine's own hashes of the hinted blocks (engines whose hash
// seeds differ name blocks differently). It keeps an n-entry buffer in C memory for the
// request's lifetime (across Reset); 0 drops it.
func (r *Request) KeepHintNames(n int) error {
	if n < 0 || n > MaxHintNames {
		return &Error{Status: StatusInvalidArgument, Op: "kvr_request_set_hint_names_buffer"}
	}
	if r.ptr == nil {
		return ErrClosed
	}
	r.freeNames()
	if n > 0 {
		r.names = (*C.uint64_t)(C.malloc(C.size_t(n) * 8))
		r.namesCap = n
	}
	return r.applyNames()
}

func (r *Request) applyNames() error {
	return r.do("kvr_request_set_hint_names_buffer", func(p *C.kvr_request) C.kvr_status {
		return C.kvr_request_set_hint_names_buffer(p, r.names, C.size_t(r.namesCap))
	})
}

// hintNames copies the first n names the last hint wrote.
func (r *Request) hintNames(n int) []uint64 {
	if r.names == nil || n <= 0 {
		return nil
	}
	if n > r.namesCap {
		n = r.namesCap
	}
	out := make([]uint64, n)
	copy(out, unsafe.Slice((*uint64)(unsafe.Pointer(r.names)), r.namesCap)[:n])
	return out
}

// requestPool lends empty requests to selections called with a nil *Request.
var requestPool = sync.Pool{}

func pooledRequest() (*Request, error) {
	if r, ok := requestPool.Get().(*Request); ok {
		return r, nil
	}
	return NewRequest()
}

func (r *Request) do(op string, f func(*C.kvr_request) C.kvr_status) error {
	if r.ptr == nil {
		return ErrClosed
	}
	gc()
	st := f(r.ptr)
	gc()
	runtime.KeepAlive(r)
	return check(st, op)
}

// Reset clears every field (keeping the request's buffers).
func (r *Request) Reset() error {
	if err := r.do("kvr_request_reset", func(p *C.kvr_request) C.kvr_status {
		return C.kvr_request_reset(p)
	}); err != nil {
		return err
	}
	if r.names != nil {
		return r.applyNames() // KeepHintNames holds across Reset
	}
	return nil
}

// SetLora sets the LoRA adapter ("" = none): it salts the hashes and narrows the
// candidates to workers serving it (never to nothing).
func (r *Request) SetLora(name string) error {
	return r.do("kvr_request_set_lora", func(p *C.kvr_request) C.kvr_status {
		np, nn := cstr(name)
		st := C.kvr_request_set_lora(p, np, nn)
		runtime.KeepAlive(name)
		return st
	})
}

// SetCacheSalt sets the request's cache salt (vLLM's cache_salt; "" = none): folded into
// block 0's hash as engines fold it, so a tokens prompt matches only blocks published
// under the same salt.
func (r *Request) SetCacheSalt(salt string) error {
	return r.do("kvr_request_set_cache_salt", func(p *C.kvr_request) C.kvr_status {
		sp, sn := cstr(salt)
		st := C.kvr_request_set_cache_salt(p, sp, sn)
		runtime.KeepAlive(salt)
		return st
	})
}

// AddMMInput adds a multimodal input to a tokens prompt: identifier (vLLM's
// mm_feature.identifier) occupying prompt tokens offset..offset+length; each block it
// touches hashes with it as vLLM's events do. At most MaxMMInputs per request.
func (r *Request) AddMMInput(identifier []byte, offset, length uint64) error {
	return r.do("kvr_request_add_mm_input", func(p *C.kvr_request) C.kvr_status {
		var ip *C.uint8_t
		if len(identifier) > 0 {
			ip = (*C.uint8_t)(unsafe.Pointer(&identifier[0]))
		}
		st := C.kvr_request_add_mm_input(p, ip, C.size_t(len(identifier)), C.uint64_t(offset), C.uint64_t(length))
		runtime.KeepAlive(identifier)
		return st
	})
}

// AddBlockKey adds a raw extra-key value to block `block` of a tokens prompt (Dynamo's
// per-block mm_hash, or a prompt-embeddings key). At most MaxBlockKeys per request.
func (r *Request) AddBlockKey(block int, key uint64) error {
	if block < 0 {
		return &Error{Status: StatusInvalidArgument, Op: "kvr_request_add_block_key"}
	}
	return r.do("kvr_request_add_block_key", func(p *C.kvr_request) C.kvr_status {
		return C.kvr_request_add_block_key(p, C.size_t(block), C.uint64_t(key))
	})
}

// SetAllowedWorkers sets the caller's allow-set. An empty set allows no worker (the
// selection's outcome is NoWorker); to allow every worker, do not set it (or Reset).
func (r *Request) SetAllowedWorkers(workers []uint64) error {
	return r.do("kvr_request_set_allowed_workers", func(p *C.kvr_request) C.kvr_status {
		wp, wn := cu64(workers)
		st := C.kvr_request_set_allowed_workers(p, wp, wn)
		runtime.KeepAlive(workers)
		return st
	})
}

// SetPinnedWorker routes to workerID if it is allowed (LoRA narrowing never removes an
// allowed pin).
func (r *Request) SetPinnedWorker(workerID uint64) error {
	return r.do("kvr_request_set_pinned_worker", func(p *C.kvr_request) C.kvr_status {
		return C.kvr_request_set_pinned_worker(p, C.uint64_t(workerID))
	})
}

// Session is a structured session context.
type Session struct {
	// ID must not be empty.
	ID string
	// ParentID ("" = none) lets a child session inherit its parent's binding.
	ParentID string
	// Final: this turn ends the session (its binding goes once its leases end).
	Final        bool
	InputTrigger string
}

// SetSession sets the structured session context; it takes precedence over a legacy
// session id.
func (r *Request) SetSession(s Session) error {
	return r.do("kvr_request_set_session", func(p *C.kvr_request) C.kvr_status {
		ip, in := cstr(s.ID)
		pp, pn := cstr(s.ParentID)
		tp, tn := cstr(s.InputTrigger)
		var final C.uint32_t
		if s.Final {
			final = 1
		}
		st := C.kvr_request_set_session(p, ip, in, pp, pn, final, tp, tn)
		runtime.KeepAlive(s.ID)
		runtime.KeepAlive(s.ParentID)
		runtime.KeepAlive(s.InputTrigger)
		return st
	})
}

// SetLegacySessionID sets a flat session id ("" = none), used only without a structured
// session context.
func (r *Request) SetLegacySessionID(id string) error {
	return r.do("kvr_request_set_legacy_session_id", func(p *C.kvr_request) C.kvr_status {
		ip, in := cstr(id)
		st := C.kvr_request_set_legacy_session_id(p, ip, in)
		runtime.KeepAlive(id)
		return st
	})
}

// Overrides are per-request cost overrides (Dynamo's four); nil keeps the partition's
// value.
type Overrides struct {
	OverlapScoreCredit    *float64
	PrefillLoadScale      *float64
	Temperature           *float64
	SharedCacheMultiplier *float64
}

// Float64 returns a pointer to v (for Overrides).
func Float64(v float64) *float64 { return &v }

func orNaN(v *float64) C.double {
	if v == nil {
		return C.double(math.NaN())
	}
	return C.double(*v)
}

// SetOverrides sets the per-request cost overrides (infinite values are refused).
func (r *Request) SetOverrides(o Overrides) error {
	return r.do("kvr_request_set_overrides", func(p *C.kvr_request) C.kvr_status {
		return C.kvr_request_set_overrides(p, orNaN(o.OverlapScoreCredit), orNaN(o.PrefillLoadScale),
			orNaN(o.Temperature), orNaN(o.SharedCacheMultiplier))
	})
}

// SetExpectedOutputTokens sets the output tokens the request is expected to produce
// (booked into decode load).
func (r *Request) SetExpectedOutputTokens(tokens uint64) error {
	return r.do("kvr_request_set_expected_output_tokens", func(p *C.kvr_request) C.kvr_status {
		return C.kvr_request_set_expected_output_tokens(p, C.uint64_t(tokens))
	})
}

// SetSelectionID sets the caller's own selection id for booked modes (0 = let the
// engine mint one). A live or recently freed id is refused with
// ErrDuplicateSelectionID when booking.
func (r *Request) SetSelectionID(id uint64) error {
	return r.do("kvr_request_set_selection_id", func(p *C.kvr_request) C.kvr_status {
		return C.kvr_request_set_selection_id(p, C.uint64_t(id))
	})
}

// SetTTL sets the booking's lifetime in booked modes, in whole milliseconds (0 = the
// partition's default; a positive duration under 1 ms is 1 ms; negative is refused).
func (r *Request) SetTTL(d time.Duration) error {
	ms, err := millis(d, "kvr_request_set_ttl_ms")
	if err != nil {
		return err
	}
	return r.do("kvr_request_set_ttl_ms", func(p *C.kvr_request) C.kvr_status {
		return C.kvr_request_set_ttl_ms(p, ms)
	})
}
