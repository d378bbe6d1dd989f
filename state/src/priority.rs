//! The snapshotter gives way to the threads that ingest and serve: on Linux it runs as
//! `SCHED_BATCH` (no preemption of a running thread when it wakes) at a higher nice
//! value. Where that is refused or not available, it runs as it is. (The journal's
//! writer keeps its priority: it must keep up with ingest, or events are dropped.)

/// Lowers the calling thread's priority: `SCHED_BATCH`, then `nice` added to its nice
/// value (0: unchanged).
pub(crate) fn background(nice: i32) {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `param` is a valid sched_param; pid 0 names the calling thread.
        let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
        if nice != 0 {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            // SAFETY: getpriority/setpriority on this thread's id; errors are ignored
            // (errno is cleared first, as getpriority may return -1 validly).
            unsafe {
                *libc::__errno_location() = 0;
                let now = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
                if *libc::__errno_location() == 0 {
                    let _ = libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, now + nice);
                }
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}
