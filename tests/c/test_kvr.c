/*
 * test_kvr.c: the C host harness of kvr's C ABI (include/kvr.h).
 *
 * One file, no framework: every exported function is called, with its error paths
 * (NULL handles and out-parameters, (NULL, n > 0) slices, invalid UTF-8, out-of-range
 * arguments, unknown ids) and with checks of what it actually does (index contents,
 * the cost model's numbers, booking counters, hook calls). tests/c/run.sh builds it
 * against target/release/libkvr.a and runs it natively and under valgrind.
 *
 *   gcc -std=c11 -Wall -Wextra -Werror -O1 -g -I include tests/c/test_kvr.c \
 *       target/release/libkvr.a -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc
 *
 * Prints "N passed, N failed" last; exits non-zero if any check failed.
 * KVR_C_TEST_SLOW=1 also runs the rank-limit test (2^18 + 1 ranks; skipped by default,
 * and always under valgrind by run.sh, because it is slow there).
 */

/* POSIX sockets and clocks, for the subscriber test (a raw ZMTP publisher). */
#define _POSIX_C_SOURCE 200809L

#include "kvr.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <threads.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------ */
/* A tiny check framework                                                                */
/* ------------------------------------------------------------------------------------ */

static unsigned g_passed, g_failed;
static const char *g_section = "";

static void check_(bool ok, const char *what, int line)
{
    if (ok) {
        g_passed++;
    } else {
        g_failed++;
        fprintf(stderr, "FAIL [%s] line %d: %s\n", g_section, line, what);
    }
}

#define CHECK(cond) check_(!!(cond), #cond, __LINE__)

/* `call` returns status `expected`. */
#define CHECK_ST(expected, call)                                                          \
    do {                                                                                  \
        kvr_status st_ = (call);                                                          \
        kvr_status ex_ = (expected);                                                      \
        if (st_ == ex_) {                                                                 \
            g_passed++;                                                                   \
        } else {                                                                          \
            g_failed++;                                                                   \
            fprintf(stderr, "FAIL [%s] line %d: %s -> %u (%s), expected %u (%s)\n",       \
                    g_section, __LINE__, #call, st_, kvr_status_str(st_), ex_,            \
                    kvr_status_str(ex_));                                                 \
        }                                                                                 \
    } while (0)

#define OK(call) CHECK_ST(KVR_OK, call)

/* Integer equality, printing both values on failure. */
#define CHECK_EQ(a, b)                                                                    \
    do {                                                                                  \
        uint64_t a_ = (uint64_t)(a);                                                      \
        uint64_t b_ = (uint64_t)(b);                                                      \
        if (a_ == b_) {                                                                   \
            g_passed++;                                                                   \
        } else {                                                                          \
            g_failed++;                                                                   \
            fprintf(stderr, "FAIL [%s] line %d: %s == %s (%" PRIu64 " != %" PRIu64 ")\n", \
                    g_section, __LINE__, #a, #b, a_, b_);                                 \
        }                                                                                 \
    } while (0)

/* Floating-point equality to 1e-9 (the costs here are sums of exact binary fractions). */
#define CHECK_COST(a, b)                                                                  \
    do {                                                                                  \
        double a_ = (a);                                                                  \
        double b_ = (b);                                                                  \
        if (fabs(a_ - b_) < 1e-9) {                                                       \
            g_passed++;                                                                   \
        } else {                                                                          \
            g_failed++;                                                                   \
            fprintf(stderr, "FAIL [%s] line %d: %s == %s (%.6f != %.6f)\n", g_section,   \
                    __LINE__, #a, #b, a_, b_);                                            \
        }                                                                                 \
    } while (0)

/* Panics the test provokes on purpose (none today); any other is a failure. */
static uint64_t g_expected_panics;

static bool all_bytes(const void *p, size_t n, unsigned char v)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        if (b[i] != v) {
            return false;
        }
    }
    return true;
}

#define SENTINEL 0xAB

/* Not UTF-8: a lone continuation byte and an invalid lead byte. */
static const char BAD_UTF8[] = "\xff\xfe";
#define BAD_UTF8_LEN 2

/* ------------------------------------------------------------------------------------ */
/* Fixtures                                                                              */
/* ------------------------------------------------------------------------------------ */

/* Block size of most test partitions, and the standard prompt: 24 tokens = 6 blocks. */
enum { BS = 4, NT = 24, NB = 6 };
static uint32_t T[NT];      /* the prompt */
static uint64_t L[NB];      /* its local hashes (no LoRA, no namespace) */
static uint64_t S[NB];      /* its sequence hashes */
static uint32_t U[NT];      /* another prompt, cached nowhere */

static kvr_engine *new_engine(uint64_t seed)
{
    kvr_engine_options *o = NULL;
    kvr_engine *e = NULL;
    if (kvr_engine_options_new(&o) != KVR_OK || kvr_engine_options_set_seed(o, seed) != KVR_OK ||
        kvr_engine_new(o, &e) != KVR_OK) {
        fprintf(stderr, "fatal: cannot create an engine\n");
        exit(2);
    }
    kvr_engine_options_free(o);
    return e;
}

/* Partition options for `block_size` with cost model `model` (KVR_COST_MODEL_*). */
static kvr_partition_options *new_opts_model(uint32_t block_size, uint32_t model)
{
    kvr_partition_options *o = NULL;
    if (kvr_partition_options_new(block_size, &o) != KVR_OK ||
        kvr_partition_options_set_cost_model(o, model) != KVR_OK) {
        fprintf(stderr, "fatal: cannot create partition options\n");
        exit(2);
    }
    return o;
}

/* The fixtures' options: Dynamo's cost model, set explicitly. The exact costs the tests
   assert (CHECK_COST, the layouts' comments) are Dynamo's formula in block equivalents
   (REFERENCE.md §3); the default, the latency model, is tested by test_latency_cost. */
static kvr_partition_options *new_opts(uint32_t block_size)
{
    return new_opts_model(block_size, KVR_COST_MODEL_DYNAMO);
}

/* Creates partition (model, "g") with `o` (consumed). */
static kvr_partition *new_partition_with(kvr_engine *e, const char *model,
                                         kvr_partition_options *o)
{
    kvr_partition *p = NULL;
    kvr_status s = kvr_engine_create_partition(e, model, strlen(model), "g", 1, o, &p);
    kvr_partition_options_free(o);
    if (s != KVR_OK) {
        fprintf(stderr, "fatal: cannot create partition %s: %s\n", model, kvr_status_str(s));
        exit(2);
    }
    return p;
}

static kvr_partition *new_partition(kvr_engine *e, const char *model)
{
    return new_partition_with(e, model, new_opts(BS));
}

static void add_worker_full(kvr_partition *p, uint64_t id, uint32_t dp, uint64_t total_kv,
                            uint64_t max_batched, const char *lora)
{
    kvr_worker *w = NULL;
    OK(kvr_worker_new(id, dp, &w));
    if (total_kv) {
        OK(kvr_worker_set_total_kv_blocks(w, total_kv));
    }
    if (max_batched) {
        OK(kvr_worker_set_max_batched_tokens(w, max_batched));
    }
    if (lora) {
        OK(kvr_worker_add_lora_adapter(w, lora, strlen(lora)));
    }
    OK(kvr_partition_upsert_worker(p, w));
    kvr_worker_free(w);
}

static void add_worker(kvr_partition *p, uint64_t id)
{
    add_worker_full(p, id, 1, 0, 0, NULL);
}

/* One Stored event of `n` blocks with external hashes ext0, ext0 + 1, ... */
static kvr_status store(const kvr_partition *p, uint64_t worker, uint32_t rank, uint32_t tier,
                        bool has_parent, uint64_t parent, uint64_t ext0, const uint64_t *local,
                        size_t n, kvr_apply_result *res)
{
    kvr_stored_block blocks[64];
    for (size_t i = 0; i < n; i++) {
        blocks[i].external_hash = ext0 + i;
        blocks[i].local_hash = local[i];
    }
    kvr_event ev = {
        .kind = KVR_EVENT_STORED,
        .tier = tier,
        .has_parent = has_parent ? 1u : 0u,
        .parent = parent,
        .blocks = blocks,
        .n_blocks = n,
    };
    return kvr_partition_apply_events(p, worker, rank, &ev, 1, res);
}

static kvr_status remove_blocks(const kvr_partition *p, uint64_t worker, uint32_t rank,
                                uint32_t tier, const uint64_t *ext, size_t n,
                                kvr_apply_result *res)
{
    kvr_event ev = {.kind = KVR_EVENT_REMOVED, .tier = tier, .removed = ext, .n_removed = n};
    return kvr_partition_apply_events(p, worker, rank, &ev, 1, res);
}

/* Index of (worker, rank) in an overlap array, or -1. */
static int find_ov(const kvr_overlap *ov, size_t n, uint64_t worker, uint32_t rank)
{
    for (size_t i = 0; i < n; i++) {
        if (ov[i].worker_id == worker && ov[i].dp_rank == rank) {
            return (int)i;
        }
    }
    return -1;
}

/*
 * The standard cache layout (block size 4, prompt T of 6 blocks):
 *   worker 1: blocks 0-2 on device, 3-4 in host memory, 5 on disk
 *   worker 2: blocks 0-5 on device
 *   worker 3: nothing
 * Dynamo's costs with default knobs (REFERENCE.md §3; prefill = ISL/B = 6, decode = 6 new
 * blocks):
 *   w1: max(0, 6 - (3 + 0.75*2 + 0.25*1)) + 6 = 7.25
 *   w2: max(0, 6 - 6) + 6 = 6
 *   w3: 6 + 6 = 12
 */
static void setup_standard(kvr_partition *p)
{
    add_worker(p, 1);
    add_worker(p, 2);
    add_worker(p, 3);
    OK(store(p, 1, 0, KVR_TIER_DEVICE, false, 0, 101, L, 3, NULL));
    OK(store(p, 1, 0, KVR_TIER_HOST, true, 103, 104, L + 3, 2, NULL));
    OK(store(p, 1, 0, KVR_TIER_DISK, true, 105, 106, L + 5, 1, NULL));
    OK(store(p, 2, 0, KVR_TIER_DEVICE, false, 0, 201, L, 6, NULL));
}

static kvr_request *new_request(const uint32_t *tokens, size_t n)
{
    kvr_request *r = NULL;
    OK(kvr_request_new(&r));
    OK(kvr_request_set_tokens(r, tokens, n));
    return r;
}

static kvr_active_load load_of(const kvr_partition *p, uint64_t w, uint32_t r)
{
    kvr_active_load l;
    memset(&l, SENTINEL, sizeof l);
    OK(kvr_partition_active_load(p, w, r, &l));
    return l;
}

#define CHECK_LOAD(p, w, r, prefill, decode, requests)                                    \
    do {                                                                                  \
        kvr_active_load l_ = load_of((p), (w), (r));                                      \
        CHECK_EQ(l_.active_prefill_tokens, (prefill));                                    \
        CHECK_EQ(l_.active_decode_blocks, (decode));                                      \
        CHECK_EQ(l_.active_requests, (requests));                                         \
    } while (0)

static kvr_booking_stats booking_stats(const kvr_partition *p)
{
    kvr_booking_stats s;
    memset(&s, SENTINEL, sizeof s);
    OK(kvr_partition_booking_stats(p, &s));
    return s;
}

static kvr_selection_stats selection_stats(const kvr_partition *p)
{
    kvr_selection_stats s;
    memset(&s, SENTINEL, sizeof s);
    OK(kvr_partition_selection_stats(p, &s));
    return s;
}

/* ------------------------------------------------------------------------------------ */
/* Host hooks                                                                            */
/* ------------------------------------------------------------------------------------ */

typedef struct {
    int release_calls;
    /* prefill_estimate */
    int prefill_calls;
    int32_t prefill_rc;
    uint64_t prefill_value;
    uint64_t seen_worker, seen_prompt, seen_cached;
    /* overloaded: UINT64_MAX = every rank, 0 = none, else that worker */
    int overload_calls;
    uint64_t overloaded_worker;
    /* available: UINT64_MAX = no rank, 0 = all, else every worker but that one */
    uint64_t unavailable_worker;
    /* shared_cache: report `shared_want` ranges, the first [0, shared_end) */
    int shared_calls;
    int32_t shared_rc;
    size_t shared_want;
    uint32_t shared_end;
    size_t shared_caps[4];
    uint64_t shared_seen[NB];
    size_t shared_seen_n;
    /* lora_filter: bit w of lora_serves = worker w serves the adapter */
    int lora_calls;
    int32_t lora_rc;
    uint64_t lora_serves;
    char lora_seen[32];
    size_t lora_seen_len;
    size_t lora_n;
} hook_ctx;

static void hook_release(void *ud)
{
    ((hook_ctx *)ud)->release_calls++;
}

static int32_t hook_prefill(void *ud, uint64_t worker_id, uint32_t dp_rank, uint64_t prompt_tokens,
                            uint64_t cached_tokens, uint64_t *out_tokens)
{
    hook_ctx *c = ud;
    (void)dp_rank;
    c->prefill_calls++;
    c->seen_worker = worker_id;
    c->seen_prompt = prompt_tokens;
    c->seen_cached = cached_tokens;
    if (c->prefill_rc != 0) {
        return c->prefill_rc;
    }
    *out_tokens = c->prefill_value;
    return 0;
}

static int32_t hook_overloaded(void *ud, uint64_t worker_id, uint32_t dp_rank)
{
    hook_ctx *c = ud;
    (void)dp_rank;
    c->overload_calls++;
    return c->overloaded_worker == UINT64_MAX || c->overloaded_worker == worker_id;
}

static int32_t hook_available(void *ud, uint64_t worker_id, uint32_t dp_rank)
{
    hook_ctx *c = ud;
    (void)dp_rank;
    if (c->unavailable_worker == UINT64_MAX) {
        return 0;
    }
    return c->unavailable_worker != worker_id;
}

static int32_t hook_shared(void *ud, const uint64_t *seq, size_t n, kvr_block_range *out, size_t cap,
                           size_t *out_len)
{
    hook_ctx *c = ud;
    if (c->shared_calls < 4) {
        c->shared_caps[c->shared_calls] = cap;
    }
    c->shared_calls++;
    c->shared_seen_n = n;
    for (size_t i = 0; i < n && i < NB; i++) {
        c->shared_seen[i] = seq[i];
    }
    if (c->shared_rc != 0) {
        return c->shared_rc;
    }
    *out_len = c->shared_want;
    if (c->shared_want > cap) {
        return 0; /* "call me again with room for them" */
    }
    for (size_t i = 0; i < c->shared_want; i++) {
        if (i == 0) {
            out[i].start = 0;
            out[i].end = c->shared_end;
        } else { /* far beyond the prompt: must not count */
            out[i].start = (uint32_t)(1000 + 2 * i);
            out[i].end = (uint32_t)(1001 + 2 * i);
        }
    }
    return 0;
}

static int32_t hook_lora(void *ud, const char *lora, size_t lora_len, const uint64_t *workers,
                         size_t n, uint8_t *out_serves)
{
    hook_ctx *c = ud;
    c->lora_calls++;
    c->lora_n = n;
    c->lora_seen_len = lora_len;
    if (lora_len < sizeof c->lora_seen) {
        memcpy(c->lora_seen, lora, lora_len);
        c->lora_seen[lora_len] = '\0';
    }
    if (c->lora_rc != 0) {
        return c->lora_rc;
    }
    for (size_t i = 0; i < n; i++) {
        out_serves[i] = workers[i] < 64 && ((c->lora_serves >> workers[i]) & 1u);
    }
    return 0;
}

static kvr_hooks hooks_for(hook_ctx *c)
{
    kvr_hooks h = {
        .user_data = c,
        .release = hook_release,
        .prefill_estimate = hook_prefill,
        .overloaded = hook_overloaded,
        .available = hook_available,
        .shared_cache = hook_shared,
        .lora_filter = hook_lora,
    };
    return h;
}

/* ------------------------------------------------------------------------------------ */
/* Sections                                                                              */
/* ------------------------------------------------------------------------------------ */

static void test_version_and_status(void)
{
    g_section = "version/status";
    KVR_ABI_CHECK();
    CHECK_EQ(kvr_abi_version(), KVR_ABI_VERSION);
    CHECK_EQ(kvr_abi_2, KVR_ABI_VERSION);
    CHECK(KVR_VERSION_MAJOR == 0 && KVR_VERSION_MINOR >= 3);

    const kvr_status all[] = {
        KVR_OK, KVR_BUSY, KVR_NO_WORKER, KVR_BUFFER_TOO_SMALL, KVR_ERR_NULL,
        KVR_ERR_INVALID_ARGUMENT, KVR_ERR_UNKNOWN_PARTITION, KVR_ERR_PARTITION_EXISTS,
        KVR_ERR_UNKNOWN_SELECTION_ID, KVR_ERR_DUPLICATE_SELECTION_ID, KVR_ERR_UNKNOWN_RANK,
        KVR_ERR_UNKNOWN_WORKER, KVR_ERR_ALREADY_FREED, KVR_ERR_TOO_LARGE,
        KVR_ERR_PARENT_NOT_FOUND, KVR_ERR_TOO_MANY_RANKS, KVR_ERR_DECODE, KVR_ERR_IO,
        KVR_ERR_INVALID_CONFIG, KVR_ERR_PANIC,
    };
    const size_t n = sizeof all / sizeof all[0];
    const char *unknown = kvr_status_str(12345);
    CHECK(unknown != NULL && strcmp(unknown, "unknown status") == 0);
    CHECK(kvr_status_str(4) == unknown || strcmp(kvr_status_str(4), "unknown status") == 0);
    for (size_t i = 0; i < n; i++) {
        const char *m = kvr_status_str(all[i]);
        CHECK(m != NULL && m[0] != '\0');
        CHECK(m != NULL && strcmp(m, "unknown status") != 0);
        for (size_t j = 0; j < i; j++) {
            CHECK(m != NULL && strcmp(m, kvr_status_str(all[j])) != 0);
        }
    }
    CHECK(strcmp(kvr_status_str(KVR_OK), "ok") == 0);

    /* kvr_status_count: counts every non-OK return, with or without a handle. */
    CHECK_EQ(kvr_status_count(KVR_OK), 0);
    uint64_t nulls = kvr_status_count(KVR_ERR_NULL);
    uint64_t invalid = kvr_status_count(KVR_ERR_INVALID_ARGUMENT);
    CHECK_ST(KVR_ERR_NULL, kvr_engine_new(NULL, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_mint_selection_id(NULL, NULL));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_new(0, NULL));
    CHECK_EQ(kvr_status_count(KVR_ERR_NULL), nulls + 2);
    CHECK_EQ(kvr_status_count(KVR_ERR_INVALID_ARGUMENT), invalid + 1);
    kvr_engine *e = NULL;
    OK(kvr_engine_new(NULL, &e));
    CHECK_EQ(kvr_status_count(KVR_OK), 0);
    CHECK_EQ(kvr_status_count(KVR_ERR_NULL), nulls + 2);
    kvr_engine_free(e);
}

static void test_hashing(void)
{
    g_section = "hashing";
    uint64_t local[4], seq[4];
    size_t n = 99;

    /* REFERENCE vectors (shared/conformance/hash_vectors.json). */
    const uint32_t tok10[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    OK(kvr_hash_tokens(4, NULL, 0, NULL, 0, tok10, 8, local, seq, 4, &n));
    CHECK_EQ(n, 2);
    CHECK_EQ(local[0], UINT64_C(9143094415614847814));
    CHECK_EQ(local[1], UINT64_C(12124091508212882195));
    CHECK_EQ(seq[0], UINT64_C(9143094415614847814));
    CHECK_EQ(seq[1], UINT64_C(9510318385840434533));
    /* Partial tail dropped: 10 tokens are still 2 blocks, same hashes. */
    memset(local, 0, sizeof local);
    OK(kvr_hash_tokens(4, NULL, 0, NULL, 0, tok10, 10, local, seq, 4, &n));
    CHECK_EQ(n, 2);
    CHECK_EQ(local[1], UINT64_C(12124091508212882195));
    CHECK_EQ(seq[1], UINT64_C(9510318385840434533));

    /* Either output may be NULL; both NULL = count only. */
    uint64_t only_seq[2];
    OK(kvr_hash_tokens(4, NULL, 0, NULL, 0, tok10, 8, NULL, only_seq, 2, &n));
    CHECK_EQ(n, 2);
    CHECK_EQ(only_seq[1], UINT64_C(9510318385840434533));
    n = 0;
    OK(kvr_hash_tokens(4, NULL, 0, NULL, 0, tok10, 10, NULL, NULL, 0, &n));
    CHECK_EQ(n, 2);
    /* Fewer tokens than a block: no block; (NULL, 0) tokens: no block. */
    OK(kvr_hash_tokens(4, NULL, 0, NULL, 0, tok10, 3, local, seq, 4, &n));
    CHECK_EQ(n, 0);
    OK(kvr_hash_tokens(4, NULL, 0, NULL, 0, NULL, 0, local, seq, 4, &n));
    CHECK_EQ(n, 0);

    /* Too small: status, the count needed, nothing written. */
    memset(local, SENTINEL, sizeof local);
    memset(seq, SENTINEL, sizeof seq);
    CHECK_ST(KVR_BUFFER_TOO_SMALL, kvr_hash_tokens(4, NULL, 0, NULL, 0, tok10, 10, local, seq, 1, &n));
    CHECK_EQ(n, 2);
    CHECK(all_bytes(local, sizeof local, SENTINEL) && all_bytes(seq, sizeof seq, SENTINEL));
    CHECK_ST(KVR_BUFFER_TOO_SMALL, kvr_hash_tokens(4, NULL, 0, NULL, 0, tok10, 8, local, NULL, 0, &n));
    CHECK_EQ(n, 2);
    CHECK(all_bytes(local, sizeof local, SENTINEL));

    /* Errors. */
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_hash_tokens(0, NULL, 0, NULL, 0, tok10, 8, local, seq, 4, &n));
    CHECK_ST(KVR_ERR_NULL, kvr_hash_tokens(4, NULL, 0, NULL, 0, tok10, 8, local, seq, 4, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_hash_tokens(4, NULL, 0, NULL, 0, NULL, 8, local, seq, 4, &n));
    CHECK_ST(KVR_ERR_NULL, kvr_hash_tokens(4, NULL, 3, NULL, 0, tok10, 8, local, seq, 4, &n));
    CHECK_ST(KVR_ERR_NULL, kvr_hash_tokens(4, NULL, 0, NULL, 3, tok10, 8, local, seq, 4, &n));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_hash_tokens(4, BAD_UTF8, BAD_UTF8_LEN, NULL, 0, tok10, 8, local, seq, 4, &n));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_hash_tokens(4, NULL, 0, BAD_UTF8, BAD_UTF8_LEN, tok10, 8, local, seq, 4, &n));

    /* Salts: LoRA and namespace change every local hash; the chain still starts at it. */
    uint64_t plain[NB], lora[NB], ns[NB], both[NB], lora_seq[NB];
    OK(kvr_hash_tokens(BS, NULL, 0, NULL, 0, T, NT, plain, NULL, NB, &n));
    OK(kvr_hash_tokens(BS, "ad", 2, NULL, 0, T, NT, lora, lora_seq, NB, &n));
    OK(kvr_hash_tokens(BS, NULL, 0, "tenant-a", 8, T, NT, ns, NULL, NB, &n));
    OK(kvr_hash_tokens(BS, "ad", 2, "tenant-a", 8, T, NT, both, NULL, NB, &n));
    CHECK_EQ(n, NB);
    for (size_t i = 0; i < NB; i++) {
        CHECK(plain[i] == L[i]);
        CHECK(lora[i] != plain[i] && ns[i] != plain[i] && both[i] != lora[i] && both[i] != ns[i]);
    }
    CHECK_EQ(lora_seq[0], lora[0]);
    CHECK(S[0] == L[0] && S[1] != L[1]);

    /* The partition's hashing = kvr_hash_tokens with its block size and namespace. */
    kvr_engine *e = new_engine(1);
    kvr_partition_options *o = new_opts(BS);
    OK(kvr_partition_options_set_cache_namespace(o, "tenant-a", 8));
    kvr_partition *pns = new_partition_with(e, "ns", o);
    kvr_partition *pplain = new_partition(e, "plain");
    uint64_t pl[NB], ps[NB];
    OK(kvr_partition_hash_tokens(pns, NULL, 0, T, NT, pl, ps, NB, &n));
    CHECK_EQ(n, NB);
    CHECK(memcmp(pl, ns, sizeof pl) == 0);
    OK(kvr_partition_hash_tokens(pns, "ad", 2, T, NT, pl, NULL, NB, &n));
    CHECK(memcmp(pl, both, sizeof pl) == 0);
    OK(kvr_partition_hash_tokens(pplain, NULL, 0, T, NT, pl, ps, NB, &n));
    CHECK(memcmp(pl, L, sizeof pl) == 0 && memcmp(ps, S, sizeof ps) == 0);
    OK(kvr_partition_hash_tokens(pplain, "ad", 2, T, NT, pl, ps, NB, &n));
    CHECK(memcmp(pl, lora, sizeof pl) == 0 && memcmp(ps, lora_seq, sizeof ps) == 0);

    memset(pl, SENTINEL, sizeof pl);
    CHECK_ST(KVR_BUFFER_TOO_SMALL, kvr_partition_hash_tokens(pplain, NULL, 0, T, NT, pl, NULL, NB - 1, &n));
    CHECK_EQ(n, NB);
    CHECK(all_bytes(pl, sizeof pl, SENTINEL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_hash_tokens(NULL, NULL, 0, T, NT, pl, ps, NB, &n));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_hash_tokens(pplain, NULL, 0, T, NT, pl, ps, NB, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_hash_tokens(pplain, NULL, 0, NULL, NT, pl, ps, NB, &n));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_hash_tokens(pplain, NULL, 1, T, NT, pl, ps, NB, &n));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_partition_hash_tokens(pplain, BAD_UTF8, BAD_UTF8_LEN, T, NT, pl, ps, NB, &n));
    OK(kvr_partition_hash_tokens(pplain, NULL, 0, NULL, 0, pl, ps, NB, &n));
    CHECK_EQ(n, 0);

    /* A namespaced partition's token selection finds blocks stored under its own hashes
       (worker 1), not under the plain ones (worker 2). */
    add_worker(pns, 1);
    add_worker(pns, 2);
    OK(store(pns, 1, 0, KVR_TIER_DEVICE, false, 0, 1, ns, NB, NULL));
    OK(store(pns, 2, 0, KVR_TIER_DEVICE, false, 0, 1, L, NB, NULL));
    kvr_request *r = new_request(T, NT);
    kvr_decision d;
    OK(kvr_partition_select(pns, r, &d));
    CHECK_EQ(d.worker_id, 1);
    CHECK_EQ(d.device_blocks, NB);
    kvr_request_free(r);

    kvr_partition_free(pns);
    kvr_partition_free(pplain);
    kvr_engine_free(e);
}

