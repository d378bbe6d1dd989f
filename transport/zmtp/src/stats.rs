//! Counters: atomics the connection tasks bump, and the plain snapshots the handles return.

use std::sync::atomic::{AtomicU64, Ordering};

/// Per-socket counters every connection task updates (one set per Publisher/Subscriber).
#[derive(Debug, Default)]
pub(crate) struct LinkCounters {
    pub(crate) handshakes: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) disconnects: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) protocol_errors: AtomicU64,
    pub(crate) oversized: AtomicU64,
    pub(crate) pings_sent: AtomicU64,
    pub(crate) pongs_received: AtomicU64,
    pub(crate) pings_answered: AtomicU64,
    pub(crate) unknown_commands: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

/// A snapshot of a [`crate::Publisher`]'s counters (cumulative unless noted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublisherStats {
    /// Subscribers connected now (handshake done).
    pub subscribers: u64,
    /// Connections that completed the handshake.
    pub accepted: u64,
    /// Connections refused: bad greeting (signature, version below 3, mechanism), bad
    /// READY or socket type, handshake timeout, or over `max_peers`.
    pub refused: u64,
    /// Messages queued to a subscriber (one per matching subscriber).
    pub sent: u64,
    /// Messages dropped because a subscriber's queue held `hwm` messages.
    pub dropped_full: u64,
    /// Connections that ended after the handshake for any reason but [`crate::Publisher::close`].
    pub disconnects: u64,
    /// Of `disconnects`: nothing arrived for `heartbeat_timeout`.
    pub timeouts: u64,
    /// Of `disconnects`: a malformed frame or command.
    pub protocol_errors: u64,
    /// Of `disconnects`: a frame above `max_frame`.
    pub oversized: u64,
    pub pings_sent: u64,
    pub pongs_received: u64,
    /// PINGs received and answered with PONG.
    pub pings_answered: u64,
    /// Valid commands this socket does not use (ignored).
    pub unknown_commands: u64,
    /// Subscriptions ignored: above `max_subscriptions` or `max_subscription_len`.
    pub subscriptions_refused: u64,
    /// Messages from a subscriber that are not subscriptions (ignored, as libzmq's PUB does).
    pub ignored_messages: u64,
}

/// A snapshot of a [`crate::Subscriber`]'s counters (cumulative unless noted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SubscriberStats {
    /// Links up now (handshake done).
    pub connected: u64,
    /// Handshakes completed.
    pub connects: u64,
    /// Connection attempts after an endpoint's first one.
    pub reconnects: u64,
    /// Messages handed to the receiver.
    pub received: u64,
    /// Messages dropped because the receiver's channel was full (the newest is dropped).
    pub dropped_full: u64,
    /// Messages dropped for not having exactly two frames.
    pub malformed: u64,
    /// Messages whose topic matches none of our subscriptions (dropped).
    pub unsubscribed: u64,
    /// Handshakes refused (greeting, READY, socket type, timeout).
    pub refused: u64,
    /// Links that ended after the handshake, for any reason but disconnect/close.
    pub disconnects: u64,
    /// Of `disconnects`: nothing arrived for `heartbeat_timeout`.
    pub timeouts: u64,
    /// Of `disconnects`: a malformed frame or command.
    pub protocol_errors: u64,
    /// Of `disconnects`: a frame above `max_frame`.
    pub oversized: u64,
    pub pings_sent: u64,
    pub pongs_received: u64,
    /// PINGs received and answered with PONG.
    pub pings_answered: u64,
    /// Valid commands this socket does not use (ignored).
    pub unknown_commands: u64,
}
