package kvr

// #include "shim.h"
import "C"

import (
	"runtime"
	"sync"
	"time"
	"unsafe"
)

// Partition is a handle to one partition (model, routing group) of an engine: its
// index, workers, load view, bookings and hooks. Its methods may be called from many
// goroutines at once. A handle keeps its engine alive.
type Partition struct {
	ptr       *C.kvr_partition
	blockSize uint32
}

func newPartition(ptr *C.kvr_partition) (*Partition, error) {
	var bs C.uint32_t
	gc()
	st := C.kvr_partition_block_size(ptr, &bs)
	gc()
	if err := check(st, "kvr_partition_block_size"); err != nil {
		C.kvr_partition_free(ptr)
		return nil, err
	}
	p := &Partition{ptr: ptr, blockSize: uint32(bs)}
	runtime.SetFinalizer(p, (*Partition).finalize)
	return p, nil
}

func (p *Partition) finalize() {
	finalized.Add(1)
	p.Close()
}

// Close releases this handle (not the partition). Idempotent; not concurrent with
// other calls on p.
func (p *Partition) Close() {
	if p.ptr == nil {
		return
	}
	gc()
	C.kvr_partition_free(p.ptr)
	gc()
	p.ptr = nil
	runtime.SetFinalizer(p, nil)
}

// BlockSize is the partition's block size in tokens (kvr_partition_block_size, read
// when the handle was made).
func (p *Partition) BlockSize() uint32 { return p.blockSize }

// UpsertWorker adds the worker to the partition or replaces its metadata (a copy is
// taken; w stays the caller's).
func (p *Partition) UpsertWorker(w *Worker) error {
	if p.ptr == nil || w == nil || w.ptr == nil {
		return ErrClosed
	}
	gc()
	st := C.kvr_partition_upsert_worker(p.ptr, w.ptr)
	gc()
	runtime.KeepAlive(p)
	runtime.KeepAlive(w)
	return check(st, "kvr_partition_upsert_worker")
}

// UpsertWorkerConfig builds a Worker from cfg, upserts it and closes it.
func (p *Partition) UpsertWorkerConfig(cfg WorkerConfig) error {
	w, err := cfg.Build()
	if err != nil {
		return err
	}
	defer w.Close()
	return p.UpsertWorker(w)
}

// RemoveWorker removes a worker: from the candidates first, then its index entries,
// reported load and bookings. ErrUnknownWorker if it was not a member.
func (p *Partition) RemoveWorker(workerID uint64) error {
	if p.ptr == nil {
		return ErrClosed
	}
	gc()
	st := C.kvr_partition_remove_worker(p.ptr, C.uint64_t(workerID))
	gc()
	runtime.KeepAlive(p)
	return check(st, "kvr_partition_remove_worker")
}

// PublishLoad publishes one batch of load reports atomically (selections see all of it
// or none); later entries for the same rank win. It returns the load view's new
// version. loads is passed to C in place. Only registered workers' own ranks are kept:
// entries for any other rank are skipped (never stored), the rest published, and the
// error is ErrUnknownRank (with the version).
func (p *Partition) PublishLoad(loads []RankLoad) (uint64, error) {
	if p.ptr == nil {
		return 0, ErrClosed
	}
	var lp *C.kvr_rank_load
	if len(loads) > 0 {
		lp = (*C.kvr_rank_load)(unsafe.Pointer(&loads[0]))
	}
	var version C.uint64_t
	gc()
	st := C.kvr_partition_publish_load(p.ptr, lp, C.size_t(len(loads)), &version)
	gc()
	runtime.KeepAlive(p)
	runtime.KeepAlive(loads)
	return uint64(version), check(st, "kvr_partition_publish_load")
}

// eventScratch holds the flattened form of an event batch (see shim.h).
type eventScratch struct {
	descs   []C.kvrgo_event
	blocks  []StoredBlock
	removed []uint64
}

