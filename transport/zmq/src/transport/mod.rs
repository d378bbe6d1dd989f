//! The ZMQ transport of ingress: a SUB socket (plus a DEALER for replay) per subscription,
//! every subscription of the process on one ingest thread, handing raw frames to a
//! [`FrameSink`] (REFERENCE.md §2, DESIGN.md §10).
//!
//! It knows nothing about events: [`Subscriber`] receives `[topic, seq, payload]` messages
//! from a vLLM/SGLang-style ZMQ PUB and calls [`FrameSink::on_message`]; when the sink
//! answers [`SourceAction::Replay`], it asks the publisher's replay ROUTER for the batches
//! from that sequence number on and feeds them to [`FrameSink::on_replayed`] until the end
//! marker ([`FrameSink::on_replay_end`]).
//!
//! # Implementation
//!
//! ZMTP is spoken by the pure-Rust `zeromq` crate, driven by a current-thread tokio runtime
//! that lives inside the ingest pipeline's thread (see below; no runtime is shared with,
//! or required from, the host). Pure Rust, because libzmq is C++: linking it into
//! `libkvr.a` would make every C and Go host add `-lstdc++`. It interoperates with libzmq
//! 4.x peers (pyzmq in `transport/zmq/tests/zmq_transport.rs`): SUB connect, SUB bind with
//! publishers connecting, and DEALER → ROUTER replay.
//!
//! # Connection handling
//!
//! - **Connect** (`bind == false`): the subscriber connects to the publisher's PUB. While
//!   the publisher is unreachable, attempts are never more than `reconnect_interval`
//!   apart (each socket retries from 50 ms with doubling gaps, and is replaced by a fresh
//!   one every `reconnect_interval`); when an established connection drops (checked every
//!   50 ms), the socket is dropped and reopened the same way. Messages sent meanwhile are
//!   lost, as with libzmq: the sink finds the gap by `seq`.
//! - **Bind** (`bind == true`): the subscriber binds and any number of publishers connect
//!   (vLLM connects whenever its endpoint has no `*`); they reconnect by themselves. A
//!   failed bind (say, the port is still taken) is retried every `reconnect_interval`.
//!   `tcp://*:PORT` binds all IPv4 interfaces, as libzmq does.
//! - **Replay**: each [`SourceAction::Replay`] opens a fresh DEALER to its endpoint (the
//!   action's, else `replay_endpoint`), sends `["", start_seq as 8-byte big-endian]` and
//!   reads `["", topic, seq, payload]` replies until the end marker `["", "", ff×8, ""]`,
//!   then closes it. A reply whose topic does not start with the subscription's `topic`
//!   is dropped, as a live message under it would be. Live messages keep flowing to [`FrameSink::on_message`] meanwhile
//!   (the sink deduplicates by `seq`). A replay ends [`ReplayEnd::TimedOut`] when nothing
//!   arrives within `replay_timeout` of the request or of the previous reply (a long
//!   replay that keeps answering is not cut short).
//!
//!   Replays are told apart by the id the sink gives them (one per stream, in kvr's
//!   subscriber): up to [`MAX_REPLAYS`] run at once, each with its own timeout, so one
//!   stuck replay delays no other stream. A `Replay` with the id of a replay in flight
//!   supersedes it: the earlier one is abandoned without an `on_replay_end` of its own, so
//!   exactly one `on_replay_end` follows the last `Replay` of an id.
//! - **Start gate**: with `start_gate` set, the subscription waits for the gate to open (or
//!   for stop) before it opens any socket or calls the sink; then it starts as above.
//! - **Ticks**: with `tick_interval` set, [`FrameSink::on_tick`] runs once right after the
//!   start and then every interval; the replays it asks for start like any other (kvr's
//!   subscriber probes idle streams this way).
//!
//! # Threads and stopping
//!
//! Every subscriber of the process is a task on one shared runtime, driven by one thread
//! named `kvr-ingest` (the ingest pipeline, [`Subscriber::thread_name`]): a fleet of a
//! thousand publishers costs one thread and one event loop, not a thousand. The thread
//! starts with the first subscriber and ends when the last one stops (a later start
//! starts it again). All sink methods run on it, one call at a time across all
//! subscriptions: a call is meant to be short (a decode and an index update), and a slow
//! one delays every subscription's next call, not just its own.
//!
//! [`Subscriber::stop`] (also run on drop) raises a flag that wakes the subscription's
//! task at once, and waits for the task to end: when `stop` returns, no sink method of
//! that subscriber runs any more, its sink has been dropped and its sockets are closed (a
//! bound port is free again). A sink call in progress is not interrupted: `stop` waits for
//! it to return. The `zeromq` crate runs part of each socket in tasks of its own (a bound
//! socket's accept loop, a connection's handshake or writer); the stopped task waits for
//! them to end too, up to half a second. Only one that hangs on its peer outlives that (a
//! peer that connected and never completes the handshake, or a reconnect attempt to a
//! host that drops it), until it ends by itself or the pipeline stops.
//!
//! A panic of a sink method ends that subscription only (it closes its sockets as on
//! stop, and [`Subscriber::is_running`] turns false); the others go on.
//!
//! `stop` called on the pipeline thread itself, from a sink method, cannot wait (the task
//! it would wait for needs that thread): it raises the flag and returns. A subscription
//! stopped this way calls no sink method after the flag (its task only resumes at the
//! stop check); it closes its sockets as soon as the current sink call returns. Waiting
//! for a task also means that `stop`, called elsewhere, must not hold a lock that any
//! sink method (of any subscription) may take, or both wait for ever.

