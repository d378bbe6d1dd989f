package kvr

import (
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// The wire of POST {url}/query_tiered_by_hash, Dynamo's standalone indexer query
// (transport/http/src/lib.rs): the local hashes as signed int64, then the partition.
type remoteQuery struct {
	BlockHashes  []int64 `json:"block_hashes"`
	ModelName    string  `json:"model_name"`
	RoutingGroup string  `json:"routing_group"`
}

type remoteRank struct {
	WorkerID uint64 `json:"worker_id"`
	DPRank   uint32 `json:"dp_rank"`
}

// remoteCount is one [rank, blocks] pair of a tier.
type remoteCount struct {
	Rank   remoteRank
	Blocks uint32
}

func (c remoteCount) MarshalJSON() ([]byte, error) {
	return json.Marshal([]any{c.Rank, c.Blocks})
}

// tieredAnswer is Dynamo's answer: device scores, then host_pinned hits extending them.
func tieredAnswer(blockSize uint32, device, host []remoteCount) map[string]any {
	return map[string]any{
		"block_size": blockSize,
		"tiered": map[string]any{
			"device":     map[string]any{"scores": device, "frequencies": []uint32{}},
			"lower_tier": []any{[]any{"host_pinned", map[string]any{"hits": host}}},
		},
	}
}

// fakeRemoteIndex serves the remote index protocol under base path /kv: each query is
// decoded (a malformed one fails the test) and handed to answer. It returns the base URL
// to configure (http://127.0.0.1:port/kv).
func fakeRemoteIndex(t *testing.T, answer func(w http.ResponseWriter, r *http.Request, q remoteQuery)) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("/kv/query_tiered_by_hash", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			t.Errorf("remote index: method %s", r.Method)
		}
		if ct := r.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
			t.Errorf("remote index: content type %q", ct)
		}
		var q remoteQuery
		dec := json.NewDecoder(r.Body)
		dec.DisallowUnknownFields()
		if err := dec.Decode(&q); err != nil {
			t.Errorf("remote index: request body: %v", err)
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		answer(w, r, q)
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		t.Errorf("remote index: unexpected %s %s", r.Method, r.URL.Path)
		http.NotFound(w, r)
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL + "/kv"
}

func indexerStats(t *testing.T, p *Partition) IndexerStats {
	t.Helper()
	s, err := p.IndexerStats()
	must(t, err)
	return s
}

