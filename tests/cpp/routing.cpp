// Checks of the C++ wrapper's issue-7 surface (kvr.hpp over C ABI 0.3): indexer policy
// options and their check (KVR_ERR_INVALID_CONFIG with its reason), the approximate
// primary fed by bookings, transfer hints on booked selections, and session affinity
// (decision flags and the session table's counters). A third translation unit including
// kvr.hpp.
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "check.hpp"
#include "kvr.hpp"

namespace {

using kvr::Outcome;
using kvr::Span;

// The exception stays cheap to copy with its reason; the selection carries a hint.
static_assert(std::is_nothrow_copy_constructible<kvr::Error>::value, "");
static_assert(std::is_same<decltype(kvr::Selection{}.hint), std::optional<kvr::KvHint>>::value, "");
static_assert(kvr::role_mask({kvr::Role::Prefill, kvr::Role::Aggregated}) == kvr::default_hint_source_roles,
              "");
static_assert(kvr::role_bit(kvr::Role::Decode) == static_cast<uint32_t>(KVR_ROLE_MASK_DECODE), "");

constexpr uint32_t kBlock = 16;
constexpr std::size_t kBlocks = 8;

std::vector<uint32_t> prompt(uint32_t seed, std::size_t blocks = kBlocks) {
    std::vector<uint32_t> t(blocks * kBlock);
    for (std::size_t i = 0; i < t.size(); ++i) t[i] = seed * 1000003u + static_cast<uint32_t>(i);
    return t;
}

/// Rank (worker, 0) holds the first `n` blocks of `tokens` on its device (a KV event).
void hold(const kvr::Partition &p, uint64_t worker, const std::vector<uint32_t> &tokens, std::size_t n) {
    const kvr::BlockHashes h = p.hash_tokens(tokens);
    std::vector<kvr::StoredBlock> blocks;
    for (std::size_t i = 0; i < n && i < h.local.size(); ++i)
        blocks.push_back({h.seq[i] ^ (worker << 40), h.local[i]});
    const kvr::ApplyResult r = p.apply_event(worker, 0, kvr::stored_event(blocks));
    CHECK(r.all_applied() && r.blocks_stored == n);
}

bool contains(std::string_view hay, std::string_view needle) {
    return hay.find(needle) != std::string_view::npos;
}

}  // namespace

