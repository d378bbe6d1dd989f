#!/usr/bin/env python3
"""A tiny vLLM-style KV-event publisher (pyzmq only) for the Go package's subscription
test (subscribe_test.go).

Usage: publisher.py MODE ENDPOINT TOPIC BLOCK_SIZE FIRST_TOKEN N_BLOCKS
  MODE bind:    the publisher binds ENDPOINT (e.g. tcp://127.0.0.1:* for any port) and
                kvr connects to it;
  MODE connect: the publisher connects to ENDPOINT, which kvr has bound.

Protocol (stdout, one line each): "READY <endpoint>" once the socket is up; then, after
kvr's subscription has arrived (an XPUB socket sees it, so nothing is published before
kvr listens), it publishes two messages [TOPIC, seq as 8-byte big-endian, payload] as
vLLM's ZmqEventPublisher does, with KVEventBatch payloads in vLLM 0.33's msgpack
encoding (tagged maps):
  seq 0: BlockStored of N_BLOCKS blocks of BLOCK_SIZE tokens, tokens FIRST_TOKEN,
         FIRST_TOKEN + 1, ...; engine block hashes 1..N_BLOCKS; no parent;
  seq 1: BlockRemoved of the last block (hash N_BLOCKS);
and prints "SENT". It keeps its socket open until stdin is closed, then exits 0.
Exit 3 when no subscription came within 20 s.
"""

import struct
import sys
import time

import zmq


def pack(v) -> bytes:
    """The msgpack encoding of v (None, bool, int, float, str, list, dict) — enough for
    a KVEventBatch, without a msgpack package."""
    if v is None:
        return b"\xc0"
    if v is True:
        return b"\xc3"
    if v is False:
        return b"\xc2"
    if isinstance(v, int):
        if 0 <= v < 128:
            return bytes([v])
        if 0 <= v < 1 << 64:
            return b"\xcf" + struct.pack(">Q", v)
        return b"\xd3" + struct.pack(">q", v)
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        b = v.encode()
        if len(b) < 32:
            return bytes([0xA0 | len(b)]) + b
        return b"\xd9" + bytes([len(b)]) + b
    if isinstance(v, list):
        head = bytes([0x90 | len(v)]) if len(v) < 16 else b"\xdc" + struct.pack(">H", len(v))
        return head + b"".join(pack(x) for x in v)
    if isinstance(v, dict):
        head = bytes([0x80 | len(v)]) if len(v) < 16 else b"\xde" + struct.pack(">H", len(v))
        return head + b"".join(pack(k) + pack(x) for k, x in v.items())
    raise TypeError(type(v))


def batch(events) -> bytes:
    """KVEventBatch: [ts, events, data_parallel_rank] (the rank omitted: none)."""
    return pack([time.time(), events])


def main() -> int:
    mode, endpoint, topic = sys.argv[1], sys.argv[2], sys.argv[3].encode()
    block_size, first, n_blocks = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 1000)
    if mode == "bind":
        pub.bind(endpoint)
        endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    elif mode == "connect":
        pub.connect(endpoint)
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 1
    print(f"READY {endpoint}", flush=True)

    # kvr's SUB subscribes as soon as it is connected: b"\x01" + prefix.
    if not pub.poll(20000):
        print("publisher: no subscription within 20 s", file=sys.stderr)
        return 3
    sub = pub.recv()
    if not sub.startswith(b"\x01"):
        print(f"publisher: unexpected {sub!r}", file=sys.stderr)
        return 2

    tokens = list(range(first, first + block_size * n_blocks))
    stored = {
        "type": "BlockStored",
        "block_hashes": list(range(1, n_blocks + 1)),
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    removed = {"type": "BlockRemoved", "block_hashes": [n_blocks], "medium": "GPU"}
    for seq, payload in enumerate([batch([stored]), batch([removed])]):
        pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
    print("SENT", flush=True)

    sys.stdin.read()  # until the test closes stdin
    pub.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
