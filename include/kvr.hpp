/*
 * kvr.hpp: a header-only C++17 wrapper over kvr.h (namespace kvr).
 *
 * Error model: EXCEPTIONS. Every C call whose status is not KVR_OK throws kvr::Error
 * (a std::runtime_error) carrying the kvr_status (Error::status()) and the message of
 * kvr_status_str(), prefixed with the C function that failed. The exceptions to the
 * rule are outcomes a correct caller meets in normal operation:
 *   - KVR_BUSY and KVR_NO_WORKER from select / select_and_reserve are returned as a
 *     kvr::Selection (outcome Selected, Busy or NoWorker, plus the kvr_decision);
 *   - KVR_BUFFER_TOO_SMALL never reaches the caller: lookups and hashing write into a
 *     caller std::vector, growing it and retrying;
 *   - a batch of KV events of which the index refused some (KVR_ERR_PARENT_NOT_FOUND,
 *     KVR_ERR_TOO_MANY_RANKS: the other events were applied) is returned as an
 *     ApplyResult with `refusal` set, so the counts are not lost; a malformed batch
 *     (nothing applied) throws.
 * KVR_ERR_INVALID_CONFIG from Engine::create_partition (options that contradict each
 * other) carries kvr_partition_options_check's reason in what() and Error::reason();
 * PartitionOptions::check() throws the same before anything is created, and otherwise
 * returns kvr's notices about the options.
 * Using an empty (moved-from) handle throws kvr::Error with KVR_ERR_NULL; destroying it
 * is a no-op. ABI: Engine's constructors call check_abi() (AbiMismatch, a
 * std::runtime_error, if the linked library is of another generation) and so reference
 * kvr_abi_2, which makes linking against a library of another generation fail.
 *
 * Ownership: Engine, EngineOptions, Partition, PartitionOptions, Worker and Request own
 * one C handle each; they are move-only and free it in their destructors. A Partition
 * keeps its engine alive (the C rule), so they may be destroyed in any order. get()
 * lends the C handle, release() gives it up, X::adopt(ptr) takes one over.
 *
 * Threads (the C rule): member functions marked `const` wrap functions taking a
 * `const kvr_x *` and may be called on one object from many threads at once; non-const
 * ones (option and worker setters, Request setters) need the object exclusively.
 *
 * Borrowing: Request::set_tokens and Request::set_local_hashes BORROW the array (kvr
 * does not copy the prompt): it must stay valid and unchanged until the request is
 * reset, given another prompt, or destroyed, and during every selection using it.
 * Overloads taking temporaries (rvalue vectors/arrays, braced lists) are deleted to
 * catch the obvious dangling cases. kvr_event values built by stored_event() /
 * removed_event() borrow their arrays too, until apply_events returns.
 *
 * Spans: C++17 has no std::span, so kvr::Span<T> is a (pointer, size) view
 * constructible from std::vector, std::array, C arrays, any contiguous container with
 * data()/size() (temporaries only for Span<const T>), or (pointer, length). It has no
 * std::initializer_list constructor on purpose (a view of a braced list dangles at the
 * end of the full expression); set_allowed_workers also takes a braced list (copied).
 * Strings are std::string_view (UTF-8, not NUL-terminated).
 *
 * Hooks: kvr::Hooks holds std::function members; Partition::set_hooks moves them to a
 * heap-allocated box passed to kvr as user_data, whose kvr `release` callback runs
 * Hooks::on_release (if set) and deletes the box, exactly once. The bridges are
 * noexcept and catch every exception (reported to Hooks::on_error if set) and answer
 * as if that hook were absent: no estimate, not overloaded, available, shared-cache
 * lookup failed, LoRA filter failed. Hooks are called from any selecting thread,
 * concurrently, with no kvr lock held: the std::function targets must be thread-safe.
 *
 * Decisions (kvr::Decision = kvr_decision) carry KVR_DECISION_* flags: session_route()
 * says how session affinity steered the choice; with transfer hints on, a booked
 * selection's hint is copied into Selection::hint (endpoint as a std::string, so a hinted
 * booking with an endpoint longer than the string's small buffer allocates).
 *
 * Everything here is inline: the header may be included from any number of
 * translation units of one program.
 */

#ifndef KVR_HPP
#define KVR_HPP

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvr.h"

namespace kvr {

// ---------------------------------------------------------------------------------------
// Versions, statuses, errors
// ---------------------------------------------------------------------------------------

inline constexpr uint32_t version_major = KVR_VERSION_MAJOR;
inline constexpr uint32_t version_minor = KVR_VERSION_MINOR;
inline constexpr uint32_t version_patch = KVR_VERSION_PATCH;
/// The ABI generation this header was generated for.
inline constexpr uint32_t header_abi_version = KVR_ABI_VERSION;

/// The static message kvr has for `status` (never NULL).
inline const char *status_str(kvr_status status) noexcept { return kvr_status_str(status); }

/// How many C calls in this process returned `status` (KVR_OK reads 0).
inline uint64_t status_count(kvr_status status) noexcept { return kvr_status_count(status); }

/// The ABI generation of the linked library.
inline uint32_t abi_version() noexcept { return kvr_abi_version(); }

/// The library's ABI-generation symbol, read through a volatile so that the reference
/// (and so the link-time check of KVR_ABI_CHECK) cannot be optimised away.
inline uint32_t linked_abi_symbol() noexcept {
    return *static_cast<const volatile uint32_t *>(&kvr_abi_2);
}

/// Whether the linked library is of this header's ABI generation.
inline bool abi_compatible() noexcept {
    return abi_version() == KVR_ABI_VERSION && linked_abi_symbol() == KVR_ABI_VERSION;
}

/// Thrown by check_abi() when the linked library is of another ABI generation.
class AbiMismatch : public std::runtime_error {
public:
    explicit AbiMismatch(uint32_t library)
        : std::runtime_error("kvr: linked library has ABI generation " +
                             std::to_string(library) + ", this header " +
                             std::to_string(KVR_ABI_VERSION)),
          library_(library) {}
    uint32_t library_abi() const noexcept { return library_; }

private:
    uint32_t library_;
};

/// Throws AbiMismatch unless abi_compatible().
inline void check_abi() {
    if (!abi_compatible()) throw AbiMismatch(abi_version());
}

/// A failed kvr call: its status and kvr_status_str's message, and kvr's explanation
/// when the call has one (KVR_ERR_INVALID_CONFIG: kvr_partition_options_check's reason).
class Error : public std::runtime_error {
public:
    explicit Error(kvr_status status, const char *function = nullptr)
        : std::runtime_error(message(status, function, {})), status_(status) {}
    /// With an explanation: appended to what() after ": ", and kept in reason().
    Error(kvr_status status, const char *function, std::string_view reason)
        : std::runtime_error(message(status, function, reason)),
          status_(status),
          reason_(reason.empty() ? nullptr : std::make_shared<const std::string>(reason)) {}

    kvr_status status() const noexcept { return status_; }
    /// kvr's explanation of the failure, or empty if the call gave none.
    std::string_view reason() const noexcept {
        return reason_ ? std::string_view(*reason_) : std::string_view();
    }

private:
    static std::string message(kvr_status status, const char *function, std::string_view reason) {
        std::string m = "kvr: ";
        if (function != nullptr) {
            m += function;
            m += ": ";
        }
        m += kvr_status_str(status);
        m += " (status ";
        m += std::to_string(status);
        m += ")";
        if (!reason.empty()) {
            m += ": ";
            m += reason;
        }
        return m;
    }

    kvr_status status_;
    // Shared, so that copying the exception cannot throw.
    std::shared_ptr<const std::string> reason_;
};

namespace detail {
inline void check(kvr_status status, const char *function) {
    if (status != KVR_OK) throw Error(status, function);
}
[[noreturn]] inline void throw_null(const char *function) { throw Error(KVR_ERR_NULL, function); }
}  // namespace detail

// ---------------------------------------------------------------------------------------
// Span
// ---------------------------------------------------------------------------------------

/// A minimal non-owning (pointer, size) view (C++17 has no std::span).
template <class T>
class Span {
    template <class C>
    using elem_of = std::remove_pointer_t<decltype(std::data(std::declval<C &>()))>;

public:
    using element_type = T;
    using value_type = std::remove_cv_t<T>;
    using pointer = T *;
    using iterator = T *;

    constexpr Span() noexcept = default;
    constexpr Span(T *data, std::size_t size) noexcept : data_(data), size_(size) {}

    /// Any contiguous container or array with std::data/std::size whose elements convert
    /// to T (qualification conversions only). Temporaries only for Span<const T>.
    template <class C,
              class E = elem_of<std::remove_reference_t<C>>,
              std::enable_if_t<std::is_convertible<E (*)[], T (*)[]>::value &&
                                   (std::is_lvalue_reference<C>::value || std::is_const<T>::value),
                               int> = 0>
    constexpr Span(C &&c) noexcept
        : data_(std::data(c)), size_(static_cast<std::size_t>(std::size(c))) {}

