//! Token arrays from Python: a buffer of `u32` ("I") is read in place; a buffer of other
//! integer types is checked and widened or narrowed into a vector; anything else is read
//! as a sequence of ints. Every value must fit a `u32` (ValueError otherwise).

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::buffer::View;

/// A prompt's tokens, borrowed from a buffer or owned.
pub(crate) enum Tokens {
    /// A held buffer of native u32s (read in place, no copy).
    Borrowed(View),
    Owned(Vec<u32>),
}

impl Tokens {
    pub(crate) fn as_slice(&self) -> &[u32] {
        match self {
            Tokens::Owned(v) => v,
            Tokens::Borrowed(view) => {
                let b = view.bytes();
                // SAFETY: checked in `from_view`: format "I"/"L"-of-4 with itemsize 4 and
                // a 4-aligned start, so the bytes are whole, aligned u32s.
                unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u32>(), b.len() / 4) }
            }
        }
    }
}

fn out_of_range(v: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("token {v} is not a u32 (0..=4294967295)"))
}

/// Decodes `n`-byte native integers, signed or not, into u32s (range-checked).
fn widen<const N: usize>(bytes: &[u8], signed: bool) -> PyResult<Vec<u32>> {
    let mut out = Vec::with_capacity(bytes.len() / N);
    for c in bytes.chunks_exact(N) {
        let mut b = [0u8; 8];
        b[..N].copy_from_slice(c);
        let v: i128 = if signed {
            // Sign-extend the N-byte value.
            let shift = 64 - 8 * N as u32;
            i128::from((i64::from_ne_bytes(b) << shift) >> shift)
        } else {
            i128::from(u64::from_ne_bytes(b))
        };
        out.push(u32::try_from(v).map_err(|_| out_of_range(v))?);
    }
    Ok(out)
}

fn from_view(view: View) -> PyResult<Tokens> {
    if view.ndim() > 1 {
        return Err(PyValueError::new_err("tokens must be one-dimensional"));
    }
    let size = view.itemsize();
    let format = view.format().to_owned();
    let signed = match format.as_str() {
        "b" | "h" | "i" | "l" | "q" | "n" => true,
        "B" | "H" | "I" | "L" | "Q" | "N" => false,
        other => {
            return Err(PyValueError::new_err(format!(
                "tokens must be integers, not buffer format {other:?}"
            )))
        }
    };
    let bytes = view.bytes();
    if !signed && size == 4 && (bytes.as_ptr() as usize).is_multiple_of(4) {
        return Ok(Tokens::Borrowed(view));
    }
    let v = match size {
        1 => widen::<1>(bytes, signed)?,
        2 => widen::<2>(bytes, signed)?,
        4 => widen::<4>(bytes, signed)?,
        8 => widen::<8>(bytes, signed)?,
        n => return Err(PyValueError::new_err(format!("unsupported item size {n}"))),
    };
    Ok(Tokens::Owned(v))
}

/// Tokens from a buffer or a sequence of ints.
pub(crate) fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Tokens> {
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>()
    {
        return Err(PyValueError::new_err(
            "tokens must be a sequence of ints or an integer array, not str/bytes",
        ));
    }
    if let Some(view) = View::get(obj) {
        return from_view(view);
    }
    if let Some(v) = from_list(obj) {
        return Ok(Tokens::Owned(v));
    }
    let iter = obj
        .try_iter()
        .map_err(|_| PyValueError::new_err("tokens must be a sequence of ints"))?;
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for item in iter {
        let item = item?;
        let v: i128 = item.extract().map_err(|_| {
            PyValueError::new_err(format!(
                "tokens must be ints, got {}",
                item.get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        })?;
        out.push(u32::try_from(v).map_err(|_| out_of_range(v))?);
    }
    Ok(Tokens::Owned(out))
}

/// The hot case: a list of ints that all fit a u32 (`None` otherwise: the caller takes
/// the general path, which also words the error). Raw C-API reads: through pyo3's
/// `Bound` wrappers each item cost a reference count round trip and a type check on top
/// of the conversion, most of an 8k-token call.
pub(crate) fn from_list(obj: &Bound<'_, PyAny>) -> Option<Vec<u32>> {
    let list = obj.cast::<pyo3::types::PyList>().ok()?;
    let py = obj.py();
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let i = ffi::Py_ssize_t::try_from(i).ok()?;
        // SAFETY: the GIL is held (`obj` is a Bound) and `i` is below the length read
        // with it; nothing in this loop runs Python code (PyLong_AsUnsignedLong reads an
        // int's value without calling into Python, and refuses anything else), so the
        // list cannot change while the borrowed item is read.
        let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), i) };
        if item.is_null() {
            let _ = PyErr::take(py);
            return None;
        }
        // SAFETY: `item` is a live object borrowed from the list (above).
        // `bool` is an int subclass: refused, as serde refuses it for u32.
        if unsafe { ffi::PyBool_Check(item) } != 0 {
            return None;
        }
        // SAFETY: as above; the call sets an exception for a non-int or a negative or
        // too large value, which is taken here.
        let v = unsafe { ffi::PyLong_AsUnsignedLong(item) };
        if v == std::ffi::c_ulong::MAX && PyErr::take(py).is_some() {
            return None;
        }
        out.push(u32::try_from(v).ok()?);
    }
    Some(out)
}
