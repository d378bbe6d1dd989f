"""A vLLM-style KV-event publisher for service/tests/robustness.rs, driven over stdin.

Usage: robustness_publisher.py PORT BLOCK_SIZE

Binds tcp://*:PORT (vLLM binds when the endpoint has `*`) with tests/e2e/kvpublisher.py's
ZmqEventPublisher (seq from 0 per process) and one EngineRank (vLLM 0.33 map encoding).
Prints READY, then answers one line per command:

  peer SECS     wait for a subscriber's handshake      -> PEER 1|0
  store T N     BlockStored of prompt T's N blocks     -> SEQ <seq>  (repeatable)
  remove T N    BlockRemoved of prompt T's N blocks    -> SEQ <seq>  (repeatable)
  stream        publish new 2-block prompts forever (prints STREAMED <n> every 100
                batches) until killed

Prompt T's tokens are T*1000 + i (the Rust side builds the same).
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../tests/e2e"))

from kvpublisher import EngineRank, ZmqEventPublisher, render_event  # noqa: E402

port, block_size = int(sys.argv[1]), int(sys.argv[2])
pub = ZmqEventPublisher(f"tcp://*:{port}")
rank = EngineRank(1, 0, pub, block_size=block_size, encoding="map-v0.33", hash_kind="uint64")
print("READY", flush=True)


def prompt(tag: int, blocks: int):
    return [tag * 1000 + i for i in range(blocks * block_size)]


for line in sys.stdin:
    cmd = line.split()
    if not cmd:
        continue
    if cmd[0] == "peer":
        print("PEER", int(pub.wait_for_peer(float(cmd[1]))), flush=True)
    elif cmd[0] == "store":
        rank.store(prompt(int(cmd[1]), int(cmd[2])))
        print("SEQ", rank.flush(), flush=True)
    elif cmd[0] == "remove":
        hashes = rank.hash_chain(prompt(int(cmd[1]), int(cmd[2])), None, None)
        for h in hashes:
            rank.held["GPU"].pop(h, None)
        values = {"block_hashes": hashes, "medium": "GPU", "group_idx": 0}
        rank.pending.append(render_event(rank.encoding, "BlockRemoved", values))
        print("SEQ", rank.flush(), flush=True)
    elif cmd[0] == "stream":
        n = 0
        while True:
            rank.store(prompt(100 + n, 2))
            rank.flush()
            n += 1
            if n % 100 == 0:
                print("STREAMED", n, flush=True)
            time.sleep(0.0005)
    else:
        print("ERROR unknown command", cmd[0], flush=True)
