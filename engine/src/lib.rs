//! kvr: an in-process selection engine for KV-cache-aware LLM inference routing, with
//! lock-free index lookups: `find_matches` and the tiered queries take no lock and never
//! wait for a writer. Everything that changes state takes mutexes, sharded where frequent (events:
//! per rank and per index shard; bookings: per booking shard and per rank, plus with
//! events off or a prediction index the rank's recorder mutex; membership and
//! load publishing: one per partition), and selection itself reads a booked rank's
//! prompt-block refcounts and a session's entry under their mutexes. The per-path table
//! is [`docs::locking`].
//!
//! The path of data: engines' KV events → [`index`] (which rank holds which prompt block)
//! → lookup (overlap per rank) → cost → booking. This crate is the engine only: no I/O,
//! no C, no HTTP, no sockets; `kvr-ffi` and `kvr-cli` wrap it. The transports are crates
//! of their own that use the engine's public API: `kvr-zmq` (transport/zmq: kvr's ZMQ
//! subscriber, feeding a partition through [`ingress::ingest::IngressStream`]) and
//! `kvr-remote` (transport/http: the HTTP client of a remote primary, implementing
//! [`index::RemoteIndex`]).
//!
//! Block hashes follow NVIDIA Dynamo's scheme ([`hash`]); the index reproduces the
//! semantics of Dynamo's radix index with a flat, lock-free-read layout ([`index`]); the
//! invariants and memory orderings are argued in [`docs`].
//!
//! # Using it
//!
//! The types a host needs are at the root: an [`Engine`] of partitions ([`PartitionKey`],
//! [`PartitionConfig`]) with their workers ([`WorkerInfo`]); KV events ([`KvEvent`]) into
//! a partition ([`Partition::apply_events`], or raw engine messages with
//! [`Partition::ingest`]); selection ([`SelectRequest`] → [`Outcome`] / [`Decision`]) and
//! the booking lifecycle by [`SelectionId`]. Everything else lives in sub-modules named
//! along the data path — [`ids`], [`hash`], [`index`] (with the indexer policy in
//! [`indexer`]), [`load`], [`cost`], [`reservation`], [`session`], [`select`],
//! [`partition`], [`engine`] — and each layer imports only the ones before it
//! (`tests/check-module-cycles.py` fails CI on a cycle).

pub mod config;
pub mod cost;
pub(crate) mod counter;
pub mod docs;
pub mod engine;
mod fields;
pub mod hash;
pub mod hooks;
pub(crate) mod idmap;
pub mod ids;
pub mod index;
pub mod indexer;
pub mod ingress;
pub mod load;
pub mod partition;
pub(crate) mod prefetch;
pub(crate) mod recycle;
pub mod reservation;
pub mod select;
pub mod session;
pub(crate) mod sync;
pub mod workers;

#[cfg(all(test, loom))]
mod loom_models;

pub use config::{ConfigError, PartitionConfig};
pub use engine::{Engine, EngineError};
pub use fields::{FieldList, FieldNames, FIELD_LISTS};
pub use hooks::HostHooks;
pub use ids::{DpRank, PartitionKey, RankId, Tier, WorkerId};
pub use index::{KvEvent, StoredBlock};
pub use indexer::IndexerConfig;
pub use partition::Partition;
pub use reservation::{FreeOutcome, SelectionId};
pub use select::{Decision, Outcome, Prompt, SelectError, SelectRequest};
pub use session::SessionContext;
pub use workers::{BackendRole, WorkerError, WorkerInfo};
