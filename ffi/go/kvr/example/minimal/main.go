// Route a prompt with kvr from Go: one worker, one cached prefix, one booking.
package main

import (
	"fmt"
	"log"

	"kvr/ffi/go/kvr"
)

func main() {
	engine, err := kvr.New()
	if err != nil {
		log.Fatal(err)
	}
	defer engine.Close()
	part, err := engine.CreatePartition("llama-3-8b", "default", 16) // 16 tokens per block
	if err != nil {
		log.Fatal(err)
	}
	defer part.Close()
	if err := part.UpsertWorkerConfig(kvr.WorkerConfig{ID: 7, DPSize: 1}); err != nil {
		log.Fatal(err)
	}
	tokens := make([]uint32, 40) // 2 complete blocks and a partial one
	for i := range tokens {
		tokens[i] = uint32(100 + i)
	}
	local, _, err := part.HashTokens("", tokens, make([]uint64, 2), nil)
	if err != nil {
		log.Fatal(err)
	}
	// The engine reports it stored both blocks (its own block ids 0xA1, 0xA2).
	stored := kvr.StoredEvent(kvr.TierDevice, kvr.StoredBlocks([]uint64{0xA1, 0xA2}, local))
	if _, err := part.ApplyEvents(7, 0, []kvr.Event{stored}); err != nil {
		log.Fatal(err)
	}
	d, err := part.SelectAndReserve(nil, kvr.Tokens(tokens))
	if err != nil || d.Outcome != kvr.Selected {
		log.Fatal(err, d.Outcome)
	}
	fmt.Printf("worker %d rank %d: %d tokens cached, %d to prefill\n",
		d.WorkerID, d.DPRank, d.CachedTokens, d.ProjectedPrefillTokens)
	if _, err := engine.FreeBooking(d.SelectionID); err != nil { // the request finished
		log.Fatal(err)
	}
}