void invalid_config_test() {
    kvr::Engine engine;

    // Default options: valid, no notices.
    kvr::PartitionOptions plain(kBlock);
    CHECK_EQ(plain.check(), "");

    // A remote primary with KV events off contradicts itself: check() and
    // create_partition both refuse it, with kvr's reason.
    kvr::PartitionOptions remote_off(kBlock);
    remote_off.set_use_kv_events(false).set_remote_indexer("http://127.0.0.1:9", 20, 50);
    try {
        remote_off.check();
        CHECK(false && "check() accepted a remote primary with events off");
    } catch (const kvr::Error &e) {
        CHECK_EQ(e.status(), static_cast<kvr_status>(KVR_ERR_INVALID_CONFIG));
        CHECK(contains(e.reason(), "no write API"));
        CHECK(contains(e.what(), "kvr_partition_options_check"));
        CHECK(contains(e.what(), "no write API"));
    }
    const uint64_t invalid_before = kvr::status_count(KVR_ERR_INVALID_CONFIG);
    try {
        engine.create_partition("m", "remote-off", remote_off);
        CHECK(false && "create_partition accepted a remote primary with events off");
    } catch (const kvr::Error &e) {
        CHECK_EQ(e.status(), static_cast<kvr_status>(KVR_ERR_INVALID_CONFIG));
        const std::string what = e.what();
        CHECK(contains(what, "kvr_engine_create_partition"));
        CHECK(contains(what, "invalid partition configuration"));
        CHECK(contains(what, "no write API"));
        CHECK(contains(e.reason(), "no write API"));
    }
    CHECK(kvr::status_count(KVR_ERR_INVALID_CONFIG) > invalid_before);
    CHECK_THROWS(KVR_ERR_UNKNOWN_PARTITION, engine.get_partition("m", "remote-off"));  // nothing made

    // A URL kvr cannot use (https): refused with a reason naming the remote index.
    kvr::PartitionOptions https(kBlock);
    https.set_remote_indexer("https://index.invalid");
    try {
        engine.create_partition("m", "https", https);
        CHECK(false && "create_partition accepted an https remote");
    } catch (const kvr::Error &e) {
        CHECK_EQ(e.status(), static_cast<kvr_status>(KVR_ERR_INVALID_CONFIG));
        CHECK(contains(e.reason(), "remote index"));
        CHECK(contains(e.what(), "https://index.invalid"));
    }
    // Dropping the URL repairs it.
    https.set_remote_indexer("");
    CHECK_EQ(https.check(), "");
    CHECK(engine.create_partition("m", "https", https));

    // Accepted with notices: capacity-bounded retention falls back to TTL, and a
    // prediction TTL means nothing with events off.
    kvr::PartitionOptions noticed(kBlock);
    noticed.set_use_kv_events(false)
        .set_approx_retention(kvr::Retention::CapacityBounded)
        .set_prediction_ttl_ms(1000);
    const std::string notices = noticed.check();
    CHECK(contains(notices, "capacity-bounded"));
    CHECK(contains(notices, "prediction TTL is ignored"));
    CHECK(contains(notices, "; "));
    kvr::Partition approx = engine.create_partition("m", "noticed", noticed);
    CHECK(kvr::policy_of(approx.indexer_stats()) == kvr::IndexerPolicy::ApproximatePrimary);

    // Setter arguments kvr refuses at once.
    kvr::PartitionOptions o(kBlock);
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, o.set_approx_index(0, 10));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, o.set_approx_index(10, 0));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, o.set_approx_retention(static_cast<kvr::Retention>(9)));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, o.set_kv_hints(4, 64, 0));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, o.set_kv_hints(4, 64, 1u << 7));
    o.set_kv_hints(4, 0, 0);  // 0 blocks = hints off: the mask is not looked at
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, o.set_session_affinity(kvr::Affinity::Soft, -1.0));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, o.set_session_affinity(kvr::Affinity::Soft, std::nan("")));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, o.set_session_affinity(static_cast<kvr::Affinity>(7)));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, o.set_remote_indexer(std::string_view("\xff", 1)));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, kvr::Worker(1).set_control_endpoint(0, std::string(512, 'e')));
    kvr::Worker(1).set_control_endpoint(0, std::string(511, 'e'));
    kvr::PartitionOptions moved(kBlock);
    kvr::PartitionOptions taker = std::move(moved);
    CHECK_THROWS(KVR_ERR_NULL, moved.check());
    CHECK_THROWS(KVR_ERR_NULL, moved.set_use_kv_events(false));
    CHECK_THROWS(KVR_ERR_NULL, kvr::Partition().indexer_stats());
    CHECK_THROWS(KVR_ERR_NULL, kvr::Partition().session_stats());
}

