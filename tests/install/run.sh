#!/usr/bin/env bash
# The install paths, as a user outside the repository meets them:
#  1. `make install PREFIX=<temp>`: the layout (bin/kvr, include/, lib/libkvr.a,
#     lib/libkvr.so.ABI with SONAME libkvr.so.ABI and the libkvr.so link, kvr.pc, the CMake
#     package), the static library's size before and after stripping; `cargo install
#     --path cli` gives a working `kvr`.
#  2. The prefix is moved (kvr.pc and kvrConfig.cmake are relocatable), then, in a temp
#     directory outside the repository, the README's C and C++ examples are built and run
#     against the installed tree: with pkg-config (kvr: shared; kvr-static: libkvr.a) and
#     with CMake (find_package(kvr VERSION CONFIG): kvr::kvr_static, kvr::kvr).
#  3. The Go example, in a temp module outside the repository, builds through
#     `#cgo pkg-config: kvr` against the installed libkvr.so and runs. Nothing is
#     published, so its go.mod replaces the module with a copy of ffi/go/kvr made outside
#     the repository (what `go mod vendor` or the module proxy would hand a user).
# Negative controls: pkg-config refuses `kvr >= 99`, find_package(kvr 99.0) fails, and the
# Go build fails without kvr.pc on PKG_CONFIG_PATH.
# Builds into $CARGO_TARGET_DIR (default target/); works from any directory.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
target="${CARGO_TARGET_DIR:-$root/target}"
mkdir -p "$target"
target="$(cd "$target" && pwd)"
export CARGO_TARGET_DIR="$target"
work="$(mktemp -d /tmp/kvr-install-test.XXXXXX)"
trap 'rm -rf "$work"' EXIT
step() { printf '\n== install: %s\n' "$*"; }
fail() { echo "tests/install: FAILED: $*" >&2; exit 1; }

version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
abi="$(sed -n 's/^#define KVR_ABI_VERSION \([0-9][0-9]*\)$/\1/p' include/kvr.h)"
[ -n "$version" ] && [ -n "$abi" ] || fail "cannot read the version ($version) or the ABI ($abi)"

step "make install PREFIX=$work/prefix (kvr $version, C ABI $abi)"
make -s install PREFIX="$work/prefix" CARGO_TARGET_DIR="$target"
prefix="$work/prefix"
for f in bin/kvr include/kvr.h include/kvr.hpp lib/libkvr.a "lib/libkvr.so.$abi" lib/libkvr.so \
    lib/pkgconfig/kvr.pc lib/pkgconfig/kvr-static.pc lib/cmake/kvr/kvrConfig.cmake lib/cmake/kvr/kvrConfigVersion.cmake \
    share/doc/kvr/LICENSE share/doc/kvr/README.md; do
    [ -e "$prefix/$f" ] || fail "missing $f"
done
[ "$(readlink "$prefix/lib/libkvr.so")" = "libkvr.so.$abi" ] || fail "lib/libkvr.so does not link to libkvr.so.$abi"
soname="$(readelf -d "$prefix/lib/libkvr.so.$abi" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')"
[ "$soname" = "libkvr.so.$abi" ] || fail "SONAME is '$soname', not libkvr.so.$abi"
echo "  SONAME $soname"
built=$(stat -c %s "$target/release/libkvr.a") installed=$(stat -c %s "$prefix/lib/libkvr.a")
echo "  libkvr.a: $built bytes built (release, line tables), $installed installed (stripped)"
[ "$installed" -lt "$built" ] || fail "the installed libkvr.a is not smaller than the built one"
"$prefix/bin/kvr" --version

step "cargo install --path cli"
cargo install -q --locked --path cli --root "$work/cargo-root"
"$work/cargo-root/bin/kvr" --version

step "the prefix moved to $work/moved (relocatable kvr.pc and CMake package)"
mv "$prefix" "$work/moved"
prefix="$work/moved"
user="$work/user"
mkdir -p "$user"
cp tests/c/example.c tests/cpp/example.cpp tests/install/CMakeLists.txt "$user/"
cd "$user"
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
unset PKG_CONFIG_LIBDIR LD_LIBRARY_PATH CPATH LIBRARY_PATH
# The shared library a binary loads, resolved (it must be the installed one).
loads() { ldd "$1" | awk '$1 ~ /^libkvr\.so/ {print $3}'; }
[ "$(pkg-config --modversion kvr)" = "$version" ] || fail "pkg-config --modversion kvr is not $version"
if pkg-config --exists 'kvr >= 99'; then fail "negative control: pkg-config accepted kvr >= 99"; fi
echo "  pkg-config kvr $version: $(pkg-config --cflags --libs kvr)"

step "C and C++ examples with pkg-config (shared), from $user"
gcc -std=c11 -Wall -Wextra -Werror example.c $(pkg-config --cflags --libs kvr) \
    -Wl,-rpath,"$prefix/lib" -o example_c_shared