    constexpr T *data() const noexcept { return data_; }
    constexpr std::size_t size() const noexcept { return size_; }
    constexpr bool empty() const noexcept { return size_ == 0; }
    constexpr T *begin() const noexcept { return data_; }
    constexpr T *end() const noexcept { return data_ + size_; }
    constexpr T &operator[](std::size_t i) const noexcept { return data_[i]; }
    constexpr Span subspan(std::size_t offset, std::size_t count) const noexcept {
        return Span(data_ + offset, count);
    }

private:
    T *data_ = nullptr;
    std::size_t size_ = 0;
};

// ---------------------------------------------------------------------------------------
// Plain values
// ---------------------------------------------------------------------------------------

using Decision = kvr_decision;
using Overlap = kvr_overlap;
using RankLoad = kvr_rank_load;
using StoredBlock = kvr_stored_block;
using Event = kvr_event;
using BlockRange = kvr_block_range;
using IndexStats = kvr_index_stats;
using SelectionStats = kvr_selection_stats;
using BookingStats = kvr_booking_stats;
using ActiveLoad = kvr_active_load;
using IndexerStats = kvr_indexer_stats;
using SessionStats = kvr_session_stats;
using StreamStats = kvr_stream_stats;
using StateRestored = kvr_state_restored;
using StateStats = kvr_state_stats;

enum class Tier : uint32_t {
    Device = KVR_TIER_DEVICE,
    Host = KVR_TIER_HOST,
    Disk = KVR_TIER_DISK,
};

enum class Role : uint32_t {
    Aggregated = KVR_ROLE_AGGREGATED,
    Prefill = KVR_ROLE_PREFILL,
    Decode = KVR_ROLE_DECODE,
};

/// A role mask's bit for `role` (KVR_ROLE_MASK_*).
inline constexpr uint32_t role_bit(Role role) noexcept {
    return uint32_t{1} << static_cast<uint32_t>(role);
}
/// The mask of `roles` (for PartitionOptions::set_kv_hints).
inline constexpr uint32_t role_mask(std::initializer_list<Role> roles) noexcept {
    uint32_t m = 0;
    for (Role r : roles) m |= role_bit(r);
    return m;
}
/// Dynamo's transfer sources: prefill and aggregated ranks.
inline constexpr uint32_t default_hint_source_roles =
    static_cast<uint32_t>(KVR_ROLE_MASK_PREFILL | KVR_ROLE_MASK_AGGREGATED);

/// Which index answers a partition's overlap (KVR_INDEXER_*; IndexerStats::policy).
enum class IndexerPolicy : uint32_t {
    EventDriven = KVR_INDEXER_EVENT_DRIVEN,
    EventDrivenWithPrediction = KVR_INDEXER_EVENT_DRIVEN_WITH_PREDICTION,
    ApproximatePrimary = KVR_INDEXER_APPROXIMATE_PRIMARY,
    RemotePrimary = KVR_INDEXER_REMOTE_PRIMARY,
};

/// The policy an IndexerStats reports.
inline IndexerPolicy policy_of(const kvr_indexer_stats &stats) noexcept {
    return static_cast<IndexerPolicy>(stats.policy);
}

/// How the approximate index forgets (KVR_RETENTION_*).
enum class Retention : uint32_t {
    Ttl = KVR_RETENTION_TTL,
    /// Accepted; falls back to Ttl for now (PartitionOptions::check() says so).
    CapacityBounded = KVR_RETENTION_CAPACITY_BOUNDED,
};

/// Which cost a partition's selections minimise (KVR_COST_MODEL_*).
enum class CostModel : uint32_t {
    /// Predicted time to first token in ms, decode load as a tie-break (the default).
    Latency = KVR_COST_MODEL_LATENCY,
    /// Dynamo's default scorer in block equivalents, term for term.
    Dynamo = KVR_COST_MODEL_DYNAMO,
};

/// A partition's learned prefill rate (Partition::prefill_rate()).
struct PrefillRate {
    /// Tokens/s per rank; empty until a few prefill completions were observed.
    std::optional<double> tokens_per_s;
    /// Prefill completions observed so far.
    uint64_t observations = 0;
};

/// A partition's learned decode drag (Partition::decode_drag()).
struct DecodeDrag {
    /// Seconds of time to first token per decode block a rank holds; empty until enough
    /// prefill completions were observed on ranks of different decode loads.
    std::optional<double> seconds_per_block;
    /// Prefill completions observed so far.
    uint64_t observations = 0;
};

/// Session affinity mode (KVR_AFFINITY_*).
enum class Affinity : uint32_t {
    Off = KVR_AFFINITY_OFF,
    Hard = KVR_AFFINITY_HARD,
    Soft = KVR_AFFINITY_SOFT,
};

/// kvr_decision.flags bits (KVR_DECISION_*).
inline constexpr uint32_t decision_kv_hint = static_cast<uint32_t>(KVR_DECISION_KV_HINT);
inline constexpr uint32_t decision_session_unbound = static_cast<uint32_t>(KVR_DECISION_SESSION_UNBOUND);
inline constexpr uint32_t decision_session_pinned = static_cast<uint32_t>(KVR_DECISION_SESSION_PINNED);
inline constexpr uint32_t decision_session_preferred =
    static_cast<uint32_t>(KVR_DECISION_SESSION_PREFERRED);
inline constexpr uint32_t decision_session_rebound = static_cast<uint32_t>(KVR_DECISION_SESSION_REBOUND);
/// Every KVR_DECISION_SESSION_* bit (a decision has at most one).
inline constexpr uint32_t decision_session_mask = decision_session_unbound | decision_session_pinned |
                                                  decision_session_preferred | decision_session_rebound;

/// How session affinity steered a decision (its KVR_DECISION_SESSION_* bit; None: no
/// session on the request, or no affinity on the partition).
enum class SessionRoute : uint32_t {
    None = 0,
    /// The session had no binding: chosen by cost (a booking binds it).
    Unbound = decision_session_unbound,
    /// Hard affinity: sent to the session's bound rank.
    Pinned = decision_session_pinned,
    /// Soft affinity: chosen by cost with the session's rank preferred (it may not win).
    Preferred = decision_session_preferred,
    /// The bound rank could not take the turn: chosen by cost; a booking rebinds it.
    Rebound = decision_session_rebound,
};

/// The session route of a decision.
inline SessionRoute session_route(const kvr_decision &d) noexcept {
    return static_cast<SessionRoute>(d.flags & decision_session_mask);
}

/// Whether a transfer hint came with the decision's booking.
inline bool has_kv_hint(const kvr_decision &d) noexcept { return (d.flags & decision_kv_hint) != 0; }

/// A transfer hint (kvr_kv_hint, with the endpoint as a std::string): the chosen rank may
/// pull prompt blocks [block_start, block_end) from rank (source_worker_id,
/// source_dp_rank) through `endpoint` instead of computing them.
struct KvHint {
    uint64_t source_worker_id = 0;
    uint32_t source_dp_rank = 0;
    uint32_t block_start = 0;
    uint32_t block_end = 0;
    /// How many of the source engine's own hashes of the hinted blocks were written to
    /// the request's hint-names buffer (Request::set_hint_names_buffer; 0 without one).
    uint32_t n_block_hashes = 0;
    /// The source rank's control endpoint (UTF-8).
    std::string endpoint;

    /// Blocks the hint covers.
    uint32_t blocks() const noexcept { return block_end - block_start; }

    /// Copies a C hint (its endpoint: control_endpoint_len bytes, at most
    /// KVR_CONTROL_ENDPOINT_MAX_LEN).
    static KvHint of(const kvr_kv_hint &h) {
        KvHint out;
        out.source_worker_id = h.source_worker_id;
        out.source_dp_rank = h.source_dp_rank;
        out.block_start = h.block_start;
        out.block_end = h.block_end;
        out.n_block_hashes = h.n_block_hashes;
        const std::size_t n =
            std::min<std::size_t>(h.control_endpoint_len, std::size_t{KVR_CONTROL_ENDPOINT_MAX_LEN});
        out.endpoint.assign(h.control_endpoint, n);
        return out;
    }
};

/// How free_booking found the booking (KVR_FREED_*).
enum class FreedBy : uint32_t {
    Now = KVR_FREED_NOW,
    ByCaller = KVR_FREED_BY_CALLER,
    Expired = KVR_FREED_EXPIRED,
    RankRemoved = KVR_FREED_RANK_REMOVED,
};

/// The outcome of a selection: KVR_OK, KVR_BUSY or KVR_NO_WORKER.
enum class Outcome { Selected, Busy, NoWorker };

/// A selection's result: the outcome, the decision when Selected (zeros otherwise), and
/// the transfer hint booked with it (select_and_reserve only, when decision.flags has
/// KVR_DECISION_KV_HINT).
struct Selection {
    Outcome outcome = Outcome::NoWorker;
    kvr_decision decision{};
    std::optional<KvHint> hint;

    bool selected() const noexcept { return outcome == Outcome::Selected; }
    explicit operator bool() const noexcept { return selected(); }
    const kvr_decision *operator->() const noexcept { return &decision; }
    const kvr_decision &operator*() const noexcept { return decision; }
    /// The status the C call returned (KVR_OK, KVR_BUSY or KVR_NO_WORKER).
    kvr_status status() const noexcept {
        return outcome == Outcome::Selected ? KVR_OK
               : outcome == Outcome::Busy   ? KVR_BUSY
                                            : KVR_NO_WORKER;
    }
    /// The decision, or kvr::Error with KVR_BUSY / KVR_NO_WORKER.
    const kvr_decision &value() const {
        if (!selected()) throw Error(status(), "kvr::Selection::value");
        return decision;
    }
    /// decision.flags (KVR_DECISION_*).
    uint32_t flags() const noexcept { return decision.flags; }
    /// How session affinity steered the decision.
    SessionRoute session_route() const noexcept { return kvr::session_route(decision); }
};

/// What one apply_events call did. `refusal` is KVR_OK, or the first refusal
/// (KVR_ERR_PARENT_NOT_FOUND, KVR_ERR_TOO_MANY_RANKS) when the index skipped some events
/// of the batch (the others were applied; events_rejected counts the skipped).
struct ApplyResult : kvr_apply_result {
    ApplyResult() noexcept : kvr_apply_result{} {}
    kvr_status refusal = KVR_OK;
    bool all_applied() const noexcept { return refusal == KVR_OK; }
    /// Throws kvr::Error with the refusal, if any.
    void throw_if_refused() const {
        if (refusal != KVR_OK) throw Error(refusal, "kvr_partition_apply_events");
    }
};

/// Both hash outputs of a prompt: local block hashes and chained sequence hashes.
struct BlockHashes {
    std::vector<uint64_t> local;
    std::vector<uint64_t> seq;
};

/// Per-request cost overrides; unset = the partition's value (NaN in C).
struct Overrides {
    std::optional<double> overlap_score_credit;
    std::optional<double> prefill_load_scale;
    std::optional<double> temperature;
    std::optional<double> shared_cache_multiplier;
};

/// A replica peer's booking (see kvr_replica_booking); prompt_blocks is read during the
/// call only.
struct ReplicaBooking {
    uint64_t selection_id = 0;
    uint64_t worker_id = 0;
    uint32_t dp_rank = 0;
    Span<const uint64_t> prompt_blocks;
    uint64_t prefill_tokens = 0;
    uint64_t expected_output_tokens = 0;
    uint64_t ttl_ms = 0;
};

// ---------------------------------------------------------------------------------------
// KV events
// ---------------------------------------------------------------------------------------

/// A stored event: `blocks` in chain order, extending `parent` if given. Borrows
/// `blocks` (keep it alive until apply_events returns).
inline kvr_event stored_event(Span<const kvr_stored_block> blocks,
                              std::optional<uint64_t> parent = std::nullopt,
                              Tier tier = Tier::Device) noexcept {
    kvr_event e{};
    e.kind = KVR_EVENT_STORED;
    e.tier = static_cast<uint32_t>(tier);
    e.has_parent = parent.has_value() ? 1u : 0u;
    e.parent = parent.value_or(0);
    e.blocks = blocks.data();
    e.n_blocks = blocks.size();
    return e;
}

// A braced list would dangle as soon as the event outlives the full expression.
kvr_event stored_event(std::initializer_list<kvr_stored_block>, std::optional<uint64_t> = std::nullopt,
                       Tier = Tier::Device) = delete;

/// A removed event of engine block hashes. Borrows `external_hashes`.
inline kvr_event removed_event(Span<const uint64_t> external_hashes,
                               Tier tier = Tier::Device) noexcept {
    kvr_event e{};
    e.kind = KVR_EVENT_REMOVED;
    e.tier = static_cast<uint32_t>(tier);
    e.removed = external_hashes.data();
    e.n_removed = external_hashes.size();
    return e;
}

kvr_event removed_event(std::initializer_list<uint64_t>, Tier = Tier::Device) = delete;

/// The rank dropped its whole cache.
inline kvr_event cleared_event() noexcept {
    kvr_event e{};
    e.kind = KVR_EVENT_CLEARED;
    return e;
}

/// Zips engine hashes and kvr local hashes into stored blocks (appended to `out`).
inline void stored_blocks(Span<const uint64_t> external, Span<const uint64_t> local,
                          std::vector<kvr_stored_block> &out) {
    if (external.size() != local.size()) throw Error(KVR_ERR_INVALID_ARGUMENT, "kvr::stored_blocks");
    out.reserve(out.size() + external.size());
    for (std::size_t i = 0; i < external.size(); ++i) out.push_back({external[i], local[i]});
}

inline std::vector<kvr_stored_block> stored_blocks(Span<const uint64_t> external,
                                                   Span<const uint64_t> local) {
    std::vector<kvr_stored_block> out;
    stored_blocks(external, local, out);
    return out;
}

// ---------------------------------------------------------------------------------------
// Handles
// ---------------------------------------------------------------------------------------

namespace detail {
template <class T>
struct Free;
template <>
struct Free<kvr_engine> {
    void operator()(kvr_engine *p) const noexcept { kvr_engine_free(p); }
};
template <>
struct Free<kvr_engine_options> {
    void operator()(kvr_engine_options *p) const noexcept { kvr_engine_options_free(p); }
};
template <>
struct Free<kvr_partition> {
    void operator()(kvr_partition *p) const noexcept { kvr_partition_free(p); }
};
template <>
struct Free<kvr_partition_options> {
    void operator()(kvr_partition_options *p) const noexcept { kvr_partition_options_free(p); }
};
template <>
struct Free<kvr_worker> {
    void operator()(kvr_worker *p) const noexcept { kvr_worker_free(p); }
};
template <>
struct Free<kvr_request> {
    void operator()(kvr_request *p) const noexcept { kvr_request_free(p); }
};
template <>
struct Free<kvr_subscribe_options> {
    void operator()(kvr_subscribe_options *p) const noexcept { kvr_subscribe_options_free(p); }
};
template <>
struct Free<kvr_subscription> {
    void operator()(kvr_subscription *p) const noexcept { kvr_subscription_free(p); }
};

/// A move-only owner of one C handle (empty after a move; freeing empty is a no-op).
template <class T>
class Handle {
public:
    Handle(Handle &&) noexcept = default;
    Handle &operator=(Handle &&) noexcept = default;
    Handle(const Handle &) = delete;
    Handle &operator=(const Handle &) = delete;
    ~Handle() = default;

