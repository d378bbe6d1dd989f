//! One TCP connection speaking ZMTP 3.1: the handshake (greeting, READY, socket types),
//! then reading and writing concurrently in the connection's task. Heartbeats live here
//! (our PING every interval; PONG to the peer's PING; close after silence), so the
//! publisher and the subscriber only see messages and subscriptions.

use std::fmt;
use std::io;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio::time::{interval_at, sleep_until, Instant, MissedTickBehavior};

use crate::config::ZmtpConfig;
use crate::frame::{
    decode_frame, encode_command, encode_frame, encode_ping, encode_ready, parse_command, Command,
    CommandError, FrameError,
};
use crate::greeting::{check_greeting, encode_greeting, GreetingError, PeerVersion, GREETING_LEN};
use crate::stats::{bump, LinkCounters};

/// Bytes reserved ahead of each read: the buffer grows with what arrives, not with what a
/// peer's length field claims.
const READ_CHUNK: usize = 64 * 1024;
/// Batch several queued messages into one write up to about this many bytes.
const WRITE_BATCH: usize = 64 * 1024;

/// Which socket we are; decides the READY we send and the peer types we accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Pub,
    Sub,
}

impl Role {
    fn socket_type(self) -> &'static str {
        match self {
            Role::Pub => "PUB",
            Role::Sub => "SUB",
        }
    }

    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            Role::Pub => peer == b"SUB" || peer == b"XSUB",
            Role::Sub => peer == b"PUB" || peer == b"XPUB",
        }
    }
}

/// Why a handshake failed.
#[derive(Debug)]
pub(crate) enum HandshakeError {
    Io(io::Error),
    Greeting(GreetingError),
    Frame(FrameError),
    Command(CommandError),
    /// Something other than READY came first.
    NotReady,
    /// The peer sent ERROR with this reason.
    PeerError(String),
    SocketType(String),
    Timeout,
}

impl fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandshakeError::Io(e) => write!(f, "I/O error: {e}"),
            HandshakeError::Greeting(e) => e.fmt(f),
            HandshakeError::Frame(e) => e.fmt(f),
            HandshakeError::Command(e) => e.fmt(f),
            HandshakeError::NotReady => f.write_str("peer did not start with READY"),
            HandshakeError::PeerError(r) => write!(f, "peer sent ERROR: {r}"),
            HandshakeError::SocketType(t) => write!(f, "incompatible peer socket type `{t}`"),
            HandshakeError::Timeout => f.write_str("handshake timed out"),
        }
    }
}

impl From<io::Error> for HandshakeError {
    fn from(e: io::Error) -> Self {
        HandshakeError::Io(e)
    }
}

/// A connection past READY: its halves, what was read beyond READY, and the peer's version.
#[derive(Debug)]
pub(crate) struct Established {
    pub(crate) version: PeerVersion,
    reader: OwnedReadHalf,
    pub(crate) writer: OwnedWriteHalf,
    buf: BytesMut,
}

/// Greets, exchanges READY and checks the peer's socket type, within `handshake_timeout`.
pub(crate) async fn handshake(
    stream: TcpStream,
    role: Role,
    cfg: &ZmtpConfig,
) -> Result<Established, HandshakeError> {
    match tokio::time::timeout(cfg.handshake_timeout, handshake_inner(stream, role, cfg)).await {
        Ok(r) => r,
        Err(_) => Err(HandshakeError::Timeout),
    }
}

async fn handshake_inner(
    stream: TcpStream,
    role: Role,
    cfg: &ZmtpConfig,
) -> Result<Established, HandshakeError> {
    let _ = stream.set_nodelay(true);
    let (mut reader, mut writer) = stream.into_split();
    writer.write_all(&encode_greeting()).await?;
    let mut buf = BytesMut::with_capacity(GREETING_LEN);
    let version = loop {
        if let Some(v) = check_greeting(&buf).map_err(HandshakeError::Greeting)? {
            break v;
        }
        // Read no further than the greeting's end: what follows is frames.
        let room = GREETING_LEN - buf.len();
        let mut want = (&mut buf).limit(room);
        if reader.read_buf(&mut want).await? == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
    };
    buf.clear();
    let mut out = BytesMut::new();
    encode_ready(&mut out, role.socket_type());
    writer.write_all(&out).await?;
    let frame = loop {
        match decode_frame(&mut buf, cfg.max_frame).map_err(HandshakeError::Frame)? {
            Some(f) => break f,
            None => {
                buf.reserve(READ_CHUNK.min(cfg.max_frame.saturating_add(9)));
                if reader.read_buf(&mut buf).await? == 0 {
                    return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
                }
            }
        }
    };
    if !frame.command {
        return Err(HandshakeError::NotReady);
    }
    match parse_command(frame.body).map_err(HandshakeError::Command)? {
        Command::Ready { socket_type } => {
            let t = socket_type.unwrap_or_default();
            if !role.accepts(&t) {
                return Err(HandshakeError::SocketType(
                    String::from_utf8_lossy(&t).into_owned(),
                ));
            }
        }
        Command::Error(reason) => return Err(HandshakeError::PeerError(reason)),
        _ => return Err(HandshakeError::NotReady),
    }
    Ok(Established {
        version,
        reader,
        writer,
        buf,
    })
}

