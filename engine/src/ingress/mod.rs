//! Ingress: engines' KV events from the wire into the index (DESIGN.md §10,
//! REFERENCE.md §2), and what a transport needs to bring them.
//!
//! The path: a publisher's `[topic, seq, payload]` messages → per-publisher sequence
//! tracking (gaps, restarts, replay: `sequence`) → the door (`door`): decode and count
//! (`decode`), translate into [`KvEvent`](crate::KvEvent)s with kvr's local hashes
//! (`translate`), apply to the sink's index → per stream counters (`counters`).
//!
//! The engine reads no socket. Messages come in three ways, all through the one door:
//! - an [`EventSource`] a transport keeps per subscription: every publisher's
//!   bookkeeping (stream identity, last heard, idle probes, replay state) is the
//!   source's, and the transport only moves bytes (kvr's own ZMQ subscriber, `kvr-zmq`,
//!   is one; a test's in-process channel is another);
//! - the partition's `ingest` (a host that reads the sockets itself, message by
//!   message, without replay);
//! - the partition's `apply_events` (typed events).

pub(crate) mod counters;
mod decode;
pub(crate) mod door;
mod groups;
pub(crate) mod health;
pub(crate) mod registry;
pub(crate) mod sequence;
mod source;
mod stream;
mod translate;

pub use counters::StreamCounters;
// The loom models build their payloads with the decoder tests' msgpack fixture.
#[cfg(all(test, loom))]
pub(crate) use decode::fixture;
pub use decode::{
    decode_batch, starts_with_clear, DecodeError, DecodeErrorKind, DecodedBatch, DecodedEvent,
    Medium, SpecKind, MAX_PAYLOAD_BYTES,
};
pub use door::EventSink;
pub use health::{HealthReason, SourceHealth};
pub use registry::{MAX_INGRESS_STREAMS, MAX_PENDING_RANKS};
pub use sequence::ReplayResult;
pub use source::{
    EventSource, SourceAction, SourceRefused, TopicRoute, DEFAULT_MAX_UNROUTED_TOPICS,
};