var eventScratchPool = sync.Pool{New: func() interface{} { return new(eventScratch) }}

// ApplyEvents applies a batch of one rank's events in order. A malformed event (unknown
// kind or tier) fails the call with nothing applied (ErrInvalidArgument). An event the
// index refuses (unknown parent, rank limit) is skipped and counted, the rest still
// apply, and the first refusal is returned (ErrParentNotFound, ErrTooManyRanks) along
// with a valid ApplyResult. The rank need not be a registered worker yet. A partition
// whose indexer applies no engine events (WithKVEvents(false), WithRemoteIndexer)
// ignores a well-formed batch: nil error, nothing applied, counted in
// IndexerStats.EventsIgnored.
func (p *Partition) ApplyEvents(workerID uint64, dpRank uint32, events []Event) (ApplyResult, error) {
	var res ApplyResult
	if p.ptr == nil {
		return res, ErrClosed
	}
	s := eventScratchPool.Get().(*eventScratch)
	s.descs = s.descs[:0]
	// One event: its arrays are passed in place. More: they are copied into one flat
	// array each (C receives no Go memory holding Go pointers).
	blocks, removed := s.blocks[:0], s.removed[:0]
	if len(events) == 1 {
		blocks, removed = events[0].Blocks, events[0].Removed
	}
	for i := range events {
		ev := &events[i]
		d := C.kvrgo_event{
			kind:        C.uint32_t(ev.Kind),
			tier:        C.uint32_t(ev.Tier),
			parent:      C.uint64_t(ev.Parent),
			n_blocks:    C.size_t(len(ev.Blocks)),
			n_removed:   C.size_t(len(ev.Removed)),
			blocks_off:  0,
			removed_off: 0,
		}
		if ev.HasParent {
			d.has_parent = 1
		}
		if len(events) > 1 {
			d.blocks_off = C.size_t(len(blocks))
			d.removed_off = C.size_t(len(removed))
			blocks = append(blocks, ev.Blocks...)
			removed = append(removed, ev.Removed...)
		}
		s.descs = append(s.descs, d)
	}
	var dp *C.kvrgo_event
	if len(s.descs) > 0 {
		dp = &s.descs[0]
	}
	var bp *C.kvr_stored_block
	if len(blocks) > 0 {
		bp = (*C.kvr_stored_block)(unsafe.Pointer(&blocks[0]))
	}
	rp, rn := cu64(removed)
	gc()
	st := C.kvrgo_apply_events(p.ptr, C.uint64_t(workerID), C.uint32_t(dpRank),
		dp, C.size_t(len(s.descs)), bp, C.size_t(len(blocks)), rp, rn,
		(*C.kvr_apply_result)(unsafe.Pointer(&res)))
	gc()
	runtime.KeepAlive(p)
	runtime.KeepAlive(events)
	runtime.KeepAlive(blocks)
	runtime.KeepAlive(removed)
	if len(events) > 1 {
		s.blocks, s.removed = blocks[:0], removed[:0]
	}
	eventScratchPool.Put(s)
	return res, check(st, "kvr_partition_apply_events")
}

// FindMatches returns the device overlap per rank of a prompt given as local block
// hashes: the ranks holding at least its first block, sorted by (worker, DP rank), with
// HostBlocks and DiskBlocks 0. The result is written into out's backing array (grown if
// too small: pass the previous result back to reuse it; nil allocates).
func (p *Partition) FindMatches(localHashes []uint64, out []Overlap) ([]Overlap, error) {
	return p.findMatches(localHashes, out, false)
}

// FindMatchesTiered is FindMatches with the tiers: per rank the device prefix, then the
// further blocks in host memory, then on disk.
func (p *Partition) FindMatchesTiered(localHashes []uint64, out []Overlap) ([]Overlap, error) {
	return p.findMatches(localHashes, out, true)
}

