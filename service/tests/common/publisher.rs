// A vLLM-style KV-event publisher in Python (tests/robustness_publisher.py) as a child,
// for the service tests that need a live one; `include!`d after common/robustness.rs.

fn python_ready() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import zmq, msgspec"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var("KVR_REQUIRE_PYZMQ").as_deref() != Ok("1"),
            "KVR_REQUIRE_PYZMQ=1 but python3 with pyzmq and msgspec is missing"
        );
        eprintln!("SKIPPED: python3 with pyzmq and msgspec not found (pip install pyzmq msgspec)");
    }
    ok
}

/// `tests/robustness_publisher.py` as a child: commands on stdin, answers on stdout.
struct Publisher {
    child: Child,
    stdin: std::process::ChildStdin,
    lines: mpsc::Receiver<String>,
    streamed: Arc<Mutex<u64>>,
}

impl Publisher {
    fn start(port: u16) -> Self {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/robustness_publisher.py");
        let mut child = Command::new("python3")
            .arg(script)
            .args([port.to_string(), "16".to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start python3");
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, rx) = mpsc::channel();
        let streamed = Arc::new(Mutex::new(0));
        let s = streamed.clone();
        std::thread::spawn(move || {
            for l in out.lines() {
                let Ok(l) = l else { break };
                if let Some(n) = l.strip_prefix("STREAMED ") {
                    *s.lock().unwrap() = n.trim().parse().unwrap_or(0);
                } else if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut p = Publisher {
            child,
            stdin,
            lines: rx,
            streamed,
        };
        assert_eq!(p.line(), "READY");
        p
    }

    fn line(&mut self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(15))
            .expect("a line from the publisher")
    }

    fn cmd(&mut self, c: &str) -> String {
        writeln!(self.stdin, "{c}").unwrap();
        self.stdin.flush().unwrap();
        self.line()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
