// Checks of the C++ wrapper's ingress and extra-key surface (kvr.hpp over C ABI 2): raw
// engine messages (Partition::ingest), per-stream counters and decode-error names, kvr's
// own subscriber (SubscribeOptions, Subscription), a request's extra keys (cache salt,
// multimodal inputs, block keys), the transfer hint's source hashes, idempotent output
// blocks and the stale-overlap option. A fourth translation unit including kvr.hpp.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "check.hpp"
#include "kvr.hpp"

namespace {

using kvr::Span;

constexpr uint32_t kBlock = 4;

// [1.0, [{"type":"BlockStored","block_hashes":[1],"parent_block_hash":nil,
//         "token_ids":[0,1,2,3],"block_size":4}], 0]  (vLLM 0.33's tagged-map encoding)
const std::vector<uint8_t> kStored0123 = [] {
    const char bytes[] =
        "\x93\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\x91\x85\xa4\x74\x79\x70\x65\xab\x42\x6c\x6f"
        "\x63\x6b\x53\x74\x6f\x72\x65\x64\xac\x62\x6c\x6f\x63\x6b\x5f\x68\x61\x73\x68\x65\x73"
        "\x91\x01\xb1\x70\x61\x72\x65\x6e\x74\x5f\x62\x6c\x6f\x63\x6b\x5f\x68\x61\x73\x68\xc0"
        "\xa9\x74\x6f\x6b\x65\x6e\x5f\x69\x64\x73\x94\x00\x01\x02\x03\xaa\x62\x6c\x6f\x63\x6b"
        "\x5f\x73\x69\x7a\x65\x04\x00";
    return std::vector<uint8_t>(bytes, bytes + sizeof bytes - 1);
}();

/// A TCP port of 127.0.0.1 that was free a moment ago (bound as port 0, then released).
uint16_t free_port() {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr *sa = reinterpret_cast<sockaddr *>(&a);
    if (fd < 0 || bind(fd, sa, sizeof a) != 0 || getsockname(fd, sa, &len) != 0) return 0;
    close(fd);
    return ntohs(a.sin_port);
}

/// The device blocks rank (worker, 0) holds of `req`'s prompt, by an advisory selection
/// pinned to it.
uint32_t held_by(const kvr::Partition &p, kvr::Request &req, uint64_t worker) {
    req.set_pinned_worker(worker);
    const kvr::Selection s = p.select(req);
    return s ? s->device_blocks : UINT32_MAX;
}

}  // namespace

void ingress_test() {
    kvr::Engine engine;
    kvr::Partition p = engine.create_partition("m", "ingest", kvr::PartitionOptions(kBlock));
    p.upsert_worker(kvr::Worker(1));

    // One stored block, hashed from its tokens, on rank (1, 0).
    kvr::IngestResult r = p.ingest(1, 0, "kv@0", 0, kStored0123);
    CHECK(r.decoded() && r.batches_applied == 1 && r.clears == 0);
    const std::vector<uint32_t> tokens = {0, 1, 2, 3, 9};
    kvr::Request req;
    req.set_tokens(tokens);
    CHECK_EQ(held_by(p, req, 1), 1u);

    // A duplicate applies nothing; garbage is reported, not thrown, applies nothing, and
    // clears what the stream fed (what it held is unknown).
    r = p.ingest(1, 0, "kv@0", 0, kStored0123);
    CHECK(r.decoded() && r.batches_applied == 0);
    const uint8_t garbage[] = {0x93, 0x01};
    r = p.ingest(1, 0, {}, 1, garbage);
    CHECK(!r.decoded() && r.status == KVR_ERR_DECODE && r.decode_errors == 1 && r.clears == 1);
    CHECK_THROWS(KVR_ERR_NULL, p.ingest(1, 0, {}, 2, Span<const uint8_t>(nullptr, 3)));
    CHECK_EQ(held_by(p, req, 1), 0u);

    // Counters of the one stream, the decode error by name.
    std::vector<kvr_stream_stats> stats;
    CHECK_EQ(p.ingress_stats(stats), 1u);
    CHECK(stats.size() == 1 && stats[0].worker_id == 1 && stats[0].stream == 0);
    CHECK_EQ(stats[0].messages, 3u);  // the NULL payload was refused before counting
    CHECK_EQ(stats[0].duplicates, 1u);
    uint64_t decode_total = 0;
    for (uint32_t i = 0; i < KVR_DECODE_ERROR_KINDS; ++i) {
        if (stats[0].decode_errors[i] == 0) continue;
        decode_total += stats[0].decode_errors[i];
        CHECK(!kvr::decode_error_name(i).empty());
    }
    CHECK_EQ(decode_total, 1u);
    CHECK_EQ(p.ingress_stats().size(), 1u);
    CHECK_EQ(kvr::decode_error_name(0), std::string_view("truncated"));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, kvr::decode_error_name(KVR_DECODE_ERROR_KINDS));

    // Subscribe options: each mode refuses the other's settings.
    kvr::SubscribeOptions conn = kvr::SubscribeOptions::connect("tcp://127.0.0.1:9", 7, 1);
    conn.set_topic("kv").set_replay_endpoint("tcp://127.0.0.1:10").set_replay_endpoint({});
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, conn.add_route("t", 1));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, conn.set_max_unrouted_topics(8));
    const uint16_t port = free_port();
    CHECK(port != 0);
    kvr::SubscribeOptions bound = kvr::SubscribeOptions::bind("tcp://127.0.0.1:" + std::to_string(port));
    bound.add_route("kv-a", 2, 0).add_route("kv-b", 3, 1, "tcp://127.0.0.1:11");
    bound.set_max_unrouted_topics(16);
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, bound.set_topic("kv"));
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, bound.set_replay_endpoint("tcp://127.0.0.1:10"));

    // A subscription runs until stopped (idempotent); destroying a running one stops it.
    kvr::Subscription sub = p.subscribe(bound);
    CHECK(sub && sub.running());
    sub.stop();
    CHECK(!sub.running());
    sub.stop();
    {
        kvr::Subscription again = p.subscribe(bound);  // the port is free again after stop()
        CHECK(again.running());
    }
    kvr::Subscription c = p.subscribe(conn);  // unreachable is not an error: kvr keeps trying
    CHECK(c.running());
    c.stop();

    // Bad endpoints, an empty handle, a partition that applies no engine events.
    CHECK_THROWS(KVR_ERR_INVALID_ARGUMENT, p.subscribe(kvr::SubscribeOptions::bind("not-a-url")));
    kvr::SubscribeOptions moved = std::move(conn);
    CHECK_THROWS(KVR_ERR_NULL, p.subscribe(conn));
    CHECK_THROWS(KVR_ERR_NULL, conn.set_topic("x"));
    kvr::Partition off = engine.create_partition("m", "no-events", kvr::PartitionOptions(kBlock).set_use_kv_events(false));
    CHECK_THROWS(KVR_ERR_INVALID_CONFIG, off.subscribe(moved));
    kvr::Subscription empty;
    CHECK(!empty);
    CHECK_THROWS(KVR_ERR_NULL, empty.running());
}

