// The multi-threaded workload: one engine and partition (16 workers, block size 16);
// four threads book, complete, grow and free selections, each with its own Request,
// while a fifth applies KV events and publishes load batches. Afterwards every booking
// must be gone, every rank's active load zero, and the index counters must match the
// events sent. (Second translation unit including kvr.hpp.)
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "kvr.hpp"

namespace {

constexpr uint64_t kWorkers = 16;
constexpr uint32_t kBlockSize = 16;
constexpr int kSelectors = 4;
constexpr int kIterations = 20000;  // selections per thread
constexpr int kPrompts = 64;
constexpr int kMinEventBatches = 3000;
constexpr std::size_t kLiveDepth = 8;  // bookings a thread keeps open at once

uint32_t dp_size(uint64_t worker) { return 1 + static_cast<uint32_t>(worker % 2); }

struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ULL + 1) {}
    uint64_t next() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        return s;
    }
    uint64_t below(uint64_t n) { return next() % n; }
};

struct Prompt {
    std::vector<uint32_t> tokens;
    kvr::BlockHashes hashes;
    std::vector<kvr::StoredBlock> blocks;  // external hash = sequence hash
};

// Thread failures: counted, first few reported.
std::atomic<int> thread_failures{0};
std::mutex report_mutex;

void thread_fail(const std::string &what) {
    if (thread_failures.fetch_add(1) < 10) {
        std::lock_guard<std::mutex> lock(report_mutex);
        std::fprintf(stderr, "FAIL (thread): %s\n", what.c_str());
    }
}

struct SelectorResult {
    uint64_t selected = 0;
    uint64_t busy = 0;
    uint64_t no_worker = 0;
    uint64_t advisory = 0;
    uint64_t lookups = 0;
    uint64_t freed_not_now = 0;
    uint64_t bad_decisions = 0;
};

void selector(int t, const kvr::Engine &engine, const kvr::Partition &part,
              const std::vector<Prompt> &prompts, const kvr::Request &shared_req,
              SelectorResult &res) {
    try {
        Rng rng(static_cast<uint64_t>(t) + 100);
        kvr::Request req;
        std::deque<uint64_t> live;
        std::vector<kvr::Overlap> matches;
        std::vector<uint64_t> allowed;
        auto free_one = [&](uint64_t id) {
            if (engine.free_booking(id) != kvr::FreedBy::Now) ++res.freed_not_now;
        };
        for (int i = 0; i < kIterations; ++i) {
            const Prompt &pr = prompts[rng.below(prompts.size())];
            req.reset();
            if (i & 1)
                req.set_tokens(pr.tokens);
            else
                req.set_local_hashes(pr.hashes.local, pr.tokens.size());
            req.set_expected_output_tokens(rng.below(512));
            if (i % 97 == 0) {
                allowed.clear();
                for (uint64_t w = 1 + rng.below(4); w <= kWorkers; w += 3) allowed.push_back(w);
                req.set_allowed_workers(allowed);
            }
            const kvr::Selection s = part.select_and_reserve(req);
            if (s.outcome == kvr::Outcome::Busy) {
                ++res.busy;
                continue;
            }
            if (s.outcome == kvr::Outcome::NoWorker) {
                ++res.no_worker;
                continue;
            }
            ++res.selected;
            const kvr::Decision &d = *s;
            const std::size_t n_blocks = pr.hashes.local.size();
            if (d.worker_id < 1 || d.worker_id > kWorkers || d.dp_rank >= dp_size(d.worker_id) ||
                d.selection_id == 0 || d.device_blocks > n_blocks ||
                d.cached_tokens > pr.tokens.size() ||
                d.cached_tokens + d.projected_prefill_tokens != pr.tokens.size())
                ++res.bad_decisions;
            if (i % 3 != 0) engine.mark_prefill_complete(d.selection_id);
            engine.add_output_blocks(d.selection_id, 1 + rng.below(4));
            live.push_back(d.selection_id);
            while (live.size() > kLiveDepth || (!live.empty() && rng.below(4) == 0)) {
                free_one(live.front());
                live.pop_front();
            }
            if (i % 16 == 0) {
                if (part.select(shared_req).selected()) ++res.advisory;
            }
            if (i % 64 == 0) {
                part.find_matches_tiered(pr.hashes.local, matches);
                for (std::size_t k = 0; k < matches.size(); ++k) {
                    const kvr::Overlap &o = matches[k];
                    if (o.device_blocks + o.host_blocks + o.disk_blocks > n_blocks ||
                        o.dp_rank >= dp_size(o.worker_id) ||
                        (k > 0 && matches[k - 1].worker_id > o.worker_id))
                        ++res.bad_decisions;
                }
                ++res.lookups;
            }
        }
        for (uint64_t id : live) free_one(id);
    } catch (const std::exception &e) {
        thread_fail(std::string("selector ") + std::to_string(t) + ": " + e.what());
    }
}

