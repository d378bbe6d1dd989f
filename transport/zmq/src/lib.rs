//! kvr's ZMQ subscriber: engines' KV events from vLLM/SGLang-style ZMQ PUB sockets into a
//! kvr partition (REFERENCE.md §2, DESIGN.md §10).
//!
//! Two layers, both built on the engine's public API:
//! - [`transport`]: the ZMQ SUB socket (and the replay DEALER) on a thread of its own,
//!   handing raw `[topic, seq, payload]` frames to a [`transport::FrameSink`]. It knows
//!   nothing about events.
//! - [`subscribe`](mod@subscribe): a subscription of a [`kvr::Partition`], whose sink keeps one
//!   engine [`kvr::ingress::IngressStream`] per publisher (connect mode: one; bind
//!   mode: one per topic) and asks the transport for a replay when the stream says so.
//!
//! What a message means (sequence tracking, gaps, restarts, replay bookkeeping, decoding,
//! applying, counters) stays the engine's (`kvr::ingress`); this crate only moves frames.
//! It was the engine's default feature `zmq` (`kvr::ingress::{transport, subscribe}`)
//! until the engine shed its network dependencies (tokio, zeromq).

pub mod subscribe;
pub mod transport;

pub use subscribe::{
    subscribe, subscribe_with, validate, SubscribeConfig, SubscribeOptions, Subscription,
    TopicRoute,
};