func (p *Partition) findMatches(localHashes []uint64, out []Overlap, tiered bool) ([]Overlap, error) {
	if p.ptr == nil {
		return out[:0], ErrClosed
	}
	op := "kvr_partition_find_matches"
	if tiered {
		op = "kvr_partition_find_matches_tiered"
	}
	hp, hn := cu64(localHashes)
	for {
		out = out[:cap(out)]
		var op0 *C.kvr_overlap
		if len(out) > 0 {
			op0 = (*C.kvr_overlap)(unsafe.Pointer(&out[0]))
		}
		var t C.int
		if tiered {
			t = 1
		}
		gc()
		st, n := unpack(C.kvrgo_find_matches(uptr(unsafe.Pointer(p.ptr)), t, hp, hn, op0, C.size_t(len(out))))
		gc()
		runtime.KeepAlive(p)
		runtime.KeepAlive(localHashes)
		runtime.KeepAlive(out)
		switch st {
		case C.KVR_OK:
			return out[:int(n)], nil
		case C.KVR_BUFFER_TOO_SMALL:
			// Room for what was needed plus slack, since events may add ranks meanwhile.
			out = make([]Overlap, 0, int(n)+int(n)/4+4)
		default:
			return out[:0], check(st, op)
		}
	}
}

// HashTokens computes the block hashes of tokens with the partition's block size and
// cache namespace (the hashes its events and lookups expect), salted by lora ("" =
// none). See the package-level HashTokens for the buffers.
func (p *Partition) HashTokens(lora string, tokens []uint32, local, seq []uint64) ([]uint64, []uint64, error) {
	if p.ptr == nil {
		return local[:0], seq[:0], ErrClosed
	}
	if p.blockSize == 0 {
		return local[:0], seq[:0], &Error{Status: StatusInvalidArgument, Op: "kvr_partition_hash_tokens"}
	}
	n := len(tokens) / int(p.blockSize)
	local, seq = grow(local, n), grow(seq, n)
	if overlap(local, seq) {
		return local[:0], seq[:0], &Error{Status: StatusInvalidArgument, Op: "kvr_partition_hash_tokens"}
	}
	lp, ln := cstr(lora)
	tp, tn := cu32(tokens)
	l0, _ := cu64(local)
	s0, _ := cu64(seq)
	gc()
	st, got := unpack(C.kvrgo_hash_tokens(uptr(unsafe.Pointer(p.ptr)), 0, lp, ln, nil, 0, tp, tn, l0, s0, C.size_t(n)))
	gc()
	runtime.KeepAlive(p)
	runtime.KeepAlive(lora)
	runtime.KeepAlive(tokens)
	runtime.KeepAlive(local)
	runtime.KeepAlive(seq)
	if err := check(st, "kvr_partition_hash_tokens"); err != nil {
		return local[:0], seq[:0], err
	}
	return local[:got], seq[:got], nil
}

// overlap reports whether two non-empty slices share memory (kvr's outputs must not:
// the library would write through two aliasing buffers).
func overlap(a, b []uint64) bool {
	if len(a) == 0 || len(b) == 0 {
		return false
	}
	a0, b0 := uintptr(unsafe.Pointer(&a[0])), uintptr(unsafe.Pointer(&b[0]))
	return a0 < b0+uintptr(len(b))*8 && b0 < a0+uintptr(len(a))*8
}