struct EventTotals {
    uint64_t batches = 0, stored = 0, removed = 0, cleared = 0, loads = 0, upserts = 0;
    uint64_t applied = 0, rejected = 0, blocks_stored = 0, blocks_removed = 0;
    uint64_t refusals = 0;
    uint64_t last_version = 0;
    bool versions_increase = true;
};

void eventer(const kvr::Partition &part, const std::vector<Prompt> &prompts,
             const std::atomic<bool> &selectors_done, EventTotals &tot) {
    try {
        Rng rng(7);
        std::vector<kvr::Event> batch;
        std::vector<uint64_t> removed;
        std::vector<kvr::RankLoad> loads;
        for (int round = 0; round < kMinEventBatches || !selectors_done.load(); ++round) {
            const uint64_t w = 1 + rng.below(kWorkers);
            const uint32_t r = static_cast<uint32_t>(rng.below(dp_size(w)));
            const Prompt &pr = prompts[rng.below(prompts.size())];
            const std::size_t n = pr.blocks.size();
            const uint64_t op = rng.below(20);
            batch.clear();
            if (op < 11) {
                // The whole chain, or a prefix and its extension naming its parent.
                const std::size_t k = 1 + rng.below(n - 1);
                if (op % 2 == 0) {
                    batch.push_back(kvr::stored_event(pr.blocks));
                } else {
                    batch.push_back(kvr::stored_event(kvr::Span<const kvr::StoredBlock>(pr.blocks.data(), k)));
                    batch.push_back(kvr::stored_event(
                        kvr::Span<const kvr::StoredBlock>(pr.blocks.data() + k, n - k),
                        pr.blocks[k - 1].external_hash, op % 3 == 0 ? kvr::Tier::Host : kvr::Tier::Device));
                }
                tot.stored += batch.size();
            } else if (op < 16) {
                const std::size_t m = 1 + rng.below(n);
                removed.assign(pr.hashes.seq.end() - static_cast<std::ptrdiff_t>(m), pr.hashes.seq.end());
                batch.push_back(kvr::removed_event(removed));
                ++tot.removed;
            } else if (op == 16) {
                batch.push_back(kvr::cleared_event());
                ++tot.cleared;
            } else if (op == 17) {
                part.upsert_worker(kvr::Worker(w, dp_size(w)).set_total_kv_blocks(20000 + rng.below(1000)));
                ++tot.upserts;
                continue;
            } else {
                loads.clear();
                for (uint64_t wk = 1; wk <= kWorkers; ++wk)
                    for (uint32_t rk = 0; rk < dp_size(wk); ++rk) {
                        kvr::RankLoad l{};
                        l.worker_id = wk;
                        l.dp_rank = rk;
                        l.waiting_requests = static_cast<uint32_t>(rng.below(8));
                        l.running_requests = static_cast<uint32_t>(rng.below(64));
                        l.kv_blocks_total = 20000;
                        l.kv_blocks_used = rng.below(20000);
                        l.pending_prefill_tokens = rng.below(4096);
                        loads.push_back(l);
                    }
                const uint64_t v = part.publish_load(loads);
                tot.versions_increase = tot.versions_increase && v > tot.last_version;
                tot.last_version = v;
                ++tot.loads;
                continue;
            }
            const kvr::ApplyResult res = part.apply_events(w, r, batch);
            ++tot.batches;
            tot.applied += res.events_applied;
            tot.rejected += res.events_rejected;
            tot.blocks_stored += res.blocks_stored;
            tot.blocks_removed += res.blocks_removed;
            if (!res.all_applied()) ++tot.refusals;
        }
    } catch (const std::exception &e) {
        thread_fail(std::string("event thread: ") + e.what());
    }
}

