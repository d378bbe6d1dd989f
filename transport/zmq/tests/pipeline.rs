//! The ingest pipeline: every subscriber of the process runs on one thread (`kvr-ingest`),
//! which ends with the last subscriber; stopping one closes its connections and its
//! listener at once though the runtime lives on; a panicking sink ends its own
//! subscription only; `stop` called from a sink returns.
//!
//! The tests count the process's threads and read `/proc/net/tcp`, so they run one at a
//! time ([`serial`]).
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use kvr::ingress::SourceAction;
use kvr_zmq::transport::{FrameSink, ReplayEnd, Subscriber, SubscriberConfig};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a sink saw, as the test's side of it.
#[derive(Default)]
struct Seen {
    messages: AtomicUsize,
    ticks: AtomicUsize,
    /// Set by the test once the subscriber's `stop` returned.
    stopped: AtomicBool,
    called_after_stop: AtomicBool,
    threads: Mutex<Vec<(ThreadId, Option<String>)>>,
}

impl Seen {
    fn call(&self) {
        if self.stopped.load(Ordering::SeqCst) {
            self.called_after_stop.store(true, Ordering::SeqCst);
        }
        let t = std::thread::current();
        let mut threads = self.threads.lock().unwrap();
        if !threads.iter().any(|(id, _)| *id == t.id()) {
            threads.push((t.id(), t.name().map(str::to_owned)));
        }
    }
}

type OnCall = Box<dyn FnMut() + Send>;

/// Counts into `seen`; runs `on_message`/`on_tick` (if any) on every such call; asks for a
/// replay on the first message when `replay` is set.
struct Sink {
    seen: Arc<Seen>,
    replay: bool,
    on_message: Option<OnCall>,
    on_tick: Option<OnCall>,
    /// Dropped with the sink: the receiver sees it disconnect.
    _alive: Option<Sender<()>>,
}

impl Sink {
    fn new(seen: &Arc<Seen>) -> Sink {
        Sink {
            seen: Arc::clone(seen),
            replay: false,
            on_message: None,
            on_tick: None,
            _alive: None,
        }
    }
}

impl FrameSink for Sink {
    fn on_message(&mut self, _: &[u8], _: u64, _: &[u8]) -> SourceAction {
        self.seen.call();
        self.seen.messages.fetch_add(1, Ordering::SeqCst);
        if let Some(f) = &mut self.on_message {
            f();
        }
        if std::mem::take(&mut self.replay) {
            return SourceAction::Replay {
                id: 0,
                from_seq: 0,
                endpoint: None,
            };
        }
        SourceAction::Continue
    }
    fn on_replayed(&mut self, _: u32, _: &[u8], _: u64, _: &[u8]) -> SourceAction {
        self.seen.call();
        SourceAction::Continue
    }
    fn on_replay_end(&mut self, _: u32, _: ReplayEnd) -> SourceAction {
        self.seen.call();
        SourceAction::Continue
    }
    fn on_tick(&mut self, _: &mut Vec<SourceAction>) {
        self.seen.call();
        self.seen.ticks.fetch_add(1, Ordering::SeqCst);
        if let Some(f) = &mut self.on_tick {
            f();
        }
    }
    fn on_bad_frame(&mut self, _: &'static str) {
        self.seen.call();
    }
}

fn config(endpoint: &str, bind: bool) -> SubscriberConfig {
    SubscriberConfig {
        reconnect_interval: Duration::from_millis(100),
        ..if bind {
            SubscriberConfig::bind(endpoint)
        } else {
            SubscriberConfig::connect(endpoint)
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The names of this process's threads.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim_end().to_owned())
        .collect()
}

fn pipeline_threads() -> usize {
    thread_names().iter().filter(|n| *n == "kvr-ingest").count()
}

/// Established IPv4 TCP connections, as (local port, remote port).
fn established() -> Vec<(u16, u16)> {
    let port = |addr: &str| u16::from_str_radix(addr.rsplit(':').next().unwrap(), 16).unwrap();
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(3) == Some(&"01")).then(|| (port(f[1]), port(f[2])))
        })
        .collect()
}

