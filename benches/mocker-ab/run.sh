#!/usr/bin/env bash
# Live A/B of kvr serve against Dynamo's KvRouter on Dynamo mocker workers.
#   benches/mocker-ab/run.sh smoke [ab.py flags]   # CI: 2 workers, 30 requests, < 60 s
#   benches/mocker-ab/run.sh full  [ab.py flags]   # 3 interleaved runs per router, medians
# DYNAMO_PY: a Python with ai-dynamo-runtime 1.6.1 (default ~/.cache/kvr/compat-venv).
# KVR_BIN:   the kvr binary (default target/release/kvr of this checkout).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
py="${DYNAMO_PY:-$HOME/.cache/kvr/compat-venv/bin/python}"
export KVR_BIN="${KVR_BIN:-$repo/target/release/kvr}"
mode="${1:-smoke}"
shift || true
if ! "$py" -c 'import dynamo._core' 2>/dev/null; then
  echo "no Dynamo runtime in $py (pip install ai-dynamo-runtime==1.6.1 there, or set DYNAMO_PY)" >&2
  exit 2
fi
if [ ! -x "$KVR_BIN" ]; then
  echo "no kvr binary at $KVR_BIN (cargo build --release -p kvr-cli, or set KVR_BIN)" >&2
  exit 2
fi
exec "$py" "$here/ab.py" "$mode" "$@"
