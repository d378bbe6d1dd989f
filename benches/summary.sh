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
#   KVR_BENCH_SKIP_RUN=1  do not run anything; summarize the results on disk of the latest
#                         run (those written since it started, whichever suites it ran)
#   KVR_BENCH_SUITES="…"  suites to run, space- or comma-separated (default: all of
#                         hashing index latency selection ffi ingest subscriber replay)
#       hashing     criterion: block hashing and sequence chaining        (benches/benches/hashing.rs)
#       index       criterion: find_matches and apply on the 1M index      (benches/benches/index.rs)
#       latency     per-call p50/p99 harness and bytes per holder-block    (benches/benches/latency.rs)
#       selection   criterion + per-call harness of select/reserve/free    (benches/benches/selection.rs)
#       ffi         C ABI overhead against the Rust call                   (benches/benches/ffi_overhead.rs)
#       ingest      criterion: decode and apply of vLLM batches            (benches/benches/ingest.rs)
#       subscriber  ZMQ PUB → kvr subscription over loopback, 3 runs       (benches/benches/subscriber.rs)
#       replay      `kvr replay` trace simulator (release build of kvr-cli), KVR_REPLAY_RUNS runs
#   KVR_SUB_BATCHES=n     batches per run of the subscriber bench (default 20000)
#   KVR_REPLAY_TRACE=f    trace of the replay suite (default tests/data/mooncake_conversation.jsonl
#                         relative to the repo root; if missing, the built-in workload)
#   KVR_REPLAY_RUNS=n     runs of the replay suite (default 3; the median is reported)
#
# Sources: criterion's <target>/criterion/**/new/{benchmark,estimates}.json (median of
# the per-iteration time), and the latency harness (benches/benches/latency.rs: per-call
# p50/p99 with std::time::Instant, and bytes per holder-block), which writes
# <target>/kvr-bench/latency.json, and the selection suite's own timing harness
# (benches/benches/selection.rs: per-call p50/p99 of select_and_reserve, free and select,
# and one- against two-thread throughput), which writes <target>/kvr-bench/selection.json,
# and the C ABI overhead harness (benches/benches/ffi_overhead.rs: paired rounds of
# kvr_partition_select against Engine::select through a handle), which writes <target>/kvr-bench/ffi.json,
# and the subscriber bench (benches/benches/subscriber.rs: batches and blocks applied per
# second and lost batches per run, median of 3), which writes <target>/kvr-bench/subscriber.json,
# and `kvr replay --json` (policies kvr and dynamo-classic; per-call wall time of the routing
# call, event-ingest block ops/s, index bytes per holder-block, hit rate, TTFT), one file per
# run in <target>/kvr-bench/replay/run-<i>.json; the table shows the kvr policy's median over
# the runs (the simulator is deterministic except for its wall-time figures).
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
sub_json="$target_dir/kvr-bench/subscriber.json"
replay_dir="$target_dir/kvr-bench/replay"
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
  rm -f "$lat_json" "$sel_json" "$ffi_json" "$sub_json"
  rm -rf "$replay_dir"
  cargo bench -p kvr-benches --no-run >&2
  suites=" ${KVR_BENCH_SUITES:-hashing index latency selection ffi ingest subscriber replay} "
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
  if [[ "$suites" == *" subscriber "* ]]; then
    echo "== subscriber" >&2
    KVR_SUBSCRIBER_JSON="$sub_json" cargo bench -p kvr-benches --bench subscriber >&2
  fi
  if [[ "$suites" == *" replay "* ]]; then
    echo "== replay" >&2
    mkdir -p "$replay_dir"
    replay_args=(replay --json --quiet --policy kvr,dynamo-classic)
    trace="${KVR_REPLAY_TRACE:-tests/data/mooncake_conversation.jsonl}"
    if [[ -f "$trace" ]]; then
      replay_args+=(--trace "$trace")
    else
      echo "replay: no trace at $trace; using the built-in workload" >&2
    fi
    # `kvr replay` is young: a failed build or run is noted in the table, not fatal.
    if cargo build --release -p kvr-cli >&2; then
      for i in $(seq 1 "${KVR_REPLAY_RUNS:-3}"); do
        echo "replay run $i: kvr ${replay_args[*]}" >&2
        if ! "$target_dir/release/kvr" "${replay_args[@]}" >"$replay_dir/run-$i.json.tmp"; then
          echo "replay run $i failed" | tee -a "$replay_dir/error" >&2
          rm -f "$replay_dir/run-$i.json.tmp"
          continue
        fi
        mv "$replay_dir/run-$i.json.tmp" "$replay_dir/run-$i.json"
      done
    else
      echo "cargo build --release -p kvr-cli failed" | tee -a "$replay_dir/error" >&2
    fi
  fi
