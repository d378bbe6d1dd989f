//! libkvr: the C library. Every `kvr_*` symbol is defined in `kvr-ffi`; linking it in
//! as a dependency is enough for the static and the dynamic library to export them.

pub use kvr_ffi::*;
