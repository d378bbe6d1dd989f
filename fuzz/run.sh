#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/fuzz_targets for ${KVR_FUZZ_SECONDS:-60} s each.
#
# Each target starts from a scratch corpus fuzz/corpus/<target> (gitignored) seeded from
# the committed fuzz/seeds/<target>; fuzz/regressions/<target> (kept crashers) is replayed
# as a read-only second corpus. A crash fails the script: libFuzzer writes the input to
# fuzz/artifacts/<target>/; fix it, then keep the input under fuzz/regressions/<target>/
# (`cargo test --manifest-path fuzz/Cargo.toml` replays every seed and regression of every
# target on stable; engine/tests/decode_regressions.rs also replays the decoder's).
# The targets' logic lives in fuzz/src/<target>.rs (crate kvr_fuzz).
#
# Needs rustup's nightly toolchain; installs cargo-fuzz if missing. Works from any cwd.
#
# Throughput (ASan, one core of the 2-vCPU VM shared with other builds, 2026-12-02; each
# target 60 s from its seeds with the options below: `cargo +nightly fuzz run --fuzz-dir
# fuzz <target> <corpus> fuzz/regressions/<target> -- -max_total_time=60
# -print_final_stats=1 <opts>`, stat::average_exec_per_sec), before (8df8b5f, 30 s runs,
# no opts) → after the per-shape engine reuse, the bounded inputs, the router built once:
#   decode 14,569 → 15,649 exec/s; event_sequence 57 → 1,121; ingest_frames 47 → 425;
#   service_bodies 211 → 1,271; recovery (new) 808.
# Below the 2,000 goal but decode: with a reused engine the callback is about a quarter
# of the time; libFuzzer's per-edge feature bookkeeping (CollectFeatures, AddRareFeature)
# takes most of the rest, as every input runs the engine, the model and the checks.
set -euo pipefail

fuzz_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$fuzz_dir")"
secs="${KVR_FUZZ_SECONDS:-60}"

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

cd "$root"
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
summary=()
shopt -s nullglob
for src in "$fuzz_dir"/fuzz_targets/*.rs; do
  target="$(basename "$src" .rs)"
  corpus="$fuzz_dir/corpus/$target"
  mkdir -p "$corpus"
  seeds=("$fuzz_dir/seeds/$target"/*)
  if [ ${#seeds[@]} -gt 0 ]; then
    cp -f "${seeds[@]}" "$corpus/"
  fi
  dirs=("$corpus")
  if [ -d "$fuzz_dir/regressions/$target" ]; then
    dirs+=("$fuzz_dir/regressions/$target")
  fi
  log="$logs/$target.log"
  opts=()
  case "$target" in
    # The differential targets keep one engine per shape across inputs (rebuilding it per
    # input cost more than most inputs): its epoch-deferred frees leave an input with one
    # malloc more than frees now and then, and libFuzzer answers each such input with a
    # full-heap leak scan (it gives up after 1,000 of them: "disabled leak detection after
    # every mutation"); off from the start here. Inputs are bounded: a few operations or
    # messages each (the seeds are longer; libFuzzer cuts what it mutates to max_len).
    event_sequence) opts=(-max_len=64 -detect_leaks=0) ;;
    ingest_frames | recovery) opts=(-max_len=128 -detect_leaks=0) ;;
  esac
  echo "== fuzz $target for ${secs}s (corpus $corpus) ${opts[*]}"
  if ! cargo +nightly fuzz run --fuzz-dir "$fuzz_dir" "$target" "${dirs[@]}" -- \
      -max_total_time="$secs" -print_final_stats=1 "${opts[@]}" 2>&1 | tee "$log"; then
    echo "FAIL: fuzz target $target crashed; the input is under $fuzz_dir/artifacts/$target/" >&2
    exit 1
  fi
  execs="$(grep -oE '^Done [0-9]+ runs' "$log" | tail -1 | grep -oE '[0-9]+' || true)"
  cov="$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+' || true)"
  ft="$(grep -oE 'ft: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+' || true)"
  summary+=("$target: execs=${execs:-?} cov=${cov:-?} ft=${ft:-?} time=${secs}s")
done

echo "== fuzz summary"
for line in "${summary[@]}"; do
  echo "$line"
done
