/*
 * C helpers of the Go binding (declarations only: this header is part of the cgo
 * preamble of hooks_export.go, whose preamble cgo copies into _cgo_export.c).
 *
 * Why they exist: cgo forbids C to keep a Go pointer after a call returns, and forbids
 * passing Go memory that itself holds Go pointers. The helpers make every borrow of Go
 * memory last exactly one cgo call:
 *   - kvrgo_select / kvrgo_reserve set the request's borrowed prompt, run the selection
 *     and clear the prompt again, inside one call;
 *   - kvrgo_apply_events builds the kvr_event array (which holds pointers) on the C side
 *     from pointer-free descriptors plus two flat Go arrays;
 *   - kvrgo_install_replica builds the kvr_replica_booking on the C stack;
 *   - kvrgo_set_hooks builds kvr_hooks with an integer handle as user_data, so Go never
 *     holds a fake pointer.
 */
#ifndef KVRGO_SHIM_H
#define KVRGO_SHIM_H

#include <stddef.h>
#include <stdint.h>
#include "kvr.h"

/* Prompt kinds of kvrgo_select / kvrgo_reserve. */
#define KVRGO_PROMPT_NONE 0
#define KVRGO_PROMPT_TOKENS 1
#define KVRGO_PROMPT_HASHES 2

/* Hook bits of kvrgo_set_hooks. */
#define KVRGO_HOOK_PREFILL 1u
#define KVRGO_HOOK_OVERLOADED 2u
#define KVRGO_HOOK_AVAILABLE 4u
#define KVRGO_HOOK_SHARED_CACHE 8u
#define KVRGO_HOOK_LORA_FILTER 16u

/* One event of a batch without pointers: its arrays are ranges of the batch's flat
   arrays. */
typedef struct kvrgo_event {
  uint32_t kind;
  uint32_t tier;
  uint32_t has_parent;
  uint32_t reserved;
  uint64_t parent;
  size_t blocks_off;
  size_t n_blocks;
  size_t removed_off;
  size_t n_removed;
} kvrgo_event;

/*
 * Handles of the routing-path helpers are passed as uintptr_t: cgo boxes a pointer to an
 * incomplete C struct into an interface for its pointer check (8 bytes allocated per
 * handle argument), which an integer avoids. A handle is C memory, never a Go pointer.
 */

/* Sets the prompt (kind, tokens or hashes), runs kvr_partition_select (reserve == 0)
   or kvr_partition_select_and_reserve_with_hint (hint may be NULL; it is written only
   when out->flags has KVR_DECISION_KV_HINT), and clears the prompt before returning. */
kvr_status kvrgo_select(uintptr_t p, uintptr_t req, int reserve,
                        int prompt_kind, const uint32_t *tokens, size_t n_tokens,
                        const uint64_t *hashes, size_t n_hashes, uint64_t prompt_tokens,
                        kvr_decision *out, kvr_kv_hint *hint);

/* kvr_partition_reserve with the same prompt handling; req may be NULL (then the
   prompt must be KVRGO_PROMPT_NONE). */
kvr_status kvrgo_reserve(uintptr_t p, uint64_t worker_id, uint32_t dp_rank,
                         uintptr_t req, int prompt_kind, const uint32_t *tokens,
                         size_t n_tokens, const uint64_t *hashes, size_t n_hashes,
                         uint64_t prompt_tokens, int has_prefill, uint64_t prefill_tokens,
                         uint64_t selection_id, kvr_decision *out);

/* kvr_partition_find_matches (tiered == 0) or _tiered; returns the status in the low
   32 bits and *out_len in the high 32 bits. */
uint64_t kvrgo_find_matches(uintptr_t p, int tiered, const uint64_t *local_hashes, size_t n,
                            kvr_overlap *out, size_t cap);

/* kvr_partition_hash_tokens (p != 0) or kvr_hash_tokens (p == 0, with block_size and
   cache_namespace); returns the status in the low 32 bits and *out_len in the high 32
   bits. */
uint64_t kvrgo_hash_tokens(uintptr_t p, uint32_t block_size, const char *lora,
                           size_t lora_len, const char *cache_namespace,
                           size_t cache_namespace_len, const uint32_t *tokens,
                           size_t n_tokens, uint64_t *local_out, uint64_t *seq_out,
                           size_t cap);

/* The booking lifecycle; free_booking returns the status in the low 32 bits and
   *out_freed in the high 32 bits. */
kvr_status kvrgo_mark_prefill_complete(uintptr_t engine, uint64_t selection_id);
kvr_status kvrgo_add_output_blocks(uintptr_t engine, uint64_t selection_id, uint64_t n);
uint64_t kvrgo_free_booking(uintptr_t engine, uint64_t selection_id);

/* kvr_partition_apply_events over descriptors into flat arrays. */
kvr_status kvrgo_apply_events(const kvr_partition *p, uint64_t worker_id, uint32_t dp_rank,
                              const kvrgo_event *evs, size_t n,
                              const kvr_stored_block *blocks, size_t n_blocks,
                              const uint64_t *removed, size_t n_removed,
                              kvr_apply_result *out);

/* kvr_partition_install_replica_booking with the struct built here. */
kvr_status kvrgo_install_replica(const kvr_partition *p, uint64_t selection_id,
                                 uint64_t worker_id, uint32_t dp_rank,
                                 const uint64_t *prompt_blocks, size_t n_prompt_blocks,
                                 uint64_t prefill_tokens, uint64_t expected_output_tokens,
                                 uint64_t ttl_ms);

/* kvr_partition_set_hooks with the Go trampolines selected by `mask` (and release),
   user_data = (void *)handle. mask == 0 removes the hooks (handle unused). */
kvr_status kvrgo_set_hooks(const kvr_partition *p, uintptr_t handle, uint32_t mask);

/* Benchmark support: `iters` advisory selections of one token prompt in a C loop (the
   same work as kvrgo_select without the Go→C transition); returns the first non-OK
   status, or KVR_OK. */
kvr_status kvrgo_bench_select_loop(uintptr_t p, uintptr_t req, const uint32_t *tokens,
                                   size_t n_tokens, uint64_t iters);
uint32_t kvrgo_bench_abi_loop(uint64_t iters);
/* A kvr-free C call of `iters` dependent steps, and `calls` of them in a C loop: the cgo
   floor for a call as long as a selection. */
uint64_t kvrgo_bench_spin(uint64_t iters, uint64_t x);
uint64_t kvrgo_bench_spin_loop(uint64_t calls, uint64_t iters);
/* The same over a cache-resident working set (a pointer chase over 16 KiB). */
void kvrgo_bench_walk_init(void);
uint64_t kvrgo_bench_walk(uint64_t iters, uint64_t at);
uint64_t kvrgo_bench_walk_loop(uint64_t calls, uint64_t iters);
kvr_status kvrgo_bench_plain_c_loop(uintptr_t p, uintptr_t req, const uint32_t *tokens,
                                    size_t n_tokens, uint64_t iters);

/* Status a helper returns when it cannot allocate its scratch (never a kvr status). */
#define KVRGO_ERR_NOMEM 0xFFFF0001u
/* A descriptor's range lies outside the flat arrays (a bug of the binding). */
#define KVRGO_ERR_RANGE 0xFFFF0002u

#endif /* KVRGO_SHIM_H */
