"""The per-op CPU table of a `run.sh --prompt-tokens` result directory.

Reads DIR/meta.json and DIR/cpu-<service>-<body>-t<tokens>-r<rep>.json (one
kvr-service-load output each, one closed-loop phase). Every figure printed comes from
those files: medians over the repetitions with their min–max.
"""

import glob
import json
import os
import re
import statistics


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs, nd=0):
    """`median (min–max)` of the values, or the value alone when there is one."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    m = statistics.median(xs)
    if len(xs) == 1:
        return f"{m:,.{nd}f}"
    return f"{m:,.{nd}f} ({min(xs):,.{nd}f}–{max(xs):,.{nd}f})"


def phase(run):
    """The run's closed-loop phase (the mode runs one concurrency; the best if several)."""
    closed = [p for p in run["phases"] if p["kind"] == "closed"]
    return max(closed, key=lambda p: p["ops_s"]) if closed else None


def load(d):
    runs = {}
    for f in sorted(glob.glob(os.path.join(d, "cpu-*-t*-r*.json"))):
        m = re.match(r"cpu-(\w+)-(\w+)-t(\d+)-r(\d+)\.json$", os.path.basename(f))
        if not m:
            continue
        p = phase(json.load(open(f)))
        if p is not None:
            runs.setdefault((int(m[3]), m[1], m[2]), {})[int(m[4])] = p
    return runs


# A server below this share of a core at saturation was not the bottleneck: the run's
# throughput is then someone else's limit (the generator's, or other processes').
SATURATED = 0.9


def main(d, meta):
    runs = load(d)
    print("## Server CPU per operation: " + " vs ".join(meta["services"].split()) + "\n")
    if meta["smoke"]:
        print("**Smoke run** (seconds): the figures below mean nothing.\n")
    print(
        f"- Machine: {meta['nproc']} cores ({meta['cpu_model']}); the server pinned to core "
        f"{meta['server_cpu']}, the load generator to core {meta['loadgen_cpu']}; a fresh "
        f"server per run; services (and kvr's body forms) alternate within each repetition."
    )
    print(
        f"- Dynamo: ai-dynamo-runtime {meta['dynamo_version']} `python -m dynamo.select_service` "
        f"(its defaults); kvr: `kvr serve` (its defaults)."
    )
    print(
        f"- {meta['workers']} workers with live KV events; every prompt exactly the given "
        f"length (shared system prompts and continued conversations); per run "
        f"{meta['warmup']} s warm-up, then {meta['duration']} s closed loop at C = {meta['conc']}; "
        f"{meta['reps']} repetitions, medians (min–max)."
    )
    print(
        "- One op = `POST /select_and_reserve` + `POST /reservations/{id}/prefill_complete` "
        "+ `DELETE /reservations/{id}`. CPU µs/op = the server's user + system CPU time "
        "over the phase (/proc/PID/stat, every thread, its KV-event intake included) ÷ "
        "the operations completed. Server cores: its CPU ÷ wall time; ops/s is the "
        f"server's throughput only where it used ≥ {SATURATED} of its core (else marked).\n"
    )
    sizes = sorted({k[0] for k in runs})
    head = ["prompt tokens", "service", "body", "server CPU µs/op", "ops/s",
            "server cores (others)", "generator cores", "hit (held)", "errors"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    verdicts = []
    for n in sizes:
        keys = sorted((k for k in runs if k[0] == n), key=lambda k: (k[1] != "dynamo", k[2]))
        for k in keys:
            ps = list(runs[k].values())
            cores = med([p.get("server_cpu") for p in ps])
            ops = spread([p["ops_s"] for p in ps])
            if cores is not None and cores < SATURATED:
                ops += " (server not saturated)"
            print("| " + " | ".join([
                f"{n:,}", k[1], k[2],
                spread([p.get("server_cpu_us_per_op") for p in ps]),
                ops,
                f"{cores:.2f} ({med([p.get('server_core_others') for p in ps]):.2f})"
                if cores is not None else "–",
                f"{med([p.get('loadgen_cpu') for p in ps]):.2f}"
                if med([p.get("loadgen_cpu") for p in ps]) is not None else "–",
                f"{med([p['hit_rate'] for p in ps]):.3f} ({med([p['held_rate'] for p in ps]):.3f})",
                str(sum(p["errors"] for p in ps)),
            ]) + " |")
        dy = runs.get((n, "dynamo", "json"))
        for k in keys:
            if k[1] != "kvr" or not dy:
                continue
            kv = runs[k]
            # Paired by repetition (the runs next to each other in time), and of the medians.
            paired = [dy[r]["server_cpu_us_per_op"] / kv[r]["server_cpu_us_per_op"]
                      for r in kv if r in dy and kv[r].get("server_cpu_us_per_op")
                      and dy[r].get("server_cpu_us_per_op")]
            a = med([p.get("server_cpu_us_per_op") for p in dy.values()])
            b = med([p.get("server_cpu_us_per_op") for p in kv.values()])
            if a and b:
                ratio = a / b
                print(f"| {n:,} | Dynamo ÷ kvr | {k[2]} | {ratio:.1f}x (per rep {spread(paired, 1)}) "
                      f"| | | | | |")
                verdicts.append((n, k[2], ratio))
    print()
    for n, body, ratio in verdicts:
        state = "met" if ratio >= 5 else "not met"
        print(f"- {n:,} tokens, kvr {body}: kvr uses 1/{ratio:.1f} of Dynamo's CPU per op "
              f"(goal ≤ 1/5: {state}).")
    missing = [(n, s) for n in sizes for s in meta["services"].split()
               if not any(k[0] == n and k[1] == s for k in runs)]
    for n, s in missing:
        print(f"- {n:,} tokens: no result from {s}.")
    errs = {}
    for k, rs in runs.items():
        for p in rs.values():
            for kind, c in p.get("error_kinds", {}).items():
                errs[(k, kind)] = errs.get((k, kind), 0) + c
    for (k, kind), c in sorted(errs.items()):
        print(f"- {k[0]:,} tokens, {k[1]} {k[2]}: {c} × {kind}")
    # A run that failed requests, or a service missing at a size, fails the run (CI).
    empty = [k for k, rs in runs.items() if any(p["ops"] == 0 for p in rs.values())]
    return 1 if errs or missing or empty else 0
