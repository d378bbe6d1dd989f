"""Emulation of vLLM's / SGLang's ZMQ KV-event publisher (REFERENCE.md §2).

Two layers:

* `ZmqEventPublisher` — the transport, as vLLM's `ZmqEventPublisher` behaves: a PUB
  socket that binds or connects (vLLM's rule: bind iff the endpoint contains `*` or `::`
  or is ipc/inproc; an explicit `mode` may override it), the DP rank added to the port
  of both endpoints, 3-frame messages `[topic, seq (8-byte BE), payload]` with a
  per-instance `seq` from 0, and an optional replay ROUTER (always bound) that keeps the
  last `buffer_steps` batches and answers `[identity, b"", start_seq]` with
  `[identity, b"", topic, seq, payload]` for each kept batch with seq >= start, then the
  end marker `[identity, b"", b"", ff*8, b""]`. Replay is served by a background thread.
  Test hooks: `drop_next(n)` (the next n batches take a seq and enter the replay buffer
  but are not sent: a batch the subscriber missed) and `restart()` (a new publisher
  instance on the same endpoints: sockets reopened, seq back to 0, buffer emptied).

* `EngineRank` — one DP rank of an engine: its prefix cache per medium (the ground
  truth), the events it emits (BlockStored / BlockRemoved / AllBlocksCleared) in one of
  the wire encodings below, and its publisher. `Worker` groups the ranks of a worker
  (one publisher per DP rank, as vLLM and SGLang run them).

Encodings (the `encoding` argument):

  map-v0.33      tagged maps exactly as vLLM 0.33 puts them on the wire (nil
                 parent/lora_id/lora_name present, extra_keys, group_idx 0,
                 kv_cache_spec_kind, locality "LOCAL" on CPU stores).
  map-sparse     tagged maps where every field at its default is absent (parent,
                 lora_id, medium for GPU, ... may be missing, not only trailing ones),
                 plus one unknown key `x_future_field` a newer version might send.
  array-sglang   positional arrays, SGLang's layout: BlockStored 9 fields, BlockRemoved
                 3 fields (nil where unset).
  array-trimmed  positional arrays of the full field list with trailing fields at
                 their default (nil) omitted, as older/shorter struct versions produce:
                 a GPU store is `[tag, hashes, parent, tokens, block_size]`, a GPU
                 removal `[tag, hashes]`.
  array-future   positional arrays of all 15 / 5 fields plus one unknown trailing
                 element (a map), as a newer version might send.

msgspec does not omit trailing defaults of `array_like` structs (msgspec issue #720),
so the shorter layouts are produced by encoding msgspec structs that declare only the
first k fields, which is what an older or SGLang struct definition puts on the wire.

Hash kinds (`hash_kind`): `uint64` (vLLM default: last 8 bytes of a SHA-256 digest,
unsigned), `int64` (SGLang: first 8 bytes, signed — about half are negative), `bin`
(all 32 bytes). A decoder folds bin to its last 8 bytes, big-endian; the engine's hash is
derived from the digest chained over (parent digest, lora name, tokens), so the same
block has the same hash on every medium.
"""

from __future__ import annotations

import collections
import hashlib
import socket
import struct
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

Hash = Union[int, bytes]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIA = ("GPU", "CPU", "STORAGE")
TIER_OF_MEDIUM = {"GPU": "device", "CPU": "host", "STORAGE": "disk"}
ENCODINGS = ("map-v0.33", "map-sparse", "array-sglang", "array-trimmed", "array-future")
HASH_KINDS = ("uint64", "int64", "bin")


