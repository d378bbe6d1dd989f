//! Dynamo-compatible replica sync: one PUB socket bound on the sync port that every peer
//! subscribes to, one SUB socket connected to every peer's port, booking events on the
//! `dynamo.slot-tracker.v1` topic. Best effort, as Dynamo's: no sequence numbers, no
//! acknowledgement, no replay (a peer's booking missed while a link was down stays missed
//! until it expires).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvr_zmtp::{Message, Publisher, Subscriber};

use crate::dynamo_wire::{self, BOOKING_TOPIC};
use crate::event::{BookingEvent, EventData};
use crate::peers::PeerBook;
use crate::stats::{Applied, SyncCounters, SyncStats};

/// Applies peers' events to this replica's bookings (the host's booking path).
pub trait BookingSink: Send + Sync + 'static {
    /// Takes one event of a peer; says what came of it.
    fn apply(&self, ev: BookingEvent) -> Applied;
    /// Takes a peer's add that may live `ttl` at most (less than the full lifetime: it was
    /// read some time after it was published, as in a replay). The default ignores `ttl`.
    fn apply_with_ttl(&self, ev: BookingEvent, ttl: Duration) -> Applied {
        let _ = ttl;
        self.apply(ev)
    }
    /// Ends a peer's booking here without telling anyone (its peer went silent or
    /// restarted); false when it was not live.
    fn expire(&self, request_id: &str) -> bool;
}

/// How long a peer's link may stay down before its bookings go (kvr's default; Dynamo
/// keeps them until they expire by age).
pub const DEFAULT_PEER_SILENCE: Duration = Duration::from_secs(30);

/// How many received messages wait for the applier at most (beyond: dropped, counted by
/// the subscriber).
const INBOUND_CAPACITY: usize = 100_000;

/// A running Dynamo-compatible replica sync.
pub struct DynamoSync {
    router_id: u64,
    /// The runtime the sockets run on: a peer registered from another thread (Python's)
    /// is connected there.
    runtime: tokio::runtime::Handle,
    publisher: Publisher,
    subscriber: Subscriber,
    counters: Arc<SyncCounters>,
}

impl std::fmt::Debug for DynamoSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoSync")
            .field("router_id", &self.router_id)
            .field("addr", &self.publisher.local_addr())
            .finish()
    }
}

impl DynamoSync {
    /// Binds the publisher on `bind`, connects to `peers` (validated first: a bad one is
    /// an error naming it, as Dynamo refuses it at start) and applies what they send
    /// through `sink` on a task of the current tokio runtime.
    pub async fn start(
        bind: SocketAddr,
        peers: &[String],
        peer_silence: Duration,
        sink: Arc<dyn BookingSink>,
    ) -> Result<Arc<Self>, String> {
        for p in peers {
            kvr_zmtp::parse_endpoint(p)
                .map_err(|_| format!("invalid replica peer endpoint `{p}`"))?;
        }
        let publisher = Publisher::bind(bind)
            .await
            .map_err(|e| format!("failed to bind replica publisher to `tcp://{bind}`: {e}"))?;
        let (subscriber, inbound) =
            Subscriber::new(vec![Bytes::from_static(BOOKING_TOPIC)], INBOUND_CAPACITY);
        let me = Arc::new(Self {
            router_id: new_router_id(),
            runtime: tokio::runtime::Handle::current(),
            publisher,
            subscriber,
            counters: Arc::default(),
        });
        for p in peers {
            me.subscriber
                .connect(p)
                .map_err(|e| format!("failed to register replica peer `{p}`: {e}"))?;
        }
        tokio::spawn(pump(
            inbound,
            sink,
            me.router_id,
            me.counters.clone(),
            me.subscriber.clone(),
            peer_silence,
        ));
        Ok(me)
    }

    /// This process's router id (random, non-zero): peers skip events that carry their
    /// own.
    pub fn router_id(&self) -> u64 {
        self.router_id
    }

