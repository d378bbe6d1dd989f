//! Applying the other replicas' events from the stream, and judging their liveness.
//!
//! One ordered consumer (ephemeral, in stream order, no acknowledgements) reads every
//! replica's subject; this replica's own messages are skipped. The consumer is recreated
//! from the last stream message applied whenever it fails (the server restarted, the
//! link dropped) or a sender's sequence shows a gap; at a fresh start it reads from the
//! oldest message that can still hold a live booking. Each event goes through
//! [`Senders`] (in order, repeat, gap, old incarnation) and then the host's
//! [`BookingSink`].

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use futures_util::StreamExt;

use super::envelope;
use super::parked::{Parked, ParkedAdds};
use super::senders::{Senders, Verdict};
use super::stats::JsCounters;
use crate::dynamo_sync::BookingSink;
use crate::event::{BookingEvent, EventData};
use crate::stats::{Applied, SyncCounters};

/// How far back a fresh start reads beyond the booking lifetime (clock skew between
/// this host and the server).
const START_MARGIN: Duration = Duration::from_secs(5);

/// What the consumer loop does after a message.
enum Flow {
    Continue,
    /// Recreate the consumer from `last_stream_seq + 1`.
    Replay,
}

/// The consumer side's state (owned by its task).
pub(crate) struct Applier {
    pub(crate) sink: Arc<dyn BookingSink>,
    pub(crate) me: String,
    pub(crate) incarnation: u64,
    pub(crate) counters: Arc<SyncCounters>,
    pub(crate) js: Arc<JsCounters>,
    pub(crate) senders: Senders,
    pub(crate) lifetime: Duration,
    pub(crate) silence: Duration,
    /// Off only in tests (the negative control): no replay at start nor after a failure.
    pub(crate) replay: bool,
    /// The last stream message taken (applied or skipped).
    pub(crate) last_stream_seq: Option<u64>,
    /// The stream position of the last gap answered by a replay (a second gap there is
    /// accepted as lost).
    pub(crate) replayed_gap_at: Option<u64>,
    pub(crate) link_up: bool,
    /// Adds waiting for their worker to be registered here.
    pub(crate) parked: ParkedAdds,
}

