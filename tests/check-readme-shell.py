#!/usr/bin/env python3
"""Runs README.md's shell blocks as a newcomer would, with the minimum Rust version.

Every fenced block of README.md must name its language. Each block in sh, bash, shell or
console is either
  - run as written (RUN below, keyed by its first line), in order, each in a fresh
    `bash -e -o pipefail` from the repository's root, with HOME a new temporary directory
    (so `make install PREFIX=$HOME/.local`, `cargo install`, `~/kvr-hello`, the venv and
    the Go module all land there), RUSTUP_TOOLCHAIN the workspace's `rust-version`
    (installed with rustup if missing; see KVR_README_RUST below), Go with its defaults but no network
    (GOPROXY=off), and the checks its entry names afterwards (e.g. the static binary
    needs no libkvr.so); or
  - covered elsewhere (COVERED below): the named file must contain each of the block's
    lines as a line of its own (.ci/run runs the two opening commands).
A shell block in neither list fails the check, as does a block that fails, times out or
prints something other than what its entry expects.

  python3 tests/check-readme-shell.py            # run them all
  python3 tests/check-readme-shell.py --list     # say what each block is, run nothing
  python3 tests/check-readme-shell.py --readme FILE --keep

Builds go to $CARGO_TARGET_DIR/readme-rust-<msrv> (default target/), kept between runs.
With KVR_README_RUST=current the blocks run with the toolchain in use instead, and build
into $CARGO_TARGET_DIR itself: .ci/run does so after its own `cargo +<msrv> check` of every
crate, which keeps the minimum version checked and lets the README's release builds reuse
the suite's (the MSRV's own release build of the same crates took about 6 of CI's minutes).
Needs what the README's quick starts need: make, cc, c++, pkg-config, go, python3 with
venv, curl, and PyPI access (maturin). Run by tests/run-all.sh.
"""
import argparse
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile

root = pathlib.Path(__file__).resolve().parent.parent
SHELL_LANGS = {"sh", "bash", "shell", "console"}


def needed_libs(binary):
    """The NEEDED entries of a binary's dynamic section."""
    out = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\).*\[(.*)\]", out)


def c_binaries_link_as_claimed(home):
    hello = home / "kvr-hello"
    static, shared = needed_libs(hello / "c-static"), needed_libs(hello / "c-shared")
    if any(lib.startswith("libkvr") for lib in static):
        return f"kvr-hello/c-static needs {static}: it is not linked statically"
    if not any(lib.startswith("libkvr.so") for lib in shared):
        return f"kvr-hello/c-shared needs {shared}: no libkvr.so"
    return None


# First line of a block -> (what it is, seconds allowed, regex its output must match,
# a check run afterwards with the temporary HOME: returns an error text or None).
RUN = {
    "cargo install --locked --path cli": (
        "install: kvr, then make install into $HOME/.local", 1800, r"kvr serve|serve", None),
    "export PKG_CONFIG_PATH=$HOME/.local/lib/pkgconfig": (
        "C and C++ quick start: shared, static and C++ builds", 300,
        r"worker 7 rank 0: 32 tokens cached(.|\n)*worker 7 rank 0: 32 tokens cached(.|\n)*worker 1 rank 0",
        c_binaries_link_as_claimed),
    "kvr_src=$PWD": (
        "Go quick start, in a module outside the repository", 600,
        r"worker 7 rank 0: 32 tokens cached", None),
    "python3 -m venv ~/kvr-venv && . ~/kvr-venv/bin/activate": (
        "Python quick start: the wheel in a venv, the example", 1800,
        r"1 http://gpu-host:8000 0", None),
    "kvr serve --host 127.0.0.1 --port 8092 --state-dir ~/kvr-state &": (
        "service quick start: kvr serve on 127.0.0.1, register, select", 120,
        r'"selection_id"', None),
    "kvr serve --port 8092 --state-dir ~/kvr-state &": (
        "service quick start: restarted on its state directory, the worker is back", 120,
        r'"worker_id":1', None),
}

