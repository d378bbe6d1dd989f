# Type stubs of the kvr package (the Python class in __init__.py and the native kvr._kvr).
import asyncio
from typing import Any, Optional, Sequence, Union

from ._errors import SelectionServiceError as SelectionServiceError

JsonLike = Any
# A sequence of ints, or any one-dimensional integer buffer (array.array, numpy, memoryview);
# a C-contiguous buffer of u32 ('I') is read in place.
Tokens = Union[Sequence[int], Any]

__version__: str
COST_MODELS: tuple[str, ...]

def hash_tokens(
    tokens: Tokens,
    kv_block_size: int,
    block_mm_infos: Optional[list[Optional[dict[str, Any]]]] = None,
    lora_name: Optional[str] = None,
    is_eagle: Optional[bool] = None,
    cache_namespace: Optional[str] = None,
) -> list[int]:
    """Local block hashes of the complete blocks: Dynamo's compute_block_hash_for_seq."""
    ...

class SelectionCacheConfig:
    ttl_secs: Optional[float]
    max_entries: Optional[int]
    max_bytes: Optional[int]
    def __init__(self, *, ttl_secs: Optional[float] = None, max_entries: Optional[int] = None,
                 max_bytes: Optional[int] = None) -> None: ...

class SelectionService:
    """Drop-in for dynamo.llm.SelectionService; `*_sync` twins need no event loop."""
    def __init__(
        self,
        *,
        indexer_threads: int = 4,
        indexer_peers: Optional[list[str]] = None,
        replica_sync_port: Optional[int] = None,
        replica_sync_peers: Optional[list[str]] = None,
        selection_cache: Optional[SelectionCacheConfig] = None,
        session_affinity_ttl_secs: Optional[float] = None,
        remote_indexer_url: Optional[str] = None,
        # kvr's cost model ("latency", the default, or "dynamo") and the latency model's
        # knobs; None keeps `kvr serve`'s default (or its KVR_* environment variable).
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
    ) -> None: ...
    def shutdown(self) -> None: ...
    async def shutdown_async(self) -> None: ...
    def upsert_worker(self, worker: JsonLike) -> asyncio.Future[JsonLike]: ...
    def patch_worker(self, worker_id: int, patch: JsonLike) -> asyncio.Future[JsonLike]: ...
    def delete_worker(self, worker_id: int) -> asyncio.Future[JsonLike]: ...
    def list_workers(self, *, model_name: Optional[str] = None,
                     routing_group: Optional[str] = None) -> JsonLike: ...
    def ready(self) -> JsonLike: ...
    # kvr's addition: every KV-event stream's state (exact, recovering, degraded, dead),
    # reason, decode errors and link failures; ready() lists the ones not exact.
    def kv_event_sources(self) -> list[dict[str, Any]]: ...
    def overlap_scores(self, request: JsonLike) -> asyncio.Future[JsonLike]: ...
    def select(self, request: JsonLike) -> asyncio.Future[JsonLike]: ...
    def select_and_reserve(self, request: JsonLike) -> asyncio.Future[JsonLike]: ...
    def create_reservation(self, request: JsonLike) -> asyncio.Future[JsonLike]: ...
    def prefill_complete(self, selection_id: str) -> asyncio.Future[None]: ...
    def add_output_block(self, selection_id: str, *,
                         decay_fraction: Optional[float] = None) -> None: ...
    def free_reservation(self, selection_id: str) -> asyncio.Future[None]: ...
    def loads(self, *, model_name: Optional[str] = None,
              routing_group: Optional[str] = None) -> JsonLike: ...
    def potential_loads(self, request: JsonLike) -> asyncio.Future[JsonLike]: ...
    def indexer_snapshot(self) -> asyncio.Future[JsonLike]: ...
    def recover_indexer_from_peers(self, peers: list[str]) -> asyncio.Future[bool]: ...
    def upsert_worker_sync(self, worker: JsonLike) -> JsonLike: ...
    def patch_worker_sync(self, worker_id: int, patch: JsonLike) -> JsonLike: ...
    def delete_worker_sync(self, worker_id: int) -> JsonLike: ...
    def select_sync(self, request: JsonLike) -> JsonLike: ...
    def select_and_reserve_sync(self, request: JsonLike) -> JsonLike: ...
    def create_reservation_sync(self, request: JsonLike) -> JsonLike: ...
    def prefill_complete_sync(self, selection_id: str) -> None: ...
    def free_reservation_sync(self, selection_id: str) -> None: ...
    def potential_loads_sync(self, request: JsonLike) -> JsonLike: ...
    def overlap_scores_sync(self, request: JsonLike) -> JsonLike: ...
    def indexer_snapshot_sync(self) -> JsonLike: ...
    def recover_indexer_from_peers_sync(self, peers: list[str]) -> bool: ...
    def __enter__(self) -> "SelectionService": ...
    def __exit__(self, *exc: Any) -> None: ...

