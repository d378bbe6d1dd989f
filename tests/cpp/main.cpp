// Single-threaded checks of the C++ wrapper (kvr.hpp), those of routing.cpp (indexer
// policy, hints, session affinity), then the multi-threaded workload of workload.cpp
// (the other translation units including kvr.hpp).
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "check.hpp"
#include "kvr.hpp"

namespace {

using kvr::Outcome;
using kvr::Span;

// -- compile-time properties ------------------------------------------------------------

template <class, class = void>
struct can_set_tokens : std::false_type {};
template <class A>
struct can_set_tokens<A, std::void_t<decltype(std::declval<kvr::Request &>().set_tokens(std::declval<A>()))>>
    : std::true_type {};

template <class, class = void>
struct can_set_hashes : std::false_type {};
template <class A>
struct can_set_hashes<
    A, std::void_t<decltype(std::declval<kvr::Request &>().set_local_hashes(std::declval<A>(), 0))>>
    : std::true_type {};

using U64 = std::vector<uint64_t>;
using U32 = std::vector<uint32_t>;

// Span conversions.
static_assert(std::is_constructible<Span<const uint64_t>, U64 &>::value, "");
static_assert(std::is_constructible<Span<const uint64_t>, const U64 &>::value, "");
static_assert(std::is_constructible<Span<const uint64_t>, U64 &&>::value, "const spans take temporaries");
static_assert(std::is_constructible<Span<uint64_t>, U64 &>::value, "");
static_assert(!std::is_constructible<Span<uint64_t>, const U64 &>::value, "no const loss");
static_assert(!std::is_constructible<Span<uint64_t>, U64 &&>::value, "no mutable view of a temporary");
static_assert(!std::is_constructible<Span<const uint32_t>, U64 &>::value, "no element conversion");
static_assert(std::is_constructible<Span<const uint64_t>, std::array<uint64_t, 3> &>::value, "");
static_assert(std::is_constructible<Span<const uint64_t>, uint64_t (&)[4]>::value, "");
static_assert(std::is_constructible<Span<const uint64_t>, const uint64_t *, std::size_t>::value, "");
static_assert(std::is_convertible<Span<uint64_t>, Span<const uint64_t>>::value, "");
static_assert(!std::is_convertible<Span<const uint64_t>, Span<uint64_t>>::value, "");
// Borrowing setters refuse temporaries, accept lvalues and spans.
static_assert(can_set_tokens<U32 &>::value, "");
static_assert(can_set_tokens<const U32 &>::value, "");
static_assert(can_set_tokens<Span<const uint32_t>>::value, "");
static_assert(!can_set_tokens<U32 &&>::value, "a temporary prompt would dangle");
static_assert(!can_set_tokens<std::array<uint32_t, 4> &&>::value, "");
static_assert(!can_set_tokens<std::initializer_list<uint32_t>>::value, "");
static_assert(can_set_hashes<U64 &>::value, "");
static_assert(!can_set_hashes<U64 &&>::value, "");
// Handles: move-only.
static_assert(!std::is_copy_constructible<kvr::Engine>::value, "");
static_assert(!std::is_copy_assignable<kvr::Partition>::value, "");
static_assert(std::is_nothrow_move_constructible<kvr::Engine>::value, "");
static_assert(std::is_nothrow_move_assignable<kvr::Request>::value, "");
static_assert(std::is_nothrow_move_constructible<kvr::Partition>::value, "");
static_assert(std::is_nothrow_move_constructible<kvr::Worker>::value, "");
static_assert(std::is_nothrow_move_constructible<kvr::PartitionOptions>::value, "");
static_assert(std::is_nothrow_move_constructible<kvr::EngineOptions>::value, "");
static_assert(std::is_base_of<std::runtime_error, kvr::Error>::value, "");

std::vector<uint32_t> prompt(uint32_t seed, std::size_t n) {
    std::vector<uint32_t> t(n);
    for (std::size_t i = 0; i < n; ++i) t[i] = seed * 100003u + static_cast<uint32_t>(i);
    return t;
}

void add_workers(const kvr::Partition &p, uint64_t first, uint64_t n, uint32_t dp = 1) {
    for (uint64_t w = first; w < first + n; ++w) p.upsert_worker(kvr::Worker(w, dp));
}

// -- tests ------------------------------------------------------------------------------

void test_abi_and_status() {
    CHECK_EQ(kvr::abi_version(), static_cast<uint32_t>(KVR_ABI_VERSION));
    CHECK(kvr::abi_compatible());
    CHECK_EQ(kvr::linked_abi_symbol(), static_cast<uint32_t>(KVR_ABI_VERSION));
    bool threw = false;
    try {
        kvr::check_abi();
    } catch (...) {
        threw = true;
    }
    CHECK(!threw);
    CHECK_EQ(std::string(kvr::status_str(KVR_BUSY)), "every candidate rank is busy");
    CHECK_EQ(std::string(kvr::status_str(4242)), "unknown status");
    kvr::Error e(KVR_ERR_UNKNOWN_PARTITION, "kvr_engine_get_partition");
    CHECK_EQ(e.status(), static_cast<kvr_status>(KVR_ERR_UNKNOWN_PARTITION));
    CHECK(std::string(e.what()).find("kvr_engine_get_partition: unknown partition") != std::string::npos);
}

void test_span() {
    std::vector<uint64_t> v{1, 2, 3};
    std::array<uint64_t, 2> a{{4, 5}};
    uint64_t c[4] = {6, 7, 8, 9};
    Span<const uint64_t> sv(v), sa(a), sc(c), sp(v.data() + 1, 2), se;
    CHECK(sv.data() == v.data() && sv.size() == 3);
    CHECK(sa.data() == a.data() && sa.size() == 2);
    CHECK(sc.data() == c && sc.size() == 4);
    CHECK(sp[0] == 2 && sp[1] == 3 && sp.size() == 2);
    CHECK(se.empty() && se.data() == nullptr);
    Span<uint64_t> m(v);
    m[0] = 10;
    Span<const uint64_t> cm = m;
    CHECK(cm[0] == 10 && v[0] == 10);
    uint64_t sum = 0;
    for (uint64_t x : sc) sum += x;
    CHECK_EQ(sum, 30u);
    CHECK_EQ(sc.subspan(1, 2)[1], 8u);
    auto count = [](Span<const uint64_t> s) { return s.size(); };
    CHECK_EQ(count(std::vector<uint64_t>{1, 2}), 2u);
    CHECK_EQ(count(Span<uint64_t>(v)), 3u);
}

void test_lifecycle_errors() {
    kvr::Engine engine(kvr::EngineOptions().set_seed(7));
    kvr::PartitionOptions opts(16);
    opts.set_cache_namespace("").set_booking_ttl_ms(60000).set_temperature(0.0);
    kvr::Partition p = engine.create_partition("model", "group", opts);
    CHECK(static_cast<bool>(p));
    CHECK_EQ(p.block_size(), 16u);
    CHECK_THROWS(KVR_ERR_PARTITION_EXISTS, engine.create_partition("model", "group", opts));
    CHECK_THROWS(KVR_ERR_UNKNOWN_PARTITION, engine.get_partition("model", "other"));
    kvr::Partition again = engine.get_partition("model", "group");
    CHECK_EQ(again.block_size(), 16u);

    kvr::PartitionOptions knobs(32);
    knobs.set_overlap_score_credit(1.0)
        .set_prefill_load_scale(1.5)
        .set_host_cache_hit_weight(0.75)
        .set_disk_cache_hit_weight(0.25)
        .set_shared_cache_multiplier(0.5)
        .set_temperature(0.5)
        .set_decode_active_request_weight(2.0)
        .set_credit_decay(0.1)
        .set_busy_decode_blocks_fraction(0.95)
        .set_busy_prefill_tokens_fraction(4.0)
        .set_busy_prefill_tokens(1u << 20)
        .set_cache_namespace("tenant-1")
        .set_booking_ttl_ms(1000);
    kvr::Partition knobbed = engine.create_partition("model", "knobs", knobs);
    CHECK_EQ(knobbed.block_size(), 32u);
    knobbed.upsert_worker(kvr::Worker(1).set_role(kvr::Role::Prefill));
    knobbed.upsert_worker(kvr::Worker(2).set_role(kvr::Role::Decode));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, kvr::PartitionOptions(0));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, opts.set_temperature(std::nan("")));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, opts.set_overlap_score_credit(HUGE_VAL));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, opts.set_booking_ttl_ms(0));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, kvr::Worker(1, 0));
    CHECK_EQ(kvr::Worker(0).get() != nullptr, true);  // worker id 0 is not a NULL handle
    kvr::Worker w(1, 2);
    w.set_role(kvr::Role::Aggregated)
        .set_control_endpoint(1, "tcp://w1:5557")
        .set_total_kv_blocks(1000)
        .set_max_batched_tokens(8192)
        .add_lora_adapter("a")
        .set_label("zone", "eu");
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, w.set_control_endpoint(2, "x"));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, w.add_lora_adapter(""));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, w.set_role(static_cast<kvr::Role>(9)));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, w.set_label(std::string_view("\xff\xfe", 2), "v"));
    p.upsert_worker(w);

    // Unknown selection ids: the status travels in the exception, and is counted.
    const uint64_t unknown_before = kvr::status_count(KVR_ERR_UNKNOWN_SELECTION_ID);
    try {
        engine.mark_prefill_complete(0xdead'beefULL);
        CHECK(false && "mark_prefill_complete of an unknown id returned");
    } catch (const kvr::Error &e) {
        CHECK_EQ(e.status(), static_cast<kvr_status>(KVR_ERR_UNKNOWN_SELECTION_ID));
        const std::string what = e.what();
        CHECK(what.find("kvr_engine_mark_prefill_complete") != std::string::npos);
        CHECK(what.find("unknown selection id") != std::string::npos);
    }
    CHECK_THROWS(KVR_ERR_UNKNOWN_SELECTION_ID, engine.free_booking(0xdead'beefULL));
    CHECK_THROWS(KVR_ERR_UNKNOWN_SELECTION_ID, engine.add_output_blocks(0xdead'beefULL, 1));
    CHECK_EQ(kvr::status_count(KVR_ERR_UNKNOWN_SELECTION_ID), unknown_before + 3);

    CHECK_THROWS(KVR_ERR_UNKNOWN_WORKER, p.remove_worker(999));
    CHECK_THROWS(KVR_ERR_UNKNOWN_RANK, p.reserve(1, 5));
    CHECK_THROWS(KVR_ERR_UNKNOWN_RANK, p.reserve(999, 0));

    kvr::Request req;
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, req.set_overrides({HUGE_VAL, {}, {}, {}}));
    req.set_overrides({1.0, std::nullopt, 0.0, std::nullopt});
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, req.set_session(""));
    req.set_session("s1", "s0", true, "user").set_legacy_session_id("legacy");
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, req.set_lora(std::string_view("\xc3", 1)));
    req.reset();

    uint64_t a = engine.mint_selection_id(), b = engine.mint_selection_id();
    CHECK(a != 0 && b != 0 && a != b);

    // Removed partition: handles still read, selections refuse.
    std::vector<uint32_t> toks = prompt(1, 64);
    req.set_tokens(toks);
    CHECK(p.select(req).selected());
    engine.remove_partition("model", "group");
    CHECK_THROWS(KVR_ERR_UNKNOWN_PARTITION, engine.remove_partition("model", "group"));
    CHECK_THROWS(KVR_ERR_UNKNOWN_PARTITION, p.select(req));
    CHECK_THROWS(KVR_ERR_UNKNOWN_PARTITION, again.select_and_reserve(req));
    CHECK_EQ(p.block_size(), 16u);
    CHECK_THROWS(KVR_ERR_UNKNOWN_PARTITION, engine.get_partition("model", "group"));
    // The key is free again.
    kvr::Partition fresh = engine.create_partition("model", "group", opts);
    CHECK_EQ(fresh.selection_stats().selections, 0u);
}

void test_selection_outcomes() {
    kvr::Engine engine;
    kvr::Partition p = engine.create_partition("m", "", kvr::PartitionOptions(16));
    std::vector<uint32_t> toks = prompt(2, 100);
    kvr::Request req;
    req.set_tokens(toks);

    kvr::Selection s = p.select(req);
    CHECK(s.outcome == Outcome::NoWorker);
    CHECK(!s);
    CHECK_EQ(s.status(), static_cast<kvr_status>(KVR_NO_WORKER));
    CHECK_THROWS(KVR_NO_WORKER, s.value());
    CHECK(p.select_and_reserve(req).outcome == Outcome::NoWorker);

    add_workers(p, 1, 4);
    s = p.select(req);
    CHECK(s.selected());
    CHECK(s->worker_id >= 1 && s->worker_id <= 4);
    CHECK_EQ(s->selection_id, 0u);
    CHECK_EQ(s->projected_prefill_tokens, 100u);

    std::vector<uint64_t> none;
    req.set_allowed_workers(none);
    CHECK(p.select(req).outcome == Outcome::NoWorker);
    req.set_allowed_workers({3});
    CHECK_EQ(p.select(req).value().worker_id, 3u);
    req.reset().set_tokens(toks).set_pinned_worker(2);
    CHECK_EQ(p.select(req)->worker_id, 2u);
    req.reset().set_tokens(toks);

    // Busy through the overload hook: nothing booked.
    p.set_hooks({{}, [](uint64_t, uint32_t) { return true; }, {}, {}, {}, {}, {}});
    const kvr::SelectionStats before = p.selection_stats();
    CHECK(p.select(req).outcome == Outcome::Busy);
    kvr::Selection busy = p.select_and_reserve(req);
    CHECK(busy.outcome == Outcome::Busy);
    CHECK_EQ(busy.status(), static_cast<kvr_status>(KVR_BUSY));
    CHECK_THROWS(KVR_BUSY, busy.value());
    CHECK_EQ(p.booking_stats().bookings, 0u);
    const kvr::SelectionStats after = p.selection_stats();
    CHECK_EQ(after.busy, before.busy + 2);
    CHECK(after.no_worker >= 2);
    p.clear_hooks();
    CHECK(p.select(req).selected());

    // Busy through a threshold: every rank carries more prefill than allowed.
    kvr::Partition q =
        engine.create_partition("m", "busy", kvr::PartitionOptions(16).set_busy_prefill_tokens(50));
    add_workers(q, 1, 3);
    std::vector<uint64_t> ids;
    for (uint64_t wkr = 1; wkr <= 3; ++wkr) ids.push_back(q.reserve(wkr, 0, nullptr, 100).selection_id);
    CHECK(q.select(req).outcome == Outcome::Busy);
    for (uint64_t id : ids) engine.mark_prefill_complete(id);
    CHECK(q.select(req).selected());
    for (uint64_t id : ids) CHECK(engine.free_booking(id) == kvr::FreedBy::Now);
}

void test_booking_lifecycle() {
    kvr::Engine engine;
    kvr::Partition p = engine.create_partition("m", "g", kvr::PartitionOptions(16));
    add_workers(p, 1, 2);
    std::vector<uint32_t> toks = prompt(3, 64);
    kvr::Request req;
    req.set_tokens(toks).set_expected_output_tokens(32).set_ttl_ms(600000);

    kvr::Selection s = p.select_and_reserve(req);
    CHECK(s.selected());
    const uint64_t id = s->selection_id;
    CHECK(id != 0);
    kvr::ActiveLoad l = p.active_load(s->worker_id, s->dp_rank);
    CHECK_EQ(l.active_requests, 1u);
    CHECK_EQ(l.active_prefill_tokens, s->projected_prefill_tokens);
    engine.mark_prefill_complete(id);
    engine.mark_prefill_complete(id);  // idempotent
    CHECK_EQ(p.active_load(s->worker_id, s->dp_rank).active_prefill_tokens, 0u);
    const uint64_t decode_before = p.active_load(s->worker_id, s->dp_rank).active_decode_blocks;
    engine.add_output_blocks(id, 3);
    CHECK_EQ(p.active_load(s->worker_id, s->dp_rank).active_decode_blocks, decode_before + 3);
    CHECK(engine.free_booking(id) == kvr::FreedBy::Now);
    CHECK(engine.free_booking(id) == kvr::FreedBy::ByCaller);
    CHECK_THROWS(KVR_ERR_ALREADY_FREED, engine.add_output_blocks(id, 1));
    l = p.active_load(s->worker_id, s->dp_rank);
    CHECK(l.active_requests == 0 && l.active_prefill_tokens == 0 && l.active_decode_blocks == 0);

    // The caller's own selection id: a second booking with it is refused.
    const uint64_t mine = engine.mint_selection_id();
    req.set_selection_id(mine);
    CHECK_EQ(p.select_and_reserve(req)->selection_id, mine);
    CHECK_THROWS(KVR_ERR_DUPLICATE_SELECTION_ID, p.select_and_reserve(req));
    CHECK(engine.free_booking(mine) == kvr::FreedBy::Now);
    CHECK_THROWS(KVR_ERR_DUPLICATE_SELECTION_ID, p.select_and_reserve(req));  // freed recently
    req.set_selection_id(0);

    // Explicit reservations: cost NaN, the prefill override booked.
    kvr::Decision d = p.reserve(2, 0, req, 42);
    CHECK(std::isnan(d.cost));
    CHECK_EQ(d.worker_id, 2u);
    CHECK_EQ(p.active_load(2, 0).active_prefill_tokens, 42u);
    const uint64_t chosen = engine.mint_selection_id();
    kvr::Decision d2 = p.reserve(1, 0, nullptr, std::nullopt, chosen);
    CHECK_EQ(d2.selection_id, chosen);
    CHECK_EQ(p.booking_stats().bookings, 2u);
    CHECK(engine.free_booking(d.selection_id) == kvr::FreedBy::Now);
    CHECK(engine.free_booking(d2.selection_id) == kvr::FreedBy::Now);

    // Replica bookings: found by the lifecycle calls through the partition scan.
    kvr::BlockHashes h = p.hash_tokens(toks);
    const uint64_t rid = engine.mint_selection_id();
    p.install_replica_booking(kvr::ReplicaBooking{rid, 1, 0, h.seq, 64, 16, 0});
    CHECK_EQ(p.active_load(1, 0).active_requests, 1u);
    CHECK_EQ(p.active_load(1, 0).active_prefill_tokens, 64u);
    engine.mark_prefill_complete(rid);
    CHECK(engine.free_booking(rid) == kvr::FreedBy::Now);
    CHECK_EQ(p.active_load(1, 0).active_requests, 0u);
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, p.install_replica_booking(kvr::ReplicaBooking{}));

    // A worker leaving frees its bookings.
    kvr::Decision gone = p.reserve(2, 0, req);
    p.remove_worker(2);
    CHECK(engine.free_booking(gone.selection_id) == kvr::FreedBy::RankRemoved);

    const kvr::BookingStats bs = p.booking_stats();
    CHECK_EQ(bs.bookings, 0u);
    CHECK_EQ(bs.counter_underflows, 0u);
    CHECK_EQ(bs.sweeper_started, 1u);
}

