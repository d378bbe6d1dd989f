"""Ingress recovery (and hybrid KV-cache groups) against vLLM 0.33.0's real publisher.

Each scenario drives `vllm/distributed/kv_events.py`'s own `ZmqEventPublisher` (imported
from the wheel with small stubs: tests/compat/vllm_publisher.py) into `kvr serve`, which
subscribes with kvr's own ZMQ subscriber, and then compares every prompt's cached depth
per (worker, DP rank) — from `/overlap_scores` — with what the engine holds. Any
overcount fails, as does a depth that never reaches the truth.

A lost batch is made the way the network loses one: the publisher's PUB socket is wrapped
so that its next N sends are dropped, while vLLM's code still numbers them and keeps them
in its replay buffer (exactly what a slow joiner or a full high-water mark does). A
restart is a new `ZmqEventPublisher` on the same endpoints (seq from 0, empty buffer).

Scenarios (issue 15's list):
  gap-at-end-of-burst       the last batch of a burst is lost, then the engine is idle
  join-after-last-batch     kvr subscribes after the engine published everything
  restart-back-to-zero      a new instance whose first batches were missed (seq < last)
  restart-at-old-last-seq   a new instance whose first batch seen has the old last seq
  dp2-one-replay-dead       two DP ranks; rank 1's replay endpoint never answers: rank 0
                            keeps its state, rank 1 recovers by clearing, never rank 0
  hybrid-groups             full-attention and sliding-window groups (one event each): the
                            window's evictions leave the full-attention blocks counted

Usage: python recovery.py [--kvr-bin target/release/kvr] [--only NAME] [--timeout S]
                          [--negative]
Exit status 0 when every scenario converged to the truth without overcounting.
--negative is the check's control: kvr serve without idle probes
(--kv-events-idle-probe-ms 0) must fail the two scenarios only a probe can recover
(gap-at-end-of-burst keeps an evicted block: an overcount; join-after-last-batch holds
nothing).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "compat"))

from harness import free_port, http  # noqa: E402
from vllm_publisher import engine_hashes, free_port_block, load_kv_events  # noqa: E402

MODEL = "m"
BS = 16


def log(msg: str) -> None:
    print(f"[recovery] {msg}", file=sys.stderr, flush=True)


class DroppingSocket:
    """The publisher's PUB socket, dropping its next `drop` sends (the batches still get
    their seq and enter vLLM's replay buffer: a loss on the way)."""

    def __init__(self, sock):
        self._sock = sock
        self.drop = 0

    def send_multipart(self, frames, *args, **kwargs):
        if self.drop > 0:
            self.drop -= 1
            return None
        return self._sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class Rank:
    """One DP rank of an engine: vLLM's real publisher and the blocks it holds."""

    def __init__(self, kv, base_port: int, replay_port: int | None, dp_rank: int):
        self.kv = kv
        self.base_port, self.replay_port, self.dp_rank = base_port, replay_port, dp_rank
        self.held: set[tuple[int, ...]] = set()  # token prefixes, one per held block
        self.pub = None
        self.start()

    def start(self) -> None:
        # vLLM offsets both ports by the DP rank itself.
        self.pub = self.kv.ZmqEventPublisher(
            data_parallel_rank=self.dp_rank,
            endpoint=f"tcp://*:{self.base_port}",
            replay_endpoint=(f"tcp://*:{self.replay_port}" if self.replay_port else None),
        )
        self.sock = DroppingSocket(self.pub._pub)
        self.pub._pub = self.sock

    def restart(self) -> None:
        """A new engine instance on the same endpoints: seq from 0, cache empty."""
        self.pub.shutdown()
        self.held.clear()
        time.sleep(0.2)
        self.start()

    def publish(self, events: list, drop: bool = False) -> None:
        if drop:
            self.sock.drop += 1
        self.pub.publish(self.kv.KVEventBatch(ts=time.time(), events=events))
        self.pub._event_queue.join()  # sent (or dropped) and in the replay buffer

    def stored(self, tokens: list[int], group: int = 0, kind: str = "full_attention"):
        """A store in KV-cache group `group`; the truth follows the full-attention group
        (group 0), which is what a prefix hit needs."""
        hashes = engine_hashes(tokens, BS)
        if group == 0:
            for i in range(len(hashes)):
                self.held.add(tuple(tokens[: (i + 1) * BS]))
        return self.kv.BlockStored(
            block_hashes=hashes, parent_block_hash=None,
            token_ids=tokens[: len(hashes) * BS], block_size=BS, lora_id=None,
            medium="GPU", lora_name=None, extra_keys=[None] * len(hashes),
            group_idx=group, kv_cache_spec_kind=kind)

    def removed(self, tokens: list[int], first_block: int, group: int = 0):
        hashes = engine_hashes(tokens, BS)
        if group == 0:
            for i in range(first_block, len(hashes)):
                self.held.discard(tuple(tokens[: (i + 1) * BS]))
        return self.kv.BlockRemoved(block_hashes=hashes[first_block:], medium="GPU",
                                    group_idx=group)

    def depth(self, prompt: list[int]) -> int:
        d = 0
        while (d + 1) * BS <= len(prompt) and tuple(prompt[: (d + 1) * BS]) in self.held:
            d += 1
        return d

    def close(self) -> None:
        self.pub.shutdown()


