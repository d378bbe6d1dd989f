"""The cost models through Python: kvr's default (latency: predicted TTFT in ms) and
Dynamo's scorer (`cost_model="dynamo"`), the latency model's knobs, their validation, and
the learned prefill rate (`Partition.prefill_rate()`)."""

import math
import time

import pytest

import kvr

BS = 16


def prompt(start, blocks=8):
    return list(range(start, start + blocks * BS))


def three_workers(**kw):
    e = kvr.Engine(seed=1)
    p = e.create_partition("m", "g", block_size=BS, **kw)
    for w in (1, 2, 3):
        p.upsert_worker(w)
    return e, p


def load_decode(e, p, worker, blocks):
    """A booking on `worker` past its prefill holding `blocks` more decode blocks."""
    d = p.select(prompt(900_000 + worker * 1000, 1), reserve=True, pinned_worker=worker)
    assert d.worker_id == worker
    e.mark_prefill_complete(d.selection_id)
    e.add_output_blocks(d.selection_id, blocks)
    return d.selection_id


def test_the_default_model_is_latency_and_prefers_the_cached_worker():
    assert kvr.COST_MODELS == ("latency", "dynamo")
    e, p = three_workers()
    assert p.cost_model == "latency"
    toks = prompt(5000)
    p.store(2, 0, toks)
    d = p.select(toks)
    assert (d.worker_id, d.cached_tokens) == (2, 8 * BS)
    # A TTFT estimate in ms: at least the fixed per-request overhead (5 ms by default),
    # and for a fully cached prompt on an idle rank not much more.
    assert 5.0 <= d.cost < 6.0, d.cost
    miss = p.select(prompt(70_000))
    # An uncached 128-token prompt at the 10k tokens/s prior: ~12.8 ms more.
    assert miss.cost > d.cost + 10.0, (miss.cost, d.cost)


def test_dynamo_and_latency_report_different_costs():
    costs = {}
    for model in ("latency", "dynamo"):
        e, p = three_workers(cost_model=model)
        assert p.cost_model == model
        toks = prompt(5000)
        p.store(2, 0, toks)
        d = p.select(toks)
        assert d.worker_id == 2
        costs[model] = d.cost
    # Dynamo's cost is in block equivalents (the cached prompt leaves its 8 decode
    # blocks); the latency model's is in ms (5 ms overhead plus a µs tie-break).
    assert costs["dynamo"] == pytest.approx(8.0)
    assert costs["latency"] == pytest.approx(5.008, abs=1e-3)
    # The overhead knob moves the latency cost one for one.
    _, p = three_workers(request_overhead_ms=50)
    p.store(2, 0, prompt(5000))
    assert p.select(prompt(5000)).cost == pytest.approx(costs["latency"] + 45.0, abs=1e-6)


def test_latency_keeps_a_cached_prefix_dynamo_trades_for_decode_balance():
    """The cached worker holds 100 more decode blocks: Dynamo's cost adds them one for
    one and sends the request elsewhere; the latency model counts them as a tie-break."""
    picks = {}
    for model in ("latency", "dynamo"):
        e, p = three_workers(cost_model=model)
        toks = prompt(5000)
        p.store(2, 0, toks)
        load_decode(e, p, 2, 100)
        picks[model] = p.select(toks).worker_id
    assert picks["latency"] == 2
    assert picks["dynamo"] in (1, 3)


def test_bad_cost_model_or_knob_is_a_value_error():
    e = kvr.Engine()
    with pytest.raises(ValueError, match="latency.*dynamo"):
        e.create_partition("bad-model", cost_model="fastest")
    for kw in (dict(prefill_rate_prior=0), dict(prefill_rate_prior=-1.0),
               dict(request_overhead_ms=-1), dict(request_overhead_ms=math.inf),
               dict(kv_pressure_threshold=1.5), dict(kv_pressure_threshold=-0.1),
               dict(kv_pressure_ms=math.nan), dict(itl_target_ms=0),
               dict(itl_base_ms=-1), dict(itl_per_request_ms=-1),
               dict(queue_externality=-1), dict(decode_block_us=-1)):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=name):
            e.create_partition(f"bad-{name}", **kw)
    with pytest.raises(TypeError):
        e.create_partition("typo", request_overhead=5)
    # In range: accepted, on either model.
    p = e.create_partition("ok", cost_model="dynamo", prefill_rate_prior=20_000,
                           learn_prefill_rate=False, request_overhead_ms=0,
                           kv_pressure_threshold=1.0, kv_pressure_ms=0, itl_target_ms=30,
                           itl_base_ms=10, itl_per_request_ms=0, queue_externality=0,
                           decode_block_us=0)
    assert p.cost_model == "dynamo"