void indexer_policies_test() {
    kvr::Engine engine;
    kvr::Partition events = engine.create_partition("m", "events", kvr::PartitionOptions(kBlock));
    kvr::IndexerStats st = events.indexer_stats();
    CHECK(kvr::policy_of(st) == kvr::IndexerPolicy::EventDriven);
    CHECK_EQ(st.reserved, 0u);

    kvr::Partition predicted = engine.create_partition(
        "m", "predicted", kvr::PartitionOptions(kBlock).set_prediction_ttl_ms(2000).set_approx_index(5000, 1000));
    CHECK(kvr::policy_of(predicted.indexer_stats()) == kvr::IndexerPolicy::EventDrivenWithPrediction);
    predicted.upsert_worker(kvr::Worker(1));
    std::vector<uint32_t> t = prompt(3);
    kvr::Request req;
    req.set_tokens(t);
    kvr::Selection s = predicted.select_and_reserve(req);
    CHECK(s.selected());
    CHECK_EQ(predicted.indexer_stats().bookings_recorded, 1u);
    engine.free_booking(s->selection_id);
    s = predicted.select(req);  // the side index counts before any event arrives
    CHECK(s && s->device_blocks == kBlocks);

    // A remote primary nobody answers: the selection goes on without overlap, counted.
    kvr::PartitionOptions ro(kBlock);
    ro.set_remote_indexer("http://127.0.0.1:9", 50, 200);
    CHECK_EQ(ro.check(), "");
    kvr::Partition remote = engine.create_partition("m", "remote", ro);
    remote.upsert_worker(kvr::Worker(1));
    st = remote.indexer_stats();
    CHECK(kvr::policy_of(st) == kvr::IndexerPolicy::RemotePrimary);
    s = remote.select(req);
    CHECK(s && s->device_blocks == 0);
    st = remote.indexer_stats();
    CHECK(st.remote_queries >= 1);
    CHECK(st.remote_failures >= 1);
}

void approximate_primary_test() {
    kvr::Engine engine;
    kvr::PartitionOptions opts(kBlock);
    opts.set_use_kv_events(false).set_approx_index(60000, 1u << 16).set_approx_retention(kvr::Retention::Ttl);
    CHECK_EQ(opts.check(), "");
    kvr::Partition p = engine.create_partition("m", "approx", opts);
    for (uint64_t w = 1; w <= 4; ++w) p.upsert_worker(kvr::Worker(w));
    CHECK(kvr::policy_of(p.indexer_stats()) == kvr::IndexerPolicy::ApproximatePrimary);

    std::vector<uint32_t> t = prompt(7);
    kvr::Request req;
    req.set_tokens(t);
    kvr::Selection first = p.select_and_reserve(req);
    CHECK(first.selected());
    CHECK_EQ(first->device_blocks, 0u);  // nothing known yet
    CHECK(!first.hint);
    kvr::IndexerStats st = p.indexer_stats();
    CHECK_EQ(st.bookings_recorded, 1u);
    CHECK_EQ(st.record_failures, 0u);
    CHECK_EQ(st.approx_blocks_recorded, static_cast<uint64_t>(kBlocks));
    // The booking is in the index: the rank it went to holds the prompt.
    std::vector<kvr::Overlap> m = p.find_matches(p.hash_tokens(t).local);
    CHECK(m.size() == 1 && m[0].worker_id == first->worker_id && m[0].device_blocks == kBlocks);
    engine.free_booking(first->selection_id);

    // The next identical prompt goes where it was booked and sees the blocks.
    kvr::Selection advised = p.select(req);
    CHECK(advised && advised->worker_id == first->worker_id && advised->dp_rank == first->dp_rank);
    CHECK_EQ(advised->device_blocks, static_cast<uint32_t>(kBlocks));
    CHECK_EQ(advised->cached_tokens, static_cast<uint64_t>(kBlocks * kBlock));
    CHECK_EQ(p.indexer_stats().bookings_recorded, 1u);  // advisory records nothing
    kvr::Selection again = p.select_and_reserve(req);
    CHECK(again && again->worker_id == first->worker_id && again->device_blocks == kBlocks);
    st = p.indexer_stats();
    CHECK_EQ(st.bookings_recorded, 2u);
    CHECK_EQ(st.approx_blocks_refreshed, static_cast<uint64_t>(kBlocks));
    engine.free_booking(again->selection_id);

    // The control: with events on, bookings record nothing.
    kvr::Partition ev = engine.create_partition("m", "events", kvr::PartitionOptions(kBlock));
    for (uint64_t w = 1; w <= 4; ++w) ev.upsert_worker(kvr::Worker(w));
    kvr::Selection b = ev.select_and_reserve(req);
    CHECK(b.selected());
    engine.free_booking(b->selection_id);
    CHECK_EQ(ev.select(req)->device_blocks, 0u);
    st = ev.indexer_stats();
    CHECK_EQ(st.bookings_recorded, 0u);
    CHECK_EQ(st.approx_blocks_recorded, 0u);
}

