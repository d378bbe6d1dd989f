// C helpers of the Go binding: see shim.h for why each exists.

#include <stdlib.h>
#include <string.h>

#include "shim.h"
#include "_cgo_export.h"

static kvr_status set_prompt(kvr_request *req, int kind, const uint32_t *tokens,
                             size_t n_tokens, const uint64_t *hashes, size_t n_hashes,
                             uint64_t prompt_tokens) {
  switch (kind) {
  case KVRGO_PROMPT_TOKENS:
    return kvr_request_set_tokens(req, tokens, n_tokens);
  case KVRGO_PROMPT_HASHES:
    return kvr_request_set_local_hashes(req, hashes, n_hashes, prompt_tokens);
  default:
    return kvr_request_set_tokens(req, NULL, 0);
  }
}

kvr_status kvrgo_select(uintptr_t partition, uintptr_t request, int reserve,
                        int prompt_kind, const uint32_t *tokens, size_t n_tokens,
                        const uint64_t *hashes, size_t n_hashes, uint64_t prompt_tokens,
                        kvr_decision *out, kvr_kv_hint *hint) {
  const kvr_partition *p = (const kvr_partition *)partition;
  kvr_request *req = (kvr_request *)request;
  kvr_status st = set_prompt(req, prompt_kind, tokens, n_tokens, hashes, n_hashes,
                             prompt_tokens);
  if (st == KVR_OK) {
    st = reserve ? kvr_partition_select_and_reserve_with_hint(p, req, out, hint)
                 : kvr_partition_select(p, req, out);
  }
  /* The Go prompt must not stay borrowed past this call. */
  (void)kvr_request_set_tokens(req, NULL, 0);
  return st;
}

kvr_status kvrgo_reserve(uintptr_t partition, uint64_t worker_id, uint32_t dp_rank,
                         uintptr_t request, int prompt_kind, const uint32_t *tokens,
                         size_t n_tokens, const uint64_t *hashes, size_t n_hashes,
                         uint64_t prompt_tokens, int has_prefill, uint64_t prefill_tokens,
                         uint64_t selection_id, kvr_decision *out) {
  const kvr_partition *p = (const kvr_partition *)partition;
  kvr_request *req = (kvr_request *)request;
  kvr_status st = KVR_OK;
  if (req != NULL) {
    st = set_prompt(req, prompt_kind, tokens, n_tokens, hashes, n_hashes, prompt_tokens);
  }
  if (st == KVR_OK) {
    st = kvr_partition_reserve(p, worker_id, dp_rank, req,
                               has_prefill ? &prefill_tokens : NULL, selection_id, out);
  }
  if (req != NULL) {
    (void)kvr_request_set_tokens(req, NULL, 0);
  }
  return st;
}

static uint64_t pack(kvr_status st, size_t n) {
  return (uint64_t)st | ((uint64_t)(n > UINT32_MAX ? UINT32_MAX : n) << 32);
}

uint64_t kvrgo_find_matches(uintptr_t partition, int tiered, const uint64_t *local_hashes,
                            size_t n, kvr_overlap *out, size_t cap) {
  const kvr_partition *p = (const kvr_partition *)partition;
  size_t out_len = 0;
  kvr_status st = tiered
      ? kvr_partition_find_matches_tiered(p, local_hashes, n, out, cap, &out_len)
      : kvr_partition_find_matches(p, local_hashes, n, out, cap, &out_len);
  return pack(st, out_len);
}

uint64_t kvrgo_hash_tokens(uintptr_t partition, uint32_t block_size, const char *lora,
                           size_t lora_len, const char *cache_namespace,
                           size_t cache_namespace_len, const uint32_t *tokens,
                           size_t n_tokens, uint64_t *local_out, uint64_t *seq_out,
                           size_t cap) {
  size_t out_len = 0;
  kvr_status st;
  if (partition != 0) {
    st = kvr_partition_hash_tokens((const kvr_partition *)partition, lora, lora_len, tokens,
                                   n_tokens, local_out, seq_out, cap, &out_len);
  } else {
    st = kvr_hash_tokens(block_size, lora, lora_len, cache_namespace, cache_namespace_len,
                         tokens, n_tokens, local_out, seq_out, cap, &out_len);
  }
  return pack(st, out_len);
}

kvr_status kvrgo_mark_prefill_complete(uintptr_t engine, uint64_t selection_id) {
  return kvr_engine_mark_prefill_complete((const kvr_engine *)engine, selection_id);
}

kvr_status kvrgo_add_output_blocks(uintptr_t engine, uint64_t selection_id, uint64_t n) {
  return kvr_engine_add_output_blocks((const kvr_engine *)engine, selection_id, n);
}

uint64_t kvrgo_free_booking(uintptr_t engine, uint64_t selection_id) {
  uint32_t how = 0;
  kvr_status st = kvr_engine_free_booking((const kvr_engine *)engine, selection_id, &how);
  return pack(st, how);
}

