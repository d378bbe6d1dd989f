"""recovery.py's bind-stuck-replay scenario: kvr binds, the engines connect.

`kvr serve` only connects to publishers, so this drives libkvr's C ABI (include/kvr.h)
through ctypes: an engine, a partition, a bind-mode subscription
(`kvr_subscribe_options_new_bind`) with one route per topic
(`kvr_subscribe_options_add_route`: topic -> worker, stream, replay endpoint), and the
tiered overlap (`kvr_partition_find_matches_tiered`) and per-stream counters
(`kvr_partition_ingress_stats`) to check it against the truth.

Three real publishers (vLLM's or SGLang's, as recovery.py picks) connect to kvr's one
bound socket (their endpoint has no `*`), each with its own topic and replay endpoint.
Publisher B's replay endpoint is "stuck": a ROUTER bound at its port that never answers
(B's own publisher has no replay socket). A batch is lost on B, then on A:
  - A recovers by replay: its depths equal the truth exactly (a clear would undercount),
    without a clear, and sooner than B's stuck replay can time out (no waiting on B);
  - B recovers by clearing once its replay times out: from then on never an overcount
    (the lost batch evicted blocks; it may undercount), and what B stores after its
    recovery is counted;
  - C, which lost nothing, is untouched: exact, no gap, no clear.
This is done twice: while B's replay in flight is the probe kvr makes right after
subscribing (a join: nothing applied yet), then while it is an idle probe (B silent for
1.5 s, probed from its last batch): the second found a kvr bug (the probe's failure
did not clear the loss it held back), fixed in engine/src/ingress/sequence.
The library path comes from KVR_LIB (recovery.py's --libkvr).
"""

from __future__ import annotations

import ctypes
import os
import time
import types

from harness import free_port
from engines import BS, Check, Rank, log, overcounts, prompt
from vllm_publisher import free_port_block

# kvr's default SubscribeOptions (transport/zmq/src/subscribe.rs), which the C ABI uses:
# a replay that has no reply for this long fails.
REPLAY_TIMEOUT_S = 5.0
u32, u64, size_t, vp = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p


class Overlap(ctypes.Structure):
    _fields_ = [("worker_id", u64), ("dp_rank", u32), ("device_blocks", u32),
                ("host_blocks", u32), ("disk_blocks", u32)]


class StreamStats(ctypes.Structure):
    _fields_ = ([("worker_id", u64), ("stream", u32), ("reserved", u32)]
                + [(n, u64) for n in ("messages", "bytes", "batches", "events",
                                      "blocks_stored", "blocks_removed", "events_rejected",
                                      "block_size_mismatches")]
                + [("decode_errors", u64 * 16)]
                + [(n, u64) for n in ("bad_frames", "gaps", "restarts", "duplicates",
                                      "replays_requested", "replays_filled",
                                      "replays_incomplete", "clears", "batches_lost",
                                      "last_seq", "last_batch_unix_ms", "replays_partial",
                                      "replays_failed", "idle_probes",
                                      "events_skipped_group", "group_switches",
                                      "events_skipped_medium", "stale_since_unix_ms")]
                + [("recovering", u32), ("reserved2", u32), ("dp_rank_refused", u64),
                   ("events_skipped_malformed", u64), ("tokenless_blocks_unknown", u64),
                   ("health", u32), ("health_reason", u32), ("health_since_unix_ms", u64),
                   ("link_failures", u64)])


