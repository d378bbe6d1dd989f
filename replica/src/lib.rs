//! Router replicas that share their bookings.
//!
//! Several kvr routers in front of the same workers all see the same KV events, so their
//! prefix indexes agree; their bookings (the load each has put on a worker) do not, unless
//! they tell each other. This crate carries booking lifecycle events between replicas:
//! [`dynamo_wire`] is NVIDIA Dynamo 1.6.1's replica-sync format, so kvr and Dynamo
//! replicas can run side by side.

pub mod dynamo_wire;
pub mod event;

pub use event::{AddRequest, BookingEvent, EventData};
