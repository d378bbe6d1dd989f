"""The markdown table of a run.sh result directory: medians over the repetitions.

Reads DIR/meta.json and DIR/<service>-n<workers>-r<rep>.json (one kvr-service-load
output each). Every figure printed comes from those files.
"""

import glob
import json
import os
import re
import statistics
import sys


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, nd=0):
    if x is None:
        return "–"
    return f"{x:,.{nd}f}"


def ms(us):
    return "–" if us is None else f"{us / 1000:.2f}"


def summarise(runs):
    """Per-run figures, then the median of each over the runs."""
    per = []
    for r in runs:
        closed = [p for p in r["phases"] if p["kind"] == "closed"]
        best = max(closed, key=lambda p: p["ops_s"])
        opens = {round(p["offered_ops_s"]): p for p in r["phases"] if p["kind"] == "open"}
        per.append(
            {
                "ops_s": best["ops_s"],
                "req_s": best["requests_s"],
                "best_c": best["concurrency"],
                "hit": best["hit_rate"],
                "held": best["held_rate"],
                "server_cpu": best.get("server_cpu"),
                "others": best.get("server_core_others"),
                "loadgen_cpu": best.get("loadgen_cpu"),
                "open": opens,
                "rss": r.get("rss_kb"),
                "hwm": r.get("hwm_kb"),
                "errors": sum(p["errors"] for p in r["phases"]),
                "mismatch": sum(p["hash_mismatches"] for p in r["phases"]),
            }
        )
    rates = sorted({k for p in per for k in p["open"]})
    s = {k: med([p[k] for p in per]) for k in
         ("ops_s", "req_s", "hit", "held", "server_cpu", "others", "loadgen_cpu", "rss", "hwm")}
    s["ops_range"] = (min(p["ops_s"] for p in per), max(p["ops_s"] for p in per))
    s["best_c"] = sorted(p["best_c"] for p in per)
    s["errors"] = sum(p["errors"] for p in per)
    s["mismatch"] = sum(p["mismatch"] for p in per)
    s["open"] = {
        rate: {
            q: med([p["open"][rate][q] for p in per if rate in p["open"]])
            for q in ("select_p50_us", "select_p99_us", "chain_p50_us", "chain_p99_us", "ops_s",
                      "start_lag_p50_us", "start_lag_p99_us")
        }
        for rate in rates
    }
    s["late"] = sum(p["open"][r]["late_starts"] for p in per for r in p["open"])
    s["reps"] = len(per)
    return s


