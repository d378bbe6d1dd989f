"""`kvr serve --indexer-peers` against a live peer, under load.

Three engine ranks (worker 1 with one DP rank, worker 2 with two), each vLLM 0.33.0's
real `ZmqEventPublisher` with its replay buffer (tests/compat/vllm_publisher.py), keep
storing new blocks and removing old ones. A peer A follows them: a `kvr serve`, or
Dynamo 1.6.1's real selection service (`python -m dynamo.select_service`, which serves
`/dump`). While the load runs, a new `kvr serve` B starts with
`--indexer-peers http://PROXY`, where PROXY fetches A's `/dump` at once and hands it over
only `--dump-delay` seconds later (a large dump on a slow link); the same workers
register on B at once, so their events arrive while the dump is on its way.

Checked:
  - B's `/ready` answers 503 until the dump was handed over, and 200 after;
  - B's answers never overcount while it catches up: `/overlap_scores` of prompts stored
    before (half of them removed before B started) is sampled all along, and back to
    back by three threads around the moment the dump is handed over (the engines go
    quiet then for `--quiet` s, so a joining stream hears no live batch); each rank's
    credited depth must be blocks it held at some time since B started. B's raw index
    (`/dump`) is sampled too: it must hold no such block once every stream is exact
    (while a stream still joins, its replay of older history shows there: reported);
  - once the load stops and B's streams have caught up, B's index is the publishers'
    truth, per (worker, rank), exactly: not a block more, not one less.

--negative is the control: B runs with KVR_TEST_APPLY_LIVE_DURING_RECOVERY=1 (its
streams apply live events while the dump is on its way, as before the hold existed), and
the check must fail: the older dump brings back blocks removed meanwhile.

Usage: python peers.py [--kvr-bin target/release/kvr] [--peer kvr|dynamo|all]
                       [--negative] [--dump-delay S]
(run with the compat venv's python: tests/compat/ensure-venv.sh prints it).
Exit 0 when every check passed (with --negative: when the check failed, as it must).
"""

from __future__ import annotations

import argparse
import http.server as httpserver
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "compat"))

from harness import Service, free_port, http, overlap_map  # noqa: E402
from vllm_publisher import WorkerPublisher, engine_hashes  # noqa: E402

BS = 16
MODEL = "m"
RANKS = [(1, 0), (2, 0), (2, 1)]
KEEP = 12  # sequences each rank holds; a store beyond removes its oldest
BASE = 4  # sequences each rank stores first and keeps


def log(msg: str):
    print(msg, flush=True)


