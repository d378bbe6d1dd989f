package kvr

import (
	"testing"
)

const testBlock = 16

// newEngine makes a seeded engine closed at the end of the test.
func newEngine(t testing.TB) *Engine {
	t.Helper()
	e, err := New(WithSeed(42))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(e.Close)
	return e
}

// testPartition makes partition ("m", group) with workers 1..n (one rank each).
func testPartition(t testing.TB, e *Engine, group string, n int, opts ...PartitionOption) *Partition {
	t.Helper()
	p, err := e.CreatePartition("m", group, testBlock, opts...)
	if err != nil {
		t.Fatalf("CreatePartition: %v", err)
	}
	t.Cleanup(p.Close)
	for i := 1; i <= n; i++ {
		if err := p.UpsertWorkerConfig(WorkerConfig{ID: uint64(i), TotalKVBlocks: 10000, MaxBatchedTokens: 8192}); err != nil {
			t.Fatalf("UpsertWorkerConfig(%d): %v", i, err)
		}
	}
	return p
}

// promptTokens is a deterministic prompt of n tokens (seed varies it).
func promptTokens(n int, seed uint32) []uint32 {
	t := make([]uint32, n)
	x := seed*2654435761 + 1
	for i := range t {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		t[i] = x % 50000
	}
	return t
}

// storePrefix stores the first blocks of tokens on worker's rank 0 (engine hash = kvr's
// sequence hash) and returns the local hashes of the whole prompt.
func storePrefix(t testing.TB, p *Partition, worker uint64, tokens []uint32, blocks int) []uint64 {
	t.Helper()
	local, seq, err := p.HashTokens("", tokens, nil, nil)
	if err != nil {
		t.Fatalf("HashTokens: %v", err)
	}
	if blocks > len(local) {
		blocks = len(local)
	}
	res, err := p.ApplyEvents(worker, 0, []Event{StoredEvent(TierDevice, StoredBlocks(seq[:blocks], local[:blocks]))})
	if err != nil {
		t.Fatalf("ApplyEvents: %v", err)
	}
	if res.EventsApplied != 1 || res.BlocksStored != uint64(blocks) {
		t.Fatalf("ApplyEvents result %+v, want 1 event, %d blocks", res, blocks)
	}
	return local
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