fi
[[ -f "$stamp" ]] || touch -d @0 "$stamp"

load_after=$(cut -d' ' -f1-3 /proc/loadavg)
elapsed=$(($(date +%s) - start_epoch))

export KVR_TARGET_DIR="$target_dir" KVR_LAT_JSON="$lat_json" KVR_STAMP="$stamp"
export KVR_SEL_JSON="$sel_json" KVR_FFI_JSON="$ffi_json"
export KVR_SUB_JSON="$sub_json" KVR_REPLAY_DIR="$replay_dir"
export KVR_LOAD_BEFORE="$load_before" KVR_LOAD_AFTER="$load_after" KVR_ELAPSED="$elapsed"
export KVR_QUICK="${KVR_BENCH_QUICK:-0}"
python3 - <<'PY'
import glob, json, os, platform, re, statistics, subprocess

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
        row(f"C ABI overhead: `kvr_partition_select` − `Engine::select` through a handle (64r/256t; median of "
            f"{f['rounds']} paired rounds × {f['calls']:,} calls)", f"{d:+.1f} ns", "", "", "",
            f"≤ 50 ns: {'met' if d <= 50 else 'MISSED'} (Rust {fmt_ns(f['rust_ns'])}, C ABI "
            f"{fmt_ns(f['c_abi_ns'])} per call, ratio {f['ratio']:.4f})")
except (OSError, ValueError, KeyError):
    pass

try:
    if os.path.getmtime(os.environ["KVR_SUB_JSON"]) >= stamp:
        f = json.load(open(os.environ["KVR_SUB_JSON"]))
        m, runs, n = f["median"], f["runs"], f["batches"]
        per_run = ", ".join(f"{r['blocks_per_s'] / 1e6:.2f}" for r in runs)
        lost = sum(r["lost"] for r in runs)
        applied = ", ".join(f"{r['applied']:,}" for r in runs)
        bps = m["blocks_per_s"]
        row(f"`subscriber`: ZMQ PUB → one kvr subscription over loopback ({n:,} batches of "
            f"4 × 16-block stores + 64 removals per run; median of {len(runs)} runs)", "", "", "",
            f"{fmt_rate(bps, 'blocks/s')}, {m['batches_per_s']:,.0f} batches/s",
            f"≥ 2 M blocks/s: {'met' if bps >= 2e6 else 'MISSED'} ({bps / 2e6:.2f}× target); "
            f"runs {per_run} M blocks/s; applied {applied} of {n:,}; lost {lost:,}")
except (OSError, ValueError, KeyError, IndexError, ZeroDivisionError):
    pass

# --- kvr replay (one JSON per run) ---
replay_runs, replay_errors = [], []
rdir = os.environ["KVR_REPLAY_DIR"]
for fn in sorted(glob.glob(os.path.join(rdir, "run-*.json"))):
    try:
        if os.path.getmtime(fn) < stamp:
            continue
        d = json.load(open(fn))
        pol = {p["policy"]: p for p in d["policies"]}
        replay_runs.append((d["workload"], pol))
    except (OSError, ValueError, KeyError, TypeError):
        replay_errors.append(f"unreadable {os.path.basename(fn)}")