class Kvr:
    """The few libkvr calls the scenario needs; every status is checked."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} missing: build libkvr (cargo build --release "
                                    f"-p kvr-ffi) or pass --libkvr")
        self.lib = lib = ctypes.CDLL(path)
        for name in ("kvr_engine_free", "kvr_partition_free", "kvr_worker_free",
                     "kvr_subscribe_options_free", "kvr_subscription_free",
                     "kvr_partition_options_free"):
            getattr(lib, name).restype = None
            getattr(lib, name).argtypes = [vp]
        lib.kvr_status_str.restype = ctypes.c_char_p
        lib.kvr_status_str.argtypes = [u32]
        self.engine = self.out("kvr_engine_new", None)
        opts = self.out("kvr_partition_options_new", u32(BS))
        self.partition = self.out("kvr_engine_create_partition", self.engine, b"m", size_t(1),
                                  b"g", size_t(1), opts)
        lib.kvr_partition_options_free(opts)
        self.sub = None

    def call(self, name: str, *args) -> None:
        fn = getattr(self.lib, name)
        fn.restype = u32
        st = fn(*args)
        if st != 0:
            raise RuntimeError(f"{name}: {self.lib.kvr_status_str(st).decode()}")

    def out(self, name: str, *args):
        h = vp()
        self.call(name, *args, ctypes.byref(h))
        return h

    def add_worker(self, worker_id: int) -> None:
        w = self.out("kvr_worker_new", u64(worker_id), u32(1))
        self.call("kvr_partition_upsert_worker", self.partition, w)
        self.lib.kvr_worker_free(w)

    def subscribe_bind(self, endpoint: str, routes: list[tuple[str, int, str | None]]):
        ep = endpoint.encode()
        opts = self.out("kvr_subscribe_options_new_bind", ep, size_t(len(ep)))
        for topic, worker_id, replay in routes:
            t, r = topic.encode(), (replay or "").encode()
            self.call("kvr_subscribe_options_add_route", opts, t, size_t(len(t)),
                      u64(worker_id), u32(0), r or None, size_t(len(r)))
        self.sub = self.out("kvr_partition_subscribe", self.partition, opts)
        self.lib.kvr_subscribe_options_free(opts)

    def overlap(self, tokens: list[int]) -> dict:
        """{(worker, rank): (device, host)}, as recovery.overlap gives kvr serve's."""
        n = len(tokens) // BS
        toks = (u32 * len(tokens))(*tokens)
        local, got = (u64 * max(n, 1))(), size_t()
        self.call("kvr_partition_hash_tokens", self.partition, None, size_t(0), toks,
                  size_t(len(tokens)), local, None, size_t(n), ctypes.byref(got))
        out, cap = (Overlap * 16)(), 16
        self.call("kvr_partition_find_matches_tiered", self.partition, local, size_t(got.value),
                  out, size_t(cap), ctypes.byref(got))
        return {(o.worker_id, o.dp_rank): (o.device_blocks, o.host_blocks)
                for o in out[: got.value]}

    def stats(self) -> dict[int, StreamStats]:
        out, got = (StreamStats * 16)(), size_t()
        self.call("kvr_partition_ingress_stats", self.partition, out, size_t(16),
                  ctypes.byref(got))
        return {s.worker_id: s for s in out[: got.value]}

    def close(self) -> None:
        self.lib.kvr_subscription_free(self.sub)  # stops and joins first
        self.lib.kvr_partition_free(self.partition)
        self.lib.kvr_engine_free(self.engine)


def summary(s: StreamStats) -> str:
    return (f"batches {s.batches}, gaps {s.gaps}, replays {s.replays_requested} asked / "
            f"{s.replays_filled} filled / {s.replays_incomplete} incomplete, "
            f"clears {s.clears}, lost {s.batches_lost}")


class Engines:
    """The three publishers and kvr, for the scenario's checks."""

    def __init__(self, fl, kvr: Kvr, timeout: float):
        import zmq
        self.kvr, self.check = kvr, Check(None, timeout, kvr.overlap)
        bind = f"tcp://127.0.0.1:{free_port()}"
        replay = free_port_block(3)
        # B's replay endpoint: bound, never answering (its publisher has none).
        self.stuck = zmq.Context.instance().socket(zmq.ROUTER)
        self.stuck.bind(f"tcp://127.0.0.1:{replay + 1}")
        self.w = {}
        routes = []
        for i, name in enumerate("ABC"):
            wid, topic = 301 + i, f"kv-{name}"
            own = None if name == "B" else f"tcp://*:{replay + i}"
            r = Rank(fl, bind, own, 0, topic)
            self.w[name] = types.SimpleNamespace(worker_id=wid, ranks=[r])
            routes.append((topic, wid, f"tcp://127.0.0.1:{replay + i}"))
            kvr.add_worker(wid)
        kvr.subscribe_bind(bind, routes)

    def rank(self, name: str) -> Rank:
        return self.w[name].ranks[0]

    def bad(self, names: str, prompts) -> list:
        return self.check.mismatches([self.w[n] for n in names], prompts)

    def converge(self, what: str, names: str, prompts, within: float) -> float | None:
        """Seconds until `names` equal the truth, or None after `within` seconds."""
        t0 = time.time()
        while True:
            bad = self.bad(names, prompts)
            if not bad:
                log(f"{what}: converged in {time.time() - t0:.2f} s")
                return time.time() - t0
            if time.time() - t0 > within:
                log(f"{what}: FAILED, (worker, rank, prompt, want, got): {bad}")
                return None
            time.sleep(0.05)

    def overcount(self, prompts) -> list:
        return [b for b in self.bad("ABC", prompts) if overcounts(b[3], b[4])]

    def close(self) -> None:
        self.kvr.close()
        for n in "ABC":
            self.rank(n).close()
        self.stuck.close(linger=0)


