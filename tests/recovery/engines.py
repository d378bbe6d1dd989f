"""The engines and the truth of tests/recovery: each engine's real publisher module
(`Flavor`: vLLM 0.33.0's or SGLang 0.5.23's `kv_events.py`), its DP ranks with the blocks
they hold per tier (`Rank`, `Worker`), and the check that compares kvr's answer with that
truth until they agree (`Check`: any overcount fails)."""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "compat"))

from harness import http  # noqa: E402
import sglang_publisher  # noqa: E402
import vllm_publisher  # noqa: E402
from vllm_publisher import free_port_block  # noqa: E402

MODEL = "m"
BS = 16
# The truth's tiers, by medium (REFERENCE.md §9): what each medium means for a router.
TIERS = {"GPU": "device", "DEVICE": "device", "CPU": "host", "CPU_PINNED": "host",
         "CPU_TIER1": "host"}


def log(msg: str) -> None:
    print(f"[recovery] {msg}", file=sys.stderr, flush=True)


class Flavor:
    """One engine's real publisher module: how to build its publisher and its events, and
    what its events can say (read from the module, not assumed)."""

    def __init__(self, name: str, kv, hashes, rank_arg: str, host_medium: str):
        self.name, self.kv, self.hashes = name, kv, hashes
        self.rank_arg, self.host_medium = rank_arg, host_medium
        self.stored_fields = set(kv.BlockStored.__struct_fields__)
        self.removed_fields = set(kv.BlockRemoved.__struct_fields__)
        self.groups = "group_idx" in self.stored_fields and "group_idx" in self.removed_fields
        # vLLM types a block hash as `bytes | int` (sha256 digests go out as bin).
        self.bin_hashes = "bytes" in str(kv.BlockStored.__annotations__.get("block_hashes"))

    def publisher(self, dp_rank: int, endpoint: str, replay_endpoint: str | None, topic: str):
        # Both engines offset both ports by the DP rank themselves.
        return self.kv.ZmqEventPublisher(**{self.rank_arg: dp_rank}, endpoint=endpoint,
                                         replay_endpoint=replay_endpoint, topic=topic)

    def batch(self, events: list):
        return self.kv.KVEventBatch(ts=time.time(), events=events)

    def _event(self, cls, fields: set, group: int, **kw):
        assert group == 0 or self.groups, f"{self.name} has no KV-cache groups"
        return cls(**{k: v for k, v in kw.items() if k in fields})

    def stored(self, hashes, tokens, medium: str, group: int, kind: str, lookahead=None):
        kw = {} if lookahead is None else {"lookahead_token_ids": lookahead}
        return self._event(
            self.kv.BlockStored, self.stored_fields, group, block_hashes=hashes,
            parent_block_hash=None, token_ids=tokens, block_size=BS, lora_id=None,
            medium=medium, lora_name=None, extra_keys=[None] * len(hashes),
            group_idx=group, kv_cache_spec_kind=kind, **kw)

    def placeholder(self, block_hash, medium: str, group: int):
        """vLLM's offloading connector's announcement of a host or disk copy without its
        tokens (vLLM 0.34's `_placeholder_stored`, sent unless `self_describing_kv_events`
        is set): one hash, no parent, no tokens, block size 0."""
        return self.kv.BlockStored(
            block_hashes=[block_hash], parent_block_hash=None, token_ids=[], lora_id=None,
            block_size=0, medium=medium, lora_name=None, group_idx=group,
            kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None)

    def checkpoint(self, block_hash, parent, medium: str, group: int):
        """A recurrent (Mamba) group's state checkpoint as vLLM 0.34's offloading tracker
        reduces a chunk to it (`_as_state_checkpoint`): the chunk's last hash, its parent,
        no tokens, kind "mamba"."""
        return self.kv.BlockStored(
            block_hashes=[block_hash], parent_block_hash=parent, token_ids=[], lora_id=None,
            block_size=BS, medium=medium, lora_name=None, group_idx=group,
            kv_cache_spec_kind="mamba", kv_cache_spec_sliding_window=None)

    def keyed(self, hashes, tokens, extra_keys=None, cache_salt=None):
        """A device store whose blocks carry extra keys (vLLM's `extra_keys`, one entry per
        block) or a request salt (SGLang's `cache_salt` field), whichever the module has."""
        kw = dict(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                  block_size=BS, lora_id=None, medium="GPU", lora_name=None)
        if extra_keys is not None:
            kw["extra_keys"] = extra_keys
        if cache_salt is not None:
            kw["cache_salt"] = cache_salt
        assert set(kw) <= self.stored_fields, (self.name, set(kw) - self.stored_fields)
        return self.kv.BlockStored(**kw)

    def removed(self, hashes, medium: str, group: int):
        return self._event(self.kv.BlockRemoved, self.removed_fields, group,
                           block_hashes=hashes, medium=medium, group_idx=group)

    def lacks(self, needs: tuple[str, ...]) -> str | None:
        """Why this publisher cannot run a scenario needing `needs`, or None."""
        if "groups" in needs and not self.groups:
            return (f"{self.name}'s BlockStored/BlockRemoved have no group_idx "
                    f"(fields: {sorted(self.stored_fields)}): no hybrid KV-cache groups")
        if "lookahead" in needs and "lookahead_token_ids" not in self.stored_fields:
            return (f"{self.name}'s BlockStored has no lookahead_token_ids "
                    f"(fields: {sorted(self.stored_fields)}): no lookahead hashing")
        if "bin" in needs and not self.bin_hashes:
            return (f"{self.name}'s block_hashes are "
                    f"{self.kv.BlockStored.__annotations__.get('block_hashes')}: no bin hashes")
        return None


