//! An event source: everything about a set of publishers except their sockets. A transport
//! (kvr's ZMQ subscriber, a test's in-process channel, a journal replaying what it
//! recorded) owns the sockets, hands each message, replay reply and clock tick to an
//! [`EventSource`], and does what it answers ([`SourceAction`]); the source keeps each
//! publisher's stream (sequence tracking, replay state, counters), which stream a message
//! belongs to, when each was last heard from, and when to probe a silent one.
//!
//! Two shapes, as vLLM deployments have them:
//! - **one publisher** ([`EventSource::single`]): every message is that engine's, one
//!   stream (a subscriber connected to one engine's PUB socket);
//! - **by topic** ([`EventSource::by_topic`]): many engines publish to one place and are
//!   told apart by topic. Each topic is its own stream; the worker comes from the
//!   configured [`TopicRoute`]s, else from the digits that end the topic (`"kv-17"` → 17;
//!   such a route-less topic gets the lowest stream number of that worker that no stream
//!   of the partition has, in the order they are first heard, so each keeps its own
//!   counters and its own clears). Each route may name its publisher's replay endpoint;
//!   every stream replays on its own.
//!
//!   What a peer sends never grows a source without bound: at most
//!   [`EventSource::max_unrouted_topics`] route-less topics get a stream (default
//!   [`DEFAULT_MAX_UNROUTED_TOPICS`]), and none past the partition's stream cap; a
//!   message under any other unknown topic is dropped and counted
//!   (`IndexerStats::ingress_refused`). Finding a message's stream is one hash lookup.
//!   A replayed batch is taken only under its stream's topic, as a live one would be.
//!
//! Recovery follows `sequence`: replay on join, on a gap and on a restart, and an **idle
//! probe**: a stream that can replay and has been silent for the source's
//! `idle_probe_after` (and every such stream right after the source starts) asks its
//! publisher for what came after the last batch applied, which finds losses at the end
//! of a burst and restarts of idle engines.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::ids::WorkerId;

use super::door::{Door, EventSink, IngestOutcome};
use super::health::HealthReason;
use super::sequence::ReplayResult;
use super::stream::IngressStream;

/// Where a topic's messages come from (a source by topic).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicRoute {
    /// The topic the publisher sends under.
    pub topic: Vec<u8>,
    /// The worker it is.
    pub worker_id: WorkerId,
    /// The publisher's stream number (e.g. its DP rank).
    pub stream: u32,
    /// The publisher's replay endpoint, if it has one.
    pub replay_endpoint: Option<String>,
}

/// What the transport does after handing a source something.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceAction {
    /// Nothing.
    Continue,
    /// Ask a publisher to resend batches from `from_seq`, as replay `id` (superseding
    /// replay `id` if it is in flight), at `endpoint`; its replies come back through
    /// [`EventSource::on_replayed`] and [`EventSource::on_replay_end`] with that id.
    Replay {
        /// The stream's replay id.
        id: u32,
        /// The first sequence number wanted.
        from_seq: u64,
        /// The publisher's replay endpoint.
        endpoint: Option<String>,
    },
}

/// Why a sink refused a source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceRefused;

impl std::fmt::Display for SourceRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the partition's indexer policy applies no engine events: no subscription")
    }
}

impl std::error::Error for SourceRefused {}

struct SourceStream {
    topic: Vec<u8>,
    replay_endpoint: Option<String>,
    state: IngressStream,
    worker: WorkerId,
    /// The last message (live or replayed) or probe; `None` before the first.
    last_heard: Option<Instant>,
    /// The last message, completed replay or reconnection (the silence bound's clock);
    /// `None` before the first.
    last_message: Option<Instant>,
}

/// The route-less topics a source by topic gives a stream, unless configured otherwise
/// ([`EventSource::with_max_unrouted_topics`]): far more engines than one endpoint
/// serves, few enough that a flood of made-up topics stays small.
pub const DEFAULT_MAX_UNROUTED_TOPICS: usize = 256;

