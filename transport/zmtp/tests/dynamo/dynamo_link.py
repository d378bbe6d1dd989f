"""Manual check of kvr-zmtp against the real Dynamo 1.6.1 selection service.

Starts `python -m dynamo.select_service` with replica sync on, runs the `dynamo_link`
example (our Subscriber on Dynamo's PUB; our Publisher registered as Dynamo's peer), lets
both links sit idle with Dynamo's default heartbeats (PING every 5 s, drop after 15 s of
silence), then:
  1. books a request on Dynamo over HTTP and expects our Subscriber to receive it;
  2. publishes a booking from our Publisher and expects Dynamo's /loads to count it.
Exit status 0 only when both links stayed up (one handshake each, no disconnects) and both
directions delivered.

  cargo build --release -p kvr-zmtp --example dynamo_link
  ~/.cache/kvr/compat-venv/bin/python transport/zmtp/tests/dynamo/dynamo_link.py \
      --example target/release/examples/dynamo_link [--idle 30] [--negative]

--negative runs the example with --no-heartbeats (no PONG, no PING): the check must then
fail (Dynamo drops both links), which shows it can.
"""

import argparse
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

MODEL = "m"
BLOCK = 16
TOPIC = b"dynamo.slot-tracker.v1"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def http(base, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    return status, (json.loads(raw) if raw else None)


def msgpack(v):
    """The subset of MessagePack the booking envelope needs (as rmp_serde writes it)."""
    if v is None:
        return b"\xc0"
    if v is True:
        return b"\xc3"
    if v is False:
        return b"\xc2"
    if isinstance(v, int):
        if 0 <= v < 128:
            return bytes([v])
        if 0 <= v < 1 << 8:
            return b"\xcc" + bytes([v])
        if 0 <= v < 1 << 16:
            return b"\xcd" + struct.pack(">H", v)
        if 0 <= v < 1 << 32:
            return b"\xce" + struct.pack(">I", v)
        return b"\xcf" + struct.pack(">Q", v)
    if isinstance(v, str):
        b = v.encode()
        return (bytes([0xA0 | len(b)]) if len(b) < 32 else b"\xd9" + bytes([len(b)])) + b
    if isinstance(v, list):
        return bytes([0x90 | len(v)]) + b"".join(msgpack(x) for x in v)
    if isinstance(v, dict):
        return bytes([0x80 | len(v)]) + b"".join(msgpack(k) + msgpack(x) for k, x in v.items())
    raise TypeError(type(v))


class Example:
    def __init__(self, path, dynamo_pub, idle, extra):
        self.proc = subprocess.Popen([path, "--dynamo-pub", dynamo_pub, "--idle", str(idle)] + extra,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def line(self):
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("dynamo_link example exited")
        print(f"  example: {line.rstrip()}", flush=True)
        return line

    def cmd(self, text):
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.line()


def stat(line, side, field):
    m = re.search(side + r"=\w+Stats \{[^}]*\b" + field + r": (\d+)", line)
    return int(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--example", required=True)
    ap.add_argument("--idle", type=int, default=30)
    ap.add_argument("--negative", action="store_true")
    args = ap.parse_args()

    http_port, sync_port = free_port(), free_port()
    base = f"http://127.0.0.1:{http_port}"
    log = tempfile.NamedTemporaryFile(prefix="dynamo-", suffix=".log", delete=False)
    env = dict(os.environ, DYN_ROUTER_USE_KV_EVENTS="false", RUST_LOG="info")
    dyn = subprocess.Popen([sys.executable, "-m", "dynamo.select_service", "--port", str(http_port),
                            "--threads", "1", "--replica-sync-port", str(sync_port)],
                           stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    failures = []
    ex = None
    try:
        for _ in range(600):
            if dyn.poll() is not None:
                raise SystemExit(f"Dynamo exited {dyn.returncode}; log {log.name}")
            try:
                if http(base, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        print(f"Dynamo up: http {base}, replica PUB tcp://127.0.0.1:{sync_port}, log {log.name}")
        st, _ = http(base, "POST", "/workers", {
            "worker_id": 1, "model_name": MODEL, "endpoint": "http://w1.invalid:8000",
            "block_size": BLOCK, "total_kv_blocks": 1000})
        assert st in (200, 201), st

        extra = ["--no-heartbeats"] if args.negative else []
        ex = Example(args.example, f"tcp://127.0.0.1:{sync_port}", args.idle, extra)
        ours = ex.line().split()[1]
        st, body = http(base, "POST", "/replica_sync/register_peer", {"endpoint": f"tcp://{ours}"})
        print(f"register_peer tcp://{ours} -> {st} {body}")
        t0 = time.time()
        while True:
            line = ex.line()
            if line.startswith("idle-done"):
                break
        print(f"idle for {time.time() - t0:.1f} s")
        for side, field, ok in [
            ("sub", "connects", lambda v: v == 1), ("sub", "disconnects", lambda v: v == 0),
            ("sub", "connected", lambda v: v == 1), ("sub", "pings_answered", lambda v: v > 0),
            ("sub", "pongs_received", lambda v: v > 0),
            ("pub", "subscribers", lambda v: v == 1), ("pub", "accepted", lambda v: v == 1),
            ("pub", "disconnects", lambda v: v == 0), ("pub", "pongs_received", lambda v: v > 0),
            ("pub", "pings_answered", lambda v: v > 0),
        ] if not args.negative else [
            # Without heartbeats only the link's survival is checked.
            ("sub", "connects", lambda v: v == 1), ("sub", "disconnects", lambda v: v == 0),
            ("pub", "accepted", lambda v: v == 1), ("pub", "disconnects", lambda v: v == 0),
        ]:
            v = stat(line, side, field)
            if v is None or not ok(v):
                failures.append(f"after idle: {side}.{field} = {v}")

        # 1. Dynamo -> our Subscriber.
        sel = {"model_name": MODEL, "selection_id": "zmtp-probe-1",
               "token_ids": list(range(1, 2 * BLOCK + 3)),
               "pinned_worker": {"worker_id": 1, "dp_rank": 0}, "expected_output_tokens": 8}
        st, body = http(base, "POST", "/select_and_reserve", sel)
        print(f"select_and_reserve -> {st}")
        got = ex.cmd("recv 10")
        if not got.startswith(f"received topic={TOPIC.decode()}") or \
                b"zmtp-probe-1".hex() not in got:
            failures.append(f"Dynamo's booking not received: {got.strip()}")

        # 2. Our Publisher -> Dynamo.
        ev = {"model_name": MODEL, "routing_group": "default", "block_size": BLOCK,
              "event": {"request_id": "zmtp-probe-2", "worker": {"worker_id": 1, "dp_rank": 0},
                        "data": {"AddRequest": {"token_sequence": [11, 12, 13],
                                                "track_prefill_tokens": True,
                                                "expected_output_tokens": None,
                                                "prefill_load_hint": None}},
                        "router_id": 4711, "lora_name": None}}
        _, before = http(base, "GET", "/loads")
        ex.cmd(f"publish {TOPIC.hex()} {msgpack(ev).hex()}")
        time.sleep(1.0)
        _, after = http(base, "GET", "/loads")
        print(f"/loads before: {json.dumps(before[0]['loads'])}")
        print(f"/loads after:  {json.dumps(after[0]['loads'])}")
        if after[0]["loads"][0]["active_requests"] != before[0]["loads"][0]["active_requests"] + 1:
            failures.append("our booking did not reach Dynamo's /loads")
        ex.cmd("stats")
        ex.proc.stdin.write("quit\n")
        ex.proc.stdin.flush()
        ex.proc.wait(10)
    finally:
        if ex is not None and ex.proc.poll() is None:
            ex.proc.kill()
        if dyn.poll() is None:
            os.killpg(dyn.pid, signal.SIGTERM)
            try:
                dyn.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(dyn.pid, signal.SIGKILL)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("OK: both links stayed up through the idle period and delivered both ways")


if __name__ == "__main__":
    main()
