"""SGLang 0.5.23's real KV-event publisher, driven without SGLang.

`sglang/srt/disaggregation/kv_events.py` is imported unchanged from the SGLang wheel
(extracted by ensure-venv.sh) with two stub modules standing in for the parts of SGLang
it imports: `sglang.srt.runtime_context` (get_parallel, used only to pick the publishing
rank) and `sglang.srt.utils.network` (NetworkAddress: host/port parsing). Everything on
the wire (ZMQ PUB framing, sequence numbers, the replay ROUTER, msgpack encoding of
KVEventBatch / BlockStored / BlockRemoved / AllBlocksCleared, the medium names of
StorageMedium) is SGLang's own code. pydantic, msgspec and pyzmq come from the venv.

How it differs from vLLM 0.33.0's (vllm_publisher.py), as read from the module:
- the constructor takes `attn_dp_rank` (vLLM: `data_parallel_rank`) and offsets both the
  PUB and the replay port by it, as vLLM does; a `bind` argument may override the
  bind-if-wildcard heuristic (which also binds `0.0.0.0`);
- the batch is `[ts, events, attn_dp_rank]` (same positions as vLLM's);
- events are tagged maps with `omit_defaults`: BlockStored has `block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, cache_salt, session_id,
  lora_name` and BlockRemoved `block_hashes, medium`: no `group_idx`,
  `kv_cache_spec_kind` or `extra_keys` (no hybrid KV-cache groups);
- media are StorageMedium's: "GPU", "CPU_PINNED" (HiCache's host tier), "DISK",
  "EXTERNAL";
- block hashes are signed int64: the first 8 bytes of a chained SHA-256
  (`hash_str_to_int64` in sglang/srt/mem_cache/utils.py), so half are negative;
- the replay ROUTER speaks the same protocol (`[b"", start_seq]`, replies, end marker).
"""

from __future__ import annotations

import hashlib
import importlib.util
import ipaddress
import os
import struct
import sys
from dataclasses import dataclass

# One maker of stub modules for both engines' loaders.
from vllm_publisher import _stub

VERSION = "0.5.23"
DEFAULT_SGLANG_DIR = os.environ.get(
    "KVR_COMPAT_SGLANG_DIR", os.path.expanduser(f"~/.cache/kvr/sglang-{VERSION}")
)
MODULE = os.path.join("sglang", "srt", "disaggregation", "kv_events.py")

_kv_events = None


def load_kv_events(sglang_dir: str = DEFAULT_SGLANG_DIR):
    """Import SGLang's real kv_events.py with stub modules for its SGLang imports."""
    global _kv_events
    if _kv_events is not None:
        return _kv_events
    src = os.path.join(sglang_dir, MODULE)
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src} missing: run tests/compat/ensure-venv.sh first")
    root = os.path.join(sglang_dir, "sglang")
    _stub("sglang", root)
    _stub("sglang.srt", os.path.join(root, "srt"))
    _stub("sglang.srt.disaggregation", os.path.join(root, "srt", "disaggregation"))
    _stub("sglang.srt.utils", os.path.join(root, "srt", "utils"))

    rc = _stub("sglang.srt.runtime_context")

    @dataclass
    class Parallel:  # the fields is_kv_publisher_rank and the scheduler read
        pp_rank: int = 0
        attn_tp_rank: int = 0
        attn_cp_rank: int = 0
        attn_dp_size: int = 1
        attn_dp_rank: int = 0
        dp_rank: int | None = None

    rc.get_parallel = Parallel

    net = _stub("sglang.srt.utils.network")

    @dataclass(frozen=True)
    class NetworkAddress:  # what kv_events.py uses: parse, host, port, is_ipv6, to_tcp
        host: str
        port: int

        def __post_init__(self):
            if self.host.startswith("[") and self.host.endswith("]"):
                object.__setattr__(self, "host", self.host[1:-1])

        @property
        def is_ipv6(self) -> bool:
            try:
                return isinstance(ipaddress.ip_address(self.host), ipaddress.IPv6Address)
            except ValueError:
                return False

        def to_tcp(self) -> str:
            host = f"[{self.host}]" if self.is_ipv6 else self.host
            return f"tcp://{host}:{self.port}"

        @classmethod
        def parse(cls, s: str) -> "NetworkAddress":
            host, sep, port = s.rpartition(":")
            if not sep or not port.isdigit():
                raise ValueError(f"not host:port: {s!r}")
            return cls(host, int(port))

    net.NetworkAddress = NetworkAddress

    spec = importlib.util.spec_from_file_location("sglang.srt.disaggregation.kv_events", src)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sglang.srt.disaggregation.kv_events"] = mod
    spec.loader.exec_module(mod)
    _kv_events = mod
    return mod


def engine_hashes(tokens: list[int], block_size: int) -> list[int]:
    """SGLang-style block hashes: a chained SHA-256 over (parent digest, page tokens),
    its first 8 bytes as a signed int64 (what hash_str_to_int64 makes of the hex)."""
    out: list[int] = []
    parent = b""
    for i in range(len(tokens) // block_size):
        h = hashlib.sha256(parent)
        h.update(struct.pack(f"<{block_size}I", *tokens[i * block_size:(i + 1) * block_size]))
        parent = h.digest()
        out.append(int.from_bytes(parent[:8], "big", signed=True))
    return out


if __name__ == "__main__":  # smoke test: decode SGLang's publisher with a SUB
    import time

    import msgspec
    import zmq

    from vllm_publisher import free_port_block

    kv = load_kv_events()
    port = free_port_block(2)
    pub = kv.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://*:{port}",
                               replay_endpoint=f"tcp://*:{port + 1}", topic="t")
    s = zmq.Context.instance().socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)
    toks = list(range(32))
    pub.publish(kv.KVEventBatch(ts=time.time(), events=[
        kv.BlockStored(block_hashes=engine_hashes(toks, 16), parent_block_hash=None,
                       token_ids=toks, block_size=16, lora_id=None,
                       medium=kv.StorageMedium.CPU),
        kv.BlockRemoved(block_hashes=engine_hashes(toks, 16)[1:], medium=kv.StorageMedium.GPU),
        kv.AllBlocksCleared()]))
    if s.poll(2000):
        topic, seq, payload = s.recv_multipart()
        print(topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload))
    pub.shutdown()
