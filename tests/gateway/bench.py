#!/usr/bin/env python3
"""What the EPP hop costs: Envoy 1.40 asking `kvr epp` (Envoy -> kvr epp -> Envoy) against
the same Envoy with no ext_proc filter at all (its own round robin), on the same emulated
pods in the same run, the two measured in turn (A, B, A, B, ...) so that machine noise
hits both. Prints a table: requests/s and latency p50 of each, what the hop adds, and
kvr epp's CPU per request with its split into parse / tokenize / select.

    cargo build --release -p kvr-cli -p kvr-service-load
    python3 tests/gateway/bench.py

The pods answer at once (no prefill or decode cost, one output token, not streamed) so the
hop dominates. Prompts go as token ids (`/v1/completions` with `prompt: [ids]`), as
text, which kvr epp tokenizes with its local tokenizer (the test tokenizer), and as chat
conversations (`--kinds chat`): each request the next turn of one of many conversations
(its history resent, plus a reply and a question), every body sent once, a fresh set per
run, so kvr epp's token reuse sees what a gateway sees. The load client is
benches/service-load's `gateway-load` (closed loop, one request in flight per
connection). Options: --sizes, --concs, --kinds, --reps, --secs, --json. No figure is
judged: this is a measurement, not a test.
"""

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from e2e import MODEL, PODS, ROOT, Gateway  # noqa: E402
from harness import Proc, log, request, words  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
PHASES = ("parse", "tokenize", "select", "total")


def cpu_secs(pid):
    """User + system CPU seconds of a process, all its threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / TICKS


def phase_sums(g):
    """kvr_epp_pick_duration_seconds sum and count per phase, from kvr epp's /metrics."""
    text = request(g.epp_http, "GET", "/metrics").body.decode()
    out = {}
    for p in PHASES:
        for kind in ("sum", "count"):
            m = re.search(rf'^kvr_epp_pick_duration_seconds_{kind}\{{[^}}]*phase="{p}"[^}}]*\}} (\S+)$', text, re.M)
            out[(p, kind)] = float(m.group(1)) if m else 0.0
    return out


def token_prompt(seed, n):
    rng = random.Random(seed)
    # The test tokenizer has 2,048 tokens; stay clear of its special tokens at the top.
    return [rng.randrange(0, 2000) for _ in range(n)]


