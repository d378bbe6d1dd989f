package kvr

// #include "shim.h"
import "C"

// MaxControlEndpointLen is the longest control endpoint a worker may register, in bytes
// (Worker.SetControlEndpoint refuses a longer one with ErrInvalidArgument): it travels
// inline in a transfer hint.
const MaxControlEndpointLen = C.KVR_CONTROL_ENDPOINT_MAX_LEN

// DecisionFlags are a decision's KVR_DECISION_* bits: whether a transfer hint came with
// the booking, and how session affinity steered the choice (at most one session bit).
type DecisionFlags uint32

// The decision flags.
const (
	// FlagKVHint: a transfer hint came with the booking (Decision.Hint).
	FlagKVHint DecisionFlags = C.KVR_DECISION_KV_HINT
	// The session bits (Decision.SessionRoute reads them).
	FlagSessionUnbound   DecisionFlags = C.KVR_DECISION_SESSION_UNBOUND
	FlagSessionPinned    DecisionFlags = C.KVR_DECISION_SESSION_PINNED
	FlagSessionPreferred DecisionFlags = C.KVR_DECISION_SESSION_PREFERRED
	FlagSessionRebound   DecisionFlags = C.KVR_DECISION_SESSION_REBOUND
)

// KVHint is a transfer hint (kvr_kv_hint): the chosen rank may pull prompt blocks
// [BlockStart, BlockEnd) from rank Source through ControlEndpoint instead of computing
// them.
type KVHint struct {
	Source     Rank
	BlockStart uint32
	BlockEnd   uint32
	// ControlEndpoint is the source rank's control endpoint (Worker.SetControlEndpoint).
	ControlEndpoint string
	// BlockHashes: the source engine's own hashes of the first blocks of the range, with
	// a request that keeps them (Request.KeepHintNames); nil otherwise.
	BlockHashes []uint64
}

// HasHint reports whether a transfer hint came with the booking (then d.Hint is set).
func (d Decision) HasHint() bool { return d.Flags&FlagKVHint != 0 }

// SessionRoute is how session affinity took part in the selection (SessionNone when it
// is off or the request has no session).
func (d Decision) SessionRoute() SessionRoute {
	switch {
	case d.Flags&FlagSessionUnbound != 0:
		return SessionUnbound
	case d.Flags&FlagSessionPinned != 0:
		return SessionPinned
	case d.Flags&FlagSessionPreferred != 0:
		return SessionPreferred
	case d.Flags&FlagSessionRebound != 0:
		return SessionRebound
	}
	return SessionNone
}

// hintOf copies a C hint into Go memory (called only when the decision has one).
func hintOf(c *C.kvr_kv_hint) *KVHint {
	n := int(c.control_endpoint_len)
	if n > MaxControlEndpointLen {
		n = MaxControlEndpointLen
	}
	return &KVHint{
		Source:          Rank{WorkerID: uint64(c.source_worker_id), DPRank: uint32(c.source_dp_rank)},
		BlockStart:      uint32(c.block_start),
		BlockEnd:        uint32(c.block_end),
		ControlEndpoint: C.GoStringN(&c.control_endpoint[0], C.int(n)),
	}
}

// WithKVHints turns transfer hints on for booked selections (SelectAndReserve): a hint
// is attached when an eligible rank holds a device prefix at least minAdvantageBlocks
// longer than the chosen rank's, asking for at most maxTransferBlocks blocks
// (maxTransferBlocks 0 turns hints off, the default). Eligible: a role among
// sourceRoles (at least one; Dynamo's default is RolePrefill and RoleAggregated), a
// control endpoint for that rank (WorkerConfig.ControlEndpoints), and not overloaded or
// busy. Dynamo's defaults are 4 and 4,096. ErrInvalidArgument for no role or an unknown
// one (with maxTransferBlocks > 0).
func WithKVHints(minAdvantageBlocks, maxTransferBlocks uint32, sourceRoles ...Role) PartitionOption {
	var mask uint32
	for _, r := range sourceRoles {
		if r >= 31 {
			mask |= 1 << 31 // no role has this bit: kvr refuses it
		} else {
			mask |= 1 << uint32(r)
		}
	}
	return func(o *C.kvr_partition_options) error {
		return check(C.kvr_partition_options_set_kv_hints(o, C.uint32_t(minAdvantageBlocks),
			C.uint32_t(maxTransferBlocks), C.uint32_t(mask)), "kvr_partition_options_set_kv_hints")
	}
}