typedef kvr_status (*f64_setter)(kvr_partition_options *, double);

static void test_options(void)
{
    g_section = "options";
    kvr_engine_options *eo = NULL;
    CHECK_ST(KVR_ERR_NULL, kvr_engine_options_new(NULL));
    OK(kvr_engine_options_new(&eo));
    CHECK(eo != NULL);
    OK(kvr_engine_options_set_seed(eo, 7));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_options_set_seed(NULL, 7));
    kvr_engine_options_free(eo);

    kvr_partition_options *o = (kvr_partition_options *)(uintptr_t)1; /* must stay untouched */
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_new(0, &o));
    CHECK(o == (kvr_partition_options *)(uintptr_t)1);
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_new(16, NULL));
    OK(kvr_partition_options_new(1, &o));
    kvr_partition_options_free(o);
    OK(kvr_partition_options_new(16, &o));

    const f64_setter setters[] = {
        kvr_partition_options_set_overlap_score_credit,
        kvr_partition_options_set_prefill_load_scale,
        kvr_partition_options_set_host_cache_hit_weight,
        kvr_partition_options_set_disk_cache_hit_weight,
        kvr_partition_options_set_shared_cache_multiplier,
        kvr_partition_options_set_temperature,
        kvr_partition_options_set_decode_active_request_weight,
        kvr_partition_options_set_credit_decay,
        kvr_partition_options_set_busy_decode_blocks_fraction,
        kvr_partition_options_set_busy_prefill_tokens_fraction,
    };
    for (size_t i = 0; i < sizeof setters / sizeof setters[0]; i++) {
        OK(setters[i](o, 0.5));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT, setters[i](o, NAN));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT, setters[i](o, INFINITY));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT, setters[i](o, -INFINITY));
        CHECK_ST(KVR_ERR_NULL, setters[i](NULL, 0.5));
    }
    /* The named calls, for the header-coverage check (run.sh greps for every function). */
    OK(kvr_partition_options_set_overlap_score_credit(o, 1.0));
    OK(kvr_partition_options_set_prefill_load_scale(o, 1.0));
    OK(kvr_partition_options_set_host_cache_hit_weight(o, 0.75));
    OK(kvr_partition_options_set_disk_cache_hit_weight(o, 0.25));
    OK(kvr_partition_options_set_shared_cache_multiplier(o, 0.0));
    OK(kvr_partition_options_set_temperature(o, 0.0));
    OK(kvr_partition_options_set_decode_active_request_weight(o, 0.0));
    OK(kvr_partition_options_set_credit_decay(o, 0.0));
    OK(kvr_partition_options_set_busy_decode_blocks_fraction(o, 0.9));
    OK(kvr_partition_options_set_busy_prefill_tokens_fraction(o, 0.9));
    /* A negative fraction would make every rank busy: refused. */
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_busy_decode_blocks_fraction(o, -0.1));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_busy_prefill_tokens_fraction(o, -1.0));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_busy_prefill_tokens_fraction(NULL, -1.0));
    OK(kvr_partition_options_set_busy_decode_blocks_fraction(o, 0.0));
    OK(kvr_partition_options_set_busy_decode_blocks_fraction(o, 0.9));

    OK(kvr_partition_options_set_busy_prefill_tokens(o, 100));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_busy_prefill_tokens(NULL, 100));
    OK(kvr_partition_options_set_booking_ttl_ms(o, 1000));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_booking_ttl_ms(o, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_booking_ttl_ms(NULL, 1000));
    OK(kvr_partition_options_set_cache_namespace(o, "ns", 2));
    OK(kvr_partition_options_set_cache_namespace(o, NULL, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_cache_namespace(o, NULL, 2));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_cache_namespace(o, BAD_UTF8, BAD_UTF8_LEN));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_cache_namespace(NULL, "ns", 2));

    /* Options are only read: a partition made from them has their block size, and later
       changes do not reach it. */
    kvr_engine *e = new_engine(2);
    kvr_partition *p = NULL;
    OK(kvr_engine_create_partition(e, "m", 1, "g", 1, o, &p));
    kvr_partition_options_free(o);
    uint32_t bs = 0;
    OK(kvr_partition_block_size(p, &bs));
    CHECK_EQ(bs, 16);
    CHECK_ST(KVR_ERR_NULL, kvr_partition_block_size(p, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_block_size(NULL, &bs));
    kvr_partition_free(p);
    kvr_engine_free(e);
}

static void test_engine_and_partitions(void)
{
    g_section = "engine/partitions";
    kvr_engine *e = NULL;
    OK(kvr_engine_new(NULL, &e)); /* NULL options = defaults */
    CHECK(e != NULL);

    uint64_t a = 0, b = 0;
    OK(kvr_engine_mint_selection_id(e, &a));
    OK(kvr_engine_mint_selection_id(e, &b));
    CHECK(a != 0 && b != 0 && a != b);
    CHECK_ST(KVR_ERR_NULL, kvr_engine_mint_selection_id(e, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_mint_selection_id(NULL, &a));

    kvr_partition_options *o = new_opts(8);
    kvr_partition *p = NULL, *q = NULL;
    CHECK_ST(KVR_ERR_NULL, kvr_engine_create_partition(NULL, "m", 1, "g", 1, o, &p));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_create_partition(e, "m", 1, "g", 1, NULL, &p));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_create_partition(e, "m", 1, "g", 1, o, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_create_partition(e, NULL, 1, "g", 1, o, &p));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_create_partition(e, "m", 1, NULL, 1, o, &p));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_engine_create_partition(e, BAD_UTF8, BAD_UTF8_LEN, "g", 1, o, &p));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_engine_create_partition(e, "m", 1, BAD_UTF8, BAD_UTF8_LEN, o, &p));
    CHECK(p == NULL);
    OK(kvr_engine_create_partition(e, "m", 1, "g", 1, o, &p));
    CHECK(p != NULL);
    /* Duplicate: refused, *out untouched. */
    CHECK_ST(KVR_ERR_PARTITION_EXISTS, kvr_engine_create_partition(e, "m", 1, "g", 1, o, &q));
    CHECK(q == NULL);
    /* Same model, other group; and the empty key (NULL, 0) is a valid name. */
    kvr_partition *p2 = NULL, *pe = NULL;
    OK(kvr_engine_create_partition(e, "m", 1, "g2", 2, o, &p2));
    OK(kvr_engine_create_partition(e, NULL, 0, NULL, 0, o, &pe));
    kvr_partition_options_free(o);

    /* get_partition: another handle to the same partition. */
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION, kvr_engine_get_partition(e, "x", 1, "g", 1, &q));
    CHECK(q == NULL);
    CHECK_ST(KVR_ERR_NULL, kvr_engine_get_partition(NULL, "m", 1, "g", 1, &q));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_get_partition(e, "m", 1, "g", 1, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_get_partition(e, NULL, 1, "g", 1, &q));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_engine_get_partition(e, BAD_UTF8, BAD_UTF8_LEN, "g", 1, &q));
    OK(kvr_engine_get_partition(e, "m", 1, "g", 1, &q));
    CHECK(q != NULL && q != p);
    uint64_t h[2];
    size_t n = 0;
    uint32_t toks[16];
    for (uint32_t i = 0; i < 16; i++) {
        toks[i] = 500 + i;
    }
    OK(kvr_partition_hash_tokens(p, NULL, 0, toks, 16, h, NULL, 2, &n));
    OK(store(p, 9, 0, KVR_TIER_DEVICE, false, 0, 1, h, 2, NULL));
    kvr_overlap ov[4];
    OK(kvr_partition_find_matches(q, h, 2, ov, 4, &n)); /* written via p, read via q */
    CHECK_EQ(n, 1);
    CHECK(n == 1 && ov[0].worker_id == 9 && ov[0].device_blocks == 2);
    OK(kvr_partition_find_matches(p2, h, 2, ov, 4, &n)); /* partitions are separate */
    CHECK_EQ(n, 0);

    /* remove_partition: errors first. */
    CHECK_ST(KVR_ERR_NULL, kvr_engine_remove_partition(NULL, "m", 1, "g", 1));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_remove_partition(e, NULL, 1, "g", 1));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_engine_remove_partition(e, "m", 1, BAD_UTF8, BAD_UTF8_LEN));
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION, kvr_engine_remove_partition(e, "nope", 4, "g", 1));
    OK(kvr_engine_remove_partition(e, NULL, 0, NULL, 0));
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION, kvr_engine_remove_partition(e, NULL, 0, NULL, 0));

    kvr_partition_free(q);
    kvr_partition_free(p2);
    kvr_partition_free(pe);
    /* Freeing the engine first: partition handles keep it alive. */
    kvr_engine_free(e);
    add_worker(p, 9);
    kvr_request *r = new_request(toks, 16);
    kvr_decision d;
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK_EQ(d.worker_id, 9);
    CHECK_EQ(d.device_blocks, 2);
    CHECK_EQ(d.cached_tokens, 16);
    kvr_request_free(r);
    kvr_partition_free(p); /* the engine (and the booking) go with the last handle */
}

static void test_workers(void)
{
    g_section = "workers";
    kvr_worker *w = (kvr_worker *)(uintptr_t)1;
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_new(7, 0, &w));
    CHECK(w == (kvr_worker *)(uintptr_t)1);
    /* A caller's dp_size drives per-rank allocations: bounded, never an abort. */
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_new(7, UINT32_MAX, &w));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_new(7, KVR_MAX_DP_SIZE + 1, &w));
    CHECK(w == (kvr_worker *)(uintptr_t)1);
    CHECK_ST(KVR_ERR_NULL, kvr_worker_new(7, 1, NULL));
    OK(kvr_worker_new(7, 2, &w));

    OK(kvr_worker_set_role(w, KVR_ROLE_PREFILL));
    OK(kvr_worker_set_role(w, KVR_ROLE_DECODE));
    OK(kvr_worker_set_role(w, KVR_ROLE_AGGREGATED));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_set_role(w, 3));
    CHECK_ST(KVR_ERR_NULL, kvr_worker_set_role(NULL, KVR_ROLE_DECODE));

    OK(kvr_worker_set_control_endpoint(w, 0, "tcp://a:1", 9));
    OK(kvr_worker_set_control_endpoint(w, 1, "tcp://a:2", 9));
    OK(kvr_worker_set_control_endpoint(w, 1, NULL, 0)); /* clears */
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_set_control_endpoint(w, 2, "tcp://a:3", 9));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_set_control_endpoint(w, 0, BAD_UTF8, BAD_UTF8_LEN));
    CHECK_ST(KVR_ERR_NULL, kvr_worker_set_control_endpoint(w, 0, NULL, 4));
    CHECK_ST(KVR_ERR_NULL, kvr_worker_set_control_endpoint(NULL, 0, "x", 1));
    /* the handle is checked before the string */
    CHECK_ST(KVR_ERR_NULL, kvr_worker_set_control_endpoint(NULL, 0, "\xff", 1));

    OK(kvr_worker_set_total_kv_blocks(w, 1000));
    CHECK_ST(KVR_ERR_NULL, kvr_worker_set_total_kv_blocks(NULL, 1000));
    OK(kvr_worker_set_max_batched_tokens(w, 8192));
    CHECK_ST(KVR_ERR_NULL, kvr_worker_set_max_batched_tokens(NULL, 8192));

    OK(kvr_worker_add_lora_adapter(w, "ad", 2));
    OK(kvr_worker_add_lora_adapter(w, "ad", 2)); /* again: no duplicate, still OK */
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_add_lora_adapter(w, "", 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_add_lora_adapter(w, BAD_UTF8, BAD_UTF8_LEN));
    CHECK_ST(KVR_ERR_NULL, kvr_worker_add_lora_adapter(w, NULL, 2));
    CHECK_ST(KVR_ERR_NULL, kvr_worker_add_lora_adapter(NULL, "ad", 2));
    CHECK_ST(KVR_ERR_NULL, kvr_worker_add_lora_adapter(NULL, NULL, 0));

    OK(kvr_worker_set_label(w, "zone", 4, "a", 1));
    OK(kvr_worker_set_label(w, "zone", 4, "b", 1));
    OK(kvr_worker_set_label(w, "empty", 5, NULL, 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_set_label(w, BAD_UTF8, BAD_UTF8_LEN, "a", 1));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_set_label(w, "k", 1, BAD_UTF8, BAD_UTF8_LEN));
    CHECK_ST(KVR_ERR_NULL, kvr_worker_set_label(w, NULL, 1, "a", 1));
    CHECK_ST(KVR_ERR_NULL, kvr_worker_set_label(w, "k", 1, NULL, 1));
    CHECK_ST(KVR_ERR_NULL, kvr_worker_set_label(NULL, "k", 1, "a", 1));
    CHECK_ST(KVR_ERR_NULL, kvr_worker_set_label(NULL, "\xff", 1, "a", 1));

    kvr_engine *e = new_engine(3);
    kvr_partition *p = new_partition(e, "workers");
    CHECK_ST(KVR_ERR_NULL, kvr_partition_upsert_worker(NULL, w));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_upsert_worker(p, NULL));
    OK(kvr_partition_upsert_worker(p, w));
    kvr_worker_free(w); /* the partition took a copy */

    /* DP ranks are (7, 0) and (7, 1): rank 1 holds the prompt and is chosen. */
    OK(store(p, 7, 1, KVR_TIER_DEVICE, false, 0, 1, L, NB, NULL));
    kvr_request *r = new_request(T, NT);
    kvr_decision d;
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 7);
    CHECK_EQ(d.dp_rank, 1);
    CHECK_EQ(d.device_blocks, NB);

    /* Upsert replaces: with dp size 1, rank 1 is no longer a member. */
    OK(kvr_worker_new(7, 1, &w));
    OK(kvr_partition_upsert_worker(p, w));
    kvr_worker_free(w);
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.dp_rank, 0);
    CHECK_EQ(d.device_blocks, 0);
    CHECK_ST(KVR_ERR_UNKNOWN_RANK, kvr_partition_reserve(p, 7, 1, NULL, NULL, 0, &d));

    /* remove_worker drops it and its index entries. */
    CHECK_ST(KVR_ERR_UNKNOWN_WORKER, kvr_partition_remove_worker(p, 8));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_remove_worker(NULL, 7));
    OK(kvr_partition_remove_worker(p, 7));
    CHECK_ST(KVR_ERR_UNKNOWN_WORKER, kvr_partition_remove_worker(p, 7));
    CHECK_ST(KVR_NO_WORKER, kvr_partition_select(p, r, &d));
    kvr_overlap ov[2];
    size_t n = 9;
    OK(kvr_partition_find_matches(p, L, NB, ov, 2, &n));
    CHECK_EQ(n, 0);

    /* Load reports. */
    kvr_rank_load loads[2] = {
        {.worker_id = 7, .dp_rank = 0, .kv_blocks_used = 1, .kv_blocks_total = 10},
        {.worker_id = 7, .dp_rank = 0, .kv_blocks_used = 2, .kv_blocks_total = 10},
    };
    uint64_t v1 = 0, v2 = 0;
    /* Worker 7 was removed: its reports are skipped, never stored, and said so. */
    CHECK_ST(KVR_ERR_UNKNOWN_RANK, kvr_partition_publish_load(p, loads, 2, &v1));
    add_worker(p, 7);
    OK(kvr_partition_publish_load(p, loads, 2, &v1));
    OK(kvr_partition_publish_load(p, NULL, 0, &v2)); /* empty batch */
    CHECK(v2 > v1);
    OK(kvr_partition_publish_load(p, loads, 1, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_publish_load(p, NULL, 1, &v1));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_publish_load(NULL, loads, 1, &v1));
    loads[1].reserved = 1;
    uint64_t v3 = 12345;
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_publish_load(p, loads, 2, &v3));
    CHECK_EQ(v3, 12345); /* nothing published */
    OK(kvr_partition_publish_load(p, loads, 1, &v3));
    CHECK_EQ(v3, v2 + 2); /* the refused batch did not bump the version */

    kvr_request_free(r);
    kvr_partition_free(p);
    kvr_engine_free(e);
}

static void test_events_and_lookups(void)
{
    g_section = "events/lookups";
    kvr_engine *e = new_engine(4);
    kvr_partition *p = new_partition(e, "events");
    setup_standard(p);
    kvr_overlap ov[4];
    size_t n = 0;

    /* Device-only lookup: sorted by rank; worker 3 (nothing cached) is absent. */
    OK(kvr_partition_find_matches(p, L, NB, ov, 4, &n));
    CHECK_EQ(n, 2);
    CHECK(ov[0].worker_id == 1 && ov[0].dp_rank == 0 && ov[0].device_blocks == 3);
    CHECK(ov[0].host_blocks == 0 && ov[0].disk_blocks == 0);
    CHECK(ov[1].worker_id == 2 && ov[1].device_blocks == NB);
    /* Tiered lookup: 3 on device, then 2 in host memory, then 1 on disk. */
    OK(kvr_partition_find_matches_tiered(p, L, NB, ov, 4, &n));
    CHECK_EQ(n, 2);
    CHECK(ov[0].worker_id == 1 && ov[0].device_blocks == 3 && ov[0].host_blocks == 2 &&
          ov[0].disk_blocks == 1);
    CHECK(ov[1].worker_id == 2 && ov[1].device_blocks == NB && ov[1].host_blocks == 0 &&
          ov[1].disk_blocks == 0);
    /* A prefix of the prompt; a prompt that diverges after block 1. */
    OK(kvr_partition_find_matches(p, L, 2, ov, 4, &n));
    CHECK(n == 2 && ov[0].device_blocks == 2 && ov[1].device_blocks == 2);
    uint64_t diverged[3] = {L[0], L[1], 42};
    OK(kvr_partition_find_matches(p, diverged, 3, ov, 4, &n));
    CHECK(n == 2 && ov[0].device_blocks == 2 && ov[1].device_blocks == 2);
    uint64_t other[2] = {42, L[1]}; /* block 1 equal, block 0 not: no match */
    OK(kvr_partition_find_matches(p, other, 2, ov, 4, &n));
    CHECK_EQ(n, 0);

    /* Buffers: too small = status + count needed + nothing written; cap 0 asks the size. */
    memset(ov, SENTINEL, sizeof ov);
    CHECK_ST(KVR_BUFFER_TOO_SMALL, kvr_partition_find_matches(p, L, NB, ov, 1, &n));
    CHECK_EQ(n, 2);
    CHECK(all_bytes(ov, sizeof ov, SENTINEL));
    CHECK_ST(KVR_BUFFER_TOO_SMALL, kvr_partition_find_matches_tiered(p, L, NB, ov, 1, &n));
    CHECK_EQ(n, 2);
    CHECK(all_bytes(ov, sizeof ov, SENTINEL));
    n = 0;
    CHECK_ST(KVR_BUFFER_TOO_SMALL, kvr_partition_find_matches(p, L, NB, NULL, 0, &n));
    CHECK_EQ(n, 2);
    n = 0;
    CHECK_ST(KVR_BUFFER_TOO_SMALL, kvr_partition_find_matches_tiered(p, L, NB, NULL, 0, &n));
    CHECK_EQ(n, 2);
    OK(kvr_partition_find_matches(p, NULL, 0, NULL, 0, &n)); /* empty prompt */
    CHECK_EQ(n, 0);
    OK(kvr_partition_find_matches_tiered(p, NULL, 0, NULL, 0, &n));
    CHECK_EQ(n, 0);
    CHECK_ST(KVR_ERR_NULL, kvr_partition_find_matches(p, NULL, 2, ov, 4, &n));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_find_matches(p, L, NB, NULL, 4, &n));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_find_matches(p, L, NB, ov, 4, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_find_matches(NULL, L, NB, ov, 4, &n));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_find_matches_tiered(p, NULL, 2, ov, 4, &n));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_find_matches_tiered(p, L, NB, NULL, 4, &n));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_find_matches_tiered(p, L, NB, ov, 4, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_find_matches_tiered(NULL, L, NB, ov, 4, &n));

    /* Index statistics of the standard layout. */
    kvr_index_stats st;
    memset(&st, SENTINEL, sizeof st);
    OK(kvr_partition_index_stats(p, &st));
    CHECK_EQ(st.ranks, 2);
    CHECK_EQ(st.nodes, NB);
    CHECK_EQ(st.holder_blocks, 12);
    CHECK_EQ(st.tier_blocks[0], 9);
    CHECK_EQ(st.tier_blocks[1], 2);
    CHECK_EQ(st.tier_blocks[2], 1);
    CHECK(st.bytes > 0);
    CHECK_EQ(st.stored_events, 4);
    CHECK_EQ(st.removed_events, 0);
    CHECK_EQ(st.cleared_events, 0);
    CHECK_EQ(st.parent_not_found, 0);
    CHECK_EQ(st.block_not_found, 0);
    CHECK_EQ(st.too_many_ranks, 0);
    CHECK_ST(KVR_ERR_NULL, kvr_partition_index_stats(p, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_index_stats(NULL, &st));

    /* A repeated store changes nothing. */
    kvr_apply_result res;
    memset(&res, SENTINEL, sizeof res);
    OK(store(p, 2, 0, KVR_TIER_DEVICE, false, 0, 201, L, NB, &res));
    CHECK(res.events_applied == 1 && res.events_rejected == 0 && res.blocks_stored == 0);

    /* Removing a middle block leaves a hole: the device prefix stops before it. Unknown
       hashes are counted, not an error. */
    uint64_t rm[2] = {203, 999};
    memset(&res, SENTINEL, sizeof res);
    OK(remove_blocks(p, 2, 0, KVR_TIER_DEVICE, rm, 2, &res));
    CHECK_EQ(res.events_applied, 1);
    CHECK_EQ(res.blocks_removed, 1);
    CHECK_EQ(res.blocks_not_found, 1);
    CHECK_EQ(res.blocks_stored, 0);
    OK(kvr_partition_find_matches(p, L, NB, ov, 4, &n));
    CHECK(n == 2 && ov[1].worker_id == 2 && ov[1].device_blocks == 2);
    /* Storing block 2 again (parent 202) closes the hole. */
    OK(store(p, 2, 0, KVR_TIER_DEVICE, true, 202, 203, L + 2, 1, &res));
    CHECK_EQ(res.blocks_stored, 1);
    OK(kvr_partition_find_matches(p, L, NB, ov, 4, &n));
    CHECK(n == 2 && ov[1].device_blocks == NB);
    /* Removing the host tier's blocks of worker 1 shortens only its host run. */
    uint64_t rm_host[1] = {105};
    OK(remove_blocks(p, 1, 0, KVR_TIER_HOST, rm_host, 1, &res));
    CHECK_EQ(res.blocks_removed, 1);
    OK(kvr_partition_find_matches_tiered(p, L, NB, ov, 4, &n));
    CHECK(n == 2 && ov[0].device_blocks == 3 && ov[0].host_blocks == 1 && ov[0].disk_blocks == 0);
    /* Removed from the wrong tier: not found there. */
    uint64_t rm_dev[1] = {101};
    OK(remove_blocks(p, 1, 0, KVR_TIER_DISK, rm_dev, 1, &res));
    CHECK(res.blocks_removed == 0 && res.blocks_not_found == 1);

    /* A rank whose first block is only in host memory: tiered yes, device lookup no. */
    OK(store(p, 3, 0, KVR_TIER_HOST, false, 0, 301, L, 2, NULL));
    OK(kvr_partition_find_matches(p, L, NB, ov, 4, &n));
    CHECK(n == 2 && find_ov(ov, n, 3, 0) < 0);
    OK(kvr_partition_find_matches_tiered(p, L, NB, ov, 4, &n));
    CHECK_EQ(n, 3);
    int i3 = find_ov(ov, n, 3, 0);
    CHECK(i3 >= 0 && ov[i3].device_blocks == 0 && ov[i3].host_blocks == 2 && ov[i3].disk_blocks == 0);

    /* Parent not found: that event is refused, the rest of the batch still applies. */
    kvr_stored_block b0 = {.external_hash = 401, .local_hash = L[0]};
    kvr_stored_block b1 = {.external_hash = 402, .local_hash = L[1]};
    kvr_event batch[3] = {
        {.kind = KVR_EVENT_STORED, .tier = KVR_TIER_DEVICE, .has_parent = 1, .parent = 777,
         .blocks = &b1, .n_blocks = 1},
        {.kind = KVR_EVENT_STORED, .tier = KVR_TIER_DEVICE, .blocks = &b0, .n_blocks = 1},
        {.kind = KVR_EVENT_STORED, .tier = KVR_TIER_DEVICE, .has_parent = 1, .parent = 401,
         .blocks = &b1, .n_blocks = 1},
    };
    memset(&res, SENTINEL, sizeof res);
    CHECK_ST(KVR_ERR_PARENT_NOT_FOUND, kvr_partition_apply_events(p, 4, 0, batch, 3, &res));
    CHECK_EQ(res.events_applied, 2);
    CHECK_EQ(res.events_rejected, 1);
    CHECK_EQ(res.blocks_stored, 2);
    CHECK_EQ(res.blocks_removed, 0);
    CHECK_EQ(res.blocks_not_found, 0);
    OK(kvr_partition_find_matches(p, L, NB, ov, 4, &n));
    int i4 = find_ov(ov, n, 4, 0);
    CHECK(i4 >= 0 && ov[i4].device_blocks == 2); /* the rank need not be a registered worker */
    OK(kvr_partition_index_stats(p, &st));
    CHECK_EQ(st.parent_not_found, 1);
    CHECK_EQ(st.block_not_found, 2);
    CHECK_EQ(st.removed_events, 3);
    CHECK_ST(KVR_ERR_PARENT_NOT_FOUND, kvr_partition_apply_events(p, 4, 0, batch, 1, NULL));

    /* A malformed batch is refused whole: nothing of it applies. */
    kvr_stored_block b2 = {.external_hash = 403, .local_hash = L[2]};
    kvr_event bad[2] = {
        {.kind = KVR_EVENT_STORED, .tier = KVR_TIER_DEVICE, .has_parent = 1, .parent = 402,
         .blocks = &b2, .n_blocks = 1},
        {.kind = 9},
    };
    kvr_index_stats before, after;
    OK(kvr_partition_index_stats(p, &before));
    memset(&res, SENTINEL, sizeof res);
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_apply_events(p, 4, 0, bad, 2, &res));
    bad[1] = (kvr_event){.kind = KVR_EVENT_STORED, .tier = 3, .blocks = &b0, .n_blocks = 1};
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_apply_events(p, 4, 0, bad, 2, &res));
    bad[1] = (kvr_event){.kind = KVR_EVENT_REMOVED, .tier = 7, .removed = rm, .n_removed = 1};
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_apply_events(p, 4, 0, bad, 2, &res));
    bad[1] = (kvr_event){.kind = KVR_EVENT_CLEARED, .reserved = 1};
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_apply_events(p, 4, 0, bad, 2, &res));
    bad[1] = (kvr_event){.kind = KVR_EVENT_STORED, .tier = KVR_TIER_DEVICE, .blocks = NULL, .n_blocks = 2};
    CHECK_ST(KVR_ERR_NULL, kvr_partition_apply_events(p, 4, 0, bad, 2, &res));
    bad[1] = (kvr_event){.kind = KVR_EVENT_REMOVED, .tier = KVR_TIER_DEVICE, .removed = NULL, .n_removed = 1};
    CHECK_ST(KVR_ERR_NULL, kvr_partition_apply_events(p, 4, 0, bad, 2, &res));
    OK(kvr_partition_index_stats(p, &after));
    CHECK(memcmp(&before, &after, sizeof before) == 0);
    OK(kvr_partition_find_matches(p, L, NB, ov, 4, &n));
    i4 = find_ov(ov, n, 4, 0);
    CHECK(i4 >= 0 && ov[i4].device_blocks == 2);
    /* Empty slices are fine: (NULL, 0) batch, events with (NULL, 0) arrays; the tier of a
       Cleared event is ignored. */
    OK(kvr_partition_apply_events(p, 4, 0, NULL, 0, NULL));
    kvr_event empty[2] = {
        {.kind = KVR_EVENT_STORED, .tier = KVR_TIER_DEVICE},
        {.kind = KVR_EVENT_REMOVED, .tier = KVR_TIER_DISK},
    };
    OK(kvr_partition_apply_events(p, 4, 0, empty, 2, &res));
    CHECK(res.events_applied == 2 && res.blocks_stored == 0 && res.blocks_removed == 0);
    CHECK_ST(KVR_ERR_NULL, kvr_partition_apply_events(p, 4, 0, NULL, 1, &res));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_apply_events(NULL, 4, 0, empty, 2, &res));

    /* Cleared drops everything the rank holds, on every tier. */
    kvr_event clear = {.kind = KVR_EVENT_CLEARED, .tier = 99};
    OK(kvr_partition_apply_events(p, 1, 0, &clear, 1, &res));
    CHECK_EQ(res.blocks_removed, 5); /* 3 device + 1 host + 1 disk left */
    OK(kvr_partition_find_matches_tiered(p, L, NB, ov, 4, &n));
    CHECK(find_ov(ov, n, 1, 0) < 0 && find_ov(ov, n, 2, 0) >= 0);
    OK(kvr_partition_index_stats(p, &st));
    CHECK_EQ(st.cleared_events, 1);

    kvr_partition_free(p);
    kvr_engine_free(e);
}

