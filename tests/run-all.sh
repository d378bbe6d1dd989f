#!/usr/bin/env bash
# The whole test suite: every crate's unit, integration and differential tests (release
# build: the churn test applies 5 M events), then the loom models of the index's atomic
# protocols with their negative controls.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo test --workspace --release"
cargo test --workspace --release

echo "== loom models (LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-3})"
RUSTFLAGS="--cfg loom --cfg crossbeam_loom" LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}" \
    cargo test -p kvr --release --lib --target-dir target/loom loom_models
