#!/usr/bin/env bash
# Builds libkvr (release), compiles the C++ wrapper tests (two translation units
# including include/kvr.hpp) and the README example with -Wall -Wextra -Werror, links
# them statically against libkvr.a, and runs them. Works from any directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"

CXX="${CXX:-g++}"
CXXFLAGS=(-std=c++17 -Wall -Wextra -Werror -O2 -pthread -I"$root/include")
LIBS=(-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc)
out="$root/target/cpp-tests"
mkdir -p "$out"

echo "== cargo build --release -p libkvr"
cargo build --release -p libkvr
lib="$root/target/release/libkvr.a"

echo "== header alone, stricter warnings"
printf '#include "kvr.hpp"\n' >"$out/header_only.cpp"
"$CXX" "${CXXFLAGS[@]}" -Wpedantic -Wshadow -Wconversion -Wsign-conversion -Wold-style-cast \
    -Wnon-virtual-dtor -Woverloaded-virtual -fsyntax-only "$out/header_only.cpp"

echo "== compile tests (main.cpp + workload.cpp) and example.cpp"
objs=()
for src in main workload; do
    "$CXX" "${CXXFLAGS[@]}" -c "$here/$src.cpp" -o "$out/$src.o"
    objs+=("$out/$src.o")
done
"$CXX" "${CXXFLAGS[@]}" "${objs[@]}" "$lib" "${LIBS[@]}" -o "$out/kvr_cpp_tests"
"$CXX" "${CXXFLAGS[@]}" "$here/example.cpp" "$lib" "${LIBS[@]}" -o "$out/kvr_cpp_example"

# The link-time ABI check must survive optimisation: the objects reference kvr_abi_1.
for o in "${objs[@]}"; do
    syms="$(nm "$o")"
    grep -q ' U kvr_abi_1$' <<<"$syms" || { echo "$o does not reference kvr_abi_1" >&2; exit 1; }
done

echo "== run example"
"$out/kvr_cpp_example"

echo "== run tests"
"$out/kvr_cpp_tests"
