//! The logic of kvr's fuzz targets, one module per target; `fuzz_targets/<name>.rs` is a
//! thin libFuzzer wrapper around `<name>::run`, and `tests/replay.rs` runs every committed
//! seed (`seeds/<name>/`) and kept crasher (`regressions/<name>/`) through the same
//! function on stable: `cargo test --manifest-path fuzz/Cargo.toml`.
//!
//! - [`decode`]: arbitrary bytes → the msgpack payload decoder (no panic, invariants,
//!   re-encoding round trip).
//! - [`ingest_frames`]: a sequence of raw engine messages (worker, stream, seq, payload)
//!   → `Partition::ingest` → index, differential against the naive model.
//! - [`event_sequence`]: a structured sequence of typed index operations → `Index`,
//!   differential against the naive model.
//! - [`recovery`]: loss / reorder / restart / replay schedules → replay-enabled ingress
//!   streams → index, never overcounting the publishers' truth once quiescent.
//! - [`ext_proc`]: sequences of Envoy ext_proc streams → `kvr epp`'s exchanges (documented
//!   statuses and counters per refusal, routes within the pool and the subset hint, no
//!   booking left after any stream).
//! - [`replica_wire`]: arbitrary bytes → Dynamo's replica-sync booking decoder (no panic,
//!   a canonical re-encoding round trip).
//! - [`service_bodies`]: a route selector and arbitrary bytes → `kvr serve`'s axum router
//!   in-process (no panic, no 5xx but the documented 503s, JSON `{"error"}` on every 4xx;
//!   the hand-read `token_ids` agree with serde on every body).
//!
//! Every target panics on a finding; a panic is the only way they report one.

pub mod check;
pub mod decode;
pub mod event_sequence;
pub mod ext_proc;
pub mod ingest_frames;
pub mod recovery;
pub mod replica_wire;
pub mod service_bodies;

/// The naive reference model of the index, shared with the engine's differential test.
#[allow(dead_code)]
#[path = "../../engine/tests/common/model.rs"]
pub mod model;
