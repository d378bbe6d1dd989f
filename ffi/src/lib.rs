//! kvr's C ABI: the typed shell over the engine that `include/kvr.h`
//! declares and `ffi/libkvr` builds into `libkvr.a` / `libkvr.so`.
//!
//! The path of data is the engine's: workers and load ([`workers`]) and KV events
//! ([`index`]) go in, under the partition's indexer policy ([`indexer`]); lookups
//! ([`index`]) and selections ([`select`]) come out, steered by session affinity
//! ([`session`]) and carrying transfer hints ([`hint`]); bookings are freed through the
//! engine ([`select`]); host hooks ([`hooks`]) and statistics ([`stats`]) hang off a
//! partition ([`handles`]), whose options choose the cost model and its knobs
//! ([`cost`]) and may keep its index on disk for a warm restart ([`state`]). Engines' own
//! KV-event messages come in raw through the host ([`ingress`]) or through kvr's own ZMQ
//! subscriber ([`subscribe`]).
//!
//! Conventions, everywhere:
//! - every symbol starts with `kvr_`; handles are opaque; option and builder objects are
//!   opaque with setters, so fields can be added without breaking the ABI;
//! - every fallible function returns a `kvr_status` (0 = OK; numbers are never reused;
//!   `kvr_status_str` names them; `kvr_status_count` counts them); results go to
//!   out-parameters; there is no thread-local "last error" (Go moves goroutines between
//!   threads);
//! - slices are `(pointer, length)`: `(NULL, 0)` is empty, `(NULL, n > 0)` is
//!   `KVR_ERR_NULL`; strings are UTF-8 `(pointer, length)`, not NUL-terminated;
//! - the caller owns every output buffer; a too-small buffer gets `KVR_BUFFER_TOO_SMALL`
//!   and the size needed; `*_free(NULL)` is a no-op;
//! - a function taking a `const` handle may be called concurrently on that handle
//!   (wasmtime's rule); a non-`const` one needs it exclusively;
//! - every body runs inside a panic boundary: a panic returns `KVR_ERR_PANIC`, never
//!   unwinds into the host, and the engine keeps serving;
//! - the routing path (`kvr_partition_select`, the lookups, hashing) allocates nothing
//!   once a thread has warmed up; booking stores the prompt's block list.

#![allow(clippy::missing_safety_doc)] // each export's `# Safety` is in its doc comment

pub mod cost;
pub mod handles;
pub mod hint;
pub mod hooks;
pub mod index;
pub mod indexer;
pub mod ingress;
pub mod kept;
pub mod request;
pub mod select;
pub mod session;
pub mod state;
pub mod stats;
pub mod status;
pub mod subscribe;
pub mod workers;

pub use cost::*;
pub use handles::*;
pub use hint::*;
pub use hooks::*;
pub use index::*;
pub use indexer::*;
pub use ingress::*;
pub use kept::*;
pub use request::*;
pub use select::*;
pub use session::*;
pub use state::*;
pub use stats::*;
pub use status::*;
pub use subscribe::*;
pub use workers::*;
