package kvr

import (
	"errors"
	"strings"
	"testing"
)

const hintEndpoint = "tcp://peer:7000"

// storeOn stores the first blocks of tokens on rank (worker, dpRank), engine hashes
// distinct per rank.
func storeOn(t *testing.T, p *Partition, worker uint64, dpRank uint32, tokens []uint32, blocks int) {
	t.Helper()
	local, seq, err := p.HashTokens("", tokens, nil, nil)
	must(t, err)
	ext := make([]uint64, blocks)
	for i := range ext {
		ext[i] = seq[i] ^ (worker<<8 | uint64(dpRank))
	}
	res, err := p.ApplyEvents(worker, dpRank, []Event{StoredEvent(TierDevice, StoredBlocks(ext, local[:blocks]))})
	must(t, err)
	if res.BlocksStored != uint64(blocks) {
		t.Fatalf("ApplyEvents %+v, want %d blocks", res, blocks)
	}
}

// hintPartition: a 16-block prompt; worker 1 (decode, the one requests pin) holds its
// first 2 blocks; worker 2 (role, DP size 2, endpoint on rank 1 only) holds `held`
// blocks on rank 1.
func hintPartition(t *testing.T, e *Engine, group string, role Role, endpoint string, held int, opts ...PartitionOption) (*Partition, []uint32) {
	t.Helper()
	p := testPartition(t, e, group, 0, opts...)
	tokens := promptTokens(16*testBlock, 50)
	must(t, p.UpsertWorkerConfig(WorkerConfig{ID: 1, Role: RoleDecode, TotalKVBlocks: 10000}))
	must(t, p.UpsertWorkerConfig(WorkerConfig{ID: 2, DPSize: 2, Role: role, TotalKVBlocks: 10000,
		ControlEndpoints: []string{"", endpoint}}))
	storeOn(t, p, 1, 0, tokens, 2)
	storeOn(t, p, 2, 1, tokens, held)
	return p, tokens
}

// pinnedBooking books tokens with worker 1 pinned and frees the booking.
func pinnedBooking(t *testing.T, e *Engine, p *Partition, tokens []uint32) Decision {
	t.Helper()
	req, err := NewRequest()
	must(t, err)
	defer req.Close()
	must(t, req.SetPinnedWorker(1))
	d, err := p.SelectAndReserve(req, Tokens(tokens))
	must(t, err)
	if d.Outcome != Selected || d.Rank != (Rank{WorkerID: 1}) {
		t.Fatalf("pinned booking = %+v", d)
	}
	_, err = e.FreeBooking(d.SelectionID)
	must(t, err)
	return d
}

// sameHint compares two hints, their block hashes included.
func sameHint(a, b KVHint) bool {
	if len(a.BlockHashes) != len(b.BlockHashes) {
		return false
	}
	for i := range a.BlockHashes {
		if a.BlockHashes[i] != b.BlockHashes[i] {
			return false
		}
	}
	a.BlockHashes, b.BlockHashes = nil, nil
	return a.Source == b.Source && a.BlockStart == b.BlockStart && a.BlockEnd == b.BlockEnd &&
		a.ControlEndpoint == b.ControlEndpoint
}

func TestKVHintNamesTheSourceBlocks(t *testing.T) {
	e := newEngine(t)
	p, tokens := hintPartition(t, e, "names", RolePrefill, hintEndpoint, 12, WithKVHints(4, 4096, RolePrefill))
	_, seq, err := p.HashTokens("", tokens, nil, nil)
	must(t, err)
	req, err := NewRequest()
	must(t, err)
	defer req.Close()
	must(t, req.KeepHintNames(4))
	must(t, req.Reset()) // the buffer holds across Reset
	must(t, req.SetPinnedWorker(1))
	d, err := p.SelectAndReserve(req, Tokens(tokens))
	must(t, err)
	if d.Hint == nil || len(d.Hint.BlockHashes) != 4 {
		t.Fatalf("hint %+v", d.Hint)
	}
	for i, h := range d.Hint.BlockHashes {
		if want := seq[2+i] ^ (2<<8 | 1); h != want { // storeOn's names for rank 2/1
			t.Fatalf("name %d = %x, want %x", i, h, want)
		}
	}
	_, err = e.FreeBooking(d.SelectionID)
	must(t, err)
	if err := req.KeepHintNames(-1); err == nil {
		t.Fatal("a negative size is refused")
	}
	must(t, req.KeepHintNames(0))
}

