//! Replica sync's state in `kvr serve` (Dynamo's `--replica-sync-port` /
//! `--replica-sync-peers`): the running sync, the frees that came before their adds, the
//! flags' checks and the metrics. What the sync does with the service's bookings is in
//! `replica_sync`.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvr_replica::{BookingEvent, DynamoSync, JetStreamSync};

/// A peer's booking lives this long after it is received at most (Dynamo's default
/// expiry of an active request; kvr's cap on replica bookings).
pub const PEER_BOOKING_TTL: Duration = kvr::MAX_REPLICA_BOOKING_TTL;

/// The most blocks a peer's booking may name (a 2M-token prompt at 16 tokens a block).
pub const MAX_PEER_BOOKING_BLOCKS: usize = 1 << 17;

/// How long a peer's free of an id not booked here is remembered, so that its add, if it
/// arrives late (another connection, or reordered), does not bring the booking back.
pub const TOMBSTONE_TTL: Duration = Duration::from_secs(30);

/// The most such frees remembered (the oldest are forgotten first).
pub const MAX_TOMBSTONES: usize = 1 << 16;

/// The service's replica sync, once started.
#[derive(Debug, Default)]
pub struct Replicas {
    sync: OnceLock<Arc<DynamoSync>>,
    jetstream: OnceLock<Arc<JetStreamSync>>,
    tombstones: Mutex<Tombstones>,
}

/// Ids whose free came before (or without) their add, for [`TOMBSTONE_TTL`].
#[derive(Debug, Default)]
struct Tombstones {
    order: VecDeque<(Instant, String)>,
    ids: HashSet<String>,
}

impl Tombstones {
    fn expire(&mut self, now: Instant) {
        while let Some((at, _)) = self.order.front() {
            if now.duration_since(*at) < TOMBSTONE_TTL && self.order.len() <= MAX_TOMBSTONES {
                break;
            }
            if let Some((_, id)) = self.order.pop_front() {
                self.ids.remove(&id);
            }
        }
    }

    fn add(&mut self, id: &str, now: Instant) {
        self.expire(now);
        if self.ids.insert(id.to_string()) {
            self.order.push_back((now, id.to_string()));
        }
    }

    /// Whether `id` was freed recently (kept until it expires: a late add may come more
    /// than once).
    fn holds(&mut self, id: &str, now: Instant) -> bool {
        self.expire(now);
        self.ids.contains(id)
    }
}

impl Replicas {
    /// The running sync, if `--replica-sync-port` started one.
    pub fn get(&self) -> Option<&Arc<DynamoSync>> {
        self.sync.get()
    }

    /// Records the started sync (once).
    pub(crate) fn set(&self, sync: Arc<DynamoSync>) {
        let _ = self.sync.set(sync);
    }

    /// The running JetStream sync, if `--replica-sync` started one.
    pub fn jetstream(&self) -> Option<&Arc<JetStreamSync>> {
        self.jetstream.get()
    }

    /// Records the started JetStream sync (once).
    pub(crate) fn set_jetstream(&self, sync: Arc<JetStreamSync>) {
        let _ = self.jetstream.set(sync);
    }

    /// Whether either sync runs (local bookings are published).
    pub(crate) fn active(&self) -> bool {
        self.sync.get().is_some() || self.jetstream.get().is_some()
    }

    /// Publishes a local booking event through whichever sync runs (never waits).
    pub(crate) fn publish(&self, ev: BookingEvent) {
        if let Some(s) = self.sync.get() {
            s.publish(ev);
        } else if let Some(s) = self.jetstream.get() {
            s.publish(ev);
        }
    }

    fn tombstones(&self) -> std::sync::MutexGuard<'_, Tombstones> {
        self.tombstones.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `id` was freed, or its free came before its add: a late add is dropped.
    pub(crate) fn bury(&self, id: &str, now: Instant) {
        self.tombstones().add(id, now);
    }

    /// Whether `id` was freed within [`TOMBSTONE_TTL`].
    pub(crate) fn buried(&self, id: &str, now: Instant) -> bool {
        self.tombstones().holds(id, now)
    }
}

/// Checks the flags as Dynamo does before anything starts.
pub fn check_args(port: Option<u16>, peers: &[String]) -> Result<(), String> {
    match port {
        None if !peers.is_empty() => {
            Err("--replica-sync-peers requires --replica-sync-port".to_string())
        }
        Some(0) => Err("replica sync port must be greater than zero".to_string()),
        _ => Ok(()),
    }
}

/// `/metrics`: the sync's counters and its links (nothing while sync is off).
#[derive(Debug)]
pub struct ReplicaMetrics(pub Arc<Replicas>);

