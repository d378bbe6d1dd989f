//! A pod's KV events on vLLM's wire (REFERENCE.md §2): a ZMQ PUB socket sending
//! `[topic, seq (8-byte big-endian), payload]` per batch, seq from 0, and a replay ROUTER
//! answering `[identity, "", start_seq]` with every buffered batch at or after it,
//! `[identity, "", topic, seq, payload]`, then the end marker `[identity, "", "",
//! ff×8, ""]`. As vLLM's publisher, one task does both, so replies never interleave
//! with a batch half sent.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// vLLM's replay buffer: the last 10,000 batches.
pub const REPLAY_BUFFER: usize = 10_000;
/// vLLM's publisher queue bound (`max_queue_size`); beyond it batches are dropped, counted.
pub const QUEUE_BOUND: usize = 100_000;
const END_SEQ: [u8; 8] = [0xff; 8];

/// Counters of a publisher.
#[derive(Debug, Default)]
pub struct PublisherCounters {
    /// Batches given a sequence number (sent, or deliberately dropped).
    pub published: AtomicU64,
    /// Batches not sent live on purpose ([`Publisher::drop_next`]); still replayable.
    pub dropped_live: AtomicU64,
    /// Batches refused because the queue was full (never sequenced, lost).
    pub queue_full: AtomicU64,
    /// Replay requests answered.
    pub replays: AtomicU64,
    /// Replay requests ignored as malformed (vLLM logs and drops them too).
    pub bad_replay_requests: AtomicU64,
}

/// The publishing side of a pod: hand it encoded batches in order.
#[derive(Debug)]
pub struct Publisher {
    tx: mpsc::Sender<Vec<u8>>,
    drop_next: Arc<AtomicU64>,
    counters: Arc<PublisherCounters>,
    /// The PUB endpoint as bound (a port 0 resolved).
    pub pub_endpoint: String,
    /// The replay endpoint as bound, if any.
    pub replay_endpoint: Option<String>,
}

impl Publisher {
    /// Binds the PUB socket (and the replay ROUTER) and starts the publishing task on the
    /// current tokio runtime.
    pub async fn start(
        pub_endpoint: &str,
        replay_endpoint: Option<&str>,
        topic: Vec<u8>,
    ) -> std::io::Result<Publisher> {
        let io = |what: &str, e: zeromq::ZmqError| {
            std::io::Error::new(std::io::ErrorKind::AddrNotAvailable, format!("{what}: {e}"))
        };
        let mut pub_socket = PubSocket::new();
        let bound = pub_socket
            .bind(pub_endpoint)
            .await
            .map_err(|e| io(&format!("bind KV-event PUB {pub_endpoint}"), e))?;
        let mut router = None;
        let mut replay_bound = None;
        if let Some(ep) = replay_endpoint {
            let mut r = RouterSocket::new();
            let b = r
                .bind(ep)
                .await
                .map_err(|e| io(&format!("bind replay ROUTER {ep}"), e))?;
            replay_bound = Some(b.to_string());
            router = Some(r);
        }
        let (tx, rx) = mpsc::channel(QUEUE_BOUND);
        let drop_next = Arc::new(AtomicU64::new(0));
        let counters = Arc::new(PublisherCounters::default());
        let task = PublishTask {
            pub_socket,
            router,
            topic,
            buffer: VecDeque::new(),
            next_seq: 0,
            drop_next: drop_next.clone(),
            counters: counters.clone(),
        };
        tokio::spawn(task.run(rx));
        Ok(Publisher {
            tx,
            drop_next,
            counters,
            pub_endpoint: bound.to_string(),
            replay_endpoint: replay_bound,
        })
    }

    /// Queues one encoded batch (`[ts, [events], dp_rank]`); false if the queue was full.
    pub fn publish(&self, payload: Vec<u8>) -> bool {
        let ok = self.tx.try_send(payload).is_ok();
        if !ok {
            self.counters.queue_full.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// The next `n` batches are sequenced and buffered but not sent live: a subscriber
    /// sees a gap, which only the replay socket can fill (tests and demos of recovery).
    pub fn drop_next(&self, n: u64) {
        self.drop_next.fetch_add(n, Ordering::SeqCst);
    }

    pub fn counters(&self) -> &PublisherCounters {
        &self.counters
    }
}

struct PublishTask {
    pub_socket: PubSocket,
    router: Option<RouterSocket>,
    topic: Vec<u8>,
    buffer: VecDeque<(u64, Vec<u8>)>,
    next_seq: u64,
    drop_next: Arc<AtomicU64>,
    counters: Arc<PublisherCounters>,
}

fn message(frames: Vec<Vec<u8>>) -> ZmqMessage {
    let mut frames = frames.into_iter();
    let mut msg = ZmqMessage::from(frames.next().unwrap_or_default());
    for f in frames {
        msg.push_back(f.into());
    }
    msg
}

impl PublishTask {
    async fn run(mut self, mut rx: mpsc::Receiver<Vec<u8>>) {
        loop {
            let request = async {
                match self.router.as_mut() {
                    Some(r) => r.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                payload = rx.recv() => match payload {
                    Some(p) => self.send_live(p).await,
                    None => return,
                },
                request = request => match request {
                    Ok(msg) => self.serve_replay(msg).await,
                    Err(_) => self.router = None,
                },
            }
        }
    }

    async fn send_live(&mut self, payload: Vec<u8>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.counters.published.fetch_add(1, Ordering::Relaxed);
        let dropped = self
            .drop_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if dropped {
            self.counters.dropped_live.fetch_add(1, Ordering::Relaxed);
        } else {
            let msg = message(vec![
                self.topic.clone(),
                seq.to_be_bytes().to_vec(),
                payload.clone(),
            ]);
            // PUB drops what no subscriber takes, as ZMQ does; an error here is not fatal.
            let _ = self.pub_socket.send(msg).await;
        }
        if self.buffer.len() == REPLAY_BUFFER {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }

    async fn serve_replay(&mut self, request: ZmqMessage) {
        let frames: Vec<Vec<u8>> = request.iter().map(|f| f.to_vec()).collect();
        let start = match &frames[..] {
            [_, empty, seq] if empty.is_empty() => <[u8; 8]>::try_from(&seq[..]).ok(),
            _ => None,
        };
        let Some(start) = start.map(u64::from_be_bytes) else {
            self.counters
                .bad_replay_requests
                .fetch_add(1, Ordering::Relaxed);
            return;
        };
        let identity = frames[0].clone();
        let Some(router) = self.router.as_mut() else {
            return;
        };
        self.counters.replays.fetch_add(1, Ordering::Relaxed);
        for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
            let reply = message(vec![
                identity.clone(),
                Vec::new(),
                self.topic.clone(),
                seq.to_be_bytes().to_vec(),
                payload.clone(),
            ]);
            if router.send(reply).await.is_err() {
                return;
            }
        }
        let end = message(vec![
            identity,
            Vec::new(),
            Vec::new(),
            END_SEQ.to_vec(),
            Vec::new(),
        ]);
        let _ = router.send(end).await;
    }
}