void test_events_and_lookups() {
    kvr::Engine engine;
    kvr::Partition p = engine.create_partition("m", "g", kvr::PartitionOptions(16));
    kvr::Partition salted =
        engine.create_partition("m", "salted", kvr::PartitionOptions(16).set_cache_namespace("ns"));
    add_workers(p, 1, 12);

    // Hashing: the partition's and the free function agree; partial blocks are dropped.
    std::vector<uint32_t> toks = prompt(4, 70);
    kvr::BlockHashes h = p.hash_tokens(toks);
    CHECK_EQ(h.local.size(), 4u);
    CHECK_EQ(h.seq.size(), 4u);
    kvr::BlockHashes f = kvr::hash_tokens(16, toks);
    CHECK(f.local == h.local && f.seq == h.seq);
    CHECK(kvr::hash_tokens(16, toks, {}, "ns").local == salted.hash_tokens(toks).local);
    CHECK(salted.hash_tokens(toks).local != h.local);
    CHECK(p.hash_tokens(toks, "lora").local != h.local);
    std::vector<uint64_t> seq_only;
    seq_only.reserve(1);  // too small: grown and retried
    CHECK_EQ(p.hash_tokens(toks, nullptr, &seq_only), 4u);
    CHECK(seq_only == h.seq);
    std::vector<uint64_t> local_only(100, 7);  // larger than needed: trimmed
    CHECK_EQ(kvr::hash_tokens(16, toks, &local_only, nullptr), 4u);
    CHECK(local_only == h.local);
    CHECK_EQ(p.hash_tokens(toks, nullptr, nullptr), 4u);
    CHECK(p.hash_tokens(Span<const uint32_t>(toks.data(), 15)).local.empty());

    // Stored on worker 1's device, and the first two blocks on worker 2's host.
    std::vector<kvr::StoredBlock> blocks = kvr::stored_blocks(h.seq, h.local);
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, kvr::stored_blocks(h.seq, Span<const uint64_t>(h.local.data(), 1)));
    kvr::ApplyResult r = p.apply_event(1, 0, kvr::stored_event(blocks));
    CHECK(r.all_applied());
    CHECK_EQ(r.events_applied, 1u);
    CHECK_EQ(r.blocks_stored, 4u);
    r = p.apply_event(2, 0, kvr::stored_event(Span<const kvr::StoredBlock>(blocks.data(), 2), std::nullopt, kvr::Tier::Host));
    CHECK_EQ(r.blocks_stored, 2u);

    std::vector<kvr::Overlap> out;  // empty: grown by the retry
    CHECK_EQ(p.find_matches(h.local, out), 1u);
    CHECK(out.size() == 1 && out[0].worker_id == 1 && out[0].device_blocks == 4);
    std::vector<kvr::Overlap> tiered = p.find_matches_tiered(h.local);
    CHECK_EQ(tiered.size(), 2u);
    if (tiered.size() == 2) {
        CHECK(tiered[0].worker_id == 1 && tiered[0].device_blocks == 4 && tiered[0].host_blocks == 0);
        CHECK(tiered[1].worker_id == 2 && tiered[1].device_blocks == 0 && tiered[1].host_blocks == 2);
    }

    // The selection prefers the cached worker, from tokens or from local hashes.
    kvr::Request req;
    req.set_tokens(toks);
    kvr::Selection s = p.select(req);
    CHECK(s && s->worker_id == 1 && s->device_blocks == 4 && s->cached_tokens == 64);
    req.set_local_hashes(h.local, toks.size());
    s = p.select(req);
    CHECK(s && s->worker_id == 1 && s->device_blocks == 4);

    // Chains with a parent; a batch with an unknown parent applies the rest.
    for (uint64_t w = 3; w <= 12; ++w) {
        std::vector<kvr::Event> batch{
            kvr::stored_event(Span<const kvr::StoredBlock>(blocks.data(), 2)),
            kvr::stored_event(Span<const kvr::StoredBlock>(blocks.data() + 2, 2), blocks[1].external_hash),
        };
        r = p.apply_events(w, 0, batch);
        CHECK(r.all_applied() && r.blocks_stored == 4);
    }
    out.clear();
    out.shrink_to_fit();
    out.reserve(2);  // too small for 11 ranks
    CHECK_EQ(p.find_matches(h.local, out), 11u);
    CHECK_EQ(out.size(), 11u);
    bool sorted = true;
    for (std::size_t i = 1; i < out.size(); ++i) sorted = sorted && out[i - 1].worker_id < out[i].worker_id;
    CHECK(sorted);

    const kvr::IndexStats before = p.index_stats();
    const uint64_t last[1] = {blocks[3].external_hash};
    std::vector<kvr::Event> bad{
        kvr::stored_event(Span<const kvr::StoredBlock>(blocks.data() + 3, 1), 0x1234567ULL),
        kvr::removed_event(last),
    };
    r = p.apply_events(5, 0, bad);
    CHECK_EQ(r.refusal, static_cast<kvr_status>(KVR_ERR_PARENT_NOT_FOUND));
    CHECK(!r.all_applied());
    CHECK_EQ(r.events_rejected, 1u);
    CHECK_EQ(r.events_applied, 1u);
    CHECK_EQ(r.blocks_removed, 1u);
    CHECK_THROWS(KVR_ERR_PARENT_NOT_FOUND, r.throw_if_refused());
    CHECK_EQ(p.index_stats().parent_not_found, before.parent_not_found + 1);

    // A malformed batch applies nothing and throws.
    kvr::Event bad_tier = kvr::cleared_event();
    bad_tier.kind = 7;
    std::vector<kvr::Event> malformed{kvr::cleared_event(), bad_tier};
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, p.apply_events(1, 0, malformed));
    kvr::Event nul = kvr::removed_event(Span<const uint64_t>());
    nul.n_removed = 3;
    CHECK_THROWS(KVR_ERR_NULL, p.apply_event(1, 0, nul));
    CHECK_EQ(p.find_matches(h.local).size(), 11u);  // worker 1 not cleared

    // Removes (one unknown), then a clear.
    std::vector<uint64_t> tail{blocks[2].external_hash, blocks[3].external_hash, 0x9999ULL};
    r = p.apply_event(1, 0, kvr::removed_event(tail));
    CHECK(r.blocks_removed == 2 && r.blocks_not_found == 1);
    out = p.find_matches(h.local);
    CHECK(!out.empty() && out[0].worker_id == 1 && out[0].device_blocks == 2);
    p.apply_event(1, 0, kvr::cleared_event());
    out = p.find_matches(h.local);
    CHECK(!out.empty() && out[0].worker_id == 3);

    const kvr::IndexStats st = p.index_stats();
    CHECK_EQ(st.stored_events, 2u + 20u + 1u);  // the refused store counts too
    CHECK_EQ(st.removed_events, 2u);
    CHECK_EQ(st.cleared_events, 1u);
    CHECK(st.ranks >= 10);
    CHECK(st.tier_blocks[1] == 2);

    // Load reports.
    std::vector<kvr::RankLoad> loads(3);
    for (uint32_t i = 0; i < 3; ++i) {
        loads[i] = kvr::RankLoad{};
        loads[i].worker_id = i + 1;
        loads[i].kv_blocks_total = 1000;
        loads[i].kv_blocks_used = 10 * i;
    }
    const uint64_t v1 = p.publish_load(loads);
    const uint64_t v2 = p.publish_load(loads);
    CHECK(v2 > v1);
    loads[1].reserved = 1;
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, p.publish_load(loads));
    CHECK(p.publish_load({}) > v2);
}

