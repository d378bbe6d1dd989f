//! Target: arbitrary bytes → the replica-sync booking decoder (logic: `kvr_fuzz::replica_wire`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvr_fuzz::replica_wire::run(data));
