//! The listener's connections: hyper's HTTP/1 server under axum's router, so that no
//! connection is held forever (axum::serve sets no timeout at all).
//!
//! - **Header-read timeout** (`--http-header-read-timeout-secs`, default 30 s, hyper's own
//!   default): a request's headers must be complete this long after the service starts
//!   waiting for them. hyper starts that clock whenever it waits for a request, so it also
//!   closes a keep-alive connection left idle that long.
//! - **Idle timeout** (`--http-idle-timeout-secs`, default 60 s): a connection that moves
//!   no byte either way for this long while the service waits on it is closed (a body
//!   that stops half-way, a client that never reads its answer).
//!
//! Each close is counted in `kvr_http_refused_total`: `header_timeout` when part of a
//! request had arrived, `idle_timeout` when nothing had (an idle or silent connection);
//! bytes that are not HTTP count as `malformed_http`. On shutdown the accept loop stops
//! and every connection finishes its request in flight, then closes.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use crate::refusals::{Refusal, Refusals};

/// The connection timeouts (`None`: off).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    pub header_read: Option<Duration>,
    pub idle: Option<Duration>,
}

/// Accepts and serves connections until `stop` turns true, then waits for the open ones
/// to finish their request in flight.
pub async fn serve_connections(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    refusals: Arc<Refusals>,
    mut stop: watch::Receiver<bool>,
) {
    let mut conns = tokio::task::JoinSet::new();
    let for_conns = stop.clone();
    let stopping = async move {
        // The guard `wait_for` returns is not `Send`: dropped at once.
        let _ = stop.wait_for(|s| *s).await.is_ok();
    };
    tokio::pin!(stopping);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    conns.spawn(serve_one(stream, router.clone(), limits, refusals.clone(), for_conns.clone()));
                }
                Err(e) => {
                    // Out of descriptors and the like: wait a little rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            () = &mut stopping => break,
        }
        while conns.try_join_next().is_some() {}
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
}

async fn serve_one(
    stream: TcpStream,
    router: Router,
    limits: ConnLimits,
    refusals: Arc<Refusals>,
    mut stop: watch::Receiver<bool>,
) {
    let io = IdleIo::new(stream, limits.idle);
    let mid_request = io.mid_request.clone();
    let io = TokioIo::new(io);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read);
    let conn = builder.serve_connection(io, TowerToHyperService::new(router));
    tokio::pin!(conn);
    let stopping = async move {
        // The guard `wait_for` returns is not `Send`: drop it before going on.
        let _ = stop.wait_for(|s| *s).await.is_ok();
    };
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = stopping => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        if let Some(why) = refusal_of(&e, mid_request.load(Ordering::Relaxed)) {
            refusals.count(why, &e.to_string());
        }
    }
}

/// The refusal a connection error stands for; `None` for a peer that went away.
/// `mid_request`: bytes of a request had arrived with no answer written since (else a
/// header-read timeout closed an idle connection).
fn refusal_of(e: &hyper::Error, mid_request: bool) -> Option<Refusal> {
    if e.is_timeout() {
        return Some(if mid_request {
            Refusal::HeaderTimeout
        } else {
            Refusal::IdleTimeout
        });
    }
    if e.is_parse() || e.is_parse_too_large() || e.is_parse_version_h2() {
        return Some(Refusal::MalformedHttp);
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<io::Error>() {
            if io.get_ref().is_some_and(|i| i.is::<IdleTimeout>()) {
                return Some(Refusal::IdleTimeout);
            }
        }
        source = s.source();
    }
    None
}

/// The error an idle connection's reads and writes fail with.
#[derive(Debug)]
struct IdleTimeout;

impl std::fmt::Display for IdleTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection idle too long")
    }
}

impl std::error::Error for IdleTimeout {}

/// A stream whose reads and writes fail once it has moved no byte for `idle` while
/// being waited on.
struct IdleIo {
    inner: TcpStream,
    idle: Option<Duration>,
    deadline: Pin<Box<Sleep>>,
    /// Bytes were read since the last bytes written (a request is arriving).
    mid_request: Arc<AtomicBool>,
}

impl IdleIo {
    fn new(inner: TcpStream, idle: Option<Duration>) -> Self {
        let first = idle.map_or(Duration::from_secs(86_400), |d| d);
        IdleIo {
            inner,
            idle,
            deadline: Box::pin(tokio::time::sleep(first)),
            mid_request: Arc::new(AtomicBool::new(false)),
        }
    }

    fn progressed(&mut self) {
        if let Some(d) = self.idle {
            self.deadline.as_mut().reset(Instant::now() + d);
        }
    }

    /// On a pending read or write: an error once the deadline has passed.
    fn check_idle(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.idle.is_some() && self.deadline.as_mut().poll(cx).is_ready() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, IdleTimeout));
        }
        Ok(())
    }
}

impl AsyncRead for IdleIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    this.progressed();
                    this.mid_request.store(true, Ordering::Relaxed);
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                this.check_idle(cx)?;
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for IdleIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Ready(r) => {
                if r.as_ref().is_ok_and(|&n| n > 0) {
                    this.progressed();
                    this.mid_request.store(false, Ordering::Relaxed);
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                this.check_idle(cx)?;
                Poll::Pending
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(Pin::new(&mut this.inner).poll_flush(cx))?;
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
