//! Connections nobody finishes are closed, and every refusal is counted: a half-sent
//! request is closed by the header-read timeout, a body stalled half-way by the idle
//! timeout (both configured short here), and `kvr_http_refused_total` counts them with
//! malformed HTTP, unknown routes, wrong methods, bad JSON and oversized bodies.
//!
//! Negative controls: with the timeouts off (`0`), the same half-sent request is still
//! open after the time the short timeout closes it in.

use super::*;

/// Sends `bytes`, then waits (up to `limit`) for the server to close; returns how long
/// it took, or `None` if the connection was still open at `limit`.
fn closed_within(addr: SocketAddr, bytes: &[u8], limit: Duration) -> Option<Duration> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(bytes).unwrap();
    let start = Instant::now();
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(start.elapsed()),
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return None
            }
            Err(_) => return Some(start.elapsed()),
        }
    }
}

fn refused(c: &mut Client, reason: &str) -> u64 {
    let text = String::from_utf8(c.get("/metrics").body).unwrap();
    let key = format!("kvr_http_refused_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |v| v.trim().parse().unwrap())
}

const HALF_SENT: &[u8] = b"POST /select HTTP/1.1\r\nHost: kvr\r\ncontent-type: appl";

#[test]
fn half_sent_requests_are_closed_and_counted() {
    let server = Server::start_with(&[
        "--http-header-read-timeout-secs",
        "1",
        "--http-idle-timeout-secs",
        "2",
        "--max-body-bytes",
        "1000",
    ]);
    let mut c = server.client();
    let t = closed_within(server.addr, HALF_SENT, Duration::from_secs(10))
        .expect("a half-sent request was never closed");
    assert!(
        t >= Duration::from_millis(900) && t < Duration::from_secs(5),
        "{t:?}"
    );
    assert_eq!(refused(&mut c, "header_timeout"), 1);

    // A connection that never sends a byte is closed too, counted as idle.
    let before = refused(&mut c, "idle_timeout");
    assert!(closed_within(server.addr, b"", Duration::from_secs(10)).is_some());
    assert!(refused(&mut c, "idle_timeout") > before);

    // Headers complete, body stalled: the idle timeout ends it.
    let stalled = b"POST /select HTTP/1.1\r\nHost: kvr\r\ncontent-type: application/json\r\n\
                    content-length: 100\r\n\r\n{\"model_name\"";
    let t = closed_within(server.addr, stalled, Duration::from_secs(10))
        .expect("a stalled body was never closed");
    assert!(t < Duration::from_secs(6), "{t:?}");

    // Refusals of every kind are counted by reason.
    assert!(closed_within(
        server.addr,
        b"\x16\x03\x01 not http\r\n\r\n",
        Duration::from_secs(5)
    )
    .is_some());
    assert_eq!(refused(&mut c, "malformed_http"), 1);
    assert_eq!(c.get("/nope").status, 404);
    assert_eq!(refused(&mut c, "unknown_route"), 1);
    assert_eq!(c.get("/select").status, 405);
    assert_eq!(refused(&mut c, "method_not_allowed"), 1);
    assert_eq!(
        c.request(
            "POST",
            "/select",
            Some("application/json"),
            b"{\"model_name\": "
        )
        .unwrap()
        .status,
        400
    );
    assert!(refused(&mut c, "bad_request") >= 1);
    assert_eq!(
        c.request("POST", "/select", Some("application/json"), b"[1,2]")
            .unwrap()
            .status,
        422
    );
    assert_eq!(refused(&mut c, "invalid_body"), 1);
    assert_eq!(
        c.request("POST", "/select", None, b"{}").unwrap().status,
        415
    );
    assert_eq!(refused(&mut c, "unsupported_media_type"), 1);
    let big = vec![b' '; 2000];
    assert_eq!(
        c.request("POST", "/select", Some("application/json"), &big)
            .unwrap()
            .status,
        413
    );
    assert_eq!(refused(&mut c, "body_too_large"), 1);
    // A valid request is not a refusal.
    assert_eq!(c.get("/health").status, 200);
    assert_eq!(refused(&mut c, "header_timeout"), 1);
}

#[test]
fn without_timeouts_a_half_sent_request_stays_open() {
    let server = Server::start_with(&[
        "--http-header-read-timeout-secs",
        "0",
        "--http-idle-timeout-secs",
        "0",
    ]);
    assert_eq!(
        closed_within(server.addr, HALF_SENT, Duration::from_secs(3)),
        None,
        "closed although no timeout is set"
    );
}
