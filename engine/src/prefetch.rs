//! A cache-line prefetch hint, the one the index and the load table share.

/// Hints the CPU to load the line holding `p` into every cache level. A hint: it never
/// faults and never dereferences, so any address (dangling, or past an array's end) is
/// fine; on targets without the instruction it does nothing.
#[inline(always)]
pub(crate) fn prefetch_line<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint that never faults or dereferences; SSE is part of the
    // x86_64 baseline, so the intrinsic is available on every x86_64 CPU.
    unsafe {
        core::arch::x86_64::_mm_prefetch(p.cast::<i8>(), core::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
