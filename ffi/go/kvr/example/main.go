// Command example is a tiny "gateway scorer": the shape of an llm-d endpoint picker
// (Gateway API inference extension EPP) plugin built on kvr.
//
// It registers candidate endpoints (model-server pods) as workers, feeds the KV events
// the pods would publish, and then, for each incoming prompt: scores every endpoint by
// its cached prefix (what an EPP prefix scorer reports), picks and books one with
// SelectAndReserve, "serves" the request, marks its prefill complete when the first
// token is out, and frees the booking on completion.
package main

import (
	"fmt"
	"hash/fnv"
	"log"
	"sort"
	"strings"

	"kvr/ffi/go/kvr"
)

const blockSize = 16

type endpoint struct {
	id       uint64
	addr     string
	draining bool
}

var endpoints = []endpoint{
	{1, "10.0.0.11:8000", false},
	{2, "10.0.0.12:8000", false},
	{3, "10.0.0.13:8000", false},
	{4, "10.0.0.14:8000", true}, // being drained: never picked
}

func addrOf(id uint64) string {
	for _, e := range endpoints {
		if e.id == id {
			return e.addr
		}
	}
	return "?"
}

// tokenize is a stand-in tokenizer: one token per word.
func tokenize(text string) []uint32 {
	words := strings.Fields(text)
	out := make([]uint32, len(words))
	for i, w := range words {
		h := fnv.New32a()
		h.Write([]byte(w))
		out[i] = h.Sum32() % 128000
	}
	return out
}

const systemPrompt = `You are a helpful assistant for the ACME support desk. Answer briefly and
politely, cite the knowledge base article when you use one, never reveal internal ticket
numbers, escalate billing disputes to a human agent, and always answer in the language of
the customer. Today the status page reports no incidents. The knowledge base contains
articles on passwords, invoices, shipping, returns, warranties and accounts. `

