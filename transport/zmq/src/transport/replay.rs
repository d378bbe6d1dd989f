//! Replays: each a DEALER to a publisher's replay ROUTER, many in flight at once, told
//! apart by the sink's id (see the parent module's "Replay").

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqError, ZmqMessage};

use super::closing::SocketTrail;
use super::{
    bad_frame, BoxFuture, FrameSink, ReplayEnd, SourceAction, SubscriberConfig, END_MARKER_SEQ,
    MAX_REPLAYS,
};

/// The replays in flight, by the sink's id.
pub(super) struct Replays {
    pub(super) running: Vec<(u32, Replay)>,
    default_endpoint: Option<String>,
    timeout: Duration,
    /// Every DEALER opened (see [`SocketTrail`]).
    trail: SocketTrail,
}

impl Replays {
    pub(super) fn new(cfg: &SubscriberConfig) -> Replays {
        Replays {
            running: Vec::new(),
            default_endpoint: cfg.replay_endpoint.clone(),
            timeout: cfg.replay_timeout,
            trail: SocketTrail::default(),
        }
    }

    /// Drops every replay in flight; what is left to close is in the trail returned.
    pub(super) fn close(self) -> SocketTrail {
        drop(self.running);
        self.trail
    }

    /// Carries out a sink's action: starts (or restarts) a replay.
    pub(super) fn start(&mut self, action: SourceAction, sink: &mut dyn FrameSink) {
        let SourceAction::Replay {
            id,
            from_seq,
            endpoint,
        } = action
        else {
            return;
        };
        // Supersedes (drops) the replay of this id in flight.
        self.running.retain(|r| r.0 != id);
        let Some(endpoint) = endpoint.or_else(|| self.default_endpoint.clone()) else {
            // A failed replay asks for no other (the sink only replays again on news).
            let _ = sink.on_replay_end(id, ReplayEnd::NotConfigured);
            return;
        };
        if self.running.len() >= MAX_REPLAYS {
            let why = format!("{MAX_REPLAYS} replays already in flight");
            let _ = sink.on_replay_end(id, ReplayEnd::Failed(why));
            return;
        }
        let replay = Replay::start(&endpoint, from_seq, self.timeout, &mut self.trail);
        self.running.push((id, replay));
    }

    /// Replay `running[i]` ended: it is dropped and the sink told (what it asks for next
    /// is started).
    pub(super) fn end(&mut self, i: usize, end: ReplayEnd, sink: &mut dyn FrameSink) {
        let id = self.running.swap_remove(i).0;
        let action = sink.on_replay_end(id, end);
        self.start(action, sink);
    }

    /// The next event of any replay in flight, with its index in `running` (never
    /// completes when there is none). Cancel-safe: each poll polls every replay's own
    /// stored futures afresh.
    pub(super) async fn next_event(&mut self) -> (usize, ReplayEvent) {
        if self.running.is_empty() {
            return std::future::pending().await;
        }
        std::future::poll_fn(|cx| {
            for (i, (_, replay)) in self.running.iter_mut().enumerate() {
                let event = std::pin::pin!(replay.next_event());
                if let Poll::Ready(event) = event.poll(cx) {
                    return Poll::Ready((i, event));
                }
            }
            Poll::Pending
        })
        .await
    }
}

/// What one replay reply was.
pub(super) enum Replied {
    /// A batch, handed to the sink, which answered this.
    Batch(SourceAction),
    /// The end marker.
    End,
    /// Malformed (reported to the sink).
    Malformed,
    /// Under a topic the subscription filters out (dropped).
    Filtered,
}

/// Hands one reply of replay `id` to the sink, unless its topic is filtered out (as a
/// live message under it would be: the publisher's replay does not filter by topic).
pub(super) fn deliver_replayed(
    id: u32,
    msg: &ZmqMessage,
    topic_filter: &[u8],
    sink: &mut dyn FrameSink,
) -> Replied {
    let frames = (msg.get(0), msg.get(1), msg.get(2), msg.get(3));
    let (Some(empty), Some(topic), Some(seq), Some(payload)) = frames else {
        sink.on_bad_frame(bad_frame::REPLAY_FRAME_COUNT);
        return Replied::Malformed;
    };
    if msg.len() != 4 || !empty.is_empty() {
        sink.on_bad_frame(bad_frame::REPLAY_FRAME_COUNT);
        return Replied::Malformed;
    }
    let Ok(seq) = <[u8; 8]>::try_from(&seq[..]) else {
        sink.on_bad_frame(bad_frame::REPLAY_SEQ_SIZE);
        return Replied::Malformed;
    };
    let seq = u64::from_be_bytes(seq);
    if seq == END_MARKER_SEQ {
        return Replied::End;
    }
    if !topic.starts_with(topic_filter) {
        return Replied::Filtered;
    }
    Replied::Batch(sink.on_replayed(id, topic, seq, payload))
}

/// One replay in flight.
pub(super) struct Replay {
    phase: ReplayPhase,
    timeout: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

enum ReplayPhase {
    /// Connecting the DEALER and sending the request.
    Requesting(BoxFuture<Result<DealerSocket, ZmqError>>),
    Receiving(DealerSocket),
}

pub(super) enum ReplayEvent {
    Reply(ZmqMessage),
    Ended(ReplayEnd),
}

impl Replay {
    fn start(endpoint: &str, from_seq: u64, timeout: Duration, trail: &mut SocketTrail) -> Replay {
        let endpoint = endpoint.to_owned();
        // The replay's deadline bounds the connect (so that running out of time is always
        // `TimedOut`); connect errors other than "not there yet" end it `Failed`.
        let mut options = SocketOptions::default();
        options.no_connect_timeout();
        let mut dealer = DealerSocket::with_options(options);
        trail.track(&dealer);
        let request = async move {
            dealer.connect(&endpoint).await?;
            let mut request = ZmqMessage::from(Vec::<u8>::new());
            request.push_back(from_seq.to_be_bytes().to_vec().into());
            dealer.send(request).await?;
            Ok(dealer)
        };
        Replay {
            phase: ReplayPhase::Requesting(Box::pin(request)),
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

impl Replay {
    /// The next event of this replay. Cancel-safe.
    async fn next_event(&mut self) -> ReplayEvent {
        loop {
            let deadline = self.deadline.as_mut();
            match &mut self.phase {
                ReplayPhase::Requesting(request) => {
                    let dealer = tokio::select! {
                        r = request.as_mut() => r,
                        () = deadline => return ReplayEvent::Ended(ReplayEnd::TimedOut),
                    };
                    match dealer {
                        Ok(dealer) => self.phase = ReplayPhase::Receiving(dealer),
                        Err(e) => return ReplayEvent::Ended(ReplayEnd::Failed(e.to_string())),
                    }
                }
                ReplayPhase::Receiving(dealer) => {
                    let reply = tokio::select! {
                        r = dealer.recv() => r,
                        () = deadline => return ReplayEvent::Ended(ReplayEnd::TimedOut),
                    };
                    return match reply {
                        Ok(msg) => {
                            let next = tokio::time::Instant::now() + self.timeout;
                            self.deadline.as_mut().reset(next);
                            ReplayEvent::Reply(msg)
                        }
                        Err(e) => ReplayEvent::Ended(ReplayEnd::Failed(e.to_string())),
                    };
                }
            }
        }
    }
}