void test_hooks() {
    kvr::Engine engine;
    kvr::Partition p = engine.create_partition("m", "hooks", kvr::PartitionOptions(16));
    add_workers(p, 1, 3);
    p.upsert_worker(kvr::Worker(2).add_lora_adapter("adapter-x"));
    std::vector<uint32_t> toks = prompt(5, 16 * 80);
    kvr::Request req;
    req.set_tokens(toks);

    auto released = std::make_shared<std::atomic<int>>(0);
    auto overloaded_calls = std::make_shared<std::atomic<int>>(0);
    auto errors = std::make_shared<std::atomic<int>>(0);
    auto token = std::make_shared<int>(0);  // captured by the hooks: gone when they are
    std::string seen_lora;
    std::vector<uint64_t> seen_workers;
    {
        kvr::Hooks h;
        h.prefill_estimate = [token](uint64_t, uint32_t, uint64_t prompt_tokens, uint64_t cached) {
            return std::optional<uint64_t>(prompt_tokens - cached + 12345);
        };
        h.overloaded = [overloaded_calls](uint64_t, uint32_t) {
            overloaded_calls->fetch_add(1);
            return false;
        };
        h.available = [](uint64_t w, uint32_t) { return w != 3; };
        h.shared_cache = [](Span<const uint64_t> seq, std::vector<kvr::BlockRange> &ranges) {
            // 70 one-block ranges: more than kvr's first offer (64), so it asks again.
            for (uint32_t i = 0; i < 70 && i < seq.size(); ++i) ranges.push_back({i, i + 1});
            return true;
        };
        h.lora_filter = [&seen_lora, &seen_workers](std::string_view lora, Span<const uint64_t> ws,
                                                    Span<uint8_t> serves) {
            seen_lora.assign(lora.data(), lora.size());
            seen_workers.assign(ws.begin(), ws.end());
            for (std::size_t i = 0; i < ws.size(); ++i) serves[i] = ws[i] == 2 ? 1 : 0;
            return true;
        };
        h.on_release = [released] { released->fetch_add(1); };
        h.on_error = [errors](const char *, std::exception_ptr) { errors->fetch_add(1); };
        p.set_hooks(std::move(h));
    }
    CHECK_EQ(token.use_count(), 2);  // the box holds the hooks
    kvr::Selection s = p.select(req);
    CHECK(s.selected());
    CHECK_EQ(s->projected_prefill_tokens, 16u * 80u + 12345u);
    CHECK_EQ(s->shared_blocks, 70u);
    CHECK(s->worker_id != 3);
    CHECK(overloaded_calls->load() >= 1);
    req.set_allowed_workers({3});
    CHECK(p.select(req).outcome == Outcome::NoWorker);  // unavailable
    req.reset().set_tokens(toks).set_lora("adapter-x");
    s = p.select(req);
    CHECK(s && s->worker_id == 2);
    CHECK_EQ(seen_lora, "adapter-x");
    CHECK(!seen_workers.empty());
    CHECK_EQ(released->load(), 0);

    // Replacing the hooks releases the old ones exactly once (and deletes them).
    auto released2 = std::make_shared<std::atomic<int>>(0);
    auto thrown = std::make_shared<std::atomic<int>>(0);
    std::string error_hook;
    kvr::Hooks h2;
    h2.overloaded = [thrown](uint64_t, uint32_t) -> bool {
        thrown->fetch_add(1);
        throw std::runtime_error("hook failure");
    };
    h2.prefill_estimate = [](uint64_t, uint32_t, uint64_t, uint64_t) -> std::optional<uint64_t> {
        throw 42;  // not even a std::exception
    };
    h2.shared_cache = [](Span<const uint64_t>, std::vector<kvr::BlockRange> &) -> bool {
        throw std::bad_alloc();
    };
    h2.on_release = [released2] { released2->fetch_add(1); };
    h2.on_error = [&error_hook](const char *hook, std::exception_ptr e) {
        if (error_hook.empty()) error_hook = hook;
        CHECK(e != nullptr);
    };
    p.set_hooks(std::move(h2));
    CHECK_EQ(released->load(), 1);
    CHECK_EQ(token.use_count(), 1);
    // Throwing hooks: the selection goes on as if they were absent.
    req.reset().set_tokens(toks);
    const uint64_t failures_before = p.selection_stats().shared_cache_failures;
    s = p.select(req);
    CHECK(s.selected());
    CHECK(thrown->load() >= 1);
    CHECK_EQ(s->projected_prefill_tokens, 16u * 80u);  // no estimate: prompt − cached
    CHECK_EQ(s->shared_blocks, 0u);
    CHECK_EQ(p.selection_stats().shared_cache_failures, failures_before + 1);
    CHECK(!error_hook.empty());
    p.clear_hooks();
    CHECK_EQ(released2->load(), 1);
    CHECK_EQ(released->load(), 1);

    // Hooks on an empty handle: refused, never released, the box deleted.
    auto released3 = std::make_shared<std::atomic<int>>(0);
    auto token3 = std::make_shared<int>(0);
    kvr::Partition empty;
    kvr::Hooks h3;
    h3.available = [token3](uint64_t, uint32_t) { return true; };
    h3.on_release = [released3] { released3->fetch_add(1); };
    CHECK_THROWS(KVR_ERR_NULL, empty.set_hooks(h3));
    CHECK_EQ(released3->load(), 0);
    h3 = kvr::Hooks{};
    CHECK_EQ(token3.use_count(), 1);

    // Hooks go away with their partition: the last handle and the engine.
    auto released4 = std::make_shared<std::atomic<int>>(0);
    auto released5 = std::make_shared<std::atomic<int>>(0);
    {
        kvr::Engine e2;
        kvr::Partition p2 = e2.create_partition("m", "g", kvr::PartitionOptions(32));
        kvr::Hooks h4;
        h4.available = [](uint64_t, uint32_t) { return true; };
        h4.on_release = [released4] { released4->fetch_add(1); };
        p2.set_hooks(std::move(h4));
        kvr::Partition p3 = e2.get_partition("m", "g");
        p2 = kvr::Partition();
        CHECK_EQ(released4->load(), 0);
        // Hooks with no hook function at all: kvr (today) releases them at once, inside
        // kvr_partition_set_hooks (see the report); either way, exactly once.
        kvr::Partition p5 = e2.create_partition("m", "h", kvr::PartitionOptions(32));
        kvr::Hooks h5;
        h5.on_release = [released5] { released5->fetch_add(1); };
        p5.set_hooks(std::move(h5));
        CHECK(released5->load() <= 1);
    }
    CHECK_EQ(released4->load(), 1);
    CHECK_EQ(released5->load(), 1);
}