    /// The C handle (NULL if empty); still owned by this object.
    T *get() const noexcept { return p_.get(); }
    /// Gives up ownership of the C handle (the caller frees it); leaves this empty.
    T *release() noexcept { return p_.release(); }
    explicit operator bool() const noexcept { return p_ != nullptr; }

protected:
    Handle() noexcept = default;
    explicit Handle(T *owned) noexcept : p_(owned) {}
    /// The handle, or kvr::Error(KVR_ERR_NULL) if empty.
    T *live(const char *function) const {
        if (!p_) throw_null(function);
        return p_.get();
    }

    std::unique_ptr<T, Free<T>> p_;
};

/// Tag of the constructors adopting a C handle (see the classes' adopt()).
struct Adopt {};

template <class T, class F>
T *make_handle(F &&create, const char *function) {
    T *out = nullptr;
    check(create(&out), function);
    return out;
}
}  // namespace detail

class Engine;
class Partition;
class Request;

/// Engine options (kvr_engine_options).
class EngineOptions : public detail::Handle<kvr_engine_options> {
public:
    /// New options, every value at its default.
    EngineOptions()
        : Handle(detail::make_handle<kvr_engine_options>(
              [](kvr_engine_options **o) { return kvr_engine_options_new(o); },
              "kvr_engine_options_new")) {}
    /// Takes ownership of a C handle (NULL = an empty object).
    static EngineOptions adopt(kvr_engine_options *owned) noexcept { return EngineOptions(detail::Adopt{}, owned); }
    EngineOptions(detail::Adopt, kvr_engine_options *owned) noexcept : Handle(owned) {}

    /// Seeds the engine's random tie-breaks (reproducible runs).
    EngineOptions &set_seed(uint64_t seed) {
        detail::check(kvr_engine_options_set_seed(live("kvr_engine_options_set_seed"), seed),
                      "kvr_engine_options_set_seed");
        return *this;
    }
};

/// Partition options (kvr_partition_options): block size plus optional knobs.
class PartitionOptions : public detail::Handle<kvr_partition_options> {
public:
    /// New options for blocks of `block_size` tokens (≥ 1).
    explicit PartitionOptions(uint32_t block_size)
        : Handle(detail::make_handle<kvr_partition_options>(
              [block_size](kvr_partition_options **o) {
                  return kvr_partition_options_new(block_size, o);
              },
              "kvr_partition_options_new")) {}
    /// Takes ownership of a C handle (NULL = an empty object).
    static PartitionOptions adopt(kvr_partition_options *owned) noexcept { return PartitionOptions(detail::Adopt{}, owned); }
    PartitionOptions(detail::Adopt, kvr_partition_options *owned) noexcept : Handle(owned) {}

    /// Keeps each partition created with these options in a directory of its own under
    /// `dir` (restored at creation, journaled after) for a warm restart; `io` is
    /// KVR_STATE_IO_AUTO, _URING or _PLAIN. An empty `dir` turns it off.
    PartitionOptions &set_state_dir(std::string_view dir, kvr_state_io io = KVR_STATE_IO_AUTO) {
        const char *fn = "kvr_partition_options_set_state_dir";
        detail::check(kvr_partition_options_set_state_dir(live(fn), dir.data(), dir.size(), io), fn);
        return *this;
    }
    PartitionOptions &set_cache_namespace(std::string_view ns) {
        const char *fn = "kvr_partition_options_set_cache_namespace";
        detail::check(kvr_partition_options_set_cache_namespace(live(fn), ns.data(), ns.size()), fn);
        return *this;
    }
    PartitionOptions &set_booking_ttl_ms(uint64_t ttl_ms) {
        const char *fn = "kvr_partition_options_set_booking_ttl_ms";
        detail::check(kvr_partition_options_set_booking_ttl_ms(live(fn), ttl_ms), fn);
        return *this;
    }
    PartitionOptions &set_overlap_score_credit(double v) {
        const char *fn = "kvr_partition_options_set_overlap_score_credit";
        detail::check(kvr_partition_options_set_overlap_score_credit(live(fn), v), fn);
        return *this;
    }
    PartitionOptions &set_prefill_load_scale(double v) {
        const char *fn = "kvr_partition_options_set_prefill_load_scale";
        detail::check(kvr_partition_options_set_prefill_load_scale(live(fn), v), fn);
        return *this;
    }
    PartitionOptions &set_host_cache_hit_weight(double v) {
        const char *fn = "kvr_partition_options_set_host_cache_hit_weight";
        detail::check(kvr_partition_options_set_host_cache_hit_weight(live(fn), v), fn);
        return *this;
    }
    PartitionOptions &set_disk_cache_hit_weight(double v) {
        const char *fn = "kvr_partition_options_set_disk_cache_hit_weight";
        detail::check(kvr_partition_options_set_disk_cache_hit_weight(live(fn), v), fn);
        return *this;
    }
    PartitionOptions &set_shared_cache_multiplier(double v) {
        const char *fn = "kvr_partition_options_set_shared_cache_multiplier";
        detail::check(kvr_partition_options_set_shared_cache_multiplier(live(fn), v), fn);
        return *this;
    }
    PartitionOptions &set_temperature(double v) {
        const char *fn = "kvr_partition_options_set_temperature";
        detail::check(kvr_partition_options_set_temperature(live(fn), v), fn);
        return *this;
    }
    PartitionOptions &set_decode_active_request_weight(double v) {
        const char *fn = "kvr_partition_options_set_decode_active_request_weight";
        detail::check(kvr_partition_options_set_decode_active_request_weight(live(fn), v), fn);
        return *this;
    }
    PartitionOptions &set_credit_decay(double v) {
        const char *fn = "kvr_partition_options_set_credit_decay";
        detail::check(kvr_partition_options_set_credit_decay(live(fn), v), fn);
        return *this;
    }
    PartitionOptions &set_busy_decode_blocks_fraction(double v) {
        const char *fn = "kvr_partition_options_set_busy_decode_blocks_fraction";
        detail::check(kvr_partition_options_set_busy_decode_blocks_fraction(live(fn), v), fn);
        return *this;
    }
    PartitionOptions &set_busy_prefill_tokens_fraction(double v) {
        const char *fn = "kvr_partition_options_set_busy_prefill_tokens_fraction";
        detail::check(kvr_partition_options_set_busy_prefill_tokens_fraction(live(fn), v), fn);
        return *this;
    }
    PartitionOptions &set_busy_prefill_tokens(uint64_t tokens) {
        const char *fn = "kvr_partition_options_set_busy_prefill_tokens";
        detail::check(kvr_partition_options_set_busy_prefill_tokens(live(fn), tokens), fn);
        return *this;
    }

    // -- cost model (kvr_partition_options_set_cost_model) and the latency model's knobs --
    // Each setter throws (KVR_ERR_INVALID_ARGUMENT) for what PartitionConfig::validate
    // refuses, and a refused value changes nothing.

