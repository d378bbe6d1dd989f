#!/usr/bin/env python3
"""A libzmq publisher (pyzmq) for kvr's ZMQ transport interop test
(transport/zmq/tests/zmq_transport.rs, `pyzmq_interop_*`).

It behaves as vLLM's ZmqEventPublisher does on the wire (REFERENCE.md §2): PUB messages
[topic, seq as 8-byte big-endian, payload]; a replay ROUTER, always bound, that takes
[identity, b"", start_seq 8-byte BE] (anything else is dropped), answers
[identity, b"", topic, seq, payload] for every buffered batch with seq >= start, then the
end marker [identity, b"", b"", -1 as 8-byte signed BE, b""].

Usage: publisher.py MODE PUB_ENDPOINT ROUTER_PORT
  MODE bind:    the PUB binds PUB_ENDPOINT (the subscriber connects);
  MODE connect: the PUB connects to PUB_ENDPOINT (the subscriber has bound it).
The ROUTER binds tcp://127.0.0.1:ROUTER_PORT.

Script (what the Rust test asserts):
  1. Batches 0..9 (topic b"kv", payload b"batch-N") go into the replay buffer only: they
     were "sent before the subscriber joined".
  2. Warm-up: [b"kv-warmup", 1000+i, b""] every 20 ms until a replay request arrives (the
     test's sink asks for a replay on its first warm-up message, so the SUB is connected).
  3. The request is answered from the buffer, then the end marker.
  4. Live: [b"other", ...] (filtered out by the subscriber's b"kv" prefix), batches 10..19
     on b"kv" (payload b"batch-N", batch 15 is 300,000 bytes), a 2-frame message, a message
     whose seq frame has 7 bytes, then [b"kv-done", 20, b""].
  5. Exit 0 (after the sockets flushed). Exit 2 on a malformed replay request, 3 when no
     request came within 20 s.
"""

import sys
import time

import zmq

TOPIC = b"kv"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def payload(seq: int) -> bytes:
    if seq == 15:
        return b"x" * 300_000
    return b"batch-%d" % seq


def main() -> int:
    mode, pub_endpoint, router_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 5000)
    if mode == "bind":
        pub.bind(pub_endpoint)
    elif mode == "connect":
        pub.connect(pub_endpoint)
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 1
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 5000)
    router.bind(f"tcp://127.0.0.1:{router_port}")
    print("publisher: ready", flush=True)

    buffer = [(s, TOPIC, payload(s)) for s in range(10)]

    deadline = time.monotonic() + 20.0
    warm = 0
    while not router.poll(20):
        if time.monotonic() > deadline:
            print("publisher: no replay request within 20 s", file=sys.stderr)
            return 3
        pub.send_multipart([b"kv-warmup", seq_bytes(1000 + warm), b""])
        warm += 1

    frames = router.recv_multipart()
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        print(f"publisher: malformed replay request {frames!r}", file=sys.stderr)
        return 2
    identity = frames[0]
    start = int.from_bytes(frames[2], "big")
    print(f"publisher: replay from {start} after {warm} warm-up messages", flush=True)
    for seq, topic, data in buffer:
        if seq >= start:
            router.send_multipart([identity, b"", topic, seq_bytes(seq), data])
    router.send_multipart([identity, b"", b"", END_SEQ, b""])

    pub.send_multipart([b"other", seq_bytes(999), b"filtered"])
    for seq in range(10, 20):
        pub.send_multipart([TOPIC, seq_bytes(seq), payload(seq)])
    pub.send_multipart([TOPIC, seq_bytes(20)])
    pub.send_multipart([TOPIC, b"\x00" * 7, b"bad-seq"])
    pub.send_multipart([b"kv-done", seq_bytes(20), b""])

    # Give the subscriber time to read everything before the connections close.
    time.sleep(0.5)
    pub.close()
    router.close()
    ctx.term()
    print("publisher: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
