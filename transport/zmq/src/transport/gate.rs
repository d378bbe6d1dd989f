//! A start gate: subscriptions started behind a closed gate open no socket, and so hear
//! and apply nothing, until the gate opens. A host that must put something into the index
//! before any live event (kvr serve recovering the index from a peer's dump) starts its
//! subscriptions behind one and opens it when that is done; each subscription then starts
//! as a late joiner would (its first probe asks the publisher for what it still buffers).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};

/// Shared by every subscription started behind it; cloning shares it. Opening is final.
#[derive(Clone, Default)]
pub struct StartGate(Arc<GateState>);

#[derive(Default)]
struct GateState {
    open: AtomicBool,
    /// The subscriptions' threads waiting for it (one waker each; `will_wake` dedupes).
    waiting: Mutex<Vec<Waker>>,
}

impl std::fmt::Debug for StartGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StartGate")
            .field("open", &self.is_open())
            .finish()
    }
}

impl StartGate {
    /// A closed gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Opens the gate: every subscription waiting behind it starts now, and any started
    /// later starts at once. Idempotent.
    pub fn open(&self) {
        self.0.open.store(true, Ordering::SeqCst);
        let waiting = std::mem::take(&mut *self.lock());
        for w in waiting {
            w.wake();
        }
    }

    pub fn is_open(&self) -> bool {
        self.0.open.load(Ordering::SeqCst)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Waker>> {
        // Only wakers are kept: a panic while holding it leaves nothing half-changed.
        self.0.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Completes once the gate is open. The waker is registered before the flag is
    /// checked again, so an `open` between the two cannot be missed.
    pub(crate) fn opened(&self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| {
            if self.is_open() {
                return Poll::Ready(());
            }
            {
                let mut waiting = self.lock();
                if !waiting.iter().any(|w| w.will_wake(cx.waker())) {
                    waiting.push(cx.waker().clone());
                }
            }
            if self.is_open() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
    }
}
