//! Shared by the index integration tests: a seeded RNG and the naive reference model.
//!
//! Each test binary uses a different part of this module.
#![allow(dead_code)]

pub mod model;
pub mod rng;
