#!/usr/bin/env python3
"""kvr end-to-end ingress scenario: several emulated vLLM/SGLang workers publish KV
events over real TCP on 127.0.0.1, phase by phase, and write each phase's ground truth.

Driven by a line protocol (stdout = protocol only; logs go to stderr):

  scenario -> READY <json>          endpoints of every publisher (see README.md)
  driver   -> GO                    after the subscriber connected / bound everything
  scenario -> PHASE <n> <path>      phase n published; <path> = its ground-truth JSON
  driver   -> NEXT                  once the subscriber's index matched (or gave up)
  ...                               (phases 1..5)
  scenario -> DONE                  after the last NEXT; then the scenario exits 0

After GO the scenario waits until every PUB socket has completed a ZMTP handshake with
a peer (up to --handshake-timeout), then --settle-ms more (the subscription message
follows the handshake) before publishing anything: batches sent before a subscription
exists are silently dropped by ZMQ. The same wait follows every restart.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import socket
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zmq  # noqa: E402

from kvpublisher import MEDIA, TIER_OF_MEDIUM, EngineRank, Worker, free_tcp_ports  # noqa: E402


def log(*args: Any) -> None:
    print("[scenario]", *args, file=sys.stderr, flush=True)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def wait_line(expected: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            log(f"timed out waiting for {expected!r} on stdin")
            sys.exit(2)
        r, _, _ = select.select([sys.stdin], [], [], left)
        if not r:
            continue
        line = sys.stdin.readline()
        if line == "":
            log(f"stdin closed while waiting for {expected!r}")
            sys.exit(3)
        line = line.strip()
        if line == expected:
            return
        if line:
            log(f"ignoring unexpected input line {line!r} (waiting for {expected!r})")


class Scenario:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.B = args.block_size
        self.rng = random.Random(args.seed)
        self.ctx = zmq.Context.instance()
        self.out_dir = args.out_dir or tempfile.mkdtemp(prefix="kvr-e2e-")
        os.makedirs(self.out_dir, exist_ok=True)
        B = self.B

        # W1: vLLM 0.33 tagged maps, uint64 hashes, DP 2 (one publisher per rank, ports
        # offset by the rank), publisher binds, replay ROUTER on each rank.
        base = free_tcp_ports(4)
        self.w1 = Worker(
            101,
            2,
            block_size=B,
            encoding="map-v0.33",
            hash_kind="uint64",
            pub_endpoint=f"tcp://127.0.0.1:{base}",
            mode="bind",
            replay_endpoint=f"tcp://127.0.0.1:{base + 2}",
            topic="kv-w1",
            ctx=self.ctx,
        )
        # W2: SGLang positional arrays (9/3 fields), int64 hashes, nil
        # data_parallel_rank, default topic "", publisher binds, no replay.
        self.w2 = Worker(
            102,
            1,
            block_size=B,
            encoding="array-sglang",
            hash_kind="int64",
            pub_endpoint="tcp://127.0.0.1:0",
            mode="bind",
            topic="",
            rank_field=False,
            ctx=self.ctx,
        )
        # W5: positional arrays with every field plus an unknown trailing one, uint64,
        # publisher binds, no replay.
        self.w5 = Worker(
            105,
            1,
            block_size=B,
            encoding="array-future",
            hash_kind="uint64",
            pub_endpoint="tcp://127.0.0.1:0",
            mode="bind",
            topic="kv-w5",
            ctx=self.ctx,
        )
        # W3 and W4 connect (no '*' in the endpoint) to one endpoint the subscriber
        # binds; the subscriber tells them apart by topic. Hold the port until READY so
        # the replay ROUTERs bound on port 0 cannot be given it.
        placeholder = socket.socket()
        placeholder.bind(("127.0.0.1", 0))
        shared_port = placeholder.getsockname()[1]
        self.shared = f"tcp://127.0.0.1:{shared_port}"
        # W3: trimmed positional arrays (trailing nils omitted), 32-byte bin hashes,
        # replay ROUTER with a 4-batch buffer (so a long gap outruns it).
        self.w3 = Worker(
            103,
            1,
            block_size=B,
            encoding="array-trimmed",
            hash_kind="bin",
            pub_endpoint=self.shared,
            mode="connect",
            replay_endpoint="tcp://127.0.0.1:0",
            buffer_steps=4,
            topic="kv-w3",
            ctx=self.ctx,
        )
        # W4: sparse tagged maps (defaulted fields absent, unknown key), bin hashes,
        # no replay.
        self.w4 = Worker(
            104,
            1,
            block_size=B,
            encoding="map-sparse",
            hash_kind="bin",
            pub_endpoint=self.shared,
            mode="connect",
            topic="kv-w4",
            ctx=self.ctx,
        )
        placeholder.close()
        self.workers = [self.w1, self.w2, self.w3, self.w4, self.w5]
        self.ranks: List[EngineRank] = [r for w in self.workers for r in w.ranks]
        self.SYS = self.toks(3)  # a shared system prompt
        self.p: Dict[str, List[int]] = {}  # prompts by name
        self.h: Dict[str, Dict[int, List[Any]]] = {}  # prompt -> worker id -> hashes

    # -- helpers ---------------------------------------------------------------------

    def toks(self, n_blocks: int, extra: int = 0) -> List[int]:
        return [self.rng.randrange(1, 152_000) for _ in range(n_blocks * self.B + extra)]

    def cache(self, rank: EngineRank, name: str, tokens: Optional[List[int]] = None, **kw: Any) -> List[Any]:
        if tokens is None:
            tokens = self.p[name]
        self.p.setdefault(name, tokens)
        hashes = rank.cache_prompt(tokens, **kw)
        self.h.setdefault(name, {})[rank.worker_id * 10 + rank.dp_rank] = hashes
        return hashes

    def hashes(self, rank: EngineRank, name: str) -> List[Any]:
        return self.h[name][rank.worker_id * 10 + rank.dp_rank]

    def ready_info(self) -> Dict[str, Any]:
        return {
            "version": 1,
            "block_size": self.B,
            "truth_dir": self.out_dir,
            "phases": 5,
            "subscriber_binds": [self.shared],
            "tiers": TIER_OF_MEDIUM,
            "workers": [w.describe() for w in self.workers],
        }

    def wait_for_subscribers(self, ranks: List[EngineRank]) -> None:
        t = self.args.handshake_timeout
        for r in ranks:
            if not r.publisher.wait_for_peer(t):
                log(f"warning: no peer handshake on {r.publisher.name} ({r.publisher.endpoint}) after {t} s")
        time.sleep(self.args.settle_ms / 1000.0)

    def expect(self, rank: EngineRank, kind: str, **kw: Any) -> Dict[str, Any]:
        d = {
            "worker_id": rank.worker_id,
            "dp_rank": rank.dp_rank,
            "pub": rank.publisher.endpoint,
            "topic": rank.publisher.topic,
            "kind": kind,
        }
        d.update(kw)
        return d

    def write_truth(self, phase: int, name: str, expect: List[Dict[str, Any]]) -> str:
        for r in self.ranks:
            assert not r.pending, "unflushed events at the end of a phase"
        doc = {
            "phase": phase,
            "name": name,
            "block_size": self.B,
            "expect": expect,
            "publishers": [
                {
                    "worker_id": r.worker_id,
                    "dp_rank": r.dp_rank,
                    "pub": r.publisher.endpoint,
                    "topic": r.publisher.topic,
                    "instance": r.publisher.instance,
                    "last_seq": r.publisher.last_seq,
                }
                for r in self.ranks
            ],
            "ranks": [e for r in self.ranks for e in r.truth()],
        }
        path = os.path.join(self.out_dir, f"phase{phase}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(path + ".tmp", path)
        n = sum(len(e["blocks"]) for e in doc["ranks"])
        log(f"phase {phase} ({name}): {n} held blocks; truth {path}")
        return path

    # -- phases ----------------------------------------------------------------------

    def phase1(self) -> List[Dict[str, Any]]:
        """Initial stores on every worker and rank, every medium, LoRA, shared prefixes."""
        w1r0, w1r1 = self.w1.rank(0), self.w1.rank(1)
        w2, w3, w4, w5 = self.w2.rank(0), self.w3.rank(0), self.w4.rank(0), self.w5.rank(0)
        B = self.B
        self.cache(w1r0, "P1", self.SYS + self.toks(4))
        w1r0.flush()
        # Trailing partial block: not cached. P1's first 5 blocks also offloaded to CPU
        # (same engine hashes on two media).
        self.cache(w1r0, "P2", self.SYS + self.toks(2, extra=self.B - 1))
        self.cache(w1r0, "P1cpu", self.p["P1"][: 5 * B], medium="CPU")
        w1r0.flush()

        self.cache(w1r1, "P3", self.SYS + self.toks(3))
        self.cache(w1r1, "P4", self.toks(4), lora_name="sql-lora", lora_id=1)
        w1r1.flush()
        self.cache(w1r1, "P4b", self.p["P4"][: 2 * B] + self.toks(2), lora_name="sql-lora", lora_id=1)
        w1r1.flush()

        self.cache(w2, "P6", self.SYS + self.toks(3))
        self.cache(w2, "P7", self.toks(5), lora_name="chat-lora", lora_id=7)
        w2.flush()
        self.cache(w2, "P8", self.p["P6"][: 4 * B] + self.toks(2))
        w2.flush()

        self.cache(w3, "P1")  # the same prompt as on W1: a block held by two workers
        w3.flush()
        self.cache(w3, "P9", self.toks(4), medium="STORAGE")
        self.cache(w3, "P10", self.toks(3))
        w3.flush()

        self.cache(w4, "P11", self.SYS + self.toks(2))
        w4.flush()
        self.cache(w4, "P12", self.toks(3), medium="CPU")
        w4.flush()

        self.cache(w5, "P13", self.toks(6))
        self.cache(w5, "P14", self.toks(2), medium="CPU")
        self.cache(w5, "P15", self.toks(3), medium="STORAGE")
        w5.flush()
        self.cache(w5, "P13b", self.p["P13"][: 3 * B] + self.toks(1))
        w5.flush()
        return []

    def phase2(self) -> List[Dict[str, Any]]:
        """Removes (leaves, several media) and an AllBlocksCleared on one rank."""
        w1r0, w1r1 = self.w1.rank(0), self.w1.rank(1)
        w2, w3, w4, w5 = self.w2.rank(0), self.w3.rank(0), self.w4.rank(0), self.w5.rank(0)
        B = self.B
        # GPU copies of P1 blocks 4..6 evicted; block 4 stays on CPU under the same hash.
        w1r0.remove(self.hashes(w1r0, "P1")[4:7], medium="GPU")
        w1r0.remove(self.hashes(w1r0, "P2")[4:5], medium="GPU")
        w1r0.flush()
        self.cache(w1r0, "P5", self.SYS + self.toks(1))
        w1r0.flush()

        w1r1.remove(self.hashes(w1r1, "P3")[5:6])
        w1r1.flush()
        self.cache(w1r1, "P3b", self.p["P3"][: 5 * B] + self.toks(2))
        w1r1.flush()

        # The cleared rank holds GPU blocks only, so "clear" is unambiguous.
        w2.clear()
        self.cache(w2, "P16", self.toks(3))
        w2.flush()
        self.cache(w2, "P6")
        w2.flush()

        w3.remove(self.hashes(w3, "P9")[2:4], medium="STORAGE")
        w3.remove(self.hashes(w3, "P10"))
        w3.flush()

        w4.remove(self.hashes(w4, "P12"), medium="CPU")
        self.cache(w4, "P17", self.SYS + self.toks(1))
        w4.flush()

        w5.remove(self.hashes(w5, "P13")[4:6])
        w5.remove(self.hashes(w5, "P15")[2:3], medium="STORAGE")
        w5.flush()
        return []

    def phase3(self) -> List[Dict[str, Any]]:
        """Gaps on publishers that serve replay: the subscriber must fetch the missing
        batches from the ROUTER (no clear)."""
        w1r1 = self.w1.rank(1)
        w2, w3, w4, w5 = self.w2.rank(0), self.w3.rank(0), self.w4.rank(0), self.w5.rank(0)
        # W1 rank 1: two batches lost (a store, then removals), the third reveals it.
        w1r1.drop_next(2)
        self.cache(w1r1, "P18", self.toks(4))
        w1r1.flush()
        w1r1.remove(self.hashes(w1r1, "P4")[2:4])
        w1r1.flush()
        self.cache(w1r1, "P19", self.SYS + self.toks(2))
        w1r1.flush()
        # W3 (connect mode, 4-batch buffer): one batch lost.
        w3.drop_next(1)
        w3.remove(self.hashes(w3, "P1")[5:7])
        self.cache(w3, "P20", self.toks(2))
        w3.flush()
        self.cache(w3, "P21", self.toks(2), medium="STORAGE")
        w3.flush()
        # Unaffected traffic meanwhile (incl. a live SGLang removal and a tagged-map
        # AllBlocksCleared on W4, which holds GPU blocks only).
        w2.remove(self.hashes(w2, "P16")[2:3])
        self.cache(w2, "P22", self.toks(2))
        w2.flush()
        w4.clear()
        self.cache(w4, "P22w4", self.SYS + self.toks(1))
        w4.flush()
        self.cache(w5, "P22w5", self.toks(2))
        w5.flush()
        return [
            self.expect(w1r1, "gap_replay", missed=2),
            self.expect(w3, "gap_replay", missed=1),
        ]

    def phase4(self) -> List[Dict[str, Any]]:
        """Gaps that replay cannot heal: W2 has no replay endpoint; W3 loses more
        batches than its 4-batch replay buffer keeps (the replay starts later than
        asked). The subscriber must clear those ranks. Ground truth stays what the
        engine holds: after the gap each of these workers sends one more batch (which
        reveals the gap) and then re-announces everything it holds (BlockStored from
        the roots, no AllBlocksCleared), so a subscriber that cleared converges and one
        that kept the stale state does not (the lost batches removed blocks)."""
        w1r0, w2, w3, w4 = self.w1.rank(0), self.w2.rank(0), self.w3.rank(0), self.w4.rank(0)
        w2.drop_next(1)
        w2.remove(self.hashes(w2, "P6")[4:6])
        self.cache(w2, "P23", self.toks(2))
        w2.flush()
        self.cache(w2, "P24", self.toks(2))  # reveals the gap
        w2.flush()
        w2.resync()
        w2.flush()

        w3.drop_next(5)
        w3.remove(self.hashes(w3, "P20")[1:2])
        self.cache(w3, "P25", self.toks(1))
        w3.flush()
        for i in range(4):
            self.cache(w3, f"P26.{i}", self.toks(1))
            w3.flush()
        self.cache(w3, "P27", self.toks(1))  # reveals the gap
        w3.flush()
        w3.resync()
        w3.flush()

        self.cache(w1r0, "P28", self.toks(2))
        w1r0.flush()
        self.cache(w4, "P28w4", self.toks(1))
        w4.flush()
        return [
            self.expect(w2, "gap_clear", missed=1),
            self.expect(w3, "replay_range_gone", missed=5),
        ]

    def phase5(self) -> List[Dict[str, Any]]:
        """Restarts: W1 (both DP ranks, bind mode, with replay) and W4 (connect mode, no
        replay) come back as new publisher instances — seq from 0, empty replay buffer,
        sockets reopened, empty cache — and store anew. Their old blocks must go."""
        w1r0, w1r1 = self.w1.rank(0), self.w1.rank(1)
        w4, w5 = self.w4.rank(0), self.w5.rank(0)
        B = self.B
        before = {r.publisher.name: r.publisher.last_seq for r in (w1r0, w1r1, w4)}
        self.w1.restart()
        self.w4.restart()
        self.wait_for_subscribers([w1r0, w1r1, w4])
        self.cache(w1r0, "P30", self.SYS + self.toks(2))
        w1r0.flush()
        self.cache(w1r0, "P30cpu", self.p["P30"][: 3 * B], medium="CPU")
        w1r0.flush()
        self.cache(w1r1, "P31", self.toks(3))
        w1r1.flush()
        self.cache(w4, "P32", self.SYS + self.toks(2))
        w4.flush()
        self.cache(w5, "P33", self.toks(2))
        w5.flush()
        return [
            self.expect(r, "restart", previous_last_seq=before[r.publisher.name])
            for r in (w1r0, w1r1, w4)
        ]

    def run(self) -> None:
        say("READY " + json.dumps(self.ready_info(), separators=(",", ":")))
        wait_line("GO", self.args.step_timeout)
        self.wait_for_subscribers(self.ranks)
        phases = [
            (1, "initial-stores", self.phase1),
            (2, "removes-and-clear", self.phase2),
            (3, "gap-with-replay", self.phase3),
            (4, "gap-without-replay-clear", self.phase4),
            (5, "restart", self.phase5),
        ]
        for n, name, fn in phases:
            expect = fn()
            path = self.write_truth(n, name, expect)
            say(f"PHASE {n} {path}")
            wait_line("NEXT", self.args.step_timeout)
        say("DONE")
        for w in self.workers:
            w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=20250601)
    ap.add_argument("--out-dir", default=None, help="where the ground-truth JSON files go (default: a new temp dir)")
    ap.add_argument("--settle-ms", type=int, default=300, help="pause after the subscribers joined, before publishing")
    ap.add_argument("--handshake-timeout", type=float, default=10.0, help="seconds to wait for a peer on each PUB")
    ap.add_argument("--step-timeout", type=float, default=120.0, help="seconds to wait for GO / NEXT before giving up")
    args = ap.parse_args()
    Scenario(args).run()


if __name__ == "__main__":
    main()