void test_move_semantics() {
    kvr::Engine a;
    kvr_engine *raw_a = a.get();
    kvr::Engine b(std::move(a));
    CHECK(!a && b && b.get() == raw_a);
    CHECK_THROWS(KVR_ERR_NULL, a.mint_selection_id());
    CHECK_THROWS(KVR_ERR_NULL, a.create_partition("m", "g", kvr::PartitionOptions(16)));
    CHECK(b.mint_selection_id() != 0);
    kvr::Engine c;
    c = std::move(b);  // c's old engine is freed
    CHECK(!b && c.get() == raw_a);

    kvr::Partition p = c.create_partition("m", "g", kvr::PartitionOptions(16));
    add_workers(p, 1, 2);
    kvr::Partition q = std::move(p);
    CHECK(!p && q);
    CHECK_THROWS(KVR_ERR_NULL, p.block_size());
    kvr::Request req;
    std::vector<uint32_t> toks = prompt(6, 32);
    req.set_tokens(toks);
    CHECK_THROWS(KVR_ERR_NULL, p.select(req));
    CHECK_THROWS(KVR_ERR_NULL, p.set_hooks(kvr::Hooks{}));
    CHECK(q.select(req).selected());

    kvr::Request r2 = std::move(req);
    CHECK(!req && r2);
    CHECK_THROWS(KVR_ERR_NULL, req.set_tokens(toks));
    CHECK_THROWS(KVR_ERR_NULL, q.select(req));
    CHECK_THROWS(KVR_ERR_NULL, q.reserve(1, 0, req));  // not silently "no request"
    CHECK(q.select(r2).selected());

    kvr::Worker w(9);
    kvr::Worker w2 = std::move(w);
    CHECK_THROWS(KVR_ERR_NULL, w.set_total_kv_blocks(1));
    CHECK_THROWS(KVR_ERR_NULL, q.upsert_worker(w));
    q.upsert_worker(w2);

    kvr::PartitionOptions po(16);
    kvr::PartitionOptions po2 = std::move(po);
    CHECK_THROWS(KVR_ERR_NULL, po.set_temperature(1.0));
    CHECK_THROWS(KVR_ERR_NULL, c.create_partition("m", "h", po));
    c.create_partition("m", "h", po2);
    kvr::EngineOptions eo;
    kvr::EngineOptions eo2 = std::move(eo);
    CHECK_THROWS(KVR_ERR_NULL, eo.set_seed(1));
    CHECK_THROWS(KVR_ERR_NULL, kvr::Engine{eo});
    kvr::Engine seeded(eo2.set_seed(3));
    CHECK(seeded);

    // release() / adopt: ownership crosses to C and back.
    kvr_request *raw = r2.release();
    CHECK(!r2 && raw != nullptr);
    kvr::Request back = kvr::Request::adopt(raw);
    CHECK(q.select(back).selected());
    kvr_engine *raw_e = seeded.release();
    kvr_engine_free(raw_e);
    kvr::Engine empty = kvr::Engine::adopt(nullptr);
    CHECK(!empty);
    // Moved-from and empty objects are destroyed here without effect.
}


