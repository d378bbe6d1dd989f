package kvr

import (
	"encoding/binary"
	"errors"
	"math"
	"testing"
	"time"
)

// msgpackStored is a vLLM KVEventBatch [ts, [BlockStored], dpRank] (tagged-map encoding)
// storing one block of tokens (< 128 each) under engine hash `hash`.
func msgpackStored(hash uint8, tokens []uint32, blockSize uint8, dpRank uint8) []byte {
	str := func(b []byte, s string) []byte { return append(append(b, 0xa0|byte(len(s))), s...) }
	b := []byte{0x93, 0xcb}
	b = binary.BigEndian.AppendUint64(b, math.Float64bits(1.0))
	b = append(b, 0x91, 0x85)
	b = str(b, "type")
	b = str(b, "BlockStored")
	b = str(b, "block_hashes")
	b = append(b, 0x91, hash)
	b = str(b, "parent_block_hash")
	b = append(b, 0xc0)
	b = str(b, "token_ids")
	b = append(b, 0xdc)
	b = binary.BigEndian.AppendUint16(b, uint16(len(tokens)))
	for _, t := range tokens {
		b = append(b, byte(t))
	}
	b = str(b, "block_size")
	b = append(b, blockSize, dpRank)
	return b
}

func streamOf(t *testing.T, p *Partition, worker uint64) (StreamStats, bool) {
	t.Helper()
	all, err := p.IngressStats()
	must(t, err)
	for _, s := range all {
		if s.WorkerID == worker {
			return s, true
		}
	}
	return StreamStats{}, false
}

