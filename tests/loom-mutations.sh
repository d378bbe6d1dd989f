#!/usr/bin/env bash
# The mutation list of engine/src/docs/mutations.rs, shown caught: builds the loom test
# binary, checks the list against the code (every fault flag of `sync::faults::Faults`
# and `session::SessionFaults` has a row, every `*_negative_*` loom test is listed, every
# listed test exists), then runs each listed negative control and prints a table: the
# flag, the control, and whether loom rejected the weakened model (CAUGHT) or not
# (MISSED). Exits 1 if anything is missed or the list has drifted.
#
# Usage: bash tests/loom-mutations.sh [FILTER]   (FILTER: only rows whose flag or test
# contains it), or bash tests/loom-mutations.sh --check: the list against the code only
# (the suite runs this; its loom run already runs every control). Environment: CARGO_TARGET_DIR (default target/; the loom build goes to
# its loom/ subdirectory, as in tests/run-all.sh), LOOM_MAX_PREEMPTIONS (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
filter="${1:-}"
check_only=0
if [ "$filter" = "--check" ]; then
    check_only=1
    filter=""
fi
target="${CARGO_TARGET_DIR:-target}/loom"
export RUSTFLAGS="--cfg loom --cfg crossbeam_loom"
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}"
unset KVR_LOOM_CHILD

doc=engine/src/docs/mutations.rs
echo "== building the loom models (target $target)"
bin="$(cargo test -p kvr --release --lib --locked --target-dir "$target" --no-run 2>&1 |
    sed -n 's/.*Executable unittests src\/lib.rs (\(.*\))$/\1/p' | tail -n1)"
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    echo "loom-mutations: could not build or find the loom test binary" >&2
    exit 1
fi

# The list's rows: "flag test".
rows="$(sed -n 's/^\/\/! | `\([a-z_]*\)` |.*| `\(loom_models::[a-z_:]*\)` |.*$/\1 \2/p' "$doc")"
if [ -z "$rows" ]; then
    echo "loom-mutations: no rows in $doc" >&2
    exit 1
fi

drift=0
# Every fault flag has a row.
flags="$(
    for f in engine/src/sync.rs engine/src/session/config.rs; do
        awk '/struct (Session)?Faults \{/{on=1; next} on && /^    \}/{on=0} on' "$f" |
            sed -n 's/^ *pub\(([a-z]*)\)\? \([a-z_]*\): bool,$/\2/p'
    done
)"
for flag in $flags; do
    if ! grep -q "^$flag " <<<"$rows"; then
        echo "DRIFT: fault flag $flag has no row in $doc" >&2
        drift=1
    fi
done
# Every negative control is listed, and every listed test exists.
tests="$("$bin" --list 2>/dev/null | sed -n 's/: test$//p')"
for t in $(grep '_negative_' <<<"$tests"); do
    if ! grep -q " $t\$" <<<"$rows"; then
        echo "DRIFT: negative control $t is not listed in $doc" >&2
        drift=1
    fi
done
while read -r flag t; do
    if ! grep -qx "$t" <<<"$tests"; then
        echo "DRIFT: $doc lists $t ($flag), which is not a loom test" >&2
        drift=1
    fi
done <<<"$rows"

if [ "$check_only" -eq 1 ]; then
    if [ "$drift" -ne 0 ]; then
        exit 1
    fi
    echo "loom-mutations: $(wc -l <<<"$rows") rows, $(wc -w <<<"$flags") fault flags, every negative control listed"
    exit 0
fi

printf '\n%-28s %-100s %-8s %s\n' "fault flag" "negative control (must be rejected by loom)" "result" "time"
missed=0
n=0
while read -r flag t; do
    if [ -n "$filter" ] && [[ "$flag $t" != *"$filter"* ]]; then
        continue
    fi
    n=$((n + 1))
    start=$(date +%s)
    if "$bin" "$t" --exact --test-threads=1 >/tmp/kvr-loom-mutation.$$ 2>&1; then
        result=CAUGHT
    else
        result=MISSED
        missed=$((missed + 1))
        sed 's/^/    /' /tmp/kvr-loom-mutation.$$ | tail -n 20 >&2
    fi
    printf '%-28s %-100s %-8s %ss\n' "$flag" "$t" "$result" "$(($(date +%s) - start))"
done <<<"$rows"
rm -f /tmp/kvr-loom-mutation.$$

echo
echo "$n negative controls run, $((n - missed)) caught, $missed missed; $(wc -w <<<"$flags") fault flags"
if [ "$drift" -ne 0 ] || [ "$missed" -ne 0 ]; then
    exit 1
fi
