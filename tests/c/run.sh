#!/usr/bin/env bash
# The C harness of kvr's C ABI: builds libkvr, checks that tests/c/test_kvr.c and
# tests/c/test_state.c (the state directory) call every function include/kvr.h declares,
# compiles them strictly and links them statically, runs them natively and under valgrind
# (0 errors, 0 definitely lost), then does the same for the README example
# (tests/c/example.c).
#
# Works from any directory; builds into $CARGO_TARGET_DIR (default target/). Environment: CC (default gcc); KVR_C_TEST_SLOW=1 adds the
# rank-limit test to the native run (2^18 ranks: slow, see test_kvr.c); RUST_BACKTRACE is
# set to 0 unless KVR_C_RUST_BACKTRACE says otherwise (one known-issue check makes kvr
# catch a panic, which prints one line on stderr).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

CC="${CC:-gcc}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
mkdir -p "$TARGET"
TARGET="$(cd "$TARGET" && pwd)"
export CARGO_TARGET_DIR="$TARGET"
OUT="$TARGET/c-tests"
CFLAGS=(-std=c11 -Wall -Wextra -Werror -O1 -g -I include)
LIBS=("$TARGET/release/libkvr.a" -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc)
VALGRIND=(valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite)
export RUST_BACKTRACE="${KVR_C_RUST_BACKTRACE:-0}"
mkdir -p "$OUT"

section() { printf '\n== %s\n' "$*"; }

# Runs "$@" under valgrind with its log in a file; prints the log's summary lines; fails
# unless valgrind reports 0 errors and nothing definitely lost.
under_valgrind() {
    local log="$1"
    shift
    local rc=0
    "${VALGRIND[@]}" --log-file="$log" "$@" || rc=$?
    grep -E 'definitely lost|indirectly lost|possibly lost|still reachable|ERROR SUMMARY' "$log" |
        sed 's/^==[0-9]*== */  valgrind: /'
    if [ "$rc" -ne 0 ]; then
        echo "FAILED under valgrind (exit $rc); full log: $log"
        return 1
    fi
    if ! grep -qE 'ERROR SUMMARY: 0 errors' "$log"; then
        echo "FAILED: valgrind reported errors; full log: $log"
        return 1
    fi
    if grep -qE 'definitely lost: [1-9]' "$log"; then
        echo "FAILED: valgrind reports definite leaks; full log: $log"
        return 1
    fi
}

section "1/6 cargo build --release -p libkvr"
cargo build --release --locked -p libkvr
ls -l "$TARGET/release/libkvr.a" | awk '{print "  " $5 " bytes  " $NF}'

section "2/6 header coverage: every function in include/kvr.h is called by tests/c/test_kvr.c or test_state.c"
mapfile -t FUNCS < <(grep -oE '\bkvr_[a-z0-9_]+\(' include/kvr.h | tr -d '(' | sort -u | grep -vx 'kvr_status')
missing=0
for f in "${FUNCS[@]}"; do
    if ! grep -qE "(^|[^A-Za-z0-9_])$f\(" tests/c/test_kvr.c tests/c/test_state.c; then
        echo "  not called: $f"
        missing=$((missing + 1))
    fi
done
if [ "$missing" -ne 0 ] || [ "${#FUNCS[@]}" -eq 0 ]; then
    echo "FAILED: $missing of ${#FUNCS[@]} declared functions are not exercised"
    exit 1
fi
echo "  ${#FUNCS[@]} functions declared, all called"

section "3/6 compile tests/c/test_kvr.c ($CC ${CFLAGS[*]}, static libkvr.a)"
"$CC" "${CFLAGS[@]}" tests/c/test_kvr.c -o "$OUT/test_kvr" "${LIBS[@]}"
echo "  built $OUT/test_kvr"
"$CC" "${CFLAGS[@]}" tests/c/test_state.c -o "$OUT/test_state" "${LIBS[@]}"
echo "  built $OUT/test_state"

section "4/6 run test_kvr and test_state"
"$OUT/test_kvr"
"$OUT/test_state"

section "5/6 test_kvr and test_state under valgrind"
if ! command -v valgrind >/dev/null; then
    echo "FAILED: valgrind is not installed"
    exit 1
fi
KVR_C_TEST_SLOW=0 under_valgrind "$OUT/valgrind-test_kvr.log" "$OUT/test_kvr"
under_valgrind "$OUT/valgrind-test_state.log" "$OUT/test_state"

section "6/6 README example (tests/c/example.c): compile, run, valgrind"
"$CC" "${CFLAGS[@]}" tests/c/example.c -o "$OUT/example" "${LIBS[@]}"
"$OUT/example"
under_valgrind "$OUT/valgrind-example.log" "$OUT/example"

printf '\nC harness: OK\n'
