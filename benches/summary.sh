#!/usr/bin/env bash
# Runs kvr's benchmark suites and prints one markdown table of the results.
#
#   benches/summary.sh                 # full criterion defaults of the suites
#   KVR_BENCH_QUICK=1 benches/summary.sh   # --warm-up-time 1 --measurement-time 2 --noplot
#
# Environment:
#   KVR_BENCH_QUICK=1     short criterion runs (the whole thing takes a few minutes)
#   KVR_BENCH_FILTER=re   criterion filter passed to the hashing and index suites
#   KVR_LAT_CALLS=n       calls per variant of the latency harness (default 200000)
#   KVR_BENCH_SKIP_RUN=1  do not run anything; summarize the latest results on disk
#
# Sources: criterion's <target>/criterion/**/new/{benchmark,estimates}.json (median of
# the per-iteration time), and the latency harness (benches/benches/latency.rs: per-call
# p50/p99 with std::time::Instant, and bytes per holder-block), which writes
# <target>/kvr-bench/latency.json.
set -euo pipefail

cd "$(dirname "$0")/.."
start_epoch=$(date +%s)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
mkdir -p "$target_dir/kvr-bench"
lat_json="$target_dir/kvr-bench/latency.json"
lat_txt="$target_dir/kvr-bench/latency.txt"
stamp="$target_dir/kvr-bench/run-start"

crit_args=()
if [[ "${KVR_BENCH_QUICK:-0}" == 1 ]]; then
  crit_args+=(--warm-up-time 1 --measurement-time 2 --noplot)
fi
filter=()
if [[ -n "${KVR_BENCH_FILTER:-}" ]]; then
  filter+=("$KVR_BENCH_FILTER")
fi

if [[ "${KVR_BENCH_SKIP_RUN:-0}" != 1 ]]; then
  touch "$stamp"
  rm -f "$lat_json"
  cargo bench -p kvr-benches --no-run >&2
  echo "== hashing" >&2
  cargo bench -p kvr-benches --bench hashing -- "${crit_args[@]}" "${filter[@]}" >&2
  echo "== index" >&2
  cargo bench -p kvr-benches --bench index -- "${crit_args[@]}" "${filter[@]}" >&2
  echo "== latency" >&2
  KVR_LATENCY_JSON="$lat_json" cargo bench -p kvr-benches --bench latency | tee "$lat_txt" >&2
fi
[[ -f "$stamp" ]] || touch -d @0 "$stamp"

load_after=$(cut -d' ' -f1-3 /proc/loadavg)
elapsed=$(($(date +%s) - start_epoch))

export KVR_TARGET_DIR="$target_dir" KVR_LAT_JSON="$lat_json" KVR_STAMP="$stamp"
export KVR_LOAD_BEFORE="$load_before" KVR_LOAD_AFTER="$load_after" KVR_ELAPSED="$elapsed"
export KVR_QUICK="${KVR_BENCH_QUICK:-0}"
python3 - <<'PY'
import glob, json, os, platform, re, subprocess

target = os.environ["KVR_TARGET_DIR"]
stamp = os.path.getmtime(os.environ["KVR_STAMP"])

def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "?"

cpu = "?"
try:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
except OSError:
    pass

# --- criterion results (only those written by this run) ---
crit = {}
for bj in glob.glob(os.path.join(target, "criterion", "**", "new", "benchmark.json"), recursive=True):
    if os.path.getmtime(bj) < stamp:
        continue
    d = os.path.dirname(bj)
    try:
        b = json.load(open(bj))
        e = json.load(open(os.path.join(d, "estimates.json")))
    except (OSError, ValueError):
        continue
    crit[b["full_id"]] = (e["median"]["point_estimate"], b.get("throughput"))

# --- latency harness ---
lat, mem = {}, {}
try:
    for r in json.load(open(os.environ["KVR_LAT_JSON"]))["results"]:
        if r["name"].startswith("memory/"):
            mem[r["name"][len("memory/"):]] = r
        else:
            lat[r["name"]] = r
except (OSError, ValueError, KeyError):
    pass

def fmt_ns(ns):
    if ns is None:
        return ""
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.3f} µs"
    return f"{ns:.1f} ns"

def unit_of(name):
    if name.startswith("hashing/hash_tokens"):
        return "tokens/s"
    if name.startswith("hashing/sequence_chain"):
        return "blocks/s"
    if name.startswith("find_matches"):
        return "queries/s"
    if name.endswith("store_remove_pair"):
        return "block events/s"
    return "blocks/s"