def flavor(name: str) -> Flavor:
    if name == "vllm":
        # vLLM's CPU offloading publishes medium "CPU".
        return Flavor("vllm", vllm_publisher.load_kv_events(), vllm_publisher.engine_hashes,
                      "data_parallel_rank", "CPU")
    kv = sglang_publisher.load_kv_events()
    return Flavor("sglang", kv, sglang_publisher.engine_hashes, "attn_dp_rank",
                  kv.StorageMedium.CPU.value)  # HiCache's host tier: "CPU_PINNED"


class DroppingSocket:
    """The publisher's PUB socket, dropping its next `drop` sends (the batches still get
    their seq and enter the engine's replay buffer: a loss on the way)."""

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
    """One DP rank of an engine: the engine's real publisher and the blocks it holds, per
    tier. `endpoint` binds when it has a `*` (kvr connects), else connects (kvr binds)."""

    def __init__(self, fl: Flavor, endpoint: str, replay_endpoint: str | None,
                 dp_rank: int, topic: str = ""):
        self.fl = fl
        # Tokens of lookahead in each block's hash (speculative decoding; 0 = none): a
        # block is held as the prefix through its lookahead tokens.
        self.lookahead = 0
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.dp_rank, self.topic = dp_rank, topic
        # token prefixes, one per held block, by tier
        self.held: dict[str, set[tuple[int, ...]]] = {"device": set(), "host": set()}
        # A hybrid model's recurrent states (token prefixes whose last block has one, any
        # tier); once a rank announced one, its prefix counts up to its last state.
        self.states: set[tuple[int, ...]] = set()
        self.hybrid = False
        self.pub = None
        self.bin = False  # name blocks by 32-byte digests (msgpack bin) instead of ints
        self.start()

    def start(self) -> None:
        self.pub = self.fl.publisher(self.dp_rank, self.endpoint, self.replay_endpoint,
                                     self.topic)
        self.sock = DroppingSocket(self.pub._pub)
        self.pub._pub = self.sock

    def restart(self) -> None:
        """A new engine instance on the same endpoints: seq from 0, cache empty."""
        self.pub.shutdown()
        for t in self.held.values():
            t.clear()
        self.states.clear()
        time.sleep(0.2)
        self.start()

    def publish(self, events: list, drop: bool = False) -> None:
        if drop:
            self.sock.drop += 1
        self.pub.publish(self.fl.batch(events))
        self.pub._event_queue.join()  # sent (or dropped) and in the replay buffer

    def stored(self, tokens: list[int], group: int = 0, kind: str = "full_attention",
               medium: str = "GPU"):
        """A store in KV-cache group `group`; the truth follows the full-attention group
        (group 0), which is what a prefix hit needs."""
        la = self.lookahead
        hashes = self.names(tokens)
        if la:
            # The engine hashes a block once its lookahead tokens exist.
            hashes = hashes[: max(0, (len(tokens) - la) // BS)]
        if group == 0:
            for i in range(len(hashes)):
                self.held[TIERS[medium]].add(tuple(tokens[: (i + 1) * BS + la]))
        ahead = None
        if la:
            ahead = [tokens[(i + 1) * BS: (i + 1) * BS + la] for i in range(len(hashes))]
        return self.fl.stored(hashes, tokens[: len(hashes) * BS], medium, group, kind, ahead)

    def placeholders(self, tokens: list[int], blocks: range, medium: str) -> list:
        """The offloading connector's tokenless announcements of host copies of `blocks`
        (which the device holds, so kvr knows their tokens), one event each."""
        hashes = self.names(tokens)
        for i in blocks:
            self.held[TIERS[medium]].add(tuple(tokens[: (i + 1) * BS + self.lookahead]))
        return [self.fl.placeholder(hashes[i], medium, 0) for i in blocks]

    def checkpoint(self, tokens: list[int], block: int, medium: str) -> object:
        """A Mamba state checkpoint at `block`, in group 1 (the recurrent group): the
        engine can now reuse the prefix up to that block."""
        hashes = self.names(tokens)
        self.hybrid = True
        self.states.add(tuple(tokens[: (block + 1) * BS]))
        return self.fl.checkpoint(hashes[block], hashes[block - 1] if block else None,
                                  medium, 1)

    def recurrent(self, tokens: list[int], blocks: list[int]) -> object:
        """The Mamba group's device store of one step, as vLLM's align mode sends it: the
        hashes of the blocks it keeps a state for (`blocks`), the token ids of all the
        step's blocks (the others are null in that group), group 1, kind "mamba"."""
        hashes = self.names(tokens)
        self.hybrid = True
        for b in blocks:
            self.states.add(tuple(tokens[: (b + 1) * BS]))
        return self.fl.stored([hashes[b] for b in blocks], tokens, "GPU", 1, "mamba")

    def removed(self, tokens: list[int], first_block: int, group: int = 0,
                medium: str = "GPU"):
        hashes = self.names(tokens)
        if self.lookahead:
            hashes = hashes[: max(0, (len(tokens) - self.lookahead) // BS)]
        if group == 0:
            for i in range(first_block, len(hashes)):
                self.held[TIERS[medium]].discard(tuple(tokens[: (i + 1) * BS + self.lookahead]))
        elif self.hybrid:
            for i in range(first_block, len(hashes)):
                self.states.discard(tuple(tokens[: (i + 1) * BS]))
        return self.fl.removed(hashes[first_block:], medium, group)

    def names(self, tokens: list[int]) -> list:
        hashes = self.fl.hashes(tokens, BS)
        if self.bin:
            import hashlib
            return [hashlib.sha256(str(h).encode()).digest() for h in hashes]
        return hashes

    def forget(self, tokens: list[int]) -> None:
        """The truth after a recovery by clearing: these blocks are gone for good."""
        for t in [*self.held.values(), self.states]:
            t.difference_update(tuple(tokens[: (i + 1) * BS])
                                for i in range(len(tokens) // BS))

    def depth(self, prompt: list[int]) -> tuple[int, int]:
        """(device blocks, host blocks extending them), as `/overlap_scores` counts."""
        la = self.lookahead

        def run(start: int, tier: str) -> int:
            d = start
            while ((d + 1) * BS + la <= len(prompt)
                   and tuple(prompt[: (d + 1) * BS + la]) in self.held[tier]):
                d += 1
            return d - start
        dev = run(0, "device")
        host = run(dev, "host")
        if self.hybrid:
            # The last block of the prefix with a recurrent state (vLLM's hybrid hit).
            total = next((k for k in range(dev + host, 0, -1)
                          if tuple(prompt[: k * BS]) in self.states), 0)
            dev = min(dev, total)
            host = total - dev
        return dev, host

    def close(self) -> None:
        self.pub.shutdown()


class Worker:
    def __init__(self, fl: Flavor, worker_id: int, dp_size: int = 1, replay: bool = True,
                 dead_replay_ranks: tuple[int, ...] = ()):
        self.worker_id = worker_id
        ports = free_port_block(2 * dp_size)
        self.base_port, self.replay_port = ports, ports + dp_size
        self.ranks = [
            Rank(fl, f"tcp://*:{self.base_port}",
                 None if (not replay or r in dead_replay_ranks) else f"tcp://*:{self.replay_port}",
                 r)
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
            # kvr (as Dynamo) offsets the replay port by the rank, as the engines bind them.
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
    return {(w["worker_id"], w["dp_rank"]):
            (w.get("device_blocks", 0), w.get("host_pinned_extension_blocks", 0))
            for w in body["workers"]}


def overcounts(want: tuple[int, int], have: tuple[int, int]) -> bool:
    """More device blocks, or more device and host blocks together, than the engine has."""
    return have[0] > want[0] or sum(have) > sum(want)


class Check:
    """Polls every (prompt, worker, rank) depth until it equals the truth, and fails if it
    does not within the timeout; an overcount still there half-way is logged as such.
    `query(prompt)` gives {(worker, rank): (device, host)} (kvr serve's by default)."""

    def __init__(self, base: str | None, timeout: float, query=None):
        self.timeout = timeout
        self.query = query or (lambda p: overlap(base, p))

    def mismatches(self, workers: list[Worker], prompts: list[list[int]]) -> list:
        bad = []
        for p in prompts:
            got = self.query(p)
            for w in workers:
                for r in w.ranks:
                    want, have = r.depth(p), got.get((w.worker_id, r.dp_rank), (0, 0))
                    if have != want:
                        bad.append((w.worker_id, r.dp_rank, p[0], want, have))
        return bad

    def converge(self, name: str, workers: list[Worker], prompts: list[list[int]],
                 settle: float = 0.0) -> bool:
        deadline = time.time() + self.timeout
        time.sleep(settle)
        reported = False
        while True:
            bad = self.mismatches(workers, prompts)
            if not bad:
                log(f"{name}: converged")
                return True
            if time.time() > deadline:
                log(f"{name}: FAILED, (worker, rank, prompt, (device, host) want, got): {bad}")
                return False
            over = [b for b in bad if overcounts(b[3], b[4])]
            if over and not reported and time.time() > deadline - self.timeout / 2:
                # Still overcounting half-way through: report it as the finding it is.
                log(f"{name}: overcount still present: {over}")
                reported = True
            time.sleep(0.1)


def prompt(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))