static void test_selection_cost(void)
{
    g_section = "selection/cost";
    kvr_engine *e = new_engine(5);
    kvr_partition *p = new_partition(e, "cost");
    setup_standard(p);
    kvr_request *r = new_request(T, NT);
    kvr_decision d;

    /* Worker 2 holds the whole prompt: lowest cost. */
    memset(&d, SENTINEL, sizeof d);
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 2);
    CHECK_EQ(d.dp_rank, 0);
    CHECK_EQ(d.device_blocks, NB);
    CHECK_EQ(d.host_blocks, 0);
    CHECK_EQ(d.disk_blocks, 0);
    CHECK_EQ(d.shared_blocks, 0);
    CHECK_EQ(d.flags, 0);
    CHECK_EQ(d.selection_id, 0); /* advisory */
    CHECK_EQ(d.cached_tokens, NT);
    CHECK_EQ(d.projected_prefill_tokens, 0);
    CHECK_EQ(d.projected_decode_blocks, NB);
    CHECK_COST(d.cost, 6.0);

    /* The same prompt as local hashes. */
    kvr_request *rh = NULL;
    OK(kvr_request_new(&rh));
    OK(kvr_request_set_local_hashes(rh, L, NB, NT));
    OK(kvr_partition_select(p, rh, &d));
    CHECK(d.worker_id == 2 && d.device_blocks == NB && d.cached_tokens == NT);
    CHECK_COST(d.cost, 6.0);
    /* Hashes with a longer prompt length: prefill counts the extra (partial-block) tokens. */
    OK(kvr_request_set_local_hashes(rh, L, NB, NT + 2));
    OK(kvr_partition_select(p, rh, &d));
    CHECK(d.worker_id == 2 && d.cached_tokens == NT && d.projected_prefill_tokens == 2);
    CHECK_COST(d.cost, 6.5);

    /* Allow-sets: {1, 3} -> worker 1 (tiered credit); {3} -> worker 3. */
    const uint64_t a13[2] = {1, 3}, a3[1] = {3}, a1[1] = {1};
    OK(kvr_request_set_allowed_workers(r, a13, 2));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 1);
    CHECK(d.device_blocks == 3 && d.host_blocks == 2 && d.disk_blocks == 1);
    CHECK_EQ(d.cached_tokens, 12);
    CHECK_EQ(d.projected_prefill_tokens, 12);
    CHECK_COST(d.cost, 7.25);
    OK(kvr_request_set_allowed_workers(r, a3, 1));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 3);
    CHECK_EQ(d.device_blocks, 0);
    CHECK_EQ(d.projected_prefill_tokens, NT);
    CHECK_COST(d.cost, 12.0);

    /* Pins: an allowed pin wins over a better cache; a pin outside the allow-set does not
       survive. */
    OK(kvr_request_reset(r));
    OK(kvr_request_set_tokens(r, T, NT));
    OK(kvr_request_set_pinned_worker(r, 3));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 3);
    OK(kvr_request_set_allowed_workers(r, a1, 1));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 1);
    OK(kvr_request_set_pinned_worker(r, 99)); /* not a member */
    OK(kvr_request_set_allowed_workers(r, a13, 2));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 1);

    /* Per-request overrides: credit 0 makes caches worthless (w2: 6 + 6 = 12 = w3). */
    OK(kvr_request_reset(r));
    OK(kvr_request_set_tokens(r, T, NT));
    OK(kvr_request_set_overrides(r, 0.0, NAN, NAN, NAN));
    OK(kvr_request_set_allowed_workers(r, a13, 2)); /* w1: 6 - (1.5 + 0.25) + 6 = 10.25 */
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 1);
    CHECK_COST(d.cost, 10.25);
    /* A refused override (infinite) leaves the previous ones in place. */
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_overrides(r, NAN, INFINITY, NAN, NAN));
    OK(kvr_partition_select(p, r, &d));
    CHECK_COST(d.cost, 10.25);
    OK(kvr_request_set_overrides(r, NAN, 2.0, NAN, NAN)); /* 2 * 1.25 + 6 */
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 1);
    CHECK_COST(d.cost, 8.5);
    OK(kvr_request_set_overrides(r, NAN, NAN, NAN, NAN));
    OK(kvr_partition_select(p, r, &d));
    CHECK_COST(d.cost, 7.25);

    /* Temperature 0: always the argmin. Temperature 1 (override): softmax, the worse rank
       (w3, cost 12 vs 6) has p = e^-1 / (1 + e^-1) ~ 0.27 per pick. */
    const uint64_t a23[2] = {2, 3};
    OK(kvr_request_reset(r));
    OK(kvr_request_set_tokens(r, T, NT));
    OK(kvr_request_set_allowed_workers(r, a23, 2));
    int picks[4] = {0};
    for (int i = 0; i < 100; i++) {
        if (kvr_partition_select(p, r, &d) == KVR_OK && d.worker_id < 4) {
            picks[d.worker_id]++;
        }
    }
    CHECK_EQ(picks[2], 100);
    OK(kvr_request_set_overrides(r, NAN, NAN, 1.0, NAN));
    memset(picks, 0, sizeof picks);
    for (int i = 0; i < 300; i++) {
        if (kvr_partition_select(p, r, &d) == KVR_OK && d.worker_id < 4) {
            picks[d.worker_id]++;
        }
    }
    CHECK_EQ(picks[2] + picks[3], 300);
    CHECK(picks[3] >= 30 && picks[3] <= 150); /* expected ~81; P(outside) < 1e-9 */
    CHECK(picks[2] > picks[3]);

    /* Ties at temperature 0 break uniformly at random. */
    kvr_request *ru = new_request(U, NT);
    memset(picks, 0, sizeof picks);
    OK(kvr_request_set_allowed_workers(ru, a13, 2));
    for (int i = 0; i < 100; i++) {
        if (kvr_partition_select(p, ru, &d) == KVR_OK && d.worker_id < 4) {
            picks[d.worker_id]++;
        }
    }
    CHECK_EQ(picks[1] + picks[3], 100);
    CHECK(picks[1] >= 20 && picks[3] >= 20);
    kvr_request_free(ru);

    /* Advisory selection booked nothing. */
    kvr_booking_stats bs = booking_stats(p);
    CHECK_EQ(bs.bookings, 0);
    CHECK_EQ(bs.tracked_ranks, 3); /* the three registered ranks, from registration on */
    CHECK_EQ(bs.sweeper_started, 0);
    CHECK_LOAD(p, 2, 0, 0, 0, 0);
    kvr_selection_stats ss = selection_stats(p);
    CHECK(ss.selections >= 500 && ss.busy == 0 && ss.no_worker == 0 && ss.shared_cache_failures == 0 &&
          ss.stale_overlaps_ignored == 0);

    /* Argument errors: out untouched. */
    memset(&d, SENTINEL, sizeof d);
    CHECK_ST(KVR_ERR_NULL, kvr_partition_select(NULL, r, &d));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_select(p, NULL, &d));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_select(p, r, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_select_and_reserve(NULL, r, &d));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_select_and_reserve(p, NULL, &d));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_select_and_reserve(p, r, NULL));
    CHECK(all_bytes(&d, sizeof d, SENTINEL));
    CHECK_EQ(booking_stats(p).bookings, 0);

    kvr_request_free(rh);
    kvr_request_free(r);
    kvr_partition_free(p);
    kvr_engine_free(e);
}

/* Cost knobs set through the partition options change the numbers as REFERENCE.md §3 says. */
static void test_option_effects(void)
{
    g_section = "option effects";
    kvr_engine *e = new_engine(6);
    kvr_request *r = new_request(T, NT);
    kvr_decision d;
    const uint64_t a1[1] = {1}, a2[1] = {2}, a3[1] = {3};

    kvr_partition_options *o = new_opts(BS);
    OK(kvr_partition_options_set_prefill_load_scale(o, 2.0));
    OK(kvr_partition_options_set_host_cache_hit_weight(o, 0.5));
    OK(kvr_partition_options_set_disk_cache_hit_weight(o, 0.0));
    OK(kvr_partition_options_set_overlap_score_credit(o, 0.5));
    kvr_partition *p = new_partition_with(e, "knobs", o);
    setup_standard(p);
    OK(kvr_request_set_allowed_workers(r, a3, 1));
    OK(kvr_partition_select(p, r, &d)); /* 2 * 6 + 6 */
    CHECK_COST(d.cost, 18.0);
    OK(kvr_request_set_allowed_workers(r, a2, 1));
    OK(kvr_partition_select(p, r, &d)); /* 2 * (6 - 0.5 * 6) + 6 */
    CHECK_COST(d.cost, 12.0);
    OK(kvr_request_set_allowed_workers(r, a1, 1));
    OK(kvr_partition_select(p, r, &d)); /* 2 * (6 - (1.5 + 1 + 0)) + 6 */
    CHECK_COST(d.cost, 13.0);
    kvr_partition_free(p);

    /* decode_active_request_weight: 10 per active request of the rank. */
    o = new_opts(BS);
    OK(kvr_partition_options_set_decode_active_request_weight(o, 10.0));
    p = new_partition_with(e, "requests", o);
    add_worker(p, 1);
    OK(kvr_request_reset(r));
    OK(kvr_request_set_tokens(r, T, NT));
    OK(kvr_partition_select(p, r, &d));
    CHECK_COST(d.cost, 12.0);
    const uint64_t zero = 0;
    kvr_decision one;
    OK(kvr_partition_reserve(p, 1, 0, NULL, &zero, 0, &one)); /* one request, no tokens */
    CHECK_LOAD(p, 1, 0, 0, 0, 1);
    OK(kvr_partition_select(p, r, &d));
    CHECK_COST(d.cost, 22.0);
    CHECK_ST(KVR_ERR_UNKNOWN_SELECTION_ID, kvr_engine_free_booking(e, 0, NULL)); /* never an id */
    OK(kvr_engine_free_booking(e, one.selection_id, NULL));
    OK(kvr_partition_select(p, r, &d));
    CHECK_COST(d.cost, 12.0);
    kvr_partition_free(p);

    /* shared_cache_multiplier (option; the hook supplies the ranges). */
    o = new_opts(BS);
    OK(kvr_partition_options_set_shared_cache_multiplier(o, 1.0));
    p = new_partition_with(e, "shared", o);
    setup_standard(p);
    hook_ctx hc = {.shared_want = 1, .shared_end = NB};
    kvr_hooks h = {.user_data = &hc, .shared_cache = hook_shared};
    OK(kvr_partition_set_hooks(p, &h));
    OK(kvr_request_set_allowed_workers(r, a1, 1));
    OK(kvr_partition_select(p, r, &d)); /* credit 4.75 + 3 shared >= 6 */
    CHECK_EQ(d.shared_blocks, 3);
    CHECK_COST(d.cost, 6.0);
    OK(kvr_request_set_overrides(r, NAN, NAN, NAN, 0.0)); /* per-request: off again */
    OK(kvr_partition_select(p, r, &d));
    CHECK_COST(d.cost, 7.25);
    kvr_partition_free(p);

    /* credit_decay: a rank with more prefill backlog than the least-loaded candidate keeps
       only part of its device credit. Worker 1 caches the prompt and has 16 prefill tokens
       booked; worker 2 caches nothing and is idle.
         no decay: w1 = (16 + 24)/4 - 6 + 6 = 10 < w2 = 12 -> w1
         decay 1:  excess = 16/4 = 4 blocks, decay = 1/(1 + 4/6) = 0.6, credit 3.6:
                   w1 = 10 - 3.6 + 6 = 12.4 > 12 -> w2 */
    for (int with_decay = 0; with_decay < 2; with_decay++) {
        o = new_opts(BS);
        if (with_decay) {
            OK(kvr_partition_options_set_credit_decay(o, 1.0));
        }
        p = new_partition_with(e, with_decay ? "decay" : "nodecay", o);
        add_worker(p, 1);
        add_worker(p, 2);
        OK(store(p, 1, 0, KVR_TIER_DEVICE, false, 0, 1, L, NB, NULL));
        const uint64_t sixteen = 16;
        kvr_decision booked;
        OK(kvr_partition_reserve(p, 1, 0, NULL, &sixteen, 0, &booked));
        OK(kvr_request_reset(r));
        OK(kvr_request_set_tokens(r, T, NT));
        OK(kvr_partition_select(p, r, &d));
        CHECK_EQ(d.worker_id, with_decay ? 2 : 1);
        CHECK_COST(d.cost, with_decay ? 12.0 : 10.0);
        uint32_t how = 99;
        OK(kvr_engine_free_booking(e, booked.selection_id, &how));
        CHECK_EQ(how, KVR_FREED_NOW);
        kvr_partition_free(p);
    }

    /* temperature as an option: > 0 spreads picks over unequal costs. */
    o = new_opts(BS);
    OK(kvr_partition_options_set_temperature(o, 1.0));
    p = new_partition_with(e, "warm", o);
    setup_standard(p);
    const uint64_t a23[2] = {2, 3};
    OK(kvr_request_reset(r));
    OK(kvr_request_set_tokens(r, T, NT));
    OK(kvr_request_set_allowed_workers(r, a23, 2));
    int w3 = 0;
    for (int i = 0; i < 300; i++) {
        if (kvr_partition_select(p, r, &d) == KVR_OK && d.worker_id == 3) {
            w3++;
        }
    }
    CHECK(w3 >= 30 && w3 <= 150);
    OK(kvr_request_set_overrides(r, NAN, NAN, 0.0, NAN)); /* per-request T = 0 */
    w3 = 0;
    for (int i = 0; i < 50; i++) {
        if (kvr_partition_select(p, r, &d) == KVR_OK && d.worker_id == 3) {
            w3++;
        }
    }
    CHECK_EQ(w3, 0);
    kvr_partition_free(p);

    kvr_request_free(r);
    kvr_engine_free(e);
}

