package kvr

// #include "shim.h"
import "C"

import (
	"runtime"
	"unsafe"
)

// benchSelectLoop runs iters advisory selections of tokens in one C loop (no Go→C
// transition per selection): BenchmarkSelectC's baseline for the binding's overhead.
func benchSelectLoop(p *Partition, req *Request, tokens []uint32, iters uint64) error {
	if p.ptr == nil || req.ptr == nil {
		return ErrClosed
	}
	tp, tn := cu32(tokens)
	st := C.kvrgo_bench_select_loop(uptr(unsafe.Pointer(p.ptr)), uptr(unsafe.Pointer(req.ptr)), tp, tn, C.uint64_t(iters))
	runtime.KeepAlive(p)
	runtime.KeepAlive(req)
	runtime.KeepAlive(tokens)
	return check(st, "kvr_partition_select")
}

// benchPlainCLoop runs iters advisory selections of tokens as a plain C host would (set
// the prompt, select; the public header only), in one C loop: BenchmarkSelectPlainC.
func benchPlainCLoop(p *Partition, req *Request, tokens []uint32, iters uint64) error {
	if p.ptr == nil || req.ptr == nil {
		return ErrClosed
	}
	tp, tn := cu32(tokens)
	st := C.kvrgo_bench_plain_c_loop(uptr(unsafe.Pointer(p.ptr)), uptr(unsafe.Pointer(req.ptr)), tp, tn, C.uint64_t(iters))
	runtime.KeepAlive(p)
	runtime.KeepAlive(req)
	runtime.KeepAlive(tokens)
	return check(st, "kvr_partition_select")
}

// benchABILoop calls kvr_abi_version iters times in one C loop (BenchmarkCgoFloorPaired).
func benchABILoop(iters uint64) uint32 {
	return uint32(C.kvrgo_bench_abi_loop(C.uint64_t(iters)))
}

// benchSpin is one kvr-free C call of iters dependent steps (the spin floor).
func benchSpin(iters, x uint64) uint64 {
	return uint64(C.kvrgo_bench_spin(C.uint64_t(iters), C.uint64_t(x)))
}

// benchSpinLoop makes calls kvrgo_bench_spin calls in one C loop.
func benchSpinLoop(calls, iters uint64) uint64 {
	return uint64(C.kvrgo_bench_spin_loop(C.uint64_t(calls), C.uint64_t(iters)))
}

// benchWalkInit lays out the pointer chase's cycle (once, before timing).
func benchWalkInit() { C.kvrgo_bench_walk_init() }

// benchWalk is one kvr-free C call of iters pointer-chase steps in 16 KiB.
func benchWalk(iters, at uint64) uint64 {
	return uint64(C.kvrgo_bench_walk(C.uint64_t(iters), C.uint64_t(at)))
}

// benchWalkLoop makes calls kvrgo_bench_walk calls in one C loop.
func benchWalkLoop(calls, iters uint64) uint64 {
	return uint64(C.kvrgo_bench_walk_loop(C.uint64_t(calls), C.uint64_t(iters)))
}