class Worker:
    def __init__(self, kv, worker_id: int, dp_size: int = 1, replay: bool = True,
                 dead_replay_ranks: tuple[int, ...] = ()):
        self.worker_id = worker_id
        ports = free_port_block(2 * dp_size)
        self.base_port, self.replay_port = ports, ports + dp_size
        self.ranks = [
            Rank(kv, self.base_port,
                 None if (not replay or r in dead_replay_ranks) else self.replay_port, r)
            for r in range(dp_size)
        ]
        self.replay = replay

    def register(self, base: str) -> None:
        body = {"worker_id": self.worker_id, "model_name": MODEL,
                "endpoint": f"http://w{self.worker_id}.invalid:8000", "block_size": BS,
                "data_parallel_size": len(self.ranks), "total_kv_blocks": 4096,
                "kv_events_endpoints": {str(r.dp_rank): f"tcp://127.0.0.1:{self.base_port + r.dp_rank}"
                                        for r in self.ranks}}
        if self.replay:
            # kvr (as Dynamo) offsets the replay port by the rank, as vLLM binds them.
            body["replay_endpoint"] = f"tcp://127.0.0.1:{self.replay_port}"
        st, resp, _ = http(base, "POST", "/workers", body)
        assert st in (200, 201), (st, resp)

    def close(self) -> None:
        for r in self.ranks:
            r.close()


def overlap(base: str, prompt: list[int]) -> dict:
    st, body, _ = http(base, "POST", "/overlap_scores",
                       {"model_name": MODEL, "token_ids": prompt})
    assert st == 200, (st, body)
    return {(w["worker_id"], w["dp_rank"]): w.get("device_blocks", 0) for w in body["workers"]}


class Check:
    """Polls every (prompt, worker, rank) depth until it equals the truth, and fails if it
    does not within the timeout; an overcount still there half-way is logged as such."""

    def __init__(self, base: str, timeout: float):
        self.base, self.timeout = base, timeout

    def converge(self, name: str, workers: list[Worker], prompts: list[list[int]],
                 settle: float = 0.0) -> bool:
        deadline = time.time() + self.timeout
        time.sleep(settle)
        reported = False
        while True:
            bad = []
            for p in prompts:
                got = overlap(self.base, p)
                for w in workers:
                    for r in w.ranks:
                        want, have = r.depth(p), got.get((w.worker_id, r.dp_rank), 0)
                        if have != want:
                            bad.append((w.worker_id, r.dp_rank, p[0], want, have))
            if not bad:
                log(f"{name}: converged")
                return True
            if time.time() > deadline:
                log(f"{name}: FAILED, (worker, rank, prompt, want, got): {bad}")
                return False
            over = [b for b in bad if b[4] > b[3]]
            if over and not reported and time.time() > deadline - self.timeout / 2:
                # Still overcounting half-way through: report it as the finding it is.
                log(f"{name}: overcount still present: {over}")
                reported = True
            time.sleep(0.1)