static void test_bookings(void)
{
    g_section = "bookings";
    kvr_engine *e = new_engine(7);
    kvr_partition *p = new_partition(e, "book");
    setup_standard(p);
    kvr_request *r = new_request(T, NT);
    kvr_decision d1, d2, d;
    uint32_t how;

    /* Booked selection on worker 1: prefill = 24 - 12 cached. */
    OK(kvr_request_set_pinned_worker(r, 1));
    OK(kvr_request_set_expected_output_tokens(r, 100)); /* recorded; adds no load itself */
    OK(kvr_request_set_ttl_ms(r, 60000));
    OK(kvr_partition_select_and_reserve(p, r, &d1));
    CHECK_EQ(d1.worker_id, 1);
    CHECK(d1.selection_id != 0);
    CHECK_EQ(d1.cached_tokens, 12);
    CHECK_EQ(d1.projected_prefill_tokens, 12);
    CHECK_EQ(d1.projected_decode_blocks, NB);
    CHECK_COST(d1.cost, 7.25);
    CHECK_LOAD(p, 1, 0, 12, NB, 1);
    CHECK_LOAD(p, 2, 0, 0, 0, 0);
    kvr_booking_stats bs = booking_stats(p);
    CHECK_EQ(bs.bookings, 1);
    CHECK_EQ(bs.tracked_ranks, 3); /* the registered ranks, booked or not */
    CHECK_EQ(bs.sweeper_started, 1);
    CHECK_EQ(bs.expired_total, 0);
    CHECK_EQ(bs.counter_underflows, 0);
    CHECK_EQ(bs.reserved, 0);

    /* A second booking of the same prompt on the same rank, with the caller's own id:
       prompt blocks are shared (counted once), prefill and requests add up. */
    const uint64_t my_id = UINT64_C(0x7000000000000001);
    OK(kvr_request_set_selection_id(r, my_id));
    OK(kvr_request_set_ttl_ms(r, 0));
    OK(kvr_partition_select_and_reserve(p, r, &d2));
    CHECK_EQ(d2.selection_id, my_id);
    CHECK_EQ(d2.projected_decode_blocks, NB); /* 6 active + 0 new */
    CHECK_LOAD(p, 1, 0, 24, NB, 2);
    /* The booking terms now weigh on worker 1: (24 + 24)/4 - 4.75 + 6 = 13.25. */
    OK(kvr_request_set_selection_id(r, 0));
    OK(kvr_partition_select(p, r, &d));
    CHECK_COST(d.cost, 13.25);

    /* Duplicate id: refused, nothing booked. */
    OK(kvr_request_set_selection_id(r, my_id));
    memset(&d, SENTINEL, sizeof d);
    CHECK_ST(KVR_ERR_DUPLICATE_SELECTION_ID, kvr_partition_select_and_reserve(p, r, &d));
    CHECK(all_bytes(&d, sizeof d, SENTINEL));
    CHECK_EQ(booking_stats(p).bookings, 2);
    CHECK_LOAD(p, 1, 0, 24, NB, 2);
    CHECK_ST(KVR_ERR_DUPLICATE_SELECTION_ID, kvr_partition_reserve(p, 2, 0, NULL, NULL, my_id, &d));
    CHECK_ST(KVR_ERR_DUPLICATE_SELECTION_ID, kvr_partition_reserve(p, 2, 0, r, NULL, 0, &d));
    CHECK_LOAD(p, 2, 0, 0, 0, 0);
    OK(kvr_request_set_selection_id(r, 0));

    /* Output blocks grow decode load; too many are refused. */
    OK(kvr_engine_add_output_blocks(e, d1.selection_id, 3));
    CHECK_LOAD(p, 1, 0, 24, NB + 3, 2);
    CHECK_ST(KVR_ERR_TOO_LARGE, kvr_engine_add_output_blocks(e, d1.selection_id, UINT64_C(1) << 41));
    CHECK_LOAD(p, 1, 0, 24, NB + 3, 2);
    CHECK_ST(KVR_ERR_UNKNOWN_SELECTION_ID, kvr_engine_add_output_blocks(e, 424242, 1));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_add_output_blocks(NULL, d1.selection_id, 1));

    /* Prefill complete: idempotent. */
    OK(kvr_engine_mark_prefill_complete(e, d1.selection_id));
    CHECK_LOAD(p, 1, 0, 12, NB + 3, 2);
    OK(kvr_engine_mark_prefill_complete(e, d1.selection_id));
    CHECK_LOAD(p, 1, 0, 12, NB + 3, 2);
    CHECK_ST(KVR_ERR_UNKNOWN_SELECTION_ID, kvr_engine_mark_prefill_complete(e, 424242));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_mark_prefill_complete(NULL, d1.selection_id));

    /* Free: the output blocks and the request go; the shared prompt blocks stay with d2. */
    how = 99;
    OK(kvr_engine_free_booking(e, d1.selection_id, &how));
    CHECK_EQ(how, KVR_FREED_NOW);
    CHECK_LOAD(p, 1, 0, 12, NB, 1);
    how = 99;
    OK(kvr_engine_free_booking(e, d1.selection_id, &how)); /* idempotent */
    CHECK_EQ(how, KVR_FREED_BY_CALLER);
    OK(kvr_engine_free_booking(e, d1.selection_id, NULL));
    CHECK_LOAD(p, 1, 0, 12, NB, 1);
    CHECK_ST(KVR_ERR_ALREADY_FREED, kvr_engine_add_output_blocks(e, d1.selection_id, 1));
    OK(kvr_engine_mark_prefill_complete(e, d1.selection_id)); /* freed recently: still OK */
    CHECK_LOAD(p, 1, 0, 12, NB, 1);
    how = 99;
    CHECK_ST(KVR_ERR_UNKNOWN_SELECTION_ID, kvr_engine_free_booking(e, 424242, &how));
    CHECK_EQ(how, 99);
    CHECK_ST(KVR_ERR_NULL, kvr_engine_free_booking(NULL, d2.selection_id, &how));

    OK(kvr_engine_free_booking(e, d2.selection_id, &how));
    CHECK_EQ(how, KVR_FREED_NOW);
    CHECK_LOAD(p, 1, 0, 0, 0, 0);
    bs = booking_stats(p);
    CHECK_EQ(bs.bookings, 0);
    CHECK_EQ(bs.counter_underflows, 0);
    /* A recently freed id cannot be booked again. */
    OK(kvr_request_set_selection_id(r, my_id));
    CHECK_ST(KVR_ERR_DUPLICATE_SELECTION_ID, kvr_partition_select_and_reserve(p, r, &d));
    CHECK_EQ(booking_stats(p).bookings, 0);
    OK(kvr_request_set_selection_id(r, 0));

    /* Load balancing: an uncached prompt, two idle workers. The first booking makes its
       rank cost (24 + 24)/4 + 6 = 18 > 12, so the second goes to the other. */
    kvr_request *ru = new_request(U, NT);
    const uint64_t a13[2] = {1, 3};
    OK(kvr_request_set_allowed_workers(ru, a13, 2));
    kvr_decision u1, u2;
    OK(kvr_partition_select_and_reserve(p, ru, &u1));
    OK(kvr_partition_select_and_reserve(p, ru, &u2));
    CHECK(u1.worker_id != u2.worker_id);
    CHECK((u1.worker_id == 1 || u1.worker_id == 3) && (u2.worker_id == 1 || u2.worker_id == 3));
    CHECK_COST(u1.cost, 12.0);
    CHECK_COST(u2.cost, 12.0);
    CHECK_LOAD(p, u1.worker_id, 0, NT, NB, 1);
    OK(kvr_engine_free_booking(e, u1.selection_id, NULL));
    OK(kvr_engine_free_booking(e, u2.selection_id, NULL));
    kvr_request_free(ru);

    /* Explicit reservations (no scoring). */
    kvr_decision x1, x2, x3;
    memset(&x1, SENTINEL, sizeof x1);
    OK(kvr_partition_reserve(p, 3, 0, r, NULL, 0, &x1));
    CHECK(x1.worker_id == 3 && x1.dp_rank == 0 && x1.selection_id != 0);
    CHECK(x1.device_blocks == 0 && x1.cached_tokens == 0 && x1.projected_prefill_tokens == NT);
    CHECK_EQ(x1.projected_decode_blocks, NB);
    CHECK(isnan(x1.cost));
    CHECK_LOAD(p, 3, 0, NT, NB, 1);
    OK(kvr_partition_reserve(p, 1, 0, r, NULL, 0, &x2)); /* worker 1 caches 3 blocks */
    CHECK(x2.device_blocks == 3 && x2.cached_tokens == 12 && x2.projected_prefill_tokens == 12);
    const uint64_t five = 5;
    const uint64_t explicit_id = UINT64_C(0x7000000000000002);
    OK(kvr_partition_reserve(p, 1, 0, NULL, &five, explicit_id, &x3)); /* no prompt */
    CHECK_EQ(x3.selection_id, explicit_id);
    CHECK(x3.projected_prefill_tokens == 5 && x3.device_blocks == 0);
    CHECK_LOAD(p, 1, 0, 17, NB, 2);
    /* The request's own id is used when the argument is 0. */
    kvr_decision x4;
    const uint64_t req_id = UINT64_C(0x7000000000000003);
    OK(kvr_request_set_selection_id(r, req_id));
    OK(kvr_partition_reserve(p, 2, 0, r, NULL, 0, &x4));
    CHECK_EQ(x4.selection_id, req_id);
    CHECK_EQ(x4.projected_prefill_tokens, 0); /* worker 2 caches everything */
    OK(kvr_request_set_selection_id(r, 0));
    /* Errors. */
    memset(&d, SENTINEL, sizeof d);
    CHECK_ST(KVR_ERR_UNKNOWN_RANK, kvr_partition_reserve(p, 99, 0, r, NULL, 0, &d));
    CHECK_ST(KVR_ERR_UNKNOWN_RANK, kvr_partition_reserve(p, 1, 1, r, NULL, 0, &d));
    const uint64_t huge = (UINT64_C(1) << 40) + 1;
    CHECK_ST(KVR_ERR_TOO_LARGE, kvr_partition_reserve(p, 1, 0, NULL, &huge, 0, &d));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_reserve(p, 1, 0, r, NULL, 0, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_reserve(NULL, 1, 0, r, NULL, 0, &d));
    CHECK(all_bytes(&d, sizeof d, SENTINEL));
    CHECK_LOAD(p, 1, 0, 17, NB, 2);
    /* Expected output over the per-booking limit: refused, nothing booked, the id freed
       for reuse. */
    OK(kvr_request_set_expected_output_tokens(r, huge));
    OK(kvr_request_set_selection_id(r, UINT64_C(0x7000000000000004)));
    CHECK_ST(KVR_ERR_TOO_LARGE, kvr_partition_select_and_reserve(p, r, &d));
    CHECK(all_bytes(&d, sizeof d, SENTINEL));
    CHECK_EQ(booking_stats(p).bookings, 4);
    OK(kvr_request_set_expected_output_tokens(r, 0));
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK_EQ(d.selection_id, UINT64_C(0x7000000000000004));
    OK(kvr_request_set_selection_id(r, 0));
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));

    /* Removing a worker frees its bookings ("rank removed"). */
    OK(kvr_partition_remove_worker(p, 3));
    CHECK_LOAD(p, 3, 0, 0, 0, 0);
    how = 99;
    OK(kvr_engine_free_booking(e, x1.selection_id, &how));
    CHECK_EQ(how, KVR_FREED_RANK_REMOVED);
    CHECK_ST(KVR_ERR_ALREADY_FREED, kvr_engine_add_output_blocks(e, x1.selection_id, 1));

    OK(kvr_engine_free_booking(e, x2.selection_id, NULL));
    OK(kvr_engine_free_booking(e, x3.selection_id, NULL));
    OK(kvr_engine_free_booking(e, x4.selection_id, NULL));
    CHECK_LOAD(p, 1, 0, 0, 0, 0);
    CHECK_LOAD(p, 2, 0, 0, 0, 0);
    bs = booking_stats(p);
    CHECK_EQ(bs.bookings, 0);
    CHECK_EQ(bs.counter_underflows, 0);
    CHECK_ST(KVR_ERR_NULL, kvr_partition_booking_stats(p, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_booking_stats(NULL, &bs));
    kvr_active_load al;
    CHECK_ST(KVR_ERR_NULL, kvr_partition_active_load(p, 1, 0, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_active_load(NULL, 1, 0, &al));
    CHECK_LOAD(p, 12345, 7, 0, 0, 0); /* a rank never seen: zeros */

    /* A live booking left at teardown is released with its partition (valgrind checks). */
    OK(kvr_partition_select_and_reserve(p, r, &d));

    kvr_request_free(r);
    kvr_partition_free(p);
    kvr_engine_free(e);
}

static void test_busy_and_no_worker(void)
{
    g_section = "busy/no-worker";
    kvr_engine *e = new_engine(8);
    kvr_request *r = new_request(U, 16); /* 4 blocks, cached nowhere: prefill 16 */
    kvr_decision d, b;
    kvr_selection_stats ss;

    /* No workers at all. */
    kvr_partition *p = new_partition(e, "empty");
    memset(&d, SENTINEL, sizeof d);
    CHECK_ST(KVR_NO_WORKER, kvr_partition_select(p, r, &d));
    CHECK_ST(KVR_NO_WORKER, kvr_partition_select_and_reserve(p, r, &d));
    CHECK(all_bytes(&d, sizeof d, SENTINEL));
    ss = selection_stats(p);
    CHECK_EQ(ss.no_worker, 2);
    CHECK_EQ(ss.selections, 2);
    CHECK_EQ(booking_stats(p).bookings, 0);
    CHECK_ST(KVR_ERR_NULL, kvr_partition_selection_stats(p, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_selection_stats(NULL, &ss));
    kvr_partition_free(p);

    /* Empty or foreign allow-sets. */
    p = new_partition(e, "allow");
    add_worker(p, 1);
    const uint64_t foreign[1] = {99};
    OK(kvr_request_set_allowed_workers(r, NULL, 0));
    CHECK_ST(KVR_NO_WORKER, kvr_partition_select(p, r, &d));
    OK(kvr_request_set_allowed_workers(r, foreign, 1));
    CHECK_ST(KVR_NO_WORKER, kvr_partition_select(p, r, &d));
    OK(kvr_request_set_pinned_worker(r, 99)); /* a pin does not widen the allow-set */
    CHECK_ST(KVR_NO_WORKER, kvr_partition_select(p, r, &d));
    OK(kvr_request_reset(r)); /* reset: every worker allowed again, and no prompt */
    OK(kvr_partition_select(p, r, &d));
    CHECK(d.worker_id == 1 && d.cached_tokens == 0 && d.projected_prefill_tokens == 0);
    OK(kvr_request_set_tokens(r, U, 16));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.projected_prefill_tokens, 16);
    CHECK_EQ(selection_stats(p).no_worker, 3);
    kvr_partition_free(p);

    /* Busy threshold on active prefill tokens (absolute): 16 > 10 after one booking. */
    kvr_partition_options *o = new_opts(BS);
    OK(kvr_partition_options_set_busy_prefill_tokens(o, 10));
    p = new_partition_with(e, "busy-abs", o);
    add_worker(p, 1);
    OK(kvr_partition_select_and_reserve(p, r, &b));
    memset(&d, SENTINEL, sizeof d);
    CHECK_ST(KVR_BUSY, kvr_partition_select(p, r, &d));
    /* A booked selection that is busy books nothing and does not keep its id. */
    const uint64_t id = UINT64_C(0x7100000000000001);
    OK(kvr_request_set_selection_id(r, id));
    CHECK_ST(KVR_BUSY, kvr_partition_select_and_reserve(p, r, &d));
    CHECK(all_bytes(&d, sizeof d, SENTINEL));
    CHECK_EQ(booking_stats(p).bookings, 1);
    ss = selection_stats(p);
    CHECK_EQ(ss.busy, 2);
    OK(kvr_engine_mark_prefill_complete(e, b.selection_id)); /* prefill 0: not busy */
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK_EQ(d.selection_id, id);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    OK(kvr_engine_free_booking(e, b.selection_id, NULL));
    OK(kvr_request_set_selection_id(r, 0));
    kvr_partition_free(p);

    /* Busy threshold as a fraction of max batched tokens: 16 > 0.1 * 100. */
    o = new_opts(BS);
    OK(kvr_partition_options_set_busy_prefill_tokens_fraction(o, 0.1));
    p = new_partition_with(e, "busy-frac", o);
    add_worker_full(p, 1, 1, 0, 100, NULL);
    OK(kvr_partition_select(p, r, &d));
    OK(kvr_partition_select_and_reserve(p, r, &b));
    CHECK_ST(KVR_BUSY, kvr_partition_select(p, r, &d));
    OK(kvr_engine_free_booking(e, b.selection_id, NULL));
    OK(kvr_partition_select(p, r, &d));
    kvr_partition_free(p);

    /* Busy threshold on decode blocks (fraction of total KV blocks), from reported load:
       3 used > 0.5 * 4. Later entries of one batch win. */
    o = new_opts(BS);
    OK(kvr_partition_options_set_busy_decode_blocks_fraction(o, 0.5));
    p = new_partition_with(e, "busy-decode", o);
    add_worker_full(p, 1, 1, 4, 0, NULL);
    OK(kvr_partition_select(p, r, &d));
    kvr_rank_load hot = {.worker_id = 1, .dp_rank = 0, .kv_blocks_used = 3, .kv_blocks_total = 4};
    kvr_rank_load cool = {.worker_id = 1, .dp_rank = 0, .kv_blocks_used = 1, .kv_blocks_total = 4};
    OK(kvr_partition_publish_load(p, &hot, 1, NULL));
    CHECK_ST(KVR_BUSY, kvr_partition_select(p, r, &d));
    kvr_rank_load batch[2] = {hot, cool};
    OK(kvr_partition_publish_load(p, batch, 2, NULL));
    OK(kvr_partition_select(p, r, &d));
    batch[0] = cool;
    batch[1] = hot;
    OK(kvr_partition_publish_load(p, batch, 2, NULL));
    CHECK_ST(KVR_BUSY, kvr_partition_select(p, r, &d));
    OK(kvr_partition_publish_load(p, &cool, 1, NULL));
    /* ... and from the engine's own bookings: 4 prompt blocks booked > 2. */
    OK(kvr_partition_select_and_reserve(p, r, &b));
    CHECK_ST(KVR_BUSY, kvr_partition_select(p, r, &d));
    OK(kvr_engine_free_booking(e, b.selection_id, NULL));
    OK(kvr_partition_select(p, r, &d));
    kvr_partition_free(p);

    kvr_request_free(r);
    kvr_engine_free(e);
}

static void test_hooks(void)
{
    g_section = "hooks";
    kvr_engine *e = new_engine(9);
    kvr_partition *p = new_partition(e, "hooks");
    setup_standard(p);
    kvr_request *r = new_request(T, NT);
    kvr_decision d;
    const uint64_t a1[1] = {1};

    CHECK_ST(KVR_ERR_NULL, kvr_partition_set_hooks(NULL, NULL));

    /* release: once per replaced hook set, never for the current one. */
    hook_ctx ha = {0}, hb = {0};
    kvr_hooks h = hooks_for(&ha);
    OK(kvr_partition_set_hooks(p, &h));
    CHECK_EQ(ha.release_calls, 0);
    h = hooks_for(&hb);
    OK(kvr_partition_set_hooks(p, &h));
    CHECK_EQ(ha.release_calls, 1);
    CHECK_EQ(hb.release_calls, 0);
    OK(kvr_partition_select(p, r, &d)); /* hb's hooks are used, ha's are not */
    CHECK(hb.overload_calls > 0 && ha.overload_calls == 0);
    OK(kvr_partition_set_hooks(p, NULL)); /* remove all */
    CHECK_EQ(ha.release_calls, 1);
    CHECK_EQ(hb.release_calls, 1);
    int calls = hb.overload_calls;
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(hb.overload_calls, calls);
    CHECK_EQ(d.worker_id, 2);

    /* A hook set without release, and with every pointer NULL. */
    kvr_hooks none = {0};
    OK(kvr_partition_set_hooks(p, &none));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 2);

    /* prefill_estimate: its answer is the projected (and booked) prefill. */
    hook_ctx hc = {.prefill_value = 123};
    h = (kvr_hooks){.user_data = &hc, .release = hook_release, .prefill_estimate = hook_prefill};
    OK(kvr_partition_set_hooks(p, &h));
    OK(kvr_request_set_pinned_worker(r, 1));
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK(hc.prefill_calls >= 1 && hc.seen_worker == 1);
    CHECK_EQ(hc.seen_prompt, NT);
    CHECK_EQ(hc.seen_cached, 12);
    CHECK_EQ(d.projected_prefill_tokens, 123);
    CHECK_LOAD(p, 1, 0, 123, NB, 1);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    /* Non-zero = no estimate: prompt - cached. */
    hc.prefill_rc = -1;
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK_EQ(d.projected_prefill_tokens, 12);
    CHECK_LOAD(p, 1, 0, 12, NB, 1);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    OK(kvr_request_reset(r));
    OK(kvr_request_set_tokens(r, T, NT));

    /* overloaded: every rank -> KVR_BUSY; one rank -> another is chosen. */
    hook_ctx ho = {.overloaded_worker = UINT64_MAX};
    h = (kvr_hooks){.user_data = &ho, .release = hook_release, .overloaded = hook_overloaded};
    OK(kvr_partition_set_hooks(p, &h));
    CHECK_EQ(hc.release_calls, 1);
    uint64_t busy0 = selection_stats(p).busy;
    memset(&d, SENTINEL, sizeof d);
    CHECK_ST(KVR_BUSY, kvr_partition_select(p, r, &d));
    CHECK_ST(KVR_BUSY, kvr_partition_select_and_reserve(p, r, &d));
    CHECK(all_bytes(&d, sizeof d, SENTINEL));
    CHECK_EQ(selection_stats(p).busy, busy0 + 2);
    CHECK_EQ(booking_stats(p).bookings, 0);
    ho.overloaded_worker = 2;
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 1); /* 7.25 < 12 */
    ho.overloaded_worker = 0;
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 2);

    /* available: zero = not a candidate at all (KVR_NO_WORKER if none). */
    hook_ctx hv = {.unavailable_worker = UINT64_MAX};
    h = (kvr_hooks){.user_data = &hv, .release = hook_release, .available = hook_available};
    OK(kvr_partition_set_hooks(p, &h));
    CHECK_EQ(ho.release_calls, 1);
    CHECK_ST(KVR_NO_WORKER, kvr_partition_select(p, r, &d));
    hv.unavailable_worker = 2;
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 1);

    /* shared_cache: it gets the prompt's sequence hashes; its ranges beyond the device
       prefix are reported (worker 1: device 3, shared [0, 6) -> 3 more). */
    hook_ctx hs = {.shared_want = 1, .shared_end = NB};
    h = (kvr_hooks){.user_data = &hs, .release = hook_release, .shared_cache = hook_shared};
    OK(kvr_partition_set_hooks(p, &h));
    CHECK_EQ(hv.release_calls, 1);
    OK(kvr_request_set_allowed_workers(r, a1, 1));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(hs.shared_calls, 1);
    CHECK_EQ(hs.shared_seen_n, NB);
    CHECK(memcmp(hs.shared_seen, S, sizeof S) == 0);
    CHECK_EQ(d.shared_blocks, 3);
    CHECK_COST(d.cost, 7.25); /* shared multiplier defaults to 0 */
    OK(kvr_request_set_overrides(r, NAN, NAN, NAN, 0.5)); /* credit + 1.5 */
    OK(kvr_partition_select(p, r, &d));
    CHECK_COST(d.cost, 6.0);
    OK(kvr_request_set_overrides(r, NAN, NAN, NAN, NAN));
    /* More ranges than offered room: kvr asks again with enough. */
    hs.shared_calls = 0;
    hs.shared_want = 100;
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(hs.shared_calls, 2);
    CHECK(hs.shared_caps[0] < 100 && hs.shared_caps[1] >= 100);
    CHECK_EQ(d.shared_blocks, 3);
    CHECK_EQ(selection_stats(p).shared_cache_failures, 0);
    /* A failing lookup: counted, and the selection goes on without it. */
    hs.shared_rc = 5;
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 1);
    CHECK_EQ(d.shared_blocks, 0);
    CHECK_EQ(selection_stats(p).shared_cache_failures, 1);
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK_EQ(selection_stats(p).shared_cache_failures, 2);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    /* An absurd range count is a failed lookup too. */
    hs.shared_rc = 0;
    hs.shared_want = (size_t)1 << 20;
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.shared_blocks, 0);
    CHECK_EQ(selection_stats(p).shared_cache_failures, 3);
    /* An empty prompt does not call the hook. */
    hs.shared_calls = 0;
    hs.shared_want = 1;
    OK(kvr_request_set_tokens(r, NULL, 0));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(hs.shared_calls, 0);

    /* The last hook set is released when the partition goes away. */
    hook_ctx hlast = {0};
    h = hooks_for(&hlast);
    OK(kvr_partition_set_hooks(p, &h));
    CHECK_EQ(hs.release_calls, 1);
    kvr_request_free(r);
    kvr_partition_free(p); /* the engine still holds the partition */
    CHECK_EQ(hlast.release_calls, 0);
    kvr_engine_free(e);
    CHECK_EQ(hlast.release_calls, 1);
    CHECK_EQ(ha.release_calls, 1);
    CHECK_EQ(hb.release_calls, 1);
    CHECK_EQ(hc.release_calls, 1);
    CHECK_EQ(ho.release_calls, 1);
    CHECK_EQ(hv.release_calls, 1);
    CHECK_EQ(hs.release_calls, 1);
}

static void test_lora(void)
{
    g_section = "lora";
    kvr_engine *e = new_engine(10);
    kvr_partition *p = new_partition(e, "lora");
    /* Worker 1 serves adapter "ad" (registered); worker 2 does not, but holds the prompt
       hashed with the "ad" salt. */
    add_worker_full(p, 1, 1, 0, 0, "ad");
    add_worker(p, 2);
    uint64_t lh[NB];
    size_t n = 0;
    OK(kvr_partition_hash_tokens(p, "ad", 2, T, NT, lh, NULL, NB, &n));
    OK(store(p, 2, 0, KVR_TIER_DEVICE, false, 0, 1, lh, NB, NULL));
    kvr_request *r = new_request(T, NT);
    kvr_decision d;

    /* The LoRA salts the request's hashes: without it, worker 2's blocks do not match. */
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.device_blocks, 0);
    const uint64_t a2[1] = {2};
    OK(kvr_request_set_allowed_workers(r, a2, 1));
    OK(kvr_request_set_lora(r, "ad", 2));
    OK(kvr_partition_select(p, r, &d));
    CHECK(d.worker_id == 2 && d.device_blocks == NB); /* narrowing to {} falls back */
    OK(kvr_request_reset(r));
    OK(kvr_request_set_tokens(r, T, NT));
    OK(kvr_request_set_lora(r, "ad", 2));

    /* No filter hook: the registered adapters narrow to worker 1, despite the cache. */
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 1);
    /* An adapter nobody serves: empty narrowing, ignored -> the cache wins. */
    OK(kvr_request_set_lora(r, "zz", 2));
    OK(kvr_request_set_local_hashes(r, lh, NB, NT)); /* precomputed "ad" hashes */
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 2);
    OK(kvr_request_set_tokens(r, T, NT));
    OK(kvr_request_set_lora(r, "ad", 2));

    /* A filter hook replaces the registered adapters. */
    hook_ctx hl = {.lora_serves = UINT64_C(1) << 1};
    kvr_hooks h = {.user_data = &hl, .release = hook_release, .lora_filter = hook_lora};
    OK(kvr_partition_set_hooks(p, &h));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 1);
    CHECK_EQ(hl.lora_calls, 1);
    CHECK_EQ(hl.lora_n, 2);
    CHECK(hl.lora_seen_len == 2 && strcmp(hl.lora_seen, "ad") == 0);
    hl.lora_serves = UINT64_C(1) << 2; /* only worker 2 */
    OK(kvr_partition_select(p, r, &d));
    CHECK(d.worker_id == 2 && d.device_blocks == NB);
    /* A failing filter: no narrowing (both candidates; worker 2's cache wins). */
    hl.lora_serves = UINT64_C(1) << 1;
    hl.lora_rc = 1;
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 2);
    /* Narrowing never widens the allow-set: the hook names worker 2, only 1 is allowed. */
    hl.lora_rc = 0;
    hl.lora_serves = UINT64_C(1) << 2;
    const uint64_t a1[1] = {1};
    OK(kvr_request_set_allowed_workers(r, a1, 1));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 1);
    /* A pin survives narrowing. */
    OK(kvr_request_reset(r));
    OK(kvr_request_set_tokens(r, T, NT));
    OK(kvr_request_set_lora(r, "ad", 2));
    hl.lora_serves = UINT64_C(1) << 2;
    OK(kvr_request_set_pinned_worker(r, 1));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 1);
    /* (NULL, 0) = no LoRA: no filter call, unsalted hashes. */
    OK(kvr_request_set_pinned_worker(r, 2));
    OK(kvr_request_set_lora(r, NULL, 0));
    OK(kvr_partition_select(p, r, &d));
    CHECK(d.worker_id == 2 && d.device_blocks == 0);

    kvr_request_free(r);
    kvr_partition_free(p);
    kvr_engine_free(e);
    CHECK_EQ(hl.release_calls, 1);
}

static void test_replica(void)
{
    g_section = "replica";
    kvr_engine *e = new_engine(11);
    kvr_partition *p = new_partition(e, "replica");
    setup_standard(p);
    kvr_partition *p2 = new_partition(e, "replica2");
    const uint64_t rid = UINT64_C(0x7200000000000001);
    kvr_replica_booking b = {
        .selection_id = rid,
        .worker_id = 1,
        .dp_rank = 0,
        .prompt_blocks = S,
        .n_prompt_blocks = NB,
        .prefill_tokens = 100,
        .expected_output_tokens = 10,
        .ttl_ms = 0,
    };
    CHECK_ST(KVR_ERR_NULL, kvr_partition_install_replica_booking(NULL, &b));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_install_replica_booking(p, NULL));
    b.selection_id = 0;
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_install_replica_booking(p, &b));
    b.selection_id = rid;
    b.reserved = 1;
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_install_replica_booking(p, &b));
    b.reserved = 0;
    b.prompt_blocks = NULL;
    CHECK_ST(KVR_ERR_NULL, kvr_partition_install_replica_booking(p, &b));
    b.prompt_blocks = S;
    b.prefill_tokens = (UINT64_C(1) << 40) + 1;
    CHECK_ST(KVR_ERR_TOO_LARGE, kvr_partition_install_replica_booking(p, &b));
    b.prefill_tokens = 100;
    CHECK_EQ(booking_stats(p).bookings, 0);

    OK(kvr_partition_install_replica_booking(p, &b));
    CHECK_LOAD(p, 1, 0, 100, NB, 1);
    CHECK_ST(KVR_ERR_DUPLICATE_SELECTION_ID, kvr_partition_install_replica_booking(p, &b));
    /* A local booking of the same prompt on the same rank shares its blocks: the replica's
       sequence hashes (from kvr_partition_hash_tokens) are the engine's own. */
    kvr_request *r = new_request(T, NT);
    OK(kvr_request_set_pinned_worker(r, 1));
    kvr_decision d;
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK_EQ(d.projected_decode_blocks, NB);
    CHECK_LOAD(p, 1, 0, 112, NB, 2);
    /* A local booking cannot take a live replica id. */
    OK(kvr_request_set_selection_id(r, rid));
    CHECK_ST(KVR_ERR_DUPLICATE_SELECTION_ID, kvr_partition_select_and_reserve(p, r, &d));
    OK(kvr_request_set_selection_id(r, 0));
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    CHECK_LOAD(p, 1, 0, 100, NB, 1);

    /* Lifecycle through the engine (found by scanning the partitions). */
    OK(kvr_engine_mark_prefill_complete(e, rid));
    CHECK_LOAD(p, 1, 0, 0, NB, 1);
    OK(kvr_engine_add_output_blocks(e, rid, 2));
    CHECK_LOAD(p, 1, 0, 0, NB + 2, 1);
    uint32_t how = 99;
    OK(kvr_engine_free_booking(e, rid, &how));
    CHECK_EQ(how, KVR_FREED_NOW);
    CHECK_LOAD(p, 1, 0, 0, 0, 0);
    OK(kvr_engine_free_booking(e, rid, &how));
    CHECK_EQ(how, KVR_FREED_BY_CALLER);
    /* A late replica message for a freed id does not resurrect it. */
    CHECK_ST(KVR_ERR_DUPLICATE_SELECTION_ID, kvr_partition_install_replica_booking(p, &b));
    CHECK_EQ(booking_stats(p).bookings, 0);

    /* A replica booking in another partition, with no prompt ((NULL, 0)). */
    b.selection_id = rid + 1;
    b.prompt_blocks = NULL;
    b.n_prompt_blocks = 0;
    b.worker_id = 5;
    /* A replica booking names a registered rank: never one the peer makes up. */
    CHECK_ST(KVR_ERR_UNKNOWN_RANK, kvr_partition_install_replica_booking(p2, &b));
    b.dp_rank = 1;
    add_worker(p2, 5);
    CHECK_ST(KVR_ERR_UNKNOWN_RANK, kvr_partition_install_replica_booking(p2, &b));
    b.dp_rank = 0;
    OK(kvr_partition_install_replica_booking(p2, &b));
    CHECK_LOAD(p2, 5, 0, 100, 0, 1);
    CHECK_LOAD(p, 5, 0, 0, 0, 0);
    OK(kvr_engine_free_booking(e, rid + 1, &how));
    CHECK_EQ(how, KVR_FREED_NOW);
    CHECK_LOAD(p2, 5, 0, 0, 0, 0);

    kvr_request_free(r);
    kvr_partition_free(p);
    kvr_partition_free(p2);
    kvr_engine_free(e);
}

static void test_remove_partition(void)
{
    g_section = "remove partition";
    kvr_engine *e = new_engine(12);
    kvr_partition *p = new_partition(e, "gone");
    setup_standard(p);
    kvr_partition *q = NULL;
    OK(kvr_engine_get_partition(e, "gone", 4, "g", 1, &q));
    hook_ctx hk = {0};
    kvr_hooks h = hooks_for(&hk);
    OK(kvr_partition_set_hooks(p, &h));
    kvr_request *r = new_request(T, NT);
    kvr_decision booked, d;
    OK(kvr_partition_select_and_reserve(p, r, &booked));

    OK(kvr_engine_remove_partition(e, "gone", 4, "g", 1));
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION, kvr_engine_remove_partition(e, "gone", 4, "g", 1));
    kvr_partition *x = NULL;
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION, kvr_engine_get_partition(e, "gone", 4, "g", 1, &x));
    CHECK(x == NULL);

    /* Selections and bookings through old handles fail... */
    memset(&d, SENTINEL, sizeof d);
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION, kvr_partition_select(p, r, &d));
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION, kvr_partition_select(q, r, &d));
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION, kvr_partition_select_and_reserve(p, r, &d));
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION, kvr_partition_reserve(p, 1, 0, r, NULL, 0, &d));
    CHECK(all_bytes(&d, sizeof d, SENTINEL));
    kvr_replica_booking rb = {.selection_id = UINT64_C(0x7300000000000001), .worker_id = 1};
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION, kvr_partition_install_replica_booking(p, &rb));
    /* ... while reads still work. */
    uint32_t bs = 0;
    OK(kvr_partition_block_size(p, &bs));
    CHECK_EQ(bs, BS);
    kvr_overlap ov[4];
    size_t n = 0;
    OK(kvr_partition_find_matches(q, L, NB, ov, 4, &n));
    CHECK_EQ(n, 2);
    kvr_index_stats st;
    OK(kvr_partition_index_stats(p, &st));
    CHECK_EQ(st.ranks, 2);
    /* Its bookings are no longer reachable through the engine. */
    CHECK_ST(KVR_ERR_UNKNOWN_SELECTION_ID, kvr_engine_free_booking(e, booked.selection_id, NULL));

    /* The name can be reused: a new, empty partition; the old handles stay dead. */
    kvr_partition *p3 = new_partition(e, "gone");
    OK(kvr_partition_find_matches(p3, L, NB, ov, 4, &n));
    CHECK_EQ(n, 0);
    add_worker(p3, 1);
    OK(kvr_partition_select(p3, r, &d));
    CHECK_EQ(d.worker_id, 1);
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION, kvr_partition_select(p, r, &d));

    /* The removed partition (and its hooks) go with its last handle. */
    kvr_partition_free(p);
    CHECK_EQ(hk.release_calls, 0);
    kvr_partition_free(q);
    CHECK_EQ(hk.release_calls, 1);

    kvr_request_free(r);
    kvr_partition_free(p3);
    kvr_engine_free(e);
}

