"""vLLM 0.33.0's real KV-event publisher, driven without vLLM.

`vllm/distributed/kv_events.py` is imported unchanged from the vLLM wheel
(extracted by ensure-venv.sh) with four stub modules standing in for the parts
of vLLM it imports: `vllm.config.kv_events` (KVEventsConfig, a plain
dataclass), `vllm.logger` (init_logger), `vllm.utils.network_utils` (get_ip,
get_tcp_uri, is_valid_ipv6_address, split_zmq_path) and
`vllm.v1.core.kv_cache_utils` (ExternalBlockHash). Everything on the wire
(ZMQ PUB framing, sequence numbers, replay ROUTER, msgpack encoding of
KVEventBatch / BlockStored / BlockRemoved / AllBlocksCleared) is vLLM's own code.

Engine block hashes are computed "the vLLM way" in spirit: a chained SHA-256
over (parent hash, block tokens, extra keys), folded to its last 8 bytes as an
unsigned int (vLLM's default int block hashes). Routers cannot recompute these
and do not need to: they key blocks by the local hash of the event's
`token_ids` (REFERENCE.md sec. 1/2). The engine hash only has to be consistent,
so that BlockRemoved and parent_block_hash refer to earlier stores. A publisher made
with `hash_seed` folds it into every hash, as two engines with different hash seeds
(vLLM's PYTHONHASHSEED-derived root) name the same tokens differently.

Usage:
    pub = WorkerPublisher(worker_id=1, dp_size=2, base_port=P, replay_base_port=R)
    pub.kv_events_endpoints()   # {"0": "tcp://127.0.0.1:P", "1": "tcp://127.0.0.1:P+1"}
    pub.wait_subscribed(timeout=10)
    pub.store(rank=0, tokens=[...], block_size=16)
    pub.remove(rank=0, tokens=[...], block_size=16)  # removes those blocks
    pub.clear(rank=0)
    pub.close()
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import ipaddress
import logging
import os
import socket
import struct
import sys
import threading
import time
import types
from typing import Any

DEFAULT_VLLM_DIR = os.environ.get(
    "KVR_COMPAT_VLLM_DIR", os.path.expanduser("~/.cache/kvr/vllm-0.33.0")
)

_kv_events = None


def _stub(name: str, path: str | None = None) -> types.ModuleType:
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        if path is not None:
            mod.__path__ = [path]  # a package
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)
    return mod


def load_kv_events(vllm_dir: str = DEFAULT_VLLM_DIR):
    """Import vLLM's real kv_events.py with stub modules for its vLLM imports."""
    global _kv_events
    if _kv_events is not None:
        return _kv_events
    src = os.path.join(vllm_dir, "vllm", "distributed", "kv_events.py")
    if not os.path.isfile(src):
        raise FileNotFoundError(
            f"{src} missing: run tests/compat/ensure-venv.sh first"
        )
    root = os.path.join(vllm_dir, "vllm")
    _stub("vllm", root)
    _stub("vllm.distributed", os.path.join(root, "distributed"))
    _stub("vllm.config", os.path.join(root, "config"))
    _stub("vllm.utils", os.path.join(root, "utils"))
    _stub("vllm.v1", os.path.join(root, "v1"))
    _stub("vllm.v1.core", os.path.join(root, "v1", "core"))

    cfg = _stub("vllm.config.kv_events")

    @dataclasses.dataclass
    class KVEventsConfig:  # the fields ZmqEventPublisher passes
        enable_kv_cache_events: bool = False
        publisher: str = "null"
        endpoint: str = "tcp://*:5557"
        replay_endpoint: str | None = None
        buffer_steps: int = 10_000
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = ""

    cfg.KVEventsConfig = KVEventsConfig

    # vllm.config.utils is imported by the real vllm/config/kv_events.py; the
    # stub above replaces that module, so an empty stand-in suffices.
    _stub("vllm.config.utils")

    lg = _stub("vllm.logger")
    lg.init_logger = lambda name: logging.getLogger(name)

    nu = _stub("vllm.utils.network_utils")

    def get_ip() -> str:
        return os.environ.get("VLLM_HOST_IP", "127.0.0.1")

    def is_valid_ipv6_address(address: str) -> bool:
        try:
            ipaddress.IPv6Address(address)
            return True
        except ValueError:
            return False

    def get_tcp_uri(ip: str, port: int) -> str:
        if is_valid_ipv6_address(ip):
            return f"tcp://[{ip}]:{port}"
        return f"tcp://{ip}:{port}"

    def split_zmq_path(path: str):
        scheme, _, rest = path.partition("://")
        host, _, port = rest.rpartition(":")
        return scheme, host.strip("[]"), port

    nu.get_ip = get_ip
    nu.get_tcp_uri = get_tcp_uri
    nu.is_valid_ipv6_address = is_valid_ipv6_address
    nu.split_zmq_path = split_zmq_path

    kcu = _stub("vllm.v1.core.kv_cache_utils")
    kcu.ExternalBlockHash = bytes | int

    spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", src)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm.distributed.kv_events"] = mod
    spec.loader.exec_module(mod)
    _kv_events = mod
    return mod


