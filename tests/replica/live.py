#!/usr/bin/env python3
"""Router replicas, live on loopback: `kvr emulate` pods behind N `kvr serve` replicas.

A client spreads a conversational workload (sessions of turns, each turn resending the
conversation so far, every session opening with a shared system prompt) round robin over
the replicas. Each request goes through the booking lifecycle on its replica
(`select_and_reserve`, the request to the chosen pod, `prefill_complete` at the first
streamed token, `DELETE` at the end), as a router's frontend would. The pods report what
they had cached (`usage.prompt_tokens_details.cached_tokens`) and publish their KV events
to every replica.

Measured per configuration: the prompt-token hit rate (cached / prompt tokens, from the
pods), the load CoV across pods (standard deviation over mean of the requests in flight at
each pod, sampled every 20 ms while any is, averaged), the largest in-flight count on one
pod over the mean, the picks of a pod with more in flight than the least loaded one, the
raced picks (a pod another replica picked less than 5 ms before), and TTFT p50/p90.
Clients start 25 ms apart (`--stagger-ms`): with 0 they start at once and, as every request
takes about as long, stay in lockstep, so replicas choose at the same instants (the
selection race at its worst). Configurations are run interleaved, `--reps` times
each, the pods' caches reset between runs; medians with min-max.

  cargo build --release -p kvr-cli
  python3 tests/replica/live.py --configs 1:none,4:none,4:dynamo,4:jetstream --reps 5

A configuration is `replicas:sync[:router temperature[:split]]`, sync `none`, `dynamo` or
`jetstream` (a nats-server of its own per run); `split` gives each replica its own
`--replica-ordinal` (of `--replica-count` replicas), so they split ties differently.
"""

import argparse
import http.client as hc
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "compat"))
from harness import Service, free_port, http  # noqa: E402

MODEL = "m"
BS = 16