/// What the link hands to its socket.
#[derive(Debug)]
pub(crate) enum Inbound {
    /// A whole message: its first two parts and how many parts it had.
    Message {
        parts: Vec<Bytes>,
        count: usize,
    },
    Subscribe(Bytes),
    Cancel(Bytes),
}

/// Why a link ended.
#[derive(Debug)]
pub(crate) enum LinkEnd {
    /// Our side closed it (close/disconnect).
    Closed,
    PeerClosed,
    Io(io::Error),
    Timeout(Duration),
    Frame(FrameError),
    Command(CommandError),
    PeerError(String),
}

impl fmt::Display for LinkEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkEnd::Closed => f.write_str("closed locally"),
            LinkEnd::PeerClosed => f.write_str("peer closed the connection"),
            LinkEnd::Io(e) => write!(f, "I/O error: {e}"),
            LinkEnd::Timeout(d) => write!(f, "nothing received for {d:?} (heartbeat timeout)"),
            LinkEnd::Frame(e) => e.fmt(f),
            LinkEnd::Command(e) => e.fmt(f),
            LinkEnd::PeerError(r) => write!(f, "peer sent ERROR: {r}"),
        }
    }
}

impl LinkEnd {
    /// Counts this end into `c` (a local close is not a disconnect).
    pub(crate) fn count(&self, c: &LinkCounters) {
        match self {
            LinkEnd::Closed => return,
            LinkEnd::Timeout(_) => bump(&c.timeouts),
            LinkEnd::Frame(FrameError::TooLarge { .. }) => bump(&c.oversized),
            LinkEnd::Frame(_) | LinkEnd::Command(_) => bump(&c.protocol_errors),
            LinkEnd::PeerClosed | LinkEnd::Io(_) | LinkEnd::PeerError(_) => {}
        }
        bump(&c.disconnects);
    }
}

/// A message to write: topic and payload frames.
pub(crate) type Outgoing = (Bytes, Bytes);

/// Runs an established link until it ends: reads frames (answering PINGs, handing
/// messages and subscriptions to `inbound`) while writing queued messages and our PINGs.
pub(crate) async fn run(
    link: Established,
    cfg: &ZmtpConfig,
    counters: &LinkCounters,
    outgoing: Option<mpsc::Receiver<Outgoing>>,
    closed: watch::Receiver<bool>,
    inbound: impl FnMut(Inbound),
) -> LinkEnd {
    let Established {
        reader,
        writer,
        buf,
        ..
    } = link;
    let (pong_tx, pong_rx) = mpsc::channel(8);
    tokio::select! {
        end = read_loop(reader, buf, cfg, counters, pong_tx, inbound) => end,
        end = write_loop(writer, cfg, counters, pong_rx, outgoing, closed) => end,
    }
}

