#!/usr/bin/env bash
# The routing-quality check of README's "Routing quality" section: the load sweep on the
# built-in workload (1×, 4×, 16× its default rate; three workload seeds) and on the
# vendored Mooncake conversation trace (1×, 2×, 4×), every policy at each load. A cell's
# figure is the median over the seeds (the trace has one). Fails unless, in every cell,
# kvr's default has the lowest TTFT p90 of all policies (within 2 %), a hit rate within 5
# points of the best, and a TPOT p90 at most 10 % above least-loaded's — or unless any
# run broke the simulator's invariants (kvr replay exits non-zero then). Prints TTFT p90
# [min–max over seeds] / hit rate / TPOT p90 per cell. KVR_SWEEP_DIR=DIR keeps the JSON
# and the plots (sweep-builtin.svg from seed 42, sweep-mooncake.svg) there.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${KVR_SWEEP_DIR:-$(mktemp -d)}
mkdir -p "$dir"
kvr=(cargo run --release -q -p kvr-cli -- replay --quiet --json)
"${kvr[@]}" --sweep rate=1,4,16 --plot "$dir/sweep-builtin.svg" >"$dir/sweep-builtin.json"
for seed in 43 44; do
  "${kvr[@]}" --seed "$seed" --sweep rate=1,4,16 >"$dir/sweep-builtin-seed$seed.json"
done
"${kvr[@]}" --trace tests/data/mooncake_conversation.jsonl --sweep rate=1,2,4 \
  --plot "$dir/sweep-mooncake.svg" >"$dir/sweep-mooncake.json"
python3 - "$dir/sweep-builtin.json,$dir/sweep-builtin-seed43.json,$dir/sweep-builtin-seed44.json" \
  "$dir/sweep-mooncake.json" <<'PY'
import json, statistics, sys

failures = []
for paths in sys.argv[1:]:
    runs = [json.load(open(p)) for p in paths.split(",")]
    name = runs[0]["workload"]["name"]
    seeds = f" (median of {len(runs)} seeds)" if len(runs) > 1 else ""
    print(f"{name}{seeds}")
    print(f"  {'load':<6}{'kvr p90 s':>22}{'best other':>34}{'kvr hit':>9}{'best hit':>22}"
          f"{'kvr TPOT p90':>14}{'least-loaded':>14}")
    for i, pt in enumerate(runs[0]["sweep"]["points"]):
        cells = [{p["policy"]: p for p in r["sweep"]["points"][i]["policies"]} for r in runs]

        def fig(policy, get):
            return statistics.median(get(c[policy]) for c in cells)

        def spread(policy, get):
            v = [get(c[policy]) for c in cells]
            return f"[{min(v) / 1e3:.3f}-{max(v) / 1e3:.3f}]" if len(v) > 1 else ""

        p90 = lambda p: p["ttft_ms"]["p90"]
        hit = lambda p: p["hit_rate"]
        tpot = lambda p: p["tpot_ms"]["p90"]
        policies = list(cells[0])
        others = [p for p in policies if p != "kvr"]
        best = min(others, key=lambda p: fig(p, p90))
        top = max(policies, key=lambda p: fig(p, hit))
        cell = f"{name} at {pt['value']}×"
        k90, b90 = fig("kvr", p90), fig(best, p90)
        khit, thit = fig("kvr", hit), fig(top, hit)
        ktpot, ltpot = fig("kvr", tpot), fig("least-loaded", tpot)
        print(f"  {str(pt['value']) + '×':<6}{format(k90 / 1e3, '.3f') + ' ' + spread('kvr', p90):>22}"
              f"{best + ' ' + format(b90 / 1e3, '.3f') + ' ' + spread(best, p90):>34}"
              f"{khit * 100:>8.1f}%{top + ' ' + format(thit * 100, '.1f') + '%':>22}"
              f"{ktpot:>14.1f}{ltpot:>14.1f}")
        if k90 > 1.02 * b90:
            failures.append(f"{cell}: kvr's TTFT p90 {k90:.0f} ms > 1.02 × {best}'s {b90:.0f} ms")
        if khit < thit - 0.05:
            failures.append(f"{cell}: kvr's hit rate {khit:.3f} is > 5 points below {top}'s {thit:.3f}")
        if ktpot > 1.10 * ltpot:
            failures.append(f"{cell}: kvr's TPOT p90 {ktpot:.1f} ms > 1.10 × least-loaded's {ltpot:.1f} ms")
if failures:
    sys.exit("replay-sweep:\n  " + "\n  ".join(failures))
print("replay-sweep: in every cell kvr has the lowest TTFT p90 (within 2 %), hits within 5 points "
      "of the best and TPOT p90 within 10 % of least-loaded's")
PY
