//! The SUB socket: keeps one connection per endpoint (reconnecting with backoff), sends
//! our subscriptions on each, and hands two-frame messages to a bounded channel.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::config::ZmtpConfig;
use crate::endpoint::{parse_endpoint, EndpointError};
use crate::link::{self, encode_subscriptions, Inbound, Role};
use crate::stats::{bump, get, LinkCounters, SubscriberStats};

/// A message received by a [`Subscriber`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub topic: Bytes,
    pub payload: Bytes,
    /// The endpoint it came from, as given to [`Subscriber::connect`].
    pub peer: String,
}

/// A ZMQ SUB socket. Cloning gives another handle to the same socket; it closes when
/// [`Subscriber::close`] is called or the last handle is dropped.
#[derive(Clone, Debug)]
pub struct Subscriber {
    handle: Arc<Handle>,
}

#[derive(Debug)]
struct Handle {
    state: Arc<State>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.state.shut_down();
    }
}

/// A kept endpoint's task and whether its link is up now.
type KeptLink = (JoinHandle<()>, Arc<AtomicBool>);

#[derive(Debug)]
struct State {
    cfg: ZmtpConfig,
    topics: Vec<Bytes>,
    tx: mpsc::Sender<Message>,
    /// Each kept endpoint's task, and whether its link is up now.
    links: Mutex<BTreeMap<String, KeptLink>>,
    closed: AtomicBool,
    link: LinkCounters,
    connected: AtomicU64,
    reconnects: AtomicU64,
    received: AtomicU64,
    dropped_full: AtomicU64,
    malformed: AtomicU64,
    unsubscribed: AtomicU64,
}

impl State {
    fn shut_down(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let links = std::mem::take(&mut *self.links.lock().unwrap_or_else(PoisonError::into_inner));
        for (_, (task, _)) in links {
            task.abort();
        }
    }
}

impl Subscriber {
    /// A subscriber to `topics` (prefixes; an empty one matches everything) delivering into
    /// a channel of `capacity` messages, with the default settings (Dynamo's).
    pub fn new(topics: Vec<Bytes>, capacity: usize) -> (Subscriber, mpsc::Receiver<Message>) {
        Subscriber::with_config(topics, capacity, ZmtpConfig::default())
    }

    /// As [`Subscriber::new`], with explicit settings.
    pub fn with_config(
        topics: Vec<Bytes>,
        capacity: usize,
        cfg: ZmtpConfig,
    ) -> (Subscriber, mpsc::Receiver<Message>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let state = Arc::new(State {
            cfg,
            topics,
            tx,
            links: Mutex::new(BTreeMap::new()),
            closed: AtomicBool::new(false),
            link: LinkCounters::default(),
            connected: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            received: AtomicU64::new(0),
            dropped_full: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            unsubscribed: AtomicU64::new(0),
        });
        (
            Subscriber {
                handle: Arc::new(Handle { state }),
            },
            rx,
        )
    }

    /// Starts keeping a connection to `endpoint` (reconnecting after 100 ms, doubling to
    /// 5 s by default). `Ok(true)` when new, `Ok(false)` when already kept or after
    /// [`Subscriber::close`]. Endpoints that cannot be reached over TCP (`ipc://`,
    /// `inproc://`, the host `*`) are refused. Must be called within a tokio runtime.
    pub fn connect(&self, endpoint: &str) -> Result<bool, EndpointError> {
        let parsed = parse_endpoint(endpoint)?;
        if let Some(refusal) = parsed.connect_refusal() {
            return Err(refusal);
        }
        let state = &self.handle.state;
        let mut links = state.links.lock().unwrap_or_else(PoisonError::into_inner);
        if state.closed.load(Ordering::Relaxed) || links.contains_key(endpoint) {
            return Ok(false);
        }
        let (host, port) = parsed.tcp().expect("checked: a TCP endpoint");
        let up = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(keep(
            Arc::clone(state),
            endpoint.to_string(),
            host.to_string(),
            port,
            Arc::clone(&up),
        ));
        links.insert(endpoint.to_string(), (task, up));
        Ok(true)
    }

    /// Stops keeping `endpoint` and drops its connection; `true` when it was kept.
    pub fn disconnect(&self, endpoint: &str) -> bool {
        let state = &self.handle.state;
        let task = state
            .links
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(endpoint);
        match task {
            Some((t, _)) => {
                t.abort();
                true
            }
            None => false,
        }
    }

    /// Whether `endpoint`'s link is up now (handshake done); `None` when it is not kept.
    pub fn link_up(&self, endpoint: &str) -> Option<bool> {
        let links = self
            .handle
            .state
            .links
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        links
            .get(endpoint)
            .map(|(_, up)| up.load(Ordering::Relaxed))
    }