async fn read_loop(
    mut reader: OwnedReadHalf,
    mut buf: BytesMut,
    cfg: &ZmtpConfig,
    counters: &LinkCounters,
    pong_tx: mpsc::Sender<Bytes>,
    mut inbound: impl FnMut(Inbound),
) -> LinkEnd {
    let mut last_rx = Instant::now();
    let mut parts: Vec<Bytes> = Vec::with_capacity(2);
    let mut count = 0usize;
    loop {
        loop {
            let frame = match decode_frame(&mut buf, cfg.max_frame) {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return LinkEnd::Frame(e),
            };
            if !frame.command {
                count += 1;
                if parts.len() < 2 {
                    parts.push(frame.body);
                }
                if !frame.more {
                    inbound(Inbound::Message {
                        parts: std::mem::replace(&mut parts, Vec::with_capacity(2)),
                        count,
                    });
                    count = 0;
                }
                continue;
            }
            match parse_command(frame.body) {
                Err(e) => return LinkEnd::Command(e),
                Ok(Command::Ping { context, .. }) => {
                    // A full queue means PONGs are already pending; one more adds nothing.
                    if let (true, Ok(slot)) = (cfg.answer_pings, pong_tx.try_reserve()) {
                        bump(&counters.pings_answered);
                        slot.send(context);
                    }
                }
                Ok(Command::Pong { .. }) => bump(&counters.pongs_received),
                Ok(Command::Subscribe(t)) => inbound(Inbound::Subscribe(t)),
                Ok(Command::Cancel(t)) => inbound(Inbound::Cancel(t)),
                Ok(Command::Error(reason)) => return LinkEnd::PeerError(reason),
                Ok(Command::Ready { .. } | Command::Other(_)) => bump(&counters.unknown_commands),
            }
        }
        buf.reserve(READ_CHUNK.min(cfg.max_frame.saturating_add(9)));
        tokio::select! {
            r = reader.read_buf(&mut buf) => match r {
                Ok(0) => return LinkEnd::PeerClosed,
                Ok(_) => last_rx = Instant::now(),
                Err(e) => return LinkEnd::Io(e),
            },
            _ = sleep_until(later(last_rx, cfg.heartbeat_timeout)) => {
                return LinkEnd::Timeout(cfg.heartbeat_timeout);
            }
        }
    }
}

async fn write_loop(
    mut writer: OwnedWriteHalf,
    cfg: &ZmtpConfig,
    counters: &LinkCounters,
    mut pong_rx: mpsc::Receiver<Bytes>,
    mut outgoing: Option<mpsc::Receiver<Outgoing>>,
    mut closed: watch::Receiver<bool>,
) -> LinkEnd {
    // tokio's interval refuses a zero period.
    let every = cfg.heartbeat_interval.max(Duration::from_millis(1));
    let mut ping = interval_at(later(Instant::now(), every), every);
    ping.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let ttl = cfg.ttl_deciseconds();
    let mut out = BytesMut::new();
    loop {
        if *closed.borrow() {
            return LinkEnd::Closed;
        }
        out.clear();
        tokio::select! {
            biased;
            _ = closed.changed() => return LinkEnd::Closed,
            Some(context) = pong_rx.recv() => encode_command(&mut out, b"PONG", &context),
            _ = ping.tick() => {
                encode_ping(&mut out, ttl);
                bump(&counters.pings_sent);
            }
            Some(msg) = next_outgoing(&mut outgoing) => {
                encode_message(&mut out, &msg);
                if let Some(rx) = outgoing.as_mut() {
                    while out.len() < WRITE_BATCH {
                        match rx.try_recv() {
                            Ok(m) => encode_message(&mut out, &m),
                            Err(_) => break,
                        }
                    }
                }
            }
        }
        if let Err(e) = writer.write_all(&out).await {
            return LinkEnd::Io(e);
        }
    }
}

/// `from + d`, or a far future when that overflows (a configured "never").
fn later(from: Instant, d: Duration) -> Instant {
    from.checked_add(d)
        .unwrap_or_else(|| from + Duration::from_secs(30 * 365 * 86_400))
}

async fn next_outgoing(rx: &mut Option<mpsc::Receiver<Outgoing>>) -> Option<Outgoing> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

fn encode_message(out: &mut BytesMut, (topic, payload): &Outgoing) {
    encode_frame(out, true, false, topic);
    encode_frame(out, false, false, payload);
}

/// Our subscriptions in the form the peer's version expects: SUBSCRIBE commands for 3.1,
/// `0x01`-prefixed messages for 3.0.
pub(crate) fn encode_subscriptions(out: &mut BytesMut, version: PeerVersion, topics: &[Bytes]) {
    for t in topics {
        match version {
            PeerVersion::V31 => encode_command(out, b"SUBSCRIBE", t),
            PeerVersion::V30 => {
                let mut body = Vec::with_capacity(1 + t.len());
                body.push(1);
                body.extend_from_slice(t);
                encode_frame(out, false, false, &body);
            }
        }
    }
}