void kv_hint_test() {
    kvr::Engine engine;
    kvr::PartitionOptions opts(kBlock);
    opts.set_kv_hints(4, 4096, kvr::role_mask({kvr::Role::Prefill, kvr::Role::Aggregated}));
    kvr::Partition p = engine.create_partition("m", "hints", opts);
    const std::string ep = "tcp://peer-2:7000";
    const std::string long_ep = "tcp://" + std::string(KVR_CONTROL_ENDPOINT_MAX_LEN - 11, 'x') + ":7000";
    CHECK_EQ(long_ep.size(), static_cast<std::size_t>(KVR_CONTROL_ENDPOINT_MAX_LEN));
    // Worker 1 (decode, the pin) holds 2 blocks; worker 2 (prefill, with an endpoint) 12;
    // worker 3 (prefill, no endpoint) 14: not a source.
    const std::vector<uint32_t> t = prompt(11, 16);
    p.upsert_worker(kvr::Worker(1).set_role(kvr::Role::Decode));
    p.upsert_worker(kvr::Worker(2).set_role(kvr::Role::Prefill).set_control_endpoint(0, ep));
    p.upsert_worker(kvr::Worker(3).set_role(kvr::Role::Prefill));
    hold(p, 1, t, 2);
    hold(p, 2, t, 12);
    hold(p, 3, t, 14);

    kvr::Request req;
    req.set_tokens(t).set_pinned_worker(1);
    kvr::Selection s = p.select_and_reserve(req);
    CHECK(s && s->worker_id == 1 && s->device_blocks == 2);
    CHECK((s.flags() & kvr::decision_kv_hint) != 0);
    CHECK(kvr::has_kv_hint(*s));
    CHECK(s.session_route() == kvr::SessionRoute::None);
    CHECK(s.hint.has_value());
    if (s.hint) {
        CHECK_EQ(s.hint->source_worker_id, 2u);
        CHECK_EQ(s.hint->source_dp_rank, 0u);
        CHECK_EQ(s.hint->block_start, 2u);
        CHECK_EQ(s.hint->block_end, 12u);
        CHECK_EQ(s.hint->blocks(), 10u);
        CHECK_EQ(s.hint->endpoint, ep);
    }
    engine.free_booking(s->selection_id);

    // Advisory selection never carries one.
    kvr::Selection adv = p.select(req);
    CHECK(adv && adv->worker_id == 1);
    CHECK_EQ(adv.flags() & kvr::decision_kv_hint, 0u);
    CHECK(!adv.hint);

    // The longest endpoint travels whole; the range is cut at max_transfer_blocks.
    kvr::Partition q = engine.create_partition("m", "short", kvr::PartitionOptions(kBlock).set_kv_hints(4, 3));
    q.upsert_worker(kvr::Worker(1).set_role(kvr::Role::Decode));
    q.upsert_worker(kvr::Worker(2).set_role(kvr::Role::Aggregated).set_control_endpoint(0, long_ep));
    hold(q, 1, t, 2);
    hold(q, 2, t, 12);
    s = q.select_and_reserve(req);
    CHECK(s && s.hint);
    if (s.hint) {
        CHECK_EQ(s.hint->source_worker_id, 2u);
        CHECK_EQ(s.hint->block_start, 2u);
        CHECK_EQ(s.hint->block_end, 5u);
        CHECK_EQ(s.hint->endpoint.size(), long_ep.size());
        CHECK_EQ(s.hint->endpoint, long_ep);
    }
    engine.free_booking(s->selection_id);

    // Below the minimum advantage, or with the source's role not allowed: none.
    kvr::Partition r = engine.create_partition(
        "m", "roles", kvr::PartitionOptions(kBlock).set_kv_hints(4, 4096, kvr::role_bit(kvr::Role::Aggregated)));
    r.upsert_worker(kvr::Worker(1).set_role(kvr::Role::Decode));
    r.upsert_worker(kvr::Worker(2).set_role(kvr::Role::Prefill).set_control_endpoint(0, ep));
    r.upsert_worker(kvr::Worker(3).set_role(kvr::Role::Aggregated).set_control_endpoint(0, ep));
    hold(r, 1, t, 2);
    hold(r, 2, t, 12);
    hold(r, 3, t, 5);  // advantage 3 < 4
    s = r.select_and_reserve(req);
    CHECK(s && s->worker_id == 1);
    CHECK_EQ(s.flags() & kvr::decision_kv_hint, 0u);
    CHECK(!s.hint);
    engine.free_booking(s->selection_id);

    // Hints off (the default): none.
    kvr::Partition off = engine.create_partition("m", "off", kvr::PartitionOptions(kBlock));
    off.upsert_worker(kvr::Worker(1).set_role(kvr::Role::Decode));
    off.upsert_worker(kvr::Worker(2).set_role(kvr::Role::Prefill).set_control_endpoint(0, ep));
    hold(off, 1, t, 2);
    hold(off, 2, t, 12);
    s = off.select_and_reserve(req);
    CHECK(s && s->worker_id == 1 && !s.hint && s.flags() == 0u);
}

