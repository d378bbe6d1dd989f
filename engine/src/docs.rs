//! Invariants and memory ordering (filled in below).
