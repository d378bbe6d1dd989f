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
                 max_bytes: Optional[int] = None) -> None:
        """Bounds of the pending-selection cache; None keeps the default (120 s, 4096 entries, 256 MiB)."""
        ...

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
        # kvr's warm restart: each partition's index (and the workers' registrations)
        # kept in this directory; state_io "auto", "uring" or "plain" (kvr serve's
        # --state-dir / --state-io, KVR_STATE_DIR / KVR_STATE_IO).
        state_dir: Optional[str] = None,
        state_io: Optional[str] = None,
    ) -> None:
        """Starts the service. Dynamo's arguments, plus kvr's cost model and latency knobs and its state directory (None keeps the default). `selection_cache` must be a kvr.SelectionCacheConfig (a dict or Dynamo's own config object is a TypeError: Dynamo's keeps its bounds out of Python's reach). Bad values are a ValueError."""
        ...
    def shutdown(self) -> None:
        """Stops the KV-event subscriptions and the sweeper and, with state_dir, writes every partition's final snapshot; later calls fail fast and ready() answers not ready. Idempotent."""
        ...
    async def shutdown_async(self) -> None:
        """shutdown() as a coroutine."""
        ...
    def register_replica_peer(self, endpoint: str) -> bool:
        """Applies a peer replica's bookings from its sync endpoint (tcp://host:port); True when new, False when it was a peer already. Raises when replica sync is off or the endpoint is invalid."""
        ...
    def deregister_replica_peer(self, endpoint: str) -> bool:
        """Stops applying a peer replica's bookings; False when it was not a peer."""
        ...
    def list_replica_peers(self) -> list[str]:
        """The peer replicas' sync endpoints, sorted (empty without replica sync)."""
        ...
    def replica_sync_stats(self) -> dict[str, int]:
        """kvr's addition: the replica sync's counters; empty without replica sync."""
        ...
    def upsert_worker(self, worker: JsonLike) -> asyncio.Future[JsonLike]:
        """Adds or replaces a worker and subscribes to its KV events; resolves to its catalog record."""
        ...
    def patch_worker(self, worker_id: int, patch: JsonLike) -> asyncio.Future[JsonLike]:
        """Changes some fields of a known worker; resolves to its catalog record."""
        ...
    def delete_worker(self, worker_id: int) -> asyncio.Future[JsonLike]:
        """Removes a worker and stops its KV events; resolves to its last catalog record."""
        ...
    def list_workers(self, *, model_name: Optional[str] = None,
                     routing_group: Optional[str] = None) -> JsonLike:
        """The catalog records, optionally of one model and routing group."""
        ...
    def ready(self) -> JsonLike:
        """Readiness: `ready`, the worker records and the KV-event streams that are not exact."""
        ...
    # kvr's addition: every KV-event stream's state (exact, recovering, degraded, dead),
    # reason, decode errors and link failures; ready() lists the ones not exact.
    def kv_event_sources(self) -> list[dict[str, Any]]:
        """kvr's addition: every KV-event stream's state (exact, recovering, degraded, dead), reason, decode errors and link failures; ready() lists the ones not exact."""
        ...
    def overlap_scores(self, request: JsonLike) -> asyncio.Future[JsonLike]:
        """Resolves to each candidate rank's cached-prefix overlap for the request, in blocks."""
        ...
    def select(self, request: JsonLike) -> asyncio.Future[JsonLike]:
        """Chooses a rank without booking it (with `selection_id`, held for a create_reservation claim); resolves to the choice."""
        ...
    def select_and_reserve(self, request: JsonLike) -> asyncio.Future[JsonLike]:
        """Chooses a rank and books the request on it; resolves to the choice with its selection_id."""
        ...
    def create_reservation(self, request: JsonLike) -> asyncio.Future[JsonLike]:
        """Books a request on a rank the caller chose, or claims a pending select; resolves to the booking."""
        ...
    def prefill_complete(self, selection_id: str) -> asyncio.Future[None]:
        """The booking's prefill is done: its prefill tokens leave the rank's load."""
        ...
    def add_output_block(self, selection_id: str, *,
                         decay_fraction: Optional[float] = None) -> None:
        """The booking's decode grew by one output block (decay_fraction decays its prefill credit)."""
        ...
    def free_reservation(self, selection_id: str) -> asyncio.Future[None]:
        """Ends a booking; its load leaves the rank."""
        ...
    def loads(self, *, model_name: Optional[str] = None,
              routing_group: Optional[str] = None) -> JsonLike:
        """Each rank's booked load (prefill tokens, decode blocks, active requests)."""
        ...
    def potential_loads(self, request: JsonLike) -> asyncio.Future[JsonLike]:
        """Resolves to each candidate rank's load were the request booked on it."""
        ...
    def indexer_snapshot(self) -> asyncio.Future[JsonLike]:
        """Resolves to the index as GET /dump answers it (what a peer recovers from)."""
        ...
    def recover_indexer_from_peers(self, peers: list[str]) -> asyncio.Future[bool]:
        """Loads the index from the first peer whose /dump answers; resolves to False when none could be used."""
        ...
    def upsert_worker_sync(self, worker: JsonLike) -> JsonLike:
        """The synchronous twin of upsert_worker (no event loop needed): answers directly."""
        ...
    def patch_worker_sync(self, worker_id: int, patch: JsonLike) -> JsonLike:
        """The synchronous twin of patch_worker (no event loop needed): answers directly."""
        ...
    def delete_worker_sync(self, worker_id: int) -> JsonLike:
        """The synchronous twin of delete_worker (no event loop needed): answers directly."""
        ...
    def select_sync(self, request: JsonLike) -> JsonLike:
        """The synchronous twin of select (no event loop needed): answers directly."""
        ...
    def select_and_reserve_sync(self, request: JsonLike) -> JsonLike:
        """The synchronous twin of select_and_reserve (no event loop needed): answers directly."""
        ...
    def create_reservation_sync(self, request: JsonLike) -> JsonLike:
        """The synchronous twin of create_reservation (no event loop needed): answers directly."""
        ...
    def prefill_complete_sync(self, selection_id: str) -> None:
        """The synchronous twin of prefill_complete (no event loop needed): answers directly."""
        ...
    def free_reservation_sync(self, selection_id: str) -> None:
        """The synchronous twin of free_reservation (no event loop needed): answers directly."""
        ...
    def potential_loads_sync(self, request: JsonLike) -> JsonLike:
        """The synchronous twin of potential_loads (no event loop needed): answers directly."""
        ...
    def overlap_scores_sync(self, request: JsonLike) -> JsonLike:
        """The synchronous twin of overlap_scores (no event loop needed): answers directly."""
        ...
    def indexer_snapshot_sync(self) -> JsonLike:
        """The synchronous twin of indexer_snapshot (no event loop needed): answers directly."""
        ...
    def recover_indexer_from_peers_sync(self, peers: list[str]) -> bool:
        """The synchronous twin of recover_indexer_from_peers (no event loop needed): answers directly."""
        ...
    def __enter__(self) -> "SelectionService":
        """The service itself."""
        ...
    def __exit__(self, *exc: Any) -> None:
        """Calls shutdown()."""
        ...

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
    def model_name(self) -> str:
        """The partition's model name."""
        ...
    @property
    def routing_group(self) -> str:
        """The partition's routing group."""
        ...
    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        ...
    @property
    def cost_model(self) -> str:
        """"latency" or "dynamo"."""
        ...
    def state_restored(self) -> Optional[dict[str, Any]]:
        """What the restore at creation found (snapshot_found, snapshot_blocks, records, events, refused, refused_files, streams, stopped, seconds); None without state_dir."""
        ...
    def state_stats(self) -> Optional[dict[str, int]]:
        """The journal writer's figures (events_queued, events_dropped, records_written, bytes_written, syncs, write_failures, snapshots, snapshot_failures, snapshot_blocks, journal_bytes, uring, closed); None without state_dir."""
        ...
    def close_state(self) -> None:
        """Writes a final snapshot and stops the journal (also done when the partition object goes away); ValueError without state_dir. Idempotent."""
        ...
    def prefill_rate(self) -> Optional[float]:
        """The learned prefill rate, tokens/s; None until a few prefills were measured."""
        ...
    def prefill_rate_observations(self) -> int:
        """How many prefills the learned rate has seen."""
        ...
    def decode_drag(self) -> Optional[float]:
        """The learned decode drag, seconds of time to first token per decode block a rank holds; None until prefills on ranks of different loads were measured."""
        ...
    def decode_drag_observations(self) -> int:
        """How many prefills the learned decode drag has seen."""
        ...
    def upsert_worker(self, worker_id: int, *, dp_size: int = 1, dp_start: int = 0,
                      total_kv_blocks: int = 0) -> None:
        """Adds or replaces a worker of dp_size ranks from dp_start."""
        ...
    def remove_worker(self, worker_id: int) -> bool:
        """Removes a worker, its cached blocks and bookings; False if it was unknown."""
        ...
    def store(self, worker_id: int, dp_rank: int, tokens: Tokens) -> int:
        """Records that a rank caches the complete blocks of tokens (a KV stored event); returns the blocks stored."""
        ...
    def select(self, tokens: Tokens, *, reserve: bool = False,
               allowed_workers: Optional[list[int]] = None, pinned_worker: Optional[int] = None,
               lora_name: Optional[str] = None, expected_output_tokens: int = 0) -> Decision:
        """Chooses a rank for tokens (reserve=True books it and fills selection_id)."""
        ...
    def load(self, worker_id: int, dp_rank: int = 0) -> tuple[int, int, int]:
        """A rank's booked load: (prefill tokens, decode blocks, active requests)."""
        ...

class Engine:
    def __init__(self, seed: Optional[int] = None) -> None:
        """A new engine with no partitions; seed makes tie-breaks and temperature sampling reproducible."""
        ...
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
        # Warm restart: the partition restored from its own directory under state_dir at
        # creation and journaled after; state_io "auto" (io_uring if it can be had; the
        # KVR_STATE_IO environment variable replaces it), "uring" or "plain".
        state_dir: Optional[str] = None,
        state_io: str = "auto",
    ) -> Partition:
        """A new partition (one model and routing group); ValueError if it exists, for an unknown cost_model, state_io or a knob out of range; OSError if state_dir cannot be created or written as state_io asks, or another partition of this process keeps its state there."""
        ...
    def mark_prefill_complete(self, selection_id: int) -> None:
        """The booking's prefill is done (its prefill tokens leave the rank's load)."""
        ...
    def add_output_blocks(self, selection_id: int, n: int = 1) -> None:
        """The booking's decode grew by n output blocks."""
        ...
    def free(self, selection_id: int) -> bool:
        """Ends a booking: True if it was live."""
        ...

class NativeService:
    def __init__(self, argv: list[str]) -> None:
        """The native core (internal): kvr serve's flags as argv."""
        ...
