#!/usr/bin/env bash
# Builds libkvr (release), compiles the C++ wrapper tests (four translation units
# including include/kvr.hpp) and the README example with -Wall -Wextra -Werror, links
# them statically against libkvr.a, and runs them, then runs the tests again under valgrind
# (0 errors, nothing definitely lost; skipped if valgrind is missing or KVR_CPP_VALGRIND=0).
# Works from any directory; builds into $CARGO_TARGET_DIR (default target/).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"

CXX="${CXX:-g++}"
CXXFLAGS=(-std=c++17 -Wall -Wextra -Werror -O2 -pthread -I"$root/include")
LIBS=(-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc)
target="${CARGO_TARGET_DIR:-$root/target}"
mkdir -p "$target"
target="$(cd "$target" && pwd)"
export CARGO_TARGET_DIR="$target"
out="$target/cpp-tests"
mkdir -p "$out"

echo "== cargo build --release -p libkvr"
cargo build --release --locked -p libkvr
lib="$target/release/libkvr.a"

echo "== header alone, stricter warnings"
printf '#include "kvr.hpp"\n' >"$out/header_only.cpp"
"$CXX" "${CXXFLAGS[@]}" -Wpedantic -Wshadow -Wconversion -Wsign-conversion -Wold-style-cast \
    -Wnon-virtual-dtor -Woverloaded-virtual -fsyntax-only "$out/header_only.cpp"

echo "== compile tests (main.cpp + routing.cpp + ingress.cpp + workload.cpp) and example.cpp"
objs=()
for src in main routing ingress workload; do
    "$CXX" "${CXXFLAGS[@]}" -c "$here/$src.cpp" -o "$out/$src.o"
    objs+=("$out/$src.o")
done
"$CXX" "${CXXFLAGS[@]}" "${objs[@]}" "$lib" "${LIBS[@]}" -o "$out/kvr_cpp_tests"
"$CXX" "${CXXFLAGS[@]}" "$here/example.cpp" "$lib" "${LIBS[@]}" -o "$out/kvr_cpp_example"

# The link-time ABI check must survive optimisation: the objects reference kvr_abi_2.
for o in "${objs[@]}"; do
    syms="$(nm "$o")"
    grep -q ' U kvr_abi_2$' <<<"$syms" || { echo "$o does not reference kvr_abi_2" >&2; exit 1; }
done

echo "== run example"
"$out/kvr_cpp_example"

echo "== run tests"
"$out/kvr_cpp_tests"

if [ "${KVR_CPP_VALGRIND:-1}" = 0 ]; then
    echo "== valgrind: skipped (KVR_CPP_VALGRIND=0)"
elif ! command -v valgrind >/dev/null; then
    echo "== valgrind: skipped (not installed)"
else
    echo "== run tests under valgrind"
    log="$out/valgrind.log"
    rc=0
    # --fair-sched: valgrind runs one thread at a time, and without a fair lock the event
    # thread of the threaded workload kept it for most of the run (about 300 s; 40 s fair).
    valgrind --fair-sched=yes --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite \
        --log-file="$log" "$out/kvr_cpp_tests" >"$out/valgrind.out" 2>&1 || rc=$?
    tail -n 1 "$out/valgrind.out"
    grep -E 'definitely lost|indirectly lost|possibly lost|ERROR SUMMARY' "$log" | sed 's/^==[0-9]*== */  valgrind: /'
    if [ "$rc" -ne 0 ] || ! grep -q 'ERROR SUMMARY: 0 errors' "$log" || grep -qE 'definitely lost: [1-9]' "$log"; then
        echo "FAILED under valgrind (exit $rc); output: $out/valgrind.out, log: $log" >&2
        exit 1
    fi
fi
