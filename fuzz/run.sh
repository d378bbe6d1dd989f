#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/fuzz_targets for ${KVR_FUZZ_SECONDS:-60} s each
# (or KVR_FUZZ_RUNS executions), without a sanitizer unless KVR_FUZZ_SANITIZER says one.
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
# Options (environment):
#   KVR_FUZZ_SECONDS   time per target (default 60); ignored when KVR_FUZZ_RUNS is set;
#   KVR_FUZZ_RUNS      executions per target instead (the closing notes' 10 M measurement);
#   KVR_FUZZ_SANITIZER none (default) or address, leak, memory, thread (cargo fuzz -s);
#   KVR_FUZZ_TARGETS   space-separated targets (default: all);
#   KVR_FUZZ_PROFILE   release (default) or dev: cargo fuzz --dev builds without
#                      optimisation, in half the time of the release build, and runs each
#                      input several times slower (.ci/run's smoke uses it: the build is
#                      most of a short run).
#
# Why no sanitizer by default: ASan costs these targets 10-25x their throughput (measured
# below), and what it adds is small here: the targets are single-threaded differential
# checks of mostly safe Rust, where the model catches wrong answers and Rust's bounds and
# overflow checks (cargo fuzz keeps debug assertions on) catch the rest; the engine's
# unsafe code (the lock-free index's epoch-retired tables) is also covered by Miri
# (tests/miri.sh) and loom. Run `KVR_FUZZ_SANITIZER=address bash fuzz/run.sh` for ASan.
#
# Throughput (one core of the 2-vCPU VM, the other busy with a build, 2026-12-02; each
# target 30 s from its seeds with the options below, stat::average_exec_per_sec):
#   target          ASan (60 s)   none
#   decode             15,649   195,977
#   event_sequence      1,121    20,103
#   ingest_frames         425     6,654
#   recovery              808     8,912
#   service_bodies      1,271    15,343
# ext_proc (added 2026-12-05, no sanitizer only, 300 s from its seeds on a shared core):
#   664,421 executions, 2,207 exec/s, cov 8,214, 0 crashes (its inputs run up to four
#   ext_proc streams of up to 16 messages through kvr epp's picker).
# With a reused engine the ASan build's callback was about a quarter of its time;
# libFuzzer's per-edge feature bookkeeping took most of the rest.
#
# 10 M executions each (KVR_FUZZ_RUNS=10000000 bash fuzz/run.sh, no sanitizer, one core,
# from the seeds, 2026-12-02; recovery and service_bodies while CI ran on the other core):
#   decode 81 s (123,456 exec/s), event_sequence 730 s (13,698), ingest_frames 1,444 s
#   (6,925), recovery 1,517 s (6,591), service_bodies 3,046 s (3,282; its rate fell from
#   16,881 to ~1,000 as its inputs grew towards 4 KB and its reused router to 1,129 MB
#   peak RSS: see README, issue 20); 0 crashes.
set -euo pipefail

fuzz_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$fuzz_dir")"
secs="${KVR_FUZZ_SECONDS:-60}"
runs="${KVR_FUZZ_RUNS:-}"
sanitizer="${KVR_FUZZ_SANITIZER:-none}"
profile="${KVR_FUZZ_PROFILE:-release}"
profile_args=()
case "$profile" in
  release) ;;
  dev) profile_args=(--dev) ;;
  *) echo "fuzz/run.sh: KVR_FUZZ_PROFILE must be release or dev" >&2; exit 2 ;;
esac
if [ -n "$runs" ]; then
  limit=(-runs="$runs")
  budget="$runs runs"
else
  limit=(-max_total_time="$secs")
  budget="${secs}s"
fi

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

cd "$root"
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
summary=()
shopt -s nullglob
targets=()
for src in "$fuzz_dir"/fuzz_targets/*.rs; do
  targets+=("$(basename "$src" .rs)")
done
if [ -n "${KVR_FUZZ_TARGETS:-}" ]; then
  read -r -a targets <<<"$KVR_FUZZ_TARGETS"
fi
for target in "${targets[@]}"; do
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
  echo "== fuzz $target for $budget, sanitizer $sanitizer, $profile build (corpus $corpus) ${opts[*]}"
  t0=$(date +%s)
  if ! cargo +nightly fuzz run "${profile_args[@]}" --fuzz-dir "$fuzz_dir" -s "$sanitizer" "$target" "${dirs[@]}" -- \
      "${limit[@]}" -print_final_stats=1 "${opts[@]}" 2>&1 | tee "$log"; then
    echo "FAIL: fuzz target $target crashed; the input is under $fuzz_dir/artifacts/$target/" >&2
    exit 1
  fi
  execs="$(grep -oE '^Done [0-9]+ runs' "$log" | tail -1 | grep -oE '[0-9]+' || true)"
  cov="$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+' || true)"
  ft="$(grep -oE 'ft: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+' || true)"
  rate="$(grep -oE 'average_exec_per_sec: *[0-9]+' "$log" | tail -1 | grep -oE '[0-9]+$' || true)"
  summary+=("$target: execs=${execs:-?} exec/s=${rate:-?} cov=${cov:-?} ft=${ft:-?} wall=$(( $(date +%s) - t0 ))s sanitizer=$sanitizer")
done

echo "== fuzz summary"
for line in "${summary[@]}"; do
  echo "$line"
done
