#!/usr/bin/env python3
"""A/B of criterion benches: a base revision against the working tree, in one run.

Builds the chosen bench binaries at BASE (a git worktree under target/ab/) and in this
tree, then runs them alternately, ROUNDS times each (base, new, base, new, ...), so both
see the same machine noise; prints per bench the median over rounds of criterion's
median estimate, for base and new, and their ratio (new / base; < 1 is faster).

    python3 benches/ab.py BASE [--rounds 3] [--bench selection:'^select/64r/256t$' ...]

Each --bench is NAME[:REGEX] (a criterion bench target of kvr-benches and a filter);
the default set covers selection, index lookup and apply, and ingest. Criterion runs in
quick mode (--warm-up-time 1 --measurement-time 2). A long run: use it by hand and report
its output; CI does not run it.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = [
    "selection:^select/64r/256t$",
    "selection:^select_and_reserve_free/1thread/64r/256t$",
    "selection:^select_and_reserve_free/1thread/8r/8192t$",
    "index:^find_matches_single/by_sequence/128$",
    "index:^find_matches_shared8/from_local/128$",
    "index:^apply_single/store_steady$",
    "ingest:^ingest/decode_apply$",
]
UNITS = {"ps": 1e-3, "ns": 1.0, "µs": 1e3, "us": 1e3, "ms": 1e6, "s": 1e9}


def build(tree, target_dir, benches):
    """Builds the bench targets in `tree`; returns {bench: executable}."""
    cmd = ["cargo", "bench", "-p", "kvr-benches", "--no-run", "--message-format=json"]
    for b in benches:
        cmd += ["--bench", b]
    env = dict(os.environ, CARGO_TARGET_DIR=target_dir)
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"build failed in {tree}:\n{out.stderr[-3000:]}")
    exes = {}
    for line in out.stdout.splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue
        if m.get("reason") == "compiler-artifact" and m.get("executable"):
            name = m["target"]["name"]
            if name in benches:
                exes[name] = m["executable"]
    missing = set(benches) - set(exes)
    if missing:
        sys.exit(f"no executable for {sorted(missing)} in {tree}")
    return exes


def run(exe, regex):
    """Runs one bench binary; returns {bench id: median ns}."""
    cmd = [exe, "--bench", "--warm-up-time", "1", "--measurement-time", "2", "--noplot"]
    if regex:
        cmd.append(regex)
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"{exe} failed:\n{out.stderr[-2000:]}")
    res, last = {}, None
    time = re.compile(r"time:\s+\[(\S+) (\S+) (\S+) (\S+) (\S+) (\S+)\]")
    for line in out.stdout.splitlines():
        m = time.search(line)
        if not m:
            if line.strip() and not line.startswith(" "):
                last = line.strip()
            continue
        head = line[: m.start()].strip()
        name = head or last
        if name:
            res[name] = float(m.group(3)) * UNITS[m.group(4)]
    return res


def fmt(ns):
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3f} {unit}"
    return f"{ns:.1f} ns"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bench", action="append")
    args = ap.parse_args()
    specs = [(s.split(":", 1) + [""])[:2] for s in (args.bench or DEFAULT)]
    benches = sorted({b for b, _ in specs})
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    wt = os.path.join(ROOT, "target", "ab", rev)
    if not os.path.isdir(wt):
        subprocess.run(["git", "worktree", "add", "--detach", wt, rev], cwd=ROOT, check=True,
                       capture_output=True)
    head = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    print(f"building {rev} (base) and {head} (new) ...", flush=True)
    old = build(wt, os.path.join(ROOT, "target", "ab", "target-base"), benches)
    new = build(ROOT, os.path.join(ROOT, "target"), benches)
    results = {"base": {}, "new": {}}
    for r in range(args.rounds):
        for side, exes in (("base", old), ("new", new)):
            for bench, regex in specs:
                for k, v in run(exes[bench], regex).items():
                    results[side].setdefault(k, []).append(v)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\nA/B, {args.rounds} alternated rounds, criterion quick mode; base {rev}, new {head}")
    print(f"{'bench':55} {'base':>12} {'new':>12} {'new/base':>9}")
    for k in results["base"]:
        if k not in results["new"]:
            continue
        b = statistics.median(results["base"][k])
        n = statistics.median(results["new"][k])
        print(f"{k:55} {fmt(b):>12} {fmt(n):>12} {n / b:>8.3f}×")
        print(f"{'  runs':55} {', '.join(fmt(x) for x in results['base'][k])} | "
              f"{', '.join(fmt(x) for x in results['new'][k])}")


if __name__ == "__main__":
    main()
