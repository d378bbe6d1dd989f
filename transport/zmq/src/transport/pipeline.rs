//! The ingest pipeline: one thread ([`THREAD_NAME`]) driving one current-thread tokio
//! runtime, on which every subscriber of the process runs as a task (see the parent
//! module's "Threads and stopping").
//!
//! It starts with the first subscriber and lives as long as any subscriber does: each
//! holds a [`Lease`], and when the last lease is released the thread is told to stop and
//! is joined (not when that release runs on the thread itself, which then ends once the
//! current task yields). Dropping the runtime drops whatever tasks are still on it. The
//! next subscriber starts a new pipeline.

use std::future::Future;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{JoinHandle, ThreadId};

use tokio::runtime::Handle;

use super::StopSignal;

/// The name of the pipeline's thread.
pub(super) const THREAD_NAME: &str = "kvr-ingest";

/// The name of the runtime's blocking threads (started on demand, gone after 10 s idle).
const BLOCKING_THREAD_NAME: &str = "kvr-ingest-blocking";

/// The running pipeline, and how many leases it has.
struct Slot {
    pipeline: Option<Pipeline>,
    leases: usize,
}

static SLOT: Mutex<Slot> = Mutex::new(Slot {
    pipeline: None,
    leases: 0,
});

fn slot() -> MutexGuard<'static, Slot> {
    // Every change under the lock is complete before anything that can panic.
    SLOT.lock().unwrap_or_else(|e| e.into_inner())
}

struct Pipeline {
    handle: Handle,
    thread: JoinHandle<()>,
    shutdown: Arc<StopSignal>,
}

impl Pipeline {
    fn start() -> io::Result<Pipeline> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            // Its blocking pool, if ever used (`zeromq` resolves a host name, or removes
            // an IPC socket's file, there).
            .thread_name(BLOCKING_THREAD_NAME)
            .build()?;
        let handle = runtime.handle().clone();
        let shutdown = Arc::new(StopSignal::default());
        let until = Arc::clone(&shutdown);
        let thread = std::thread::Builder::new()
            .name(THREAD_NAME.to_owned())
            .spawn(move || {
                // The tasks run while `block_on` waits.
                runtime.block_on(until.raised());
                drop(runtime);
            })?;
        Ok(Pipeline {
            handle,
            thread,
            shutdown,
        })
    }
}

/// A subscriber's hold on the pipeline: its task runs there, and the pipeline runs as
/// long as a lease is held. Released on drop.
pub(super) struct Lease {
    handle: Handle,
    thread: ThreadId,
}

impl Lease {
    /// A lease on the running pipeline, started if there is none.
    ///
    /// # Errors
    ///
    /// Creating the runtime or the thread failed.
    pub(super) fn take() -> io::Result<Lease> {
        let mut slot = slot();
        let pipeline = match &mut slot.pipeline {
            Some(p) => p,
            none => none.insert(Pipeline::start()?),
        };
        let lease = Lease {
            handle: pipeline.handle.clone(),
            thread: pipeline.thread.thread().id(),
        };
        slot.leases += 1;
        Ok(lease)
    }

    /// Runs `task` on the pipeline.
    pub(super) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        // Detached: the subscriber follows its task through its own shared state.
        drop(self.handle.spawn(task));
    }

    /// Whether the caller runs on the pipeline's thread (inside one of its tasks).
    pub(super) fn on_pipeline_thread(&self) -> bool {
        std::thread::current().id() == self.thread
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let last = {
            let mut slot = slot();
            slot.leases -= 1;
            if slot.leases == 0 {
                slot.pipeline.take()
            } else {
                None
            }
        };
        if let Some(pipeline) = last {
            pipeline.shutdown.raise();
            if !self.on_pipeline_thread() {
                // The thread ends as soon as the task it runs (if any) yields.
                let _ = pipeline.thread.join();
            }
        }
    }
}