// HashTokens computes Dynamo-compatible block hashes of tokens (REFERENCE.md §1): for
// each complete block of blockSize tokens (a trailing partial block is not hashed) its
// local hash and its chained sequence hash, salted by lora and cacheNamespace ("" =
// none). The results are written into local's and seq's backing arrays, grown if too
// small (pass nil to allocate); overlapping local and seq are ErrInvalidArgument.
func HashTokens(blockSize uint32, lora, cacheNamespace string, tokens []uint32, local, seq []uint64) ([]uint64, []uint64, error) {
	n := 0
	if blockSize > 0 {
		n = len(tokens) / int(blockSize)
	}
	local, seq = grow(local, n), grow(seq, n)
	if overlap(local, seq) {
		return local[:0], seq[:0], &Error{Status: StatusInvalidArgument, Op: "kvr_hash_tokens"}
	}
	lp, ln := cstr(lora)
	np, nn := cstr(cacheNamespace)
	tp, tn := cu32(tokens)
	l0, _ := cu64(local)
	s0, _ := cu64(seq)
	gc()
	st, got := unpack(C.kvrgo_hash_tokens(0, C.uint32_t(blockSize), lp, ln, np, nn, tp, tn, l0, s0, C.size_t(n)))
	gc()
	runtime.KeepAlive(lora)
	runtime.KeepAlive(cacheNamespace)
	runtime.KeepAlive(tokens)
	runtime.KeepAlive(local)
	runtime.KeepAlive(seq)
	if err := check(st, "kvr_hash_tokens"); err != nil {
		return local[:0], seq[:0], err
	}
	return local[:got], seq[:got], nil
}

// Prompt is a request's prompt: token ids (kvr hashes them with the partition's salt
// and the request's LoRA) or precomputed local block hashes. It is borrowed for the
// duration of one selection call only. The zero Prompt is empty.
type Prompt struct {
	tokens       []uint32
	hashes       []uint64
	promptTokens uint64
	kind         C.int
}

// Tokens is a prompt given as token ids.
func Tokens(tokens []uint32) Prompt {
	return Prompt{tokens: tokens, kind: C.KVRGO_PROMPT_TOKENS}
}

// LocalHashes is a prompt given as local block hashes (HashTokens's local output, or
// the host's own Dynamo-compatible hashing) and its length in tokens.
func LocalHashes(hashes []uint64, promptTokens uint64) Prompt {
	return Prompt{hashes: hashes, promptTokens: promptTokens, kind: C.KVRGO_PROMPT_HASHES}
}

// Select is an advisory selection (DESIGN.md §7): the rank kvr would choose for the
// prompt and the load it would add; it books nothing. req carries everything but the
// prompt (LoRA, allow-set, session, overrides); nil means none of that. Busy and
// NoWorker are outcomes (Decision.Outcome) with a nil error.
func (p *Partition) Select(req *Request, prompt Prompt) (Decision, error) {
	return p.selection(req, prompt, 0)
}

// SelectAndReserve is a booked selection: as Select, and the chosen rank is booked
// before it returns. Decision.SelectionID names the booking: call
// Engine.MarkPrefillComplete after the prefill and Engine.FreeBooking when the request
// finishes (a booking nobody frees expires after the partition's booking TTL). With
// transfer hints on (WithKVHints), Decision.Hint is the booking's hint, if it has one.
func (p *Partition) SelectAndReserve(req *Request, prompt Prompt) (Decision, error) {
	return p.selection(req, prompt, 1)
}

func (p *Partition) selection(req *Request, prompt Prompt, reserve C.int) (Decision, error) {
	if p.ptr == nil {
		return Decision{}, ErrClosed
	}
	r := req
	if r == nil {
		var err error
		if r, err = pooledRequest(); err != nil {
			return Decision{}, err
		}
		defer requestPool.Put(r)
	} else if r.ptr == nil {
		return Decision{}, ErrClosed
	}
	tp, tn := cu32(prompt.tokens)
	hp, hn := cu64(prompt.hashes)
	var hint *C.kvr_kv_hint
	if reserve != 0 {
		hint = &r.hint
	}
	gc()
	st := C.kvrgo_select(uptr(unsafe.Pointer(p.ptr)), uptr(unsafe.Pointer(r.ptr)), reserve,
		prompt.kind, tp, tn, hp, hn, C.uint64_t(prompt.promptTokens), &r.out, hint)
	gc()
	runtime.KeepAlive(p)
	runtime.KeepAlive(r)
	runtime.KeepAlive(prompt.tokens)
	runtime.KeepAlive(prompt.hashes)
	switch st {
	case C.KVR_OK:
		d := decisionOf(&r.out)
		if hint != nil && d.Flags&FlagKVHint != 0 {
			// The one allocation of a selection, and only when it carries a hint.
			d.Hint = hintOf(hint)
			d.Hint.BlockHashes = r.hintNames(int(hint.n_block_hashes))
		}
		return d, nil
	case C.KVR_BUSY:
		return Decision{Outcome: Busy}, nil
	case C.KVR_NO_WORKER:
		return Decision{Outcome: NoWorker}, nil
	}
	if reserve != 0 {
		return Decision{}, check(st, "kvr_partition_select_and_reserve")
	}
	return Decision{}, check(st, "kvr_partition_select")
}

