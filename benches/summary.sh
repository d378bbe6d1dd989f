#!/usr/bin/env bash
# Runs kvr's benchmark suites and prints one markdown table of the results.
#
#   benches/summary.sh                 # full criterion defaults of the suites
#   KVR_BENCH_QUICK=1 benches/summary.sh   # --warm-up-time 1 --measurement-time 2 --noplot
#
# Environment:
#   KVR_BENCH_QUICK=1     short criterion runs (the whole thing takes a few minutes)
#   KVR_BENCH_FILTER=re   criterion filter passed to the hashing, index and selection suites
#   KVR_LAT_CALLS=n       calls per variant of the latency harness (default 200000)
#   KVR_SEL_CALLS=n       calls of the selection harness's target case (default 100000)
#   KVR_BENCH_SKIP_RUN=1  do not run anything; summarize the latest results on disk
#   KVR_BENCH_SUITES="…"  suites to run (default: hashing index latency selection ffi ingest)
#
# Sources: criterion's <target>/criterion/**/new/{benchmark,estimates}.json (median of
# the per-iteration time), and the latency harness (benches/benches/latency.rs: per-call
# p50/p99 with std::time::Instant, and bytes per holder-block), which writes
# <target>/kvr-bench/latency.json, and the selection suite's own timing harness
# (benches/benches/selection.rs: per-call p50/p99 of select_and_reserve, free and select,
# and one- against two-thread throughput), which writes <target>/kvr-bench/selection.json,
# and the C ABI overhead harness (benches/benches/ffi_overhead.rs: paired rounds of
# kvr_partition_select against Engine::select_in), which writes <target>/kvr-bench/ffi.json.
set -euo pipefail

cd "$(dirname "$0")/.."
start_epoch=$(date +%s)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
mkdir -p "$target_dir/kvr-bench"
lat_json="$target_dir/kvr-bench/latency.json"
lat_txt="$target_dir/kvr-bench/latency.txt"
sel_json="$target_dir/kvr-bench/selection.json"
ffi_json="$target_dir/kvr-bench/ffi.json"
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
  rm -f "$lat_json" "$sel_json" "$ffi_json"
  cargo bench -p kvr-benches --no-run >&2
  suites=" ${KVR_BENCH_SUITES:-hashing index latency selection ffi ingest} "
  suites=${suites//,/ }
  if [[ "$suites" == *" hashing "* ]]; then
    echo "== hashing" >&2
    cargo bench -p kvr-benches --bench hashing -- "${crit_args[@]}" "${filter[@]}" >&2
  fi
  if [[ "$suites" == *" index "* ]]; then
    echo "== index" >&2
    cargo bench -p kvr-benches --bench index -- "${crit_args[@]}" "${filter[@]}" >&2
  fi
  if [[ "$suites" == *" latency "* ]]; then
    echo "== latency" >&2
    KVR_LATENCY_JSON="$lat_json" cargo bench -p kvr-benches --bench latency | tee "$lat_txt" >&2
  fi
  if [[ "$suites" == *" selection "* ]]; then
    echo "== selection" >&2
    KVR_SELECTION_JSON="$sel_json" cargo bench -p kvr-benches --bench selection -- \
      "${crit_args[@]}" "${filter[@]}" >&2
  fi
  if [[ "$suites" == *" ffi "* ]]; then
    echo "== ffi" >&2
    KVR_FFI_JSON="$ffi_json" cargo bench -p kvr-benches --bench ffi_overhead -- \
      "${crit_args[@]}" >&2
  fi
  if [[ "$suites" == *" ingest "* ]]; then
    echo "== ingest" >&2
    cargo bench -p kvr-benches --bench ingest -- "${crit_args[@]}" >&2
  fi
fi
[[ -f "$stamp" ]] || touch -d @0 "$stamp"

load_after=$(cut -d' ' -f1-3 /proc/loadavg)
elapsed=$(($(date +%s) - start_epoch))

export KVR_TARGET_DIR="$target_dir" KVR_LAT_JSON="$lat_json" KVR_STAMP="$stamp"
export KVR_SEL_JSON="$sel_json" KVR_FFI_JSON="$ffi_json"
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

# --- selection harness ---
sel, sel_scaling, sel_workloads = {}, {}, {}
try:
    if os.path.getmtime(os.environ["KVR_SEL_JSON"]) >= stamp:
        for r in json.load(open(os.environ["KVR_SEL_JSON"]))["results"]:
            if r["name"].startswith("scaling/"):
                sel_scaling[r["name"][len("scaling/"):]] = r
            elif r["name"].startswith("workload/"):
                sel_workloads[r["name"][len("workload/"):]] = r
            else:
                sel[r["name"]] = r
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
    if name.startswith("select"):
        return "selections/s"
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

# Selection rows: one block per case (<ranks>r/<tokens>t), in this order.
SEL_KINDS = ("select_and_reserve_free/1thread/", "select_and_reserve/", "free/",
             "select_and_reserve_free/2threads/", "select/")

def sel_parts(name):
    m = re.fullmatch(r"(.*/)(\d+)r/(\d+)t", name)
    if m and m.group(1) in SEL_KINDS:
        return SEL_KINDS.index(m.group(1)), int(m.group(2)), int(m.group(3))
    return None

def order(name):
    sp = sel_parts(name)
    if sp:
        return (10, [sp[1], sp[2], sp[0]])
    for i, p in enumerate(("hashing/", "find_matches_single", "find_matches_shared8",
                           "apply_single", "apply_shared8")):
        if name.startswith(p):
            break
    else:
        i = 9
    # numeric parts sort as numbers: .../32 before .../128
    return (i, [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)])

