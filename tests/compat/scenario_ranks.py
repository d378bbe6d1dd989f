"""The harness's steps on ranks and engine names (run after the main sequence, with
workers and a model of their own, by `harness.scenario`, so in `compare` over HTTP and in
tests/python/test_differential.py in process alike):

- the overlap a selection reports for the rank it lands on, when that rank is not the
  worker's best-cached one: pinned to each rank in turn, and unpinned with the best rank
  loaded so another rank wins;
- what `/dump` names each worker's blocks when two engines publish the same tokens under
  different engine hashes (different hash seeds).

- a chain one engine extends past the prefix another engine stored first under other
  names.

Worker 21 (dp 1, hash seed "engine-a") and worker 22 (dp 2, hash seed "engine-b") of
model `m-ranks`, each rank a real vLLM publisher. Prompt Q (4 blocks): 22/0 holds all 4,
22/1 the first 1, 21/0 the first 3 (stored last), so every rank's overlap is distinct.
Prompt R (3 blocks): 21/0 stores the first 2, then 22/0 all 3.
"""

from __future__ import annotations

import json

MODEL = "m-ranks"
SEEDS = {21: "engine-a", 22: "engine-b"}


def q_prompt(bs: int) -> list[int]:
    return list(range(70_000, 70_000 + 4 * bs))


def r_prompt(bs: int) -> list[int]:
    return list(range(75_000, 75_000 + 3 * bs))


def marker_prompt(bs: int) -> list[int]:
    return list(range(78_000, 78_000 + bs))


def names(bs: int) -> dict[int, str]:
    """Engine hash -> the seed that makes it (each worker's hashes of every prompt here)."""
    from vllm_publisher import engine_hashes
    out = {}
    for seed in SEEDS.values():
        for prompt in (q_prompt(bs), r_prompt(bs), marker_prompt(bs)):
            for x in engine_hashes(prompt, bs, seed=seed):
                out[x] = seed
    return out


def _events(dump) -> list[dict]:
    part = dump.get(f"{MODEL}:default") if isinstance(dump, dict) else None
    return list(part.get("events", [])) if isinstance(part, dict) else []


def _structure(e: dict) -> dict:
    e = json.loads(json.dumps(e))
    inner = e.get("event", {})
    inner.pop("event_id", None)
    st = inner.get("data", {}).get("stored", {})
    if st.get("parent_hash") is not None:
        st["parent_hash"] = "<engine-hash>"
    for b in st.get("blocks", []):
        b["block_hash"] = "<engine-hash>"
    return e


def _by_structure(events: list[dict]) -> list[dict]:
    """Events in an order that does not depend on their engine names."""
    return sorted(events, key=lambda e: json.dumps(_structure(e), sort_keys=True))


def dump_structure(dump):
    """The partition's events with engine hashes replaced by placeholders and event ids
    dropped, sorted: which ranks hold which blocks (tokens hashes), whatever they are called."""
    if not isinstance(dump, dict):
        return dump
    return sorted((_structure(e) for e in _events(dump)),
                  key=lambda e: json.dumps(e, sort_keys=True))


def dump_names(dump, label):
    """Per `<worker>/<rank>/<tier>`, the seed whose hash names each block (and the
    parent, if any), in chain order: whose engine name the dump gives a worker's blocks."""
    if not isinstance(dump, dict):
        return dump
    out: dict[str, list[str]] = {}
    for e in _by_structure(_events(dump)):
        inner = e.get("event", {})
        st = inner.get("data", {}).get("stored", {})
        key = f"{e.get('worker_id')}/{inner.get('dp_rank')}/{e.get('storage_tier')}"
        row = out.setdefault(key, [])
        if st.get("parent_hash") is not None:
            row.append("parent:" + label(st["parent_hash"]))
        row.extend(label(b.get("block_hash")) for b in st.get("blocks", []))
    return dict(sorted(out.items()))


def run(rec, base: str, h) -> None:
    from vllm_publisher import WorkerPublisher
    bs = h.BS
    q = q_prompt(bs)
    known = names(bs)

    def label(x):
        return known.get(x, "unknown")

    w21 = WorkerPublisher(worker_id=21, dp_size=1, replay=False, hash_seed=SEEDS[21])
    w22 = WorkerPublisher(worker_id=22, dp_size=2, replay=False, hash_seed=SEEDS[22])
    try:
        rec.subst.update({w21.endpoint(0): "<kv-events:w21:r0>",
                          w22.endpoint(0): "<kv-events:w22:r0>",
                          w22.endpoint(1): "<kv-events:w22:r1>"})
        _steps(rec, base, h, q, w21, w22, label)
    finally:
        w21.close()
        w22.close()


