package kvr

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

func TestABIAndStatus(t *testing.T) {
	if ABIVersion() != ABIVersionHeader {
		t.Fatalf("ABIVersion %d, header %d", ABIVersion(), ABIVersionHeader)
	}
	if got := StatusBusy.String(); got != "every candidate rank is busy" {
		t.Errorf("StatusBusy.String() = %q", got)
	}
	if got := Status(9999).String(); got != "unknown status" {
		t.Errorf("Status(9999).String() = %q", got)
	}
	if StatusCount(StatusOK) != 0 {
		t.Errorf("StatusCount(OK) = %d", StatusCount(StatusOK))
	}
	err := error(&Error{Status: StatusUnknownSelectionID, Op: "kvr_engine_free_booking"})
	if !errors.Is(err, ErrUnknownSelectionID) || errors.Is(err, ErrUnknownRank) {
		t.Errorf("errors.Is mismatch for %v", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "kvr_engine_free_booking") || !strings.Contains(msg, "unknown selection id") || !strings.Contains(msg, "104") {
		t.Errorf("Error() = %q", msg)
	}
}

func TestStoreFindSelect(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 4)
	if p.BlockSize() != testBlock {
		t.Fatalf("BlockSize %d", p.BlockSize())
	}
	tokens := promptTokens(64, 1)
	local := storePrefix(t, p, 3, tokens, 4)
	if len(local) != 4 {
		t.Fatalf("%d local hashes, want 4", len(local))
	}

	// A zero-capacity buffer grows.
	m, err := p.FindMatches(local, make([]Overlap, 0))
	must(t, err)
	want := Overlap{WorkerID: 3, DPRank: 0, DeviceBlocks: 4}
	if len(m) != 1 || m[0] != want {
		t.Fatalf("FindMatches = %+v, want [%+v]", m, want)
	}
	if m[0].Rank() != (Rank{WorkerID: 3}) {
		t.Fatalf("Rank() = %+v", m[0].Rank())
	}
	// A prefix of the prompt matches as far as it goes; an unrelated one not at all.
	m, err = p.FindMatches(local[:2], m)
	must(t, err)
	if len(m) != 1 || m[0].DeviceBlocks != 2 {
		t.Fatalf("FindMatches(prefix) = %+v", m)
	}
	other, _, err := p.HashTokens("", promptTokens(64, 2), nil, nil)
	must(t, err)
	if m, err = p.FindMatches(other, m); err != nil || len(m) != 0 {
		t.Fatalf("FindMatches(other) = %+v, %v", m, err)
	}
	if m, err = p.FindMatches(nil, m); err != nil || len(m) != 0 {
		t.Fatalf("FindMatches(nil) = %+v, %v", m, err)
	}
	mt, err := p.FindMatchesTiered(local, nil)
	must(t, err)
	if len(mt) != 1 || mt[0] != want {
		t.Fatalf("FindMatchesTiered = %+v", mt)
	}

	for _, prompt := range []Prompt{Tokens(tokens), LocalHashes(local, uint64(len(tokens)))} {
		d, err := p.Select(nil, prompt)
		must(t, err)
		if d.Outcome != Selected || d.WorkerID != 3 || d.DPRank != 0 {
			t.Fatalf("Select = %+v, want worker 3", d)
		}
		if d.DeviceBlocks != 4 || d.CachedTokens != 64 || d.SelectionID != 0 || d.Err() != nil {
			t.Fatalf("Select = %+v", d)
		}
	}
	// Advisory selection books nothing.
	bs, err := p.BookingStats()
	must(t, err)
	if bs.Bookings != 0 {
		t.Fatalf("advisory selection booked: %+v", bs)
	}
	ss, err := p.SelectionStats()
	must(t, err)
	if ss.Selections < 2 {
		t.Fatalf("SelectionStats %+v", ss)
	}
	is, err := p.IndexStats()
	must(t, err)
	if is.Ranks != 1 || is.HolderBlocks != 4 || is.TierBlocks[0] != 4 || is.StoredEvents != 1 || is.Bytes == 0 {
		t.Fatalf("IndexStats %+v", is)
	}
}