def wait(cond, within: float) -> bool:
    deadline = time.time() + within
    while not cond():
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


def in_flight(s: StreamStats) -> int:
    """The stream's replays asked for and not ended (one at most: a new one supersedes)."""
    return s.replays_requested - s.replays_filled - s.replays_incomplete


def run(fl, check):
    """Returns (engines, ok, known_bug_ok): `ok` for what kvr already does right, the
    last for the loss during B's idle probe (KNOWN_BUG)."""
    kvr = Kvr(os.environ["KVR_LIB"])
    e = Engines(fl, kvr, check.timeout)
    A, B, C = e.rank("A"), e.rank("B"), e.rank("C")
    b = lambda: kvr.stats()[302]  # noqa: E731
    p = {n: [prompt(base + 1000 * k, 4) for k in range(5)]
         for n, base in (("A", 21000), ("B", 31000), ("C", 41000))}
    prompts = [q for n in "ABC" for q in p[n]]
    fails: list[str] = []

    def losses(phase: str, b_lost: list, b_live: list[int], a_lost: list, a_live: list[int]):
        """A batch lost on B, then one on A (each seen at the next live batch), while B's
        replay, at its stuck endpoint, is in flight: A must replay, and at once."""
        if not in_flight(b()):
            fails.append(f"{phase}: no replay of B's in flight (the scenario's premise)")
        B.publish(b_lost, drop=True)
        B.publish([B.stored(b_live)])
        A.publish(a_lost, drop=True)
        A.publish([A.stored(a_live)])
        took = e.converge(f"bind-stuck-replay ({phase}: A replayed, C untouched)", "AC",
                          prompts, REPLAY_TIMEOUT_S)
        if took is None or took > REPLAY_TIMEOUT_S / 2:
            fails.append(f"{phase}: A's recovery took {took} s, not under "
                         f"{REPLAY_TIMEOUT_S / 2} s (it waited for B's stuck replay?)")

    def b_recovered(phase: str, clears: int) -> list[str]:
        """B's stuck replay times out: B must be cleared, and never overcount from then."""
        wait(lambda: not in_flight(b()), REPLAY_TIMEOUT_S + 2)
        cleared = b().clears > clears
        over = e.overcount(prompts)
        if cleared and not over:
            return []
        return [f"{phase}: B's replay ended ({summary(b())}) with B "
                f"{'cleared' if cleared else 'NOT cleared'}, overcounts (worker, rank, "
                f"prompt, want, got): {over}"]

    time.sleep(1.0)  # the publishers connect to kvr's socket (before, PUB drops)
    for n, r in (("A", A), ("B", B), ("C", C)):
        r.publish([r.stored(p[n][0])])
    if e.converge("bind-stuck-replay (A and C live)", "AC", prompts, check.timeout) is None:
        fails.append("A and C did not count their live stores")
    # Phase 1: every route is probed once subscribed; B's probe (a join: nothing applied
    # before it) hangs at the stuck endpoint, and B's loss falls in it.
    clears = b().clears
    losses("join probe", [B.removed(p["B"][0], 1)], p["B"][1],
           [A.removed(p["A"][0], 2), A.stored(p["A"][1])], p["A"][2])
    fails += b_recovered("join probe", clears)
    # After the clear B may undercount what it held before (the truth stays what the
    # engine holds); what it stores now is counted.
    B.publish([B.stored(p["B"][2])])
    C.publish([C.stored(p["C"][1])])
    if e.converge("bind-stuck-replay (B live again)", "B", [p["B"][2]], check.timeout) is None:
        fails.append("B did not count its store after its clear")
    # Phase 2: after 1.5 s of silence B is probed again (from its last batch), at the
    # stuck endpoint; a loss on B now is only known from the live batch it holds back.
    requested = b().replays_requested
    wait(lambda: b().replays_requested > requested, REPLAY_TIMEOUT_S)
    clears = b().clears
    losses("idle probe", [B.removed(p["B"][2], 2)], p["B"][3],
           [A.removed(p["A"][1], 1), A.stored(p["A"][3])], p["A"][4])
    known = b_recovered("idle probe", clears)
    st = kvr.stats()
    for n, wid in (("A", 301), ("B", 302), ("C", 303)):
        log(f"bind-stuck-replay: {n} (worker {wid}): {summary(st[wid])}")
    if st[301].clears or st[301].replays_filled < 2:
        fails.append("A was cleared, or recovered without replays")
    if st[303].gaps or st[303].clears:
        fails.append("C, which lost nothing, saw a gap or a clear")
    for f in fails + known:
        log(f"bind-stuck-replay: FAILED: {f}")
    return e, not fails, not known