    /// Which cost the selections minimise (default CostModel::Latency).
    PartitionOptions &set_cost_model(CostModel model) {
        const char *fn = "kvr_partition_options_set_cost_model";
        detail::check(kvr_partition_options_set_cost_model(live(fn), static_cast<uint32_t>(model)), fn);
        return *this;
    }
    /// Prefill tokens/s of one rank before any is learned (default 10,000; > 0).
    PartitionOptions &set_prefill_rate_prior(double tokens_per_s) {
        const char *fn = "kvr_partition_options_set_prefill_rate_prior";
        detail::check(kvr_partition_options_set_prefill_rate_prior(live(fn), tokens_per_s), fn);
        return *this;
    }
    /// Whether the prefill rate is learned from mark_prefill_complete timings (default true).
    PartitionOptions &set_learn_prefill_rate(bool on) {
        const char *fn = "kvr_partition_options_set_learn_prefill_rate";
        detail::check(kvr_partition_options_set_learn_prefill_rate(live(fn), on ? 1u : 0u), fn);
        return *this;
    }
    /// Fixed cost of one prefill, ms (default 5; ≥ 0).
    PartitionOptions &set_request_overhead_ms(double ms) {
        const char *fn = "kvr_partition_options_set_request_overhead_ms";
        detail::check(kvr_partition_options_set_request_overhead_ms(live(fn), ms), fn);
        return *this;
    }
    /// KV-use share above which pressure is charged (default 0.9; in [0, 1]).
    PartitionOptions &set_kv_pressure_threshold(double share) {
        const char *fn = "kvr_partition_options_set_kv_pressure_threshold";
        detail::check(kvr_partition_options_set_kv_pressure_threshold(live(fn), share), fn);
        return *this;
    }
    /// The pressure charge at full KV memory, ms (default 1,000; ≥ 0).
    PartitionOptions &set_kv_pressure_ms(double ms) {
        const char *fn = "kvr_partition_options_set_kv_pressure_ms";
        detail::check(kvr_partition_options_set_kv_pressure_ms(live(fn), ms), fn);
        return *this;
    }
    /// A per-token latency target, ms (> 0); 0 clears it (the default: none).
    PartitionOptions &set_itl_target_ms(double ms) {
        const char *fn = "kvr_partition_options_set_itl_target_ms";
        detail::check(kvr_partition_options_set_itl_target_ms(live(fn), ms), fn);
        return *this;
    }
    /// Predicted per-token latency of a lone request, ms (default 20; ≥ 0).
    PartitionOptions &set_itl_base_ms(double ms) {
        const char *fn = "kvr_partition_options_set_itl_base_ms";
        detail::check(kvr_partition_options_set_itl_base_ms(live(fn), ms), fn);
        return *this;
    }
    /// Extra per-token latency per running request, ms (default 0.2; ≥ 0).
    PartitionOptions &set_itl_per_request_ms(double ms) {
        const char *fn = "kvr_partition_options_set_itl_per_request_ms";
        detail::check(kvr_partition_options_set_itl_per_request_ms(live(fn), ms), fn);
        return *this;
    }
    /// Weight of the queue externality (default 2; 0 = off; ≥ 0).
    PartitionOptions &set_queue_externality(double weight) {
        const char *fn = "kvr_partition_options_set_queue_externality";
        detail::check(kvr_partition_options_set_queue_externality(live(fn), weight), fn);
        return *this;
    }
    /// Tie-break: µs per decode block held after the booking (default 1; ≥ 0).
    PartitionOptions &set_decode_block_us(double us) {
        const char *fn = "kvr_partition_options_set_decode_block_us";
        detail::check(kvr_partition_options_set_decode_block_us(live(fn), us), fn);
        return *this;
    }

    // -- indexer policy (the policy follows from these; check() validates them) ----------

    /// Whether the engines' KV events feed the index (default true). false: the index is
    /// approximate, fed by bookings (Retention and set_approx_index).
    PartitionOptions &set_use_kv_events(bool on) {
        const char *fn = "kvr_partition_options_set_use_kv_events";
        detail::check(kvr_partition_options_set_use_kv_events(live(fn), on ? 1u : 0u), fn);
        return *this;
    }
    /// With events on: also record bookings into a side index kept `ttl_ms` (0 = none,
    /// the default).
    PartitionOptions &set_prediction_ttl_ms(uint64_t ttl_ms) {
        const char *fn = "kvr_partition_options_set_prediction_ttl_ms";
        detail::check(kvr_partition_options_set_prediction_ttl_ms(live(fn), ttl_ms), fn);
        return *this;
    }
    /// A remote index service as the primary (copied; empty = none). Needs KV events on
    /// (else creating the partition fails with KVR_ERR_INVALID_CONFIG). Timeouts 0 = the
    /// defaults (50 ms to connect, 200 ms in all).
    PartitionOptions &set_remote_indexer(std::string_view url, uint64_t connect_timeout_ms = 0,
                                         uint64_t request_timeout_ms = 0) {
        const char *fn = "kvr_partition_options_set_remote_indexer";
        detail::check(kvr_partition_options_set_remote_indexer(live(fn), url.data(), url.size(),
                                                               connect_timeout_ms, request_timeout_ms),
                      fn);
        return *this;
    }
    /// The approximate index's TTL after a record's last booking and its size bound in
    /// (rank, block) records (both ≥ 1; defaults 120,000 ms and 2^20).
    PartitionOptions &set_approx_index(uint64_t ttl_ms, uint64_t max_blocks) {
        const char *fn = "kvr_partition_options_set_approx_index";
        detail::check(kvr_partition_options_set_approx_index(live(fn), ttl_ms, max_blocks), fn);
        return *this;
    }
    /// Whether selection credits a stale rank's overlap (a stream whose loss is being
    /// replayed, or degraded or dead; kvr_stream_stats.stale_since_unix_ms, health);
    /// default false: it counts as none.
    PartitionOptions &set_trust_stale_overlap(bool on) {
        const char *fn = "kvr_partition_options_set_trust_stale_overlap";
        detail::check(kvr_partition_options_set_trust_stale_overlap(live(fn), on ? 1u : 0u), fn);
        return *this;
    }
    PartitionOptions &set_approx_retention(Retention retention) {
        const char *fn = "kvr_partition_options_set_approx_retention";
        detail::check(
            kvr_partition_options_set_approx_retention(live(fn), static_cast<uint32_t>(retention)), fn);
        return *this;
    }

    // -- transfer hints and session affinity ----------------------------------------------

    /// Transfer hints on booked selections (see Selection::hint): from a rank of a role in
    /// `source_roles` (a role_mask(), not 0) with a control endpoint, holding a device
    /// prefix at least `min_advantage_blocks` longer than the chosen rank's; at most
    /// `max_transfer_blocks` blocks (0 = hints off, the default).
    PartitionOptions &set_kv_hints(uint32_t min_advantage_blocks, uint32_t max_transfer_blocks,
                                   uint32_t source_roles = default_hint_source_roles) {
        const char *fn = "kvr_partition_options_set_kv_hints";
        detail::check(kvr_partition_options_set_kv_hints(live(fn), min_advantage_blocks,
                                                         max_transfer_blocks, source_roles),
                      fn);
        return *this;
    }
    /// Session affinity (requests carry their session with Request::set_session; how it
    /// steered comes back as Selection::session_route()). `soft_penalty_blocks` (finite,
    /// ≥ 0) is for Soft only; `max_entries` 0 = 65,536; `idle_ttl_ms` 0 = 600,000.
    PartitionOptions &set_session_affinity(Affinity mode, double soft_penalty_blocks = 0.0,
                                           uint64_t max_entries = 0, uint64_t idle_ttl_ms = 0) {
        const char *fn = "kvr_partition_options_set_session_affinity";
        detail::check(kvr_partition_options_set_session_affinity(live(fn), static_cast<uint32_t>(mode),
                                                                 soft_penalty_blocks, max_entries,
                                                                 idle_ttl_ms),
                      fn);
        return *this;
    }

    /// Checks the options as Engine::create_partition would, creating nothing. Returns
    /// kvr's notices about them joined by "; " (empty if none, e.g. capacity-bounded
    /// retention falling back to TTL); throws kvr::Error KVR_ERR_INVALID_CONFIG with the
    /// reason (Error::reason(), also in what()) if no partition can be made from them.
    std::string check() const {
        const char *fn = "kvr_partition_options_check";
        std::string text;
        const kvr_status s = check_into(live(fn), text, fn);
        if (s != KVR_OK) throw Error(s, fn, text);
        return text;
    }

private:
    friend class Engine;
    /// kvr_partition_options_check's text into `text`; returns KVR_OK or
    /// KVR_ERR_INVALID_CONFIG, throws on any other status.
    static kvr_status check_into(const kvr_partition_options *opts, std::string &text,
                                 const char *fn) {
        for (;;) {
            std::size_t len = 0;
            const kvr_status s = kvr_partition_options_check(opts, text.empty() ? nullptr : text.data(),
                                                             text.size(), &len);
            if (s != KVR_OK && s != KVR_ERR_INVALID_CONFIG) throw Error(s, fn);
            const bool fits = len <= text.size();
            text.resize(len);
            if (fits) return s;
        }
    }
};

/// A worker's metadata under construction (kvr_worker); upsert_worker copies it.
class Worker : public detail::Handle<kvr_worker> {
public:
    /// Worker `worker_id` with `dp_size` (≥ 1) data-parallel ranks, role aggregated.
    explicit Worker(uint64_t worker_id, uint32_t dp_size = 1)
        : Handle(detail::make_handle<kvr_worker>(
              [&](kvr_worker **w) { return kvr_worker_new(worker_id, dp_size, w); },
              "kvr_worker_new")) {}
    /// Takes ownership of a C handle (NULL = an empty object).
    static Worker adopt(kvr_worker *owned) noexcept { return Worker(detail::Adopt{}, owned); }
    Worker(detail::Adopt, kvr_worker *owned) noexcept : Handle(owned) {}

    Worker &set_role(Role role) {
        const char *fn = "kvr_worker_set_role";
        detail::check(kvr_worker_set_role(live(fn), static_cast<uint32_t>(role)), fn);
        return *this;
    }
    /// The endpoint peers pull KV blocks of rank `dp_rank` from (empty = clear).
    Worker &set_control_endpoint(uint32_t dp_rank, std::string_view endpoint) {
        const char *fn = "kvr_worker_set_control_endpoint";
        detail::check(
            kvr_worker_set_control_endpoint(live(fn), dp_rank, endpoint.data(), endpoint.size()), fn);
        return *this;
    }
    Worker &set_total_kv_blocks(uint64_t blocks) {
        const char *fn = "kvr_worker_set_total_kv_blocks";
        detail::check(kvr_worker_set_total_kv_blocks(live(fn), blocks), fn);
        return *this;
    }
    Worker &set_max_batched_tokens(uint64_t tokens) {
        const char *fn = "kvr_worker_set_max_batched_tokens";
        detail::check(kvr_worker_set_max_batched_tokens(live(fn), tokens), fn);
        return *this;
    }
    Worker &add_lora_adapter(std::string_view name) {
        const char *fn = "kvr_worker_add_lora_adapter";
        detail::check(kvr_worker_add_lora_adapter(live(fn), name.data(), name.size()), fn);
        return *this;
    }
    Worker &set_label(std::string_view key, std::string_view value) {
        const char *fn = "kvr_worker_set_label";
        detail::check(
            kvr_worker_set_label(live(fn), key.data(), key.size(), value.data(), value.size()), fn);
        return *this;
    }
};

/// A reusable selection request (kvr_request). Setters need it exclusively; selections
/// only read it (one Request may serve concurrent selections if nobody sets it then).
class Request : public detail::Handle<kvr_request> {
public:
    /// A new, empty request.
    Request()
        : Handle(detail::make_handle<kvr_request>(
              [](kvr_request **r) { return kvr_request_new(r); }, "kvr_request_new")) {}
    /// Takes ownership of a C handle (NULL = an empty object).
    static Request adopt(kvr_request *owned) noexcept { return Request(detail::Adopt{}, owned); }
    Request(detail::Adopt, kvr_request *owned) noexcept : Handle(owned) {}

