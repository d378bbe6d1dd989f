//! The /tokenize client against a one-shot local HTTP server.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvr_tokenize::{ChatMessage, TokenizeCallError, TokenizeClient, Tokenized};

/// Serves one request: answers `status` with `body` after `delay`; returns the request
/// line and body it received.
fn serve_once(
    status: u16,
    body: &'static str,
    delay: Duration,
) -> (String, JoinHandle<(String, String)>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let handle = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let (line, req) = read_request(&stream);
        std::thread::sleep(delay);
        let mut s = stream;
        let _ = write!(
            s,
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        (line, req)
    });
    (url, handle)
}

fn read_request(stream: &TcpStream) -> (String, String) {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let mut len = 0;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        if h == "\r\n" || h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap();
            }
        }
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body).unwrap();
    (line.trim_end().to_owned(), String::from_utf8(body).unwrap())
}

fn client(url: &str, timeout_ms: u64) -> TokenizeClient {
    TokenizeClient::new(url, Duration::from_millis(timeout_ms)).unwrap()
}

#[test]
fn prompt_and_chat() {
    let (url, h) = serve_once(
        200,
        r#"{"tokens": [1, 2, 3], "count": 3, "max_model_len": 4096}"#,
        Duration::ZERO,
    );
    let got = client(&url, 5000).tokenize_prompt("m", "hello").unwrap();
    assert_eq!(
        got,
        Tokenized {
            tokens: vec![1, 2, 3],
            max_model_len: Some(4096)
        }
    );
    let (line, body) = h.join().unwrap();
    assert_eq!(line, "POST /tokenize HTTP/1.1");
    let sent: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(sent, serde_json::json!({"model": "m", "prompt": "hello"}));

    let (url, h) = serve_once(200, r#"{"tokens": [9]}"#, Duration::ZERO);
    let msgs = [
        ChatMessage::new("user", "hi"),
        ChatMessage {
            role: "assistant".into(),
            content: None,
        },
    ];
    let got = client(&format!("{url}/base/"), 5000)
        .tokenize_chat("m", &msgs)
        .unwrap();
    assert_eq!(
        got,
        Tokenized {
            tokens: vec![9],
            max_model_len: None
        }
    );
    let (line, body) = h.join().unwrap();
    assert_eq!(line, "POST /base/tokenize HTTP/1.1");
    let sent: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        sent,
        serde_json::json!({"model": "m", "add_generation_prompt": true, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]})
    );
}

#[test]
fn bad_status() {
    let (url, h) = serve_once(404, r#"{"error": "model not found"}"#, Duration::ZERO);
    let e = client(&url, 5000).tokenize_prompt("m", "x").unwrap_err();
    assert_eq!(e, TokenizeCallError::BadStatus(404));
    assert_eq!(e.kind(), "bad_status");
    h.join().unwrap();
}

#[test]
fn bad_bodies() {
    for body in [
        "not json",
        r#"{"count": 1}"#,
        r#"{"tokens": [1, -2]}"#,
        r#"{"tokens": "1 2"}"#,
        r#"{"tokens": [1, 2], "count": 3}"#,
    ] {
        let (url, h) = serve_once(200, body, Duration::ZERO);
        let e = client(&url, 5000).tokenize_prompt("m", "x").unwrap_err();
        assert_eq!(e.kind(), "bad_body", "{body}: {e}");
        h.join().unwrap();
    }
}

#[test]
fn timeout() {
    let (url, h) = serve_once(200, r#"{"tokens": [1]}"#, Duration::from_millis(800));
    let start = Instant::now();
    let e = client(&url, 150).tokenize_prompt("m", "x").unwrap_err();
    let took = start.elapsed();
    assert_eq!(e, TokenizeCallError::Timeout, "after {took:?}");
    assert!(took < Duration::from_millis(700), "gave up after {took:?}");
    h.join().unwrap();
}

#[test]
fn unreachable_and_invalid_url() {
    // A port that was just free: nothing listens on it.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = client(&format!("http://127.0.0.1:{port}"), 2000)
        .tokenize_prompt("m", "x")
        .unwrap_err();
    assert_eq!(e.kind(), "unreachable", "{e}");
    for bad in ["localhost:8000", "https://h", "ftp://h", "http://h?q=1"] {
        let e = TokenizeClient::new(bad, Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.kind(), "invalid_url", "{bad}");
    }
}