def log(*args: Any) -> None:
    print("[kvpublisher]", *args, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Event structs, tagged-map encoding (current vLLM; REFERENCE.md §2 field list).
# --------------------------------------------------------------------------------------


class KVCacheEvent(
    msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, gc=False
):
    """Base of the tagged-map events: `{"type": "<Name>", field: value, ...}`."""


class BlockStored(KVCacheEvent, tag="BlockStored"):
    # vLLM 0.33: these seven have no default, so they are on the wire even when nil.
    block_hashes: List[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    # Defaulted: absent from the wire while at their default (omit_defaults).
    extra_keys: Optional[List[Optional[List[Any]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[List[List[int]]] = None


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: List[Hash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class SparseBlockStored(KVCacheEvent, tag="BlockStored", kw_only=True):
    """Every field except the essential ones defaulted: nil fields vanish anywhere."""

    block_hashes: List[Hash]
    parent_block_hash: Optional[Hash] = None
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None
    extra_keys: Optional[List[Optional[List[Any]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[List[List[int]]] = None
    x_future_field: Optional[Dict[str, Any]] = None  # unknown to today's decoders


class SparseBlockRemoved(KVCacheEvent, tag="BlockRemoved", kw_only=True):
    block_hashes: List[Hash]
    medium: Optional[str] = None
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    x_future_field: Optional[Dict[str, Any]] = None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The batch: a msgpack array `[ts, events, data_parallel_rank]`."""

    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


# --------------------------------------------------------------------------------------
# Positional-array encoding (older vLLM, SGLang): `[tag, field, field, ...]`.
# --------------------------------------------------------------------------------------

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
STORED_REQUIRED = 4  # block_hashes, parent_block_hash, token_ids, block_size
REMOVED_REQUIRED = 1  # block_hashes

_array_struct_cache: Dict[Tuple[str, int, bool], type] = {}


def array_struct(tag: str, n_fields: int, future: bool = False) -> type:
    """An `array_like` msgspec struct declaring the first `n_fields` fields of `tag`
    (plus an unknown trailing `x_future_field` when `future`)."""
    key = (tag, n_fields, future)
    cls = _array_struct_cache.get(key)
    if cls is None:
        names: Sequence[str]
        if tag == "BlockStored":
            names, required = STORED_FIELDS[:n_fields], STORED_REQUIRED
        elif tag == "BlockRemoved":
            names, required = REMOVED_FIELDS[:n_fields], REMOVED_REQUIRED
        else:
            names, required = (), 0
        fields: List[Any] = []
        for i, name in enumerate(names):
            fields.append((name, Any) if i < required else (name, Any, None))
        if future:
            fields.append(("x_future_field", Any, None))
        cls = msgspec.defstruct(
            f"Array{tag}{n_fields}{'F' if future else ''}",
            fields,
            tag=tag,
            array_like=True,
            omit_defaults=True,
            gc=False,
        )
        _array_struct_cache[key] = cls
    return cls


FUTURE_VALUE = {"hint": [1, 2, 3], "note": "unknown to this decoder"}


def render_event(encoding: str, tag: str, values: Dict[str, Any]) -> Any:
    """The msgspec struct instance that puts event `tag` with field `values` on the wire
    in `encoding`."""
    if encoding == "map-v0.33":
        if tag == "BlockStored":
            return BlockStored(**{k: values.get(k) for k in STORED_FIELDS})
        if tag == "BlockRemoved":
            return BlockRemoved(**{k: values.get(k) for k in REMOVED_FIELDS})
        return AllBlocksCleared()
    if encoding == "map-sparse":
        if tag == "BlockStored":
            kw = {k: values.get(k) for k in STORED_FIELDS}
            return SparseBlockStored(**kw, x_future_field=FUTURE_VALUE)
        if tag == "BlockRemoved":
            kw = {k: values.get(k) for k in REMOVED_FIELDS}
            return SparseBlockRemoved(**kw, x_future_field=FUTURE_VALUE)
        return AllBlocksCleared()
    if tag == "AllBlocksCleared":
        return array_struct(tag, 0)()
    names = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS
    required = STORED_REQUIRED if tag == "BlockStored" else REMOVED_REQUIRED
    future = False
    if encoding == "array-sglang":
        n = 9 if tag == "BlockStored" else 3
    elif encoding == "array-trimmed":
        n = len(names)
        while n > required and values.get(names[n - 1]) is None:
            n -= 1
    elif encoding == "array-future":
        n, future = len(names), True
    else:
        raise ValueError(f"unknown encoding {encoding!r}")
    cls = array_struct(tag, n, future)
    kw = {k: values.get(k) for k in names[:n]}
    if future:
        kw["x_future_field"] = FUTURE_VALUE
    return cls(**kw)


# --------------------------------------------------------------------------------------
# Transport.
# --------------------------------------------------------------------------------------


def offset_endpoint_port(endpoint: Optional[str], dp_rank: int) -> Optional[str]:
    """vLLM's rule: the DP rank is added to the port (inproc gets a `_dp<r>` suffix).
    Port 0 (pick a free port) is left alone."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint and ":" in endpoint:
        base, port = endpoint.rsplit(":", 1)
        if int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + dp_rank}"
    return endpoint


def vllm_binds(endpoint: str) -> bool:
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def free_tcp_ports(n: int = 1, host: str = "127.0.0.1") -> int:
    """A base port such that base .. base+n-1 are free on `host` right now."""
    for _ in range(200):
        probes = []
        try:
            s = socket.socket()
            s.bind((host, 0))
            probes.append(s)
            base = s.getsockname()[1]
            if base + n - 1 > 65535:
                continue
            ok = True
            for p in range(base + 1, base + n):
                t = socket.socket()
                try:
                    t.bind((host, p))
                except OSError:
                    t.close()
                    ok = False
                    break
                probes.append(t)
            if ok:
                return base
        finally:
            for s in probes:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


class ZmqEventPublisher:
    """vLLM's ZmqEventPublisher, synchronous on the sending side (the caller's thread
    owns the PUB socket), with the replay ROUTER served by a background thread."""

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: Optional[str] = None,
        *,
        dp_rank: int = 0,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        mode: str = "auto",
        ctx: Optional[zmq.Context] = None,
        name: str = "",
    ) -> None:
        assert mode in ("auto", "bind", "connect")
        self.ctx = ctx or zmq.Context.instance()
        self.dp_rank = dp_rank
        self.topic = topic
        self.topic_bytes = topic.encode("utf-8")
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.name = name or f"pub(dp{dp_rank})"
        ep = offset_endpoint_port(endpoint, dp_rank)
        assert ep is not None
        self.mode = ("bind" if vllm_binds(ep) else "connect") if mode == "auto" else mode
        self.endpoint = ep
        self.replay_endpoint = offset_endpoint_port(replay_endpoint, dp_rank)
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self.instance = 0
        self.sent = 0
        self.dropped = 0
        self.replay_requests = 0
        self._open()

    # -- sockets ---------------------------------------------------------------------

    def _bind_retry(self, sock: zmq.Socket, endpoint: str) -> str:
        deadline = time.monotonic() + 5.0
        while True:
            try:
                sock.bind(endpoint)
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            except zmq.ZMQError as e:
                # A restart rebinds the port the previous instance just released; the
                # old listener closes asynchronously.
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _open(self) -> None:
        self._seq = 0
        self._drop = 0
        with self._lock:
            self._buffer: collections.deque = collections.deque(maxlen=self.buffer_steps)
        pub = self.ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        pub.setsockopt(zmq.LINGER, 1000)
        self._monitor = pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._handshakes = 0
        if self.mode == "bind":
            # Later instances (restart) rebind the very port the first one got.
            self.endpoint = self._bind_retry(pub, self.endpoint)
        else:
            pub.connect(self.endpoint)
        self._pub = pub
        self._replay = None
        self._replay_thread = None
        self._replay_stop = threading.Event()
        if self.replay_endpoint is not None:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 0)
            self.replay_endpoint = self._bind_retry(router, self.replay_endpoint)
            self._replay = router
            self._replay_thread = threading.Thread(
                target=self._serve_replay,
                args=(router, self._replay_stop),
                name=f"replay-{self.name}",
                daemon=True,
            )
            self._replay_thread.start()

    def _close(self) -> None:
        if self._replay_thread is not None:
            self._replay_stop.set()
            self._replay_thread.join()
            self._replay_thread = None
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
        try:
            self._pub.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._pub.close(linger=0)

    def close(self) -> None:
        self._close()

    # -- replay server ---------------------------------------------------------------

    def _serve_replay(self, router: zmq.Socket, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) != 3:
                log(f"{self.name}: invalid replay request ({len(frames)} frames), dropped")
                continue
            ident, _empty, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            with self._lock:
                items = [(s, p) for s, p in self._buffer if s >= start]
                self.replay_requests += 1
            for s, p in items:
                router.send_multipart([ident, b"", self.topic_bytes, s.to_bytes(8, "big"), p])
            router.send_multipart([ident, b"", b"", END_SEQ, b""])
            log(f"{self.name}: replay from {start}: {len(items)} batches")

    # -- publishing ------------------------------------------------------------------

    def encode_batch(self, events: List[Any], rank_field: Optional[int], ts: Optional[float] = None) -> bytes:
        batch = KVEventBatch(ts=time.time() if ts is None else ts, events=events, data_parallel_rank=rank_field)
        return self._encoder.encode(batch)

    def publish_payload(self, payload: bytes) -> int:
        """Give `payload` the next seq, keep it for replay, send it (unless dropping)."""
        seq = self._seq
        self._seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        if self._drop > 0:
            self._drop -= 1
            self.dropped += 1
            return seq
        self._pub.send_multipart([self.topic_bytes, seq.to_bytes(8, "big"), payload])
        self.sent += 1
        return seq

    def drop_next(self, n: int = 1) -> None:
        """The next `n` batches are lost on the way: seq advances, the replay buffer
        keeps them, the subscriber never sees them live."""
        self._drop += n

    @property
    def next_seq(self) -> int:
        return self._seq

    @property
    def last_seq(self) -> Optional[int]:
        return self._seq - 1 if self._seq > 0 else None

    def restart(self) -> None:
        """A new publisher instance on the same endpoints: seq back to 0, replay
        buffer empty, sockets reopened (subscribers reconnect)."""
        self._close()
        self.instance += 1
        self._open()

    def wait_for_peer(self, timeout: float) -> bool:
        """Wait until at least one peer completed the ZMTP handshake with the PUB socket
        of this instance."""
        deadline = time.monotonic() + timeout
        while self._handshakes == 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._monitor.poll(int(left * 1000) + 1):
                ev = recv_monitor_message(self._monitor)
                if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._handshakes += 1
        return True

    def describe(self) -> Dict[str, Any]:
        return {
            "pub": self.endpoint,
            "mode": self.mode,
            "replay": self.replay_endpoint,
            "replay_buffer": self.buffer_steps if self.replay_endpoint else None,
            "topic": self.topic,
        }


# --------------------------------------------------------------------------------------
# Engine model: one DP rank's prefix cache + its events.
# --------------------------------------------------------------------------------------


class BlockMeta:
    __slots__ = ("parent", "tokens", "lora_name", "digest")

    def __init__(self, parent: Optional[Hash], tokens: Tuple[int, ...], lora_name: Optional[str], digest: bytes):
        self.parent = parent
        self.tokens = tokens
        self.lora_name = lora_name
        self.digest = digest


class EngineRank:
    """One DP rank of an engine. `held[medium]` is the set of block hashes it holds
    (the ground truth); `meta` remembers every block it has ever hashed (tokens,
    parent, lora) so a held block's full token prefix can always be rebuilt."""

    def __init__(
        self,
        worker_id: int,
        dp_rank: int,
        publisher: ZmqEventPublisher,
        *,
        block_size: int,
        encoding: str,
        hash_kind: str,
        rank_field: bool = True,
    ) -> None:
        assert encoding in ENCODINGS, encoding
        assert hash_kind in HASH_KINDS, hash_kind
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.publisher = publisher
        self.block_size = block_size
        self.encoding = encoding
        self.hash_kind = hash_kind
        # data_parallel_rank in the batch: the rank, or nil (SGLang without DP attention).
        self.rank_field: Optional[int] = dp_rank if rank_field else None
        self.held: Dict[str, Dict[Hash, None]] = {m: {} for m in MEDIA}  # ordered sets
        self.meta: Dict[Hash, BlockMeta] = {}
        self.lora_ids: Dict[str, Optional[int]] = {}
        self.pending: List[Any] = []
        self.batches = 0

    # -- hashing ---------------------------------------------------------------------

    def _wire_hash(self, digest: bytes) -> Hash:
        if self.hash_kind == "uint64":
            return int.from_bytes(digest[-8:], "big")
        if self.hash_kind == "int64":
            return int.from_bytes(digest[:8], "big", signed=True)
        return digest

    def hash_chain(self, token_ids: Sequence[int], parent: Optional[Hash], lora_name: Optional[str]) -> List[Hash]:
        """Engine hashes of the complete blocks of `token_ids` after `parent` (records
        their meta)."""
        B = self.block_size
        assert len(token_ids) % B == 0, "token_ids must be whole blocks"
        prev = self.meta[parent].digest if parent is not None else b""
        out: List[Hash] = []
        for i in range(0, len(token_ids), B):
            toks = tuple(token_ids[i : i + B])
            h = hashlib.sha256()
            h.update(prev)
            h.update((lora_name or "").encode() + b"\0")
            h.update(struct.pack(f"<{B}I", *toks))
            digest = h.digest()
            wh = self._wire_hash(digest)
            self.meta[wh] = BlockMeta(parent if not out else out[-1], toks, lora_name, digest)
            out.append(wh)
            prev = digest
        return out

    # -- events ----------------------------------------------------------------------

    def store(
        self,
        token_ids: Sequence[int],
        *,
        parent: Optional[Hash] = None,
        medium: str = "GPU",
        lora_name: Optional[str] = None,
        lora_id: Optional[int] = None,
        block_hashes: Optional[List[Hash]] = None,
    ) -> List[Hash]:
        """BlockStored for the chain of complete blocks `token_ids`, child of `parent`
        (which must be held on `medium`)."""
        assert medium in MEDIA
        if parent is not None:
            assert parent in self.held[medium], "parent not held on this medium"
        if block_hashes is None:
            block_hashes = self.hash_chain(token_ids, parent, lora_name)
        else:
            B = self.block_size
            assert len(block_hashes) * B == len(token_ids)
            for i, wh in enumerate(block_hashes):
                if wh in self.meta:  # hashed before (cache_prompt): keep its digest
                    continue
                self.meta[wh] = BlockMeta(
                    parent if i == 0 else block_hashes[i - 1],
                    tuple(token_ids[i * B : (i + 1) * B]),
                    lora_name,
                    wh if isinstance(wh, bytes) else wh.to_bytes(8, "big", signed=wh < 0),
                )
        for wh in block_hashes:
            self.held[medium][wh] = None
        if lora_name:
            self.lora_ids[lora_name] = lora_id
        n = len(block_hashes)
        values: Dict[str, Any] = {
            "block_hashes": list(block_hashes),
            "parent_block_hash": parent,
            "token_ids": list(token_ids),
            "block_size": self.block_size,
            "lora_id": lora_id if lora_name else None,
            "medium": medium,
            "lora_name": lora_name,
        }
        if self.encoding == "map-v0.33":
            values["extra_keys"] = [[lora_name] if lora_name else None for _ in range(n)]
            values["group_idx"] = 0
            values["kv_cache_spec_kind"] = "full_attention"
            if medium == "CPU":
                values["locality"] = "LOCAL"
        elif self.encoding in ("map-sparse", "array-trimmed") and medium == "GPU":
            values["medium"] = None  # nil / absent medium means GPU
        self.pending.append(render_event(self.encoding, "BlockStored", values))
        return list(block_hashes)

    def cache_prompt(
        self,
        tokens: Sequence[int],
        *,
        medium: str = "GPU",
        lora_name: Optional[str] = None,
        lora_id: Optional[int] = None,
    ) -> List[Hash]:
        """What an engine does after a prefill: its complete blocks become cached; only
        the ones not already held on `medium` are announced, as one BlockStored whose
        parent is the last block already held. Returns the hashes of all the prompt's
        complete blocks."""
        B = self.block_size
        n = len(tokens) // B
        full = list(tokens[: n * B])
        # Hashes of the whole prompt (recorded in meta; deterministic).
        hashes = self.hash_chain(full, None, lora_name) if n else []
        k = 0
        while k < n and hashes[k] in self.held[medium]:
            k += 1
        if k < n:
            self.store(
                full[k * B :],
                parent=hashes[k - 1] if k else None,
                medium=medium,
                lora_name=lora_name,
                lora_id=lora_id,
                block_hashes=hashes[k:],
            )
        return hashes

    def remove(self, block_hashes: Sequence[Hash], *, medium: str = "GPU") -> None:
        """BlockRemoved: evict blocks from `medium`. Only leaves may go (no block left
        on that medium may have a removed block as parent), so every held block keeps
        a well-defined prefix."""
        gone = set(block_hashes)
        for wh in block_hashes:
            assert wh in self.held[medium], "removing a block not held"
        for wh in self.held[medium]:
            if wh not in gone:
                assert self.meta[wh].parent not in gone, "removing a parent of a held block"
        for wh in block_hashes:
            del self.held[medium][wh]
        values: Dict[str, Any] = {"block_hashes": list(block_hashes), "medium": medium}
        if self.encoding == "map-v0.33":
            values["group_idx"] = 0
        elif self.encoding in ("map-sparse", "array-trimmed") and medium == "GPU":
            values["medium"] = None
        self.pending.append(render_event(self.encoding, "BlockRemoved", values))

    def clear(self) -> None:
        """AllBlocksCleared: the rank holds nothing afterwards (every medium)."""
        for m in MEDIA:
            self.held[m].clear()
        self.pending.append(render_event(self.encoding, "AllBlocksCleared", {}))

    def resync(self) -> None:
        """Re-announce everything held (no AllBlocksCleared): per medium, the forest of
        held blocks as BlockStored runs from the roots down, parents first."""
        for m in MEDIA:
            held = self.held[m]
            children: Dict[Optional[Hash], List[Hash]] = {}
            for wh in held:
                p = self.meta[wh].parent
                assert p is None or p in held, "held block without its parent"
                children.setdefault(p, []).append(wh)

            def emit(start: Hash, parent: Optional[Hash]) -> None:
                path = [start]
                while len(children.get(path[-1], [])) == 1:
                    path.append(children[path[-1]][0])
                lora = self.meta[start].lora_name
                toks = [t for wh in path for t in self.meta[wh].tokens]
                values = {
                    "block_hashes": path,
                    "parent_block_hash": parent,
                    "token_ids": toks,
                    "block_size": self.block_size,
                    "lora_id": self.lora_ids.get(lora) if lora else None,
                    "medium": m,
                    "lora_name": lora,
                }
                if self.encoding == "map-v0.33":
                    values["extra_keys"] = [[lora] if lora else None for _ in path]
                    values["group_idx"] = 0
                    values["kv_cache_spec_kind"] = "full_attention"
                    if m == "CPU":
                        values["locality"] = "LOCAL"
                elif self.encoding in ("map-sparse", "array-trimmed") and m == "GPU":
                    values["medium"] = None
                self.pending.append(render_event(self.encoding, "BlockStored", values))
                for c in children.get(path[-1], []):
                    emit(c, path[-1])

            for root in list(children.get(None, [])):
                emit(root, None)

    def flush(self, ts: Optional[float] = None) -> Optional[int]:
        """Publish the pending events as one batch; returns its seq (None if empty)."""
        if not self.pending:
            return None
        payload = self.publisher.encode_batch(self.pending, self.rank_field, ts)
        self.pending = []
        self.batches += 1
        return self.publisher.publish_payload(payload)

    def drop_next(self, n: int = 1) -> None:
        self.publisher.drop_next(n)

    def restart(self) -> None:
        """The engine restarts: empty cache, new publisher instance (seq from 0)."""
        self.pending = []
        for m in MEDIA:
            self.held[m].clear()
        self.publisher.restart()

    # -- ground truth ----------------------------------------------------------------

    def prefix_tokens(self, wh: Hash) -> List[int]:
        chain: List[Tuple[int, ...]] = []
        cur: Optional[Hash] = wh
        while cur is not None:
            meta = self.meta[cur]
            chain.append(meta.tokens)
            cur = meta.parent
        return [t for toks in reversed(chain) for t in toks]

    def truth(self) -> List[Dict[str, Any]]:
        out = []
        for m in MEDIA:
            blocks = sorted(
                {(self.meta[wh].lora_name, tuple(self.prefix_tokens(wh))) for wh in self.held[m]},
                key=lambda b: (len(b[1]), b[0] or "", b[1]),
            )
            assert len(blocks) == len(self.held[m]), "two held blocks with one prefix"
            out.append(
                {
                    "worker_id": self.worker_id,
                    "dp_rank": self.dp_rank,
                    "medium": m,
                    "tier": TIER_OF_MEDIUM[m],
                    "blocks": [{"lora_name": lora, "tokens": list(toks)} for lora, toks in blocks],
                }
            )
        return out


class Worker:
    """A worker: one EngineRank (and one publisher) per DP rank, ports offset by the
    rank as vLLM does."""

    def __init__(
        self,
        worker_id: int,
        dp_size: int,
        *,
        block_size: int,
        encoding: str,
        hash_kind: str,
        pub_endpoint: str,
        mode: str = "auto",
        replay_endpoint: Optional[str] = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        rank_field: bool = True,
        ctx: Optional[zmq.Context] = None,
    ) -> None:
        self.worker_id = worker_id
        self.dp_size = dp_size
        self.encoding = encoding
        self.hash_kind = hash_kind
        self.ranks: List[EngineRank] = []
        for r in range(dp_size):
            pub = ZmqEventPublisher(
                pub_endpoint,
                replay_endpoint,
                dp_rank=r,
                topic=topic,
                buffer_steps=buffer_steps,
                mode=mode,
                ctx=ctx,
                name=f"w{worker_id}/dp{r}",
            )
            self.ranks.append(
                EngineRank(
                    worker_id,
                    r,
                    pub,
                    block_size=block_size,
                    encoding=encoding,
                    hash_kind=hash_kind,
                    rank_field=rank_field,
                )
            )

    def rank(self, r: int) -> EngineRank:
        return self.ranks[r]

    def flush(self) -> None:
        for r in self.ranks:
            r.flush()

    def restart(self) -> None:
        for r in self.ranks:
            r.restart()

    def close(self) -> None:
        for r in self.ranks:
            r.publisher.close()

    def describe(self) -> Dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "dp_size": self.dp_size,
            "encoding": self.encoding,
            "hash_kind": self.hash_kind,
            "publishers": [
                dict(dp_rank=r.dp_rank, data_parallel_rank=r.rank_field, **r.publisher.describe())
                for r in self.ranks
            ],
        }
