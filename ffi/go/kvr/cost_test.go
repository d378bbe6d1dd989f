package kvr

import (
	"errors"
	"math"
	"testing"
	"time"
)

func closeTo(a, b float64) bool { return math.Abs(a-b) <= 1e-6*math.Max(1, math.Abs(b)) }

// costRequest is a request closed at the end of the test.
func costRequest(t *testing.T) *Request {
	t.Helper()
	r, err := NewRequest()
	must(t, err)
	t.Cleanup(r.Close)
	return r
}

// The latency model is the default: the cost is a TTFT estimate in ms (overhead + uncached
// tokens at the prior rate + the decode tie-break), the cached rank wins, and Dynamo's
// model, set explicitly, gives its block equivalents.
func TestCostModelLatencyDefault(t *testing.T) {
	e := newEngine(t)
	tokens := promptTokens(64, 11) // 4 blocks of 16
	lat := testPartition(t, e, "latency", 2)
	storePrefix(t, lat, 2, tokens, 4)
	req := costRequest(t)
	d, err := lat.Select(req, Tokens(tokens))
	must(t, err)
	if d.Rank.WorkerID != 2 || d.CachedTokens != 64 {
		t.Fatalf("latency default chose %+v, want the cached worker 2", d)
	}
	// 5 ms overhead, nothing to prefill, 4 decode blocks × 1 µs.
	if !closeTo(d.Cost, 5.004) {
		t.Errorf("cached cost %v, want 5.004 ms", d.Cost)
	}
	// Worker 1 has nothing: 64 tokens at 10,000 tokens/s = 6.4 ms more.
	must(t, req.SetAllowedWorkers([]uint64{1}))
	d, err = lat.Select(req, Tokens(tokens))
	must(t, err)
	if d.Rank.WorkerID != 1 || !closeTo(d.Cost, 5+6.4+0.004) {
		t.Errorf("uncached: %+v, want worker 1 at 11.404 ms", d)
	}

	dyn := testPartition(t, e, "dynamo", 2, WithCostModel(CostModelDynamo))
	storePrefix(t, dyn, 2, tokens, 4)
	d, err = dyn.Select(nil, Tokens(tokens))
	must(t, err)
	if d.Rank.WorkerID != 2 || !closeTo(d.Cost, 4) { // 0 prefill + 4 decode blocks
		t.Errorf("dynamo: %+v, want worker 2 at cost 4", d)
	}
	if CostModelLatency.String() != "latency" || CostModelDynamo.String() != "dynamo" || CostModel(9).String() != "CostModel(9)" {
		t.Errorf("CostModel names: %v %v %v", CostModelLatency, CostModelDynamo, CostModel(9))
	}
}

// Each knob reaches the cost.
func TestCostModelLatencyKnobs(t *testing.T) {
	e := newEngine(t)
	tokens := promptTokens(64, 12)
	p := testPartition(t, e, "knobs", 1,
		WithCostModel(CostModelLatency),
		WithPrefillRatePrior(1000), // a token costs 1 ms
		WithLearnPrefillRate(false),
		WithRequestOverhead(time.Millisecond),
		WithKVPressureThreshold(0.95),
		WithKVPressureCharge(10*time.Millisecond),
		WithITLTarget(10*time.Millisecond),
		WithITLBase(20*time.Millisecond),
		WithITLPerRequest(500*time.Microsecond),
		WithQueueExternality(0),
		WithDecodeBlockCharge(0),
	)
	req := costRequest(t)
	d, err := p.Select(req, Tokens(tokens))
	must(t, err)
	if !closeTo(d.Cost, 1+64) {
		t.Errorf("cost %v, want 65 ms", d.Cost)
	}
	// The per-token target: predicted 20 + 0.5 × 1 = 20.5 ms, 10.5 ms over, per expected
	// output token.
	must(t, req.SetExpectedOutputTokens(4))
	d, err = p.Select(req, Tokens(tokens))
	must(t, err)
	if !closeTo(d.Cost, 1+64+42) {
		t.Errorf("cost with a target %v, want 107 ms", d.Cost)
	}
	cleared := testPartition(t, e, "cleared", 1, WithPrefillRatePrior(1000), WithITLTarget(10*time.Millisecond),
		WithITLTarget(0), WithDecodeBlockCharge(0))
	d, err = cleared.Select(req, Tokens(tokens))
	must(t, err)
	if !closeTo(d.Cost, 5+64) {
		t.Errorf("cost with the target cleared %v, want 69 ms", d.Cost)
	}
}

