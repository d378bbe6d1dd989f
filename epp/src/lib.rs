//! `kvr epp`: kvr as the endpoint picker (EPP) of a gateway. Envoy (or a gateway built on
//! it: Envoy Gateway, kgateway, Istio) asks it over ext_proc, per request, which
//! model-server endpoint to send the request to, following the Gateway API Inference
//! Extension's endpoint-picker protocol; kvr picks the rank that holds the prompt's
//! prefix at the least load, books the request there, and frees the booking when the
//! response ends or the stream breaks.
//!
//! Layers, importing one way: `pool` (membership) and `prompt` (bodies to token ids) →
//! `protocol` (ext_proc messages) → `picker` (the selection service's booking path) →
//! `exchange` (one request's stream) → `server` (gRPC, health, the HTTP API, shutdown).
//! The engine stays free of network code; the selection service (`kvr-service`) is the
//! state this host shares with `kvr serve`.

pub mod args;
pub mod exchange;
pub mod metrics;
pub mod picker;
pub mod pool;
pub mod prompt;
pub mod protocol;
pub mod server;

pub use args::EppArgs;
pub use server::{run, serve_with};