std::vector<Prompt> make_prompts(const kvr::Partition &part) {
    std::vector<Prompt> prompts(kPrompts);
    for (int i = 0; i < kPrompts; ++i) {
        Prompt &p = prompts[static_cast<std::size_t>(i)];
        const uint32_t family = static_cast<uint32_t>(i % 8);
        for (uint32_t k = 0; k < 256; ++k) p.tokens.push_back(family * 1000003u + k);  // shared prefix
        const uint32_t tail = kBlockSize * (1 + static_cast<uint32_t>(i % 24)) + static_cast<uint32_t>(i % 7);
        for (uint32_t k = 0; k < tail; ++k) p.tokens.push_back(0x40000000u + static_cast<uint32_t>(i) * 4096u + k);
        p.hashes = part.hash_tokens(p.tokens);
        p.blocks = kvr::stored_blocks(p.hashes.seq, p.hashes.local);
    }
    return prompts;
}

}  // namespace

void workload_test() {
    const uint64_t panics_before = kvr::status_count(KVR_ERR_PANIC);
    auto released = std::make_shared<std::atomic<int>>(0);
    auto available_calls = std::make_shared<std::atomic<uint64_t>>(0);
    auto estimate_calls = std::make_shared<std::atomic<uint64_t>>(0);
    {
        kvr::Engine engine(kvr::EngineOptions().set_seed(2024));
        const kvr::Partition part = engine.create_partition(
            "llama", "pool-a", kvr::PartitionOptions(kBlockSize).set_temperature(0.0));
        for (uint64_t w = 1; w <= kWorkers; ++w)
            part.upsert_worker(kvr::Worker(w, dp_size(w)).set_total_kv_blocks(20000).set_max_batched_tokens(8192));
        kvr::Hooks hooks;
        hooks.available = [available_calls](uint64_t, uint32_t) {
            available_calls->fetch_add(1, std::memory_order_relaxed);
            return true;
        };
        hooks.prefill_estimate = [estimate_calls](uint64_t, uint32_t, uint64_t, uint64_t) {
            estimate_calls->fetch_add(1, std::memory_order_relaxed);
            return std::optional<uint64_t>();  // no estimate: prompt − cached
        };
        hooks.on_release = [released] { released->fetch_add(1); };
        part.set_hooks(std::move(hooks));

        const std::vector<Prompt> prompts = make_prompts(part);
        CHECK_EQ(prompts[0].hashes.local.size(), 17u);

        // One request shared (read-only) by all selector threads' advisory selections.
        kvr::Request shared_req;
        shared_req.set_tokens(prompts[5].tokens);

        std::vector<SelectorResult> results(kSelectors);
        EventTotals totals;
        std::atomic<bool> selectors_done{false};
        const auto t0 = std::chrono::steady_clock::now();
        std::thread events(eventer, std::cref(part), std::cref(prompts), std::cref(selectors_done),
                           std::ref(totals));
        std::vector<std::thread> threads;
        for (int t = 0; t < kSelectors; ++t)
            threads.emplace_back(selector, t, std::cref(engine), std::cref(part), std::cref(prompts),
                                 std::cref(shared_req), std::ref(results[static_cast<std::size_t>(t)]));
        for (std::thread &th : threads) th.join();
        selectors_done.store(true);
        events.join();
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

        SelectorResult sum;
        for (const SelectorResult &r : results) {
            sum.selected += r.selected;
            sum.busy += r.busy;
            sum.no_worker += r.no_worker;
            sum.advisory += r.advisory;
            sum.lookups += r.lookups;
            sum.freed_not_now += r.freed_not_now;
            sum.bad_decisions += r.bad_decisions;
        }
        std::printf("  %d threads x %d booked selections in %.2f s (%.0f/s); %" PRIu64
                    " event batches, %" PRIu64 " load batches, %" PRIu64 " upserts alongside\n",
                    kSelectors, kIterations, secs, kSelectors * kIterations / secs, totals.batches,
                    totals.loads, totals.upserts);

        CHECK_EQ(thread_failures.load(), 0);
        const uint64_t attempts = static_cast<uint64_t>(kSelectors) * kIterations;
        CHECK_EQ(sum.selected + sum.busy + sum.no_worker, attempts);
        CHECK_EQ(sum.selected, attempts);  // no thresholds, allow-sets never empty
        CHECK_EQ(sum.freed_not_now, 0u);
        CHECK_EQ(sum.bad_decisions, 0u);
        CHECK(sum.lookups > 0);
        CHECK(sum.advisory > 0);

        // Every booking freed, every rank's booked load back to zero.
        const kvr::BookingStats bs = part.booking_stats();
        CHECK_EQ(bs.bookings, 0u);
        CHECK_EQ(bs.counter_underflows, 0u);
        CHECK_EQ(bs.sweeper_started, 1u);
        CHECK_EQ(bs.expired_total, 0u);
        uint64_t nonzero_ranks = 0;
        for (uint64_t w = 1; w <= kWorkers; ++w)
            for (uint32_t r = 0; r < dp_size(w); ++r) {
                const kvr::ActiveLoad l = part.active_load(w, r);
                if (l.active_prefill_tokens != 0 || l.active_decode_blocks != 0 || l.active_requests != 0)
                    ++nonzero_ranks;
            }
        CHECK_EQ(nonzero_ranks, 0u);

        // Selection counters: every booked and advisory selection counted.
        const kvr::SelectionStats ss = part.selection_stats();
        CHECK_EQ(ss.selections, attempts + sum.advisory);
        CHECK_EQ(ss.busy, 0u);
        CHECK_EQ(ss.no_worker, 0u);

        // The index saw exactly the events sent.
        const kvr::IndexStats is = part.index_stats();
        CHECK(totals.batches >= static_cast<uint64_t>(kMinEventBatches) / 2);
        CHECK_EQ(is.stored_events, totals.stored);
        CHECK_EQ(is.removed_events, totals.removed);
        CHECK_EQ(is.cleared_events, totals.cleared);
        CHECK_EQ(is.parent_not_found, 0u);
        CHECK_EQ(is.too_many_ranks, 0u);
        CHECK_EQ(totals.applied, totals.stored + totals.removed + totals.cleared);
        CHECK_EQ(totals.rejected, 0u);
        CHECK_EQ(totals.refusals, 0u);
        CHECK(totals.blocks_stored > 0 && totals.blocks_removed > 0);
        CHECK(is.ranks > 0 && is.ranks <= 24);
        CHECK(totals.versions_increase);

        // The hooks ran on the selecting threads.
        CHECK(available_calls->load() >= attempts);
        CHECK(estimate_calls->load() >= attempts);
        CHECK_EQ(released->load(), 0);
    }
    // Engine and partition gone: the hooks released exactly once.
    CHECK_EQ(released->load(), 1);
    CHECK_EQ(kvr::status_count(KVR_ERR_PANIC), panics_before);
}