use std::fmt;
use std::future::Future;
use std::io;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Poll, Waker};
use std::time::Duration;

use kvr::ingress::{HealthReason, SourceAction};
use zeromq::{Endpoint, ZmqMessage};

/// Sequence number of the replay end marker (`-1` as a signed 8-byte big-endian integer).
const END_MARKER_SEQ: u64 = u64::MAX;

/// Floor for `reconnect_interval` and `tick_interval` (a zero interval would spin).
const MIN_RECONNECT_INTERVAL: Duration = Duration::from_millis(10);

/// Replays in flight at once, at most (one DEALER each); beyond, a replay ends
/// [`ReplayEnd::Failed`] at once.
pub const MAX_REPLAYS: usize = 64;

/// What one subscription connects to. See the module documentation for the semantics.
#[derive(Clone, Debug)]
pub struct SubscriberConfig {
    /// Endpoint to connect to (e.g. `"tcp://10.0.0.5:5557"`), or to bind when `bind` is
    /// true (many publishers connect to it; vLLM connects when its endpoint has no `*`).
    /// `tcp://HOST:PORT` (IPv4, `[IPv6]` or a host name) and `ipc://PATH`.
    pub endpoint: String,
    /// Bind `endpoint` instead of connecting to it.
    pub bind: bool,
    /// SUB topic prefix filter (`b""` = all).
    pub topic: Vec<u8>,
    /// The publisher's replay ROUTER endpoint (connect), if any.
    pub replay_endpoint: Option<String>,
    /// Longest delay between connection (or bind) attempts; values under 10 ms count as
    /// 10 ms.
    pub reconnect_interval: Duration,
    /// How long a replay may go without a reply before it ends [`ReplayEnd::TimedOut`].
    pub replay_timeout: Duration,
    /// Call [`FrameSink::on_tick`] right after the start and then this often (`None`:
    /// never; values under 10 ms count as 10 ms).
    pub tick_interval: Option<Duration>,
    /// Open no socket (and call no sink method) until this gate opens (`None`: start at
    /// once); see [`StartGate`].
    pub start_gate: Option<StartGate>,
}

impl SubscriberConfig {
    /// A configuration connecting to `endpoint`, all topics, no replay, reconnecting every
    /// 500 ms, replay timeout 5 s.
    pub fn connect(endpoint: impl Into<String>) -> SubscriberConfig {
        SubscriberConfig {
            endpoint: endpoint.into(),
            bind: false,
            topic: Vec::new(),
            replay_endpoint: None,
            reconnect_interval: Duration::from_millis(500),
            replay_timeout: Duration::from_secs(5),
            tick_interval: None,
            start_gate: None,
        }
    }

    /// Like [`SubscriberConfig::connect`], but binding `endpoint`.
    pub fn bind(endpoint: impl Into<String>) -> SubscriberConfig {
        SubscriberConfig {
            bind: true,
            ..SubscriberConfig::connect(endpoint)
        }
    }
}

/// How a replay ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplayEnd {
    /// The end marker was received: every batch the publisher still had was replayed.
    Completed,
    /// No reply within `replay_timeout` of the request or of the previous reply.
    TimedOut,
    /// The replay connection failed (the message says how).
    Failed(String),
    /// No `replay_endpoint` is configured.
    NotConfigured,
}

