package kvr

// #include "shim.h"
import "C"

import (
	"runtime"
	"sync"
	"sync/atomic"
)

// Hooks are a partition's host hooks: Go functions kvr calls during a selection (from
// the selecting goroutine's thread, possibly from several goroutines at once, with no
// engine lock held: a hook may call kvr again). Every field may be nil (= that input as
// if no host supplied it).
//
// Slices handed to a hook point into kvr's memory: valid during the call only, never to
// be retained.
//
// A hook that panics is recovered (counted by HookPanics) and answers as if absent:
// no estimate, not overloaded, available, a failed shared-cache lookup, no LoRA
// narrowing.
//
// Each hook is a C→Go callback (a few hundred ns); Overloaded, Available and
// PrefillEstimate run once per candidate rank, so prefer PublishLoad and busy
// thresholds for figures that can be pushed ahead of time.
type Hooks struct {
	// PrefillEstimate returns the projected prefill tokens of the request on rank, or
	// ok = false for "no estimate" (kvr then uses prompt − cached).
	PrefillEstimate func(rank Rank, promptTokens, cachedTokens uint64) (tokens uint64, ok bool)
	// Overloaded reports whether rank is overloaded now (not chosen; all overloaded =
	// the Busy outcome).
	Overloaded func(rank Rank) bool
	// Available reports whether rank can take requests (false = not a candidate).
	Available func(rank Rank) bool
	// SharedCache returns the block ranges of the prompt (given by its sequence hashes)
	// present in the host's shared KV cache, appended to dst (empty, with room kvr
	// provides; appending beyond its capacity is fine). An error = a failed lookup:
	// counted (SelectionStats.SharedCacheFailures), and the selection goes on without
	// shared-cache hits. It may be called again for the same selection when it returns
	// more ranges than dst had room for.
	SharedCache func(seqHashes []uint64, dst []BlockRange) ([]BlockRange, error)
	// LoraFilter sets serves[i] for each of workers that serves adapter lora. An error =
	// no narrowing.
	LoraFilter func(lora string, workers []uint64, serves []bool) error
}

// The handle table: C's user_data is a key of hookTable, never a Go pointer.
var (
	hookMu     sync.RWMutex
	hookTable  = map[uintptr]*Hooks{}
	hookNext   uintptr
	hookPanics atomic.Uint64
)

// HookPanics is how many hook calls panicked (and were recovered) in this process.
func HookPanics() uint64 { return hookPanics.Load() }

// hooksRegistered is the number of live hook handles (tests watch it).
func hooksRegistered() int {
	hookMu.RLock()
	defer hookMu.RUnlock()
	return len(hookTable)
}

func lookupHooks(h C.uintptr_t) *Hooks {
	hookMu.RLock()
	hk := hookTable[uintptr(h)]
	hookMu.RUnlock()
	return hk
}

func releaseHooks(h uintptr) {
	hookMu.Lock()
	delete(hookTable, h)
	hookMu.Unlock()
}

// SetHooks replaces the partition's host hooks (nil, or no function set, removes them).
// The Hooks struct is copied. Selections already running finish with the hooks they
// started with; kvr releases the previous hooks once none uses them. Hooks belong to the
// partition, not to this handle: they stay registered until replaced or until the
// partition goes away (removed from the engine, or the engine dropped, and every handle
// to it closed).
func (p *Partition) SetHooks(h *Hooks) error {
	if p.ptr == nil {
		return ErrClosed
	}
	var mask C.uint32_t
	if h != nil {
		if h.PrefillEstimate != nil {
			mask |= C.KVRGO_HOOK_PREFILL
		}
		if h.Overloaded != nil {
			mask |= C.KVRGO_HOOK_OVERLOADED
		}
		if h.Available != nil {
			mask |= C.KVRGO_HOOK_AVAILABLE
		}
		if h.SharedCache != nil {
			mask |= C.KVRGO_HOOK_SHARED_CACHE
		}
		if h.LoraFilter != nil {
			mask |= C.KVRGO_HOOK_LORA_FILTER
		}
	}
	var handle uintptr
	if mask != 0 {
		cp := *h
		hookMu.Lock()
		hookNext++
		handle = hookNext
		hookTable[handle] = &cp
		hookMu.Unlock()
	}
	gc()
	st := C.kvrgo_set_hooks(p.ptr, C.uintptr_t(handle), mask)
	gc()
	runtime.KeepAlive(p)
	if err := check(st, "kvr_partition_set_hooks"); err != nil {
		// kvr did not take the hooks, so it will not release them.
		if handle != 0 {
			releaseHooks(handle)
		}
		return err
	}
	return nil
}