func TestBookingLifecycle(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 2)
	tokens := promptTokens(100, 3) // 6 full blocks + 4 tokens
	storePrefix(t, p, 1, tokens, 4)
	rank := Rank{WorkerID: 1}

	req, err := NewRequest()
	must(t, err)
	defer req.Close()
	must(t, req.SetExpectedOutputTokens(32))
	d, err := p.SelectAndReserve(req, Tokens(tokens))
	must(t, err)
	if d.Outcome != Selected || d.Rank != rank || d.SelectionID == 0 {
		t.Fatalf("SelectAndReserve = %+v", d)
	}
	if d.CachedTokens != 64 || d.ProjectedPrefillTokens != 36 {
		t.Fatalf("SelectAndReserve = %+v, want 64 cached, 36 prefill", d)
	}
	bs, err := p.BookingStats()
	must(t, err)
	if bs.Bookings != 1 || !bs.SweeperStarted {
		t.Fatalf("BookingStats after booking %+v", bs)
	}
	al, err := p.ActiveLoad(rank)
	must(t, err)
	if al.ActivePrefillTokens != 36 || al.ActiveRequests != 1 || al.ActiveDecodeBlocks == 0 || al.ActiveDecodeBlocks != d.ProjectedDecodeBlocks {
		t.Fatalf("ActiveLoad after booking %+v (decision %+v)", al, d)
	}
	decode := al.ActiveDecodeBlocks

	must(t, e.MarkPrefillComplete(d.SelectionID))
	must(t, e.MarkPrefillComplete(d.SelectionID)) // idempotent
	al, err = p.ActiveLoad(rank)
	must(t, err)
	if al.ActivePrefillTokens != 0 || al.ActiveRequests != 1 || al.ActiveDecodeBlocks != decode {
		t.Fatalf("ActiveLoad after prefill %+v", al)
	}
	must(t, e.AddOutputBlocks(d.SelectionID, 3))
	al, err = p.ActiveLoad(rank)
	must(t, err)
	if al.ActiveDecodeBlocks != decode+3 {
		t.Fatalf("ActiveLoad after 3 output blocks %+v (was %d)", al, decode)
	}

	how, err := e.FreeBooking(d.SelectionID)
	must(t, err)
	if how != FreedNow {
		t.Fatalf("FreeBooking = %v", how)
	}
	al, err = p.ActiveLoad(rank)
	must(t, err)
	if al != (ActiveLoad{}) {
		t.Fatalf("ActiveLoad after free %+v", al)
	}
	bs, err = p.BookingStats()
	must(t, err)
	if bs.Bookings != 0 || bs.CounterUnderflows != 0 {
		t.Fatalf("BookingStats after free %+v", bs)
	}
	if how, err = e.FreeBooking(d.SelectionID); err != nil || how != FreedByCaller {
		t.Fatalf("second FreeBooking = %v, %v", how, err)
	}
	if err := e.AddOutputBlocks(d.SelectionID, 1); !errors.Is(err, ErrAlreadyFreed) {
		t.Fatalf("AddOutputBlocks after free: %v", err)
	}

	// Unknown selection ids are errors with the status and the C function.
	before := StatusCount(StatusUnknownSelectionID)
	err = e.MarkPrefillComplete(0xdead_beef_0000)
	if !errors.Is(err, ErrUnknownSelectionID) {
		t.Fatalf("MarkPrefillComplete(unknown) = %v", err)
	}
	var ke *Error
	if !errors.As(err, &ke) || ke.Status != StatusUnknownSelectionID || ke.Op != "kvr_engine_mark_prefill_complete" {
		t.Fatalf("errors.As: %#v", ke)
	}
	if _, err := e.FreeBooking(0xdead_beef_0001); !errors.Is(err, ErrUnknownSelectionID) {
		t.Fatalf("FreeBooking(unknown) = %v", err)
	}
	if StatusCount(StatusUnknownSelectionID) < before+2 {
		t.Fatalf("StatusCount did not count the unknown ids")
	}

	// A caller-chosen selection id; booking it twice is refused.
	id, err := e.MintSelectionID()
	must(t, err)
	must(t, req.Reset())
	must(t, req.SetSelectionID(id))
	if err := req.SetTTL(-time.Second); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("negative TTL: %v", err)
	}
	must(t, req.SetTTL(time.Minute))
	d, err = p.SelectAndReserve(req, Tokens(tokens))
	must(t, err)
	if d.SelectionID != id {
		t.Fatalf("SelectionID %d, want %d", d.SelectionID, id)
	}
	if _, err := p.SelectAndReserve(req, Tokens(tokens)); !errors.Is(err, ErrDuplicateSelectionID) {
		t.Fatalf("duplicate selection id: %v", err)
	}
	if _, err := e.FreeBooking(id); err != nil {
		t.Fatal(err)
	}
}

