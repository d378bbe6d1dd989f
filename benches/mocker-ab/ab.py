#!/usr/bin/env python3
"""Live A/B of routers on Dynamo mocker workers: kvr serve vs Dynamo's KvRouter (and
round-robin), each run on freshly started workers (empty caches), same trace window.

    python ab.py smoke              # 2 workers, 30 requests, kvr and dynamo once each
    python ab.py full               # interleaved runs (default 3 of each router), medians

Run with the Python of a venv holding `ai-dynamo-runtime` 1.6.1. Every process this
starts (workers, kvr serve, the driver) gets its own session and is stopped (SIGTERM to
its process group, SIGKILL after 5 s) at the end of its run, on error and on Ctrl-C.
Results: <out-dir>/runs/<n>-<router>/requests.jsonl per run, <out-dir>/summary.json, and
the table printed at the end.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

LIVE = []  # Popen objects whose process groups are still to be stopped


def start(cmd, log_path, env=None):
    log = open(log_path, "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True)
    LIVE.append(p)
    return p


def stop(p):
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    # the group may hold children that outlived the leader
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if p in LIVE:
        LIVE.remove(p)


def stop_all(*_):
    for p in list(LIVE):
        stop(p)


def wait_for(pred, timeout, what, procs=()):
    deadline = time.time() + timeout
    while not pred():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: process exited with {p.returncode}")
        if time.time() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout} s")
        time.sleep(0.1)


def http_ok(url):
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def pct(xs, q):
    """Percentile q (0..100) with linear interpolation between closest ranks."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(path: Path) -> dict:
    recs = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    ok = [r for r in recs if "error" not in r]
    ttft = [r["ttft_ms"] for r in ok]
    itl = [r["itl_ms"] for r in ok if r.get("itl_ms") is not None]
    e2e = [r["e2e_ms"] for r in ok]
    route = [r["route_ms"] for r in ok if r.get("route_ms") is not None]
    send = [r["send_ms"] for r in ok if r.get("send_ms") is not None]
    dispatch = [r["dispatch_ms"] for r in ok if r.get("dispatch_ms") is not None]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    per_worker = {}
    for r in ok:
        per_worker[str(r.get("worker"))] = per_worker.get(str(r.get("worker")), 0) + 1
    return {
        "requests": len(recs), "errors": len(recs) - len(ok),
        "cached_reported": sum(1 for r in ok if r.get("cached_tokens") is not None),
        "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50), "e2e_p50": pct(e2e, 50), "e2e_p90": pct(e2e, 90),
        "route_p50": pct(route, 50), "send_p50": pct(send, 50),
        "dispatch_p50": pct(dispatch, 50),
        "late_max": max((r["late_ms"] for r in recs), default=0),
        "hit_rate": cached / prompt if prompt else float("nan"),
        "per_worker": per_worker,
    }


def one_run(a, n, router, out_dir: Path) -> dict:
    run_dir = out_dir / "runs" / f"{n:02d}-{router}"
    run_dir.mkdir(parents=True, exist_ok=True)
    # a fresh port range per run, so no run waits on a socket the previous one left
    zmq_base = a.zmq_port_base + (n % 8) * 200
    t0 = time.time()
    workers = start([a.python, str(HERE / "workers.py"), "--workers", str(a.workers),
                     "--run-dir", str(run_dir), "--zmq-port-base", str(zmq_base),
                     "--speedup-ratio", str(a.speedup_ratio),
                     "--num-gpu-blocks", str(a.num_gpu_blocks)],
                    run_dir / "workers.out")
    procs = [workers]
    try:
        wait_for(lambda: (run_dir / "endpoints.json").exists(), 90, "workers", [workers])
        cmd = [a.python, str(HERE / "driver.py"), "--endpoints", str(run_dir / "endpoints.json"),
               "--router", router, "--trace", a.trace, "--start", str(a.start),
               "--requests", str(a.requests), "--max-output", str(a.max_output),
               "--time-compression", str(a.time_compression),
               "--transport", a.transport,
               "--out", str(run_dir / "requests.jsonl")]
        if router == "kvr":
            port = a.kvr_port + n % 8
            kvr = start([a.kvr_bin, "serve", "--port", str(port)] + a.kvr_args,
                        run_dir / "kvr.log")
            procs.append(kvr)
            wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 20, "kvr serve", [kvr])
            cmd += ["--kvr-url", f"http://127.0.0.1:{port}"]
        driver = start(cmd, run_dir / "driver.log")
        procs.append(driver)
        try:
            driver.wait(timeout=a.run_timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"driver did not finish in {a.run_timeout} s")
        if driver.returncode != 0:
            tail = (run_dir / "driver.log").read_text()[-1500:]
            print(f"  driver exited {driver.returncode}; log tail:\n{tail}", file=sys.stderr)
        if router == "kvr":
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    (run_dir / "kvr-metrics.txt").write_bytes(r.read())
            except OSError:
                pass
    finally:
        for p in reversed(procs):
            stop(p)
    s = summarize(run_dir / "requests.jsonl")
    for line in (run_dir / "driver.log").read_text(errors="replace").splitlines():
        if line.startswith('{"router"'):
            try:
                s["driver"] = json.loads(line)
            except ValueError:
                pass
    s.update(router=router, run=n, seconds=round(time.time() - t0, 1))
    return s


COLS = [("ttft_p50", "TTFT p50 ms", 0), ("ttft_p90", "p90", 0), ("ttft_p99", "p99", 0),
        ("itl_p50", "ITL p50 ms", 1), ("e2e_p50", "E2E p50 ms", 0),
        ("hit_rate", "hit rate", 3), ("route_p50", "route p50 ms", 1),
        ("dispatch_p50", "dispatch p50 ms", 0)]