def sel_target(name):
    """Issue 3's targets, on the 64-rank 256-token case."""
    if name == "select_and_reserve/64r/256t" and name in sel:
        p50, p99 = sel[name]["p50_ns"], sel[name]["p99_ns"]
        return (f"p50 ≤ 2 µs: {'met' if p50 <= 2000 else 'MISSED'} ({p50 / 2000:.2f}× target); "
                f"p99 ≤ 5 µs: {'met' if p99 <= 5000 else 'MISSED'} ({p99 / 5000:.2f}× target)")
    sp = sel_parts(name)
    if sp and SEL_KINDS[sp[0]] == "select_and_reserve_free/2threads/":
        one = crit.get(name.replace("/2threads/", "/1thread/"))
        if one and name in crit:
            ratio = one[0] / crit[name][0]
            t = f"2 threads / 1 thread = {ratio:.2f}× (criterion medians)"
            if name.endswith("/64r/256t"):
                t += f"; ≥ 1.7×: {'met' if ratio >= 1.7 else 'MISSED'}"
            return t
    return ""

# per-call rows of the selection harness that have no criterion row (select_and_reserve
# and free alone, or a filtered criterion run)
sel_only = [n for n in sel if n != "timer_overhead" and n not in crit]

for name in sorted(list(crit) + sel_only, key=order):
    if name not in crit:
        r = sel[name]
        row(f"`{name}` (per call)", "", fmt_ns(r["p50_ns"]), fmt_ns(r["p99_ns"]), "",
            sel_target(name))
        continue
    med, thr = crit[name]
    rate = ""
    per_s = None
    if thr and "Elements" in thr:
        per_s = thr["Elements"] / (med * 1e-9)
        rate = fmt_rate(per_s, unit_of(name))
    elif thr and "Bytes" in thr:
        rate = fmt_rate(thr["Bytes"] / (med * 1e-9), "B/s")
    p50 = p99 = target = ""
    if name in sel:
        p50, p99 = fmt_ns(sel[name]["p50_ns"]), fmt_ns(sel[name]["p99_ns"])
    target = sel_target(name)
    if name in lat:
        p50, p99 = fmt_ns(lat[name]["p50_ns"]), fmt_ns(lat[name]["p99_ns"])
        if name.endswith("/128"):
            ok = lat[name]["p50_ns"] <= 1000
            target = f"p50 ≤ 1 µs: {'met' if ok else 'MISSED'} ({lat[name]['p50_ns'] / 1000:.2f}× target)"
    if name == "ingest/decode_apply" and per_s:
        target = f"≥ 2 M blocks/s: {'met' if per_s >= 2e6 else 'MISSED'} ({per_s / 2e6:.2f}× target)"
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

for name, r in sel_scaling.items():
    ratio = r["ratio"]
    t = f"2t/1t = {ratio:.2f}×"
    if name.endswith("/64r/256t"):
        t += f"; ≥ 1.7×: {'met' if ratio >= 1.7 else 'MISSED'} ({ratio / 1.7:.2f}× target)"
    row(f"`{name}` 1 vs 2 threads (harness, {r['calls']:,} selections, median of 3"
        f"{', pinned' if r.get('pinned') else ''})", "", "", "",
        f"{fmt_rate(r['one_thread_per_s'], 'selections/s')} → {fmt_rate(r['two_threads_per_s'], 'selections/s')}",
        t)
if "timer_overhead" in sel:
    r = sel["timer_overhead"]
    row("selection harness timer overhead (per call)", "", fmt_ns(r["p50_ns"]), fmt_ns(r["p99_ns"]))

try:
    if os.path.getmtime(os.environ["KVR_FFI_JSON"]) >= stamp:
        f = json.load(open(os.environ["KVR_FFI_JSON"]))
        d = f["diff_ns"]
        row(f"C ABI overhead: `kvr_partition_select` − `Engine::select_in` (64r/256t; median of "
            f"{f['rounds']} paired rounds × {f['calls']:,} calls)", f"{d:+.1f} ns", "", "", "",
            f"≤ 50 ns: {'met' if d <= 50 else 'MISSED'} (Rust {fmt_ns(f['rust_ns'])}, C ABI "
            f"{fmt_ns(f['c_abi_ns'])} per call, ratio {f['ratio']:.4f})")
except (OSError, ValueError, KeyError):
    pass

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
if sel or any(n.startswith("select") for n in crit):
    wl = "; ".join(f"{k}: {v['holder_blocks']:,} holder-blocks, {v['nodes']:,} nodes, {v['live_bookings']:,} live bookings"
                   for k, v in sorted(sel_workloads.items(), key=lambda kv: int(kv[0][:-1])))
    print("- selection (`<ranks>r/<tokens>t`, block size 16, prompts as tokens): `select_and_reserve_free` = one booked selection and its free; "
          "`2threads` = the same on two threads (pinned to two CPUs) sharing one engine, median = wall time / selections; "
          "p50/p99 = per-call `Instant` timings of the selection harness"
          + (f" ({wl})" if wl else ""))
print()
print("| bench | median | p50 (per call) | p99 (per call) | throughput | target |")
print("|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(r) + " |")
PY
