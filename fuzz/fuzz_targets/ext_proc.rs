//! Target (e): sequences of Envoy ext_proc streams → `kvr epp`'s exchanges, in-process
//! (logic and input format: `kvr_fuzz::ext_proc`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvr_fuzz::ext_proc::run(data));