def prompt(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


# ------------------------------------------------------------------ scenarios

def gap_at_end_of_burst(kv, base, check):
    w = Worker(kv, 101)
    w.register(base)
    r = w.ranks[0]
    time.sleep(1.0)  # the SUB connects (vLLM drops what it sends before)
    p, q = prompt(1000, 4), prompt(2000, 4)
    r.publish([r.stored(p)])
    r.publish([r.stored(q)])
    ok = check.converge("gap-at-end-of-burst (before the loss)", [w], [p, q])
    # The burst's last batch (Q's blocks leave) is lost; the engine then goes idle.
    r.publish([r.removed(q, 1)], drop=True)
    ok &= check.converge("gap-at-end-of-burst", [w], [p, q])
    return w, ok


def join_after_last_batch(kv, base, check):
    w = Worker(kv, 102)
    r = w.ranks[0]
    p, q = prompt(3000, 3), prompt(4000, 5)
    r.publish([r.stored(p)])  # nobody subscribed yet: dropped by ZMQ, kept for replay
    r.publish([r.stored(q)])
    r.publish([r.removed(q, 3)])
    w.register(base)
    return w, check.converge("join-after-last-batch", [w], [p, q])


def restart(kv, base, check, name, worker_id, start, n_old, n_missed):
    """The old instance publishes n_old batches; the new one's first n_missed are lost,
    then one arrives live with seq n_missed."""
    w = Worker(kv, worker_id)
    w.register(base)
    r = w.ranks[0]
    time.sleep(1.0)
    old = [prompt(start + 100 * i, 2) for i in range(n_old)]
    for p in old:
        r.publish([r.stored(p)])
    ok = check.converge(f"{name} (before)", [w], old)
    r.restart()
    new = [prompt(start + 5000 + 100 * i, 3) for i in range(n_missed + 1)]
    for p in new[:n_missed]:
        r.publish([r.stored(p)], drop=True)
    time.sleep(0.5)
    r.publish([r.stored(new[-1])])
    ok &= check.converge(name, [w], old + new)
    return w, ok


def restart_back_to_zero(kv, base, check):
    # The first live batch of the new instance has seq 2 < the old last 4.
    return restart(kv, base, check, "restart-back-to-zero", 103, 5000, 5, 2)


def restart_at_old_last_seq(kv, base, check):
    # The first live batch of the new instance has seq 3 == the old last.
    return restart(kv, base, check, "restart-at-old-last-seq", 104, 7000, 4, 3)


def dp2_one_replay_dead(kv, base, check):
    w = Worker(kv, 105, dp_size=2, dead_replay_ranks=(1,))
    r0, r1 = w.ranks
    p0, p1, p1b = prompt(9000, 4), prompt(9500, 2), prompt(9800, 3)
    r1.publish([r1.stored(p1)])  # before kvr subscribed: rank 1 must replay, and cannot
    w.register(base)
    time.sleep(1.0)
    r0.publish([r0.stored(p0)])
    r1.publish([r1.stored(p1b)])  # seq 1: a late join on rank 1, its replay times out
    # Undercounting rank 1's first store is what a dead replay endpoint costs; kvr must
    # not touch rank 0. The truth for the check: rank 1 lost p1 for good.
    r1.held -= {tuple(p1[: (i + 1) * BS]) for i in range(2)}
    ok = check.converge("dp2-one-replay-dead", [w], [p0, p1, p1b], settle=6.5)
    return w, ok


def hybrid_groups(kv, base, check):
    """gpt-oss-like: each batch stores in group 0 (full attention) and group 1 (sliding
    window); the window evicts the blocks it slid past, the full group keeps them."""
    w = Worker(kv, 106)
    w.register(base)
    r = w.ranks[0]
    time.sleep(1.0)
    p = prompt(11000, 6)
    r.publish([r.stored(p, 0), r.stored(p, 1, "sliding_window")])
    r.publish([r.removed(p[: 4 * BS], 0, group=1)])
    ok = check.converge("hybrid-groups (window slid)", [w], [p])
    r.publish([r.removed(p, 5, group=0)])
    ok &= check.converge("hybrid-groups (full-attention eviction)", [w], [p])
    return w, ok


SCENARIOS = {
    "gap-at-end-of-burst": gap_at_end_of_burst,
    "join-after-last-batch": join_after_last_batch,
    "restart-back-to-zero": restart_back_to_zero,
    "restart-at-old-last-seq": restart_at_old_last_seq,
    "dp2-one-replay-dead": dp2_one_replay_dead,
    "hybrid-groups": hybrid_groups,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    ap.add_argument("--kvr-bin", default=os.environ.get("KVR_BIN", os.path.join(target, "release", "kvr")))
    ap.add_argument("--only", action="append", choices=sorted(SCENARIOS))
    ap.add_argument("--timeout", type=float, default=15.0)
    ap.add_argument("--negative", action="store_true")
    args = ap.parse_args(argv)
    extra = []
    if args.negative:
        extra = ["--kv-events-idle-probe-ms", "0"]
        args.only = ["gap-at-end-of-burst", "join-after-last-batch"]
        args.timeout = min(args.timeout, 5.0)
    kv = load_kv_events()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    logf = tempfile.NamedTemporaryFile(prefix="kvr-recovery-", suffix=".log", delete=False)
    svc = subprocess.Popen([args.kvr_bin, "serve", "--port", str(port)] + extra,
                           stdout=logf, stderr=logf)
    workers, failed = [], []
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if http(base, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        check = Check(base, args.timeout)
        for name in args.only or list(SCENARIOS):
            log(f"== {name}")
            w, ok = SCENARIOS[name](kv, base, check)
            workers.append(w)
            if not ok:
                failed.append(name)
    finally:
        for w in workers:
            w.close()
        svc.terminate()
        svc.wait(timeout=20)
    if args.negative:
        passed = [n for n in args.only if n not in failed]
        if passed:
            log(f"negative control FAILED: {', '.join(passed)} converged without idle probes")
            return 1
        log("negative control: without idle probes both scenarios stay wrong, as they must")
        return 0
    if failed:
        log(f"FAILED: {', '.join(failed)} (kvr serve's log: {logf.name})")
        return 1
    log(f"all {len(workers)} scenarios converged without overcounting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
