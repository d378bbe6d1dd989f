package kvr

import (
	"sort"
	"testing"
	"time"
)

// benchPartition: 64 workers, block size 16, a 256-token prompt (16 blocks) of which
// worker w holds the first w % 17 blocks (so overlaps from 0 to 16 blocks).
func benchPartition(b *testing.B) (*Engine, *Partition, []uint32, []uint64) {
	b.Helper()
	e := newEngine(b)
	p := testPartition(b, e, "bench", 64)
	tokens := promptTokens(256, 1234)
	local, seq, err := p.HashTokens("", tokens, nil, nil)
	must(b, err)
	blocks := StoredBlocks(seq, local)
	for w := 1; w <= 64; w++ {
		if n := w % 17; n > 0 {
			if _, err := p.ApplyEvents(uint64(w), 0, []Event{StoredEvent(TierDevice, blocks[:n])}); err != nil {
				b.Fatal(err)
			}
		}
	}
	return e, p, tokens, local
}

// BenchmarkSelect: one advisory selection through cgo (one cgo call: the C helper sets
// the borrowed prompt, selects and clears the prompt).
func BenchmarkSelect(b *testing.B) {
	_, p, tokens, _ := benchPartition(b)
	req, err := NewRequest()
	must(b, err)
	defer req.Close()
	prompt := Tokens(tokens)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		d, err := p.Select(req, prompt)
		if err != nil || d.Outcome != Selected {
			b.Fatal(d, err)
		}
	}
}

// BenchmarkSelectParallel: Select from GOMAXPROCS goroutines, one Request each.
func BenchmarkSelectParallel(b *testing.B) {
	_, p, tokens, _ := benchPartition(b)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		req, err := NewRequest()
		if err != nil {
			b.Error(err)
			return
		}
		defer req.Close()
		for pb.Next() {
			if d, err := p.Select(req, Tokens(tokens)); err != nil || d.Outcome != Selected {
				b.Error(d, err)
				return
			}
		}
	})
}

