//! kvr's own subscriber: a ZMQ subscription ([`crate::transport`]) whose frames go to the
//! engine's [`EventSource`] for a partition, with replay. All a publisher's bookkeeping
//! (its stream, sequence tracking, replay state, when it was last heard, idle probes) is
//! the source's; this module only opens sockets and passes bytes and the clock.
//!
//! Two shapes, as vLLM deployments have them (REFERENCE.md §2):
//! - **connect**: kvr connects to one engine's bound PUB socket (and its replay ROUTER);
//!   every message is that engine's, one stream ([`EventSource::single`]).
//! - **bind**: kvr binds one endpoint and many engines connect to it (vLLM connects when
//!   its endpoint has no `*`); each topic is its own stream, routed by [`TopicRoute`]s or
//!   by the digits that end the topic ([`EventSource::by_topic`]), at most
//!   [`SubscribeOptions::max_unrouted_topics`] of the latter.
//!
//! Replayed batches pass the same topic filter as live ones: the transport drops those
//! outside the subscription's topic, and a bound source those not under the replaying
//! stream's topic.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvr::ingress::{
    EventSource, HealthReason, ReplayResult, SourceAction, TopicRoute, DEFAULT_MAX_UNROUTED_TOPICS,
};
use kvr::{Partition, WorkerId};

use crate::transport::{FrameSink, ReplayEnd, StartGate, Subscriber, SubscriberConfig};

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
/// 5 s, no silence bound).
#[derive(Clone, Debug)]
pub struct SubscribeOptions {
    /// Probe a stream with a replay endpoint after this long without a message (and once
    /// right after subscribing); `None`: never probe.
    pub idle_probe_after: Option<Duration>,
    /// How long a replay may go without a reply before it fails.
    pub replay_timeout: Duration,
    /// Bind: the most route-less topics given a stream of their own (default
    /// [`DEFAULT_MAX_UNROUTED_TOPICS`]); a message under any further unknown topic is
    /// dropped and counted (`IndexerStats::ingress_refused`). 0 takes routed topics only.
    pub max_unrouted_topics: usize,
    /// A stream silent this long while connected counts as dead (`None`: silence never
    /// does; an idle engine without a replay endpoint is silent).
    pub silence_bound: Option<Duration>,
    /// Start no stream (open no socket, apply nothing) until this gate opens; `None`:
    /// start at once. kvr serve holds its streams this way while it recovers the index
    /// from a peer, so that no live event applies before the peer's older dump.
    pub start_gate: Option<StartGate>,
}

impl Default for SubscribeOptions {
    fn default() -> Self {
        SubscribeOptions {
            idle_probe_after: Some(Duration::from_millis(1500)),
            replay_timeout: Duration::from_secs(5),
            max_unrouted_topics: DEFAULT_MAX_UNROUTED_TOPICS,
            silence_bound: None,
            start_gate: None,
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
    /// Stops the subscription and waits for its task on the ingest thread to end: after
    /// this returns, no event of it is applied any more and its sockets are closed.
    /// Idempotent. (Called from the ingest thread itself it cannot wait; see
    /// [`crate::transport`], "Threads and stopping".)
    pub fn stop(&mut self) {
        self.subscriber.stop();
    }

    pub fn is_running(&self) -> bool {
        self.subscriber.is_running()
    }
}

/// The engine's source as the transport's sink: frames and the clock in, its actions out.
struct SourceSink(EventSource<Arc<Partition>>);

impl FrameSink for SourceSink {
    fn on_message(&mut self, topic: &[u8], seq: u64, payload: &[u8]) -> SourceAction {
        self.0.on_message(topic, seq, payload, Instant::now())
    }

    fn on_replayed(&mut self, id: u32, topic: &[u8], seq: u64, payload: &[u8]) -> SourceAction {
        self.0
            .on_replayed_under(id, topic, seq, payload, Instant::now())
    }

    fn on_replay_end(&mut self, id: u32, end: ReplayEnd) -> SourceAction {
        let result = match end {
            ReplayEnd::Completed => ReplayResult::Completed,
            _ => ReplayResult::Failed,
        };
        self.0.on_replay_end(id, result, Instant::now())
    }

    fn on_tick(&mut self, actions: &mut Vec<SourceAction>) {
        self.0.on_tick(Instant::now(), actions);
    }

    fn on_bad_frame(&mut self, _why: &'static str) {
        self.0.on_bad_frame();
    }

    fn on_link(&mut self, down: Option<HealthReason>) {
        self.0.on_link(down, Instant::now());
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

/// Subscribes `partition` to engine events as `cfg` says, on the process's ingest thread
/// (shared by every subscription), with the default [`SubscribeOptions`].
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
    validate(&cfg)?;
    let refused = |e: kvr::ingress::SourceRefused| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
    };
    let probe = options.idle_probe_after;
    let (transport, source) = match cfg {
        SubscribeConfig::Connect {
            endpoint,
            replay_endpoint,
            topic,
            worker_id,
            stream,
        } => {
            let mut t = SubscriberConfig::connect(&endpoint);
            t.topic = topic;
            t.replay_endpoint = replay_endpoint.clone();
            let source = EventSource::single(partition, worker_id, stream, replay_endpoint, probe);
            (
                t,
                source
                    .map_err(refused)?
                    .with_silence_bound(options.silence_bound),
            )
        }
        SubscribeConfig::Bind { endpoint, routes } => {
            let source = EventSource::by_topic(partition, routes, probe)
                .map(|s| s.with_max_unrouted_topics(options.max_unrouted_topics));
            let source = source.map_err(refused)?;
            (
                SubscriberConfig::bind(&endpoint),
                source.with_silence_bound(options.silence_bound),
            )
        }
    };
    let transport = SubscriberConfig {
        replay_timeout: options.replay_timeout,
        tick_interval: source.tick_interval(),
        start_gate: options.start_gate,
        ..transport
    };
    Ok(Subscription {
        subscriber: Subscriber::start(transport, Box::new(SourceSink(source)))?,
    })
}