void session_hard_test() {
    kvr::Engine engine;
    kvr::Partition p = engine.create_partition(
        "m", "hard", kvr::PartitionOptions(kBlock).set_session_affinity(kvr::Affinity::Hard, 0.0, 1000, 60000));
    for (uint64_t w = 1; w <= 4; ++w) p.upsert_worker(kvr::Worker(w));
    kvr::SessionStats st = p.session_stats();
    CHECK_EQ(st.enabled, 1u);
    CHECK_EQ(st.entries, 0u);

    const std::vector<uint32_t> t1 = prompt(21), t2 = prompt(22), t3 = prompt(23);
    kvr::Request req;
    req.set_tokens(t1).set_session("s");
    kvr::Selection first = p.select_and_reserve(req);
    CHECK(first.selected());
    CHECK(first.session_route() == kvr::SessionRoute::Unbound);
    CHECK_EQ(first.flags(), kvr::decision_session_unbound);
    st = p.session_stats();
    CHECK(st.entries == 1 && st.leases == 1 && st.bindings_created == 1);
    engine.free_booking(first->selection_id);
    CHECK_EQ(p.session_stats().leases, 0u);
    const uint64_t home = first->worker_id;

    // Another worker holds the whole next prompt; the session still goes home, pinned.
    const uint64_t other = home % 4 + 1;
    hold(p, other, t2, kBlocks);
    req.set_tokens(t2);
    kvr::Selection second = p.select_and_reserve(req);
    CHECK(second && second->worker_id == home);
    CHECK(second.session_route() == kvr::SessionRoute::Pinned);
    CHECK((second.flags() & kvr::decision_session_pinned) != 0);
    CHECK_EQ(second->device_blocks, 0u);
    engine.free_booking(second->selection_id);
    // Without a session the cached worker wins, and no session bit is set.
    kvr::Request plain;
    plain.set_tokens(t2);
    kvr::Selection cached = p.select(plain);
    CHECK(cached && cached->worker_id == other && cached.session_route() == kvr::SessionRoute::None);
    CHECK_EQ(cached.flags(), 0u);

    // The home worker leaves: the next turn is rebound (flag, counted), then pinned there.
    p.remove_worker(home);
    req.set_tokens(t3);
    kvr::Selection third = p.select_and_reserve(req);
    CHECK(third && third->worker_id != home);
    CHECK(third.session_route() == kvr::SessionRoute::Rebound);
    CHECK_EQ(third.flags() & kvr::decision_session_mask, kvr::decision_session_rebound);
    st = p.session_stats();
    CHECK_EQ(st.forced_rebinds, 1u);
    CHECK_EQ(st.rebinds, 1u);
    engine.free_booking(third->selection_id);
    req.set_tokens(t1);
    kvr::Selection fourth = p.select_and_reserve(req);
    CHECK(fourth && fourth->worker_id == third->worker_id);
    CHECK(fourth.session_route() == kvr::SessionRoute::Pinned);
    engine.free_booking(fourth->selection_id);

    // A final turn releases the binding when its booking ends.
    req.set_tokens(t1).set_session("s", "", true);
    kvr::Selection last = p.select_and_reserve(req);
    CHECK(last && last.session_route() == kvr::SessionRoute::Pinned);
    CHECK_EQ(p.session_stats().entries, 1u);
    engine.free_booking(last->selection_id);
    st = p.session_stats();
    CHECK(st.entries == 0 && st.leases == 0 && st.finals_released == 1);

    // Without affinity: sessions steer nothing and the table reads all zero.
    kvr::Partition none = engine.create_partition("m", "none", kvr::PartitionOptions(kBlock));
    none.upsert_worker(kvr::Worker(1));
    req.set_session("s");
    kvr::Selection s = none.select_and_reserve(req);
    CHECK(s && s.session_route() == kvr::SessionRoute::None && s.flags() == 0u);
    st = none.session_stats();
    CHECK(st.enabled == 0 && st.bindings_created == 0 && st.entries == 0);
    // Affinity set, then turned off again on the options: none either.
    kvr::PartitionOptions toggled(kBlock);
    toggled.set_session_affinity(kvr::Affinity::Hard).set_session_affinity(kvr::Affinity::Off);
    CHECK_EQ(engine.create_partition("m", "toggled", toggled).session_stats().enabled, 0u);
}

