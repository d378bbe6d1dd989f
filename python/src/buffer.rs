//! The buffer protocol through the stable ABI. pyo3's `PyBuffer` needs `Py_3_11` under
//! `abi3` (the buffer functions joined the limited API in 3.11), and this wheel is abi3
//! for 3.10: so the two functions and `Py_buffer` (the 3.11 limited API's layout, the
//! same struct CPython has had since 3.0) are declared here and called only on 3.11+;
//! on 3.10 [`crate::tokens`] reads the tokens through the sequence protocol instead.

use std::ffi::{c_char, c_int, c_void, CStr};

use pyo3::ffi;
use pyo3::prelude::*;

/// `Py_buffer`, as `Include/pybuffer.h` declares it.
#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

/// `PyBUF_C_CONTIGUOUS | PyBUF_FORMAT`: one C-contiguous run of items and their format.
const FLAGS: c_int = 0x0038 | 0x0004;

/// A held, C-contiguous view of an object's buffer; released on drop (with the GIL).
pub(crate) struct View {
    raw: Box<RawBuffer>,
}

// SAFETY: the view is only a pointer to memory its exporter keeps alive and unresized
// until PyBuffer_Release; `View` is released on the thread holding the GIL (drop), and
// shared read-only meanwhile.
unsafe impl Send for View {}
// SAFETY: as above: shared access only reads the items.
unsafe impl Sync for View {}

/// Whether this interpreter has the buffer functions in its stable ABI (3.11+).
pub(crate) fn available(py: Python<'_>) -> bool {
    py.version_info() >= (3, 11)
}

impl View {
    /// The object's C-contiguous buffer, or `None` when it has none (or not contiguous);
    /// the error such an attempt raised is cleared.
    pub(crate) fn get(obj: &Bound<'_, PyAny>) -> Option<Self> {
        if !available(obj.py()) {
            return None;
        }
        // SAFETY: a zeroed Py_buffer is a valid out-parameter (GetBuffer fills it).
        let mut raw: Box<RawBuffer> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: `obj` is a live object and the GIL is held (its Bound proves both);
        // the function is in the stable ABI from 3.11, checked above.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *raw, FLAGS) };
        if rc != 0 {
            // Not a buffer, or not C-contiguous: the caller takes the sequence path.
            let _ = PyErr::take(obj.py());
            return None;
        }
        Some(Self { raw })
    }

    /// The format string without its byte-order prefix (native order only), e.g. "I".
    pub(crate) fn format(&self) -> &str {
        if self.raw.format.is_null() {
            return "B";
        }
        // SAFETY: a non-null format is a NUL-terminated string owned by the exporter,
        // alive while the view is held.
        let f = unsafe { CStr::from_ptr(self.raw.format) };
        let f = f.to_str().unwrap_or("?");
        f.strip_prefix(['@', '=']).unwrap_or(f)
    }

    pub(crate) fn itemsize(&self) -> usize {
        usize::try_from(self.raw.itemsize).unwrap_or(0)
    }

    pub(crate) fn ndim(&self) -> i32 {
        self.raw.ndim
    }

    /// The bytes of the buffer.
    pub(crate) fn bytes(&self) -> &[u8] {
        let len = usize::try_from(self.raw.len).unwrap_or(0);
        if len == 0 || self.raw.buf.is_null() {
            return &[];
        }
        // SAFETY: GetBuffer with PyBUF_C_CONTIGUOUS gives `len` contiguous bytes at `buf`,
        // alive and unresized until release (exporters refuse to resize while exported).
        // Another thread writing the items meanwhile would race with this read, as with
        // any buffer consumer that releases the GIL; callers must not.
        unsafe { std::slice::from_raw_parts(self.raw.buf.cast::<u8>(), len) }
    }
}

impl Drop for View {
    fn drop(&mut self) {
        Python::attach(|_py| {
            // SAFETY: the view was filled by a successful GetBuffer and is released once;
            // the GIL is held here.
            unsafe { PyBuffer_Release(&mut *self.raw) };
        });
    }
}
