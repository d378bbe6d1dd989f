#!/usr/bin/env python3
"""Two `kvr serve` replicas sharing bookings through NATS JetStream (`--replica-sync`),
with a replica and then the server killed (SIGKILL) and restarted.

The test keeps the truth (every live booking, which replica made it, on which worker)
and compares each replica's `/loads` with it, worker by worker (requests, and blocks
counted once when both replicas book the same prompt):

1. bookings and frees cross both ways; a prompt booked on both replicas counts its
   blocks once;
2. B is killed while it holds bookings and A keeps booking and freeing; B restarts under
   the same `--replica-name`: A drops B's old bookings as soon as B's new incarnation is
   heard (the heartbeat bound is long, so this is not the silence bound at work), and B
   reloads A's live bookings from the stream, those made while it was down included;
3. the NATS server (file storage) is killed and restarted while both replicas keep
   booking and freeing: afterwards both views equal the truth;
4. A is killed for good: B drops A's bookings after its heartbeat bound (3 s here);
5. on a small stream, a replica stopped (SIGSTOP) while the other books past the byte
   bound notices, when it resumes, that it fell behind the retention, and counts it once
   (the events are not repaired: no snapshot exists to reload from).

`--negative` runs the replicas with replay off (a test switch): the restarted B misses
A's bookings made before it started, and that check must fail (the run stops there).

Skips (exit 0, with the reason) when nats-server is not installed, unless
KVR_REQUIRE_NATS=1 (tests/run-all.sh sets it).

  python3 tests/replica/jetstream_peers.py --kvr-bin target/release/kvr
"""

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "compat"))
from harness import Service, free_port, http  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from checks import StopChecks, check, finish  # noqa: E402

MODEL = "m"
BS = 16
WORKERS = (1, 2, 3, 4)
SILENCE = 3  # the restarted B's heartbeat bound, seconds


class Truth:
    """The live bookings: selection id -> (replica, worker, prompt)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live = {}

    def add(self, sid, replica, worker, prompt):
        with self.lock:
            self.live[sid] = (replica, worker, prompt)

    def drop(self, sid):
        with self.lock:
            self.live.pop(sid, None)

    def drop_replica(self, replica):
        with self.lock:
            for sid in [s for s, v in self.live.items() if v[0] == replica]:
                del self.live[sid]

    def of(self, replica):
        with self.lock:
            return [s for s, v in self.live.items() if v[0] == replica]

    def requests(self):
        with self.lock:
            out = {w: 0 for w in WORKERS}
            for _, w, _ in self.live.values():
                out[w] += 1
            return out


def view(base):
    """Active requests and blocks per worker, as `base` sees them."""
    st, body, _ = http(base, "GET", "/loads")
    assert st == 200, (st, body)
    req = {w: 0 for w in WORKERS}
    blocks = {w: 0 for w in WORKERS}
    for p in body:
        for l in p["loads"]:
            req[l["worker_id"]] += l["active_requests"]
            blocks[l["worker_id"]] += l["potential_decode_blocks"]
    return req, blocks


def wait_view(bases, want, timeout):
    """Until every replica's request counts equal `want()`; the last views seen."""
    deadline = time.time() + timeout
    got = {}
    while time.time() < deadline:
        w = want()
        got = {b: view(b)[0] for b in bases}
        if all(g == w for g in got.values()):
            return True, got, w
        time.sleep(0.1)
    return False, got, want()