/// The bookkeeping of one source's publishers (module docs), feeding sink `S`.
pub struct EventSource<S: EventSink> {
    sink: S,
    /// One publisher: the one stream; by topic: one per topic seen (and one per route
    /// with a replay endpoint from the start, so that it is probed at once). A stream's
    /// index is its replay id.
    streams: Vec<SourceStream>,
    /// By topic: each stream's index in `streams`, by its topic.
    by_topic_index: HashMap<Vec<u8>, usize>,
    routes: Vec<TopicRoute>,
    /// Each route's index in `routes`, by its topic.
    route_index: HashMap<Vec<u8>, usize>,
    by_topic: bool,
    /// Route-less topics given a stream so far, and at most.
    unrouted: usize,
    max_unrouted: usize,
    idle_probe_after: Option<Duration>,
    /// A stream silent this long (while its link is up) is dead (`None`: never).
    silence_bound: Option<Duration>,
    /// The first tick (the silence bound's clock for a stream never heard from).
    started: Option<Instant>,
    /// What the transport last reported about the link (`None`: up, or not reported).
    link_down: Option<HealthReason>,
}

impl<S: EventSink> std::fmt::Debug for EventSource<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSource")
            .field("streams", &self.streams.len())
            .field("by_topic", &self.by_topic)
            .finish_non_exhaustive()
    }
}

impl<S: EventSink> EventSource<S> {
    /// A source of one publisher, `worker_id`'s stream `stream`, whose replay endpoint (if
    /// any) resends lost batches; a silent stream with replay is probed after
    /// `idle_probe_after` (`None`: never). Refused when the sink takes no engine events.
    pub fn single(
        sink: S,
        worker_id: WorkerId,
        stream: u32,
        replay_endpoint: Option<String>,
        idle_probe_after: Option<Duration>,
    ) -> Result<Self, SourceRefused> {
        let mut s = Self::new(sink, Vec::new(), false, idle_probe_after)?;
        s.add_stream(Vec::new(), worker_id, stream, replay_endpoint);
        Ok(s)
    }

    /// A source of many publishers told apart by topic, routed by `routes` (module docs).
    /// Refused when the sink takes no engine events.
    pub fn by_topic(
        sink: S,
        routes: Vec<TopicRoute>,
        idle_probe_after: Option<Duration>,
    ) -> Result<Self, SourceRefused> {
        let mut s = Self::new(sink, routes, true, idle_probe_after)?;
        for r in s.routes.clone() {
            if r.replay_endpoint.is_some() {
                s.add_stream(r.topic, r.worker_id, r.stream, r.replay_endpoint);
            }
        }
        Ok(s)
    }

    /// Gives at most `max` route-less topics a stream (a source by topic; module docs).
    pub fn with_max_unrouted_topics(mut self, max: usize) -> Self {
        self.max_unrouted = max;
        self
    }

    /// The most route-less topics this source gives a stream.
    pub fn max_unrouted_topics(&self) -> usize {
        self.max_unrouted
    }

    /// The number of streams this source keeps.
    pub fn stream_count(&self) -> usize {
        self.streams.len()
    }

    /// Each stream's (worker, stream number), by replay id.
    pub fn stream_ids(&self) -> Vec<(WorkerId, u32)> {
        self.streams
            .iter()
            .map(|s| (s.worker, s.state.stream()))
            .collect()
    }

    fn new(
        sink: S,
        routes: Vec<TopicRoute>,
        by_topic: bool,
        idle_probe_after: Option<Duration>,
    ) -> Result<Self, SourceRefused> {
        if Door::open(&sink).is_none() {
            return Err(SourceRefused);
        }
        // The first route of a topic wins, as a search in order would find it.
        let mut route_index = HashMap::new();
        for (i, r) in routes.iter().enumerate() {
            route_index.entry(r.topic.clone()).or_insert(i);
        }
        Ok(EventSource {
            sink,
            streams: Vec::new(),
            by_topic_index: HashMap::new(),
            routes,
            route_index,
            by_topic,
            unrouted: 0,
            max_unrouted: DEFAULT_MAX_UNROUTED_TOPICS,
            idle_probe_after,
            silence_bound: None,
            started: None,
            link_down: None,
        })
    }