func TestReserve(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 2)
	tokens := promptTokens(100, 4)
	r2 := Rank{WorkerID: 2}

	d, err := p.Reserve(r2, nil, Tokens(tokens), ReserveOptions{})
	must(t, err)
	if d.Rank != r2 || d.SelectionID == 0 || !math.IsNaN(d.Cost) || d.ProjectedPrefillTokens != 100 {
		t.Fatalf("Reserve = %+v", d)
	}
	al, err := p.ActiveLoad(r2)
	must(t, err)
	if al.ActivePrefillTokens != 100 || al.ActiveRequests != 1 {
		t.Fatalf("ActiveLoad %+v", al)
	}
	d2, err := p.Reserve(r2, nil, Prompt{}, ReserveOptions{PrefillTokens: 7, SetPrefillTokens: true, SelectionID: 4242})
	must(t, err)
	if d2.SelectionID != 4242 || d2.ProjectedPrefillTokens != 7 {
		t.Fatalf("Reserve(override) = %+v", d2)
	}
	d3, err := p.Reserve(r2, nil, Prompt{}, ReserveOptions{})
	must(t, err)
	if d3.ProjectedPrefillTokens != 0 {
		t.Fatalf("Reserve(no prompt) = %+v", d3)
	}
	al, err = p.ActiveLoad(r2)
	must(t, err)
	if al.ActivePrefillTokens != 107 || al.ActiveRequests != 3 {
		t.Fatalf("ActiveLoad %+v", al)
	}
	for _, id := range []uint64{d.SelectionID, d2.SelectionID, d3.SelectionID} {
		if _, err := e.FreeBooking(id); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := p.Reserve(Rank{WorkerID: 99}, nil, Tokens(tokens), ReserveOptions{}); !errors.Is(err, ErrUnknownRank) {
		t.Fatalf("Reserve(unknown rank) = %v", err)
	}
	if al, _ = p.ActiveLoad(r2); al != (ActiveLoad{}) {
		t.Fatalf("ActiveLoad after frees %+v", al)
	}
}

func TestPartitions(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 1)
	if _, err := e.CreatePartition("m", "g", 32); !errors.Is(err, ErrPartitionExists) {
		t.Fatalf("duplicate partition: %v", err)
	}
	if _, err := e.Partition("m", "nope"); !errors.Is(err, ErrUnknownPartition) {
		t.Fatalf("unknown partition: %v", err)
	}
	if _, err := e.CreatePartition("m", "zero", 0); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("block size 0: %v", err)
	}
	for _, opt := range []PartitionOption{WithBookingTTL(0), WithBookingTTL(-time.Second), WithTemperature(math.Inf(1)), WithOverlapScoreCredit(math.NaN())} {
		if _, err := e.CreatePartition("m", "badopt", 16, opt); !errors.Is(err, ErrInvalidArgument) {
			t.Fatalf("bad option: %v", err)
		}
	}
	// Every option, with valid values.
	all, err := e.CreatePartition("m", "all", 32, WithCacheNamespace("ns"), WithBookingTTL(time.Minute),
		WithOverlapScoreCredit(1), WithPrefillLoadScale(1), WithHostCacheHitWeight(0.5),
		WithDiskCacheHitWeight(0.1), WithSharedCacheMultiplier(0.5), WithTemperature(0),
		WithDecodeActiveRequestWeight(0.1), WithCreditDecay(0), WithBusyDecodeBlocksFraction(0.9),
		WithBusyPrefillTokensFraction(0.9), WithBusyPrefillTokens(1<<20))
	must(t, err)
	if all.BlockSize() != 32 {
		t.Fatalf("BlockSize %d", all.BlockSize())
	}
	all.Close()

	p2, err := e.Partition("m", "g")
	must(t, err)
	defer p2.Close()
	if p2.BlockSize() != p.BlockSize() {
		t.Fatalf("block sizes differ")
	}
	tokens := promptTokens(32, 5)
	if d, err := p2.Select(nil, Tokens(tokens)); err != nil || d.WorkerID != 1 {
		t.Fatalf("Select via second handle = %+v, %v", d, err)
	}
	must(t, e.RemovePartition("m", "g"))
	if err := e.RemovePartition("m", "g"); !errors.Is(err, ErrUnknownPartition) {
		t.Fatalf("second RemovePartition: %v", err)
	}
	if _, err := p.Select(nil, Tokens(tokens)); !errors.Is(err, ErrUnknownPartition) {
		t.Fatalf("Select on removed partition: %v", err)
	}
	if _, err := p.SelectAndReserve(nil, Tokens(tokens)); !errors.Is(err, ErrUnknownPartition) {
		t.Fatalf("SelectAndReserve on removed partition: %v", err)
	}
	// Reading still works.
	if _, err := p.IndexStats(); err != nil {
		t.Fatalf("IndexStats on removed partition: %v", err)
	}
	// The name is free again.
	p3, err := e.CreatePartition("m", "g", 16)
	must(t, err)
	p3.Close()
}

