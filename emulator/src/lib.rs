//! kvr-emulator: what plays an inference engine against kvr without a GPU. For now the
//! engines' KV-event wire format ([`BatchEncoder`]): batches as vLLM publishes them, which
//! kvr's real ingress path decodes. The trace simulator (`kvr replay`), the benchmarks,
//! the fuzzers and the tests feed kvr through it.

#![warn(missing_docs)]

mod wire;

pub use wire::{BatchEncoder, WireExtraKey};
