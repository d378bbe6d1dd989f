"""Process, HTTP and polling helpers of the gateway end-to-end test (e2e.py)."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

TIMEOUT = 60.0  # readiness and polls: generous, for a loaded 2-core machine


def log(msg):
    print(f"[gateway-e2e] {msg}", file=sys.stderr, flush=True)


def free_ports(n, pairs=0):
    """n distinct free loopback ports, then `pairs` bases of two consecutive free ports
    (a data-parallel pod's replay ports: rank r's is rank 0's plus r). Every port stays
    bound until all are chosen, so no two answers can name the same port."""
    held, ports, bases = [], [], []

    def hold(port):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            return None
        held.append(s)
        return s.getsockname()[1]

    try:
        for _ in range(n):
            ports.append(hold(0))
        for _ in range(pairs):
            for _ in range(100):
                a = hold(0)
                if hold(a + 1) is not None:
                    bases.append(a)
                    break
            else:
                raise RuntimeError("no two consecutive free ports")
    finally:
        for s in held:
            s.close()
    return (ports, bases) if pairs else ports


def poll(what, fn, timeout=TIMEOUT, every=0.1):
    """Calls fn until it returns a truthy value; raises after timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
            last = v
        except (OSError, http.client.HTTPException, ValueError) as e:
            last = e
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


class Response:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = {k.lower(): v for k, v in headers}
        self.body = body

    def json(self):
        return json.loads(self.body)


def request(port, method, path, body=None, headers=None, timeout=30.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        h = {"content-type": "application/json"}
        h.update(headers or {})
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        return Response(r.status, r.getheaders(), r.read())
    finally:
        conn.close()


class Proc:
    """A child process in its own process group, its output in a log file."""

    def __init__(self, name, argv, workdir, env=None):
        self.name = name
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.logf = open(self.log_path, "ab")
        self.argv = argv
        self.p = subprocess.Popen(
            argv, stdout=self.logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def alive(self):
        return self.p.poll() is None

    def stop(self, timeout=10.0):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.p.wait()
        self.logf.close()

    def tail(self, n=30):
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()
            return "\n".join(lines[-n:])
        except OSError:
            return ""


def words(seed, n):
    """n distinct-looking words (text the test tokenizer splits into many tokens)."""
    vocab = [
        "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
        "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
        "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu",
    ]
    return " ".join(f"{vocab[(seed * 7 + i * 3) % len(vocab)]}{seed}" for i in range(n))


def settle(what, send, ok, then=4, timeout=30.0):
    """Sends (send(i)) until ok(response), then `then` more that must all be ok; returns
    how many were sent before the first ok."""
    deadline = time.monotonic() + timeout
    i, last = 0, None
    while True:
        last = send(i)
        i += 1
        if ok(last):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout:.0f}s ({i} requests, last {last.status} {last.body[:200]!r})")
        time.sleep(0.05)
    early = i - 1
    for k in range(then):
        r = send(i + k)
        expect(ok(r), f"{what}: request {k + 2} of {then + 1} after it settled: {r.status} {r.body[:200]!r}")
    return early


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)