func TestClosedHandles(t *testing.T) {
	e, err := New()
	must(t, err)
	p, err := e.CreatePartition("m", "g", 16)
	must(t, err)
	must(t, p.UpsertWorkerConfig(WorkerConfig{ID: 1}))
	tokens := promptTokens(64, 6)

	// The partition handle keeps the engine alive after the engine handle is closed.
	e.Close()
	e.Close() // idempotent
	if d, err := p.SelectAndReserve(nil, Tokens(tokens)); err != nil || d.WorkerID != 1 {
		t.Fatalf("Select after engine Close = %+v, %v", d, err)
	}
	if _, err := e.MintSelectionID(); err != ErrClosed {
		t.Fatalf("MintSelectionID on closed engine: %v", err)
	}
	if _, err := e.CreatePartition("m", "h", 16); err != ErrClosed {
		t.Fatalf("CreatePartition on closed engine: %v", err)
	}
	if _, err := e.FreeBooking(1); err != ErrClosed {
		t.Fatalf("FreeBooking on closed engine: %v", err)
	}
	if err := e.MarkPrefillComplete(1); err != ErrClosed {
		t.Fatal(err)
	}

	req, err := NewRequest()
	must(t, err)
	req.Close()
	req.Close()
	if _, err := p.Select(req, Tokens(tokens)); err != ErrClosed {
		t.Fatalf("Select with closed request: %v", err)
	}
	if err := req.SetLora("x"); err != ErrClosed {
		t.Fatal(err)
	}
	w, err := NewWorker(2, 1)
	must(t, err)
	w.Close()
	if err := p.UpsertWorker(w); err != ErrClosed {
		t.Fatalf("UpsertWorker(closed worker): %v", err)
	}
	if err := w.SetRole(RoleDecode); err != ErrClosed {
		t.Fatal(err)
	}

	p.Close()
	p.Close()
	if _, err := p.Select(nil, Tokens(tokens)); err != ErrClosed {
		t.Fatalf("Select on closed partition: %v", err)
	}
	if _, err := p.FindMatches(nil, nil); err != ErrClosed {
		t.Fatal(err)
	}
	if _, err := p.ApplyEvents(1, 0, []Event{ClearedEvent()}); err != ErrClosed {
		t.Fatal(err)
	}
	if _, _, err := p.HashTokens("", tokens, nil, nil); err != ErrClosed {
		t.Fatal(err)
	}
	if err := p.SetHooks(&Hooks{Overloaded: func(Rank) bool { return false }}); err != ErrClosed {
		t.Fatal(err)
	}
	if _, err := p.BookingStats(); err != ErrClosed {
		t.Fatal(err)
	}
}

