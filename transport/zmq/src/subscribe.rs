//! kvr's own subscriber: a ZMQ subscription ([`crate::transport`]) whose messages go
//! through the engine's ingress streams ([`IngressStream`], `kvr::ingress::ingest`) into a
//! partition, with replay.
//!
//! Two shapes, as vLLM deployments have them (REFERENCE.md §2):
//! - **connect**: kvr connects to one engine's bound PUB socket (and its replay ROUTER);
//!   every message is that engine's, one stream.
//! - **bind**: kvr binds one endpoint and many engines connect to it (vLLM connects when
//!   its endpoint has no `*`). Each topic is its own stream; the worker comes from the
//!   configured topic routes, else from the digits that end the topic (`"kv-17"` → 17;
//!   such route-less topics of one worker are its streams 0, 1, … in the order they are
//!   first heard, so each keeps its own counters and its own clears).
//!   Each route may name its publisher's replay ROUTER; every stream replays on its own
//!   (concurrently, each with its own timeout), so one stuck replay delays no other.
//!
//! Recovery follows `kvr::ingress::sequence`: replay on join, on a gap and on a restart,
//! and an **idle probe** — a stream with a replay endpoint that has been silent for
//! [`SubscribeOptions::idle_probe_after`] (and every such stream right after subscribing)
//! asks its publisher for what came after the last batch applied, which finds losses at
//! the end of a burst and restarts of idle engines.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvr::ingress::ReplayResult;
use kvr::ingress::{IngestOutcome, IngressStream};
use kvr::Partition;
use kvr::WorkerId;

use crate::transport::{FrameSink, ReplayEnd, SinkAction, Subscriber, SubscriberConfig};

/// Where a topic's messages come from (bind mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicRoute {
    pub topic: Vec<u8>,
    pub worker_id: WorkerId,
    /// The publisher's stream number (e.g. its DP rank).
    pub stream: u32,
    /// The publisher's replay ROUTER, if it has one.
    pub replay_endpoint: Option<String>,
}

/// What to subscribe to.
#[derive(Clone, Debug)]
pub enum SubscribeConfig {
    /// Connect to one engine's PUB endpoint (and its replay endpoint, if any).
    Connect {
        endpoint: String,
        replay_endpoint: Option<String>,
        /// Topic prefix filter (empty = everything).
        topic: Vec<u8>,
        worker_id: WorkerId,
        stream: u32,
    },
    /// Bind `endpoint`; engines connect to it and are told apart by topic.
    Bind {
        endpoint: String,
        routes: Vec<TopicRoute>,
    },
}

/// How a subscription recovers (defaults: probe after 1.5 s of silence, replay timeout
/// 5 s).
#[derive(Clone, Debug)]
pub struct SubscribeOptions {
    /// Probe a stream with a replay endpoint after this long without a message (and once
    /// right after subscribing); `None`: never probe.
    pub idle_probe_after: Option<Duration>,
    /// How long a replay may go without a reply before it fails.
    pub replay_timeout: Duration,
}

impl Default for SubscribeOptions {
    fn default() -> Self {
        SubscribeOptions {
            idle_probe_after: Some(Duration::from_millis(1500)),
            replay_timeout: Duration::from_secs(5),
        }
    }
}

/// A running subscription; `stop` (or drop) ends it.
pub struct Subscription {
    subscriber: Subscriber,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription").finish_non_exhaustive()
    }
}

impl Subscription {
    /// Stops the subscription and joins its thread: after this returns, no event of it is
    /// applied any more. Idempotent.
    pub fn stop(&mut self) {
        self.subscriber.stop();
    }

    pub fn is_running(&self) -> bool {
        self.subscriber.is_running()
    }
}

struct Stream {
    topic: Vec<u8>,
    replay_endpoint: Option<String>,
    state: IngressStream,
    worker: WorkerId,
    /// The last message (live or replayed) or probe; `None` before the first.
    last_heard: Option<Instant>,
}

struct PartitionSink {
    partition: Arc<Partition>,
    /// Connect mode: the one stream; bind mode: one per topic seen (and one per route
    /// with a replay endpoint from the start, so that it is probed at once). A stream's
    /// index is its replay id.
    streams: Vec<Stream>,
    routes: Vec<TopicRoute>,
    bind: bool,
    idle_probe_after: Option<Duration>,
}

/// The lowest stream number of `worker` no stream or route uses yet.
fn next_stream(streams: &[Stream], routes: &[TopicRoute], worker: WorkerId) -> u32 {
    let used = |n: u32| {
        routes
            .iter()
            .any(|r| r.worker_id == worker && r.stream == n)
            || streams
                .iter()
                .any(|s| s.worker == worker && s.state.stream() == n)
    };
    (0..).find(|&n| !used(n)).unwrap_or(0)
}

