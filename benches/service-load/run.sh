#!/usr/bin/env bash
# The selection-service load benchmark: kvr serve vs Dynamo 1.6.1's select_service, the
# same workload (same seed) against each, each server alone in turn, pinned to one core
# and the load generator to the other. Prints a markdown table (see README.md).
#
#   benches/service-load/run.sh [--smoke] [--only dynamo|kvr] [--reps R]
#       [--workers "16 64"] [--warmup S] [--duration S] [--conc 8,32,128]
#       [--rates r1,r2,r3 | --fractions 0.25,0.5,0.8] [--out DIR] [--no-build]
#       [-- extra kvr-service-load flags]
#   benches/service-load/run.sh --prompt-tokens 1024,8192,32768 [--quick] [--bodies json,msgpack]
#       [--only …] [--reps R] [--workers N] [--warmup S] [--duration S] [--conc C] [--out DIR]
#       the per-op CPU mode: prompts of exactly each length, closed loop only; reports the
#       server's CPU microseconds per operation (see README.md)
#
# Environment: KVR_BIN (default $CARGO_TARGET_DIR/release/kvr, else target/release/kvr),
# DYN_PYTHON (default: the venv of tests/compat/ensure-venv.sh), CARGO_TARGET_DIR, SERVER_CPU / LOADGEN_CPU (0 / 1),
# PORT_BASE (28200), ZMQ_BASE (29200).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

smoke=0 only="" reps=3 workers="16 64" warmup=5 duration=10 conc="8,32,128"
rates="" fractions="0.25,0.5,0.8" out="" build=1 extra=()
prompt_tokens="" bodies="json"
for a in "$@"; do
  [ "$a" = -- ] && break
  case "$a" in
    --prompt-tokens)
      # The per-op CPU mode's defaults: one fleet size, one concurrency that saturates a
      # core, no open loop.
      workers="16" conc="32" ;;
  esac
done
for a in "$@"; do
  [ "$a" = -- ] && break
  if [ "$a" = --smoke ]; then
    # Everything tiny (seconds in all, for CI; the figures mean nothing). These are
    # defaults: flags given explicitly still apply.
    smoke=1 reps=1 workers="4" warmup=0.5 duration=1 conc="4"
  fi
  if [ "$a" = --quick ]; then
    # The per-op CPU mode in seconds (CI): the smallest and the largest prompt.
    smoke=1 reps=1 workers="4" warmup=0.3 duration=1 conc="4"
    prompt_tokens=${prompt_tokens:-1024,32768}
  fi
done
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke|--quick) ;;
    --prompt-tokens) prompt_tokens=$2; shift ;;
    --bodies) bodies=$2; shift ;;
    --only) only=$2; shift ;;
    --reps) reps=$2; shift ;;
    --workers) workers=$2; shift ;;
    --warmup) warmup=$2; shift ;;
    --duration) duration=$2; shift ;;
    --conc) conc=$2; shift ;;
    --rates) rates=$2; shift ;;
    --fractions) fractions=$2; shift ;;
    --out) out=$2; shift ;;
    --no-build) build=0 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$smoke" = 1 ] && [ -z "$prompt_tokens" ]; then
  extra=(--cache-blocks 1024 --max-len 2048 --groups 4 --group-max 1024 --sessions 32 "${extra[@]}")
fi
case "$only" in
  "") services="dynamo kvr" ;;
  dynamo|kvr) services=$only ;;
  *) echo "--only takes dynamo or kvr" >&2; exit 2 ;;
esac
out=${out:-$(mktemp -d /tmp/service-load.XXXXXX)}
mkdir -p "$out"

target=${CARGO_TARGET_DIR:-target}
kvr_bin=${KVR_BIN:-$target/release/kvr}
dyn_python=${DYN_PYTHON:-${KVR_COMPAT_VENV:-$HOME/.cache/kvr/compat-venv}/bin/python}
loadgen=$target/release/kvr-service-load
server_cpu=${SERVER_CPU:-0} loadgen_cpu=${LOADGEN_CPU:-1}
if [ "$(nproc --all)" -lt 2 ]; then server_cpu=0 loadgen_cpu=0; fi
port_base=${PORT_BASE:-28200} zmq_base=${ZMQ_BASE:-29200}

log() { echo "[run] $*" >&2; }

# Fail early, with the way out, rather than run half the comparison.
for s in $services; do
  case $s in
    dynamo) "$dyn_python" -c 'import dynamo.select_service' 2>/dev/null ||
      { echo "Dynamo not found ($dyn_python -m dynamo.select_service); set DYN_PYTHON or use --only kvr" >&2; exit 2; } ;;
    kvr) "$kvr_bin" serve --help >/dev/null 2>&1 ||
      { echo "'$kvr_bin serve' not available; set KVR_BIN or use --only dynamo" >&2; exit 2; } ;;
  esac
done
if [ "$build" = 1 ]; then
  cargo build --release -q -p kvr-service-load
fi
[ -x "$loadgen" ] || { echo "no load generator at $loadgen" >&2; exit 2; }

server_pid=""
stop_server() {
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
  fi
}
trap stop_server EXIT

port_free() { ! ss -ltnH "sport = :$1" | grep -q .; }