# First line of a block -> (the file that runs it, why it is not run here).
COVERED = {
    "cargo run --release -p kvr-cli -- replay": (
        ".ci/run", "the opening commands: CI runs both, and this check runs inside the second"),
    "kvr serve --port 8001 --replica-sync-port 7301 --replica-sync-peers tcp://10.0.0.2:7302 --replica-sync-host 0.0.0.0 --replica-ordinal 0 --replica-count 2": (
        "docs/replicas.md", "replicas need a second host or a NATS server; tests/replica runs both modes"),
    "cargo build --release -p kvr-cli && python3 tests/gateway/demo.py": (
        "tests/run-all.sh", "the gateway demo needs Envoy, which the suite's gateway step installs"),
}


def blocks(readme_text):
    """(language, body, line number) of every fenced block."""
    out, lines, i = [], readme_text.split("\n"), 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        lang, start, body = m.group(2).strip(), i + 1, []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            sys.exit(f"README line {start}: a fence that is never closed")
        out.append((lang, "\n".join(body) + "\n", start))
        i += 1
    return out


def msrv():
    m = re.search(r'^rust-version = "([0-9.]+)"', (root / "Cargo.toml").read_text(), re.M)
    if not m:
        sys.exit("check-readme-shell: no rust-version in Cargo.toml's [workspace.package]")
    return m.group(1)


def ensure_toolchain(version):
    listed = subprocess.run(["rustup", "toolchain", "list"], capture_output=True, text=True)
    if listed.returncode == 0 and re.search(rf"^{re.escape(version)}[-.]", listed.stdout, re.M):
        return
    print(f"check-readme-shell: installing Rust {version} (rustup, minimal profile)")
    if subprocess.run(["rustup", "toolchain", "install", version, "--profile", "minimal"]).returncode:
        sys.exit(f"check-readme-shell: FAILED: cannot install Rust {version}, the README's "
                 "minimum; install it (rustup toolchain install "
                 f"{version} --profile minimal) and run again")


def sandbox_env(home, version, target):
    """The blocks' environment; `version` None keeps the toolchain rustup picks now."""
    real_home = pathlib.Path(os.environ.get("HOME", str(pathlib.Path.home())))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARGO_", "RUSTUP_", "GO",
           "PKG_CONFIG", "PYTHON", "VIRTUAL_ENV", "PIP_", "LD_LIBRARY", "CGO_"))}
    # Build settings pass (.ci/run turns off release line tables and incremental builds):
    # with others than the suite's, every release build here would start again from nothing.
    env.update({k: v for k, v in os.environ.items()
                if k.startswith("CARGO_PROFILE_") or k == "CARGO_INCREMENTAL"})
    # The Python venvs the suite puts first on PATH are not a newcomer's python3.
    path = [p for p in os.environ.get("PATH", "").split(":")
            if p and not (pathlib.Path(p).parent / "pyvenv.cfg").exists()]
    cargo_home = os.environ.get("CARGO_HOME", str(real_home / ".cargo"))
    env.update(
        HOME=str(home),
        # rustup's toolchains and cargo's registry cache are the machine's; what the
        # README installs goes under the temporary HOME.
        RUSTUP_HOME=os.environ.get("RUSTUP_HOME", str(real_home / ".rustup")),
        CARGO_HOME=cargo_home,
        CARGO_INSTALL_ROOT=str(home / ".cargo"),
        CARGO_TARGET_DIR=str(target),
        CARGO_TERM_COLOR="never",
        # Go as a fresh machine has it (no GOFLAGS: -mod=mod would hide a missing
        # `go mod tidy`), but with no network: the quick start must not need it.
        GOPROXY="off",
        GOTOOLCHAIN="local",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_CACHE_DIR=str(real_home / ".cache" / "pip"),
        PATH=":".join([str(home / ".cargo" / "bin"), f"{cargo_home}/bin"] + path),
    )
    toolchain = version or os.environ.get("RUSTUP_TOOLCHAIN")
    if toolchain:
        env["RUSTUP_TOOLCHAIN"] = toolchain
    return env


