"""`remote_indexer_url=`: overlaps come from a remote primary index (here a stub of
Dynamo's standalone indexer answering `POST /query_tiered_by_hash`), and the awaitable
calls run off the event loop (a network round trip each)."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import kvr

BS = 16


class Indexer(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Indexer.seen.append((self.path, body))
        out = {"block_size": BS, "tiered": {
            "device": {"scores": [[{"worker_id": 2, "dp_rank": 0}, 3]], "frequencies": []},
            "lower_tier": []}}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def remote():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Indexer)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    Indexer.seen = []
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_overlap_from_the_remote_index(remote):
    s = kvr.SelectionService(remote_indexer_url=remote)
    for w in (1, 2):
        s.upsert_worker_sync({"worker_id": w, "model_name": "m", "block_size": BS,
                              "endpoint": f"http://w{w}.invalid"})
    prompt = list(range(4 * BS))
    r = s.select_sync({"model_name": "m", "token_ids": prompt})
    assert (r["worker_id"], r["overlap"]["gpu"]) == (2, 3 * BS)
    path, body = Indexer.seen[-1]
    assert path == "/query_tiered_by_hash" and len(body["block_hashes"]) == 4
    assert [kvr.hash_tokens(prompt, BS)[0]] == [h % 2**64 for h in body["block_hashes"][:1]]

    async def main():
        f = s.select_and_reserve({"model_name": "m", "token_ids": prompt, "selection_id": "r"})
        assert not f.done()  # on the executor, not run inline on the loop
        b = await f
        assert b["worker_id"] == 2
        await s.free_reservation("r")
    asyncio.run(main())
    s.shutdown()
