//! Target (a): arbitrary bytes → the payload decoder (logic: `kvr_fuzz::decode`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvr_fuzz::decode::run(data));
