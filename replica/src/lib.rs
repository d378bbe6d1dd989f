//! Router replicas that share their bookings.
//!
//! Several kvr routers in front of the same workers all see the same KV events, so their
//! prefix indexes agree; their bookings (the load each has put on a worker) do not, unless
//! they tell each other. This crate carries booking lifecycle events between replicas:
//! [`dynamo_wire`] is NVIDIA Dynamo 1.6.1's replica-sync format and [`DynamoSync`] its
//! sockets, so kvr and Dynamo replicas can run side by side; [`jetstream`] is kvr's own
//! sync over NATS JetStream, which replays what a replica missed; the host applies peers'
//! events through a [`BookingSink`].

pub mod dynamo_sync;
pub mod dynamo_wire;
pub mod event;
pub mod jetstream;
mod peers;
pub mod stats;

pub use dynamo_sync::{BookingSink, DynamoSync, DEFAULT_PEER_SILENCE};
pub use event::{AddRequest, BookingEvent, EventData};
pub use jetstream::{JetStreamConfig, JetStreamStats, JetStreamSync};
pub use peers::MAX_TRACKED_BOOKINGS;
pub use stats::{Applied, SyncStats};