func TestKVHint(t *testing.T) {
	e := newEngine(t)
	hints := WithKVHints(4, 4096, RolePrefill, RoleAggregated)
	p, tokens := hintPartition(t, e, "hint", RolePrefill, hintEndpoint, 12, hints)

	d := pinnedBooking(t, e, p, tokens)
	want := KVHint{Source: Rank{WorkerID: 2, DPRank: 1}, BlockStart: 2, BlockEnd: 12, ControlEndpoint: hintEndpoint}
	if !d.HasHint() || d.Flags&FlagKVHint == 0 || d.Hint == nil || !sameHint(*d.Hint, want) {
		t.Fatalf("booked decision %+v, hint %+v; want %+v", d, d.Hint, want)
	}
	if d.DeviceBlocks != 2 || d.SessionRoute() != SessionNone {
		t.Fatalf("booked decision %+v", d)
	}

	// Advisory selection never carries a hint.
	req, err := NewRequest()
	must(t, err)
	defer req.Close()
	must(t, req.SetPinnedWorker(1))
	a, err := p.Select(req, Tokens(tokens))
	must(t, err)
	if a.WorkerID != 1 || a.HasHint() || a.Hint != nil || a.Flags != 0 {
		t.Fatalf("advisory Select = %+v", a)
	}
	// The same request books with a hint, then (unpinned: the longest holder is chosen)
	// without one: nothing stale comes back.
	b, err := p.SelectAndReserve(req, Tokens(tokens))
	must(t, err)
	if b.Hint == nil || !sameHint(*b.Hint, want) {
		t.Fatalf("booking through a reused request: %+v", b.Hint)
	}
	_, err = e.FreeBooking(b.SelectionID)
	must(t, err)
	must(t, req.Reset())
	c, err := p.SelectAndReserve(req, Tokens(tokens))
	must(t, err)
	if c.Rank != (Rank{WorkerID: 2, DPRank: 1}) || c.HasHint() || c.Hint != nil {
		t.Fatalf("unpinned booking = %+v, hint %+v; want rank 2/1 without a hint", c, c.Hint)
	}
	_, err = e.FreeBooking(c.SelectionID)
	must(t, err)

	// The transfer is capped by the maximum length.
	p, tokens = hintPartition(t, e, "hint-short", RolePrefill, hintEndpoint, 12, WithKVHints(4, 4, RolePrefill))
	if d := pinnedBooking(t, e, p, tokens); d.Hint == nil || d.Hint.BlockStart != 2 || d.Hint.BlockEnd != 6 {
		t.Fatalf("capped hint %+v", d.Hint)
	}
	// Below the minimum advantage (3 < 4): none; at it: one.
	p, tokens = hintPartition(t, e, "hint-min", RolePrefill, hintEndpoint, 5, hints)
	if d := pinnedBooking(t, e, p, tokens); d.HasHint() || d.Hint != nil {
		t.Fatalf("advantage 3: %+v", d.Hint)
	}
	p, tokens = hintPartition(t, e, "hint-min4", RolePrefill, hintEndpoint, 6, hints)
	if d := pinnedBooking(t, e, p, tokens); d.Hint == nil || d.Hint.BlockEnd != 6 {
		t.Fatalf("advantage 4: %+v", d.Hint)
	}
	// No hint when hints are off, from a role not allowed, or without an endpoint.
	for group, opts := range map[string][]PartitionOption{
		"hints-default": nil,
		"hints-off":     {hints, WithKVHints(4, 0)},
		"hints-decode":  {WithKVHints(4, 4096, RoleDecode)},
	} {
		p, tokens = hintPartition(t, e, group, RolePrefill, hintEndpoint, 12, opts...)
		if d := pinnedBooking(t, e, p, tokens); d.HasHint() || d.Hint != nil {
			t.Fatalf("%s: hint %+v", group, d.Hint)
		}
	}
	p, tokens = hintPartition(t, e, "hint-no-endpoint", RolePrefill, "", 12, hints)
	if d := pinnedBooking(t, e, p, tokens); d.HasHint() {
		t.Fatalf("no endpoint: hint %+v", d.Hint)
	}
	p, tokens = hintPartition(t, e, "hint-aggregated", RoleAggregated, hintEndpoint, 12, hints)
	if d := pinnedBooking(t, e, p, tokens); d.Hint == nil || d.Hint.Source != (Rank{WorkerID: 2, DPRank: 1}) {
		t.Fatalf("aggregated source: %+v", d.Hint)
	}
}

