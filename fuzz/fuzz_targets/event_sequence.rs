//! Target (c): a structured sequence of typed index operations → `Index`, differential
//! against the naive model (logic and input format: `kvr_fuzz::event_sequence`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvr_fuzz::event_sequence::run(data));