def _steps(rec, base, h, q, w21, w22, label):
    S = rec.step
    bs = h.BS

    def sel(**kw):
        return dict({"model_name": MODEL, "token_ids": q}, **kw)

    S("ranks-register-w21", "POST", "/workers",
      {"worker_id": 21, "model_name": MODEL, "endpoint": "http://w21.invalid:8000",
       "kv_events_endpoint": w21.endpoint(0), "block_size": bs})
    S("ranks-register-w22", "POST", "/workers",
      {"worker_id": 22, "model_name": MODEL, "endpoint": "http://w22.invalid:8000",
       "kv_events_endpoints": w22.kv_events_endpoints(), "block_size": bs,
       "data_parallel_size": 2})
    if not (w21.wait_subscribed(20) and w22.wait_subscribed(20)):
        rec.note("ranks: publishers saw no subscriber")
    # One store at a time, each applied before the next: which engine published a block
    # first is fixed, so the names a dump keeps are not up to arrival order.
    for pub, rank, n, expect in ((w22, 0, 4, {(22, 0): 4}), (w22, 1, 1, {(22, 1): 1}),
                                 (w21, 0, 3, {(21, 0): 3})):
        pub.store(rank, q[:n * bs], bs)
        h.wait_overlap(base, q, expect, republish=lambda: pub.store(rank, q[:n * bs], bs),
                       rec=rec, what=f"ranks: store {n} blocks on {pub.worker_id}/{rank}",
                       model=MODEL)
    for key in ((21, 0), (22, 0), (22, 1)):
        h.wait_potential(base, MODEL, q, key, len(q) // bs, rec=rec,
                         what=f"ranks: load slot of {key}")

    S("ranks-overlap", "POST", "/overlap_scores", sel())
    for w, r in ((21, 0), (22, 0), (22, 1)):
        S(f"ranks-select-pin-w{w}r{r}", "POST", "/select",
          sel(pinned_worker={"worker_id": w, "dp_rank": r}))
    S("ranks-select-and-reserve-pin-w22r1", "POST", "/select_and_reserve",
      sel(selection_id="ranks-sr", pinned_worker={"worker_id": 22, "dp_rank": 1}))
    S("ranks-free-sr", "DELETE", "/reservations/ranks-sr")
    S("ranks-select-best", "POST", "/select", sel())
    # 22/0 (4 blocks cached) loaded with a booked, unprefilled 12-block prompt: among
    # worker 22's ranks, 22/1 (1 block cached) is then cheaper in Dynamo's cost model
    # (prefill and decode blocks) and in kvr's latency one (queued prefill tokens) alike.
    S("ranks-load-w22r0", "POST", "/select_and_reserve",
      sel(selection_id="ranks-heavy", pinned_worker={"worker_id": 22, "dp_rank": 0},
          token_ids=list(range(80_000, 80_000 + 12 * bs))))
    S("ranks-select-w22-loaded", "POST", "/select", sel(allowed_worker_ids=[22]))
    S("ranks-free-heavy", "DELETE", "/reservations/ranks-heavy")

    S("ranks-dump-structure", "GET", "/dump", post=dump_structure)
    S("ranks-dump-names", "GET", "/dump", post=lambda d: dump_names(d, label))
    # Worker 21 removes its third block by its own engine hash, then stores a marker block
    # in a later batch of the same stream: once the marker shows, the removal has been
    # applied (or ignored); how many of Q's blocks 21/0 keeps is what is compared.
    w21.remove(0, q[:3 * bs], bs, first_block=2)
    w21.store(0, marker_prompt(bs), bs)
    h.wait_overlap(base, marker_prompt(bs), {(21, 0): 1}, rec=rec,
                   what="ranks: marker after 21/0's removal", model=MODEL)
    S("ranks-overlap-after-remove", "POST", "/overlap_scores", sel())
    S("ranks-dump-names-after-remove", "GET", "/dump", post=lambda d: dump_names(d, label))

    # R: 21/0 stores 2 blocks, then 22/0 the same 2 (under its own names) and a third.
    r = r_prompt(bs)
    w21.store(0, r[:2 * bs], bs)
    h.wait_overlap(base, r, {(21, 0): 2}, republish=lambda: w21.store(0, r[:2 * bs], bs),
                   rec=rec, what="ranks: store R's 2 blocks on 21/0", model=MODEL)
    w22.store(0, r, bs)
    # Applied once 22/0 shows any of R (one batch: all of it or none); how much is compared.
    if not _wait(lambda: (h.overlap_map(base, r, MODEL) or {}).get((22, 0), 0) > 0):
        rec.note("ranks: 22/0's store of R never showed")
    S("ranks-overlap-extended", "POST", "/overlap_scores", sel(token_ids=r))
    for w in (21, 22):
        S(f"ranks-delete-w{w}", "DELETE", f"/workers/{w}")


def _wait(cond, timeout: float = 10.0) -> bool:
    import time
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def own_figures_failures(t: dict) -> list[str]:
    """What kvr's transcript must show on these steps whatever Dynamo does (the allow-list
    only permits a difference; this requires kvr's side of it): a selection reports the
    overlap of the rank it chose; every worker's blocks are dumped under its own engine
    hashes; a worker's removal under its own hash and a chain extended past another
    engine's names are counted as the engine says."""
    steps = {s["name"]: s.get("value") for s in t["steps"]}
    out = []
    for name, v in steps.items():
        if not name.startswith("ranks-select") or not isinstance(v, dict) or "overlap" not in v:
            continue
        o = v["overlap"]
        own = o.get("dp", {}).get(str(v.get("dp_rank")))
        if not (o.get("gpu") == own and o.get("longest_matched") == o.get("disk")):
            out.append(f"{name}: overlap {o} is not rank {v.get('dp_rank')}'s own ({own})")
    for name in ("ranks-dump-names", "ranks-dump-names-after-remove"):
        for key, row in (steps.get(name) or {}).items():
            seed = SEEDS.get(int(key.split("/")[0]))
            if any(x.split(":")[-1] != seed for x in row):
                out.append(f"{name}: {key} named {row}, not by its own engine ({seed})")
    for name, key, want in (("ranks-overlap-after-remove", (21, 0), 2),
                            ("ranks-overlap-extended", (22, 0), 3)):
        v = steps.get(name) or {}
        got = {(w["worker_id"], w["dp_rank"]): w["device_blocks"] for w in v.get("workers", [])}
        if got.get(key) != want:
            out.append(f"{name}: {key} has {got.get(key)} device blocks, not {want}")
    return out
