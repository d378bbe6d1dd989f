//! Knobs shared by [`crate::Publisher`] and [`crate::Subscriber`]. The defaults are
//! libzmq's as Dynamo 1.6.1 sets them (heartbeats 5 s / 15 s / 15 s, HWM 1000, reconnect
//! 100 ms doubling to 5 s); tests shorten the intervals.

use std::time::Duration;

/// Transport settings; `Default` gives Dynamo's values.
#[derive(Clone, Debug)]
pub struct ZmtpConfig {
    /// How often each connection sends a PING.
    pub heartbeat_interval: Duration,
    /// A connection from which nothing arrived for this long is closed. (The TTL a peer
    /// announces in its PINGs is not used: our own bound applies to every peer.)
    pub heartbeat_timeout: Duration,
    /// The TTL our PINGs announce (the peer may close after this long without traffic).
    pub heartbeat_ttl: Duration,
    /// Bound on connecting plus the greeting/READY exchange.
    pub handshake_timeout: Duration,
    /// Largest frame accepted from a peer; a larger one closes the connection.
    pub max_frame: usize,
    /// Publisher: messages queued per subscriber before new ones are dropped.
    pub hwm: usize,
    /// Publisher: most simultaneous connections, handshaking ones included (more are
    /// closed at once and counted as refused).
    pub max_peers: usize,
    /// Publisher: most distinct subscriptions per connection (more are ignored, counted).
    pub max_subscriptions: usize,
    /// Publisher: longest subscription prefix in bytes (longer are ignored, counted).
    pub max_subscription_len: usize,
    /// Subscriber: first reconnect delay, doubled after each failed attempt...
    pub reconnect_interval: Duration,
    /// ...up to this.
    pub reconnect_interval_max: Duration,
    /// Test-only: `false` stops answering PING with PONG (the negative control showing
    /// that libzmq drops a peer that does not answer).
    #[doc(hidden)]
    pub answer_pings: bool,
}

impl Default for ZmtpConfig {
    fn default() -> Self {
        ZmtpConfig {
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_timeout: Duration::from_secs(15),
            heartbeat_ttl: Duration::from_secs(15),
            handshake_timeout: Duration::from_secs(10),
            max_frame: 16 << 20,
            hwm: 1000,
            max_peers: 1024,
            max_subscriptions: 64,
            max_subscription_len: 256,
            reconnect_interval: Duration::from_millis(100),
            reconnect_interval_max: Duration::from_secs(5),
            answer_pings: true,
        }
    }
}

impl ZmtpConfig {
    /// The PING TTL field: deciseconds, saturating at the field's maximum.
    pub(crate) fn ttl_deciseconds(&self) -> u16 {
        u16::try_from(self.heartbeat_ttl.as_millis() / 100).unwrap_or(u16::MAX)
    }
}