func TestInvalidConfig(t *testing.T) {
	e := newEngine(t)
	// A remote primary with KV events off: nothing would ever fill the remote index.
	for _, opts := range [][]PartitionOption{
		{WithRemoteIndexer("http://127.0.0.1:9", 0, 0), WithKVEvents(false)},
		{WithKVEvents(false), WithRemoteIndexer("http://127.0.0.1:9", 0, 0)},
	} {
		p, err := e.CreatePartition("m", "remote-off", testBlock, opts...)
		if p != nil || !errors.Is(err, ErrInvalidConfig) {
			t.Fatalf("CreatePartition(remote, events off) = %v, %v; want ErrInvalidConfig", p, err)
		}
		var ke *Error
		if !errors.As(err, &ke) || ke.Op != "kvr_engine_create_partition" || !strings.Contains(ke.Reason, "no write API") {
			t.Fatalf("error %#v: want the op and the reason", err)
		}
		if msg := err.Error(); !strings.Contains(msg, "invalid partition configuration") || !strings.Contains(msg, "KV events off") {
			t.Fatalf("Error() = %q", msg)
		}
		// Nothing was created.
		if _, err := e.Partition("m", "remote-off"); !errors.Is(err, ErrUnknownPartition) {
			t.Fatalf("Partition after refusal: %v", err)
		}
		notices, err := CheckPartitionOptions(testBlock, opts...)
		if notices != "" || !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.(*Error).Reason, "no write API") {
			t.Fatalf("CheckPartitionOptions = %q, %v", notices, err)
		}
		if err.(*Error).Op != "kvr_partition_options_check" {
			t.Fatalf("op %q", err.(*Error).Op)
		}
	}
	if !errors.Is(&Error{Status: StatusInvalidConfig, Op: "x", Reason: "y"}, ErrInvalidConfig) || errors.Is(ErrInvalidConfig, ErrInvalidArgument) {
		t.Fatal("ErrInvalidConfig sentinel mismatch")
	}

	// URLs kvr cannot use, whatever the events; a reason longer than the first buffer
	// (256 bytes) comes back whole.
	long := "ftp://" + strings.Repeat("h", 400) + ":1"
	for url, why := range map[string]string{
		"https://127.0.0.1:9": "https",
		"127.0.0.1:9":         "",
		" ":                   "empty",
		long:                  long,
	} {
		_, err := e.CreatePartition("m", "bad-url", testBlock, WithRemoteIndexer(url, 0, 0))
		if !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.(*Error).Reason, why) || err.(*Error).Reason == "" {
			t.Fatalf("remote URL %q: %v (want a reason with %q)", url, err, why)
		}
		if _, err := CheckPartitionOptions(testBlock, WithRemoteIndexer(url, 0, 0)); !errors.Is(err, ErrInvalidConfig) {
			t.Fatalf("CheckPartitionOptions(remote URL %q): %v", url, err)
		}
	}

	// Refusals of the option setters themselves are invalid arguments.
	for name, opt := range map[string]PartitionOption{
		"approx ttl 0":            WithApproxIndex(0, 10),
		"approx max blocks 0":     WithApproxIndex(time.Second, 0),
		"approx negative ttl":     WithApproxIndex(-time.Second, 10),
		"unknown retention":       WithApproxRetention(Retention(7)),
		"negative prediction ttl": WithPredictionTTL(-time.Millisecond),
		"negative timeout":        WithRemoteIndexer("http://127.0.0.1:9", -time.Second, 0),
	} {
		if _, err := e.CreatePartition("m", "bad-arg", testBlock, opt); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: CreatePartition: %v, want ErrInvalidArgument", name, err)
		}
		if _, err := CheckPartitionOptions(testBlock, opt); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: CheckPartitionOptions: %v, want ErrInvalidArgument", name, err)
		}
	}
	if _, err := CheckPartitionOptions(0); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("CheckPartitionOptions(block size 0): %v", err)
	}
}

func TestCheckPartitionOptionsNotices(t *testing.T) {
	if n, err := CheckPartitionOptions(testBlock); n != "" || err != nil {
		t.Fatalf("defaults: %q, %v", n, err)
	}
	capacity := []PartitionOption{WithKVEvents(false), WithApproxRetention(RetentionCapacityBounded)}
	n, err := CheckPartitionOptions(testBlock, capacity...)
	if err != nil || !strings.Contains(n, "capacity-bounded") {
		t.Fatalf("capacity-bounded retention: %q, %v", n, err)
	}
	n, err = CheckPartitionOptions(testBlock, WithKVEvents(false), WithPredictionTTL(time.Second))
	if err != nil || !strings.Contains(n, "prediction TTL is ignored") {
		t.Fatalf("prediction TTL with events off: %q, %v", n, err)
	}
	n, err = CheckPartitionOptions(testBlock, append(capacity, WithPredictionTTL(time.Second))...)
	if err != nil || !strings.Contains(n, "capacity-bounded") || !strings.Contains(n, "prediction TTL is ignored") {
		t.Fatalf("two notices: %q, %v", n, err)
	}
	n, err = CheckPartitionOptions(testBlock, WithRemoteIndexer("http://127.0.0.1:9/kv", 0, 0), WithPredictionTTL(time.Second))
	if err != nil || !strings.Contains(n, "remote primary") {
		t.Fatalf("prediction TTL with a remote primary: %q, %v", n, err)
	}

	// The partition takes the options and runs as a TTL one.
	e := newEngine(t)
	p := testPartition(t, e, "capacity", 2, capacity...)
	if s := indexerStats(t, p); s.Policy != IndexerApproximatePrimary {
		t.Fatalf("policy %v", s.Policy)
	}
}

