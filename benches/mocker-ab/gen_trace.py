#!/usr/bin/env python3
"""Write a small synthetic multi-turn trace in Mooncake's JSONL format, with much more
prefix reuse inside a minute than the first requests of the Mooncake conversation trace.

Each session picks one of a few shared system prompts; turn k's prompt is the system
prompt, then every earlier turn's message and answer, then a new message, so turn k+1
extends turn k (the trace does not say what was generated, so an "answer" is just fresh
hash ids that the next turn carries). Sessions start as a Poisson process; a session's next
turn comes a think time after the previous one (open loop: it does not wait for the
answer). Hash ids are 512-token blocks as in Mooncake; the last block of a prompt may be
partial. Deterministic for a given --seed.

    python gen_trace.py --out /tmp/sessions.jsonl --sessions 12 --turns 4
"""

import argparse
import json
import random

CHUNK = 512


def generate(a):
    rng = random.Random(a.seed)
    next_id = [0]

    def fresh(n):
        ids = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return ids

    systems = [fresh(a.system_blocks) for _ in range(a.system_prompts)]
    events = []
    t = 0.0
    for s in range(a.sessions):
        t += rng.expovariate(a.session_rate)
        history = list(systems[rng.randrange(len(systems))])
        at = t
        for k in range(a.turns):
            prompt = history + fresh(rng.randint(1, a.max_message_blocks))
            # the last block partly filled: the prompt ends inside it
            length = (len(prompt) - 1) * CHUNK + rng.randint(CHUNK // 4, CHUNK)
            events.append((at, s, k, prompt, length))
            # the next turn carries this prompt and an answer of one or two blocks
            history = prompt + fresh(rng.randint(1, 2))
            at += rng.uniform(a.think_min, a.think_max)
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    return [
        {"timestamp": int(round(at * 1000)), "input_length": length,
         "output_length": a.output_length, "hash_ids": prompt, "session": s, "turn": k}
        for at, s, k, prompt, length in events
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--session-rate", type=float, default=1.0, help="session starts per second")
    ap.add_argument("--think-min", type=float, default=2.0, help="seconds between turns")
    ap.add_argument("--think-max", type=float, default=5.0)
    ap.add_argument("--system-prompts", type=int, default=3)
    ap.add_argument("--system-blocks", type=int, default=4, help="512-token blocks each")
    ap.add_argument("--max-message-blocks", type=int, default=3)
    ap.add_argument("--output-length", type=int, default=32)
    a = ap.parse_args()
    rows = generate(a)
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} requests, {sum(r['input_length'] for r in rows)} prompt tokens, "
          f"{rows[-1]['timestamp'] / 1000:.1f} s -> {a.out}")


if __name__ == "__main__":
    main()