static void test_request_setters(void)
{
    g_section = "request";
    kvr_request *r = (kvr_request *)(uintptr_t)1;
    CHECK_ST(KVR_ERR_NULL, kvr_request_new(NULL));
    OK(kvr_request_new(&r));
    CHECK(r != NULL);

    CHECK_ST(KVR_ERR_NULL, kvr_request_reset(NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_tokens(NULL, T, NT));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_tokens(r, NULL, 3));
    OK(kvr_request_set_tokens(r, NULL, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_local_hashes(NULL, L, NB, NT));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_local_hashes(r, NULL, 2, 8));
    OK(kvr_request_set_local_hashes(r, NULL, 0, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_lora(NULL, "ad", 2));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_lora(r, NULL, 2));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_lora(r, BAD_UTF8, BAD_UTF8_LEN));
    OK(kvr_request_set_lora(r, NULL, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_allowed_workers(NULL, L, 1));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_allowed_workers(r, NULL, 1));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_pinned_worker(NULL, 1));

    CHECK_ST(KVR_ERR_NULL, kvr_request_set_session(NULL, "s", 1, NULL, 0, 0, NULL, 0));
    OK(kvr_request_set_session(r, "s1", 2, "parent", 6, 1, "user", 4));
    OK(kvr_request_set_session(r, "s1", 2, NULL, 0, 0, NULL, 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_session(r, NULL, 0, NULL, 0, 0, NULL, 0));
    {
        /* Longer than KVR_MAX_SESSION_ID_BYTES: refused when set, not dropped later. */
        char long_id[KVR_MAX_SESSION_ID_BYTES + 1];
        memset(long_id, 'x', sizeof long_id);
        OK(kvr_request_set_session(r, long_id, KVR_MAX_SESSION_ID_BYTES, NULL, 0, 0, NULL, 0));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
                 kvr_request_set_session(r, long_id, sizeof long_id, NULL, 0, 0, NULL, 0));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
                 kvr_request_set_session(r, "s", 1, long_id, sizeof long_id, 0, NULL, 0));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
                 kvr_request_set_legacy_session_id(r, long_id, sizeof long_id));
        OK(kvr_request_set_session(r, "s1", 2, NULL, 0, 0, NULL, 0));
    }
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_session(r, BAD_UTF8, BAD_UTF8_LEN, NULL, 0, 0, NULL, 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_session(r, "s", 1, BAD_UTF8, BAD_UTF8_LEN, 0, NULL, 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_session(r, "s", 1, NULL, 0, 0, BAD_UTF8, BAD_UTF8_LEN));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_session(r, NULL, 1, NULL, 0, 0, NULL, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_session(r, "s", 1, NULL, 3, 0, NULL, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_session(r, "s", 1, NULL, 0, 0, NULL, 3));

    CHECK_ST(KVR_ERR_NULL, kvr_request_set_legacy_session_id(NULL, "x", 1));
    OK(kvr_request_set_legacy_session_id(r, "legacy", 6));
    OK(kvr_request_set_legacy_session_id(r, NULL, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_legacy_session_id(r, NULL, 1));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_legacy_session_id(r, BAD_UTF8, BAD_UTF8_LEN));

    CHECK_ST(KVR_ERR_NULL, kvr_request_set_overrides(NULL, NAN, NAN, NAN, NAN));
    OK(kvr_request_set_overrides(r, NAN, NAN, NAN, NAN));
    OK(kvr_request_set_overrides(r, 1.0, 1.0, 0.0, 0.0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_overrides(r, INFINITY, NAN, NAN, NAN));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_overrides(r, NAN, -INFINITY, NAN, NAN));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_overrides(r, NAN, NAN, INFINITY, NAN));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_overrides(r, NAN, NAN, NAN, INFINITY));

    CHECK_ST(KVR_ERR_NULL, kvr_request_set_expected_output_tokens(NULL, 1));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_selection_id(NULL, 1));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_ttl_ms(NULL, 1));

    /* Sessions ride along without changing the decision. */
    kvr_engine *e = new_engine(13);
    kvr_partition *p = new_partition(e, "sessions");
    setup_standard(p);
    OK(kvr_request_reset(r));
    OK(kvr_request_set_tokens(r, T, NT));
    OK(kvr_request_set_session(r, "s1", 2, "s0", 2, 1, "tool", 4));
    OK(kvr_request_set_legacy_session_id(r, "old", 3));
    kvr_decision d;
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 2);
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK_EQ(d.worker_id, 2);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    /* A prompt given as hashes, then as tokens: the last one counts. */
    const uint64_t junk[2] = {1, 2};
    OK(kvr_request_set_local_hashes(r, junk, 2, 8));
    OK(kvr_request_set_tokens(r, T, NT));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.device_blocks, NB);
    OK(kvr_request_set_tokens(r, T, NT));
    OK(kvr_request_set_local_hashes(r, junk, 2, 8));
    OK(kvr_partition_select(p, r, &d));
    CHECK(d.device_blocks == 0 && d.cached_tokens == 0 && d.projected_prefill_tokens == 8);

    kvr_partition_free(p);
    kvr_engine_free(e);
    kvr_request_free(r);
}

/* ---- hooks that call kvr, and hooks replaced mid-selection -------------------------- */

typedef struct {
    kvr_partition *p;
    const kvr_request *req;
    int depth;
    kvr_status find_st, load_st, hash_st, select_st;
    size_t find_n;
    uint32_t find_device;
    kvr_active_load load;
    /* swap mode: replace the hooks from inside the shared-cache hook */
    const kvr_hooks *swap_to;
    kvr_status swap_st;
    int release_calls_at_swap;
    int *release_counter;
} reenter_ctx;

static int32_t hook_reenter(void *ud, uint64_t worker_id, uint32_t dp_rank)
{
    reenter_ctx *c = ud;
    (void)dp_rank;
    if (c->depth == 0 && worker_id == 2) {
        c->depth++;
        kvr_overlap ov[4];
        uint64_t h[NB];
        size_t n = 0;
        c->find_st = kvr_partition_find_matches(c->p, L, NB, ov, 4, &c->find_n);
        int i = find_ov(ov, c->find_n, 2, 0);
        c->find_device = i >= 0 ? ov[i].device_blocks : 0;
        c->load_st = kvr_partition_active_load(c->p, 2, 0, &c->load);
        c->hash_st = kvr_partition_hash_tokens(c->p, NULL, 0, T, NT, h, NULL, NB, &n);
        kvr_decision d;
        c->select_st = kvr_partition_select(c->p, c->req, &d);
        c->depth--;
    }
    return 0;
}

static void counting_release(void *ud)
{
    (*(int *)ud)++;
}

static void release_via_ctx(void *ud)
{
    (*((reenter_ctx *)ud)->release_counter)++;
}

static int32_t hook_swapping_shared(void *ud, const uint64_t *seq, size_t n, kvr_block_range *out,
                                    size_t cap, size_t *out_len)
{
    reenter_ctx *c = ud;
    (void)seq;
    (void)n;
    (void)out;
    (void)cap;
    *out_len = 0;
    if (c->swap_to != NULL) {
        c->swap_st = kvr_partition_set_hooks(c->p, c->swap_to);
        c->release_calls_at_swap = *c->release_counter;
        c->swap_to = NULL;
    }
    return 0;
}

static void test_reentrant_hooks(void)
{
    g_section = "re-entrant hooks";
    kvr_engine *e = new_engine(16);
    kvr_partition *p = new_partition(e, "reenter");
    setup_standard(p);
    kvr_request *r = new_request(T, NT);
    kvr_decision d;

    /* A hook may call kvr again (hooks run with no engine lock held). */
    reenter_ctx c = {.p = p, .req = r, .find_st = 999, .load_st = 999, .hash_st = 999, .select_st = 999};
    kvr_hooks h = {.user_data = &c, .overloaded = hook_reenter};
    OK(kvr_partition_set_hooks(p, &h));
    uint64_t panics = kvr_status_count(KVR_ERR_PANIC);
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK_EQ(d.worker_id, 2);
    OK(c.find_st);
    CHECK(c.find_n == 2 && c.find_device == NB);
    OK(c.load_st);
    CHECK_EQ(c.load.active_requests, 0); /* the outer booking is not made yet */
    OK(c.hash_st);
    OK(c.select_st); /* a selection from inside a hook gets its own tie-break RNG */
    CHECK_EQ(kvr_status_count(KVR_ERR_PANIC), panics);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));

    /* Hooks replaced from inside a hook: the running selection finishes with the hooks it
       started with, which are released only after it; the next selection sees the new set
       (here: no rank available). */
    int released_old = 0;
    hook_ctx unavailable = {.unavailable_worker = UINT64_MAX};
    kvr_hooks no_rank = {.user_data = &unavailable, .release = hook_release,
                         .available = hook_available};
    reenter_ctx sw = {.p = p, .swap_to = &no_rank, .swap_st = 999,
                      .release_counter = &released_old, .release_calls_at_swap = -1};
    kvr_hooks swapping = {.user_data = &sw, .shared_cache = hook_swapping_shared};
    OK(kvr_partition_set_hooks(p, &swapping));
    OK(kvr_partition_select(p, r, &d));
    OK(sw.swap_st);
    CHECK_EQ(d.worker_id, 2); /* the old set (no availability hook) was used to the end */
    CHECK_ST(KVR_NO_WORKER, kvr_partition_select(p, r, &d));
    CHECK_EQ(unavailable.release_calls, 0);

    /* A set with a release and no function: released exactly once (kvr releases it at once,
       as nothing can use its user_data; see the report), never again. */
    kvr_hooks release_only = {.user_data = &released_old, .release = counting_release};
    OK(kvr_partition_set_hooks(p, &release_only));
    CHECK_EQ(unavailable.release_calls, 1);
    OK(kvr_partition_set_hooks(p, NULL));
    CHECK_EQ(released_old, 1);

    /* Release timing: a set replaced from inside its own hook is released only once the
       selection that started with it has finished. */
    hook_ctx swapped_in = {0};
    kvr_hooks plain = {.user_data = &swapped_in, .release = hook_release};
    released_old = 0;
    sw = (reenter_ctx){.p = p, .swap_to = &plain, .swap_st = 999,
                       .release_counter = &released_old, .release_calls_at_swap = -1};
    /* A set whose shared-cache hook swaps and whose release counts: user_data must serve
       both, so route the release through the reenter_ctx's counter. */
    kvr_hooks swapping2 = {.user_data = &sw, .release = release_via_ctx,
                           .shared_cache = hook_swapping_shared};
    OK(kvr_partition_set_hooks(p, &swapping2));
    OK(kvr_partition_select(p, r, &d));
    OK(sw.swap_st);
    CHECK_EQ(sw.release_calls_at_swap, 0); /* still in use when replaced */
    CHECK_EQ(released_old, 1);             /* released once the selection ended */
    OK(kvr_partition_set_hooks(p, NULL));
    CHECK_EQ(released_old, 1);
    CHECK_EQ(swapped_in.release_calls, 1);

    kvr_request_free(r);
    kvr_partition_free(p);
    kvr_engine_free(e);
}

static void test_misaligned(void)
{
    g_section = "misaligned slices";
    kvr_engine *e = new_engine(17);
    kvr_partition *p = new_partition(e, "align");
    /* Integer -> pointer conversions (implementation-defined, not UB) one byte off. */
    uint64_t buf[8] = {0};
    const uint32_t *mis_tok = (const uint32_t *)(uintptr_t)((uintptr_t)T + 1);
    const uint64_t *mis_hash = (const uint64_t *)(uintptr_t)((uintptr_t)buf + 1);
    kvr_overlap ov[2];
    kvr_overlap *mis_ov = (kvr_overlap *)(uintptr_t)((uintptr_t)ov + 4);
    kvr_event evs[2] = {{.kind = KVR_EVENT_CLEARED}, {.kind = KVR_EVENT_CLEARED}};
    const kvr_event *mis_ev = (const kvr_event *)(uintptr_t)((uintptr_t)evs + 4);
    size_t n = 0;
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_hash_tokens(BS, NULL, 0, NULL, 0, mis_tok, 8, buf, NULL, 8, &n));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_find_matches(p, mis_hash, 2, ov, 2, &n));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_find_matches(p, L, NB, mis_ov, 1, &n));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_apply_events(p, 1, 0, mis_ev, 1, NULL));
    kvr_request *r = NULL;
    OK(kvr_request_new(&r));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_tokens(r, mis_tok, 8));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_local_hashes(r, mis_hash, 2, 8));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_allowed_workers(r, mis_hash, 2));
    kvr_request_free(r);
    kvr_partition_free(p);
    kvr_engine_free(e);
}

/* Selection ids of a removed partition stay claimed in the engine's id index. */
static void test_known_id_leak(void)
{
    g_section = "id index";
    kvr_engine *e = new_engine(18);
    kvr_partition *a = new_partition(e, "a");
    kvr_partition *b = new_partition(e, "b");
    add_worker(a, 1);
    add_worker(b, 1);
    kvr_request *r = new_request(T, NT);
    const uint64_t id = UINT64_C(0x7400000000000001);
    OK(kvr_request_set_selection_id(r, id));
    kvr_decision d;
    OK(kvr_partition_select_and_reserve(a, r, &d));
    OK(kvr_engine_remove_partition(e, "a", 1, "g", 1));
    CHECK_ST(KVR_ERR_UNKNOWN_SELECTION_ID, kvr_engine_free_booking(e, id, NULL));
    kvr_status st = kvr_partition_select_and_reserve(b, r, &d);
    OK(st); /* the removed partition's ids left the id index with it */
    if (st == KVR_OK) {
        OK(kvr_engine_free_booking(e, id, NULL));
    }
    kvr_request_free(r);
    kvr_partition_free(a);
    kvr_partition_free(b);
    kvr_engine_free(e);
}

/* ---- seeded tie-breaks, each engine on its own fresh thread -------------------------- */

enum { SEED_PICKS = 48 };

typedef struct {
    uint64_t seed;
    uint64_t picks[SEED_PICKS];
    int failures;
} seed_run;

/* A fresh engine with 4 idle workers; SEED_PICKS advisory selections of an uncached prompt
   (all four tie), recording the chosen workers. */
static void seeded_picks(seed_run *s)
{
    kvr_engine *e = new_engine(s->seed);
    kvr_partition *p = NULL;
    kvr_partition_options *o = new_opts(BS);
    if (kvr_engine_create_partition(e, "seed", 4, "g", 1, o, &p) != KVR_OK) {
        s->failures++;
    }
    kvr_partition_options_free(o);
    for (uint64_t w = 1; w <= 4; w++) {
        kvr_worker *wk = NULL;
        if (kvr_worker_new(w, 1, &wk) != KVR_OK || kvr_partition_upsert_worker(p, wk) != KVR_OK) {
            s->failures++;
        }
        kvr_worker_free(wk);
    }
    kvr_request *r = NULL;
    if (kvr_request_new(&r) != KVR_OK || kvr_request_set_tokens(r, U, NT) != KVR_OK) {
        s->failures++;
    }
    for (int i = 0; i < SEED_PICKS; i++) {
        kvr_decision d;
        if (kvr_partition_select(p, r, &d) != KVR_OK) {
            s->failures++;
        }
        s->picks[i] = d.worker_id;
    }
    kvr_request_free(r);
    kvr_partition_free(p);
    kvr_engine_free(e);
}

static int seeded_thread(void *arg)
{
    seeded_picks(arg);
    return 0;
}

static void run_on_thread(seed_run *s)
{
    thrd_t t;
    if (thrd_create(&t, seeded_thread, s) != thrd_success) {
        s->failures++;
        return;
    }
    thrd_join(t, NULL);
}

static void test_seed(void)
{
    g_section = "seed";
    seed_run a = {.seed = 42}, b = {.seed = 42}, c = {.seed = 43};
    run_on_thread(&a);
    run_on_thread(&b);
    run_on_thread(&c);
    CHECK_EQ(a.failures + b.failures + c.failures, 0);
    CHECK(memcmp(a.picks, b.picks, sizeof a.picks) == 0); /* same seed: same choices */
    CHECK(memcmp(a.picks, c.picks, sizeof a.picks) != 0); /* P(equal) = 4^-48 */
    int seen[5] = {0};
    for (int i = 0; i < SEED_PICKS; i++) {
        if (a.picks[i] >= 1 && a.picks[i] <= 4) {
            seen[a.picks[i]]++;
        }
    }
    CHECK(seen[1] > 0 && seen[2] > 0 && seen[3] > 0 && seen[4] > 0);
    CHECK_EQ(seen[1] + seen[2] + seen[3] + seen[4], SEED_PICKS);

    /* Each engine has its own tie-break RNG per thread: a second seeded engine on a thread
       that already selected with another engine gets its seed's sequence. */
    seed_run m = {.seed = 42};
    seeded_picks(&m); /* on the main thread, which has selected before */
    CHECK(m.failures == 0 && memcmp(a.picks, m.picks, sizeof a.picks) == 0);
}

/* ---- concurrency: const handles from several threads --------------------------------- */

enum { CONC_THREADS = 3, CONC_ITERS = 150 };

typedef struct {
    kvr_engine *e;
    kvr_partition *p;
    int index;
    int failures;
} conc_arg;

static int conc_booker(void *argp)
{
    conc_arg *a = argp;
    kvr_request *r = NULL;
    if (kvr_request_new(&r) != KVR_OK || kvr_request_set_tokens(r, T, NT) != KVR_OK) {
        a->failures++;
        return 0;
    }
    for (int i = 0; i < CONC_ITERS; i++) {
        kvr_decision d;
        uint32_t how = 99;
        if (kvr_partition_select_and_reserve(a->p, r, &d) != KVR_OK ||
            kvr_engine_mark_prefill_complete(a->e, d.selection_id) != KVR_OK ||
            kvr_engine_add_output_blocks(a->e, d.selection_id, 1) != KVR_OK ||
            kvr_engine_free_booking(a->e, d.selection_id, &how) != KVR_OK || how != KVR_FREED_NOW) {
            a->failures++;
        }
    }
    kvr_request_free(r);
    return 0;
}

static int conc_writer(void *argp)
{
    conc_arg *a = argp;
    kvr_overlap ov[8];
    for (int i = 0; i < CONC_ITERS; i++) {
        size_t n = 0;
        kvr_event clear = {.kind = KVR_EVENT_CLEARED};
        if (store(a->p, 9, 0, KVR_TIER_DEVICE, false, 0, 1, L, NB, NULL) != KVR_OK ||
            kvr_partition_find_matches(a->p, L, NB, ov, 8, &n) != KVR_OK ||
            kvr_partition_apply_events(a->p, 9, 0, &clear, 1, NULL) != KVR_OK) {
            a->failures++;
        }
        /* Never an overcount: worker 2 holds all 6 blocks, worker 9 at most 6. */
        for (size_t k = 0; k < n; k++) {
            if (ov[k].device_blocks > NB) {
                a->failures++;
            }
        }
    }
    return 0;
}

static void test_concurrency(void)
{
    g_section = "concurrency";
    kvr_engine *e = new_engine(14);
    kvr_partition *p = new_partition(e, "conc");
    setup_standard(p);
    add_worker(p, 9);
    conc_arg args[CONC_THREADS + 1];
    thrd_t t[CONC_THREADS + 1];
    int started = 0;
    for (int i = 0; i <= CONC_THREADS; i++) {
        args[i] = (conc_arg){.e = e, .p = p, .index = i};
        if (thrd_create(&t[i], i == CONC_THREADS ? conc_writer : conc_booker, &args[i]) ==
            thrd_success) {
            started++;
        }
    }
    CHECK_EQ(started, CONC_THREADS + 1);
    int failures = 0;
    for (int i = 0; i < started; i++) {
        thrd_join(t[i], NULL);
        failures += args[i].failures;
    }
    CHECK_EQ(failures, 0);
    kvr_booking_stats bs = booking_stats(p);
    CHECK_EQ(bs.bookings, 0);
    CHECK_EQ(bs.counter_underflows, 0);
    for (uint64_t w = 1; w <= 9; w++) {
        CHECK_LOAD(p, w, 0, 0, 0, 0);
    }
    kvr_partition_free(p);
    kvr_engine_free(e);
}

static void test_free_null(void)
{
    g_section = "free(NULL)";
    /* Each is a no-op (and must not crash). */
    kvr_engine_options_free(NULL);
    kvr_engine_free(NULL);
    kvr_partition_options_free(NULL);
    kvr_partition_free(NULL);
    kvr_request_free(NULL);
    kvr_worker_free(NULL);
    kvr_subscribe_options_free(NULL);
    kvr_subscription_free(NULL);
    CHECK(true); /* reached */
}

/* The index's rank limit (2^18 ranks): slow, so only with KVR_C_TEST_SLOW=1. */
static void test_too_many_ranks(void)
{
    g_section = "too many ranks";
    kvr_engine *e = new_engine(15);
    kvr_partition *p = new_partition(e, "ranks");
    const uint64_t limit = UINT64_C(1) << 18;
    uint64_t failures = 0;
    for (uint64_t w = 0; w < limit; w++) {
        if (store(p, w, 0, KVR_TIER_DEVICE, false, 0, 1, L, 1, NULL) != KVR_OK) {
            failures++;
        }
    }
    CHECK_EQ(failures, 0);
    kvr_apply_result res;
    CHECK_ST(KVR_ERR_TOO_MANY_RANKS, store(p, limit, 0, KVR_TIER_DEVICE, false, 0, 1, L, 1, &res));
    CHECK(res.events_applied == 0 && res.events_rejected == 1);
    kvr_index_stats st;
    OK(kvr_partition_index_stats(p, &st));
    CHECK_EQ(st.ranks, limit);
    CHECK_EQ(st.too_many_ranks, 1);
    kvr_partition_free(p);
    kvr_engine_free(e);
}

/* ---- extra keys: images and cache salts (kvr_request_add_mm_input, ...) ------------- */

/* [1.0, [{"type":"BlockStored","block_hashes":[7],"parent_block_hash":nil,
           "token_ids":[9,9,9,9],"block_size":4,"extra_keys":[[["imgA",1]]]}], 0]
   (vLLM 0.33's encoding; byte IMG_AT is the image name's last letter) */
static const uint8_t STORED_IMG_A[] =
    "\x93\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\x91\x86\xa4\x74\x79\x70\x65\xab\x42\x6c\x6f"
    "\x63\x6b\x53\x74\x6f\x72\x65\x64\xac\x62\x6c\x6f\x63\x6b\x5f\x68\x61\x73\x68\x65\x73"
    "\x91\x07\xb1\x70\x61\x72\x65\x6e\x74\x5f\x62\x6c\x6f\x63\x6b\x5f\x68\x61\x73\x68\xc0"
    "\xa9\x74\x6f\x6b\x65\x6e\x5f\x69\x64\x73\x94\x09\x09\x09\x09\xaa\x62\x6c\x6f\x63\x6b"
    "\x5f\x73\x69\x7a\x65\x04\xaa\x65\x78\x74\x72\x61\x5f\x6b\x65\x79\x73\x91\x91\x92\xa4"
    "\x69\x6d\x67\x41\x01\x00";
enum { IMG_AT = 108 };

/* Selects the 4-token placeholder prompt with image `img` at token 1 (and `salt`). */
static void select_image(const kvr_partition *p, const char *img, const char *salt,
                         uint64_t want_worker, uint32_t want_blocks)
{
    static const uint32_t toks[4] = {9, 9, 9, 9};
    kvr_request *r = new_request(toks, 4);
    OK(kvr_request_add_mm_input(r, (const uint8_t *)img, strlen(img), 1, 3));
    if (salt) {
        OK(kvr_request_set_cache_salt(r, salt, strlen(salt)));
    }
    kvr_decision d;
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.device_blocks, want_blocks);
    if (want_blocks) {
        CHECK_EQ(d.worker_id, want_worker);
    }
    kvr_request_free(r);
}

static void test_extra_keys(void)
{
    g_section = "extra keys";
    kvr_engine *e = new_engine(5);
    kvr_partition *p = new_partition(e, "extra"); /* block size BS = 4 */
    add_worker(p, 1);
    add_worker(p, 2);
    uint8_t msg[sizeof STORED_IMG_A];
    memcpy(msg, STORED_IMG_A, sizeof msg);
    CHECK_EQ(msg[IMG_AT], 'A');
    OK(kvr_partition_ingest(p, 1, 0, NULL, 0, 0, msg, sizeof msg - 1, NULL));
    msg[IMG_AT] = 'B';
    OK(kvr_partition_ingest(p, 2, 0, NULL, 0, 0, msg, sizeof msg - 1, NULL));
    /* Equal tokens, different images: each worker is credited for its own image only. */
    select_image(p, "imgA", NULL, 1, 1);
    select_image(p, "imgB", NULL, 2, 1);
    select_image(p, "imgC", NULL, 0, 0);
    select_image(p, "imgA", "salt", 0, 0); /* a salt the engine did not use */

    /* Bad input: NULL request or data, invalid UTF-8 salt, too many inputs. */
    kvr_request *r = NULL;
    OK(kvr_request_new(&r));
    CHECK_ST(KVR_ERR_NULL, kvr_request_add_mm_input(NULL, (const uint8_t *)"i", 1, 0, 1));
    CHECK_ST(KVR_ERR_NULL, kvr_request_add_mm_input(r, NULL, 1, 0, 1));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_cache_salt(NULL, "s", 1));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_cache_salt(r, BAD_UTF8, BAD_UTF8_LEN));
    CHECK_ST(KVR_ERR_NULL, kvr_request_add_block_key(NULL, 0, 1));
    /* Absurd offsets, lengths and block indexes are stored as given and touch nothing
       beyond the prompt; the count is bounded. */
    OK(kvr_request_add_mm_input(r, (const uint8_t *)"i", 1, UINT64_MAX, UINT64_MAX));
    OK(kvr_request_add_block_key(r, SIZE_MAX, UINT64_MAX));
    for (size_t i = 1; i < KVR_MAX_MM_INPUTS; i++) {
        OK(kvr_request_add_mm_input(r, (const uint8_t *)"i", 1, 0, 0));
    }
    CHECK_ST(KVR_ERR_TOO_LARGE, kvr_request_add_mm_input(r, (const uint8_t *)"i", 1, 0, 1));
    for (size_t i = 1; i < KVR_MAX_BLOCK_KEYS; i++) {
        OK(kvr_request_add_block_key(r, i, i));
    }
    CHECK_ST(KVR_ERR_TOO_LARGE, kvr_request_add_block_key(r, 0, 1));
    /* A reset forgets them: inputs can be added again. */
    OK(kvr_request_reset(r));
    OK(kvr_request_add_mm_input(r, (const uint8_t *)"i", 1, 0, 1));
    OK(kvr_request_add_block_key(r, 0, 1));
    kvr_request_free(r);
    kvr_partition_free(p);
    kvr_engine_free(e);
}