g++ -std=c++17 -Wall -Wextra -Werror example.cpp $(pkg-config --cflags --libs kvr) \
    -Wl,-rpath,"$prefix/lib" -o example_cpp_shared
for exe in example_c_shared example_cpp_shared; do
    [ "$(realpath "$(loads ./$exe)")" = "$(realpath "$prefix/lib/libkvr.so.$abi")" ] ||
        fail "$exe loads '$(loads ./$exe)', not the installed libkvr.so.$abi"
    ./$exe
done

step "C example with pkg-config's kvr-static module (libkvr.a)"
# needs: the dynamic section's NEEDED entries of a binary.
needs() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
[ "$(pkg-config --modversion kvr-static)" = "$version" ] || fail "pkg-config --modversion kvr-static is not $version"
gcc -std=c11 -Wall -Wextra -Werror example.c $(pkg-config --cflags --libs kvr-static) -o example_c_static
if needs ./example_c_static | grep -q libkvr; then fail "example_c_static needs $(needs ./example_c_static | grep libkvr)"; fi
[ -z "$(loads ./example_c_static)" ] || fail "example_c_static loads libkvr.so"
./example_c_static
# Why kvr-static exists: `--static` adds kvr.pc's private libraries, but its -lkvr still
# resolves to libkvr.so when both are installed.
gcc -std=c11 example.c $(pkg-config --cflags --static --libs kvr) -o example_c_kvr_static_flag
needs ./example_c_kvr_static_flag | grep -q "libkvr.so.$abi" ||
    fail "control: pkg-config --static --libs kvr no longer links libkvr.so (kvr-static may be unnecessary)"
echo "  control: pkg-config --static --libs kvr still links libkvr.so.$abi; kvr-static links libkvr.a"

step "CMake: find_package(kvr $version CONFIG), C static and C++ shared"
cmake -S . -B build -DCMAKE_PREFIX_PATH="$prefix" -DKVR_WANT_VERSION="$version" >build.log ||
    { cat build.log; fail "cmake configure"; }
grep 'kvr .* from' build.log | sed 's/^-- /  /'
cmake --build build >>build.log 2>&1 || { cat build.log; fail "cmake build"; }
[ -z "$(loads build/example_c)" ] || fail "build/example_c (kvr::kvr_static) loads libkvr.so"
[ "$(realpath "$(loads build/example_cpp)")" = "$(realpath "$prefix/lib/libkvr.so.$abi")" ] ||
    fail "build/example_cpp (kvr::kvr) does not load the installed libkvr.so.$abi"
build/example_c
build/example_cpp
if cmake -S . -B build-neg -DCMAKE_PREFIX_PATH="$prefix" -DKVR_WANT_VERSION=99.0 >neg.log 2>&1; then
    fail "negative control: find_package(kvr 99.0) succeeded"
fi
echo "  negative control: find_package(kvr 99.0) refused"

step "Go example in a module outside the repository (#cgo pkg-config: kvr)"
if ! command -v go >/dev/null 2>&1; then fail "go is not installed (tests/env/check-tools.sh)"; fi
gopkg="$work/gopkg/kvr"
mkdir -p "$(dirname "$gopkg")"
cp -r "$root/ffi/go/kvr" "$gopkg"
gouser="$work/gouser"
mkdir -p "$gouser"
cp "$root/ffi/go/kvr/example/main.go" "$gouser/main.go"
sed -e "s|@VERSION@|$version|" -e "s|@GOPKG@|$gopkg|" "$root/tests/install/go.mod.in" >"$gouser/go.mod"
cd "$gouser"
export GOPATH="$work/gopath" GOCACHE="$target/go/cache" GOFLAGS=-mod=mod GOPROXY=off \
    GOTOOLCHAIN=local GO111MODULE=on CGO_ENABLED=1
if PKG_CONFIG_PATH="$work/nowhere" go build -o kvruser-neg . >neg.log 2>&1; then
    fail "negative control: the Go build succeeded without kvr.pc on PKG_CONFIG_PATH"
fi
grep -q 'kvr' neg.log || { cat neg.log; fail "negative control: an unexpected Go build failure"; }
echo "  negative control: without kvr.pc the Go build fails ($(grep -m1 -o 'Package kvr was not found[^.]*' neg.log || head -n1 neg.log))"
CGO_LDFLAGS="-Wl,-rpath,$prefix/lib" go build -o kvruser .
[ "$(realpath "$(loads ./kvruser)")" = "$(realpath "$prefix/lib/libkvr.so.$abi")" ] ||
    fail "the Go example does not load the installed libkvr.so.$abi"
./kvruser >go.out
head -n 3 go.out | sed 's/^/  /'

printf '\ntests/install: OK (make install, cargo install, pkg-config, CMake, Go: all against the installed tree)\n'
