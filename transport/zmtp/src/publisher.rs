//! The PUB socket: binds a TCP port, accepts subscribers (one task each), and queues each
//! message to every subscriber whose subscriptions match its topic, dropping it for a
//! subscriber whose queue is full (libzmq's PUB behaviour at its high-water mark).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use crate::config::ZmtpConfig;
use crate::link::{self, Inbound, Outgoing, Role};
use crate::stats::{bump, get, LinkCounters, PublisherStats};
use crate::subscriptions::Subscriptions;

/// A ZMQ PUB socket bound on one TCP address. Cloning gives another handle to the same
/// socket; it closes when [`Publisher::close`] is called or the last handle is dropped.
#[derive(Clone, Debug)]
pub struct Publisher {
    handle: Arc<Handle>,
}

/// Owned by the handles only: dropping the last one closes the socket.
#[derive(Debug)]
struct Handle {
    state: Arc<State>,
    closed: watch::Sender<bool>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.closed.send_replace(true);
    }
}

/// Shared with the accept and connection tasks.
#[derive(Debug)]
struct State {
    cfg: ZmtpConfig,
    local: SocketAddr,
    peers: Mutex<HashMap<u64, Arc<Peer>>>,
    next_id: AtomicU64,
    /// Connections alive, handshaking ones included (bounded by `max_peers`).
    live: AtomicUsize,
    link: LinkCounters,
    sent: AtomicU64,
    dropped_full: AtomicU64,
    subscriptions_refused: AtomicU64,
    ignored_messages: AtomicU64,
}

#[derive(Debug)]
struct Peer {
    subs: Mutex<Subscriptions>,
    queue: mpsc::Sender<Outgoing>,
}

impl Publisher {
    /// Binds `addr` with the default settings (Dynamo's).
    pub async fn bind(addr: SocketAddr) -> std::io::Result<Publisher> {
        Publisher::bind_with(addr, ZmtpConfig::default()).await
    }

