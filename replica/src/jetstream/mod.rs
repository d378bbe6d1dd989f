//! Replica sync over NATS JetStream, which loses nothing the stream holds: every local
//! booking event goes to a file-backed stream (subject `<stream>.ev.<replica name>`),
//! acknowledged and de-duplicated, with the replica's incarnation and a sequence number;
//! every replica reads the others' events in stream order, replays after a failure or a
//! gap, and at a fresh start reloads the live bookings from the stream's retention.
//! Heartbeats on core NATS (`<stream>.hb.<replica name>`) tell which replicas are alive.

mod consumer;
mod envelope;
mod parked;
mod publisher;
mod senders;
mod stats;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::dynamo_sync::BookingSink;
use crate::event::BookingEvent;
use crate::stats::{SyncCounters, SyncStats};
pub use envelope::{valid_name, MAX_NAME_LEN};
pub use stats::JetStreamStats;

/// The stream's name when none is given.
pub const DEFAULT_STREAM: &str = "KVR_BOOKINGS";

/// How long the stream keeps an event beyond the peer-booking lifetime.
pub const RETENTION_MARGIN: Duration = Duration::from_secs(60);

/// The stream's byte bound when none is given (oldest events go first beyond it).
pub const DEFAULT_MAX_BYTES: i64 = 1 << 30;

/// How long the server remembers a message id to drop a retried publish.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// The most events waiting to be published (while the server is down); beyond it an
/// event is dropped and counted, and peers see a gap in its sequence.
pub const PUBLISH_QUEUE: usize = 100_000;

/// How often a replica says it is alive.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// What to start.
#[derive(Clone, Debug)]
pub struct JetStreamConfig {
    /// The server (`nats://host:port`).
    pub url: String,
    /// This replica's name: a subject token, the same across its restarts.
    pub name: String,
    /// The stream (created when missing).
    pub stream: String,
    /// A peer whose heartbeats stop this long has its bookings dropped here.
    pub peer_silence: Duration,
    /// A peer's booking lives this long after it was published at most.
    pub booking_lifetime: Duration,
    /// The stream's byte bound.
    pub max_bytes: i64,
    /// Replay at start and after failures (off only for tests' negative controls).
    pub replay: bool,
}

/// A running JetStream replica sync.
pub struct JetStreamSync {
    name: String,
    incarnation: u64,
    stream: String,
    /// The sequence number last given out, and the queue, under one lock: sequence
    /// numbers enter the queue in order.
    outbox: Mutex<(u64, mpsc::Sender<publisher::Outgoing>)>,
    counters: Arc<SyncCounters>,
    js: Arc<stats::JsCounters>,
    client: async_nats::Client,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for JetStreamSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamSync")
            .field("name", &self.name)
            .field("incarnation", &self.incarnation)
            .field("stream", &self.stream)
            .finish()
    }
}

/// A new incarnation id: the start time in microseconds, so a restart under the same
/// name has a larger one (peers ignore the older one's late events).
fn new_incarnation() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64)
        .max(1)
}

