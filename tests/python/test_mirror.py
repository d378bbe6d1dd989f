"""The Python bindings' mirror of the engine's structs against their field lists
(engine/src/fields.rs, read from ffi/fields.json, which ffi/tests/fields_json.rs checks
against the engine): the knobs of ``Engine.create_partition`` and
``SelectionService.__init__`` and the figures ``Partition`` reads, in both the runtime
objects (``inspect``) and the stub (``python/kvr/__init__.pyi``, ``ast``). Naming rule:
the engine's name. Each host's table says where it mirrors a struct and, with a reason,
where it legitimately differs. A missing or extra name, a stale exception or an engine
struct a host does not place fails."""

from __future__ import annotations

import ast
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path

import kvr

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "python" / "kvr" / "__init__.pyi"

ENV = "read from kvr serve's environment (DYN_ROUTER_*/KVR_*), as Dynamo's SelectionService reads its router settings"
SERVICE_DEFAULT = "kvr serve's default (it has no such flag)"


@dataclass
class Host:
    """Where one Python API mirrors the engine's structs."""

    name: str
    #: engine struct -> (location, prefix) where its fields are, by the naming rule.
    places: dict
    #: engine struct -> why this host does not mirror it.
    not_mirrored: dict
    #: (struct, field) -> (name in the struct's location, why).
    renamed: dict = field(default_factory=dict)
    #: (struct, field) -> why the host omits it.
    omitted: dict = field(default_factory=dict)
    #: name in a location -> why it mirrors no engine field.
    extra: dict = field(default_factory=dict)
    #: whether a name of the location that mirrors nothing fails (not for a class's methods).
    check_extras: bool = True


NO_STATS = "the Partition host's (create_partition configures)"

CREATE_PARTITION = Host(
    name="Engine.create_partition",
    places={
        "PartitionConfig": ("create_partition", ""),
        "CostConfig": ("create_partition", ""),
        "LatencyConfig": ("create_partition", ""),
        "BusyThresholds": ("create_partition", "busy_"),
        "IndexerConfig": ("create_partition", ""),
    },
    not_mirrored={
        "CostOverrides": "the typed select() takes no per-request overrides (SelectionService requests carry router_config_override)",
        "HintConfig": "transfer hints need workers' control endpoints, which Partition.upsert_worker does not take",
        "SessionConfig": "the typed select() carries no session (SelectionService's requests do)",
        "ApproxConfig": "its defaults (TTL 120 s, 2^20 blocks) serve use_kv_events=False",
        **{s: NO_STATS for s in ("IndexStats", "SelectionStats", "SessionStats", "IndexerStats",
                                  "ApproxStats", "ReservationStats", "StreamStats",
                                  "SequenceStats", "RankLoad", "ActiveLoad")},
    },
    renamed={
        ("PartitionConfig", "booking_ttl"): ("booking_ttl_ms", "milliseconds, as the C ABI"),
        ("CostConfig", "model"): ("cost_model", "`model` alone would not say which model"),
    },
    omitted={
        ("PartitionConfig", "index_dump"): "the typed path has no index dump",
        ("PartitionConfig", "trust_stale_overlap"): "the typed path has no event streams (store() applies blocks at once): nothing is ever stale",
        ("CostConfig", "shared_cache_multiplier"): "Python sets no shared-cache hook: nothing to multiply",
        ("IndexerConfig", "prediction_ttl"): "predictions bridge the delay of engine events; store() applies blocks at once",
        ("IndexerConfig", "remote_url"): "the typed path has no network client (SelectionService(remote_indexer_url=...) has)",
        ("IndexerConfig", "remote_connect_timeout"): "no network client in the typed path",
        ("IndexerConfig", "remote_request_timeout"): "no network client in the typed path",
        ("IndexerConfig", "remote_client"): "no network client in the typed path",
        ("IndexerConfig", "retention"): "approximate-index retention, with ApproxConfig: its default",
    },
    extra={
        "model_name": "the partition's key, not a config field",
        "routing_group": "the partition's key, not a config field",
        "state_dir": "kvr-state's (the partition kept on disk), not an engine field",
        "state_io": "kvr-state's (how its files are written), not an engine field",
    },
)