func TestIndexerPolicies(t *testing.T) {
	e := newEngine(t)
	for _, c := range []struct {
		name string
		opts []PartitionOption
		want IndexerPolicy
	}{
		{"default", nil, IndexerEventDriven},
		{"events on", []PartitionOption{WithKVEvents(true)}, IndexerEventDriven},
		{"prediction", []PartitionOption{WithPredictionTTL(2 * time.Second)}, IndexerEventDrivenWithPrediction},
		// A positive TTL under a millisecond is 1 ms, not 0 (= no side index).
		{"prediction 1 µs", []PartitionOption{WithPredictionTTL(time.Microsecond)}, IndexerEventDrivenWithPrediction},
		{"prediction 0", []PartitionOption{WithPredictionTTL(0)}, IndexerEventDriven},
		{"events off", []PartitionOption{WithKVEvents(false)}, IndexerApproximatePrimary},
		{"events off + prediction", []PartitionOption{WithKVEvents(false), WithPredictionTTL(time.Second)}, IndexerApproximatePrimary},
		{"remote", []PartitionOption{WithRemoteIndexer("http://127.0.0.1:9", 0, 0)}, IndexerRemotePrimary},
		{"remote dropped", []PartitionOption{WithRemoteIndexer("http://127.0.0.1:9", 0, 0), WithRemoteIndexer("", 0, 0)}, IndexerEventDriven},
	} {
		p := testPartition(t, e, c.name, 1, c.opts...)
		s := indexerStats(t, p)
		if s.Policy != c.want {
			t.Errorf("%s: policy %v, want %v", c.name, s.Policy, c.want)
		}
		if s.Policy.String() == "" || strings.HasPrefix(s.Policy.String(), "IndexerPolicy(") {
			t.Errorf("%s: policy name %q", c.name, s.Policy)
		}
	}
	if IndexerPolicy(9).String() != "IndexerPolicy(9)" {
		t.Errorf("unknown policy name %q", IndexerPolicy(9))
	}
	p := testPartition(t, e, "closed", 0)
	p.Close()
	if _, err := p.IndexerStats(); err != ErrClosed {
		t.Fatalf("IndexerStats on a closed partition: %v", err)
	}
}

// Events off: the index holds what bookings recorded.
func TestApproximatePrimary(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "approx", 4, WithKVEvents(false))
	tokens := promptTokens(8*testBlock, 41)

	// Advisory selection records nothing.
	for i := 0; i < 3; i++ {
		d, err := p.Select(nil, Tokens(tokens))
		if err != nil || d.Outcome != Selected || d.DeviceBlocks != 0 {
			t.Fatalf("advisory Select %d = %+v, %v", i, d, err)
		}
	}
	if s := indexerStats(t, p); s.BookingsRecorded != 0 || s.ApproxBlocksRecorded != 0 {
		t.Fatalf("advisory selections recorded: %+v", s)
	}

	// A booking records its prompt on its rank, after the booking.
	first, err := p.SelectAndReserve(nil, Tokens(tokens))
	must(t, err)
	if first.Outcome != Selected || first.DeviceBlocks != 0 {
		t.Fatalf("first booking %+v", first)
	}
	s := indexerStats(t, p)
	if s.Policy != IndexerApproximatePrimary || s.BookingsRecorded != 1 || s.ApproxBlocksRecorded != 8 || s.RecordFailures != 0 ||
		s.ApproxRecords != 1 || s.ApproxRecordErrors != 0 || s.ApproxBlocksOverBound != 0 {
		t.Fatalf("after one booking: %+v", s)
	}
	_, err = e.FreeBooking(first.SelectionID)
	must(t, err)
	// The next identical prompt goes where the first was booked, and sees its blocks.
	d, err := p.Select(nil, Tokens(tokens))
	must(t, err)
	if d.Rank != first.Rank || d.DeviceBlocks != 8 || d.CachedTokens != 8*testBlock {
		t.Fatalf("advisory Select after the booking = %+v, want rank %+v with 8 blocks", d, first.Rank)
	}
	second, err := p.SelectAndReserve(nil, Tokens(tokens))
	must(t, err)
	if second.Rank != first.Rank || second.DeviceBlocks != 8 {
		t.Fatalf("second booking %+v, want rank %+v with 8 blocks", second, first.Rank)
	}
	if s := indexerStats(t, p); s.BookingsRecorded != 2 || s.ApproxBlocksRefreshed == 0 {
		t.Fatalf("after the second booking: %+v", s)
	}
	_, err = e.FreeBooking(second.SelectionID)
	must(t, err)

	// An explicit reservation with a prompt records it too.
	other := promptTokens(8*testBlock, 42)
	rank := Rank{WorkerID: 1}
	if rank == first.Rank {
		rank.WorkerID = 2
	}
	r, err := p.Reserve(rank, nil, Tokens(other), ReserveOptions{})
	must(t, err)
	_, err = e.FreeBooking(r.SelectionID)
	must(t, err)
	if d, err := p.Select(nil, Tokens(other)); err != nil || d.Rank != rank || d.DeviceBlocks != 8 {
		t.Fatalf("Select after Reserve = %+v, %v; want %+v", d, err, rank)
	}
	if s := indexerStats(t, p); s.BookingsRecorded != 3 {
		t.Fatalf("after Reserve: %+v", s)
	}

	// Engine events are ignored, counted.
	local, seq, err := p.HashTokens("", other, nil, nil)
	must(t, err)
	res, err := p.ApplyEvents(3, 0, []Event{StoredEvent(TierDevice, StoredBlocks(seq, local))})
	if err != nil || res != (ApplyResult{}) {
		t.Fatalf("ApplyEvents on an events-off partition = %+v, %v", res, err)
	}
	ing, err := p.Ingest(3, 0, nil, 0, msgpackStored(1, make([]uint32, testBlock), testBlock, 0))
	if err != nil || ing.BatchesApplied != 0 {
		t.Fatalf("Ingest on an events-off partition = %+v, %v", ing, err)
	}
	if s := indexerStats(t, p); s.EventsIgnored != 2 {
		t.Fatalf("EventsIgnored %d, want 2 (%+v)", s.EventsIgnored, s)
	}
	if m, err := p.FindMatches(local, nil); err != nil || len(m) != 1 || m[0].WorkerID != rank.WorkerID {
		t.Fatalf("FindMatches = %+v, %v: want only the reservation's record", m, err)
	}
}