    /// Streams silent for `bound` while their link is up count as dead
    /// (`HealthReason::Silent`); `None` (the default): silence is never dead. Only for
    /// publishers that are never idle that long: an idle engine without a replay
    /// endpoint sends nothing (one with a replay endpoint answers the idle probes).
    pub fn with_silence_bound(mut self, bound: Option<Duration>) -> Self {
        self.silence_bound = bound;
        self
    }

    /// The transport reached its endpoint (`None`: connected, or bound) or failed to
    /// (`Some`, a dead reason: every failed attempt, counted in `link_failures`). It applies
    /// to every stream of the source; a stream that held state and comes back stays
    /// degraded until a batch applies or a replay fills.
    pub fn on_link(&mut self, down: Option<HealthReason>, now: Instant) {
        self.link_down = down;
        for s in &mut self.streams {
            if down.is_none() {
                s.last_message = Some(now);
            }
            s.state.on_link(&self.sink, down);
        }
    }

    /// How often the transport should call [`EventSource::on_tick`]: often enough that a
    /// probe starts within a fifth of the silence it waits for (`None`: no probes).
    pub fn tick_interval(&self) -> Option<Duration> {
        let probe = self.idle_probe_after.map(|d| d / 5);
        let silence = self.silence_bound.map(|d| d / 5);
        let shortest = match (probe, silence) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        shortest.map(|d| d.min(Duration::from_millis(250)))
    }

    /// One live message under `topic` (ignored with one publisher), heard at `now`.
    pub fn on_message(
        &mut self,
        topic: &[u8],
        seq: u64,
        payload: &[u8],
        now: Instant,
    ) -> SourceAction {
        let i = match self.stream_for(topic) {
            Ok(i) => i,
            Err(NoStream::NoWorker) => {
                self.on_bad_frame();
                return SourceAction::Continue;
            }
            Err(NoStream::Refused) => {
                self.sink.note_refused();
                return SourceAction::Continue;
            }
        };
        self.heard(i, now);
        self.feed(i, now, |s, d| s.on_live(d, seq, payload))
    }

    /// One batch of replay `id`, in the publisher's order (its topic not checked: see
    /// [`EventSource::on_replayed_under`]).
    pub fn on_replayed(&mut self, id: u32, seq: u64, payload: &[u8], now: Instant) -> SourceAction {
        self.heard(id as usize, now);
        self.feed(id as usize, now, |s, d| s.on_replayed(d, seq, payload))
    }

    /// One batch of replay `id` that the publisher sent under `topic`: by topic, a batch
    /// under another topic than the stream's is not the stream's, and is dropped (a live
    /// message under it would not reach this stream either); with one publisher every
    /// topic is its (the transport filters both live and replayed batches alike).
    pub fn on_replayed_under(
        &mut self,
        id: u32,
        topic: &[u8],
        seq: u64,
        payload: &[u8],
        now: Instant,
    ) -> SourceAction {
        let theirs = self
            .streams
            .get(id as usize)
            .is_some_and(|s| !self.by_topic || s.topic == topic);
        if !theirs {
            return SourceAction::Continue;
        }
        self.on_replayed(id, seq, payload, now)
    }

    /// Replay `id` ended.
    pub fn on_replay_end(&mut self, id: u32, result: ReplayResult, now: Instant) -> SourceAction {
        if result == ReplayResult::Completed {
            self.heard(id as usize, now);
        }
        self.feed(id as usize, now, |s, d| s.on_replay_end(d, result))
    }