def test_dynamo_knobs_busy_thresholds_and_booking_ttl_reach_the_partition():
    e = kvr.Engine()
    for kw in (dict(overlap_score_credit=math.nan), dict(temperature=math.inf),
               dict(host_cache_hit_weight=math.nan), dict(credit_decay=math.nan),
               dict(busy_decode_blocks_fraction=math.inf)):
        name = next(iter(kw)).removeprefix("busy_")
        with pytest.raises(ValueError, match=name):
            e.create_partition(f"bad-{name}", **kw)
    with pytest.raises(ValueError, match="booking TTL"):
        e.create_partition("ttl0", booking_ttl_ms=0)
    # One worker: past its busy threshold (a booked prompt's prefill), a selection is busy.
    p = e.create_partition("busy", block_size=BS, busy_prefill_tokens=BS, cost_model="dynamo",
                           overlap_score_credit=2.0, prefill_load_scale=1.0,
                           disk_cache_hit_weight=0.5, decode_active_request_weight=0.0,
                           cache_namespace="tenant", booking_ttl_ms=60_000)
    p.upsert_worker(1)
    p.store(1, 0, prompt(5000))
    assert p.select(prompt(5000)).cached_tokens == 8 * BS  # store and select share the salt
    p.select(prompt(0), reserve=True)
    with pytest.raises(kvr.SelectionServiceError):
        p.select(prompt(10_000))


def test_prefill_rate_is_learned_from_prefill_completions():
    e = kvr.Engine(seed=1)
    p = e.create_partition("m", block_size=BS)
    p.upsert_worker(1)
    assert p.prefill_rate() is None and p.prefill_rate_observations() == 0
    assert p.decode_drag() is None and p.decode_drag_observations() == 0
    for i in range(10):
        d = p.select(prompt(i * 10_000, 4), reserve=True)
        time.sleep(0.003)  # the prefill's service time: booking to completion
        e.mark_prefill_complete(d.selection_id)
        if i < 7:
            assert p.prefill_rate() is None  # needs a few observations first
        e.free(d.selection_id)
    assert p.prefill_rate_observations() == 10
    assert p.decode_drag_observations() == 10
    assert p.decode_drag() is None  # one rank, one load: nothing to learn a drag from
    rate = p.prefill_rate()
    assert isinstance(rate, float) and rate > 0.0
    # 64 tokens in >= 3 ms each: at most ~21k tokens/s.
    assert rate < 64 / 0.003 * 1.01, rate


# -- kvr.SelectionService: cost_model= and the knobs map to kvr serve's flags


def service(monkeypatch, **kw):
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    s = kvr.SelectionService(**kw)
    for w in (1, 2):
        s.upsert_worker_sync({"worker_id": w, "model_name": "m", "block_size": BS,
                              "endpoint": f"http://w{w}.invalid"})
    return s


def decode_heavy_vs_prefill_queued(s):
    """Worker 1: 25 blocks of decode, prefill done. Worker 2: a 4-block prompt still in
    prefill. Dynamo's cost (prefill + decode blocks) prefers 2 for the next 4-block
    prompt; the latency model (2's prefill queue delays it) prefers 1."""
    s.select_and_reserve_sync({"model_name": "m", "token_ids": prompt(0, 25),
                               "selection_id": "a", "allowed_worker_ids": [1]})
    s.prefill_complete_sync("a")
    s.select_and_reserve_sync({"model_name": "m", "token_ids": prompt(10_000, 4),
                               "selection_id": "b", "allowed_worker_ids": [2]})
    return s.select_sync({"model_name": "m", "token_ids": prompt(20_000, 4)})["worker_id"]


@pytest.mark.parametrize("kw, env, want", [
    ({}, None, 1),
    ({"cost_model": "latency"}, None, 1),
    ({"cost_model": "dynamo"}, None, 2),
    ({}, "dynamo", 2),  # KVR_COST_MODEL, as kvr serve reads it
    ({"cost_model": "latency"}, "dynamo", 1),  # the argument wins over the environment
])
def test_service_cost_model(monkeypatch, kw, env, want):
    if env is not None:
        monkeypatch.setenv("KVR_COST_MODEL", env)
    else:
        monkeypatch.delenv("KVR_COST_MODEL", raising=False)
    s = service(monkeypatch, **kw)
    try:
        assert decode_heavy_vs_prefill_queued(s) == want
    finally:
        s.shutdown()


def test_service_knobs_are_accepted(monkeypatch):
    s = service(monkeypatch, cost_model="latency", prefill_rate_prior=20_000,
                learn_prefill_rate=False, request_overhead_ms=1, kv_pressure_threshold=0.8,
                kv_pressure_ms=500, itl_target_ms=40, itl_base_ms=10,
                itl_per_request_ms=0.5, queue_externality=0, decode_block_us=2)
    try:
        assert decode_heavy_vs_prefill_queued(s) == 1
    finally:
        s.shutdown()


@pytest.mark.parametrize("kw", [
    dict(cost_model="fastest"), dict(cost_model=5), dict(request_overhead_ms=-1),
    dict(kv_pressure_threshold=2), dict(prefill_rate_prior=0), dict(itl_target_ms=0),
    dict(decode_block_us=math.nan), dict(queue_externality="x"), dict(learn_prefill_rate=1),
])
def test_service_bad_cost_arguments(monkeypatch, kw):
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    with pytest.raises(ValueError):
        kvr.SelectionService(**kw)
