//! Shared by the integration tests: a seeded RNG, the naive reference model of the index,
//! and small prompts on a partition.
//!
//! Each test binary uses a different part of this module.
#![allow(dead_code)]

pub mod model;
pub mod partition;
pub mod rng;
