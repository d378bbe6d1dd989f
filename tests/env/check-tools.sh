#!/usr/bin/env bash
# Checks, before anything is built, that every tool the suite (tests/run-all.sh) needs is
# on this machine, and says in one message what is missing and how to install it on
# Debian/Ubuntu. Exits 0 when all are there, 1 otherwise. .ci/run installs the Debian
# packages itself; a developer runs the apt-get line it prints.
#
#   bash tests/env/check-tools.sh            # check
#   bash tests/env/check-tools.sh --packages # print only the Debian packages missing
set -uo pipefail

missing=()   # "what: why"
packages=()  # Debian packages that provide the missing tools
need() {     # need CMD DEBIAN_PACKAGE WHY
    if ! command -v "$1" >/dev/null 2>&1; then
        missing+=("$1 ($3)")
        packages+=("$2")
    fi
}

need cargo "" "Rust via rustup, https://rustup.rs"
need gcc gcc "the C harness, tests/c"
need g++ g++ "the C++ harness, tests/cpp"
need nm binutils "the C++ harness's ABI symbol check"
need make make "make install, tests/install"
need pkg-config pkg-config "building against the installed libkvr, tests/install and ffi/go"
need cmake cmake "the CMake package test, tests/install"
need valgrind valgrind "the C and C++ harnesses under valgrind"
need go golang-go "the Go package, ffi/go (Go 1.19 or later)"
need python3 python3 "the e2e publisher, tests/compat, tests/python"
need curl curl "the README's service quick start, tests/check-readme-shell.py"
need readelf binutils "the static-link checks, tests/install and tests/check-readme-shell.py"
# Debian installs it in /usr/sbin, which a non-root PATH may lack.
if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
    missing+=("nats-server (the JetStream replica sync test, tests/replica/jetstream_peers.py)")
    packages+=(nats-server)
fi

if command -v go >/dev/null 2>&1; then
    v="$(go env GOVERSION 2>/dev/null | sed 's/^go//')"
    major="${v%%.*}" rest="${v#*.}" minor="${rest%%.*}"
    if [[ ! "$major" =~ ^[0-9]+$ || ! "$minor" =~ ^[0-9]+$ ]] || ((major < 1 || (major == 1 && minor < 19))); then
        missing+=("go >= 1.19 (found '${v:-unknown}')")
        packages+=(golang-go)
    fi
fi
if command -v python3 >/dev/null 2>&1; then
    # Debian splits venv's pip bootstrap into python3-venv: without it `python3 -m venv` fails.
    if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
        missing+=("python3 -m venv (the suite's Python packages go into a project venv)")
        packages+=(python3-venv)
    fi
fi

if [ "${1:-}" = --packages ]; then
    printf '%s\n' "${packages[@]}" | grep -v '^$' | sort -u | tr '\n' ' '
    echo
    exit 0
fi
if [ ${#missing[@]} -eq 0 ]; then
    echo "check-tools: all tools present (cargo, gcc, g++, nm, make, pkg-config, cmake, valgrind, go, python3 with venv, curl, readelf, nats-server)"
    exit 0
fi
{
    echo "check-tools: the suite needs tools this machine lacks:"
    printf '  - %s\n' "${missing[@]}"
    debs="$(printf '%s\n' "${packages[@]}" | grep -v '^$' | sort -u | tr '\n' ' ')"
    if [ -n "$debs" ]; then
        echo "  on Debian/Ubuntu: sudo apt-get install -y $debs"
    fi
} >&2
exit 1