func TestApproximateTTL(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "approx-ttl", 2, WithKVEvents(false), WithApproxIndex(200*time.Millisecond, 1<<20))
	a, b := promptTokens(4*testBlock, 43), promptTokens(4*testBlock, 44)
	d, err := p.SelectAndReserve(nil, Tokens(a))
	must(t, err)
	_, err = e.FreeBooking(d.SelectionID)
	must(t, err)
	if d2, err := p.Select(nil, Tokens(a)); err != nil || d2.DeviceBlocks != 4 {
		t.Fatalf("within the TTL: %+v, %v", d2, err)
	}
	time.Sleep(400 * time.Millisecond)
	// Expiry is lazy: the next booking's recording expires the first record.
	d, err = p.SelectAndReserve(nil, Tokens(b))
	must(t, err)
	_, err = e.FreeBooking(d.SelectionID)
	must(t, err)
	if d2, err := p.Select(nil, Tokens(a)); err != nil || d2.DeviceBlocks != 0 {
		t.Fatalf("after the TTL: %+v, %v", d2, err)
	}
	if s := indexerStats(t, p); s.ApproxBlocksExpired != 4 {
		t.Fatalf("after the TTL: %+v", s)
	}
}

// Events on with a prediction TTL: bookings feed a side index, events the primary; a
// query takes the per-rank maximum.
func TestPredictionIndex(t *testing.T) {
	e := newEngine(t)
	p := testPartition(t, e, "prediction", 4, WithPredictionTTL(time.Minute))
	tokens := promptTokens(8*testBlock, 45)
	d, err := p.SelectAndReserve(nil, Tokens(tokens))
	must(t, err)
	_, err = e.FreeBooking(d.SelectionID)
	must(t, err)
	s := indexerStats(t, p)
	if s.Policy != IndexerEventDrivenWithPrediction || s.BookingsRecorded != 1 || s.ApproxBlocksRecorded != 8 {
		t.Fatalf("after a booking: %+v", s)
	}
	if is, err := p.IndexStats(); err != nil || is.HolderBlocks != 0 {
		t.Fatalf("the primary took the booking: %+v, %v", is, err)
	}
	if got, err := p.Select(nil, Tokens(tokens)); err != nil || got.Rank != d.Rank || got.DeviceBlocks != 8 {
		t.Fatalf("predicted Select = %+v, %v; want %+v with 8 blocks", got, err, d.Rank)
	}
	// An event for half the prompt on another rank: that rank gets its own 4 blocks.
	other := d.WorkerID%4 + 1
	storePrefix(t, p, other, tokens, 4)
	req, err := NewRequest()
	must(t, err)
	defer req.Close()
	must(t, req.SetAllowedWorkers([]uint64{other}))
	if got, err := p.Select(req, Tokens(tokens)); err != nil || got.WorkerID != other || got.DeviceBlocks != 4 {
		t.Fatalf("Select on the evented rank = %+v, %v", got, err)
	}
	if got, err := p.Select(nil, Tokens(tokens)); err != nil || got.Rank != d.Rank || got.DeviceBlocks != 8 {
		t.Fatalf("Select = %+v, %v; want the predicted 8 blocks", got, err)
	}
}

