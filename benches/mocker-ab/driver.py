#!/usr/bin/env python3
"""Replay the first K requests of a Mooncake trace against mocker workers started by
workers.py, routing every request through one router, and write one JSON line per request.

Routers (--router):
  kvr          `kvr serve` at --kvr-url: the driver registers the workers (with their ZMQ
               KV-event and replay endpoints, which kvr subscribes to), then per request
               POST /select_and_reserve -> send to the chosen worker -> POST
               /reservations/{id}/prefill_complete at the first token -> DELETE
               /reservations/{id} at the end.
  dynamo       Dynamo's own KvRouter (default KvRouterConfig) in this process, fed by the
               workers' KV events over Dynamo's event plane; KvRouter.generate() picks the
               worker, sends the request and keeps its own bookings.
  round-robin  request i goes to worker i mod N.

Prompts follow `kvr replay`'s convention (cli/src/replay/workload.rs): each 512-token
hash_id is a segment whose token j is SplitMix64(id, j) mod 128256, so equal ids at equal
positions give equal tokens and the engines' chained block hashes share exactly the
prefixes the ids share. Arrivals are the trace's timestamps (ms, relative to the first
request) divided by --time-compression.

Per request: ttft_ms (scheduled arrival -> first token, routing included), itl_ms (mean gap
between tokens after the first), e2e_ms (arrival -> last token), route_ms (the routing
call alone), late_ms (how late the driver sent it against its schedule), worker, prompt and
output tokens, and cached_tokens as the engine reports it (completion_usage.
prompt_tokens_details.cached_tokens).
"""

import argparse
import array
import asyncio
import http.client
import json
import os
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

M64 = (1 << 64) - 1
VOCAB = 128_256
CHUNK = 512


def token_at(cid: int, j: int) -> int:
    """kvr replay's synthetic token j of content id `cid` (SplitMix64 of the pair)."""
    z = (cid * 0x9E3779B97F4A7C15 + j * 0xD1B54A32D192ED03 + 0x632BE59BD9B3E8A5) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return (z ^ (z >> 31)) % VOCAB


_chunks: dict = {}


def chunk_tokens(cid: int) -> list:
    t = _chunks.get(cid)
    if t is None:
        t = [token_at(cid, j) for j in range(CHUNK)]
        _chunks[cid] = t
    return t


def load_trace(path: str, start: int, count: int, max_output: int, compression: float):
    reqs = []
    with open(path) as f:
        for n, line in enumerate(f):
            if n < start:
                continue
            if len(reqs) >= count:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            left = int(rec["input_length"])
            tokens = []
            for cid in rec["hash_ids"]:
                take = min(left, CHUNK)
                tokens.extend(chunk_tokens(int(cid))[:take])
                left -= take
            if left > 0:
                raise SystemExit(f"{path}:{n + 1}: too few hash_ids for input_length")
            reqs.append({
                "line": n + 1,
                "ts_ms": float(rec["timestamp"]),
                "tokens": tokens,
                "output": max(1, min(int(rec["output_length"]), max_output)),
            })
    if not reqs:
        raise SystemExit("no requests")
    t0 = reqs[0]["ts_ms"]
    for r in reqs:
        r["arrival_s"] = (r["ts_ms"] - t0) / 1000.0 / compression
    return reqs


def msgpack_select_body(model: str, tokens: list) -> bytes:
    """{"model_name": model, "token_ids": <bin: little-endian u32s>} as msgpack, the binary
    body kvr serve reads (docs/service.md, "Binary request bodies"); spares both sides
    printing and parsing tens of kilobytes of decimal token ids."""
    def s(text):
        b = text.encode()
        return (bytes([0xA0 | len(b)]) if len(b) < 32 else b"\xd9" + bytes([len(b)])) + b
    ids = array.array("I", tokens)
    assert ids.itemsize == 4
    if sys.byteorder != "little":
        ids.byteswap()
    raw = ids.tobytes()
    return (b"\x82" + s("model_name") + s(model) + s("token_ids")
            + b"\xc6" + len(raw).to_bytes(4, "big") + raw)


class Http:
    """A keep-alive HTTP/1.1 connection per thread to one service (blocking; called
    through asyncio.to_thread)."""

    def __init__(self, url: str):
        u = urlparse(url)
        self.host, self.port = u.hostname, u.port or 80
        self.local = threading.local()

    def call(self, method: str, path: str, body=None):
        if isinstance(body, bytes):
            data, headers = body, {"content-type": "application/msgpack"}
        elif body is not None:
            data, headers = json.dumps(body).encode(), {"content-type": "application/json"}
        else:
            data, headers = None, {}
        for attempt in range(2):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
                self.local.conn = conn
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                text = resp.read()
                if resp.status >= 300:
                    raise RuntimeError(f"{method} {path}: {resp.status} {text[:300]!r}")
                return json.loads(text) if text else None
            except (http.client.HTTPException, ConnectionError, OSError):
                conn.close()
                self.local.conn = None
                if attempt:
                    raise