def engine_block_hash(parent: int | None, block_tokens: list[int], extra=None,
                      seed: str | None = None) -> int:
    """Chained SHA-256 over (seed, parent, tokens, extra), last 8 bytes as u64; no seed
    folds nothing (the hashes every test saw before seeds existed)."""
    h = hashlib.sha256()
    if seed is not None:
        h.update(b"seed:" + seed.encode())
    h.update(b"none" if parent is None else parent.to_bytes(8, "big"))
    h.update(struct.pack(f"<{len(block_tokens)}I", *block_tokens))
    h.update(repr(extra).encode())
    return int.from_bytes(h.digest()[-8:], "big")


def engine_hashes(tokens: list[int], block_size: int, extra=None,
                  seed: str | None = None) -> list[int]:
    out: list[int] = []
    parent = None
    for i in range(len(tokens) // block_size):
        parent = engine_block_hash(parent, tokens[i * block_size:(i + 1) * block_size], extra, seed)
        out.append(parent)
    return out


def free_port_block(n: int, host: str = "127.0.0.1", lo: int = 20000, hi: int = 60000) -> int:
    """A base port P such that P..P+n-1 are all bindable right now."""
    import random
    rng = random.Random(os.getpid() ^ int(time.time() * 1e6))
    for _ in range(500):
        base = rng.randrange(lo, hi - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


class WorkerPublisher:
    """One engine (worker) with dp_size ranks, each a real vLLM ZmqEventPublisher.

    Rank r's PUB binds tcp://*:(base_port + r) and its replay ROUTER binds
    tcp://*:(replay_base_port + r) — vLLM adds the DP rank to both ports itself.
    """

    _monitor_seq = 0

    def __init__(self, worker_id: int, dp_size: int = 1, base_port: int | None = None,
                 replay_base_port: int | None = None, dp_start_rank: int = 0,
                 host: str = "127.0.0.1", topic: str = "", replay: bool = True,
                 hash_seed: str | None = None, buffer_steps: int | None = None):
        import zmq
        self.hash_seed = hash_seed
        self.kv = load_kv_events()
        self.zmq = zmq
        self.worker_id = worker_id
        self.dp_size = dp_size
        self.dp_start_rank = dp_start_rank
        self.host = host
        if base_port is None:
            base_port = free_port_block(dp_size * 2 if replay else dp_size)
            if replay and replay_base_port is None:
                replay_base_port = base_port + dp_size
        self.base_port = base_port
        self.replay_base_port = replay_base_port if replay else None
        self.pubs = {}
        self._monitors = {}
        for i in range(dp_size):
            rank = dp_start_rank + i
            pub = self.kv.ZmqEventPublisher(
                data_parallel_rank=i,  # vLLM offsets both ports by it
                endpoint=f"tcp://*:{base_port}",
                replay_endpoint=(f"tcp://*:{self.replay_base_port}"
                                 if self.replay_base_port is not None else None),
                topic=topic,
                # How many batches its replay ROUTER still holds (vLLM's default 10 000).
                **({} if buffer_steps is None else {"buffer_steps": buffer_steps}),
            )
            # vLLM offsets ports by its own data_parallel_rank; batches carry it.
            pub._data_parallel_rank = rank
            # The monitor is attached before the first publish, while the
            # publisher thread does not touch its PUB socket.
            # A unique inproc address: pyzmq's default (inproc://monitor.s-<fd>)
            # collides when a later publisher reuses a closed socket's fd, and
            # then that publisher silently sends nothing.
            WorkerPublisher._monitor_seq += 1
            self._monitors[rank] = pub._pub.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED,
                addr=f"inproc://kvr-compat-monitor-{os.getpid()}-{WorkerPublisher._monitor_seq}")
            self.pubs[rank] = pub
        self.subscribers = {r: 0 for r in self.pubs}
        self._lock = threading.Lock()

    # endpoints as the service should be told (it connects to them)
    def endpoint(self, rank: int) -> str:
        return f"tcp://{self.host}:{self.base_port + rank - self.dp_start_rank}"

    def replay_endpoint(self, rank: int) -> str | None:
        if self.replay_base_port is None:
            return None
        return f"tcp://{self.host}:{self.replay_base_port + rank - self.dp_start_rank}"

    def kv_events_endpoints(self) -> dict[str, str]:
        return {str(r): self.endpoint(r) for r in self.pubs}

    def _drain_monitor(self, rank: int, timeout_ms: int) -> None:
        from zmq.utils.monitor import recv_monitor_message
        mon = self._monitors[rank]
        if mon.poll(timeout_ms):
            while True:
                msg = recv_monitor_message(mon)
                if msg["event"] == self.zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.subscribers[rank] += 1
                elif msg["event"] == self.zmq.EVENT_DISCONNECTED:
                    self.subscribers[rank] = max(0, self.subscribers[rank] - 1)
                if not mon.poll(0):
                    break

    def wait_subscribed(self, timeout: float = 15.0, settle: float = 0.3) -> bool:
        """Wait until every rank's PUB has at least one connected subscriber.

        ZMQ drops what a PUB sends before the subscription arrives, so the
        harness waits for the handshake and then a short settle time for the
        SUBSCRIBE frame itself.
        """
        deadline = time.time() + timeout
        for rank in self.pubs:
            while self.subscribers[rank] == 0:
                left = deadline - time.time()
                if left <= 0:
                    return False
                self._drain_monitor(rank, int(min(left, 0.2) * 1000))
        time.sleep(settle)
        return True

    def _publish(self, rank: int, events: list) -> None:
        batch = self.kv.KVEventBatch(ts=time.time(), events=events)
        self.pubs[rank].publish(batch)

    def stored_event(self, tokens: list[int], block_size: int, parent_tokens: list[int] | None = None,
                     medium: str | None = "GPU", lora_name: str | None = None):
        """BlockStored for the complete blocks of `tokens` (appended after parent_tokens)."""
        parent_tokens = list(parent_tokens or [])
        full = parent_tokens + list(tokens)
        hashes = engine_hashes(full, block_size, lora_name, self.hash_seed)
        n_parent = len(parent_tokens) // block_size
        new = hashes[n_parent:]
        n = len(new)
        return self.kv.BlockStored(
            block_hashes=new,
            parent_block_hash=hashes[n_parent - 1] if n_parent else None,
            token_ids=full[n_parent * block_size:(n_parent + n) * block_size],
            block_size=block_size,
            lora_id=None,
            medium=medium,
            lora_name=lora_name,
            extra_keys=[None] * n,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def store(self, rank: int, tokens: list[int], block_size: int,
              parent_tokens: list[int] | None = None, medium: str | None = "GPU",
              lora_name: str | None = None) -> None:
        self._publish(rank, [self.stored_event(tokens, block_size, parent_tokens, medium, lora_name)])

    def remove(self, rank: int, tokens: list[int], block_size: int, first_block: int = 0,
               medium: str | None = "GPU", lora_name: str | None = None) -> None:
        """BlockRemoved for blocks first_block.. of the chain of `tokens`."""
        hashes = engine_hashes(list(tokens), block_size, lora_name, self.hash_seed)[first_block:]
        self._publish(rank, [self.kv.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)])

    def clear(self, rank: int) -> None:
        self._publish(rank, [self.kv.AllBlocksCleared()])

    def close(self) -> None:
        for rank, pub in self.pubs.items():
            try:
                pub._pub.disable_monitor()
                self._monitors[rank].close(linger=0)
            except Exception:
                pass
            pub.shutdown()


if __name__ == "__main__":  # smoke test: decode our own publisher with a SUB
    import msgspec
    import zmq
    p = WorkerPublisher(worker_id=1, dp_size=2)
    ctx = zmq.Context.instance()
    subs = []
    for r in (0, 1):
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(p.endpoint(r))
        subs.append(s)
    print("subscribed:", p.wait_subscribed(5))
    p.store(0, list(range(32)), 16)
    p.store(1, list(range(100, 116)), 16)
    p.remove(0, list(range(32)), 16, first_block=1)
    p.clear(1)
    for r, s in enumerate(subs):
        for _ in range(2):
            if s.poll(2000):
                topic, seq, payload = s.recv_multipart()
                print(r, topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload))
    p.close()