// BenchmarkSelectAndReserveFree: a booked selection and its FreeBooking (two cgo calls).
func BenchmarkSelectAndReserveFree(b *testing.B) {
	e, p, tokens, _ := benchPartition(b)
	req, err := NewRequest()
	must(b, err)
	defer req.Close()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		d, err := p.SelectAndReserve(req, Tokens(tokens))
		if err != nil || d.Outcome != Selected {
			b.Fatal(d, err)
		}
		if _, err := e.FreeBooking(d.SelectionID); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFindMatches: the index lookup alone, into a reused buffer.
func BenchmarkFindMatches(b *testing.B) {
	_, p, _, local := benchPartition(b)
	out := make([]Overlap, 0, 64)
	var err error
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if out, err = p.FindMatches(local, out); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkNoopCgo: the cheapest cgo call (kvr_abi_version), to subtract from the
// others: the Go↔C transition cost per call.
func BenchmarkNoopCgo(b *testing.B) {
	var sum uint32
	for i := 0; i < b.N; i++ {
		sum += ABIVersion()
	}
	if sum == 0 && b.N > 0 {
		b.Fatal("ABIVersion returned 0")
	}
}

// BenchmarkSelectC: BenchmarkSelect's selections in a C loop (one cgo call in all):
// BenchmarkSelect − BenchmarkSelectC is the binding's overhead per selection.
func BenchmarkSelectC(b *testing.B) {
	_, p, tokens, _ := benchPartition(b)
	req, err := NewRequest()
	must(b, err)
	defer req.Close()
	b.ResetTimer()
	if err := benchSelectLoop(p, req, tokens, uint64(b.N)); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkSelectPlainC: the same selections as a plain C host makes them (set the
// request's prompt, select, through kvr.h only), in a C loop: BenchmarkSelect −
// BenchmarkSelectPlainC is what a Go gateway pays over a C server for one selection.
func BenchmarkSelectPlainC(b *testing.B) {
	_, p, tokens, _ := benchPartition(b)
	req, err := NewRequest()
	must(b, err)
	defer req.Close()
	b.ResetTimer()
	if err := benchPlainCLoop(p, req, tokens, uint64(b.N)); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkSelectOverheadPaired: the binding's overhead over a plain C host, measured
// robustly on a shared machine: rounds of 1,000 selections through Go's Select and
// 1,000 through the plain C loop, alternated; reports the median over the rounds of the
// per-selection difference (ns-over-c/op) and of each side (go-ns/op, c-ns/op).
//
// Each round also times the floor under that figure, with no kvr in it: C calls as long
// as a selection (calibrated before the rounds), 1,000 from Go and 1,000 from a C loop.
// Two of them: a spin (arithmetic only: spin-over-c/op is the runtime's cost per call)
// and a pointer chase over 16 KiB (data that stays in cache, as a selection's mostly
// does: walk-over-c/op adds the refills of what Go's runtime evicted between calls).
// binding-over-walk/op, the median of the per-round difference, is what kvr's binding
// adds beyond the second floor. b.N counts rounds.
func BenchmarkSelectOverheadPaired(b *testing.B) {
	_, p, tokens, _ := benchPartition(b)
	req, err := NewRequest()
	must(b, err)
	defer req.Close()
	prompt := Tokens(tokens)
	const per = 1000
	benchWalkInit()
	target := medianTime(func() {
		if err := benchPlainCLoop(p, req, tokens, per); err != nil {
			b.Fatal(err)
		}
	}) / per
	spinIters := calibrate(b, target, func(n uint64) { benchSpinLoop(per, n) }, per)
	walkIters := calibrate(b, target, func(n uint64) { benchWalkLoop(per, n) }, per)
	var diffs, gos, cs, spins, walks, walkCs, beyond []float64
	var sink uint64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		for j := 0; j < per; j++ {
			if d, err := p.Select(req, prompt); err != nil || d.Outcome != Selected {
				b.Fatal(d, err)
			}
		}
		t1 := time.Now()
		if err := benchPlainCLoop(p, req, tokens, per); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		for j := 0; j < per; j++ {
			sink = benchSpin(spinIters, sink|1)
		}
		t3 := time.Now()
		sink += benchSpinLoop(per, spinIters)
		t4 := time.Now()
		for j := 0; j < per; j++ {
			sink += benchWalk(walkIters, sink)
		}
		t5 := time.Now()
		sink += benchWalkLoop(per, walkIters)
		t6 := time.Now()
		ns := func(from, to time.Time) float64 { return float64(to.Sub(from).Nanoseconds()) / per }
		g, c := ns(t0, t1), ns(t1, t2)
		spin := ns(t2, t3) - ns(t3, t4)
		walk := ns(t4, t5) - ns(t5, t6)
		gos, cs, diffs = append(gos, g), append(cs, c), append(diffs, g-c)
		spins, walks, walkCs = append(spins, spin), append(walks, walk), append(walkCs, ns(t5, t6))
		beyond = append(beyond, (g-c)-walk)
	}
	b.StopTimer()
	if sink == 0 {
		b.Fatal("the floors' chain reached 0")
	}
	b.ReportMetric(median(diffs), "ns-over-c/op")
	b.ReportMetric(median(gos), "go-ns/op")
	b.ReportMetric(median(cs), "c-ns/op")
	b.ReportMetric(median(spins), "spin-over-c/op")
	b.ReportMetric(median(walks), "walk-over-c/op")
	b.ReportMetric(median(walkCs), "walk-c-ns/op")
	b.ReportMetric(median(beyond), "binding-over-walk/op")
}

// median sorts v and returns its middle element.
func median(v []float64) float64 {
	sort.Float64s(v)
	return v[len(v)/2]
}

// medianTime is the median of seven timings of f, in ns.
func medianTime(f func()) float64 {
	var v []float64
	for k := 0; k < 7; k++ {
		t := time.Now()
		f()
		v = append(v, float64(time.Since(t).Nanoseconds()))
	}
	return median(v)
}

// calibrate returns the steps that make one call of a floor take `target` ns: loop(n)
// makes `per` calls of n steps each in C.
func calibrate(b *testing.B, target float64, loop func(n uint64), per int) uint64 {
	const probe = 20000
	step := medianTime(func() { loop(probe) }) / float64(per) / probe
	if step <= 0 || target <= 0 {
		b.Fatalf("calibration: %.3f ns a step, %.1f ns a selection", step, target)
	}
	return uint64(target/step) + 1
}

// BenchmarkCgoFloorPaired: what one Go→C call costs over the same call made from C, on
// this machine: rounds of 1,000 ABIVersion() calls through cgo and 1,000 in a C loop,
// alternated; the median over the rounds of the per-call difference (ns-over-c/op). The
// floor under BenchmarkSelectOverheadPaired's figure. b.N counts rounds.
func BenchmarkCgoFloorPaired(b *testing.B) {
	const per = 1000
	var diffs []float64
	var sum uint32
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		for j := 0; j < per; j++ {
			sum += ABIVersion()
		}
		t1 := time.Now()
		sum += benchABILoop(per)
		t2 := time.Now()
		diffs = append(diffs, float64(t1.Sub(t0).Nanoseconds()-t2.Sub(t1).Nanoseconds())/per)
	}
	b.StopTimer()
	if sum == 0 {
		b.Fatal("ABIVersion returned 0")
	}
	sort.Float64s(diffs)
	b.ReportMetric(diffs[len(diffs)/2], "ns-over-c/op")
}

// BenchmarkSelectWithHook: Select with an Overloaded hook, a C→Go callback per
// candidate rank (64 per selection); minus BenchmarkSelect, over 64, is one callback.
func BenchmarkSelectWithHook(b *testing.B) {
	_, p, tokens, _ := benchPartition(b)
	must(b, p.SetHooks(&Hooks{Overloaded: func(Rank) bool { return false }}))
	req, err := NewRequest()
	must(b, err)
	defer req.Close()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if d, err := p.Select(req, Tokens(tokens)); err != nil || d.Outcome != Selected {
			b.Fatal(d, err)
		}
	}
}