    /// Clears every field (keeps the request's buffers for reuse).
    Request &reset() {
        detail::check(kvr_request_reset(live("kvr_request_reset")), "kvr_request_reset");
        return *this;
    }

    /// The prompt as token ids. BORROWED, not copied: `tokens` must stay valid and
    /// unchanged until reset / another prompt / destruction, and during every selection.
    Request &set_tokens(Span<const uint32_t> tokens) {
        const char *fn = "kvr_request_set_tokens";
        detail::check(kvr_request_set_tokens(live(fn), tokens.data(), tokens.size()), fn);
        return *this;
    }
    // Temporaries would dangle: refused at compile time.
    template <class A>
    Request &set_tokens(std::vector<uint32_t, A> &&) = delete;
    template <std::size_t N>
    Request &set_tokens(std::array<uint32_t, N> &&) = delete;
    Request &set_tokens(std::initializer_list<uint32_t>) = delete;

    /// The prompt as local block hashes plus its length in tokens. BORROWED, as
    /// set_tokens.
    Request &set_local_hashes(Span<const uint64_t> hashes, uint64_t prompt_tokens) {
        const char *fn = "kvr_request_set_local_hashes";
        detail::check(
            kvr_request_set_local_hashes(live(fn), hashes.data(), hashes.size(), prompt_tokens), fn);
        return *this;
    }
    template <class A>
    Request &set_local_hashes(std::vector<uint64_t, A> &&, uint64_t) = delete;
    template <std::size_t N>
    Request &set_local_hashes(std::array<uint64_t, N> &&, uint64_t) = delete;
    Request &set_local_hashes(std::initializer_list<uint64_t>, uint64_t) = delete;

    /// The LoRA adapter (copied; empty = none).
    Request &set_lora(std::string_view name) {
        const char *fn = "kvr_request_set_lora";
        detail::check(kvr_request_set_lora(live(fn), name.data(), name.size()), fn);
        return *this;
    }
    /// The allow-set (copied). Empty = no worker allowed (NoWorker); to allow every
    /// worker, do not set it (or reset()).
    Request &set_allowed_workers(Span<const uint64_t> workers) {
        const char *fn = "kvr_request_set_allowed_workers";
        detail::check(kvr_request_set_allowed_workers(live(fn), workers.data(), workers.size()), fn);
        return *this;
    }
    Request &set_allowed_workers(std::initializer_list<uint64_t> workers) {
        return set_allowed_workers(Span<const uint64_t>(workers.begin(), workers.size()));
    }
    Request &set_pinned_worker(uint64_t worker_id) {
        const char *fn = "kvr_request_set_pinned_worker";
        detail::check(kvr_request_set_pinned_worker(live(fn), worker_id), fn);
        return *this;
    }
    /// The structured session context (copied; `session_id` must not be empty; empty
    /// parent / trigger = none).
    Request &set_session(std::string_view session_id, std::string_view parent_session_id = {},
                         bool session_final = false, std::string_view input_trigger = {}) {
        const char *fn = "kvr_request_set_session";
        detail::check(kvr_request_set_session(live(fn), session_id.data(), session_id.size(),
                                              parent_session_id.data(), parent_session_id.size(),
                                              session_final ? 1u : 0u, input_trigger.data(),
                                              input_trigger.size()),
                      fn);
        return *this;
    }
    /// A legacy flat session id (copied; empty = none).
    Request &set_legacy_session_id(std::string_view id) {
        const char *fn = "kvr_request_set_legacy_session_id";
        detail::check(kvr_request_set_legacy_session_id(live(fn), id.data(), id.size()), fn);
        return *this;
    }
    /// Per-request cost overrides (unset = the partition's value; infinities refused).
    Request &set_overrides(const Overrides &o) {
        const char *fn = "kvr_request_set_overrides";
        const double nan = std::numeric_limits<double>::quiet_NaN();
        detail::check(kvr_request_set_overrides(live(fn), o.overlap_score_credit.value_or(nan),
                                                o.prefill_load_scale.value_or(nan),
                                                o.temperature.value_or(nan),
                                                o.shared_cache_multiplier.value_or(nan)),
                      fn);
        return *this;
    }
    Request &set_expected_output_tokens(uint64_t tokens) {
        const char *fn = "kvr_request_set_expected_output_tokens";
        detail::check(kvr_request_set_expected_output_tokens(live(fn), tokens), fn);
        return *this;
    }
    /// Booked modes: the caller's own selection id (0 = let the engine mint one).
    Request &set_selection_id(uint64_t id) {
        const char *fn = "kvr_request_set_selection_id";
        detail::check(kvr_request_set_selection_id(live(fn), id), fn);
        return *this;
    }
    /// Booked modes: the booking's lifetime (0 = the partition's default).
    Request &set_ttl_ms(uint64_t ttl_ms) {
        const char *fn = "kvr_request_set_ttl_ms";
        detail::check(kvr_request_set_ttl_ms(live(fn), ttl_ms), fn);
        return *this;
    }

    // -- extra keys (kvr::hash): what engines fold into a block's hash -------------

    /// vLLM's cache_salt (copied; empty = none): folded into block 0 as engines fold it,
    /// so a tokens prompt matches only blocks published under the same salt.
    Request &set_cache_salt(std::string_view salt) {
        const char *fn = "kvr_request_set_cache_salt";
        detail::check(kvr_request_set_cache_salt(live(fn), salt.data(), salt.size()), fn);
        return *this;
    }
    /// A multimodal input (vLLM's mm_feature.identifier, copied) over prompt tokens
    /// [offset, offset + length); at most KVR_MAX_MM_INPUTS (Error KVR_ERR_TOO_LARGE).
    Request &add_mm_input(std::string_view identifier, uint64_t offset, uint64_t length) {
        const char *fn = "kvr_request_add_mm_input";
        detail::check(kvr_request_add_mm_input(live(fn), reinterpret_cast<const uint8_t *>(identifier.data()),
                                               identifier.size(), offset, length),
                      fn);
        return *this;
    }
    /// A raw extra-key value on block `block` (Dynamo's per-block mm_hash, or a
    /// prompt-embeddings key); at most KVR_MAX_BLOCK_KEYS (Error KVR_ERR_TOO_LARGE).
    Request &add_block_key(std::size_t block, uint64_t key) {
        const char *fn = "kvr_request_add_block_key";
        detail::check(kvr_request_add_block_key(live(fn), block, key), fn);
        return *this;
    }
    /// Where a booked selection's transfer hint writes the source engine's own hashes of
    /// the hinted blocks (KvHint::n_block_hashes says how many). BORROWED, as set_tokens,
    /// and written by every selection with this request: one buffer per concurrent use.
    /// An empty span = none.
    Request &set_hint_names_buffer(Span<uint64_t> buf) {
        const char *fn = "kvr_request_set_hint_names_buffer";
        detail::check(kvr_request_set_hint_names_buffer(live(fn), buf.data(), buf.size()), fn);
        return *this;
    }
    template <class A>
    Request &set_hint_names_buffer(std::vector<uint64_t, A> &&) = delete;
    template <std::size_t N>
    Request &set_hint_names_buffer(std::array<uint64_t, N> &&) = delete;

private:
    friend class Partition;
    const kvr_request *checked(const char *fn) const { return live(fn); }
};

// ---------------------------------------------------------------------------------------
// Hooks
// ---------------------------------------------------------------------------------------

/// A partition's host hooks; an empty std::function = that hook absent. Called from any
/// selecting thread, concurrently: targets must be thread-safe.
struct Hooks {
    /// Projected prefill tokens on a rank, or nullopt for "no estimate".
    std::function<std::optional<uint64_t>(uint64_t worker_id, uint32_t dp_rank,
                                          uint64_t prompt_tokens, uint64_t cached_tokens)>
        prefill_estimate;
    /// true = the rank is overloaded now (not chosen; all overloaded = Busy).
    std::function<bool(uint64_t worker_id, uint32_t dp_rank)> overloaded;
    /// false = the rank cannot take requests (not a candidate).
    std::function<bool(uint64_t worker_id, uint32_t dp_rank)> available;
    /// Block ranges of the prompt (sequence hashes) in the host's shared cache: append
    /// them to `ranges` (given empty) and return true; false = the lookup failed. If more
    /// ranges are found than kvr offered room for, kvr asks again (a second call).
    std::function<bool(Span<const uint64_t> seq_hashes, std::vector<kvr_block_range> &ranges)>
        shared_cache;
    /// Which of `workers` serve `lora`: set serves[i] non-zero, return true; false = no
    /// narrowing.
    std::function<bool(std::string_view lora, Span<const uint64_t> workers, Span<uint8_t> serves)>
        lora_filter;
    /// Called once when kvr drops these hooks (replaced, cleared, or partition gone).
    /// Note: kvr drops hooks that set no hook function at all immediately, inside
    /// set_hooks (libkvr 0.1.0 behaviour).
    std::function<void()> on_release;
    /// Called (from the hook's thread) when a hook threw; `hook` names it.
    std::function<void(const char *hook, std::exception_ptr error)> on_error;
};

namespace detail {
struct HookBox {
    explicit HookBox(Hooks h) : hooks(std::move(h)) {}
    Hooks hooks;

