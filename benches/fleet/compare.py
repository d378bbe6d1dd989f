#!/usr/bin/env python3
"""Side by side of fleet-bench JSON runs of two builds: for each figure, the median over
runs of each run's value (its median round), the min-max over runs, and the ratio.

    python3 benches/fleet/compare.py A_LABEL 'a-*.json' B_LABEL 'b-*.json'
"""
import glob
import json
import statistics
import sys


def load(pattern):
    runs = [json.load(open(p)) for p in sorted(glob.glob(pattern))]
    if not runs:
        sys.exit(f"no file matches {pattern}")
    out = {}
    for r in runs:
        for f in r["figures"]:
            for q in ("p50", "p99"):
                if f[q] is not None:
                    out.setdefault((f["name"], q, f["unit"]), []).append(f[q]["median"])
    return out, len(runs)


def show(v, unit):
    if unit == "ns":
        if v >= 1e6:
            return f"{v / 1e6:.2f} ms"
        if v >= 1e3:
            return f"{v / 1e3:.2f} µs"
        return f"{v:.0f} ns"
    return f"{v:.1f} {unit}"


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    a_label, a_pat, b_label, b_pat = sys.argv[1:]
    a, na = load(a_pat)
    b, nb = load(b_pat)
    print(f"| figure | {a_label} ({na} runs) | {b_label} ({nb} runs) | {a_label} ÷ {b_label} |")
    print("|---|---|---|---|")
    for key in a:
        if key not in b:
            continue
        name, q, unit = key
        ma, mb = statistics.median(a[key]), statistics.median(b[key])
        cell = lambda m, v: f"{show(m, unit)} ({show(min(v), unit)}–{show(max(v), unit)})"
        ratio = f"{ma / mb:.2f}×" if mb else "–"
        what = q if (name, "p99", unit) in a else "value"
        print(f"| {name} {what} | {cell(ma, a[key])} | {cell(mb, b[key])} | {ratio} |")


if __name__ == "__main__":
    main()