SELECTION_SERVICE = Host(
    name="SelectionService.__init__",
    places={
        "CostConfig": ("__init__", ""),
        "LatencyConfig": ("__init__", ""),
        "IndexerConfig": ("__init__", ""),
        "SessionConfig": ("__init__", ""),
    },
    not_mirrored={
        "PartitionConfig": ENV,
        "CostOverrides": "per request: router_config_override in the request dict",
        "BusyThresholds": "kvr serve marks no rank busy, as Dynamo's service",
        "HintConfig": "kvr serve answers no transfer hints, as Dynamo's service",
        "ApproxConfig": SERVICE_DEFAULT,
        **{s: "kvr serve's GET /metrics, not the constructor"
           for s in ("IndexStats", "SelectionStats", "SessionStats", "IndexerStats",
                     "ApproxStats", "ReservationStats", "StreamStats", "SequenceStats")},
        "RankLoad": "reported by engines, not configured",
        "ActiveLoad": "the loads() method's dicts",
    },
    renamed={
        ("CostConfig", "model"): ("cost_model", "`model` alone would not say which model"),
        ("IndexerConfig", "remote_url"): ("remote_indexer_url", "kvr serve's flag name"),
        ("SessionConfig", "idle_ttl"): ("session_affinity_ttl_secs", "Dynamo's argument, in seconds"),
    },
    omitted={
        **{("CostConfig", f): ENV for f in (
            "overlap_score_credit", "prefill_load_scale", "host_cache_hit_weight",
            "disk_cache_hit_weight", "temperature", "decode_active_request_weight", "credit_decay")},
        ("CostConfig", "shared_cache_multiplier"): "kvr serve sets no shared-cache hook",
        ("IndexerConfig", "use_kv_events"): ENV,
        ("IndexerConfig", "prediction_ttl"): SERVICE_DEFAULT,
        ("IndexerConfig", "remote_connect_timeout"): SERVICE_DEFAULT,
        ("IndexerConfig", "remote_request_timeout"): SERVICE_DEFAULT,
        ("IndexerConfig", "remote_client"): "kvr serve builds it from the URL",
        ("IndexerConfig", "retention"): SERVICE_DEFAULT,
        ("SessionConfig", "mode"): "kvr serve's sessions are hard affinity, as Dynamo's",
        ("SessionConfig", "max_entries"): SERVICE_DEFAULT,
        ("SessionConfig", "shards"): SERVICE_DEFAULT,
        ("SessionConfig", "max_session_id_bytes"): SERVICE_DEFAULT,
        ("SessionConfig", "early_release_memory"): SERVICE_DEFAULT,
    },
    extra={
        **{n: "Dynamo's constructor argument: a service setting, not an engine field"
           for n in ("indexer_threads", "indexer_peers", "replica_sync_port", "replica_sync_peers",
                     "selection_cache")},
        "state_dir": "kvr serve's --state-dir: a service setting (kvr-state), not an engine field",
        "state_io": "kvr serve's --state-io: a service setting (kvr-state), not an engine field",
    },
)

PARTITION = Host(
    name="Partition",
    places={"ReservationStats": ("Partition", ""), "ActiveLoad": ("Partition", "")},
    not_mirrored={
        **{s: "Engine.create_partition's (a partition's configuration)"
           for s in ("PartitionConfig", "CostConfig", "LatencyConfig", "CostOverrides",
                     "BusyThresholds", "HintConfig", "SessionConfig", "IndexerConfig",
                     "ApproxConfig")},
        **{s: "the typed path reads no index or ingress figures (kvr serve's GET /metrics does)"
           for s in ("IndexStats", "SelectionStats", "SessionStats", "IndexerStats",
                     "ApproxStats", "StreamStats", "SequenceStats")},
        "RankLoad": "the typed path takes no load reports",
    },
    renamed={
        ("ActiveLoad", f): ("load", "Partition.load(worker_id, dp_rank) returns the three as a tuple")
        for f in ("active_prefill_tokens", "active_decode_blocks", "active_requests")
    },
    omitted={
        ("ReservationStats", f): "the typed path reads the learned estimates only; the booking table's figures are kvr serve's"
        for f in ("bookings", "tracked_ranks", "expired_total", "counter_underflows", "sweeper_started")
    },
    check_extras=False,
)

HOSTS = (CREATE_PARTITION, SELECTION_SERVICE, PARTITION)


def engine_lists() -> list[dict]:
    doc = json.loads((ROOT / "ffi" / "fields.json").read_text())
    assert doc["structs"], "ffi/fields.json lists no struct"
    return doc["structs"]


