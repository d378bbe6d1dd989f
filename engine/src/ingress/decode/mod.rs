//! vLLM / SGLang `KVEventBatch` msgpack payloads (REFERENCE.md §2, DESIGN.md §10).
//!
//! A payload is one msgpack array `[ts, events, data_parallel_rank]`. Each event is either a
//! tagged map (current vLLM: `{"type": "BlockStored", "block_hashes": [...], ...}`, any
//! field may be absent, keys in any order) or a positional array (older vLLM and SGLang:
//! `["BlockStored", block_hashes, parent_block_hash, ...]`, trailing defaults omitted).
//! Both encodings are accepted in the same batch; unknown keys and extra trailing fields
//! (newer engine versions) are skipped, whatever their type.
//!
//! [`decode_batch`] reads with `rmp`'s low-level reader over the payload slice and writes
//! into a caller-owned [`DecodedBatch`]: events refer to ranges of its shared `hashes`,
//! `tokens` and `text` buffers, so a reused batch decodes without allocating once its
//! buffers have grown to the workload's size (no per-event or per-block allocation).
//!
//! Guards: every length prefix is checked against the bytes left in the payload before
//! anything is read or reserved; unknown values are skipped by an iterative skipper (a
//! count of pending values, no recursion, so nesting depth cannot exhaust the stack); all
//! arithmetic on wire-supplied numbers is checked; no input panics (fuzzed: `fuzz/`).
//!
//! Every listed field of an event is decoded and type-checked even when it is not kept
//! (`lora_id`, `extra_keys`, `group_idx`, `kv_cache_spec_*`, `locality`, `ownership`,
//! `session_id`, `lookahead_token_ids`): a payload whose known fields have the wrong
//! types is rejected rather than half-understood.

mod batch;
mod cursor;
mod error;
mod event;
mod payload;

pub use batch::{DecodedBatch, DecodedEvent, Medium, SpecKind, MAX_PAYLOAD_BYTES};
pub use error::{DecodeError, DecodeErrorKind};
pub use payload::decode_batch;
pub use payload::starts_with_clear;

#[cfg(test)]
pub(crate) mod fixture;
#[cfg(all(test, not(loom)))]
mod tests;