impl Applier {
    fn deliver_policy(&self) -> DeliverPolicy {
        match (self.replay, self.last_stream_seq) {
            (false, _) => DeliverPolicy::New,
            (true, Some(s)) => DeliverPolicy::ByStartSequence {
                start_sequence: s + 1,
            },
            (true, None) => {
                let back = self.lifetime + START_MARGIN;
                let start = SystemTime::now()
                    .checked_sub(back)
                    .unwrap_or(UNIX_EPOCH)
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as i128);
                match async_nats::datetime::from_nanos(start) {
                    Ok(start_time) => DeliverPolicy::ByStartTime { start_time },
                    Err(_) => DeliverPolicy::All,
                }
            }
        }
    }

    fn take(&mut self, m: &async_nats::jetstream::Message) -> Flow {
        let (sseq, published_ns) = match m.info() {
            Ok(i) => (i.stream_sequence, i.published.unix_timestamp_nanos()),
            Err(_) => {
                SyncCounters::bump(&self.counters.received);
                SyncCounters::bump(&self.counters.undecodable);
                return Flow::Continue;
            }
        };
        self.take_payload(sseq, published_ns, &m.payload)
    }

    /// One stream message: its position, when the server stored it, its bytes.
    fn take_payload(&mut self, sseq: u64, published_ns: i128, payload: &[u8]) -> Flow {
        SyncCounters::bump(&self.counters.received);
        self.js.received.fetch_add(1, Ordering::Relaxed);
        let mut behind = false;
        if let Some(last) = self.last_stream_seq {
            if sseq > last + 1 || sseq <= last {
                behind = true;
                self.js.fell_behind.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    expected = last + 1,
                    got = sseq,
                    "replica sync (jetstream): the stream no longer holds the next message (this replica fell behind its retention, or the stream was recreated); events in between are lost here"
                );
            }
        }
        self.last_stream_seq = Some(sseq);
        let env = match envelope::decode(payload) {
            Ok(e) => e,
            Err(e) => {
                SyncCounters::bump(&self.counters.undecodable);
                tracing::debug!(sseq, "replica sync (jetstream): {e}");
                return Flow::Continue;
            }
        };
        if env.name == self.me {
            SyncCounters::bump(&self.counters.own);
            // An earlier process of this replica may have freed or completed a peer's
            // booking: that still holds. Its own bookings died with it.
            if env.incarnation < self.incarnation {
                self.apply_ending(env.event);
            }
            return Flow::Continue;
        }
        let now = Instant::now();
        self.restarting(&env.name, env.incarnation);
        let (verdict, gone) = self.senders.event(&env.name, env.incarnation, env.seq, now);
        self.expire(gone, &env.name, "it restarted (a new incarnation)");
        match verdict {
            Verdict::Apply => {}
            Verdict::Repeat => {
                self.js.repeated.fetch_add(1, Ordering::Relaxed);
                return Flow::Continue;
            }
            Verdict::Stale => {
                // A dead process's bookings are gone, but what it freed or completed of
                // the others' bookings holds.
                self.js.stale.fetch_add(1, Ordering::Relaxed);
                self.apply_ending(env.event);
                return Flow::Continue;
            }
            Verdict::Refused => {
                self.counters.outcome(Applied::Refused);
                return Flow::Continue;
            }
            Verdict::Gap { missing } => {
                let replay_from = self.senders.replay_from(&env.name);
                // Behind the retention, a replay cannot bring the events back.
                if self.replay
                    && !behind
                    && self.replayed_gap_at != Some(sseq)
                    && replay_from.is_some()
                {
                    self.js.gaps.fetch_add(1, Ordering::Relaxed);
                    self.replayed_gap_at = Some(sseq);
                    tracing::warn!(
                        peer = %env.name,
                        missing,
                        "replica sync (jetstream): a gap in a peer's events; replaying from its last applied message"
                    );
                    self.last_stream_seq = replay_from;
                    return Flow::Replay;
                }
                self.js.lost.fetch_add(missing, Ordering::Relaxed);
                tracing::warn!(
                    peer = %env.name,
                    missing,
                    "replica sync (jetstream): a peer's events are not in the stream (dropped at its publisher, or aged out of the stream); going on without them"
                );
                self.senders.skip_to(&env.name, env.seq);
            }
        }
        self.senders.applied_at(&env.name, sseq);
        self.apply(env, published_ns);
        Flow::Continue
    }

    /// What is left of a booking's lifetime, published at `published_ns` (`None`: none).
    fn remaining(&self, published_ns: i128) -> Option<Duration> {
        let now_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        let age = Duration::from_nanos((now_ns - published_ns).clamp(0, u64::MAX as i128) as u64);
        self.lifetime.checked_sub(age).filter(|t| !t.is_zero())
    }

    fn apply(&mut self, env: envelope::Envelope, published_ns: i128) {
        let (name, ev) = (env.name, env.event);
        let id = ev.request_id.clone();
        let outcome = match &ev.data {
            EventData::Add(_) => {
                let Some(ttl) = self.remaining(published_ns) else {
                    self.js.too_old.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                let o = self.sink.apply_with_ttl(ev.clone(), ttl);
                match o {
                    Applied::Applied => self.senders.booked(&name, &id),
                    Applied::UnknownPartition | Applied::UnknownRank => {
                        let p = Parked {
                            name,
                            event: ev,
                            published_ns,
                            prefill_done: false,
                        };
                        if self.parked.park(p) {
                            self.js.parked.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    _ => {}
                }
                o
            }
            EventData::Free | EventData::PrefillComplete => {
                self.apply_ending(ev);
                return;
            }
        };
        self.counters.outcome(outcome);
    }

    /// A free or prefill completion from an earlier incarnation (of a peer, or of this
    /// replica): applied; an add is not (its booking died with its process).
    fn apply_ending(&mut self, ev: BookingEvent) {
        let id = ev.request_id.clone();
        let outcome = match ev.data {
            EventData::Add(_) => return,
            EventData::Free => {
                self.senders.ended(&id);
                if self.parked.freed(&id) {
                    Applied::Applied
                } else {
                    self.sink.apply(ev)
                }
            }
            EventData::PrefillComplete => {
                if self.parked.prefill_done(&id) {
                    Applied::Applied
                } else {
                    self.sink.apply(ev)
                }
            }
        };
        self.counters.outcome(outcome);
    }

    /// Tries the waiting adds again.
    fn retry_parked(&mut self) {
        for p in self.parked.take_all() {
            let Some(ttl) = self.remaining(p.published_ns) else {
                self.js.too_old.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            match self.sink.apply_with_ttl(p.event.clone(), ttl) {
                Applied::Applied => {
                    self.senders.booked(&p.name, &p.event.request_id);
                    self.js.unparked.fetch_add(1, Ordering::Relaxed);
                    if p.prefill_done {
                        self.sink.apply(BookingEvent {
                            data: EventData::PrefillComplete,
                            ..p.event
                        });
                    }
                }
                Applied::UnknownPartition | Applied::UnknownRank => {
                    self.parked.park(p);
                }
                _ => {}
            }
        }
    }

    /// Heard `name` in `incarnation`: when it is a newer one, its previous process's
    /// waiting adds go (its applied bookings go through [`Senders`]).
    fn restarting(&mut self, name: &str, incarnation: u64) {
        if self
            .senders
            .incarnation(name)
            .is_some_and(|known| known < incarnation)
        {
            self.parked.drop_sender(name);
        }
    }

    fn heartbeat(&mut self, payload: &[u8]) {
        let Ok(hb) = envelope::decode_heartbeat(payload) else {
            SyncCounters::bump(&self.counters.undecodable);
            return;
        };
        if hb.name == self.me {
            if hb.incarnation != self.incarnation {
                tracing::warn!(
                    name = %self.me,
                    "replica sync (jetstream): another process sends heartbeats under this replica's name"
                );
            }
            return;
        }
        self.js.heartbeats.fetch_add(1, Ordering::Relaxed);
        self.restarting(&hb.name, hb.incarnation);
        let gone = self
            .senders
            .heartbeat(&hb.name, hb.incarnation, Instant::now());
        self.expire(gone, &hb.name, "it restarted (a new incarnation)");
    }

    fn tick(&mut self, state: async_nats::connection::State) {
        let now = Instant::now();
        let up = state == async_nats::connection::State::Connected;
        if up != self.link_up {
            self.link_up = up;
            if up {
                // The others' silence while this link was down says nothing about them.
                self.senders.heard_all(now);
                tracing::info!("replica sync (jetstream): link to the NATS server up");
            } else {
                tracing::warn!("replica sync (jetstream): link to the NATS server down; peers' bookings are kept until it is back");
            }
        }
        if self.link_up {
            let (ids, names) = self.senders.silent(now, self.silence);
            for n in &names {
                tracing::warn!(peer = %n, "replica sync (jetstream): peer silent (no heartbeat within the bound)");
                self.parked.drop_sender(n);
            }
            self.expire(ids, "", "it fell silent");
        }
        if !self.parked.is_empty() {
            self.retry_parked();
        }
        self.js
            .waiting
            .store(self.parked.len() as u64, Ordering::Relaxed);
        self.js
            .peers
            .store(self.senders.len() as u64, Ordering::Relaxed);
    }

    fn expire(&mut self, ids: Vec<String>, peer: &str, why: &str) {
        if ids.is_empty() {
            return;
        }
        let n = ids.iter().filter(|id| self.sink.expire(id)).count();
        self.counters
            .peer_gone
            .fetch_add(n as u64, Ordering::Relaxed);
        tracing::warn!(
            peer,
            bookings = n,
            "replica sync (jetstream): a peer's bookings dropped: {why}"
        );
    }
}

/// The consumer task: (re)creates the ordered consumer and applies what it delivers,
/// with the peers' heartbeats and a once-a-second liveness check alongside.
pub(crate) async fn run(
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
    stream: String,
    filter: String,
    heartbeats: String,
    mut applier: Applier,
) {
    let mut hb = loop {
        match client.subscribe(heartbeats.clone()).await {
            Ok(s) => break s,
            Err(e) => {
                tracing::warn!("replica sync (jetstream): heartbeat subscription failed: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let policy = applier.deliver_policy();
        let messages = match open(&js, &stream, &filter, policy).await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(
                    stream,
                    "replica sync (jetstream): cannot read the stream, retrying: {e}"
                );
                tokio::time::sleep(Duration::from_secs(1)).await;
                applier.tick(client.connection_state());
                continue;
            }
        };
        applier.js.consumer_starts.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            stream,
            from = ?applier.last_stream_seq.map(|s| s + 1),
            "replica sync (jetstream): reading peers' events"
        );
        let mut messages = std::pin::pin!(messages);
        loop {
            tokio::select! {
                m = messages.next() => match m {
                    Some(Ok(m)) => {
                        if let Flow::Replay = applier.take(&m) {
                            break;
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(stream, "replica sync (jetstream): reading the stream failed, resuming from the last message applied: {e}");
                        break;
                    }
                    None => break,
                },
                h = hb.next() => match h {
                    Some(h) => applier.heartbeat(&h.payload),
                    None => return,
                },
                _ = tick.tick() => applier.tick(client.connection_state()),
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn open(
    js: &async_nats::jetstream::Context,
    stream: &str,
    filter: &str,
    deliver_policy: DeliverPolicy,
) -> Result<async_nats::jetstream::consumer::pull::Ordered, String> {
    let s = js.get_stream(stream).await.map_err(|e| e.to_string())?;
    let c = s
        .create_consumer(OrderedConfig {
            filter_subject: filter.to_string(),
            deliver_policy,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    c.messages().await.map_err(|e| e.to_string())
}

#[cfg(test)]
#[path = "consumer_tests.rs"]
mod tests;
