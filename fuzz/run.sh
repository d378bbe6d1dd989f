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
  echo "== fuzz $target for ${secs}s (corpus $corpus)"
  if ! cargo +nightly fuzz run --fuzz-dir "$fuzz_dir" "$target" "${dirs[@]}" -- \
      -max_total_time="$secs" -print_final_stats=1 2>&1 | tee "$log"; then
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