void session_soft_test() {
    kvr::Engine engine;
    kvr::Partition p = engine.create_partition(
        "m", "soft", kvr::PartitionOptions(kBlock).set_session_affinity(kvr::Affinity::Soft, 4.0));
    for (uint64_t w = 1; w <= 4; ++w) p.upsert_worker(kvr::Worker(w));
    CHECK_EQ(p.session_stats().enabled, 1u);

    std::vector<uint32_t> t = prompt(31);
    kvr::Request req;
    req.set_tokens(t).set_session("soft-s");
    kvr::Selection first = p.select_and_reserve(req);
    CHECK(first && first.session_route() == kvr::SessionRoute::Unbound);
    engine.free_booking(first->selection_id);

    // Equal costs elsewhere: the preference decides, flagged Preferred.
    for (uint32_t i = 0; i < 4; ++i) {
        std::vector<uint32_t> ti = prompt(40 + i);
        req.set_tokens(ti);
        kvr::Selection s = p.select_and_reserve(req);
        CHECK(s && s->worker_id == first->worker_id);
        CHECK(s.session_route() == kvr::SessionRoute::Preferred);
        CHECK_EQ(s.flags(), kvr::decision_session_preferred);
        engine.free_booking(s->selection_id);
    }
    // A worker holding the whole prompt (8 blocks) beats a 4-block preference; the
    // decision is still flagged Preferred (the preference was weighed, and lost).
    const uint64_t other = first->worker_id % 4 + 1;
    std::vector<uint32_t> cached = prompt(50);
    hold(p, other, cached, kBlocks);
    req.set_tokens(cached);
    kvr::Selection s = p.select_and_reserve(req);
    CHECK(s && s->worker_id == other && s->device_blocks == kBlocks);
    CHECK(s.session_route() == kvr::SessionRoute::Preferred);
    engine.free_booking(s->selection_id);
    const kvr::SessionStats st = p.session_stats();
    CHECK_EQ(st.bindings_created, 1u);
    CHECK_EQ(st.forced_rebinds, 0u);
}