    /// Where the publisher listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.publisher.local_addr()
    }

    /// Publishes a local booking event to every peer (never waits: a peer whose queue is
    /// full misses it, counted by the publisher).
    pub fn publish(&self, mut ev: BookingEvent) {
        ev.router_id = self.router_id;
        let payload = dynamo_wire::encode(&ev);
        self.publisher.send(BOOKING_TOPIC, Bytes::from(payload));
        SyncCounters::bump(&self.counters.sent);
    }

    /// Connects to a peer's publisher: `Ok(true)` when new, `Ok(false)` when it was one
    /// already; the error text is Dynamo's.
    pub fn register_peer(&self, endpoint: &str) -> Result<bool, String> {
        let _in_runtime = self.runtime.enter();
        self.subscriber.connect(endpoint).map_err(|e| e.to_string())
    }

    /// Disconnects from a peer: `Ok(false)` when it was not one (Dynamo's "peer not found").
    pub fn deregister_peer(&self, endpoint: &str) -> Result<bool, String> {
        kvr_zmtp::parse_endpoint(endpoint).map_err(|e| e.to_string())?;
        Ok(self.subscriber.disconnect(endpoint))
    }

    /// The peers, as given, sorted.
    pub fn peers(&self) -> Vec<String> {
        self.subscriber.endpoints()
    }

    /// The sync's counters.
    pub fn stats(&self) -> SyncStats {
        self.counters.snapshot()
    }

    /// The transport's counters (publisher, subscriber).
    pub fn transport_stats(&self) -> (kvr_zmtp::PublisherStats, kvr_zmtp::SubscriberStats) {
        (self.publisher.stats(), self.subscriber.stats())
    }

    /// Stops both sockets.
    pub fn close(&self) {
        self.publisher.close();
        self.subscriber.close();
    }
}

/// Applies what the peers send, and once a second lets the bookings of peers gone silent
/// go.
async fn pump(
    mut inbound: tokio::sync::mpsc::Receiver<Message>,
    sink: Arc<dyn BookingSink>,
    router_id: u64,
    counters: Arc<SyncCounters>,
    subscriber: Subscriber,
    peer_silence: Duration,
) {
    let mut book = PeerBook::default();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            m = inbound.recv() => {
                let Some(m) = m else { return };
                take(&m, &*sink, router_id, &counters, &mut book);
            }
            _ = tick.tick() => {
                let gone = book.silent(Instant::now(), peer_silence, |e| subscriber.link_up(e));
                expire(&*sink, &counters, gone, "its link is down or it was deregistered");
            }
        }
    }
}

fn take(
    m: &Message,
    sink: &dyn BookingSink,
    router_id: u64,
    counters: &SyncCounters,
    book: &mut PeerBook,
) {
    SyncCounters::bump(&counters.received);
    if m.topic.as_ref() != BOOKING_TOPIC {
        SyncCounters::bump(&counters.unknown_topic);
        return;
    }
    let ev = match dynamo_wire::decode(&m.payload) {
        Ok(ev) => ev,
        Err(e) => {
            SyncCounters::bump(&counters.undecodable);
            tracing::debug!(peer = %m.peer, "replica sync: {e}");
            return;
        }
    };
    if ev.router_id == router_id {
        SyncCounters::bump(&counters.own);
        return;
    }
    let restarted = book.heard(ev.router_id, &m.peer);
    expire(sink, counters, restarted, "it restarted (a new router id)");
    let (sender, id) = (ev.router_id, ev.request_id.clone());
    let kind = std::mem::discriminant(&ev.data);
    let add = matches!(ev.data, EventData::Add(_));
    let free = kind == std::mem::discriminant(&EventData::Free);
    let outcome = sink.apply(ev);
    counters.outcome(outcome);
    if add && outcome == Applied::Applied {
        book.booked(sender, &id);
    } else if free {
        book.ended(&id);
    }
}

fn expire(sink: &dyn BookingSink, counters: &SyncCounters, ids: Vec<String>, why: &str) {
    if ids.is_empty() {
        return;
    }
    let n = ids.iter().filter(|id| sink.expire(id)).count();
    counters
        .peer_gone
        .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    tracing::warn!(
        bookings = n,
        "replica sync: a peer's bookings dropped: {why}"
    );
}

/// A random non-zero id for this process (the standard library's per-process random
/// hash keys, mixed with the time and the process id): Dynamo's router id, and the seed of
/// a JetStream replica's default name.
pub fn new_router_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    kvr::hash::splitmix64(h.finish()).max(1)
}
