//! Ingress: engines' KV events from the wire into the index (DESIGN.md §10,
//! REFERENCE.md §2).
//!
//! The path: ZMQ frames (`transport`, behind the default `zmq` feature) → per-publisher
//! sequence tracking (gaps, restarts, replay) → msgpack payload decoding (`decode`) →
//! events applied to a partition's index (local hashes computed from the tokens) → per
//! worker counters.

pub mod decode;
pub mod encode;
pub mod ingest;
pub mod sequence;
#[cfg(feature = "zmq")]
pub mod subscribe;
#[cfg(feature = "zmq")]
pub mod transport;
