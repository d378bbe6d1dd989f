"""kvr replay's simulator against Dynamo's mocker, on the same trace and engine.

Runs Dynamo 1.6.1's offline mocker (`run_mocker_trace_replay`, from the pinned wheel)
and `kvr replay` on the first lines of the vendored Mooncake conversation trace, with
kvr's engine parameters set to the mocker's (REFERENCE: prefill 53,700 tokens/s, 16.5 ms
a prefilling step, 6.1 ms a token, 6 % more per other decoding request, no event lag),
16 workers of 16,384 blocks of 64 tokens. Round-robin against round-robin, and
kvr's `dynamo-classic` against the mocker's `kv_router` (Dynamo's cost), in each regime:
arrivals 1x, 2x and 4x on the mocker's default engine speed, and a deep overload (the
engine 5x slower, arrivals 4x).

A regime is checked when it is listed in CHECKED: hit rates within HIT_POINTS points and
TTFT p50 and p90 within TTFT_SHARE of the mocker's. The others are measured and printed,
not failed (the deep overload diverges; kvr's engine has no preemption). `--negative`
gives kvr's engine half the mocker's prefill rate and must fail. Usage:
python compare.py KVR_BIN [--lines N] [--negative]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "tests" / "data" / "mooncake_conversation.jsonl"
WORKERS, BLOCKS, BLOCK = 16, 16_384, 64
ENGINE = dict(prefill_rate=53_700.0, overhead_ms=16.5, tpot_ms=6.1, slowdown=0.06)
# (name, engine speed ratio, arrival speed-up)
REGIMES = [("1x", 1.0, 1.0), ("2x", 1.0, 2.0), ("4x", 1.0, 4.0), ("overload", 0.2, 4.0)]
CHECKED = {"1x", "2x", "4x"}
HIT_POINTS = 1.5
# TTFT p90 within 10 %, p50 within 25 %: at 2x kvr's p50 is 17-21 % below the mocker's
# on 2,000-6,000 lines (p90 within 2 %), a gap whose cause is not yet known.
TTFT_SHARE = {"p50": 0.25, "p90": 0.10}
PAIRS = [("round-robin", "round_robin"), ("dynamo-classic", "kv_router")]


def mocker(trace, mode, engine_speed, arrivals):
    os.environ.setdefault("DYN_LOG", "warn")  # the router logs every pick at info
    from dynamo._core import run_mocker_trace_replay

    r = run_mocker_trace_replay(
        [str(trace)],
        extra_engine_args={"engine": {"block_size": BLOCK, "num_gpu_blocks": BLOCKS,
                                      "speedup_ratio": engine_speed}},
        num_workers=WORKERS, router_mode=mode, arrival_speedup_ratio=arrivals,
        trace_block_size=512)
    s = r.summary
    return {"hit": s["prefix_cache_reused_ratio"], "p50": s["median_ttft_ms"],
            "p90": s["p90_ttft_ms"]}


def kvr(bin_, trace, engine_speed, arrivals, rate_factor=1.0):
    cmd = [bin_, "replay", "--quiet", "--json", "--trace", str(trace),
           "--policy", ",".join(p for p, _ in PAIRS), "--workers", str(WORKERS),
           "--kv-blocks", str(BLOCKS), "--block-size", str(BLOCK),
           "--prefill-rate", str(ENGINE["prefill_rate"] * engine_speed * rate_factor),
           "--prefill-overhead-ms", str(ENGINE["overhead_ms"] / engine_speed),
           "--tpot-ms", str(ENGINE["tpot_ms"] / engine_speed),
           "--batch-slowdown", str(ENGINE["slowdown"]), "--event-delay-ms", "0",
           "--speed", str(arrivals)]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {p["policy"]: {"hit": p["hit_rate"], "p50": p["ttft_ms"]["p50"],
                          "p90": p["ttft_ms"]["p90"]} for p in out["policies"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kvr_bin")
    ap.add_argument("--lines", type=int, default=3000)
    ap.add_argument("--negative", action="store_true",
                    help="kvr's engine at half the prefill rate: the check must fail")
    args = ap.parse_args()
    regimes = [r for r in REGIMES if r[0] in CHECKED] if args.negative else REGIMES
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        with open(TRACE) as src, open(trace, "w") as dst:
            for i, line in enumerate(src):
                if i >= args.lines:
                    break
                dst.write(line)
        failures = []
        print(f"{args.lines} trace lines, {WORKERS} workers; kvr replay against Dynamo's mocker")
        print(f"{'regime':<10}{'kvr policy':<16}{'hit kvr/mocker':>18}{'TTFT p50 ms':>22}"
              f"{'TTFT p90 ms':>22}  checked")
        for name, speed, arrivals in regimes:
            t = time.time()
            ours = kvr(args.kvr_bin, trace, speed, arrivals, 0.5 if args.negative else 1.0)
            for policy, mode in PAIRS:
                theirs = mocker(trace, mode, speed, arrivals)
                k = ours[policy]
                checked = name in CHECKED
                print(f"{name:<10}{policy:<16}{k['hit'] * 100:>8.1f}/{theirs['hit'] * 100:.1f} %"
                      f"{k['p50']:>12.0f}/{theirs['p50']:<9.0f}{k['p90']:>12.0f}/{theirs['p90']:<9.0f}"
                      f"  {'yes' if checked else 'no (measured)'}")
                if not checked:
                    continue
                if abs(k["hit"] - theirs["hit"]) * 100 > HIT_POINTS:
                    failures.append(f"{name} {policy}: hit rate {k['hit']:.3f} against "
                                    f"the mocker's {theirs['hit']:.3f}")
                for q in ("p50", "p90"):
                    if abs(k[q] - theirs[q]) > TTFT_SHARE[q] * theirs[q]:
                        failures.append(f"{name} {policy}: TTFT {q} {k[q]:.0f} ms against "
                                        f"the mocker's {theirs[q]:.0f} ms")
            print(f"{'':<10}({time.time() - t:.1f} s)")
    if args.negative:
        if not failures:
            sys.exit("sim-compare --negative: half the prefill rate went unnoticed")
        print(f"sim-compare --negative: failed as it must ({len(failures)} differences, "
              f"first: {failures[0]})")
        return
    if failures:
        sys.exit("sim-compare:\n  " + "\n  ".join(failures))
    print("sim-compare: kvr replay agrees with Dynamo's mocker in every checked regime")


if __name__ == "__main__":
    main()