try:
    if os.path.getmtime(os.path.join(rdir, "error")) >= stamp:
        replay_errors += open(os.path.join(rdir, "error")).read().split("\n")
except OSError:
    pass
replay_errors = [e for e in replay_errors if e]
replay_ok = [(w, pol) for w, pol in replay_runs if "kvr" in pol]
if replay_ok:
    w0 = replay_ok[0][0]
    name = w0.get("name", "?")
    workload = ("built-in workload" if name == "built-in"
                else f"trace `{os.path.basename(name)}`")
    med = lambda f: statistics.median(f(pol["kvr"]) for _, pol in replay_ok)
    p50 = med(lambda p: p["select_ns"]["p50"])
    p99 = med(lambda p: p["select_ns"]["p99"])
    ops = med(lambda p: p["block_ops_per_s"])
    bph = med(lambda p: p["bytes_per_holder_block"])
    # deterministic figures: the same in every run; the first run's stand for all
    k0 = replay_ok[0][1]["kvr"]
    ctx = (f"{bph:.2f} B/holder-block (index, end of replay); context: hit rate "
           f"{k0['hit_rate'] * 100:.1f} %, TTFT p90 {k0['ttft_ms']['p90']:,.0f} ms")
    dc = replay_ok[0][1].get("dynamo-classic")
    if dc:
        ctx += (f" (dynamo-classic: hit rate {dc['hit_rate'] * 100:.1f} %, TTFT p90 "
                f"{dc['ttft_ms']['p90']:,.0f} ms, select p50 "
                f"{fmt_ns(statistics.median(pol['dynamo-classic']['select_ns']['p50'] for _, pol in replay_ok if 'dynamo-classic' in pol))})")
    hits = sorted({pol["kvr"]["hit_rate"] for _, pol in replay_ok})
    if len(hits) > 1:
        ctx += f"; hit rate VARIED across runs ({hits[0] * 100:.2f}–{hits[-1] * 100:.2f} %)"
    ctx += "; select p50 per run " + ", ".join(fmt_ns(pol["kvr"]["select_ns"]["p50"]) for _, pol in replay_ok)
    if replay_errors:
        ctx += f"; {len(replay_errors)} failed: {'; '.join(replay_errors)}"
    row(f"`replay` kvr policy, {workload} ({w0.get('requests', 0):,} requests, "
        f"{w0.get('workers', '?')} workers): routing call wall time; event ingest "
        f"(median of {len(replay_ok)} runs)", "", fmt_ns(p50), fmt_ns(p99),
        fmt_rate(ops, "block ops/s"), ctx)
elif replay_errors or replay_runs:
    row("`replay`: no result", "", "", "", "",
        "; ".join(replay_errors) or "no kvr policy in the output")

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
if any(r[0].startswith("`subscriber`") for r in rows):
    print("- subscriber: a Rust ZMQ PUB (`zeromq` crate) floods prebuilt vLLM batches at one kvr subscription over loopback; "
          "blocks/s and batches/s applied from the first send to the last batch applied; lost = batches the PUB's high-water mark dropped")
if replay_ok:
    print(f"- replay: `kvr replay --json --quiet --policy kvr,dynamo-classic` ({w0.get('workers', '?')} workers × "
          f"{w0.get('kv_blocks', 0):,} KV blocks, block size {w0.get('block_size', '?')}, {w0.get('requests', 0):,} requests); "
          "p50/p99 = per-call wall time of the kvr policy's routing call, throughput = its event ingest, both median over the runs; "
          "hit rate and TTFT are simulated (deterministic) figures")
print()
print("| bench | median | p50 (per call) | p99 (per call) | throughput | target |")
print("|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(r) + " |")
PY
