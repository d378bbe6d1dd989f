#!/usr/bin/env bash
# The whole test suite: every crate's unit, integration and differential tests (release
# build: the churn test applies 5 M events; the header test checks include/kvr.h), the
# loom models of the atomic protocols with their negative controls, Miri over the unit
# tests of the unsafe index modules (tests/miri.sh, nightly), then the host
# harnesses over libkvr: C (also under valgrind), C++ (multi-threaded) and Go (vet, race,
# cgocheck=2, kvrdebug), the e2e publisher's self-test and the README's host examples.
# (The ingress end-to-end test against that publisher runs in cargo test, in kvr-zmq; it
# needs python3 with pyzmq and msgspec, which .ci/run installs, and skips without them.)
set -euo pipefail
cd "$(dirname "$0")/.."

# The e2e publisher's Python packages (ffi/go/run.sh likewise installs Go if missing).
python3 -c "import zmq, msgspec" 2>/dev/null || python3 -m pip install -q pyzmq msgspec

echo "== cargo test --workspace --release"
cargo test --workspace --release
# The transports on their own (outside the workspace's unified features): kvr-zmq (the ZMQ
# transport, pyzmq interop, the ingress e2e test) and kvr-remote (the HTTP client, and
# selection on a remote primary against failing servers).
cargo test -p kvr-zmq -p kvr-remote --release

echo "== fuzz replay (fuzz/: every seed and kept crasher through its target, on stable)"
cargo test --manifest-path fuzz/Cargo.toml  # debug: overflow checks on

echo "== loom models (LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-3})"
RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}" \
    cargo test -p kvr --release --lib --target-dir target/loom loom_models

echo "== C host (tests/c)"
bash tests/c/run.sh

echo "== C++ host (tests/cpp)"
bash tests/cpp/run.sh

echo "== Go package (ffi/go)"
bash ffi/go/run.sh

echo "== ingress e2e publisher self-test (tests/e2e)"
python3 tests/e2e/selftest.py

echo "== README host examples"
python3 tests/check-readme-examples.py

echo "== no import cycle among the engine's modules (and the check's negative control)"
python3 tests/check-module-cycles.py
python3 tests/check-module-cycles.py --self-test

echo "== miri (unit tests of the unsafe-heavy index modules, tests/miri.sh)"
bash tests/miri.sh

echo "== seed 000's statements each name existing tests (docs/seed-000.md)"
python3 tests/check-seed-map.py
