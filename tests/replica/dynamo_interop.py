#!/usr/bin/env python3
"""Replica sync between `kvr serve` and Dynamo 1.6.1's selection service, both directions.

Starts one `kvr serve` (K) and one `python -m dynamo.select_service` (D) on loopback, each
publishing its bookings on its own sync port and subscribed to the other's, with the same
workers registered on both (and one worker only on K). After an idle wait longer than the
ZMTP heartbeat timeout (the link must survive it), it books, completes prefills and frees
on each side and checks the other's `/loads` follows: peer bookings counted in the same
per-rank accounting (a prompt booked on both sides counts its blocks once, which needs the
same block hashes), frees and prefill completions of a peer's booking working from either
side, an id a peer booked refused locally with 409, a booking on a worker the peer lacks
ignored. The `/replica_sync/*` routes answer as Dynamo's do (status and body compared
with D's for the same calls).

Run with the compat venv's python (tests/compat/ensure-venv.sh):
  python tests/replica/dynamo_interop.py --kvr-bin target/release/kvr [--idle-secs 25]
`--negative` starts K without replica sync and expects the first check to fail.
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "compat"))
from harness import Service, free_port, http  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from checks import StopChecks, check, finish  # noqa: E402

MODEL = "m"
BS = 16


def load_of(base, worker, rank=0):
    st, body, _ = http(base, "GET", "/loads")
    assert st == 200, (st, body)
    for part in body:
        if part["model_name"] != MODEL:
            continue
        for l in part["loads"]:
            if l["worker_id"] == worker and l["dp_rank"] == rank:
                return (l["potential_prefill_tokens"], l["potential_decode_blocks"],
                        l["active_requests"])
    return (0, 0, 0)


def wait_load(base, worker, want, rank=0, timeout=5.0):
    deadline = time.time() + timeout
    got = None
    while time.time() < deadline:
        got = load_of(base, worker, rank)
        if got == want:
            return got
        time.sleep(0.05)
    return got


def post(base, path, body, want=200):
    st, resp, _ = http(base, "POST", path, body)
    if st != want:
        raise SystemExit(f"POST {base}{path} {json.dumps(body)} -> {st} {resp} (wanted {want})")
    return resp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvr-bin", required=True)
    ap.add_argument("--idle-secs", type=float, default=25.0,
                    help="wait this long idle before the checks (Dynamo's libzmq drops a "
                         "link whose heartbeats go unanswered after about 20 s)")
    ap.add_argument("--negative", action="store_true",
                    help="K without replica sync: the first check must fail")
    args = ap.parse_args()
    log_dir = tempfile.mkdtemp(prefix="kvr-replica-interop-")
    hk, hd, sk, sd = (free_port() for _ in range(4))
    k_sync, d_sync = f"tcp://127.0.0.1:{sk}", f"tcp://127.0.0.1:{sd}"
    os.environ["DYN_ROUTER_USE_KV_EVENTS"] = "false"
    k_argv = [args.kvr_bin, "serve", "--port", str(hk)]
    if not args.negative:
        k_argv += ["--replica-sync-port", str(sk), "--replica-sync-peers", d_sync]
    d_argv = [sys.executable, "-m", "dynamo.select_service", "--port", str(hd), "--threads", "1",
              "--replica-sync-port", str(sd), "--replica-sync-peers", k_sync]
    k = Service(k_argv, "kvr", log_dir)
    d = Service(d_argv, "dynamo", log_dir)
    kb, db = f"http://127.0.0.1:{hk}", f"http://127.0.0.1:{hd}"
    try:
        k.wait_healthy(kb)
        d.wait_healthy(db, timeout=120)
        w1 = {"worker_id": 1, "model_name": MODEL, "endpoint": "http://w1.invalid:8000",
              "block_size": BS, "total_kv_blocks": 1000}
        w7 = {"worker_id": 7, "model_name": MODEL, "endpoint": "http://w7.invalid:8000",
              "block_size": BS, "total_kv_blocks": 1000, "data_parallel_size": 2}
        w9 = {"worker_id": 9, "model_name": MODEL, "endpoint": "http://w9.invalid:8000",
              "block_size": BS, "total_kv_blocks": 1000}
        for base in (kb, db):
            for w in (w1, w7):
                st, resp, _ = http(base, "POST", "/workers", w)
                assert st in (200, 201), (base, st, resp)
        st, resp, _ = http(kb, "POST", "/workers", w9)
        assert st in (200, 201), (st, resp)
        print(f"idle {args.idle_secs:.0f} s (heartbeats must keep both links)", flush=True)
        time.sleep(max(args.idle_secs, 1.0))

        toks = list(range(1, 4 * BS + 6))  # 69 tokens: 4 full blocks
        def sel(sid, worker=1, rank=0):
            return {"model_name": MODEL, "selection_id": sid, "token_ids": toks,
                    "pinned_worker": {"worker_id": worker, "dp_rank": rank},
                    "expected_output_tokens": 32}

        # 1. kvr books: Dynamo counts it.
        post(kb, "/select_and_reserve", sel("k-1"))
        check(wait_load(db, 1, (69, 4, 1)) == (69, 4, 1),
              f"kvr's booking shows in Dynamo's /loads as (69, 4, 1): {load_of(db, 1)}")
        if args.negative:
            raise StopChecks
        # 2. Dynamo books the same prompt: both count its blocks once.
        post(db, "/select_and_reserve", sel("d-1"))
        check(wait_load(kb, 1, (138, 4, 2)) == (138, 4, 2),
              f"Dynamo's booking of the same prompt shows in kvr's /loads, blocks counted once: {load_of(kb, 1)}")
        check(load_of(db, 1) == (138, 4, 2), f"and in Dynamo's own: {load_of(db, 1)}")
        # 3. Prefill completions cross both ways.
        post(kb, "/reservations/k-1/prefill_complete", None)
        check(wait_load(db, 1, (69, 4, 2)) == (69, 4, 2),
              f"kvr's prefill completion reaches Dynamo: {load_of(db, 1)}")
        post(db, "/reservations/d-1/prefill_complete", None)
        check(wait_load(kb, 1, (0, 4, 2)) == (0, 4, 2),
              f"Dynamo's prefill completion reaches kvr: {load_of(kb, 1)}")
        # 4. A peer's booking freed from the other side.
        st, _, _ = http(kb, "DELETE", "/reservations/d-1")
        check(st == 200, f"kvr frees Dynamo's booking d-1: {st}")
        check(wait_load(db, 1, (0, 4, 1)) == (0, 4, 1),
              f"the free reaches Dynamo: {load_of(db, 1)}")
        st, _, _ = http(db, "DELETE", "/reservations/d-1")
        check(st == 404, f"Dynamo's own DELETE of d-1 is then 404: {st}")
        st, _, _ = http(db, "DELETE", "/reservations/k-1")
        check(st == 200, f"Dynamo frees kvr's booking k-1: {st}")
        check(wait_load(kb, 1, (0, 0, 0)) == (0, 0, 0),
              f"the free reaches kvr: {load_of(kb, 1)}")
        st, _, _ = http(kb, "DELETE", "/reservations/k-1")
        check(st == 404, f"kvr's own DELETE of k-1 is then 404: {st}")
        # 5. An id a peer booked is taken here (409 on both sides).
        post(db, "/select_and_reserve", sel("x-1", worker=7, rank=1))
        check(wait_load(kb, 7, (69, 4, 1), rank=1) == (69, 4, 1),
              f"Dynamo's booking on worker 7 rank 1 in kvr: {load_of(kb, 7, 1)}")
        st, resp, _ = http(kb, "POST", "/select_and_reserve", sel("x-1"))
        check(st == 409, f"kvr refuses a booking under the peer's id x-1 with 409: {st} {resp}")
        post(kb, "/select_and_reserve", sel("y-1"))
        # Dynamo can refuse the id only once the booking has reached it (its blocks and
        # request; the prefill tokens it counts depend on what it has seen before).
        deadline = time.time() + 5.0
        while load_of(db, 1)[1:] != (4, 1) and time.time() < deadline:
            time.sleep(0.02)
        check(load_of(db, 1)[1:] == (4, 1), f"kvr's booking y-1 reaches Dynamo: {load_of(db, 1)}")
        st, resp, _ = http(db, "POST", "/select_and_reserve", sel("y-1"))
        time.sleep(0.3)
        check(st == 409, f"Dynamo refuses kvr's id y-1 with 409: {st} {resp}")
        # 6. An explicit reservation (hashes given, no prefill) crosses with its hashes.
        post(kb, "/reservations", {"selection_id": "e-1", "model_name": MODEL, "worker_id": 7,
                                   "dp_rank": 0, "block_hashes": [11, 12], "sequence_hashes": [-1, 5],
                                   "isl_tokens": 2 * BS}, want=201)
        check(wait_load(db, 7, (0, 2, 1), rank=0) == (0, 2, 1),
              f"kvr's explicit reservation in Dynamo: {load_of(db, 7, 0)}")
        # 7. A worker the peer lacks: ignored there.
        post(kb, "/select_and_reserve", sel("w9-1", worker=9))
        time.sleep(0.5)
        check(load_of(db, 9) == (0, 0, 0), f"a booking on a worker Dynamo lacks is ignored: {load_of(db, 9)}")
        # 8. The routes answer as Dynamo's: same calls, same status and body.
        extra = f"tcp://127.0.0.1:{free_port()}"
        calls = [
            ("GET", "/replica_sync/peers", None),
            ("POST", "/replica_sync/register_peer", {"endpoint": extra}),
            ("POST", "/replica_sync/register_peer", {"endpoint": extra}),
            ("GET", "/replica_sync/peers", None),
            ("POST", "/replica_sync/deregister_peer", {"endpoint": extra}),
            ("POST", "/replica_sync/deregister_peer", {"endpoint": extra}),
            ("POST", "/replica_sync/register_peer", {"endpoint": "http://x:1"}),
            ("POST", "/replica_sync/register_peer", {"endpoint": ""}),
            ("POST", "/replica_sync/register_peer", {"endpoint": "tcp://nohost"}),
            ("POST", "/replica_sync/register_peer", {"endpoint": "tcp://h:99999"}),
            ("POST", "/replica_sync/register_peer", {}),
            ("POST", "/replica_sync/register_peer", {"endpoint": 5}),
            ("GET", "/replica_sync/register_peer", None),
        ]
        for method, path, body in calls:
            a = http(kb, method, path, body)[:2]
            b = http(db, method, path, body)[:2]
            if path == "/replica_sync/peers" and method == "GET":
                # Each lists its own peers: the other's sync endpoint (and the extra one).
                a = (a[0], [p for p in a[1] if p != d_sync])
                b = (b[0], [p for p in b[1] if p != k_sync])
            check(a == b, f"{method} {path} {json.dumps(body)}: kvr {a} dynamo {b}")
    except StopChecks:
        pass
    finally:
        k.stop()
        d.stop()
        print(f"logs: {log_dir}")
    finish(args.negative, 'replica sync interop: all checks passed',
           'the check failed without replica sync, as it must',
           'the check passed without replica sync')


if __name__ == "__main__":
    main()
