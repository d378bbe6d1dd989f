#!/usr/bin/env python3
"""The suite's release builds share their libraries: a check on cargo's unit graph.

CI builds `kvr-cli` (the README's first command), then the workspace's tests, then the
Python wheel with maturin. Features unify per cargo call, so a test-only dependency that
turns on a feature of a shared crate (or a new dependency of the wheel) makes the next
call compile that crate, and everything above it, a second time: minutes of CI, with no
test failing. `cli/Cargo.toml` and `python/Cargo.toml` ask for those features themselves;
this check fails when they drift.

It asks cargo for each call's unit graph (nothing is built: `--unit-graph`, an unstable
flag, enabled here with RUSTC_BOOTSTRAP=1 on the toolchain in use), gives every unit an
identity made of its package, target, mode, features, profile and its dependencies'
identities (what cargo's own build hash covers), and requires:

- every unit of `cargo build -p kvr-cli --release` in the workspace test build;
- every unit of the wheel's build (`-p kvr-python --lib --features extension-module`) in
  it too, except PyO3's crates and the extension itself.

  python3 tests/check-build-sharing.py
"""
import hashlib
import json
import os
import subprocess
import sys

# The wheel's own crates: only its build needs them.
WHEEL_ONLY = {"kvr-python", "pyo3", "pyo3-ffi", "pyo3-build-config", "pyo3-macros",
              "pyo3-macros-backend", "pythonize", "indoc", "unindent", "memoffset",
              "target-lexicon"}

TEST_BUILD = ["test", "--workspace", "--exclude", "kvr", "--exclude", "kvr-python",
              "--release", "--locked", "--no-run"]
CLI_BUILD = ["build", "-p", "kvr-cli", "--release", "--locked"]
WHEEL_BUILD = ["build", "-p", "kvr-python", "--lib", "--features", "extension-module",
               "--release", "--locked"]


def unit_graph(args):
    env = dict(os.environ, RUSTC_BOOTSTRAP="1")
    out = subprocess.run(["cargo", *args, "--unit-graph", "-Zunstable-options"], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"check-build-sharing: cargo {' '.join(args)} --unit-graph failed:\n"
                 f"{out.stderr}")
    return json.loads(out.stdout)["units"]


def package(unit):
    """The package's name, from a pkg_id such as `...#name@1.2.3` or `path+file://...#0.4.0`."""
    tail = unit["pkg_id"].rsplit("#", 1)[-1]
    if "@" in tail:
        return tail.split("@", 1)[0]
    return unit["pkg_id"].rsplit("#", 1)[0].rstrip("/").rsplit("/", 1)[-1]


def identities(units):
    """Each unit's identity (a digest over what makes cargo build it again) and a label."""
    memo = {}

    def ident(i):
        if i in memo:
            return memo[i]
        u = units[i]
        deps = sorted(ident(d["index"]) for d in u["dependencies"])
        key = json.dumps([u["pkg_id"], u["target"]["kind"], u["target"]["name"], u["mode"],
                          sorted(u["features"]), u["profile"], u.get("platform"), deps],
                         sort_keys=True)
        memo[i] = hashlib.sha256(key.encode()).hexdigest()
        return memo[i]

    sys.setrecursionlimit(10000)
    return {ident(i): (package(u), u["target"]["name"], u["mode"], sorted(u["features"]))
            for i, u in enumerate(units)}


def missing(name, small, big, skip=frozenset()):
    lost = [label for key, label in small.items() if key not in big and label[0] not in skip]
    for label in sorted(lost):
        print(f"check-build-sharing: {name}: {label[0]} ({label[1]}, {label[2]}, "
              f"features {label[3]}) is not in the workspace test build", file=sys.stderr)
    return lost


def main():
    tests = identities(unit_graph(TEST_BUILD))
    cli = identities(unit_graph(CLI_BUILD))
    wheel = identities(unit_graph(WHEEL_BUILD))
    lost = missing("kvr-cli", cli, tests) + missing("the wheel", wheel, tests, WHEEL_ONLY)
    if lost:
        print("check-build-sharing: those crates would be compiled again for that build; "
              "ask for the test build's features in cli/Cargo.toml or python/Cargo.toml "
              "(see the comments there)", file=sys.stderr)
        return 1
    print(f"check-build-sharing: kvr-cli's {len(cli)} units and the wheel's "
          f"{sum(1 for v in wheel.values() if v[0] not in WHEEL_ONLY)} shared ones are all "
          f"in the workspace test build ({len(tests)} units)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
