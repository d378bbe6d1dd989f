#!/usr/bin/env bash
# What a flood of 100,000 distinct topics costs a bound source, against a clean run of as
# many messages under 4 routed topics (each run then times 100,000 routed messages: what
# the flood costs the other publishers): RSS growth and time per message, medians of RUNS
# runs of each (one process per run). Usage: tests/flood/measure.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/../.."
runs=${1:-5}
cargo build --release --locked -p kvr --example ingress_flood >&2
bin="${CARGO_TARGET_DIR:-target}/release/examples/ingress_flood"
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
for mode in clean flood; do
  out=$(for _ in $(seq "$runs"); do "$bin" "$mode"; done)
  echo "$out" >&2
  ns=$(echo "$out" | sed -n 's/.* ns_per_message=\([0-9]*\).*/\1/p' | median)
  routed=$(echo "$out" | sed -n 's/.*routed_ns_per_message=\([0-9]*\).*/\1/p' | median)
  kib=$(echo "$out" | sed -n 's/.*rss_growth_kib=\([0-9]*\).*/\1/p' | median)
  echo "$mode: median over $runs runs: ${ns} ns/message, then ${routed} ns per routed message, RSS growth ${kib} KiB"
done