/// The worker named by the digits that end `topic`.
fn worker_from_topic(topic: &[u8]) -> Option<WorkerId> {
    let digits = topic
        .iter()
        .rev()
        .take_while(|b| b.is_ascii_digit())
        .count();
    let tail = std::str::from_utf8(&topic[topic.len() - digits..]).ok()?;
    tail.parse().ok()
}

impl PartitionSink {
    fn stream_for(&mut self, topic: &[u8]) -> Option<usize> {
        if !self.bind {
            return Some(0);
        }
        if let Some(i) = self.streams.iter().position(|s| s.topic == topic) {
            return Some(i);
        }
        let (worker, stream, replay) = match self.routes.iter().find(|r| r.topic == topic) {
            Some(r) => (r.worker_id, r.stream, r.replay_endpoint.clone()),
            None => {
                let w = worker_from_topic(topic)?;
                (w, next_stream(&self.streams, &self.routes, w), None)
            }
        };
        self.add_stream(topic.to_vec(), worker, stream, replay);
        Some(self.streams.len() - 1)
    }

    fn add_stream(
        &mut self,
        topic: Vec<u8>,
        worker: WorkerId,
        stream: u32,
        replay_endpoint: Option<String>,
    ) {
        let state = IngressStream::new(&self.partition, worker, stream, replay_endpoint.is_some());
        self.streams.push(Stream {
            topic,
            replay_endpoint,
            state,
            worker,
            last_heard: None,
        });
    }

    /// Feeds stream `i` (if it exists) one step, noting that it was heard from, and
    /// returns the transport's action for the outcome.
    fn feed(
        &mut self,
        i: usize,
        step: impl FnOnce(&mut IngressStream, &Arc<Partition>) -> IngestOutcome,
    ) -> SinkAction {
        let Some(s) = self.streams.get_mut(i) else {
            return SinkAction::Continue;
        };
        s.last_heard = Some(Instant::now());
        let out = step(&mut s.state, &self.partition);
        self.action(i, out)
    }

    /// The transport's action for stream `i`'s outcome (a replay, as replay id `i`).
    fn action(&self, i: usize, out: IngestOutcome) -> SinkAction {
        let Some(from_seq) = out.replay_from else {
            return SinkAction::Continue;
        };
        SinkAction::Replay {
            id: i as u32,
            from_seq,
            // Connect mode: the transport's configured endpoint.
            endpoint: if self.bind {
                self.streams[i].replay_endpoint.clone()
            } else {
                None
            },
        }
    }
}

impl FrameSink for PartitionSink {
    fn on_message(&mut self, topic: &[u8], seq: u64, payload: &[u8]) -> SinkAction {
        let Some(i) = self.stream_for(topic) else {
            self.on_bad_frame("topic names no worker");
            return SinkAction::Continue;
        };
        self.feed(i, |s, p| s.on_live(p, seq, payload))
    }

    fn on_replayed(&mut self, id: u32, _topic: &[u8], seq: u64, payload: &[u8]) -> SinkAction {
        self.feed(id as usize, |s, p| s.on_replayed(p, seq, payload))
    }

    fn on_replay_end(&mut self, id: u32, end: ReplayEnd) -> SinkAction {
        let result = match end {
            ReplayEnd::Completed => ReplayResult::Completed,
            _ => ReplayResult::Failed,
        };
        self.feed(id as usize, |s, p| s.on_replay_end(p, result))
    }

    fn on_tick(&mut self, actions: &mut Vec<SinkAction>) {
        let Some(after) = self.idle_probe_after else {
            return;
        };
        let now = Instant::now();
        for i in 0..self.streams.len() {
            let s = &self.streams[i];
            let idle = s
                .last_heard
                .map_or(true, |t| now.duration_since(t) >= after);
            if !idle || s.state.replaying() {
                continue;
            }
            match self.feed(i, |s, p| s.on_idle(p)) {
                SinkAction::Continue => {}
                a => actions.push(a),
            }
        }
    }

    fn on_bad_frame(&mut self, _why: &'static str) {
        if let Some(s) = self.streams.first_mut() {
            s.state.on_bad_frame();
        }
    }
}