void extras_test() {
    kvr::Engine engine;
    kvr::Partition p = engine.create_partition(
        "m", "extras", kvr::PartitionOptions(kBlock).set_trust_stale_overlap(true).set_trust_stale_overlap(false));
    p.upsert_worker(kvr::Worker(1));
    CHECK(p.ingest(1, 0, {}, 0, kStored0123).batches_applied == 1);  // block [0,1,2,3], no keys
    const std::vector<uint32_t> tokens = {0, 1, 2, 3, 9};
    kvr::Request req;
    req.set_tokens(tokens);
    CHECK_EQ(held_by(p, req, 1), 1u);

    // Each extra key makes block 0 another block than the engine published without one.
    req.set_cache_salt("tenant-a");
    CHECK_EQ(held_by(p, req, 1), 0u);
    req.set_cache_salt({});
    CHECK_EQ(held_by(p, req, 1), 1u);
    req.add_mm_input("image-1", 0, 2);
    CHECK_EQ(held_by(p, req, 1), 0u);
    req.reset().set_tokens(tokens);
    CHECK_EQ(held_by(p, req, 1), 1u);
    req.add_block_key(0, 0xfeed);
    CHECK_EQ(held_by(p, req, 1), 0u);
    req.reset().set_tokens(tokens);
    req.add_block_key(1, 0xfeed);  // a block past the prompt's complete ones: no effect
    CHECK_EQ(held_by(p, req, 1), 1u);

    // Bounds: KVR_MAX_MM_INPUTS inputs at most.
    kvr::Request many;
    for (uint32_t i = 0; i < KVR_MAX_MM_INPUTS; ++i) many.add_mm_input("x", i, 1);
    CHECK_THROWS(KVR_ERR_TOO_LARGE, many.add_mm_input("x", 0, 1));

    // Output blocks set idempotently: a retried or late total adds nothing.
    req.reset().set_tokens(tokens);
    const kvr::Selection s = p.select_and_reserve(req);
    CHECK(s.selected());
    CHECK_EQ(engine.set_output_blocks(s->selection_id, 3), 3u);
    CHECK_EQ(engine.set_output_blocks(s->selection_id, 3), 0u);
    CHECK_EQ(engine.set_output_blocks(s->selection_id, 2), 0u);
    CHECK_EQ(engine.set_output_blocks(s->selection_id, 5), 2u);
    engine.free_booking(s->selection_id);
}

void hint_names_test() {
    constexpr uint32_t block = 16;
    kvr::Engine engine;
    kvr::Partition p = engine.create_partition("m", "hint-names", kvr::PartitionOptions(block).set_kv_hints(4, 4096));
    p.upsert_worker(kvr::Worker(1).set_role(kvr::Role::Decode));
    p.upsert_worker(kvr::Worker(2).set_role(kvr::Role::Prefill).set_control_endpoint(0, "tcp://peer:7000"));
    std::vector<uint32_t> tokens(12 * block);
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i * 7 + 1);
    const kvr::BlockHashes h = p.hash_tokens(tokens);
    // Worker 1 holds 2 blocks, worker 2 all 12, each under its own engine hashes.
    for (uint64_t w : {1u, 2u}) {
        std::vector<kvr::StoredBlock> blocks;
        for (std::size_t i = 0; i < (w == 1 ? 2u : 12u); ++i) blocks.push_back({1000 * w + i, h.local[i]});
        CHECK(p.apply_event(w, 0, kvr::stored_event(blocks)).all_applied());
    }
    kvr::Request req;
    req.set_tokens(tokens).set_pinned_worker(1);
    std::vector<uint64_t> names(4, 0);
    req.set_hint_names_buffer(names);
    kvr::Selection s = p.select_and_reserve(req);
    CHECK(s && s.hint);
    if (s.hint) {
        CHECK_EQ(s.hint->block_start, 2u);
        CHECK_EQ(s.hint->block_end, 12u);
        CHECK_EQ(s.hint->n_block_hashes, 4u);  // as many as fit
        CHECK(names == (std::vector<uint64_t>{2002, 2003, 2004, 2005}));
    }
    engine.free_booking(s->selection_id);
    req.set_hint_names_buffer({});
    s = p.select_and_reserve(req);
    CHECK(s && s.hint && s.hint->n_block_hashes == 0);
    engine.free_booking(s->selection_id);
}
