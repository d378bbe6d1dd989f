//! Target (b): raw engine messages → `Partition::ingest` → index, differential against the
//! naive model (logic and input format: `kvr_fuzz::ingest_frames`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvr_fuzz::ingest_frames::run(data));