/* ---- absurd numbers: every caller-supplied size or count at its maximum ------------- */

/* `call` returns OK or a refusal, never a caught panic (and the process is still here:
   nothing aborted on an allocation the number asked for). */
#define NO_PANIC(call)                                                                    \
    do {                                                                                  \
        uint64_t p0_ = kvr_status_count(KVR_ERR_PANIC);                                   \
        kvr_status st_ = (call);                                                          \
        CHECK(st_ != KVR_ERR_PANIC);                                                      \
        CHECK_EQ(kvr_status_count(KVR_ERR_PANIC), p0_);                                   \
    } while (0)

/* A partition whose every numeric option is at its maximum, used for a booked selection,
   output blocks, a free and lookups: the numbers are either refused when set or harmless
   when used. */
static void absurd_partition(kvr_engine *e)
{
    kvr_partition_options *o = new_opts(UINT32_MAX);
    NO_PANIC(kvr_partition_options_set_booking_ttl_ms(o, UINT64_MAX));
    NO_PANIC(kvr_partition_options_set_busy_prefill_tokens(o, UINT64_MAX));
    NO_PANIC(kvr_partition_options_set_kv_hints(o, UINT32_MAX, UINT32_MAX, UINT32_MAX));
    NO_PANIC(kvr_partition_options_set_kv_hints(o, 1, UINT32_MAX, 0));
    NO_PANIC(kvr_partition_options_set_prediction_ttl_ms(o, UINT64_MAX));
    NO_PANIC(kvr_partition_options_set_approx_retention(o, UINT32_MAX));
    NO_PANIC(kvr_partition_options_set_session_affinity(o, UINT32_MAX, 1e308, UINT64_MAX, UINT64_MAX));
    NO_PANIC(kvr_partition_options_set_session_affinity(o, KVR_AFFINITY_SOFT, 1.0, UINT64_MAX, UINT64_MAX));
    char why[8];
    size_t len = 0;
    NO_PANIC(kvr_partition_options_check(o, why, SIZE_MAX, &len));
    kvr_partition *p = NULL;
    NO_PANIC(kvr_engine_create_partition(e, "absurd", 6, "g", 1, o, &p));
    kvr_partition_options_free(o);
    if (p == NULL) {
        CHECK(p != NULL);
        return;
    }
    kvr_worker *w = NULL;
    OK(kvr_worker_new(UINT64_MAX, 2, &w));
    NO_PANIC(kvr_worker_set_role(w, UINT32_MAX));
    NO_PANIC(kvr_worker_set_control_endpoint(w, UINT32_MAX, "tcp://h:1", 9));
    OK(kvr_worker_set_control_endpoint(w, 1, "tcp://h:1", 9));
    OK(kvr_worker_set_total_kv_blocks(w, UINT64_MAX));
    OK(kvr_worker_set_max_batched_tokens(w, UINT64_MAX));
    OK(kvr_partition_upsert_worker(p, w));
    kvr_worker_free(w);
    /* A prompt of two huge blocks' worth of tokens is not a complete block here. */
    static const uint32_t toks[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    kvr_request *r = new_request(toks, 8);
    OK(kvr_request_set_expected_output_tokens(r, UINT64_MAX));
    OK(kvr_request_set_ttl_ms(r, UINT64_MAX));
    NO_PANIC(kvr_request_add_mm_input(r, (const uint8_t *)"i", 1, UINT64_MAX, UINT64_MAX));
    NO_PANIC(kvr_request_add_block_key(r, SIZE_MAX, UINT64_MAX));
    kvr_decision d;
    memset(&d, 0, sizeof d);
    /* A booking whose output would overflow its counters is refused, nothing booked. */
    CHECK_ST(KVR_ERR_TOO_LARGE, kvr_partition_select_and_reserve(p, r, &d));
    OK(kvr_request_set_expected_output_tokens(r, 1u << 20));
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK(d.selection_id != 0);
    /* Output blocks by total (a block index + 1): a retry adds nothing. */
    uint64_t added = 9;
    OK(kvr_engine_set_output_blocks(e, d.selection_id, 5, &added));
    CHECK_EQ(added, 5);
    OK(kvr_engine_set_output_blocks(e, d.selection_id, 5, &added));
    CHECK_EQ(added, 0);
    OK(kvr_engine_set_output_blocks(e, d.selection_id, 3, NULL));
    CHECK_ST(KVR_ERR_TOO_LARGE, kvr_engine_set_output_blocks(e, d.selection_id, UINT64_MAX, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_engine_set_output_blocks(NULL, d.selection_id, 1, NULL));
    CHECK_ST(KVR_ERR_UNKNOWN_SELECTION_ID, kvr_engine_set_output_blocks(e, UINT64_MAX - 7, 1, NULL));
    NO_PANIC(kvr_engine_add_output_blocks(e, d.selection_id, UINT64_MAX));
    NO_PANIC(kvr_engine_add_output_blocks(e, d.selection_id, UINT64_MAX));
    NO_PANIC(kvr_engine_mark_prefill_complete(e, d.selection_id));
    kvr_active_load al;
    NO_PANIC(kvr_partition_active_load(p, UINT64_MAX, 1, &al));
    NO_PANIC(kvr_partition_active_load(p, UINT64_MAX, UINT32_MAX, &al));
    NO_PANIC(kvr_engine_free_booking(e, d.selection_id, NULL));
    /* Hashes with an absurd prompt length; a reservation of an absurd rank. */
    static const uint64_t hashes[2] = {1, 2};
    OK(kvr_request_set_local_hashes(r, hashes, 2, UINT64_MAX));
    memset(&d, 0, sizeof d);
    NO_PANIC(kvr_partition_select_and_reserve(p, r, &d));
    NO_PANIC(kvr_engine_free_booking(e, d.selection_id, NULL));
    const uint64_t huge = UINT64_MAX;
    NO_PANIC(kvr_partition_reserve(p, UINT64_MAX, UINT32_MAX, r, &huge, UINT64_MAX, &d));
    NO_PANIC(kvr_partition_reserve(p, UINT64_MAX, 1, r, &huge, UINT64_MAX - 1, &d));
    NO_PANIC(kvr_engine_add_output_blocks(e, UINT64_MAX - 1, UINT64_MAX));
    NO_PANIC(kvr_engine_free_booking(e, UINT64_MAX - 1, NULL));
    /* Stored events of rank UINT32_MAX: refused (not a rank of the worker) or applied. */
    static const uint64_t L1[1] = {42};
    NO_PANIC(store(p, UINT64_MAX, UINT32_MAX, KVR_TIER_DEVICE, false, 0, 1, L1, 1, NULL));
    NO_PANIC(store(p, 7, UINT32_MAX, UINT32_MAX, true, UINT64_MAX, UINT64_MAX, L1, 1, NULL));
    kvr_request_free(r);
    kvr_partition_free(p);
}

static void test_absurd_numbers(void)
{
    g_section = "absurd numbers";
    kvr_engine *e = new_engine(9);
    absurd_partition(e);
    /* Sizes at SIZE_MAX with real pointers: refused before anything is read. */
    uint32_t t[4] = {0};
    uint64_t h[4] = {0};
    size_t n = 0;
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_hash_tokens(4, NULL, 0, NULL, 0, t, SIZE_MAX, h, h, 4, &n));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_hash_tokens(4, "l", SIZE_MAX, NULL, 0, t, 4, h, h, 4, &n));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_hash_tokens(4, NULL, 0, NULL, 0, t, 4, h, h, SIZE_MAX, &n));
    NO_PANIC(kvr_hash_tokens(UINT32_MAX, NULL, 0, NULL, 0, t, 4, h, h, 4, &n));
    kvr_partition *p = new_partition(e, "sizes");
    kvr_overlap ov[2];
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_find_matches(p, h, SIZE_MAX, ov, 2, &n));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_find_matches(p, h, 1, ov, SIZE_MAX, &n));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_hash_tokens(p, NULL, 0, t, SIZE_MAX, h, h, 4, &n));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_ingest(p, 1, 0, (const uint8_t *)"t", SIZE_MAX, 0, (const uint8_t *)"x", 1, NULL));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_ingest(p, 1, 0, NULL, 0, 0, (const uint8_t *)"x", SIZE_MAX, NULL));
    NO_PANIC(kvr_partition_ingest(p, UINT64_MAX, UINT32_MAX, NULL, 0, UINT64_MAX, STORED_IMG_A, sizeof STORED_IMG_A - 1, NULL));
    kvr_stream_stats st[1];
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_ingress_stats(p, st, SIZE_MAX, &n));
    const char *name = NULL;
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_decode_error_name(UINT32_MAX, &name, &n));
    kvr_request *r = NULL;
    OK(kvr_request_new(&r));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_tokens(r, t, SIZE_MAX));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_local_hashes(r, h, SIZE_MAX, 4));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_lora(r, "l", SIZE_MAX));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_cache_salt(r, "s", SIZE_MAX));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_add_mm_input(r, (const uint8_t *)"i", SIZE_MAX, 0, 1));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_allowed_workers(r, h, SIZE_MAX));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_session(r, "s", SIZE_MAX, NULL, 0, 0, NULL, 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_legacy_session_id(r, "s", SIZE_MAX));
    kvr_request_free(r);
    kvr_worker *w = NULL;
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_new(1, UINT32_MAX, &w));
    OK(kvr_worker_new(1, 1, &w));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_add_lora_adapter(w, "a", SIZE_MAX));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_set_label(w, "k", SIZE_MAX, "v", 1));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_worker_set_control_endpoint(w, 0, "e", SIZE_MAX));
    kvr_worker_free(w);
    kvr_rank_load loads[1];
    memset(loads, 0, sizeof loads);
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_publish_load(p, loads, SIZE_MAX, NULL));
    kvr_subscribe_options *so = NULL;
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_subscribe_options_new_connect("tcp://h:1", SIZE_MAX, 1, 0, &so));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_subscribe_options_new_bind("tcp://h:1", SIZE_MAX, &so));
    kvr_partition_free(p);
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_engine_get_partition(e, "m", SIZE_MAX, "g", 1, &p));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_engine_remove_partition(e, "m", 1, "g", SIZE_MAX));
    kvr_partition_options *o = new_opts(4);
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_cache_namespace(o, "n", SIZE_MAX));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_remote_indexer(o, "u", SIZE_MAX, 1, 1));
    NO_PANIC(kvr_partition_options_set_remote_indexer(o, "http://127.0.0.1:9", 18, UINT64_MAX, UINT64_MAX));
    NO_PANIC(kvr_partition_options_set_approx_index(o, UINT64_MAX, UINT64_MAX));
    kvr_partition_options_free(o);
    kvr_engine_free(e);
}

/* ---- raw engine messages: kvr_partition_ingest ------------------------------------- */

/* [1.0, [{"type":"BlockStored","block_hashes":[1],"parent_block_hash":nil,
           "token_ids":[0,1,2,3],"block_size":4}], 0]  (vLLM 0.33's tagged-map encoding) */
static const uint8_t STORED_0123[] =
    "\x93\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\x91\x85\xa4\x74\x79\x70\x65\xab\x42\x6c\x6f"
    "\x63\x6b\x53\x74\x6f\x72\x65\x64\xac\x62\x6c\x6f\x63\x6b\x5f\x68\x61\x73\x68\x65\x73"
    "\x91\x01\xb1\x70\x61\x72\x65\x6e\x74\x5f\x62\x6c\x6f\x63\x6b\x5f\x68\x61\x73\x68\xc0"
    "\xa9\x74\x6f\x6b\x65\x6e\x5f\x69\x64\x73\x94\x00\x01\x02\x03\xaa\x62\x6c\x6f\x63\x6b"
    "\x5f\x73\x69\x7a\x65\x04\x00";

static void test_ingest(void)
{
    g_section = "ingest";
    kvr_engine *e = new_engine(5);
    kvr_partition *p = new_partition(e, "ingest"); /* block size BS */
    const size_t n = sizeof STORED_0123 - 1;
    kvr_ingest_result r;
    CHECK_ST(KVR_ERR_NULL, kvr_partition_ingest(NULL, 1, 0, NULL, 0, 0, STORED_0123, n, &r));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_ingest(p, 1, 0, NULL, 3, 0, STORED_0123, n, &r));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_ingest(p, 1, 0, NULL, 0, 0, NULL, n, &r));
    OK(kvr_partition_ingest(p, 1, 0, NULL, 0, 0, STORED_0123, n, &r)); /* block size 4 = BS */
    CHECK_EQ(r.batches_applied, 1);
    /* The block is on rank 1/0, hashed from its tokens. */
    uint32_t toks[4] = {0, 1, 2, 3};
    uint64_t local[1];
    size_t nb = 0;
    OK(kvr_partition_hash_tokens(p, NULL, 0, toks, 4, local, NULL, 1, &nb));
    kvr_overlap ov[4];
    size_t no = 0;
    OK(kvr_partition_find_matches(p, local, 1, ov, 4, &no));
    CHECK(no == 1 && ov[0].worker_id == 1 && ov[0].dp_rank == 0 && ov[0].device_blocks == 1);
    /* A duplicate applies nothing; garbage is a decode error and applies nothing. */
    OK(kvr_partition_ingest(p, 1, 0, (const uint8_t *)"t", 1, 0, STORED_0123, n, &r));
    CHECK_EQ(r.batches_applied, 0);
    CHECK_ST(KVR_ERR_DECODE, kvr_partition_ingest(p, 1, 0, NULL, 0, 1, (const uint8_t *)"\x93\x01", 2, &r));
    CHECK_EQ(r.decode_errors, 1);
    /* A restart (seq back to 0) clears the stream's ranks. */
    OK(kvr_partition_ingest(p, 1, 0, NULL, 0, 0, STORED_0123, n, NULL));

    kvr_stream_stats st[2];
    size_t ns = 0;
    CHECK_ST(KVR_ERR_NULL, kvr_partition_ingress_stats(p, st, 2, NULL));
    CHECK_ST(KVR_BUFFER_TOO_SMALL, kvr_partition_ingress_stats(p, st, 0, &ns));
    CHECK_EQ(ns, 1);
    OK(kvr_partition_ingress_stats(p, st, 2, &ns));
    CHECK_EQ(ns, 1);
    CHECK_EQ(st[0].worker_id, 1);
    CHECK_EQ(st[0].messages, 4);
    CHECK_EQ(st[0].duplicates, 1);
    CHECK_EQ(st[0].restarts, 1);
    CHECK_EQ(st[0].last_seq, 0);
    /* A host-fed stream never replays: never recovering, never stale. */
    CHECK(st[0].recovering == 0 && st[0].stale_since_unix_ms == 0 && st[0].idle_probes == 0);
    CHECK(st[0].replays_partial == 0 && st[0].replays_failed == 0);
    CHECK(st[0].events_skipped_group == 0 && st[0].group_switches == 0);
    CHECK_EQ(st[0].events_skipped_medium, 0);
    /* The restart's batch applied after the decode error: exact again, no link. */
    CHECK(st[0].health == KVR_SOURCE_EXACT && st[0].health_reason == 0 && st[0].link_failures == 0);
    CHECK(st[0].health_since_unix_ms > 0);
    uint64_t decode_total = 0;
    for (size_t i = 0; i < KVR_DECODE_ERROR_KINDS; i++) {
        decode_total += st[0].decode_errors[i];
    }
    CHECK_EQ(decode_total, 1);
    CHECK_EQ(st[0].dp_rank_refused, 0);

    /* A batch naming DP rank 4096 (KVR_MAX_DP_SIZE) of a worker not registered is refused
       and counted: the wire never picks which ranks exist. Stream 7: the same batch, its
       last byte (data_parallel_rank 0) replaced by msgpack 4096. */
    uint8_t far[sizeof STORED_0123 + 2];
    memcpy(far, STORED_0123, n - 1);
    memcpy(far + n - 1, "\xcd\x10\x00", 3);
    CHECK_ST(KVR_ERR_UNKNOWN_WORKER, kvr_partition_ingest(p, 1, 7, NULL, 0, 0, far, n + 2, &r));
    CHECK_EQ(r.batches_applied, 0);
    CHECK_EQ(r.refused, 1);
    OK(kvr_partition_ingress_stats(p, st, 2, &ns));
    CHECK_EQ(ns, 2);
    const kvr_stream_stats *s7 = st[0].stream == 7 ? &st[0] : &st[1];
    CHECK(s7->stream == 7 && s7->dp_rank_refused == 1 && s7->events_rejected == 1);
    CHECK_EQ(s7->blocks_stored, 0);

    const char *name = NULL;
    size_t len = 0;
    OK(kvr_decode_error_name(0, &name, &len));
    CHECK(len == strlen("truncated") && memcmp(name, "truncated", len) == 0);
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_decode_error_name(KVR_DECODE_ERROR_KINDS, &name, &len));
    CHECK_ST(KVR_ERR_NULL, kvr_decode_error_name(0, NULL, &len));
    OK(kvr_health_reason_name(4, &name, &len));
    CHECK(len == strlen("decode errors") && memcmp(name, "decode errors", len) == 0);
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_health_reason_name(UINT32_MAX, &name, &len));
    CHECK_ST(KVR_ERR_NULL, kvr_health_reason_name(0, &name, NULL));

    kvr_partition_free(p);
    kvr_engine_free(e);
}

/* ---- kvr's own ZMQ subscriber: kvr_partition_subscribe ---------------------------- */

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static struct sockaddr_in loopback(uint16_t port)
{
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    return a;
}

/* A TCP port of 127.0.0.1 that was free a moment ago (bound as port 0, then released). */
static uint16_t free_port(void)
{
    struct sockaddr_in a = loopback(0);
    socklen_t len = sizeof a;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        fprintf(stderr, "fatal: cannot find a free port: %s\n", strerror(errno));
        exit(2);
    }
    close(fd);
    return ntohs(a.sin_port);
}

/* Whether a listening socket could be bound to 127.0.0.1:port now (SO_REUSEADDR, so
   connections in TIME_WAIT do not count: only another listener does). */
static bool port_bindable(uint16_t port)
{
    struct sockaddr_in a = loopback(port);
    int one = 1;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
        return false;
    }
    bool ok = setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
              bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && listen(fd, 1) == 0;
    close(fd);
    return ok;
}

/* A TCP connection to 127.0.0.1:port (5 s receive timeout), retried for up to
   `timeout_ms` while refused; -1 if none. */
static int tcp_connect(uint16_t port, unsigned timeout_ms)
{
    const uint64_t deadline = now_ms() + timeout_ms;
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) {
            return -1;
        }
        struct timeval tv = {.tv_sec = 5, .tv_usec = 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        struct sockaddr_in a = loopback(port);
        if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
            return fd;
        }
        close(fd);
        if (now_ms() > deadline) {
            return -1;
        }
        sleep_ms(20);
    }
}

static bool send_all(int fd, const void *buf, size_t n)
{
    const unsigned char *b = buf;
    while (n > 0) {
        ssize_t k = send(fd, b, n, MSG_NOSIGNAL);
        if (k <= 0) {
            return false;
        }
        b += k;
        n -= (size_t)k;
    }
    return true;
}

static bool recv_all(int fd, void *buf, size_t n)
{
    unsigned char *b = buf;
    while (n > 0) {
        ssize_t k = recv(fd, b, n, 0);
        if (k <= 0) {
            return false;
        }
        b += k;
        n -= (size_t)k;
    }
    return true;
}

/* One ZMTP 3 frame (flags: 1 = more, 4 = command; long sizes as needed). */
static bool zmtp_frame(int fd, unsigned flags, const void *body, size_t n)
{
    unsigned char h[9];
    size_t hn = 2;
    if (n < 256) {
        h[0] = (unsigned char)flags;
        h[1] = (unsigned char)n;
    } else {
        h[0] = (unsigned char)(flags | 2u);
        for (int i = 0; i < 8; i++) {
            h[1 + i] = (unsigned char)((uint64_t)n >> (56 - 8 * i));
        }
        hn = 9;
    }
    return send_all(fd, h, hn) && send_all(fd, body, n);
}

/*
 * A minimal ZMTP 3.0 PUB peer (NULL mechanism) connected to a SUB bound on
 * 127.0.0.1:port, as a vLLM publisher connects to kvr's bound endpoint: greeting and
 * READY both ways; it ignores what the SUB sends after that (its subscriptions) and
 * filters nothing. -1 on failure.
 */
