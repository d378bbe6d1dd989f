//! kvr: an in-process selection engine for KV-cache-aware LLM inference routing, with
//! lock-free index lookups: [`Index::find_matches`] and the tiered queries take no lock
//! and never wait for a writer. Everything that changes state takes mutexes, sharded where
//! frequent (events: per rank and per index shard; bookings: per booking shard and per
//! rank, plus with events off or a prediction index the rank's recorder mutex; membership
//! and load publishing: one per partition), and selection itself reads a booked rank's
//! prompt-block refcounts and a session's entry under their mutexes.
//!
//! The path of data: engines' KV events → the [`Index`] (which rank holds which prompt
//! block) → lookup (overlap per rank) → cost → booking. This crate is the engine only: no
//! I/O, no C, no HTTP, no sockets. The hosts and transports are crates of their own over
//! this public API: `kvr-ffi` (the C ABI), `kvr-service` (`kvr serve`), `kvr-zmq` (kvr's
//! ZMQ subscriber, feeding a partition through [`ingress`]) and `kvr-remote` (the HTTP
//! client of a remote primary, implementing [`RemoteIndex`]).
//!
//! # Using it
//!
//! The types a host needs are at the root: an [`Engine`] of partitions ([`PartitionKey`],
//! [`config::PartitionConfig`]) with their workers ([`WorkerInfo`]); KV events
//! ([`KvEvent`]) into a partition ([`Partition::apply_events`], or raw engine messages
//! with [`Partition::ingest`]); selection ([`SelectRequest`] → [`Outcome`] /
//! [`Decision`]) and the booking lifecycle by [`SelectionId`]. Five modules group the
//! rest: [`config`] (every configuration), [`stats`] (every counter snapshot), [`hash`]
//! (Dynamo-compatible block hashing), [`cost`] (the selection cost as pure functions, for
//! simulators) and [`ingress`] (what an event transport needs). Every type has one public
//! name.
//!
//! # Layers
//!
//! Inside, the modules are named along the data path, and each imports only modules of
//! lower floors (`tests/check-layers.py` reads this list and fails on any other import):
//!
//! ```text
//!     floor 0: sync docs
//!     floor 1: counter prefetch recycle table
//!     floor 2: ids idmap
//!     floor 3: hash
//!     floor 4: index
//!     floor 5: load reservation session freshness lookahead cost workers hooks
//!     floor 6: indexer
//!     floor 7: config
//!     floor 8: select ingress
//!     floor 9: partition
//!     floor 10: engine
//!     floor 11: stats
//!     floor 12: fields
//! ```
//!
//! The invariants and memory orderings are argued in the crate-private `docs` modules
//! (`cargo doc -p kvr --document-private-items`).

#![warn(missing_docs, unnameable_types)]
// A loom build compiles only the models: the helpers other tests use are idle in it.
#![cfg_attr(loom, allow(dead_code, unreachable_pub))]

pub mod config;
pub mod cost;
pub mod hash;
pub mod ingress;
pub mod stats;

mod counter;
mod docs;
mod engine;
mod fields;
mod freshness;
mod hooks;
mod idmap;
mod ids;
mod index;
mod indexer;
mod load;
mod lookahead;
mod partition;
mod prefetch;
mod recycle;
mod reservation;
mod select;
mod session;
mod sync;
mod table;
mod workers;

#[cfg(feature = "testing")]
pub mod testing;

#[cfg(all(test, loom))]
mod loom_models;

pub use cost::config::CostOverrides;
pub use engine::{Engine, EngineError, PartitionRef};
pub use fields::{FieldList, FieldNames, FIELD_LISTS};
pub use freshness::StaleRanks;
pub use hooks::{
    BlockRange, HostHooks, LoraFilter, PrefillEstimator, PrefillQuery, SharedCacheLookup, TieBreak,
};
pub use ids::{DpRank, PartitionKey, RankId, SelectionId, Tier, WorkerId};
pub use index::{
    ApplyOutcome, DumpedStore, Index, IndexDump, IndexError, KvEvent, OverlapScores, RemoteError,
    RemoteIndex, StoredBlock, TieredOverlap, TieredScores, MAX_RANKS, MAX_RESERVED_BLOCKS,
    MAX_RESERVED_BLOCKS_PER_INDEX,
};
pub use indexer::RemoteClient;
pub use ingress::door::{EventsOutcome, IngestOutcome, Origin, StreamResume};
pub use load::{LoadSnapshot, LoadView, RankLoad};
pub use partition::{AppliedLog, Partition, MAX_REPLICA_BOOKING_TTL};
pub use reservation::{
    ActiveLoad, ActiveLoads, BookingOrigin, BookingRequest, BookingStatus, BookingView,
    ForgetListener, FreeOutcome, FreedBy, Released, ReservationError, ReservationTable,
    MAX_PER_BOOKING,
};
pub use select::{
    Decision, KvHint, Outcome, Overlap, Prompt, SelectError, SelectRequest, SessionRoute,
};
pub use session::SessionContext;
pub use workers::{
    BackendRole, WorkerError, WorkerInfo, WorkerSet, MAX_CONTROL_ENDPOINT_LEN, MAX_DP_SIZE,
};