    void report(const char *hook) const noexcept {
        if (!hooks.on_error) return;
        try {
            hooks.on_error(hook, std::current_exception());
        } catch (...) {
        }
    }
};

inline void hook_release(void *ud) noexcept {
    auto *box = static_cast<HookBox *>(ud);
    if (box->hooks.on_release) {
        try {
            box->hooks.on_release();
        } catch (...) {
            box->report("on_release");
        }
    }
    delete box;
}

inline int32_t hook_prefill_estimate(void *ud, uint64_t worker_id, uint32_t dp_rank,
                                     uint64_t prompt_tokens, uint64_t cached_tokens,
                                     uint64_t *out_tokens) noexcept {
    const auto *box = static_cast<const HookBox *>(ud);
    try {
        std::optional<uint64_t> v =
            box->hooks.prefill_estimate(worker_id, dp_rank, prompt_tokens, cached_tokens);
        if (!v) return 1;
        *out_tokens = *v;
        return 0;
    } catch (...) {
        box->report("prefill_estimate");
        return 1;
    }
}

inline int32_t hook_overloaded(void *ud, uint64_t worker_id, uint32_t dp_rank) noexcept {
    const auto *box = static_cast<const HookBox *>(ud);
    try {
        return box->hooks.overloaded(worker_id, dp_rank) ? 1 : 0;
    } catch (...) {
        box->report("overloaded");
        return 0;
    }
}

inline int32_t hook_available(void *ud, uint64_t worker_id, uint32_t dp_rank) noexcept {
    const auto *box = static_cast<const HookBox *>(ud);
    try {
        return box->hooks.available(worker_id, dp_rank) ? 1 : 0;
    } catch (...) {
        box->report("available");
        return 1;
    }
}

inline int32_t hook_shared_cache(void *ud, const uint64_t *seq_hashes, std::size_t n,
                                 kvr_block_range *out, std::size_t cap,
                                 std::size_t *out_len) noexcept {
    const auto *box = static_cast<const HookBox *>(ud);
    try {
        // Reused per thread: no allocation per selection once warmed up.
        static thread_local std::vector<kvr_block_range> ranges;
        ranges.clear();
        if (!box->hooks.shared_cache(Span<const uint64_t>(seq_hashes, n), ranges)) return 1;
        *out_len = ranges.size();
        if (ranges.size() <= cap) std::copy(ranges.begin(), ranges.end(), out);
        return 0;
    } catch (...) {
        box->report("shared_cache");
        return 1;
    }
}

inline int32_t hook_lora_filter(void *ud, const char *lora, std::size_t lora_len,
                                const uint64_t *workers, std::size_t n,
                                uint8_t *out_serves) noexcept {
    const auto *box = static_cast<const HookBox *>(ud);
    try {
        return box->hooks.lora_filter(std::string_view(lora, lora_len),
                                      Span<const uint64_t>(workers, n), Span<uint8_t>(out_serves, n))
                   ? 0
                   : 1;
    } catch (...) {
        box->report("lora_filter");
        return 1;
    }
}
}  // namespace detail

// ---------------------------------------------------------------------------------------
// Ingress: raw engine messages and kvr's own subscriber
// ---------------------------------------------------------------------------------------

/// What one Partition::ingest call did. `status` is KVR_OK, or KVR_ERR_DECODE when the
/// payload did not decode (nothing of it applied; decode_errors is 1); other failures
/// throw.
struct IngestResult : kvr_ingest_result {
    IngestResult() noexcept : kvr_ingest_result{} {}
    kvr_status status = KVR_OK;
    bool decoded() const noexcept { return status == KVR_OK; }
};

/// The name of decode-error slot `kind` of kvr_stream_stats::decode_errors (e.g.
/// "truncated"; a static string). Error KVR_ERR_INVALID_ARGUMENT for a slot kvr does not use.
inline std::string_view decode_error_name(uint32_t kind) {
    const char *fn = "kvr_decode_error_name";
    const char *name = nullptr;
    std::size_t len = 0;
    detail::check(kvr_decode_error_name(kind, &name, &len), fn);
    return std::string_view(name, len);
}

/// The words for kvr_stream_stats::health_reason (e.g. "decode errors"; a static
/// string). Error KVR_ERR_INVALID_ARGUMENT for a number kvr does not use.
inline std::string_view health_reason_name(uint32_t reason) {
    const char *fn = "kvr_health_reason_name";
    const char *name = nullptr;
    std::size_t len = 0;
    detail::check(kvr_health_reason_name(reason, &name, &len), fn);
    return std::string_view(name, len);
}

/// How Partition::subscribe reaches engines (kvr_subscribe_options): connect to one
/// engine's PUB socket, or bind one socket that many engines connect to.
class SubscribeOptions : public detail::Handle<kvr_subscribe_options> {
public:
    /// Connect to `endpoint` (tcp://HOST:PORT or ipc://PATH); its batches are
    /// `worker_id`'s stream `stream`. No replay endpoint, every topic.
    static SubscribeOptions connect(std::string_view endpoint, uint64_t worker_id, uint32_t stream = 0) {
        return SubscribeOptions(detail::make_handle<kvr_subscribe_options>(
            [&](kvr_subscribe_options **o) {
                return kvr_subscribe_options_new_connect(endpoint.data(), endpoint.size(), worker_id,
                                                         stream, o);
            },
            "kvr_subscribe_options_new_connect"));
    }
    /// Bind `endpoint` (HOST `*` = every IPv4 interface); each topic is its own stream,
    /// its worker from a route (add_route) or from the digits ending the topic.
    static SubscribeOptions bind(std::string_view endpoint) {
        return SubscribeOptions(detail::make_handle<kvr_subscribe_options>(
            [&](kvr_subscribe_options **o) {
                return kvr_subscribe_options_new_bind(endpoint.data(), endpoint.size(), o);
            },
            "kvr_subscribe_options_new_bind"));
    }
    /// Takes ownership of a C handle (NULL = an empty object).
    static SubscribeOptions adopt(kvr_subscribe_options *owned) noexcept { return SubscribeOptions(owned); }

    /// Connect mode: the engine's replay ROUTER (empty = none); gaps are then filled by
    /// a replay before newer batches apply.
    SubscribeOptions &set_replay_endpoint(std::string_view endpoint) {
        const char *fn = "kvr_subscribe_options_set_replay_endpoint";
        detail::check(kvr_subscribe_options_set_replay_endpoint(live(fn), endpoint.data(), endpoint.size()),
                      fn);
        return *this;
    }
    /// Connect mode: only topics starting with `prefix` (empty = every topic).
    SubscribeOptions &set_topic(std::string_view prefix) {
        const char *fn = "kvr_subscribe_options_set_topic";
        detail::check(kvr_subscribe_options_set_topic(live(fn), reinterpret_cast<const uint8_t *>(prefix.data()),
                                                      prefix.size()),
                      fn);
        return *this;
    }
    /// Bind mode: messages of topic exactly `topic` are `worker_id`'s stream `stream`,
    /// whose publisher serves replays at `replay_endpoint` (empty = none).
    SubscribeOptions &add_route(std::string_view topic, uint64_t worker_id, uint32_t stream = 0,
                                std::string_view replay_endpoint = {}) {
        const char *fn = "kvr_subscribe_options_add_route";
        detail::check(kvr_subscribe_options_add_route(live(fn), reinterpret_cast<const uint8_t *>(topic.data()),
                                                      topic.size(), worker_id, stream,
                                                      replay_endpoint.data(), replay_endpoint.size()),
                      fn);
        return *this;
    }
    /// Bind mode: at most `max` topics no route names get a stream of their own (default
    /// 256; 0 = routed topics only); messages under further ones are dropped and counted.
    SubscribeOptions &set_max_unrouted_topics(uint32_t max) {
        const char *fn = "kvr_subscribe_options_set_max_unrouted_topics";
        detail::check(kvr_subscribe_options_set_max_unrouted_topics(live(fn), max), fn);
        return *this;
    }

private:
    friend class Partition;
    explicit SubscribeOptions(kvr_subscribe_options *owned) noexcept : Handle(owned) {}
    const kvr_subscribe_options *checked(const char *fn) const { return live(fn); }
};

/// A running subscription (kvr_subscription): a task on kvr's ingest thread (one for all
/// subscriptions of the process) feeding the partition. Destroying it stops it (waiting
/// for it to end) and frees it.
class Subscription : public detail::Handle<kvr_subscription> {
public:
    Subscription() noexcept = default;
    /// Takes ownership of a C handle (NULL = an empty object).
    static Subscription adopt(kvr_subscription *owned) noexcept { return Subscription(owned); }

    /// Stops it and waits for it to end: afterwards no event of it is applied and its
    /// sockets are closed. Idempotent.
    void stop() {
        const char *fn = "kvr_subscription_stop";
        detail::check(kvr_subscription_stop(live(fn)), fn);
    }
    /// Whether it runs (false after stop(), or if it ended on an internal error).
    bool running() const {
        const char *fn = "kvr_subscription_is_running";
        uint32_t on = 0;
        detail::check(kvr_subscription_is_running(live(fn), &on), fn);
        return on != 0;
    }

private:
    explicit Subscription(kvr_subscription *owned) noexcept : Handle(owned) {}
};

// ---------------------------------------------------------------------------------------
// Partition
// ---------------------------------------------------------------------------------------

/// A handle to one partition (model, routing group) of an engine. Obtained from
/// Engine::create_partition / get_partition; default-constructed = empty.
class Partition : public detail::Handle<kvr_partition> {
public:
    Partition() noexcept = default;
    /// Takes ownership of a C handle (NULL = an empty object).
    static Partition adopt(kvr_partition *owned) noexcept { return Partition(detail::Adopt{}, owned); }
    Partition(detail::Adopt, kvr_partition *owned) noexcept : Handle(owned) {}

    uint32_t block_size() const {
        const char *fn = "kvr_partition_block_size";
        uint32_t out = 0;
        detail::check(kvr_partition_block_size(live(fn), &out), fn);
        return out;
    }

    /// Replaces the partition's hooks with `hooks` (see Hooks). The previous hooks are
    /// released once no selection uses them any more.
    void set_hooks(Hooks hooks) const {
        const char *fn = "kvr_partition_set_hooks";
        const kvr_partition *p = live(fn);
        auto box = std::make_unique<detail::HookBox>(std::move(hooks));
        const Hooks &h = box->hooks;
        kvr_hooks c{};
        c.user_data = box.get();
        c.release = &detail::hook_release;
        c.prefill_estimate = h.prefill_estimate ? &detail::hook_prefill_estimate : nullptr;
        c.overloaded = h.overloaded ? &detail::hook_overloaded : nullptr;
        c.available = h.available ? &detail::hook_available : nullptr;
        c.shared_cache = h.shared_cache ? &detail::hook_shared_cache : nullptr;
        c.lora_filter = h.lora_filter ? &detail::hook_lora_filter : nullptr;
        const kvr_status s = kvr_partition_set_hooks(p, &c);
        // OK: kvr owns the box (release deletes it). After a caught panic we cannot tell
        // whether kvr already released it: leak it rather than risk a double delete.
        if (s == KVR_OK || s == KVR_ERR_PANIC) (void)box.release();
        detail::check(s, fn);
    }

    /// Removes every hook (the previous ones are released as set_hooks says).
    void clear_hooks() const {
        const char *fn = "kvr_partition_set_hooks";
        detail::check(kvr_partition_set_hooks(live(fn), nullptr), fn);
    }

    /// Adds the worker or replaces its metadata (copied).
    void upsert_worker(const Worker &worker) const {
        const char *fn = "kvr_partition_upsert_worker";
        if (!worker) detail::throw_null(fn);
        detail::check(kvr_partition_upsert_worker(live(fn), worker.get()), fn);
    }

