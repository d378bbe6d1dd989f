//! Test support: a libzmq peer (pyzmq, `tests/pyzmq/peer.py`) driven over stdin/stdout.
#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// A Python with pyzmq: `KVR_ZMTP_PYTHON`, else the compat venv's, else the test venv's,
/// else `python3`. `None` (with the reason printed) when there is none, unless
/// `KVR_REQUIRE_PYZMQ=1`, which makes that a failure.
pub fn python() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("KVR_ZMTP_PYTHON") {
        candidates.push(p.into());
    }
    if let Some(v) = std::env::var_os("KVR_COMPAT_VENV") {
        candidates.push(PathBuf::from(v).join("bin/python"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        let cache = PathBuf::from(home).join(".cache/kvr");
        candidates.push(cache.join("compat-venv/bin/python"));
        candidates.push(cache.join("test-venv/bin/python"));
    }
    candidates.push("python3".into());
    for c in &candidates {
        let ok = Command::new(c)
            .args(["-c", "import zmq"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(c.clone());
        }
    }
    let why = format!("no Python with pyzmq among {candidates:?}");
    if std::env::var("KVR_REQUIRE_PYZMQ").as_deref() == Ok("1") {
        panic!("{why} (KVR_REQUIRE_PYZMQ=1)");
    }
    // Straight to stderr, past the test harness's capture, so the skip shows in its output.
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED (not passed): {why}; run tests/compat/ensure-venv.sh"
    );
    None
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex from peer.py"))
        .collect()
}

/// A port free at the time of asking.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// One running peer.py.
pub struct PyPeer {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<Value>,
    /// Monitor events seen so far ("connected", "accepted", "disconnected", ...).
    pub events: Vec<String>,
}

impl PyPeer {
    /// Starts `peer.py ARGS...` and waits for its `ready` line.
    pub fn spawn(python: &PathBuf, args: &[&str]) -> PyPeer {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/pyzmq/peer.py");
        let mut child = Command::new(python)
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start peer.py");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let v: Value = serde_json::from_str(&line).expect("peer.py prints JSON");
                if tx.send(v).is_err() {
                    break;
                }
            }
        });
        let peer = PyPeer {
            child,
            stdin,
            lines,
            events: Vec::new(),
        };
        let first = peer
            .lines
            .recv_timeout(Duration::from_secs(20))
            .expect("peer.py ready");
        assert_eq!(first["ready"], Value::Bool(true), "{first}");
        peer
    }

    /// Sends `[topic, payload]` (PUB role).
    pub fn send(&mut self, topic: &[u8], payload: &[u8]) {
        writeln!(self.stdin, "send {} {}", hex(topic), hex(payload)).expect("peer.py stdin");
        self.stdin.flush().unwrap();
    }

    /// The next message received within `wait` (SUB role); events met meanwhile are kept.
    pub fn next_msg(&mut self, wait: Duration) -> Option<Vec<Vec<u8>>> {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = self.lines.recv_timeout(left).ok()?;
            if let Some(ev) = v["event"].as_str() {
                self.events.push(ev.to_string());
                continue;
            }
            if let Some(frames) = v["msg"].as_array() {
                return Some(frames.iter().map(|f| unhex(f.as_str().unwrap())).collect());
            }
        }
    }

    /// Collects events printed so far (without waiting).
    pub fn poll_events(&mut self) {
        while let Ok(v) = self.lines.try_recv() {
            if let Some(ev) = v["event"].as_str() {
                self.events.push(ev.to_string());
            }
        }
    }

    pub fn count(&self, event: &str) -> usize {
        self.events.iter().filter(|e| *e == event).count()
    }

    /// Stops the peer (its socket closes with linger 0).
    pub fn stop(mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PyPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