    /// The endpoints kept, as given, sorted.
    pub fn endpoints(&self) -> Vec<String> {
        let links = self
            .handle
            .state
            .links
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        links.keys().cloned().collect()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> SubscriberStats {
        let s = &self.handle.state;
        SubscriberStats {
            connected: get(&s.connected),
            connects: get(&s.link.handshakes),
            reconnects: get(&s.reconnects),
            received: get(&s.received),
            dropped_full: get(&s.dropped_full),
            malformed: get(&s.malformed),
            unsubscribed: get(&s.unsubscribed),
            refused: get(&s.link.refused),
            disconnects: get(&s.link.disconnects),
            timeouts: get(&s.link.timeouts),
            protocol_errors: get(&s.link.protocol_errors),
            oversized: get(&s.link.oversized),
            pings_sent: get(&s.link.pings_sent),
            pongs_received: get(&s.link.pongs_received),
            pings_answered: get(&s.link.pings_answered),
            unknown_commands: get(&s.link.unknown_commands),
        }
    }

    /// Drops every connection and stops reconnecting; later `connect` calls do nothing.
    pub fn close(&self) {
        self.handle.state.shut_down();
    }
}

/// Counts a live link in `connected`, and marks it up, until dropped (also when its task
/// is aborted).
struct Connected<'a>(&'a AtomicU64, &'a AtomicBool);

impl Drop for Connected<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        self.1.store(false, Ordering::Relaxed);
    }
}

/// Keeps one endpoint connected until the task is aborted.
async fn keep(state: Arc<State>, endpoint: String, host: String, port: u16, up: Arc<AtomicBool>) {
    let cfg = &state.cfg;
    // Never zero: a zero interval would spin on a dead endpoint.
    let first_backoff = cfg.reconnect_interval.max(Duration::from_millis(1));
    let mut backoff = first_backoff;
    let mut first = true;
    // Never set: a link ends by its task being aborted (disconnect/close).
    let (_never_closed, closed_rx) = watch::channel(false);
    loop {
        if !first {
            bump(&state.reconnects);
        }
        first = false;
        let connect = tokio::time::timeout(
            cfg.handshake_timeout,
            TcpStream::connect((host.as_str(), port)),
        );
        match connect.await {
            Ok(Ok(stream)) => match link::handshake(stream, Role::Sub, cfg).await {
                Ok(mut established) => {
                    bump(&state.link.handshakes);
                    state.connected.fetch_add(1, Ordering::Relaxed);
                    up.store(true, Ordering::Relaxed);
                    let _up = Connected(&state.connected, &up);
                    backoff = first_backoff;
                    tracing::debug!(%endpoint, version = ?established.version, "ZMTP subscriber: connected");
                    let mut subs = BytesMut::new();
                    encode_subscriptions(&mut subs, established.version, &state.topics);
                    let end = match established.writer.write_all(&subs).await {
                        Ok(()) => {
                            let deliver = |m: Inbound| deliver(&state, &endpoint, m);
                            link::run(
                                established,
                                cfg,
                                &state.link,
                                None,
                                closed_rx.clone(),
                                deliver,
                            )
                            .await
                        }
                        Err(e) => link::LinkEnd::Io(e),
                    };
                    end.count(&state.link);
                    tracing::info!(%endpoint, reason = %end, "ZMTP subscriber: link down, reconnecting");
                }
                Err(e) => {
                    bump(&state.link.refused);
                    tracing::warn!(%endpoint, error = %e, "ZMTP subscriber: handshake refused");
                }
            },
            Ok(Err(e)) => tracing::debug!(%endpoint, error = %e, "ZMTP subscriber: connect failed"),
            Err(_) => tracing::debug!(%endpoint, "ZMTP subscriber: connect timed out"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(cfg.reconnect_interval_max.max(first_backoff));
    }
}

/// A message from the publisher: two frames, on one of our topics, into the channel.
fn deliver(state: &State, endpoint: &str, msg: Inbound) {
    let Inbound::Message { mut parts, count } = msg else {
        // SUBSCRIBE/CANCEL sent to a SUB: meaningless, ignored.
        bump(&state.link.unknown_commands);
        return;
    };
    if count != 2 || parts.len() != 2 {
        bump(&state.malformed);
        return;
    }
    let payload = parts.pop().unwrap_or_default();
    let topic = parts.pop().unwrap_or_default();
    if !state.topics.iter().any(|t| topic.starts_with(t)) {
        bump(&state.unsubscribed);
        return;
    }
    let msg = Message {
        topic,
        payload,
        peer: endpoint.to_string(),
    };
    // Counted before it is handed over, so a receiver never sees a message the counters
    // do not yet include.
    match state.tx.try_reserve() {
        Ok(slot) => {
            bump(&state.received);
            slot.send(msg);
        }
        Err(_) => bump(&state.dropped_full),
    }
}
