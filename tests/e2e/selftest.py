#!/usr/bin/env python3
"""Self-test of the end-to-end scenario, in pure Python.

1. Unit checks of kvpublisher.py: the wire shape of every encoding and hash kind, and
   the replay ROUTER (reply frames, buffer limit, start past the head, malformed
   request, drop_next, restart).
2. Drives scenario.py through its line protocol with a reference subscriber (pyzmq SUB
   + DEALER replay, per-publisher sequence tracking, a naive index keyed by token
   prefixes) and checks, after every phase, that the index equals the phase's ground
   truth and that the subscriber saw exactly the gaps / replays / clears / restarts the
   phase announces in `expect`. It also replays each phase into a copy of the previous
   phase's index with a subscriber that ignores sequence numbers, and checks that this
   one diverges exactly on the ranks the phase's `expect` names: the scenario really
   exercises the mechanisms it claims to.

Exit 0 on success.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, HERE)

import msgspec  # noqa: E402
import zmq  # noqa: E402

from kvpublisher import (  # noqa: E402
    END_SEQ,
    MEDIA,
    REMOVED_FIELDS,
    STORED_FIELDS,
    EngineRank,
    ZmqEventPublisher,
)

MASK64 = (1 << 64) - 1
failures: List[str] = []


def check(cond: bool, what: str) -> None:
    if not cond:
        failures.append(what)
        print(f"  FAIL: {what}", flush=True)


# --------------------------------------------------------------------------------------
# Wire decoding (what any subscriber must do; both encodings, all hash kinds).
# --------------------------------------------------------------------------------------


def fold(h: Any) -> int:
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(bytes(h[-8:]), "big")
    return int(h) & MASK64


def event_fields(ev: Any) -> Tuple[str, Dict[str, Any]]:
    if isinstance(ev, dict):
        return ev["type"], ev
    tag = ev[0]
    names = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS if tag == "BlockRemoved" else ()
    return tag, dict(zip(names, ev[1:]))  # extra trailing fields dropped by zip


def decode_batch(payload: bytes) -> Tuple[float, List[Any], Optional[int]]:
    b = msgspec.msgpack.decode(payload)
    assert isinstance(b, list) and len(b) >= 2, "batch must be an array [ts, events, rank]"
    return b[0], b[1], (b[2] if len(b) > 2 else None)


Key = Tuple[int, int, str]  # (worker_id, dp_rank, medium)
Index = Dict[Key, Dict[int, Tuple[Optional[str], Tuple[int, ...]]]]


class Stats:
    def __init__(self) -> None:
        self.orphans = 0
        self.shapes: Set[Tuple[str, str, int]] = set()  # (kind, tag, len or nkeys)
        self.hash_types: Set[str] = set()


def apply_batch(index: Index, worker_id: int, default_rank: int, payload: bytes, block_size: int, stats: Optional[Stats]) -> None:
    _ts, events, rank = decode_batch(payload)
    rank = default_rank if rank is None else rank
    for ev in events:
        tag, f = event_fields(ev)
        if stats is not None:
            stats.shapes.add(("map" if isinstance(ev, dict) else "array", tag, len(ev)))
        if tag == "AllBlocksCleared":
            for m in MEDIA:
                index.pop((worker_id, rank, m), None)
            continue
        medium = f.get("medium") or "GPU"
        tier = index.setdefault((worker_id, rank, medium), {})
        hashes = f["block_hashes"]
        if stats is not None:
            for h in hashes:
                if isinstance(h, bytes):
                    stats.hash_types.add(f"bin{len(h)}")
                elif h < 0:
                    stats.hash_types.add("negative-int")
                elif h >= 1 << 63:
                    stats.hash_types.add("uint64-high")
                else:
                    stats.hash_types.add("int")
        if tag == "BlockRemoved":
            for h in hashes:
                tier.pop(fold(h), None)
            continue
        assert tag == "BlockStored", tag
        assert f["block_size"] == block_size, "block size mismatch"
        toks = f["token_ids"]
        assert len(toks) == len(hashes) * block_size
        parent = f.get("parent_block_hash")
        lora = f.get("lora_name")
        if parent is None:
            prefix: Tuple[int, ...] = ()
        else:
            got = tier.get(fold(parent))
            if got is None:
                if stats is not None:
                    stats.orphans += 1
                continue
            prefix = got[1]
        for i, h in enumerate(hashes):
            prefix = prefix + tuple(toks[i * block_size : (i + 1) * block_size])
            tier[fold(h)] = (lora, prefix)


def index_view(index: Index) -> Dict[Key, Set[Tuple[Optional[str], Tuple[int, ...]]]]:
    return {k: set(v.values()) for k, v in index.items() if v}


def truth_view(truth: Dict[str, Any]) -> Dict[Key, Set[Tuple[Optional[str], Tuple[int, ...]]]]:
    out = {}
    for e in truth["ranks"]:
        s = {(b["lora_name"], tuple(b["tokens"])) for b in e["blocks"]}
        if s:
            out[(e["worker_id"], e["dp_rank"], e["medium"])] = s
    return out


def diff(a: Dict[Key, Set[Any]], b: Dict[Key, Set[Any]]) -> List[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k, set()), b.get(k, set())
        if x != y:
            out.append(f"{k}: {len(x - y)} extra, {len(y - x)} missing")
    return out


def ranks_differing(a: Dict[Key, Set[Any]], b: Dict[Key, Set[Any]]) -> Set[Tuple[int, int]]:
    return {(k[0], k[1]) for k in set(a) | set(b) if a.get(k, set()) != b.get(k, set())}


# --------------------------------------------------------------------------------------
# Reference subscriber.
# --------------------------------------------------------------------------------------

COUNTERS = ("batches", "gaps", "replays_ok", "replay_range_gone", "gap_clears", "restarts", "replay_timeouts")


class Replay:
    def __init__(self, want: int, first_live: Tuple[int, bytes]) -> None:
        self.want = want
        self.live: List[Tuple[int, bytes]] = [first_live]
        self.failed = False
        self.deadline = time.monotonic() + 3.0


class Pub:
    def __init__(self, worker_id: int, desc: Dict[str, Any]) -> None:
        self.worker_id = worker_id
        self.dp_rank = desc["dp_rank"]
        self.endpoint = desc["pub"]
        self.mode = desc["mode"]
        self.topic = desc["topic"].encode()
        self.replay_ep = desc["replay"]
        self.dealer: Optional[zmq.Socket] = None
        self.last: Optional[int] = None
        self.replay: Optional[Replay] = None
        self.count = {c: 0 for c in COUNTERS}
        self.missed: List[int] = []
        self.ranks: Set[int] = {self.dp_rank}

    @property
    def name(self) -> str:
        return f"w{self.worker_id}/dp{self.dp_rank}"


class Subscriber:
    def __init__(self, ready: Dict[str, Any], ctx: zmq.Context) -> None:
        self.B = ready["block_size"]
        self.index: Index = {}
        self.shadow: Index = {}  # sequence-blind subscriber, reset to `index` per phase
        self.stats = Stats()
        self.pubs: List[Pub] = []
        self.by_sub: Dict[Tuple[str, bytes], Pub] = {}
        self.subs: Dict[str, zmq.Socket] = {}
        self.sub_ep: Dict[zmq.Socket, str] = {}
        self.by_dealer: Dict[zmq.Socket, Pub] = {}
        self.poller = zmq.Poller()
        for w in ready["workers"]:
            for d in w["publishers"]:
                p = Pub(w["worker_id"], d)
                self.pubs.append(p)
                self.by_sub[(p.endpoint, p.topic)] = p
                sub = self.subs.get(p.endpoint)
                if sub is None:
                    sub = ctx.socket(zmq.SUB)
                    sub.setsockopt(zmq.LINGER, 0)
                    sub.setsockopt(zmq.RCVHWM, 0)
                    if p.mode == "bind":
                        sub.connect(p.endpoint)
                    else:
                        sub.bind(p.endpoint)
                    self.subs[p.endpoint] = sub
                    self.sub_ep[sub] = p.endpoint
                    self.poller.register(sub, zmq.POLLIN)
                sub.setsockopt(zmq.SUBSCRIBE, p.topic)
                if p.replay_ep:
                    dealer = ctx.socket(zmq.DEALER)
                    dealer.setsockopt(zmq.LINGER, 0)
                    dealer.connect(p.replay_ep)
                    p.dealer = dealer
                    self.by_dealer[dealer] = p
                    self.poller.register(dealer, zmq.POLLIN)

    # -- index operations ------------------------------------------------------------

    def apply(self, p: Pub, seq: int, payload: bytes) -> None:
        _ts, _ev, rank = decode_batch(payload)
        p.ranks.add(p.dp_rank if rank is None else rank)
        apply_batch(self.index, p.worker_id, p.dp_rank, payload, self.B, self.stats)
        p.last = seq
        p.count["batches"] += 1

    def clear(self, p: Pub) -> None:
        for r in p.ranks:
            for m in MEDIA:
                self.index.pop((p.worker_id, r, m), None)

    # -- sequence tracking -----------------------------------------------------------

    def on_live(self, p: Pub, seq: int, payload: bytes) -> None:
        if p.replay is not None:
            p.replay.live.append((seq, payload))
            return
        if p.last is None or seq == p.last + 1:
            self.apply(p, seq, payload)
            return
        if seq <= p.last:
            # The live stream never repeats a seq: the publisher restarted.
            p.count["restarts"] += 1
            self.clear(p)
            p.last = None
            if seq == 0 or p.dealer is None:
                self.apply(p, seq, payload)
            else:
                self.start_replay(p, 0, seq, payload)
            return
        p.count["gaps"] += 1
        p.missed.append(seq - p.last - 1)
        if p.dealer is not None:
            self.start_replay(p, p.last + 1, seq, payload)
        else:
            p.count["gap_clears"] += 1
            self.clear(p)
            self.apply(p, seq, payload)

    def start_replay(self, p: Pub, start: int, seq: int, payload: bytes) -> None:
        assert p.dealer is not None
        p.replay = Replay(start, (seq, payload))
        p.dealer.send_multipart([b"", start.to_bytes(8, "big")])

    def on_replay(self, p: Pub, frames: List[bytes]) -> None:
        rp = p.replay
        if rp is None or len(frames) != 4 or frames[0] != b"":
            return  # stray or malformed
        if frames[2] == END_SEQ and frames[1] == b"":
            self.finish_replay(p, timed_out=False)
            return
        if frames[1] != p.topic:
            return
        seq = int.from_bytes(frames[2], "big")
        if rp.failed or seq < rp.want:
            return  # duplicate of something applied
        if seq > rp.want:
            rp.failed = True  # the range we need is gone from the buffer
            return
        self.apply(p, seq, frames[3])
        rp.want += 1

    def finish_replay(self, p: Pub, timed_out: bool) -> None:
        rp = p.replay
        assert rp is not None
        p.replay = None
        first_live = rp.live[0][0]
        if timed_out or rp.failed or rp.want < first_live:
            p.count["replay_timeouts" if timed_out else "replay_range_gone"] += 1
            self.clear(p)
            p.last = first_live - 1
        else:
            p.count["replays_ok"] += 1
        for seq, payload in rp.live:
            if p.last is not None and seq <= p.last:
                continue  # already applied from the replay
            self.on_live(p, seq, payload)

    # -- pump ------------------------------------------------------------------------

    def pump(self, timeout_ms: int) -> None:
        for sock, _ in self.poller.poll(timeout_ms):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if sock in self.by_dealer:
                    self.on_replay(self.by_dealer[sock], frames)
                    continue
                assert len(frames) == 3, f"live message with {len(frames)} frames"
                topic, seqb, payload = frames
                p = self.by_sub.get((self.sub_ep[sock], topic))
                if p is None:
                    continue
                assert len(seqb) == 8
                # Sequence-blind subscriber: every live batch, nothing else.
                apply_batch(self.shadow, p.worker_id, p.dp_rank, payload, self.B, None)
                self.on_live(p, int.from_bytes(seqb, "big"), payload)
        now = time.monotonic()
        for p in self.pubs:
            if p.replay is not None and now > p.replay.deadline:
                self.finish_replay(p, timed_out=True)

    def close(self) -> None:
        for s in list(self.subs.values()) + list(self.by_dealer):
            s.close(linger=0)


# --------------------------------------------------------------------------------------
# 1. Unit checks of kvpublisher.
# --------------------------------------------------------------------------------------


class NullPub:
    pass


def unit_encodings() -> None:
    print("unit: encodings", flush=True)
    B = 4
    for enc, hk in [
        ("map-v0.33", "uint64"),
        ("map-sparse", "bin"),
        ("array-sglang", "int64"),
        ("array-trimmed", "bin"),
        ("array-future", "uint64"),
    ]:
        r = EngineRank(1, 0, NullPub(), block_size=B, encoding=enc, hash_kind=hk)  # type: ignore[arg-type]
        hs = r.cache_prompt(list(range(1, 3 * B + 1)))
        r.cache_prompt(list(range(1, 3 * B + 1)), medium="CPU")
        r.cache_prompt(list(range(1, 2 * B + 1)) + [99] * B, lora_name="l", lora_id=3)
        r.remove(hs[2:], medium="GPU")
        r.remove(hs, medium="CPU")
        r.clear()
        raw = [msgspec.msgpack.decode(msgspec.msgpack.encode(e)) for e in r.pending]
        gpu_store, cpu_store, lora_store, gpu_rm, cpu_rm, clear = raw
        for h in hs:
            if hk == "uint64":
                check(isinstance(h, int) and 0 <= h <= MASK64, f"{enc}: uint64 hash")
            elif hk == "int64":
                check(isinstance(h, int) and -(1 << 63) <= h < (1 << 63), f"{enc}: int64 hash")
            else:
                check(isinstance(h, bytes) and len(h) == 32, f"{enc}: bin hash")
        # The lora store chains on no GPU block (different salt → different hashes).
        if enc == "map-v0.33":
            base = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}
            check(set(gpu_store) == base, f"{enc}: GPU store keys {sorted(gpu_store)}")
            check(set(cpu_store) == base | {"locality"} and cpu_store["locality"] == "LOCAL", f"{enc}: CPU store keys")
            check(gpu_store["parent_block_hash"] is None and gpu_store["extra_keys"] == [None] * 3, f"{enc}: nil fields present")
            check(lora_store["lora_name"] == "l" and lora_store["extra_keys"] == [["l"]] * 3, f"{enc}: lora")
            check(set(gpu_rm) == {"type", "block_hashes", "medium", "group_idx"}, f"{enc}: removed keys {sorted(gpu_rm)}")
            check(clear == {"type": "AllBlocksCleared"}, f"{enc}: clear")
        elif enc == "map-sparse":
            check(set(gpu_store) == {"type", "block_hashes", "token_ids", "block_size", "x_future_field"},
                  f"{enc}: GPU store keys {sorted(gpu_store)}")
            check(cpu_store["medium"] == "CPU" and "parent_block_hash" not in cpu_store, f"{enc}: CPU store")
            check(set(gpu_rm) == {"type", "block_hashes", "x_future_field"}, f"{enc}: removed keys {sorted(gpu_rm)}")
            check(clear == {"type": "AllBlocksCleared"}, f"{enc}: clear")
        elif enc == "array-sglang":
            check(len(gpu_store) == 10 and gpu_store[0] == "BlockStored" and gpu_store[6] == "GPU", f"{enc}: store len {len(gpu_store)}")
            check(lora_store[7] == "l" and lora_store[5] == 3, f"{enc}: lora fields")
            check(len(gpu_rm) == 4 and gpu_rm[0] == "BlockRemoved", f"{enc}: removed len {len(gpu_rm)}")
            check(clear == ["AllBlocksCleared"], f"{enc}: clear")
        elif enc == "array-trimmed":
            check(len(gpu_store) == 5, f"{enc}: GPU store len {len(gpu_store)}")
            check(len(cpu_store) == 7 and cpu_store[6] == "CPU", f"{enc}: CPU store len {len(cpu_store)}")
            check(len(lora_store) == 8 and lora_store[7] == "l", f"{enc}: lora store len {len(lora_store)}")
            check(len(gpu_rm) == 2 and len(cpu_rm) == 3, f"{enc}: removed lens {len(gpu_rm)}, {len(cpu_rm)}")
        elif enc == "array-future":
            check(len(gpu_store) == 17 and isinstance(gpu_store[16], dict), f"{enc}: store len {len(gpu_store)}")
            check(len(gpu_rm) == 7 and isinstance(gpu_rm[6], dict), f"{enc}: removed len {len(gpu_rm)}")
        # And the reference decoder reads every shape back into the same view.
        payload = msgspec.msgpack.encode([1.0, raw[:3], 0])
        idx: Index = {}
        apply_batch(idx, 1, 0, payload, B, None)
        r2 = EngineRank(1, 0, NullPub(), block_size=B, encoding=enc, hash_kind=hk)  # type: ignore[arg-type]
        r2.cache_prompt(list(range(1, 3 * B + 1)))
        r2.cache_prompt(list(range(1, 3 * B + 1)), medium="CPU")
        r2.cache_prompt(list(range(1, 2 * B + 1)) + [99] * B, lora_name="l", lora_id=3)
        truth = {"ranks": r2.truth()}
        check(index_view(idx) == truth_view(truth), f"{enc}: decoded view equals the engine's")


def recv_all(sock: zmq.Socket, timeout_ms: int) -> List[List[bytes]]:
    out = []
    while sock.poll(timeout_ms):
        m = sock.recv_multipart()
        out.append(m)
        if m[1] == b"" and len(m) == 4 and m[2] == END_SEQ:
            break
    return out


def unit_replay(ctx: zmq.Context) -> None:
    print("unit: replay ROUTER, drop_next, restart", flush=True)
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="t", buffer_steps=3, mode="bind", ctx=ctx, name="unit")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"t")
    sub.connect(pub.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    check(pub.wait_for_peer(5.0), "unit: SUB handshake seen by the publisher monitor")
    time.sleep(0.2)
    payloads = [pub.encode_batch([], 0, ts=float(i)) for i in range(5)]
    pub.publish_payload(payloads[0])
    pub.drop_next(2)
    for p in payloads[1:]:
        pub.publish_payload(p)
    live = []
    while sub.poll(300):
        live.append(sub.recv_multipart())
    check([int.from_bytes(m[1], "big") for m in live] == [0, 3, 4], f"unit: live seqs {[m[1] for m in live]}")
    check(all(m[0] == b"t" and len(m) == 3 for m in live), "unit: live frames [topic, seq, payload]")
    check(live[0][2] == payloads[0] and decode_batch(live[0][2])[2] == 0, "unit: payload [ts, events, rank]")

    def ask(start: int) -> List[int]:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        msgs = recv_all(dealer, 2000)
        check(bool(msgs) and msgs[-1] == [b"", b"", END_SEQ, b""], f"unit: end marker after replay from {start}")
        body = msgs[:-1]
        check(all(len(m) == 4 and m[0] == b"" and m[1] == b"t" for m in body), "unit: replay frames [b'', topic, seq, payload]")
        for m in body:
            s = int.from_bytes(m[2], "big")
            check(m[3] == payloads[s], f"unit: replayed payload of seq {s}")
        return [int.from_bytes(m[2], "big") for m in body]

    check(ask(0) == [2, 3, 4], "unit: start older than the buffer begins at the oldest kept")
    check(ask(3) == [3, 4], "unit: replay from 3")
    check(ask(5) == [], "unit: start past the head gives only the end marker")
    dealer.send_multipart([b"", (0).to_bytes(8, "big"), b"extra"])
    check(not dealer.poll(300), "unit: a malformed (4-frame) request gets no reply")
    check(ask(4) == [4], "unit: the ROUTER still serves after a malformed request")

    old_ep, old_rep = pub.endpoint, pub.replay_endpoint
    pub.restart()
    check((pub.endpoint, pub.replay_endpoint) == (old_ep, old_rep), "unit: restart rebinds the same endpoints")
    check(pub.wait_for_peer(5.0), "unit: SUB reconnected after restart")
    # libzmq re-sends a reconnected SUB's subscriptions only when the SUB socket
    # processes its commands (any call into it): keep servicing it while waiting.
    sub.poll(300)
    check(pub.publish_payload(payloads[0]) == 0, "unit: restart sets seq back to 0")
    m = sub.recv_multipart() if sub.poll(2000) else None
    check(m is not None and int.from_bytes(m[1], "big") == 0, "unit: seq 0 received after restart")
    check(ask(0) == [0], "unit: restart emptied the replay buffer")
    pub.close()
    sub.close(linger=0)
    dealer.close(linger=0)


# --------------------------------------------------------------------------------------
# 2. Drive the scenario.
# --------------------------------------------------------------------------------------

EXPECTED_DELTA = {
    "gap_replay": {"gaps": 1, "replays_ok": 1},
    "gap_clear": {"gaps": 1, "gap_clears": 1},
    "replay_range_gone": {"gaps": 1, "replay_range_gone": 1},
    "restart": {"restarts": 1},
}


def drive(ctx: zmq.Context) -> None:
    out_dir = tempfile.mkdtemp(prefix="kvr-e2e-selftest-")
    err_path = os.path.join(out_dir, "scenario.stderr")
    err = open(err_path, "w")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "scenario.py"), "--out-dir", out_dir, "--step-timeout", "60"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        bufsize=1,
    )
    lines: "queue.Queue[str]" = queue.Queue()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put("")  # EOF

    threading.Thread(target=reader, daemon=True).start()
    sub: Optional[Subscriber] = None

    def send(s: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(s + "\n")
        proc.stdin.flush()

    def next_line(timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return lines.get_nowait()
            except queue.Empty:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("no line from the scenario")
            if sub is not None:
                sub.pump(20)
            else:
                time.sleep(0.02)

    try:
        line = next_line(30)
        assert line.startswith("READY "), line
        ready = json.loads(line[len("READY "):])
        sub = Subscriber(ready, ctx)
        print(f"scenario: {sum(len(w['publishers']) for w in ready['workers'])} publishers of "
              f"{len(ready['workers'])} workers, block size {ready['block_size']}, "
              f"subscriber binds {ready['subscriber_binds']}", flush=True)
        for w in ready["workers"]:
            for d in w["publishers"]:
                print(f"  w{w['worker_id']}/dp{d['dp_rank']}: {w['encoding']}, {w['hash_kind']}, "
                      f"{d['mode']} {d['pub']} topic {d['topic']!r}, replay {d['replay']}"
                      + (f" (buffer {d['replay_buffer']})" if d["replay"] else ""), flush=True)
        send("GO")
        start_counts = {p.name: dict(p.count) for p in sub.pubs}
        start_missed = {p.name: len(p.missed) for p in sub.pubs}
        sub.shadow = copy.deepcopy(sub.index)
        while True:
            line = next_line(60)
            if line == "DONE":
                break
            assert line.startswith("PHASE "), f"unexpected line {line!r}"
            _, n, path = line.split(" ", 2)
            truth = json.load(open(path))
            want = truth_view(truth)
            expected: Dict[str, Dict[str, int]] = {p.name: {} for p in sub.pubs}
            missed_exp: Dict[str, int] = {}
            for e in truth["expect"]:
                name = f"w{e['worker_id']}/dp{e['dp_rank']}"
                expected[name] = EXPECTED_DELTA[e["kind"]]
                if "missed" in e:
                    missed_exp[name] = e["missed"]

            def deltas() -> Dict[str, Dict[str, int]]:
                out = {}
                for p in sub.pubs:
                    d = {c: p.count[c] - start_counts[p.name][c] for c in COUNTERS if c != "batches"}
                    out[p.name] = {c: v for c, v in d.items() if v}
                return out

            t0 = time.monotonic()
            while time.monotonic() - t0 < 20:
                if index_view(sub.index) == want and deltas() == expected and all(p.replay is None for p in sub.pubs):
                    break
                sub.pump(20)
            took = time.monotonic() - t0
            got = index_view(sub.index)
            nblocks = sum(len(v) for v in want.values())
            ok_index = got == want
            check(ok_index, f"phase {n}: index equals ground truth ({'; '.join(diff(got, want))})")
            check(deltas() == expected, f"phase {n}: subscriber reactions {deltas()} == expected {expected}")
            for name, m in missed_exp.items():
                p = next(p for p in sub.pubs if p.name == name)
                check(p.missed[start_missed[name]:] == [m], f"phase {n}: {name} missed {p.missed[start_missed[name]:]} == [{m}]")
            # The sequence-blind subscriber must diverge exactly on the announced ranks.
            announced = {(e["worker_id"], e["dp_rank"]) for e in truth["expect"]}
            naive_bad = ranks_differing(index_view(sub.shadow), want)
            check(naive_bad == announced, f"phase {n}: sequence-blind subscriber diverges on {sorted(naive_bad)} == {sorted(announced)}")
            reactions = ", ".join(
                f"{e['kind']} on w{e['worker_id']}/dp{e['dp_rank']}" + (f" (missed {e['missed']})" if "missed" in e else "")
                for e in truth["expect"]
            ) or "no gaps/restarts"
            print(f"phase {n} {truth['name']}: {'converged' if ok_index else 'NOT converged'} in {took:.2f} s, "
                  f"{nblocks} blocks on {len(want)} rank-tiers; {reactions}; "
                  f"sequence-blind subscriber wrong on {len(naive_bad)} rank(s)", flush=True)
            start_counts = {p.name: dict(p.count) for p in sub.pubs}
            start_missed = {p.name: len(p.missed) for p in sub.pubs}
            sub.shadow = copy.deepcopy(sub.index)
            send("NEXT")
        rc = proc.wait(timeout=20)
        check(rc == 0, f"scenario exit status {rc}")
        check(sub.stats.orphans == 0, f"{sub.stats.orphans} stores with an unknown parent")
        shapes = sorted(sub.stats.shapes)
        print("wire shapes seen: " + ", ".join(f"{k} {t} {n}" for k, t, n in shapes), flush=True)
        print("hash kinds seen: " + ", ".join(sorted(sub.stats.hash_types)), flush=True)
        for need in ("bin32", "negative-int", "uint64-high"):
            check(need in sub.stats.hash_types, f"hash kind {need} exercised")
        check({k for k, _, _ in shapes} == {"map", "array"}, "both encodings exercised")
        total = {c: sum(p.count[c] for p in sub.pubs) for c in COUNTERS}
        print("subscriber totals: " + ", ".join(f"{c} {v}" for c, v in total.items()), flush=True)
    except Exception as e:  # noqa: BLE001
        failures.append(f"driver: {type(e).__name__}: {e}")
        print(f"  FAIL: driver: {type(e).__name__}: {e}", flush=True)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()
        if sub is not None:
            sub.close()
        if failures:
            print("---- scenario stderr ----\n" + open(err_path).read(), flush=True)


def main() -> int:
    ctx = zmq.Context.instance()
    unit_encodings()
    unit_replay(ctx)
    drive(ctx)
    if failures:
        print(f"selftest: {len(failures)} failure(s)", flush=True)
        return 1
    print("selftest: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