    /// Removes a worker (its index entries, load and bookings); Error KVR_ERR_UNKNOWN_WORKER
    /// if it was not a member.
    void remove_worker(uint64_t worker_id) const {
        const char *fn = "kvr_partition_remove_worker";
        detail::check(kvr_partition_remove_worker(live(fn), worker_id), fn);
    }

    /// Publishes one batch of load reports atomically; returns the load view's version.
    uint64_t publish_load(Span<const kvr_rank_load> loads) const {
        const char *fn = "kvr_partition_publish_load";
        uint64_t version = 0;
        detail::check(kvr_partition_publish_load(live(fn), loads.data(), loads.size(), &version), fn);
        return version;
    }

    /// Applies one rank's batch of events in order. Throws if the batch is malformed
    /// (nothing applied); refusals of single events are reported in the result.
    ApplyResult apply_events(uint64_t worker_id, uint32_t dp_rank,
                             Span<const kvr_event> events) const {
        const char *fn = "kvr_partition_apply_events";
        ApplyResult r;
        const kvr_status s =
            kvr_partition_apply_events(live(fn), worker_id, dp_rank, events.data(), events.size(), &r);
        if (s == KVR_ERR_PARENT_NOT_FOUND || s == KVR_ERR_TOO_MANY_RANKS) {
            r.refusal = s;
            return r;
        }
        detail::check(s, fn);
        return r;
    }

    ApplyResult apply_event(uint64_t worker_id, uint32_t dp_rank, const kvr_event &event) const {
        return apply_events(worker_id, dp_rank, Span<const kvr_event>(&event, 1));
    }

    /// Device overlap per rank of a prompt (local hashes) into `out` (resized to the
    /// answer; its capacity is reused, grown as needed). Returns the number of entries.
    std::size_t find_matches(Span<const uint64_t> local_hashes, std::vector<kvr_overlap> &out) const {
        return lookup(&kvr_partition_find_matches, "kvr_partition_find_matches", local_hashes, out);
    }
    std::vector<kvr_overlap> find_matches(Span<const uint64_t> local_hashes) const {
        std::vector<kvr_overlap> out;
        find_matches(local_hashes, out);
        return out;
    }

    /// Tiered overlap per rank (device, host, disk), as find_matches.
    std::size_t find_matches_tiered(Span<const uint64_t> local_hashes,
                                    std::vector<kvr_overlap> &out) const {
        return lookup(&kvr_partition_find_matches_tiered, "kvr_partition_find_matches_tiered",
                      local_hashes, out);
    }
    std::vector<kvr_overlap> find_matches_tiered(Span<const uint64_t> local_hashes) const {
        std::vector<kvr_overlap> out;
        find_matches_tiered(local_hashes, out);
        return out;
    }

    /// Block hashes of `tokens` with the partition's block size and namespace into
    /// `local` and/or `seq` (either may be NULL; resized to the number of complete
    /// blocks, which is returned).
    std::size_t hash_tokens(Span<const uint32_t> tokens, std::vector<uint64_t> *local,
                            std::vector<uint64_t> *seq, std::string_view lora = {}) const;
    BlockHashes hash_tokens(Span<const uint32_t> tokens, std::string_view lora = {}) const {
        BlockHashes h;
        hash_tokens(tokens, &h.local, &h.seq, lora);
        return h;
    }

    /// Advisory selection: books nothing.
    Selection select(const Request &req) const {
        return selection(&kvr_partition_select, "kvr_partition_select", req);
    }

    /// Booked selection: decision.selection_id names the booking (Engine::free_booking).
    /// With transfer hints on (PartitionOptions::set_kv_hints), Selection::hint holds the
    /// hint booked with it, if any (decision.flags then has KVR_DECISION_KV_HINT).
    Selection select_and_reserve(const Request &req) const {
        const char *fn = "kvr_partition_select_and_reserve_with_hint";
        Selection sel;
        kvr_kv_hint h;  // written by kvr only with KVR_DECISION_KV_HINT
        outcome(sel, kvr_partition_select_and_reserve_with_hint(live(fn), req.checked(fn),
                                                                 &sel.decision, &h),
                fn);
        if (sel.selected() && has_kv_hint(sel.decision)) sel.hint = KvHint::of(h);
        return sel;
    }

    /// Books a request on a rank the caller chose (no scoring); `req` may be NULL.
    /// `prefill_tokens` overrides the prefill booked; `selection_id` 0 = the request's,
    /// else minted.
    kvr_decision reserve(uint64_t worker_id, uint32_t dp_rank, const Request *req = nullptr,
                         std::optional<uint64_t> prefill_tokens = std::nullopt,
                         uint64_t selection_id = 0) const {
        const char *fn = "kvr_partition_reserve";
        const kvr_partition *p = live(fn);
        const kvr_request *r = req != nullptr ? req->checked(fn) : nullptr;
        const uint64_t prefill = prefill_tokens.value_or(0);
        kvr_decision d{};
        detail::check(kvr_partition_reserve(p, worker_id, dp_rank, r,
                                            prefill_tokens ? &prefill : nullptr, selection_id, &d),
                      fn);
        return d;
    }
    kvr_decision reserve(uint64_t worker_id, uint32_t dp_rank, const Request &req,
                         std::optional<uint64_t> prefill_tokens = std::nullopt,
                         uint64_t selection_id = 0) const {
        return reserve(worker_id, dp_rank, &req, prefill_tokens, selection_id);
    }

    /// Installs a replica peer's booking.
    void install_replica_booking(const kvr_replica_booking &booking) const {
        const char *fn = "kvr_partition_install_replica_booking";
        detail::check(kvr_partition_install_replica_booking(live(fn), &booking), fn);
    }
    void install_replica_booking(const ReplicaBooking &b) const {
        kvr_replica_booking c{};
        c.selection_id = b.selection_id;
        c.worker_id = b.worker_id;
        c.dp_rank = b.dp_rank;
        c.prompt_blocks = b.prompt_blocks.data();
        c.n_prompt_blocks = b.prompt_blocks.size();
        c.prefill_tokens = b.prefill_tokens;
        c.expected_output_tokens = b.expected_output_tokens;
        c.ttl_ms = b.ttl_ms;
        install_replica_booking(c);
    }

    kvr_index_stats index_stats() const {
        return read<kvr_index_stats>(&kvr_partition_index_stats, "kvr_partition_index_stats");
    }
    kvr_selection_stats selection_stats() const {
        return read<kvr_selection_stats>(&kvr_partition_selection_stats,
                                         "kvr_partition_selection_stats");
    }
    kvr_booking_stats booking_stats() const {
        return read<kvr_booking_stats>(&kvr_partition_booking_stats, "kvr_partition_booking_stats");
    }
    /// The prefill rate learned from mark_prefill_complete timings (empty until a few
    /// completions were observed) and the completions observed.
    PrefillRate prefill_rate() const {
        const char *fn = "kvr_partition_prefill_rate";
        double rate = 0.0;
        uint64_t observations = 0;
        detail::check(kvr_partition_prefill_rate(live(fn), &rate, &observations), fn);
        PrefillRate out;
        if (rate > 0.0) {
            out.tokens_per_s = rate;
        }
        out.observations = observations;
        return out;
    }
    /// The decode drag learned from the same timings (empty until enough completions on
    /// ranks of different decode loads were observed) and the completions observed.
    DecodeDrag decode_drag() const {
        const char *fn = "kvr_partition_decode_drag";
        double drag = -1.0;
        uint64_t observations = 0;
        detail::check(kvr_partition_decode_drag(live(fn), &drag, &observations), fn);
        DecodeDrag out;
        if (drag >= 0.0) {
            out.seconds_per_block = drag;
        }
        out.observations = observations;
        return out;
    }
    /// What the restore at creation found (throws KVR_ERR_INVALID_CONFIG without a state
    /// directory).
    kvr_state_restored state_restored() const {
        return read<kvr_state_restored>(&kvr_partition_state_restored, "kvr_partition_state_restored");
    }
    /// The journal writer's figures (throws KVR_ERR_INVALID_CONFIG without a state directory).
    kvr_state_stats state_stats() const {
        return read<kvr_state_stats>(&kvr_partition_state_stats, "kvr_partition_state_stats");
    }
    /// Writes a final snapshot and stops the journal (also done when the partition's last
    /// handle goes).
    void close_state() {
        const char *fn = "kvr_partition_close_state";
        detail::check(kvr_partition_close_state(live(fn)), fn);
    }
    /// The indexer's policy (policy_of()) and what it recorded or asked.
    kvr_indexer_stats indexer_stats() const {
        return read<kvr_indexer_stats>(&kvr_partition_indexer_stats, "kvr_partition_indexer_stats");
    }
    /// The session table's figures (all 0, `enabled` 0, without session affinity).
    kvr_session_stats session_stats() const {
        return read<kvr_session_stats>(&kvr_partition_session_stats, "kvr_partition_session_stats");
    }
    /// The engine's live bookings on rank (worker_id, dp_rank).
    /// Hands kvr one message of `worker_id`'s KV-event stream `stream` (topic, sequence
    /// number, msgpack payload, as the engine's ZMQ frames carry them): sequence-checked,
    /// decoded and applied. A payload that does not decode is reported in the result
    /// (IngestResult::decoded() false), not thrown. Messages of one stream in order.
    IngestResult ingest(uint64_t worker_id, uint32_t stream, std::string_view topic, uint64_t seq,
                        Span<const uint8_t> payload) const {
        const char *fn = "kvr_partition_ingest";
        IngestResult r;
        const kvr_status s =
            kvr_partition_ingest(live(fn), worker_id, stream, reinterpret_cast<const uint8_t *>(topic.data()),
                                 topic.size(), seq, payload.data(), payload.size(), &r);
        if (s == KVR_ERR_DECODE) {
            r.status = s;
            return r;
        }
        detail::check(s, fn);
        return r;
    }

    /// Counters of every event stream of the partition (ingested or subscribed) into
    /// `out` (resized to the answer; its capacity is reused). Returns the stream count.
    std::size_t ingress_stats(std::vector<kvr_stream_stats> &out) const {
        const char *fn = "kvr_partition_ingress_stats";
        const kvr_partition *p = live(fn);
        for (;;) {
            out.resize(std::max<std::size_t>(out.capacity(), 1));
            std::size_t n = 0;
            const kvr_status s = kvr_partition_ingress_stats(p, out.data(), out.size(), &n);
            if (s == KVR_BUFFER_TOO_SMALL) {  // streams may be added meanwhile: loop
                out.resize(n);
                continue;
            }
            detail::check(s, fn);
            out.resize(n);
            return n;
        }
    }
    std::vector<kvr_stream_stats> ingress_stats() const {
        std::vector<kvr_stream_stats> out;
        ingress_stats(out);
        return out;
    }