def workload(sessions, turns, system_tokens, turn_tokens, seed):
    """Each session's turns as token-id prompts (a turn resends the whole conversation)."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 50_000) for _ in range(system_tokens)]
    out = []
    for s in range(sessions):
        convo = list(system)
        seq = []
        for t in range(turns):
            convo = convo + [rng.randrange(1, 50_000) for _ in range(turn_tokens)]
            seq.append(list(convo))
            convo = convo + [rng.randrange(1, 50_000) for _ in range(16)]  # the reply
        out.append(seq)
    return out


class Pods:
    def __init__(self, kvr_bin, n, log_dir, prefill_ns, decode_ns, capacity):
        self.http = [free_port() for _ in range(n)]
        ev = []
        for _ in range(n):
            ev.append((free_port(), free_port()))
        self.events = ev
        specs = []
        for i in range(n):
            specs += ["--pod", f"name=pod-{i},http={self.http[i]},kv-events={ev[i][0]},replay={ev[i][1]}"]
        argv = [kvr_bin, "emulate", "--model", MODEL, "--block-size", str(BS),
                "--capacity-blocks", str(capacity), "--prefill-ns-per-token", str(prefill_ns),
                "--decode-ns-per-token", str(decode_ns), "--quiet"] + specs
        self.proc = Service(argv, "pods", log_dir)
        for p in self.http:
            self.proc.wait_healthy(f"http://127.0.0.1:{p}")

    def worker(self, i):
        return {"worker_id": i + 1, "model_name": MODEL, "block_size": BS,
                "endpoint": f"http://127.0.0.1:{self.http[i]}",
                "kv_events_endpoint": f"tcp://127.0.0.1:{self.events[i][0]}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.events[i][1]}",
                "total_kv_blocks": 1}

    def reset(self):
        for p in self.http:
            for _ in range(100):
                st, _, _ = http(f"http://127.0.0.1:{p}", "POST", "/reset_prefix_cache")
                if st == 200:
                    break
                time.sleep(0.05)


def start_nats(log_dir, tag):
    """A JetStream server of its own (a fresh store) for one run."""
    binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
    port = free_port()
    store = tempfile.mkdtemp(prefix="nats-", dir=log_dir)
    svc = Service([binary, "-js", "-sd", store, "-a", "127.0.0.1", "-p", str(port)], f"{tag}-nats", log_dir)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return svc, f"nats://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("nats-server did not start")


def start_replicas(kvr_bin, n, sync, log_dir, tag, temperature, split=False):
    ports = [free_port() for _ in range(n)]
    sync_ports = [free_port() for _ in range(n)]
    out = []
    nats = None
    if sync == "jetstream":
        nats, url = start_nats(log_dir, tag)
        out.append((nats, None))
    for i in range(n):
        argv = [kvr_bin, "serve", "--port", str(ports[i])]
        if temperature:
            argv += ["--router-temperature", str(temperature)]
        if split:
            argv += ["--replica-ordinal", str(i), "--replica-count", str(n)]
        if sync == "dynamo" and n > 1:
            peers = ",".join(f"tcp://127.0.0.1:{sync_ports[j]}" for j in range(n) if j != i)
            argv += ["--replica-sync-port", str(sync_ports[i]), "--replica-sync-peers", peers]
        if sync == "jetstream":
            argv += ["--replica-sync", url, "--replica-name", f"r{i}"]
        out.append((Service(argv, f"{tag}-r{i}", log_dir), f"http://127.0.0.1:{ports[i]}"))
    for svc, base in out:
        if base:
            svc.wait_healthy(base)
    return out


def run_one(replicas, pods, work, concurrency, max_tokens, stagger=0.0):
    bases = [b for _, b in replicas if b]
    flight = [0] * len(pods.http)
    lock = threading.Lock()
    results = []
    samples = []
    picks = []  # (time, replica, pod, whether the pod had more in flight than the least)
    done = threading.Event()
    # Sessions are worked through in turn order: each session's next turn is queued when
    # its previous turn ended.
    queue = [(s, 0) for s in range(len(work))]
    qlock = threading.Condition()
    rr = [0]
    remaining = [sum(len(t) for t in work)]

    def sampler():
        while not done.is_set():
            with lock:
                f = list(flight)
            m = sum(f) / len(f)
            if m > 0:
                sd = statistics.pstdev(f)
                samples.append((sd / m, max(f) / m))
            time.sleep(0.02)

    def one(s, t):
        prompt = work[s][t]
        with lock:
            r = rr[0] % len(bases)
            rr[0] += 1
        base = bases[r]
        st, d, _ = http(base, "POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": prompt})
        if st != 200:
            raise RuntimeError(f"select_and_reserve: {st} {d}")
        sid, pod = d["selection_id"], d["worker_id"] - 1
        with lock:
            picks.append((time.time(), r, pod, flight[pod] > min(flight)))
            flight[pod] += 1
        t0 = time.time()
        conn = hc.HTTPConnection("127.0.0.1", pods.http[pod], timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}), {"content-type": "application/json"})
        resp = conn.getresponse()
        ttft = None
        cached = None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            body = line[5:].strip()
            if body == "[DONE]":
                break
            if ttft is None:
                ttft = time.time() - t0
                http(base, "POST", f"/reservations/{sid}/prefill_complete")
            ev = json.loads(body)
            u = ev.get("usage")
            if u:
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        conn.close()
        http(base, "DELETE", f"/reservations/{sid}")
        with lock:
            flight[pod] -= 1
            results.append((len(prompt), cached or 0, ttft or 0.0))

    def worker(k):
        time.sleep(k * stagger)
        while True:
            with qlock:
                while not queue and remaining[0] > 0:
                    qlock.wait(0.1)
                if remaining[0] <= 0 and not queue:
                    return
                if not queue:
                    continue
                s, t = queue.pop(0)
            one(s, t)
            with qlock:
                remaining[0] -= 1
                if t + 1 < len(work[s]):
                    queue.append((s, t + 1))
                qlock.notify_all()

    smp = threading.Thread(target=sampler, daemon=True)
    smp.start()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    done.set()
    smp.join()
    prompt = sum(p for p, _, _ in results)
    cached = sum(c for _, c, _ in results)
    ttfts = sorted(t for _, _, t in results)
    left = 0
    for b in bases:
        st, loads, _ = http(b, "GET", "/loads")
        left += sum(l["active_requests"] for p in loads for l in p["loads"])
    return {
        "hit": cached / prompt,
        "above_min": sum(1 for p in picks if p[3]) / max(1, len(picks)),
        "race": race_fraction(picks, 0.005),
        "cov": statistics.mean(c for c, _ in samples) if samples else 0.0,
        "max_over_mean": statistics.mean(m for _, m in samples) if samples else 0.0,
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p90": ttfts[int(len(ttfts) * 0.9)],
        "requests": len(results),
        "bookings_left": left,
    }


def race_fraction(picks, window):
    """The share of picks that chose a pod another replica had picked less than `window`
    seconds before (with one replica: none)."""
    raced = 0
    for i, (t, r, pod, _) in enumerate(picks):
        j = i - 1
        while j >= 0 and t - picks[j][0] < window:
            if picks[j][1] != r and picks[j][2] == pod:
                raced += 1
                break
            j -= 1
    return raced / max(1, len(picks))


def main():
    ap = argparse.ArgumentParser()
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "target"))
    ap.add_argument("--kvr-bin", default=os.path.join(target, "release", "kvr"))
    ap.add_argument("--configs", default="1:none,4:none,4:dynamo")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--turn-tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prefill-ns", type=int, default=200_000)
    ap.add_argument("--decode-ns", type=int, default=4_000_000)
    ap.add_argument("--capacity-blocks", type=int, default=4096)
    ap.add_argument("--stagger-ms", type=float, default=25.0,
                    help="client k starts k times this late; 0: every client at once, and "
                         "since every request takes about as long, in lockstep ever after")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.environ["DYN_ROUTER_USE_KV_EVENTS"] = "true"
    log_dir = tempfile.mkdtemp(prefix="kvr-replica-live-")
    # replicas:sync[:temperature]
    configs = []
    for c in a.configs.split(","):
        f = c.split(":")
        configs.append((int(f[0]), f[1], float(f[2] or 0) if len(f) > 2 else 0.0,
                        len(f) > 3 and f[3] == "split"))
    pods = Pods(a.kvr_bin, a.pods, log_dir, a.prefill_ns, a.decode_ns, a.capacity_blocks)
    rows = {c: [] for c in configs}
    try:
        for rep in range(a.reps):
            for (n, sync, temp, split) in configs:
                pods.reset()
                reps = start_replicas(a.kvr_bin, n, sync, log_dir, f"{n}{sync}{rep}", temp, split)
                try:
                    for base in [b for _, b in reps if b]:
                        for i in range(a.pods):
                            w = pods.worker(i)
                            w["total_kv_blocks"] = a.capacity_blocks
                            st, body, _ = http(base, "POST", "/workers", w)
                            assert st in (200, 201), (st, body)
                    time.sleep(1.5)  # subscriptions and sync links up
                    work = workload(a.sessions, a.turns, a.system_tokens, a.turn_tokens, seed=1000 + rep)
                    r = run_one(reps, pods, work, a.concurrency, a.max_tokens, a.stagger_ms / 1e3)
                finally:
                    for svc, _ in reversed(reps):
                        svc.stop()
                rows[(n, sync, temp, split)].append(r)
                print(f"rep {rep} {n} replicas sync={sync} temperature={temp} split={split}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    finally:
        pods.proc.stop()
    def fmt(vals, scale=1.0, d=3):
        vals = sorted(v * scale for v in vals)
        return f"{statistics.median(vals):.{d}f} ({vals[0]:.{d}f}-{vals[-1]:.{d}f})"
    print()
    print("| replicas | sync | temperature | ties | hit rate | load CoV | max/mean in flight | picks above the least loaded | raced picks | TTFT p50 ms | TTFT p90 ms | bookings left |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (n, sync, temp, split), rs in rows.items():
        ties = "split" if split else "random"
        print(f"| {n} | {sync} | {temp:g} | {ties} | {fmt([r['hit'] for r in rs])} | {fmt([r['cov'] for r in rs])} | "
              f"{fmt([r['max_over_mean'] for r in rs], d=2)} | {fmt([r['above_min'] for r in rs])} | "
              f"{fmt([r['race'] for r in rs])} | {fmt([r['ttft_p50'] for r in rs], 1e3, 1)} | "
              f"{fmt([r['ttft_p90'] for r in rs], 1e3, 1)} | {max(r['bookings_left'] for r in rs)} |")
    if a.json:
        print(json.dumps({f"{n}:{s}:{t:g}" + (":split" if sp else ""): v
                          for (n, s, t, sp), v in rows.items()}))
    if any(r["bookings_left"] for rs in rows.values() for r in rs):
        raise SystemExit("bookings were left after a run")


if __name__ == "__main__":
    main()
