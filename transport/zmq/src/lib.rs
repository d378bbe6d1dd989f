//! kvr's ZMQ subscriber: engines' KV events from vLLM/SGLang-style ZMQ PUB sockets into a
//! kvr partition (REFERENCE.md §2, DESIGN.md §10).
//!
//! Two layers, both built on the engine's public API:
//! - [`transport`]: the ZMQ SUB socket (and the replay DEALER), every subscription of the
//!   process on one shared ingest thread, handing raw `[topic, seq, payload]` frames to a
//!   [`transport::FrameSink`]. It knows nothing about events.
//! - [`subscribe`](mod@subscribe): a subscription of a [`kvr::Partition`]: the transport's
//!   frames go to the engine's [`kvr::ingress::EventSource`], which keeps every
//!   publisher's stream and asks the transport for a replay when a stream needs one.
//!
//! What a message means (which publisher sent it, sequence tracking, gaps, restarts,
//! replay bookkeeping, idle probes, decoding, applying, counters) is the engine's
//! (`kvr::ingress`); this crate only opens sockets and moves frames.

pub mod subscribe;
pub mod transport;

pub use transport::StartGate;

pub use subscribe::{
    subscribe, subscribe_with, validate, SubscribeConfig, SubscribeOptions, Subscription,
};