impl fmt::Display for ReplayEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplayEnd::Completed => f.write_str("completed"),
            ReplayEnd::TimedOut => f.write_str("timed out"),
            ReplayEnd::Failed(why) => write!(f, "failed: {why}"),
            ReplayEnd::NotConfigured => f.write_str("no replay endpoint configured"),
        }
    }
}

/// Receives what a [`Subscriber`] reads. Every method runs on the ingest pipeline's thread,
/// one call at a time (across all subscribers); none runs after [`Subscriber::stop`] has
/// returned. A method's returned [`SourceAction`] is carried out before the next call. A
/// replay action's `endpoint` names the publisher's replay ROUTER (a bound subscription
/// receives many publishers, each with its own); `None` takes the configured
/// `replay_endpoint`. With neither, [`FrameSink::on_replay_end`] is called at once with
/// [`ReplayEnd::NotConfigured`].
pub trait FrameSink: Send + 'static {
    /// One live message `[topic, seq, payload]` (malformed frame counts/sizes are reported
    /// via [`FrameSink::on_bad_frame`] instead).
    fn on_message(&mut self, topic: &[u8], seq: u64, payload: &[u8]) -> SourceAction;
    /// One batch of replay `id`, in the publisher's order.
    fn on_replayed(&mut self, id: u32, topic: &[u8], seq: u64, payload: &[u8]) -> SourceAction;
    /// Replay `id` (requested by the last [`SourceAction::Replay`] with that id) ended.
    fn on_replay_end(&mut self, id: u32, end: ReplayEnd) -> SourceAction;
    /// Periodic, with `tick_interval` set (see the module documentation): replays to start.
    fn on_tick(&mut self, _out: &mut Vec<SourceAction>) {}
    /// A message without exactly 3 frames, or a seq frame not 8 bytes (live or replayed).
    fn on_bad_frame(&mut self, why: &'static str);
    /// The SUB socket connected (or bound): `None`; or an attempt failed, or the
    /// connection dropped: `Some` with why (each failed attempt is reported).
    fn on_link(&mut self, _down: Option<HealthReason>) {}
}

/// [`FrameSink::on_bad_frame`] causes.
pub mod bad_frame {
    /// A live message without exactly 3 frames.
    pub const FRAME_COUNT: &str = "message without exactly 3 frames";
    /// A live message whose seq frame is not 8 bytes.
    pub const SEQ_SIZE: &str = "sequence frame not 8 bytes";
    /// A replay reply that is not `["", topic, seq, payload]`.
    pub const REPLAY_FRAME_COUNT: &str = "replay reply without [\"\", topic, seq, payload]";
    /// A replay reply whose seq frame is not 8 bytes.
    pub const REPLAY_SEQ_SIZE: &str = "replay sequence frame not 8 bytes";
}

/// A running subscription: a task on the ingest pipeline's thread, stopped by
/// [`Subscriber::stop`] or on drop.
pub struct Subscriber {
    task: Arc<TaskState>,
    /// `None` once stopped.
    lease: Option<Lease>,
    id: u64,
}

impl fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscriber")
            .field("id", &self.id)
            .field("thread", &self.thread_name())
            .field("running", &self.is_running())
            .finish()
    }
}