def fmt(v, d):
    return "nan" if v != v else f"{v:.{d}f}"


def print_table(rows, routers, spread):
    head = f"{'router':<12} {'runs':>4} {'err':>4} " + " ".join(f"{c[1]:>{20 if spread else 12}}" for c in COLS)
    print(head)
    for router in routers:
        rs = [r for r in rows if r["router"] == router]
        if not rs:
            continue
        cells = []
        for key, _, d in COLS:
            vals = [r[key] for r in rs if r[key] == r[key]]
            if not vals:
                cells.append(f"{'nan':>{20 if spread else 12}}")
                continue
            med = statistics.median(vals)
            if spread:
                cells.append(f"{fmt(med, d) + ' [' + fmt(min(vals), d) + '-' + fmt(max(vals), d) + ']':>20}")
            else:
                cells.append(f"{fmt(med, d):>12}")
        errs = sum(r["errors"] for r in rs)
        print(f"{router:<12} {len(rs):>4} {errs:>4} " + " ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["smoke", "full"])
    ap.add_argument("--routers", default=None,
                    help="comma-separated of kvr,dynamo,round-robin (smoke: kvr,dynamo; "
                         "full: all three)")
    ap.add_argument("--reps", type=int, default=None, help="runs per router (smoke 1, full 3)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=None, help="smoke 30, full 60")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--time-compression", type=float, default=1.0)
    ap.add_argument("--speedup-ratio", type=float, default=0.5)
    ap.add_argument("--num-gpu-blocks", type=int, default=16384)
    ap.add_argument("--trace", default=str(REPO / "tests" / "data" / "mooncake_conversation.jsonl"))
    ap.add_argument("--kvr-bin", default=os.environ.get("KVR_BIN", str(REPO / "target" / "release" / "kvr")))
    ap.add_argument("--kvr-arg", dest="kvr_args", action="append", default=[],
                    help="extra argument for kvr serve (repeatable)")
    ap.add_argument("--kvr-port", type=int, default=18092)
    ap.add_argument("--zmq-port-base", type=int, default=25600)
    ap.add_argument("--transport", choices=["router", "direct"], default="router",
                    help="send path for kvr and round-robin (see driver.py --help)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--run-timeout", type=float, default=120)
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args()
    smoke = a.mode == "smoke"
    routers = (a.routers or ("kvr,dynamo" if smoke else "kvr,dynamo,round-robin")).split(",")
    for r in routers:
        if r not in ("kvr", "dynamo", "round-robin"):
            ap.error(f"unknown router {r}")
    reps = a.reps or (1 if smoke else 3)
    a.requests = a.requests or (30 if smoke else 60)
    if a.workers > 4:
        ap.error("at most 4 workers (shared machine)")
    if not Path(a.kvr_bin).exists() and "kvr" in routers:
        ap.error(f"no kvr binary at {a.kvr_bin} (set --kvr-bin or KVR_BIN)")
    out_dir = Path(a.out_dir or f"/tmp/mocker-ab-{a.mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)

    signal.signal(signal.SIGTERM, lambda *_: (stop_all(), sys.exit(143)))
    # interleave: each rep runs every router, the order rotated so none always goes first
    schedule = []
    for rep in range(reps):
        k = rep % len(routers)
        schedule += routers[k:] + routers[:k]
    rows = []
    t0 = time.time()
    try:
        for n, router in enumerate(schedule):
            s = one_run(a, n, router, out_dir)
            rows.append(s)
            print(f"run {n} {router:<11} {s['seconds']:>5.1f}s  requests {s['requests']} "
                  f"errors {s['errors']}  TTFT p50 {fmt(s['ttft_p50'], 0)} ms p90 "
                  f"{fmt(s['ttft_p90'], 0)} ms  hit {fmt(s['hit_rate'], 3)}  "
                  f"per worker {s['per_worker']}", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        stop_all()
    config = {k: getattr(a, k) for k in ("workers", "requests", "start", "max_output",
                                         "time_compression", "speedup_ratio", "transport",
                                         "num_gpu_blocks", "trace", "kvr_args")}
    (out_dir / "summary.json").write_text(json.dumps(
        {"mode": a.mode, "config": config, "runs": rows}, indent=1))
    print(f"\n{a.mode}: {a.workers} mocker workers, trace lines {a.start + 1}-"
          f"{a.start + a.requests}, outputs capped at {a.max_output} tokens, mocker "
          f"speedup_ratio {a.speedup_ratio}, time compression {a.time_compression}; "
          f"{len(rows)} runs in {time.time() - t0:.0f} s; results in {out_dir}")
    if not smoke:
        print("medians over runs [min-max]")
    print_table(rows, routers, spread=not smoke)
    bad = sum(r["errors"] for r in rows) or len(rows) < len(schedule)
    # The routers' indexes must have followed the engines' KV events: the worker that
    # served the last request holds every complete block of its prompt.
    for r in rows:
        check = r.get("driver", {}).get("index_check", {})
        if r["router"] == "round-robin":
            continue
        # (JSON turned the worker keys into strings.)
        by_worker = {str(k): v for k, v in (check.get("device_blocks") or {}).items()}
        held = by_worker.get(str(check.get("served_by")))
        if held != check.get("prompt_blocks"):
            print(f"{r['router']}: its index does not show the last prompt on the worker "
                  f"that served it: {check}", file=sys.stderr)
            bad = True
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