func TestIngest(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "ingest", 0)
	tokens := make([]uint32, testBlock)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	payload := msgpackStored(1, tokens, testBlock, 0)

	if s, _ := streamOf(t, p, 1); s.Messages != 0 {
		t.Fatalf("a stream before any message: %+v", s)
	}
	before := time.Now().Add(-time.Second)
	res, err := p.Ingest(1, 0, []byte("kv"), 0, payload)
	must(t, err)
	if res != (IngestResult{BatchesApplied: 1}) {
		t.Fatalf("Ingest = %+v", res)
	}
	local, _, err := p.HashTokens("", tokens, nil, nil)
	must(t, err)
	ov, err := p.FindMatches(local, nil)
	must(t, err)
	if len(ov) != 1 || ov[0].WorkerID != 1 || ov[0].DPRank != 0 || ov[0].DeviceBlocks != 1 {
		t.Fatalf("FindMatches after Ingest = %+v", ov)
	}

	// A duplicate applies nothing; garbage is ErrDecode, counted; a restart clears.
	res, err = p.Ingest(1, 0, nil, 0, payload)
	must(t, err)
	if res.BatchesApplied != 0 {
		t.Fatalf("duplicate: %+v", res)
	}
	res, err = p.Ingest(1, 0, nil, 1, []byte{0x93, 0x01})
	if !errors.Is(err, ErrDecode) || res.DecodeErrors != 1 || res.BatchesApplied != 0 {
		t.Fatalf("garbage: %+v, %v", res, err)
	}
	var kerr *Error
	if !errors.As(err, &kerr) || kerr.Op != "kvr_partition_ingest" || kerr.Status != StatusDecode {
		t.Fatalf("garbage error %#v", err)
	}
	res, err = p.Ingest(1, 0, nil, 0, payload)
	must(t, err)
	if res.Clears != 1 || res.BatchesApplied != 1 {
		t.Fatalf("restart: %+v", res)
	}
	// A batch naming DP rank 0 of another worker; an empty payload does not decode.
	_, err = p.Ingest(2, 3, nil, 7, msgpackStored(9, tokens, testBlock, 0))
	must(t, err)
	if _, err := p.Ingest(2, 3, nil, 8, nil); !errors.Is(err, ErrDecode) {
		t.Fatalf("empty payload: %v", err)
	}

	s, ok := streamOf(t, p, 1)
	if !ok {
		t.Fatal("no stream of worker 1")
	}
	if s.Stream != 0 || s.Messages != 4 || s.Batches != 2 || s.Duplicates != 1 || s.Restarts != 1 ||
		s.Clears != 1 || s.BlocksStored != 2 || s.Events != 2 || !s.HasLastSeq || s.LastSeq != 0 ||
		s.DecodeErrorTotal() != 1 || s.Bytes == 0 {
		t.Fatalf("worker 1's stream: %+v", s)
	}
	if s.LastBatch.Before(before) || s.LastBatch.After(time.Now().Add(time.Second)) {
		t.Fatalf("LastBatch %v", s.LastBatch)
	}
	if s.Health != SourceExact || s.HealthReason != "in sequence" || s.LinkFailures != 0 {
		t.Fatalf("worker 1's health: %v %q", s.Health, s.HealthReason)
	}
	s2, ok := streamOf(t, p, 2)
	if !ok || s2.Stream != 3 || s2.LastSeq != 8 || s2.DecodeErrorTotal() != 1 {
		t.Fatalf("worker 2's stream: %+v", s2)
	}
	// Its last batch did not decode: degraded, its rank cleared (so nothing stale: an
	// undercount only), its overlap gone.
	if s2.Health != SourceDegraded || s2.HealthReason != "decode errors" || !s2.StaleSince.IsZero() ||
		s2.HealthSince.IsZero() || s2.Health.String() != "degraded" {
		t.Fatalf("worker 2's health: %v %q since %v", s2.Health, s2.HealthReason, s2.HealthSince)
	}
	ov, err = p.FindMatches(local, ov)
	must(t, err)
	if len(ov) != 1 || ov[0].WorkerID != 1 {
		t.Fatalf("FindMatches with worker 2 degraded = %+v", ov)
	}
	// The next batch that applies makes it exact again.
	_, err = p.Ingest(2, 3, nil, 9, msgpackStored(9, tokens, testBlock, 0))
	must(t, err)
	if s2, _ = streamOf(t, p, 2); s2.Health != SourceExact || !s2.StaleSince.IsZero() {
		t.Fatalf("worker 2 after a good batch: %v %q", s2.Health, s2.HealthReason)
	}
	ov, err = p.FindMatches(local, ov)
	must(t, err)
	if len(ov) != 2 || ov[1].Rank() != (Rank{WorkerID: 2, DPRank: 0}) {
		t.Fatalf("FindMatches = %+v", ov)
	}

	// A batch naming DP rank 5 of a registered dp-size-1 worker is refused and counted:
	// the wire never picks which ranks exist.
	must(t, p.UpsertWorkerConfig(WorkerConfig{ID: 30, TotalKVBlocks: 10000}))
	res, err = p.Ingest(30, 0, nil, 0, msgpackStored(1, tokens, testBlock, 5))
	if !errors.Is(err, ErrUnknownRank) || res.Refused != 1 || res.BatchesApplied != 0 {
		t.Fatalf("a batch for DP rank 5: %v %+v", err, res)
	}
	s30, ok := streamOf(t, p, 30)
	if !ok || s30.DPRankRefused != 1 || s30.EventsRejected != 1 || s30.BlocksStored != 0 {
		t.Fatalf("worker 30's stream after a batch for DP rank 5: %+v (%+v)", s30, res)
	}
	if s.DPRankRefused != 0 {
		t.Fatalf("worker 1's stream: %+v", s)
	}
	ov, err = p.FindMatches(local, ov)
	must(t, err)
	if len(ov) != 2 {
		t.Fatalf("a refused batch was applied: %+v", ov)
	}

	// More streams than IngressStats's first buffer holds.
	for w := uint64(10); w < 20; w++ {
		_, err := p.Ingest(w, 0, nil, 0, payload)
		must(t, err)
	}
	all, err := p.IngressStats()
	must(t, err)
	if len(all) != 13 {
		t.Fatalf("IngressStats: %d streams, want 13", len(all))
	}

	// Decode-error names.
	name, err := DecodeErrorName(0)
	if err != nil || name != "truncated" {
		t.Fatalf("DecodeErrorName(0) = %q, %v", name, err)
	}
	for _, k := range []int{-1, DecodeErrorKinds, DecodeErrorKinds - 1} {
		if _, err := DecodeErrorName(k); !errors.Is(err, ErrInvalidArgument) {
			t.Fatalf("DecodeErrorName(%d): %v", k, err)
		}
	}
	names := map[string]bool{}
	for k := 0; k < DecodeErrorKinds; k++ {
		if n, err := DecodeErrorName(k); err == nil {
			if n == "" || names[n] {
				t.Fatalf("DecodeErrorName(%d) = %q (empty or repeated)", k, n)
			}
			names[n] = true
		}
	}

	p.Close()
	if _, err := p.Ingest(1, 0, nil, 0, payload); err != ErrClosed {
		t.Fatalf("Ingest on closed partition: %v", err)
	}
	if _, err := p.IngressStats(); err != ErrClosed {
		t.Fatalf("IngressStats on closed partition: %v", err)
	}
}
