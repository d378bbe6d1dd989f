"""kvr.SelectionService on its own: lifecycle, the async and sync surfaces, bad input,
errors, and concurrency from threads (the GIL released, no deadlock, loads back to 0)."""

import asyncio
import threading

import pytest

import kvr

BS = 16


def prompt(start, blocks=4):
    return list(range(start, start + blocks * BS))


@pytest.fixture
def svc(monkeypatch):
    # No KV-event publishers here: workers are schedulable without an events endpoint.
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    s = kvr.SelectionService()
    for w in (1, 2):
        s.upsert_worker_sync({"worker_id": w, "model_name": "m", "block_size": BS,
                              "endpoint": f"http://w{w}.invalid"})
    yield s
    s.shutdown()


def total_active(s):
    return sum(r["active_requests"] for p in s.loads() for r in p["loads"])


def test_lifecycle_sync(svc):
    assert svc.ready()["ready"] is True
    r = svc.select_and_reserve_sync({"model_name": "m", "token_ids": prompt(0), "selection_id": "a"})
    assert r["selection_id"] == "a" and r["worker_id"] in (1, 2)
    assert r["isl_tokens"] == 4 * BS and len(r["sequence_hashes"]) == 4
    assert total_active(svc) == 1
    svc.prefill_complete_sync("a")
    svc.add_output_block("a")
    svc.free_reservation_sync("a")
    assert total_active(svc) == 0
    with pytest.raises(kvr.SelectionServiceError) as e:
        svc.free_reservation_sync("a")
    assert (e.value.kind, e.value.status_code) == ("not_found", 404)


def test_pending_selection_claimed(svc):
    s = svc.select_sync({"model_name": "m", "token_ids": prompt(100), "selection_id": "p"})
    r = svc.create_reservation_sync({"selection_id": "p", "model_name": "m"})
    assert r["worker_id"] == s["worker_id"]
    with pytest.raises(kvr.SelectionServiceError) as e:
        svc.create_reservation_sync({"selection_id": "p", "model_name": "m"})
    assert e.value.status_code == 404
    svc.free_reservation_sync("p")
    assert total_active(svc) == 0


def test_workers_crud(svc):
    assert {w["worker_id"] for w in svc.list_workers(model_name="m")} == {1, 2}
    assert svc.list_workers(model_name="nope") == []
    rec = svc.patch_worker_sync(2, {"total_kv_blocks": 99})
    assert rec["total_kv_blocks"] == 99
    assert svc.delete_worker_sync(2)["worker_id"] == 2
    with pytest.raises(kvr.SelectionServiceError) as e:
        svc.delete_worker_sync(2)
    assert e.value.kind == "not_found"
    with pytest.raises(TypeError):
        svc.delete_worker_sync("x")


def test_int_rank_keys_in_and_out(monkeypatch):
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    with kvr.SelectionService() as s:
        rec = s.upsert_worker_sync({"worker_id": 5, "model_name": "m", "block_size": BS,
                                    "data_parallel_size": 2, "endpoint": "http://x.invalid",
                                    "kv_events_endpoints": {0: "tcp://127.0.0.1:9",
                                                            1: "tcp://127.0.0.1:10"}})
        assert rec["kv_events_endpoints"] == {0: "tcp://127.0.0.1:9", 1: "tcp://127.0.0.1:10"}


def test_dead_kv_event_endpoint_is_visible(monkeypatch):
    """A worker whose KV-event endpoint nobody listens on: kv_event_sources() says dead
    (with why), ready() stays ready and lists it; a worker without one lists nothing."""
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "true")
    import socket
    import time
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    s = kvr.SelectionService()
    try:
        s.upsert_worker_sync({"worker_id": 1, "model_name": "m", "block_size": BS,
                              "endpoint": "http://w1.invalid",
                              "kv_events_endpoint": f"tcp://127.0.0.1:{port}"})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            src = s.kv_event_sources()
            if src and src[0]["state"] == "dead":
                break
            time.sleep(0.05)
        assert [(x["worker_id"], x["state"]) for x in src] == [(1, "dead")], src
        assert src[0]["reason"] == "cannot connect (refused or timed out)"
        assert src[0]["link_failures"] >= 1 and src[0]["decode_errors"] == 0
        r = s.ready()
        assert r["ready"] is True
        assert [x["state"] for x in r["kv_event_sources"]] == ["dead"]
    finally:
        s.shutdown()


