#!/usr/bin/env bash
# README's second replay example: the Mooncake conversation trace on 16 workers × 16,384
# KV blocks, every policy. Fails unless the kvr policy's hit rate beats round-robin's and
# least-loaded's and no policy broke the simulator's invariants (kvr replay exits non-zero
# then). Prints the table; KVR_REPLAY_JSON=FILE also keeps the JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
trace=tests/data/mooncake_conversation.jsonl  # vendored: tests/data/README.md
json=${KVR_REPLAY_JSON:-$(mktemp)}
cargo run --release -q -p kvr-cli -- replay --trace "$trace" --workers 16 --kv-blocks 16384 \
  --json --quiet >"$json"
python3 - "$json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
by = {p["policy"]: p for p in d["policies"]}
print(f"{'policy':<16}{'hit rate':>10}{'TTFT p50 s':>12}{'p90 s':>8}{'p99 s':>8}{'imbalance':>11}")
for p in d["policies"]:
    t = p["ttft_ms"]
    print(f"{p['policy']:<16}{p['hit_rate'] * 100:>9.1f}%{t['p50'] / 1e3:>12.2f}{t['p90'] / 1e3:>8.2f}"
          f"{t['p99'] / 1e3:>8.2f}{p['load_imbalance']:>11.2f}")
kvr = by["kvr"]["hit_rate"]
bad = [n for n in ("round-robin", "least-loaded") if by[n]["hit_rate"] >= kvr]
if bad:
    sys.exit(f"replay-mooncake: kvr's hit rate {kvr:.3f} does not beat {', '.join(bad)}")
best = min(d["policies"], key=lambda p: p["ttft_ms"]["p90"])
print(f"kvr hit rate {kvr * 100:.1f} % beats round-robin and least-loaded; lowest TTFT p90: "
      f"{best['policy']} ({best['ttft_ms']['p90'] / 1e3:.2f} s; kvr {by['kvr']['ttft_ms']['p90'] / 1e3:.2f} s)")
PY