func TestOutcomes(t *testing.T) {
	e := newEngine(t)
	tokens := promptTokens(64, 7)

	empty := testPartition(t, e, "empty", 0)
	d, err := empty.Select(nil, Tokens(tokens))
	if err != nil || d.Outcome != NoWorker {
		t.Fatalf("Select on empty partition = %+v, %v", d, err)
	}
	if !errors.Is(d.Err(), ErrNoWorker) {
		t.Fatalf("Err() = %v", d.Err())
	}
	if d, err = empty.SelectAndReserve(nil, Tokens(tokens)); err != nil || d.Outcome != NoWorker {
		t.Fatalf("SelectAndReserve on empty partition = %+v, %v", d, err)
	}
	ss, err := empty.SelectionStats()
	must(t, err)
	if ss.NoWorker != 2 {
		t.Fatalf("SelectionStats %+v", ss)
	}

	p := testPartition(t, e, "g", 3)
	storePrefix(t, p, 1, tokens, 4)
	req, err := NewRequest()
	must(t, err)
	defer req.Close()
	must(t, req.SetAllowedWorkers(nil))
	if d, err = p.Select(req, Tokens(tokens)); err != nil || d.Outcome != NoWorker {
		t.Fatalf("empty allow-set = %+v, %v", d, err)
	}
	must(t, req.SetAllowedWorkers([]uint64{2}))
	if d, err = p.Select(req, Tokens(tokens)); err != nil || d.WorkerID != 2 {
		t.Fatalf("allow-set {2} = %+v, %v", d, err)
	}
	must(t, req.Reset())
	must(t, req.SetPinnedWorker(3))
	if d, err = p.Select(req, Tokens(tokens)); err != nil || d.WorkerID != 3 {
		t.Fatalf("pinned 3 = %+v, %v", d, err)
	}
	must(t, req.Reset())

	// Busy through the overload hook.
	must(t, p.SetHooks(&Hooks{Overloaded: func(Rank) bool { return true }}))
	if d, err = p.SelectAndReserve(req, Tokens(tokens)); err != nil || d.Outcome != Busy {
		t.Fatalf("all overloaded = %+v, %v", d, err)
	}
	if !errors.Is(d.Err(), ErrBusy) {
		t.Fatalf("Err() = %v", d.Err())
	}
	must(t, p.SetHooks(nil))
	bs, _ := p.BookingStats()
	ss, _ = p.SelectionStats()
	if bs.Bookings != 0 || ss.Busy != 1 {
		t.Fatalf("after Busy: %+v %+v", bs, ss)
	}

	// Busy through a threshold: more active prefill than allowed.
	b := testPartition(t, e, "busy", 1, WithBusyPrefillTokens(10))
	r, err := b.Reserve(Rank{WorkerID: 1}, nil, Prompt{}, ReserveOptions{PrefillTokens: 100, SetPrefillTokens: true})
	must(t, err)
	if d, err = b.Select(nil, Tokens(tokens)); err != nil || d.Outcome != Busy {
		t.Fatalf("over threshold = %+v, %v", d, err)
	}
	must(t, e.MarkPrefillComplete(r.SelectionID))
	if d, err = b.Select(nil, Tokens(tokens)); err != nil || d.Outcome != Selected {
		t.Fatalf("after prefill complete = %+v, %v", d, err)
	}
	_, err = e.FreeBooking(r.SelectionID)
	must(t, err)
}

func TestEvents(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 2)
	tokens := promptTokens(64, 8)
	local, seq, err := p.HashTokens("", tokens, nil, nil)
	must(t, err)
	blocks := StoredBlocks(seq, local)

	// A batch: a root store and its child.
	res, err := p.ApplyEvents(1, 0, []Event{
		StoredEvent(TierDevice, blocks[:2]),
		StoredChildEvent(TierDevice, seq[1], blocks[2:]),
	})
	must(t, err)
	if res != (ApplyResult{EventsApplied: 2, BlocksStored: 4}) {
		t.Fatalf("ApplyEvents %+v", res)
	}
	m, err := p.FindMatches(local, nil)
	must(t, err)
	if len(m) != 1 || m[0].DeviceBlocks != 4 {
		t.Fatalf("FindMatches %+v", m)
	}
	// Removing the last block shortens the match; an unknown hash is counted.
	res, err = p.ApplyEvents(1, 0, []Event{RemovedEvent(TierDevice, []uint64{seq[3], 12345})})
	must(t, err)
	if res.BlocksRemoved != 1 || res.BlocksNotFound != 1 {
		t.Fatalf("remove %+v", res)
	}
	if m, _ = p.FindMatches(local, m); len(m) != 1 || m[0].DeviceBlocks != 3 {
		t.Fatalf("FindMatches after remove %+v", m)
	}
	// An unknown parent: that event is refused, the rest of the batch applies.
	res, err = p.ApplyEvents(2, 0, []Event{
		StoredChildEvent(TierDevice, 999, blocks[:1]),
		StoredEvent(TierDevice, blocks[:1]),
	})
	if !errors.Is(err, ErrParentNotFound) {
		t.Fatalf("unknown parent: %v", err)
	}
	if res.EventsApplied != 1 || res.EventsRejected != 1 || res.BlocksStored != 1 {
		t.Fatalf("unknown parent result %+v", res)
	}
	// A malformed batch applies nothing.
	before, _ := p.IndexStats()
	if _, err = p.ApplyEvents(2, 0, []Event{ClearedEvent(), {Kind: EventStored, Tier: 7, Blocks: blocks}}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("bad tier: %v", err)
	}
	if _, err = p.ApplyEvents(2, 0, []Event{{Kind: 9}}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("bad kind: %v", err)
	}
	after, _ := p.IndexStats()
	if after.ClearedEvents != before.ClearedEvents || after.HolderBlocks != before.HolderBlocks {
		t.Fatalf("malformed batch applied something: %+v -> %+v", before, after)
	}
	// Cleared drops the rank; an empty batch is fine.
	res, err = p.ApplyEvents(1, 0, []Event{ClearedEvent()})
	must(t, err)
	if res.EventsApplied != 1 {
		t.Fatalf("clear %+v", res)
	}
	if _, err = p.ApplyEvents(1, 0, nil); err != nil {
		t.Fatal(err)
	}
	if m, _ = p.FindMatches(local, m); len(m) != 1 || m[0].WorkerID != 2 {
		t.Fatalf("FindMatches after clear %+v", m)
	}

	// Tiers: worker 1 holds 2 blocks on the device and the next 2 in host memory.
	_, err = p.ApplyEvents(1, 0, []Event{StoredEvent(TierDevice, blocks[:2]), StoredEvent(TierHost, blocks)})
	must(t, err)
	mt, err := p.FindMatchesTiered(local, nil)
	must(t, err)
	var w1 *Overlap
	for i := range mt {
		if mt[i].WorkerID == 1 {
			w1 = &mt[i]
		}
	}
	if w1 == nil || w1.DeviceBlocks != 2 || w1.HostBlocks != 2 || w1.DiskBlocks != 0 {
		t.Fatalf("FindMatchesTiered %+v", mt)
	}

	// A long batch (more events than the C helper keeps on its stack), chained.
	long := promptTokens(40*testBlock, 9)
	ll, ls, err := p.HashTokens("", long, nil, nil)
	must(t, err)
	lb := StoredBlocks(ls, ll)
	evs := []Event{StoredEvent(TierDevice, lb[:1])}
	for i := 1; i < len(lb); i++ {
		evs = append(evs, StoredChildEvent(TierDevice, ls[i-1], lb[i:i+1]))
	}
	res, err = p.ApplyEvents(2, 0, evs)
	must(t, err)
	if res.EventsApplied != 40 || res.BlocksStored != 40 {
		t.Fatalf("long batch %+v", res)
	}
	if m, _ = p.FindMatches(ll, m); len(m) != 1 || m[0].DeviceBlocks != 40 {
		t.Fatalf("FindMatches(long) %+v", m)
	}
	// Events of a rank that is not a worker (yet) are accepted.
	if _, err = p.ApplyEvents(77, 1, []Event{StoredEvent(TierDevice, blocks)}); err != nil {
		t.Fatal(err)
	}
}

