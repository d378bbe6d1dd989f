#!/usr/bin/env bash
# The routing-quality check of README's "Routing quality" section: the load sweep on the
# built-in workload (1×, 4×, 16× its default rate) and on the vendored Mooncake
# conversation trace (1×, 2×, 4×), every policy at each load. Fails unless, in every
# cell, kvr's default has the lowest TTFT p90 of all policies (within 2 %), a hit rate
# within 5 points of the best, and a TPOT p90 at most 10 % above least-loaded's — or
# unless any run broke the simulator's invariants (kvr replay exits non-zero then).
# Prints TTFT p90 / hit rate / TPOT p90 per cell. KVR_SWEEP_DIR=DIR keeps the JSON and
# the plots (sweep-builtin.svg, sweep-mooncake.svg) there.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${KVR_SWEEP_DIR:-$(mktemp -d)}
mkdir -p "$dir"
kvr=(cargo run --release -q -p kvr-cli -- replay --quiet --json)
"${kvr[@]}" --sweep rate=1,4,16 --plot "$dir/sweep-builtin.svg" >"$dir/sweep-builtin.json"
"${kvr[@]}" --trace tests/data/mooncake_conversation.jsonl --sweep rate=1,2,4 \
  --plot "$dir/sweep-mooncake.svg" >"$dir/sweep-mooncake.json"
python3 - "$dir/sweep-builtin.json" "$dir/sweep-mooncake.json" <<'PY'
import json, sys
failures = []
for path in sys.argv[1:]:
    d = json.load(open(path))
    name = d["workload"]["name"]
    print(f"{name}")
    print(f"  {'load':<6}{'kvr p90 s':>10}{'best other':>26}{'kvr hit':>9}{'best hit':>22}"
          f"{'kvr TPOT p90':>14}{'least-loaded':>14}")
    for pt in d["sweep"]["points"]:
        by = {p["policy"]: p for p in pt["policies"]}
        kvr = by["kvr"]
        others = [p for p in pt["policies"] if p["policy"] != "kvr"]
        best = min(others, key=lambda p: p["ttft_ms"]["p90"])
        top = max(pt["policies"], key=lambda p: p["hit_rate"])
        ll = by["least-loaded"]
        cell = f"{name} at {pt['value']}×"
        k90, b90 = kvr["ttft_ms"]["p90"], best["ttft_ms"]["p90"]
        print(f"  {str(pt['value']) + '×':<6}{k90 / 1e3:>10.3f}{best['policy'] + ' ' + format(b90 / 1e3, '.3f'):>26}"
              f"{kvr['hit_rate'] * 100:>8.1f}%{top['policy'] + ' ' + format(top['hit_rate'] * 100, '.1f') + '%':>22}"
              f"{kvr['tpot_ms']['p90']:>14.1f}{ll['tpot_ms']['p90']:>14.1f}")
        if k90 > 1.02 * b90:
            failures.append(f"{cell}: kvr's TTFT p90 {k90:.0f} ms > 1.02 × {best['policy']}'s {b90:.0f} ms")
        if kvr["hit_rate"] < top["hit_rate"] - 0.05:
            failures.append(f"{cell}: kvr's hit rate {kvr['hit_rate']:.3f} is > 5 points below {top['policy']}'s {top['hit_rate']:.3f}")
        if kvr["tpot_ms"]["p90"] > 1.10 * ll["tpot_ms"]["p90"]:
            failures.append(f"{cell}: kvr's TPOT p90 {kvr['tpot_ms']['p90']:.1f} ms > 1.10 × least-loaded's {ll['tpot_ms']['p90']:.1f} ms")
if failures:
    sys.exit("replay-sweep:\n  " + "\n  ".join(failures))
print("replay-sweep: in every cell kvr has the lowest TTFT p90 (within 2 %), hits within 5 points "
      "of the best and TPOT p90 within 10 % of least-loaded's")
PY