#define KVRGO_STACK_EVENTS 32

kvr_status kvrgo_apply_events(const kvr_partition *p, uint64_t worker_id, uint32_t dp_rank,
                              const kvrgo_event *evs, size_t n,
                              const kvr_stored_block *blocks, size_t n_blocks,
                              const uint64_t *removed, size_t n_removed,
                              kvr_apply_result *out) {
  kvr_event stack[KVRGO_STACK_EVENTS];
  kvr_event *events = stack;
  if (n > KVRGO_STACK_EVENTS) {
    if (n > SIZE_MAX / sizeof(kvr_event)) {
      return KVRGO_ERR_NOMEM;
    }
    events = (kvr_event *)malloc(n * sizeof(kvr_event));
    if (events == NULL) {
      return KVRGO_ERR_NOMEM;
    }
  }
  for (size_t i = 0; i < n; i++) {
    const kvrgo_event *d = &evs[i];
    if (d->blocks_off > n_blocks || d->n_blocks > n_blocks - d->blocks_off ||
        d->removed_off > n_removed || d->n_removed > n_removed - d->removed_off) {
      if (events != stack) {
        free(events);
      }
      return KVRGO_ERR_RANGE;
    }
    kvr_event *e = &events[i];
    memset(e, 0, sizeof(*e));
    e->kind = d->kind;
    e->tier = d->tier;
    e->has_parent = d->has_parent;
    e->reserved = d->reserved;
    e->parent = d->parent;
    e->blocks = d->n_blocks ? blocks + d->blocks_off : NULL;
    e->n_blocks = d->n_blocks;
    e->removed = d->n_removed ? removed + d->removed_off : NULL;
    e->n_removed = d->n_removed;
  }
  kvr_status st = kvr_partition_apply_events(p, worker_id, dp_rank, n ? events : NULL, n, out);
  if (events != stack) {
    free(events);
  }
  return st;
}

kvr_status kvrgo_install_replica(const kvr_partition *p, uint64_t selection_id,
                                 uint64_t worker_id, uint32_t dp_rank,
                                 const uint64_t *prompt_blocks, size_t n_prompt_blocks,
                                 uint64_t prefill_tokens, uint64_t expected_output_tokens,
                                 uint64_t ttl_ms) {
  kvr_replica_booking b;
  memset(&b, 0, sizeof(b));
  b.selection_id = selection_id;
  b.worker_id = worker_id;
  b.dp_rank = dp_rank;
  b.prompt_blocks = prompt_blocks;
  b.n_prompt_blocks = n_prompt_blocks;
  b.prefill_tokens = prefill_tokens;
  b.expected_output_tokens = expected_output_tokens;
  b.ttl_ms = ttl_ms;
  return kvr_partition_install_replica_booking(p, &b);
}

kvr_status kvrgo_bench_select_loop(uintptr_t p, uintptr_t req, const uint32_t *tokens,
                                   size_t n_tokens, uint64_t iters) {
  kvr_decision d;
  for (uint64_t i = 0; i < iters; i++) {
    kvr_status st = kvrgo_select(p, req, 0, KVRGO_PROMPT_TOKENS, tokens, n_tokens, NULL, 0,
                                 0, &d, NULL);
    if (st != KVR_OK) {
      return st;
    }
  }
  return KVR_OK;
}

/* A plain C host's loop, for the binding's overhead: what a C server does per selection
   (set the request's prompt, select), through the public header only. */
kvr_status kvrgo_bench_plain_c_loop(uintptr_t p, uintptr_t req, const uint32_t *tokens,
                                    size_t n_tokens, uint64_t iters) {
  const kvr_partition *part = (const kvr_partition *)p;
  kvr_request *r = (kvr_request *)req;
  kvr_decision d;
  for (uint64_t i = 0; i < iters; i++) {
    kvr_status st = kvr_request_set_tokens(r, tokens, n_tokens);
    if (st == KVR_OK) {
      st = kvr_partition_select(part, r, &d);
    }
    if (st != KVR_OK) {
      return st;
    }
  }
  (void)kvr_request_set_tokens(r, NULL, 0);
  return KVR_OK;
}

/* kvr_abi_version() iters times in C: the C side of the cgo floor's paired benchmark. */
uint32_t kvrgo_bench_abi_loop(uint64_t iters) {
  uint32_t sum = 0;
  for (uint64_t i = 0; i < iters; i++) {
    sum += kvr_abi_version();
  }
  return sum;
}

/* A C call with no kvr in it that takes `iters` steps of a dependent integer chain: the
   floor under the binding's overhead, for a call as long as a selection. Not inlined, so
   the C loop below pays a call per spin as Go does. */
__attribute__((noinline)) uint64_t kvrgo_bench_spin(uint64_t iters, uint64_t x) {
  for (uint64_t i = 0; i < iters; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
  }
  return x;
}

