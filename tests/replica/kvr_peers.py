#!/usr/bin/env python3
"""Two `kvr serve` replicas syncing bookings, one of them killed and restarted.

A and B each publish their bookings and apply the other's. The test checks that A's
bookings show in B's `/loads` and go when B's own `DELETE` frees them; that when A is
killed (SIGKILL: no free is ever sent), B drops A's bookings once A's link has been down
for `--replica-sync-peer-timeout-secs` instead of keeping phantoms for 300 s; that a
restarted A is heard again; and that when A restarts within the bound (its link barely
down), its old bookings go as soon as it speaks with its new router id. `--negative`
runs B with the timeout off (0, Dynamo's behaviour): the phantom check must fail.

  python3 tests/replica/kvr_peers.py --kvr-bin target/release/kvr
"""

import argparse
import os
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "compat"))
from harness import Service, free_port, http  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from checks import StopChecks, check, finish  # noqa: E402

MODEL = "m"
BS = 16


def requests_on(base, worker):
    st, body, _ = http(base, "GET", "/loads")
    assert st == 200, (st, body)
    return sum(l["active_requests"] for p in body for l in p["loads"] if l["worker_id"] == worker)


def wait_requests(base, worker, want, timeout):
    deadline = time.time() + timeout
    got = None
    while time.time() < deadline:
        got = requests_on(base, worker)
        if got == want:
            return got
        time.sleep(0.05)
    return got


def wait_subscribed(base, timeout=15):
    """Until a peer is subscribed to this replica's publisher (messages before that are
    lost, as with any PUB/SUB)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        st, body, _ = http(base, "GET", "/metrics")
        text = body.get("<text>", "") if isinstance(body, dict) else ""
        if 'kvr_replica_sync_peers{side="publisher"} 1' in text:
            return True
        time.sleep(0.05)
    return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvr-bin", required=True)
    ap.add_argument("--negative", action="store_true")
    args = ap.parse_args()
    log_dir = tempfile.mkdtemp(prefix="kvr-replica-peers-")
    ha, hb, sa, sb = (free_port() for _ in range(4))
    timeout = 0 if args.negative else 2
    os.environ["DYN_ROUTER_USE_KV_EVENTS"] = "false"

    def start_a(n):
        return Service([args.kvr_bin, "serve", "--port", str(ha), "--replica-sync-port", str(sa),
                        "--replica-sync-peers", f"tcp://127.0.0.1:{sb}"], f"a{n}", log_dir)

    b = Service([args.kvr_bin, "serve", "--port", str(hb), "--replica-sync-port", str(sb),
                 "--replica-sync-peers", f"tcp://127.0.0.1:{sa}",
                 "--replica-sync-peer-timeout-secs", str(timeout)], "b", log_dir)
    a = start_a(0)
    ab, bb = f"http://127.0.0.1:{ha}", f"http://127.0.0.1:{hb}"
    workers = [{"worker_id": w, "model_name": MODEL, "endpoint": f"http://w{w}.invalid",
                "block_size": BS, "total_kv_blocks": 1000} for w in (1, 2)]

    def register(base):
        for w in workers:
            st, resp, _ = http(base, "POST", "/workers", w)
            assert st in (200, 201), (st, resp)

    def book(base, sid, worker=1):
        st, resp, _ = http(base, "POST", "/select_and_reserve", {
            "model_name": MODEL, "selection_id": sid, "token_ids": list(range(1, 70)),
            "pinned_worker": {"worker_id": worker, "dp_rank": 0}})
        assert st == 200, (st, resp)

    try:
        a.wait_healthy(ab)
        b.wait_healthy(bb)
        register(ab)
        register(bb)
        assert wait_subscribed(ab), "B never subscribed to A"
        for i in range(3):
            book(ab, f"a-{i}")
        check(wait_requests(bb, 1, 3, 5) == 3, "A's three bookings show in B")
        st, _, _ = http(bb, "DELETE", "/reservations/a-0")
        check(st == 200 and wait_requests(ab, 1, 2, 5) == 2, "B frees one of A's; A sees it")
        # A dies without freeing anything.
        os.killpg(a.proc.pid, signal.SIGKILL)
        a.proc.wait()
        got = wait_requests(bb, 1, 0, 10)
        check(got == 0, f"B drops the dead peer's bookings after its link is down for {timeout} s: {got} left")
        if args.negative:
            raise StopChecks
        # A comes back (a new process, a new router id) and is heard again.
        a = start_a(1)
        a.wait_healthy(ab)
        register(ab)
        check(wait_subscribed(ab), "B subscribes to the restarted A")
        book(ab, "a-new", worker=2)
        check(wait_requests(bb, 2, 1, 5) == 1, "a restarted A's booking shows in B")
        # A restarted again at once: its link is down for less than the bound, and its
        # old booking goes when it first speaks with its new router id.
        a.stop()
        a = start_a(2)
        a.wait_healthy(ab)
        register(ab)
        check(wait_subscribed(ab), "B subscribes to A again")
        check(requests_on(bb, 2) == 1, "within the bound, B still holds the old booking")
        book(ab, "a-newer", worker=1)
        check(wait_requests(bb, 2, 0, 5) == 0, "the new router id drops the old process's booking")
        check(wait_requests(bb, 1, 1, 5) == 1, "and the new process's booking counts")
    except StopChecks:
        pass
    finally:
        a.stop()
        b.stop()
        print(f"logs: {log_dir}")
    finish(args.negative, 'kvr replicas: all checks passed',
           "B kept the dead peer's bookings with the timeout off, as it must",
           'the phantom check passed with the timeout off')


if __name__ == "__main__":
    main()
