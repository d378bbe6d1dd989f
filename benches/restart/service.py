"""Time to ready and to an exact index after a restart, through `kvr serve` end to end.

The restart benchmark's service half (`restart-bench` measures the same steps in process).
Eight engine ranks, each vLLM's real `ZmqEventPublisher` (tests/compat/vllm_publisher.py)
with its replay buffer of the last `--buffer-steps` batches (vLLM's default 10,000), store
`--blocks` holder-blocks: every rank a 4-block system prompt, then sequences of 64 blocks
stored 4 blocks a batch (a prefill chunk), each chained on the system prompt. A `kvr serve`
A with `--state-dir` and Dynamo 1.6.1's selection service D follow them from the start.
Then the engines go quiet and, in turn, each rep:

  peer-kvr      a new `kvr serve` with `--indexer-peers A` (A's /dump);
  peer-dynamo   a new `kvr serve` with `--indexer-peers D` (Dynamo's /dump);
  dynamo-peer   a new Dynamo service with `--indexer-peers D` (Dynamo's own restart path);
  cold          a new `kvr serve` with neither: the engines' replay buffers only;
  state-uring   A killed (SIGKILL) and started again on its state directory, io_uring;
  state-plain   the same through pwrite/fdatasync.

For each: seconds from spawn until `/ready` answers 200 (kvr runs with
`--ready-min-exact-share 1`, so ready means every stream exact), and until the index is
the publishers' truth (kvr: `kvr_index_blocks` equals the holder-blocks stored, and, at
`--verify-max` holder-blocks or fewer, `/dump` equals the truth block for block; Dynamo:
`/overlap_scores` of a sample of sequences on every rank, whole). Workers register as soon
as `/health` answers (after a restart from a state directory they need not: workers.json).

Usage (the compat venv's python: tests/compat/ensure-venv.sh prints it):
  python benches/restart/service.py [--kvr-bin target/release/kvr] [--blocks 1000000]
        [--reps 3] [--only peer-kvr,state-uring,...] [--no-dynamo]
Prints a markdown table: medians over the reps with min-max.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "compat"))

from harness import free_port, http, overlap_map  # noqa: E402
from vllm_publisher import WorkerPublisher, engine_block_hash  # noqa: E402

BS = 16
MODEL = "m"
PROMPT_BLOCKS = 4  # the system prompt every rank holds
SEQ_BLOCKS = 64  # a sequence, stored CHUNK blocks a batch
CHUNK = 4
SCENARIOS = ("peer-kvr", "peer-dynamo", "dynamo-peer", "cold", "state-uring", "state-plain")


def log(msg: str) -> None:
    print(f"[restart] {msg}", file=sys.stderr, flush=True)


class Engines:
    """`ranks` single-rank workers and what they stored: a shared system prompt, then
    disjoint sequences. Keeps each rank's engine hashes when `keep` (for /dump checks)
    and a few sequences per rank to sample overlaps with."""

    def __init__(self, ranks: int, buffer_steps: int, keep: bool):
        self.pubs = [WorkerPublisher(worker_id=100 + r, buffer_steps=buffer_steps)
                     for r in range(ranks)]
        self.kv = self.pubs[0].kv
        self.system = list(range(1, PROMPT_BLOCKS * BS + 1))
        self.system_hashes = []
        parent = None
        for i in range(PROMPT_BLOCKS):
            parent = engine_block_hash(parent, self.system[i * BS:(i + 1) * BS])
            self.system_hashes.append(parent)
        self.next_token = 1_000
        self.truth = [set() for _ in range(ranks)] if keep else None
        self.held = [0] * ranks
        self.samples = [[] for _ in range(ranks)]  # whole sequences (token lists)
        self.batches = 0

    def workers(self) -> list[dict]:
        return [{"worker_id": p.worker_id, "model_name": MODEL,
                 "endpoint": f"http://w{p.worker_id}.invalid:8000",
                 "kv_events_endpoint": p.endpoint(0), "replay_endpoint": p.replay_endpoint(0),
                 "block_size": BS, "total_kv_blocks": 1 << 24} for p in self.pubs]

    def register(self, base: str) -> None:
        for w in self.workers():
            st, body, _ = http(base, "POST", "/workers", w)
            if st not in (200, 201):
                raise RuntimeError(f"{base} refused worker {w['worker_id']}: {st} {body}")

    def _stored(self, r: int, hashes: list[int], parent: int | None, tokens: list[int]):
        self.pubs[r]._publish(0, [self.kv.BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
            lora_id=None, medium="GPU", lora_name=None, extra_keys=[None] * len(hashes),
            group_idx=0, kv_cache_spec_kind="full_attention")])
        self.batches += 1
        self.held[r] += len(hashes)
        if self.truth is not None:
            self.truth[r].update(hashes)

    def store_system(self) -> None:
        for r in range(len(self.pubs)):
            self._stored(r, self.system_hashes, None, self.system)

    def store_sequence(self, r: int) -> None:
        """One sequence on rank r, CHUNK blocks a batch."""
        start = self.next_token
        self.next_token += SEQ_BLOCKS * BS
        toks = list(range(start, start + SEQ_BLOCKS * BS))
        parent = self.system_hashes[-1]
        for c in range(0, SEQ_BLOCKS, CHUNK):
            chunk = toks[c * BS:(c + CHUNK) * BS]
            hashes = []
            p = parent
            for i in range(CHUNK):
                p = engine_block_hash(p, chunk[i * BS:(i + 1) * BS])
                hashes.append(p)
            self._stored(r, hashes, parent, chunk)
            parent = hashes[-1]
        if len(self.samples[r]) < 64 or (self.held[r] // SEQ_BLOCKS) % 97 == 0:
            self.samples[r].append(toks)

    def sample_prompts(self) -> list[tuple[int, list[int]]]:
        """(rank, prompt) pairs: up to 8 sequences a rank, spread over its history."""
        out = []
        for r, seqs in enumerate(self.samples):
            step = max(1, len(seqs) // 8)
            out += [(r, self.system + s) for s in seqs[::step][:8]]
        return out

    def total(self) -> int:
        return sum(self.held)

    def close(self) -> None:
        for p in self.pubs:
            p.close()


class Proc:
    def __init__(self, argv: list[str], name: str, log_dir: str):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.logf = open(self.log_path, "ab")
        self.t0 = time.time()
        self.proc = subprocess.Popen(argv, stdout=self.logf, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log {self.log_path}")

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.logf.close()


def get(base: str, path: str, timeout: float = 5.0):
    try:
        return http(base, "GET", path, timeout=timeout)
    except OSError:
        return None, None, None


def wait_health(p: Proc, base: str, timeout: float) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        p.alive()
        if get(base, "/health", 1.0)[0] == 200:
            return time.time() - p.t0
        time.sleep(0.005)
    raise RuntimeError(f"{p.name}: no /health in {timeout} s; log {p.log_path}")


def metric(base: str, name: str) -> float | None:
    st, body, _ = get(base, "/metrics")
    if st != 200:
        return None
    total, seen = 0.0, False
    for line in body["<text>"].splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def dump_truth_diff(base: str, eng: Engines) -> str | None:
    """None when /dump holds exactly the truth, per rank; else what differs."""
    st, body, _ = http(base, "GET", "/dump", timeout=600)
    if st != 200 or not isinstance(body, dict):
        return f"/dump answered {st}"
    got = [set() for _ in eng.pubs]
    for part in body.values():
        for e in part.get("events", []):
            r = e["worker_id"] - 100
            for b in e["event"]["data"]["stored"]["blocks"]:
                got[r].add(b["block_hash"])
    bad = [f"rank {r}: {len(g - w)} more, {len(w - g)} fewer"
           for r, (g, w) in enumerate(zip(got, eng.truth)) if g != w]
    return "; ".join(bad) or None


def sampled_whole(base: str, eng: Engines, prompts) -> bool:
    for r, prompt in prompts:
        try:
            got = overlap_map(base, prompt) or {}
        except OSError:  # busy applying a dump: not whole yet
            return False
        if got.get((100 + r, 0)) != len(prompt) // BS:
            return False
    return True


def watch(p: Proc, base: str, eng: Engines, kvr: bool, register: bool, timeout: float,
          settle: float = 0.0) -> dict:
    """Spawned p: registers the workers when asked, then polls until ready and exact.
    Returns {ready, exact, blocks} (seconds from spawn; None when not reached)."""
    out = {"health": wait_health(p, base, timeout), "ready": None, "exact": None,
           "blocks": None}
    if register:
        eng.register(base)
    want = eng.total()
    prompts = eng.sample_prompts()
    deadline = p.t0 + timeout
    last, last_change = None, time.time()
    while time.time() < deadline:
        p.alive()
        now = time.time()
        if out["ready"] is None and get(base, "/ready", 2.0)[0] == 200:
            out["ready"] = now - p.t0
        if kvr:
            held = metric(base, "kvr_index_blocks")
            out["blocks"] = held
            if held == want and out["exact"] is None:
                out["exact"] = now - p.t0
            if held != last:
                last, last_change = held, now
        elif out["exact"] is None and sampled_whole(base, eng, prompts):
            out["exact"] = now - p.t0
        if out["ready"] is not None and out["exact"] is not None:
            break
        # Cold start: the index stops growing short of the truth; no use waiting. Dynamo
        # serves HTTP once its recovery has ended: whole within `settle` of that, or never.
        if settle and out["ready"] is not None and now - last_change > settle:
            break
        if settle and not kvr and out["ready"] is not None and now - p.t0 - out["ready"] > settle:
            break
        time.sleep(0.01)
    if kvr:
        # A cold start's replay brings chains whose heads are older than the buffer.
        out["parent_not_found"] = metric(base, "kvr_index_parent_not_found_total")
    return out


def kvr_argv(args, port: int, extra=()) -> list[str]:
    return [args.kvr_bin, "serve", "--port", str(port), "--ready-min-exact-share", "1",
            "--ready-wait-secs", str(int(args.timeout))] + list(extra)


def dynamo_argv(port: int, extra=()) -> list[str]:
    return [sys.executable, "-m", "dynamo.select_service", "--port", str(port)] + list(extra)


def populate(args, eng: Engines, bases: list[str]) -> None:
    """Stores the holder-blocks, pausing every few thousand batches until every follower
    shows each rank's newest sequence whole (a slow subscriber's socket would drop)."""
    eng.store_system()
    t0 = time.time()
    per_rank = (args.blocks - PROMPT_BLOCKS * len(eng.pubs)) // SEQ_BLOCKS // len(eng.pubs)
    last = [None] * len(eng.pubs)
    for k in range(per_rank):
        for r in range(len(eng.pubs)):
            eng.store_sequence(r)
            last[r] = eng.system + list(range(eng.next_token - SEQ_BLOCKS * BS, eng.next_token))
        if (k + 1) % 64 == 0 or k + 1 == per_rank:
            for base in bases:
                deadline = time.time() + 600
                while not all((overlap_map(base, last[r]) or {}).get((100 + r, 0))
                              == len(last[r]) // BS for r in range(len(eng.pubs))):
                    if time.time() > deadline:
                        raise RuntimeError(f"{base} never caught up with the engines")
                    time.sleep(0.02)
        if (k + 1) % 512 == 0:
            log(f"stored {eng.total():,} holder-blocks in {eng.batches:,} batches, "
                f"{time.time() - t0:.0f} s")
    log(f"stored {eng.total():,} holder-blocks in {eng.batches:,} batches, "
        f"{time.time() - t0:.0f} s")


def main(argv=None) -> int:
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvr-bin", default=os.path.join(target, "release", "kvr"))
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--verify-max", type=int, default=2_000_000,
                    help="check /dump block for block up to this many holder-blocks")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--only", default=",".join(SCENARIOS))
    ap.add_argument("--no-dynamo", action="store_true")
    args = ap.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    if args.no_dynamo:
        only = [s for s in only if "dynamo" not in s]
    log_dir = tempfile.mkdtemp(prefix="kvr-restart-bench-")
    state = os.path.join(log_dir, "state")
    eng = Engines(args.ranks, args.buffer_steps, keep=args.blocks <= args.verify_max)
    procs = []
    results = {s: [] for s in only}
    failures = []
    try:
        port_a = free_port()
        base_a = f"http://127.0.0.1:{port_a}"
        a = Proc(kvr_argv(args, port_a, ["--state-dir", state]), "A", log_dir)
        procs.append(a)
        wait_health(a, base_a, 60)
        eng.register(base_a)
        bases = [base_a]
        base_d = None
        if any("dynamo" in s for s in only):
            port_d = free_port()
            base_d = f"http://127.0.0.1:{port_d}"
            d = Proc(dynamo_argv(port_d), "D", log_dir)
            procs.append(d)
            wait_health(d, base_d, 120)
            eng.register(base_d)
            bases.append(base_d)
        for p in eng.pubs:
            if not p.wait_subscribed(30):
                raise RuntimeError("the followers never subscribed")
        populate(args, eng, bases)
        if metric(base_a, "kvr_index_blocks") != eng.total():
            raise RuntimeError(f"A holds {metric(base_a, 'kvr_index_blocks')} holder-blocks, "
                               f"the engines stored {eng.total()}")
        time.sleep(1.0)  # A's journal: its group commit is 10 ms
        for rep in range(args.reps):
            for s in only:
                port = free_port()
                base = f"http://127.0.0.1:{port}"
                if s.startswith("state-"):
                    a.kill()
                    io = s.split("-")[1]
                    a = Proc(kvr_argv(args, port, ["--state-dir", state, "--state-io", io]),
                             f"A-{s}-{rep}", log_dir)
                    procs.append(a)
                    base_a = base
                    r = watch(a, base, eng, kvr=True, register=False, timeout=args.timeout)
                    p = a
                else:
                    extra = {"peer-kvr": ["--indexer-peers", base_a],
                             "peer-dynamo": ["--indexer-peers", base_d or ""],
                             "dynamo-peer": ["--indexer-peers", base_d or ""],
                             "cold": []}[s]
                    kvr = s != "dynamo-peer"
                    argv_ = kvr_argv(args, port, extra) if kvr else dynamo_argv(port, extra)
                    p = Proc(argv_, f"{s}-{rep}", log_dir)
                    procs.append(p)
                    r = watch(p, base, eng, kvr=kvr, register=True, timeout=args.timeout,
                              settle={"cold": 5.0, "dynamo-peer": 10.0}.get(s, 0.0))
                if r["exact"] is not None and eng.truth is not None and s != "dynamo-peer":
                    bad = dump_truth_diff(base, eng)
                    if bad:
                        failures.append(f"{s} rep {rep}: /dump differs from the truth: {bad}")
                        r["exact"] = None
                # Only kvr's own ways back must end exact (the cold start cannot: the
                # engines' buffers are shorter than their history; Dynamo's is measured).
                if s not in ("cold", "dynamo-peer") and r["exact"] is None:
                    failures.append(f"{s} rep {rep}: never exact ({r['blocks']} of {eng.total()})")
                log(f"{s} rep {rep}: health {r['health']:.3f} s, ready {fmt(r['ready'])}, "
                    f"exact {fmt(r['exact'])}, holder-blocks {r['blocks']}, "
                    f"stores whose parent was unknown {r.get('parent_not_found')}")
                results[s].append(r)
                if p is not a:
                    p.kill()
    finally:
        for p in procs:
            p.kill()
        eng.close()
    total = eng.total()
    print(f"| holder-blocks | way | time to ready | time to exact | index after |")
    print("|---|---|---|---|---|")
    for s in only:
        rs = results[s]
        blocks = [r["blocks"] for r in rs if r["blocks"] is not None]
        after = (f"{statistics.median(blocks) / total:.1%} of the truth" if blocks
                 else "(sampled)")
        size = f"{total / 1e6:.1f} M" if total >= 100_000 else f"{total:,}"
        print(f"| {size} | {s} | {spread([r['ready'] for r in rs])} | "
              f"{spread([r['exact'] for r in rs])} | {after} |")
    for f in failures:
        log(f"FAILED: {f}")
    log(f"logs in {log_dir}")
    return 1 if failures else 0


def fmt(v) -> str:
    return "-" if v is None else f"{v:.3f} s"


def spread(vs) -> str:
    got = [v for v in vs if v is not None]
    if not got:
        return "never"
    med = statistics.median(got)
    missing = f", {len(vs) - len(got)} of {len(vs)} never" if len(got) < len(vs) else ""
    return f"{med:.2f} s ({min(got):.2f}–{max(got):.2f}{missing})"


if __name__ == "__main__":
    sys.exit(main())