class Load:
    """The publishers and the truth: every block each rank holds, and when each block was
    stored and removed (the time of the publish call)."""

    def __init__(self, seed: int, buffer_steps: int):
        self.rng = random.Random(seed)
        self.pubs = {1: WorkerPublisher(worker_id=1, dp_size=1, buffer_steps=buffer_steps),
                     2: WorkerPublisher(worker_id=2, dp_size=2, buffer_steps=buffer_steps)}
        self.lock = threading.Lock()
        self.held = {r: {} for r in RANKS}  # rank -> {seq id: (tokens, hashes)}, churned
        self.base = {r: set() for r in RANKS}  # rank -> hashes stored first, never removed
        self.published = {r: 0 for r in RANKS}  # batches per rank
        self.prompts = []  # every (rank, tokens, hashes) ever stored, for overlap queries
        self.stored_at = {}  # (rank, hash) -> t
        self.removed_at = {}  # (rank, hash) -> t
        self.next_token = itertools.count(1_000_000, 100 * BS)
        self.seq_ids = itertools.count()
        self.batches = 0
        self.stop = threading.Event()
        self.quiet = threading.Event()  # set: the engines publish nothing
        self.thread = None

    def workers(self) -> list[dict]:
        w1, w2 = self.pubs[1], self.pubs[2]
        return [
            {"worker_id": 1, "model_name": MODEL, "endpoint": "http://w1.invalid:8000",
             "kv_events_endpoint": w1.endpoint(0), "replay_endpoint": w1.replay_endpoint(0),
             "block_size": BS, "total_kv_blocks": 4096},
            {"worker_id": 2, "model_name": MODEL, "endpoint": "http://w2.invalid:8000",
             "kv_events_endpoints": w2.kv_events_endpoints(),
             "replay_endpoint": w2.replay_endpoint(0),
             "block_size": BS, "data_parallel_size": 2, "total_kv_blocks": 4096},
        ]

    def step(self, rank):
        worker, dp = rank
        pub = self.pubs[worker]
        held = self.held[rank]
        n = self.rng.randint(1, 4)
        start = next(self.next_token)
        toks = list(range(start, start + n * BS))
        hashes = engine_hashes(toks, BS)
        with self.lock:
            t = time.time()
            if self.rng.random() < 0.5 or not held:
                pub.store(dp, toks, BS)
                held[next(self.seq_ids)] = (toks, hashes)
                self.prompts.append((rank, toks, hashes))
                for h in hashes:
                    self.stored_at[(rank, h)] = t
            else:
                # Chained on a held sequence: its new blocks name its last as parent.
                sid = self.rng.choice(list(held))
                ptoks, phashes = held[sid]
                full = ptoks + toks
                fh = engine_hashes(full, BS)
                pub.store(dp, toks, BS, parent_tokens=ptoks)
                held[sid] = (full, fh)
                self.prompts.append((rank, full, fh))
                for h in fh[len(phashes):]:
                    self.stored_at[(rank, h)] = t
            self.batches += 1
            self.published[rank] += 1
            if len(held) > KEEP:
                sid = min(held)
                toks, hashes = held.pop(sid)
                pub.remove(dp, toks, BS)
                t = time.time()
                for h in hashes:
                    self.removed_at[(rank, h)] = t
                self.batches += 1
                self.published[rank] += 1

    def store_base(self):
        """A few sequences per rank stored first and never removed (a shared system prompt):
        once the replay buffer has moved past them, only a peer's dump can bring them."""
        for rank in RANKS:
            worker, dp = rank
            for _ in range(BASE):
                start = next(self.next_token)
                toks = list(range(start, start + 3 * BS))
                with self.lock:
                    self.pubs[worker].store(dp, toks, BS)
                    self.prompts.append((rank, toks, engine_hashes(toks, BS)))
                    t = time.time()
                    for h in engine_hashes(toks, BS):
                        self.base[rank].add(h)
                        self.stored_at[(rank, h)] = t
                    self.batches += 1
                    self.published[rank] += 1

    def run(self, period: float):
        ranks = itertools.cycle(RANKS)
        while not self.stop.is_set():
            if not self.quiet.is_set():
                self.step(next(ranks))
            time.sleep(period)

    def start(self, period: float = 0.004):
        self.thread = threading.Thread(target=self.run, args=(period,), daemon=True)
        self.thread.start()

    def halt(self):
        self.stop.set()
        if self.thread:
            self.thread.join()

    def truth(self) -> dict:
        with self.lock:
            return {r: self.base[r] | {h for _, hs in self.held[r].values() for h in hs}
                    for r in RANKS}

    def overcounts(self, seen: dict, t0: float, t_end: float) -> list[str]:
        """Blocks `seen` names that its rank never held between t0 and t_end."""
        bad = []
        with self.lock:
            for rank, hashes in seen.items():
                for h in hashes:
                    s = self.stored_at.get((rank, h))
                    r = self.removed_at.get((rank, h))
                    if s is None or s > t_end:
                        bad.append(f"{rank} {h:#x}: never stored there")
                    elif r is not None and r < t0:
                        bad.append(f"{rank} {h:#x}: removed {t0 - r:.2f}s before B started")
        return bad

    def held_between(self, rank, h, t0: float, t_end: float) -> bool:
        s, r = self.stored_at.get((rank, h)), self.removed_at.get((rank, h))
        return s is not None and s <= t_end and (r is None or r >= t0)

    def check_answer(self, rank, hashes, got: dict, t0: float, t_end: float) -> list[str]:
        bad = []
        with self.lock:
            for r, depth in got.items():
                if not depth:
                    continue
                if r != rank:
                    bad.append(f"{r} credited {depth} blocks of a prompt of {rank}")
                elif not all(self.held_between(rank, h, t0, t_end) for h in hashes[:depth]):
                    bad.append(f"{rank} credited {depth} blocks, not all held since B started")
        return bad

    def recent_ghosts(self, t0: float, per_rank: int = 30) -> list:
        """Per rank, the prompts removed last before t0: still in the replay buffer, so a
        join replays their store and, a little later, their removal."""
        out = []
        with self.lock:
            for rank in RANKS:
                gone = [p for p in self.prompts if p[0] == rank
                        and self.removed_at.get((rank, p[2][-1]), t0) < t0]
                out += gone[-per_rank:]
        return out

    def overlap_overcounts(self, base: str, t0: float, n: int = 12) -> tuple[int, list[str]]:
        """B's answers: `/overlap_scores` of `n` prompts ever stored (half of them among
        those removed before t0, the blocks a replay of old history would bring back):
        each rank's reported depth must be blocks it held at some time since t0."""
        with self.lock:
            gone = [p for p in self.prompts
                    if (p[0], p[2][-1]) in self.removed_at and self.removed_at[(p[0], p[2][-1])] < t0]
            pick = self.rng.sample(gone, min(len(gone), n // 2))
            pick += self.rng.sample(self.prompts, min(len(self.prompts), n - len(pick)))
        bad = []
        for rank, toks, hashes in pick:
            got = overlap_map(base, toks, MODEL) or {}
            bad += self.check_answer(rank, hashes, got, t0, time.time())
        return len(pick), bad

    def close(self):
        for p in self.pubs.values():
            p.close()


def dump_sets(base: str) -> dict | None:
    st, body, _ = http(base, "GET", "/dump", timeout=10)
    if st != 200 or not isinstance(body, dict):
        return None
    out = {r: set() for r in RANKS}
    for part in body.values():
        for e in part.get("events", []):
            rank = (e["worker_id"], e["event"].get("dp_rank", 0))
            blocks = e["event"]["data"]["stored"]["blocks"]
            out.setdefault(rank, set()).update(b["block_hash"] for b in blocks)
    return out


def diff(got: dict, want: dict) -> list[str]:
    lines = []
    for rank in sorted(set(got) | set(want)):
        g, w = got.get(rank, set()), want.get(rank, set())
        if g != w:
            lines.append(f"{rank}: {len(g - w)} more ({len(g)} held), {len(w - g)} fewer "
                         f"({len(w)} truth)")
    return lines


class DelayedDump:
    """An HTTP proxy for A whose `/dump` is fetched from A at once and answered `delay`
    seconds later (other paths: forwarded)."""

    def __init__(self, peer: str, delay: float, load: Load):
        self.fetched = self.delivered = None
        outer = self

        class Handler(httpserver.BaseHTTPRequestHandler):
            def do_GET(self):
                with urllib.request.urlopen(peer + self.path, timeout=30) as r:
                    body, status = r.read(), r.status
                if self.path == "/dump":
                    outer.fetched = time.time()
                    load.published_at_fetch = dict(load.published)
                    time.sleep(delay)
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                if self.path == "/dump":
                    outer.delivered = time.time()
                    load.published_at_delivery = dict(load.published)

            def log_message(self, *a):
                pass

        self.server = httpserver.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def register(base: str, load: Load, dynamo: bool = False):
    for w in load.workers():
        if dynamo and w.get("data_parallel_size", 1) > 1:
            # Dynamo takes a replay endpoint for one DP rank only (its peer A needs none:
            # it subscribes before the load starts).
            w = {k: v for k, v in w.items() if k != "replay_endpoint"}
        st, body, _ = http(base, "POST", "/workers", w)
        if st not in (200, 201):
            raise RuntimeError(f"{base} refused worker {w['worker_id']}: {st} {body}")


def run_one(peer: str, mode: str, args, log_dir: str) -> list[str]:
    """One run with peer A of kind `peer`; B recovers from it (`mode` "hold"), or applies
    live events during recovery ("no-hold", a control), or starts without
    `--indexer-peers` ("no-peers", a control). Returns the failures."""
    failures = []
    load = Load(seed=7, buffer_steps=args.buffer_steps)
    a = b = proxy = None
    tag = f"{peer}/{mode}"
    try:
        port = free_port()
        if peer == "kvr":
            argv = [args.kvr_bin, "serve", "--port", str(port)]
        else:
            argv = [sys.executable, "-m", "dynamo.select_service", "--port", str(port)]
        base_a = f"http://127.0.0.1:{port}"
        a = Service(argv, f"peer-A-{peer}-{mode}", log_dir)
        a.wait_healthy(base_a)
        register(base_a, load, dynamo=peer == "dynamo")
        for p in load.pubs.values():
            if not p.wait_subscribed(20):
                raise RuntimeError("A never subscribed to the publishers")
        load.store_base()
        load.start()
        time.sleep(args.warm)
        # On a slow machine the ranks publish fewer batches in that time: wait (a minute at
        # most) until each has published enough for the base blocks to leave its replay
        # buffer; the setup check below still fails a run where one has not.
        deadline = time.time() + 60
        while (any(load.published[r] <= args.buffer_steps + BASE for r in RANKS)
               and time.time() < deadline):
            time.sleep(0.05)
        log(f"[{tag}] A holds {sum(map(len, (dump_sets(base_a) or {}).values()))} blocks "
            f"after {load.batches} batches")

        proxy = DelayedDump(base_a, args.dump_delay, load)
        port_b = free_port()
        base_b = f"http://127.0.0.1:{port_b}"
        extra = [] if mode == "no-peers" else ["--indexer-peers", proxy.url]
        saved = os.environ.get("KVR_TEST_APPLY_LIVE_DURING_RECOVERY")
        if mode == "no-hold":
            os.environ["KVR_TEST_APPLY_LIVE_DURING_RECOVERY"] = "1"
        t0 = time.time()
        at_t0 = dict(load.published)
        try:
            b = Service([args.kvr_bin, "serve", "--port", str(port_b)] + extra,
                        f"recovering-B-{peer}-{mode}", log_dir)
        finally:
            if saved is None:
                os.environ.pop("KVR_TEST_APPLY_LIVE_DURING_RECOVERY", None)
        # The base blocks must be out of every replay buffer (only the dump has them).
        short = [r for r in RANKS if at_t0[r] <= args.buffer_steps + BASE]
        if short:
            failures.append(f"setup: ranks {short} published too few batches before B "
                            f"started for the base blocks to leave the replay buffer")
        b.wait_healthy(base_b)
        register(base_b, load)
        # The moment a stream joins (right after the dump) is when its replay of old
        # history runs: B's answers for the prompts removed last before it started are
        # asked back to back from just before the dump is handed over until 1 s after.
        ghosts = load.recent_ghosts(t0)
        hammered, over_answers = [], []

        def hammer(offset):
            while proxy.fetched is None or time.time() < proxy.fetched + args.dump_delay - 0.2:
                time.sleep(0.005)
            # The engines go quiet around the dump for `--quiet` s: a stream that joins
            # then hears no live batch, which would have marked its ranks stale itself.
            if offset == 0:
                load.quiet.set()
            stop_at = time.time() + 0.2 + args.quiet
            for rank, toks, hashes in itertools.cycle(ghosts[offset::3] or ghosts):
                if time.time() > stop_at:
                    return
                got = overlap_map(base_b, toks, MODEL) or {}
                bad = load.check_answer(rank, hashes, got, t0, time.time())
                hammered.append(bool(bad))
                if bad:
                    over_answers.append((time.time() - t0, bad))
                if offset == 0 and time.time() > stop_at - 0.05:
                    load.quiet.clear()

        hammer_threads = [threading.Thread(target=hammer, args=(i,), daemon=True)
                          for i in range(3)]
        if ghosts and mode != "no-peers":
            for t in hammer_threads:
                t.start()
        samples = ready_early = 0
        ready_after = None
        over, joining = [], []
        answers = 0
        end = t0 + args.dump_delay + args.after if mode == "no-peers" else None
        while True:
            now = time.time()
            if proxy.delivered is not None and end is None:
                end = proxy.delivered + args.after
            if end is not None and now > end:
                break
            if now - t0 > args.dump_delay + 30:
                failures.append("the dump was never fetched through the proxy")
                break
            st, body, _ = http(base_b, "GET", "/ready")
            t_ready = time.time()
            if proxy.delivered is None and st == 200:
                ready_early += 1
            if proxy.delivered is not None and st == 200 and ready_after is None:
                ready_after = t_ready - proxy.delivered
            t_s = time.time()
            seen = dump_sets(base_b)
            t_e = time.time()
            _, after, _ = http(base_b, "GET", "/ready")
            # A stream still joining (its replay of the publisher's buffer running) may
            # show blocks of the buffer's history; settled: every stream exact around it.
            settled = all(isinstance(x, dict) and not x.get("kv_event_sources")
                          for x in (body, after))
            if seen is not None:
                samples += 1
                bad = load.overcounts(seen, t0, t_e)
                if bad:
                    (over if settled else joining).append((t_s - t0, bad))
            n, bad = load.overlap_overcounts(base_b, t0)
            answers += n
            if bad:
                over_answers.append((time.time() - t0, bad))
            time.sleep(0.01)
        load.halt()
        for t in hammer_threads:
            if t.ident is not None:
                t.join()
        load.quiet.clear()
        answers += len(hammered)
        if proxy.fetched is not None:
            # What the streams must catch up on after the dump: it must still be buffered.
            behind = {r: load.published_at_delivery[r] - load.published_at_fetch[r]
                      for r in RANKS}
            log(f"[{tag}] dump fetched {proxy.fetched - t0:.2f}s after B started, handed "
                f"over {proxy.delivered - t0:.2f}s after; batches per rank meanwhile "
                f"{list(behind.values())} (replay buffer {args.buffer_steps})")
            if max(behind.values()) >= args.buffer_steps:
                failures.append("setup: the replay buffer no longer held what was published "
                                "while the dump was on its way")
        log(f"[{tag}] {load.batches} batches published; {samples} samples of B's index, "
            f"{answers} /overlap_scores answers checked")
        if mode != "no-peers":
            if ready_early:
                failures.append(f"/ready answered 200 {ready_early} times before the dump "
                                "was applied")
            if ready_after is None:
                failures.append("/ready never answered 200 after the dump was applied")
            else:
                log(f"[{tag}] /ready 503 until the dump, 200 {ready_after:.2f}s after it")
        if over:
            t, bad = over[0]
            failures.append(f"B overcounted in {len(over)} of {samples} samples while "
                            f"catching up; first at {t:.2f}s: {bad[:3]} ({len(bad)} blocks)")
        if over_answers:
            t, bad = over_answers[0]
            failures.append(f"B's /overlap_scores overcounted in {len(over_answers)} of "
                            f"{answers} samples; first at {t:.2f}s: {bad[:3]}")
        if joining:
            # A join replays the publisher's buffer from its first batch over what the
            # index holds, so the raw index shows that history until the replay ends (the
            # stream `recovering`); answers give the ranks no credit meanwhile (checked
            # above). Reported, not failed: see docs/service.md.
            t, bad = joining[0]
            log(f"[{tag}] raw index: {len(joining)} of {samples} samples, taken while a "
                f"stream was still joining, held blocks of the replayed history; first at "
                f"{t:.2f}s: {len(bad)} blocks")
        truth = load.truth()
        deadline = time.time() + args.converge
        got = None
        while time.time() < deadline:
            got = dump_sets(base_b)
            if got == truth:
                break
            time.sleep(0.1)
        d = diff(got or {}, truth)
        if d:
            failures.append("B's index after catching up differs from the publishers': "
                            + "; ".join(d))
        else:
            log(f"[{tag}] B's index equals the publishers' truth (blocks per rank: "
                + ", ".join(f"{r}: {len(truth[r])}" for r in RANKS) + ")")
        d = diff(dump_sets(base_a) or {}, truth)
        if d:
            log(f"[{tag}] note: A itself differs from the truth: {'; '.join(d)}")
    finally:
        load.halt()
        for s in (b, a):
            if s:
                s.stop()
        if proxy:
            proxy.close()
        load.close()
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvr-bin", default=os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "kvr"))
    ap.add_argument("--peer", choices=("kvr", "dynamo", "all"), default="all")
    ap.add_argument("--negative", action="store_true",
                    help="controls: B applying live events during recovery, and B without "
                         "--indexer-peers, must each fail")
    ap.add_argument("--dump-delay", type=float, default=1.0)
    ap.add_argument("--buffer-steps", type=int, default=300,
                    help="the publishers' replay buffer (batches per rank)")
    ap.add_argument("--warm", type=float, default=3.0, help="load before B starts (s)")
    ap.add_argument("--after", type=float, default=2.0, help="load after the dump (s)")
    ap.add_argument("--converge", type=float, default=10.0)
    ap.add_argument("--quiet", type=float, default=0.6,
                    help="engines publish nothing from 0.2 s before the dump for this long")
    ap.add_argument("--log-dir")
    args = ap.parse_args(argv)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvr-peers-")
    os.makedirs(log_dir, exist_ok=True)
    peers = ["kvr", "dynamo"] if args.peer == "all" else [args.peer]
    modes = ["no-hold", "no-peers"] if args.negative else ["hold"]
    results = {}
    for peer in peers:
        for mode in modes:
            f = run_one(peer, mode, args, log_dir)
            for line in f:
                log(f"[{peer}/{mode}]   {line}")
            results[(peer, mode)] = f
    log(f"logs in {log_dir}")
    if args.negative:
        # A control counts only if the setup held and the check itself failed.
        caught = {k: bool(f) and not any(x.startswith("setup:") for x in f)
                  for k, f in results.items()}
        for (peer, mode), c in caught.items():
            log(f"control {peer}/{mode}: " + ("failed, as it must" if c else "NOT caught"))
        ok = all(caught.values())
        log("peer recovery under load, negative controls: " + ("PASS" if ok else "FAIL"))
        return 0 if ok else 1
    ok = not any(results.values())
    log("peer recovery under load: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