impl Subscriber {
    /// Starts the subscription as a task on the ingest pipeline (whose thread is started
    /// if this is the only subscriber). Connect failures are retried every
    /// `reconnect_interval`; the subscription runs until [`Subscriber::stop`].
    ///
    /// # Errors
    ///
    /// `InvalidInput` when `endpoint` or `replay_endpoint` is not a valid ZMQ endpoint
    /// (`tcp://HOST:PORT`, `ipc://PATH`; `*` as host only when binding); any error from
    /// creating the pipeline's runtime or thread.
    pub fn start(cfg: SubscriberConfig, sink: Box<dyn FrameSink>) -> io::Result<Subscriber> {
        let endpoint = checked_endpoint(&cfg.endpoint, cfg.bind)?;
        if let Some(replay) = &cfg.replay_endpoint {
            checked_endpoint(replay, false)?;
        }
        let cfg = SubscriberConfig {
            endpoint,
            reconnect_interval: cfg.reconnect_interval.max(MIN_RECONNECT_INTERVAL),
            tick_interval: cfg.tick_interval.map(|t| t.max(MIN_RECONNECT_INTERVAL)),
            ..cfg
        };
        let lease = Lease::take()?;
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        let task = Arc::new(TaskState::default());
        let ended = Ended(Arc::clone(&task));
        lease.spawn(async move {
            subscription(cfg, sink, &ended.0.stop).await;
            drop(ended);
        });
        Ok(Subscriber {
            task,
            lease: Some(lease),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Stops the subscription: when it returns no sink method of it runs any more, the
    /// sink is dropped and its sockets are closed (see the module documentation, also for
    /// a call from a sink). Idempotent; also run on drop. A panic of the sink (which ended
    /// the subscription early) is not propagated.
    pub fn stop(&mut self) {
        self.task.stop.raise();
        if let Some(lease) = self.lease.take() {
            if !lease.on_pipeline_thread() {
                self.task.wait_ended();
            }
        }
    }

    /// Whether the subscription still runs (false after [`Subscriber::stop`], or if a
    /// sink method panicked).
    pub fn is_running(&self) -> bool {
        self.lease.is_some() && !self.task.has_ended()
    }

    /// The name of the thread its sink methods run on: the ingest pipeline's
    /// (`kvr-ingest`), which every subscriber of the process shares.
    pub fn thread_name(&self) -> &str {
        pipeline::THREAD_NAME
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What a subscriber and its task share.
#[derive(Default)]
struct TaskState {
    stop: StopSignal,
    ended: Mutex<bool>,
    ended_changed: Condvar,
}

impl TaskState {
    fn ended(&self) -> std::sync::MutexGuard<'_, bool> {
        // A bool: nothing half-changed after a panic.
        self.ended.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn has_ended(&self) -> bool {
        *self.ended()
    }

    fn wait_ended(&self) {
        let mut ended = self.ended();
        while !*ended {
            ended = self
                .ended_changed
                .wait(ended)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Marks the task ended when dropped: once it completed, or if it was dropped unfinished
/// (the pipeline's runtime shutting down).
struct Ended(Arc<TaskState>);

impl Drop for Ended {
    fn drop(&mut self) {
        *self.0.ended() = true;
        self.0.ended_changed.notify_all();
    }
}

/// Validates `endpoint` and returns it in the form handed to `zeromq` (`tcp://*:P` →
/// `tcp://0.0.0.0:P` when binding).
pub(crate) fn checked_endpoint(endpoint: &str, bind: bool) -> io::Result<String> {
    let invalid = |why: String| io::Error::new(io::ErrorKind::InvalidInput, why);
    let endpoint = match endpoint.strip_prefix("tcp://*:") {
        Some(port) if bind => format!("tcp://0.0.0.0:{port}"),
        Some(_) => {
            return Err(invalid(format!(
                "ZMQ endpoint {endpoint:?}: `*` can only be bound, not connected to"
            )))
        }
        None => endpoint.to_owned(),
    };
    endpoint
        .parse::<Endpoint>()
        .map_err(|e| invalid(format!("invalid ZMQ endpoint {endpoint:?}: {e}")))?;
    Ok(endpoint)
}

/// A stop flag, and the waker of the task waiting for it so that raising it wakes that task
/// at once (no polling delay): a subscription's, or the pipeline thread's own.
#[derive(Default)]
struct StopSignal {
    raised: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl StopSignal {
    fn raise(&self) {
        self.raised.store(true, Ordering::SeqCst);
        let waker = self.waker.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    fn is_raised(&self) -> bool {
        self.raised.load(Ordering::SeqCst)
    }

    /// Completes once the flag is raised. The waker is registered before the flag is
    /// re-checked, so a `raise` between the two cannot be missed.
    fn raised(&self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| {
            if self.is_raised() {
                return Poll::Ready(());
            }
            *self.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
            if self.is_raised() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
    }
}

/// A subscriber's task: waits for the start gate, runs [`run`] until stop (or a panic of
/// the sink, which ends this subscription only), then closes its sockets. The sink and
/// every socket are dropped when it completes.
async fn subscription(cfg: SubscriberConfig, mut sink: Box<dyn FrameSink>, stop: &StopSignal) {
    if let Some(gate) = &cfg.start_gate {
        tokio::select! {
            biased;
            () = stop.raised() => return,
            () = gate.opened() => {}
        }
    }
    let mut link = SubLink::new(&cfg);
    let mut replays = Replays::new(&cfg);
    let run = run(&cfg, sink.as_mut(), stop, &mut link, &mut replays);
    // A panic ends the subscription here (the panic hook has reported it).
    let _ = catch_unwind(run).await;
    let trail = link.close().join(replays.close());
    drop(sink);
    trail.closed(CLOSE_BOUND).await;
}

/// Runs `fut`, catching a panic of any of its polls (`Err`; `fut` is dropped then).
async fn catch_unwind<F: Future>(fut: F) -> Result<F::Output, ()> {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(move |cx| {
        match std::panic::catch_unwind(AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(_) => Poll::Ready(Err(())),
        }
    })
    .await
}

/// The subscription's main loop: live messages, replay replies, ticks and the stop
/// signal, until stop. Its only await is the `select!` below, whose first branch is the
/// stop signal: once stop is raised, no sink method is called again.
async fn run(
    cfg: &SubscriberConfig,
    sink: &mut dyn FrameSink,
    stop: &StopSignal,
    link: &mut SubLink,
    replays: &mut Replays,
) {
    let topic_filter = &cfg.topic[..];
    let mut tick = cfg.tick_interval.map(|t| {
        let mut i = tokio::time::interval(t);
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        i
    });
    let mut actions = Vec::new();
    loop {
        // Every branch is cancel-safe: state lives in `link`, `replays` and `tick`, not in
        // the futures dropped when another branch wins.
        let step = tokio::select! {
            biased;
            () = stop.raised() => return,
            (i, event) = replays.next_event() => Step::Replay(i, event),
            event = link.next_event() => match event {
                LinkEvent::Message(msg) => Step::Live(msg),
                LinkEvent::Changed(down) => Step::Link(down),
            },
            () = next_tick(&mut tick) => Step::Tick,
        };
        if stop.is_raised() {
            return;
        }
        match step {
            Step::Live(msg) => {
                if let Some(action) = deliver_live(&msg, topic_filter, sink) {
                    replays.start(action, sink);
                }
            }
            Step::Replay(i, ReplayEvent::Reply(msg)) => {
                let id = replays.running[i].0;
                match deliver_replayed(id, &msg, topic_filter, sink) {
                    Replied::Batch(action) => replays.start(action, sink),
                    Replied::Malformed | Replied::Filtered => {}
                    Replied::End => replays.end(i, ReplayEnd::Completed, sink),
                }
            }
            Step::Replay(i, ReplayEvent::Ended(end)) => replays.end(i, end, sink),
            Step::Link(down) => sink.on_link(down),
            Step::Tick => {
                sink.on_tick(&mut actions);
                for action in actions.drain(..) {
                    replays.start(action, sink);
                }
            }
        }
    }
}

/// The next tick (never, without ticks). Cancel-safe.
async fn next_tick(tick: &mut Option<tokio::time::Interval>) {
    match tick {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

enum Step {
    Live(ZmqMessage),
    /// The link opened (`None`) or failed (`Some`).
    Link(Option<HealthReason>),
    /// An event of `replays.running[i]`.
    Replay(usize, ReplayEvent),
    Tick,
}

/// Hands one live message to the sink; `None` when it was malformed or filtered out.
fn deliver_live(
    msg: &ZmqMessage,
    topic_filter: &[u8],
    sink: &mut dyn FrameSink,
) -> Option<SourceAction> {
    if msg.len() != 3 {
        sink.on_bad_frame(bad_frame::FRAME_COUNT);
        return None;
    }
    let (topic, seq, payload) = (msg.get(0)?, msg.get(1)?, msg.get(2)?);
    // The publisher filters by the subscription already; this also covers a topic that is
    // not UTF-8 (subscribed to as "" — see `subscription`).
    if !topic.starts_with(topic_filter) {
        return None;
    }
    let Ok(seq) = <[u8; 8]>::try_from(&seq[..]) else {
        sink.on_bad_frame(bad_frame::SEQ_SIZE);
        return None;
    };
    Some(sink.on_message(topic, u64::from_be_bytes(seq), payload))
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

mod gate;
pub use gate::StartGate;

mod replay;
use replay::{deliver_replayed, ReplayEvent, Replays, Replied};

mod link;
use link::{LinkEvent, SubLink};

mod closing;
use closing::CLOSE_BOUND;

mod pipeline;
use pipeline::Lease;