func TestWorkersAndLoad(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 0)
	if _, err := NewWorker(1, 0); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("dp size 0: %v", err)
	}
	w, err := NewWorker(1, 2)
	must(t, err)
	defer w.Close()
	must(t, w.SetRole(RolePrefill))
	must(t, w.SetControlEndpoint(1, "tcp://10.0.0.1:5557"))
	must(t, w.SetControlEndpoint(1, ""))
	must(t, w.SetTotalKVBlocks(1000))
	must(t, w.SetMaxBatchedTokens(4096))
	must(t, w.AddLoraAdapter("a"))
	must(t, w.SetLabel("zone", "a"))
	if err := w.SetRole(Role(9)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("bad role: %v", err)
	}
	if err := w.AddLoraAdapter(""); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("empty adapter: %v", err)
	}
	if err := w.SetControlEndpoint(2, "x"); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("endpoint of rank 2 of 2: %v", err)
	}
	must(t, w.SetRole(RoleAggregated))
	must(t, p.UpsertWorker(w))
	must(t, p.UpsertWorker(w)) // replace
	must(t, p.UpsertWorkerConfig(WorkerConfig{ID: 2, DPSize: 1, Role: RoleDecode,
		ControlEndpoints: []string{"tcp://b"}, LoraAdapters: []string{"a", "b"},
		Labels: map[string]string{"zone": "b", "pool": "x"}}))
	if err := p.UpsertWorkerConfig(WorkerConfig{ID: 3, LoraAdapters: []string{""}}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("bad config: %v", err)
	}

	tokens := promptTokens(64, 10)
	d, err := p.Select(nil, Tokens(tokens))
	must(t, err)
	if d.Outcome != Selected {
		t.Fatalf("Select %+v", d)
	}
	// Both ranks of worker 1 are candidates.
	seen := map[Rank]bool{}
	for i := 0; i < 50; i++ {
		d, err := p.SelectAndReserve(nil, Tokens(tokens))
		must(t, err)
		seen[d.Rank] = true
		defer e.FreeBooking(d.SelectionID) //nolint:errcheck
	}
	if !seen[Rank{WorkerID: 1, DPRank: 1}] {
		t.Fatalf("rank (1,1) never chosen: %v", seen)
	}

	v1, err := p.PublishLoad([]RankLoad{{WorkerID: 1, DPRank: 0, WaitingRequests: 3, KVBlocksUsed: 10, KVBlocksTotal: 1000}})
	must(t, err)
	v2, err := p.PublishLoad([]RankLoad{{WorkerID: 1, DPRank: 1, RunningRequests: 1}, {WorkerID: 2, PendingPrefillTokens: 5}})
	must(t, err)
	if v2 <= v1 {
		t.Fatalf("load versions %d then %d", v1, v2)
	}
	if _, err := p.PublishLoad(nil); err != nil {
		t.Fatal(err)
	}

	// Removing a worker frees its bookings.
	r, err := p.Reserve(Rank{WorkerID: 2}, nil, Tokens(tokens), ReserveOptions{})
	must(t, err)
	must(t, p.RemoveWorker(2))
	if err := p.RemoveWorker(2); !errors.Is(err, ErrUnknownWorker) {
		t.Fatalf("second RemoveWorker: %v", err)
	}
	how, err := e.FreeBooking(r.SelectionID)
	must(t, err)
	if how != FreedRankRemoved {
		t.Fatalf("FreeBooking after RemoveWorker = %v", how)
	}
	for i := 0; i < 20; i++ {
		if d, _ := p.Select(nil, Tokens(tokens)); d.WorkerID == 2 {
			t.Fatalf("removed worker selected")
		}
	}
}