// A remote primary: each selection asks the remote index service for the overlap.
func TestRemotePrimary(t *testing.T) {
	e := newEngine(t)
	tokens := promptTokens(8*testBlock, 46)
	local, _, err := HashTokens(testBlock, "", "", tokens, nil, nil)
	must(t, err)
	var mu sync.Mutex
	var queries []remoteQuery
	url := fakeRemoteIndex(t, func(w http.ResponseWriter, _ *http.Request, q remoteQuery) {
		mu.Lock()
		queries = append(queries, q)
		mu.Unlock()
		// Worker 3 holds the prompt's first 6 blocks: 4 on its device, 2 in host memory;
		// a rank that is no worker of the partition (its id above 2^53) holds 1.
		n := 0
		for n < len(q.BlockHashes) && n < 6 && q.BlockHashes[n] == int64(local[n]) {
			n++
		}
		device, host := []remoteCount{}, []remoteCount{}
		if n > 0 {
			dev := uint32(n)
			if dev > 4 {
				dev = 4
			}
			device = append(device,
				remoteCount{remoteRank{WorkerID: 1<<64 - 2, DPRank: 3}, 1},
				remoteCount{remoteRank{WorkerID: 3}, dev})
			if uint32(n) > dev {
				host = append(host, remoteCount{remoteRank{WorkerID: 3}, uint32(n) - dev})
			}
		}
		ans := tieredAnswer(testBlock, device, host)
		w.Header().Set("Content-Type", "application/json")
		if err := json.NewEncoder(w).Encode(ans); err != nil {
			t.Errorf("remote index: %v", err)
		}
	})
	p := testPartition(t, e, "remote", 4, WithRemoteIndexer(url, 2*time.Second, 10*time.Second))
	if s := indexerStats(t, p); s.Policy != IndexerRemotePrimary {
		t.Fatalf("policy %v", s.Policy)
	}
	for i, sel := range []func(*Request, Prompt) (Decision, error){p.Select, p.SelectAndReserve} {
		d, err := sel(nil, Tokens(tokens))
		must(t, err)
		if d.Outcome != Selected || d.WorkerID != 3 || d.DeviceBlocks != 4 || d.HostBlocks != 2 || d.CachedTokens != 4*testBlock {
			t.Fatalf("selection %d = %+v, want worker 3 with 4 + 2 blocks", i, d)
		}
		if d.SelectionID != 0 {
			_, err = e.FreeBooking(d.SelectionID)
			must(t, err)
		}
	}
	s := indexerStats(t, p)
	if s.RemoteQueries != 2 || s.RemoteFailures != 0 || s.BookingsRecorded != 0 {
		t.Fatalf("after two selections: %+v", s)
	}
	mu.Lock()
	q := queries[0]
	mu.Unlock()
	if q.ModelName != "m" || q.RoutingGroup != "remote" || len(q.BlockHashes) != len(local) {
		t.Fatalf("query %+v", q)
	}
	negative := 0
	for i := range local {
		if q.BlockHashes[i] != int64(local[i]) {
			t.Fatalf("query hash %d = %d, want the local hash %d as int64", i, q.BlockHashes[i], local[i])
		}
		if q.BlockHashes[i] < 0 {
			negative++
		}
	}
	if negative == 0 {
		t.Fatalf("no local hash above 2^63: the signed wire form is not exercised")
	}
	// A prompt the remote knows nothing of: chosen on load alone.
	if d, err := p.Select(nil, Tokens(promptTokens(8*testBlock, 47))); err != nil || d.Outcome != Selected || d.DeviceBlocks != 0 {
		t.Fatalf("unknown prompt = %+v, %v", d, err)
	}
	// A prompt without a complete block makes no query.
	if _, err := p.Select(nil, Tokens(tokens[:testBlock-1])); err != nil {
		t.Fatal(err)
	}
	if s := indexerStats(t, p); s.RemoteQueries != 3 || s.RemoteFailures != 0 {
		t.Fatalf("after the unknown and the short prompt: %+v", s)
	}
	// Events are not applied to a remote primary.
	res, err := p.ApplyEvents(1, 0, []Event{StoredEvent(TierDevice, StoredBlocks(local, local))})
	if err != nil || res.EventsApplied != 0 {
		t.Fatalf("ApplyEvents = %+v, %v", res, err)
	}
	if s := indexerStats(t, p); s.EventsIgnored != 1 {
		t.Fatalf("EventsIgnored: %+v", s)
	}
}

