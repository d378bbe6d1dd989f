//! Errors as Dynamo's `SelectionService` raises them: bad input (the HTTP service's 400
//! and 422) is `ValueError`; the rest is `kvr.SelectionServiceError` with Dynamo's
//! `.kind` and `.status_code`.

use kvr_service::error::ApiError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// `kvr.SelectionServiceError` (defined in Python, kvr/_errors.py, so it pickles and
/// subclasses like any exception), looked up once.
static ERROR_TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Dynamo's `kind` for a status and message (as Dynamo 1.6.1 answers them: see
/// tests/python/test_differential.py).
pub(crate) fn kind_of(status: u16, message: &str) -> &'static str {
    match status {
        // A rank its worker does not have: Dynamo's sequence tracker answers it.
        404 if message.starts_with("Worker WorkerWithDpRank") => "sequence",
        404 => "not_found",
        409 => "conflict",
        429 => "overloaded",
        503 if message.starts_with("no endpoints available") => "scheduler",
        503 => "not_ready",
        _ => "internal",
    }
}

/// A `SelectionServiceError` of this kind and status.
pub(crate) fn service_error(py: Python<'_>, status: u16, kind: &str, message: &str) -> PyErr {
    let ty = match ERROR_TYPE.get_or_try_init(py, || {
        let t = py
            .import("kvr._errors")?
            .getattr("SelectionServiceError")?
            .cast_into::<PyType>()?;
        Ok::<_, PyErr>(t.unbind())
    }) {
        Ok(t) => t.bind(py),
        Err(e) => return e,
    };
    match ty.call1((message, kind, status)) {
        Ok(instance) => PyErr::from_value(instance),
        Err(e) => e,
    }
}

/// The Python exception of a service answer.
pub(crate) fn api_error(py: Python<'_>, e: &ApiError) -> PyErr {
    let status = e.status.as_u16();
    if status == 400 || status == 422 {
        return PyValueError::new_err(e.message.clone());
    }
    service_error(py, status, kind_of(status, &e.message), &e.message)
}
