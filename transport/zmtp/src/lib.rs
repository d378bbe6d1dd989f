//! A small ZMTP 3.1 transport for exactly one PUB and one SUB socket type over TCP, written
//! for links with libzmq peers (NVIDIA Dynamo's router replica sync): it answers libzmq's
//! heartbeats (PING with PONG), sends its own and drops silent peers, which the pure-Rust
//! `zeromq` crate does not.
//!
//! What it speaks: the 3.1 greeting with the NULL mechanism; READY with `Socket-Type`
//! (PUB with SUB/XSUB, SUB with PUB/XPUB); subscriptions as SUBSCRIBE/CANCEL commands (3.1)
//! or `0x01`/`0x00`-prefixed messages (3.0 peers); two-frame messages `[topic, payload]`.
//! Everything a peer sends is bounded (frame size, subscriptions, queues), and malformed
//! input closes that connection with a counter, never the socket.
//!
//! Both sockets run as tasks on the caller's tokio runtime (multi-thread).
//!
//! Choices where the protocol or Dynamo leaves room, made as a libzmq user would expect:
//! - [`Subscriber::connect`] refuses `ipc://`, `inproc://` and the host `*` (they parse,
//!   as in Dynamo, whose connect then fails the same way);
//! - a connection is closed after `heartbeat_timeout` without traffic whatever TTL the
//!   peer announces;
//! - the Subscriber also filters by topic locally (as libzmq's SUB does), counting what it
//!   drops, and drops the newest message when its channel is full;
//! - the Publisher drops a message for a subscriber whose queue is full (libzmq's PUB at
//!   its high-water mark) and discards queued messages on close (Dynamo's linger 0).

mod config;
mod endpoint;
mod frame;
mod greeting;
mod link;
mod publisher;
mod stats;
mod subscriber;
mod subscriptions;

pub use config::ZmtpConfig;
pub use endpoint::{parse_endpoint, Endpoint, EndpointError};
pub use publisher::Publisher;
pub use stats::{PublisherStats, SubscriberStats};
pub use subscriber::{Message, Subscriber};
