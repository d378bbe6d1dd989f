"""vLLM-like KV-event publishers for tests/dynamo_indexer.rs (Dynamo's real indexer
subscribes to them). Uses tests/e2e/kvpublisher.py; needs pyzmq and msgspec.

argv[1] is a JSON scenario:
  {"block_size": 16, "tokens": [...],
   "publishers": [{"dp_rank": 0, "stores": [{"medium": "GPU", "from": 0, "to": 3}, ...]}]}
Each store is one BlockStored of the prompt's blocks from..to (block i's engine hash is
EXT + i, its parent block from-1's), on that medium, in one batch per publisher.

Protocol (stdout; logs on stderr):
  -> READY {"endpoints": ["tcp://127.0.0.1:port", ...]}   (one per publisher, bound)
  <- GO                        (the subscriber is connected)
  -> PUBLISHED                 (after every PUB socket saw a handshake and sent its batch)
  then exits when stdin closes.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "tests", "e2e"))
import kvpublisher as kp  # noqa: E402

# Engine hashes above 2^63, as vLLM's uint64 hashes often are.
EXT = 0xF000_0000_0000_0000


def main() -> int:
    spec = json.loads(sys.argv[1])
    bs = spec["block_size"]
    tokens = spec["tokens"]
    pubs = [
        kp.ZmqEventPublisher("tcp://127.0.0.1:*", mode="bind", name=f"pub{i}")
        for i, _ in enumerate(spec["publishers"])
    ]
    print("READY " + json.dumps({"endpoints": [p.endpoint for p in pubs]}), flush=True)
    if sys.stdin.readline().strip() != "GO":
        return 3
    for p in pubs:
        if not p.wait_for_peer(20.0):
            kp.log(f"{p.name}: no subscriber connected")
            return 4
    time.sleep(0.3)  # let the subscription reach the PUB sockets
    for p, desc in zip(pubs, spec["publishers"]):
        events = []
        for s in desc["stores"]:
            a, b = s["from"], s["to"]
            events.append(
                kp.BlockStored(
                    block_hashes=[EXT + i for i in range(a, b)],
                    parent_block_hash=EXT + a - 1 if a > 0 else None,
                    token_ids=tokens[a * bs : b * bs],
                    block_size=bs,
                    lora_id=None,
                    medium=s["medium"],
                    lora_name=None,
                )
            )
        p.publish_payload(p.encode_batch(events, desc["dp_rank"]))
    print("PUBLISHED", flush=True)
    sys.stdin.read()
    for p in pubs:
        p.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
