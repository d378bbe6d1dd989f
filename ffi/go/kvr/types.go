package kvr

// #include "shim.h"
import "C"

import (
	"time"
	"unsafe"
)

// Rank is one data-parallel rank of a worker: every index entry, load figure and
// booking is keyed by rank.
type Rank struct {
	WorkerID uint64
	DPRank   uint32
}

// Tier is a KV storage tier.
type Tier uint32

// The storage tiers.
const (
	TierDevice Tier = C.KVR_TIER_DEVICE // GPU memory, the primary tier
	TierHost   Tier = C.KVR_TIER_HOST   // host memory
	TierDisk   Tier = C.KVR_TIER_DISK   // disk
)

// EventKind is the kind of a KV event.
type EventKind uint32

// The event kinds.
const (
	EventStored  EventKind = C.KVR_EVENT_STORED
	EventRemoved EventKind = C.KVR_EVENT_REMOVED
	EventCleared EventKind = C.KVR_EVENT_CLEARED
)

// StoredBlock is one stored block: the engine's own opaque block hash and kvr's local
// hash of the block's tokens (HashTokens). Same layout as kvr_stored_block.
type StoredBlock struct {
	ExternalHash uint64
	LocalHash    uint64
}

// StoredBlocks pairs engine hashes with local hashes (the shorter length wins).
func StoredBlocks(external, local []uint64) []StoredBlock {
	n := len(external)
	if len(local) < n {
		n = len(local)
	}
	out := make([]StoredBlock, n)
	for i := range out {
		out[i] = StoredBlock{ExternalHash: external[i], LocalHash: local[i]}
	}
	return out
}

// Event is one KV event of a rank; fields its kind does not use are ignored.
type Event struct {
	Kind EventKind
	// Tier of a stored or removed event.
	Tier Tier
	// HasParent: a stored chain extends the block whose engine hash is Parent.
	HasParent bool
	Parent    uint64
	// Blocks of a stored event, in chain order.
	Blocks []StoredBlock
	// Removed: engine block hashes of a removed event.
	Removed []uint64
}

// StoredEvent is a stored event starting a chain at the root.
func StoredEvent(tier Tier, blocks []StoredBlock) Event {
	return Event{Kind: EventStored, Tier: tier, Blocks: blocks}
}

// StoredChildEvent is a stored event extending the chain ending at parent (an engine
// block hash).
func StoredChildEvent(tier Tier, parent uint64, blocks []StoredBlock) Event {
	return Event{Kind: EventStored, Tier: tier, HasParent: true, Parent: parent, Blocks: blocks}
}

// RemovedEvent evicts blocks (engine hashes) from tier.
func RemovedEvent(tier Tier, hashes []uint64) Event {
	return Event{Kind: EventRemoved, Tier: tier, Removed: hashes}
}

// ClearedEvent drops the rank's whole cache.
func ClearedEvent() Event {
	return Event{Kind: EventCleared}
}

// ApplyResult is what one ApplyEvents call did (kvr_apply_result).
type ApplyResult struct {
	EventsApplied uint64
	// EventsRejected: events the index refused (unknown parent, rank limit).
	EventsRejected uint64
	BlocksStored   uint64
	BlocksRemoved  uint64
	// BlocksNotFound: removed hashes the rank did not hold.
	BlocksNotFound uint64
}

// Overlap is one rank's overlap with a prompt in leading blocks: DeviceBlocks on the
// device, then HostBlocks more in host memory, then DiskBlocks more on disk. Same
// layout as kvr_overlap (FindMatches writes into []Overlap directly).
type Overlap struct {
	WorkerID     uint64
	DPRank       uint32
	DeviceBlocks uint32
	HostBlocks   uint32
	DiskBlocks   uint32
}

// Rank is the overlap's rank.
func (o Overlap) Rank() Rank { return Rank{WorkerID: o.WorkerID, DPRank: o.DPRank} }

// BlockRange is a range [Start, End) of prompt blocks (kvr_block_range).
type BlockRange struct {
	Start uint32
	End   uint32
}

// RankLoad is the load a host reports for one rank (0 = unknown for every figure).
// Same layout as kvr_rank_load (PublishLoad passes []RankLoad directly).
type RankLoad struct {
	WorkerID uint64
	DPRank   uint32
	// WaitingRequests: queued, not yet scheduled.
	WaitingRequests uint32
	// RunningRequests: being prefilled or decoded.
	RunningRequests uint32
	reserved        uint32
	// KVBlocksUsed and KVBlocksTotal: device KV blocks in use and in total.
	KVBlocksUsed  uint64
	KVBlocksTotal uint64
	// PendingPrefillTokens: scheduled but not yet computed.
	PendingPrefillTokens uint64
}