// The endpoint travels inline in the hint: the longest one allowed comes back whole,
// a longer one is refused when the worker is set up.
func TestKVHintEndpointLength(t *testing.T) {
	e := newEngine(t)
	longest := "tcp://" + strings.Repeat("e", MaxControlEndpointLen-len("tcp://"))
	p, tokens := hintPartition(t, e, "hint-longest", RolePrefill, longest, 12, WithKVHints(4, 4096, RolePrefill))
	if d := pinnedBooking(t, e, p, tokens); d.Hint == nil || d.Hint.ControlEndpoint != longest {
		t.Fatalf("longest endpoint: hint %+v", d.Hint)
	}
	w, err := NewWorker(3, 1)
	must(t, err)
	defer w.Close()
	if err := w.SetControlEndpoint(0, longest+"x"); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("endpoint of %d bytes: %v", len(longest)+1, err)
	}
	must(t, w.SetControlEndpoint(0, longest))
	err = p.UpsertWorkerConfig(WorkerConfig{ID: 4, ControlEndpoints: []string{longest + "x"}})
	if !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("UpsertWorkerConfig with a too-long endpoint: %v", err)
	}
}

func TestKVHintInvalidArguments(t *testing.T) {
	e := newEngine(t)
	for name, opt := range map[string]PartitionOption{
		"no role":      WithKVHints(4, 4096),
		"unknown role": WithKVHints(4, 4096, RolePrefill, Role(5)),
		"huge role":    WithKVHints(4, 4096, Role(40)),
	} {
		if _, err := e.CreatePartition("m", "bad-hints", testBlock, opt); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", name, err)
		}
	}
	// Hints off take no roles.
	if _, err := CheckPartitionOptions(testBlock, WithKVHints(0, 0)); err != nil {
		t.Fatalf("hints off: %v", err)
	}
}

// Booked selections without a hint allocate nothing, hints on or off.
func TestKVHintNoAllocations(t *testing.T) {
	if debugMode {
		t.Skip("kvrdebug collects around every call")
	}
	e := newEngine(t)
	for _, opts := range [][]PartitionOption{nil, {WithKVHints(4, 4096, RolePrefill, RoleAggregated)}} {
		// Unpinned: the longest holder (worker 2) is chosen, so no hint.
		p, tokens := hintPartition(t, e, "hint-allocs-"+itoa(uint64(len(opts))), RolePrefill, hintEndpoint, 12, opts...)
		req, err := NewRequest()
		must(t, err)
		var d Decision
		if n := testing.AllocsPerRun(200, func() {
			d, err = p.SelectAndReserve(req, Tokens(tokens))
			if err == nil {
				_, err = e.FreeBooking(d.SelectionID)
			}
		}); n != 0 || err != nil || d.WorkerID != 2 || d.Hint != nil {
			t.Fatalf("SelectAndReserve + FreeBooking (%d options): %v allocs/op (%+v, %v)", len(opts), n, d, err)
		}
		req.Close()
	}
}