def run_block(body, env, timeout):
    """Runs a block in its own process group; whatever it left running is killed after."""
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", body], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        status = f"timeout after {timeout} s"
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return status, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readme", default=str(root / "README.md"))
    ap.add_argument("--list", action="store_true", help="classify the blocks, run nothing")
    ap.add_argument("--keep", action="store_true", help="keep the temporary HOME")
    args = ap.parse_args()
    found = blocks(pathlib.Path(args.readme).read_text())
    problems, to_run = [], []
    for lang, body, line in found:
        if not lang:
            problems.append(f"README line {line}: a fenced block without a language")
            continue
        if lang not in SHELL_LANGS:
            continue
        first = body.split("\n", 1)[0].strip()
        if first in RUN:
            to_run.append((line, body, RUN[first]))
            print(f"README line {line}: run here: {RUN[first][0]}")
        elif first in COVERED:
            where, why = COVERED[first]
            text = (root / where).read_text().split("\n")
            missing = [ln.strip() for ln in body.split("\n")
                       if ln.strip() and ln.strip() not in (t.strip() for t in text)]
            if missing:
                problems.append(f"README line {line}: {where} does not run {missing}")
            else:
                print(f"README line {line}: run by {where} ({why})")
        else:
            problems.append(f"README line {line}: a {lang} block this check neither runs nor "
                            f"maps to a test (first line {first!r}): add it to RUN or COVERED")
    unused = set(RUN) - {b.split("\n", 1)[0].strip() for _, b, _ in found}
    for first in sorted(unused):
        problems.append(f"RUN names a block README.md no longer has: {first!r}")
    if problems:
        print("\n".join(f"check-readme-shell: {p}" for p in problems), file=sys.stderr)
        return 1
    if args.list:
        return 0

    target_root = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", root / "target")).resolve()
    choice = os.environ.get("KVR_README_RUST", "msrv")
    if choice == "msrv":
        version = msrv()
        ensure_toolchain(version)
        target = target_root / f"readme-rust-{version}"
    elif choice == "current":
        version, target = None, target_root
    else:
        sys.exit(f"check-readme-shell: KVR_README_RUST={choice!r}: expected msrv or current")
    home = pathlib.Path(tempfile.mkdtemp(prefix="kvr-readme-home."))
    env = sandbox_env(home, version, target)
    rust = subprocess.run(["rustc", "--version"], env=env, capture_output=True, text=True)
    print(f"check-readme-shell: {rust.stdout.strip() or 'rustc ?'}, HOME={home}, "
          f"CARGO_TARGET_DIR={target}")
    failed = 0
    try:
        for line, body, (what, timeout, expect, check) in to_run:
            print(f"\n== README line {line}: {what}", flush=True)
            status, out = run_block(body, env, timeout)
            error = None
            if status != 0:
                error = f"exit status {status}"
            elif expect and not re.search(expect, out):
                error = f"output does not match {expect!r}"
            elif check:
                error = check(home)
            tail = "\n".join(out.rstrip().split("\n")[-12:])
            print(tail)
            if error:
                print(f"check-readme-shell: FAILED: README line {line} ({what}): {error}\n"
                      f"--- the block ---\n{body}--- its output ---\n{out}", file=sys.stderr)
                failed += 1
                break  # later blocks build on this one
    finally:
        if args.keep:
            print(f"check-readme-shell: kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    if failed:
        return 1
    print(f"\ncheck-readme-shell: OK ({len(to_run)} blocks run with "
          f"{rust.stdout.strip() or 'rustc ?'}, "
          f"{len(COVERED)} covered by CI)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