    /// The clock: probes every silent stream that can replay (its replay actions into
    /// `out`).
    pub fn on_tick(&mut self, now: Instant, out: &mut Vec<SourceAction>) {
        self.check_silence(now);
        let Some(after) = self.idle_probe_after else {
            return;
        };
        for i in 0..self.streams.len() {
            let s = &self.streams[i];
            let idle = s
                .last_heard
                .is_none_or(|t| now.saturating_duration_since(t) >= after);
            if !idle || s.state.replaying() {
                continue;
            }
            match self.feed(i, now, |s, d| s.on_idle(d)) {
                SourceAction::Continue => {}
                a => out.push(a),
            }
        }
    }

    /// Marks each stream silent or not by the silence bound (the link being up).
    fn check_silence(&mut self, now: Instant) {
        let Some(bound) = self.silence_bound else {
            return;
        };
        let start = *self.started.get_or_insert(now);
        for s in &mut self.streams {
            let since = s.last_message.unwrap_or(start);
            let silent = self.link_down.is_none() && now.saturating_duration_since(since) >= bound;
            s.state.on_silence(&self.sink, silent);
        }
    }

    /// Stream `i` delivered something: the silence bound's clock restarts.
    fn heard(&mut self, i: usize, now: Instant) {
        if let Some(s) = self.streams.get_mut(i) {
            s.last_message = Some(now);
            if s.state.silent() {
                s.state.on_silence(&self.sink, false);
            }
        }
    }

    /// A message the transport could not parse into frames, or whose topic names no
    /// worker (counted on the source's first stream).
    pub fn on_bad_frame(&mut self) {
        if let Some(s) = self.streams.first_mut() {
            s.state.on_bad_frame();
        }
    }

    /// Whether stream `id` (its replay id) has a replay in flight.
    pub fn replaying(&self, id: u32) -> bool {
        self.streams
            .get(id as usize)
            .is_some_and(|s| s.state.replaying())
    }

    /// The stream a message under `topic` belongs to, created on first sight: routed, or
    /// route-less within the caps (module docs).
    fn stream_for(&mut self, topic: &[u8]) -> Result<usize, NoStream> {
        if !self.by_topic {
            return Ok(0);
        }
        if let Some(&i) = self.by_topic_index.get(topic) {
            return Ok(i);
        }
        let (worker, stream, replay) = match self.route_index.get(topic) {
            Some(&r) => {
                let r = &self.routes[r];
                (r.worker_id, r.stream, r.replay_endpoint.clone())
            }
            None => {
                let w = worker_from_topic(topic).ok_or(NoStream::NoWorker)?;
                if self.unrouted >= self.max_unrouted {
                    return Err(NoStream::Refused);
                }
                let routes = &self.routes;
                let routed = |n: u32| routes.iter().any(|r| r.worker_id == w && r.stream == n);
                let n = self
                    .sink
                    .claim_stream(w, &routed)
                    .ok_or(NoStream::Refused)?;
                self.unrouted += 1;
                (w, n, None)
            }
        };
        self.add_stream(topic.to_vec(), worker, stream, replay);
        Ok(self.streams.len() - 1)
    }

    fn add_stream(
        &mut self,
        topic: Vec<u8>,
        worker: WorkerId,
        stream: u32,
        replay_endpoint: Option<String>,
    ) {
        let state = IngressStream::new(&self.sink, worker, stream, replay_endpoint.is_some());
        if self.by_topic {
            self.by_topic_index
                .insert(topic.clone(), self.streams.len());
        }
        self.streams.push(SourceStream {
            topic,
            replay_endpoint,
            state,
            worker,
            last_heard: None,
            last_message: None,
        });
    }

