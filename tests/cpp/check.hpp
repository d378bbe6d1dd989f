// A tiny test harness shared by the C++ wrapper tests (every translation unit includes it;
// its counters are inline variables, so there is one of each per program).
#ifndef KVR_TEST_CHECK_HPP
#define KVR_TEST_CHECK_HPP

#include <atomic>
#include <cstdio>
#include <exception>
#include <string>

#include "kvr.hpp"

namespace test {

inline std::atomic<int> passed{0};
inline std::atomic<int> failed{0};

inline bool check(bool ok, const char *expr, const char *file, int line) {
    if (ok) {
        passed.fetch_add(1, std::memory_order_relaxed);
    } else {
        failed.fetch_add(1, std::memory_order_relaxed);
        std::fprintf(stderr, "FAIL %s:%d: %s\n", file, line, expr);
    }
    return ok;
}

/// Runs `f`; passes iff it throws kvr::Error with `status`.
template <class F>
bool check_throws(kvr_status status, F &&f, const char *expr, const char *file, int line) {
    try {
        f();
    } catch (const kvr::Error &e) {
        if (e.status() == status) return check(true, expr, file, line);
        std::fprintf(stderr, "FAIL %s:%d: %s: threw status %u (%s), wanted %u\n", file, line, expr,
                     e.status(), e.what(), status);
        failed.fetch_add(1, std::memory_order_relaxed);
        return false;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "FAIL %s:%d: %s: threw %s\n", file, line, expr, e.what());
        failed.fetch_add(1, std::memory_order_relaxed);
        return false;
    }
    std::fprintf(stderr, "FAIL %s:%d: %s: did not throw\n", file, line, expr);
    failed.fetch_add(1, std::memory_order_relaxed);
    return false;
}

/// Runs a test body: an unexpected exception is one failure, not a crash.
template <class F>
void run(const char *name, F &&body) {
    const int before = failed.load();
    try {
        body();
    } catch (const std::exception &e) {
        std::fprintf(stderr, "FAIL %s: unexpected exception: %s\n", name, e.what());
        failed.fetch_add(1);
    } catch (...) {
        std::fprintf(stderr, "FAIL %s: unexpected non-std exception\n", name);
        failed.fetch_add(1);
    }
    std::printf("%-28s %s\n", name, failed.load() == before ? "ok" : "FAILED");
    std::fflush(stdout);
}

}  // namespace test

#define CHECK(cond) ::test::check(static_cast<bool>(cond), #cond, __FILE__, __LINE__)
#define CHECK_EQ(a, b) CHECK((a) == (b))
#define CHECK_THROWS(status, stmt) \
    ::test::check_throws((status), [&] { stmt; }, #stmt " throws " #status, __FILE__, __LINE__)

// The multi-threaded workload (workload.cpp).
void workload_test();

// Indexer policy, transfer hints and session affinity (routing.cpp).
void invalid_config_test();
void indexer_policies_test();
void approximate_primary_test();
void kv_hint_test();
void session_hard_test();
void session_soft_test();

// Raw ingest, the subscriber, extra keys, hint names, output blocks (ingress.cpp).
void ingress_test();
void extras_test();
void hint_names_test();

#endif
