#!/usr/bin/env bash
# The whole test suite: every crate's unit, integration and differential tests (release
# build: the churn test applies 5 M events; the header test checks include/kvr.h), the
# loom models of the atomic protocols with their negative controls, then the host
# harnesses over libkvr: C (also under valgrind), C++ (multi-threaded) and Go (vet, race,
# cgocheck=2, kvrdebug), and the README's host examples.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo test --workspace --release"
cargo test --workspace --release

echo "== loom models (LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-3})"
RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}" \
    cargo test -p kvr --release --lib --target-dir target/loom loom_models

echo "== C host (tests/c)"
bash tests/c/run.sh

echo "== C++ host (tests/cpp)"
bash tests/cpp/run.sh

echo "== Go package (ffi/go)"
bash ffi/go/run.sh

echo "== README host examples"
python3 tests/check-readme-examples.py
