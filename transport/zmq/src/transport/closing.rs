//! Closing a subscription's sockets on a runtime that outlives it.
//!
//! The `zeromq` crate runs part of every socket in tasks of its own, spawned on the runtime
//! the socket is used on: a bound socket's accept loop (it holds the listener) and the
//! handshake of each connection it accepts, a connected SUB socket's reconnect task, a
//! DEALER's per-peer writer (it holds the connection's write half). Dropping a socket
//! only tells them to end; they do on their next poll. When every subscription had a
//! runtime of its own, dropping that runtime ended them all at once. On the shared
//! pipeline a stopped subscription's task waits for them instead: each of those tasks
//! holds its socket's backend (an `Arc`), so once no backend of the subscription is left
//! alive, none of its tasks is, and every listener and connection they held is closed.

use std::sync::{Arc, Weak};
use std::time::Duration;

use zeromq::{MultiPeerBackend, Socket};

/// How long a stopped subscription waits for its sockets' tasks to end. They end on their
/// next poll, within microseconds, but for one that hangs on its peer (a handshake the
/// peer never completes, a reconnect attempt to a host that drops it); past this bound
/// that one is left to end by itself, or with the pipeline.
pub(super) const CLOSE_BOUND: Duration = Duration::from_millis(500);

/// Weak handles to the backends of the sockets a subscription opened, pruned of those
/// already gone as new ones come.
#[derive(Default)]
pub(super) struct SocketTrail(Vec<Weak<dyn MultiPeerBackend>>);

impl SocketTrail {
    /// Keeps track of `socket` (until it and its tasks are gone).
    pub(super) fn track(&mut self, socket: &impl Socket) {
        self.0.retain(|b| b.strong_count() > 0);
        self.0.push(Arc::downgrade(&socket.backend()));
    }

    /// Adds `other`'s sockets to this trail.
    pub(super) fn join(mut self, other: SocketTrail) -> SocketTrail {
        self.0.extend(other.0);
        self
    }

    fn is_closed(&mut self) -> bool {
        self.0.retain(|b| b.strong_count() > 0);
        self.0.is_empty()
    }

    /// Completes once every tracked socket (whose owner dropped it) and its tasks are
    /// gone, or after `bound`; true if they are gone. The tasks run on the same runtime as
    /// the caller, which lets them: it yields, a few times at once, then every
    /// millisecond.
    pub(super) async fn closed(mut self, bound: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + bound;
        let mut yields = 0;
        while !self.is_closed() {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            if yields < 8 {
                yields += 1;
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        true
    }
}
