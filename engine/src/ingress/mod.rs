//! Ingress: engines' KV events from the wire into the index (DESIGN.md §10,
//! REFERENCE.md §2).
//!
//! The path: a publisher's `[topic, seq, payload]` messages → per-publisher sequence
//! tracking (gaps, restarts, replay: `sequence`) → msgpack payload decoding (`decode`) →
//! events applied to a partition's index (local hashes computed from the tokens) → per
//! worker counters (`ingest`).
//!
//! The engine reads no socket. Messages come in through [`Partition::ingest`] (a host that
//! reads the sockets itself) or through an [`ingest::IngressStream`] a transport keeps per
//! publisher, with replay: kvr's own ZMQ subscriber is such a transport, in the `kvr-zmq`
//! crate (transport/zmq).
//!
//! [`Partition::ingest`]: crate::partition::Partition::ingest

mod decode;
mod groups;
pub(crate) mod ingest;
pub(crate) mod sequence;

pub use decode::{
    decode_batch, DecodeError, DecodeErrorKind, DecodedBatch, DecodedEvent, Medium, SpecKind,
    MAX_PAYLOAD_BYTES,
};
pub use ingest::{EventSink, IngestOutcome, IngressRegistry, IngressStream};
pub use sequence::ReplayResult;
