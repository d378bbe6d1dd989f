// README example: one engine, one partition, one worker; book a selection, free it.
#include <cinttypes>
#include <cstdio>
#include <vector>

#include "kvr.hpp"

int main() try {
    kvr::Engine engine;
    kvr::Partition part = engine.create_partition("llama-3-8b", "default", kvr::PartitionOptions(16));
    part.upsert_worker(kvr::Worker(/*worker_id=*/1, /*dp_size=*/1).set_total_kv_blocks(4096));

    std::vector<uint32_t> tokens(100, 42);  // the prompt's token ids
    kvr::Request req;
    req.set_tokens(tokens);  // borrowed: keep `tokens` alive while `req` uses it

    kvr::Selection sel = part.select_and_reserve(req);
    if (sel.outcome != kvr::Outcome::Selected) {  // Busy or NoWorker: outcomes, not errors
        std::printf("no rank now: %s\n", kvr::status_str(sel.status()));
        return 1;
    }
    std::printf("worker %" PRIu64 " rank %u, %" PRIu64 " cached tokens, selection %" PRIu64 "\n",
                sel->worker_id, sel->dp_rank, sel->cached_tokens, sel->selection_id);

    engine.mark_prefill_complete(sel->selection_id);  // prefill done
    engine.free_booking(sel->selection_id);           // request finished
    return 0;
} catch (const kvr::Error &e) {  // every other status throws
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
}