func TestRequestSetters(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 2)
	req, err := NewRequest()
	must(t, err)
	defer req.Close()
	if err := req.SetSession(Session{}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("empty session id: %v", err)
	}
	must(t, req.SetSession(Session{ID: "s1", ParentID: "s0", InputTrigger: "user"}))
	must(t, req.SetLegacySessionID("legacy"))
	if err := req.SetOverrides(Overrides{Temperature: Float64(math.Inf(1))}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("infinite override: %v", err)
	}
	must(t, req.SetOverrides(Overrides{OverlapScoreCredit: Float64(2), PrefillLoadScale: Float64(1)}))
	must(t, req.SetLora("adapter"))
	must(t, req.SetExpectedOutputTokens(10))
	must(t, req.SetTTL(time.Second))
	tokens := promptTokens(64, 11)
	d, err := p.SelectAndReserve(req, Tokens(tokens))
	must(t, err)
	if d.Outcome != Selected || d.SelectionID == 0 {
		t.Fatalf("SelectAndReserve %+v", d)
	}
	_, err = e.FreeBooking(d.SelectionID)
	must(t, err)
	must(t, req.SetSession(Session{ID: "s1", Final: true}))
	if d, err = p.Select(req, Tokens(tokens)); err != nil || d.Outcome != Selected {
		t.Fatalf("Select %+v, %v", d, err)
	}
}

func TestReplicaBooking(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 2)
	_, seq, err := p.HashTokens("", promptTokens(64, 12), nil, nil)
	must(t, err)
	must(t, p.InstallReplicaBooking(ReplicaBooking{SelectionID: 777000, Rank: Rank{WorkerID: 1},
		PromptBlocks: seq, PrefillTokens: 50, ExpectedOutputTokens: 16, TTL: time.Minute}))
	bs, err := p.BookingStats()
	must(t, err)
	if bs.Bookings != 1 {
		t.Fatalf("BookingStats %+v", bs)
	}
	al, err := p.ActiveLoad(Rank{WorkerID: 1})
	must(t, err)
	if al.ActivePrefillTokens != 50 || al.ActiveRequests != 1 || al.ActiveDecodeBlocks < 4 {
		t.Fatalf("ActiveLoad %+v", al)
	}
	// Lifecycle calls find it by scanning the partitions.
	must(t, e.MarkPrefillComplete(777000))
	how, err := e.FreeBooking(777000)
	must(t, err)
	if how != FreedNow {
		t.Fatalf("FreeBooking = %v", how)
	}
	if err := p.InstallReplicaBooking(ReplicaBooking{Rank: Rank{WorkerID: 1}}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("selection id 0: %v", err)
	}
}