impl JetStreamSync {
    /// Connects, creates the stream or binds to it, and starts the publisher, the
    /// heartbeat and the consumer on the current tokio runtime.
    pub async fn start(
        cfg: JetStreamConfig,
        sink: Arc<dyn BookingSink>,
    ) -> Result<Arc<Self>, String> {
        if !valid_name(&cfg.name) {
            return Err(format!(
                "replica name `{}` must be 1 to {MAX_NAME_LEN} letters, digits, `-` or `_`",
                cfg.name
            ));
        }
        if !valid_name(&cfg.stream) {
            return Err(format!(
                "replica sync stream `{}` must be 1 to {MAX_NAME_LEN} letters, digits, `-` or `_`",
                cfg.stream
            ));
        }
        let client = async_nats::ConnectOptions::new()
            .name(format!("kvr-replica-{}", cfg.name))
            .connect(cfg.url.as_str())
            .await
            .map_err(|e| format!("replica sync: cannot connect to `{}`: {e}", cfg.url))?;
        let js = async_nats::jetstream::new(client.clone());
        let filter = format!("{}.ev.>", cfg.stream);
        let retention = cfg.booking_lifetime + RETENTION_MARGIN;
        let stream = js
            .get_or_create_stream(async_nats::jetstream::stream::Config {
                name: cfg.stream.clone(),
                subjects: vec![filter.clone()],
                max_age: retention,
                max_bytes: cfg.max_bytes,
                storage: async_nats::jetstream::stream::StorageType::File,
                discard: async_nats::jetstream::stream::DiscardPolicy::Old,
                duplicate_window: DUPLICATE_WINDOW,
                ..Default::default()
            })
            .await
            .map_err(|e| {
                format!(
                    "replica sync: cannot create or bind stream `{}`: {e}",
                    cfg.stream
                )
            })?;
        let have = &stream.cached_info().config;
        if !have.max_age.is_zero() && have.max_age < cfg.booking_lifetime {
            tracing::warn!(
                stream = cfg.stream,
                max_age = ?have.max_age,
                "replica sync (jetstream): the existing stream keeps events for less than a booking's lifetime; a replica starting late misses the older live bookings"
            );
        }
        let incarnation = new_incarnation();
        let counters: Arc<SyncCounters> = Arc::default();
        let jsc: Arc<stats::JsCounters> = Arc::default();
        let (tx, rx) = mpsc::channel(PUBLISH_QUEUE);
        let mut tasks = Vec::new();
        tasks.push(tokio::spawn(publisher::run(
            js.clone(),
            format!("{}.ev.{}", cfg.stream, cfg.name),
            rx,
            jsc.clone(),
        )));
        let applier = consumer::Applier {
            sink,
            me: cfg.name.clone(),
            incarnation,
            counters: counters.clone(),
            js: jsc.clone(),
            senders: senders::Senders::default(),
            lifetime: cfg.booking_lifetime,
            silence: cfg.peer_silence,
            replay: cfg.replay,
            last_stream_seq: None,
            replayed_gap_at: None,
            parked: parked::ParkedAdds::default(),
            link_up: true,
        };
        tasks.push(tokio::spawn(consumer::run(
            client.clone(),
            js,
            cfg.stream.clone(),
            filter,
            format!("{}.hb.*", cfg.stream),
            applier,
        )));
        let sync = Arc::new(Self {
            name: cfg.name.clone(),
            incarnation,
            stream: cfg.stream.clone(),
            outbox: Mutex::new((0, tx)),
            counters,
            js: jsc,
            client: client.clone(),
            tasks: Mutex::new(tasks),
        });
        let hb_subject = format!("{}.hb.{}", cfg.stream, cfg.name);
        let weak = Arc::downgrade(&sync);
        let heartbeat = tokio::spawn(async move {
            let mut tick = tokio::time::interval(HEARTBEAT_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(s) = weak.upgrade() else { return };
                let payload = envelope::encode_heartbeat(&envelope::Heartbeat {
                    name: s.name.clone(),
                    incarnation: s.incarnation,
                    seq: s.lock_outbox().0,
                });
                let client = s.client.clone();
                drop(s);
                // Only enqueues on the client (it may wait while its buffer is full: this
                // task only).
                let _ = client
                    .publish(hb_subject.clone(), Bytes::from(payload))
                    .await;
            }
        });
        sync.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(heartbeat);
        tracing::info!(
            url = cfg.url,
            stream = cfg.stream,
            name = cfg.name,
            incarnation,
            "replica sync (jetstream): started"
        );
        Ok(sync)
    }

    fn lock_outbox(&self) -> std::sync::MutexGuard<'_, (u64, mpsc::Sender<publisher::Outgoing>)> {
        self.outbox.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enqueues a local booking event for the stream (never waits: over
    /// [`PUBLISH_QUEUE`] the event is dropped and counted, and its sequence number is
    /// spent so peers see the gap).
    pub fn publish(&self, mut ev: BookingEvent) {
        ev.router_id = self.incarnation;
        let mut outbox = self.lock_outbox();
        outbox.0 += 1;
        let seq = outbox.0;
        let payload = envelope::encode(&self.name, self.incarnation, seq, &ev);
        let out = publisher::Outgoing {
            msg_id: format!("{}-{}-{}", self.name, self.incarnation, seq),
            payload: Bytes::from(payload),
        };
        // Counted before the send: the publisher task decrements it.
        self.js.queued.fetch_add(1, Ordering::Relaxed);
        match outbox.1.try_send(out) {
            Ok(()) => SyncCounters::bump(&self.counters.sent),
            Err(_) => {
                self.js.queued.fetch_sub(1, Ordering::Relaxed);
                self.js.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// This replica's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This process's incarnation id.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The booking outcomes and message counts (as the Dynamo-compatible sync's).
    pub fn stats(&self) -> SyncStats {
        self.counters.snapshot()
    }

    /// The JetStream side's counters.
    pub fn jetstream_stats(&self) -> JetStreamStats {
        self.js.snapshot()
    }

    /// Whether the link to the server is up now.
    pub fn connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Waits until every event enqueued so far is acknowledged by the stream, or
    /// `timeout` passed: whether they all were.
    pub async fn flush(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let (sent, js) = (self.counters.snapshot().sent, self.js.snapshot());
            if js.acked >= sent {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the tasks: publisher, consumer, heartbeat (events still queued are not
    /// published; [`JetStreamSync::flush`] first).
    pub fn close(&self) {
        for t in self.tasks.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            t.abort();
        }
    }
}