    /// Subscribes the partition to engine KV events as `opts` says (copied; `opts` may be
    /// destroyed afterwards), on a thread of kvr's own. Error KVR_ERR_INVALID_CONFIG if the
    /// partition applies no engine events, KVR_ERR_INVALID_ARGUMENT for a malformed
    /// endpoint; an unreachable endpoint is not an error (kvr keeps trying).
    Subscription subscribe(const SubscribeOptions &opts) const {
        const char *fn = "kvr_partition_subscribe";
        const kvr_partition *p = live(fn);
        kvr_subscription *out = nullptr;
        detail::check(kvr_partition_subscribe(p, opts.checked(fn), &out), fn);
        return Subscription::adopt(out);
    }

    kvr_active_load active_load(uint64_t worker_id, uint32_t dp_rank) const {
        const char *fn = "kvr_partition_active_load";
        kvr_active_load out{};
        detail::check(kvr_partition_active_load(live(fn), worker_id, dp_rank, &out), fn);
        return out;
    }

private:
    using LookupFn = kvr_status (*)(const kvr_partition *, const uint64_t *, std::size_t,
                                    kvr_overlap *, std::size_t, std::size_t *);
    using SelectFn = kvr_status (*)(const kvr_partition *, const kvr_request *, kvr_decision *);

    std::size_t lookup(LookupFn f, const char *fn, Span<const uint64_t> hashes,
                       std::vector<kvr_overlap> &out) const {
        const kvr_partition *p = live(fn);
        for (;;) {
            if (out.size() < out.capacity()) out.resize(out.capacity());
            std::size_t n = 0;
            const kvr_status s = f(p, hashes.data(), hashes.size(), out.data(), out.size(), &n);
            if (s == KVR_BUFFER_TOO_SMALL) {  // the index may grow again meanwhile: loop
                out.resize(n);
                continue;
            }
            detail::check(s, fn);
            out.resize(n);
            return n;
        }
    }

    Selection selection(SelectFn f, const char *fn, const Request &req) const {
        Selection sel;
        outcome(sel, f(live(fn), req.checked(fn), &sel.decision), fn);
        return sel;
    }

    static void outcome(Selection &sel, kvr_status s, const char *fn) {
        switch (s) {
            case KVR_OK: sel.outcome = Outcome::Selected; break;
            case KVR_BUSY: sel.outcome = Outcome::Busy; break;
            case KVR_NO_WORKER: sel.outcome = Outcome::NoWorker; break;
            default: throw Error(s, fn);
        }
    }

    template <class T>
    T read(kvr_status (*f)(const kvr_partition *, T *), const char *fn) const {
        T out{};
        detail::check(f(live(fn), &out), fn);
        return out;
    }
};

namespace detail {
/// Hashing into caller vectors with kvr's buffer protocol: offer each vector's
/// capacity (at least 1, so a wanted output is never passed as NULL), grow on
/// KVR_BUFFER_TOO_SMALL, and trim to the number of blocks.
template <class Call>
std::size_t hash_into(Call call, const char *fn, std::vector<uint64_t> *local,
                      std::vector<uint64_t> *seq) {
    for (;;) {
        std::size_t cap = SIZE_MAX;
        for (std::vector<uint64_t> *v : {local, seq}) {
            if (v == nullptr) continue;
            v->resize(std::max<std::size_t>(v->capacity(), 1));
            cap = std::min(cap, v->size());
        }
        if (local == nullptr && seq == nullptr) cap = 0;
        std::size_t n = 0;
        const kvr_status s = call(local != nullptr ? local->data() : nullptr,
                                  seq != nullptr ? seq->data() : nullptr, cap, &n);
        if (s == KVR_BUFFER_TOO_SMALL) {
            for (std::vector<uint64_t> *v : {local, seq})
                if (v != nullptr) v->resize(n);
            continue;
        }
        check(s, fn);
        for (std::vector<uint64_t> *v : {local, seq})
            if (v != nullptr) v->resize(n);
        return n;
    }
}
}  // namespace detail

inline std::size_t Partition::hash_tokens(Span<const uint32_t> tokens, std::vector<uint64_t> *local,
                                          std::vector<uint64_t> *seq, std::string_view lora) const {
    const char *fn = "kvr_partition_hash_tokens";
    const kvr_partition *p = live(fn);
    return detail::hash_into(
        [&](uint64_t *l, uint64_t *s, std::size_t cap, std::size_t *n) {
            return kvr_partition_hash_tokens(p, lora.data(), lora.size(), tokens.data(), tokens.size(),
                                             l, s, cap, n);
        },
        fn, local, seq);
}

/// Block hashes of `tokens` for blocks of `block_size` tokens (Dynamo's), salted by
/// `lora` and `cache_namespace` (empty = none), into `local` and/or `seq` (either may be
/// NULL; resized to the number of complete blocks, which is returned).
inline std::size_t hash_tokens(uint32_t block_size, Span<const uint32_t> tokens,
                               std::vector<uint64_t> *local, std::vector<uint64_t> *seq,
                               std::string_view lora = {}, std::string_view cache_namespace = {}) {
    return detail::hash_into(
        [&](uint64_t *l, uint64_t *s, std::size_t cap, std::size_t *n) {
            return kvr_hash_tokens(block_size, lora.data(), lora.size(), cache_namespace.data(),
                                   cache_namespace.size(), tokens.data(), tokens.size(), l, s, cap, n);
        },
        "kvr_hash_tokens", local, seq);
}

inline BlockHashes hash_tokens(uint32_t block_size, Span<const uint32_t> tokens,
                               std::string_view lora = {}, std::string_view cache_namespace = {}) {
    BlockHashes h;
    hash_tokens(block_size, tokens, &h.local, &h.seq, lora, cache_namespace);
    return h;
}

// ---------------------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------------------

/// The selection engine (kvr_engine): partitions and the booking lifecycle.
class Engine : public detail::Handle<kvr_engine> {
public:
    /// A new engine with default options.
    Engine() : Engine(WithOptions{}, nullptr) {}
    /// A new engine with `opts` (only read; may be destroyed afterwards).
    explicit Engine(const EngineOptions &opts) : Engine(WithOptions{}, options_of(opts)) {}
    /// Takes ownership of a C handle (NULL = an empty object).
    static Engine adopt(kvr_engine *owned) noexcept { return Engine(detail::Adopt{}, owned); }
    Engine(detail::Adopt, kvr_engine *owned) noexcept : Handle(owned) {}

    /// A fresh engine-unique selection id (never 0).
    uint64_t mint_selection_id() const {
        const char *fn = "kvr_engine_mint_selection_id";
        uint64_t id = 0;
        detail::check(kvr_engine_mint_selection_id(live(fn), &id), fn);
        return id;
    }

    /// Creates partition (model, group); Error KVR_ERR_PARTITION_EXISTS if it exists.
    Partition create_partition(std::string_view model, std::string_view group,
                               const PartitionOptions &opts) const {
        const char *fn = "kvr_engine_create_partition";
        const kvr_engine *e = live(fn);
        if (!opts) detail::throw_null(fn);
        kvr_partition *out = nullptr;
        const kvr_status s = kvr_engine_create_partition(e, model.data(), model.size(), group.data(),
                                                         group.size(), opts.get(), &out);
        if (s == KVR_ERR_INVALID_CONFIG) throw invalid_config(opts.get(), fn);
        detail::check(s, fn);
        return Partition::adopt(out);
    }

    /// A new handle to partition (model, group); Error KVR_ERR_UNKNOWN_PARTITION if none.
    Partition get_partition(std::string_view model, std::string_view group) const {
        const char *fn = "kvr_engine_get_partition";
        kvr_partition *out = nullptr;
        detail::check(kvr_engine_get_partition(live(fn), model.data(), model.size(), group.data(),
                                               group.size(), &out),
                      fn);
        return Partition::adopt(out);
    }

    /// Removes partition (model, group); its handles stay valid to read and free.
    void remove_partition(std::string_view model, std::string_view group) const {
        const char *fn = "kvr_engine_remove_partition";
        detail::check(
            kvr_engine_remove_partition(live(fn), model.data(), model.size(), group.data(), group.size()),
            fn);
    }

    /// The booking's prefill is done (idempotent).
    void mark_prefill_complete(uint64_t selection_id) const {
        const char *fn = "kvr_engine_mark_prefill_complete";
        detail::check(kvr_engine_mark_prefill_complete(live(fn), selection_id), fn);
    }

    /// The booking produced `n` more output blocks.
    void add_output_blocks(uint64_t selection_id, uint64_t n) const {
        const char *fn = "kvr_engine_add_output_blocks";
        detail::check(kvr_engine_add_output_blocks(live(fn), selection_id, n), fn);
    }

    /// The booking has produced `total` output blocks so far: its output blocks rise to
    /// `total` (idempotent, unlike add_output_blocks). Returns the blocks this call added.
    uint64_t set_output_blocks(uint64_t selection_id, uint64_t total) const {
        const char *fn = "kvr_engine_set_output_blocks";
        uint64_t added = 0;
        detail::check(kvr_engine_set_output_blocks(live(fn), selection_id, total, &added), fn);
        return added;
    }

    /// Frees the booking (idempotent); says how it found it.
    FreedBy free_booking(uint64_t selection_id) const {
        const char *fn = "kvr_engine_free_booking";
        uint32_t how = 0;
        detail::check(kvr_engine_free_booking(live(fn), selection_id, &how), fn);
        return static_cast<FreedBy>(how);
    }

private:
    /// KVR_ERR_INVALID_CONFIG from `fn`, with kvr_partition_options_check's reason (none
    /// if the check cannot tell, or fails itself).
    static Error invalid_config(const kvr_partition_options *opts, const char *fn) {
        try {
            std::string why;
            if (PartitionOptions::check_into(opts, why, fn) == KVR_ERR_INVALID_CONFIG)
                return Error(KVR_ERR_INVALID_CONFIG, fn, why);
        } catch (...) {
        }
        return Error(KVR_ERR_INVALID_CONFIG, fn);
    }

    struct WithOptions {};
    static const kvr_engine_options *options_of(const EngineOptions &opts) {
        if (!opts) detail::throw_null("kvr_engine_new");
        return opts.get();
    }
    Engine(WithOptions, const kvr_engine_options *opts)
        : Handle(detail::make_handle<kvr_engine>(
              [opts](kvr_engine **e) {
                  check_abi();
                  return kvr_engine_new(opts, e);
              },
              "kvr_engine_new")) {}
};

}  // namespace kvr

#endif  // KVR_HPP
