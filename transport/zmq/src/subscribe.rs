//! kvr's own subscriber: a ZMQ subscription ([`crate::transport`]) whose messages go
//! through the engine's ingress streams ([`IngressStream`], `kvr::ingress::ingest`) into a
//! partition, with replay.
//!
//! Two shapes, as vLLM deployments have them (REFERENCE.md §2):
//! - **connect**: kvr connects to one engine's bound PUB socket (and its replay ROUTER);
//!   every message is that engine's, one stream.
//! - **bind**: kvr binds one endpoint and many engines connect to it (vLLM connects when
//!   its endpoint has no `*`). Each topic is its own stream; the worker comes from the
//!   configured topic routes, else from the digits that end the topic (`"kv-17"` → 17).
//!   Each route may name its publisher's replay ROUTER. One replay runs at a time per
//!   subscription: a second stream that needs one meanwhile is treated as unreplayable
//!   (its worker is cleared) rather than waiting.

use std::sync::Arc;

use kvr::index::WorkerId;
use kvr::ingress::ingest::IngressStream;
use kvr::ingress::sequence::ReplayResult;
use kvr::partition::Partition;

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
}

struct PartitionSink {
    partition: Arc<Partition>,
    /// Connect mode: the one stream; bind mode: one per topic seen.
    streams: Vec<Stream>,
    routes: Vec<TopicRoute>,
    bind: bool,
    /// The stream whose replay is in flight.
    replaying: Option<usize>,
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
            None => (worker_from_topic(topic)?, 0, None),
        };
        self.streams.push(Stream {
            topic: topic.to_vec(),
            state: IngressStream::new(&self.partition, worker, stream, replay.is_some()),
            replay_endpoint: replay,
        });
        Some(self.streams.len() - 1)
    }
}

impl FrameSink for PartitionSink {
    fn on_message(&mut self, topic: &[u8], seq: u64, payload: &[u8]) -> SinkAction {
        let Some(i) = self.stream_for(topic) else {
            self.on_bad_frame("topic names no worker");
            return SinkAction::Continue;
        };
        let p = self.partition.clone();
        let out = self.streams[i].state.on_live(&p, seq, payload);
        let Some(from_seq) = out.replay_from else {
            return SinkAction::Continue;
        };
        if self.replaying.is_some_and(|r| r != i) {
            // One replay at a time: this stream's gap cannot be filled now.
            self.streams[i]
                .state
                .on_replay_end(&p, ReplayResult::Failed);
            return SinkAction::Continue;
        }
        self.replaying = Some(i);
        match (&self.streams[i].replay_endpoint, self.bind) {
            (Some(endpoint), true) => SinkAction::ReplayAt {
                from_seq,
                endpoint: endpoint.clone(),
            },
            _ => SinkAction::Replay { from_seq },
        }
    }

    fn on_replayed(&mut self, _topic: &[u8], seq: u64, payload: &[u8]) {
        if let Some(i) = self.replaying {
            let p = self.partition.clone();
            self.streams[i].state.on_replayed(&p, seq, payload);
        }
    }

    fn on_replay_end(&mut self, end: ReplayEnd) {
        if let Some(i) = self.replaying.take() {
            let result = match end {
                ReplayEnd::Completed => ReplayResult::Completed,
                _ => ReplayResult::Failed,
            };
            let p = self.partition.clone();
            self.streams[i].state.on_replay_end(&p, result);
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

/// Subscribes `partition` to engine events as `cfg` says, on a thread of its own.
///
/// A partition whose indexer policy applies no events (events off, or a remote primary:
/// DESIGN.md §5) is refused: it starts no local subscription.
pub fn subscribe(partition: Arc<Partition>, cfg: SubscribeConfig) -> std::io::Result<Subscription> {
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
            let state =
                IngressStream::new(&partition, worker_id, stream, replay_endpoint.is_some());
            let mut t = SubscriberConfig::connect(&endpoint);
            t.topic = topic.clone();
            t.replay_endpoint = replay_endpoint.clone();
            let sink = PartitionSink {
                partition,
                streams: vec![Stream {
                    topic,
                    replay_endpoint,
                    state,
                }],
                routes: Vec::new(),
                bind: false,
                replaying: None,
            };
            (t, sink)
        }
        SubscribeConfig::Bind { endpoint, routes } => {
            let t = SubscriberConfig::bind(&endpoint);
            let sink = PartitionSink {
                partition,
                streams: Vec::new(),
                routes,
                bind: true,
                replaying: None,
            };
            (t, sink)
        }
    };
    Ok(Subscription {
        subscriber: Subscriber::start(transport, Box::new(sink))?,
    })
}

#[cfg(test)]
mod tests {
    use super::worker_from_topic;

    #[test]
    fn the_worker_is_the_number_that_ends_the_topic() {
        assert_eq!(worker_from_topic(b"kv-17"), Some(17));
        assert_eq!(worker_from_topic(b"42"), Some(42));
        assert_eq!(worker_from_topic(b"kv"), None);
        assert_eq!(worker_from_topic(b""), None);
    }
}
