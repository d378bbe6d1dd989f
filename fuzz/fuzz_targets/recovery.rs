//! Target (e): loss / reorder / restart / replay schedules → replay-enabled ingress
//! streams → index, against the publishers' truth (logic and input format:
//! `kvr_fuzz::recovery`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvr_fuzz::recovery::run(data));