func main() {
	log.SetFlags(0)
	engine, err := kvr.New(kvr.WithSeed(1))
	if err != nil {
		log.Fatal(err)
	}
	defer engine.Close()
	pool, err := engine.CreatePartition("meta-llama/Llama-3.1-8B-Instruct", "default", blockSize)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	// 1. Register the candidate endpoints.
	for _, e := range endpoints {
		err := pool.UpsertWorkerConfig(kvr.WorkerConfig{ID: e.id, TotalKVBlocks: 20000,
			MaxBatchedTokens: 8192, Labels: map[string]string{"addr": e.addr}})
		if err != nil {
			log.Fatal(err)
		}
	}
	// Draining endpoints are filtered out through the availability hook.
	if err := pool.SetHooks(&kvr.Hooks{Available: func(r kvr.Rank) bool {
		for _, e := range endpoints {
			if e.id == r.WorkerID {
				return !e.draining
			}
		}
		return false
	}}); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("registered %d endpoints (block size %d)\n", len(endpoints), pool.BlockSize())

	// 2. KV events: endpoint 2 served a request with the same system prompt earlier, and
	// endpoint 4 (draining) holds it too. Engines name blocks by their own hashes; kvr
	// keeps them opaque and indexes its own local hashes of the tokens.
	sys := tokenize(systemPrompt)
	local, seq, err := pool.HashTokens("", sys, nil, nil)
	if err != nil {
		log.Fatal(err)
	}
	engineHashes := make([]uint64, len(seq))
	for i, s := range seq {
		engineHashes[i] = s ^ 0x5eed // any engine-side id will do
	}
	for _, id := range []uint64{2, 4} {
		res, err := pool.ApplyEvents(id, 0, []kvr.Event{
			kvr.StoredEvent(kvr.TierDevice, kvr.StoredBlocks(engineHashes, local)),
		})
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("KV event from %s: %d blocks stored\n", addrOf(id), res.BlocksStored)
	}
	// Endpoint 1 reports a busier queue.
	if _, err := pool.PublishLoad([]kvr.RankLoad{
		{WorkerID: 1, WaitingRequests: 4, RunningRequests: 12, KVBlocksUsed: 9000, KVBlocksTotal: 20000},
		{WorkerID: 2, RunningRequests: 3, KVBlocksUsed: 2000, KVBlocksTotal: 20000},
		{WorkerID: 3, RunningRequests: 2, KVBlocksUsed: 1500, KVBlocksTotal: 20000},
	}); err != nil {
		log.Fatal(err)
	}

	// 3. Requests arrive; each is scored, picked and booked. They are all in flight at
	// once, so each booking weighs on the next pick.
	var matches []kvr.Overlap
	var qLocal []uint64
	var inFlight []kvr.Decision
	for i, question := range []string{
		"How do I reset my password?",
		"Where is my invoice for March?",
		"Write a haiku about routers.",
	} {
		prompt := sys
		if i == 2 {
			prompt = nil // no system prompt: nothing cached anywhere
		}
		prompt = append(append([]uint32(nil), prompt...), tokenize(strings.Repeat(question+" ", 8))...)
		fmt.Printf("\nrequest %d: %d tokens\n", i+1, len(prompt))

		// Score: the fraction of the prompt's blocks each endpoint holds (a prefix scorer).
		qLocal, _, err = pool.HashTokens("", prompt, qLocal, nil)
		if err != nil {
			log.Fatal(err)
		}
		matches, err = pool.FindMatches(qLocal, matches)
		if err != nil {
			log.Fatal(err)
		}
		sort.Slice(matches, func(a, b int) bool { return matches[a].WorkerID < matches[b].WorkerID })
		for _, m := range matches {
			fmt.Printf("  prefix score %-15s %.2f (%d/%d blocks)\n", addrOf(m.WorkerID),
				float64(m.DeviceBlocks)/float64(len(qLocal)), m.DeviceBlocks, len(qLocal))
		}

		// Pick and book (a nil *Request: no LoRA, allow-set or session for this one).
		d, err := pool.SelectAndReserve(nil, kvr.Tokens(prompt))
		if err != nil {
			log.Fatal(err)
		}
		switch d.Outcome {
		case kvr.Busy:
			fmt.Println("  every endpoint is busy: queue the request and retry")
			continue
		case kvr.NoWorker:
			fmt.Println("  no endpoint can serve it: answer 503")
			continue
		}
		fmt.Printf("  -> route to %s (booking %d): %d cached tokens, %d to prefill, cost %.1f\n",
			addrOf(d.WorkerID), d.SelectionID, d.CachedTokens, d.ProjectedPrefillTokens, d.Cost)
		inFlight = append(inFlight, d)
	}

	// 4. Serve them: the first token means the prefill is done; output grows the decode
	// load; completion frees the booking.
	show := func(d kvr.Decision, when string) {
		al, err := pool.ActiveLoad(d.Rank)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("  %-15s %-24s active prefill %4d tokens, decode %3d blocks, %d requests\n",
			addrOf(d.WorkerID), when, al.ActivePrefillTokens, al.ActiveDecodeBlocks, al.ActiveRequests)
	}
	fmt.Println()
	for _, d := range inFlight {
		fmt.Printf("booking %d:\n", d.SelectionID)
		show(d, "booked:")
		if err := engine.MarkPrefillComplete(d.SelectionID); err != nil {
			log.Fatal(err)
		}
		show(d, "first token:")
		if err := engine.AddOutputBlocks(d.SelectionID, 200/blockSize); err != nil {
			log.Fatal(err)
		}
		show(d, "200 tokens out:")
		how, err := engine.FreeBooking(d.SelectionID)
		if err != nil {
			log.Fatal(err)
		}
		show(d, "completed ("+how.String()+"):")
	}

	ss, err := pool.SelectionStats()
	if err != nil {
		log.Fatal(err)
	}
	bs, err := pool.BookingStats()
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("\n%d selections, %d busy, %d no-worker; %d live bookings\n",
		ss.Selections, ss.Busy, ss.NoWorker, bs.Bookings)
}
