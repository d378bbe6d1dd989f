//! Shared by the integration tests: a seeded RNG, the naive reference model of the index,
//! and small prompts on a partition.
//!
//! Each test binary uses a different part of this module.
#![allow(dead_code)]

pub(crate) mod model;
pub(crate) mod partition;
pub(crate) mod rng;
