package kvr

// #include "shim.h"
import "C"

import "time"

// CostModel is which cost a partition's selections minimise (KVR_COST_MODEL_*).
type CostModel uint32

// The cost models.
const (
	// CostModelLatency: each candidate's predicted time to first token in ms (its booked
	// prefill queue plus the prompt's uncached part at the partition's prefill rate), with
	// decode load as a tie-break until KV memory nears full or a per-token latency target
	// is set. The default; Decision.Cost is then a TTFT estimate in ms.
	CostModelLatency CostModel = C.KVR_COST_MODEL_LATENCY
	// CostModelDynamo: Dynamo's default scorer, term for term, in block equivalents, for
	// a deployment that must route exactly as Dynamo does.
	CostModelDynamo CostModel = C.KVR_COST_MODEL_DYNAMO
)

func (m CostModel) String() string {
	switch m {
	case CostModelLatency:
		return "latency"
	case CostModelDynamo:
		return "dynamo"
	}
	return "CostModel(" + itoa(uint64(m)) + ")"
}

// WithCostModel sets which cost the partition's selections minimise (default
// CostModelLatency); another value is ErrInvalidArgument. The latency knobs below are
// kept, and checked, whichever model is set.
func WithCostModel(m CostModel) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		return check(C.kvr_partition_options_set_cost_model(o, C.uint32_t(m)),
			"kvr_partition_options_set_cost_model")
	}
}

// fracMillis is d in (fractional) milliseconds, as the latency knobs take them.
func fracMillis(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// WithPrefillRatePrior sets the latency model's prefill throughput of one rank before
// any is learned, tokens/s (default 10,000; finite and > 0, else ErrInvalidArgument). A
// learned rate is kept within [prior / 10, prior × 10].
func WithPrefillRatePrior(tokensPerSecond float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_prefill_rate_prior(o, v)
	}, "kvr_partition_options_set_prefill_rate_prior", tokensPerSecond)
}

// WithLearnPrefillRate sets whether the partition learns its prefill rate from the
// timings of MarkPrefillComplete (default true) or keeps the prior (false).
// Partition.PrefillRate reports what was learned either way.
func WithLearnPrefillRate(on bool) PartitionOption {
	return func(o *C.kvr_partition_options) error {
		var v C.uint32_t
		if on {
			v = 1
		}
		return check(C.kvr_partition_options_set_learn_prefill_rate(o, v),
			"kvr_partition_options_set_learn_prefill_rate")
	}
}

// WithRequestOverhead sets the latency model's fixed cost of one request's prefill
// (default 5 ms; negative is ErrInvalidArgument).
func WithRequestOverhead(d time.Duration) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_request_overhead_ms(o, v)
	}, "kvr_partition_options_set_request_overhead_ms", fracMillis(d))
}

// WithKVPressureThreshold sets the share of a rank's KV blocks in use (after the
// booking) above which KV memory pressure is charged (default 0.9; in [0, 1], else
// ErrInvalidArgument).
func WithKVPressureThreshold(share float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_kv_pressure_threshold(o, v)
	}, "kvr_partition_options_set_kv_pressure_threshold", share)
}

// WithKVPressureCharge sets the KV pressure charge at full KV memory, rising linearly
// from the threshold (kvr_partition_options_set_kv_pressure_ms; default 1 s; negative is
// ErrInvalidArgument).
func WithKVPressureCharge(d time.Duration) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_kv_pressure_ms(o, v)
	}, "kvr_partition_options_set_kv_pressure_ms", fracMillis(d))
}

// WithITLTarget sets a per-token latency target: a rank whose predicted per-token
// latency exceeds it is charged the excess over the request's expected output. Default:
// no target; 0 clears it; negative is ErrInvalidArgument.
func WithITLTarget(d time.Duration) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_itl_target_ms(o, v)
	}, "kvr_partition_options_set_itl_target_ms", fracMillis(d))
}