run_k=0
# run_one SERVICE WORKERS NAME RATES [FLAGS...]: a fresh server, one load-generator run
# (with FLAGS), JSON to $out/NAME.json, the server's log to $out/NAME.server.log.
run_one() {
  local service=$1 n=$2 name=$3 run_rates=$4
  shift 4
  local more=("$@")
  local port zbase i
  # A new port per run: no TIME_WAIT or a lingering socket of the previous server.
  while :; do
    port=$((port_base + run_k % 100)) zbase=$((zmq_base + (run_k % 8) * 128))
    run_k=$((run_k + 1))
    port_free "$port" || continue
    for ((i = 0; i < n; i++)); do port_free $((zbase + i)) || continue 2; done
    break
  done
  case $service in
    dynamo) taskset -c "$server_cpu" "$dyn_python" -m dynamo.select_service --port "$port" \
              >"$out/$name.server.log" 2>&1 & ;;
    kvr) taskset -c "$server_cpu" "$kvr_bin" serve --port "$port" \
           >"$out/$name.server.log" 2>&1 & ;;
  esac
  server_pid=$!
  local args=(--port "$port" --service "$service" --server-pid "$server_pid" --workers "$n"
    --server-core "$server_cpu" --loadgen-core "$loadgen_cpu"
    --zmq-base-port "$zbase" --warmup "$warmup" --duration "$duration" --conc "$conc")
  [ -n "$run_rates" ] && args+=(--rates "$run_rates")
  args+=("${more[@]}")
  log "$name: $service on core $server_cpu (pid $server_pid, port $port), load generator on core $loadgen_cpu"
  if ! taskset -c "$loadgen_cpu" "$loadgen" "${args[@]}" "${extra[@]}" \
      >"$out/$name.json" 2>"$out/$name.load.log"; then
    cat "$out/$name.load.log" >&2
    log "$name failed; server log: $out/$name.server.log"
    exit 1
  fi
  grep -v '^\[load\] first' "$out/$name.load.log" | sed "s/^/  /" >&2 || true
  stop_server
}

best_ops() {
  python3 -c 'import json,sys; print(max(p["ops_s"] for p in json.load(open(sys.argv[1]))["phases"] if p["kind"]=="closed"))' "$1"
}

dyn_version=$("$dyn_python" -c 'import importlib.metadata as m; print(m.version("ai-dynamo-runtime"))' 2>/dev/null || echo "?")
cpu_model=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//;s/"//g')

if [ -n "$prompt_tokens" ]; then
  # The per-op CPU mode: for each length, each repetition runs every service (and, for
  # kvr, every body form) in turn, so drift on the machine hits all of them alike.
  n=${workers%% *}
  for len in ${prompt_tokens//,/ }; do
    for ((r = 1; r <= reps; r++)); do
      for s in $services; do
        for body in ${bodies//,/ }; do
          # Dynamo's service reads JSON only.
          [ "$s" = dynamo ] && [ "$body" != json ] && continue
          run_one "$s" "$n" "cpu-$s-$body-t$len-r$r" "" --prompt-tokens "$len" \
            --min-len "$len" --max-len "$len" --body "$body"
        done
      done
    done
  done
  cat >"$out/meta.json" <<EOF
{"mode": "cpu", "services": "$services", "bodies": "$bodies", "workers": "$n", "reps": $reps,
 "warmup": $warmup, "duration": $duration, "conc": "$conc", "prompt_tokens": "$prompt_tokens",
 "smoke": $smoke, "server_cpu": "$server_cpu", "loadgen_cpu": "$loadgen_cpu",
 "nproc": $(nproc --all), "cpu_model": "$cpu_model", "dynamo_version": "$dyn_version",
 "kvr_bin": "$kvr_bin", "extra": "${extra[*]}"}
EOF
  python3 "$here/report.py" "$out"
  log "raw results: $out"
  exit 0
fi

declare -A rate_of
for n in $workers; do
  if [ -n "$rates" ]; then
    rate_of[$n]=$rates
    continue
  fi
  # The offered loads are fractions of Dynamo's saturation throughput (of kvr's when
  # Dynamo is not run), from one calibration run per fleet size.
  calib=dynamo
  case " $services " in *" dynamo "*) ;; *) calib=kvr ;; esac
  run_one "$calib" "$n" "calibrate-$calib-n$n" ""
  sat=$(best_ops "$out/calibrate-$calib-n$n.json")
  rate_of[$n]=$(python3 -c 'import sys; s=float(sys.argv[1]); print(",".join(str(max(1,round(s*float(f)))) for f in sys.argv[2].split(",")))' "$sat" "$fractions")
  log "workers=$n: $calib saturates at $sat ops/s; offered loads ${rate_of[$n]} ops/s"
done

for n in $workers; do
  for ((r = 1; r <= reps; r++)); do
    # Services alternate within each repetition, so a drift of the machine hits both.
    for s in $services; do
      run_one "$s" "$n" "$s-n$n-r$r" "${rate_of[$n]}"
    done
  done
done

rates_json=$(for n in $workers; do echo "\"$n\": \"${rate_of[$n]}\""; done | paste -sd, -)
cat >"$out/meta.json" <<EOF
{"services": "$services", "workers": "$workers", "reps": $reps, "warmup": $warmup,
 "duration": $duration, "conc": "$conc", "fractions": "$fractions", "rates": {$rates_json},
 "fixed_rates": $([ -n "$rates" ] && echo true || echo false), "smoke": $smoke,
 "server_cpu": "$server_cpu", "loadgen_cpu": "$loadgen_cpu", "nproc": $(nproc --all),
 "cpu_model": "$cpu_model",
 "dynamo_version": "$dyn_version", "kvr_bin": "$kvr_bin", "extra": "${extra[*]}"}
EOF
python3 "$here/report.py" "$out"
log "raw results: $out"
