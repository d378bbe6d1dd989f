"""Warm restart of `kvr serve --state-dir` against the real vLLM (or SGLang) publisher.

Two engines (each its own real `ZmqEventPublisher`, replay buffer cut to BUFFER batches so
that their history is longer than what they can replay) publish stores and evictions
without pause. kvr serve is killed with SIGKILL at a random moment, the engines go on
while it is down, then hold still, and it is started again on the same state directory,
with no worker registered by the test (kvr registers the kept ones itself). After each
restart:

  * no answer of /overlap_scores may ever overcount what an engine holds (a rank whose
    stream has not yet proved it continues is stale: selection credits it nothing);
  * the answers must reach exactly what each engine holds: the blocks stored before the
    crash come back from the state directory (the engines cannot replay them: too old),
    those sent while kvr was down from the engines' replay buffers;
  * in `crash`, kvr runs with `--ready-min-exact-share 1`: /ready must wait until every
    stream caught up, so its first answers after ready are already exact.

Scenarios: `crash` (the SIGKILL loop, --kills N), `fence` (an engine restarted while kvr
was down: its old blocks must not come back, its new ones must), `graceful` (SIGTERM: a
final snapshot, nothing to replay from the journal), `unwritable` (a state directory that
cannot be created: kvr serve does not start, and says why).
--negative: the same crash with an empty state directory at each restart must NOT
converge (the engines' buffers cannot bring the old blocks back): the control that the
state directory is what restores them.

Usage: python warm_restart.py [--kvr-bin B] [--publisher vllm|sglang] [--kills N]
                              [--state-io auto|uring|plain] [--negative] [--seed S]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "compat"))
sys.path.insert(0, HERE)

from harness import free_port, http  # noqa: E402
from engines import BS, Check, Worker, flavor, log, overcounts, overlap, prompt  # noqa: E402

# Batches each engine can replay: fewer than its history (3 s of load, ~40 batches/s per
# engine, and more at each kill), more than what a crash can leave out of the journal (it
# lags the index by its group commit, and by the disk's sync latency, which on a shared
# disk reaches a few hundred ms) plus what the engines send while kvr is down.
BUFFER = 64


class Kvr:
    """One `kvr serve` on a state directory; restarted on a new port each time."""

    def __init__(self, kvr_bin: str, state_dir: str, io: str, extra=()):
        self.bin, self.state_dir, self.io = kvr_bin, state_dir, io
        self.extra = list(extra)
        self.proc = None
        self.base = None
        self.logs = []

    def start(self, route: str = "/ready") -> float:
        """Starts it; returns the seconds until `route` answers 200 (/ready needs a
        worker: /health on a first start)."""
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        logf = tempfile.NamedTemporaryFile(prefix="kvr-warm-", suffix=".log", delete=False)
        self.logs.append(logf.name)
        t0 = time.time()
        self.proc = subprocess.Popen(
            [self.bin, "serve", "--port", str(port), "--state-dir", self.state_dir,
             "--state-io", self.io, "--kv-events-idle-probe-ms", "500"] + self.extra,
            stdout=logf, stderr=logf)
        deadline = t0 + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvr serve exited with {self.proc.returncode}; log {logf.name}")
            try:
                if http(self.base, "GET", route, timeout=2)[0] == 200:
                    return time.time() - t0
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"kvr serve: no 200 from {route} in 30 s; log {logf.name}\n"
                           + self.diagnosis())

    def diagnosis(self) -> str:
        """What /ready says and the per-stream health lines, for a start that timed out."""
        out = []
        try:
            status, body = http(self.base, "GET", "/ready", timeout=2)
            out.append(f"/ready {status}: {json.dumps(body)[:2000]}")
            text = http(self.base, "GET", "/metrics", timeout=2)[1]["<text>"]
            out += [line for line in text.splitlines()
                    if line.startswith(("kvr_kv_stream", "kvr_ready", "kvr_state", "kvr_index_"))
                    and "bucket" not in line][:120]
        except OSError as e:
            out.append(f"(no diagnosis: {e})")
        return "\n".join(out)

    def kill(self, sig=signal.SIGKILL) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=30)

    def metric(self, name: str) -> float:
        text = http(self.base, "GET", "/metrics")[1]["<text>"]
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


class Load:
    """Publishes without pause on every rank: a new prompt stored, or an older one's tail
    evicted, until paused. The truth (each Rank's `held`) changes under `lock`."""

    def __init__(self, workers, rng: random.Random):
        self.workers, self.rng = workers, rng
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.stop = False
        self.live = collections.defaultdict(list)  # rank -> prompts stored, oldest first
        self.stored = []  # every prompt stored (the check's probes)
        self.next_prompt = 1000
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def step(self) -> None:
        w = self.rng.choice(self.workers)
        r = w.ranks[0]
        mine = self.live[(w.worker_id, 0)]
        with self.lock:
            if mine and (len(mine) > 12 or self.rng.random() < 0.35):
                p = mine.pop(0) if self.rng.random() < 0.7 else mine.pop()
                r.publish([r.removed(p, self.rng.randrange(0, len(p) // BS))])
            else:
                # Shared heads across prompts (prefix sharing), own tails.
                head = prompt(500 + 100 * self.rng.randrange(4), 2)
                p = head + prompt(self.next_prompt, self.rng.randrange(1, 4))
                self.next_prompt += 100
                mine.append(p)
                self.stored.append(p)
                r.publish([r.stored(p)])

    def run(self) -> None:
        while not self.stop:
            if not self.running.wait(0.1):
                continue
            self.step()
            time.sleep(0.01)

    def prompts(self) -> list:
        """Every prompt stored so far, evicted or not (the check's probes)."""
        return list(self.stored)

    def pause(self) -> None:
        self.running.clear()
        with self.lock:  # the step in flight is over
            pass


def converge(kvr: Kvr, workers, prompts, timeout: float) -> tuple[bool, list, list]:
    """Samples until the answers equal the truth: (converged, overcounts seen, last
    mismatches)."""
    check = Check(None, timeout, query=lambda p: overlap(kvr.base, p))
    deadline = time.time() + timeout
    over_seen = []
    while True:
        bad = check.mismatches(workers, prompts)
        over_seen += [b for b in bad if overcounts(b[3], b[4])]
        if not bad:
            return True, over_seen, []
        if time.time() > deadline:
            return False, over_seen, bad
        time.sleep(0.05)


def make_workers(fl, n: int, first_id: int):
    ws = [Worker(fl, first_id + i) for i in range(n)]
    for w in ws:
        for r in w.ranks:
            r.pub._buffer = collections.deque(r.pub._buffer, maxlen=BUFFER)
    return ws


def crash(args, fl, rng, negative: bool) -> bool:
    state = tempfile.mkdtemp(prefix="kvr-warm-state-")
    # /ready waits until every stream is exact: its first answer after ready must be.
    kvr = Kvr(args.kvr_bin, state, args.state_io, ["--ready-min-exact-share", str(args.ready_share)])
    workers = make_workers(fl, 2, 201)
    load = Load(workers, rng)
    ok = True
    ready_times = []
    try:
        kvr.start("/health")
        for w in workers:
            w.register(kvr.base)
        time.sleep(1.0)  # the SUBs connect
        load.running.set()
        time.sleep(3.0)  # a history longer than the engines' buffers
        for k in range(args.kills):
            time.sleep(rng.uniform(0.1, 1.2))
            kvr.kill()
            # The engines go on while kvr is down (fewer batches than their buffers),
            # then hold still: every answer after the restart is checked against a
            # truth that does not move.
            time.sleep(rng.uniform(0.0, 0.08))
            load.pause()
            if negative:
                shutil.rmtree(state)
                os.makedirs(state)
            ready = kvr.start("/health" if negative else "/ready")
            if negative:
                for w in workers:
                    w.register(kvr.base)
            ready_times.append(ready)
            first = Check(None, 0, query=lambda p: overlap(kvr.base, p)).mismatches(
                workers, load.prompts())
            if first and not negative:
                log(f"crash {k + 1}: /ready said ready with every stream exact, yet the "
                    f"first answers differ from the engines: {first[:5]}")
                # Transient or not: the same questions again, and what kvr says of itself.
                for _ in range(3):
                    again = Check(None, 0, query=lambda p: overlap(kvr.base, p)).mismatches(
                        workers, load.prompts())
                    log(f"  asked again: {len(again)} differ {again[:3]}")
                    time.sleep(0.01)
                log("  " + kvr.diagnosis().replace("\n", "\n  "))
                ok = False
            conv, over, bad = converge(kvr, workers, load.prompts(), args.timeout)
            if over:
                log(f"crash {k + 1}: OVERCOUNT after the restart: {over[:5]}")
                ok = False
            if not conv:
                log(f"crash {k + 1}: did not converge: {bad[:5]}")
                ok = False
                if negative:
                    break
            else:
                log(f"crash {k + 1}/{args.kills}: ready in {ready:.3f} s, exact")
            if not ok and not negative:
                break
            load.running.set()
        if ready_times:
            s = sorted(ready_times)
            log(f"crash: {len(s)} restarts, time to ready median {s[len(s) // 2]:.3f} s, "
                f"max {s[-1]:.3f} s")
    finally:
        load.stop = True
        load.running.set()
        load.thread.join(timeout=5)
        if kvr.proc and kvr.proc.poll() is None:
            kvr.kill()
        for w in workers:
            w.close()
        if ok:
            shutil.rmtree(state, ignore_errors=True)
        else:
            log(f"state dir kept: {state}; kvr logs: {kvr.logs[-2:]}")
    return ok


def fence(args, fl, rng) -> bool:
    """An engine restarted while kvr was down: its restored blocks are not credited, then
    cleared; its new ones come in. The other engine's come back."""
    state = tempfile.mkdtemp(prefix="kvr-warm-state-")
    kvr = Kvr(args.kvr_bin, state, args.state_io)
    a, b = make_workers(fl, 2, 301)
    try:
        kvr.start("/health")
        for w in (a, b):
            w.register(kvr.base)
        time.sleep(1.0)
        ps = [prompt(40000 + 100 * i, 3) for i in range(BUFFER + 4)]
        for p in ps:
            a.ranks[0].publish([a.ranks[0].stored(p)])
            b.ranks[0].publish([b.ranks[0].stored(p)])
        conv, over, bad = converge(kvr, [a, b], ps, args.timeout)
        if not conv:
            log(f"fence (before): did not converge: {bad[:5]}")
            return False
        kvr.kill()
        a.ranks[0].restart()  # a new instance: empty cache, seq from 0
        for r in a.ranks:
            r.pub._buffer = collections.deque(r.pub._buffer, maxlen=BUFFER)
        q = prompt(49000, 4)
        a.ranks[0].publish([a.ranks[0].stored(q)])
        ready = kvr.start()
        conv, over, bad = converge(kvr, [a, b], ps + [q], args.timeout)
        log(f"fence: ready in {ready:.3f} s; converged {conv}; overcounts seen {len(over)}"
            + (f": {over[:3]}" if over else "") + (f"; left {bad[:3]}" if bad else ""))
        return conv and not over
    finally:
        if kvr.proc and kvr.proc.poll() is None:
            kvr.kill()
        for w in (a, b):
            w.close()
        shutil.rmtree(state, ignore_errors=True)


def graceful(args, fl, rng) -> bool:
    """SIGTERM: a final snapshot; the restart replays no journal record."""
    state = tempfile.mkdtemp(prefix="kvr-warm-state-")
    kvr = Kvr(args.kvr_bin, state, args.state_io)
    (a,) = make_workers(fl, 1, 401)
    try:
        kvr.start("/health")
        a.register(kvr.base)
        time.sleep(1.0)
        ps = [prompt(60000 + 100 * i, 3) for i in range(BUFFER + 4)]
        for p in ps:
            a.ranks[0].publish([a.ranks[0].stored(p)])
        a.ranks[0].publish([a.ranks[0].removed(ps[0], 1)])
        conv, _, bad = converge(kvr, [a], ps, args.timeout)
        if not conv:
            log(f"graceful (before): did not converge: {bad[:5]}")
            return False
        kvr.kill(signal.SIGTERM)
        ready = kvr.start()
        records = kvr.metric("kvr_state_restored_records")
        blocks = kvr.metric("kvr_state_restored_blocks")
        conv, over, bad = converge(kvr, [a], ps, args.timeout)
        log(f"graceful: ready in {ready:.3f} s, {blocks:.0f} blocks restored from the "
            f"snapshot, {records:.0f} journal records replayed; converged {conv}")
        return conv and not over and records == 0 and blocks > 0
    finally:
        if kvr.proc and kvr.proc.poll() is None:
            kvr.kill()
        a.close()
        shutil.rmtree(state, ignore_errors=True)


def unwritable(args, fl, rng) -> bool:
    """A state directory that cannot be created: kvr serve refuses to start, saying why."""
    tmp = tempfile.mkdtemp(prefix="kvr-warm-bad-")
    try:
        afile = os.path.join(tmp, "a-file")
        open(afile, "w").close()
        out = subprocess.run([args.kvr_bin, "serve", "--port", str(free_port()), "--state-dir",
                              os.path.join(afile, "state")], capture_output=True, text=True,
                             timeout=30)
        said = (out.stdout + out.stderr).strip().splitlines()
        log(f"unwritable: exit {out.returncode}: {said[-1] if said else ''}")
        return out.returncode != 0 and any("--state-dir" in line for line in said)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    ap.add_argument("--kvr-bin", default=os.environ.get("KVR_BIN", os.path.join(target, "release", "kvr")))
    ap.add_argument("--publisher", choices=["vllm", "sglang"], default="vllm")
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--state-io", choices=["auto", "uring", "plain"], default="auto")
    ap.add_argument("--timeout", type=float, default=15.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--negative", action="store_true")
    ap.add_argument("--ready-share", type=float, default=1.0,
                    help="--ready-min-exact-share for the crash scenario (0: /ready does not "
                         "wait, and its first answers may lag: a control for the check)")
    ap.add_argument("--only", action="append",
                    choices=["crash", "fence", "graceful", "unwritable"])
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    log(f"seed {seed}; publisher {args.publisher}; state I/O {args.state_io}")
    rng = random.Random(seed)
    fl = flavor(args.publisher)
    t0 = time.time()
    if args.negative:
        args.kills = 1
        args.timeout = min(args.timeout, 6.0)
        ok = crash(args, fl, rng, negative=True)
        if ok:
            log("negative control FAILED: an empty state directory converged")
            return 1
        log(f"negative control: with an empty state directory the old blocks stay lost, "
            f"as they must ({time.time() - t0:.0f} s)")
        return 0
    results = {}
    for name in args.only or ["unwritable", "graceful", "fence", "crash"]:
        fn = {"crash": lambda: crash(args, fl, rng, False), "fence": lambda: fence(args, fl, rng),
              "graceful": lambda: graceful(args, fl, rng),
              "unwritable": lambda: unwritable(args, fl, rng)}[name]
        log(f"== {name}")
        results[name] = fn()
        log(f"{name}: {'ok' if results[name] else 'FAILED'}")
    failed = [n for n, ok in results.items() if not ok]
    print(f"warm-restart: {len(results) - len(failed)} passed, {len(failed)} failed "
          f"({time.time() - t0:.0f} s, seed {seed})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
