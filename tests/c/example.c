/* Route a prompt with kvr from C: one worker, one cached prefix, one booking. */
#include <inttypes.h>
#include <stdio.h>
#include "kvr.h"

#define TRY(call) do { kvr_status s_ = (call); if (s_ != KVR_OK) { \
    fprintf(stderr, "%s: %s\n", #call, kvr_status_str(s_)); return 1; } } while (0)

int main(void) {
    KVR_ABI_CHECK(); /* fails to link against a library of another ABI generation */
    kvr_engine *engine; kvr_partition_options *opts; kvr_partition *part;
    kvr_worker *worker; kvr_request *req;
    TRY(kvr_engine_new(NULL, &engine));
    TRY(kvr_partition_options_new(16, &opts)); /* 16 tokens per KV block */
    TRY(kvr_engine_create_partition(engine, "llama-3-8b", 10, "default", 7, opts, &part));
    kvr_partition_options_free(opts);
    TRY(kvr_worker_new(7, 1, &worker)); /* worker 7, one data-parallel rank */
    TRY(kvr_partition_upsert_worker(part, worker));
    kvr_worker_free(worker);

    uint32_t tokens[40]; /* 2 complete blocks and a partial one */
    for (uint32_t i = 0; i < 40; i++) tokens[i] = 100 + i;
    uint64_t local[2]; size_t n;
    TRY(kvr_partition_hash_tokens(part, NULL, 0, tokens, 40, local, NULL, 2, &n));
    /* The engine reports it stored both blocks (its own block ids 0xA1, 0xA2). */
    kvr_stored_block blocks[2] = {{0xA1, local[0]}, {0xA2, local[1]}};
    kvr_event ev = {.kind = KVR_EVENT_STORED, .tier = KVR_TIER_DEVICE, .blocks = blocks, .n_blocks = 2};
    TRY(kvr_partition_apply_events(part, 7, 0, &ev, 1, NULL));

    TRY(kvr_request_new(&req));
    TRY(kvr_request_set_tokens(req, tokens, 40));
    kvr_decision d;
    TRY(kvr_partition_select_and_reserve(part, req, &d));
    printf("worker %" PRIu64 " rank %u: %" PRIu64 " tokens cached, %" PRIu64 " to prefill\n",
           d.worker_id, d.dp_rank, d.cached_tokens, d.projected_prefill_tokens);
    TRY(kvr_engine_free_booking(engine, d.selection_id, NULL)); /* the request finished */

    kvr_request_free(req); kvr_partition_free(part); kvr_engine_free(engine);
    return 0;
}
