//! A minimal HTTP/1.1 server for the client tests: one thread accepting, one thread per
//! connection, persistent connections, `Content-Length` bodies only (std::net only).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// One request as the server read it.
#[derive(Clone, Debug)]
pub(crate) struct Received {
    pub method: String,
    pub path: String,
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

/// What the handler tells the server to do with a request.
pub(crate) enum Reply {
    /// Answer with this status and body (`Content-Type: application/json`).
    Json(u16, String),
    /// Answer 200 with this body, then close the connection; announced with
    /// `Connection: close` when the flag is set, unannounced otherwise.
    JsonThenClose(bool, String),
    /// Write these bytes and close the connection.
    Raw(&'static [u8]),
    /// Never answer (the connection is held until the server is dropped).
    Hang,
    /// Wait, then reply.
    Delay(Duration, Box<Reply>),
    /// Send the head (status 200, the body's length) at once and the body after a delay.
    SlowBody(Duration, String),
}

pub(crate) type Handler = dyn Fn(&Received) -> Reply + Send + Sync;

pub(crate) struct TestServer {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    received: Arc<Mutex<Vec<Received>>>,
    stop: Arc<AtomicBool>,
}

impl TestServer {
    pub(crate) fn start(
        handler: impl Fn(&Received) -> Reply + Send + Sync + 'static,
    ) -> TestServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let handler: Arc<Handler> = Arc::new(handler);
        let connections = Arc::new(AtomicUsize::new(0));
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, r, s) = (connections.clone(), received.clone(), stop.clone());
        thread::spawn(move || {
            for stream in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                c.fetch_add(1, Ordering::SeqCst);
                let (h, r, s) = (handler.clone(), r.clone(), s.clone());
                thread::spawn(move || serve_connection(stream, &*h, &r, &s));
            }
        });
        TestServer {
            addr,
            connections,
            received,
            stop,
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub(crate) fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    pub(crate) fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so that it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

/// Reads one request (head and `Content-Length` body); `None` at end of stream.
fn read_request(reader: &mut BufReader<TcpStream>) -> Option<Received> {
    let mut line = String::new();
    if reader.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let mut content_length = 0usize;
    let mut content_type = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (name, value) = h.split_once(':')?;
        let value = value.trim();
        match name.to_ascii_lowercase().as_str() {
            "content-length" => content_length = value.parse().ok()?,
            "content-type" => content_type = Some(value.to_string()),
            "transfer-encoding" => panic!("the client sent a chunked body"),
            _ => {}
        }
    }
    let mut body = vec![0; content_length];
    reader.read_exact(&mut body).ok()?;
    Some(Received {
        method,
        path,
        content_type,
        body,
    })
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        500 => "Internal Server Error",
        _ => "Whatever",
    }
}

fn head(status: u16, len: usize) -> String {
    format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n",
        reason(status)
    )
}

/// Sleeps up to `d`, returning early once the server is stopped.
fn sleep_unless_stopped(d: Duration, stop: &AtomicBool) {
    let until = Instant::now() + d;
    while Instant::now() < until && !stop.load(Ordering::SeqCst) {
        thread::sleep(Duration::from_millis(10));
    }
}

fn serve_connection(
    stream: TcpStream,
    handler: &Handler,
    received: &Mutex<Vec<Received>>,
    stop: &AtomicBool,
) {
    let mut out = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    while let Some(req) = read_request(&mut reader) {
        received.lock().unwrap().push(req.clone());
        let mut reply = handler(&req);
        loop {
            match reply {
                Reply::Delay(d, next) => {
                    sleep_unless_stopped(d, stop);
                    reply = *next;
                }
                Reply::Json(status, body) => {
                    let msg = head(status, body.len()) + &body;
                    if out.write_all(msg.as_bytes()).is_err() {
                        return;
                    }
                    break;
                }
                Reply::JsonThenClose(announce, body) => {
                    let mut h = head(200, body.len());
                    if announce {
                        h.insert_str(h.len() - 2, "Connection: close\r\n");
                    }
                    let _ = out.write_all((h + &body).as_bytes());
                    return;
                }
                Reply::Raw(bytes) => {
                    let _ = out.write_all(bytes);
                    return;
                }
                Reply::Hang => {
                    // Bounded, so that a leaked connection thread ends by itself.
                    sleep_unless_stopped(Duration::from_secs(30), stop);
                    return;
                }
                Reply::SlowBody(d, body) => {
                    if out.write_all(head(200, body.len()).as_bytes()).is_err() {
                        return;
                    }
                    sleep_unless_stopped(d, stop);
                    let _ = out.write_all(body.as_bytes());
                    return;
                }
            }
        }
    }
}
