//! `kvr._kvr`: the native half of the `kvr` Python package (python/kvr/ is the other).
//!
//! - [`service`]: `SelectionService`'s core, the HTTP service's operations (kvr-service's
//!   `App`) called without HTTP, dicts in and out, so its answers are `kvr serve`'s.
//! - [`engine`]: the typed hot path (`Engine`, `Partition`, `Decision`); [`state`] keeps a
//!   partition's index on disk for a warm restart.
//! - [`tokens`]: token arrays from lists or any buffer (zero-copy where the layout allows).
//! - [`hash`]: `hash_tokens`, Dynamo's `compute_block_hash_for_seq`.
//! - [`errors`]: `ValueError` for bad input, `SelectionServiceError` for the rest.
//!
//! Every call that does engine work releases the GIL (`Python::detach`); nothing panics
//! across the boundary (a panic in a call becomes pyo3's `PanicException`, and the calls
//! check their input first).

mod buffer;
mod engine;
mod errors;
mod hash;
mod service;
mod state;
mod tokens;

use pyo3::prelude::*;

#[pymodule]
fn _kvr(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<service::NativeService>()?;
    m.add_class::<engine::Engine>()?;
    m.add_class::<engine::Partition>()?;
    m.add_class::<engine::Decision>()?;
    m.add_function(wrap_pyfunction!(hash::hash_tokens, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