/// A PUB socket (bound, or connecting to `connect_to`) publishing `[b"kv", seq, ""]` every
/// 2 ms, and a bound ROUTER that reads replay requests and never answers, served by a
/// thread of the test's own.
struct Publisher {
    pub_port: u16,
    router: String,
    done: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Publisher {
    fn spawn(connect_to: Option<&str>) -> Publisher {
        let (ready, endpoints) = channel();
        let done = Arc::new(AtomicBool::new(false));
        let until = Arc::clone(&done);
        let connect_to = connect_to.map(str::to_owned);
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let mut publisher = PubSocket::new();
                let pub_port = match &connect_to {
                    Some(endpoint) => {
                        publisher.connect(endpoint).await.unwrap();
                        0
                    }
                    None => match publisher.bind("tcp://127.0.0.1:0").await.unwrap() {
                        zeromq::Endpoint::Tcp(_, port) => port,
                        other => panic!("{other}"),
                    },
                };
                let mut router = RouterSocket::new();
                let router_ep = router.bind("tcp://127.0.0.1:0").await.unwrap();
                tokio::spawn(async move { while router.recv().await.is_ok() {} });
                ready.send((pub_port, router_ep.to_string())).unwrap();
                let mut seq = 0u64;
                while !until.load(Ordering::SeqCst) {
                    let mut msg = ZmqMessage::from(b"kv".to_vec());
                    msg.push_back(seq.to_be_bytes().to_vec().into());
                    msg.push_back(Vec::new().into());
                    let _ = publisher.send(msg).await;
                    seq += 1;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            });
        });
        let (pub_port, router) = endpoints.recv().unwrap();
        Publisher {
            pub_port,
            router,
            done,
            thread: Some(thread),
        }
    }

    fn endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.pub_port)
    }

    fn router_port(&self) -> u16 {
        self.router.rsplit(':').next().unwrap().parse().unwrap()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn every_subscriber_runs_on_one_thread_that_ends_with_the_last() {
    let _serial = serial();
    // A pipeline left by an earlier test (stopped from its own thread) may still be ending.
    wait_until("no pipeline thread", || pipeline_threads() == 0);
    let before = thread_names().len();
    let seen = Arc::new(Seen::default());
    let mut subs: Vec<Subscriber> = (0..100)
        .map(|_| {
            // Nothing listens there: each keeps reconnecting, and ticks.
            let cfg = SubscriberConfig {
                tick_interval: Some(Duration::from_millis(20)),
                ..config(&format!("tcp://127.0.0.1:{}", free_port()), false)
            };
            Subscriber::start(cfg, Box::new(Sink::new(&seen))).unwrap()
        })
        .collect();
    wait_until("every subscriber's first ticks", || {
        seen.ticks.load(Ordering::SeqCst) >= 300
    });
    // One thread more, not 100 (the test harness may start a thread for the next test
    // meanwhile).
    let names = thread_names();
    assert!(names.len() <= before + 3, "threads: {names:?}");
    assert_eq!(pipeline_threads(), 1);
    assert!(!names.iter().any(|n| n.starts_with("kvr-sub")));
    let threads = seen.threads.lock().unwrap().clone();
    assert_eq!(threads.len(), 1, "sink calls ran on {threads:?}");
    assert_eq!(threads[0].1.as_deref(), Some("kvr-ingest"));
    assert!(subs.iter().all(|s| s.is_running()));
    assert!(subs.iter().all(|s| s.thread_name() == "kvr-ingest"));

    // The thread outlives every stop but the last, which joins it.
    let last = subs.pop().unwrap();
    for mut s in subs {
        s.stop();
        assert!(!s.is_running());
    }
    assert_eq!(pipeline_threads(), 1);
    drop(last);
    // Joined: the thread has exited (its /proc entry may take a moment to go).
    wait_until("the pipeline thread to go", || pipeline_threads() == 0);

    // The next subscriber starts a new one.
    let again = Arc::new(Seen::default());
    let cfg = SubscriberConfig {
        tick_interval: Some(Duration::from_millis(10)),
        ..config(&format!("tcp://127.0.0.1:{}", free_port()), false)
    };
    let mut sub = Subscriber::start(cfg, Box::new(Sink::new(&again))).unwrap();
    wait_until("a tick", || again.ticks.load(Ordering::SeqCst) > 0);
    assert_eq!(pipeline_threads(), 1);
    sub.stop();
    wait_until("the pipeline thread to go", || pipeline_threads() == 0);
}

#[test]
fn a_panicking_sink_ends_its_subscription_only() {
    let _serial = serial();
    let publisher = Publisher::spawn(None);
    // The panicking one is bound, with a publisher connected to it: its port must be freed.
    let port = free_port();
    let bound = format!("tcp://127.0.0.1:{port}");
    let doomed_seen = Arc::new(Seen::default());
    let mut sink = Sink::new(&doomed_seen);
    sink.on_message = Some(Box::new(|| panic!("a sink's bug (this panic is expected)")));
    let mut doomed = Subscriber::start(config(&bound, true), Box::new(sink)).unwrap();
    let _feeding_doomed = Publisher::spawn(Some(&bound));
    let seen = Arc::new(Seen::default());
    let mut other = Subscriber::start(
        config(&publisher.endpoint(), false),
        Box::new(Sink::new(&seen)),
    )
    .unwrap();
    wait_until("messages on the other subscriber", || {
        seen.messages.load(Ordering::SeqCst) > 10
    });
    wait_until("the panicking subscriber to end", || !doomed.is_running());
    assert_eq!(doomed_seen.messages.load(Ordering::SeqCst), 1);
    // Its connection is closed (without a stop), and its listener.
    assert!(!established().iter().any(|&(local, _)| local == port));
    assert!(TcpListener::bind(("127.0.0.1", port)).is_ok());

    let at_panic = seen.messages.load(Ordering::SeqCst);
    wait_until("more messages on the other subscriber", || {
        seen.messages.load(Ordering::SeqCst) > at_panic + 10
    });
    assert!(other.is_running());
    doomed.stop(); // a no-op, but for the lease
    other.stop();
    assert!(!other.is_running());
}

#[test]
fn stop_closes_every_connection_and_the_listener_at_once() {
    let _serial = serial();
    // Keeps the pipeline (and its runtime) running throughout: the stops below are not
    // the last, so dropping the runtime does not close their sockets for them.
    let idle = config(&format!("tcp://127.0.0.1:{}", free_port()), false);
    let _keeper = Subscriber::start(idle, Box::new(Sink::new(&Arc::new(Seen::default()))));
    // Connected: the SUB's connection and a replay's DEALER (its request unanswered).
    let publisher = Publisher::spawn(None);
    let seen = Arc::new(Seen::default());
    let mut sink = Sink::new(&seen);
    sink.replay = true;
    let cfg = SubscriberConfig {
        replay_endpoint: Some(publisher.router.clone()),
        replay_timeout: Duration::from_secs(60),
        ..config(&publisher.endpoint(), false)
    };
    let mut sub = Subscriber::start(cfg, Box::new(sink)).unwrap();
    let ours = |(_, remote): &(u16, u16)| {
        *remote == publisher.pub_port || *remote == publisher.router_port()
    };
    wait_until("both connections", || {
        established().iter().filter(|c| ours(c)).count() == 2
    });
    sub.stop();
    assert_eq!(established().iter().filter(|c| ours(c)).count(), 0);

    // Bound, a publisher connected: the port is free when stop returns.
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let seen = Arc::new(Seen::default());
    let mut sub = Subscriber::start(config(&endpoint, true), Box::new(Sink::new(&seen))).unwrap();
    let feeding = Publisher::spawn(Some(&endpoint));
    wait_until("messages", || seen.messages.load(Ordering::SeqCst) > 0);
    assert!(TcpListener::bind(("127.0.0.1", port)).is_err());
    sub.stop();
    assert!(!established().iter().any(|&(local, _)| local == port));
    assert!(TcpListener::bind(("127.0.0.1", port)).is_ok());
    drop(feeding);
}

/// A subscriber in a slot a sink can take it from.
type Shared = Arc<Mutex<Option<Subscriber>>>;

#[test]
fn stop_called_from_a_sink_returns() {
    let _serial = serial();
    let publisher = Publisher::spawn(None);

    // Another subscriber's sink stops this one.
    let target_seen = Arc::new(Seen::default());
    let target: Shared = Arc::new(Mutex::new(Some(
        Subscriber::start(
            config(&publisher.endpoint(), false),
            Box::new(Sink::new(&target_seen)),
        )
        .unwrap(),
    )));
    wait_until("messages on the target", || {
        target_seen.messages.load(Ordering::SeqCst) > 0
    });
    let stopped_it = Arc::new(AtomicBool::new(false));
    let mut sink = Sink::new(&Arc::new(Seen::default()));
    let (slot, flag, seen) = (Arc::clone(&target), Arc::clone(&stopped_it), &target_seen);
    let seen = Arc::clone(seen);
    sink.on_tick = Some(Box::new(move || {
        if let Some(t) = slot.lock().unwrap().as_mut() {
            t.stop();
            assert!(!t.is_running());
            seen.stopped.store(true, Ordering::SeqCst);
            flag.store(true, Ordering::SeqCst);
        }
    }));
    let cfg = SubscriberConfig {
        tick_interval: Some(Duration::from_millis(10)),
        ..config(&format!("tcp://127.0.0.1:{}", free_port()), false)
    };
    let mut stopper = Subscriber::start(cfg, Box::new(sink)).unwrap();
    wait_until("the stop from a sink", || stopped_it.load(Ordering::SeqCst));
    std::thread::sleep(Duration::from_millis(100));
    assert!(!target_seen.called_after_stop.load(Ordering::SeqCst));
    let port = publisher.pub_port;
    wait_until("the target's connection to close", || {
        !established().iter().any(|&(_, remote)| remote == port)
    });
    drop(target.lock().unwrap().take());

    // A sink drops its own subscriber (the last one but `stopper`), then `stopper` stops.
    let self_seen = Arc::new(Seen::default());
    let own: Shared = Arc::new(Mutex::new(None));
    let (alive, gone): (Sender<()>, Receiver<()>) = channel();
    let mut sink = Sink::new(&self_seen);
    sink._alive = Some(alive);
    let slot = Arc::clone(&own);
    sink.on_message = Some(Box::new(move || drop(slot.lock().unwrap().take())));
    {
        // Held until the subscriber is in its slot: the first message waits for it.
        let mut slot = own.lock().unwrap();
        let cfg = config(&publisher.endpoint(), false);
        *slot = Some(Subscriber::start(cfg, Box::new(sink)).unwrap());
    }
    // Its sink is dropped (with its task) once the stop raised from within returned.
    assert_eq!(
        gone.recv_timeout(Duration::from_secs(20)),
        Err(RecvTimeoutError::Disconnected)
    );
    assert_eq!(self_seen.messages.load(Ordering::SeqCst), 1);
    stopper.stop();
    wait_until("the pipeline thread to go", || pipeline_threads() == 0);
}

#[test]
fn a_peer_stuck_in_its_handshake_delays_stop_by_a_bound() {
    let _serial = serial();
    let idle = config(&format!("tcp://127.0.0.1:{}", free_port()), false);
    let _keeper = Subscriber::start(idle, Box::new(Sink::new(&Arc::new(Seen::default()))));
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let seen = Arc::new(Seen::default());
    let mut sub = Subscriber::start(config(&endpoint, true), Box::new(Sink::new(&seen))).unwrap();
    // Connects at the TCP level and never sends its ZMTP greeting.
    let deadline = Instant::now() + Duration::from_secs(20);
    let silent = loop {
        if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            break s;
        }
        assert!(Instant::now() < deadline, "the subscriber never bound");
        std::thread::sleep(Duration::from_millis(5));
    };
    std::thread::sleep(Duration::from_millis(50));
    let t = Instant::now();
    sub.stop();
    let took = t.elapsed();
    assert!(took < Duration::from_secs(2), "stop took {took:?}");
    // The listener is closed all the same.
    assert!(TcpListener::bind(("127.0.0.1", port)).is_ok());
    drop(silent);
}

#[test]
fn starts_and_stops_from_many_threads_at_once() {
    let _serial = serial();
    // The pipeline comes and goes as the count of subscribers touches zero.
    let workers: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(|| {
                for i in 0..50 {
                    let seen = Arc::new(Seen::default());
                    let cfg = SubscriberConfig {
                        tick_interval: Some(Duration::from_millis(10)),
                        ..config(&format!("tcp://127.0.0.1:{}", free_port()), false)
                    };
                    let mut sub = Subscriber::start(cfg, Box::new(Sink::new(&seen))).unwrap();
                    if i % 2 == 0 {
                        wait_until("a tick", || seen.ticks.load(Ordering::SeqCst) > 0);
                    }
                    sub.stop();
                    seen.stopped.store(true, Ordering::SeqCst);
                    assert!(!sub.is_running());
                    std::thread::sleep(Duration::from_millis(1));
                    assert!(!seen.called_after_stop.load(Ordering::SeqCst));
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    wait_until("the pipeline thread to go", || pipeline_threads() == 0);
}
