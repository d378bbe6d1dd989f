//! Expiry: the sweep that frees every booking past its expiry, and the lazily started
//! background thread that runs it periodically. The thread starts on a table's first
//! booking (never at construction), holds only a weak reference to the table's state and
//! ends with the table. There is no sweep thread under loom.

#[cfg(not(loom))]
use std::time::Duration;
use std::time::Instant;

use super::inner::Inner;
use super::shard::Booking;
use super::types::FreedBy;
use crate::ids::SelectionId;
use crate::sync::atomic::Ordering;
#[cfg(not(loom))]
use crate::sync::atomic::{AtomicBool, AtomicUsize};
#[cfg(not(loom))]
use crate::sync::{Arc, Mutex};

/// The lazily started sweep thread.
#[cfg(not(loom))]
#[derive(Default)]
pub(super) struct SweeperSlot {
    /// Raised by the one booking that starts the thread; read on every booking (one
    /// relaxed load once it is set).
    pub(super) started: AtomicBool,
    /// Threads spawned by this table: 0 or 1.
    pub(super) spawned: AtomicUsize,
    pub(super) handle: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Set by the thread as it exits (tests observe the end of the thread with it).
    pub(super) exited: Arc<AtomicBool>,
}

/// Raises a flag when dropped: the sweep thread's exit, however it exits.
#[cfg(not(loom))]
struct RaiseOnDrop(Arc<AtomicBool>);

#[cfg(not(loom))]
impl Drop for RaiseOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

#[cfg(not(loom))]
impl SweeperSlot {
    /// Starts the sweep thread on `inner` with period `interval`, unless this slot started
    /// one already.
    pub(super) fn start(&self, inner: &Arc<Inner>, interval: Duration) {
        let slot = self;
        if slot.started.load(Ordering::Relaxed)
            || slot
                .started
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let weak = Arc::downgrade(inner);
        let exited = RaiseOnDrop(slot.exited.clone());
        let spawned = std::thread::Builder::new()
            .name("kvr-reservation-sweep".into())
            .spawn(move || {
                let _exited = exited;
                loop {
                    // Woken early only by the table's `Drop` (or spuriously: an early
                    // sweep is harmless).
                    std::thread::park_timeout(interval);
                    let Some(inner) = weak.upgrade() else { return };
                    if inner.shutdown.load(Ordering::Acquire) {
                        return;
                    }
                    inner.sweep_expired(Instant::now());
                }
            });
        // If the thread cannot be spawned (resources exhausted), sweeping stays available
        // through `sweep_expired`; retrying on every booking would only make it worse.
        if let Ok(handle) = spawned {
            slot.spawned.fetch_add(1, Ordering::Relaxed);
            *slot.handle.lock() = Some(handle);
        }
    }
}

impl Inner {
    pub(super) fn sweep_expired(&self, now: Instant) -> usize {
        let mut expired: Vec<Booking> = Vec::new();
        let mut ids: Vec<SelectionId> = Vec::new();
        let mut total = 0;
        for shard in self.shards.iter() {
            let mut g = shard.lock();
            match g.earliest_expiry {
                Some(e) if e <= now => {}
                _ => continue,
            }
            ids.clear();
            let mut next: Option<Instant> = None;
            for (id, b) in &g.live {
                match b.expires_at {
                    Some(e) if e <= now => ids.push(*id),
                    Some(e) => next = Some(next.map_or(e, |x| x.min(e))),
                    None => {}
                }
            }
            g.earliest_expiry = next;
            for &id in &ids {
                if let Some(b) = self.take(&mut g, id, FreedBy::Expired) {
                    expired.push(b);
                }
            }
            drop(g);
            total += expired.len();
            for b in expired.drain(..) {
                self.release(&b);
            }
            self.forget(&ids);
        }
        if total > 0 {
            self.expired_total
                .fetch_add(total as u64, Ordering::Relaxed);
        }
        if let Some(f) = &self.on_sweep {
            f(now);
        }
        total
    }
}
