package kvr

import (
	"fmt"
	"math/rand"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Handles dropped without Close are released by their finalizers, and the hooks of a
// partition that goes away with them are released too; nothing crashes.
func TestFinalizers(t *testing.T) {
	base := finalized.Load()
	baseHooks := hooksRegistered()
	const rounds = 20
	for i := 0; i < rounds; i++ {
		func() {
			e, err := New()
			must(t, err)
			p, err := e.CreatePartition("m", "g", 16)
			must(t, err)
			w, err := NewWorker(1, 1)
			must(t, err)
			must(t, p.UpsertWorker(w))
			must(t, p.SetHooks(&Hooks{Overloaded: func(Rank) bool { return false }}))
			req, err := NewRequest()
			must(t, err)
			tokens := promptTokens(64, uint32(i))
			d, err := p.SelectAndReserve(req, Tokens(tokens))
			must(t, err)
			if d.Outcome != Selected {
				t.Fatalf("SelectAndReserve %+v", d)
			}
			// Dropped here: e, p, w, req (and the live booking with them).
		}()
	}
	deadline := time.Now().Add(20 * time.Second)
	for finalized.Load() < base+4*rounds || hooksRegistered() > baseHooks {
		if time.Now().After(deadline) {
			t.Fatalf("after GC: %d handles finalized (want %d), %d hook handles registered (want %d)",
				finalized.Load()-base, 4*rounds, hooksRegistered(), baseHooks)
		}
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
}

// Several goroutines select, book and free while others apply events, publish load,
// read and swap hooks. Run with -race: the binding's own state (hook table, pools,
// scratch) must be race-free, and kvr's counters must return to zero.
func TestConcurrency(t *testing.T) {
	iters := 400
	if debugMode {
		iters = 25
	} else if testing.Short() {
		iters = 100
	}
	const workers, selectors, promptLen = 16, 6, 256
	e := newEngine(t)
	p := testPartition(t, e, "g", workers)

	prompts := make([][]uint32, 8)
	hashes := make([][2][]uint64, len(prompts))
	for i := range prompts {
		// Pairs of prompts share their first half.
		prompts[i] = promptTokens(promptLen, uint32(i))
		if i%2 == 1 {
			copy(prompts[i], prompts[i-1][:promptLen/2])
		}
		l, s, err := p.HashTokens("", prompts[i], nil, nil)
		must(t, err)
		hashes[i] = [2][]uint64{l, s}
	}
	var hookCalls atomic.Int64
	hooks := &Hooks{Overloaded: func(Rank) bool { hookCalls.Add(1); return false }}
	must(t, p.SetHooks(hooks))

	var stop atomic.Bool
	var wg, bg sync.WaitGroup
	errs := make(chan error, 64)
	fail := func(err error) {
		select {
		case errs <- err:
		default:
		}
	}

	for g := 0; g < selectors; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(g)))
			req, err := NewRequest()
			if err != nil {
				fail(err)
				return
			}
			defer req.Close()
			for i := 0; i < iters; i++ {
				k := rng.Intn(len(prompts))
				switch i % 4 {
				case 0:
					d, err := p.Select(req, Tokens(prompts[k]))
					if err != nil || d.Outcome != Selected {
						fail(fmt.Errorf("Select: %+v %v", d, err))
						return
					}
				case 1:
					d, err := p.Select(nil, LocalHashes(hashes[k][0], promptLen))
					if err != nil || d.Outcome != Selected {
						fail(fmt.Errorf("Select(hashes): %+v %v", d, err))
						return
					}
				default:
					if err := req.SetExpectedOutputTokens(uint64(rng.Intn(64))); err != nil {
						fail(err)
						return
					}
					d, err := p.SelectAndReserve(req, Tokens(prompts[k]))
					if err != nil || d.Outcome != Selected {
						fail(fmt.Errorf("SelectAndReserve: %+v %v", d, err))
						return
					}
					if err := e.MarkPrefillComplete(d.SelectionID); err != nil {
						fail(err)
						return
					}
					if err := e.AddOutputBlocks(d.SelectionID, uint64(rng.Intn(4))); err != nil {
						fail(err)
						return
					}
					if how, err := e.FreeBooking(d.SelectionID); err != nil || how != FreedNow {
						fail(fmt.Errorf("FreeBooking: %v %v", how, err))
						return
					}
					if err := req.Reset(); err != nil {
						fail(err)
						return
					}
				}
			}
		}(g)
	}

	// Events and load.
	bg.Add(1)
	go func() {
		defer bg.Done()
		rng := rand.New(rand.NewSource(99))
		var version uint64
		for !stop.Load() {
			w := uint64(rng.Intn(workers) + 1)
			k := rng.Intn(len(prompts))
			l, s := hashes[k][0], hashes[k][1]
			n := rng.Intn(len(l)) + 1
			var evs []Event
			switch rng.Intn(4) {
			case 0:
				evs = []Event{ClearedEvent()}
			case 1:
				evs = []Event{RemovedEvent(TierDevice, s[n-1:n])}
			default:
				blocks := StoredBlocks(s[:n], l[:n])
				evs = []Event{StoredEvent(TierDevice, blocks[:1])}
				if n > 1 {
					evs = append(evs, StoredChildEvent(TierDevice, s[0], blocks[1:]))
				}
			}
			if _, err := p.ApplyEvents(w, 0, evs); err != nil {
				fail(fmt.Errorf("ApplyEvents: %v", err))
				return
			}
			v, err := p.PublishLoad([]RankLoad{{WorkerID: w, KVBlocksUsed: uint64(rng.Intn(1000)), KVBlocksTotal: 10000}})
			if err != nil || v <= version {
				fail(fmt.Errorf("PublishLoad: %d after %d, %v", v, version, err))
				return
			}
			version = v
		}
	}()
	// Readers and a hook swapper.
	bg.Add(1)
	go func() {
		defer bg.Done()
		var out []Overlap
		var err error
		for i := 0; !stop.Load(); i++ {
			if out, err = p.FindMatchesTiered(hashes[i%len(hashes)][0], out); err != nil {
				fail(err)
				return
			}
			if _, err = p.BookingStats(); err != nil {
				fail(err)
				return
			}
			if i%16 == 0 {
				if err := p.SetHooks(hooks); err != nil {
					fail(err)
					return
				}
			}
		}
	}()

	wg.Wait()
	stop.Store(true)
	bg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if hookCalls.Load() == 0 {
		t.Errorf("hooks never called")
	}
	bs, err := p.BookingStats()
	must(t, err)
	if bs.Bookings != 0 || bs.CounterUnderflows != 0 {
		t.Errorf("BookingStats after the run %+v", bs)
	}
	for w := 1; w <= workers; w++ {
		if al, err := p.ActiveLoad(Rank{WorkerID: uint64(w)}); err != nil || al != (ActiveLoad{}) {
			t.Errorf("ActiveLoad(%d) after the run %+v %v", w, al, err)
		}
	}
}
