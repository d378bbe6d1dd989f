"""A libzmq (pyzmq) PUB or SUB peer for kvr-zmtp's interop tests.

  peer.py sub ENDPOINT TOPIC...   connect a SUB, subscribe to each TOPIC (hex; "" = all)
  peer.py pub PORT                bind a PUB on tcp://127.0.0.1:PORT

Heartbeats are short, as the tests ask: ZMQ_HEARTBEAT_IVL 200 ms, HEARTBEAT_TIMEOUT and
HEARTBEAT_TTL 600 ms (override with --hb-ivl/--hb-timeout/--hb-ttl in ms).

stdout, one JSON object per line:
  {"ready": true}                          socket set up
  {"msg": [hex, ...]}                      a message received (SUB)
  {"event": "connected"|"accepted"|"disconnected"|...}   socket monitor events
stdin (PUB), one command per line:
  send TOPIC_HEX PAYLOAD_HEX    send a two-frame message
  quit
The process exits when stdin closes.
"""

import argparse
import json
import os
import sys

import zmq
from zmq.utils.monitor import recv_monitor_message

EVENTS = {
    zmq.EVENT_CONNECTED: "connected",
    zmq.EVENT_ACCEPTED: "accepted",
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshake_succeeded",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed_protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
}


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["pub", "sub"])
    ap.add_argument("where")
    ap.add_argument("topics", nargs="*")
    ap.add_argument("--hb-ivl", type=int, default=200)
    ap.add_argument("--hb-timeout", type=int, default=600)
    ap.add_argument("--hb-ttl", type=int, default=600)
    args = ap.parse_args()

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB if args.role == "pub" else zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, args.hb_ivl)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, args.hb_timeout)
    sock.setsockopt(zmq.HEARTBEAT_TTL, args.hb_ttl)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    mon = sock.get_monitor_socket()
    if args.role == "pub":
        sock.bind(f"tcp://127.0.0.1:{int(args.where)}")
    else:
        for t in args.topics:
            sock.setsockopt(zmq.SUBSCRIBE, bytes.fromhex(t))
        sock.connect(args.where)
    out({"ready": True})

    poller = zmq.Poller()
    poller.register(mon, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    if args.role == "sub":
        poller.register(sock, zmq.POLLIN)
    pending = b""
    while True:
        for item, _ in poller.poll():
            if item is mon:
                ev = recv_monitor_message(mon)
                name = EVENTS.get(ev["event"])
                if name:
                    out({"event": name})
            elif item is sock:
                frames = sock.recv_multipart()
                out({"msg": [f.hex() for f in frames]})
            else:
                # Raw reads: a buffered readline() could hold lines that poll() never
                # reports again.
                chunk = os.read(0, 65536)
                pending += chunk
                lines = pending.split(b"\n")
                pending = lines.pop()
                if not chunk:
                    lines.append(b"quit")
                for line in lines:
                    cmd = line.decode().split()
                    if cmd == ["quit"]:
                        sock.close(0)
                        mon.close(0)
                        ctx.term()
                        return
                    if cmd and cmd[0] == "send":
                        topic = bytes.fromhex(cmd[1]) if len(cmd) > 1 else b""
                        payload = bytes.fromhex(cmd[2]) if len(cmd) > 2 else b""
                        sock.send_multipart([topic, payload])


if __name__ == "__main__":
    main()