def main(d):
    meta = json.load(open(os.path.join(d, "meta.json")))
    if meta.get("mode") == "cpu":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import report_cpu

        sys.exit(report_cpu.main(d, meta))
    runs = {}
    for f in sorted(glob.glob(os.path.join(d, "*-n*-r*.json"))):
        m = re.match(r"(\w+)-n(\d+)-r(\d+)\.json$", os.path.basename(f))
        if m:
            runs.setdefault((m[1], int(m[2])), []).append(json.load(open(f)))
    services = meta["services"].split()
    workers = [int(n) for n in meta["workers"].split()]
    table = {k: summarise(v) for k, v in runs.items()}

    print(f"## Selection-service load: {' vs '.join(services)}\n")
    if meta["smoke"]:
        print("**Smoke run** (tiny, seconds): the figures below mean nothing.\n")
    print(
        f"- Machine: {meta['nproc']} cores ({meta['cpu_model']}). The server is pinned to core "
        f"{meta['server_cpu']} and the load generator to core {meta['loadgen_cpu']} "
        f"(`taskset`); each server runs alone in turn, a fresh process per run. "
        f"Other processes on the machine are not controlled."
    )
    print(
        f"- Dynamo: ai-dynamo-runtime {meta['dynamo_version']} `python -m dynamo.select_service` "
        f"(its defaults); kvr: `{meta['kvr_bin']} serve`."
    )
    print(
        f"- Each figure is the median of {meta['reps']} runs; per run: {meta['warmup']} s warm-up, "
        f"then {meta['duration']} s per phase; closed loop at C = {meta['conc']} "
        f"(saturation = the best C); open loop at the offered loads below."
    )
    if meta["fixed_rates"]:
        print("- Offered loads: as given (`--rates`).")
    else:
        base = "Dynamo's" if "dynamo" in services else "kvr's (Dynamo not run)"
        print(
            f"- Offered loads: {meta['fractions']} of {base} saturation throughput in a "
            f"calibration run, the same absolute rates for every service."
        )
    if meta["extra"]:
        print(f"- Load-generator flags: `{meta['extra']}`")
    print(
        "- One op = `POST /select_and_reserve` + `POST /reservations/{id}/prefill_complete` "
        "+ `DELETE /reservations/{id}`; latency is select_and_reserve's, from the intended "
        "send time (open loop). Hit = overlap.gpu / prompt tokens at saturation (held = "
        "what the chosen worker really held). Sat. ops/s: median (min–max over the runs). "
        "Server CPU: cores the server used at saturation (others: what other processes "
        "took on its core meanwhile; a server short of 1.0 with others > 0 was starved).\n"
    )

    for n in workers:
        rates = sorted({r for s in services if (s, n) in table for r in table[(s, n)]["open"]})
        head = ["service", "workers", "sat. ops/s", "sat. req/s", "best C"]
        head += [f"p50 / p99 ms @ {r} ops/s" for r in rates]
        head += ["hit (held)", "RSS MiB", "peak RSS MiB", "server CPU (others)", "errors"]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for s in services:
            t = table.get((s, n))
            if not t:
                continue
            lo, hi = t["ops_range"]
            sat = fmt(t["ops_s"]) + (f" ({fmt(lo)}–{fmt(hi)})" if t["reps"] > 1 else "")
            row = [s, str(n), sat, fmt(t["req_s"]), ",".join(map(str, t["best_c"]))]
            for r in rates:
                o = t["open"].get(r)
                row.append(f"{ms(o['select_p50_us'])} / {ms(o['select_p99_us'])}" if o else "–")
            row.append(f"{t['hit']:.3f} ({t['held']:.3f})")
            row.append(fmt(t["rss"] and t["rss"] / 1024, 1))
            row.append(fmt(t["hwm"] and t["hwm"] / 1024, 1))
            row.append(f"{fmt(t['server_cpu'], 2)} ({fmt(t['others'], 2)})")
            row.append(str(t["errors"]))
            print("| " + " | ".join(row) + " |")
        k, dy = table.get(("kvr", n)), table.get(("dynamo", n))
        if k and dy:
            def ratio(a, b):
                return "–" if not a or not b else f"{a / b:.2f}x"
            row = ["kvr/Dynamo", str(n), ratio(k["ops_s"], dy["ops_s"]), ratio(k["req_s"], dy["req_s"]), ""]
            for r in rates:
                a, b = k["open"].get(r), dy["open"].get(r)
                row.append(
                    f"{ratio(a['select_p50_us'], b['select_p50_us'])} / {ratio(a['select_p99_us'], b['select_p99_us'])}"
                    if a and b else "–"
                )
            row += ["", ratio(k["rss"], dy["rss"]), ratio(k["hwm"], dy["hwm"]), "", ""]
            print("| " + " | ".join(row) + " |")
        print()
        for s in services:
            t = table.get((s, n))
            if not t:
                continue
            notes = []
            if t["late"]:
                notes.append(f"{t['late']} open-loop ops started late (in-flight cap)")
            if t["mismatch"]:
                notes.append(f"{t['mismatch']} answers with sequence_hashes unlike ours")
            if t["loadgen_cpu"] is not None and t["loadgen_cpu"] > 0.9:
                notes.append(f"the load generator used {t['loadgen_cpu']:.2f} cores at saturation: "
                             "the throughput may be the generator's limit")
            lags = ", ".join(f"{ms(o['start_lag_p50_us'])} / {ms(o['start_lag_p99_us'])}"
                             for o in t["open"].values())
            if lags:
                notes.append(f"generator start lag p50 / p99 ms (inside the latencies): {lags}")
            for r, o in t["open"].items():
                if o["ops_s"] is not None and o["ops_s"] < 0.95 * r:
                    notes.append(f"at {r} ops/s only {o['ops_s']:.0f} ops/s completed (overloaded)")
            if notes:
                print(f"- {s}, {n} workers: " + "; ".join(notes))
        print()


if __name__ == "__main__":
    main(sys.argv[1])