static int zmtp_pub_connect(uint16_t port)
{
    int fd = tcp_connect(port, 30000);
    if (fd < 0) {
        return -1;
    }
    unsigned char greeting[64] = {0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 0, 'N', 'U', 'L', 'L'};
    unsigned char peer[64];
    static const unsigned char ready[] = {5,   'R', 'E', 'A', 'D', 'Y', 11,  'S', 'o',
                                          'c', 'k', 'e', 't', '-', 'T', 'y', 'p', 'e',
                                          0,   0,   0,   3,   'P', 'U', 'B'};
    unsigned char flags = 0, size = 0, body[255];
    bool ok = send_all(fd, greeting, sizeof greeting) && recv_all(fd, peer, sizeof peer) &&
              peer[0] == 0xff && peer[9] == 0x7f && peer[10] >= 3 &&
              zmtp_frame(fd, 4, ready, sizeof ready) && recv_all(fd, &flags, 1) &&
              flags == 4 /* a short command */ && recv_all(fd, &size, 1) &&
              recv_all(fd, body, size) && size >= 6 && memcmp(body, "\x05READY", 6) == 0;
    if (!ok) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Publishes one vLLM message [topic, seq (8 bytes big-endian), payload]. */
static bool zmtp_publish(int fd, const char *topic, uint64_t seq, const uint8_t *payload, size_t n)
{
    unsigned char be[8];
    for (int i = 0; i < 8; i++) {
        be[i] = (unsigned char)(seq >> (56 - 8 * i));
    }
    return zmtp_frame(fd, 1, topic, strlen(topic)) && zmtp_frame(fd, 1, be, 8) &&
           zmtp_frame(fd, 0, payload, n);
}

/* The counters of worker `worker`'s newest stream, or all zeros if it has none yet (a
   stopped subscription's streams keep their counters: a subscription whose route names
   a replay endpoint registers its stream at once, to probe it). */
static kvr_stream_stats stream_of(const kvr_partition *p, uint64_t worker)
{
    kvr_stream_stats st[16], found;
    memset(&found, 0, sizeof found);
    size_t n = 0;
    if (kvr_partition_ingress_stats(p, st, 16, &n) != KVR_OK) {
        return found;
    }
    for (size_t i = 0; i < n && i < 16; i++) {
        if (st[i].worker_id == worker) {
            found = st[i];
        }
    }
    return found;
}

/* Waits up to 30 s until worker's stream has taken `messages` messages. */
static bool wait_messages(const kvr_partition *p, uint64_t worker, uint64_t messages)
{
    const uint64_t deadline = now_ms() + 30000;
    while (stream_of(p, worker).messages < messages) {
        if (now_ms() > deadline) {
            return false;
        }
        sleep_ms(10);
    }
    return true;
}

static uint32_t running(const kvr_subscription *s)
{
    uint32_t r = 99;
    OK(kvr_subscription_is_running(s, &r));
    return r;
}

/* Subscribes p with `o` (freed here); NULL if that failed. */
static kvr_subscription *subscribe_with(const kvr_partition *p, kvr_subscribe_options *o)
{
    kvr_subscription *s = NULL;
    OK(kvr_partition_subscribe(p, o, &s));
    kvr_subscribe_options_free(o);
    return s;
}

static void test_subscribe(void)
{
    g_section = "subscribe";
    kvr_engine *e = new_engine(16);
    kvr_partition *p = new_partition(e, "subscribe"); /* block size BS */
    kvr_subscribe_options *o = NULL, *ob = NULL;
    kvr_subscription *s = NULL;
    char ep[64];

    /* Options: NULL out-parameters and handles, (NULL, n) strings, invalid UTF-8, the
       mode each setter belongs to. */
    const char *any = "tcp://127.0.0.1:1";
    CHECK_ST(KVR_ERR_NULL, kvr_subscribe_options_new_connect(any, strlen(any), 1, 0, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_subscribe_options_new_connect(NULL, 5, 1, 0, &o));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_subscribe_options_new_connect(BAD_UTF8, BAD_UTF8_LEN, 1, 0, &o));
    CHECK_ST(KVR_ERR_NULL, kvr_subscribe_options_new_bind(any, strlen(any), NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_subscribe_options_new_bind(NULL, 5, &ob));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_subscribe_options_new_bind(BAD_UTF8, BAD_UTF8_LEN, &ob));
    CHECK(o == NULL && ob == NULL);
    OK(kvr_subscribe_options_new_connect(any, strlen(any), 1, 0, &o));
    OK(kvr_subscribe_options_new_bind(any, strlen(any), &ob));
    CHECK(o != NULL && ob != NULL);

    CHECK_ST(KVR_ERR_NULL, kvr_subscribe_options_set_replay_endpoint(NULL, any, strlen(any)));
    CHECK_ST(KVR_ERR_NULL, kvr_subscribe_options_set_replay_endpoint(o, NULL, 3));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_subscribe_options_set_replay_endpoint(o, BAD_UTF8, BAD_UTF8_LEN));
    OK(kvr_subscribe_options_set_replay_endpoint(o, any, strlen(any)));
    OK(kvr_subscribe_options_set_replay_endpoint(o, NULL, 0)); /* none again */
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_subscribe_options_set_replay_endpoint(ob, any, strlen(any)));

    CHECK_ST(KVR_ERR_NULL, kvr_subscribe_options_set_topic(NULL, (const uint8_t *)"kv", 2));
    CHECK_ST(KVR_ERR_NULL, kvr_subscribe_options_set_topic(o, NULL, 2));
    OK(kvr_subscribe_options_set_topic(o, (const uint8_t *)"kv", 2));
    OK(kvr_subscribe_options_set_topic(o, (const uint8_t *)"\xff", 1)); /* bytes, not UTF-8 */
    OK(kvr_subscribe_options_set_topic(o, NULL, 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_subscribe_options_set_topic(ob, (const uint8_t *)"kv", 2));

    CHECK_ST(KVR_ERR_NULL, kvr_subscribe_options_set_max_unrouted_topics(NULL, 8));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_subscribe_options_set_max_unrouted_topics(o, 8));
    OK(kvr_subscribe_options_set_max_unrouted_topics(ob, 8));
    OK(kvr_subscribe_options_set_max_unrouted_topics(ob, 0)); /* routed topics only */

    CHECK_ST(KVR_ERR_NULL, kvr_subscribe_options_add_route(NULL, (const uint8_t *)"kv", 2, 9, 0, NULL, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_subscribe_options_add_route(ob, NULL, 2, 9, 0, NULL, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_subscribe_options_add_route(ob, (const uint8_t *)"kv", 2, 9, 0, NULL, 4));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_subscribe_options_add_route(ob, (const uint8_t *)"kv", 2, 9, 0, BAD_UTF8, BAD_UTF8_LEN));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_subscribe_options_add_route(o, (const uint8_t *)"kv", 2, 9, 0, NULL, 0));
    OK(kvr_subscribe_options_add_route(ob, NULL, 0, 8, 0, NULL, 0)); /* the empty topic */

    /* kvr_partition_subscribe: NULL handles and out-parameter. */
    CHECK_ST(KVR_ERR_NULL, kvr_partition_subscribe(NULL, o, &s));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_subscribe(p, NULL, &s));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_subscribe(p, o, NULL));
    CHECK(s == NULL);
    kvr_subscribe_options_free(o);
    kvr_subscribe_options_free(ob);

    /* Invalid endpoints: nothing starts. */
    static const char *const bad_connect[] = {
        "", "tcp://127.0.0.1", "127.0.0.1:5557", "tcp://127.0.0.1:65536", "udp://127.0.0.1:1",
        "tcp://*:5557", /* `*` can only be bound */
    };
    for (size_t i = 0; i < sizeof bad_connect / sizeof bad_connect[0]; i++) {
        o = NULL;
        OK(kvr_subscribe_options_new_connect(bad_connect[i], strlen(bad_connect[i]), 1, 0, &o));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_subscribe(p, o, &s));
        kvr_subscribe_options_free(o);
    }
    static const char *const bad_bind[] = {"", "tcp://127.0.0.1", "tcp://127.0.0.1:70000", "zmq"};
    for (size_t i = 0; i < sizeof bad_bind / sizeof bad_bind[0]; i++) {
        ob = NULL;
        OK(kvr_subscribe_options_new_bind(bad_bind[i], strlen(bad_bind[i]), &ob));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_subscribe(p, ob, &s));
        kvr_subscribe_options_free(ob);
    }
    /* A malformed replay endpoint, of the connect options or of a route. */
    OK(kvr_subscribe_options_new_connect(any, strlen(any), 1, 0, &o));
    OK(kvr_subscribe_options_set_replay_endpoint(o, "tcp://x", 7));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_subscribe(p, o, &s));
    kvr_subscribe_options_free(o);
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%u", (unsigned)free_port());
    OK(kvr_subscribe_options_new_bind(ep, strlen(ep), &ob));
    OK(kvr_subscribe_options_add_route(ob, (const uint8_t *)"kv", 2, 9, 0, "tcp://*:5558", 12));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_subscribe(p, ob, &s));
    OK(kvr_subscribe_options_add_route(ob, (const uint8_t *)"kv", 2, 9, 0, "tcp://127.0.0.1:5558", 20));
    size_t nstreams = 99;
    OK(kvr_partition_ingress_stats(p, NULL, 0, &nstreams));
    CHECK_EQ(nstreams, 0); /* a refused subscription leaves no stream behind */
    s = subscribe_with(p, ob); /* the later route replaced the bad one */
    CHECK(s != NULL);
    kvr_subscription_free(s);
    s = NULL;

    /* Stop / is_running: NULL handles and out-parameters. */
    CHECK_ST(KVR_ERR_NULL, kvr_subscription_stop(NULL));
    uint32_t r = 0;
    CHECK_ST(KVR_ERR_NULL, kvr_subscription_is_running(NULL, &r));

    /* Connect mode to an engine that is not there: kvr keeps trying until stopped. */
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%u", (unsigned)free_port());
    OK(kvr_subscribe_options_new_connect(ep, strlen(ep), 3, 0, &o));
    OK(kvr_subscribe_options_set_replay_endpoint(o, ep, strlen(ep)));
    OK(kvr_subscribe_options_set_topic(o, (const uint8_t *)"kv", 2));
    s = subscribe_with(p, o);
    CHECK_ST(KVR_ERR_NULL, kvr_subscription_is_running(s, NULL));
    CHECK_EQ(running(s), 1);
    OK(kvr_subscription_stop(s));
    CHECK_EQ(running(s), 0);
    OK(kvr_subscription_stop(s)); /* idempotent */
    CHECK_EQ(running(s), 0);
    kvr_subscription_free(s);

    /* Bind mode on a free port of 127.0.0.1, with a publisher speaking ZMTP: topic "kv"
       is routed to worker 9; its batches are applied until the stop, none after. */
    const uint16_t port = free_port();
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%u", (unsigned)port);
    OK(kvr_subscribe_options_new_bind(ep, strlen(ep), &ob));
    OK(kvr_subscribe_options_add_route(ob, (const uint8_t *)"kv", 2, 9, 0, NULL, 0));
    s = subscribe_with(p, ob);
    CHECK_EQ(running(s), 1);
    int pub = zmtp_pub_connect(port); /* retried until kvr's bind is up */
    CHECK(pub >= 0);
    CHECK(!port_bindable(port)); /* kvr listens on it */
    const size_t n = sizeof STORED_0123 - 1;
    CHECK(pub >= 0 && zmtp_publish(pub, "kv", 0, STORED_0123, n));
    CHECK(wait_messages(p, 9, 1));
    uint32_t toks[4] = {0, 1, 2, 3};
    uint64_t local[1];
    size_t nb = 0;
    OK(kvr_partition_hash_tokens(p, NULL, 0, toks, 4, local, NULL, 1, &nb));
    kvr_overlap ov[4];
    size_t no = 0;
    OK(kvr_partition_find_matches(p, local, 1, ov, 4, &no));
    CHECK(no == 1 && ov[0].worker_id == 9 && ov[0].dp_rank == 0 && ov[0].device_blocks == 1);
    CHECK(pub >= 0 && zmtp_publish(pub, "kv", 1, STORED_0123, n));
    CHECK(wait_messages(p, 9, 2));
    kvr_stream_stats st = stream_of(p, 9);
    CHECK_EQ(st.batches, 2);
    CHECK_EQ(st.last_seq, 1);
    CHECK_EQ(st.gaps, 0);
    OK(kvr_subscription_stop(s));
    CHECK_EQ(running(s), 0);
    CHECK(port_bindable(port)); /* the listener is closed */
    /* After the stop, nothing more is applied (the send may fail: the peer is gone). */
    if (pub >= 0) {
        (void)zmtp_publish(pub, "kv", 2, STORED_0123, n);
        (void)zmtp_publish(pub, "kv", 3, (const uint8_t *)"\x93\x01", 2);
    }
    sleep_ms(200);
    st = stream_of(p, 9);
    CHECK_EQ(st.messages, 2);
    CHECK_EQ(st.last_seq, 1);
    OK(kvr_subscription_stop(s)); /* double stop */
    kvr_subscription_free(s);
    if (pub >= 0) {
        close(pub);
    }

    /* Free without stop, after the partition and engine handles: the subscription holds
       the partition, and kvr_subscription_free stops it (the port is released). */
    const uint16_t port2 = free_port();
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%u", (unsigned)port2);
    OK(kvr_subscribe_options_new_bind(ep, strlen(ep), &ob));
    s = subscribe_with(p, ob);
    kvr_partition_free(p);
    kvr_engine_free(e);
    pub = zmtp_pub_connect(port2);
    CHECK(pub >= 0);
    /* Topic "kv-4" names worker 4 (no route): applied to the partition nobody else holds. */
    CHECK(pub >= 0 && zmtp_publish(pub, "kv-4", 0, STORED_0123, n));
    sleep_ms(100);
    CHECK_EQ(running(s), 1);
    kvr_subscription_free(s);
    CHECK(port_bindable(port2));
    if (pub >= 0) {
        close(pub);
    }
}

/* ------------------------------------------------------------------------------------ */
/* Indexer policies, the remote primary, transfer hints, session affinity (issue 7)      */
/* ------------------------------------------------------------------------------------ */

static kvr_indexer_stats indexer_stats(const kvr_partition *p)
{
    kvr_indexer_stats s;
    memset(&s, SENTINEL, sizeof s);
    OK(kvr_partition_indexer_stats(p, &s));
    return s;
}

static kvr_session_stats session_stats(const kvr_partition *p)
{
    kvr_session_stats s;
    memset(&s, SENTINEL, sizeof s);
    OK(kvr_partition_session_stats(p, &s));
    return s;
}

/* kvr_partition_options_check's text into `why` (NUL-terminated); returns its status. */
static kvr_status check_opts(const kvr_partition_options *o, char *why, size_t cap)
{
    size_t len = 0;
    kvr_status st = kvr_partition_options_check(o, why, cap - 1, &len);
    why[len < cap - 1 ? len : cap - 1] = '\0';
    return st;
}

static void test_indexer_options(void)
{
    g_section = "indexer options";
    kvr_engine *e = new_engine(21);
    kvr_partition_options *o = new_opts(BS);
    char why[512];
    size_t len = 7;

    /* Setters: NULL handles, bad strings, out-of-range values. */
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_use_kv_events(NULL, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_trust_stale_overlap(NULL, 1));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_prediction_ttl_ms(NULL, 1));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_remote_indexer(NULL, "http://h", 8, 0, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_remote_indexer(o, NULL, 8, 0, 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_partition_options_set_remote_indexer(o, BAD_UTF8, BAD_UTF8_LEN, 0, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_approx_index(NULL, 1, 1));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_approx_index(o, 0, 1));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_approx_index(o, 1, 0));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_approx_retention(NULL, KVR_RETENTION_TTL));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_approx_retention(o, 2));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_check(NULL, why, sizeof why, &len));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_check(o, why, sizeof why, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_check(o, NULL, 4, &len));

    /* Defaults: valid, no notices; the event-driven policy. */
    OK(kvr_partition_options_set_trust_stale_overlap(o, 0));
    OK(kvr_partition_options_check(o, NULL, 0, &len));
    CHECK_EQ(len, 0);

    /* DESIGN.md §5's rejected row: a remote primary with events off. The check and the
       creation both refuse, with the reason; nothing is created; the status is counted. */
    const char *url = "http://127.0.0.1:9";
    OK(kvr_partition_options_set_remote_indexer(o, url, strlen(url), 0, 0));
    OK(kvr_partition_options_set_use_kv_events(o, 0));
    CHECK_ST(KVR_ERR_INVALID_CONFIG, check_opts(o, why, sizeof why));
    CHECK(strstr(why, "KV events off") != NULL);
    CHECK_ST(KVR_ERR_INVALID_CONFIG, kvr_partition_options_check(o, NULL, 0, &len));
    CHECK_EQ(len, strlen(why)); /* the full length, with no buffer */
    char small[8];
    memset(small, SENTINEL, sizeof small);
    CHECK_ST(KVR_ERR_INVALID_CONFIG, kvr_partition_options_check(o, small, 4, &len));
    CHECK(memcmp(small, why, 4) == 0 && all_bytes(small + 4, 4, SENTINEL)); /* truncated */
    uint64_t refused = kvr_status_count(KVR_ERR_INVALID_CONFIG);
    kvr_partition *p = NULL;
    CHECK_ST(KVR_ERR_INVALID_CONFIG, kvr_engine_create_partition(e, "r", 1, "g", 1, o, &p));
    CHECK(p == NULL);
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION, kvr_engine_get_partition(e, "r", 1, "g", 1, &p));
    CHECK_EQ(kvr_status_count(KVR_ERR_INVALID_CONFIG), refused + 1);
    CHECK(strcmp(kvr_status_str(KVR_ERR_INVALID_CONFIG), "invalid partition configuration") == 0);

    /* A URL kvr cannot use (TLS is not supported): refused with the URL named. */
    OK(kvr_partition_options_set_use_kv_events(o, 1));
    const char *tls = "https://index:443";
    OK(kvr_partition_options_set_remote_indexer(o, tls, strlen(tls), 0, 0));
    CHECK_ST(KVR_ERR_INVALID_CONFIG, check_opts(o, why, sizeof why));
    CHECK(strstr(why, "https://index:443") != NULL);
    OK(kvr_partition_options_set_remote_indexer(o, url, strlen(url), 0, 0));
    OK(check_opts(o, why, sizeof why)); /* remote primary, events on: valid */
    OK(kvr_partition_options_set_remote_indexer(o, NULL, 0, 0, 0)); /* none again */

    /* Capacity-bounded retention is accepted with a notice (it falls back to TTL). */
    OK(kvr_partition_options_set_use_kv_events(o, 0));
    OK(kvr_partition_options_set_approx_retention(o, KVR_RETENTION_CAPACITY_BOUNDED));
    OK(check_opts(o, why, sizeof why));
    CHECK(strstr(why, "capacity-bounded") != NULL);
    OK(kvr_partition_options_set_approx_retention(o, KVR_RETENTION_TTL));
    OK(check_opts(o, why, sizeof why));
    CHECK_EQ(strlen(why), 0);
    kvr_partition_options_free(o);
    kvr_engine_free(e);
}

/* Events off: the approximate primary holds what bookings recorded; advisory selection
   records nothing; engine events are ignored and counted. */
static void test_approximate_primary(void)
{
    g_section = "approximate primary";
    kvr_engine *e = new_engine(22);
    kvr_partition_options *o = new_opts(BS);
    OK(kvr_partition_options_set_use_kv_events(o, 0));
    OK(kvr_partition_options_set_approx_index(o, 60000, 1024));
    kvr_partition *p = new_partition_with(e, "approx", o);
    add_worker(p, 1);
    add_worker(p, 2);
    add_worker(p, 3);
    kvr_indexer_stats s = indexer_stats(p);
    CHECK_EQ(s.policy, KVR_INDEXER_APPROXIMATE_PRIMARY);
    CHECK_EQ(s.reserved, 0);
    CHECK_EQ(s.bookings_recorded, 0);

    /* Advisory selection records nothing. */
    kvr_request *r = new_request(T, NT);
    kvr_decision d;
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.device_blocks, 0);
    CHECK_EQ(indexer_stats(p).bookings_recorded, 0);

    /* A booking records its prompt on its rank: the same prompt now finds it there. */
    OK(kvr_partition_select_and_reserve(p, r, &d));
    const uint64_t first = d.worker_id;
    CHECK_EQ(d.device_blocks, 0);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, first);
    CHECK_EQ(d.device_blocks, NB);
    s = indexer_stats(p);
    CHECK_EQ(s.bookings_recorded, 1);
    CHECK_EQ(s.approx_records, 1);
    CHECK_EQ(s.approx_blocks_recorded, NB);
    CHECK_EQ(s.record_failures, 0);
    CHECK(s.approx_record_errors == 0 && s.approx_blocks_over_bound == 0);

    /* An explicit reservation carrying the prompt records it too (a refresh here). */
    OK(kvr_partition_reserve(p, first, 0, r, NULL, 0, &d));
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    s = indexer_stats(p);
    CHECK_EQ(s.bookings_recorded, 2);
    CHECK_EQ(s.approx_blocks_refreshed, NB);

    /* Engine events are not applied to an approximate primary: ignored, counted. */
    kvr_apply_result res;
    memset(&res, SENTINEL, sizeof res);
    OK(store(p, 2, 0, KVR_TIER_DEVICE, false, 0, 201, L, NB, &res));
    CHECK_EQ(res.events_applied, 0);
    CHECK_EQ(res.blocks_stored, 0);
    CHECK_EQ(indexer_stats(p).events_ignored, 1);
    kvr_overlap ov[4];
    size_t n = 0;
    OK(kvr_partition_find_matches(p, L, NB, ov, 4, &n));
    CHECK(n == 1 && ov[0].worker_id == first); /* only the recorded booking */

    CHECK_ST(KVR_ERR_NULL, kvr_partition_indexer_stats(NULL, &s));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_indexer_stats(p, NULL));
    kvr_request_free(r);
    kvr_partition_free(p);
    kvr_engine_free(e);
}

/* Events on plus a prediction side index: a booking counts before its engine's events. */
static void test_prediction_index(void)
{
    g_section = "prediction index";
    kvr_engine *e = new_engine(23);
    kvr_partition_options *o = new_opts(BS);
    OK(kvr_partition_options_set_prediction_ttl_ms(o, 60000));
    kvr_partition *p = new_partition_with(e, "predict", o);
    add_worker(p, 1);
    add_worker(p, 2);
    CHECK_EQ(indexer_stats(p).policy, KVR_INDEXER_EVENT_DRIVEN_WITH_PREDICTION);
    kvr_request *r = new_request(T, NT);
    kvr_decision d;
    OK(kvr_partition_select_and_reserve(p, r, &d));
    const uint64_t booked = d.worker_id;
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, booked);
    CHECK_EQ(d.device_blocks, NB); /* from the side index: no event arrived */
    /* A host's lookup reads what selection scores: the side index's prediction too. */
    kvr_overlap ov[4];
    size_t nov = 0;
    OK(kvr_partition_find_matches(p, L, NB, ov, 4, &nov));
    CHECK_EQ(nov, 1);
    CHECK(ov[0].worker_id == booked && ov[0].device_blocks == NB);
    OK(kvr_partition_find_matches_tiered(p, L, NB, ov, 4, &nov));
    CHECK(nov == 1 && ov[0].worker_id == booked && ov[0].device_blocks == NB);
    /* Events still feed the primary. */
    OK(store(p, 2, 0, KVR_TIER_DEVICE, false, 0, 201, L, 2, NULL));
    CHECK_EQ(indexer_stats(p).events_ignored, 0);
    kvr_request_free(r);
    kvr_partition_free(p);

    /* Without a prediction TTL: the plain event-driven policy, bookings record nothing. */
    p = new_partition(e, "events");
    add_worker(p, 1);
    r = new_request(T, NT);
    OK(kvr_partition_select_and_reserve(p, r, &d));
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.device_blocks, 0);
    kvr_indexer_stats s = indexer_stats(p);
    CHECK_EQ(s.policy, KVR_INDEXER_EVENT_DRIVEN);
    CHECK_EQ(s.bookings_recorded, 0);
    kvr_request_free(r);
    kvr_partition_free(p);
    kvr_engine_free(e);
}

/* A one-connection HTTP server for the remote primary: answers per `mode`. */
enum { HTTP_ANSWER, HTTP_GARBAGE, HTTP_HANG };
typedef struct {
    int listen_fd;
    int mode;
    char request[8192];
} http_server;

static int http_serve(void *arg)
{
    http_server *s = arg;
    int fd = accept(s->listen_fd, NULL, NULL);
    if (fd < 0) {
        return 1;
    }
    struct timeval tv = {.tv_sec = 5, .tv_usec = 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    size_t n = 0;
    /* The request ends with its JSON body's closing brace. */
    while (n < sizeof s->request - 1) {
        ssize_t k = recv(fd, s->request + n, sizeof s->request - 1 - n, 0);
        if (k <= 0) {
            break;
        }
        n += (size_t)k;
        s->request[n] = '\0';
        if (strstr(s->request, "\r\n\r\n") != NULL && s->request[n - 1] == '}') {
            break;
        }
    }
    char reply[512];
    if (s->mode == HTTP_ANSWER) {
        /* Dynamo's tiered answer: worker 2 holds all six blocks on its device. */
        const char *body = "{\"block_size\":4,\"tiered\":{\"device\":{\"scores\":[[{\"worker_id\":2,"
                           "\"dp_rank\":0},6]],\"frequencies\":[]},\"lower_tier\":[[\"host_pinned\","
                           "{\"hits\":[]}]]}}";
        snprintf(reply, sizeof reply,
                 "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                 "%zu\r\nConnection: close\r\n\r\n%s",
                 strlen(body), body);
        send_all(fd, reply, strlen(reply));
    } else if (s->mode == HTTP_GARBAGE) {
        snprintf(reply, sizeof reply,
                 "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                 "9\r\nConnection: close\r\n\r\nnot json!");
        send_all(fd, reply, strlen(reply));
    } else {
        sleep_ms(600); /* past the client's request timeout */
    }
    close(fd);
    return 0;
}

/* Listens on an ephemeral loopback port; returns it (0 on failure). */
static uint16_t http_listen(http_server *s, int mode)
{
    memset(s, 0, sizeof *s);
    s->mode = mode;
    s->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(0);
    socklen_t al = sizeof a;
    if (s->listen_fd < 0 || bind(s->listen_fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        listen(s->listen_fd, 4) != 0 ||
        getsockname(s->listen_fd, (struct sockaddr *)&a, &al) != 0) {
        return 0;
    }
    return ntohs(a.sin_port);
}

/* A remote-primary partition `model` on `url` with workers 1-3. */
static kvr_partition *remote_partition(kvr_engine *e, const char *model, const char *url,
                                       uint64_t request_timeout_ms)
{
    kvr_partition_options *o = new_opts(BS);
    OK(kvr_partition_options_set_remote_indexer(o, url, strlen(url), 1000, request_timeout_ms));
    kvr_partition *p = new_partition_with(e, model, o);
    add_worker(p, 1);
    add_worker(p, 2);
    add_worker(p, 3);
    return p;
}

static void test_remote_primary(void)
{
    g_section = "remote primary";
    kvr_engine *e = new_engine(24);
    kvr_request *r = new_request(T, NT);
    kvr_decision d;
    char url[64];

    /* A remote that answers: its overlap decides the selection; kvr sent Dynamo's request:
       the prompt's local hashes as signed i64, then the partition. */
    http_server s;
    uint16_t port = http_listen(&s, HTTP_ANSWER);
    CHECK(port != 0);
    snprintf(url, sizeof url, "http://127.0.0.1:%u", (unsigned)port);
    kvr_partition *p = remote_partition(e, "remote", url, 5000);
    CHECK_EQ(indexer_stats(p).policy, KVR_INDEXER_REMOTE_PRIMARY);
    thrd_t t;
    CHECK(thrd_create(&t, http_serve, &s) == thrd_success);
    OK(kvr_partition_select(p, r, &d));
    thrd_join(t, NULL);
    CHECK_EQ(d.worker_id, 2);
    CHECK_EQ(d.device_blocks, NB);
    CHECK(strncmp(s.request, "POST /query_tiered_by_hash ", 27) == 0);
    char hashes[NB * 24 + 64] = "{\"block_hashes\":[";
    int negative = 0;
    for (size_t i = 0; i < NB; i++) {
        char h[24];
        snprintf(h, sizeof h, "%s%" PRId64, i ? "," : "", (int64_t)L[i]);
        strcat(hashes, h);
        negative += (int64_t)L[i] < 0;
    }
    strcat(hashes, "],\"model_name\":\"remote\",\"routing_group\":\"g\"}");
    CHECK(negative > 0); /* the prompt has hashes above 2^63: the signed form is checked */
    CHECK(strstr(s.request, hashes) != NULL);
    CHECK(strstr(s.request, "block_size") == NULL);
    kvr_indexer_stats st = indexer_stats(p);
    CHECK_EQ(st.remote_queries, 1);
    CHECK_EQ(st.remote_failures, 0);
    /* A host's lookup asks the remote too, and agrees with what selection scored (the
       local index of a remote-primary partition is empty). */
    CHECK(thrd_create(&t, http_serve, &s) == thrd_success);
    kvr_overlap ov[4];
    size_t nov = 0;
    OK(kvr_partition_find_matches(p, L, NB, ov, 4, &nov));
    thrd_join(t, NULL);
    close(s.listen_fd);
    CHECK_EQ(nov, 1);
    CHECK(ov[0].worker_id == 2 && ov[0].dp_rank == 0 && ov[0].device_blocks == NB);
    CHECK(strncmp(s.request, "POST /query_tiered_by_hash ", 27) == 0);
    CHECK_EQ(indexer_stats(p).remote_queries, 2);
    /* A remote primary applies no engine events (ignored, counted) and starts no
       subscription. */
    kvr_apply_result res;
    OK(store(p, 3, 0, KVR_TIER_DEVICE, false, 0, 301, L, NB, &res));
    CHECK_EQ(res.events_applied, 0);
    CHECK_EQ(indexer_stats(p).events_ignored, 1);
    kvr_subscribe_options *so = NULL;
    kvr_subscription *sub = NULL;
    OK(kvr_subscribe_options_new_connect("tcp://127.0.0.1:5557", 20, 3, 0, &so));
    CHECK_ST(KVR_ERR_INVALID_CONFIG, kvr_partition_subscribe(p, so, &sub));
    CHECK(sub == NULL);
    kvr_subscribe_options_free(so);
    kvr_partition_free(p);

    /* Refused (nothing listens), garbage, hang: each selection still succeeds without
       overlap, and each failure is counted. */
    port = http_listen(&s, HTTP_GARBAGE);
    close(s.listen_fd); /* nothing listens on `port` now */
    snprintf(url, sizeof url, "http://127.0.0.1:%u", (unsigned)port);
    p = remote_partition(e, "refused", url, 5000);
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK_EQ(d.device_blocks, 0);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    st = indexer_stats(p);
    CHECK(st.remote_queries == 1 && st.remote_failures == 1);
    kvr_partition_free(p);

    const int modes[] = {HTTP_GARBAGE, HTTP_HANG};
    const char *names[] = {"garbage", "hang"};
    for (int i = 0; i < 2; i++) {
        port = http_listen(&s, modes[i]);
        CHECK(port != 0);
        snprintf(url, sizeof url, "http://127.0.0.1:%u", (unsigned)port);
        p = remote_partition(e, names[i], url, modes[i] == HTTP_HANG ? 100 : 5000);
        CHECK(thrd_create(&t, http_serve, &s) == thrd_success);
        const uint64_t t0 = now_ms();
        OK(kvr_partition_select(p, r, &d));
        const uint64_t took = now_ms() - t0;
        thrd_join(t, NULL);
        close(s.listen_fd);
        CHECK_EQ(d.device_blocks, 0);
        st = indexer_stats(p);
        CHECK(st.remote_queries == 1 && st.remote_failures == 1);
        if (modes[i] == HTTP_HANG) {
            CHECK(took < 550); /* the request timeout (100 ms) ended it, not the server */
        }
        kvr_partition_free(p);
    }
    kvr_request_free(r);
    kvr_engine_free(e);
}

/* Transfer hints (DESIGN.md §7): worker 1 (decode, the pin) holds 1 block; worker 2
   (prefill, with a control endpoint) all 6; worker 3 (decode, with an endpoint) all 6. */
static kvr_partition *hint_partition(kvr_engine *e, const char *model, uint32_t w1_blocks,
                                     bool hints)
{
    kvr_partition_options *o = new_opts(BS);
    if (hints) {
        OK(kvr_partition_options_set_kv_hints(o, 2, 3, KVR_ROLE_MASK_PREFILL | KVR_ROLE_MASK_AGGREGATED));
    }
    kvr_partition *p = new_partition_with(e, model, o);
    const uint32_t roles[] = {KVR_ROLE_DECODE, KVR_ROLE_PREFILL, KVR_ROLE_DECODE};
    const char *eps[] = {NULL, "tcp://peer:7000", "tcp://decode:7000"};
    for (uint64_t w = 1; w <= 3; w++) {
        kvr_worker *k = NULL;
        OK(kvr_worker_new(w, 1, &k));
        OK(kvr_worker_set_role(k, roles[w - 1]));
        if (eps[w - 1] != NULL) {
            OK(kvr_worker_set_control_endpoint(k, 0, eps[w - 1], strlen(eps[w - 1])));
        }
        OK(kvr_partition_upsert_worker(p, k));
        kvr_worker_free(k);
    }
    OK(store(p, 1, 0, KVR_TIER_DEVICE, false, 0, 101, L, w1_blocks, NULL));
    OK(store(p, 2, 0, KVR_TIER_DEVICE, false, 0, 201, L, NB, NULL));
    OK(store(p, 3, 0, KVR_TIER_DEVICE, false, 0, 301, L, NB, NULL));
    return p;
}

static void test_kv_hints(void)
{
    g_section = "kv hints";
    kvr_engine *e = new_engine(25);
    kvr_partition_options *o = new_opts(BS);
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_kv_hints(NULL, 4, 4096, KVR_ROLE_MASK_PREFILL));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_kv_hints(o, 4, 4096, 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_kv_hints(o, 4, 4096, 1u << 3));
    OK(kvr_partition_options_set_kv_hints(o, 4, 0, 0)); /* off */
    kvr_partition_options_free(o);

    /* A control endpoint travels inline in the hint: at most 511 bytes. */
    kvr_worker *w = NULL;
    OK(kvr_worker_new(9, 1, &w));
    char long_ep[KVR_CONTROL_ENDPOINT_CAP + 1];
    memset(long_ep, 'a', sizeof long_ep);
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_worker_set_control_endpoint(w, 0, long_ep, KVR_CONTROL_ENDPOINT_MAX_LEN + 1));
    OK(kvr_worker_set_control_endpoint(w, 0, long_ep, KVR_CONTROL_ENDPOINT_MAX_LEN));
    kvr_worker_free(w);

    kvr_partition *p = hint_partition(e, "hints", 1, true);
    kvr_request *r = new_request(T, NT);
    OK(kvr_request_set_pinned_worker(r, 1));
    kvr_decision d;
    kvr_kv_hint h;

    /* Booked: a hint from worker 2 (worker 3's role may not serve), blocks [1, 4): from
       the chosen rank's prefix, capped at 3 blocks. */
    memset(&h, SENTINEL, sizeof h);
    OK(kvr_partition_select_and_reserve_with_hint(p, r, &d, &h));
    CHECK_EQ(d.worker_id, 1);
    CHECK_EQ(d.flags, KVR_DECISION_KV_HINT);
    CHECK_EQ(h.source_worker_id, 2);
    CHECK_EQ(h.source_dp_rank, 0);
    CHECK_EQ(h.block_start, 1);
    CHECK_EQ(h.block_end, 4);
    CHECK_EQ(h.control_endpoint_len, strlen("tcp://peer:7000"));
    CHECK(strcmp(h.control_endpoint, "tcp://peer:7000") == 0);
    CHECK_EQ(h.n_block_hashes, 0); /* no names buffer set */
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    /* With a names buffer: the source's own hashes of blocks 1..4 (it stored 201 + i),
       as many as fit. */
    uint64_t names[8] = {0};
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_hint_names_buffer(NULL, names, 8));
    CHECK_ST(KVR_ERR_NULL, kvr_request_set_hint_names_buffer(r, NULL, 8));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_request_set_hint_names_buffer(r, names, SIZE_MAX));
    OK(kvr_request_set_hint_names_buffer(r, names, 2));
    OK(kvr_partition_select_and_reserve_with_hint(p, r, &d, &h));
    CHECK(h.n_block_hashes == 2 && names[0] == 202 && names[1] == 203 && names[2] == 0);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    OK(kvr_request_set_hint_names_buffer(r, names, 8));
    OK(kvr_partition_select_and_reserve_with_hint(p, r, &d, &h));
    CHECK(h.n_block_hashes == 3 && names[2] == 204 && names[3] == 0);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    OK(kvr_request_set_hint_names_buffer(r, NULL, 0));
    /* Without a hint buffer, and through the plain call: the flag says one was dropped. */
    OK(kvr_partition_select_and_reserve_with_hint(p, r, &d, NULL));
    CHECK_EQ(d.flags, KVR_DECISION_KV_HINT);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK_EQ(d.flags, KVR_DECISION_KV_HINT);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    /* Advisory selection never carries one. */
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.flags, 0);
    CHECK_ST(KVR_ERR_NULL, kvr_partition_select_and_reserve_with_hint(p, r, NULL, &h));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_select_and_reserve_with_hint(NULL, r, &d, &h));
    kvr_partition_free(p);

    /* Below the minimum advantage (5 of 6 blocks held already): no hint, *hint untouched. */
    p = hint_partition(e, "close", 5, true);
    memset(&h, SENTINEL, sizeof h);
    OK(kvr_partition_select_and_reserve_with_hint(p, r, &d, &h));
    CHECK_EQ(d.flags, 0);
    CHECK(all_bytes(&h, sizeof h, SENTINEL));
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    kvr_partition_free(p);

    /* A partition that consumes no hints gets none. */
    p = hint_partition(e, "off", 1, false);
    OK(kvr_partition_select_and_reserve_with_hint(p, r, &d, &h));
    CHECK_EQ(d.flags, 0);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    kvr_partition_free(p);
    kvr_request_free(r);
    kvr_engine_free(e);
}