// Outcome is how a selection ended.
type Outcome uint8

const (
	// NoOutcome is the zero value (a Decision returned with an error).
	NoOutcome Outcome = iota
	// Selected: the Decision names a rank.
	Selected
	// Busy: every candidate rank is busy or overloaded; nothing was booked; try again
	// later (KVR_BUSY).
	Busy
	// NoWorker: no rank can serve the request (no workers, none allowed or available)
	// (KVR_NO_WORKER).
	NoWorker
)

func (o Outcome) String() string {
	switch o {
	case Selected:
		return "selected"
	case Busy:
		return "busy"
	case NoWorker:
		return "no worker"
	}
	return "no outcome"
}

// Decision is a selection's answer. Only Outcome is set unless it is Selected.
type Decision struct {
	Outcome Outcome
	Rank
	// DeviceBlocks: leading prompt blocks cached on the chosen rank's device; then
	// HostBlocks more in its host memory and DiskBlocks more on its disk.
	DeviceBlocks uint32
	HostBlocks   uint32
	DiskBlocks   uint32
	// SharedBlocks: blocks the host's shared cache holds beyond the device prefix.
	SharedBlocks uint32
	// SelectionID names the booking (booked modes); 0 for an advisory selection.
	SelectionID uint64
	// CachedTokens: prompt tokens cached on the chosen rank's device.
	CachedTokens uint64
	// ProjectedPrefillTokens: prefill tokens this request adds to the rank.
	ProjectedPrefillTokens uint64
	// ProjectedDecodeBlocks: the rank's decode blocks once this request is booked on it.
	ProjectedDecodeBlocks uint64
	// Cost of the chosen rank: a predicted TTFT in ms with CostModelLatency (the
	// default), block equivalents with CostModelDynamo; NaN for explicit reservations.
	Cost float64
	// Flags: whether a transfer hint came with the booking (HasHint) and how session
	// affinity steered the choice (SessionRoute).
	Flags DecisionFlags
	// Hint is the booking's transfer hint (WithKVHints; SelectAndReserve only), nil
	// without one. Only a decision with a hint allocates it.
	Hint *KVHint
}

// Err is nil for Selected, ErrBusy or ErrNoWorker for those outcomes (for callers that
// prefer an error), and ErrNull for NoOutcome.
func (d Decision) Err() error {
	switch d.Outcome {
	case Selected:
		return nil
	case Busy:
		return ErrBusy
	case NoWorker:
		return ErrNoWorker
	}
	return ErrNull
}

func decisionOf(c *C.kvr_decision) Decision {
	return Decision{
		Outcome:                Selected,
		Rank:                   Rank{WorkerID: uint64(c.worker_id), DPRank: uint32(c.dp_rank)},
		DeviceBlocks:           uint32(c.device_blocks),
		HostBlocks:             uint32(c.host_blocks),
		DiskBlocks:             uint32(c.disk_blocks),
		SharedBlocks:           uint32(c.shared_blocks),
		SelectionID:            uint64(c.selection_id),
		CachedTokens:           uint64(c.cached_tokens),
		ProjectedPrefillTokens: uint64(c.projected_prefill_tokens),
		ProjectedDecodeBlocks:  uint64(c.projected_decode_blocks),
		Cost:                   float64(c.cost),
		Flags:                  DecisionFlags(c.flags),
	}
}

// ReplicaBooking is a booking received from a replica peer (another router instance over
// the same workers).
type ReplicaBooking struct {
	// SelectionID must not be 0.
	SelectionID uint64
	Rank        Rank
	// PromptBlocks: the prompt's sequence hashes (seq output of HashTokens).
	PromptBlocks         []uint64
	PrefillTokens        uint64
	ExpectedOutputTokens uint64
	// TTL of the booking (0 = the partition's default), in whole milliseconds.
	TTL time.Duration
}

// IndexStats are index-wide figures (event and refusal counters are totals since
// creation).
type IndexStats struct {
	Ranks uint64
	// Nodes: distinct prefixes held by at least one rank.
	Nodes uint64
	// HolderBlocks: (rank, block) pairs held on any tier; TierBlocks per tier (device,
	// host, disk).
	HolderBlocks uint64
	TierBlocks   [3]uint64
	// Bytes: all index memory.
	Bytes         uint64
	StoredEvents  uint64
	RemovedEvents uint64
	ClearedEvents uint64
	// ParentNotFound: stores refused because their parent was unknown.
	ParentNotFound uint64
	// BlockNotFound: removed hashes the rank did not hold.
	BlockNotFound uint64
	// TooManyRanks: events refused because the rank limit was reached.
	TooManyRanks uint64
}

