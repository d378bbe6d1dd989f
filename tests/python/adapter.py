"""The HTTP harness's scenario (tests/compat/harness.py) against an in-process
SelectionService: each (method, path, body) the scenario sends becomes the class's call,
answered as (status, body, content type) the way the harness records HTTP answers:

- a value: (200, value); ValueError: (400, {"error": text});
  SelectionServiceError: (status_code, {"error": text, "kind": kind});
  any other exception: (its type name, {"error": text}) — so both sides must raise alike;
- requests with no method to call (raw bodies that are not JSON, /health, /replica_sync,
  unknown routes) answer ("n/a", None) on both sides.

The awaitable methods run on one event loop in a background thread (Dynamo's need a
running loop), so the scenario's synchronous steps can wait on them.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse

NA = ("n/a", None, None)


class Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, fn, timeout=60):
        async def call():
            r = fn()
            if asyncio.isfuture(r) or asyncio.iscoroutine(r):
                r = await r
            return r
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def answer(loop: Loop, fn, error_type):
    try:
        v = loop.run(fn)
    except ValueError as e:
        return 400, {"error": str(e)}, "application/json"
    except error_type as e:
        return e.status_code, {"error": str(e), "kind": e.kind}, "application/json"
    except Exception as e:  # noqa: BLE001 - recorded, compared with the other side
        return type(e).__name__, {"error": str(e)}, "application/json"
    return 200, v, "application/json"


def py_worker(body):
    """A worker dict as Python callers write it for Dynamo's class: the per-rank
    `kv_events_endpoints` keyed by int rank (JSON's keys are strings)."""
    eps = body.get("kv_events_endpoints") if isinstance(body, dict) else None
    if isinstance(eps, dict):
        body = dict(body)
        body["kv_events_endpoints"] = {int(k) if str(k).isdigit() else k: v for k, v in eps.items()}
    return body


def route(svc, method: str, path: str, body):
    """The class call for one HTTP request, or None when there is none."""
    u = urllib.parse.urlsplit(path)
    q = {k: v[-1] for k, v in urllib.parse.parse_qs(u.query).items()}
    parts = [p for p in u.path.split("/") if p]
    filt = {k: q[k] for k in ("model_name", "routing_group") if k in q}
    if method == "GET" and parts == ["ready"]:
        return svc.ready
    if method == "GET" and parts == ["dump"]:
        return svc.indexer_snapshot
    if method == "GET" and parts == ["workers"]:
        return lambda: svc.list_workers(**filt)
    if method == "GET" and parts == ["loads"]:
        return lambda: svc.loads(**filt)
    if method == "POST" and parts == ["workers"]:
        return lambda: svc.upsert_worker(py_worker(body))
    if len(parts) == 2 and parts[0] == "workers" and method in ("PATCH", "DELETE"):
        wid = int(parts[1]) if parts[1].isdigit() else parts[1]
        if method == "PATCH":
            return lambda: svc.patch_worker(wid, body)
        return lambda: svc.delete_worker(wid)
    ops = {"select": svc.select, "select_and_reserve": svc.select_and_reserve,
           "potential_loads": svc.potential_loads, "overlap_scores": svc.overlap_scores,
           "reservations": svc.create_reservation}
    if method == "POST" and len(parts) == 1 and parts[0] in ops:
        op = ops[parts[0]]
        return lambda: op(body)
    if parts[:1] == ["reservations"] and len(parts) >= 2:
        rid = parts[1]
        if method == "DELETE" and len(parts) == 2:
            return lambda: svc.free_reservation(rid)
        if method == "POST" and parts[2:] == ["prefill_complete"]:
            return lambda: svc.prefill_complete(rid)
        if method == "POST" and parts[2:] == ["output_block"]:
            df = body.get("decay_fraction") if isinstance(body, dict) else None
            return lambda: svc.add_output_block(rid, decay_fraction=df)
    return None


class InProcess:
    """`harness.http` for bases of the form inproc://<name>, registered here."""

    def __init__(self, real_http):
        self.real_http = real_http
        self.sides: dict[str, tuple] = {}

    def add(self, name: str, svc, error_type):
        self.sides[name] = (svc, Loop(), error_type)
        return f"inproc://{name}"

    def close(self, name: str):
        svc, loop, _ = self.sides.pop(name)
        loop.close()

    def __call__(self, base, method, path, body=None, raw=None, content_type="application/json"):
        if not base.startswith("inproc://"):
            return self.real_http(base, method, path, body, raw, content_type)
        svc, loop, error_type = self.sides[base[len("inproc://"):]]
        if raw is not None:
            try:
                body = json.loads(raw)
            except ValueError:
                return NA
        fn = route(svc, method, path, body if body is not None else {})
        if fn is None:
            return NA
        return answer(loop, fn, error_type)