// A remote that is down, hangs or answers garbage: the selection still succeeds, without
// overlap, and the failure is counted.
func TestRemotePrimaryFailures(t *testing.T) {
	e := newEngine(t)
	tokens := promptTokens(8*testBlock, 48)
	release := make(chan struct{})
	write := func(status int, body string) func(http.ResponseWriter, *http.Request, remoteQuery) {
		return func(w http.ResponseWriter, _ *http.Request, _ remoteQuery) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			_, _ = w.Write([]byte(body))
		}
	}
	// A port nothing listens on: closed once every server of the test is up, so none of
	// them can take it over (the cases run afterwards, binding nothing).
	down, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	cases := []struct {
		name string
		url  string
	}{
		{"refused", "http://" + down.Addr().String()},
		{"hangs", fakeRemoteIndex(t, func(_ http.ResponseWriter, r *http.Request, _ remoteQuery) {
			select {
			case <-release:
			case <-r.Context().Done():
			}
		})},
		{"not json", fakeRemoteIndex(t, write(http.StatusOK, "this is not json"))},
		{"wrong shape", fakeRemoteIndex(t, write(http.StatusOK, `{"ranks":[]}`))},
		{"overcount", fakeRemoteIndex(t, write(http.StatusOK, `{"block_size":16,"tiered":{"device":{"scores":[[{"worker_id":1,"dp_rank":0},99]],"frequencies":[]}}}`))},
		{"rank twice", fakeRemoteIndex(t, write(http.StatusOK,
			`{"block_size":16,"tiered":{"device":{"scores":[[{"worker_id":1,"dp_rank":0},2],[{"worker_id":1,"dp_rank":0},3]],"frequencies":[]}}}`))},
		{"other block size", fakeRemoteIndex(t, write(http.StatusOK, `{"block_size":32,"tiered":{"device":{"scores":[[{"worker_id":1,"dp_rank":0},2]],"frequencies":[]}}}`))},
		{"status 500", fakeRemoteIndex(t, write(http.StatusInternalServerError, `{"error":"boom"}`))},
		{"unknown partition", fakeRemoteIndex(t, write(http.StatusNotFound, `{"error":"no indexer"}`))},
	}
	must(t, down.Close())
	// Runs before the servers' Close (cleanups run last-in first-out): a hanging handler
	// must return for Close to.
	t.Cleanup(func() { close(release) })
	const timeout = 100 * time.Millisecond
	for _, c := range cases {
		p := testPartition(t, e, c.name, 3, WithRemoteIndexer(c.url, timeout, timeout))
		start := time.Now()
		d, err := p.Select(nil, Tokens(tokens))
		if err != nil || d.Outcome != Selected || d.DeviceBlocks != 0 || d.HostBlocks != 0 {
			t.Fatalf("%s: Select = %+v, %v; want a selection without overlap", c.name, d, err)
		}
		if took := time.Since(start); took > 5*time.Second {
			t.Fatalf("%s: Select took %v with a %v request timeout", c.name, took, timeout)
		}
		b, err := p.SelectAndReserve(nil, Tokens(tokens))
		if err != nil || b.Outcome != Selected || b.SelectionID == 0 {
			t.Fatalf("%s: SelectAndReserve = %+v, %v", c.name, b, err)
		}
		_, err = e.FreeBooking(b.SelectionID)
		must(t, err)
		s := indexerStats(t, p)
		if s.RemoteQueries != 2 || s.RemoteFailures != 2 {
			t.Fatalf("%s: %+v, want 2 queries, 2 failures", c.name, s)
		}
	}
}