/* One booked turn of session `id` on prompt `tokens`. */
static kvr_decision session_turn(const kvr_partition *p, const uint32_t *tokens, const char *id,
                                 bool final)
{
    kvr_request *r = new_request(tokens, NT);
    OK(kvr_request_set_session(r, id, strlen(id), NULL, 0, final ? 1u : 0u, NULL, 0));
    kvr_decision d;
    memset(&d, 0, sizeof d);
    OK(kvr_partition_select_and_reserve(p, r, &d));
    kvr_request_free(r);
    return d;
}

static void test_session_affinity(void)
{
    g_section = "session affinity";
    kvr_engine *e = new_engine(26);
    kvr_partition_options *o = new_opts(BS);
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_session_affinity(NULL, KVR_AFFINITY_HARD, 0, 0, 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_session_affinity(o, 9, 0, 0, 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_partition_options_set_session_affinity(o, KVR_AFFINITY_SOFT, -1.0, 0, 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_partition_options_set_session_affinity(o, KVR_AFFINITY_SOFT, NAN, 0, 0));
    OK(kvr_partition_options_set_session_affinity(o, KVR_AFFINITY_OFF, 0, 0, 0));

    /* Off: sessions steer nothing, the stats say so. */
    kvr_partition *p = new_partition_with(e, "nosessions", o);
    add_worker(p, 1);
    kvr_decision d = session_turn(p, T, "s", false);
    CHECK_EQ(d.flags, 0);
    kvr_session_stats ss = session_stats(p);
    CHECK(ss.enabled == 0 && ss.entries == 0 && ss.bindings_created == 0);
    CHECK_ST(KVR_ERR_NULL, kvr_partition_session_stats(NULL, &ss));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_session_stats(p, NULL));
    kvr_partition_free(p);

    /* Hard: the first turn binds; the next goes home over a rank holding its prompt. */
    o = new_opts(BS);
    OK(kvr_partition_options_set_session_affinity(o, KVR_AFFINITY_HARD, 0, 16, 60000));
    p = new_partition_with(e, "hard", o);
    add_worker(p, 1);
    add_worker(p, 2);
    add_worker(p, 3);
    d = session_turn(p, U, "s", false);
    CHECK_EQ(d.flags, KVR_DECISION_SESSION_UNBOUND);
    const uint64_t home = d.worker_id;
    ss = session_stats(p);
    CHECK(ss.enabled == 1 && ss.reserved == 0);
    CHECK_EQ(ss.entries, 1);
    CHECK_EQ(ss.leases, 1);
    CHECK_EQ(ss.bindings_created, 1);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    ss = session_stats(p);
    CHECK_EQ(ss.leases, 0); /* the lease ended with its booking */
    CHECK_EQ(ss.leases_released, 1);
    CHECK(ss.unknown_lease_releases == 0 && ss.early_releases == 0 && ss.duplicate_leases == 0);
    const uint64_t other = home % 3 + 1;
    OK(store(p, other, 0, KVR_TIER_DEVICE, false, 0, 900, L, NB, NULL));
    d = session_turn(p, T, "s", false);
    CHECK_EQ(d.worker_id, home);
    CHECK_EQ(d.flags, KVR_DECISION_SESSION_PINNED);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    /* Without a session the cached rank wins; no session bit. */
    kvr_request *r = new_request(T, NT);
    OK(kvr_partition_select(p, r, &d));
    CHECK(d.worker_id == other && d.flags == 0);
    kvr_request_free(r);

    /* The bound worker leaves: the next turn is rebound (forced) and counted. */
    OK(kvr_partition_remove_worker(p, home));
    d = session_turn(p, T, "s", false);
    CHECK(d.worker_id != home);
    CHECK_EQ(d.flags, KVR_DECISION_SESSION_REBOUND);
    ss = session_stats(p);
    CHECK_EQ(ss.forced_rebinds, 1);
    CHECK_EQ(ss.bindings_dropped, 1);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));

    /* A final turn releases the session when its booking ends. */
    d = session_turn(p, T, "s", true);
    CHECK_EQ(d.flags, KVR_DECISION_SESSION_PINNED);
    CHECK_EQ(session_stats(p).entries, 1);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    ss = session_stats(p);
    CHECK_EQ(ss.entries, 0);
    CHECK_EQ(ss.finals_released, 1);

    /* A child session starts from its parent's binding. */
    d = session_turn(p, U, "parent", false);
    const uint64_t parent_home = d.worker_id;
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    r = new_request(T, NT);
    OK(kvr_request_set_session(r, "child", 5, "parent", 6, 0, NULL, 0));
    OK(kvr_partition_select_and_reserve(p, r, &d));
    CHECK_EQ(d.worker_id, parent_home);
    CHECK_EQ(d.flags, KVR_DECISION_SESSION_PINNED);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    kvr_request_free(r);
    kvr_partition_free(p);

    /* Soft: the bound rank is preferred by its penalty. */
    o = new_opts(BS);
    OK(kvr_partition_options_set_session_affinity(o, KVR_AFFINITY_SOFT, 4.0, 0, 0));
    p = new_partition_with(e, "soft", o);
    add_worker(p, 1);
    add_worker(p, 2);
    d = session_turn(p, U, "s", false);
    CHECK_EQ(d.flags, KVR_DECISION_SESSION_UNBOUND);
    const uint64_t bound = d.worker_id;
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    d = session_turn(p, U, "s", false);
    CHECK_EQ(d.worker_id, bound);
    CHECK_EQ(d.flags, KVR_DECISION_SESSION_PREFERRED);
    OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    kvr_partition_free(p);
    kvr_engine_free(e);
}

/* ------------------------------------------------------------------------------------ */
/* The latency cost model (the default) and its knobs                                   */
/* ------------------------------------------------------------------------------------ */

/* A latency cost in ms, to 1e-6 relative (the prefill rate divides, so the sums are not
   exact binary fractions as Dynamo's are). */
#define CHECK_MS(a, b)                                                                    \
    do {                                                                                  \
        double a_ = (a);                                                                  \
        double b_ = (b);                                                                  \
        if (fabs(a_ - b_) <= 1e-6 * fmax(1.0, fabs(b_))) {                                \
            g_passed++;                                                                   \
        } else {                                                                          \
            g_failed++;                                                                   \
            fprintf(stderr, "FAIL [%s] line %d: %s == %s (%.9f != %.9f)\n", g_section,   \
                    __LINE__, #a, #b, a_, b_);                                            \
        }                                                                                 \
    } while (0)

/* The advisory decision for prompt T with only worker `w` allowed and `out_tokens`
   expected output tokens. */
static kvr_decision select_on(const kvr_partition *p, uint64_t w, uint64_t out_tokens)
{
    kvr_request *r = new_request(T, NT);
    OK(kvr_request_set_allowed_workers(r, &w, 1));
    OK(kvr_request_set_expected_output_tokens(r, out_tokens));
    kvr_decision d;
    memset(&d, SENTINEL, sizeof d);
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, w);
    kvr_request_free(r);
    return d;
}

static void test_latency_options(void)
{
    g_section = "latency/options";
    kvr_partition_options *o = NULL;
    OK(kvr_partition_options_new(BS, &o));

    /* The model: two stable codes; anything else refused; NULL refused. */
    OK(kvr_partition_options_set_cost_model(o, KVR_COST_MODEL_DYNAMO));
    OK(kvr_partition_options_set_cost_model(o, KVR_COST_MODEL_LATENCY));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_cost_model(o, 2));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_cost_model(o, UINT32_MAX));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_cost_model(NULL, KVR_COST_MODEL_LATENCY));
    CHECK(KVR_COST_MODEL_LATENCY == 0 && KVR_COST_MODEL_DYNAMO == 1);

    OK(kvr_partition_options_set_learn_prefill_rate(o, 0));
    OK(kvr_partition_options_set_learn_prefill_rate(o, 1));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_learn_prefill_rate(NULL, 1));

    /* Times and weights: finite and >= 0. */
    const f64_setter non_negative[] = {
        kvr_partition_options_set_request_overhead_ms,
        kvr_partition_options_set_kv_pressure_ms,
        kvr_partition_options_set_itl_base_ms,
        kvr_partition_options_set_itl_per_request_ms,
        kvr_partition_options_set_queue_externality,
        kvr_partition_options_set_decode_block_us,
        kvr_partition_options_set_kv_pressure_threshold, /* and <= 1, below */
        kvr_partition_options_set_itl_target_ms,         /* 0 clears it, below */
    };
    for (size_t i = 0; i < sizeof non_negative / sizeof non_negative[0]; i++) {
        OK(non_negative[i](o, 0.5));
        OK(non_negative[i](o, 0.0));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT, non_negative[i](o, NAN));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT, non_negative[i](o, INFINITY));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT, non_negative[i](o, -INFINITY));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT, non_negative[i](o, -1.0));
        CHECK_ST(KVR_ERR_INVALID_ARGUMENT, non_negative[i](o, -1e-9));
        CHECK_ST(KVR_ERR_NULL, non_negative[i](NULL, 0.5));
        CHECK_ST(KVR_ERR_NULL, non_negative[i](NULL, NAN)); /* NULL is reported first */
    }
    /* The prior is a rate: > 0. */
    OK(kvr_partition_options_set_prefill_rate_prior(o, 1.0));
    OK(kvr_partition_options_set_prefill_rate_prior(o, 1e-3));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_prefill_rate_prior(o, 0.0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_prefill_rate_prior(o, -0.0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_prefill_rate_prior(o, -5.0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_prefill_rate_prior(o, NAN));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_prefill_rate_prior(o, INFINITY));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_prefill_rate_prior(NULL, 1.0));
    OK(kvr_partition_options_set_prefill_rate_prior(o, 10000.0));
    /* The threshold is a share: [0, 1]. */
    OK(kvr_partition_options_set_kv_pressure_threshold(o, 1.0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_kv_pressure_threshold(o, 1.5));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_kv_pressure_threshold(o, 1.0 + 1e-9));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_kv_pressure_threshold(o, -0.1));
    OK(kvr_partition_options_set_kv_pressure_threshold(o, 0.9));
    /* The per-token target: > 0 sets it, 0 clears it. */
    OK(kvr_partition_options_set_itl_target_ms(o, 30.0));
    OK(kvr_partition_options_set_itl_target_ms(o, 0.0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_itl_target_ms(o, -30.0));
    /* Back to the defaults; a partition can be made from the options. */
    OK(kvr_partition_options_set_request_overhead_ms(o, 5.0));
    OK(kvr_partition_options_set_kv_pressure_ms(o, 1000.0));
    OK(kvr_partition_options_set_itl_base_ms(o, 20.0));
    OK(kvr_partition_options_set_itl_per_request_ms(o, 0.2));
    OK(kvr_partition_options_set_queue_externality(o, 2.0));
    OK(kvr_partition_options_set_decode_block_us(o, 1.0));
    char why[256];
    size_t why_len = 0;
    OK(kvr_partition_options_check(o, why, sizeof why, &why_len));
    CHECK_EQ(why_len, 0);
    kvr_partition_options_free(o);
}

/*
 * The latency model on the standard layout (default knobs: rate prior 10,000 tokens/s,
 * overhead 5 ms, 1 µs per decode block after the booking; no bookings, so no queue, no
 * externality; KV capacity unknown, so no pressure; no per-token target):
 *   cost = 5 + uncached_tokens / 10,000 * 1000 + 6 blocks * 0.001
 *   w2: 24 tokens cached              -> 5 + 0   + 0.006 = 5.006
 *   w1: 19 tokens credited (4.75 blk) -> 5 + 0.5 + 0.006 = 5.506
 *   w3: nothing cached                -> 5 + 2.4 + 0.006 = 7.406
 */
static void test_latency_cost(void)
{
    g_section = "latency/cost";
    kvr_engine *e = new_engine(23);
    /* The default model: options with no model set. */
    kvr_partition_options *o = NULL;
    OK(kvr_partition_options_new(BS, &o));
    kvr_partition *p = new_partition_with(e, "latency", o);
    setup_standard(p);
    kvr_request *r = new_request(T, NT);
    kvr_decision d;
    memset(&d, SENTINEL, sizeof d);
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 2); /* the cached rank */
    CHECK_EQ(d.cached_tokens, NT);
    CHECK_MS(d.cost, 5.006);
    CHECK(d.cost >= 5.0); /* never below the request overhead */
    CHECK_MS(select_on(p, 1, 0).cost, 5.506);
    CHECK_MS(select_on(p, 3, 0).cost, 7.406);
    kvr_partition_free(p);

    /* The same layout with Dynamo's model set explicitly: block equivalents. */
    p = new_partition_with(e, "dynamo", new_opts_model(BS, KVR_COST_MODEL_DYNAMO));
    setup_standard(p);
    OK(kvr_partition_select(p, r, &d));
    CHECK_EQ(d.worker_id, 2);
    CHECK_COST(d.cost, 6.0);
    kvr_partition_free(p);

    /* Knobs reach the cost; a refused value changes nothing (the model stays latency,
       the overhead 1 ms). Rate 1,000 tokens/s: a token costs 1 ms; no tie-break. */
    o = new_opts_model(BS, KVR_COST_MODEL_LATENCY);
    OK(kvr_partition_options_set_request_overhead_ms(o, 1.0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_request_overhead_ms(o, -1.0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_cost_model(o, 7));
    OK(kvr_partition_options_set_prefill_rate_prior(o, 1000.0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_prefill_rate_prior(o, 0.0));
    OK(kvr_partition_options_set_decode_block_us(o, 0.0));
    OK(kvr_partition_options_set_kv_pressure_threshold(o, 0.5));
    OK(kvr_partition_options_set_kv_pressure_ms(o, 100.0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_kv_pressure_threshold(o, 2.0));
    p = new_partition_with(e, "knobs", o);
    setup_standard(p);
    /* Worker 4: nothing cached, 6 KV blocks, so the booking's 6 blocks fill it: share
       1.0, charged 100 ms * (1.0 - 0.5) / (1 - 0.5) = 100 ms. */
    add_worker_full(p, 4, 1, 6, 0, NULL);
    CHECK_MS(select_on(p, 2, 0).cost, 1.0);
    CHECK_MS(select_on(p, 1, 0).cost, 1.0 + 5.0);
    CHECK_MS(select_on(p, 3, 0).cost, 1.0 + 24.0);
    CHECK_MS(select_on(p, 4, 0).cost, 1.0 + 24.0 + 100.0);
    kvr_partition_free(p);

    /* A per-token target: predicted 20 + 0.5 * (0 + 1) = 20.5 ms > 10, so the excess is
       charged per expected output token: 10.5 * 4 = 42 ms. Cleared (0): no charge. */
    for (int cleared = 0; cleared < 2; cleared++) {
        o = new_opts_model(BS, KVR_COST_MODEL_LATENCY);
        OK(kvr_partition_options_set_decode_block_us(o, 0.0));
        OK(kvr_partition_options_set_itl_target_ms(o, 10.0));
        OK(kvr_partition_options_set_itl_base_ms(o, 20.0));
        OK(kvr_partition_options_set_itl_per_request_ms(o, 0.5));
        OK(kvr_partition_options_set_queue_externality(o, 0.0));
        if (cleared) {
            OK(kvr_partition_options_set_itl_target_ms(o, 0.0));
        }
        p = new_partition_with(e, cleared ? "itl-cleared" : "itl", o);
        setup_standard(p);
        CHECK_MS(select_on(p, 2, 4).cost, 5.0 + (cleared ? 0.0 : 42.0));
        CHECK_MS(select_on(p, 2, 0).cost, 5.0); /* no output expected: no charge */
        kvr_partition_free(p);
    }
    kvr_request_free(r);
    kvr_engine_free(e);
}

/* Books prompt U on worker 1 and completes its prefill `n` times (each after ~2 ms). */
static void complete_prefills(kvr_engine *e, const kvr_partition *p, int n)
{
    kvr_request *r = new_request(U, NT);
    for (int i = 0; i < n; i++) {
        kvr_decision d;
        OK(kvr_partition_select_and_reserve(p, r, &d));
        CHECK_EQ(d.projected_prefill_tokens, NT);
        sleep_ms(2);
        OK(kvr_engine_mark_prefill_complete(e, d.selection_id));
        OK(kvr_engine_free_booking(e, d.selection_id, NULL));
    }
    kvr_request_free(r);
}

static void test_prefill_rate(void)
{
    g_section = "latency/prefill rate";
    kvr_engine *e = new_engine(29);
    for (int learn = 1; learn >= 0; learn--) {
        kvr_partition_options *o = new_opts_model(BS, KVR_COST_MODEL_LATENCY);
        OK(kvr_partition_options_set_learn_prefill_rate(o, (uint32_t)learn));
        kvr_partition *p = new_partition_with(e, learn ? "learn" : "prior", o);
        add_worker(p, 1);

        /* None before any completion: rate 0, KVR_OK. */
        double rate = -1.0;
        uint64_t seen = 99;
        OK(kvr_partition_prefill_rate(p, &rate, &seen));
        CHECK(rate == 0.0);
        CHECK_EQ(seen, 0);
        CHECK_ST(KVR_ERR_NULL, kvr_partition_prefill_rate(NULL, &rate, &seen));
        CHECK_ST(KVR_ERR_NULL, kvr_partition_prefill_rate(p, NULL, &seen));
        CHECK_ST(KVR_ERR_NULL, kvr_partition_prefill_rate(p, &rate, NULL));
        /* The decode drag likewise: none learned is -1, KVR_OK. */
        double drag = 0.0;
        uint64_t drag_seen = 99;
        OK(kvr_partition_decode_drag(p, &drag, &drag_seen));
        CHECK(drag == -1.0);
        CHECK_EQ(drag_seen, 0);
        CHECK_ST(KVR_ERR_NULL, kvr_partition_decode_drag(NULL, &drag, &drag_seen));
        CHECK_ST(KVR_ERR_NULL, kvr_partition_decode_drag(p, NULL, &drag_seen));
        CHECK_ST(KVR_ERR_NULL, kvr_partition_decode_drag(p, &drag, NULL));

        /* A few completions are needed before the estimate is used. */
        complete_prefills(e, p, 1);
        OK(kvr_partition_prefill_rate(p, &rate, &seen));
        CHECK(rate == 0.0);
        CHECK_EQ(seen, 1);
        complete_prefills(e, p, 7);
        OK(kvr_partition_prefill_rate(p, &rate, &seen));
        CHECK_EQ(seen, 8);
        /* Counted by the drag too; eight on one rank are too few to learn it. */
        OK(kvr_partition_decode_drag(p, &drag, &drag_seen));
        CHECK_EQ(drag_seen, 8);
        CHECK(drag == -1.0);
        /* 24 tokens in >= 2 ms each: positive, at most 12,000 tokens/s. */
        CHECK(rate > 0.0 && rate <= 12000.0 * 1.01);

        /* Selection uses it, within [prior / 10, prior * 10], only when learning. */
        kvr_request *r = new_request(U, NT);
        kvr_decision d;
        OK(kvr_partition_select(p, r, &d));
        const double used = learn ? fmin(fmax(rate, 1000.0), 100000.0) : 10000.0;
        CHECK_MS(d.cost, 5.0 + NT * 1000.0 / used + NB * 0.001);
        kvr_request_free(r);
        kvr_partition_free(p);
    }
    kvr_engine_free(e);
}

int main(void)
{
    for (uint32_t i = 0; i < NT; i++) {
        T[i] = 1000 + i;
        U[i] = 50000 + 7 * i;
    }
    size_t n = 0;
    if (kvr_hash_tokens(BS, NULL, 0, NULL, 0, T, NT, L, S, NB, &n) != KVR_OK || n != NB) {
        fprintf(stderr, "fatal: cannot hash the test prompt\n");
        return 2;
    }

    test_version_and_status();
    test_hashing();
    test_options();
    test_engine_and_partitions();
    test_workers();
    test_events_and_lookups();
    test_selection_cost();
    test_option_effects();
    test_bookings();
    test_busy_and_no_worker();
    test_hooks();
    test_lora();
    test_replica();
    test_remove_partition();
    test_request_setters();
    test_seed();
    test_concurrency();
    test_reentrant_hooks();
    test_misaligned();
    test_known_id_leak();
    test_free_null();
    test_ingest();
    test_extra_keys();
    test_absurd_numbers();
    test_subscribe();
    test_indexer_options();
    test_approximate_primary();
    test_prediction_index();
    test_remote_primary();
    test_kv_hints();
    test_session_affinity();
    test_latency_options();
    test_latency_cost();
    test_prefill_rate();
    const char *slow = getenv("KVR_C_TEST_SLOW");
    if (slow != NULL && strcmp(slow, "1") == 0) {
        test_too_many_ranks();
    } else {
        printf("  (rank-limit test skipped; KVR_C_TEST_SLOW=1 runs it)\n");
    }

    g_section = "end";
    CHECK_EQ(kvr_status_count(KVR_ERR_PANIC), g_expected_panics); /* no other panic */
    printf("%u passed, %u failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