    /// Binds `addr` and starts accepting subscribers.
    pub async fn bind_with(addr: SocketAddr, cfg: ZmtpConfig) -> std::io::Result<Publisher> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let (closed, closed_rx) = watch::channel(false);
        let state = Arc::new(State {
            cfg,
            local,
            peers: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            live: AtomicUsize::new(0),
            link: LinkCounters::default(),
            sent: AtomicU64::new(0),
            dropped_full: AtomicU64::new(0),
            subscriptions_refused: AtomicU64::new(0),
            ignored_messages: AtomicU64::new(0),
        });
        tokio::spawn(accept_loop(listener, Arc::clone(&state), closed_rx));
        Ok(Publisher {
            handle: Arc::new(Handle { state, closed }),
        })
    }

    /// The bound address (with the port the system chose for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.handle.state.local
    }

    /// Queues `[topic, payload]` to every subscriber with a matching subscription (prefix
    /// match, as ZMQ). Never blocks: a subscriber whose queue holds `hwm` messages misses
    /// this one (counted in `dropped_full`).
    pub fn send(&self, topic: &[u8], payload: Bytes) {
        let state = &self.handle.state;
        let topic = Bytes::copy_from_slice(topic);
        let peers = state.peers.lock().unwrap_or_else(PoisonError::into_inner);
        for peer in peers.values() {
            let wanted = peer
                .subs
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .matches(&topic);
            if !wanted {
                continue;
            }
            match peer.queue.try_send((topic.clone(), payload.clone())) {
                Ok(()) => bump(&state.sent),
                Err(mpsc::error::TrySendError::Full(_)) => bump(&state.dropped_full),
                // The connection is ending; it leaves the table on its own.
                Err(mpsc::error::TrySendError::Closed(_)) => {}
            }
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PublisherStats {
        let s = &self.handle.state;
        let subscribers = s.peers.lock().unwrap_or_else(PoisonError::into_inner).len() as u64;
        PublisherStats {
            subscribers,
            accepted: get(&s.link.handshakes),
            refused: get(&s.link.refused),
            sent: get(&s.sent),
            dropped_full: get(&s.dropped_full),
            disconnects: get(&s.link.disconnects),
            timeouts: get(&s.link.timeouts),
            protocol_errors: get(&s.link.protocol_errors),
            oversized: get(&s.link.oversized),
            pings_sent: get(&s.link.pings_sent),
            pongs_received: get(&s.link.pongs_received),
            pings_answered: get(&s.link.pings_answered),
            unknown_commands: get(&s.link.unknown_commands),
            subscriptions_refused: get(&s.subscriptions_refused),
            ignored_messages: get(&s.ignored_messages),
        }
    }

    /// Stops accepting and drops every connection (queued messages are discarded, as with
    /// libzmq's linger 0, which Dynamo sets).
    pub fn close(&self) {
        self.handle.closed.send_replace(true);
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>, mut closed: watch::Receiver<bool>) {
    loop {
        let accepted = tokio::select! {
            _ = closed.wait_for(|c| *c) => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, addr)) => {
                if state.live.load(Ordering::Relaxed) >= state.cfg.max_peers {
                    bump(&state.link.refused);
                    tracing::warn!(peer = %addr, max = state.cfg.max_peers, "ZMTP publisher: too many connections, refused one");
                    continue;
                }
                state.live.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(serve(stream, addr, Arc::clone(&state), closed.clone()));
            }
            Err(e) => {
                // Out of descriptors and the like: wait a little rather than spin.
                tracing::warn!(error = %e, local = %state.local, "ZMTP publisher: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// Gives a connection's place back when its task ends (however it ends).
struct Live<'a>(&'a AtomicUsize);

impl Drop for Live<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn serve(
    stream: TcpStream,
    addr: SocketAddr,
    state: Arc<State>,
    mut closed: watch::Receiver<bool>,
) {
    let _live = Live(&state.live);
    let cfg = &state.cfg;
    let established = tokio::select! {
        _ = closed.wait_for(|c| *c) => return,
        r = link::handshake(stream, Role::Pub, cfg) => r,
    };
    let link = match established {
        Ok(l) => l,
        Err(e) => {
            bump(&state.link.refused);
            tracing::warn!(peer = %addr, error = %e, "ZMTP publisher: refused a subscriber");
            return;
        }
    };
    let (queue, queue_rx) = mpsc::channel(cfg.hwm.max(1));
    let peer = Arc::new(Peer {
        subs: Mutex::new(Subscriptions::default()),
        queue,
    });
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    state
        .peers
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(id, Arc::clone(&peer));
    bump(&state.link.handshakes);
    tracing::debug!(peer = %addr, version = ?link.version, "ZMTP publisher: subscriber connected");
    let on_inbound = |msg: Inbound| handle_inbound(&state, &peer, msg);
    let end = link::run(link, cfg, &state.link, Some(queue_rx), closed, on_inbound).await;
    state
        .peers
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&id);
    end.count(&state.link);
    tracing::debug!(peer = %addr, reason = %end, "ZMTP publisher: subscriber gone");
}

/// Subscriptions from the peer: SUBSCRIBE/CANCEL commands (3.1) or messages whose first
/// byte is 1/0 (3.0, which libzmq also accepts from 3.1 peers); other messages are ignored.
fn handle_inbound(state: &State, peer: &Peer, msg: Inbound) {
    let (topic, subscribe) = match msg {
        Inbound::Subscribe(t) => (t, true),
        Inbound::Cancel(t) => (t, false),
        Inbound::Message { mut parts, .. } => {
            let first = if parts.is_empty() {
                Bytes::new()
            } else {
                parts.swap_remove(0)
            };
            match first.first() {
                Some(1) => (first.slice(1..), true),
                Some(0) => (first.slice(1..), false),
                _ => {
                    bump(&state.ignored_messages);
                    return;
                }
            }
        }
    };
    let mut subs = peer.subs.lock().unwrap_or_else(PoisonError::into_inner);
    if subscribe {
        let cfg = &state.cfg;
        if let Err(why) = subs.subscribe(topic, cfg.max_subscriptions, cfg.max_subscription_len) {
            bump(&state.subscriptions_refused);
            tracing::debug!(
                ?why,
                held = subs.len(),
                "ZMTP publisher: subscription ignored"
            );
        }
    } else {
        subs.cancel(&topic);
    }
}