def metric(base, name):
    st, body, _ = http(base, "GET", "/metrics")
    text = body.get("<text>", "") if isinstance(body, dict) else ""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvr-bin", required=True)
    ap.add_argument("--nats-server", default=shutil.which("nats-server") or "/usr/sbin/nats-server")
    ap.add_argument("--negative", action="store_true")
    ap.add_argument("--outage-secs", type=float, default=8.0,
                    help="how long the server stays down (over the client's 5 s publish "
                         "acknowledgement timeout: publishes are retried)")
    args = ap.parse_args()
    if not os.path.exists(args.nats_server):
        if os.environ.get("KVR_REQUIRE_NATS") == "1":
            raise SystemExit("nats-server not found and KVR_REQUIRE_NATS=1 (apt-get install nats-server)")
        print("SKIP jetstream_peers: nats-server not installed (apt-get install nats-server)")
        return
    log_dir = tempfile.mkdtemp(prefix="kvr-replica-jetstream-")
    store = os.path.join(log_dir, "jetstream")
    np_, ha, hb = free_port(), free_port(), free_port()
    url = f"nats://127.0.0.1:{np_}"
    os.environ["DYN_ROUTER_USE_KV_EVENTS"] = "false"
    rng = random.Random(7)
    truth = Truth()
    ab, bb = f"http://127.0.0.1:{ha}", f"http://127.0.0.1:{hb}"
    bases = {"a": ab, "b": bb}
    counter = [0]

    def nats(n):
        p = Service([args.nats_server, "-js", "-sd", store, "-a", "127.0.0.1", "-p", str(np_)],
                    f"nats{n}", log_dir)
        deadline = time.time() + 10
        import socket
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", np_), timeout=0.5).close()
                return p
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nats-server did not start")

    def replica(name, port, n, heartbeat_bound=120, extra=()):
        argv = [args.kvr_bin, "serve", "--port", str(port), "--replica-sync", url,
                "--replica-name", name, "--replica-sync-heartbeat-timeout-secs", str(heartbeat_bound),
                *extra]
        if args.negative:
            argv.append("--replica-sync-test-no-replay")
        s = Service(argv, f"{name}{n}", log_dir)
        s.wait_healthy(bases[name])
        for w in WORKERS:
            st, resp, _ = http(bases[name], "POST", "/workers", {
                "worker_id": w, "model_name": MODEL, "endpoint": f"http://w{w}.invalid",
                "block_size": BS, "total_kv_blocks": 100000})
            assert st in (200, 201), (st, resp)
        return s

    def book(name, worker=None, prompt=None):
        counter[0] += 1
        sid = f"{name}-{counter[0]}"
        worker = worker or rng.choice(WORKERS)
        prompt = prompt if prompt is not None else rng.randrange(1 << 20)
        tokens = [prompt * 100 + i for i in range(1, 70)]
        st, resp, _ = http(bases[name], "POST", "/select_and_reserve", {
            "model_name": MODEL, "selection_id": sid, "token_ids": tokens,
            "pinned_worker": {"worker_id": worker, "dp_rank": 0}})
        assert st == 200, (st, resp)
        truth.add(sid, name, worker, prompt)
        return sid

    def free(base, sid):
        st, resp, _ = http(base, "DELETE", f"/reservations/{sid}")
        assert st == 200, (st, resp, sid)
        truth.drop(sid)

    server = nats(0)
    a = b = c = d = None
    try:
        a = replica("a", ha, 0)
        b = replica("b", hb, 0)
        # 1. Bookings and frees cross.
        for _ in range(6):
            book("a")
            book("b")
        ok, got, want = wait_view([ab, bb], truth.requests, 10)
        check(ok, f"both replicas see both replicas' bookings: {got} want {want}")
        free(bb, truth.of("a")[0])
        free(ab, truth.of("b")[0])
        ok, got, want = wait_view([ab, bb], truth.requests, 10)
        check(ok, f"frees of the other's bookings cross both ways: {got} want {want}")
        before = {x: view(x)[1][1] for x in (ab, bb)}
        s1 = book("a", worker=1, prompt=424242)
        s2 = book("b", worker=1, prompt=424242)
        ok, got, want = wait_view([ab, bb], truth.requests, 10)
        after = {x: view(x)[1][1] for x in (ab, bb)}
        grew = {x: after[x] - before[x] for x in (ab, bb)}
        check(ok and grew[ab] == grew[bb] == 4,
              f"one prompt booked on both replicas counts its 4 blocks once on each: {grew}")
        free(ab, s1)
        free(bb, s2)

        # 2. B dies holding bookings; A goes on; B restarts under its name.
        for _ in range(3):
            book("b")
        ok, got, want = wait_view([ab, bb], truth.requests, 10)
        check(ok, f"before the kill both views agree: {got} want {want}")
        os.killpg(b.proc.pid, signal.SIGKILL)
        b.proc.wait()
        truth.drop_replica("b")  # its bookings died with it
        for _ in range(4):
            book("a")
        free(ab, truth.of("a")[0])
        time.sleep(1)
        t0 = time.time()
        b = replica("b", hb, 1, heartbeat_bound=SILENCE)
        ok, got, want = wait_view([ab, bb], truth.requests, 15)
        check(ok, f"restarted B reloads A's live bookings and A drops B's old ones "
                  f"({time.time() - t0:.1f} s, heartbeat bound 120 s): {got} want {want}")
        if args.negative:
            raise StopChecks
        book("b")
        free(bb, truth.of("a")[0])
        ok, got, want = wait_view([ab, bb], truth.requests, 10)
        check(ok, f"the restarted B books and frees across again: {got} want {want}")

        # 3. The server dies and comes back while both replicas book and free.
        stop = threading.Event()
        errors = []

        def churn(name):
            r = random.Random(name)
            try:
                while not stop.is_set():
                    mine = truth.of(name)
                    if len(mine) > 8 and r.random() < 0.5:
                        free(bases[name], r.choice(mine))
                    else:
                        book(name)
                    time.sleep(0.02)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{name}: {e!r}")

        threads = [threading.Thread(target=churn, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        time.sleep(1.5)
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        server.log.close()
        booked_before = counter[0]
        time.sleep(args.outage_secs)
        print(f"     {counter[0] - booked_before} bookings made while the server was down", flush=True)
        server = nats(1)
        time.sleep(2)
        stop.set()
        for t in threads:
            t.join()
        check(not errors, f"the replicas kept serving while the server was down: {errors}")
        ok, got, want = wait_view([ab, bb], truth.requests, 30)
        check(ok, f"after the server's restart both views equal the live bookings "
                  f"({sum(want.values())} live): {got} want {want}")
        for name, base in bases.items():
            figures = {w: metric(base, f'kvr_replica_sync_jetstream_total{{what="{w}"}}')
                       for w in ("publish_retries", "deduplicated", "consumer_starts", "repeated",
                                 "gaps", "lost", "fell_behind")}
            print(f"     {name}: {figures}", flush=True)
        # Everything freed: nothing left anywhere.
        for sid, (name, _, _) in list(truth.live.items()):
            free(bases[name], sid)
        ok, got, want = wait_view([ab, bb], truth.requests, 10)
        check(ok, f"all freed: no phantom left: {got}")

        # 4. A dies for good: B drops A's bookings once A's heartbeats have been missing
        # for B's bound.
        for _ in range(3):
            book("a")
        ok, got, want = wait_view([ab, bb], truth.requests, 10)
        check(ok, f"A's last bookings show on both: {got}")
        os.killpg(a.proc.pid, signal.SIGKILL)
        a.proc.wait()
        t0 = time.time()
        truth.drop_replica("a")
        ok, got, want = wait_view([bb], truth.requests, SILENCE + 5)
        took = time.time() - t0
        check(ok and took >= SILENCE - 1.5,
              f"B drops the dead A's bookings after its {SILENCE} s heartbeat bound ({took:.1f} s): {got}")

        # 5. On a stream of 64 KiB, D is stopped (SIGSTOP) while C books 2000 times, so
        # the stream drops events D has not read: D must notice and count it.
        hc, hd = free_port(), free_port()
        bases["c"], bases["d"] = f"http://127.0.0.1:{hc}", f"http://127.0.0.1:{hd}"
        small = ["--replica-sync-stream", "KVR_SMALL", "--replica-sync-stream-max-bytes", "65536"]
        c = replica("c", hc, 0, extra=small)
        d = replica("d", hd, 0, extra=small)
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            # More than the consumer's outstanding pulls (500 a pull, a second one at
            # half) and the ~140 events 64 KiB holds.
            for _ in range(2000):
                book("c")
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        fell = 'kvr_replica_sync_jetstream_total{what="fell_behind"}'
        deadline = time.time() + 20
        while time.time() < deadline and not metric(bases["d"], fell):
            time.sleep(0.2)
        time.sleep(1)
        fd, fc = metric(bases["d"], fell), metric(bases["c"], fell)
        for n in ("c", "d"):
            figures = {w: metric(bases[n], f'kvr_replica_sync_jetstream_total{{what="{w}"}}')
                       for w in ("acked", "received", "consumer_starts", "fell_behind", "gaps", "lost")}
            print(f"     {n}: {figures}", flush=True)
        check(fd == 1 and fc == 0,
              f"the replica that fell behind the stream's retention counts it (d {fd}, c {fc})")
    except StopChecks:
        pass
    finally:
        for s in (a, b, c, d, server):
            if s is not None:
                s.stop()
        print(f"logs: {log_dir}")
    finish(args.negative, 'jetstream replicas: all checks passed',
           'without replay the views miss bookings, as they must',
           'every check passed with replay off')


if __name__ == "__main__":
    main()
