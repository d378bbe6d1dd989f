package kvr

// #include "shim.h"
import "C"

import (
	"runtime"
	"sort"
)

// Role is a worker's backend role.
type Role uint32

// The roles.
const (
	// RoleAggregated: prefill and decode on the same worker (the default).
	RoleAggregated Role = C.KVR_ROLE_AGGREGATED
	// RolePrefill: a prefill worker of a disaggregated deployment.
	RolePrefill Role = C.KVR_ROLE_PREFILL
	// RoleDecode: a decode worker of a disaggregated deployment.
	RoleDecode Role = C.KVR_ROLE_DECODE
)

// Worker is a worker's metadata under construction (a kvr_worker builder): set it up,
// then Partition.UpsertWorker copies it. It stays the caller's and may be reused. Use
// it from one goroutine at a time.
type Worker struct {
	ptr *C.kvr_worker
}

// NewWorker starts a worker workerID with dpSize data-parallel ranks (≥ 1), role
// aggregated, nothing else set.
func NewWorker(workerID uint64, dpSize uint32) (*Worker, error) {
	var ptr *C.kvr_worker
	gc()
	st := C.kvr_worker_new(C.uint64_t(workerID), C.uint32_t(dpSize), &ptr)
	gc()
	if err := check(st, "kvr_worker_new"); err != nil {
		return nil, err
	}
	w := &Worker{ptr: ptr}
	runtime.SetFinalizer(w, (*Worker).finalize)
	return w, nil
}

func (w *Worker) finalize() {
	finalized.Add(1)
	w.Close()
}

// Close frees the builder. Idempotent.
func (w *Worker) Close() {
	if w.ptr == nil {
		return
	}
	gc()
	C.kvr_worker_free(w.ptr)
	gc()
	w.ptr = nil
	runtime.SetFinalizer(w, nil)
}

func (w *Worker) do(op string, f func(*C.kvr_worker) C.kvr_status) error {
	if w.ptr == nil {
		return ErrClosed
	}
	gc()
	st := f(w.ptr)
	gc()
	runtime.KeepAlive(w)
	return check(st, op)
}

// SetRole sets the worker's role.
func (w *Worker) SetRole(role Role) error {
	return w.do("kvr_worker_set_role", func(p *C.kvr_worker) C.kvr_status {
		return C.kvr_worker_set_role(p, C.uint32_t(role))
	})
}

// SetControlEndpoint sets the endpoint a peer uses to pull KV blocks from rank dpRank
// (< dp size); "" clears it.
func (w *Worker) SetControlEndpoint(dpRank uint32, endpoint string) error {
	return w.do("kvr_worker_set_control_endpoint", func(p *C.kvr_worker) C.kvr_status {
		ep, en := cstr(endpoint)
		st := C.kvr_worker_set_control_endpoint(p, C.uint32_t(dpRank), ep, en)
		runtime.KeepAlive(endpoint)
		return st
	})
}

// SetTotalKVBlocks sets the device KV blocks per rank (0 = unknown).
func (w *Worker) SetTotalKVBlocks(blocks uint64) error {
	return w.do("kvr_worker_set_total_kv_blocks", func(p *C.kvr_worker) C.kvr_status {
		return C.kvr_worker_set_total_kv_blocks(p, C.uint64_t(blocks))
	})
}

// SetMaxBatchedTokens sets the largest prefill batch per rank in tokens (0 = unknown).
func (w *Worker) SetMaxBatchedTokens(tokens uint64) error {
	return w.do("kvr_worker_set_max_batched_tokens", func(p *C.kvr_worker) C.kvr_status {
		return C.kvr_worker_set_max_batched_tokens(p, C.uint64_t(tokens))
	})
}

// AddLoraAdapter adds a LoRA adapter the worker serves (empty names are refused).
func (w *Worker) AddLoraAdapter(name string) error {
	return w.do("kvr_worker_add_lora_adapter", func(p *C.kvr_worker) C.kvr_status {
		np, nn := cstr(name)
		st := C.kvr_worker_add_lora_adapter(p, np, nn)
		runtime.KeepAlive(name)
		return st
	})
}

// SetLabel sets label key = value (a later value for the same key wins).
func (w *Worker) SetLabel(key, value string) error {
	return w.do("kvr_worker_set_label", func(p *C.kvr_worker) C.kvr_status {
		kp, kn := cstr(key)
		vp, vn := cstr(value)
		st := C.kvr_worker_set_label(p, kp, kn, vp, vn)
		runtime.KeepAlive(key)
		runtime.KeepAlive(value)
		return st
	})
}

// WorkerConfig is a worker's metadata as plain data (Build makes the Worker).
type WorkerConfig struct {
	ID uint64
	// DPSize: data-parallel ranks (0 means 1).
	DPSize uint32
	Role   Role
	// ControlEndpoints[i] is rank i's endpoint ("" = none).
	ControlEndpoints []string
	// TotalKVBlocks and MaxBatchedTokens per rank (0 = unknown).
	TotalKVBlocks    uint64
	MaxBatchedTokens uint64
	LoraAdapters     []string
	Labels           map[string]string
}

// Build makes a Worker from the config; the caller closes it.
func (c WorkerConfig) Build() (*Worker, error) {
	dp := c.DPSize
	if dp == 0 {
		dp = 1
	}
	w, err := NewWorker(c.ID, dp)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*Worker, error) {
		w.Close()
		return nil, err
	}
	if c.Role != RoleAggregated {
		if err := w.SetRole(c.Role); err != nil {
			return fail(err)
		}
	}
	for i, ep := range c.ControlEndpoints {
		if ep != "" {
			if err := w.SetControlEndpoint(uint32(i), ep); err != nil {
				return fail(err)
			}
		}
	}
	if c.TotalKVBlocks != 0 {
		if err := w.SetTotalKVBlocks(c.TotalKVBlocks); err != nil {
			return fail(err)
		}
	}
	if c.MaxBatchedTokens != 0 {
		if err := w.SetMaxBatchedTokens(c.MaxBatchedTokens); err != nil {
			return fail(err)
		}
	}
	for _, l := range c.LoraAdapters {
		if err := w.AddLoraAdapter(l); err != nil {
			return fail(err)
		}
	}
	keys := make([]string, 0, len(c.Labels))
	for k := range c.Labels {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if err := w.SetLabel(k, c.Labels[k]); err != nil {
			return fail(err)
		}
	}
	return w, nil
}