// ReserveOptions are the optional inputs of Reserve.
type ReserveOptions struct {
	// PrefillTokens overrides the prefill booked when SetPrefillTokens is true (default:
	// the prompt tokens not cached on the rank; 0 without a prompt).
	PrefillTokens    uint64
	SetPrefillTokens bool
	// SelectionID names the booking (0 = the request's, else minted).
	SelectionID uint64
}

// Reserve books a request on a rank the caller chose (no scoring). With a prompt, its
// blocks join the rank's active blocks; req (may be nil) supplies the selection id, TTL
// and expected output. ErrUnknownRank if the rank is not in the partition. The
// decision's Cost is NaN.
func (p *Partition) Reserve(rank Rank, req *Request, prompt Prompt, opts ReserveOptions) (Decision, error) {
	if p.ptr == nil {
		return Decision{}, ErrClosed
	}
	r := req
	if r == nil {
		var err error
		if r, err = pooledRequest(); err != nil {
			return Decision{}, err
		}
		defer requestPool.Put(r)
	} else if r.ptr == nil {
		return Decision{}, ErrClosed
	}
	var rp C.uintptr_t
	if req != nil || prompt.kind != C.KVRGO_PROMPT_NONE {
		rp = uptr(unsafe.Pointer(r.ptr))
	}
	var hasPrefill C.int
	if opts.SetPrefillTokens {
		hasPrefill = 1
	}
	tp, tn := cu32(prompt.tokens)
	hp, hn := cu64(prompt.hashes)
	gc()
	st := C.kvrgo_reserve(uptr(unsafe.Pointer(p.ptr)), C.uint64_t(rank.WorkerID), C.uint32_t(rank.DPRank), rp,
		prompt.kind, tp, tn, hp, hn, C.uint64_t(prompt.promptTokens),
		hasPrefill, C.uint64_t(opts.PrefillTokens), C.uint64_t(opts.SelectionID), &r.out)
	gc()
	runtime.KeepAlive(p)
	runtime.KeepAlive(r)
	runtime.KeepAlive(prompt.tokens)
	runtime.KeepAlive(prompt.hashes)
	if err := check(st, "kvr_partition_reserve"); err != nil {
		return Decision{}, err
	}
	return decisionOf(&r.out), nil
}

// InstallReplicaBooking installs a replica peer's booking. Lifecycle calls find it by
// scanning the partitions. b.PromptBlocks is passed to C in place.
func (p *Partition) InstallReplicaBooking(b ReplicaBooking) error {
	if p.ptr == nil {
		return ErrClosed
	}
	bp, bn := cu64(b.PromptBlocks)
	gc()
	st := C.kvrgo_install_replica(p.ptr, C.uint64_t(b.SelectionID), C.uint64_t(b.Rank.WorkerID),
		C.uint32_t(b.Rank.DPRank), bp, bn, C.uint64_t(b.PrefillTokens),
		C.uint64_t(b.ExpectedOutputTokens), C.uint64_t(b.TTL/time.Millisecond))
	gc()
	runtime.KeepAlive(p)
	runtime.KeepAlive(b.PromptBlocks)
	return check(st, "kvr_partition_install_replica_booking")
}