def runtime_locations() -> dict[str, set[str]]:
    """The installed package's mirror, read from the objects themselves."""

    def params(f) -> set[str]:
        return {p for p in inspect.signature(f).parameters if p != "self"}

    return {
        "create_partition": params(kvr.Engine.create_partition),
        "__init__": params(kvr.SelectionService.__init__),
        "Partition": {n for n in dir(kvr.Partition) if not n.startswith("_")},
    }


def stub_locations(text: str) -> dict[str, set[str]]:
    """The stub's mirror: the same locations, read from its syntax tree."""
    classes = {c.name: c for c in ast.parse(text).body if isinstance(c, ast.ClassDef)}

    def method(cls: str, name: str) -> set[str]:
        for f in classes[cls].body:
            if isinstance(f, ast.FunctionDef) and f.name == name:
                a = f.args
                return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} - {"self"}
        raise AssertionError(f"the stub's {cls} has no {name}")

    return {
        "create_partition": method("Engine", "create_partition"),
        "__init__": method("SelectionService", "__init__"),
        "Partition": {f.name for f in classes["Partition"].body
                      if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")},
    }


def differences(host: Host, source: str, locs: dict[str, set[str]]) -> list[str]:
    """Every difference between the host's mirror (in `locs`) and the engine's lists."""
    who = f"Python {host.name} ({source})"
    errors, claimed, checked = [], set(), set()
    lists = engine_lists()
    for s in sorted(set(host.places) | set(host.not_mirrored)):
        if s not in {l["name"] for l in lists}:
            errors.append(f"{who}: the table names {s}, not an engine struct")
    for l in lists:
        s = l["name"]
        if s in host.not_mirrored:
            continue
        if s not in host.places:
            errors.append(f"{who}: engine struct {s} has no place in this check")
            continue
        loc, prefix = host.places[s]
        checked.add(loc)
        have = locs[loc]
        for f in l["fields"]:
            if (s, f) in host.omitted:
                if prefix + f in have:
                    errors.append(f"{who}: {s}.{f} is listed as omitted, but {loc} has it: drop the exception")
                continue
            name = host.renamed.get((s, f), (prefix + f, None))[0]
            if name in have:
                claimed.add((loc, name))
            elif f not in l["nested"]:
                errors.append(f"{who}: {s}.{f} is missing (looked for `{name}` in {loc})")
    for loc in sorted(checked):
        for name in sorted(locs[loc]):
            if host.check_extras and (loc, name) not in claimed and name not in host.extra:
                errors.append(f"{who}: `{name}` in {loc} is extra: it mirrors no engine field")
    for name in host.extra:
        if not any(name in locs[loc] for loc in checked):
            errors.append(f"{who}: exception for `{name}`, which is not there: drop it")
    return errors


def test_python_mirrors_every_engine_field():
    stub = stub_locations(STUB.read_text())
    errors = []
    for host in HOSTS:
        errors += differences(host, "runtime", runtime_locations())
        errors += differences(host, "stub", stub)
    assert not errors, (
        f"{len(errors)} Python mirror(s) differ from the engine's field lists (ffi/fields.json):\n  "
        + "\n  ".join(errors))


def test_latency_flags_map_every_latency_knob():
    """SelectionService passes the latency knobs on as kvr serve flags (_LATENCY_FLAGS)."""
    latency = next(l for l in engine_lists() if l["name"] == "LatencyConfig")
    assert set(kvr._LATENCY_FLAGS) == set(latency["fields"])
    assert all(flag == "--" + name.replace("_", "-") for name, flag in kvr._LATENCY_FLAGS.items())


def test_mirror_check_catches_removals():
    """The negative control: a knob taken out of a copy of the stub, and a figure taken
    out of the runtime's locations, must each be reported as missing."""
    text = STUB.read_text()
    mutated = text.replace("        itl_base_ms: Optional[float] = None,  # [20]\n", "", 1)
    assert mutated != text
    errors = differences(CREATE_PARTITION, "stub", stub_locations(mutated))
    assert any("LatencyConfig.itl_base_ms is missing" in e for e in errors), errors
    locs = runtime_locations()
    locs["Partition"].discard("prefill_rate_observations")
    errors = differences(PARTITION, "runtime", locs)
    assert any("ReservationStats.prefill_rate_observations is missing" in e for e in errors), errors
    locs = runtime_locations()
    locs["Partition"].discard("decode_drag_observations")
    errors = differences(PARTITION, "runtime", locs)
    assert any("ReservationStats.decode_drag_observations is missing" in e for e in errors), errors
