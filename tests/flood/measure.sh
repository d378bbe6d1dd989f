#!/usr/bin/env bash
# What a flood costs kvr, against a clean run, at three levels (one process per run; clean
# and flood runs alternate; medians of RUNS runs of each, with the spread min-max):
#   engine  the EventSource a bound subscription feeds, called directly
#           (engine/examples/ingress_flood.rs): 100,000 distinct topics vs 100,000
#           messages under 4 routed topics, then 100,000 routed messages timed;
#   socket  a real bound kvr_zmq subscription over ipc:// with 4 zeromq PUB publishers
#           (transport/zmq/examples/socket_flood.rs): the same phases end to end, from
#           the first send until the partition's ingress stats count the last message;
#   c-abi   10,000 made-up workers and DP ranks through every C entry that takes one
#           (ffi/examples/ffi_flood.rs) vs as many calls with a registered worker's own
#           ranks, then 100,000 valid kvr_partition_apply_events calls timed.
# RSS growth is VmRSS after the timed part minus before the phase. The target: a flood
# leaves RSS within 10 MiB of a clean run and the routed/valid per-message cost within 2x.
# A measurement the lead runs and reports; it fails only if a binary does.
# Usage: tests/flood/measure.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/../.."
runs=${1:-5}
cargo build --release --locked -p kvr --example ingress_flood >&2
cargo build --release --locked -p kvr-zmq --example socket_flood >&2
cargo build --release --locked -p kvr-ffi --example ffi_flood >&2
bin="${CARGO_TARGET_DIR:-target}/release/examples"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

for _ in $(seq "$runs"); do
  for mode in clean flood; do
    "$bin/ingress_flood" "$mode" | tee -a "$out/engine-$mode" >&2
    "$bin/socket_flood" "$mode" | tee -a "$out/socket-$mode" >&2
    "$bin/ffi_flood" "$mode" | tee -a "$out/c-abi-$mode" >&2
  done
done

# "median min max" of KEY's values in FILE.
stats() {
  sed -n "s/.* $1=\([0-9]*\).*/\1/p" "$2" | sort -n |
    awk '{a[NR]=$1} END {m = NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2; print m, a[1], a[NR]}'
}

echo
echo "flood vs clean, medians of $runs runs each (min-max); $(date -u '+%Y-%m-%d %H:%M UTC')"
printf '%-7s %-26s %-22s %-22s %s\n' level figure clean flood flood/clean
verdicts=()
row() { # level figure key kind(ratio|kib)
  local level=$1 figure=$2 key=$3 kind=$4 c f
  read -r cm cmin cmax < <(stats "$key" "$out/$level-clean")
  read -r fm fmin fmax < <(stats "$key" "$out/$level-flood")
  if [ "$kind" = kib ]; then
    c=$(awk -v m="$fm" -v c="$cm" 'BEGIN {printf "%+d KiB", m - c}')
  else
    c=$(awk -v m="$fm" -v c="$cm" 'BEGIN {printf "%.2fx", c ? m / c : 0}')
  fi
  printf '%-7s %-26s %-22s %-22s %s\n' "$level" "$figure" \
    "$cm ($cmin-$cmax)" "$fm ($fmin-$fmax)" "$c"
  case $kind in
    kib) awk -v m="$fm" -v c="$cm" 'BEGIN {exit !(m - c <= 10240)}' && v=met || v=MISSED
         verdicts+=("$level RSS within 10 MiB of clean: $v") ;;
    target) awk -v m="$fm" -v c="$cm" 'BEGIN {exit !(m <= 2 * c)}' && v=met || v=MISSED
         verdicts+=("$level $figure within 2x of clean: $v") ;;
  esac
}
row engine "phase ns/message" ns_per_message ratio
row engine "then ns/routed message" routed_ns_per_message target
row engine "RSS growth KiB" rss_growth_kib kib
row socket "phase ns/message" ns_per_message ratio
row socket "then ns/routed message" routed_ns_per_message target
row socket "RSS growth KiB" rss_growth_kib kib
row c-abi "phase ns/call" ns_per_call ratio
row c-abi "then ns/valid apply" apply_ns_per_call target
row c-abi "RSS growth KiB" rss_growth_kib kib
printf '%s\n' "${verdicts[@]}"
# A socket run whose PUB queues dropped messages timed fewer than it sent: say so.
cat "$out"/socket-* | awk '{
  for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
  if (v["heard"] != v["sent"] || v["routed"] != v["messages"])
    print "WARNING: a socket run heard less than it sent: " $0
}'