func TestHashTokens(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 0)
	tokens := promptTokens(100, 13)
	l1, s1, err := HashTokens(testBlock, "", "", tokens, nil, nil)
	must(t, err)
	if len(l1) != 6 || len(s1) != 6 {
		t.Fatalf("%d/%d hashes, want 6", len(l1), len(s1))
	}
	l2, s2, err := p.HashTokens("", tokens, make([]uint64, 0, 100), make([]uint64, 3))
	must(t, err)
	for i := range l1 {
		if l1[i] != l2[i] || s1[i] != s2[i] {
			t.Fatalf("package and partition hashes differ at %d", i)
		}
	}
	if cap(l2) != 100 {
		t.Fatalf("buffer not reused")
	}
	// The chain: a prompt's prefix has the same hashes.
	l3, s3, err := HashTokens(testBlock, "", "", tokens[:40], nil, nil)
	must(t, err)
	if len(l3) != 2 || l3[1] != l1[1] || s3[1] != s1[1] {
		t.Fatalf("prefix hashes differ")
	}
	// Salts change the hashes.
	ll, _, err := HashTokens(testBlock, "lora", "", tokens, nil, nil)
	must(t, err)
	ln, _, err := HashTokens(testBlock, "", "ns", tokens, nil, nil)
	must(t, err)
	if ll[0] == l1[0] || ln[0] == l1[0] || ll[0] == ln[0] {
		t.Fatalf("salts do not change the hashes")
	}
	nsp, err := e.CreatePartition("m", "ns", testBlock, WithCacheNamespace("ns"))
	must(t, err)
	defer nsp.Close()
	lp, _, err := nsp.HashTokens("", tokens, nil, nil)
	must(t, err)
	if lp[0] != ln[0] {
		t.Fatalf("partition namespace not applied")
	}
	if l, s, err := HashTokens(testBlock, "", "", tokens[:15], nil, nil); err != nil || len(l) != 0 || len(s) != 0 {
		t.Fatalf("partial block hashed: %v %v %v", l, s, err)
	}
	if _, _, err := HashTokens(0, "", "", tokens, nil, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("block size 0: %v", err)
	}
}

func TestNoAllocations(t *testing.T) {
	if debugMode {
		t.Skip("kvrdebug collects around every call")
	}
	e := newEngine(t)
	p := testPartition(t, e, "g", 8)
	tokens := promptTokens(256, 14)
	local := storePrefix(t, p, 3, tokens, 8)
	req, err := NewRequest()
	must(t, err)
	defer req.Close()
	var d Decision
	if n := testing.AllocsPerRun(200, func() {
		d, err = p.Select(req, Tokens(tokens))
	}); n != 0 || err != nil || d.WorkerID != 3 {
		t.Fatalf("Select: %v allocs/op (%+v, %v)", n, d, err)
	}
	out := make([]Overlap, 0, 16)
	if n := testing.AllocsPerRun(200, func() {
		out, err = p.FindMatches(local, out)
	}); n != 0 || err != nil || len(out) != 1 {
		t.Fatalf("FindMatches: %v allocs/op", n)
	}
	l, s := make([]uint64, 16), make([]uint64, 16)
	if n := testing.AllocsPerRun(200, func() {
		l, s, err = HashTokens(testBlock, "", "", tokens, l, s)
	}); n != 0 || err != nil {
		t.Fatalf("HashTokens: %v allocs/op", n)
	}
}

// A minted selection id skips ids callers chose themselves: a booking that chose no id
// never fails with ErrDuplicateSelectionID because of a caller's id.
func TestMintedIDCollision(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "g", 1)
	tokens := promptTokens(64, 30)
	next, err := e.MintSelectionID()
	must(t, err)
	next++ // the id the engine mints next
	req, err := NewRequest()
	must(t, err)
	defer req.Close()
	must(t, req.SetSelectionID(next))
	mine, err := p.SelectAndReserve(req, Tokens(tokens))
	must(t, err)
	if mine.SelectionID != next {
		t.Fatalf("caller id %d booked as %d", next, mine.SelectionID)
	}
	d, err := p.SelectAndReserve(nil, Tokens(tokens))
	must(t, err)
	if d.SelectionID == 0 || d.SelectionID == next {
		t.Fatalf("minted booking %+v", d)
	}
	r, err := p.Reserve(Rank{WorkerID: 1}, nil, Prompt{}, ReserveOptions{})
	must(t, err)
	// The caller's own id is not retried.
	if _, err := p.SelectAndReserve(req, Tokens(tokens)); !errors.Is(err, ErrDuplicateSelectionID) {
		t.Fatalf("caller's duplicate id: %v", err)
	}
	for _, id := range []uint64{mine.SelectionID, d.SelectionID, r.SelectionID} {
		_, err := e.FreeBooking(id)
		must(t, err)
	}
	// Overlapping hash buffers are refused.
	buf := make([]uint64, 8)
	if _, _, err := HashTokens(testBlock, "", "", tokens, buf[:4], buf[2:6]); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("overlapping buffers: %v", err)
	}
	if _, _, err := p.HashTokens("", tokens, buf[:4], buf[4:8]); err != nil {
		t.Fatalf("adjacent buffers: %v", err)
	}
}