// WithITLBase sets the predicted per-token latency of a lone request (default 20 ms;
// only read with a target; negative is ErrInvalidArgument).
func WithITLBase(d time.Duration) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_itl_base_ms(o, v)
	}, "kvr_partition_options_set_itl_base_ms", fracMillis(d))
}

// WithITLPerRequest sets the predicted extra per-token latency per request running on
// the rank (default 0.2 ms; only read with a target; negative is ErrInvalidArgument).
func WithITLPerRequest(d time.Duration) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_itl_per_request_ms(o, v)
	}, "kvr_partition_options_set_itl_per_request_ms", fracMillis(d))
}

// WithQueueExternality sets the weight of the queue externality (default 2; 0 = price
// only this request's TTFT; finite and ≥ 0, else ErrInvalidArgument): a prompt's
// uncached tokens also delay the requests that will queue behind them.
func WithQueueExternality(weight float64) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_queue_externality(o, v)
	}, "kvr_partition_options_set_queue_externality", weight)
}

// WithDecodeBlockCharge sets the latency model's tie-break: the time charged per decode
// block the rank would hold after the booking (kvr_partition_options_set_decode_block_us;
// default 1 µs; negative is ErrInvalidArgument).
func WithDecodeBlockCharge(d time.Duration) PartitionOption {
	return f64Option(func(o *C.kvr_partition_options, v C.double) C.kvr_status {
		return C.kvr_partition_options_set_decode_block_us(o, v)
	}, "kvr_partition_options_set_decode_block_us", float64(d)/float64(time.Microsecond))
}

// PrefillRate is a partition's prefill throughput learned from MarkPrefillComplete
// timings.
type PrefillRate struct {
	// TokensPerSecond per rank; 0 until a few prefill completions were observed (or
	// none took measurable time). A selection with the latency model and learning on
	// uses it within [prior / 10, prior × 10].
	TokensPerSecond float64
	// Observations: prefill completions observed so far.
	Observations uint64
}

// Learned reports whether a rate was learned.
func (r PrefillRate) Learned() bool { return r.TokensPerSecond > 0 }

// PrefillRate returns the partition's learned prefill rate (zero TokensPerSecond while
// none is learned).
func (p *Partition) PrefillRate() (PrefillRate, error) {
	return readStats(p, "kvr_partition_prefill_rate",
		func(p *C.kvr_partition, c *learnedPair) C.kvr_status {
			return C.kvr_partition_prefill_rate(p, &c.value, &c.n)
		},
		func(c *learnedPair) PrefillRate {
			return PrefillRate{TokensPerSecond: float64(c.value), Observations: uint64(c.n)}
		})
}

// learnedPair is what the C calls for a learned estimate write: the estimate and the
// observations behind it.
type learnedPair struct {
	value C.double
	n     C.uint64_t
}

// DecodeDrag is a partition's learned decode drag: how much a rank's decode load
// lengthens a request's time to first token there.
type DecodeDrag struct {
	// SecondsPerBlock of time to first token per decode block a rank holds; -1 until
	// enough prefill completions were observed on ranks of different decode loads (0 is
	// a learned value). A selection with the latency model and learning on charges it
	// capped at 1 ms a block.
	SecondsPerBlock float64
	// Observations: prefill completions observed so far.
	Observations uint64
}

// Learned reports whether a drag was learned.
func (d DecodeDrag) Learned() bool { return d.SecondsPerBlock >= 0 }

// DecodeDrag returns the partition's learned decode drag (SecondsPerBlock -1 while none
// is learned).
func (p *Partition) DecodeDrag() (DecodeDrag, error) {
	return readStats(p, "kvr_partition_decode_drag",
		func(p *C.kvr_partition, c *learnedPair) C.kvr_status {
			return C.kvr_partition_decode_drag(p, &c.value, &c.n)
		},
		func(c *learnedPair) DecodeDrag {
			return DecodeDrag{SecondsPerBlock: float64(c.value), Observations: uint64(c.n)}
		})
}
