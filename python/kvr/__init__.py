"""kvr: a KV-cache-aware selection engine for LLM inference routing.

``kvr.SelectionService`` is a drop-in for Dynamo 1.6.1's ``dynamo.llm.SelectionService``:
the same constructor arguments, methods and dicts (the field names of its HTTP API), the
same methods awaitable. Each awaitable method also has a ``*_sync`` twin for callers
without an event loop (``select_sync``, ``select_and_reserve_sync``, ...). The work is
kvr-service's, the engine behind ``kvr serve``, called in process with the GIL released.

``kvr.Engine`` / ``kvr.Partition`` / ``kvr.Decision`` are the typed hot path (token
arrays in, no dicts), and ``kvr.hash_tokens`` is Dynamo's ``compute_block_hash_for_seq``.

Cost models: kvr minimises each rank's predicted time to first token by default
(``cost_model="latency"``; costs in ms). To route exactly as Dynamo does, pass
``cost_model="dynamo"`` to ``SelectionService(...)`` or ``Engine.create_partition(...)``
(or set ``KVR_COST_MODEL=dynamo`` for the service); its costs are Dynamo's block
equivalents. Both take the latency model's knobs as keyword arguments.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Optional

from ._errors import SelectionServiceError
from ._kvr import Decision, Engine, NativeService, Partition, __version__, hash_tokens

__all__ = [
    "COST_MODELS",
    "Decision",
    "Engine",
    "Partition",
    "SelectionCacheConfig",
    "SelectionService",
    "SelectionServiceError",
    "hash_tokens",
    "__version__",
]


class SelectionCacheConfig:
    """Bounds of the pending-selection cache (``select`` with a ``selection_id``), as
    Dynamo's ``SelectionCacheConfig``; ``None`` keeps the default (120 s, 4096 entries,
    256 MiB). ``SelectionService(selection_cache=...)`` takes only this class: Dynamo's
    own keeps its bounds where Python cannot read them, and a dict is refused as Dynamo
    refuses it (a ``TypeError`` either way, never a bound silently dropped)."""

    def __init__(self, *, ttl_secs: Optional[float] = None, max_entries: Optional[int] = None,
                 max_bytes: Optional[int] = None) -> None:
        """The bounds (checked when the service starts: a ``ValueError`` if out of range)."""
        self.ttl_secs = ttl_secs
        self.max_entries = max_entries
        self.max_bytes = max_bytes


def _cache_config(c: Any) -> SelectionCacheConfig:
    """``selection_cache`` as kvr's class, or a TypeError: never a bound silently dropped.

    Dynamo's own ``SelectionCacheConfig`` keeps its bounds in native fields Python cannot
    read (no attributes, no pickling), so kvr cannot honour them and refuses the object,
    naming the class to pass instead. Anything else (a dict, ...) is refused with the
    TypeError Dynamo's constructor raises for it."""
    if isinstance(c, SelectionCacheConfig):
        return c
    kind = type(c).__name__
    if kind == "SelectionCacheConfig":
        raise TypeError(
            "argument 'selection_cache': Dynamo's SelectionCacheConfig does not expose its "
            "bounds to Python, so kvr cannot honour them; pass kvr.SelectionCacheConfig("
            "ttl_secs=..., max_entries=..., max_bytes=...) with the same arguments")
    raise TypeError(f"argument 'selection_cache': '{kind}' object cannot be converted to "
                    "'SelectionCacheConfig'")