def test_async_surface(svc):
    async def main():
        r = await svc.select_and_reserve({"model_name": "m", "token_ids": prompt(0),
                                          "selection_id": "x"})
        await svc.prefill_complete("x")
        assert (await svc.overlap_scores({"model_name": "m", "token_ids": prompt(0)}))["block_size"] == BS
        assert len(await svc.potential_loads({"model_name": "m", "token_ids": prompt(0)})) == 2
        snap = await svc.indexer_snapshot()
        assert isinstance(snap, dict)
        # Failures come out of the await, as Dynamo's.
        fut = svc.select_and_reserve({"model_name": "m", "token_ids": prompt(0), "selection_id": "x"})
        with pytest.raises(kvr.SelectionServiceError) as e:
            await fut
        assert (e.value.kind, e.value.status_code) == ("conflict", 409)
        # Many at once on one loop.
        ids = [f"c{i}" for i in range(50)]
        await asyncio.gather(*(svc.select_and_reserve({"model_name": "m", "token_ids": prompt(i),
                                                       "selection_id": i_}) for i, i_ in enumerate(ids)))
        assert total_active(svc) == 51
        await asyncio.gather(*(svc.free_reservation(i) for i in ids + ["x"]))
        assert total_active(svc) == 0
        assert r["worker_id"] in (1, 2)
    asyncio.run(main())


def test_async_needs_a_loop(svc):
    with pytest.raises(RuntimeError):
        svc.select({"model_name": "m", "token_ids": prompt(0)})


@pytest.mark.parametrize("body", [
    {"model_name": "m", "token_ids": "x"},
    {"model_name": "m", "token_ids": [-1]},
    {"model_name": "m", "token_ids": [2**32]},
    {"model_name": "m", "token_ids": [1.5]},
    {"model_name": "m"},
    {"model_name": 5, "token_ids": [1]},
    {"model_name": "m", "block_hashes": [1, 2], "sequence_hashes": [1], "isl_tokens": 32},
    5,
    None,
    [1, 2],
    "select",
])
def test_bad_input_is_value_error(svc, body):
    with pytest.raises(ValueError):
        svc.select_sync(body)
    with pytest.raises(ValueError):
        svc.select_and_reserve_sync(body)
    assert total_active(svc) == 0


def test_bad_input_raises_at_the_call(svc):
    async def main():
        with pytest.raises(ValueError):
            svc.select({"model_name": "m", "token_ids": "x"})  # no await needed
    asyncio.run(main())


def test_service_errors(svc):
    with pytest.raises(kvr.SelectionServiceError) as e:
        svc.select_sync({"model_name": "nope", "token_ids": [1]})
    assert (e.value.kind, e.value.status_code) == ("not_ready", 503)
    with pytest.raises(kvr.SelectionServiceError) as e:
        svc.select_sync({"model_name": "m", "token_ids": [1], "allowed_worker_ids": [99]})
    assert (e.value.kind, e.value.status_code) == ("scheduler", 503)
    with pytest.raises(ValueError):
        svc.add_output_block("zz", decay_fraction=2.0)
    with pytest.raises(ValueError):
        svc.select_and_reserve_sync({"model_name": "m", "token_ids": [1], "selection_id": ""})


def test_constructor_arguments(monkeypatch):
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    s = kvr.SelectionService(indexer_threads=2, session_affinity_ttl_secs=30,
                             selection_cache=kvr.SelectionCacheConfig(ttl_secs=1.5, max_entries=8))
    s.shutdown()
    for bad in (dict(indexer_threads=0), dict(session_affinity_ttl_secs=0),
                dict(session_affinity_ttl_secs=10**9), dict(indexer_threads="4")):
        with pytest.raises(ValueError):
            kvr.SelectionService(**bad)
    with pytest.raises(TypeError):
        kvr.SelectionService(bogus=1)


def test_peers_recovery_without_peers_answers_false(svc):
    assert svc.recover_indexer_from_peers_sync(["http://127.0.0.1:1"]) is False


def test_shutdown(svc):
    svc.shutdown()
    svc.shutdown()  # idempotent
    assert svc.ready()["schedulable_workers"] == 2
    with pytest.raises(kvr.SelectionServiceError) as e:
        svc.select_sync({"model_name": "m", "token_ids": [1]})
    assert (e.value.kind, e.value.status_code) == ("not_ready", 503)