def stream_items(resp):
    """Engine responses arrive as dicts (KvRouter) or Annotated objects (Client)."""
    return resp.data() if hasattr(resp, "data") and callable(resp.data) else resp


async def consume(stream, rec, t_arrival, on_first):
    n_tokens = 0
    t_first = t_last = None
    async for item in stream:
        d = stream_items(item)
        if not isinstance(d, dict):
            continue
        usage = d.get("completion_usage")
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                rec["cached_tokens"] = details["cached_tokens"]
            rec["prompt_tokens_reported"] = usage.get("prompt_tokens")
        rd = d.get("routing_data") or {}
        wid = rd.get("worker_id") if isinstance(rd, dict) else None
        if isinstance(wid, dict) and wid.get("decode_worker_id") is not None:
            rec["instance_id"] = wid["decode_worker_id"]
        toks = d.get("token_ids") or []
        if toks:
            now = time.perf_counter()
            if t_first is None:
                t_first = now
                on_first()
            t_last = now
            n_tokens += len(toks)
        if d.get("finish_reason"):
            rec["finish_reason"] = d["finish_reason"]
    if t_first is None:
        raise RuntimeError("no token came back")
    rec["ttft_ms"] = (t_first - t_arrival) * 1000
    rec["e2e_ms"] = (t_last - t_arrival) * 1000
    rec["output_tokens"] = n_tokens
    rec["itl_ms"] = ((t_last - t_first) * 1000 / (n_tokens - 1)) if n_tokens > 1 else None


def request_body(model: str, tokens: list, out: int) -> dict:
    return {
        "model": model,
        "token_ids": tokens,
        "stop_conditions": {"max_tokens": out, "ignore_eos": True},
        "sampling_options": {},
        "output_options": {},
        "eos_token_ids": [],
    }


