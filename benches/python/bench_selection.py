#!/usr/bin/env python3
"""Per-call cost of select_and_reserve + free_reservation from Python: Dynamo 1.6.1's
dynamo.llm.SelectionService and kvr.SelectionService side by side in one run (plus kvr's
sync twins and its typed Engine API, with list prompts and with array('I') prompts read
in place), 16 and 64 workers, 1k- and 8k-token prompts.

Each worker registers with a KV-events endpoint nobody publishes on (schedulable, empty
index: the cost measured is the call's own: dict conversion, hashing, scoring, booking).
Each cell is the median over --runs runs of the mean per call of --calls calls (a call =
select_and_reserve then free_reservation, prompts cycling through 32 random ones).

    bash benches/python/run.sh            # builds the wheel, uses the compat venv
"""

from __future__ import annotations

import argparse
import array
import asyncio
import random
import statistics
import sys
import time

BS = 16


def prompts(n_tokens: int, k: int = 32) -> list[list[int]]:
    rng = random.Random(n_tokens)
    return [[rng.randrange(50_000) for _ in range(n_tokens)] for _ in range(k)]


def workers(n: int) -> list[dict]:
    return [{"worker_id": w, "model_name": "m", "block_size": BS,
             "endpoint": f"http://w{w}.invalid:8000",
             "kv_events_endpoint": f"tcp://127.0.0.1:{20000 + w}"} for w in range(1, n + 1)]


async def run_async(svc, ps, calls: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        sid = f"b{i}"
        await svc.select_and_reserve({"model_name": "m", "token_ids": ps[i % len(ps)],
                                      "selection_id": sid})
        await svc.free_reservation(sid)
    return (time.perf_counter() - t0) / calls


def run_sync(svc, ps, calls: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        sid = f"b{i}"
        svc.select_and_reserve_sync({"model_name": "m", "token_ids": ps[i % len(ps)],
                                     "selection_id": sid})
        svc.free_reservation_sync(sid)
    return (time.perf_counter() - t0) / calls


def run_typed(engine, part, ps, calls: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        d = part.select(ps[i % len(ps)], reserve=True)
        engine.free(d.selection_id)
    return (time.perf_counter() - t0) / calls


async def service(cls, n_workers: int):
    svc = cls()
    for w in workers(n_workers):
        await svc.upsert_worker(w)
    deadline = time.time() + 30
    while svc.ready()["schedulable_workers"] < n_workers and time.time() < deadline:
        await asyncio.sleep(0.05)
    assert svc.ready()["schedulable_workers"] == n_workers, svc.ready()
    return svc


def median_of(runs: int, f) -> float:
    f()  # warm-up
    return statistics.median(f() for _ in range(runs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--calls", type=int, default=0, help="calls per run (0: 2000 at 1k, 500 at 8k)")
    args = ap.parse_args(argv)
    import kvr
    from dynamo.llm import SelectionService as Dynamo

    rows = []
    loop = asyncio.new_event_loop()
    for n_workers in (16, 64):
        for n_tokens in (1024, 8192):
            ps = prompts(n_tokens)
            calls = args.calls or (2000 if n_tokens <= 1024 else 500)
            dyn = loop.run_until_complete(service(Dynamo, n_workers))
            d = median_of(args.runs, lambda: loop.run_until_complete(run_async(dyn, ps, calls)))
            dyn.shutdown()
            kv = loop.run_until_complete(service(kvr.SelectionService, n_workers))
            k = median_of(args.runs, lambda: loop.run_until_complete(run_async(kv, ps, calls)))
            ks = median_of(args.runs, lambda: run_sync(kv, ps, calls))
            kv.shutdown()
            eng = kvr.Engine()
            part = eng.create_partition("m", block_size=BS)
            for w in range(1, n_workers + 1):
                part.upsert_worker(w)
            kt = median_of(args.runs, lambda: run_typed(eng, part, ps, calls))
            arrays = [array.array("I", p) for p in ps]
            ka = median_of(args.runs, lambda: run_typed(eng, part, arrays, calls))
            rows.append((n_workers, n_tokens, d, k, ks, kt, ka))
            print(f"  {n_workers} workers, {n_tokens} tokens: dynamo {d * 1e6:.1f} us, "
                  f"kvr {k * 1e6:.1f} us", file=sys.stderr)
    loop.close()
    print("| workers | prompt tokens | Dynamo (await) µs | kvr (await) µs | kvr ×cheaper "
          "| kvr `_sync` µs | kvr `Partition.select`, list µs | same, `array('I')` µs |")
    print("|---|---|---|---|---|---|---|---|")
    for n, t, d, k, ks, kt, ka in rows:
        print(f"| {n} | {t} | {d * 1e6:.1f} | {k * 1e6:.1f} | {d / k:.1f}× | {ks * 1e6:.1f} "
              f"| {kt * 1e6:.1f} | {ka * 1e6:.1f} |")
    print(f"\n(median of {args.runs} runs; per call: select_and_reserve + free_reservation)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