def test_threads_book_and_free(svc):
    """8 threads × 300 bookings: no deadlock, every booking freed, loads back to zero."""
    errors = []
    barrier = threading.Barrier(8)

    def work(t):
        try:
            barrier.wait()
            for i in range(300):
                sid = f"t{t}-{i}"
                svc.select_and_reserve_sync({"model_name": "m", "token_ids": prompt(i * 7 + t, 8),
                                             "selection_id": sid})
                if i % 3 == 0:
                    svc.prefill_complete_sync(sid)
                    svc.add_output_block(sid)
                svc.free_reservation_sync(sid)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "deadlock: threads still running"
    assert not errors, errors[:3]
    assert total_active(svc) == 0
    for p in svc.loads():
        for r in p["loads"]:
            assert r["potential_prefill_tokens"] == 0 and r["potential_decode_blocks"] == 0


def _public_methods(cls):
    return [n for n, v in vars(cls).items()
            if callable(v) and (not n.startswith("_") or n in ("__init__", "__enter__", "__exit__"))]


def test_every_public_method_documented():
    """Every public method of the Python classes, the native ones and the .pyi stubs has
    a docstring of its own."""
    import ast
    import inspect
    import os
    missing = []
    for cls in (kvr.SelectionService, kvr.SelectionCacheConfig, kvr.Engine, kvr.Partition,
                kvr.Decision):
        for name in _public_methods(cls):
            if name == "__init__" and cls in (kvr.Engine,):
                doc = cls.__doc__ or cls.__init__.__doc__
            else:
                doc = getattr(cls, name).__doc__
            if not doc or doc == object.__init__.__doc__:
                missing.append(f"{cls.__name__}.{name}")
    stub = os.path.join(os.path.dirname(kvr.__file__), "__init__.pyi")
    for c in ast.parse(open(stub).read()).body:
        if isinstance(c, ast.ClassDef):
            for f in c.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not ast.get_docstring(f):
                    missing.append(f"stub {c.name}.{f.name}")
    assert not missing, missing
    assert inspect.getdoc(kvr.SelectionService.select)  # the check reads real docstrings


def test_selection_cache_config_refused_unless_kvrs():
    for bad in ({"max_entries": 1}, 7, object()):
        with pytest.raises(TypeError, match="selection_cache"):
            kvr.SelectionService(selection_cache=bad)
    for bad in (dict(max_entries=-1), dict(max_entries=1.5), dict(max_bytes=True),
                dict(ttl_secs=-1)):
        with pytest.raises(ValueError):
            kvr.SelectionService(selection_cache=kvr.SelectionCacheConfig(**bad))


def test_selection_cache_bound_honoured(monkeypatch):
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    with kvr.SelectionService(selection_cache=kvr.SelectionCacheConfig(max_entries=1)) as s:
        s.upsert_worker_sync({"worker_id": 1, "model_name": "m", "block_size": BS,
                              "endpoint": "http://w1.invalid"})
        for sid, start in (("p1", 0), ("p2", 100)):
            s.select_sync({"model_name": "m", "token_ids": prompt(start), "selection_id": sid})
        with pytest.raises(kvr.SelectionServiceError):  # evicted by the one-entry bound
            s.create_reservation_sync({"selection_id": "p1", "model_name": "m"})
        assert s.create_reservation_sync({"selection_id": "p2", "model_name": "m"})["selection_id"] == "p2"


def test_pin_to_a_missing_rank_is_unavailable(svc):
    """A pin to an unknown worker or to a rank it lacks is 503 (Dynamo's answer), not a
    selection elsewhere; a pin to a rank it has routes there."""
    for pin in ({"worker_id": 99, "dp_rank": 0}, {"worker_id": 1, "dp_rank": 5}):
        for call in (svc.select_sync, svc.select_and_reserve_sync):
            with pytest.raises(kvr.SelectionServiceError) as e:
                call({"model_name": "m", "token_ids": prompt(0), "pinned_worker": pin})
            assert e.value.status_code == 503, pin
    r = svc.select_sync({"model_name": "m", "token_ids": prompt(0),
                         "pinned_worker": {"worker_id": 2, "dp_rank": 0}})
    assert (r["worker_id"], r["dp_rank"]) == (2, 0)