async def main_async(a) -> int:
    os.environ["DYN_FILE_KV"] = json.loads(Path(a.endpoints).read_text())["discovery_dir"]
    info = json.loads(Path(a.endpoints).read_text())
    from dynamo._core import DistributedRuntime

    reqs = load_trace(a.trace, a.start, a.requests, a.max_output, a.time_compression)
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp")
    endpoint = runtime.endpoint(info["endpoint"])
    client = await endpoint.client()
    want = {w["instance_id"] for w in info["workers"]}
    deadline = time.time() + 30
    while not want <= set(client.instance_ids()):
        if time.time() > deadline:
            raise SystemExit(f"workers not visible: {client.instance_ids()} vs {want}")
        await asyncio.sleep(0.1)
    workers = info["workers"]
    by_instance = {w["instance_id"]: w["index"] for w in workers}
    model = info["model_name"]

    kvr = router = None
    if a.router == "kvr":
        kvr = Http(a.kvr_url)
        for w in workers:
            kvr.call("POST", "/workers", {
                "worker_id": w["index"], "model_name": model,
                "endpoint": f"{info['endpoint']}/{w['instance_id']}",
                "block_size": info["block_size"], "total_kv_blocks": info["num_gpu_blocks"],
                "max_num_batched_tokens": info["max_num_batched_tokens"],
                "kv_events_endpoint": w["kv_events_endpoint"],
                "replay_endpoint": w["replay_endpoint"],
            })
        deadline = time.time() + 20
        while True:  # every KV-event stream subscribed and exact
            ready = kvr.call("GET", "/ready")
            if ready.get("ready") and not ready.get("kv_event_sources"):
                break
            if time.time() > deadline:
                raise SystemExit(f"kvr not ready: {json.dumps(ready)[:500]}")
            await asyncio.sleep(0.1)
    if a.router == "dynamo" or a.transport == "router":
        # Dynamo's KvRouter routes in `dynamo` mode; with --transport router (the default)
        # the same object also carries kvr's and round-robin's requests to the worker they
        # chose (generate(worker_id=...)), so all three use one send path.
        from dynamo._core import KvRouter, KvRouterConfig
        router = KvRouter(endpoint, info["block_size"], KvRouterConfig())
        deadline = time.time() + 20
        while True:  # the router sees every worker
            loads = await router.get_potential_loads([1] * info["block_size"])
            if {l["worker_id"] for l in loads} >= want:
                break
            if time.time() > deadline:
                raise SystemExit(f"KvRouter sees {loads}, expected {want}")
            await asyncio.sleep(0.1)

    out = open(a.out, "w")
    done, served = [], {}  # completion order; worker per request
    rr = [0]
    t_start = time.perf_counter() + 0.5

    async def one(i, r):
        t_arrival = t_start + r["arrival_s"]
        await asyncio.sleep(max(0.0, t_arrival - time.perf_counter()))
        rec = {"router": a.router, "transport": a.transport, "i": i, "line": r["line"], "arrival_s": r["arrival_s"],
               "prompt_tokens": len(r["tokens"]), "requested_output": r["output"],
               "late_ms": (time.perf_counter() - t_arrival) * 1000}
        stop = {"max_tokens": r["output"], "ignore_eos": True}

        async def send_to(instance_id):
            if a.transport == "router":
                return await router.generate(r["tokens"], model, stop_conditions=stop,
                                             worker_id=instance_id, dp_rank=0)
            return await client.direct(request_body(model, r["tokens"], r["output"]),
                                       instance_id)

        try:
            if a.router == "dynamo":
                t0 = time.perf_counter()
                stream = await router.generate(r["tokens"], model, stop_conditions=stop)
                rec["route_ms"] = (time.perf_counter() - t0) * 1000  # route + send
                rec["dispatch_ms"] = (time.perf_counter() - t_arrival) * 1000
                await consume(stream, rec, t_arrival, lambda: None)
                if "instance_id" in rec:
                    rec["worker"] = by_instance.get(rec["instance_id"])
            elif a.router == "kvr":
                t0 = time.perf_counter()
                sel = await asyncio.to_thread(kvr.call, "POST", "/select_and_reserve",
                                              msgpack_select_body(model, r["tokens"]))
                rec["route_ms"] = (time.perf_counter() - t0) * 1000
                sid = sel["selection_id"]
                rec["worker"] = sel["worker_id"]
                rec["router_overlap_tokens"] = (sel.get("overlap") or {}).get("gpu")
                inst = workers[sel["worker_id"]]["instance_id"]
                t1 = time.perf_counter()
                stream = await send_to(inst)
                rec["send_ms"] = (time.perf_counter() - t1) * 1000
                rec["dispatch_ms"] = (time.perf_counter() - t_arrival) * 1000
                marks = []

                def first():
                    marks.append(asyncio.ensure_future(asyncio.to_thread(
                        kvr.call, "POST", f"/reservations/{sid}/prefill_complete", {})))

                try:
                    await consume(stream, rec, t_arrival, first)
                finally:
                    for m in marks:
                        await m
                    await asyncio.to_thread(kvr.call, "DELETE", f"/reservations/{sid}")
            else:
                w = rr[0] % len(workers)
                rr[0] += 1
                rec["route_ms"] = 0.0
                rec["worker"] = w
                t1 = time.perf_counter()
                stream = await send_to(workers[w]["instance_id"])
                rec["send_ms"] = (time.perf_counter() - t1) * 1000
                rec["dispatch_ms"] = (time.perf_counter() - t_arrival) * 1000
                await consume(stream, rec, t_arrival, lambda: None)
        except Exception as e:  # recorded, not hidden: the summary counts failures
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        if "error" not in rec:
            done.append(i)
            served[i] = rec.get("worker")
        out.write(json.dumps(rec) + "\n")
        out.flush()

    t_wall = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    out.close()
    wall = time.perf_counter() - t_wall
    errors = sum(1 for line in open(a.out) if '"error"' in line)
    # Sanity check that the router's index followed the engines' KV events: the overlap
    # it reports now for the prompt of the request that finished last (the most recently
    # cached, so the least likely to be evicted): the worker that served it should hold
    # all its complete blocks, the others at most what they share with it.
    check = {}
    try:
        last = done[-1] if done else 0
        check["request"] = last
        check["served_by"] = served.get(last)
        check["prompt_blocks"] = len(reqs[last]["tokens"]) // info["block_size"]
        if a.router == "dynamo":
            sc = await router.get_overlap_scores(reqs[last]["tokens"])
            check["device_blocks"] = {by_instance.get(w["worker_id"]): w["device_blocks"]
                                      for w in sc["workers"]}
        elif a.router == "kvr":
            sc = await asyncio.to_thread(
                kvr.call, "POST", "/overlap_scores",
                {"model_name": model, "token_ids": reqs[last]["tokens"]})
            check["device_blocks"] = {w["worker_id"]: w["device_blocks"] for w in sc["workers"]}
    except Exception as e:
        check["error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps({"router": a.router, "requests": len(reqs), "errors": errors,
                      "wall_s": round(wall, 2), "index_check": check}, default=str),
          flush=True)
    runtime.shutdown()
    return 1 if errors else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoints", required=True, help="endpoints.json written by workers.py")
    ap.add_argument("--router", choices=["kvr", "dynamo", "round-robin"], required=True)
    ap.add_argument("--transport", choices=["router", "direct"], default="router",
                    help="how kvr's and round-robin's choices reach the worker: Dynamo's "
                         "KvRouter.generate(worker_id=...) (the path the dynamo router "
                         "uses) or Client.direct()")
    ap.add_argument("--kvr-url", default="http://127.0.0.1:18092")
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parent.parent.parent
                                           / "tests" / "data" / "mooncake_conversation.jsonl"))
    ap.add_argument("--start", type=int, default=0, help="skip this many trace lines")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-output", type=int, default=32,
                    help="cap on each request's output tokens (the trace's can be ~1000)")
    ap.add_argument("--time-compression", type=float, default=1.0,
                    help="arrivals at trace time / this")
    ap.add_argument("--out", required=True, help="JSON-lines output")
    a = ap.parse_args()
    return asyncio.run(main_async(a))


if __name__ == "__main__":
    sys.exit(main())