impl prometheus_client::collector::Collector for ReplicaMetrics {
    fn encode(
        &self,
        mut enc: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        if let Some(js) = self.0.jetstream() {
            return encode_jetstream(js, enc);
        }
        let Some(sync) = self.0.get() else {
            return Ok(());
        };
        encode_events(&mut enc, sync.stats())?;
        let (publisher, subscriber) = sync.transport_stats();
        crate::figures::family(
            &mut enc,
            "kvr_replica_sync_peers",
            "Replica sync links up now: peers subscribed to this replica (publisher), peers this replica is connected to (subscriber)",
            MetricType::Gauge,
            &[
                (vec![("side", "publisher".to_string())], ConstGauge::new(publisher.subscribers as i64)),
                (vec![("side", "subscriber".to_string())], ConstGauge::new(subscriber.connected as i64)),
            ],
        )?;
        crate::figures::family(
            &mut enc,
            "kvr_replica_sync_dropped",
            "Replica sync messages a full queue dropped (publisher: to a slow peer; subscriber: before this replica applied them)",
            MetricType::Counter,
            &[
                (vec![("side", "publisher".to_string())], ConstCounter::new(publisher.dropped_full)),
                (vec![("side", "subscriber".to_string())], ConstCounter::new(subscriber.dropped_full)),
            ],
        )?;
        crate::figures::family(
            &mut enc,
            "kvr_replica_sync_link_failures",
            "Replica sync links ended or refused: heartbeat timeouts, protocol errors, refused handshakes, reconnects",
            MetricType::Counter,
            &[
                (vec![("kind", "timeout".to_string())], ConstCounter::new(publisher.timeouts + subscriber.timeouts)),
                (vec![("kind", "protocol".to_string())], ConstCounter::new(publisher.protocol_errors + subscriber.protocol_errors)),
                (vec![("kind", "refused".to_string())], ConstCounter::new(publisher.refused + subscriber.refused)),
                (vec![("kind", "reconnect".to_string())], ConstCounter::new(subscriber.reconnects)),
            ],
        )
    }
}

/// `kvr_replica_sync_events_total{what}`: the same family in both modes.
fn encode_events(
    enc: &mut prometheus_client::encoding::DescriptorEncoder,
    stats: kvr_replica::SyncStats,
) -> Result<(), std::fmt::Error> {
    use prometheus_client::metrics::counter::ConstCounter;
    let rows: Vec<(crate::figures::Labels, ConstCounter)> = stats
        .named()
        .into_iter()
        .map(|(what, n)| (vec![("what", what.to_string())], ConstCounter::new(n)))
        .collect();
    crate::figures::family(
        enc,
        "kvr_replica_sync_events",
        "Replica sync: booking events sent, received, and how each received one was taken",
        prometheus_client::metrics::MetricType::Counter,
        &rows,
    )
}

/// `/metrics` of the JetStream sync: the same `kvr_replica_sync_events_total{what}` as the
/// Dynamo-compatible sync's, and its own families.
fn encode_jetstream(
    js: &JetStreamSync,
    mut enc: prometheus_client::encoding::DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    use prometheus_client::metrics::counter::ConstCounter;
    use prometheus_client::metrics::gauge::ConstGauge;
    use prometheus_client::metrics::MetricType;
    encode_events(&mut enc, js.stats())?;
    let s = js.jetstream_stats();
    let (gauges, counters): (Vec<_>, Vec<_>) = s
        .named()
        .into_iter()
        .partition(|(what, _)| matches!(*what, "queued" | "peers"));
    let rows: Vec<(crate::figures::Labels, ConstCounter)> = counters
        .into_iter()
        .map(|(what, n)| (vec![("what", what.to_string())], ConstCounter::new(n)))
        .collect();
    crate::figures::family(
        &mut enc,
        "kvr_replica_sync_jetstream",
        "JetStream replica sync: publishes acknowledged, de-duplicated, retried and dropped; sequence gaps, replays and events lost; consumer restarts",
        MetricType::Counter,
        &rows,
    )?;
    let mut rows: Vec<(crate::figures::Labels, ConstGauge)> = gauges
        .into_iter()
        .map(|(what, n)| (vec![("what", what.to_string())], ConstGauge::new(n as i64)))
        .collect();
    rows.push((
        vec![("what", "connected".to_string())],
        ConstGauge::new(i64::from(js.connected())),
    ));
    crate::figures::family(
        &mut enc,
        "kvr_replica_sync_jetstream_state",
        "JetStream replica sync now: events waiting to be published, peers heard from, whether the server link is up",
        MetricType::Gauge,
        &rows,
    )
}
