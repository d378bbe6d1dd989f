package kvr

import (
	"errors"
	"sync/atomic"
	"testing"
)

func TestHooks(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 3)
	tokens := promptTokens(64, 20)
	storePrefix(t, p, 1, tokens, 4)
	base := hooksRegistered()

	var prefillCalls, overloadCalls, availCalls atomic.Int64
	must(t, p.SetHooks(&Hooks{
		Available: func(r Rank) bool {
			availCalls.Add(1)
			return r.WorkerID != 1 // the worker holding the prefix is unavailable
		},
		Overloaded: func(r Rank) bool {
			overloadCalls.Add(1)
			// A hook may call kvr again.
			if _, err := p.ActiveLoad(r); err != nil {
				panic(err)
			}
			return r.WorkerID == 3
		},
		PrefillEstimate: func(r Rank, prompt, cached uint64) (uint64, bool) {
			prefillCalls.Add(1)
			if prompt != 64 {
				panic("prompt tokens")
			}
			return 777, r.WorkerID == 2
		},
	}))
	if hooksRegistered() != base+1 {
		t.Fatalf("hooks not registered")
	}
	for i := 0; i < 10; i++ {
		d, err := p.Select(nil, Tokens(tokens))
		must(t, err)
		if d.WorkerID != 2 || d.ProjectedPrefillTokens != 777 {
			t.Fatalf("Select with hooks = %+v", d)
		}
	}
	if availCalls.Load() == 0 || overloadCalls.Load() == 0 || prefillCalls.Load() == 0 {
		t.Fatalf("hooks not called: available %d, overloaded %d, prefill %d",
			availCalls.Load(), overloadCalls.Load(), prefillCalls.Load())
	}

	// Replacing the hooks releases the old ones; removing them releases the new.
	var loraCalls atomic.Int64
	must(t, p.SetHooks(&Hooks{LoraFilter: func(lora string, workers []uint64, serves []bool) error {
		loraCalls.Add(1)
		if lora != "adapterA" || len(workers) != len(serves) {
			return errors.New("unexpected arguments")
		}
		for i, w := range workers {
			serves[i] = w == 3
		}
		return nil
	}}))
	if hooksRegistered() != base+1 {
		t.Fatalf("replaced hooks not released: %d registered, base %d", hooksRegistered(), base)
	}
	req, err := NewRequest()
	must(t, err)
	defer req.Close()
	must(t, req.SetLora("adapterA"))
	for i := 0; i < 5; i++ {
		d, err := p.Select(req, Tokens(tokens))
		must(t, err)
		if d.WorkerID != 3 {
			t.Fatalf("LoRA narrowing ignored: %+v", d)
		}
	}
	if loraCalls.Load() == 0 {
		t.Fatalf("LoRA filter not called")
	}
	// A failing filter narrows nothing.
	must(t, p.SetHooks(&Hooks{LoraFilter: func(string, []uint64, []bool) error { return errors.New("down") }}))
	seen := map[uint64]bool{}
	for i := 0; i < 60; i++ {
		d, err := p.Select(req, Tokens(tokens))
		must(t, err)
		seen[d.WorkerID] = true
	}
	if len(seen) < 2 {
		t.Fatalf("failing LoRA filter narrowed the candidates: %v", seen)
	}

	must(t, p.SetHooks(nil))
	if hooksRegistered() != base {
		t.Fatalf("removed hooks not released")
	}
	must(t, p.SetHooks(&Hooks{})) // no function: same as nil
	if hooksRegistered() != base {
		t.Fatalf("empty hooks registered")
	}

	// Hooks go with the partition.
	q := testPartition(t, e, "q", 1)
	must(t, q.SetHooks(&Hooks{Overloaded: func(Rank) bool { return false }}))
	if hooksRegistered() != base+1 {
		t.Fatalf("hooks of q not registered")
	}
	must(t, e.RemovePartition("m", "q"))
	q.Close()
	if hooksRegistered() != base {
		t.Fatalf("hooks of a removed, closed partition not released")
	}
}

func TestSharedCacheHook(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 2, WithSharedCacheMultiplier(1))
	tokens := promptTokens(64, 21)
	storePrefix(t, p, 1, tokens, 1)

	var calls atomic.Int64
	must(t, p.SetHooks(&Hooks{SharedCache: func(seq []uint64, dst []BlockRange) ([]BlockRange, error) {
		calls.Add(1)
		return append(dst, BlockRange{Start: 0, End: uint32(len(seq))}), nil
	}}))
	d, err := p.Select(nil, Tokens(tokens))
	must(t, err)
	if calls.Load() != 1 || d.SharedBlocks != 4-d.DeviceBlocks {
		t.Fatalf("shared cache: %d calls, decision %+v", calls.Load(), d)
	}

	// More ranges than kvr first offers room for: kvr asks again with room.
	long := promptTokens(100*testBlock, 22)
	calls.Store(0)
	var lastCap int64
	must(t, p.SetHooks(&Hooks{SharedCache: func(seq []uint64, dst []BlockRange) ([]BlockRange, error) {
		calls.Add(1)
		atomic.StoreInt64(&lastCap, int64(cap(dst)))
		out := make([]BlockRange, 0, len(seq)) // not dst: the binding copies it
		for i := range seq {
			out = append(out, BlockRange{Start: uint32(i), End: uint32(i + 1)})
		}
		return out, nil
	}}))
	d, err = p.Select(nil, Tokens(long))
	must(t, err)
	if calls.Load() != 2 || atomic.LoadInt64(&lastCap) < 100 || d.SharedBlocks == 0 {
		t.Fatalf("shared cache retry: %d calls, last cap %d, decision %+v", calls.Load(), lastCap, d)
	}

	// A failing lookup is counted and the selection goes on.
	before, err := p.SelectionStats()
	must(t, err)
	must(t, p.SetHooks(&Hooks{SharedCache: func([]uint64, []BlockRange) ([]BlockRange, error) {
		return nil, errors.New("cache down")
	}}))
	d, err = p.Select(nil, Tokens(tokens))
	must(t, err)
	if d.Outcome != Selected || d.SharedBlocks != 0 {
		t.Fatalf("Select with failing shared cache = %+v", d)
	}
	after, err := p.SelectionStats()
	must(t, err)
	if after.SharedCacheFailures != before.SharedCacheFailures+1 {
		t.Fatalf("shared-cache failures %d -> %d", before.SharedCacheFailures, after.SharedCacheFailures)
	}
}

func TestPanickingHook(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 2)
	tokens := promptTokens(64, 23)
	before := HookPanics()
	must(t, p.SetHooks(&Hooks{
		Overloaded:      func(Rank) bool { panic("overloaded") },
		Available:       func(Rank) bool { panic("available") },
		PrefillEstimate: func(Rank, uint64, uint64) (uint64, bool) { panic("prefill") },
		SharedCache:     func([]uint64, []BlockRange) ([]BlockRange, error) { panic("shared") },
	}))
	d, err := p.Select(nil, Tokens(tokens))
	must(t, err)
	if d.Outcome != Selected || d.ProjectedPrefillTokens != 64 {
		t.Fatalf("Select with panicking hooks = %+v", d)
	}
	if HookPanics() < before+4 {
		t.Fatalf("HookPanics %d -> %d", before, HookPanics())
	}
	ss, err := p.SelectionStats()
	must(t, err)
	if ss.SharedCacheFailures != 1 {
		t.Fatalf("panicking shared-cache hook not counted as a failure: %+v", ss)
	}
}