def fmt_rate(x, unit):
    for div, p in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.2f} {p}{unit}"
    return f"{x:.1f} {unit}"

rows = []
def row(name, median="", p50="", p99="", thr="", target=""):
    rows.append((name, median, p50, p99, thr, target))

def order(name):
    for i, p in enumerate(("hashing/", "find_matches_single", "find_matches_shared8",
                           "apply_single", "apply_shared8")):
        if name.startswith(p):
            break
    else:
        i = 9
    # numeric parts sort as numbers: .../32 before .../128
    return (i, [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)])

for name in sorted(crit, key=order):
    med, thr = crit[name]
    rate = ""
    per_s = None
    if thr and "Elements" in thr:
        per_s = thr["Elements"] / (med * 1e-9)
        rate = fmt_rate(per_s, unit_of(name))
    elif thr and "Bytes" in thr:
        rate = fmt_rate(thr["Bytes"] / (med * 1e-9), "B/s")
    p50 = p99 = target = ""
    if name in lat:
        p50, p99 = fmt_ns(lat[name]["p50_ns"]), fmt_ns(lat[name]["p99_ns"])
        if name.endswith("/128"):
            ok = lat[name]["p50_ns"] <= 1000
            target = f"p50 ≤ 1 µs: {'met' if ok else 'MISSED'} ({lat[name]['p50_ns'] / 1000:.2f}× target)"
    if name.startswith("apply_") and "store_" in name and not name.endswith("pair") and per_s:
        ok = per_s >= 5e6
        target = f"≥ 5 M blocks/s: {'met' if ok else 'MISSED'} ({per_s / 5e6:.2f}× target)"
    row(f"`{name}`", fmt_ns(med), p50, p99, rate, target)

# per-call rows the criterion run did not cover (e.g. a filtered run)
for name, r in lat.items():
    if name == "timer_overhead":
        row("timer overhead (`Instant::now` + `elapsed`, per call)", "", fmt_ns(r["p50_ns"]), fmt_ns(r["p99_ns"]))
    elif name not in crit:
        row(f"`{name}` (per-call only)", "", fmt_ns(r["p50_ns"]), fmt_ns(r["p99_ns"]))

for shape, m in mem.items():
    hb = m["holder_blocks"]
    bph = m["bytes_per_holder_block"]
    parts = (f"{bph:.2f} B = table {m['table_bytes'] / hb:.2f} + holder sets "
             f"{m['holder_set_bytes'] / hb:.2f} + rank maps {m['rank_map_bytes'] / hb:.2f}")
    if m.get("rss_growth_bytes") is not None:
        parts += f"; RSS growth {m['rss_growth_bytes'] / hb:.2f} B"
    ok = bph <= 32
    row(f"bytes/holder-block `{shape}` ({hb:,} holder-blocks, {m['nodes']:,} nodes)",
        parts, "", "", "", f"≤ 32 B: {'met' if ok else 'MISSED'} ({bph / 32:.2f}× target)")

rustc = sh("rustc", "--version")
commit = sh("git", "rev-parse", "--short", "HEAD")
dirty = sh("git", "status", "--porcelain", "--untracked-files=no")
mode = "quick (--warm-up-time 1 --measurement-time 2)" if os.environ["KVR_QUICK"] == "1" else "suite defaults"
print(f"## kvr benchmarks — {sh('date', '-u', '+%Y-%m-%d %H:%M UTC')}")
print()
print(f"- machine: {os.cpu_count()} CPUs (nproc {sh('nproc')}), {cpu}, {platform.system()} {platform.release()}")
print(f"- {rustc}; commit {commit}{' + uncommitted changes' if dirty not in ('', '?') else ''}; criterion mode: {mode}")
print(f"- load average (1/5/15 min) before: {os.environ['KVR_LOAD_BEFORE']}, after: {os.environ['KVR_LOAD_AFTER']}; run took {os.environ['KVR_ELAPSED']} s")
print("- one thread; median = criterion median per iteration; p50/p99 = per-call `Instant` timings of the latency harness (timer overhead "
      + (f"p50 {fmt_ns(lat['timer_overhead']['p50_ns'])}" if "timer_overhead" in lat else "n/a") + ", not subtracted)")
print()
print("| bench | median | p50 (per call) | p99 (per call) | throughput | target |")
print("|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(r) + " |")
PY