// SelectionStats are a partition's selection counters.
type SelectionStats struct {
	Selections uint64
	Busy       uint64
	NoWorker   uint64
	// SharedCacheFailures: shared-cache hook failures (the selections went on without).
	SharedCacheFailures uint64
	// StaleOverlapsIgnored: ranks whose overlap a lookup did not credit because their
	// event stream was stale (WithTrustStaleOverlap credits it).
	StaleOverlapsIgnored uint64
}

// BookingStats are a partition's booking-table figures.
type BookingStats struct {
	// Bookings: live bookings.
	Bookings uint64
	// TrackedRanks: ranks with booking counters.
	TrackedRanks uint64
	// ExpiredTotal: bookings freed by expiry sweeps so far.
	ExpiredTotal uint64
	// CounterUnderflows: subtractions that would have gone below zero (0 unless kvr has
	// a bug).
	CounterUnderflows uint64
	// SweeperStarted: the expiry sweep thread has started (on the first booking).
	SweeperStarted bool
}

// ActiveLoad is the engine's live bookings on one rank.
type ActiveLoad struct {
	ActivePrefillTokens uint64
	// ActiveDecodeBlocks: distinct prompt blocks of the rank's bookings plus their
	// output blocks.
	ActiveDecodeBlocks uint64
	ActiveRequests     uint64
}

// Compile-time layout checks of the types passed to C in place (equal sizes and
// offsets: each pair of arrays fails to compile if the difference is negative).
var (
	_ [unsafe.Sizeof(Overlap{}) - unsafe.Sizeof(C.kvr_overlap{})]byte
	_ [unsafe.Sizeof(C.kvr_overlap{}) - unsafe.Sizeof(Overlap{})]byte
	_ [unsafe.Offsetof(Overlap{}.DiskBlocks) - unsafe.Offsetof(C.kvr_overlap{}.disk_blocks)]byte
	_ [unsafe.Offsetof(C.kvr_overlap{}.disk_blocks) - unsafe.Offsetof(Overlap{}.DiskBlocks)]byte
	_ [unsafe.Offsetof(Overlap{}.DPRank) - unsafe.Offsetof(C.kvr_overlap{}.dp_rank)]byte
	_ [unsafe.Offsetof(C.kvr_overlap{}.dp_rank) - unsafe.Offsetof(Overlap{}.DPRank)]byte

	_ [unsafe.Sizeof(StoredBlock{}) - unsafe.Sizeof(C.kvr_stored_block{})]byte
	_ [unsafe.Sizeof(C.kvr_stored_block{}) - unsafe.Sizeof(StoredBlock{})]byte
	_ [unsafe.Offsetof(StoredBlock{}.LocalHash) - unsafe.Offsetof(C.kvr_stored_block{}.local_hash)]byte
	_ [unsafe.Offsetof(C.kvr_stored_block{}.local_hash) - unsafe.Offsetof(StoredBlock{}.LocalHash)]byte

	_ [unsafe.Sizeof(BlockRange{}) - unsafe.Sizeof(C.kvr_block_range{})]byte
	_ [unsafe.Sizeof(C.kvr_block_range{}) - unsafe.Sizeof(BlockRange{})]byte

	_ [unsafe.Sizeof(RankLoad{}) - unsafe.Sizeof(C.kvr_rank_load{})]byte
	_ [unsafe.Sizeof(C.kvr_rank_load{}) - unsafe.Sizeof(RankLoad{})]byte
	_ [unsafe.Offsetof(RankLoad{}.KVBlocksUsed) - unsafe.Offsetof(C.kvr_rank_load{}.kv_blocks_used)]byte
	_ [unsafe.Offsetof(C.kvr_rank_load{}.kv_blocks_used) - unsafe.Offsetof(RankLoad{}.KVBlocksUsed)]byte
	_ [unsafe.Offsetof(RankLoad{}.PendingPrefillTokens) - unsafe.Offsetof(C.kvr_rank_load{}.pending_prefill_tokens)]byte
	_ [unsafe.Offsetof(C.kvr_rank_load{}.pending_prefill_tokens) - unsafe.Offsetof(RankLoad{}.PendingPrefillTokens)]byte

	_ [unsafe.Sizeof(ApplyResult{}) - unsafe.Sizeof(C.kvr_apply_result{})]byte
	_ [unsafe.Sizeof(C.kvr_apply_result{}) - unsafe.Sizeof(ApplyResult{})]byte
)