    /// Feeds stream `i` (if it exists) one step through the sink's door, noting that it
    /// was heard from, and returns the transport's action for the outcome.
    fn feed(
        &mut self,
        i: usize,
        now: Instant,
        step: impl FnOnce(&mut IngressStream, &Door<'_, S>) -> IngestOutcome,
    ) -> SourceAction {
        let Some(s) = self.streams.get_mut(i) else {
            return SourceAction::Continue;
        };
        s.last_heard = Some(now);
        let Some(door) = Door::open(&self.sink) else {
            return SourceAction::Continue;
        };
        let Some(from_seq) = step(&mut s.state, &door).replay_from else {
            return SourceAction::Continue;
        };
        SourceAction::Replay {
            id: i as u32,
            from_seq,
            endpoint: s.replay_endpoint.clone(),
        }
    }
}

/// Why a message under a topic has no stream.
enum NoStream {
    /// The topic is not routed and ends in no worker id (a bad frame).
    NoWorker,
    /// The topic would open a route-less stream past a cap (dropped and counted).
    Refused,
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::config::PartitionConfig;
    use crate::ids::PartitionKey;
    use crate::partition::Partition;
    use crate::sync::StdArc;

    fn partition() -> StdArc<Partition> {
        StdArc::new(Partition::new(
            PartitionKey::new("m", "g"),
            PartitionConfig::new(4),
        ))
    }

    fn streams_of(p: &Partition) -> Vec<(u64, u32)> {
        p.ingress_stats()
            .iter()
            .map(|s| (s.worker_id, s.stream))
            .collect()
    }

    #[test]
    fn route_less_topics_of_one_worker_are_distinct_streams() {
        let p = partition();
        let route = TopicRoute {
            topic: b"routed".to_vec(),
            worker_id: 17,
            stream: 0,
            replay_endpoint: None,
        };
        let mut source = EventSource::by_topic(p.clone(), vec![route], None).unwrap();
        for t in [&b"routed"[..], b"a-17", b"b-17", b"a-17", b"c-3"] {
            assert!(source.stream_for(t).is_ok());
        }
        assert_eq!(source.stream_ids(), vec![(17, 0), (17, 1), (17, 2), (3, 0)]);
        assert_eq!(
            streams_of(&p),
            source.stream_ids(),
            "each stream has its counters"
        );
        assert!(matches!(
            source.stream_for(b"no-digits"),
            Err(NoStream::NoWorker)
        ));
    }

    #[test]
    fn two_sources_never_number_a_workers_streams_alike() {
        let p = partition();
        let mut a = EventSource::by_topic(p.clone(), Vec::new(), None).unwrap();
        let mut b = EventSource::by_topic(p.clone(), Vec::new(), None).unwrap();
        assert!(a.stream_for(b"kv-7").is_ok());
        assert!(b.stream_for(b"kv-7").is_ok());
        assert!(b.stream_for(b"other-7").is_ok());
        assert!(a.stream_for(b"more-7").is_ok());
        assert_eq!(streams_of(&p), vec![(7, 0), (7, 1), (7, 2), (7, 3)]);
    }

    #[test]
    fn route_less_topics_past_the_cap_are_dropped_and_counted() {
        let p = partition();
        let route = TopicRoute {
            topic: b"routed".to_vec(),
            worker_id: 1,
            stream: 0,
            replay_endpoint: None,
        };
        let mut source = EventSource::by_topic(p.clone(), vec![route], None)
            .unwrap()
            .with_max_unrouted_topics(3);
        let now = Instant::now();
        for i in 0..1_000u32 {
            source.on_message(format!("kv-{i}").as_bytes(), 0, b"", now);
        }
        // A routed topic and the topics already heard still get their stream.
        source.on_message(b"routed", 0, b"", now);
        source.on_message(b"kv-1", 1, b"", now);
        assert_eq!(source.stream_count(), 4);
        assert_eq!(p.ingress_stats().len(), 4);
        assert_eq!(p.indexer_stats().ingress_refused, 997);

        // Negative control: without the source's cap, the partition's stream cap is the
        // bound left.
        let p = partition();
        let mut source = EventSource::by_topic(p.clone(), Vec::new(), None)
            .unwrap()
            .with_max_unrouted_topics(usize::MAX);
        for i in 0..2_000u32 {
            source.on_message(format!("kv-{i}").as_bytes(), 0, b"", now);
        }
        assert_eq!(p.ingress_stats().len(), crate::ingress::MAX_INGRESS_STREAMS);
        let over = 2_000 - crate::ingress::MAX_INGRESS_STREAMS as u64;
        assert_eq!(p.indexer_stats().ingress_refused, over);
    }

