#!/usr/bin/env python3
"""A built-in conversational workload sent to an OpenAI-compatible URL (a gateway, or a
pod): sessions of several turns, each turn the whole conversation so far plus a new user
message, streamed, with the usage chunk. Reports what a KV-aware router is for: the share
of prompt tokens the serving pod had cached (from each response's
usage.prompt_tokens_details.cached_tokens), time to first token, and which pods served.

Usage: workload.py --url http://127.0.0.1:10000 [--sessions 24 --turns 4 --concurrency 8]
Prints one JSON object (run() returns it to other scripts).
"""
import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse

WORDS = ("cache block prefix token route worker engine model request answer gateway "
         "picker latency memory transfer session history context prompt batch queue "
         "load decode prefill store evict hash chain rank pool event stream").split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def post_stream(url: str, body: dict, timeout: float):
    """(status, ttft seconds or None, usage dict or None, content text, pod header)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", u.path.rstrip("/") + "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        pod = resp.getheader("x-kvr-emulated-pod")
        if resp.status != 200:
            resp.read()
            return resp.status, None, None, "", pod
        ttft, usage, content = None, None, []
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    content.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
        return 200, ttft, usage, "".join(content), pod
    finally:
        conn.close()


def run(url: str, sessions: int = 24, turns: int = 4, concurrency: int = 8,
        model: str = "m", system_words: int = 300, turn_words: int = 40,
        max_tokens: int = 8, seed: int = 7, timeout: float = 60.0) -> dict:
    rng = random.Random(seed)
    system = text(rng, system_words)
    convs = [{"messages": [{"role": "system", "content": system}], "turn": 0,
              "rng": random.Random(seed * 1000 + i)} for i in range(sessions)]
    lock = threading.Lock()
    results = []
    pending = list(range(sessions))  # sessions ready for their next turn
    busy = set()

    def worker():
        while True:
            with lock:
                ready = [s for s in pending if s not in busy]
                if not ready:
                    if not pending and not busy:
                        return
                    i = None
                else:
                    i = ready[0]
                    pending.remove(i)
                    busy.add(i)
            if i is None:
                time.sleep(0.005)
                with lock:
                    if not pending and not busy:
                        return
                continue
            c = convs[i]
            c["messages"].append({"role": "user", "content": text(c["rng"], turn_words)})
            body = {"model": model, "messages": c["messages"], "stream": True,
                    "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
            try:
                status, ttft, usage, content, pod = post_stream(url, body, timeout)
            except OSError as e:
                status, ttft, usage, content, pod = -1, None, None, "", str(e)
            c["messages"].append({"role": "assistant", "content": content or "ok"})
            c["turn"] += 1
            with lock:
                results.append({"session": i, "turn": c["turn"], "status": status,
                                "ttft": ttft, "usage": usage, "pod": pod})
                busy.discard(i)
                if c["turn"] < turns:
                    pending.append(i)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    ok = [r for r in results if r["status"] == 200 and r["usage"]]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                 for r in ok)
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    q = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else None
    later = [r for r in ok if r["turn"] > 1]
    pods = {}
    for r in results:
        pods[r["pod"]] = pods.get(r["pod"], 0) + 1
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "later_turns_hit_rate": (
            sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for r in later) / max(1, sum(r["usage"]["prompt_tokens"] for r in later))),
        "ttft_p50_ms": q(0.5) * 1e3 if ttfts else None,
        "ttft_p90_ms": q(0.9) * 1e3 if ttfts else None,
        "ttft_mean_ms": statistics.mean(ttfts) * 1e3 if ttfts else None,
        "wall_s": wall,
        "by_pod": pods,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model", default="m")
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--turn-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    out = run(a.url, a.sessions, a.turns, a.concurrency, a.model, a.system_words,
              a.turn_words, a.max_tokens, a.seed)
    print(json.dumps(out, indent=2))
    return 0 if out["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
