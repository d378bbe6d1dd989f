package kvr

// The Go side of the hook trampolines (shim.c): kvr calls the C trampoline with the
// hooks' user_data, which forwards it as an integer handle of hookTable to these.
// This file's preamble holds declarations only (cgo copies it into _cgo_export.c).

// #include "shim.h"
import "C"

import "unsafe"

// recoverHook is deferred by every trampoline: a panicking hook must not unwind through
// kvr's Rust frames, so it is recovered, counted, and answered with fallback.
func recoverHook(rc *C.int32_t, fallback C.int32_t) {
	if r := recover(); r != nil {
		hookPanics.Add(1)
		*rc = fallback
	}
}

//export kvrgoHookRelease
func kvrgoHookRelease(h C.uintptr_t) {
	releaseHooks(uintptr(h))
}

//export kvrgoHookPrefill
func kvrgoHookPrefill(h C.uintptr_t, workerID C.uint64_t, dpRank C.uint32_t, promptTokens, cachedTokens C.uint64_t, out *C.uint64_t) (rc C.int32_t) {
	hk := lookupHooks(h)
	if hk == nil || hk.PrefillEstimate == nil {
		return 1
	}
	defer recoverHook(&rc, 1)
	t, ok := hk.PrefillEstimate(Rank{WorkerID: uint64(workerID), DPRank: uint32(dpRank)},
		uint64(promptTokens), uint64(cachedTokens))
	if !ok {
		return 1
	}
	*out = C.uint64_t(t)
	return 0
}

//export kvrgoHookOverloaded
func kvrgoHookOverloaded(h C.uintptr_t, workerID C.uint64_t, dpRank C.uint32_t) (rc C.int32_t) {
	hk := lookupHooks(h)
	if hk == nil || hk.Overloaded == nil {
		return 0
	}
	defer recoverHook(&rc, 0)
	if hk.Overloaded(Rank{WorkerID: uint64(workerID), DPRank: uint32(dpRank)}) {
		return 1
	}
	return 0
}

//export kvrgoHookAvailable
func kvrgoHookAvailable(h C.uintptr_t, workerID C.uint64_t, dpRank C.uint32_t) (rc C.int32_t) {
	hk := lookupHooks(h)
	if hk == nil || hk.Available == nil {
		return 1
	}
	defer recoverHook(&rc, 1)
	if hk.Available(Rank{WorkerID: uint64(workerID), DPRank: uint32(dpRank)}) {
		return 1
	}
	return 0
}

//export kvrgoHookSharedCache
func kvrgoHookSharedCache(h C.uintptr_t, seq *C.uint64_t, n C.size_t, out *C.kvr_block_range, capacity C.size_t, outLen *C.size_t) (rc C.int32_t) {
	hk := lookupHooks(h)
	if hk == nil || hk.SharedCache == nil {
		return 1
	}
	defer recoverHook(&rc, 1)
	var seqs []uint64
	if n > 0 && seq != nil {
		seqs = unsafe.Slice((*uint64)(unsafe.Pointer(seq)), int(n))
	}
	var full []BlockRange
	if capacity > 0 && out != nil {
		full = unsafe.Slice((*BlockRange)(unsafe.Pointer(out)), int(capacity))
	}
	got, err := hk.SharedCache(seqs, full[:0])
	if err != nil {
		return 1
	}
	if len(got) <= len(full) {
		copy(full, got) // a no-op when the hook appended in place
	}
	*outLen = C.size_t(len(got))
	return 0
}

//export kvrgoHookLoraFilter
func kvrgoHookLoraFilter(h C.uintptr_t, lora *C.char, loraLen C.size_t, workers *C.uint64_t, n C.size_t, serves *C.uint8_t) (rc C.int32_t) {
	hk := lookupHooks(h)
	if hk == nil || hk.LoraFilter == nil {
		return 1
	}
	defer recoverHook(&rc, 1)
	name := C.GoStringN(lora, C.int(loraLen))
	var ws []uint64
	var sv []bool
	if n > 0 && workers != nil && serves != nil {
		ws = unsafe.Slice((*uint64)(unsafe.Pointer(workers)), int(n))
		// kvr zeroes out_serves, so every byte is a valid Go bool.
		sv = unsafe.Slice((*bool)(unsafe.Pointer(serves)), int(n))
	}
	if err := hk.LoraFilter(name, ws, sv); err != nil {
		return 1
	}
	return 0
}