/// Checks every endpoint of `cfg` (the subscription's own and every replay endpoint):
/// `InvalidInput` names the first malformed one. [`subscribe`] does this before anything
/// else, so a refused subscription leaves no trace (no stream in the ingress stats).
pub fn validate(cfg: &SubscribeConfig) -> std::io::Result<()> {
    use crate::transport::checked_endpoint;
    match cfg {
        SubscribeConfig::Connect {
            endpoint,
            replay_endpoint,
            ..
        } => {
            checked_endpoint(endpoint, false)?;
            if let Some(r) = replay_endpoint {
                checked_endpoint(r, false)?;
            }
        }
        SubscribeConfig::Bind { endpoint, routes } => {
            checked_endpoint(endpoint, true)?;
            for r in routes.iter().filter_map(|r| r.replay_endpoint.as_deref()) {
                checked_endpoint(r, false)?;
            }
        }
    }
    Ok(())
}

/// Subscribes `partition` to engine events as `cfg` says, on a thread of its own, with
/// the default [`SubscribeOptions`].
///
/// A partition whose indexer policy applies no events (events off, or a remote primary:
/// DESIGN.md §5) is refused: it starts no local subscription.
pub fn subscribe(partition: Arc<Partition>, cfg: SubscribeConfig) -> std::io::Result<Subscription> {
    subscribe_with(partition, cfg, SubscribeOptions::default())
}

/// [`subscribe`] with these recovery options.
pub fn subscribe_with(
    partition: Arc<Partition>,
    cfg: SubscribeConfig,
    options: SubscribeOptions,
) -> std::io::Result<Subscription> {
    if !partition.indexer_policy().applies_events() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "the partition's indexer policy ({:?}) applies no engine events: no subscription",
                partition.indexer_policy()
            ),
        ));
    }
    validate(&cfg)?;
    let (transport, sink) = match cfg {
        SubscribeConfig::Connect {
            endpoint,
            replay_endpoint,
            topic,
            worker_id,
            stream,
        } => {
            let mut t = SubscriberConfig::connect(&endpoint);
            t.topic = topic.clone();
            t.replay_endpoint = replay_endpoint.clone();
            let mut sink = PartitionSink {
                partition,
                streams: Vec::new(),
                routes: Vec::new(),
                bind: false,
                idle_probe_after: options.idle_probe_after,
            };
            sink.add_stream(topic, worker_id, stream, replay_endpoint);
            (t, sink)
        }
        SubscribeConfig::Bind { endpoint, routes } => {
            let t = SubscriberConfig::bind(&endpoint);
            let mut sink = PartitionSink {
                partition,
                streams: Vec::new(),
                routes,
                bind: true,
                idle_probe_after: options.idle_probe_after,
            };
            for r in sink.routes.clone() {
                if r.replay_endpoint.is_some() {
                    sink.add_stream(r.topic, r.worker_id, r.stream, r.replay_endpoint);
                }
            }
            (t, sink)
        }
    };
    let transport = SubscriberConfig {
        replay_timeout: options.replay_timeout,
        // Often enough that a probe starts within a fifth of the silence it waits for.
        tick_interval: options
            .idle_probe_after
            .map(|d| (d / 5).min(Duration::from_millis(250))),
        ..transport
    };
    Ok(Subscription {
        subscriber: Subscriber::start(transport, Box::new(sink))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvr::config::PartitionConfig;
    use kvr::PartitionKey;

    #[test]
    fn route_less_topics_of_one_worker_are_distinct_streams() {
        let mut sink = PartitionSink {
            partition: Arc::new(Partition::new(
                PartitionKey::new("m", "g"),
                PartitionConfig::new(4),
            )),
            streams: Vec::new(),
            routes: vec![TopicRoute {
                topic: b"routed".to_vec(),
                worker_id: 17,
                stream: 0,
                replay_endpoint: None,
            }],
            bind: true,
            idle_probe_after: None,
        };
        for t in [&b"routed"[..], b"a-17", b"b-17", b"a-17", b"c-3"] {
            sink.stream_for(t).unwrap();
        }
        let got: Vec<(u64, u32)> = sink
            .streams
            .iter()
            .map(|s| (s.worker, s.state.stream()))
            .collect();
        assert_eq!(got, vec![(17, 0), (17, 1), (17, 2), (3, 0)]);
        assert!(sink.stream_for(b"no-digits").is_none());
        let stats: Vec<(u64, u32)> = sink
            .partition
            .ingress_stats()
            .iter()
            .map(|s| (s.worker_id, s.stream))
            .collect();
        assert_eq!(stats, got, "each stream has its own counters");
    }

    #[test]
    fn the_worker_is_the_number_that_ends_the_topic() {
        assert_eq!(worker_from_topic(b"kv-17"), Some(17));
        assert_eq!(worker_from_topic(b"42"), Some(42));
        assert_eq!(worker_from_topic(b"kv"), None);
        assert_eq!(worker_from_topic(b""), None);
    }
}