    #[test]
    fn a_replayed_batch_under_another_topic_is_not_the_streams() {
        let p = partition();
        let mut source = EventSource::by_topic(p.clone(), Vec::new(), None).unwrap();
        let now = Instant::now();
        source.on_message(b"kv-2", 0, b"", now);
        source.on_replayed_under(0, b"kv-3", 1, b"", now);
        assert_eq!(p.ingress_stats()[0].messages, 1);
        source.on_replayed_under(0, b"kv-2", 1, b"", now);
        assert_eq!(p.ingress_stats()[0].messages, 2);
    }

    #[test]
    fn link_and_silence_make_a_stream_dead_and_a_batch_makes_it_exact_again() {
        use crate::ingress::decode::fixture::{a, batch, enc, m, s, toks, u, V};
        use crate::ingress::health::{HealthReason as R, SourceHealth as H};
        let p = StdArc::new(Partition::new(
            PartitionKey::new("m", "g"),
            PartitionConfig::new(4),
        ));
        let store = |hash: u64| {
            enc(&batch(vec![m(vec![
                ("type", s("BlockStored")),
                ("block_hashes", a(vec![u(hash)])),
                ("parent_block_hash", V::Nil),
                ("token_ids", toks(1..5)),
                ("block_size", u(4)),
                ("medium", s("GPU")),
            ])]))
        };
        let mut source = EventSource::single(p.clone(), 1, 0, None, None)
            .unwrap()
            .with_silence_bound(Some(Duration::from_secs(2)));
        let health = || {
            let st = &p.ingress_stats()[0];
            (st.health, st.health_reason, st.link_failures)
        };
        let stale = || p.ingress_stats()[0].stale_since_unix_ms != 0;
        let t0 = Instant::now();
        source.on_message(b"", 0, &store(7), t0);
        assert_eq!(health(), (H::Exact, R::InSequence, 0));
        // Two failed connects: dead, counted twice, the rank stale.
        source.on_link(Some(R::Unreachable), t0);
        source.on_link(Some(R::Unreachable), t0);
        assert_eq!(health(), (H::Dead, R::Unreachable, 2));
        assert!(stale());
        // Back: degraded until a batch applies.
        source.on_link(None, t0);
        assert_eq!(health().0, H::Degraded);
        assert!(stale());
        source.on_message(b"", 1, &store(8), t0);
        assert_eq!(health(), (H::Exact, R::InSequence, 2));
        assert!(!stale());
        // Silent beyond the bound: dead; a message: exact.
        let mut out = Vec::new();
        source.on_tick(t0 + Duration::from_secs(1), &mut out);
        assert_eq!(health().0, H::Exact);
        source.on_tick(t0 + Duration::from_secs(3), &mut out);
        assert_eq!(health().1, R::Silent);
        assert!(stale());
        source.on_message(b"", 2, &store(9), t0 + Duration::from_secs(3));
        assert_eq!(health().0, H::Exact);
        // An undecodable batch: degraded (decode errors) until the next good one; its
        // stream's ranks were cleared, so nothing is stale (an undercount only).
        source.on_message(b"", 3, &[0x93, 0x01], t0 + Duration::from_secs(3));
        assert_eq!(health(), (H::Degraded, R::DecodeErrors, 2));
        assert!(!stale());
        source.on_message(b"", 4, &store(10), t0 + Duration::from_secs(3));
        assert_eq!(health().0, H::Exact);
        assert!(!stale());
    }

    #[test]
    fn the_worker_is_the_number_that_ends_the_topic() {
        assert_eq!(worker_from_topic(b"kv-17"), Some(17));
        assert_eq!(worker_from_topic(b"42"), Some(42));
        assert_eq!(worker_from_topic(b"kv"), None);
        assert_eq!(worker_from_topic(b""), None);
    }
}
