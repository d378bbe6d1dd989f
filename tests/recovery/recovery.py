"""Ingress recovery (hybrid KV-cache groups, host tiers) against the real vLLM 0.33.0 and
SGLang 0.5.23 publishers.

Each scenario drives one engine's own `ZmqEventPublisher` — vLLM's
`vllm/distributed/kv_events.py` or SGLang's `sglang/srt/disaggregation/kv_events.py`,
each imported from its wheel with small stubs (tests/compat/vllm_publisher.py,
tests/compat/sglang_publisher.py) — into `kvr serve`, which subscribes with kvr's own
ZMQ subscriber, and then compares every prompt's cached depth per (worker, DP rank) and
tier — device, then the host blocks extending it, from `/overlap_scores` — with what the
engine holds. Any overcount fails, as does a depth that never reaches the truth. Every
scenario runs once per publisher, against a fresh `kvr serve`.

A lost batch is made the way the network loses one: the publisher's PUB socket is wrapped
so that its next N sends are dropped, while the engine's code still numbers them and keeps
them in its replay buffer (exactly what a slow joiner or a full high-water mark does). A
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
                            (vLLM only: SGLang's events have no group_idx; logged as a skip)
  host-tier                 write-back to the host tier (vLLM "CPU", SGLang HiCache
                            "CPU_PINNED"), device evictions, host-only stores: counted in
                            the host tier, never in device
  extra-keys                equal placeholder tokens with images A / B (vLLM extra_keys
                            (identifier, offset) pairs) or a cache salt (vLLM's bare string
                            on block 0, SGLang's cache_salt field): a request's mm_inputs /
                            cache_salt match only the worker holding the same ones
  connector-shapes          vLLM 0.34's offloading placeholders (no tokens) and a Mamba
                            state checkpoint beside device stores in one batch, and stores
                            hashed with speculative lookahead: the device blocks indexed,
                            host copies counted, lookahead blocks only where the prompt
                            continues with their lookahead tokens (vLLM only: SGLang has no
                            lookahead field; logged as a skip)
  bin-hashes                blocks named by 32-byte digests (msgpack bin), an eviction lost
                            (vLLM only: SGLang's hashes are ints; logged as a skip)
  bind-stuck-replay         kvr binds one socket (the C ABI through ctypes: kvr serve only
                            connects) and three publishers connect to it, each with its
                            topic and replay endpoint; B's replay ROUTER never answers. A
                            batch lost on A is replayed (exact) without waiting for B's,
                            B recovers by clearing, C is untouched (bind_ctypes.py)
  restore-from-checkpoint   an engine restored from a checkpoint on the same endpoints
                            (numbers going on from the checkpoint's, the old replay buffer,
                            AllBlocksCleared first): kvr clears and goes on, no replay asked
  loss-during-idle-probe    a rank whose replay endpoint never answers loses a batch while
                            an idle probe is in flight: the probe's failure must clear it
Scenarios hit by a kvr bug keep that part as an expected failure (KNOWN_BUGS).

Usage: python recovery.py [--kvr-bin target/release/kvr] [--libkvr target/release/libkvr.so]
                          [--publisher vllm|sglang|all] [--only NAME] [--timeout S]
                          [--negative]
Exit status 0 when every scenario converged to the truth without overcounting (a scenario
a publisher cannot run is skipped with its reason logged).
--negative is the check's control: kvr serve without idle probes
(--kv-events-idle-probe-ms 0) must fail, for every publisher, the two scenarios only a
probe can recover (gap-at-end-of-burst keeps an evicted block: an overcount;
join-after-last-batch holds nothing).
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "compat"))

from harness import free_port, http  # noqa: E402
from engines import (  # noqa: E402
    BS, MODEL, Check, Flavor, Worker, flavor, log, overcounts, prompt,
)


# ------------------------------------------------------------------ scenarios

def gap_at_end_of_burst(fl, base, check):
    w = Worker(fl, 101)
    w.register(base)
    r = w.ranks[0]
    time.sleep(1.0)  # the SUB connects (the publisher drops what it sends before)
    p, q = prompt(1000, 4), prompt(2000, 4)
    r.publish([r.stored(p)])
    r.publish([r.stored(q)])
    ok = check.converge("gap-at-end-of-burst (before the loss)", [w], [p, q])
    # The burst's last batch (Q's blocks leave) is lost; the engine then goes idle.
    r.publish([r.removed(q, 1)], drop=True)
    ok &= check.converge("gap-at-end-of-burst", [w], [p, q])
    return w, ok


def join_after_last_batch(fl, base, check):
    w = Worker(fl, 102)
    r = w.ranks[0]
    p, q = prompt(3000, 3), prompt(4000, 5)
    r.publish([r.stored(p)])  # nobody subscribed yet: dropped by ZMQ, kept for replay
    r.publish([r.stored(q)])
    r.publish([r.removed(q, 3)])
    w.register(base)
    return w, check.converge("join-after-last-batch", [w], [p, q])


def restart(fl, base, check, name, worker_id, start, n_old, n_missed):
    """The old instance publishes n_old batches; the new one's first n_missed are lost,
    then one arrives live with seq n_missed."""
    w = Worker(fl, worker_id)
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


def restart_back_to_zero(fl, base, check):
    # The first live batch of the new instance has seq 2 < the old last 4.
    return restart(fl, base, check, "restart-back-to-zero", 103, 5000, 5, 2)


def restart_at_old_last_seq(fl, base, check):
    # The first live batch of the new instance has seq 3 == the old last.
    return restart(fl, base, check, "restart-at-old-last-seq", 104, 7000, 4, 3)


def dp2_one_replay_dead(fl, base, check):
    w = Worker(fl, 105, dp_size=2, dead_replay_ranks=(1,))
    r0, r1 = w.ranks
    p0, p1, p1b = prompt(9000, 4), prompt(9500, 2), prompt(9800, 3)
    r1.publish([r1.stored(p1)])  # before kvr subscribed: rank 1 must replay, and cannot
    w.register(base)
    time.sleep(1.0)
    r0.publish([r0.stored(p0)])
    r1.publish([r1.stored(p1b)])  # seq 1: a late join on rank 1, its replay times out
    # Undercounting rank 1's first store is what a dead replay endpoint costs; kvr must
    # not touch rank 0. The truth for the check: rank 1 lost p1 for good.
    r1.forget(p1)
    ok = check.converge("dp2-one-replay-dead", [w], [p0, p1, p1b], settle=6.5)
    return w, ok


def hybrid_groups(fl, base, check):
    """gpt-oss-like: each batch stores in group 0 (full attention) and group 1 (sliding
    window); the window evicts the blocks it slid past, the full group keeps them."""
    w = Worker(fl, 106)
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


def host_tier(fl, base, check):
    """The engine writes its device blocks back to the host tier (vLLM's CPU offload,
    SGLang's HiCache), evicts from device, loads blocks that are only on the host, then
    evicts from the host: a host block counts as host (extending the device prefix), never
    as device."""
    host = fl.host_medium
    w = Worker(fl, 107)
    w.register(base)
    r = w.ranks[0]
    time.sleep(1.0)
    p, q = prompt(13000, 6), prompt(14000, 4)
    r.publish([r.stored(p)])
    r.publish([r.stored(p, medium=host)])  # write-back: on both tiers
    ok = check.converge(f"host-tier ({host} write-back)", [w], [p, q])
    r.publish([r.removed(p, 3)])  # the device evicts; the host copy stays
    r.publish([r.stored(q, medium=host)])  # on the host only
    ok &= check.converge(f"host-tier (device eviction, {host}-only store)", [w], [p, q])
    r.publish([r.removed(p, 4, medium=host)], drop=True)  # a host eviction, lost
    ok &= check.converge(f"host-tier ({host} eviction lost, recovered)", [w], [p, q])
    return w, ok


def connector_shapes(fl, base, check):
    """What vLLM 0.34 sends beside its device events, in the same batches: the offloading
    connector's tokenless placeholders of host copies, a hybrid model's Mamba group (its
    device store naming the blocks it keeps a state for, and a state checkpoint offloaded
    to host memory), and stores hashed with speculative lookahead. Every device block must
    be indexed (such a batch used to be refused whole), each host copy counted where kvr
    knows its tokens, the hybrid rank's prefix only up to its last recurrent state, and a
    lookahead block only where the prompt continues with its lookahead tokens (never at a
    divergence or a prompt's tail)."""
    plain, ahead = Worker(fl, 112), Worker(fl, 113)
    for w in (plain, ahead):
        w.register(base)
    r, la = plain.ranks[0], ahead.ranks[0]
    la.lookahead = 2
    time.sleep(1.0)
    p, q = prompt(20000, 6), prompt(21000, 6)
    # One scheduler step: the Mamba group's device store first (states at blocks 2 and 5
    # of q), device stores, host placeholders of blocks 0..3, the state checkpoint of
    # block 3 offloaded to host memory, and another device store after them.
    r.publish([r.recurrent(q, [2, 5]), r.stored(p[: 4 * BS]),
               *r.placeholders(p, range(4), "CPU"), r.checkpoint(p, 3, "CPU"),
               r.stored(q)])
    la.publish([la.stored(q)])
    # The lookahead rank's prompts: its own, a divergence right after block 0 (its
    # lookahead differs), and its prompt cut after block 1 (block 1's lookahead missing).
    diverged = q[:BS] + [7] + q[BS + 1:]
    prompts = [p, q, diverged, q[: 2 * BS], q[: 2 * BS + 2], q[: 4 * BS]]
    ok = check.converge("connector-shapes (placeholders, checkpoint, lookahead)",
                        [plain, ahead], prompts)
    # The device evicts; the host copies stay and extend the device prefix. The Mamba
    # group drops q's last state: q's prefix now ends at block 2's.
    r.publish([r.removed(p[: 4 * BS], 2), r.removed(q, 5, group=1)])
    la.publish([la.removed(q, 3)])
    ok &= check.converge("connector-shapes (device evictions, host copies stay)",
                         [plain, ahead], prompts)
    return [plain, ahead], ok


def restore_from_checkpoint(fl, base, check):
    """An engine restored from a checkpoint on the same endpoints: its batch numbers go
    on from the checkpoint's (behind what kvr applied), its replay buffer is the old
    instance's, and its first batch clears everything. That clear is a fence: kvr clears
    and goes on from it without asking a replay (the old history it would bring is cleared
    anyway). Run with idle probes off, so that any replay counted is the restore's."""
    w = Worker(fl, 114)
    w.register(base)
    r = w.ranks[0]
    time.sleep(1.0)
    p, q = prompt(22000, 4), prompt(23000, 3)
    for i in range(4):
        r.publish([r.stored(p[: (i + 1) * BS])])  # batches 0..3
    ok = check.converge("restore-from-checkpoint (before)", [w], [p, q])
    replays = metric(base, "kvr_kv_stream_replays_total", 114)
    # The checkpoint was taken after batch 1: the restored engine numbers from 2 on, its
    # replay buffer as it was then.
    r.pub._seq_gen = itertools.count(2)
    kept = [b for b in r.pub._buffer if b[0] < 2]
    r.pub._buffer.clear()
    r.pub._buffer.extend(kept)
    r.forget(p)
    r.publish([fl.kv.AllBlocksCleared(), r.stored(q)])
    ok &= check.converge("restore-from-checkpoint (restored, cleared)", [w], [p, q])
    asked = metric(base, "kvr_kv_stream_replays_total", 114) - replays
    if asked:
        log(f"restore-from-checkpoint: {asked:.0f} replay(s) asked; a fence needs none")
        ok = False
    return w, ok


def extra_keys(fl, base, check):
    """Equal tokens, different images or cache salts, are different blocks (REFERENCE.md
    §9): engines publish them with vLLM's `extra_keys` ((mm identifier, offset) pairs, a
    bare salt string on block 0) or SGLang's `cache_salt` field, and a request naming the
    same inputs (`mm_inputs`, `cache_salt`) matches exactly its own blocks."""
    tokens = [7] * (2 * BS)  # placeholder tokens: the same for every image
    hashes = fl.hashes(tokens, BS)
    # An image on tokens 4..20: block 0 holds it from offset 4, block 1 from offset -12.
    img = lambda i: [[(i, 4)], [(i, 4 - BS)]]  # noqa: E731
    stores = {}  # worker: the store it publishes
    if "extra_keys" in fl.stored_fields:
        stores[120] = fl.keyed(hashes, tokens, extra_keys=img("imgA"))
        stores[121] = fl.keyed(hashes, tokens, extra_keys=img("imgB"))
        stores[122] = fl.keyed(hashes, tokens, extra_keys=[["s1"], None])
    else:
        log(f"extra-keys: {fl.name}'s BlockStored has no extra_keys: images not tested")
    if "cache_salt" in fl.stored_fields:
        stores[123] = fl.keyed(hashes, tokens, cache_salt="s1")
    workers = {wid: Worker(fl, wid) for wid in stores}
    for w in workers.values():
        w.register(base)
    time.sleep(1.0)
    for wid, ev in stores.items():
        workers[wid].ranks[0].publish([ev])
    mm = lambda i: [{"identifier": i, "offset": 4, "length": BS}]  # noqa: E731
    # (request extras, the workers that hold both blocks of that request; all others: 0)
    cases = [({"mm_inputs": mm("imgA")}, {120}), ({"mm_inputs": mm("imgB")}, {121}),
             ({"mm_inputs": mm("imgC")}, set()), ({"cache_salt": "s1"}, {122, 123}),
             ({"cache_salt": "s2"}, set()), ({}, set())]
    ok = True
    deadline = time.time() + check.timeout
    for extra, holders in cases:
        want = {wid: (2 if wid in holders else 0) for wid in stores}
        while True:
            st, body, _ = http(base, "POST", "/overlap_scores",
                               {"model_name": MODEL, "token_ids": tokens, **extra})
            assert st == 200, (st, body)
            got = {w["worker_id"]: w.get("device_blocks", 0) for w in body["workers"]}
            have = {wid: got.get(wid, 0) for wid in stores}
            if have == want or time.time() > deadline:
                break
            time.sleep(0.1)
        log(f"extra-keys {extra}: want {want}, got {have}")
        ok &= have == want
    return list(workers.values()), ok


def bin_hashes(fl, base, check):
    """Blocks named by 32-byte digests (vLLM's sha256 hashing sends them as msgpack bin):
    stores, an eviction and a lost eviction recovered by replay."""
    w = Worker(fl, 124)
    w.register(base)
    r = w.ranks[0]
    r.bin = True
    time.sleep(1.0)
    p, q = prompt(17000, 5), prompt(18000, 3)
    r.publish([r.stored(p), r.stored(q)])
    ok = check.converge("bin-hashes (stored)", [w], [p, q])
    r.publish([r.removed(p, 3)])
    r.publish([r.removed(q, 1)], drop=True)
    ok &= check.converge("bin-hashes (evicted, one eviction lost)", [w], [p, q])
    return w, ok


def metric(base: str, name: str, worker_id: int) -> float:
    """A per-stream gauge or counter of kvr serve's /metrics (stream 0's)."""
    text = http(base, "GET", "/metrics")[1]["<text>"]
    for line in text.splitlines():
        if line.startswith(name + "{") and f'worker_id="{worker_id}"' in line \
                and 'stream="0"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def loss_during_idle_probe(fl, base, check):
    """A rank whose replay endpoint never answers (registered, nobody bound there) is
    probed again and again; a batch lost while a probe is in flight must still end in a
    clear when that probe fails (an undercount is allowed, never an overcount). kvr serve
    runs with a 300 ms probe and a 2 s replay timeout here (SCENARIOS)."""
    w = Worker(fl, 108, dead_replay_ranks=(0,))
    w.register(base)
    r = w.ranks[0]
    time.sleep(1.0)
    p, q = prompt(15000, 4), prompt(16000, 3)
    r.publish([r.stored(p)])  # applies at once, probe or not
    ok = check.converge("loss-during-idle-probe (live)", [w], [p])
    recovering = lambda: metric(base, "kvr_kv_stream_recovering", 108)  # noqa: E731
    deadline = time.time() + 10
    while recovering() and time.time() < deadline:  # a probe in flight: wait for the next
        time.sleep(0.02)
    while not recovering() and time.time() < deadline:
        time.sleep(0.02)
    log(f"loss-during-idle-probe: probe {metric(base, 'kvr_kv_stream_idle_probes_total', 108):.0f} "
        f"in flight; a removal is lost, then a store arrives")
    r.publish([r.removed(p, 1)], drop=True)
    r.publish([r.stored(q)])
    while recovering() and time.time() < deadline + 5:
        time.sleep(0.05)
    time.sleep(0.3)
    bad = check.mismatches([w], [p, q])
    over = [b for b in bad if overcounts(b[3], b[4])]
    q_ok = not [b for b in bad if b[2] == q[0]]
    log(f"loss-during-idle-probe: after the probe failed: clears "
        f"{metric(base, 'kvr_kv_stream_clears_total', 108):.0f}, mismatches {bad}")
    return w, ok, not over and q_ok


def bind_stuck_replay(fl, base, check):
    import bind_ctypes  # the C ABI through ctypes; needs --libkvr, not kvr serve
    return bind_ctypes.run(fl, check)  # (engines, ok, the KNOWN_BUGS part's ok)


# name: (function, what it needs of the publisher, whether it runs against kvr serve)
SCENARIOS = {
    "gap-at-end-of-burst": (gap_at_end_of_burst, (), True),
    "join-after-last-batch": (join_after_last_batch, (), True),
    "restart-back-to-zero": (restart_back_to_zero, (), True),
    "restart-at-old-last-seq": (restart_at_old_last_seq, (), True),
    "dp2-one-replay-dead": (dp2_one_replay_dead, (), True),
    "hybrid-groups": (hybrid_groups, ("groups",), True),
    "host-tier": (host_tier, (), True),
    "extra-keys": (extra_keys, (), True),
    "connector-shapes": (connector_shapes, ("groups", "lookahead"), True),
    "bin-hashes": (bin_hashes, ("bin",), True),
    # its own kvr serve: probes every 300 ms of silence, replays time out after 2 s
    "loss-during-idle-probe": (loss_during_idle_probe, (),
                               ["--kv-events-idle-probe-ms", "300",
                                "--kv-events-replay-timeout-ms", "2000"]),
    "bind-stuck-replay": (bind_stuck_replay, (), False),
    "restore-from-checkpoint": (restore_from_checkpoint, (),
                                ["--kv-events-idle-probe-ms", "0"]),
}
NEGATIVE = ["gap-at-end-of-burst", "join-after-last-batch"]
# Scenarios with a part that fails because of a kvr bug (not of the test): that part is
# an expected failure, logged as such; once it passes, the run fails until it is removed
# here (the fix is then guarded by the scenario).
KNOWN_BUGS: dict[str, str] = {
    # none open. Fixed: "a loss found while an idle probe is in flight is never
    # recovered" (loss-during-idle-probe, bind-stuck-replay), in
    # engine/src/ingress/sequence/mod.rs: a live batch held during a probe makes it a gap
    # recovery.
}


def serve(kvr_bin: str, extra: list[str]):
    """A fresh `kvr serve`, healthy: (process, base URL, log path)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    logf = tempfile.NamedTemporaryFile(prefix="kvr-recovery-", suffix=".log", delete=False)
    svc = subprocess.Popen([kvr_bin, "serve", "--port", str(port)] + extra,
                           stdout=logf, stderr=logf)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if http(base, "GET", "/health")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.1)
    return svc, base, logf.name


def run_publisher(fl: Flavor, names: list[str], args, extra: list[str]):
    """Runs `names` against publisher `fl`: (failed, skipped, passed, expected failures)
    scenario names."""
    failed, skipped, passed, xfailed = [], [], [], []
    svc = base = logname = None
    workers = []
    try:
        for name in names:
            fn, needs, served = SCENARIOS[name]
            why = fl.lacks(needs)
            if why:
                log(f"== {fl.name}/{name}: SKIPPED: {why}")
                skipped.append(name)
                continue
            own = None
            if isinstance(served, list):  # a kvr serve of its own, with these options
                own = svc, base, logname
                svc, base, logname = serve(args.kvr_bin, extra + served)
            elif served and svc is None:
                svc, base, logname = serve(args.kvr_bin, extra)
            log(f"== {fl.name}/{name}")
            t0 = time.time()
            # A scenario may return a third value: whether its bug-prone part held.
            w, ok, *part = fn(fl, base, Check(base, args.timeout))
            workers.extend(w if isinstance(w, list) else [w])
            verdict = "ok" if ok else "FAILED"
            bug = KNOWN_BUGS.get(name)
            if part and not part[0] and bug:
                log(f"{fl.name}/{name}: EXPECTED FAILURE, known kvr bug: {bug}")
                verdict += " (but for the known bug)"
                if ok:
                    xfailed.append(name)
            elif part and not part[0]:
                ok, verdict = False, "FAILED"
            elif bug:
                log(f"{fl.name}/{name}: the known kvr bug no longer shows: remove it from "
                    f"KNOWN_BUGS")
                ok, verdict = False, "FAILED (known bug gone)"
            log(f"{fl.name}/{name}: {verdict} in {time.time() - t0:.1f} s")
            if ok and name not in xfailed:
                passed.append(name)
            elif not ok:
                failed.append(name)
            if own is not None:
                svc.terminate()
                svc.wait(timeout=20)
                svc, base, logname = own
    finally:
        # In parallel: SGLang's shutdown often waits its full second for a sentinel its
        # thread never takes (kv_events.py's own race), and vLLM's can too.
        closing = [threading.Thread(target=w.close) for w in workers]
        for t in closing:
            t.start()
        for t in closing:
            t.join()
        if svc is not None:
            svc.terminate()
            svc.wait(timeout=20)
    if failed and logname:
        log(f"{fl.name}: kvr serve's log: {logname}")
    return failed, skipped, passed, xfailed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    ap.add_argument("--kvr-bin", default=os.environ.get("KVR_BIN", os.path.join(target, "release", "kvr")))
    ap.add_argument("--libkvr", default=os.environ.get("KVR_LIB", os.path.join(target, "release", "libkvr.so")))
    ap.add_argument("--publisher", choices=["vllm", "sglang", "all"], default="all")
    ap.add_argument("--only", action="append", choices=sorted(SCENARIOS))
    ap.add_argument("--timeout", type=float, default=15.0)
    ap.add_argument("--negative", action="store_true")
    args = ap.parse_args(argv)
    os.environ["KVR_LIB"] = args.libkvr  # for bind_ctypes
    extra = []
    names = args.only or list(SCENARIOS)
    if args.negative:
        extra = ["--kv-events-idle-probe-ms", "0"]
        names = NEGATIVE
        args.timeout = min(args.timeout, 5.0)
    flavors = ["vllm", "sglang"] if args.publisher == "all" else [args.publisher]
    results = {}
    t0 = time.time()
    for name in flavors:
        results[name] = run_publisher(flavor(name), names, args, extra)
    elapsed = time.time() - t0
    if args.negative:
        passed = [f"{f}/{n}" for f, (_, _, ok, _) in results.items() for n in ok]
        if passed:
            log(f"negative control FAILED: {', '.join(passed)} converged without idle probes")
            return 1
        log(f"negative control: without idle probes, for {' and '.join(flavors)}, both "
            f"scenarios stay wrong, as they must ({elapsed:.0f} s)")
        return 0
    for f, (failed, skipped, passed, xfailed) in results.items():
        log(f"{f}: {len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped, "
            f"{len(xfailed)} expected failures"
            + (f" (failed: {', '.join(failed)})" if failed else "")
            + (f" (expected: {', '.join(xfailed)})" if xfailed else ""))
    n_failed, n_skipped, n_passed, n_xfailed = (sum(len(r[i]) for r in results.values())
                                                for i in range(4))
    log(f"{elapsed:.0f} s; {n_xfailed} expected failures (KNOWN_BUGS)")
    # Skipped and expected failures both count as skipped in the closing line.
    print(f"recovery: {n_passed} passed, {n_failed} failed, {n_skipped + n_xfailed} skipped",
          flush=True)
    return 1 if n_failed else 0


if __name__ == "__main__":
    sys.exit(main())
