//! Target: arbitrary bytes → Dynamo's replica-sync booking decoder (`kvr_replica::dynamo_wire`).
//!
//! No panic; whatever decodes re-encodes (Dynamo's map form) to bytes that decode to the
//! same event, and a second encoding is byte for byte the first (the writer's form is
//! canonical).

use kvr_replica::dynamo_wire::{decode, encode};

/// Panics on a finding.
pub fn run(data: &[u8]) {
    let Ok(ev) = decode(data) else {
        return;
    };
    let bytes = encode(&ev);
    let again = decode(&bytes).unwrap_or_else(|e| panic!("re-encoded event does not decode: {e}"));
    assert_eq!(again, ev, "the round trip changed the event");
    assert_eq!(encode(&again), bytes, "a second encoding differs");
}