def text_prompt(g, seed, n):
    """Text the test tokenizer turns into about n tokens (the pod says how many)."""
    pod = g.pod_http[PODS[0]]

    def count(k):
        r = request(pod, "POST", "/v1/completions",
                    {"model": MODEL, "prompt": words(seed, k), "max_tokens": 1})
        if r.status != 200:
            raise SystemExit(f"calibrating a text prompt: {r.status} {r.body[:200]!r}")
        return r.json()["usage"]["prompt_tokens"]

    k = max(1, n // 3)
    for _ in range(3):
        got = count(k)
        k = max(1, round(k * n / got))
    text = words(seed, k)
    return text, count(k)


def load(client, port, conc, secs, bodies, path="/v1/completions", shared=False):
    out = subprocess.run([client, "--port", str(port), "--conc", str(conc), "--secs", str(secs),
                          "--path", path, *(["--shared-order"] if shared else []), *bodies],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


CHAT_TURNS = 16
CHAT_STEP = 512  # tokens a turn adds: a reply and a question


def words_per_token(g):
    """How many of harness.words' words the test tokenizer makes of one token."""
    r = request(g.pod_http[PODS[0]], "POST", "/v1/completions",
                {"model": MODEL, "prompt": words(7, 1000), "max_tokens": 1})
    return 1000 / r.json()["usage"]["prompt_tokens"]


def chat_set(seed, size, convs, wpt):
    """Bodies of `convs` conversations of CHAT_TURNS turns, turn by turn across them
    (c0 t0, c1 t0, ..., c0 t1, ...): each turn is the previous one plus a reply and a
    question (CHAT_STEP tokens), so its history is a prompt sent before; a conversation
    averages about `size` tokens over its turns."""
    base = max(CHAT_STEP, size - CHAT_TURNS * CHAT_STEP // 2)
    half = max(1, round(CHAT_STEP / 2 * wpt))
    convs_msgs = [[{"role": "system", "content": words(seed * 1000 + c, round(base * wpt))}]
                  for c in range(convs)]
    bodies = []
    for t in range(CHAT_TURNS):
        for c, msgs in enumerate(convs_msgs):
            k = (seed * 1000 + c) * 100 + t
            if t:
                msgs.append({"role": "assistant", "content": words(k * 2, half)})
            msgs.append({"role": "user", "content": words(k * 2 + 1, half)})
            bodies.append({"model": MODEL, "messages": list(msgs), "max_tokens": 1, "stream": False})
    return bodies


def chat_tokens(g, bodies, every=97):
    """Mean prompt tokens of a sample of chat bodies, as the pod counts them."""
    pod = g.pod_http[PODS[0]]
    replies = [request(pod, "POST", "/v1/chat/completions", b) for b in bodies[::every]]
    bad = [r for r in replies if r.status != 200]
    if bad:
        raise SystemExit(f"a chat body: {bad[0].status} {bad[0].body[:300]!r}")
    got = [r.json()["usage"]["prompt_tokens"] for r in replies]
    return round(statistics.mean(got))


def spread(xs):
    return statistics.median(xs), min(xs), max(xs)


def main() -> int:
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvr-bin", default=os.path.join(target, "release", "kvr"))
    ap.add_argument("--client", default=os.path.join(target, "release", "gateway-load"))
    ap.add_argument("--envoy", help="the Envoy 1.40 binary (default: tests/gateway/ensure-envoy.sh)")
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "tokenize", "tests", "assets", "tokenizer"))
    ap.add_argument("--sizes", default="1024,8192,32768", help="prompt tokens")
    ap.add_argument("--concs", default="1,16,64", help="concurrent streams")
    ap.add_argument("--kinds", default="ids,text,chat",
                    help="prompts as token ids, as text, as chat conversations (comma-separated)")
    ap.add_argument("--chat-convs", type=int, default=100,
                    help="conversations per chat run (x 16 turns: the bodies of one run)")
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts per size, sent in turn")
    ap.add_argument("--reps", type=int, default=3, help="runs of each arm, interleaved")
    ap.add_argument("--secs", type=float, default=3.0, help="seconds per run")
    ap.add_argument("--request-body-mode", default="FULL_DUPLEX_STREAMED",
                    help="Envoy's ext_proc request body mode (FULL_DUPLEX_STREAMED or BUFFERED)")
    ap.add_argument("--response-body-mode", default="FULL_DUPLEX_STREAMED",
                    help="Envoy's ext_proc response body mode (FULL_DUPLEX_STREAMED or NONE)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    for path, build in ((a.kvr_bin, "kvr-cli"), (a.client, "kvr-service-load")):
        if not os.access(path, os.X_OK):
            sys.exit(f"no {path}: cargo build --release -p {build}")
    envoy = a.envoy or subprocess.run(
        ["bash", os.path.join(HERE, "ensure-envoy.sh")], check=True, capture_output=True, text=True
    ).stdout.strip().splitlines()[-1]
    sizes = [int(x) for x in a.sizes.split(",")]
    concs = [int(x) for x in a.concs.split(",")]
    kinds = a.kinds.split(",")
    args = argparse.Namespace(
        kvr_bin=a.kvr_bin, envoy=envoy, tokenizer=a.tokenizer, response_body_mode=a.response_body_mode,
        request_body_mode=a.request_body_mode,
        envoy_log_level="error", negative=False, keep=False, only=None,
        emulate_args=["--prefill-ns-per-token", "0", "--decode-ns-per-token", "0", "--max-tokens", "1",
                      "--max-model-len", str(4 * max(sizes)), "--capacity-blocks", "65536", "--quiet"],
        # Pods that answer at once are never busy; no shedding to blur the comparison.
        epp_args=["--shed-when-busy", "false"])
    g = Gateway(args)
    g.envoy = {"epp": dict(g.envoy["open"]), "static": dict(g.envoy["closed"], static=True)}
    bodydir = tempfile.mkdtemp(prefix="kvr-gateway-bench-")
    rows = []
    try:
        g.start_emulator()
        g.write_pool()
        g.start_epp()
        for which in g.envoy:
            g.procs[f"envoy-{which}"] = Proc(
                f"envoy-{which}", [envoy, "-c", g.envoy_config(which), "--disable-hot-restart",
                                   "--log-level", "error", "--concurrency", "2"], g.workdir)
        g.wait_epp_health("epp", healthy=True)
        epp_pid = g.procs["epp"].p.pid
        wpt = words_per_token(g) if "chat" in kinds else 0
        for kind in kinds:
            for size in sizes:
                path, shared, bodies, got = "/v1/completions", False, [], []
                if kind == "chat":
                    path, shared = "/v1/chat/completions", True
                else:
                    for i in range(a.prompts):
                        if kind == "ids":
                            prompt, n = token_prompt(size * 100 + i, size), size
                        else:
                            prompt, n = text_prompt(g, size * 100 + i, size)
                        got.append(n)
                        p = os.path.join(bodydir, f"{kind}-{size}-{i}.json")
                        with open(p, "w") as f:
                            json.dump({"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": False}, f)
                        bodies.append(p)
                    tokens = round(statistics.mean(got))

                def body_files(seed):
                    """Chat: a fresh set of conversations per run (each body sent once)."""
                    if kind != "chat":
                        return bodies
                    d = os.path.join(bodydir, f"chat-{seed}")
                    os.makedirs(d, exist_ok=True)
                    out = []
                    # Seeds of one width: harness.words' words carry the seed's digits.
                    for i, b in enumerate(chat_set(10**6 + seed, size, a.chat_convs, wpt)):
                        out.append(os.path.join(d, f"{i}.json"))
                        with open(out[-1], "w") as f:
                            json.dump(b, f)
                    return out

                # Warm both arms (connections, the pods' caches, the index). Chat: scale
                # the words per token until the conversations average `size` tokens.
                warm = body_files(size * 10 + 1)
                for _ in range(3 if kind == "chat" else 0):
                    tokens = chat_tokens(g, [json.load(open(x)) for x in warm])
                    wpt *= size / tokens
                    warm = body_files(size * 10 + 1)
                if kind == "chat":
                    tokens = chat_tokens(g, [json.load(open(x)) for x in warm])
                for which in g.envoy:
                    load(a.client, g.envoy[which]["listen"], 4, 1.0, warm, path, shared)
                for conc in concs:
                    runs = {"epp": [], "static": []}
                    for rep in range(a.reps):
                        files = body_files(size * 10 + 100 * conc + rep + 2)
                        for which in ("epp", "static"):
                            before_cpu, before_ph = cpu_secs(epp_pid), phase_sums(g)
                            r = load(a.client, g.envoy[which]["listen"], conc, a.secs, files, path, shared)
                            after_cpu, after_ph = cpu_secs(epp_pid), phase_sums(g)
                            sent = sum(r["statuses"].values())
                            r["epp_cpu_ms_per_req"] = 1000 * (after_cpu - before_cpu) / max(sent, 1)
                            for p in PHASES:
                                n = after_ph[(p, "count")] - before_ph[(p, "count")]
                                s = after_ph[(p, "sum")] - before_ph[(p, "sum")]
                                r[f"{p}_ms"] = 1000 * s / n if n else 0.0
                            r["errors"] = sent - r["ok"]
                            runs[which].append(r)
                            log(f"{kind} {tokens} tok conc {conc} rep {rep + 1} {which}: {r['rps']:.0f} req/s "
                                f"p50 {r['p50_ms']:.2f} ms, errors {r['errors']} {r['statuses'] if r['errors'] else ''}"
                                f"{' (bodies wrapped: repeats sent)' if r.get('wrapped') else ''}")
                    added = [e["p50_ms"] - s["p50_ms"] for e, s in zip(runs["epp"], runs["static"])]
                    rows.append({"kind": kind, "tokens": tokens, "conc": conc, "runs": runs, "added_p50_ms": added})
    finally:
        g.stop_all()
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    f = lambda xs, d=2: "{:.{d}f} ({:.{d}f}–{:.{d}f})".format(*spread(xs), d=d)  # noqa: E731
    print("\nmedian (min–max) of", a.reps, "interleaved runs of", a.secs, "s each\n")
    print("| prompt | tokens | streams | req/s static | req/s kvr epp | p50 ms static | p50 ms kvr epp | "
          "added p50 ms | epp CPU ms/req | parse ms | tokenize ms | select ms | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        e, s = r["runs"]["epp"], r["runs"]["static"]
        errs = sum(x["errors"] for x in e + s)
        kind = {"ids": "token ids", "text": "text", "chat": "chat turns"}[r["kind"]]
        if any(x.get("wrapped") for x in e):
            kind += " (wrapped)"
        print(f"| {kind} | {r['tokens']} | {r['conc']} "
              f"| {f([x['rps'] for x in s], 0)} | {f([x['rps'] for x in e], 0)} "
              f"| {f([x['p50_ms'] for x in s])} | {f([x['p50_ms'] for x in e])} | {f(r['added_p50_ms'])} "
              f"| {f([x['epp_cpu_ms_per_req'] for x in e])} | {f([x['parse_ms'] for x in e], 3)} "
              f"| {f([x['tokenize_ms'] for x in e], 3)} | {f([x['select_ms'] for x in e], 3)} | {errs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
