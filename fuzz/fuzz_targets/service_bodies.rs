//! Target (d): arbitrary request bodies → `kvr serve`'s routes through the axum router,
//! in-process (logic and input format: `kvr_fuzz::service_bodies`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvr_fuzz::service_bodies::run(data));
