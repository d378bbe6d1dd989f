package kvr

import (
	"errors"
	"testing"
)

// msgpackStoredImage is msgpackStored with vLLM 0.33's extra_keys: one block whose
// multimodal input `image` starts at token `offset` of the block ([[[image, offset]]]).
func msgpackStoredImage(hash uint8, tokens []uint32, image string, offset uint8) []byte {
	b := msgpackStored(hash, tokens, testBlock, 0)
	b = b[:len(b)-1] // the batch's DP rank comes after the event
	b[11] = 0x86     // six fields in the event's map
	b = append(b, 0xa0|byte(len("extra_keys")))
	b = append(b, "extra_keys"...)
	b = append(b, 0x91, 0x91, 0x92, 0xa0|byte(len(image)))
	b = append(b, image...)
	return append(b, offset, 0)
}

func TestExtraKeysTellImagesApart(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "extra", 2)
	tokens := make([]uint32, testBlock)
	for i := range tokens {
		tokens[i] = 7 // image placeholder tokens: equal for every image
	}
	for w, image := range map[uint64]string{1: "imgA", 2: "imgB"} {
		res, err := p.Ingest(w, 0, nil, 0, msgpackStoredImage(uint8(w), tokens, image, 2))
		must(t, err)
		if res.BatchesApplied != 1 {
			t.Fatalf("worker %d: %+v", w, res)
		}
	}
	for _, c := range []struct {
		image, salt string
		worker      uint64
		blocks      uint32
	}{{"imgA", "", 1, 1}, {"imgB", "", 2, 1}, {"imgC", "", 0, 0}, {"imgA", "s", 0, 0}} {
		req, err := NewRequest()
		must(t, err)
		must(t, req.AddMMInput([]byte(c.image), 2, 4))
		must(t, req.SetCacheSalt(c.salt))
		d, err := p.Select(req, Tokens(tokens))
		must(t, err)
		if d.DeviceBlocks != c.blocks || (c.blocks > 0 && d.WorkerID != c.worker) {
			t.Errorf("%+v: got worker %d with %d blocks", c, d.WorkerID, d.DeviceBlocks)
		}
		req.Close()
	}
}

func TestExtraKeysAreBounded(t *testing.T) {
	req, err := NewRequest()
	must(t, err)
	defer req.Close()
	for i := 0; i < MaxMMInputs; i++ {
		must(t, req.AddMMInput(nil, ^uint64(0), ^uint64(0)))
	}
	var kerr *Error
	if err := req.AddMMInput([]byte("x"), 0, 1); !errors.As(err, &kerr) || kerr.Status != StatusTooLarge {
		t.Fatalf("input %d: %v", MaxMMInputs+1, err)
	}
	if err := req.AddBlockKey(-1, 1); !errors.As(err, &kerr) || kerr.Status != StatusInvalidArgument {
		t.Fatalf("negative block: %v", err)
	}
	must(t, req.Reset())
	must(t, req.AddMMInput([]byte("x"), 0, 1))
	must(t, req.AddBlockKey(0, 1))
}

func TestFreshnessCountersOfAHostFedStream(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "fresh", 1, WithTrustStaleOverlap(false))
	tokens := make([]uint32, testBlock)
	_, err := p.Ingest(1, 0, nil, 0, msgpackStored(1, tokens, testBlock, 0))
	must(t, err)
	s, ok := streamOf(t, p, 1)
	if !ok || s.Recovering || !s.StaleSince.IsZero() || s.IdleProbes != 0 || s.EventsSkippedMedium != 0 {
		t.Fatalf("a host-fed stream never replays: %+v", s)
	}
}

func TestSetOutputBlocksIsIdempotent(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "output", 1)
	d, err := p.SelectAndReserve(nil, Tokens(promptTokens(2*testBlock, 3)))
	must(t, err)
	for _, c := range []struct{ total, added uint64 }{{4, 4}, {4, 0}, {2, 0}, {6, 2}} {
		got, err := e.SetOutputBlocks(d.SelectionID, c.total)
		must(t, err)
		if got != c.added {
			t.Fatalf("SetOutputBlocks(%d) added %d, want %d", c.total, got, c.added)
		}
	}
	_, err = e.FreeBooking(d.SelectionID)
	must(t, err)
}