/* kvrgo_bench_spin(iters) `calls` times in C: the C side of the spin floor. */
uint64_t kvrgo_bench_spin_loop(uint64_t calls, uint64_t iters) {
  uint64_t x = 0x9e3779b97f4a7c15u;
  for (uint64_t i = 0; i < calls; i++) {
    x = kvrgo_bench_spin(iters, x);
  }
  return x;
}

/* A kvr-free C call whose data stays in the core's caches, as a selection's mostly does:
   `iters` steps of a pointer chase around one fixed random cycle over KVRGO_WALK_WORDS
   4-byte words (16 KiB by default, a third of this VM's L1 data cache; other sizes with
   CGO_CFLAGS=-DKVRGO_WALK_WORDS=n). What Go's runtime touches between calls evicts some
   of it, and a goroutine that moves to another thread finds it in another core's caches,
   so this floor includes the refills a call from Go pays and a C loop does not. */
#ifndef KVRGO_WALK_WORDS
#define KVRGO_WALK_WORDS 4096
#endif
static uint32_t walk_next[KVRGO_WALK_WORDS];

/* Lays the cycle out (Sattolo's shuffle, fixed seed); idempotent. Not thread-safe: the
   benchmarks call it once before timing. */
void kvrgo_bench_walk_init(void) {
  uint64_t x = 0x2545f4914f6cdd1du;
  for (uint32_t i = 0; i < KVRGO_WALK_WORDS; i++) {
    walk_next[i] = i;
  }
  for (uint32_t i = KVRGO_WALK_WORDS - 1; i > 0; i--) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    uint32_t j = (uint32_t)(x % i);
    uint32_t t = walk_next[i];
    walk_next[i] = walk_next[j];
    walk_next[j] = t;
  }
}

__attribute__((noinline)) uint64_t kvrgo_bench_walk(uint64_t iters, uint64_t at) {
  uint32_t i = (uint32_t)(at % KVRGO_WALK_WORDS);
  for (uint64_t k = 0; k < iters; k++) {
    i = walk_next[i];
  }
  return i;
}

/* kvrgo_bench_walk(iters) `calls` times in C. */
uint64_t kvrgo_bench_walk_loop(uint64_t calls, uint64_t iters) {
  uint64_t at = 1;
  for (uint64_t i = 0; i < calls; i++) {
    at = kvrgo_bench_walk(iters, at);
  }
  return at;
}

/* Trampolines: the C signatures kvr calls, forwarding to the exported Go functions with
   user_data as the integer handle it is. */

static void tramp_release(void *user_data) { kvrgoHookRelease((uintptr_t)user_data); }

static int32_t tramp_prefill(void *user_data, uint64_t worker_id, uint32_t dp_rank,
                             uint64_t prompt_tokens, uint64_t cached_tokens,
                             uint64_t *out_tokens) {
  return kvrgoHookPrefill((uintptr_t)user_data, worker_id, dp_rank, prompt_tokens,
                          cached_tokens, out_tokens);
}

static int32_t tramp_overloaded(void *user_data, uint64_t worker_id, uint32_t dp_rank) {
  return kvrgoHookOverloaded((uintptr_t)user_data, worker_id, dp_rank);
}

static int32_t tramp_available(void *user_data, uint64_t worker_id, uint32_t dp_rank) {
  return kvrgoHookAvailable((uintptr_t)user_data, worker_id, dp_rank);
}

static int32_t tramp_shared_cache(void *user_data, const uint64_t *seq_hashes, size_t n,
                                  kvr_block_range *out, size_t cap, size_t *out_len) {
  return kvrgoHookSharedCache((uintptr_t)user_data, (uint64_t *)seq_hashes, n, out, cap,
                              out_len);
}

static int32_t tramp_lora_filter(void *user_data, const char *lora, size_t lora_len,
                                 const uint64_t *workers, size_t n, uint8_t *out_serves) {
  return kvrgoHookLoraFilter((uintptr_t)user_data, (char *)lora, lora_len,
                             (uint64_t *)workers, n, out_serves);
}

kvr_status kvrgo_set_hooks(const kvr_partition *p, uintptr_t handle, uint32_t mask) {
  if (mask == 0) {
    return kvr_partition_set_hooks(p, NULL);
  }
  kvr_hooks h;
  memset(&h, 0, sizeof(h));
  h.user_data = (void *)handle;
  h.release = tramp_release;
  if (mask & KVRGO_HOOK_PREFILL) h.prefill_estimate = tramp_prefill;
  if (mask & KVRGO_HOOK_OVERLOADED) h.overloaded = tramp_overloaded;
  if (mask & KVRGO_HOOK_AVAILABLE) h.available = tramp_available;
  if (mask & KVRGO_HOOK_SHARED_CACHE) h.shared_cache = tramp_shared_cache;
  if (mask & KVRGO_HOOK_LORA_FILTER) h.lora_filter = tramp_lora_filter;
  return kvr_partition_set_hooks(p, &h);
}