def _count(name: str, v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be an int >= 0")
    return str(v)


def _whole_secs(name: str, v: float, lo: int = 0) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < lo:
        raise ValueError(f"{name} must be a number of seconds >= {lo}")
    if v > 31536000:
        raise ValueError(f"{name} must be at most 31536000 seconds")
    # kvr keeps whole seconds; a fraction rounds up (never shorter than asked).
    return str(int(-(-v // 1)))


#: kvr's cost models (``cost_model=``): ``"latency"`` (the default, predicted time to first
#: token in ms) and ``"dynamo"`` (Dynamo's default scorer, term for term).
COST_MODELS = ("latency", "dynamo")

#: The latency model's knobs as ``SelectionService`` keyword arguments, each mapped to its
#: ``kvr serve`` flag (``None`` = the flag's default, or its ``KVR_*`` environment variable).
_LATENCY_FLAGS = {
    "prefill_rate_prior": "--prefill-rate-prior",
    "learn_prefill_rate": "--learn-prefill-rate",
    "request_overhead_ms": "--request-overhead-ms",
    "kv_pressure_threshold": "--kv-pressure-threshold",
    "kv_pressure_ms": "--kv-pressure-ms",
    "itl_target_ms": "--itl-target-ms",
    "itl_base_ms": "--itl-base-ms",
    "itl_per_request_ms": "--itl-per-request-ms",
    "queue_externality": "--queue-externality",
    "decode_block_us": "--decode-block-us",
}


def _cost_argv(cost_model, latency: dict) -> list[str]:
    argv: list[str] = []
    if cost_model is not None:
        if cost_model not in COST_MODELS:
            raise ValueError(f"unknown cost_model {cost_model!r} (valid: "
                             + ", ".join(repr(m) for m in COST_MODELS) + ")")
        argv += ["--cost-model", cost_model]
    for name, flag in _LATENCY_FLAGS.items():
        v = latency[name]
        if v is None:
            continue
        if name == "learn_prefill_rate":
            if not isinstance(v, bool):
                raise ValueError("learn_prefill_rate must be a bool")
            argv += [flag, "true" if v else "false"]
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name} must be a number")
        argv += [flag, repr(float(v))]
    return argv


def _argv(indexer_threads, indexer_peers, replica_sync_port, replica_sync_peers,
          selection_cache, session_affinity_ttl_secs, remote_indexer_url) -> list[str]:
    if isinstance(indexer_threads, bool) or not isinstance(indexer_threads, int) or indexer_threads < 1:
        raise ValueError("indexer_threads must be an int >= 1")
    argv: list[str] = []
    if indexer_peers:
        argv += ["--indexer-peers", ",".join(indexer_peers)]
    # Dynamo's checks, in its words.
    if replica_sync_peers and replica_sync_port is None:
        raise ValueError("replica_sync_peers requires replica_sync_port")
    if replica_sync_port is not None and int(replica_sync_port) <= 0:
        raise Exception("replica sync port must be greater than zero")
    if replica_sync_port is not None:
        argv += ["--replica-sync-port", str(int(replica_sync_port))]
    if replica_sync_peers:
        argv += ["--replica-sync-peers", ",".join(replica_sync_peers)]
    if selection_cache is not None:
        c = _cache_config(selection_cache)
        if c.ttl_secs is not None:
            argv += ["--selection-cache-ttl-secs", _whole_secs("ttl_secs", c.ttl_secs)]
        if c.max_entries is not None:
            argv += ["--selection-cache-max-entries", _count("max_entries", c.max_entries)]
        if c.max_bytes is not None:
            argv += ["--selection-cache-max-bytes", _count("max_bytes", c.max_bytes)]
    if session_affinity_ttl_secs is not None:
        argv += ["--session-affinity-ttl-secs",
                 _whole_secs("session_affinity_ttl_secs", session_affinity_ttl_secs, 1)]
    if remote_indexer_url is not None:
        argv += ["--remote-indexer-url", str(remote_indexer_url)]
    return argv


class SelectionService:
    """In-process selection service, a drop-in for ``dynamo.llm.SelectionService``.

    The awaitable methods return an ``asyncio.Future`` of the running loop, as Dynamo's
    do: bad input raises ``ValueError`` at the call, other failures
    (``SelectionServiceError``) come out of the await. The engine answers in
    microseconds, so the future is complete when returned; with ``remote_indexer_url``
    (kvr's addition: overlaps from a remote primary index, a network round trip per
    selection) the work runs on the loop's default executor instead.

    kvr's other additions, all keyword-only and all ``None`` by default (then ``kvr
    serve``'s default, or its environment variable, applies): ``cost_model`` —
    ``"latency"`` (kvr's default: each rank's predicted time to first token, in ms) or
    ``"dynamo"`` (Dynamo's default scorer term for term, in block equivalents; what a
    deployment that must route exactly as Dynamo does sets), ``--cost-model`` /
    ``KVR_COST_MODEL``; and the latency model's knobs ``prefill_rate_prior``,
    ``learn_prefill_rate``, ``request_overhead_ms``, ``kv_pressure_threshold``,
    ``kv_pressure_ms``, ``itl_target_ms``, ``itl_base_ms``, ``itl_per_request_ms``,
    ``queue_externality``, ``decode_block_us`` (``--prefill-rate-prior`` /
    ``KVR_PREFILL_RATE_PRIOR`` and so on). An unknown model or a knob out of range is a
    ``ValueError``. ``state_dir`` keeps each partition's index and the workers'
    registrations in that directory for a warm restart, written as ``state_io`` says
    (``"auto"``, ``"uring"``, ``"plain"``): ``--state-dir`` / ``KVR_STATE_DIR`` and
    ``--state-io`` / ``KVR_STATE_IO``; ``shutdown()`` writes the final snapshots.
    """

    def __init__(self, *, indexer_threads: int = 4, indexer_peers: Optional[list[str]] = None,
                 replica_sync_port: Optional[int] = None,
                 replica_sync_peers: Optional[list[str]] = None,
                 selection_cache: Optional[SelectionCacheConfig] = None,
                 session_affinity_ttl_secs: Optional[float] = None,
                 remote_indexer_url: Optional[str] = None,
                 cost_model: Optional[str] = None,
                 prefill_rate_prior: Optional[float] = None,
                 learn_prefill_rate: Optional[bool] = None,
                 request_overhead_ms: Optional[float] = None,
                 kv_pressure_threshold: Optional[float] = None,
                 kv_pressure_ms: Optional[float] = None,
                 itl_target_ms: Optional[float] = None,
                 itl_base_ms: Optional[float] = None,
                 itl_per_request_ms: Optional[float] = None,
                 queue_externality: Optional[float] = None,
                 decode_block_us: Optional[float] = None,
                 state_dir: Optional[str] = None,
                 state_io: Optional[str] = None) -> None:
        """Starts the service (see the class docstring for the arguments)."""
        argv = _argv(indexer_threads, indexer_peers, replica_sync_port, replica_sync_peers,
                     selection_cache, session_affinity_ttl_secs, remote_indexer_url)
        argv += _cost_argv(cost_model, dict(
            prefill_rate_prior=prefill_rate_prior, learn_prefill_rate=learn_prefill_rate,
            request_overhead_ms=request_overhead_ms,
            kv_pressure_threshold=kv_pressure_threshold, kv_pressure_ms=kv_pressure_ms,
            itl_target_ms=itl_target_ms, itl_base_ms=itl_base_ms,
            itl_per_request_ms=itl_per_request_ms, queue_externality=queue_externality,
            decode_block_us=decode_block_us))
        if state_dir is not None:
            argv += ["--state-dir", os.fspath(state_dir)]
        if state_io is not None:
            argv += ["--state-io", str(state_io)]
        self._core = NativeService(argv)
        self._offload = self._core.uses_remote_index()

    # -- the awaitable surface (Dynamo's), on the running loop
    def _future(self, fn, *args) -> "asyncio.Future[Any]":
        loop = asyncio.get_running_loop()
        if self._offload:
            return loop.run_in_executor(None, fn, *args)
        fut = loop.create_future()
        try:
            fut.set_result(fn(*args))
        except SelectionServiceError as e:
            fut.set_exception(e)
        return fut

    def upsert_worker(self, worker: dict) -> "asyncio.Future[dict]":
        """Adds or replaces a worker (Dynamo's worker dict) and subscribes to its KV events; resolves to its catalog record."""
        return self._future(self._core.upsert_worker, worker)

    def patch_worker(self, worker_id: int, patch: dict) -> "asyncio.Future[dict]":
        """Changes some fields of a known worker; resolves to its catalog record."""
        return self._future(self._core.patch_worker, worker_id, patch)

    def delete_worker(self, worker_id: int) -> "asyncio.Future[dict]":
        """Removes a worker and stops its KV events; resolves to its last catalog record."""
        return self._future(self._core.delete_worker, worker_id)

    def select(self, request: dict) -> "asyncio.Future[dict]":
        """Chooses a rank for the request dict without booking it (with ``selection_id``, the choice is held for a later ``create_reservation`` claim); resolves to the choice."""
        return self._future(self._core.select, request)

    def select_and_reserve(self, request: dict) -> "asyncio.Future[dict]":
        """Chooses a rank and books the request on it; resolves to the choice with its ``selection_id``."""
        return self._future(self._core.select_and_reserve, request)

    def create_reservation(self, request: dict) -> "asyncio.Future[dict]":
        """Books a request on a rank the caller chose, or claims a pending ``select``; resolves to the booking."""
        return self._future(self._core.create_reservation, request)

    def prefill_complete(self, selection_id: str) -> "asyncio.Future[None]":
        """The booking's prefill is done: its prefill tokens leave the rank's load. Resolves to ``None``."""
        return self._future(self._core.prefill_complete, selection_id)

    def free_reservation(self, selection_id: str) -> "asyncio.Future[None]":
        """Ends a booking; its load leaves the rank. Resolves to ``None``."""
        return self._future(self._core.free_reservation, selection_id)

    def potential_loads(self, request: dict) -> "asyncio.Future[list]":
        """Resolves to each candidate rank's load were the request booked on it."""
        return self._future(self._core.potential_loads, request)

    def overlap_scores(self, request: dict) -> "asyncio.Future[dict]":
        """Resolves to each candidate rank's cached-prefix overlap for the request, in blocks."""
        return self._future(self._core.overlap_scores, request)

    def indexer_snapshot(self) -> "asyncio.Future[dict]":
        """Resolves to the index as ``GET /dump`` answers it (what a peer recovers from)."""
        return self._future(self._core.indexer_snapshot)

    def recover_indexer_from_peers(self, peers: list[str]) -> "asyncio.Future[bool]":
        """Loads the index from the first peer whose ``/dump`` answers; resolves to False when none could be used. Runs on the loop's default executor (blocking HTTP)."""
        # Blocking HTTP GETs: always off the loop.
        return asyncio.get_running_loop().run_in_executor(
            None, self._core.recover_indexer_from_peers, list(peers))

    async def shutdown_async(self) -> None:
        """``shutdown()`` as a coroutine."""
        self._core.shutdown()

    # -- synchronous in Dynamo too
    def list_workers(self, *, model_name: Optional[str] = None,
                     routing_group: Optional[str] = None) -> list:
        """The catalog records, optionally of one model and routing group."""
        return self._core.list_workers(model_name, routing_group)

    def ready(self) -> dict:
        """Readiness: ``ready``, the worker records and the KV-event streams that are not exact."""
        return self._core.ready()

    def kv_event_sources(self) -> list:
        """kvr's addition: every KV-event stream's state (``exact``, ``recovering``,
        ``degraded``, ``dead``), ``reason``, ``decode_errors`` and ``link_failures``;
        ``ready()`` lists the streams that are not exact."""
        return self._core.kv_event_sources()

    def loads(self, *, model_name: Optional[str] = None,
              routing_group: Optional[str] = None) -> list:
        """Each rank's booked load (prefill tokens, decode blocks, active requests), optionally of one model and routing group."""
        return self._core.loads(model_name, routing_group)

    def add_output_block(self, selection_id: str, *,
                         decay_fraction: Optional[float] = None) -> None:
        """The booking's decode grew by one output block (``decay_fraction`` decays its prefill credit)."""
        return self._core.add_output_block(selection_id, decay_fraction=decay_fraction)

    def shutdown(self) -> None:
        """Stops the KV-event subscriptions and the sweeper; later calls fail fast. Idempotent."""
        self._core.shutdown()

    def register_replica_peer(self, endpoint: str) -> bool:
        """Applies a peer replica's bookings from its sync endpoint (``tcp://host:port``); True when the peer is new, False when it was one already."""
        if not isinstance(endpoint, str):
            raise TypeError("endpoint must be a str")
        return self._core.register_replica_peer(endpoint)

    def deregister_replica_peer(self, endpoint: str) -> bool:
        """Stops applying a peer replica's bookings; False when it was not a peer."""
        if not isinstance(endpoint, str):
            raise TypeError("endpoint must be a str")
        return self._core.deregister_replica_peer(endpoint)

    def list_replica_peers(self) -> list:
        """The peer replicas' sync endpoints, sorted (empty without replica sync)."""
        return self._core.list_replica_peers()

    def replica_sync_stats(self) -> dict:
        """kvr's addition: the replica sync's counters (events sent, received, applied, and each reason one was not); empty without replica sync."""
        return self._core.replica_sync_stats()

    # -- synchronous twins of the awaitable methods (kvr's; no event loop needed)
    def upsert_worker_sync(self, worker: dict) -> dict:
        """The synchronous twin of ``upsert_worker`` (kvr's; no event loop needed): answers directly."""
        return self._core.upsert_worker(worker)

    def patch_worker_sync(self, worker_id: int, patch: dict) -> dict:
        """The synchronous twin of ``patch_worker`` (kvr's; no event loop needed): answers directly."""
        return self._core.patch_worker(worker_id, patch)

    def delete_worker_sync(self, worker_id: int) -> dict:
        """The synchronous twin of ``delete_worker`` (kvr's; no event loop needed): answers directly."""
        return self._core.delete_worker(worker_id)

    def select_sync(self, request: dict) -> dict:
        """The synchronous twin of ``select`` (kvr's; no event loop needed): answers directly."""
        return self._core.select(request)

    def select_and_reserve_sync(self, request: dict) -> dict:
        """The synchronous twin of ``select_and_reserve`` (kvr's; no event loop needed): answers directly."""
        return self._core.select_and_reserve(request)

    def create_reservation_sync(self, request: dict) -> dict:
        """The synchronous twin of ``create_reservation`` (kvr's; no event loop needed): answers directly."""
        return self._core.create_reservation(request)

    def prefill_complete_sync(self, selection_id: str) -> None:
        """The synchronous twin of ``prefill_complete`` (kvr's; no event loop needed): answers directly."""
        return self._core.prefill_complete(selection_id)

    def free_reservation_sync(self, selection_id: str) -> None:
        """The synchronous twin of ``free_reservation`` (kvr's; no event loop needed): answers directly."""
        return self._core.free_reservation(selection_id)

    def potential_loads_sync(self, request: dict) -> list:
        """The synchronous twin of ``potential_loads`` (kvr's; no event loop needed): answers directly."""
        return self._core.potential_loads(request)

    def overlap_scores_sync(self, request: dict) -> dict:
        """The synchronous twin of ``overlap_scores`` (kvr's; no event loop needed): answers directly."""
        return self._core.overlap_scores(request)

    def indexer_snapshot_sync(self) -> dict:
        """The synchronous twin of ``indexer_snapshot`` (kvr's; no event loop needed): answers directly."""
        return self._core.indexer_snapshot()

    def recover_indexer_from_peers_sync(self, peers: list[str]) -> bool:
        """The synchronous twin of ``recover_indexer_from_peers`` (kvr's; no event loop needed): answers directly."""
        return self._core.recover_indexer_from_peers(list(peers))

    def __enter__(self) -> "SelectionService":
        """The service itself (``with SelectionService(...) as svc:``)."""
        return self

    def __exit__(self, *exc) -> None:
        """Calls ``shutdown()``."""
        self.shutdown()