// The cost model: the latency default (a TTFT estimate in ms), Dynamo's when set, each
// latency knob reaching the cost, refusals, and the learned prefill rate.
void test_cost_model() {
    auto close = [](double a, double b) { return std::fabs(a - b) <= 1e-6 * std::fmax(1.0, std::fabs(b)); };
    kvr::Engine engine(kvr::EngineOptions().set_seed(3));
    std::vector<uint32_t> toks = prompt(9, 64);  // 4 blocks of 16, cached nowhere
    kvr::Request req;
    req.set_tokens(toks);

    // Default: 5 ms + 64 tokens at 10,000/s + 4 decode blocks at 1 µs.
    kvr::Partition lat = engine.create_partition("m", "latency", kvr::PartitionOptions(16));
    add_workers(lat, 1, 2);
    CHECK(close(lat.select(req)->cost, 5.0 + 6.4 + 0.004));
    // Dynamo: 4 prefill blocks + 4 decode blocks.
    kvr::Partition dyn = engine.create_partition(
        "m", "dynamo", kvr::PartitionOptions(16).set_cost_model(kvr::CostModel::Dynamo));
    add_workers(dyn, 1, 2);
    CHECK(close(dyn.select(req)->cost, 8.0));

    kvr::PartitionOptions knobs(16);
    knobs.set_cost_model(kvr::CostModel::Latency)
        .set_prefill_rate_prior(1000.0)
        .set_learn_prefill_rate(false)
        .set_request_overhead_ms(1.0)
        .set_kv_pressure_threshold(0.95)
        .set_kv_pressure_ms(10.0)
        .set_itl_target_ms(25.0)
        .set_itl_target_ms(0.0)  // cleared
        .set_itl_base_ms(20.0)
        .set_itl_per_request_ms(0.2)
        .set_queue_externality(0.0)
        .set_decode_block_us(0.0);
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, knobs.set_cost_model(static_cast<kvr::CostModel>(5)));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, knobs.set_prefill_rate_prior(0.0));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, knobs.set_kv_pressure_threshold(1.5));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, knobs.set_itl_target_ms(-1.0));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, knobs.set_request_overhead_ms(std::nan("")));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, knobs.set_decode_block_us(-1.0));
    kvr::Partition tuned = engine.create_partition("m", "tuned", knobs);
    add_workers(tuned, 1, 2);
    CHECK(close(tuned.select(req)->cost, 1.0 + 64.0));  // the refusals changed nothing

    // The learned rate: none, then positive after a few completed prefills.
    kvr::PrefillRate none = lat.prefill_rate();
    CHECK(!none.tokens_per_s.has_value());
    CHECK_EQ(none.observations, 0u);
    kvr::DecodeDrag no_drag = lat.decode_drag();
    CHECK(!no_drag.seconds_per_block.has_value());
    CHECK_EQ(no_drag.observations, 0u);
    for (int i = 0; i < 8; ++i) {
        kvr::Selection s = lat.select_and_reserve(req);
        CHECK(s.selected());
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        engine.mark_prefill_complete(s->selection_id);
        CHECK(engine.free_booking(s->selection_id) == kvr::FreedBy::Now);
    }
    kvr::PrefillRate learned = lat.prefill_rate();
    CHECK_EQ(learned.observations, 8u);
    CHECK(learned.tokens_per_s.has_value() && *learned.tokens_per_s > 0.0);
    // Eight completions on one rank's load: counted, too few (and no spread) for a drag.
    kvr::DecodeDrag drag = lat.decode_drag();
    CHECK_EQ(drag.observations, 8u);
    CHECK(!drag.seconds_per_block.has_value());
    CHECK(!tuned.prefill_rate().tokens_per_s.has_value());
    kvr::Partition moved = std::move(tuned);
    CHECK_THROWS(KVR_ERR_NULL, tuned.prefill_rate());
}

}  // namespace

int main() {
    KVR_ABI_CHECK();
    test::run("abi and status", test_abi_and_status);
    test::run("span", test_span);
    test::run("lifecycle errors", test_lifecycle_errors);
    test::run("selection outcomes", test_selection_outcomes);
    test::run("booking lifecycle", test_booking_lifecycle);
    test::run("events and lookups", test_events_and_lookups);
    test::run("hooks", test_hooks);
    test::run("move semantics", test_move_semantics);
    test::run("cost model", test_cost_model);
    test::run("invalid config", invalid_config_test);
    test::run("indexer policies", indexer_policies_test);
    test::run("approximate primary", approximate_primary_test);
    test::run("kv hints", kv_hint_test);
    test::run("session affinity hard", session_hard_test);
    test::run("session affinity soft", session_soft_test);
    test::run("ingest and subscribe", ingress_test);
    test::run("extra keys, output blocks", extras_test);
    test::run("hint source hashes", hint_names_test);
    test::run("threaded workload", workload_test);
    const int p = test::passed.load(), f = test::failed.load();
    std::printf("%d passed, %d failed\n", p, f);
    return f == 0 && p > 0 ? 0 : 1;
}