// Every setter refuses what the partition would refuse, as ErrInvalidArgument.
func TestCostModelSettersRefuse(t *testing.T) {
	bad := map[string]PartitionOption{
		"unknown model":            WithCostModel(CostModel(2)),
		"model MaxUint32":          WithCostModel(CostModel(math.MaxUint32)),
		"prior 0":                  WithPrefillRatePrior(0),
		"prior negative":           WithPrefillRatePrior(-1),
		"prior NaN":                WithPrefillRatePrior(math.NaN()),
		"prior +Inf":               WithPrefillRatePrior(math.Inf(1)),
		"overhead negative":        WithRequestOverhead(-time.Millisecond),
		"threshold above 1":        WithKVPressureThreshold(1.5),
		"threshold negative":       WithKVPressureThreshold(-0.1),
		"threshold NaN":            WithKVPressureThreshold(math.NaN()),
		"pressure negative":        WithKVPressureCharge(-time.Second),
		"target negative":          WithITLTarget(-time.Millisecond),
		"itl base negative":        WithITLBase(-time.Millisecond),
		"itl per-request negative": WithITLPerRequest(-time.Microsecond),
		"externality negative":     WithQueueExternality(-1),
		"externality NaN":          WithQueueExternality(math.NaN()),
		"externality -Inf":         WithQueueExternality(math.Inf(-1)),
		"decode charge negative":   WithDecodeBlockCharge(-time.Microsecond),
	}
	e := newEngine(t)
	for name, opt := range bad {
		if _, err := CheckPartitionOptions(testBlock, opt); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: CheckPartitionOptions: %v, want ErrInvalidArgument", name, err)
		}
		if _, err := e.CreatePartition("m", name, testBlock, opt); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: CreatePartition: %v, want ErrInvalidArgument", name, err)
		}
	}
	good := []PartitionOption{
		WithCostModel(CostModelDynamo), WithCostModel(CostModelLatency), WithPrefillRatePrior(1),
		WithLearnPrefillRate(true), WithRequestOverhead(0), WithKVPressureThreshold(0),
		WithKVPressureThreshold(1), WithKVPressureCharge(0), WithITLTarget(time.Millisecond),
		WithITLTarget(0), WithITLBase(0), WithITLPerRequest(0), WithQueueExternality(0),
		WithDecodeBlockCharge(0),
	}
	if notices, err := CheckPartitionOptions(testBlock, good...); err != nil || notices != "" {
		t.Fatalf("CheckPartitionOptions(valid knobs) = %q, %v", notices, err)
	}
}

// PrefillRate: none before any completion; learned after a few completed prefills.
func TestPrefillRate(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "rate", 1)
	r, err := p.PrefillRate()
	must(t, err)
	if r.Learned() || r.TokensPerSecond != 0 || r.Observations != 0 {
		t.Fatalf("before any completion: %+v", r)
	}
	dr, err := p.DecodeDrag()
	must(t, err)
	if dr.Learned() || dr.SecondsPerBlock != -1 || dr.Observations != 0 {
		t.Fatalf("drag before any completion: %+v", dr)
	}
	tokens := promptTokens(64, 13)
	for i := 0; i < 8; i++ {
		d, err := p.SelectAndReserve(nil, Tokens(tokens))
		must(t, err)
		time.Sleep(2 * time.Millisecond)
		must(t, e.MarkPrefillComplete(d.SelectionID))
		_, err = e.FreeBooking(d.SelectionID)
		must(t, err)
	}
	r, err = p.PrefillRate()
	must(t, err)
	if !r.Learned() || r.Observations != 8 || math.IsInf(r.TokensPerSecond, 0) {
		t.Fatalf("after 8 completions: %+v", r)
	}
	// 64 tokens in at least 2 ms each.
	if r.TokensPerSecond > 32000*1.01 {
		t.Errorf("rate %v tokens/s, want at most 32,000", r.TokensPerSecond)
	}
	// The drag counts the same completions; eight on one rank teach it nothing yet.
	dr, err = p.DecodeDrag()
	must(t, err)
	if dr.Learned() || dr.Observations != 8 {
		t.Fatalf("drag after 8 completions: %+v", dr)
	}
	p.Close()
	if _, err := p.PrefillRate(); !errors.Is(err, ErrClosed) {
		t.Errorf("PrefillRate after Close: %v", err)
	}
	if _, err := p.DecodeDrag(); !errors.Is(err, ErrClosed) {
		t.Errorf("DecodeDrag after Close: %v", err)
	}
}
