//! The fixed limits, as constants in the code (each row names its constant).
//!
//! Configurable sizes (shard counts, TTLs, table bounds) are listed with their defaults;
//! the rest are compiled in.
//!
//! # Index
//!
//! | limit | value | where |
//! |---|---|---|
//! | ranks per index (live, plus removed ones whose slot is still deferred) | 2^18 = 262,144; past it an event or recording of a new rank is refused (`IndexError::TooManyRanks`) | [`MAX_RANKS`] (`index::ranks::SLOT_BITS` = 18) |
//! | blocks of one run | 2,048; a chain goes on in a child run at that offset | `index::run::MAX_RUN` |
//! | a rank's covers per run | one 16-byte `Cover` (counts of at most 65,535, above any run's length) | `index::hold::Cover` |
//! | tiers | 3: device, host, disk | [`Tier`] |
//! | branch-table shards | 64 by default, rounded up to a power of two | [`IndexConfig::shards`] |
//! | smallest shard table | 64 slots by default | [`IndexConfig::min_shard_capacity`] |
//! | branch-key collision (two (run, offset, local) triples with one 64-bit key) | the store stops there, its later blocks unindexed and counted (`Index::run_counts`); never an overcount | `index::branch::branch_key` |
//! | rank maps sized ahead from a registered capacity | 2^20 blocks a rank, 2^23 for all of an index's ranks together; past that, ranks grow as they fill, a growth step stopping at their capacity's size | [`MAX_RESERVED_BLOCKS`], [`MAX_RESERVED_BLOCKS_PER_INDEX`] |
//! | rank maps | bucketized cuckoo, 8-slot buckets, 64-96 % full, growing by 1.5× (a registered capacity sizes them once, for it and a twentieth more); 12 bytes a slot (an engine hash and a 4-byte place) | `index::block_map` |
//! | runs a rank holds blocks of at once | 2^21 (a place is a 21-bit index in the rank's run table and an 11-bit offset); blocks a store would put in one more are left unindexed and counted (`Index::held_run_limit_hits`); never an overcount | `index::place::MAX_HELD_RUNS` |
//! | table rebuild | when live + dead slots exceed 85 % of capacity; shrink below 1/8 live; a rebuilt table starts at ~62 % | `table::{MAX_LOAD_PCT, SHRINK_RATIO, TARGET_LOAD_PCT}` |
//! | probe tail past the last home slot | `max(capacity / 64, 32)` slots, the last one an always-empty sentinel | `table::tail` |
//! | table capacities | `(8 + m) << e` (steps of 1/8); the capacity code lives in the low 8 bits of the 256-byte-aligned table pointer | `table::TABLE_ALIGN` |
//! | table key 0 | stored under `0x9e37_79b9_7f4a_7c15` instead (a branch key is a 64-bit mix, so this costs a collision at probability 2^-64, handled as above) | `table::ZERO_ALIAS` |
//!
//! # Identifiers
//!
//! | limit | value | where |
//! |---|---|---|
//! | worker id | any `u64` | [`WorkerId`] |
//! | DP rank | any `u32` (a worker's ranks are `0..dp_size`) | [`DpRank`] |
//! | selection id | any `u64`; minted ids start at 1 and are never 0, handed to each thread 1,024 at a time | [`SelectionId`], `engine::ID_BLOCK` |
//! | selection ids 0 and `0x9e37_79b9_7f4a_7c15` | share one node of the engine's id index (the same `ZERO_ALIAS`): a caller who supplies both sees the second refused as a duplicate while the first is live | `idmap` via `table::table_key` |
//! | engine's id-index shards | 64 | `Engine::with_seed` |
//! | retries of a booking whose minted id the table still remembers | 8 | `engine::MINT_ATTEMPTS` |
//!
//! # Bookings
//!
//! | limit | value | where |
//! |---|---|---|
//! | prefill tokens, expected output tokens, output blocks per booking | at most 2^40 each (`ReservationError::TooLarge` beyond) | [`MAX_PER_BOOKING`] |
//! | booking shards | 64 by default, clamped to 1..=65,536 and rounded up to a power of two | [`ReservationConfig::shards`] |
//! | default booking TTL | 3,600 s | [`ReservationConfig::default_ttl`] |
//! | a replica peer's booking's lifetime | at most 300 s (a longer TTL, or the default, is cut to it) | [`MAX_REPLICA_BOOKING_TTL`] |
//! | sweep interval | 30 s by default; with an approximate index at most half its TTL (at least 100 ms) | [`ReservationConfig::sweep_interval`] |
//! | freed ids remembered per shard | 256 by default | [`ReservationConfig::recently_freed_per_shard`] |
//!
//! # Sessions
//!
//! | limit | value | where |
//! |---|---|---|
//! | sessions per table | 65,536 by default, enforced per shard | [`SessionConfig::max_entries`] |
//! | session and lease shards | 64 by default, clamped to 1..=65,536; session shards halved while one would hold fewer than 16 entries | [`SessionConfig::shards`], [`MIN_ENTRIES_PER_SHARD`] |
//! | session id length | 256 bytes by default (longer ids are refused) | [`SessionConfig::max_session_id_bytes`] |
//! | idle TTL | 600 s by default | [`SessionConfig::idle_ttl`] |
//! | leases released before their bind, remembered per lease shard | 64 by default, each for 60 s | [`SessionConfig::early_release_memory`], [`EARLY_RELEASE_WINDOW`] |
//!
//! # Ingress and the remote primary
//!
//! | limit | value | where |
//! |---|---|---|
//! | engine event payload | 64 MiB (larger is rejected before decoding) | [`MAX_PAYLOAD_BYTES`] |
//! | live batches held while a replay is in flight | 100,000 (beyond, the replay is abandoned: clear and go on live) | `ingress::sequence::MAX_HELD` |
//! | ingress streams per partition (subscriptions' and raw ones) | one per registered DP rank and 1,024 more; a message that would open another is dropped and counted (`IndexerStats::ingress_refused`) | [`MAX_INGRESS_STREAMS`] |
//! | stream resume points (a warm restart's) per partition | 65,536, or the stream bound if higher; past it `Partition::resume_stream` returns false | `ingress::registry` `MAX_RESUME_POINTS` |
//! | route-less topics a bound source gives a stream | 256 by default; further unknown topics are dropped and counted | [`DEFAULT_MAX_UNROUTED_TOPICS`] |
//! | DP ranks of workers not registered yet that take events | 256 per partition (below `MAX_DP_SIZE`); released when the worker is registered or removed | [`MAX_PENDING_RANKS`] |
//! | remote query timeouts | connect 50 ms, request 200 ms by default; at least 1 ms | [`DEFAULT_CONNECT_TIMEOUT`], [`DEFAULT_REQUEST_TIMEOUT`], `index::remote` `MIN_TIMEOUT` |
//! | remote response body | 32 MiB; at most 32 idle connections kept | `index::remote` `MAX_RESPONSE_BYTES`, `MAX_IDLE_CONNECTIONS` |
//!
//! # C ABI (`kvr-ffi`)
//!
//! | limit | value | where |
//! |---|---|---|
//! | a worker's control endpoint | at most 511 bytes; `kvr_kv_hint.control_endpoint` is 512 bytes with its NUL | `KVR_CONTROL_ENDPOINT_MAX_LEN`, `KVR_CONTROL_ENDPOINT_CAP` |
//! | ranges accepted from one shared-cache hook call | 65,536 (more = a failed lookup); 64 offered room first | `ffi/src/hooks.rs` `MAX_SHARED_RANGES`, `SHARED_RANGES` |
//! | decode-error kinds reported per stream | 16 slots | `KVR_DECODE_ERROR_KINDS` |
//!
//! # Other
//!
//! | limit | value | where |
//! |---|---|---|
//! | stripes of the per-partition selection counter | 8 | `counter::STRIPES` |
//! | per-thread RNGs and id blocks remembered | 8 engines per thread | `engine::RNGS_PER_THREAD` |
//!
//! [`MAX_RANKS`]: crate::index::MAX_RANKS
//! [`MAX_RESERVED_BLOCKS`]: crate::index::MAX_RESERVED_BLOCKS
//! [`MAX_RESERVED_BLOCKS_PER_INDEX`]: crate::index::MAX_RESERVED_BLOCKS_PER_INDEX
//! [`MAX_INGRESS_STREAMS`]: crate::ingress::MAX_INGRESS_STREAMS
//! [`MAX_PENDING_RANKS`]: crate::ingress::MAX_PENDING_RANKS
//! [`DEFAULT_MAX_UNROUTED_TOPICS`]: crate::ingress::DEFAULT_MAX_UNROUTED_TOPICS
//! [`MAX_REPLICA_BOOKING_TTL`]: crate::partition::MAX_REPLICA_BOOKING_TTL
//! [`Tier`]: crate::ids::Tier
//! [`IndexConfig::shards`]: crate::index::IndexConfig::shards
//! [`IndexConfig::min_shard_capacity`]: crate::index::IndexConfig::min_shard_capacity
//! [`WorkerId`]: crate::ids::WorkerId
//! [`DpRank`]: crate::ids::DpRank
//! [`SelectionId`]: crate::ids::SelectionId
//! [`MAX_PER_BOOKING`]: crate::reservation::MAX_PER_BOOKING
//! [`ReservationConfig::shards`]: crate::reservation::ReservationConfig::shards
//! [`ReservationConfig::default_ttl`]: crate::reservation::ReservationConfig::default_ttl
//! [`ReservationConfig::sweep_interval`]: crate::reservation::ReservationConfig::sweep_interval
//! [`ReservationConfig::recently_freed_per_shard`]: crate::reservation::ReservationConfig::recently_freed_per_shard
//! [`SessionConfig::max_entries`]: crate::session::SessionConfig::max_entries
//! [`SessionConfig::shards`]: crate::session::SessionConfig::shards
//! [`SessionConfig::max_session_id_bytes`]: crate::session::SessionConfig::max_session_id_bytes
//! [`SessionConfig::idle_ttl`]: crate::session::SessionConfig::idle_ttl
//! [`SessionConfig::early_release_memory`]: crate::session::SessionConfig::early_release_memory
//! [`MIN_ENTRIES_PER_SHARD`]: crate::session::MIN_ENTRIES_PER_SHARD
//! [`EARLY_RELEASE_WINDOW`]: crate::session::EARLY_RELEASE_WINDOW
//! [`MAX_PAYLOAD_BYTES`]: crate::ingress::decode::MAX_PAYLOAD_BYTES
//! [`DEFAULT_CONNECT_TIMEOUT`]: crate::index::remote::DEFAULT_CONNECT_TIMEOUT
//! [`DEFAULT_REQUEST_TIMEOUT`]: crate::index::remote::DEFAULT_REQUEST_TIMEOUT
