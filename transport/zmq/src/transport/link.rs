//! The SUB socket and its (re)connection state machine (see the parent module's
//! "Connection handling").

use std::pin::Pin;
use std::time::{Duration, Instant};

use kvr::ingress::HealthReason;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket, ZmqError, ZmqMessage};

use super::closing::SocketTrail;
use super::{BoxFuture, SubscriberConfig};

/// How often a connected SUB socket checks for a dropped connection.
const LINK_CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// The SUB subscription string: the topic filter if it is UTF-8 (the `zeromq` API takes
/// `&str`), else everything (and the delivery filters).
fn subscription(topic: &[u8]) -> String {
    std::str::from_utf8(topic).unwrap_or("").to_owned()
}

/// The SUB socket and its (re)connection state machine.
pub(super) struct SubLink {
    endpoint: String,
    bind: bool,
    subscription: String,
    reconnect_interval: Duration,
    state: LinkState,
    /// Every SUB socket opened (see [`SocketTrail`]).
    trail: SocketTrail,
}

enum LinkState {
    /// No socket: open one.
    Closed,
    /// Opening (connect or bind), started at the instant given.
    Opening(BoxFuture<Result<OpenSub, ZmqError>>, Instant),
    /// Waiting before the next attempt.
    Backoff(Pin<Box<tokio::time::Sleep>>),
    Open(OpenSub),
}

struct OpenSub {
    socket: SubSocket,
    /// Drains the socket's monitor (connect mode only): true if it reported a
    /// `Disconnected`, which closes the link.
    disconnected: Option<Box<dyn FnMut() -> bool + Send>>,
    check: tokio::time::Interval,
}

impl SubLink {
    pub(super) fn new(cfg: &SubscriberConfig) -> SubLink {
        SubLink {
            endpoint: cfg.endpoint.clone(),
            bind: cfg.bind,
            subscription: subscription(&cfg.topic),
            reconnect_interval: cfg.reconnect_interval,
            state: LinkState::Closed,
            trail: SocketTrail::default(),
        }
    }

    /// Drops the socket (if any); what is left to close is in the trail returned.
    pub(super) fn close(self) -> SocketTrail {
        drop(self.state);
        self.trail
    }

    /// The next live message or change of the link, (re)opening the socket as needed.
    /// Cancel-safe.
    pub(super) async fn next_event(&mut self) -> LinkEvent {
        loop {
            match &mut self.state {
                LinkState::Closed => {
                    let mut options = SocketOptions::default();
                    options.connect_timeout(self.reconnect_interval);
                    let socket = SubSocket::with_options(options);
                    self.trail.track(&socket);
                    let open = open_sub(
                        socket,
                        self.endpoint.clone(),
                        self.bind,
                        self.subscription.clone(),
                    );
                    self.state = LinkState::Opening(Box::pin(open), Instant::now());
                }
                LinkState::Opening(open, started) => {
                    let started = *started;
                    match open.as_mut().await {
                        Ok(open) => {
                            self.state = LinkState::Open(open);
                            return LinkEvent::Changed(None);
                        }
                        Err(e) => {
                            // A connect keeps retrying for up to `reconnect_interval` before it
                            // fails; a bind fails at once. Either way the next attempt starts
                            // `reconnect_interval` after this one did.
                            let wait = self.reconnect_interval.saturating_sub(started.elapsed());
                            self.state = LinkState::Backoff(Box::pin(tokio::time::sleep(wait)));
                            return LinkEvent::Changed(Some(failure_reason(&e, self.bind)));
                        }
                    }
                }
                LinkState::Backoff(sleep) => {
                    sleep.as_mut().await;
                    self.state = LinkState::Closed;
                }
                LinkState::Open(open) => {
                    let got = tokio::select! {
                        msg = open.socket.recv() => Some(msg),
                        _ = open.check.tick() => None,
                    };
                    match got {
                        Some(Ok(msg)) => return LinkEvent::Message(msg),
                        // A peer's error: the peer is dropped (in connect mode the monitor
                        // reports it, below).
                        Some(Err(_)) => {}
                        None => {}
                    }
                    if open.disconnected() {
                        self.state = LinkState::Closed;
                        return LinkEvent::Changed(Some(HealthReason::Disconnected));
                    }
                }
            }
        }
    }
}

/// What the SUB link yields.
pub(super) enum LinkEvent {
    Message(ZmqMessage),
    /// Opened (`None`) or failed (`Some`).
    Changed(Option<HealthReason>),
}

/// Why opening the SUB socket failed, as a stream's health reason.
fn failure_reason(e: &ZmqError, bind: bool) -> HealthReason {
    match e {
        _ if bind => HealthReason::BindFailed,
        ZmqError::Codec(_) | ZmqError::UnsupportedVersion(_) | ZmqError::Socket(_) => {
            HealthReason::HandshakeFailed
        }
        _ => HealthReason::Unreachable,
    }
}

impl OpenSub {
    /// Whether the monitor reported the (only) connection gone.
    fn disconnected(&mut self) -> bool {
        self.disconnected.as_mut().is_some_and(|drain| drain())
    }
}

async fn open_sub(
    mut socket: SubSocket,
    endpoint: String,
    bind: bool,
    subscription: String,
) -> Result<OpenSub, ZmqError> {
    let disconnected = if bind {
        None
    } else {
        let mut monitor = socket.monitor();
        let drain = move || {
            let mut gone = false;
            while let Ok(event) = monitor.try_recv() {
                gone |= matches!(event, SocketEvent::Disconnected(_));
            }
            gone
        };
        Some(Box::new(drain) as Box<dyn FnMut() -> bool + Send>)
    };
    // Remembered and sent to every peer as it connects.
    socket.subscribe(&subscription).await?;
    if bind {
        socket.bind(&endpoint).await?;
    } else {
        socket.connect(&endpoint).await?;
    }
    let mut check = tokio::time::interval(LINK_CHECK_INTERVAL);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    Ok(OpenSub {
        socket,
        disconnected,
        check,
    })
}
