//! The service's robustness tests, one test binary: each file below is a module (the
//! server in-process, the hand-written HTTP client and the child publisher are shared,
//! from `common/`). One binary rather than six: each of them instantiated the whole HTTP
//! stack again, and compiling them was most of the service's test build.

// Each module uses part of the shared helpers (and of their imports); for all of them:
#![allow(dead_code, unused_imports)]

include!("../common/robustness.rs");
include!("../common/publisher.rs");

mod connections;
mod event_endpoints;
mod killed_publisher;
mod malformed_bodies;
mod peer_recovery;
mod source_health;
