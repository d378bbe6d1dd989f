/*
 * test_state.c: a partition's index kept on disk through the C ABI
 * (kvr_partition_options_set_state_dir): a partition fed events and freed comes back from
 * its directory in a new engine, answering the same overlaps; the documented errors (NULL
 * or non-UTF-8 directory, an unknown I/O mode, a directory that cannot be created, a
 * directory another partition writes in, calls on a partition without state). Built and
 * run by tests/c/run.sh, natively and under valgrind (no leak).
 *
 * Prints "N passed, N failed" last; exits non-zero if any check failed.
 */

#define _POSIX_C_SOURCE 200809L

#include "kvr.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static unsigned g_passed, g_failed;
static const char *g_section = "";

#define CHECK(cond)                                                                       \
    do {                                                                                  \
        if (cond) {                                                                       \
            g_passed++;                                                                   \
        } else {                                                                          \
            g_failed++;                                                                   \
            fprintf(stderr, "FAIL [%s] line %d: %s\n", g_section, __LINE__, #cond);      \
        }                                                                                 \
    } while (0)

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

#define BS 16
#define NB 6

static const char MODEL[] = "state-model";
static const char GROUP[] = "g";
static char g_root[256];

static kvr_engine *new_engine(void)
{
    kvr_engine *e = NULL;
    if (kvr_engine_new(NULL, &e) != KVR_OK) {
        fprintf(stderr, "fatal: cannot create an engine\n");
        exit(2);
    }
    return e;
}

static kvr_partition_options *state_opts(const char *dir, kvr_state_io io)
{
    kvr_partition_options *o = NULL;
    if (kvr_partition_options_new(BS, &o) != KVR_OK) {
        fprintf(stderr, "fatal: cannot create partition options\n");
        exit(2);
    }
    OK(kvr_partition_options_set_state_dir(o, dir, strlen(dir), io));
    return o;
}

static kvr_status create(kvr_engine *e, const kvr_partition_options *o, kvr_partition **out)
{
    return kvr_engine_create_partition(e, MODEL, strlen(MODEL), GROUP, strlen(GROUP), o, out);
}

static void add_worker(kvr_partition *p, uint64_t id)
{
    kvr_worker *w = NULL;
    OK(kvr_worker_new(id, 1, &w));
    OK(kvr_partition_upsert_worker(p, w));
    kvr_worker_free(w);
}

/* One Stored chain of `n` blocks with local hashes local[i] and external ext0 + i. */
static void store(kvr_partition *p, uint64_t worker, uint64_t ext0, const uint64_t *local,
                  size_t n)
{
    kvr_stored_block blocks[NB];
    for (size_t i = 0; i < n; i++) {
        blocks[i].external_hash = ext0 + i;
        blocks[i].local_hash = local[i];
    }
    kvr_event ev = {.kind = KVR_EVENT_STORED, .tier = KVR_TIER_DEVICE, .blocks = blocks,
                    .n_blocks = n};
    kvr_apply_result res;
    OK(kvr_partition_apply_events(p, worker, 0, &ev, 1, &res));
    CHECK_EQ(res.events_applied, 1);
    CHECK_EQ(res.blocks_stored, n);
}

/* Device blocks of `worker` for the prompt `local` (0 when it is not in the answer). */
static uint32_t overlap(const kvr_partition *p, const uint64_t *local, size_t n, uint64_t worker)
{
    kvr_overlap ov[4];
    size_t got = 0;
    OK(kvr_partition_find_matches(p, local, n, ov, 4, &got));
    for (size_t i = 0; i < got; i++) {
        if (ov[i].worker_id == worker) {
            return ov[i].device_blocks;
        }
    }
    return 0;
}

static uint64_t L[NB];

/* Kept, freed, restored in a new engine: the same overlaps; stats say what was written. */
static void test_restart(kvr_state_io io)
{
    g_section = io == KVR_STATE_IO_PLAIN ? "restart/plain" : "restart/auto";
    char dir[300];
    snprintf(dir, sizeof dir, "%s/%s", g_root, io == KVR_STATE_IO_PLAIN ? "plain" : "auto");

    kvr_engine *e = new_engine();
    kvr_partition_options *o = state_opts(dir, io);
    kvr_partition *p = NULL;
    OK(create(e, o, &p));
    kvr_state_restored r;
    memset(&r, 0xAB, sizeof r);
    OK(kvr_partition_state_restored(p, &r));
    CHECK_EQ(r.snapshot_found, 0); /* a new directory: nothing to restore */
    CHECK_EQ(r.snapshot_blocks, 0);
    CHECK_EQ(r.records, 0);
    CHECK_EQ(r.refused_files, 0);
    add_worker(p, 1);
    add_worker(p, 2);
    store(p, 1, 100, L, NB);
    store(p, 2, 200, L, 3);
    CHECK_EQ(overlap(p, L, NB, 1), NB);
    CHECK_EQ(overlap(p, L, NB, 2), 3);

    /* A second handle shares the state: its figures, and it does not close it. */
    kvr_partition *p2 = NULL;
    OK(kvr_engine_get_partition(e, MODEL, strlen(MODEL), GROUP, strlen(GROUP), &p2));
    kvr_state_stats st;
    OK(kvr_partition_state_stats(p2, &st));
    CHECK_EQ(st.closed, 0);
    kvr_partition_free(p2);
    OK(kvr_partition_state_stats(p, &st));
    CHECK_EQ(st.closed, 0);
    if (io == KVR_STATE_IO_PLAIN) {
        CHECK_EQ(st.uring, 0);
    }

    /* The same directory again, from another engine, while this state is open: refused. */
    kvr_engine *e2 = new_engine();
    kvr_partition *clash = NULL;
    CHECK_ST(KVR_ERR_IO, create(e2, o, &clash));
    CHECK(clash == NULL);
    kvr_engine_free(e2);

    /* Closed explicitly: the writer took its events and a final snapshot. */
    OK(kvr_partition_close_state(p));
    OK(kvr_partition_close_state(p)); /* again: nothing more */
    OK(kvr_partition_state_stats(p, &st));
    CHECK_EQ(st.closed, 1);
    CHECK(st.events_queued >= 2);
    CHECK_EQ(st.events_dropped, 0);
    CHECK(st.records_written >= 1);
    CHECK(st.snapshots >= 2); /* at start and at close */
    CHECK_EQ(st.snapshot_failures, 0);
    CHECK_EQ(st.write_failures, 0);
    CHECK_EQ(st.snapshot_blocks, NB + 3);
    CHECK_EQ(st.journal_bytes, 0);
    kvr_partition_free(p);
    kvr_engine_free(e);

    /* A new engine restores the partition from the directory at creation. */
    e = new_engine();
    OK(create(e, o, &p));
    kvr_partition_options_free(o);
    OK(kvr_partition_state_restored(p, &r));
    CHECK_EQ(r.snapshot_found, 1);
    CHECK_EQ(r.snapshot_blocks, NB + 3);
    CHECK_EQ(r.records, 0); /* the final snapshot left nothing to replay */
    CHECK_EQ(r.stopped_early, 0);
    CHECK_EQ(r.refused_files, 0);
    CHECK(r.seconds >= 0.0);
    add_worker(p, 1);
    add_worker(p, 2);
    CHECK_EQ(overlap(p, L, NB, 1), NB);
    CHECK_EQ(overlap(p, L, NB, 2), 3);

    /* Fed more, then the last handle freed without close_state: freeing closes it. */
    uint64_t more[NB];
    for (size_t i = 0; i < NB; i++) {
        more[i] = L[i] ^ 0x5555;
    }
    store(p, 2, 300, more, 2);
    kvr_engine_free(e); /* the engine first: the handle keeps the partition alive */
    kvr_partition_free(p);

    e = new_engine();
    o = state_opts(dir, io);
    OK(create(e, o, &p));
    kvr_partition_options_free(o);
    OK(kvr_partition_state_restored(p, &r));
    CHECK_EQ(r.snapshot_found, 1);
    CHECK_EQ(r.snapshot_blocks, NB + 3 + 2); /* the final snapshot has them all */
    CHECK_EQ(r.records, 0);
    add_worker(p, 1);
    add_worker(p, 2);
    CHECK_EQ(overlap(p, L, NB, 1), NB);
    CHECK_EQ(overlap(p, more, 2, 2), 2);
    kvr_partition_free(p);
    kvr_engine_free(e);
}

/* Without the option, an empty directory as the negative control: nothing comes back. */
static void test_not_kept(void)
{
    g_section = "not kept";
    kvr_engine *e = new_engine();
    kvr_partition_options *o = NULL;
    OK(kvr_partition_options_new(BS, &o));
    kvr_partition *p = NULL;
    OK(create(e, o, &p));
    kvr_state_restored r;
    kvr_state_stats st;
    CHECK_ST(KVR_ERR_INVALID_CONFIG, kvr_partition_state_restored(p, &r));
    CHECK_ST(KVR_ERR_INVALID_CONFIG, kvr_partition_state_stats(p, &st));
    CHECK_ST(KVR_ERR_INVALID_CONFIG, kvr_partition_close_state(p));
    kvr_partition_free(p);
    OK(kvr_engine_remove_partition(e, MODEL, strlen(MODEL), GROUP, strlen(GROUP)));

    /* A state directory set, then turned off with (NULL, 0). */
    char dir[300];
    snprintf(dir, sizeof dir, "%s/off", g_root);
    OK(kvr_partition_options_set_state_dir(o, dir, strlen(dir), KVR_STATE_IO_PLAIN));
    OK(kvr_partition_options_set_state_dir(o, NULL, 0, KVR_STATE_IO_AUTO));
    OK(create(e, o, &p));
    CHECK_ST(KVR_ERR_INVALID_CONFIG, kvr_partition_state_stats(p, &st));
    CHECK(access(dir, F_OK) != 0); /* nothing was created */
    kvr_partition_free(p);
    kvr_partition_options_free(o);

    /* A fresh directory restores nothing (the negative control of test_restart). */
    kvr_engine_free(e);
    e = new_engine();
    snprintf(dir, sizeof dir, "%s/empty", g_root);
    o = state_opts(dir, KVR_STATE_IO_PLAIN);
    OK(create(e, o, &p));
    kvr_partition_options_free(o);
    OK(kvr_partition_state_restored(p, &r));
    CHECK_EQ(r.snapshot_found, 0);
    add_worker(p, 1);
    CHECK_EQ(overlap(p, L, NB, 1), 0);
    kvr_partition_free(p);
    kvr_engine_free(e);
}

static void test_errors(void)
{
    g_section = "errors";
    kvr_partition_options *o = NULL;
    OK(kvr_partition_options_new(BS, &o));
    const char bad_utf8[] = "\xff\xfe";
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_state_dir(NULL, "d", 1, KVR_STATE_IO_AUTO));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_options_set_state_dir(o, NULL, 4, KVR_STATE_IO_AUTO));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT,
             kvr_partition_options_set_state_dir(o, bad_utf8, 2, KVR_STATE_IO_AUTO));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_state_dir(o, "a\0b", 3, 0));
    CHECK_ST(KVR_ERR_INVALID_ARGUMENT, kvr_partition_options_set_state_dir(o, "d", 1, 3));

    /* A directory under a regular file cannot be created: KVR_ERR_IO, no partition. */
    char file[300], dir[320];
    snprintf(file, sizeof file, "%s/a-file", g_root);
    FILE *f = fopen(file, "w");
    CHECK(f != NULL);
    if (f) {
        fclose(f);
    }
    snprintf(dir, sizeof dir, "%s/sub", file);
    OK(kvr_partition_options_set_state_dir(o, dir, strlen(dir), KVR_STATE_IO_PLAIN));
    kvr_engine *e = new_engine();
    kvr_partition *p = NULL;
    CHECK_ST(KVR_ERR_IO, create(e, o, &p));
    CHECK(p == NULL);
    CHECK_ST(KVR_ERR_UNKNOWN_PARTITION,
             kvr_engine_get_partition(e, MODEL, strlen(MODEL), GROUP, strlen(GROUP), &p));
    /* kvr_partition_options_check says why. */
    char why[512];
    size_t why_len = 0;
    CHECK_ST(KVR_ERR_IO, kvr_partition_options_check(o, why, sizeof why - 1, &why_len));
    why[why_len < sizeof why - 1 ? why_len : sizeof why - 1] = '\0';
    CHECK(strstr(why, "cannot create it") != NULL);

    /* KVR_STATE_IO_AUTO takes KVR_STATE_IO from the environment; an unknown value is an
       error, never ignored. */
    snprintf(dir, sizeof dir, "%s/env", g_root);
    OK(kvr_partition_options_set_state_dir(o, dir, strlen(dir), KVR_STATE_IO_AUTO));
    const char *saved = getenv("KVR_STATE_IO");
    char *saved_copy = saved ? strdup(saved) : NULL;
    setenv("KVR_STATE_IO", "sideways", 1);
    CHECK_ST(KVR_ERR_INVALID_CONFIG, create(e, o, &p));
    CHECK_ST(KVR_ERR_INVALID_CONFIG, kvr_partition_options_check(o, why, sizeof why, &why_len));
    setenv("KVR_STATE_IO", "plain", 1);
    OK(kvr_partition_options_check(o, why, sizeof why, &why_len));
    OK(create(e, o, &p));
    kvr_state_stats st;
    OK(kvr_partition_state_stats(p, &st));
    CHECK_EQ(st.uring, 0); /* plain, as the environment says */
    kvr_partition_free(p);
    if (saved_copy) {
        setenv("KVR_STATE_IO", saved_copy, 1);
        free(saved_copy);
    } else {
        unsetenv("KVR_STATE_IO");
    }

    CHECK_ST(KVR_ERR_NULL, kvr_partition_state_restored(NULL, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_state_stats(NULL, NULL));
    CHECK_ST(KVR_ERR_NULL, kvr_partition_close_state(NULL));
    kvr_partition_options_free(o);
    kvr_engine_free(e);
}

int main(void)
{
    size_t n = 0;
    uint32_t tokens[NB * BS];
    for (uint32_t i = 0; i < NB * BS; i++) {
        tokens[i] = 7000 + i;
    }
    uint64_t seq[NB];
    if (kvr_hash_tokens(BS, NULL, 0, NULL, 0, tokens, NB * BS, L, seq, NB, &n) != KVR_OK ||
        n != NB) {
        fprintf(stderr, "fatal: cannot hash the test prompt\n");
        return 2;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(g_root, sizeof g_root, "%s/kvr-c-state-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(g_root) == NULL) {
        fprintf(stderr, "fatal: cannot create a temporary directory\n");
        return 2;
    }

    test_restart(KVR_STATE_IO_PLAIN);
    test_restart(KVR_STATE_IO_AUTO);
    test_not_kept();
    test_errors();

    g_section = "end";
    CHECK_EQ(kvr_status_count(KVR_ERR_PANIC), 0);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    if (system(cmd) != 0) {
        fprintf(stderr, "note: could not remove %s\n", g_root);
    }
    printf("%u passed, %u failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