class Decision:
    worker_id: int
    dp_rank: int
    selection_id: Optional[int]
    cached_tokens: int
    device_blocks: int
    host_blocks: int
    disk_blocks: int
    projected_prefill_tokens: int
    projected_decode_blocks: int
    # In the partition's cost model's unit: ms (latency) or block equivalents (dynamo).
    cost: float

class Partition:
    @property
    def model_name(self) -> str: ...
    @property
    def routing_group(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def cost_model(self) -> str:
        """"latency" or "dynamo"."""
        ...
    def prefill_rate(self) -> Optional[float]:
        """The learned prefill rate, tokens/s; None until a few prefills were measured."""
        ...
    def prefill_rate_observations(self) -> int: ...
    def upsert_worker(self, worker_id: int, *, dp_size: int = 1, dp_start: int = 0,
                      total_kv_blocks: int = 0) -> None: ...
    def remove_worker(self, worker_id: int) -> bool: ...
    def store(self, worker_id: int, dp_rank: int, tokens: Tokens) -> int: ...
    def select(self, tokens: Tokens, *, reserve: bool = False,
               allowed_workers: Optional[list[int]] = None, pinned_worker: Optional[int] = None,
               lora_name: Optional[str] = None, expected_output_tokens: int = 0) -> Decision: ...
    def load(self, worker_id: int, dp_rank: int = 0) -> tuple[int, int, int]: ...

class Engine:
    def __init__(self, seed: Optional[int] = None) -> None: ...
    def create_partition(
        self,
        model_name: str = "default",
        routing_group: str = "default",
        *,
        block_size: int = 16,
        use_kv_events: bool = True,
        cache_namespace: Optional[str] = None,  # salts every block hash [None]
        booking_ttl_ms: Optional[int] = None,  # a booking nobody frees expires [3600000]
        # "latency" (predicted TTFT, ms) or "dynamo" (Dynamo's scorer, block equivalents).
        cost_model: str = "latency",
        # The latency model's knobs; None = the engine's default (shown in brackets).
        prefill_rate_prior: Optional[float] = None,  # tokens/s [10000]
        learn_prefill_rate: Optional[bool] = None,  # [True]
        request_overhead_ms: Optional[float] = None,  # [5]
        kv_pressure_threshold: Optional[float] = None,  # share of KV blocks, 0..1 [0.9]
        kv_pressure_ms: Optional[float] = None,  # [1000]
        itl_target_ms: Optional[float] = None,  # [None: no target]
        itl_base_ms: Optional[float] = None,  # [20]
        itl_per_request_ms: Optional[float] = None,  # [0.2]
        queue_externality: Optional[float] = None,  # [2]
        decode_block_us: Optional[float] = None,  # [1]
        # Dynamo's knobs (the latency model reads the cache credits and temperature too).
        overlap_score_credit: Optional[float] = None,  # [1.0]
        prefill_load_scale: Optional[float] = None,  # [1.0]
        host_cache_hit_weight: Optional[float] = None,  # [0.75]
        disk_cache_hit_weight: Optional[float] = None,  # [0.25]
        temperature: Optional[float] = None,  # 0 = lowest cost wins [0]
        decode_active_request_weight: Optional[float] = None,  # [0: off]
        credit_decay: Optional[float] = None,  # [None: off]
        # Busy thresholds (None = none): a rank past one is not chosen.
        busy_decode_blocks_fraction: Optional[float] = None,  # of its total KV blocks
        busy_prefill_tokens: Optional[int] = None,
        busy_prefill_tokens_fraction: Optional[float] = None,  # of its max batched tokens
    ) -> Partition: ...
    def mark_prefill_complete(self, selection_id: int) -> None: ...
    def add_output_blocks(self, selection_id: int, n: int = 1) -> None: ...
    def free(self, selection_id: int) -> bool: ...

class NativeService:
    def __init__(self, argv: list[str]) -> None: ...
